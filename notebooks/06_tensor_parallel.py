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
# # 06 · Tensor parallelism: one layer split over several ranks
#
# Data parallelism (lessons 02-04) copies the whole model to every rank and splits the batch.
# Tensor parallelism (Megatron-LM, Shoeybi et al. 2019) splits every *layer*: each of the `t`
# ranks holds `1/t` of each weight matrix and computes `1/t` of each matrix product, on the
# *same* batch. The trick is in how two linear layers are cut:
#
# * **column-parallel** `Y = X A`, `A = [A_1 A_2]` split by columns: rank `r` computes
#   `Y_r = X A_r`, a slice of the output. Nothing to add up, and an element-wise function
#   (GELU) can be applied to the slice.
# * **row-parallel** `Z = Y B`, `B = [B_1; B_2]` split by rows: rank `r` multiplies *its* slice
#   `Y_r` by its rows `B_r`; the partial products are summed: `Z = Y_1 B_1 + Y_2 B_2`, one
#   all-reduce.
#
# Column then row: the slice the first layer leaves is exactly the input the second needs, so a
# whole MLP costs one all-reduce forward. Everything below uses `workbench.parallel.tensor`.

# %%
import copy
import os

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.nn.functional as F
from IPython.display import Markdown, display
from matplotlib.patches import Rectangle
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import workbench
from workbench import everyone
from workbench import comm
from workbench.apps.bench import tensor as bench_tensor
from workbench.measure.metrics import MemoryMeter
from workbench.models import GPT, GPTConfig
from workbench.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, activation_bytes_per_layer,
                                       communication_per_layer, full_state_dict, tensor_parallel)
from workbench.apps.train import preload

KiB = 1024
# the first optimizer or DTensor of a process imports torch._dynamo (slow): do it once here, and
# every rank launch() forks below inherits it instead of importing it again
preload()


# %%
def draw_split(ax):
    """X (replicated) x [A_1 A_2] -> [Y_1 Y_2] -> x [B_1; B_2] -> partial Z_r -> all-reduce."""
    colors = ["#4c72b0", "#dd8452"]

    def box(x, y, w, h, color, text, alpha=0.35):
        ax.add_patch(Rectangle((x, y), w, h, facecolor=color, edgecolor="k", alpha=alpha))
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=10)

    box(0, 1, 1, 2, "#999999", "X")
    ax.text(1.25, 2, "x", fontsize=12, va="center")
    for r in range(2):
        box(1.6 + 0.8 * r, 1, 0.8, 2, colors[r], f"A$_{r + 1}$")
    ax.text(3.3, 2, "=", fontsize=12, va="center")
    for r in range(2):
        box(3.6 + 0.8 * r, 1, 0.8, 2, colors[r], f"Y$_{r + 1}$")
    ax.text(5.3, 2, "x", fontsize=12, va="center")
    for r in range(2):
        box(5.6, 2 - r, 1.6, 1, colors[r], f"B$_{r + 1}$")
    ax.text(7.5, 2, "=", fontsize=12, va="center")
    for r in range(2):
        box(7.8, 2.2 - 1.4 * r, 1.2, 1, colors[r], f"Y$_{r + 1}$B$_{r + 1}$")
    ax.annotate("", (10.3, 2), (9.1, 2), arrowprops=dict(arrowstyle="->"))
    ax.text(9.7, 2.25, "all-reduce\n(g)", ha="center", fontsize=9)
    box(10.4, 1.5, 1.2, 1, "#55a868", "Z")
    ax.text(0.5, 0.6, "f: copy\n(all-reduce dX\nin backward)", ha="center", fontsize=8, va="top")
    ax.text(2.4, 0.6, "column-parallel\n(rank 1 | rank 2)", ha="center", fontsize=8, va="top")
    ax.text(6.4, 0.6, "row-parallel", ha="center", fontsize=8, va="top")
    ax.set_xlim(-0.2, 11.8)
    ax.set_ylim(-0.6, 3.5)
    ax.axis("off")


fig, ax = plt.subplots(figsize=(10, 3), layout="constrained")
draw_split(ax)
_ = ax.set_title("a column-parallel layer, then a row-parallel one: one all-reduce (t = 2, ranks in colour)")

# %% [markdown]
# ## 1. f and g, and checking a layer against one device
#
# Megatron names the two communication points `f` and `g`, each the identity one way and an
# all-reduce the other (they are *conjugate*):
#
# | operator | forward | backward | where |
# | --- | --- | --- | --- |
# | `f` (`copy_to_parallel`) | identity: every rank uses the whole `X` | all-reduce `dX` | before a column-parallel layer |
# | `g` (`reduce_from_parallel`) | all-reduce the partial `Z_r` | identity | after a row-parallel layer |
#
# `f` needs an all-reduce in backward because every rank used the whole `X` with *its* columns:
# `dX = sum_r dY_r A_r^T`. So an MLP (or attention) block costs one all-reduce forward (`g`)
# and one backward (`f`); a transformer layer has two blocks: **two all-reduces forward and two
# backward**, each of `b s h` elements (batch x sequence x hidden).
#
# **How to check a tensor-parallel layer against one device**: build the ordinary layers with a
# seed, slice them with `from_linear` on every rank, run the same input, and compare the output
# and the *input's* gradient (which `f` all-reduces) with the single-device ones. Every rank
# must get the full answer.

