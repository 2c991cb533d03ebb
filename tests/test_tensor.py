"""Tensor and sequence parallelism: parity with one process and with PyTorch's DTensor, and the
exact communication, parameter and activation-memory figures.

A launch costs more than a small case, so one launch per world size runs every check inside the
ranks and returns numbers; the tests below read them (module-scoped fixtures). World size 2 is
the default; 4 runs the parity and the formulas once more (vocabulary 65 padded to 68, one head
per rank).

* Whole model: GPT ``tiny`` trained 3 AdamW steps on the same batches by one process and by
  ``tensor_parallel`` (with and without sequence parallelism, tied and untied head): the loss of
  every step equal to 1e-6 and ``full_state_dict`` equal to the single model's parameters to 1e-5.
* Layers alone, forward and input gradients against one device: column-then-row MLP, the same
  with an unsplit input and a gathered output, the vocab-parallel embedding, the vocab-parallel
  cross-entropy against ``F.cross_entropy`` (with padding columns), the four f/g operators.
* PyTorch: ``parallelize_module`` (``ColwiseParallel``, ``RowwiseParallel``, ``SequenceParallel``,
  ``loss_parallel``) on the same GPT and weights: the same loss each step to 1e-6.
* Formulas: ``comm.counters()`` of one layer's forward and backward against
  ``communication_per_layer`` (calls and bytes, exact); parameters per rank against
  ``parameters_per_rank`` (exact); activation bytes per layer (``MemoryMeter``: what is alive
  for backward when forward ends, the moment of the step's peak, for a 6- minus a 2-layer model,
  divided by 4) against ``activation_bytes_per_layer``.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import workbench
from workbench import comm
from workbench.measure.memory_meter import MemoryMeter
from workbench.models import GPT, GPTConfig
from workbench.parallel import tp_ops
from workbench.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding,
                                       activation_bytes_per_layer, communication_per_layer,
                                       communication_per_step, full_state_dict,
                                       parameters_per_rank, tensor_parallel, vocab_parallel_cross_entropy)

ADAMW = dict(lr=1e-3, eps=1e-5, weight_decay=0.1)
STEPS = 3
B, T = 4, 16


def _batches(steps=STEPS, seed=1, b=B, t=T):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 65, (b, t), generator=g), torch.randint(0, 65, (b, t), generator=g))
            for _ in range(steps)]


def _parity_with_single(sp: bool, tie: bool, algorithm: str = "native") -> dict:
    torch.manual_seed(0)
    ref = GPT(GPTConfig.preset("tiny", tie_weights=tie))
    model = tensor_parallel(copy.deepcopy(ref), sequence_parallel=sp, algorithm=algorithm)
    opt_ref, opt = torch.optim.AdamW(ref.parameters(), **ADAMW), torch.optim.AdamW(model.parameters(), **ADAMW)
    losses = []
    for x, y in _batches():
        for m, o in ((ref, opt_ref), (model, opt)):
            _, loss = m(x, y)
            loss.backward()
            o.step()
            o.zero_grad()
            losses.append(loss.item())
    full, single = full_state_dict(model), ref.state_dict()
    return {"loss_diff": max(abs(a - b) for a, b in zip(losses[::2], losses[1::2])),
            "keys_equal": sorted(full) == sorted(single),
            "shapes_equal": all(full[k].shape == single[k].shape for k in single),
            "param_diff": max((full[k] - single[k]).abs().max().item() for k in single),
            "losses": losses[::2]}


def _parity_with_dtensor(sp: bool, tie: bool) -> dict:
    from workbench.apps.bench.tensor import torch_step, torch_tensor_parallel

    torch.manual_seed(0)
    ref = GPT(GPTConfig.preset("tiny", tie_weights=tie))
    ours = tensor_parallel(copy.deepcopy(ref), sequence_parallel=sp)
    theirs = torch_tensor_parallel(copy.deepcopy(ref), sequence_parallel=sp)
    o1, o2 = torch.optim.AdamW(ours.parameters(), **ADAMW), torch.optim.AdamW(theirs.parameters(), **ADAMW)
    diffs = []
    for x, y in _batches():
        _, loss = ours(x, y)
        loss.backward()
        o1.step()
        o1.zero_grad()
        diffs.append(abs(loss.item() - torch_step(theirs, o2, x, y)))
    return {"loss_diff": max(diffs)}


def _layers_alone() -> dict:
    """Each layer against its single-device counterpart: outputs and input gradients."""
    t, r = workbench.world_size(), workbench.rank()
    out = {}
    torch.manual_seed(0)
    fc, proj = nn.Linear(8, 16), nn.Linear(16, 8)
    x = torch.randn(3, 2 * t, 8, requires_grad=True)
    ref = proj(F.gelu(fc(x)))
    (gx_ref,) = torch.autograd.grad(ref.pow(2).sum(), x)
    for gather in (False, True):  # column -> row, and column(gather_output) -> row(input_is_parallel=False)
        col = ColumnParallelLinear.from_linear(fc, gather_output=gather)
        row = RowParallelLinear.from_linear(proj, input_is_parallel=not gather)
        xi = x.detach().clone().requires_grad_()
        y = row(F.gelu(col(xi)))
        (gx,) = torch.autograd.grad(y.pow(2).sum(), xi)
        out[f"mlp gather={gather}"] = max((y - ref).abs().max().item(), (gx - gx_ref).abs().max().item())
    # sequence parallel MLP: input and output split by sequence
    col = ColumnParallelLinear.from_linear(fc, sequence_parallel=True)
    row = RowParallelLinear.from_linear(proj, sequence_parallel=True)
    xs = x.detach().chunk(t, 1)[r].clone().requires_grad_()
    ys = row(F.gelu(col(xs)))
    ys.pow(2).sum().backward()
    gxs = xs.grad
    out["mlp sequence parallel"] = max((ys - ref.chunk(t, 1)[r]).abs().max().item(),
                                       (gxs - gx_ref.chunk(t, 1)[r]).abs().max().item())
    # weight gradients of the column layer (the re-gather in backward) against one device
    fc.zero_grad()
    proj(F.gelu(fc(x.detach()))).pow(2).sum().backward()
    out["column weight grad (sp)"] = max((col.weight.grad - fc.weight.grad.chunk(t, 0)[r]).abs().max().item(),
                                         (row.weight.grad - proj.weight.grad.chunk(t, 1)[r]).abs().max().item(),
                                         (row.bias.grad - proj.bias.grad).abs().max().item())
    # vocab-parallel embedding: 65 rows, padded
    emb = nn.Embedding(65, 8)
    idx = torch.randint(0, 65, (3, 4 * t))
    w = torch.randn(3, 4 * t, 8)
    (emb(idx) * w).sum().backward()
    for sp in (False, True):
        vemb = VocabParallelEmbedding.from_embedding(emb, sequence_parallel=sp)
        e = vemb(idx)
        ref_e = emb(idx).chunk(t, 1)[r] if sp else emb(idx)
        (e * (w.chunk(t, 1)[r] if sp else w)).sum().backward()
        n = vemb.vocab_end - vemb.vocab_start
        out[f"embedding sp={sp}"] = max((e - ref_e).abs().max().item(),
                                        (vemb.weight.grad[:n] - emb.weight.grad[vemb.vocab_start:vemb.vocab_end])
                                        .abs().max().item(), vemb.weight.grad[n:].abs().max().item() if n < len(vemb.weight) else 0.0)
    # vocab-parallel cross-entropy against F.cross_entropy (65 columns padded to a multiple of t)
    logits = torch.randn(6, 7, 65, requires_grad=True)
    target = torch.randint(0, 65, (6, 7))
    loss_ref = F.cross_entropy(logits.view(-1, 65), target.view(-1))
    (g_ref,) = torch.autograd.grad(loss_ref, logits)
    n = -(-65 // t)
    padded = torch.cat([logits.detach(), torch.full((6, 7, n * t - 65), 123.0)], -1)  # padding must not count
    shard = padded.chunk(t, -1)[r].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(shard, target, vocab_size=65)
    (g,) = torch.autograd.grad(loss, shard)
    g_full = torch.cat([g_ref, torch.zeros(6, 7, n * t - 65)], -1).chunk(t, -1)[r]
    out["cross entropy"] = max(abs(loss.item() - loss_ref.item()), (g - g_full).abs().max().item())
    # the four operators: forward and backward of each against its definition
    a = torch.randn(2, 4 * t, 3) + r  # different on every rank
    a_all = [torch.empty_like(a) for _ in range(t)]
    torch.distributed.all_gather(a_all, a)
    total = sum(a_all)
    checks = []
    u = a.clone().requires_grad_()
    v = tp_ops.copy_to_parallel(u)
    v.backward(a)
    checks += [(v - a).abs().max(), (u.grad - total).abs().max()]
    u = a.clone().requires_grad_()
    v = tp_ops.reduce_from_parallel(u)
    v.backward(a)
    checks += [(v - total).abs().max(), (u.grad - a).abs().max()]
    u = a.clone().requires_grad_()
    v = tp_ops.gather_from_sequence(u)
    v.backward(torch.cat(a_all, 1))
    checks += [(v - torch.cat(a_all, 1)).abs().max(), (u.grad - t * a).abs().max()]
    u = a.clone().requires_grad_()
    v = tp_ops.scatter_to_sequence(u)
    v.backward(v.detach())
    checks += [(v - total.chunk(t, 1)[r]).abs().max(), (u.grad - torch.cat(
        [s.chunk(t, 1)[i] for i, s in enumerate([total] * t)], 1)).abs().max()]
    out["operators"] = max(c.item() for c in checks)
    return out


def _layer_comm(sp: bool) -> dict:
    """Counters of one Block's forward and backward, and of a whole step (every all-reduce)."""
    torch.manual_seed(0)
    b, s = 2, 16
    model = tensor_parallel(GPT(GPTConfig.preset("tiny")), sequence_parallel=sp)
    t = workbench.world_size()
    h = model.config.n_embd
    x = torch.randn(b, s // t if sp else s, h, requires_grad=True)
    with comm.counters() as fwd:
        y = model.blocks[0](x)
    with comm.counters() as bwd:
        y.backward(torch.ones_like(y))
    idx = torch.randint(0, 65, (b, s), generator=torch.Generator().manual_seed(0))
    with comm.counters() as step:
        model(idx, idx)[1].backward()
    return {"forward": fwd.as_dict(), "backward": bwd.as_dict(), "step": step.as_dict(), "b": b, "s": s, "h": h}


def _errors() -> dict:
    t = workbench.world_size()
    out = {}

    def catch(key, fn):
        try:
            fn()
            out[key] = ""
        except ValueError as e:
            out[key] = str(e)

    catch("n_head", lambda: tensor_parallel(GPT(GPTConfig(n_layer=1, n_head=3, n_embd=12, block_size=8))))
    bad_mlp = GPT(GPTConfig.preset("tiny", n_layer=1))
    bad_mlp.blocks[0].mlp.c_fc = nn.Linear(64, 255)
    catch("4C", lambda: tensor_parallel(bad_mlp))
    catch("no layers", lambda: tensor_parallel(nn.Sequential(nn.Linear(4, 4))))
    model = tensor_parallel(GPT(GPTConfig.preset("tiny", n_layer=1)), sequence_parallel=True)
    catch("twice", lambda: tensor_parallel(model))
    with comm.counters() as c:
        catch("sequence", lambda: model(torch.zeros(2, 2 * t + 1, dtype=torch.long)))
    out["messages before the sequence error"] = c.total_calls
    catch("algorithm", lambda: tensor_parallel(GPT(GPTConfig.preset("tiny", n_layer=1)), algorithm="nope"))
    return out


def _side_effects() -> dict:
    """tensor_parallel draws no random numbers (the caller's stream stays in step with one process's),
    and a head with a bias is split too (its padding entries ignored)."""
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=1, tie_weights=False))
    model.lm_head = nn.Linear(64, 65)
    ref = copy.deepcopy(model)
    state = torch.get_rng_state()
    tensor_parallel(model)
    untouched = torch.equal(state, torch.get_rng_state())
    x = torch.randint(0, 65, (2, 8))
    full = full_state_dict(model)
    return {"rng untouched": untouched,
            "biased head loss diff": abs(model(x, x)[1].item() - ref(x, x)[1].item()),
            "biased head state diff": max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items())}


