"""DistributedDataParallel: parity with PyTorch's DDP and with single-process training.

Each launch runs many cases inside the ranks (a launch costs far more than a small case). In
every case three copies of one initial model train for 5 steps on the same data:

* ours   ``workbench.parallel.DistributedDataParallel`` on this rank's shard of the global batch
* torch  ``torch.nn.parallel.DistributedDataParallel`` on the same shard
* single the plain model on the whole global batch, in this process (the reference)

and the parameters must agree: ours with torch's to 1e-6 (the same averaging, in float32), ours
with single-process training to 1e-5 (the sums are taken in another order). BatchNorm is only
compared with torch's DDP: each rank normalises with its own shard's statistics, so it is *not*
single-process training on the global batch (that would be SyncBatchNorm).
"""
import contextlib
import copy

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import workbench
from workbench.models import GPT, MLP, GPTConfig
from workbench.parallel import DistributedDataParallel

STEPS = 5


class Tied(nn.Module):
    """Embedding and output projection share one weight (the tied-weights case)."""

    def __init__(self, vocab=11, dim=8):
        super().__init__()
        self.emb = nn.Embedding(vocab, dim)
        self.hidden = nn.Linear(dim, dim)
        self.out = nn.Linear(dim, vocab, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, idx):
        return self.out(torch.tanh(self.hidden(self.emb(idx))))


class WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 3))

    def forward(self, x):
        return self.net(x)


class Branchy(nn.Module):
    """``unused`` never takes part; ``sometimes`` only on rank 0 (``find_unused_parameters``)."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.sometimes = nn.Linear(5, 5)
        self.unused = nn.Linear(5, 5)
        self.b = nn.Linear(5, 2)

    def forward(self, x, use_sometimes=False):
        h = torch.relu(self.a(x))
        if use_sometimes:
            h = h + self.sometimes(h)
        return self.b(h)


def _mlp():
    return MLP(width=16, depth=3)


def _frozen_mlp():
    m = MLP(width=16, depth=3)
    for p in m.layers[0].parameters():
        p.requires_grad_(False)
    return m


def _gpt():
    return GPT(GPTConfig.preset("tiny"))


def _regression_batch(step, global_batch, features, outputs):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(global_batch, features, generator=g), torch.randn(global_batch, outputs, generator=g)


def _make_optimizer(kind, params):
    if kind == "sgd":
        return torch.optim.SGD(params, lr=0.05, momentum=0.9)
    # eps=1e-5: see _single_tolerance
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-5, weight_decay=0.1)


def _loss_fn(model_name):
    """(batch maker, loss(model, inputs, targets)) for each model family."""
    if model_name == "gpt":
        def batch(step, n):
            g = torch.Generator().manual_seed(step)
            idx = torch.randint(0, 65, (n, 17), generator=g)
            return idx[:, :-1], idx[:, 1:]
        return batch, lambda m, x, y: m(x, y)[1]
    if model_name == "tied":
        def batch(step, n):
            g = torch.Generator().manual_seed(step)
            return torch.randint(0, 11, (n, 4), generator=g), torch.randint(0, 11, (n, 4), generator=g)
        return batch, lambda m, x, y: nn.functional.cross_entropy(m(x).flatten(0, 1), y.flatten())
    if model_name == "bn":
        return (lambda step, n: _regression_batch(step, n, 6, 3)), \
            lambda m, x, y: nn.functional.mse_loss(m(x), y)
    return (lambda step, n: _regression_batch(step, n, 16, 16)), \
        lambda m, x, y: nn.functional.mse_loss(m(x), y)


MODELS = {"mlp": _mlp, "frozen": _frozen_mlp, "gpt": _gpt, "tied": Tied, "bn": WithBatchNorm}


def _train(model_name, optimizer, ours_kwargs, micro_batches=1, set_to_none=True):
    """Train ours, torch's DDP and single-process copies; return the largest differences."""
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    base = MODELS[model_name]()
    # rank 1 starts from other weights: DDP's construction broadcast must fix that
    if rank != 0:
        with torch.no_grad():
            for p in base.parameters():
                p.add_(1.0)
    ours = DistributedDataParallel(copy.deepcopy(base), **ours_kwargs)
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=ours_kwargs.get("bucket_cap_mb", 25.0))
    single = copy.deepcopy(ours.module)  # after the broadcast: rank 0's weights
    initial = copy.deepcopy(ours.module)
    opts = [_make_optimizer(optimizer, m.parameters()) for m in (ours, theirs, single)]
    batch, loss_fn = _loss_fn(model_name)
    per_rank = 2
    for step in range(STEPS):
        for micro in range(micro_batches):
            x, y = batch(step * micro_batches + micro, per_rank * world)
            xs, ys = x[rank * per_rank:(rank + 1) * per_rank], y[rank * per_rank:(rank + 1) * per_rank]
            last = micro == micro_batches - 1
            for model in (ours, theirs):
                ctx = model.no_sync() if not last else contextlib.nullcontext()
                with ctx:
                    loss_fn(model, xs, ys).backward()
            if model_name != "bn":
                loss_fn(single, x, y).backward()
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=set_to_none)
    diff_torch = max((a - b).abs().max().item() for a, b in zip(ours.module.state_dict().values(),
                                                                 theirs.module.state_dict().values()))
    diff_single = 0.0 if model_name == "bn" else \
        max((a - b).abs().max().item() for a, b in zip(ours.module.parameters(), single.parameters()))
    moved = max((a - b).abs().max().item() for a, b in zip(ours.module.parameters(), initial.parameters()))
    return {"torch": diff_torch, "single": diff_single, "moved": moved}


