"""The memory levers measured against their formulas: precision, sharding, recomputation.

``workbench bench memory`` trains the GPT ``small`` preset (AdamW, batch 4 of 128 tokens per
rank) in one launch and reports three tables:

* **Model state** for ZeRO stages 0-3 (DDP, ZeRO-1, ZeRO-2, FSDP), float32 and bfloat16
  (``MixedPrecision(param_dtype=torch.bfloat16)``): ``model_state_bytes`` after backward and
  the optimizer step of the third step (DDP broadcasts its rebuilt bucket order once, in the
  second step) (Adam state exists, gradients still held), against the
  ZeRO paper's formulas (float32: 16, 8 + 8/N, 4 + 12/N, 16/N bytes per parameter; mixed
  precision 2 + 2 + 12: 16, 4 + 12/N, 2 + 14/N, 16/N), and the bytes this rank sent in
  that step, bfloat16 over float32 (exactly 0.5 expected).
* **Activations** for each precision, recomputation policy (none, selective, full) and
  attention kernel (fused, math): bytes of activations alive at the end of forward (``kept``)
  and the peak over forward and backward (``MemoryMeter``, category "activations"), against
  :func:`workbench.parallel.recompute.activation_bytes`. Measured on the rank's model itself
  (float32, or cast to bfloat16 as the strategies compute), outside the wrappers: the
  activations of a data-parallel rank do not depend on the stage (same micro-batch, same
  model), and inside the wrappers the meter would count the gradients autograd produces
  before DDP copies them into its buckets, and FSDP's gathered parameters, as activations.
  The peak is the activations' share at the moment the total peaks.
* **Step time** of each policy relative to none, float32, fused kernel (interleaved trials,
  median, slowest rank): the price of recomputation (about one extra forward for ``full``).

:func:`figure` draws the stacked bars of the lesson (model state and activations per rank,
formula beside measurement). CPU timings are noisy while anything else runs.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring
from workbench.models.data import synthetic_batch
from workbench.measure.metrics import MemoryMeter, model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel import MixedPrecision, recompute, zero
from workbench.parallel.recompute import activation_bytes

STAGES = (0, 1, 2, 3)
STAGE_NAMES = {0: "DDP", 1: "ZeRO-1", 2: "ZeRO-2", 3: "ZeRO-3"}
PRECISIONS = ("fp32", "bf16")
POLICIES = ("none", "selective", "full")
KERNELS = ("fused", "math")
ADAMW = dict(lr=1e-3, weight_decay=0.0)

# bytes per parameter of model state, psi parameters, n ranks (ZeRO paper, Adam)
FORMULAS = {
    "fp32": {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 8 * psi + 8 * psi / n,
             2: lambda psi, n: 4 * psi + 12 * psi / n, 3: lambda psi, n: 16 * psi / n},
    "bf16": {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 4 * psi + 12 * psi / n,
             2: lambda psi, n: 2 * psi + 14 * psi / n, 3: lambda psi, n: 16 * psi / n},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="small", help="GPT preset (default: small)")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank (default 4)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved timing trials (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per trial (default 2)")
    parser.add_argument("--out", default=None, help="folder for memory.json and memory.png")
    parser.add_argument("--no-plot", action="store_true", help="do not draw memory.png")


def _policy(precision: str):
    return MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None


def _build(base, stage: int, precision: str, policy: str):
    """``(model, optimizer)``: a copy of ``base`` under recomputation ``policy``, wrapped by ZeRO ``stage``
    at ``precision``, with AdamW."""
    module = recompute(copy.deepcopy(base), policy) if policy != "none" else copy.deepcopy(base)
    return zero(module, torch.optim.AdamW, stage, mp_policy=_policy(precision), **ADAMW)


def _state_rows(base, x, y, psi: int, n: int) -> list[dict]:
    """Model state per stage and precision after the third step's backward and optimizer step, against
    the ZeRO formulas, with the bytes that step sent at bfloat16 over float32."""
    state_rows = []
    for stage in STAGES:
        sent = {}
        for precision in PRECISIONS:
            model, opt = _build(base, stage, precision, "none")
            for _ in range(2):   # Adam state created, DDP's buckets rebuilt (a broadcast)
                model(x, y)[1].backward()
                opt.step()
                opt.zero_grad()
            with comm.counters() as c:
                model(x, y)[1].backward()
                opt.step()
            sent[precision] = c.total_bytes_sent
            held = model_state_bytes(model, opt)
            formula = FORMULAS[precision][stage](psi, n)
            state_rows.append({"stage": STAGE_NAMES[stage], "precision": precision, **held,
                               "formula": formula, "ratio": held["total"] / formula})
            del model, opt
        for row in state_rows[-2:]:
            row["wire_vs_fp32"] = sent[row["precision"]] / sent["fp32"]
    return state_rows


def _fp32_reduce_row(base, x, y, psi: int, n: int) -> dict:
    """ZeRO-2 reducing bfloat16 gradients in float32: a 4 psi / N gradient shard, float32 on the wire
    (formula ``2 psi + 16 psi / N``)."""
    model, opt = zero(copy.deepcopy(base), torch.optim.AdamW, 2, **ADAMW,
                      mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for _ in range(3):
        model(x, y)[1].backward()
        opt.step()
    held = model_state_bytes(model, opt)
    formula = 2 * psi + 16 * psi / n
    return {"stage": "ZeRO-2", "precision": "bf16/fp32-reduce", **held, "formula": formula,
            "ratio": held["total"] / formula, "wire_vs_fp32": float("nan")}


def _activation_rows(base, config, x, y, batch_size: int) -> list[dict]:
    """Activations kept at the end of forward and their peak over forward and backward, per precision,
    attention kernel and recomputation policy, on the rank's model outside the wrappers, against
    :func:`workbench.parallel.recompute.activation_bytes`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    activation_rows = []
    for precision in PRECISIONS:
        for kernel, backend in zip(KERNELS, (SDPBackend.FLASH_ATTENTION, SDPBackend.MATH)):
            for policy in POLICIES:
                # the rank's model as the strategies run it, without their buffers in the meter
                model = recompute(copy.deepcopy(base), policy)
                if precision == "bf16":
                    model = model.to(torch.bfloat16)
                with sdpa_kernel(backend):
                    with MemoryMeter(model, x, y) as forward_only:
                        logits, loss = model(x, y)
                    kept = forward_only.current_by_category["activations"]
                    del logits, loss
                    with MemoryMeter(model, x, y) as meter:
                        logits, loss = model(x, y)
                        loss.backward()
                    del logits, loss
                f = activation_bytes(config, batch_size, policy=policy, kernel=kernel,
                                     dtype=torch.bfloat16 if precision == "bf16" else torch.float32)
                peak = meter.peak_by_category["activations"]
                activation_rows.append({"precision": precision, "kernel": kernel, "policy": policy,
                                        "kept": kept, "kept_formula": f["kept"], "kept_ratio": kept / f["kept"],
                                        "peak": peak, "peak_formula": f["peak"], "peak_ratio": peak / f["peak"]})
                del model
    return activation_rows


