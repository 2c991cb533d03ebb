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
# # 05 · Pipeline parallelism: micro-batches, 1F1B, interleaving and zero bubble
#
# **The idea.** When the model does not fit on one device, cut it by depth: rank 0 holds the
# first layers (a *stage*), rank 1 the next, and so on; activations flow forward from stage to
# stage and gradients flow back. Each boundary carries one activation tensor per micro-batch
# each way -- far less than data parallelism's gradient all-reduce.
#
# **The catch.** Stage 1 cannot start before stage 0 has finished, so with one batch only one
# stage works at a time. Cutting the batch into `m` *micro-batches* lets stage 0 start
# micro-batch 2 while stage 1 works on micro-batch 1. What is left idle at the start and the end
# is the *bubble*: with `p` stages and equal times, a fraction `(p-1)/(m+p-1)` of the step.
#
# In `workbench.parallel.pipeline` every schedule is **data**: a list of actions per rank
# (`F` forward, `B` backward, `W` weight-gradient backward, `send`, `recv`), built before the run
# (`schedule.actions`) and run by one interpreter. After a step, `schedule.timeline` holds when
# every action really ran, on every rank. Schedules differ only in the order of the same actions.
#
# To time schedules with more stages than this machine has cores, the stages *sleep* a fixed
# time in forward and backward (`SleepStage`): sleeping releases the core, so 4 stages on 2
# cores show the schedule's real bubble.

# %%
import copy
import os
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
import torch.distributed.pipelining  # noqa: F401 -- imported once here: see the comment below
import torch.nn.functional as F
from IPython.display import Markdown, display
from matplotlib.lines import Line2D

import workbench
from workbench import comm
from workbench.measure import measuring, plots, trace
from workbench.apps.bench import pipeline as bench_pipeline
from workbench.runtime.busy import busy_fraction, were_free
from workbench.models.data import synthetic_batch
from workbench.models import GPT, GPTConfig
from workbench.models.sleep import SleepStage
from workbench.parallel import pipeline as pp
from workbench.parallel import pipeline_schedules as plans

# torch.distributed.pipelining (section 6) imports torch._dynamo, which MemoryMeter's dispatch mode
# (section 5) needs as well: seconds of imports, paid once in this kernel instead of by every rank
# that a launch forks from it.
torch.set_num_threads(1)
SCHEDULES = pp.SCHEDULES  # every schedule by name
P = 4            # stages for the timing runs (under torchrun, the world size decides)
SLEEP = 0.01     # seconds per forward (and per backward half) of a whole stage
STEPS = 2        # timed steps at the m the check asserts; the least idle one counts (one elsewhere)
MS = [1, 2, 4, 8]  # micro-batches per step in the sweep; the check asserts the last
OUT = Path("runs") / "05_pipeline_parallel"  # what the lesson writes (runs/ is not kept in git)
SMOKE = workbench.smoke_test()  # the test suite's quick run: tiny sleeps, no timing claim asserted
if SMOKE:
    SLEEP, STEPS, MS = 0.002, 1, [1, 4]  # two ends of a sweep (m = 4: enough for every schedule at p = 2)


def sleeping_pipeline(name, m, steps=1):
    """Schedule ``name`` on sleeping stages (``bench.pipeline.sleeping_pipeline``): the least idle
    of ``steps`` timed steps (a busy machine only ever adds idle time: a rank waits for a core),
    after one untimed step (the first also sends the activations' shapes)."""
    p = dist.get_world_size()
    run = bench_pipeline.sleeping_pipeline(name, m, SLEEP, steps)
    best = min(run["timelines"], key=lambda t: plans.bubble(t, p))
    return {"timeline": best, "actions": run["actions"]}


def too_few():
    """What ``Schedule1F1B`` says when given fewer micro-batches than stages (section 3)."""
    stage = pp.PipelineStage(SleepStage(0.0), dist.get_rank(), dist.get_world_size())
    try:
        pp.Schedule1F1B(stage, 1)
    except ValueError as e:
        return str(e)


def every_schedule(ms):
    """On every rank of one launch: every schedule at every m in ``ms`` it accepts, on sleeping
    stages; ``STEPS`` timed steps at the m the check asserts (``ms[-1]``), one elsewhere."""
    p = dist.get_world_size()
    runs = {(name, m): sleeping_pipeline(name, m, STEPS if m == ms[-1] else 1)
            for name in SCHEDULES for m in ms if m >= plans.min_microbatches(name, p)}
    return {"p": p, "runs": runs, "too_few": too_few()}