# %%
def check_mlp():
    torch.manual_seed(0)
    fc, proj = nn.Linear(16, 64), nn.Linear(64, 16)
    x = torch.randn(4, 8, 16, requires_grad=True)
    z_ref = proj(F.gelu(fc(x)))
    (dx_ref,) = torch.autograd.grad(z_ref.square().sum(), x)
    col, row = ColumnParallelLinear.from_linear(fc), RowParallelLinear.from_linear(proj)
    xi = x.detach().clone().requires_grad_()
    with comm.counters() as c:
        z = row(F.gelu(col(xi)))
        z.square().sum().backward()
    return everyone({"rank": dist.get_rank(), "fc slice": tuple(col.weight.shape), "proj slice": tuple(row.weight.shape),
                     "output diff": (z - z_ref).abs().max().item(), "input grad diff": (xi.grad - dx_ref).abs().max().item(),
                     "all-reduces": c.stats[("all_reduce", "native")].calls})


mlp = workbench.launch(check_mlp, world_size=2)[0]
for r in mlp:
    print(r)

# %% [markdown]
# ## 2. Attention: split by heads
#
# Heads never talk to each other, so attention splits by heads with no message in between:
# rank `r` holds heads `r n_head/t ... (r+1) n_head/t - 1`. `c_attn` is column-parallel, but it is
# one fused `C x 3C` matrix `[q | k | v]`: each rank must take *its heads' slice of each* of q, k
# and v (`from_linear(c_attn, chunks=3)`), not a contiguous third. `c_proj` is row-parallel.
#
# ## 3. The vocabulary-parallel loss: the logits are never gathered
#
# The head `lm_head` is column-parallel over the vocabulary: each rank has the logits of `V/t`
# tokens. Gathering `b s V` logits to compute the loss would cost a large all-gather and the
# full memory; instead `vocab_parallel_cross_entropy` all-reduces two numbers per token: the
# maximum logit (for a stable exponential), then the sum of exponentials together with the
# target's logit (held by one rank, zero on the others): `loss = log sum exp - z_target`.
# The token embedding `wte` is split the same way (each rank looks up the ids it holds, zeros
# for the rest, then an all-reduce), so a tied head shares its slice.
#
# **"Why does my loss differ from one GPU?"** One common cause: a vocabulary that is not
# divisible by `t` (65 characters on 2 or 4 ranks) is padded, and if the padded logits take part
# in the softmax the loss changes. Here the padding rows start at zero and the loss ignores their
# columns, so the loss is exactly the single-device loss:

# %%
def check_gpt():
    """Single process and tensor-parallel (without and with sequence parallelism), 3 AdamW steps."""
    t = dist.get_world_size()
    out = {"t": t}
    g = torch.Generator().manual_seed(1)
    batches = [(torch.randint(0, 65, (4, 32), generator=g), torch.randint(0, 65, (4, 32), generator=g))
               for _ in range(3)]
    for sp in (False, True):
        torch.manual_seed(0)
        ref = GPT(GPTConfig.preset("tiny"))
        model = tensor_parallel(copy.deepcopy(ref), sequence_parallel=sp)
        # eps=1e-5: with Adam's default 1e-8, near-zero gradients turn last-bit differences of
        # summation order into whole steps, and parameters drift apart by ~2e-5 in 3 steps
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, eps=1e-5) for m in (ref, model)]
        losses = []
        for x, y in batches:
            pair = []
            for m, o in zip((ref, model), opts):
                logits, loss = m(x, y)
                loss.backward()
                o.step()
                o.zero_grad()
                pair.append(loss.item())
            losses.append(pair)
        full, single = full_state_dict(model), ref.state_dict()
        out[sp] = {"losses": losses, "param diff": max((full[k] - single[k]).abs().max().item() for k in single),
                   "logits shard": tuple(logits.shape), "vocab rows here": model.wte.weight.shape[0]}
    return out


gpt = workbench.launch(check_gpt, world_size=2)[0]
for sp in (False, True):
    r = gpt[sp]
    print(f"sequence_parallel={sp}: logits on this rank {r['logits shard']} (vocabulary 65 padded to "
          f"{r['vocab rows here'] * gpt['t']}), max |param difference| after 3 steps {r['param diff']:.1e}")
    for step, (single, tp) in enumerate(r["losses"]):
        print(f"   step {step}: single {single:.7f}   tensor-parallel {tp:.7f}   |diff| {abs(single - tp):.1e}")