def _time_rows(base, x, y, trials: int, steps: int) -> list[dict]:
    """Step time of each recomputation policy (DDP, float32), one untimed step each first, then interleaved
    trials (median, slowest rank), relative to no recomputation."""
    pairs = {p: _build(base, 0, "fp32", p) for p in POLICIES}

    def step(p):
        model, opt = pairs[p]
        model(x, y)[1].backward()
        opt.step()
        opt.zero_grad()

    for p in POLICIES:
        step(p)
    samples = measuring.interleaved_trials(list(POLICIES), trials,
                                           lambda p: measuring.max_over_ranks(measuring.timed(lambda: step(p), steps)))
    time_rows = [{"policy": p, "step_ms": 1e3 * measuring.median(samples[p]),
                  "samples_ms": [1e3 * s for s in samples[p]]} for p in POLICIES]
    for row in time_rows:
        row["vs_none"] = row["step_ms"] / time_rows[0]["step_ms"]
    return time_rows


def run(preset: str = "small", batch_size: int = 4, trials: int = 5, steps: int = 2) -> dict:
    """Inside every rank: the three tables of the module docstring (rank 0's view of memory,
    the slowest rank's time)."""
    rank, n = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.preset(preset)
    torch.manual_seed(0)
    base = GPT(config)
    psi = base.num_parameters()
    x, y = synthetic_batch(batch_size, block_size=config.block_size, seed=rank)
    state_rows = _state_rows(base, x, y, psi, n) + [_fp32_reduce_row(base, x, y, psi, n)]
    activation_rows = _activation_rows(base, config, x, y, batch_size)
    time_rows = _time_rows(base, x, y, trials, steps)
    return {"state": state_rows, "activations": activation_rows, "time": time_rows, "parameters": psi,
            "preset": preset, "batch_size": batch_size, "world_size": n, "sequence": config.block_size}