def _memory(sp: bool) -> dict:
    t = workbench.world_size()
    b, s = 4, 64

    def peak(layers):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_layer=layers, block_size=s))
        if t > 1:
            model = tensor_parallel(model, sequence_parallel=sp)
        x, y = _batches(1, b=b, t=s)[0]
        with MemoryMeter(model) as meter:
            loss = model(x, y)[1]
            kept = meter.current_by_category["activations"]  # alive for backward: the peak's bulk
            loss.backward()
        return kept

    measured = (peak(6) - peak(2)) / 4
    cfg = GPTConfig.preset("tiny")
    return {"measured": measured, "formula": activation_bytes_per_layer(b, s, cfg.n_embd, cfg.n_head, t, sp)}


def _params_per_rank() -> dict:
    out = {}
    for tie in (True, False):
        cfg = GPTConfig.preset("tiny", tie_weights=tie)
        model = tensor_parallel(GPT(cfg))
        out[tie] = (sum(p.numel() for p in model.parameters()), parameters_per_rank(cfg, workbench.world_size()))
    return out


def _world2() -> dict:
    res = {"single": {(sp, tie): _parity_with_single(sp, tie) for sp in (False, True) for tie in (True, False)}}
    res["single-ring"] = _parity_with_single(True, True, "ring")
    res["dtensor"] = {(sp, tie): _parity_with_dtensor(sp, tie) for sp in (False, True) for tie in (True, False)}
    res["layers"] = _layers_alone()
    res["comm"] = {sp: _layer_comm(sp) for sp in (False, True)}
    res["errors"] = _errors()
    res["side effects"] = _side_effects()
    res["memory"] = {sp: _memory(sp) for sp in (False, True)}
    res["params"] = _params_per_rank()
    from workbench.apps.train import TrainConfig, train

    res["compare"] = {name: train(name, TrainConfig(model="tiny", steps=3, batch_size=4, memory_step=2))
                      for name in ("tp", "tp-sp")}
    return res