# %% [markdown]
# ## 1. Naive model parallelism: one stage busy at a time
#
# Every measured schedule in sections 1, 2 and 4 comes from the one launch below: 4 ranks run
# each schedule at each `m` of the sweep (`MS`) on sleeping stages, and the lesson draws from
# what it returns (`sweep`), so the ranks start once.
#
# First, one micro-batch (`m = 1`) through 4 stages: the forward goes down the stages, the
# backward comes back up, and each rank waits for all the others. Idle fraction `(p-1)/p`.

# %%
# NBVAL_IGNORE_OUTPUT
other_work = [busy_fraction()]  # the cores' busy fraction from other work, before and after (see the check)
sweep = workbench.launch(every_schedule, world_size=P, args=(MS,), timeout=300)[0]
other_work.append(busy_fraction())
p = sweep["p"]
measured = {key: plans.bubble(run["timeline"], p) for key, run in sweep["runs"].items()}
naive = sweep["runs"][("gpipe", 1)]
plots.pipeline_schedule(naive["timeline"], title="Measured: one micro-batch, one stage busy at a time")
plt.show()
display(Markdown(f"Measured idle fraction: **{measured[('gpipe', 1)]:.2f}** "
                 f"(formula (p-1)/p = {(p - 1) / p:.2f}); load average {os.getloadavg()[0]:.1f} on "
                 f"{os.cpu_count()} cores."))

# %% [markdown]
# ## 2. GPipe: micro-batches fill the pipeline
#
# GPipe runs all `m` forwards, then all `m` backwards. Left: the plan, laid out with a forward
# taking 1 and a backward 2 (a backward costs about two forwards). Right: the same list, run.

# %%
# NBVAL_IGNORE_OUTPUT
gpipe = sweep["runs"][("gpipe", MS[-1])]
fig, axes = plt.subplots(1, 2, figsize=(14, 2.8), layout="constrained")
plots.pipeline_schedule(gpipe["actions"], axes[0], title=f"GPipe, m = {MS[-1]}, planned")
plots.pipeline_schedule(gpipe["timeline"], axes[1], title=f"GPipe, m = {MS[-1]}, measured")
plt.show()

# %% [markdown]
# ## 3. 1F1B: the same bubble, less memory
#
# GPipe keeps the activations of all `m` micro-batches until their backward. 1F1B starts each
# backward as soon as it can: stage `s` runs a **warm-up** of `p - s - 1` forwards, then
# alternates **one forward, one backward**, then **cools down** with the remaining backwards.
# So stage `s` never holds more than `p - s` micro-batches -- the first stage holds the most,
# because its first backward comes back last. The bubble stays `(p-1)/(m+p-1)`.
#
# **Why `m >= p`?** The steady state needs a micro-batch to come back before the warm-up is
# over; with fewer micro-batches than stages there is none, and `Schedule1F1B` refuses (the
# last line below: what it said to `m = 1` in the launch of section 1).

# %%
plan = plans.with_comms(plans.one_f_one_b(4, 8), 4)
for s, acts in enumerate(plan):
    compute = [a for a in acts if a.kind in ("F", "B")]
    warmup = next(i for i, a in enumerate(compute) if a.kind == "B") - 1
    print(f"stage {s}: warm-up {warmup} forwards, at most {plans.live_microbatches(acts)[s]} micro-batches alive:",
          " ".join(str(a) for a in compute[:8]), "...")
plots.pipeline_schedule(plan, title="1F1B, p = 4, m = 8, planned")
plt.show()
print(sweep["too_few"])

# %% [markdown]
# ## 4. The bubble against `m`, and how to shrink it
#
# * **Interleaved 1F1B** gives each rank `v` smaller stages (rank `r` holds `r, r+p, ...`): the
#   ramp-up costs a stage of `1/v` the size, so the bubble is `(p-1)/(v m + p - 1)`, at `v`
#   times the messages.
# * **Zero bubble (ZB-H1)** splits each backward into `B` (the input gradient the previous stage
#   waits for) and `W` (the weight gradient nobody waits for) and defers `W`s into the
#   cool-down: bubble `(p-1)/(3m + p - 1)` with equal `F`, `B`, `W`.
# * **ZBV** puts two stages per rank in a V (rank `r` holds `r` and `2p-1-r`): with `m >= 2p`,
#   `(p-1)/(6m + p - 1)`.
# * **DualPipeV** (DeepSeek-V3) runs on the same V, pairing one chunk's forward with the other
#   chunk's backward in the steady state. With equal `F`, `B`, `W` it idles as long as ZBV; its
#   gain is hiding each pair's communication (expert all-to-all) behind the other's compute,
#   which sleeping stages do not model. It needs `m >= 2p`.
#
# In the plot each marker is a measured step (sleeping stages; the markers of one `m` are set
# slightly apart, or GPipe's would hide under 1F1B's). Each line joins the schedule's expected
# idle fraction with equal `F`, `B` and `W` (`plans.bubble_formula`; GPipe and 1F1B share one):
# the closed form above where one applies, and where none does -- interleaved with `m < p`, ZBV
# with `m < 2p` -- the plan itself replayed by `plans.simulate()` (those values are crossed).
#
# *Which m?* `m` is the number of micro-batches in one optimizer step (the global batch on this
# pipeline divided by the micro-batch size), not the number of steps.

