# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Workbench (Python, 1 thread per rank)
#     language: python
#     name: workbench
# ---

# %% [markdown]
# # 04b · The memory levers: mixed precision, recomputation, sharding
#
# When a model does not fit, three levers come before (or with) a new kind of parallelism:
#
# * **Mixed precision.** Forward and backward run on 16-bit copies of the weights, the optimizer
#   keeps float32 *master* weights (a bfloat16 weight would round most small updates away).
#   `MixedPrecision(param_dtype=torch.bfloat16)` (FSDP2's names), passed as `mp_policy=` to
#   DDP, ZeRO-1/2 and FSDP. For a model of `psi` parameters trained with Adam on `N` ranks, the
#   ZeRO paper counts `2 + 2 + K` bytes per parameter: a 16-bit weight, a 16-bit gradient, and
#   `K` bytes of *optimizer state*, the paper's name for everything the optimizer keeps per
#   parameter in float32 (for Adam `K = 12`: a 4-byte master weight and two 4-byte moments).
#   That is still `16 psi` for DDP, but ZeRO-1 becomes `4 psi + 12 psi/N` and ZeRO-2
#   `2 psi + 14 psi/N`. Every byte on the wire is a 16-bit byte: half of float32's.
# * **Activation recomputation.** `recompute(model, "full")` keeps only each block's input and
#   re-runs the block in backward (one extra forward); `recompute(model, "selective")` recomputes
#   only the attention core (Korthikanti et al. 2022), whose scores grow as `a s^2` per sequence
#   (`a` heads, `s` tokens).
# * **Sharding** (lesson 04): ZeRO-1, 2, 3 divide the `K` bytes, the gradients, the weights by `N`.
#
# Sections 1 to 4 come from one run of `workbench bench memory` inside two ranks: GPT
# `small` (3.2 M parameters), AdamW, a micro-batch of 2 sequences of 128 tokens per rank.
# Section 5 runs PyTorch's own mixed precision (`torch.autocast`, `torch.amp.GradScaler`) in
# this process.

# %%
import copy
import math
import os

import matplotlib.pyplot as plt
import torch
from IPython.display import Markdown, display

import workbench
from workbench.apps.train import preload
from workbench.advise.shape import ModelShape
from workbench.advise.timing import flops_per_token
from workbench.apps.bench import memory as bench_memory
from workbench.models.data import get_batch
from workbench.measure.memory_meter import storage_bytes
from workbench.measure.metrics import format_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel import MixedPrecision, zero

SMOKE = workbench.smoke_test()  # the test suite's quick run: one timing trial, a few training steps
# the first optimizer of a process imports torch._dynamo (slow): do it once here, and every rank
# launch() forks below inherits it instead of importing it again
preload()
results = workbench.launch(bench_memory.run, world_size=2, args=("small", 2, 1 if SMOKE else 3, 1), timeout=600)[0]
psi, n = results["parameters"], results["world_size"]
print(f"psi = {psi:,} parameters, N = {n} ranks")

# %% [markdown]
# ## 1. Model state per rank, float32 and bfloat16, against the formulas
#
# `model_state_bytes(model, optimizer)` counts every storage a rank holds for the model once:
# 16-bit parameters and gradients, float32 master weights (wherever they live: the module, or
# the optimizer's own parameter list for ZeRO-1/2), Adam's moments, and buffers a strategy holds
# outside `.grad` (DDP's buckets, ZeRO-2's reduced gradient shard). Measured after the third
# step's backward and update. The last column is the bytes this rank sent in that step over
# what it sends in float32.

# %%
print("stage   precision           params     grads  optimizer     total   formula  measured/formula  wire/fp32")
for r in results["state"]:
    wire = "n/a" if math.isnan(r["wire_vs_fp32"]) else f"{r['wire_vs_fp32']:.3f}"
    print(f"{r['stage']:6s}  {r['precision']:16s} {format_bytes(r['params']):>9s} {format_bytes(r['grads']):>9s} "
          f"{format_bytes(r['optimizer']):>10s} {format_bytes(r['total']):>9s} {format_bytes(r['formula']):>9s}"
          f"  {r['ratio']:16.4f}  {wire:>9s}")
print("n/a: the bench counts the bytes sent only for the float32/bfloat16 pairs, not for this extra row")


