"""The CUDA paths: NCCL at world size 1, CUDA tensors through gloo (several ranks sharing one GPU),
``MemoryMeter`` on CUDA, every strategy training on a GPU, and launching after the parent used
CUDA or autograd.

Marked ``cuda`` and skipped where this machine has no CUDA device (CI has none); run them on a
GPU machine with ``pytest -m cuda tests/test_cuda.py``. The functions the ranks run are at module
level, so a launch can spawn them if this process can no longer fork safely (see
``workbench.ranks.launch._fork_is_unsafe``).
"""
from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm, runtime

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(runtime.gpu_count() == 0, reason="needs a CUDA device")]


def _every_collective() -> dict[str, str]:
    """Every algorithm of every collective, and a point-to-point message, on CUDA tensors."""
    dev, r, w = runtime.device(), dist.get_rank(), dist.get_world_size()
    assert dev.type == "cuda", dev
    total = w * (w + 1) / 2
    n = 37  # not a multiple of the world size: uneven blocks
    out: dict[str, str] = {}

    def full(v):
        return torch.full((n,), float(v), device=dev)

    for coll, algorithms in comm.ALGORITHMS.items():
        for a in algorithms:
            if coll == "all_reduce":
                t = full(r + 1)
                comm.all_reduce(t, algorithm=a)
                got = [(t, total)]
            elif coll == "broadcast":
                t = full(r + 1)
                comm.broadcast(t, src=0, algorithm=a)
                got = [(t, 1)]
            elif coll == "reduce":
                t = full(r + 1)
                comm.reduce(t, dst=0, algorithm=a)
                got = [(t, total)] if r == 0 else []
            elif coll == "all_gather":
                outs = [torch.empty(n, device=dev) for _ in range(w)]
                comm.all_gather(outs, full(r + 1), algorithm=a)
                got = [(o, i + 1) for i, o in enumerate(outs)]
            elif coll == "reduce_scatter":
                o = torch.empty(n, device=dev)
                comm.reduce_scatter(o, [full(r + 1) for _ in range(w)], algorithm=a)
                got = [(o, total)]
            elif coll == "scatter":
                o = torch.empty(n, device=dev)
                comm.scatter(o, [full(i + 1) for i in range(w)] if r == 0 else None, src=0, algorithm=a)
                got = [(o, r + 1)]
            elif coll == "gather":
                outs = [torch.empty(n, device=dev) for _ in range(w)] if r == 0 else None
                comm.gather(full(r + 1), outs, dst=0, algorithm=a)
                got = [(o, i + 1) for i, o in enumerate(outs)] if r == 0 else []
            elif coll == "all_to_all_single":
                o = torch.empty(w * n, device=dev)
                comm.all_to_all_single(o, torch.cat([full(10 * r + j) for j in range(w)]), algorithm=a)
                got = [(b, 10 * i + r) for i, b in enumerate(o.split(n))]
            else:
                raise AssertionError(f"no check written for {coll}")
            wrong = [f"{t.device}:{t[:3].tolist()} != {v}" for t, v in got
                     if t.device != dev or not torch.equal(t, torch.full_like(t, float(v)))]
            out[f"{coll}/{a}"] = "; ".join(wrong) or "ok"
    t = torch.ones(n, device=dev)
    handle = comm.all_reduce(t, algorithm="ring", async_op=True)
    handle.wait()
    out["all_reduce/ring async"] = "ok" if torch.equal(t, torch.full_like(t, float(w))) else str(t[:3].tolist())
    if w > 1:
        t = torch.arange(n, dtype=torch.float32, device=dev) * (r + 1)
        if r == 0:
            comm.send(t, dst=1)
        elif r == 1:
            comm.recv(t, src=0)
            ok = torch.equal(t, torch.arange(n, dtype=torch.float32, device=dev))
            out["send/recv"] = "ok" if ok else str(t[:3].tolist())
    return out


def _all_ok(results: list[dict]) -> None:
    bad = {f"rank {r}: {k}": v for r, res in enumerate(results) for k, v in res.items() if v != "ok"}
    assert not bad, bad


def test_nccl_at_world_size_one_runs_every_algorithm():
    _all_ok(workbench.launch(_every_collective, 1, backend="nccl", timeout=120))


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_carries_cuda_tensors_between_ranks_sharing_a_gpu(world_size):
    _all_ok(workbench.launch(_every_collective, world_size, backend="gloo", device="cuda", timeout=120))