def figure(results: dict, kernel: str = "fused"):
    """Stacked bars per rank: model state (parameters, gradients, optimizer state, measured) and
    peak activations (measured under ``kernel``), for every stage x precision x recomputation
    policy; a black tick marks the formula's total (model-state formula + activation formula)."""
    import matplotlib.pyplot as plt

    state = {(r["stage"], r["precision"]): r for r in results["state"]}
    acts = {(r["precision"], r["policy"]): r for r in results["activations"] if r["kernel"] == kernel}
    mib = 1 / (1 << 20)
    fig, axes = plt.subplots(1, len(PRECISIONS), figsize=(12, 4.2), layout="constrained", sharey=True)
    colors = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52"}
    for ax, precision in zip(axes, PRECISIONS):
        labels, x = [], 0
        for stage in STAGES:
            s = state[(STAGE_NAMES[stage], precision)]
            for policy in POLICIES:
                a = acts[(precision, policy)]
                bottom = 0.0
                for key in ("params", "grads", "optimizer"):
                    ax.bar(x, s[key] * mib, bottom=bottom, color=colors[key], width=0.8,
                           label=key if x == 0 else None)
                    bottom += s[key] * mib
                ax.bar(x, a["peak"] * mib, bottom=bottom, color=colors["activations"], width=0.8,
                       alpha={"none": 1.0, "selective": 0.7, "full": 0.4}[policy],
                       label=f"activations ({policy})" if stage == 0 else None)
                ax.plot([x - 0.4, x + 0.4], [(s["formula"] + a["peak_formula"]) * mib] * 2, color="k", lw=1.5,
                        label="formula" if x == 0 else None)
                labels.append({"none": "none", "selective": "sel.", "full": "full"}[policy])
                x += 1
            ax.text(x - 2, -0.11, STAGE_NAMES[stage], transform=ax.get_xaxis_transform(), ha="center", fontsize=9)
            x += 0.5
        ticks = [i + (i // 3) * 0.5 for i in range(len(labels))]
        ax.set_xticks(ticks, labels, fontsize=7)
        ax.set_title(f"{precision}: GPT {results['preset']}, {results['parameters'] / 1e6:.1f} M parameters, world "
                     f"{results['world_size']}, batch {results['batch_size']}x{results['sequence']}, {kernel} attention",
                     fontsize=9)
        ax.set_ylabel("MiB per rank")
    axes[-1].legend(fontsize=7, loc="upper right")
    return fig


def main(args: argparse.Namespace) -> int:
    for name in ("world_size", "trials", "steps", "batch_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    start = time.time()
    res = workbench.launch(run, world_size=args.world_size,
                           args=(args.preset, args.batch_size, args.trials, args.steps), timeout=3600)[0]
    mib = 1 / (1 << 20)
    for row in res["state"]:
        row["MiB"], row["formula_MiB"] = row["total"] * mib, row["formula"] * mib
    print(measuring.format_table(res["state"], [
        ("stage", "stage", "s"), ("precision", "precision", "s"), ("MiB", "state MiB", "{:.2f}"),
        ("formula_MiB", "formula MiB", "{:.2f}"), ("ratio", "ratio", "{:.4f}"),
        ("wire_vs_fp32", "wire / fp32", "{:.3f}")],
        title=f"bench memory: model state per rank, GPT {res['preset']} ({res['parameters'] / 1e6:.2f} M "
              f"parameters), world size {res['world_size']}, AdamW"))
    for row in res["activations"]:
        row["kept_MiB"], row["peak_MiB"] = row["kept"] * mib, row["peak"] * mib
    print(measuring.format_table(res["activations"], [
        ("precision", "precision", "s"), ("kernel", "kernel", "s"), ("policy", "policy", "s"),
        ("kept_MiB", "kept MiB", "{:.2f}"), ("kept_ratio", "kept/formula", "{:.3f}"),
        ("peak_MiB", "peak MiB", "{:.2f}"), ("peak_ratio", "peak/formula", "{:.3f}")],
        title=f"activations per rank, batch {res['batch_size']} x {res['sequence']} tokens (the rank's model, outside the wrappers)"))
    print(measuring.format_table(res["time"], [
        ("policy", "policy", "s"), ("step_ms", "step ms", "{:.1f}"), ("vs_none", "x none", "{:.3f}")],
        title=f"step time of recomputation (float32, fused kernel), median of {args.trials} interleaved trials"))
    ok = all(1.0 <= r["ratio"] <= 1.05 for r in res["state"]) and \
        all(r["wire_vs_fp32"] == 0.5 for r in res["state"] if r["precision"] == "bf16")
    print(f"# model state within 1.00-1.05 of the formulas and bf16 wire bytes exactly half: {'yes' if ok else 'NO'}")
    measuring.save_outputs(args, "memory", {"results": res, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: figure(res)))
    return 0 if ok else 1