# %% [markdown]
# The `params` column of a bfloat16 row mixes two kinds of weights: the 16-bit *working* copy
# that forward and backward read, and the float32 *masters* that the optimizer updates. Which
# of them a rank keeps between steps depends on the stage, so the next cell wraps the model
# once more at each stage in bfloat16 and counts the weight storages by dtype with
# `workbench.measure.memory_meter.storage_bytes` (each storage once, as `model_state_bytes` does). Training
# does not change which weights a rank holds between steps: the check cell asserts that the
# two add up to the `params` the bench measured after its third step.

# %%
def weights_by_dtype(preset: str) -> dict[str, dict[str, int]]:
    """Inside every rank: bytes of bfloat16 working weights and of float32 master weights this rank
    holds at each ZeRO stage under bfloat16 mixed precision (the module's parameters and buffers,
    and the optimizer's own parameters: ZeRO-1/2 keep the masters there)."""
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset(preset))
    split = {}
    for stage in bench_memory.STAGES:
        model, opt = zero(copy.deepcopy(base), torch.optim.AdamW, stage,
                          mp_policy=MixedPrecision(param_dtype=torch.bfloat16), **bench_memory.ADAMW)
        weights = [*model.parameters(), *model.buffers(), *(p for g in opt.param_groups for p in g["params"])]
        split[bench_memory.STAGE_NAMES[stage]] = {
            "working": storage_bytes(w for w in weights if w.dtype == torch.bfloat16),
            "master": storage_bytes(w for w in weights if w.dtype == torch.float32)}
        del model, opt
    return split


weights = workbench.launch(weights_by_dtype, world_size=2, args=(results["preset"],), timeout=300)[0]
state = {(r["stage"], r["precision"]): r for r in results["state"]}
print("stage   bf16 working   fp32 master   sum        bench's params (bf16)   fp32 weights")
for stage, w in weights.items():
    print(f"{stage:6s}  {format_bytes(w['working']):>12s}  {format_bytes(w['master']):>11s}  "
          f"{format_bytes(w['working'] + w['master']):>9s}  {format_bytes(state[(stage, 'bf16')]['params']):>22s}"
          f"  {format_bytes(state[(stage, 'fp32')]['params']):>12s}")

# %% [markdown]
# Where the bytes sit is worth a look. DDP keeps float32 masters and float32 gradients between
# steps (its 16-bit copies exist only during forward and backward, as in PyTorch's DDP), so
# mixed precision saves it nothing in model state: `4 + 4 + 8 = 16 psi` either way. ZeRO-1 and
# ZeRO-2 turn the module's weights into bfloat16 views of flat buffers (the working copy, half
# of float32's weights) and keep the float32 masters only for their own shard: that is where
# the paper's `2 + 2 + 12/N` comes from, and at `N = 2` the two halves add up to float32's
# weights again, so their saving shows in the gradients. FSDP shards everything, masters
# included, and frees its gathered bfloat16 copies after use: `16 psi / N` in either precision.
# What mixed precision always halves is the traffic (last column of the first table) and, next,
# the activations.
#
# The last row of the first table reduces ZeRO-2's bfloat16 gradients in float32
# (`reduce_dtype=torch.float32`, no rounding at each hop of the sum): its gradient shard is
# `4 psi / N`, the formula `2 psi + 16 psi / N`. Its wire ratio is not measured (`n/a`): it
# would lie between the other two, since its reduce-scatter of gradients sends float32 and its
# all-gather of updated weights sends bfloat16.
#
# float16 instead of bfloat16 needs a loss scaler (its smallest normal number is `6e-5`):
# `DynamicLossScaler` multiplies the loss, unscales the float32 gradients, and skips the step
# on every rank if any rank's gradient shard overflowed (the check is all-reduced), exactly as
# `torch.amp.GradScaler` does in one process (section 5 runs PyTorch's).
#
# ## 2. Activations: none, selective, full; fused and math attention
#
# The derivation is in `workbench.parallel.recompute`'s docstring. Per layer, in float32, with
# `s` tokens per sequence, `b` sequences, `h` width, `a` heads, autograd keeps for backward:
#
# * with the fused attention kernel, `16 sbh + 4 sb + a s b` elements. The `a s b` is the
#   kernel's *log-sum-exp*: for each head and query token, `log sum_j exp(score_j)` over the
#   keys `j`, one number from which backward rebuilds the softmax out of recomputed scores,
#   instead of keeping the `s x s` score matrix;
# * with the math kernel, `16 sbh + 4 sb + a s^2 b`: it keeps the softmax itself, `a s^2 b`
#   elements. Korthikanti et al. write a layer's activations as `sbh (34 + 5 a s / h)` bytes
#   in 16 bits with dropout: `34 sbh` for the per-token tensors (this table's `16 sbh` elements
#   at 2 bytes, plus two 1-byte dropout masks) and `5 a s / h` for the scores: `a s^2 b` of them,
#   each with 2 bytes of softmax, 1 of dropout mask and 2 of dropout output, and
#   `5 a s^2 b = sbh x 5 a s / h`. This GPT has no dropout and counts elements, so its term is
#   `a s^2 b = sbh x a s / h`: the scores outweigh the rest of the layer once `a s / h` exceeds 16.
#
# Selective recomputation leaves `16 sbh + 4 sb` with either kernel; full leaves `sbh`. In
# bfloat16 every term halves except what the kernels keep in float32 (the fused kernel's
# log-sum-exp; the math kernel computes in float32).