def _context_and_experts_on_cuda() -> dict:
    """Context parallelism's ring and Ulysses attention on CUDA tensors (float32, both layouts,
    causal and not) against SDPA on the GPU: the output and q, k, v's gradients; and an
    expert-parallel MoE GPT on the GPU: every all-to-all algorithm routes the same forward, and a
    training step's loss, averaged over the ranks, is the one process's on the whole batch."""
    import torch.nn.functional as F

    from workbench.models.gpt import GPT, GPTConfig
    from workbench.parallel import context as cp
    from workbench.parallel.expert import expert_parallel

    dev, p, r = runtime.device(), dist.get_world_size(), dist.get_rank()
    out: dict = {}
    for name, attend in (("ring", cp.ring_attention), ("ulysses", cp.ulysses_attention)):
        for layout in cp.LAYOUTS:
            for causal in (True, False):
                g = torch.Generator().manual_seed(1)
                q, k, v, w = (torch.randn(1, 4, 32, 16, generator=g).to(dev) for _ in range(4))
                ref = [t.clone().requires_grad_() for t in (q, k, v)]
                (F.scaled_dot_product_attention(*ref, is_causal=causal) * w).sum().backward()
                o_ref = F.scaled_dot_product_attention(*(t.detach() for t in ref), is_causal=causal)

                def shard(t, layout=layout):
                    return cp.shard_sequence(t, layout=layout)

                mine = [shard(t).requires_grad_() for t in (q, k, v)]
                o = attend(*mine, is_causal=causal, layout=layout)
                (o * shard(w)).sum().backward()
                pairs = [(o, o_ref)] + [(m.grad, t.grad) for m, t in zip(mine, ref)]
                worst = max((a.detach() - shard(b.detach())).abs().max().item() for a, b in pairs)
                ok = o.device.type == "cuda" and worst <= 1e-4
                out[f"context {name}/{layout}/{'causal' if causal else 'full'}"] = "ok" if ok else f"{o.device} {worst}"
    cfg = GPTConfig.preset("tiny", n_experts=4, top_k=2)
    torch.manual_seed(0)
    whole = GPT(cfg).to(dev)
    torch.manual_seed(0)
    model = expert_parallel(GPT(cfg)).to(dev)
    x = torch.randint(0, cfg.vocab_size, (2 * p, cfg.block_size), generator=torch.Generator().manual_seed(2)).to(dev)
    mine = x[2 * r:2 * r + 2]
    with torch.no_grad():
        want = model(mine)[0]
        for alg in ("pairwise", "bruck", "native"):
            for block in model.blocks:
                block.mlp.algorithm = alg
            diff = (model(mine)[0] - want).abs().max().item()
            out[f"experts {alg}"] = "ok" if want.device.type == "cuda" and diff < 1e-5 else f"{want.device} {diff}"
    _, loss = model(mine, mine)
    loss.backward()
    total = loss.detach().clone()
    dist.all_reduce(total)
    with torch.no_grad():
        _, ref_loss = whole(x, x)
    diff = abs(total.item() / p - ref_loss.item())
    out["experts loss"] = "ok" if diff < 1e-4 else f"{total.item() / p} vs {ref_loss.item()}"
    return out


def test_context_and_expert_parallelism_on_cuda_tensors():
    _all_ok(workbench.launch(_context_and_experts_on_cuda, 2, backend="gloo", device="cuda", timeout=180))


def _meter_one_step(batch: int = 4) -> dict:
    from workbench.measure.memory_meter import MemoryMeter
    from workbench.models.gpt import GPT, GPTConfig

    dev = runtime.device()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny")).to(dev)
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randint(0, model.config.vocab_size, (batch, model.config.block_size), device=dev)
    with MemoryMeter(device=dev) as first:  # a fresh process: cuBLAS allocates its workspaces here
        model(x, x)[1].backward()
    model.zero_grad(set_to_none=True)
    with MemoryMeter(model, opt, device=dev) as meter:
        _, loss = model(x, x)
        loss.backward()
        opt.step()
    with MemoryMeter(device=dev) as alone:
        block = torch.empty(1 << 20, device=dev)  # 4 MiB, nothing else
        del block
    return {"first_other": first.peak_by_category.get("other", 0), "peak": meter.peak_bytes,
            "by": meter.peak_by_category, "alone": alone.peak_bytes,
            "after": meter.current_by_category, "param_tensors": len(list(model.parameters()))}