# %%
# NBVAL_IGNORE_OUTPUT
def from_simulate(name, m):
    """Where bubble_formula has no closed form and replays the plan instead (its docstring)."""
    return (name == "interleaved" and m < p) or (name == "zbv" and m < 2 * p)


def upper_bound(name, m):
    """The most idle time the check accepts: the expected bubble, plus half of it (a ZB-H1 that
    idled like 1F1B fails; the check's comparisons catch schedules closer together), plus 0.05
    for what every action and message adds to the sleeps on 2 cores."""
    expected = plans.bubble_formula(name, p, m)
    return expected + 0.5 * expected + 0.05


fig, ax = plt.subplots(figsize=(8, 4.5), layout="constrained")
colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
for k, (name, color, marker) in enumerate(zip(SCHEDULES, colors, "osD^vP")):
    ms = [m for m in MS if (name, m) in measured]
    ax.plot(ms, [plans.bubble_formula(name, p, m) for m in ms], color=color, lw=1)
    simulated = [m for m in ms if from_simulate(name, m)]
    ax.plot(simulated, [plans.bubble_formula(name, p, m) for m in simulated], "x", color=color, ms=8, mew=1.5)
    apart = 2 ** (0.05 * (k - (len(SCHEDULES) - 1) / 2))  # markers of one m side by side
    ax.plot([m * apart for m in ms], [measured[(name, m)] for m in ms], marker, color=color, ls="none",
            label=name)
ax.set_xscale("log", base=2)
ax.set_xticks(MS, [str(m) for m in MS])
ax.set_xlabel("micro-batches m")
ax.set_ylabel("idle fraction of the step")
ax.set_title(f"Bubble, p = {p}: measured against expected")
by_schedule = ax.legend(title="schedule (measured)", loc="upper right")
ax.add_artist(by_schedule)
ax.legend(handles=[Line2D([], [], color="grey", marker="o", ls="none", label="measured (least idle step)"),
                   Line2D([], [], color="grey", lw=1, label="expected: the closed form"),
                   Line2D([], [], color="grey", marker="x", ls="none", mew=1.5,
                          label="expected: no closed form, simulate()")], loc="lower left", fontsize=9)
plt.show()
worst = max(abs(v - plans.bubble_formula(n, p, m)) for (n, m), v in measured.items())
display(Markdown(f"Largest distance from the expected value: **{worst:.3f}** (load average "
                 f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores). Measured bubbles are "
                 "a little larger: every action and message costs some Python and a wake-up, on "
                 "top of the sleeps -- *why is my bubble bigger than (p-1)/(m+p-1)?* -- and "
                 "stages of unequal cost make it worse still."
                 + ("" if were_free(other_work) else " Here other work kept the cores busy around the sweep, "
                    "so the bubbles also hold waits for a core, which the schedule did not cause (the check "
                    "says so and asserts neither their upper bounds nor the comparisons).")
                 + " At the m the check asserts:\n\n"
                 "| schedule | expected | measured | the check allows up to |\n|---|---|---|---|\n" + "\n".join(
                     f"| {n} | {plans.bubble_formula(n, p, m):.3f} | {v:.3f} | "
                     f"{upper_bound(n, m):.3f} |"
                     for (n, m), v in measured.items() if m == MS[-1])))

# %% [markdown]
# Every schedule's measured step at the sweep's largest `m` also goes to one Chrome trace file
# (`workbench.measure.trace.export`: each rank a process, its `F`, `B` and `W` on one row and its sends
# and receives on another, one pair of rows per schedule). Open it at
# [ui.perfetto.dev](https://ui.perfetto.dev) ("Open trace file", or drag it onto the page) or in
# Chrome's `chrome://tracing` ("Load") to zoom into a ramp, measure a gap with the mouse, or
# click an action for its stage and micro-batch.