# %% [markdown]
# ## 4. Sequence parallelism
#
# Between a row-parallel layer and the next column-parallel one sit the layer norm, the dropout
# and the residual add, and under plain tensor parallelism every rank computes them on the whole
# `b s h` tensor: the same work `t` times, and `t` copies of their activations. Korthikanti et al.
# (2022) split them by **sequence**: an all-reduce is a reduce-scatter followed by an all-gather,
# so do the reduce-scatter at the end of the row-parallel layer (each rank keeps `s/t` positions
# of the summed output), run norm, dropout and residual on that shard, and all-gather before the
# next column-parallel layer:
#
# | | forward | backward |
# | --- | --- | --- |
# | tensor parallel | `g` all-reduce | `f` all-reduce |
# | sequence parallel | reduce-scatter (end of row layer), all-gather (start of column layer) | all-gather, reduce-scatter |
#
# **Forward** moves the same bytes: a reduce-scatter plus an all-gather send together what one
# all-reduce sent. **Backward moves more.** In backward a column-parallel layer computes
# `dX = dY A_r^T`, which needs only `dY`, and its weight gradient `dA_r = X^T dY_r`, which needs
# the whole input `X`, every position. Keeping the gathered `X` for backward would cost `b s h`
# per rank and undo the saving, so our column-parallel layer keeps only its *shard* and
# all-gathers it **again** in backward: Megatron's choice (Korthikanti et al. 2022, sec.
# 4.2.2; Megatron overlaps that all-gather with computing `dX`, ours runs them one after the
# other). One more all-gather per column-parallel layer, two per transformer layer, buys the
# `1/t` activation memory. And the norms' parameters (and the row-parallel biases) now see `1/t` of the
# positions each, so their gradients are all-reduced (small: `h` each). Section 5 counts it all.
#
# ## 5. Communication per layer, measured against the formula
#
# `comm.counters()` around one transformer block's forward and its backward, against
# `communication_per_layer` (every call's size; native collectives are counted with the bytes a
# bandwidth-optimal ring moves per rank: `2 (t-1)/t n` for an all-reduce, `(t-1)/t n` for an
# all-gather or a reduce-scatter).

