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
#   DDP, ZeRO-1/2 and FSDP. The ZeRO paper counts `2 + 2 + K` bytes per parameter (16-bit
#   weight, 16-bit gradient, `K = 12` of float32 master and Adam moments): still `16 psi` for
#   DDP, but ZeRO-1 becomes `4 psi + 12 psi/N` and ZeRO-2 `2 psi + 14 psi/N`. Every byte on
#   the wire is a 16-bit byte: half of float32's.
# * **Activation recomputation.** `recompute(model, "full")` keeps only each block's input and
#   re-runs the block in backward (one extra forward); `recompute(model, "selective")` recomputes
#   only the attention core (Korthikanti et al. 2022), whose scores grow as `a s^2` per sequence.
# * **Sharding** (lesson 04): ZeRO-1, 2, 3 divide the `K` bytes, the gradients, the weights by `N`.
#
# Everything below comes from one run of `workbench bench memory` inside two ranks: GPT
# `small` (3.2 M parameters), AdamW, a micro-batch of 2 sequences of 128 tokens per rank.

# %%
import torch
from IPython.display import Markdown, display

import workbench
from workbench.bench import memory as bench_memory
from workbench.metrics import format_bytes

results = workbench.launch(bench_memory.run, world_size=2, args=("small", 2, 1 if workbench.smoke_test() else 3, 1),
                          timeout=600)[0]  # the test suite's quick run (smoke test) takes one trial
psi, n = results["parameters"], results["world_size"]
print(f"psi = {psi:,} parameters, N = {n} ranks")

# %% [markdown]
# ## 1. Model state per rank, float32 and bfloat16, against the formulas
#
# `model_state_bytes(model, optimizer)` counts every storage a rank holds for the model once:
# 16-bit parameters and gradients, float32 master weights (wherever they live: the module, or
# the optimizer's own parameter list for ZeRO-1/2), Adam's moments, and buffers a strategy holds
# outside `.grad` (DDP's buckets, ZeRO-2's reduced gradient shard). Measured after the third
# step's backward and update.

# %%
print("stage   precision   params     grads  optimizer     total   formula  measured/formula  wire/fp32")
for r in results["state"]:
    print(f"{r['stage']:6s}  {r['precision']:9s} {format_bytes(r['params']):>9s} {format_bytes(r['grads']):>9s} "
          f"{format_bytes(r['optimizer']):>10s} {format_bytes(r['total']):>9s} {format_bytes(r['formula']):>9s}"
          f"  {r['ratio']:16.4f}  {r['wire_vs_fp32']:9.3f}")

# %% [markdown]
# Where the bytes sit is worth a look. DDP keeps float32 masters and float32 gradients between
# steps (its 16-bit copies exist only during forward and backward, as in PyTorch's DDP), so
# mixed precision saves it nothing in model state: `4 + 4 + 8 = 16 psi` either way. ZeRO-1 and
# ZeRO-2 turn the module's weights into bfloat16 views of flat buffers and keep the float32
# masters only for their own shard, which is where the paper's `2 + 2 + 12/N` comes from.
# FSDP shards everything, masters included: `16 psi / N` in either precision. What mixed
# precision always halves is the traffic (last column) and, next, the activations. The last
# row reduces ZeRO-2's bfloat16 gradients in float32 (`reduce_dtype=torch.float32`, no rounding
# at each hop of the sum): its gradient shard is `4 psi / N`, the formula `2 psi + 16 psi / N`.
#
# float16 instead of bfloat16 needs a loss scaler (its smallest normal number is `6e-5`):
# `DynamicLossScaler` multiplies the loss, unscales the float32 gradients, and skips the step
# on every rank if any rank's gradient shard overflowed (the check is all-reduced), exactly as
# `torch.amp.GradScaler` does in one process.
#
# ## 2. Activations: none, selective, full; fused and math attention
#
# The derivation is in `workbench.parallel.recompute`'s docstring. Per layer, in float32, with
# `s` tokens, `b` sequences, `h` width, `a` heads: the fused attention kernel keeps
# `16 sbh + 4 sb + a s b` elements; the math kernel `16 sbh + 4 sb + a s^2 b` (it stores the
# softmax, the paper's `5 a s / h` term); selective recomputation leaves `16 sbh + 4 sb` with
# either kernel; full leaves `sbh`. In bfloat16 every term halves except what the kernels keep
# in float32 (the fused kernel's log-sum-exp; the math kernel computes in float32).

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
# sequences where `a s / h` dominates, it removes the largest term at the cost of recomputing
# one matrix product per layer.
#
# ## 3. The price of recomputation
#
# Step time (forward, backward, update) of each policy against none, float32, fused kernel,
# interleaved trials, the slowest rank's median. Full recomputation runs every block's forward
# twice, about a third more compute.

# %%
# NBVAL_IGNORE_OUTPUT
import os

load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
for r in results["time"]:
    print(f"{r['policy']:9s} {r['step_ms']:7.1f} ms  {r['vs_none']:.2f}x none")
print(f"(load average {load:.1f} while this ran)")

# %% [markdown]
# ## 4. All of it in one figure
#
# Per rank, for every stage and precision, with each recomputation policy: model state split
# into parameters, gradients and optimizer state, with the peak activations stacked on top; the
# black tick is the formula (model-state formula plus activation formula).

# %%
fig = bench_memory.figure(results)

# %% [markdown]
# ## Check
#
# * model state within [1.00, 1.05] of the ZeRO formulas for every stage, float32 and
#   bfloat16; bfloat16 sends exactly half the bytes of float32;
# * activations kept at the end of forward within [1.00, 1.10] of the derived formula, and
#   the peak too, for every precision, kernel and policy;
# * full recomputation keeps less than a fifth of none's activations.

# %%
for r in results["state"]:
    assert 1.0 <= r["ratio"] <= 1.05, r
    if r["precision"] in ("fp32", "bf16"):
        assert r["wire_vs_fp32"] == (0.5 if r["precision"] == "bf16" else 1.0), r
for r in results["activations"]:
    assert 1.0 <= r["kept_ratio"] <= 1.10 and 1.0 <= r["peak_ratio"] <= 1.10, r
assert acts[("fp32", "fused", "full")]["kept"] < 0.2 * acts[("fp32", "fused", "none")]["kept"]
print("check passed: model state and activations match their formulas; bf16 halves the wire bytes")