def test_memory_meter_on_cuda_counts_what_it_counts_on_the_cpu():
    gpu = workbench.launch(_meter_one_step, 1, backend="nccl", timeout=120)[0]
    cpu = workbench.launch(_meter_one_step, 1, backend="gloo", timeout=120)[0]
    for category in ("params", "grads", "activations"):
        assert gpu["by"][category] == cpu["by"][category] > 0, (category, gpu["by"], cpu["by"])
    # Adam's moments on the GPU; its step counters stay on the CPU (4 bytes each) beside CUDA
    # parameters, so the GPU's meter does not count them and the CPU's does
    assert gpu["after"]["optimizer"] == 2 * gpu["after"]["params"]
    assert cpu["after"]["optimizer"] - gpu["after"]["optimizer"] == 4 * cpu["param_tensors"]
    counted = sum(v for k, v in gpu["by"].items() if k != "other")
    assert gpu["peak"] == counted + gpu["by"]["other"]
    # once cuBLAS has its workspaces (allocated by the first matmuls, counted as other then), what
    # the allocator holds beyond the tensors seen is its 512-byte rounding: small
    assert gpu["first_other"] > 1 << 20 and cpu["first_other"] == 0
    assert 0 <= gpu["by"]["other"] < 1 << 20, gpu["by"]
    assert (4 << 20) <= gpu["alone"] <= (4 << 20) + 4096, gpu["alone"]
    assert cpu["alone"] == 4 << 20


@pytest.mark.parametrize("device,world_size,precision", [(None, 1, "fp32"), ("cuda", 2, "fp32"), (None, 1, "bf16")])
def test_every_strategy_trains_on_cuda_like_one_process(device, world_size, precision):
    """World 1: NCCL (one GPU per rank); world 2: two ranks share the GPU over gloo; bf16 with
    every strategy that takes a mixed-precision policy (PyTorch DDP's refuses the GPT's tied head:
    see the next test)."""
    from workbench.apps import compare
    from workbench.apps.train import TrainConfig

    names = None if world_size == 2 else ["single", "ddp", "zero1", "zero2", "zero3", "torch-fsdp"] + \
        (["torch-ddp"] if precision == "fp32" else [])
    rows = compare.run(TrainConfig(model="tiny", steps=3, batch_size=8, precision=precision), names, world_size,
                       timeout=300, device=device, log=lambda *a: None)
    by = {row["strategy"]: row for row in rows}
    assert by["single"]["loss_diff"] is None
    tolerance = 1e-4 if precision == "fp32" else 1e-2  # bf16: a few units in the last place of ~4
    far = {name: row["loss_diff"] for name, row in by.items()
           if name != "single" and not row["loss_diff"] < tolerance}
    assert not far, far
    assert len(by) >= (6 if world_size == 1 else 10), sorted(by)


def test_torch_ddp_mixed_precision_refuses_a_tied_head_with_the_reason():
    from workbench.apps import compare, strategies
    from workbench.apps.train import TrainConfig

    config = TrainConfig(model="tiny", steps=1, batch_size=8, precision="bf16")
    with pytest.raises(ValueError, match="torch-ddp cannot train in mixed precision on cuda: PyTorch DDP's"):
        compare.run(config, ["single", "torch-ddp"], 1, log=lambda *a: None)
    assert strategies.supports_mixed_precision(strategies.get("torch-ddp"), "cuda", tied=False)


def test_launch_after_the_parent_ran_backward_spawns_or_says_why():
    """On a machine with CUDA devices, one backward pass in the parent stops autograd in every
    forked child. A fresh interpreter shows it: launch spawns a module-level function instead,
    with a warning, and refuses a function it cannot send, naming the cause and the fix."""
    script = textwrap.dedent("""
        import warnings, torch, workbench
        from workbench import runtime
        x = torch.ones(2, requires_grad=True)
        (x * 3).sum().backward()                      # starts autograd's device threads
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            print("ranks", workbench.launch(runtime.rank, 2, backend="gloo"))
        print("warned", any("spawn" in str(w.message) and "backward" in str(w.message) for w in seen))
        try:
            workbench.launch(lambda: 1, 2, backend="gloo")
        except RuntimeError as e:
            print("refused", "backward" in str(e) and "Restart the kernel" in str(e))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ranks [0, 1]" in run.stdout and "warned True" in run.stdout and "refused True" in run.stdout, \
        run.stdout + run.stderr[-2000:]


def _cuda_sum() -> float:
    return float(torch.ones(3, device="cuda").sum())


def test_launch_after_the_parent_asked_cuda_is_available_spawns():
    """``torch.cuda.is_available()`` calls the CUDA runtime, and a child forked after it cannot
    initialise CUDA although ``torch.cuda.is_initialized()`` stays False in the parent. The launch's
    forked probe sees it and spawns instead, with a warning naming the cause."""
    script = textwrap.dedent("""
        import warnings, torch, workbench
        from tests.test_cuda import _cuda_sum
        assert torch.cuda.is_available() and not torch.cuda.is_initialized()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            print("ranks", workbench.launch(_cuda_sum, 2, backend="gloo"))
        print("warned", any("spawn" in str(w.message) and "CUDA runtime" in str(w.message) for w in seen))
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "ranks [3.0, 3.0]" in run.stdout and "warned True" in run.stdout, run.stdout + run.stderr[-2000:]