# %%
def layer_comm():
    t = dist.get_world_size()
    out = {}
    b, s = 4, 32
    for sp in (False, True):
        torch.manual_seed(0)
        model = tensor_parallel(GPT(GPTConfig.preset("tiny")), sequence_parallel=sp)
        h = model.config.n_embd
        x = torch.randn(b, s // t if sp else s, h, requires_grad=True)
        with comm.counters() as fwd:
            y = model.blocks[0](x)
        with comm.counters() as bwd:
            y.backward(torch.ones_like(y))
        expected = {}
        for phase, calls in communication_per_layer(b, s, h, sp).items():
            for coll, sizes in calls.items():
                f = 2 * (t - 1) / t if coll == "all_reduce" else (t - 1) / t
                expected[(phase, coll)] = (len(sizes), sum(int(4 * n * f) for n in sizes))
        measured = {(phase, key.split("/")[0]): (v["calls"], v["bytes_sent"])
                    for phase, c in (("forward", fwd), ("backward", bwd)) for key, v in c.as_dict().items()}
        out[sp] = {"measured": measured, "expected": expected, "bsh": b * s * h, "b": b, "s": s}
    return out


comm_rows = workbench.launch(layer_comm, world_size=2)[0]
COLLECTIVE = {"all_reduce": "all-reduce", "all_gather": "all-gather", "reduce_scatter": "reduce-scatter"}
fig, axes = plt.subplots(1, 2, figsize=(11, 3.8), layout="constrained", sharey=True, width_ratios=[2, 5])
for ax, sp in zip(axes, (False, True)):
    r = comm_rows[sp]
    keys = sorted(r["expected"], key=lambda k: (k[0] != "forward", k[1]))
    measured = [r["measured"].get(k, (0, 0))[1] / KiB for k in keys]
    bars = ax.bar([i - 0.2 for i in range(len(keys))], measured, 0.4, label="measured (comm.counters)")
    ax.bar([i + 0.2 for i in range(len(keys))], [r["expected"][k][1] / KiB for k in keys], 0.4,
           label="formula (communication_per_layer)", color="#999999")
    ax.bar_label(bars, [f"{v:g}" for v in measured], fontsize=8)
    ax.set_xticks(range(len(keys)), [f"{'forward' if ph == 'forward' else 'backward'}\n{COLLECTIVE[coll]}\n"
                                     f"{r['measured'].get((ph, coll), (0, 0))[0]} calls" for ph, coll in keys],
                  fontsize=8)
    ax.set_xlim(-0.6, len(keys) - 0.4)
    ax.set_title(f"{'with' if sp else 'without'} sequence parallelism", fontsize=10)
axes[0].set_yscale("log", base=2)  # shared: the 1.5 KiB of small all-reduces beside the 64 KiB ones
axes[0].set_yticks([2**k for k in range(7)], [f"{2**k}" for k in range(7)])
axes[0].minorticks_off()
axes[0].set_ylim(1, 128)
axes[0].set_ylabel("KiB sent per rank (log scale)")
fig.suptitle("one transformer layer's collectives, t = 2 (bar labels: measured KiB)", fontsize=11)
fig.legend(*axes[0].get_legend_handles_labels(), loc="outside lower center", ncols=2, fontsize=8)
for sp in (False, True):
    r = comm_rows[sp]
    print(f"sequence_parallel={sp}: " + ", ".join(
        f"{ph} {coll}: {calls} calls, {sent} B" for (ph, coll), (calls, sent) in sorted(r["measured"].items())))
# bytes and calls per phase, with and without sequence parallelism
sent = {(sp, ph): sum(v[1] for (p, _), v in comm_rows[sp]["measured"].items() if p == ph)
        for sp in (False, True) for ph in ("forward", "backward")}
calls = {sp: sum(v[0] for v in comm_rows[sp]["measured"].values()) for sp in (False, True)}
b_comm, s_comm = comm_rows[False]["b"], comm_rows[False]["s"]
backward_ratio = sent[(True, "backward")] / sent[(False, "backward")]
display(Markdown(
    f"Bytes one rank sends for one layer: forward **{sent[(False, 'forward')]}** without sequence parallelism "
    f"and **{sent[(True, 'forward')]}** with it; backward **{sent[(False, 'backward')]}** and "
    f"**{sent[(True, 'backward')]}**, **{backward_ratio:.4f}x** (the formula below, `3/2 + 3/(b s)` with "
    f"b = {b_comm}, s = {s_comm}: **{1.5 + 3 / (b_comm * s_comm):.4f}**). Collective calls per layer: "
    f"**{calls[False]}** without, **{calls[True]}** with."))

# %% [markdown]
# Without sequence parallelism: two all-reduces forward (after `attn.c_proj` and `mlp.c_proj`, the
# `g`s) and two backward (before `attn.c_attn` and `mlp.c_fc`, the `f`s), each of `b s h`
# elements. With it, forward sends the same bytes as all-gathers and reduce-scatters; backward
# sends more. Counting the elements one rank sends (ring collectives, `n = b s h`):
#
# | backward, one layer | collectives | elements sent per rank |
# | --- | --- | --- |
# | tensor parallel | 2 all-reduces (`f`) | `2 x 2 (t-1)/t n = 4 (t-1)/t n` |
# | sequence parallel | 2 all-gathers of `dY`, 2 reduce-scatters of `dX` (forward's conjugates), 2 re-gathers of inputs | `6 (t-1)/t n` |
# | | 6 all-reduces of `h` (2 norms' weights and biases, 2 row-parallel biases) | `6 x 2 (t-1)/t h` |
#
# The ratio is `(6 n + 12 h) / (4 n) = 3/2 + 3/(b s)`, whatever `t`: the two re-gathers are the
# extra half, the small all-reduces the rest, and that is what the measurement above shows.
# Korthikanti et al.'s same volume is that of the collectives replacing the all-reduces; the
# re-gathers come on top, the price of not keeping the gathered input, and Megatron overlaps
# them with computation rather than avoiding them.
#
# ## 6. Activation memory per rank
#
# Korthikanti et al. count what one layer keeps for backward, in 16-bit activations with 1-byte
# dropout masks: `s b h (10 + 24/t + 5 a s/(h t))` with tensor parallelism and
# `s b h/t (34 + 5 a s/h)` with sequence parallelism too. For this model in float32, without
# dropout, and with PyTorch's fused attention (which keeps one log-sum-exp per row instead of the
# `a s^2 b` scores), the same count gives `4 (s b h (4 + 12/t) + a s b/t + 4 s b)` bytes and
# `4 (16 s b h + a s b + 4 s b)/t` (derived in `activation_bytes_per_layer`'s docstring). Measured
# with `MemoryMeter`: the activation bytes still alive when forward ends (what backward will
# need; the step's peak is reached right there, plus the loss's temporaries), for a 6-layer
# model minus a 2-layer one, divided by 4: what one layer keeps, at t = 1, 2 and 4.

# %%
# NBVAL_IGNORE_OUTPUT
# (ignored by nbval: the bytes can move by a few hundred per layer between runs, when gloo's thread
# lets go of a finished collective's buffer a moment late; the check cell asserts the band)
B_MEM, S_MEM = 4, 64


def layer_activation_bytes(sp, layers):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=layers, block_size=S_MEM))
    if dist.is_initialized() and dist.get_world_size() > 1:
        model = tensor_parallel(model, sequence_parallel=sp)
    x = torch.randint(0, 65, (B_MEM, S_MEM), generator=torch.Generator().manual_seed(0))
    with MemoryMeter(model, device="cpu") as meter:
        loss = model(x, x)[1]
        kept = meter.current_by_category["activations"]  # what forward left alive for backward
        loss.backward()
    return kept