CASES = [
    # name, model, optimizer, our kwargs, micro-batches, set_to_none
    ("mlp-sgd", "mlp", "sgd", {}, 1, True),
    ("mlp-adamw", "mlp", "adamw", {}, 1, True),
    ("mlp-sgd-per-param-no-overlap", "mlp", "sgd", {"bucket_cap_mb": 0, "overlap": False}, 1, False),
    ("gpt-adamw-small-buckets", "gpt", "adamw", {"bucket_cap_mb": 0.05}, 1, True),
    ("gpt-sgd", "gpt", "sgd", {}, 1, False),
    ("tied-adamw", "tied", "adamw", {"bucket_cap_mb": 0}, 1, True),
    ("frozen-sgd", "frozen", "sgd", {}, 1, True),
    ("frozen-adamw", "frozen", "adamw", {"bucket_cap_mb": 0.001}, 1, False),
    ("batchnorm-sgd", "bn", "sgd", {}, 1, True),
    ("batchnorm-adamw-no-sync", "bn", "adamw", {}, 3, True),
    ("mlp-no-sync-3-micro-batches", "mlp", "sgd", {"bucket_cap_mb": 0.002}, 3, True),
    ("gpt-no-sync-3-micro-batches-adamw", "gpt", "adamw", {}, 3, False),
    ("gpt-no-sync-3-micro-batches-sgd", "gpt", "sgd", {"bucket_cap_mb": 0.01, "overlap": False}, 3, True),
]


def _parity(cases, algorithm):
    return {name: _train(model, opt, {**kw, "algorithm": algorithm}, micro, stn)
            for name, model, opt, kw, micro, stn in cases}


def _single_tolerance(name):
    # The key third of GPT's c_attn bias has a gradient that is zero in exact arithmetic (softmax
    # ignores a shift shared by all keys). In float32 it is rounding noise (~1e-9) whose value
    # depends on the summation order, and AdamW divides it by its own RMS: with the default
    # eps=1e-8 that turns noise into steps of about lr, so the tests use eps=1e-5, which damps it
    # (against torch's DDP, which sums in our order, the result is identical either way).
    return 1e-5


def _check(results, world):
    for rank, per_case in enumerate(results):
        for name, d in per_case.items():
            where = f"{name}, world {world}, rank {rank}"
            assert d["torch"] <= 1e-6, f"{where}: ours differs from torch DDP by {d['torch']:.3g}"
            assert d["single"] <= _single_tolerance(name), \
                f"{where}: ours differs from single-process by {d['single']:.3g}"
            assert d["moved"] > 1e-3, f"{where}: training did not move the parameters ({d['moved']:.3g})"


