"""Our tensor parallelism against PyTorch's DTensor, and against data parallelism.

``workbench bench tensor`` trains the GPT ``small`` preset (4 layers, C=256, T=128) with t=2
ranks in one launch and times whole training steps (forward, backward, AdamW step, zero_grad):

================  ==============================================================================
candidate         what it is
================  ==============================================================================
dtensor           PyTorch: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``
                  (:func:`torch_tensor_parallel`), logits gathered, plain cross-entropy
dtensor-sp        the same plus ``SequenceParallel`` norms and ``loss_parallel``
ours              ``workbench.parallel.tensor_parallel`` (``algorithm="native"``)
ours-sp           ``tensor_parallel(..., sequence_parallel=True)``
ours-ring         ours with the hand-written ring collectives (``algorithm="ring"``)
ours-sp-ring      sequence parallel with the ring collectives
ddp               data parallelism at the same world size: torch DDP, each rank half the batch
================  ==============================================================================

Every candidate sees the same global batch: the tensor-parallel ones the whole batch on every
rank, ``ddp`` its half. The report gives the median step time over interleaved trials, the ratio
to DTensor measured in the same run (``ours`` / ``dtensor``, ``ours-sp`` / ``dtensor-sp``), the
tokens per second, and the model-state bytes per rank (parameters, gradients, AdamW moments);
``ours`` and ``dtensor`` must give the same loss (checked outside the timed loop).

Why ours can be faster on a CPU: DTensor routes every operator on a distributed tensor through
its sharding propagation (Python, per operator, per step); ours runs plain local tensors and
names each collective in the code, so its overhead is a few autograd functions per layer.
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
from workbench import runtime
from workbench.measure import measuring
from workbench.models.data import synthetic_batch
from workbench.measure.metrics import MemoryMeter, model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel.tensor import ParallelSelfAttention, tensor_parallel

CANDIDATES = ("dtensor", "ours", "dtensor-sp", "ours-sp", "ours-ring", "ours-sp-ring", "ddp")
# what each candidate's ratio is taken against
PAIRS = {"dtensor": "dtensor", "dtensor-sp": "dtensor", "ours": "dtensor", "ours-sp": "dtensor-sp",
         "ours-ring": "dtensor", "ours-sp-ring": "dtensor-sp", "ddp": "ours"}
TARGET_RATIO = 1.10


# ------------------------------------------------------------------------------ PyTorch's TP
def torch_tensor_parallel(model: nn.Module, *, sequence_parallel: bool = False, mesh=None) -> nn.Module:
    """PyTorch's tensor parallelism on a copy of workbench's GPT: the reference ours is checked against.

    ``parallelize_module`` with ``ColwiseParallel`` for ``c_attn``/``c_fc`` and ``RowwiseParallel``
    for the ``c_proj`` layers and the token embedding; with ``sequence_parallel`` the norms are
    ``SequenceParallel``, the blocks all-gather their input (``PrepareModuleInput``), the
    row-parallel layers reduce-scatter (``output_layouts=Shard(1)``), the position embedding is
    split by sequence, and the head leaves vocabulary-sharded logits for ``loss_parallel``. Run
    forward and backward inside ``torch.distributed.tensor.parallel.loss_parallel()``.

    Two things are not DTensor's to decide and are prepared here: ``c_attn`` is one fused
    ``[q | k | v]`` matrix, which ``ColwiseParallel`` would cut into contiguous row blocks (rank 0
    would get q and half of k), so its rows are reordered rank-major ``[q_0 k_0 v_0 | q_1 k_1 v_1]``
    first; and the attention must run on ``n_head/t`` local heads, so each attention module is
    replaced by our :class:`~workbench.parallel.tensor.ParallelSelfAttention`, local arithmetic
    only (DTensor does every message). A tied head is re-tied after parallelising.

    All of this runs on gloo and CPU tensors in torch 2.13 (the tests check it at t = 2, tied and
    untied, with and without sequence parallelism), ``loss_parallel`` included, and with the
    65-character vocabulary sharded unevenly (33 + 32 rows: DTensor splits like ``torch.chunk``,
    no padding needed).
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    t = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(runtime.device().type, (t,))
    tied = model.lm_head.weight is model.wte.weight
    for block in model.blocks:
        a = block.attn
        with torch.no_grad():
            for p in (a.c_attn.weight, a.c_attn.bias):
                if p is not None:
                    q, k, v = p.chunk(3, 0)
                    p.copy_(torch.cat([torch.cat([u.chunk(t, 0)[r] for u in (q, k, v)]) for r in range(t)]))
        block.attn = ParallelSelfAttention(a.c_attn, a.c_proj, a.n_head, t, a.dropout, a.resid_dropout)
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)}
    if sp:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    else:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        plan[b + "attn.c_attn"] = ColwiseParallel()
        plan[b + "attn.c_proj"] = RowwiseParallel(output_layouts=residual)
        plan[b + "mlp.c_fc"] = ColwiseParallel()
        plan[b + "mlp.c_proj"] = RowwiseParallel(output_layouts=residual)
        if sp:
            plan[b + "ln_1"] = SequenceParallel()
            plan[b + "ln_2"] = SequenceParallel()
            plan[b + "attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan[b + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.wte.weight
    return model


def torch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward of a :func:`torch_tensor_parallel` model inside ``loss_parallel`` (a plain tensor)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        _, loss = model(x, y)
    return loss


def torch_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step of a DTensor model: forward and backward inside ``loss_parallel``."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        _, loss = model(x, y)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return _as_float(loss)


def _as_float(loss) -> float:
    return float(loss.full_tensor().item()) if hasattr(loss, "full_tensor") else float(loss.item())


# ------------------------------------------------------------------------------ the command
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", help="GPT preset (default small: 4 layers, C=256, T=128)")
    parser.add_argument("--batch", type=int, default=8, help="global batch in sequences (default 8)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated subset of {', '.join(CANDIDATES)} (dtensor is always included)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks = tensor-parallel size t (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials per candidate (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per trial (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per candidate first (default 1)")
    parser.add_argument("--out", default=None, help="folder for tensor.json and tensor.png (default runs/tensor-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw tensor.png")


def _build(candidate: str, base: nn.Module):
    """``(model, step_fn)``: ``step_fn(optimizer, x, y) -> loss`` on the whole global batch."""
    model = copy.deepcopy(base)
    if candidate.startswith("dtensor"):
        model = torch_tensor_parallel(model, sequence_parallel=candidate.endswith("-sp"))
        return model, lambda opt, x, y: torch_step(model, opt, x, y)
    if candidate == "ddp":
        ddp = DistributedDataParallel(model)
        t, r = dist.get_world_size(), dist.get_rank()

        def dp_step(opt, x, y):
            b = x.shape[0] // t
            _, loss = ddp(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])
            loss.backward()
            opt.step()
            opt.zero_grad()
            return loss.item()
        return ddp, dp_step
    model = tensor_parallel(model, sequence_parallel="-sp" in candidate,
                            algorithm="ring" if candidate.endswith("-ring") else "native")

    def tp_step(opt, x, y):
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.item()
    return model, tp_step