def memory_rows():
    t = dist.get_world_size() if dist.is_initialized() else 1
    cfg = GPTConfig.preset("tiny")
    rows = []
    for sp in ((False, True) if t > 1 else (False,)):
        per_layer = (layer_activation_bytes(sp, 6) - layer_activation_bytes(sp, 2)) / 4
        rows.append({"t": t, "sp": sp, "measured": per_layer,
                     "formula": activation_bytes_per_layer(B_MEM, S_MEM, cfg.n_embd, cfg.n_head, t, sp)})
    return rows


mem = {(r["t"], r["sp"]): r for r in memory_rows()}  # t = 1: this process (under torchrun: its world)
if not dist.is_initialized():  # under torchrun every launch() runs in torchrun's world: measured above
    for n in (2, 4):
        for r in workbench.launch(memory_rows, world_size=n)[0]:
            mem[(r["t"], r["sp"])] = r
for (t, sp), r in sorted(mem.items()):
    print(f"t={t} sequence_parallel={sp!s:5}: {r['measured'] / KiB:7.1f} KiB per layer, formula "
          f"{r['formula'] / KiB:7.1f} KiB, ratio {r['measured'] / r['formula']:.3f}")
fig, ax = plt.subplots(figsize=(7, 3.5), layout="constrained")
ts = sorted({t for t, _ in mem})
for i, sp in enumerate((False, True)):
    sel = [mem.get((t, sp if t > 1 else False)) for t in ts]
    xs = [j + 0.38 * i for j in range(len(ts))]
    ax.bar(xs, [r["measured"] / KiB for r in sel], 0.36, label=f"measured, {'SP' if sp else 'TP only'}")
    ax.scatter(xs, [r["formula"] / KiB for r in sel], marker="_", s=500, color="k", zorder=3,
               label="formula" if i == 0 else None)
ax.set_xticks([j + 0.19 for j in range(len(ts))], [f"t = {t}" for t in ts])
ax.set_ylabel("KiB of activations per layer per rank")
ax.set_title(f"GPT tiny, b={B_MEM}, s={S_MEM}: activations per layer per rank")
_ = ax.legend(fontsize=8)

# %% [markdown]
# Tensor parallelism alone leaves the `4 s b h` of the norms' inputs and outputs on every rank
# (the floor the blue bars approach as `t` grows, dotted below); sequence parallelism divides
# everything by `t`. Move the sliders to see the formula at other sizes; the figure under them is
# the default, a GPT-2-XL-like layer (`h` = 1600, 25 heads, `s` = 1024, `b` = 8): the `a s b/t`
# log-sum-exp term is small next to `s b h`, which is why fused attention removed the `5 a s/h`
# term that dominated Korthikanti's count at long sequences.

# %%
import ipywidgets as widgets  # noqa: E402


def draw_formula(h=1600, heads=25, s=1024, b=8):
    ts = [1, 2, 4, 8]
    tp = [activation_bytes_per_layer(b, s, h, heads, t, False) / 2**20 for t in ts]
    sp = [activation_bytes_per_layer(b, s, h, heads, t, True) / 2**20 for t in ts]
    fig, ax = plt.subplots(figsize=(6.5, 3.2), layout="constrained")
    ax.bar([i - 0.2 for i in range(len(ts))], tp, 0.4, label="tensor parallel")
    ax.bar([i + 0.2 for i in range(len(ts))], sp, 0.4, label="+ sequence parallel")
    ax.axhline(4 * 4 * s * b * h / 2**20, color="k", ls=":", lw=0.8,
               label="floor of tensor parallelism alone: 4 s b h floats")
    ax.set_xticks(range(len(ts)), [f"t = {t}" for t in ts])
    ax.set_ylabel("MiB per layer per rank (formula)")
    ax.set_title(f"float32 activations kept per layer: h={h}, a={heads}, s={s}, b={b}")
    ax.legend(fontsize=8)
    plt.show()


sliders = {"h": widgets.IntSlider(1600, 200, 8192, 200, description="h"),
           "heads": widgets.IntSlider(25, 1, 64, description="heads"),
           "s": widgets.IntSlider(1024, 128, 8192, 128, description="s"),
           "b": widgets.IntSlider(8, 1, 64, description="b")}
formula_area = widgets.Output()


def redraw_formula(change=None):
    with formula_area:
        formula_area.clear_output(wait=True)
        draw_formula(**{name: slider.value for name, slider in sliders.items()})


for slider in sliders.values():
    slider.observe(redraw_formula, names="value")
display(widgets.VBox([widgets.HBox(list(sliders.values())[:2]), widgets.HBox(list(sliders.values())[2:]),
                      formula_area]))