# %%
trace_file = trace.export(OUT / "schedules.json", {f"{name}, m = {m}": run["timeline"]
                                                   for (name, m), run in sweep["runs"].items() if m == MS[-1]})
print(f"wrote {trace_file}")

# %% [markdown]
# Planned grids of the zero-bubble schedules: orange `W`s fill what was idle in 1F1B.
# DualPipeV splits a backward only in the ramps.

# %%
fig, axes = plt.subplots(3, 1, figsize=(11, 6.9), layout="constrained")
plots.pipeline_schedule(plans.with_comms(plans.zero_bubble_h1(4, 8), 4), axes[0], title="ZB-H1, p = 4, m = 8, planned")
plots.pipeline_schedule(plans.with_comms(plans.zbv(4, 8), 8, "v"), axes[1], style="v", title="ZBV, p = 4, m = 8, planned")
plots.pipeline_schedule(plans.with_comms(plans.dualpipev(4, 8), 8, "v"), axes[2], style="v",
                        title="DualPipeV, p = 4, m = 8, planned")
plt.show()

# %% [markdown]
# ## 5. Activation memory per stage
#
# A real GPT (8 blocks), cut into stages, 8 micro-batches, every schedule, p = 2 and 4. What a
# micro-batch in flight holds is `M_B`: the tensors its forward saved for backward, its input
# and its output. The *count* is the plan's micro-batches in flight times that: GPipe `m`,
# 1F1B `p - s` on stage `s`, interleaved and ZBV per chunk. `MemoryMeter` measures the live
# activation bytes at the end of every action of a step (between actions nothing is computing)
# and `M_B` on one micro-batch run alone (`workbench.apps.bench.pipeline.activation_memory`).
#
# Three things sit *beside* that count, and are kept out of it on purpose:
#
# * **A backward's temporaries.** While one micro-batch runs its backward, the gradients in
#   flight through its layers exist for a moment on top of everything in flight (light bars).
#   They are not anyone's activations; the peak over the whole step includes them.
# * **Returned outputs.** `step()` returns the last stage's outputs, so by default it keeps all
#   `m` of them (a GPT's logits). With a loss they are not needed for backward: pass
#   `return_outputs=False` (as in `torch.distributed.pipelining`) and they are not kept.
# * **Zero bubble's W.** Between `B` and `W` a micro-batch holds only what `W` reads: the
#   inputs of its matrix products and the gradients of their outputs (`M_W`). Everything else
#   its forward saved is released after `B`, and LayerNorm's and the biases' gradients are
#   computed in `B`. The count for ZB-H1 on stage `s` is `(p - s) M_B + s M_W` -- at most
#   1F1B's first-stage `p M_B` *where* `M_W <= M_B`, the zero-bubble paper's claim. The first
#   stage is the exception: its `M_W` is a little *larger* than its `M_B` (printed below the
#   chart, explained after it).

# %%
# NBVAL_IGNORE_OUTPUT
MEM_PS = (2, 4)     # stages p; under torchrun every launch runs in torchrun's world, so the smoke test runs one
M_MEM = 8           # micro-batches per step
BLOCKS = 8          # GPT blocks, cut into stages (two per rank for the V schedules)
MICROBATCH = 4      # sequences per micro-batch (of GPT tiny's 64 tokens)
if SMOKE:  # p = 2: the fewest micro-batches every schedule accepts there, and blocks for 2 x 2 stages
    MEM_PS, M_MEM, BLOCKS = (2,), 4, 4
memory = [row for p_mem in MEM_PS
          for rank_rows in workbench.launch(bench_pipeline.activation_memory, world_size=p_mem,
                                            args=(list(SCHEDULES), M_MEM, BLOCKS, MICROBATCH), timeout=300)
          for row in rank_rows]