def _world4() -> dict:
    return {"single": {(sp, True): _parity_with_single(sp, True) for sp in (False, True)},
            "layers": _layers_alone(), "comm": {sp: _layer_comm(sp) for sp in (False, True)},
            "memory": {sp: _memory(sp) for sp in (False, True)}, "params": _params_per_rank()}


@pytest.fixture(scope="module")
def world2():
    return workbench.launch(_world2, world_size=2, timeout=300)


@pytest.fixture(scope="module")
def world4():
    return workbench.launch(_world4, world_size=4, timeout=300)


def _check_single(results):
    for res in results:
        for case, r in res["single"].items():
            assert r["keys_equal"] and r["shapes_equal"], case
            assert r["loss_diff"] <= 1e-6, (case, r)
            assert r["param_diff"] <= 1e-5, (case, r)


def test_parity_with_single_process_t2(world2):
    _check_single(world2)
    r = world2[0]["single-ring"]
    assert r["loss_diff"] <= 1e-6 and r["param_diff"] <= 1e-5, r
    assert len(world2[0]["single"]) == 4  # sp x tied


def test_parity_with_single_process_t4(world4):
    _check_single(world4)


def test_parity_with_dtensor(world2):
    for res in world2:
        for case, r in res["dtensor"].items():
            assert r["loss_diff"] <= 1e-6, (case, r)