draw_formula()  # the default state, stored with the notebook; moving a slider redraws above

# %% [markdown]
# ## 7. PyTorch's counterpart: `parallelize_module`
#
# PyTorch writes the same split as a *plan*, a dict from submodule names to styles, applied by
# `torch.distributed.tensor.parallel.parallelize_module(module, mesh, plan)`. `ColwiseParallel`
# is our column-parallel layer: it shards `nn.Linear`'s `out x in` weight by rows (`Shard(0)`),
# takes a replicated input and leaves its output sharded on the last dimension. `RowwiseParallel`
# is our row-parallel layer: weight sharded by columns (`Shard(1)`), input sharded, output
# all-reduced into a replicated tensor (`g`). The parameters become DTensors, and DTensor issues
# the messages: `g` after the row-parallel layer, and `f` (the input gradient's all-reduce) in
# backward. On section 1's MLP, the whole plan is one line (below).
#
# Attention takes the same two styles (`attn.c_attn` column-wise, `attn.c_proj` row-wise) plus
# two preparations that are not DTensor's to decide: the fused `[q | k | v]` rows are reordered
# rank-major so that a contiguous block holds one rank's heads of each, and the attention must
# run on `n_head/t` local heads. `bench_tensor.torch_tensor_parallel` does both and builds the
# plan for a whole GPT; with `sequence_parallel=True` it adds `SequenceParallel` norms,
# `PrepareModuleInput` to all-gather each block's input, and `RowwiseParallel(output_layouts=Shard(1))`
# for the reduce-scatter. Below, one transformer block (attention and MLP) of PyTorch's and of
# ours get the same input and the same upstream gradient; we compare the output, the input's
# gradient and every parameter's gradient (this rank's shard; a DTensor gradient left `Partial`,
# a sum not yet taken, is summed first), each as the largest difference over the largest value.

# %%
class MLP(nn.Module):
    """Section 1's MLP as a module, so that a plan can name its layers."""

    def __init__(self, c_fc: nn.Module, c_proj: nn.Module):
        super().__init__()
        self.c_fc, self.c_proj = c_fc, c_proj

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


def local(tensor):
    """A plain tensor: this rank's shard of a DTensor, its sum over ranks if it is still Partial."""
    if not hasattr(tensor, "placements"):
        return tensor
    return tensor.full_tensor() if any(p.is_partial() for p in tensor.placements) else tensor.to_local()


def forward_backward(module, x, dy):
    x = x.detach().clone().requires_grad_()
    y = local(module(x))
    y.backward(dy)
    return {"output": y, "input grad": x.grad, **{n: local(p.grad) for n, p in module.named_parameters()}}


def relative_differences(ours, theirs):
    """{what: max |ours - theirs| / max |theirs|}, over the output, the input grad and each parameter grad."""
    assert sorted(ours) == sorted(theirs), (sorted(ours), sorted(theirs))
    return {k: ((ours[k] - theirs[k]).abs().max() / theirs[k].abs().max().clamp_min(1e-30)).item() for k in ours}


def against_dtensor():
    t, r = dist.get_world_size(), dist.get_rank()
    mesh = init_device_mesh("cpu", (t,))
    out = {}
    torch.manual_seed(0)  # section 1's MLP, input and an upstream gradient
    fc, proj = nn.Linear(16, 64), nn.Linear(64, 16)
    x, dy = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    ours = MLP(ColumnParallelLinear.from_linear(fc), RowParallelLinear.from_linear(proj))
    theirs = parallelize_module(MLP(copy.deepcopy(fc), copy.deepcopy(proj)), mesh,
                                {"c_fc": ColwiseParallel(), "c_proj": RowwiseParallel()})
    out["MLP"] = relative_differences(forward_backward(ours, x, dy), forward_backward(theirs, x, dy))
    torch.manual_seed(0)  # one block of the tiny GPT
    ref = GPT(GPTConfig.preset("tiny"))
    x, dy = torch.randn(4, 32, ref.config.n_embd), torch.randn(4, 32, ref.config.n_embd)
    placements = {}
    for sp in (False, True):
        ours = tensor_parallel(copy.deepcopy(ref), sequence_parallel=sp).blocks[0]
        theirs = bench_tensor.torch_tensor_parallel(copy.deepcopy(ref), sequence_parallel=sp, mesh=mesh).blocks[0]
        xs, dys = (x.chunk(t, 1)[r], dy.chunk(t, 1)[r]) if sp else (x, dy)  # SP: this rank's positions
        name = f"block, {'sequence' if sp else 'tensor'} parallel"
        out[name] = relative_differences(forward_backward(ours, xs, dys), forward_backward(theirs, xs, dys))
        placements[sp] = {n: (", ".join(map(repr, p.placements)) if hasattr(p, "placements") else "plain tensor",
                              tuple(local(p).shape)) for n, p in theirs.named_parameters() if n.endswith("weight")}
    return everyone({"differences": out, "placements": placements})  # every rank's, on every rank