def plot_activation_memory(rows):
    """Small multiples: one panel per schedule (columns) and p (rows), one bar per rank: the live
    activations measured (solid), one backward's temporaries on top (light), and the schedule's
    count (black line) -- a bar that reaches its line is on the count."""
    ps = sorted({r["p"] for r in rows})
    names = [n for n in SCHEDULES if any(r["schedule"] == n for r in rows)]
    fig, axes = plt.subplots(len(ps), len(names), figsize=(12, 1.2 + 2.3 * len(ps)), sharey=True,
                             squeeze=False, layout="constrained")
    mib = 2 ** 20
    for i, p_mem in enumerate(ps):
        for j, name in enumerate(names):
            ax = axes[i][j]
            mine = sorted((r for r in rows if r["p"] == p_mem and r["schedule"] == name), key=lambda r: r["rank"])
            ranks = [r["rank"] for r in mine]
            live = [r["live_activation_bytes"] / mib for r in mine]
            ax.bar(ranks, live, width=0.7, color="#c44e52")
            ax.bar(ranks, [r["temporaries_bytes"] / mib for r in mine], bottom=live, width=0.7,
                   color="#c44e52", alpha=0.25)
            ax.hlines([r["count_bytes"] / mib for r in mine], [x - 0.45 for x in ranks],
                      [x + 0.45 for x in ranks], colors="k", lw=2.5)
            ax.set_xticks(range(p_mem))
            ax.set_xlim(-0.6, p_mem - 0.4)
            if i == 0:
                ax.set_title(name)
            if i == len(ps) - 1:
                ax.set_xlabel("rank")
            if j == 0:
                ax.set_ylabel(f"p = {p_mem}\nactivation MiB")
    fig.legend(handles=[plt.Rectangle((0, 0), 1, 1, color="#c44e52", label="live activations, measured"),
                        plt.Rectangle((0, 0), 1, 1, color="#c44e52", alpha=0.25,
                                      label="+ one backward's temporaries, measured"),
                        Line2D([], [], color="k", lw=2.5,
                               label="count: micro-batches in flight x M_B (+ pending W's x M_W)")],
               loc="outside lower center", ncol=3)
    fig.suptitle(f"Activation memory per rank, one step of m = {rows[0]['m']} micro-batches")
    return fig


plot_activation_memory(memory)
plt.show()
ratios = {}
for r in memory:
    ratios.setdefault(r["schedule"], []).append(r["ratio"])
p_zb = max(r["p"] for r in memory)
zb = sorted((r for r in memory if r["schedule"] == "zb_h1" and r["p"] == p_zb), key=lambda r: r["rank"])
M_B = {r["rank"]: r["one_microbatch_bytes"][str(r["rank"])] for r in zb}  # the stage of rank r is r
M_W = {r["rank"]: r["held_for_w_bytes"][str(r["rank"])] for r in zb}
config = GPTConfig.preset("tiny")
boundary = MICROBATCH * config.block_size * config.n_embd * 4  # one micro-batch's activation between stages, float32
display(Markdown(
    f"Live activations / count, over every rank at p = {', '.join(map(str, MEM_PS))}: " + "; ".join(
        f"{name} **{min(v):.3f}-{max(v):.3f}**" for name, v in ratios.items()) + f".\n\nZB-H1 at p = {p_zb}, "
    "what a pending W holds against a pending backward (M_W / M_B): " + ", ".join(
        f"stage {s} **{M_W[s] / M_B[s]:.3f}**" for s in M_B) + "; its count in units of each stage's own M_B: "
    + ", ".join(f"stage {r['rank']} **{r['count_bytes'] / M_B[r['rank']]:.3f}**" for r in zb)
    + f" (1F1B's first stage: {p_zb})." + (
        f" On stage 0, M_W - M_B = **{M_W[0] - M_B[0]}** bytes: one micro-batch's output gradient, "
        f"{MICROBATCH} x {config.block_size} tokens x {config.n_embd} channels x 4 bytes = {boundary}."
        if 0 in M_B else "")))

# %% [markdown]
# *Why does the first stage hold the most?* In 1F1B its first backward starts only after the
# micro-batch has gone down the whole pipeline and come back, so `p` forwards are in flight;
# the last stage runs each backward right after its forward. In GPipe every stage holds all
# `m`.
#
# *Why does a pending W hold more than a pending backward on stage 0?* The first stage is fed
# token ids, which need no gradient: it has no input gradient to compute, so its `B` does
# nothing and its `W` is the whole backward. What waits for that `W` is everything the forward
# saved, *plus* the gradient of the stage's output that came back from stage 1: one boundary
# activation more than a pending backward holds (the bytes printed above). ZB-H1 defers `s`
# weight passes on stage `s` -- none on stage 0, whose `W` runs right after its `B` -- so the
# extra output gradient lives for one backward only, and stage 0's count is
# `(p - 1) M_B + M_W`: a hair above 1F1B's `p M_B`. On the other stages `B` sends its input
# gradient on and lets go of what only it needed, while `W` keeps the gradients of its matrix
# products' outputs; in our GPT the two nearly cancel (no dropout masks, and the fused attention
# saves no `T x T` matrix), so `M_W` is a little below `M_B` and the count stays under `p M_B`.
# In the paper's GPT, with both, a pending `W` holds clearly less than a pending backward.