@pytest.mark.parametrize("world", [2, 4])
def test_layers_alone_match_one_device(world, request):
    for res in request.getfixturevalue(f"world{world}"):
        for name, diff in res["layers"].items():
            assert diff <= 1e-5, (name, diff)


def _expected_stats(b, s, h, t, sp) -> dict:
    """``{phase: {collective/native: (calls, bytes_sent)}}`` from ``communication_per_layer``."""
    out = {}
    for phase, calls in communication_per_layer(b, s, h, sp).items():
        out[phase] = {}
        for collective, sizes in calls.items():
            factor = 2 * (t - 1) / t if collective == "all_reduce" else (t - 1) / t
            out[phase][f"{collective}/native"] = (len(sizes), sum(int(4 * n * factor) for n in sizes))
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_communication_per_layer_is_exact(world, request):
    for res in request.getfixturevalue(f"world{world}"):
        for sp, c in res["comm"].items():
            expected = _expected_stats(c["b"], c["s"], c["h"], world, sp)
            for phase in ("forward", "backward"):
                got = {k: (v["calls"], v["bytes_sent"]) for k, v in c[phase].items()}
                assert got == expected[phase], (sp, phase, got, expected[phase])
    c = request.getfixturevalue(f"world{world}")[0]["comm"]
    for sp in (False, True):  # a whole step: the layers plus the embedding, the head and the loss
        expected = {}
        for collective, sizes in communication_per_step(c[sp]["b"], c[sp]["s"], GPTConfig.preset("tiny"), sp).items():
            factor = 2 * (world - 1) / world if collective == "all_reduce" else (world - 1) / world
            expected[f"{collective}/native"] = (len(sizes), sum(int(4 * n * factor) for n in sizes))
        assert {k: (v["calls"], v["bytes_sent"]) for k, v in c[sp]["step"].items()} == expected, (sp, expected)
    bsh = c[False]["b"] * c[False]["s"] * c[False]["h"] * 4
    assert c[False]["forward"]["all_reduce/native"]["calls"] == 2
    assert c[False]["backward"]["all_reduce/native"]["bytes_sent"] == 2 * 2 * (world - 1) * bsh // world
    # an all-gather and a reduce-scatter move what one all-reduce moves
    fwd = c[True]["forward"]
    assert fwd["all_gather/native"]["bytes_sent"] + fwd["reduce_scatter/native"]["bytes_sent"] == \
        c[False]["forward"]["all_reduce/native"]["bytes_sent"]