vs_dtensor = workbench.launch(against_dtensor, world_size=2)[0]
print("PyTorch's block 0 on rank 0, weights: DTensor placement (local shape), tensor parallel | + sequence parallel")
for n, (placement, shape) in vs_dtensor[0]["placements"][False].items():
    print(f"  {n:20s} {placement + ' ' + str(shape):28s} | {vs_dtensor[0]['placements'][True][n][0]}")
print("largest |ours - PyTorch's| / largest |PyTorch's|, over both ranks:")
for case in vs_dtensor[0]["differences"]:
    d = {k: max(r["differences"][case][k] for r in vs_dtensor) for k in vs_dtensor[0]["differences"][case]}
    grads = max(v for k, v in d.items() if k not in ("output", "input grad"))
    print(f"  {case:26s} output {d['output']:.1e}, input grad {d['input grad']:.1e}, "
          f"{len(d) - 2} parameter grads {grads:.1e}")

# %% [markdown]
# The same layouts (ours keeps `c_attn`'s q, k and v heads of a rank together the same way) and
# the same results to float32 rounding: the two implementations differ in who issues the
# messages, not in the algorithm. DTensor's version is general (any module, any layout, the
# redistributions derived from the placements); ours names each collective in the code.
#
# ## 8. Tensor against data parallelism at the same world size
#
# Two ranks can split the model (tensor parallelism: each holds half the weights, both see the
# whole batch, and four all-reduces of activations per layer) or split the batch (DDP: each
# holds the whole model, sees half the batch, and all-reduces the gradients once per step).
# `workbench bench tensor` times them side by side with PyTorch's DTensor; here a short run on the
# `tiny` GPT (global batch 8 x 64 tokens; the numbers are this machine's, under its load).

# %%
# NBVAL_IGNORE_OUTPUT
bench = workbench.launch(bench_tensor.measure, world_size=2,
                         args=("tiny", 8, ["dtensor", "ours", "dtensor-sp", "ours-sp", "ddp"], 3, 2, 1))[0]
by = {r["candidate"]: r for r in bench["rows"]}
fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 3.5), layout="constrained")
names = list(by)
a1.bar(names, [by[n]["tokens_per_s"] for n in names], color=["#888888", "#4c72b0", "#888888", "#4c72b0", "#55a868"])
a1.set_ylabel("tokens / s")
a1.set_title("throughput, 2 ranks")
a2.bar(names, [by[n]["state_MiB"] for n in names], label="model state")
a2.bar(names, [by[n]["activations_MiB"] for n in names], bottom=[by[n]["state_MiB"] for n in names],
       label="peak activations")
a2.set_ylabel("MiB per rank")
a2.set_title("memory per rank")
a2.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1, 1))  # outside: the bars fill the axes
for ax in (a1, a2):
    ax.tick_params(axis="x", labelsize=8)
faster = "data" if by["ddp"]["tokens_per_s"] > by["ours"]["tokens_per_s"] else "tensor"
display(Markdown(
    f"Measured here (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores): ours takes "
    f"**{by['ours']['ratio']:.2f}x** DTensor's step time ({by['ours-sp']['ratio']:.2f}x with sequence parallelism). "
    f"DDP runs **{by['ddp']['tokens_per_s'] / by['ours']['tokens_per_s']:.2f}x** the tokens/s of tensor parallelism "
    f"(so **{faster} parallelism** was faster in this run) and holds "
    f"**{by['ddp']['state_MiB'] / by['ours']['state_MiB']:.2f}x** its model state per rank."))