# %%
print("precision  kernel  policy     kept  kept/formula      peak  peak/formula")
for r in results["activations"]:
    print(f"{r['precision']:9s}  {r['kernel']:6s}  {r['policy']:9s} {format_bytes(r['kept']):>9s}"
          f"  {r['kept_ratio']:12.3f} {format_bytes(r['peak']):>9s}  {r['peak_ratio']:12.3f}")

acts = {(r["precision"], r["kernel"], r["policy"]): r for r in results["activations"]}
saved = {k: 1 - acts[("fp32", k, "selective")]["kept"] / acts[("fp32", k, "none")]["kept"] for k in ("fused", "math")}
display(Markdown(
    f"Selective recomputation keeps {saved['fused']:.1%} fewer activation bytes than none with the "
    f"fused kernel (which stores no scores), {saved['math']:.1%} fewer with the math kernel (which stores "
    f"the `a s^2 b` softmax). Full recomputation keeps "
    f"{acts[('fp32', 'fused', 'full')]['kept'] / acts[('fp32', 'fused', 'none')]['kept']:.1%} of none's."))

# %% [markdown]
# On this CPU, `scaled_dot_product_attention` picks the fused (flash) kernel, so selective
# recomputation buys almost nothing here; on a GPU running the math kernel, or at long
# sequences where `a s / h` is large, it removes the largest term at the cost of recomputing
# the attention core: two matrix products per layer.
#
# ## 3. The price of recomputation
#
# Count the matrix-multiply FLOPs: backward costs two forwards, so a layer costs 3 forwards
# without recomputation and 4 with full (its forward runs again inside backward): `4/3`. The
# head and the loss are not re-run, so the whole model's ratio sits a little below. Selective
# re-runs only the attention core, `q k^T` and the product with `v`, a small part of a layer
# at this sequence length. The FLOP column is `workbench.advise.timing.flops_per_token` (the
# adviser's count, a causal kernel computing half the scores); the time column is the step
# (forward, backward, AdamW update) of each policy against none, float32, fused kernel,
# interleaved trials, the slowest rank's median.

# %%
# NBVAL_IGNORE_OUTPUT
config = GPTConfig.preset(results["preset"])
shape = ModelShape.from_gpt(config)


def model_flops(policy):
    f = flops_per_token(shape, recompute=policy)
    return config.n_layer * f["layer"] + f["head"]


flop_ratio = {p: model_flops(p) / model_flops("none") for p in bench_memory.POLICIES}
load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
print("policy     FLOPs/none   step time  time/none   trials (min-max)")
for r in results["time"]:
    print(f"{r['policy']:9s}  {flop_ratio[r['policy']]:9.3f}x  {r['step_ms']:7.1f} ms  {r['vs_none']:8.2f}x"
          f"   {min(r['samples_ms']):.0f}-{max(r['samples_ms']):.0f} ms")
print(f"(load average {load:.1f} on {os.cpu_count()} cores while this ran)")
time_ratio = {r["policy"]: r["vs_none"] for r in results["time"]}
display(Markdown(
    f"By FLOPs full recomputation costs {flop_ratio['full']:.2f}x none and selective {flop_ratio['selective']:.2f}x; "
    f"measured here, {time_ratio['full']:.2f}x and {time_ratio['selective']:.2f}x."))

