"""``workbench compare`` end to end, the strategy registry, and the training loop's errors."""
import json

import pytest
import torch

from workbench.apps import cli, strategies
from workbench.apps.train import TrainConfig


def test_compare_end_to_end(tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["compare", "--model", "tiny", "--steps", "3", "--batch-size", "8", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    for name in ("report.md", "results.json", "throughput.png", "memory.png", "loss.png"):
        assert (out / name).stat().st_size > 0, name
    assert f"report: {out / 'report.md'}" in printed

    # the table: a row per registered strategy, printed and written
    report = (out / "report.md").read_text()
    table = [line for line in report.splitlines() if line.startswith("| ") and not line.startswith("| strategy")
             and not line.startswith("| ---")]
    assert [line.split("|")[1].strip() for line in table] == [s.name for s in strategies.all_strategies() if s.default]
    assert all(line in printed for line in table)
    header = "| strategy | world size | tokens/s | peak memory per rank | final loss | max abs loss diff vs single |"
    assert header in report

    rows = {r["strategy"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    single, ddp, fsdp = rows["single"], rows["torch-ddp"], rows["torch-fsdp"]
    assert single["world_size"] == 1 and ddp["world_size"] == fsdp["world_size"] == 2
    assert len(single["losses"]) == 3 and single["loss_diff"] is None
    # same seed, same global batches, global mean loss: PyTorch's DDP and FSDP2 match one process
    assert ddp["loss_diff"] < 1e-5 and fsdp["loss_diff"] < 1e-5
    assert max(abs(a - b) for a, b in zip(ddp["losses"], single["losses"])) < 1e-5
    assert rows["2d"]["world_size"] == 4 and rows["2d"]["loss_diff"] < 1e-5  # the dp x tp mesh
    from workbench.models import GPTConfig
    from workbench.parallel.tensor import parameters_per_rank

    assert all(s["params"] == 4 * parameters_per_rank(GPTConfig.preset("tiny"), 2) for s in rows["2d"]["model_state"])
    assert single["losses"][-1] < single["losses"][0]  # it trains
    assert all(r["tokens_per_s"] > 0 for r in rows.values())
    assert all(len(r["peak_bytes"]) == r["world_size"] and min(r["peak_bytes"]) > 0 for r in rows.values())
    # model state: DDP replicates it, FSDP2 holds about half of it on each of 2 ranks
    full = single["model_state"][0]["params"]
    assert full == 4 * single["parameters"]
    assert all(s["params"] == full for s in ddp["model_state"])
    assert all(abs(s["params"] - full / 2) < 0.01 * full for s in fsdp["model_state"])
    assert all(s["optimizer"] < 0.51 * single["model_state"][0]["optimizer"] for s in fsdp["model_state"])
    # the memory meter saw each rank's parameters at the peak
    assert all(c["params"] >= s["params"] for c, s in zip(ddp["peak_by_category"], ddp["model_state"]))


def test_compare_rejects_bad_arguments(capsys):
    assert cli.main(["compare", "--strategies", "single,nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown strategy 'nope'" in err and all(n in err for n in ("single", "torch-ddp", "torch-fsdp"))
    assert cli.main(["compare", "--batch-size", "15", "--world-size", "2", "--strategies", "single"]) == 2
    err = capsys.readouterr().err
    assert "batch_size=15 does not split evenly over world_size=2" in err and "multiple of 2" in err
    with pytest.raises(SystemExit):
        cli.main(["compare", "--model", "huge"])
    capsys.readouterr()


def test_registry():
    assert strategies.names()[:3] == ["single", "torch-ddp", "torch-fsdp"]
    assert strategies.get("single").distributed is False and strategies.get("torch-fsdp").distributed is True
    with pytest.raises(ValueError, match="unknown strategy 'zero9': registered strategies are single, torch-ddp"):
        strategies.get("zero9")
    with pytest.raises(ValueError, match="already registered"):
        strategies.register(strategies.Strategy("single", "again", False, lambda m, f: (m, f(m.parameters()))))
    with pytest.raises(ValueError, match="without spaces"):
        strategies.Strategy("my strategy", "", False, lambda m, f: (m, f(m.parameters())))
    model = torch.nn.Linear(2, 2)
    wrapped, opt = strategies.get("single").wrap(model, lambda ps: torch.optim.SGD(ps, lr=0.1))
    assert wrapped is model and opt.param_groups[0]["params"][0] is model.weight


def test_train_config_errors():
    with pytest.raises(ValueError, match=r"block_size=100 is longer than the 'tiny' model's context \(64"):
        TrainConfig(model="tiny", block_size=100)
    with pytest.raises(ValueError, match="model='large' is not a preset"):
        TrainConfig(model="large")
    with pytest.raises(ValueError, match="steps=0"):
        TrainConfig(steps=0)


def test_strategy_fields_reach_the_loop():
    """A strategy that is not data parallel: every rank trains an unsynchronised replica on the
    *whole* batch (``batch=whole_batch``) with its own step function. Each rank then does exactly
    what the single process does, so the global loss equals the reference's step for step, and
    throughput counts the global batch's tokens once, not once per rank."""
    import workbench
    from workbench.apps.train import train

    calls = []

    def step(model, optimizer, x, y):
        calls.append(tuple(x.shape))
        return strategies.data_parallel_step(model, optimizer, x, y)

    replicated = strategies.Strategy("replicated-test", "replicas on the whole batch, no sync", True,
                                     strategies.get("single").wrap, batch=strategies.whole_batch, step=step,
                                     world_size=2)
    assert replicated.ranks(8) == 2 and strategies.get("ddp").ranks(8) == 8 and strategies.get("single").ranks(8) == 1
    config = TrainConfig(model="tiny", steps=3, batch_size=4, memory_step=None)

    def run():
        record = train(replicated, config)
        return record, calls

    ranks = workbench.launch(run, world_size=2)
    single = workbench.launch(train, world_size=1, args=("single", config))[0]
    for record, seen in ranks:
        assert seen == [(4, config.sequence_length)] * 3  # the whole global batch on every rank
        assert max(abs(a - b) for a, b in zip(record["losses"], single["losses"])) < 1e-6
        assert record["tokens_per_step"] == single["tokens_per_step"] == 4 * config.sequence_length


def test_strategy_field_errors():
    wrap = strategies.get("single").wrap
    with pytest.raises(TypeError, match="step=3 must be a callable step"):
        strategies.Strategy("s", "", True, wrap, step=3)
    with pytest.raises(ValueError, match="world_size=0 must be a whole number >= 1"):
        strategies.Strategy("s", "", True, wrap, world_size=0)
    with pytest.raises(ValueError, match="distributed=False trains in one process"):
        strategies.Strategy("s", "", False, wrap, world_size=2)