cfg = GPTConfig.preset("tiny")
b_bench, s_bench = bench["batch"], bench["block_size"]
per_layer = {name: activation_bytes_per_layer(b, s_bench, cfg.n_embd, cfg.n_head, t, sp) / KiB  # DDP: b/2, whole layer
             for name, b, t, sp in (("ours", b_bench, 2, False), ("ours-sp", b_bench, 2, True),
                                    ("ddp", b_bench // 2, 1, False))}
display(Markdown(
    "Memory per rank, model state + peak activations (MiB): " + ", ".join(
        f"{n} **{by[n]['state_MiB']:.2f} + {by[n]['activations_MiB']:.2f}**" for n in ("ours", "ours-sp", "ddp")) +
    ". The formula of section 6 for one layer's activations: tensor parallel (whole batch, t = 2) "
    f"**{per_layer['ours']:.0f} KiB**, with sequence parallelism **{per_layer['ours-sp']:.0f} KiB**, "
    f"a DDP rank (half the batch, the whole layer) **{per_layer['ddp']:.0f} KiB**."))

# %% [markdown]
# **Why sequence parallelism is slower here**, ours and DTensor's alike: per layer it issues
# many more collectives than tensor parallelism alone (section 5 counts them), and on two CPU
# ranks each collective has a fixed cost (a gloo exchange, an autograd function in Python,
# waiting for the other rank) that is large next to a matrix product with `h` = 64. What it
# saves, the norms and residual adds on `s/t` positions, is little work at this size. The extra
# bytes of the re-gathers would matter on a real network; here the count of calls is what
# costs. As `h` grows, a layer's matrix products grow as `h^2` per token and these fixed costs
# fade.
#
# **Why tensor parallelism's memory per rank is no lower than DDP's** here: it halves the model
# state (the lower segments), but the tiny model's state is small next to its activations, and
# a tensor-parallel rank works on the whole batch while a DDP rank works on `1/t` of it. Per
# layer, tensor parallelism alone keeps `4 (4 + 12/t) s b h` bytes (plus small terms; the
# norms' share is not divided, section 6) and a DDP rank `4 x 16 s (b/t) h`. Since
# `4 + 12/t > 16/t` for every `t > 1`, tensor parallelism alone always keeps *more* activations
# per rank than data parallelism at the same world size, which eats the state it saves (the
# numbers above). With sequence parallelism the two are equal, `16 s b h/t` each, and the
# divided state is the whole saving: the `ours-sp` bar is below DDP's. The larger the model
# (state `16 psi` bytes, `psi` growing as `h^2`) next to `b s h`, the more that saving weighs.
#
# What decides the speed: data parallelism moves the gradients once per step (`2 psi` elements
# through an all-reduce, which can overlap with backward); tensor parallelism moves activations,
# four all-reduces of `b s h` per layer, on the critical path (the next layer waits for them).
# Which is larger depends on the model and the batch: `psi` grows with `h^2`, the activations
# with `b s h`. Tensor parallelism also divides the matrix products, so each rank's kernels are
# `t` times smaller, and on a GPU less efficient. It is what you use when the model does not fit:
# it divides the weights, gradients, optimizer state *and* (with sequence parallelism) the
# activations by `t`, at the price of communication proportional to the activations, which is
# why it stays inside a node, on its fastest links (lesson 07).
# DTensor does the same algorithm, but every operator on a distributed tensor goes through
# DTensor's sharding propagation in Python; ours runs plain tensors and a few autograd functions
# per layer, hence the gap on a CPU, where each operator is cheap.
#
# ## Check
#
# * the tensor-parallel GPT's loss equals the single process's at every step (1e-6), with and
#   without sequence parallelism, and its gathered parameters after 3 AdamW steps too (1e-5);
# * the column-then-row MLP matches one device (output and input gradient);
# * one layer's communication equals the formula exactly: 2 all-reduces of `b s h` forward and 2
#   backward; with sequence parallelism the same bytes forward (as all-gathers and
#   reduce-scatters) and `3/2 + 3/(b s)` times the bytes backward (the re-gathers);
# * activations per layer are within [0.99, 1.10] of the derived formula at every t measured;
# * PyTorch's `parallelize_module` (`ColwiseParallel`/`RowwiseParallel`) gives the MLP's and a
#   transformer block's output, input gradient and parameter gradients within 1e-6 (relative) of
#   ours, with and without sequence parallelism;
# * in the comparison with DDP, tensor parallelism alone keeps more activations per rank than DDP
#   and sequence parallelism holds less memory in all than DDP (memory, not time: load cannot flip it).

# %%
for sp in (False, True):
    assert all(abs(a - b) <= 1e-6 for a, b in gpt[sp]["losses"]), gpt[sp]["losses"]
    assert gpt[sp]["param diff"] <= 1e-5, gpt[sp]["param diff"]
for r in mlp:
    assert r["output diff"] <= 1e-5 and r["input grad diff"] <= 1e-5 and r["all-reduces"] == 2, r
for sp in (False, True):
    assert comm_rows[sp]["measured"] == comm_rows[sp]["expected"], comm_rows[sp]
bsh_bytes = 4 * comm_rows[False]["bsh"]
assert comm_rows[False]["measured"][("forward", "all_reduce")] == (2, 2 * bsh_bytes)  # t = 2: 2 (t-1)/t = 1
assert sent[(True, "forward")] == sent[(False, "forward")], sent
assert abs(backward_ratio - (1.5 + 3 / (b_comm * s_comm))) <= 1e-12, backward_ratio
for r in mem.values():
    assert 0.99 <= r["measured"] / r["formula"] <= 1.10, r
for r in vs_dtensor:
    for case, diffs in r["differences"].items():
        assert max(diffs.values()) <= 1e-6, (case, diffs)
assert by["ours"]["activations_MiB"] > by["ddp"]["activations_MiB"], by
total = {n: by[n]["state_MiB"] + by[n]["activations_MiB"] for n in ("ours-sp", "ddp")}
assert total["ours-sp"] < total["ddp"], total
print("check passed: parity with one process and with PyTorch's parallelize_module, communication = formula, "
      "activations = formula")