def measure(preset: str, batch: int, candidates: list[str], trials: int, steps: int, warmup: int) -> dict:
    """In every rank: time ``candidates`` (interleaved trials, slowest rank), then measure one more
    step's memory (``MemoryMeter``) and model state; ``{"rows": [...], ...}`` (the same on every rank)."""
    torch.manual_seed(0)
    config = GPTConfig.preset(preset)
    base = GPT(config)
    x, y = synthetic_batch(batch, block_size=config.block_size, seed=0)
    built = {c: _build(c, base) for c in candidates}
    optims = {c: torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for c, (m, _) in built.items()}
    first_loss = {c: built[c][1](optims[c], x, y) for c in candidates}  # also a warm-up step
    for c in candidates:
        for _ in range(warmup - 1):
            built[c][1](optims[c], x, y)

    def time_one(c):
        return measuring.max_over_ranks(measuring.timed(lambda: built[c][1](optims[c], x, y), steps))

    samples = measuring.interleaved_trials(candidates, trials, time_one)
    rows = []
    for c in candidates:
        model, step = built[c]
        with MemoryMeter(model, optims[c]) as meter:  # one more step, outside the timed loop
            step(optims[c], x, y)
        state = model_state_bytes(model, optims[c])
        ms = 1e3 * measuring.median(samples[c])
        rows.append({"candidate": c, "step_ms": ms, "samples_ms": [1e3 * s for s in samples[c]],
                     "tokens_per_s": batch * config.block_size / (ms / 1e3),
                     "state_MiB": measuring.max_over_ranks(state["total"]) / 2**20,
                     "peak_MiB": measuring.max_over_ranks(meter.peak_bytes) / 2**20,
                     "activations_MiB": measuring.max_over_ranks(meter.peak_by_category["activations"]) / 2**20,
                     "first_loss": first_loss[c]})
    by = {r["candidate"]: r for r in rows}
    for r in rows:
        ref = by.get(PAIRS[r["candidate"]])
        r["ratio"] = r["step_ms"] / ref["step_ms"] if ref else float("nan")
        r["vs"] = PAIRS[r["candidate"]] if ref else "-"
    return {"rows": rows, "parameters": sum(p.numel() for p in base.parameters()), "preset": preset,
            "batch": batch, "block_size": config.block_size}