@pytest.mark.parametrize("world", [2, 3])
def test_parity_with_torch_ddp_and_single_process(world):
    # World 3 (where a sum of three depends on the order the ring adds in): a subset, to keep time.
    cases = CASES if world == 2 else [c for c in CASES if c[0] in (
        "mlp-adamw", "gpt-sgd", "gpt-adamw-small-buckets", "tied-adamw", "batchnorm-sgd",
        "mlp-no-sync-3-micro-batches", "frozen-adamw")]
    _check(workbench.launch(_parity, world_size=world, args=(cases, "native"), timeout=240), world)


def test_parity_with_ring_all_reduce():
    from workbench import comm

    assert "ring" in _all_reduce_algorithms(comm)
    cases = [c for c in CASES if c[0] in ("mlp-adamw", "gpt-sgd", "mlp-no-sync-3-micro-batches")]
    _check(workbench.launch(_parity, world_size=3, args=(cases, "ring"), timeout=240), 3)


def _all_reduce_algorithms(comm):
    algos = comm.ALGORITHMS
    return algos.get("all_reduce", ()) if isinstance(algos, dict) else algos


# ------------------------------------------------------------------- unused parameters, API


def _unused_parameters():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    # find_unused_parameters=True: parity with torch, AdamW (a zero gradient would still move
    # an unused parameter through weight decay: it must stay None where no rank used it)
    torch.manual_seed(0)
    base = Branchy()
    ours = DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0001)
    theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0001)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
    for step in range(STEPS):
        g = torch.Generator().manual_seed(step)
        x = torch.randn(2 * world, 5, generator=g)[rank * 2:rank * 2 + 2]
        for m in (ours, theirs):
            m(x, use_sometimes=(rank == 0)).pow(2).mean().backward()
        out[f"unused grad is None (step {step})"] = ours.module.unused.weight.grad is None
        out[f"sometimes grad equal (step {step})"] = torch.allclose(
            ours.module.sometimes.weight.grad, theirs.module.sometimes.weight.grad, atol=1e-7)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    out["unused-parity"] = max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))
    out["unused weight untouched"] = torch.equal(ours.module.unused.weight, base.unused.weight)

    # without the flag: a clear error naming the parameter
    strict = DistributedDataParallel(copy.deepcopy(base))
    try:
        strict(torch.randn(2, 5)).sum().backward()
        out["error"] = ""
    except RuntimeError as e:
        out["error"] = str(e)

    # finish_gradient_synchronization is idempotent; no_sync skips communication;
    # .module is the wrapped model; events are recorded per bucket
    model = MLP(width=8, depth=4)
    ddp = DistributedDataParallel(model, bucket_cap_mb=0)
    out["module is model"] = ddp.module is model
    x = torch.randn(2, 8) + rank
    ddp(x).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]
    ddp.finish_gradient_synchronization()
    ddp.finish_gradient_synchronization()
    out["idempotent"] = all(torch.equal(a, p.grad) for a, p in zip(grads, model.parameters()))
    gathered = [torch.zeros_like(grads[0]) for _ in range(world)]
    dist.all_gather(gathered, grads[0])
    out["grads equal on all ranks"] = all(torch.equal(gathered[0], t) for t in gathered)
    model.zero_grad()
    with ddp.no_sync():
        ddp(x).sum().backward()
    local = model.layers[0].weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()  # plain local backward: what no_sync must leave untouched
    out["no_sync is local"] = torch.equal(local, model.layers[0].weight.grad)
    step_events = ddp.events[-1]
    out["events"] = [(b["ready"] is not None and b["start"] is not None and b["end"] is not None
                      and b["ready"] <= b["start"] <= b["end"]) for b in step_events["buckets"]]
    out["buckets"] = len(ddp.buckets)
    out["lanes"] = sorted({e["lane"] for e in ddp.timeline_events()})

    # The all-reduce bars are when the communication thread ran each bucket: inside issue..seen
    # done, and one at a time (the thread runs them in turn), so the bars of one rank never overlap.
    out["bars inside issue..done"] = all(b["start"] <= b["run_start"] <= b["run_end"] <= b["end"]
                                         for b in step_events["buckets"])
    bars = sorted((e for e in ddp.timeline_events() if e["lane"] == "all-reduce"), key=lambda e: e["start"])
    out["bars one at a time"] = len(bars) == 8 and all(a["end"] <= b["start"] and b["issued"] <= b["start"]
                                                       for a, b in zip(bars, bars[1:]))

    # synchronize_accumulated_gradients: backwards under no_sync (a pipeline's micro-batches),
    # then one average of what they accumulated
    model.zero_grad(set_to_none=True)
    with ddp.no_sync():
        ddp(x).sum().backward()
        ddp(2 * x).pow(2).sum().backward()
    want = [p.grad.clone() for p in model.parameters()]
    for g in want:
        dist.all_reduce(g)
        g /= world
    ddp.synchronize_accumulated_gradients()
    out["no_sync then synchronize averages"] = all(torch.allclose(g, p.grad, rtol=1e-6, atol=1e-7)
                                                   for g, p in zip(want, model.parameters()))
    out["no_sync then synchronize events"] = all(b["ready"] is not None and b["end"] is not None
                                                 for b in ddp.events[-1]["buckets"])
    return out