# %% [markdown]
# The two columns need not agree on a CPU, for three reasons:
#
# * **The FLOP count is what a large model on a GPU approaches**, where the matrix products take
#   almost all of a step. A CPU step of this small model is not dominated by FLOPs that way: a
#   large share goes to per-operator overhead (dispatch, autograd's bookkeeping, allocation,
#   for a few hundred small operators) and to memory traffic (the AdamW update reads and writes
#   every weight and both moments; layer norms, GELU, softmax and the loss stream their tensors
#   without much arithmetic). Recomputation repeats only part of that, so the time ratio of
#   full tends to fall short of its FLOP ratio, while selective's extra operator calls can cost
#   more than its few FLOPs suggest.
# * **Fewer live activations can even make a step faster**: the memory that recomputation does
#   not keep is not allocated, written, and read back in backward, and what is recomputed is
#   still in cache when backward uses it.
# * **The timing is noisy**: the median of a few short trials on two cores that other work
#   shares; the trials' spread (last column) and the load average say how far to trust it.
#
# ## 4. All of it in one figure
#
# Per rank, for every stage and precision, with each recomputation policy: model state split
# into bfloat16 working weights, float32 master weights (in float32 training the weights
# themselves), gradients and optimizer state (Adam's moments), with the peak activations
# (fused kernel) stacked on top; the black tick is the formula (model-state formula plus
# activation formula). Compare the two panels stage by stage: in bfloat16, ZeRO-1 and ZeRO-2
# trade float32's weights for a working copy of half their size plus this rank's share of the
# masters, and hold 16-bit gradients; DDP and FSDP hold no working copy between steps and keep
# float32 gradients; with every stage the activations shrink.