# %% [markdown]
# ## 6. Same training as one process -- including the tied embedding
#
# With `tie_weights=True` the GPT's head reuses the token embedding `wte.weight`. After
# `partition`, the first stage uses it to embed and the last stage as its head: each holds a
# copy and gets only its own use's gradient. After backward the schedule **sums the two
# gradients between the first and last stage** (Megatron's embedding group), so both copies take
# the same AdamW step and stay equal -- exactly the single-process tied model.
#
# The loss of each micro-batch is its mean; backward runs on `loss / m`, so the gradients are
# those of the mean loss over the whole batch (gradient accumulation normalised per micro-batch
# would be `m` times too large). Parity is checked in float64 (in float32, Adam turns rounding
# noise in near-zero gradients into visible updates).
#
# **What crosses the boundary.** `comm.counters()` counts every byte the ranks send. Each step,
# stage 0 sends each micro-batch's activation (`b/m x T x C` numbers) forward and stage 1 sends
# its gradient, of the same shape, back: `2 m` messages per boundary, `2 b T C` numbers in all,
# whatever `m` is. On top: the tied embedding's gradient (`V x C`), which each of the two ranks
# sends the other once per step, and before the very first step one small message with the
# activation's shape, so that stage 1 can allocate its receive buffers. The formula below counts
# all of that; the check asserts it equals what was measured.
#
# **Against PyTorch.** The same stages, cut by the same `partition`, also run under
# `torch.distributed.pipelining` (torch's `PipelineStage` and its schedule of the same name, via
# the helpers of `workbench bench pipeline`): every schedule that has a torch twin takes one step
# on the same weights and batch, and the losses and gradients are compared. The model is
# untied there: torch's pipelining does not sum a tied embedding's two gradients.

# %%
def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def on_every_rank(value):
    """Every rank's ``value`` (a whole number), on every rank: one all-reduce of a one-hot vector."""
    t = torch.zeros(dist.get_world_size(), dtype=torch.float64)
    t[dist.get_rank()] = value
    dist.all_reduce(t)
    return [int(v) for v in t.tolist()]


def parity(steps=3, m=4):
    """1F1B against one process, tied embedding, float64: the largest parameter difference after
    ``steps`` AdamW steps, and the bytes each rank sent."""
    rank, p = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", tie_weights=True)).double()
    reference = copy.deepcopy(model)
    stage = pp.partition(model, p)[rank]
    schedule = pp.Schedule1F1B(pp.PipelineStage(stage, rank, p), m, loss_fn=loss_fn)
    opt = torch.optim.AdamW(stage.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 65, (8, 32), generator=g), torch.randint(0, 65, (8, 32), generator=g)
    with comm.counters() as c:
        for _ in range(steps):
            opt.zero_grad()
            schedule.step(*((x,) if rank == 0 else ()), target=y if rank == p - 1 else None)
            opt.step()
            ref_opt.zero_grad()
            reference(x, y)[1].backward()
            ref_opt.step()
    want = dict(reference.named_parameters(remove_duplicate=False))
    diff = max((q - want[n]).abs().max().item() for n, q in stage.named_parameters())
    return measuring.max_over_ranks(diff), on_every_rank(c.stats[("isend", "native")].bytes_sent)


def against_torch(names=tuple(bench_pipeline.TORCH_TWIN), m=4, trials=5, steps=3):
    """Ours against torch.distributed.pipelining on the same stages (GPT tiny, untied, float64):
    for each schedule in ``names`` (1F1B among them), the largest loss and gradient difference
    after one step from the same weights; then 1F1B's step time, ours and torch's taking turns in
    ``trials`` interleaved trials of ``steps`` steps (the median of the slowest rank's)."""
    rank, p = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.preset("tiny", tie_weights=False)
    x, y = synthetic_batch(8, block_size=32, seed=0)
    diffs, timed = {}, {}
    for name in names:
        got = {}
        for impl in ("ours", "torch"):
            torch.manual_seed(0)
            schedule, mods, S, local = bench_pipeline._pipeline(name, GPT(config).double(), p, rank, m, impl)
            losses = []
            bench_pipeline._step(schedule, S, local, x, y, losses=losses)
            got[impl] = [q.grad for mod in mods for q in mod.parameters()], losses
            if name == "1f1b":
                timed[impl] = schedule, mods, S, local
        grads = max((a - b).abs().max().item() for a, b in zip(got["ours"][0], got["torch"][0]))
        loss = max([(a - b).abs().item() for a, b in zip(got["ours"][1], got["torch"][1])], default=0.0)
        diffs[name] = measuring.max_over_ranks(max(grads, loss))

    def step_time(impl):
        schedule, mods, S, local = timed[impl]

        def one_step():
            bench_pipeline._step(schedule, S, local, x, y, return_outputs=False)
            for mod in mods:
                mod.zero_grad(set_to_none=True)

        return measuring.max_over_ranks(measuring.timed(one_step, steps))

    samples = measuring.interleaved_trials(["ours", "torch"], trials, step_time)
    return diffs, {impl: measuring.median(v) for impl, v in samples.items()}


