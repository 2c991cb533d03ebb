"""ZeRO stages 0-3 against PyTorch's ZeroRedundancyOptimizer and FSDP2: step time and memory.

``workbench bench zero`` trains the GPT ``small`` preset (batch 8 of 128 tokens per rank, AdamW)
with six set-ups in one launch:

==============  ===============================================================================
candidate       what it is
==============  ===============================================================================
stage0          ``zero(..., stage=0)``: our DistributedDataParallel, AdamW on full replicas
stage1          ``zero(..., stage=1)``: our ``ShardedOptimizer`` (ZeRO-1)
stage2          ``zero(..., stage=2)``: gradients reduce-scattered during backward (ZeRO-2)
stage3          ``zero(..., stage=3)``: our ``FullyShardedDataParallel`` (ZeRO-3)
torch-zero      PyTorch DDP + ``torch.distributed.optim.ZeroRedundancyOptimizer`` (ZeRO-1)
torch-fsdp      PyTorch FSDP2: ``fully_shard`` on every block, then the root (ZeRO-3)
==============  ===============================================================================

For each: the median step time over interleaved trials (``workbench.measure.measuring``: candidates
take turns in rotating order; a trial's number is the slowest rank's mean step time), the ratio
to ``torch-fsdp`` measured in the same run, the peak bytes of live tensors during one step
(``workbench.measure.metrics.MemoryMeter``, split into parameters, gradients, optimizer state,
activations, communication buffers), and the model-state bytes held between steps
(``model_state_bytes``). The figure to reach: ``stage3`` at most 1.25x ``torch-fsdp``'s step time.
After the timed loop, ``stage1`` must hold the same weights as ``torch-zero`` and ``stage3`` as
``torch-fsdp`` (same data, same steps).

CPU timings are noisy while anything else runs: read the ratios, and repeat with more
``--trials`` before trusting a difference of a few percent.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring
from workbench.models.data import synthetic_batch
from workbench.measure.metrics import MemoryMeter, model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel import zero
from workbench.parallel.zero_memory import bytes_sent_per_rank, model_state_per_rank

CANDIDATES = ("stage0", "stage1", "stage2", "stage3", "torch-zero", "torch-fsdp")
TARGET_RATIO = 1.25
ADAMW = dict(lr=1e-3, weight_decay=0.0)
CATEGORY_ORDER = ("params", "grads", "optimizer", "activations", "comm")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated subset of {', '.join(CANDIDATES)} (stage3 and torch-fsdp always run)")
    parser.add_argument("--preset", default="small", help="GPT preset (default: small)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials per candidate (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per trial (default 3)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate first (default 2)")
    parser.add_argument("--out", default=None, help="folder for zero.json and zero.png (default runs/zero-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw zero.png")


def _wrap(candidate: str, model: nn.Module):
    """``(model, optimizer)`` for one candidate, from an identically initialised model."""
    if candidate.startswith("stage"):
        return zero(model, torch.optim.AdamW, int(candidate[-1]), **ADAMW)
    if candidate == "torch-zero":
        from torch.distributed.optim import ZeroRedundancyOptimizer
        ddp = DistributedDataParallel(model)
        return ddp, ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, **ADAMW)
    from torch.distributed.fsdp import fully_shard

    for block in model.blocks:
        fully_shard(block)
    fully_shard(model)
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _weights(candidate: str, model: nn.Module) -> dict:
    if candidate == "stage3":
        return model.full_state_dict()
    if candidate == "torch-fsdp":
        return {k: v.full_tensor() for k, v in model.state_dict().items()}
    return {k: v.detach() for k, v in getattr(model, "module", model).state_dict().items()}


def run(candidates: list[str], preset: str, batch_size: int, trials: int, steps: int, warmup: int,
        seq_len: int | None = None) -> dict:
    """Inside every rank: build, warm up, measure memory, time interleaved trials, check weights.
    ``seq_len``: tokens per sequence (default: the preset's ``block_size``)."""
    rank = dist.get_rank()
    config = GPTConfig.preset(preset)
    torch.manual_seed(0)
    base = GPT(config)
    x, y = synthetic_batch(batch_size, block_size=seq_len or config.block_size, seed=rank)
    pairs = {c: _wrap(c, copy.deepcopy(base)) for c in candidates}

    def step(c):
        model, optimizer = pairs[c]
        model(x, y)[1].backward()
        optimizer.step()
        optimizer.zero_grad()

    memory = {}
    for c in candidates:
        for _ in range(warmup):
            step(c)
        with MemoryMeter(x, y) as meter:
            step(c)
        model, optimizer = pairs[c]
        # ZeroRedundancyOptimizer keeps its shard's state in a local optimizer, ``.optim``.
        state = model_state_bytes(model, optimizer.optim if c == "torch-zero" else optimizer)
        memory[c] = {"peak": int(measuring.max_over_ranks(meter.peak_bytes)),
                     "peak_by_category": {k: int(v) for k, v in meter.peak_by_category.items()},
                     "model_state": state["total"] - state["grads"]}  # between steps: no gradients

    def measure(c):
        return measuring.max_over_ranks(measuring.timed(lambda: step(c), steps))

    samples = measuring.interleaved_trials(candidates, trials, measure)
    checks = {}
    for ours, theirs in (("stage1", "torch-zero"), ("stage3", "torch-fsdp")):
        if ours in pairs and theirs in pairs:
            a, b = _weights(ours, pairs[ours][0]), _weights(theirs, pairs[theirs][0])
            checks[f"{ours} vs {theirs}"] = max((a[k] - b[k]).abs().max().item() for k in b)
    rows = []
    for c in candidates:
        rows.append({"candidate": c, "step_ms": 1e3 * measuring.median(samples[c]),
                     "samples_ms": [1e3 * s for s in samples[c]], **memory[c]})
    reference = rows[candidates.index("torch-fsdp")]["step_ms"]
    for row in rows:
        row["ratio"] = row["step_ms"] / reference
    return {"rows": rows, "weight_checks": checks, "parameters": base.num_parameters(), "preset": preset}


def state_and_traffic(preset: str = "small", stages=(0, 1, 2, 3), batch_size: int = 2, seq_len: int = 64) -> list[dict]:
    """Inside every rank: for each ZeRO stage, the model state this rank holds after a training
    step and the bytes it sent during that step, beside the ZeRO formulas
    (:mod:`workbench.parallel.zero_memory`). Rank 0's rows are returned on every rank.

    Model state is ``model_state_bytes``: every storage of parameters, gradients and optimizer
    state, counted once and in full, padding included. Bytes sent come from ``comm.counters()``;
    for ``native`` calls (torch.distributed, which reports nothing) they are counted from the
    call's sizes, as the ring algorithm would send them.
    """
    n, rows = dist.get_world_size(), []
    for stage in stages:
        torch.manual_seed(0)
        module = GPT(GPTConfig.preset(preset))
        psi = module.num_parameters()
        model, optimizer = zero(module, torch.optim.AdamW, stage, **ADAMW)
        x = torch.randint(0, module.config.vocab_size, (batch_size, seq_len),
                          generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x, x)[1].backward()   # a first step creates the optimizer state
        optimizer.step()
        optimizer.zero_grad()
        with comm.counters() as c:
            model(x, x)[1].backward()
            optimizer.step()
        state = model_state_bytes(model, optimizer)
        rows.append({"stage": stage, "N": n, "psi": psi, **state,
                     "formula": model_state_per_rank(psi, n, stage)["total"], "sent": c.total_bytes_sent,
                     "sent_formula": bytes_sent_per_rank(psi, n, stage)})
    gathered = [None] * n
    dist.all_gather_object(gathered, rows)
    return gathered[0]


def main(args: argparse.Namespace) -> int:
    candidates = measuring.choices(args.candidates, CANDIDATES, "candidates")
    for needed in ("stage3", "torch-fsdp"):
        if needed not in candidates:
            candidates.append(needed)
    candidates = [c for c in CANDIDATES if c in candidates]
    for name in ("world_size", "trials", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    start = time.time()
    res = workbench.launch(run, world_size=args.world_size,
                           args=(candidates, args.preset, args.batch_size, args.trials, args.steps, args.warmup),
                           timeout=3600)[0]
    mib = 1 / (1 << 20)
    for row in res["rows"]:
        row["peak_mib"] = row["peak"] * mib
        row["state_mib"] = row["model_state"] * mib
    title = (f"bench zero: GPT {res['preset']} ({res['parameters'] / 1e6:.2f} M parameters), world size "
             f"{args.world_size}, batch {args.batch_size} per rank, AdamW; median of {args.trials} interleaved "
             f"trials x {args.steps} steps\n" +
             "; ".join(f"{k}: max |weight difference| = {v:.2g}" for k, v in res["weight_checks"].items()))
    print(measuring.format_table(res["rows"], [
        ("candidate", "candidate", "s"), ("step_ms", "step ms", "{:.1f}"), ("ratio", "x fsdp2", "{:.3f}"),
        ("peak_mib", "peak MiB", "{:.1f}"), ("state_mib", "state MiB", "{:.1f}")], title=title))
    ratio = next(r["ratio"] for r in res["rows"] if r["candidate"] == "stage3")
    ok = ratio <= TARGET_RATIO
    print(f"# stage3 / torch-fsdp = {ratio:.3f}: {'meets' if ok else 'MISSES'} the target <= {TARGET_RATIO:.2f} "
          "(CPU timings are noisy while other processes run)")
    measuring.save_outputs(args, "zero", {"results": res, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(res)))
    return 0 if ok else 1


def plot(res: dict):
    """Left: step time relative to FSDP2. Right: peak memory per rank, stacked by category."""
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = [r["candidate"] for r in rows]
    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    colors = ["#888888" if n.startswith("torch") else "#4c72b0" for n in names]
    ax_t.barh(names[::-1], [r["ratio"] for r in rows][::-1], color=colors[::-1])
    ax_t.axvline(1.0, color="k", lw=0.8)
    ax_t.axvline(TARGET_RATIO, color="#c44e52", ls="--", lw=0.8, label=f"target for stage3: {TARGET_RATIO:.2f}x")
    for yy, r in enumerate(rows[::-1]):
        ax_t.text(r["ratio"], yy, f" {r['step_ms']:.0f} ms", va="center", fontsize=8)
    ax_t.set_xlabel("step time / FSDP2's (lower is better)")
    ax_t.legend(loc="lower right", fontsize=8)
    bottom = [0.0] * len(rows)
    for cat in CATEGORY_ORDER:
        values = [r["peak_by_category"].get(cat, 0) / (1 << 20) for r in rows]
        ax_m.bar(names, values, bottom=bottom, label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax_m.set_ylabel("peak MiB per rank (live tensors)")
    ax_m.tick_params(axis="x", rotation=30)
    ax_m.legend(fontsize=8)
    fig.suptitle(f"GPT {res['preset']}: ZeRO stages against PyTorch")
    return fig