# %%
def memory_figure(results, weights, kernel="fused"):
    """Stacked bars per rank: bf16 working weights, fp32 master weights, gradients, optimizer
    state (measured model state) and peak activations under ``kernel``, for every stage x
    precision x recomputation policy; a black tick marks the formula's total."""
    state = {(r["stage"], r["precision"]): r for r in results["state"]}
    acts = {(r["precision"], r["policy"]): r for r in results["activations"] if r["kernel"] == kernel}
    mib = 1 / (1 << 20)
    colors = {"bf16 working weights": "#8fb3e0", "fp32 master weights": "#2f5d9a", "gradients": "#dd8452",
              "optimizer state": "#55a868", "activations": "#c44e52"}
    fig, axes = plt.subplots(1, len(bench_memory.PRECISIONS), figsize=(12, 4.2), layout="constrained", sharey=True)
    for ax, precision in zip(axes, bench_memory.PRECISIONS):
        labels, x = [], 0
        for stage in bench_memory.STAGES:
            name = bench_memory.STAGE_NAMES[stage]
            s = state[(name, precision)]
            working = weights[name]["working"] if precision == "bf16" else 0
            parts = {"bf16 working weights": working, "fp32 master weights": s["params"] - working,
                     "gradients": s["grads"], "optimizer state": s["optimizer"]}
            for policy in bench_memory.POLICIES:
                a = acts[(precision, policy)]
                bottom = 0.0
                for key, nbytes in parts.items():
                    ax.bar(x, nbytes * mib, bottom=bottom, color=colors[key], width=0.8)
                    bottom += nbytes * mib
                ax.bar(x, a["peak"] * mib, bottom=bottom, color=colors["activations"], width=0.8,
                       alpha={"none": 1.0, "selective": 0.7, "full": 0.4}[policy])
                ax.plot([x - 0.4, x + 0.4], [(s["formula"] + a["peak_formula"]) * mib] * 2, color="k", lw=1.5)
                labels.append({"none": "none", "selective": "sel.", "full": "full"}[policy])
                x += 1
            ax.text(x - 2, -0.11, name, transform=ax.get_xaxis_transform(), ha="center", fontsize=9)
            x += 0.5
        ax.set_xticks([i + (i // 3) * 0.5 for i in range(len(labels))], labels, fontsize=7)
        ax.set_title(f"{precision}: GPT {results['preset']}, {results['parameters'] / 1e6:.1f} M parameters, world "
                     f"{results['world_size']}, batch {results['batch_size']}x{results['sequence']}, {kernel} attention",
                     fontsize=9)
        ax.set_ylabel("MiB per rank")
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colors.values()]
    handles += [plt.Rectangle((0, 0), 1, 1, color=colors["activations"], alpha=al) for al in (0.7, 0.4)]
    handles.append(plt.Line2D([], [], color="k", lw=1.5))
    axes[-1].legend(handles, [*list(colors)[:-1], "activations (none)", "activations (selective)",
                              "activations (full)", "formula"], fontsize=7, loc="upper right")
    return fig


fig = memory_figure(results, weights)

# %% [markdown]
# ## 5. PyTorch's counterpart: `torch.autocast` and `torch.amp.GradScaler`
#
# In one process PyTorch does mixed precision per operator: the model and the optimizer stay
# float32 (those weights are the masters), and inside `torch.autocast(device, dtype)` each
# matrix product casts its inputs to the 16-bit `dtype` (losses and reductions stay float32).
# Whether the loss needs scaling depends on the 16-bit format's exponent:
#
# * **bfloat16** has float32's 8 exponent bits (the same range, down to about `1e-38`) and
#   fewer mantissa bits: it rounds more coarsely, but a small gradient does not underflow, so
#   it needs no loss scaling (a `GradScaler` would only multiply and divide by a power of 2).
# * **float16** has 5 exponent bits: numbers below about `6e-5` lose precision and below `6e-8`
#   flush to zero, and above `65504` overflow. `GradScaler` multiplies the loss by a scale `S`
#   (`2^16` to start), so the gradients are `S` times larger through backward; `step` divides the
#   float32 gradients by `S` and skips the update if any is inf or nan; `update` halves `S`
#   after a skip and doubles it after 2000 good steps.
#
# The cell trains the `tiny` GPT preset (float16 matrix products are slow on most CPUs, which
# have no half-precision arithmetic) on tiny Shakespeare for a few AdamW steps three ways from
# the same start: float32, bfloat16 autocast, float16 autocast with `GradScaler`. It also casts
# the first step's float32 gradients to each format, as a proxy for what backward in 16 bits
# would lose.

# %%
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    fi = torch.finfo(dtype)
    mantissa = round(-math.log2(fi.eps))
    print(f"{str(dtype):15s} exponent bits {fi.bits - 1 - mantissa}, mantissa bits {mantissa:2d}, "
          f"smallest normal {fi.smallest_normal:.1e}, largest {fi.max:.1e}, eps {fi.eps:.1e}")

# %%
# NBVAL_IGNORE_OUTPUT
AMP_STEPS = 3 if SMOKE else 8
AMP_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
amp_config = GPTConfig.preset("tiny")
torch.manual_seed(0)
amp_start = GPT(amp_config)


def train_autocast(dtype, scaler=None, steps=AMP_STEPS, batch_size=4):
    """``steps`` AdamW steps of a copy of ``amp_start``, forward under ``torch.autocast(dtype)`` (none
    for float32) and, with ``scaler``, the loss scaled: (loss per step, steps the scaler skipped)."""
    model = copy.deepcopy(amp_start)
    opt = torch.optim.AdamW(model.parameters(), **bench_memory.ADAMW)
    losses, skipped = [], []
    for step in range(steps):
        x, y = get_batch("train", batch_size, amp_config.block_size, step=step)
        with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
            loss = model(x, y)[1]
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scale = scaler.get_scale()
            scaler.scale(loss).backward()
            scaler.step(opt)        # unscale the float32 gradients; skip the update on inf/nan
            scaler.update()         # halve the scale after a skip
            if scaler.get_scale() < scale:
                skipped.append(step)
        opt.zero_grad()
        losses.append(loss.item())
    return losses, skipped


scaler = torch.amp.GradScaler("cpu")
amp = {"fp32": train_autocast(torch.float32), "bf16": train_autocast(torch.bfloat16),
       "fp16": train_autocast(torch.float16, scaler)}
gap = {k: max(abs(a - b) / b for a, b in zip(amp[k][0], amp["fp32"][0])) for k in ("bf16", "fp16")}

# the first step's float32 gradients, cast: which nonzero entries would a 16-bit format flush to zero?
model = copy.deepcopy(amp_start)
model(*get_batch("train", 4, amp_config.block_size, step=0))[1].backward()
grad = torch.cat([p.grad.flatten() for p in model.parameters()])
nonzero = grad != 0
flushed = {"bf16": grad.bfloat16(), "fp16": grad.half(), "fp16 x S": (grad * scaler.get_scale()).half()}
flushed = {k: ((v == 0) & nonzero).sum().item() / nonzero.sum().item() for k, v in flushed.items()}

fig, (ax_loss, ax_gap) = plt.subplots(1, 2, figsize=(11, 3.6), layout="constrained")
amp_colors = {"fp32": "k", "bf16": "#4c72b0", "fp16": "#dd8452"}
for k, (losses, _) in amp.items():
    ax_loss.plot(range(AMP_STEPS), losses, marker="o", ms=3, color=amp_colors[k], lw=2.5 if k == "fp32" else 1,
                 label=k + (" + GradScaler" if k == "fp16" else ""))
    if k != "fp32":
        rel = [abs(a - b) / b for a, b in zip(losses, amp["fp32"][0])]
        ax_gap.plot(range(AMP_STEPS), rel, marker="o", ms=3, color=amp_colors[k], label=f"{k} vs fp32")
        ax_gap.axhline(torch.finfo(AMP_DTYPES[k]).eps, color=amp_colors[k], ls="--", lw=1, label=f"{k} eps (the bound)")
ax_loss.set(xlabel="step", ylabel="training loss", title="GPT tiny, AdamW: the three curves overlap")
ax_gap.set(xlabel="step", ylabel="|loss - fp32 loss| / fp32 loss", title="gap to float32 (equal steps not drawn)")
ax_gap.set_yscale("log", nonpositive="mask")
ax_gap.set_ylim(1e-7, 0.05)
ax_loss.legend(fontsize=8)
ax_gap.legend(fontsize=8, loc="lower right")
plt.show()
display(Markdown(
    f"Over {AMP_STEPS} steps the bfloat16 loss stays within {gap['bf16']:.1e} of float32's (relative) and the "
    f"float16 one within {gap['fp16']:.1e}; the scaler skipped {len(amp['fp16'][1])} step(s) and ends at "
    f"S = {scaler.get_scale():g}. Cast to float16, {flushed['fp16']:.2%} of the first step's nonzero gradient "
    f"entries flush to zero, {flushed['fp16 x S']:.3%} after scaling by S; bfloat16 flushes {flushed['bf16']:.0%}."))

# %% [markdown]
# At this size and for this many steps the loss curves cannot tell the formats apart, and the
# scaler has nothing to rescue: what the scale buys shows in the gradients themselves, where
# float16 without it flushes the smallest entries to zero and bfloat16 flushes none. Over long
# runs those lost updates (and, without a scaler's skips, an overflow's inf) are what make
# unscaled float16 training drift or diverge. bfloat16 is the usual choice where the hardware
# has it; its coarser rounding is why the masters and Adam's moments stay float32.
#
# ## Check
#
# * model state within [1.00, 1.05] of the ZeRO formulas for every stage, float32 and
#   bfloat16; bfloat16 sends exactly half the bytes of float32;
# * the bfloat16 weights split exactly into working copies and masters (their sum is the
#   table's `params`);
# * activations kept at the end of forward within [1.00, 1.10] of the derived formula, and
#   the peak too, for every precision, kernel and policy;
# * full recomputation keeps less than a fifth of none's activations;
# * PyTorch's autocast: the bfloat16 loss and the float16 loss (with `GradScaler`, no step
#   skipped) stay within one `eps` of their format (relative) of float32's at every step; cast
#   to float16 some nonzero gradients flush to zero, fewer after scaling, none in bfloat16.

# %%
for r in results["state"]:
    assert 1.0 <= r["ratio"] <= 1.05, r
    if r["precision"] in ("fp32", "bf16"):
        assert r["wire_vs_fp32"] == (0.5 if r["precision"] == "bf16" else 1.0), r
for stage, w in weights.items():
    assert w["working"] + w["master"] == state[(stage, "bf16")]["params"], (stage, w)
for r in results["activations"]:
    assert 1.0 <= r["kept_ratio"] <= 1.10 and 1.0 <= r["peak_ratio"] <= 1.10, r
assert acts[("fp32", "fused", "full")]["kept"] < 0.2 * acts[("fp32", "fused", "none")]["kept"]
for k in ("bf16", "fp16"):
    assert gap[k] <= torch.finfo(AMP_DTYPES[k]).eps, (k, gap[k], amp[k][0], amp["fp32"][0])
assert amp["fp16"][1] == [], f"GradScaler skipped steps {amp['fp16'][1]}"
assert flushed["bf16"] == 0 and flushed["fp16 x S"] < flushed["fp16"], flushed
print("check passed: model state and activations match their formulas; bf16 halves the wire bytes; "
      "autocast bf16 and fp16 + GradScaler track fp32's loss")