def section_6():
    """Both comparisons in one launch of 2 ranks (the smoke test: 1F1B against torch's, one step timed)."""
    if SMOKE:
        return parity(), against_torch(("1f1b",), trials=1, steps=1)
    return parity(), against_torch()


(max_diff, sent), (torch_diff, step_s) = workbench.launch(section_6, world_size=2)[0]
# the bytes, counted: 3 steps, m = 4 micro-batches of b/m = 2 sequences x T = 32 tokens, float64
config = GPTConfig.preset("tiny")
activation = (8 // 4) * 32 * config.n_embd * 8     # one micro-batch's activation (or its gradient) at the boundary
tied_grad = config.vocab_size * config.n_embd * 8  # wte.weight's gradient, exchanged once per step
shape_message = 12 * 8                             # once: ndim, dtype code and up to 10 sizes, int64
expected_sent = [3 * (4 * activation + tied_grad) + shape_message,  # rank 0: activations forward
                 3 * (4 * activation + tied_grad)]                  # rank 1: their gradients back
display(Markdown(
    f"1F1B on 2 stages against one process, 3 AdamW steps, tied embedding: largest parameter difference "
    f"**{max_diff:.1e}**.\n\nBytes sent, measured against counted: rank 0 **{sent[0]}** = 3 steps x "
    f"(4 activations x {activation} + the tied gradient {tied_grad}) + the shape message {shape_message} "
    f"= **{expected_sent[0]}**; rank 1 **{sent[1]}** = 3 x (4 gradients x {activation} + {tied_grad}) = "
    f"**{expected_sent[1]}**. An activation is {8 // 4} x 32 x {config.n_embd} float64 numbers; a tied "
    f"gradient {config.vocab_size} x {config.n_embd}.\n\n`torch.distributed.pipelining` on the same stages, "
    "one step from the same weights and batch, largest loss or gradient difference from ours: " + ", ".join(
        f"{name} **{d:.1e}**" for name, d in torch_diff.items()) + "."))

# %%
# NBVAL_IGNORE_OUTPUT
display(Markdown(f"1F1B step of GPT tiny on 2 ranks, median of the interleaved trials: ours "
                 f"{1e3 * step_s['ours']:.1f} ms, torch.distributed.pipelining's {1e3 * step_s['torch']:.1f} ms "
                 f"(ours / torch **{step_s['ours'] / step_s['torch']:.2f}**; load average "
                 f"{os.getloadavg()[0]:.1f} on {os.cpu_count()} cores). At this size a step is mostly "
                 "Python per action and message, so the ratio compares the two interpreters' overheads; "
                 "`workbench bench pipeline` times a larger GPT. Not asserted: other work on the machine "
                 "moves it."))

# %% [markdown]
# ## 7. Try it: any schedule, any `p` and `m`
#
# The widget draws the planned grid from the same builders the interpreter runs.

# %%
import ipywidgets as widgets  # noqa: E402


def draw(schedule="1F1B", p=4, m=8):
    name = {"GPipe": "gpipe", "1F1B": "1f1b", "interleaved": "interleaved", "ZB-H1": "zb_h1", "ZBV": "zbv",
            "DualPipeV": "dualpipev"}.get(schedule, schedule)
    if m < plans.min_microbatches(name, p):
        print(f"{schedule} needs m >= {plans.min_microbatches(name, p)} for p = {p}")
        return
    build = {"gpipe": lambda: plans.gpipe(p, m), "1f1b": lambda: plans.one_f_one_b(p, m),
             "interleaved": lambda: plans.interleaved(p, 2, m), "zb_h1": lambda: plans.zero_bubble_h1(p, m),
             "zbv": lambda: plans.zbv(p, m), "dualpipev": lambda: plans.dualpipev(p, m)}[name]
    v = 2 if name in ("interleaved", "zbv", "dualpipev") else 1
    style = "v" if name in ("zbv", "dualpipev") else "loop"
    plots.pipeline_schedule(plans.with_comms(build(), v * p, style), num_stages=v * p, style=style,
                            title=f"{schedule}, p = {p}, m = {m}: planned (formula "
                                  f"{plans.bubble_formula(name, p, m):.0%} idle)")
    plt.show()


schedule_box = widgets.Dropdown(options=["GPipe", "1F1B", "interleaved", "ZB-H1", "ZBV", "DualPipeV"], value="1F1B",
                                description="schedule")
p_box = widgets.IntSlider(value=4, min=2, max=8, description="stages p")
m_box = widgets.IntSlider(value=8, min=1, max=16, description="micro-batches m")
figure_area = widgets.Output()


def redraw(change=None):
    with figure_area:
        figure_area.clear_output(wait=True)
        draw(schedule_box.value, p_box.value, m_box.value)


for box in (schedule_box, p_box, m_box):
    box.observe(redraw, names="value")
display(widgets.VBox([widgets.HBox([schedule_box, p_box, m_box]), figure_area]))
draw(schedule_box.value, p_box.value, m_box.value)  # the default state; moving a control redraws above


# %% [markdown]
# `workbench bench pipeline` times our schedules against `torch.distributed.pipelining` on the
# GPT `small`, sweeps the bubble for p = 2, 4, 8 and m = 1..16, and measures activation memory
# and boundary bytes.
#
# ## Check
#
# * one process and the 2-stage 1F1B pipeline end with the same parameters (1e-6), and
#   `torch.distributed.pipelining` gives the same losses and gradients as ours on the same stages
#   for every schedule it has (1e-6);
# * each rank sent exactly the bytes counted above;
# * the measured bubble of every schedule at the sweep's largest `m` is not below its expected
#   value by more than 0.02 (overheads only add idle time), and not above it by more than half
#   the expected value plus 0.05 (the table in section 4: a ZB-H1 that idled like 1F1B fails);
# * measured, ZB-H1 idles less than 1F1B, interleaved 1F1B less than 1F1B, and ZBV less than
#   ZB-H1 (each improvement shows, also where the bounds alone would let it slip);
# * every rank's live activations are 1.00-1.10 of its schedule's count, each boundary carried
#   the `2 m` activations and gradients of its count, and on stage 0 a pending W holds exactly
#   one output gradient more than a pending backward.
#
# The timing claims (the bubbles' upper bounds and the three comparisons) are asserted where the
# sweep ran on free cores (other work used at most a quarter of the cores' time just before and
# just after it): on a machine running other work a rank waits for a core after each sleep and
# message, and those waits are idle time the schedule did not cause. 1F1B's step time against
# torch's is reported, not asserted.

# %%
assert max_diff < 1e-6, max_diff
assert all(d < 1e-6 for d in torch_diff.values()), torch_diff
assert sent == expected_sent, (sent, expected_sent)
# Sleeping stages show the schedule's own idle time only if a rank gets a core as soon as its sleep
# or its message ends. With other work keeping the cores busy (workbench.runtime.busy: more than a quarter
# of the cores' time, just before or just after the sweep) the waits for a core join the bubble,
# so the timing claims (upper bounds, comparisons) are asserted on free cores only.
FREE_CORES = were_free(other_work)
if not SMOKE:  # a 2 ms sleep is of the order of an action's own overhead: no bubble to check
    m = MS[-1]
    for name in SCHEDULES:
        value = measured[(name, m)]
        assert value - plans.bubble_formula(name, p, m) > -0.02, (name, m, value)  # overheads only add
        assert value <= upper_bound(name, m) or not FREE_CORES, (name, m, value, upper_bound(name, m))
    for better, than in (("zb_h1", "1f1b"), ("interleaved", "1f1b"), ("zbv", "zb_h1")):
        assert measured[(better, m)] < measured[(than, m)] or not FREE_CORES, (better, than, measured)
assert all(1.0 <= r["ratio"] <= 1.10 for r in memory), [(r["schedule"], r["p"], r["rank"], r["ratio"]) for r in memory]
assert all(r["bytes_sent"] == r["bytes_expected"] for r in memory), \
    [(r["schedule"], r["p"], r["rank"], r["bytes_sent"], r["bytes_expected"]) for r in memory]
assert all(r["held_for_w_bytes"]["0"] - r["one_microbatch_bytes"]["0"] == boundary
           for r in memory if r["schedule"] == "zb_h1" and r["rank"] == 0), boundary
print("all checks passed: parity with one process and with torch.distributed.pipelining, boundary bytes "
      "as counted, bubbles on the formulas, activation memory on the count"
      + (" (smoke test: bubbles not asserted)" if SMOKE else "" if FREE_CORES else
         f" (bubbles' upper bounds and comparisons not asserted: other work kept the cores "
         f"{max(b for b in other_work if b is not None):.0%} busy around the sweep)"))