@pytest.mark.parametrize("world", [2, 4])
def test_parameters_per_rank_exact(world, request):
    for res in request.getfixturevalue(f"world{world}"):
        for tie, (got, formula) in res["params"].items():
            assert got == formula, (tie, got, formula)
    single = GPT(GPTConfig.preset("tiny")).num_parameters()
    assert request.getfixturevalue(f"world{world}")[0]["params"][True][0] < single


@pytest.mark.parametrize("world", [2, 4])
def test_activation_memory_per_layer_matches_formula(world, request):
    for res in request.getfixturevalue(f"world{world}"):
        for sp, m in res["memory"].items():
            ratio = m["measured"] / m["formula"]
            assert 0.99 <= ratio <= 1.10, (world, sp, m, ratio)
    m = request.getfixturevalue(f"world{world}")[0]["memory"]
    assert m[True]["measured"] < m[False]["measured"]  # sequence parallelism saves memory


def test_activation_memory_t1_matches_formula():
    """t = 1: the plain GPT in this process against the same formula (18 -> 16 sbh + asb + 4 sb)."""
    b, s = 4, 64

    def peak(layers):
        torch.manual_seed(0)
        model = GPT(GPTConfig.preset("tiny", n_layer=layers, block_size=s))
        x, y = _batches(1, b=b, t=s)[0]
        with MemoryMeter(model, device="cpu") as meter:
            loss = model(x, y)[1]
            kept = meter.current_by_category["activations"]
            loss.backward()
        return kept

    ratio = (peak(6) - peak(2)) / 4 / activation_bytes_per_layer(b, s, 64, 4, 1, False)
    assert 0.99 <= ratio <= 1.10, ratio


def test_registered_in_compare(world2):
    """``tp`` and ``tp-sp`` in the strategy registry: every rank the whole batch, the loss of one process."""
    from workbench.apps import strategies
    from workbench.apps.train import TrainConfig, train

    config = TrainConfig(model="tiny", steps=3, batch_size=4, memory_step=2)
    single = workbench.launch(train, world_size=1, args=("single", config))[0]
    for name in ("tp", "tp-sp"):
        strategy = strategies.get(name)
        assert strategy.batch is strategies.whole_batch and strategy.ranks(8) == 2
        for record in world2:
            r = record["compare"][name]
            assert r["tokens_per_step"] == single["tokens_per_step"]
            assert max(abs(a - b) for a, b in zip(r["losses"], single["losses"])) <= 1e-6, (name, r["losses"])
            assert r["model_state"]["params"] == 4 * parameters_per_rank(GPTConfig.preset("tiny"), 2)


def test_no_random_numbers_drawn_and_biased_head(world2):
    for res in world2:
        r = res["side effects"]
        assert r["rng untouched"] is True
        assert r["biased head loss diff"] <= 1e-6 and r["biased head state diff"] == 0.0, r


def test_bad_input_errors(world2):
    errors = world2[0]["errors"]
    assert "n_head=3" in errors["n_head"] and "t=2" in errors["n_head"]
    assert "4C=255" in errors["4C"]
    assert "lacks the layers" in errors["no layers"]
    assert "already tensor-parallel" in errors["twice"]
    assert "T=5" in errors["sequence"] and "divisible by t=2" in errors["sequence"]
    assert errors["messages before the sequence error"] == 0
    assert "algorithm='nope'" in errors["algorithm"]


def test_bench_tensor_command_writes_its_table_json_and_plot(tmp_path, capsys):
    """`workbench bench tensor` end to end on a tiny run (timings are the command's, not asserted)."""
    import json

    from workbench.apps.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "tensor", "--preset", "tiny", "--candidates", "ours,ours-sp,ddp", "--trials", "1",
                 "--steps", "1", "--out", str(out)]) in (0, 1)
    text = capsys.readouterr().out
    assert "ours-sp" in text and "dtensor-sp" in text
    assert float(text.split("|difference| = ")[1].split()[0]) <= 1e-6
    data = json.loads((out / "tensor.json").read_text())
    rows = {r["candidate"]: r for r in data["results"]["rows"]}
    assert rows["ours"]["state_MiB"] < rows["ddp"]["state_MiB"]  # tensor parallelism shards model state
    assert (out / "tensor.png").stat().st_size > 0