def main(args: argparse.Namespace) -> int:
    items = measuring.choices(args.candidates, CANDIDATES, "candidates")
    if any(c.endswith("-sp") or c == "ours-sp-ring" for c in items) and "dtensor-sp" not in items:
        items.insert(0, "dtensor-sp")
    if "dtensor" not in items:
        items.insert(0, "dtensor")
    if "ddp" in items and "ours" not in items:
        items.insert(1, "ours")
    for name in ("world_size", "trials", "steps", "warmup", "batch"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.batch % args.world_size:
        raise ValueError(f"--batch={args.batch} must be divisible by --world-size={args.world_size} (the ddp "
                         "candidate gives each rank batch / world-size sequences)")
    start = time.time()
    res = workbench.launch(measure, world_size=args.world_size,
                           args=(args.preset, args.batch, items, args.trials, args.steps, args.warmup),
                           timeout=3600)[0]
    by = {r["candidate"]: r for r in res["rows"]}
    loss_diff = abs(by["ours"]["first_loss"] - by["dtensor"]["first_loss"]) if "ours" in by else float("nan")
    title = (f"bench tensor: GPT {res['preset']} ({res['parameters'] / 1e6:.2f} M parameters), t = {args.world_size}, "
             f"global batch {res['batch']} x {res['block_size']} tokens, median of {args.trials} interleaved "
             f"trials x {args.steps} steps\nfirst-step loss, ours vs dtensor: |difference| = {loss_diff:.2g}")
    lines = [measuring.format_table(res["rows"], [
        ("candidate", "candidate", "s"), ("step_ms", "step ms", "{:.1f}"), ("vs", "vs", "s"),
        ("ratio", "ratio", "{:.3f}"), ("tokens_per_s", "tokens/s", "{:.0f}"), ("state_MiB", "state MiB", "{:.2f}"),
        ("activations_MiB", "activ. MiB", "{:.2f}"), ("peak_MiB", "peak MiB", "{:.2f}")], title=title)]
    ok = True
    for ours, theirs in (("ours", "dtensor"), ("ours-sp", "dtensor-sp")):
        if ours in by:
            r = by[ours]["ratio"]
            ok &= r <= TARGET_RATIO
            lines.append(f"# {ours} / {theirs} = {r:.3f}: {'meets' if r <= TARGET_RATIO else 'MISSES'} the target "
                         f"<= {TARGET_RATIO:.2f}" + (f" ({1 / r:.2f}x faster)" if r < 1 else ""))
    if "ddp" in by and "ours" in by:
        lines.append(f"# tensor vs data parallelism at t = {args.world_size}: tokens/s ours {by['ours']['tokens_per_s']:.0f}"
                     f" vs ddp {by['ddp']['tokens_per_s']:.0f}; model state per rank {by['ours']['state_MiB']:.2f} vs "
                     f"{by['ddp']['state_MiB']:.2f} MiB")
    print("\n".join(lines))
    measuring.save_outputs(args, "tensor", {"results": res, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(res)))
    return 0 if ok else 1


def plot(res: dict):
    """Left: step time over DTensor's. Right: tokens/s and memory per rank (TP against DP)."""
    import matplotlib.pyplot as plt

    rows = res["rows"]
    names = [r["candidate"] for r in rows]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    colors = ["#888888" if n.startswith("dtensor") else "#55a868" if n == "ddp" else "#4c72b0" for n in names]
    a1.barh(names[::-1], [r["ratio"] for r in rows][::-1], color=colors[::-1])
    a1.axvline(1.0, color="k", lw=0.8)
    a1.axvline(TARGET_RATIO, color="#c44e52", ls="--", lw=0.8, label=f"target {TARGET_RATIO:.2f}x")
    for i, r in enumerate(rows[::-1]):
        a1.text(r["ratio"], i, f" {r['step_ms']:.0f} ms (vs {r['vs']})", va="center", fontsize=8)
    a1.set_xlabel("step time / DTensor's (lower is better)")
    a1.set_xlim(0, max(r["ratio"] for r in rows) * 1.5)
    a1.legend(loc="lower right", fontsize=8)
    a1.set_title(f"GPT {res['preset']}: ours against DTensor")
    x = range(len(rows))
    a2.bar([i - 0.2 for i in x], [r["state_MiB"] for r in rows], 0.4, label="model state MiB / rank")
    a2.bar([i + 0.2 for i in x], [r["activations_MiB"] for r in rows], 0.4, label="peak activations MiB / rank")
    a2.set_xticks(list(x), names, rotation=30, ha="right", fontsize=8)
    a2.set_ylabel("MiB per rank")
    tw = a2.twinx()
    tw.plot(list(x), [r["tokens_per_s"] for r in rows], "ko-", label="tokens/s")
    tw.set_ylabel("tokens / s")
    a2.legend(loc="upper left", fontsize=8)
    a2.set_title("memory per rank and throughput (TP vs DP)")
    return fig