def test_unused_parameters_errors_and_api():
    results = workbench.launch(_unused_parameters, world_size=2, timeout=120)
    for rank, out in enumerate(results):
        for key, value in out.items():
            if key.startswith(("unused grad", "sometimes grad", "module is", "idempotent", "grads equal",
                               "no_sync", "unused weight", "bars")):  # "no_sync then synchronize ..." too
                assert value is True, f"rank {rank}: {key}"
        assert out["unused-parity"] <= 1e-6, out["unused-parity"]
        assert "unused.weight" in out["error"] and "find_unused_parameters=True" in out["error"], out["error"]
        assert out["buckets"] == 8 and out["events"] == [True] * 8  # bucket_cap_mb=0: one per parameter
        assert out["lanes"] == ["all-reduce", "backward"]


def test_bucket_assignment_reverse_order_and_first_bucket():
    from workbench.parallel.buckets import MB, assign_buckets

    # float32 sizes: 1 MB, 1 MB, 0.5 MB, 40 B, 3 MB, 20 B
    params = [nn.Parameter(torch.zeros(n)) for n in (MB // 4, MB // 4, MB // 8, 10, 3 * MB // 4, 5)]
    # reverse order 5,4,3,2,1,0; the first bucket closes once it reaches 1 MB (after the 3 MB
    # tensor that crossed it), the next ones once they reach the 2 MB cap
    assert assign_buckets(params, cap_bytes=2 * MB) == [[5, 4], [3, 2, 1, 0]]
    assert assign_buckets(params, cap_bytes=2 * MB, first_cap_bytes=None) == [[5, 4], [3, 2, 1, 0]]
    assert assign_buckets(params, cap_bytes=100 * MB) == [[5, 4], [3, 2, 1, 0]]
    assert assign_buckets(params, cap_bytes=MB // 2) == [[5, 4], [3, 2], [1], [0]]
    assert assign_buckets(params, cap_bytes=0) == [[5], [4], [3], [2], [1], [0]]
    half = [nn.Parameter(torch.zeros(4, dtype=torch.float64)), nn.Parameter(torch.zeros(4))]
    assert sorted(assign_buckets(half, cap_bytes=MB)) == [[0], [1]]  # one dtype per bucket


def test_bad_arguments():
    model = MLP(width=4, depth=1)
    with pytest.raises(ValueError, match="bucket_cap_mb"):
        DistributedDataParallel(model, bucket_cap_mb=-1)
    with pytest.raises(TypeError, match="overlap"):
        DistributedDataParallel(model, overlap="yes")
    with pytest.raises(RuntimeError, match="process group"):
        DistributedDataParallel(model)  # not inside a rank


def test_bench_ddp_command_writes_its_table_json_and_plot(tmp_path, capsys):
    """`workbench bench ddp` end to end on a tiny run (the figures themselves are not asserted:
    timings are measured by the command, not by tests)."""
    import json

    from workbench.apps.cli import main

    out = tmp_path / "bench"
    assert main(["bench", "ddp", "--models", "mlp", "--candidates", "ours,ours-ring", "--trials", "1",
                 "--steps", "1", "--warmup", "1", "--out", str(out)]) in (0, 1)
    text = capsys.readouterr().out
    assert "x torch" in text and "ours-ring" in text and "max |weight difference| = 0" in text
    data = json.loads((out / "ddp.json").read_text())
    assert "machine" in data and "results" in data
    assert (out / "ddp.png").stat().st_size > 0
