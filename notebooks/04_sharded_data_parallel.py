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
# # 04 · Sharded data parallelism: ZeRO-1, ZeRO-2 and ZeRO-3
#
# Data parallelism keeps the whole model state on every rank. With float32 AdamW and `psi`
# parameters that is `4 psi` bytes of parameters, `4 psi` of gradients and `8 psi` of Adam's two
# moments: `16 psi` per rank, however many ranks there are. Yet after the all-reduce every rank
# applies the *same* update. ZeRO (Rajbhandari et al. 2020) gives each of the `N` ranks `1/N` of
# the work, and then it only needs `1/N` of the state:
#
# | stage | what is sharded | what moves per step (elements per rank) | model state per rank |
# | --- | --- | --- | --- |
# | 0 (DDP) | nothing | all-reduce: `2 psi (N-1)/N` | `16 psi` |
# | 1 | optimizer state | reduce-scatter + all-gather: `2 psi (N-1)/N` | `8 psi + 8 psi/N` |
# | 2 | + gradients | the same, reduce-scatter during backward | `4 psi + 12 psi/N` |
# | 3 (FSDP) | + parameters | all-gather twice + reduce-scatter: `3 psi (N-1)/N` | `16 psi/N` |
#
# Stages 1 and 2 are free in bandwidth: a ring all-reduce *is* a reduce-scatter followed by an
# all-gather, ZeRO just runs the optimizer between the two. Stage 3 gathers each unit (a
# transformer block) just before its forward and again before its backward, and pays 1.5x.
#
# Everything below uses `workbench.parallel.zero(module, optimizer_cls, stage)`, which returns the
# `(model, optimizer)` of any stage, on the GPT `small` preset (3.2 M parameters).

# %%
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import workbench
from workbench import comm, plots
from workbench.metrics import MemoryMeter, model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel import zero

FORMULA = {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 8 * psi + 8 * psi / n,
           2: lambda psi, n: 4 * psi + 12 * psi / n, 3: lambda psi, n: 16 * psi / n}
VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}  # elements moved per step, in units of psi (N-1)/N
MB = 1e6


def everyone(value):
    """The list of every rank's ``value``, on every rank (so results[0] holds all of it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# %% [markdown]
# ## 1. Model state per rank, measured against the formulas
#
# Each rank builds the same GPT, wraps it at one stage, trains two steps, and reports what it
# holds right after the second step (`model_state_bytes`: every storage of parameters,
# gradients and optimizer state, counted once and in full, padding included), and how many
# bytes it sent during that step (`comm.counters()`). World sizes 2 and 4.

# %%
def measure_stages():
    n = dist.get_world_size()
    rows = []
    for stage in range(4):
        torch.manual_seed(0)
        module = GPT(GPTConfig.preset("small"))
        psi = module.num_parameters()
        model, optimizer = zero(module, torch.optim.AdamW, stage, lr=1e-3)
        x = torch.randint(0, 65, (2, 64), generator=torch.Generator().manual_seed(dist.get_rank()))
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
        with comm.counters() as c:
            model(x, x)[1].backward()
            optimizer.step()
        state = model_state_bytes(model, optimizer)
        rows.append({"stage": stage, "N": n, "psi": psi, **state, "formula": FORMULA[stage](psi, n),
                     "sent": c.total_bytes_sent, "sent_formula": 4 * VOLUME[stage] * psi * (n - 1) / n})
    return everyone(rows)[0]


# Keyed by the world size that really ran: under torchrun, launch() runs in torchrun's own world.
by_key = {(row["N"], row["stage"]): row for n in (2, 4) for row in workbench.launch(measure_stages, world_size=n)[0]}
rows = list(by_key.values())
SIZES = sorted({r["N"] for r in rows})
print(f"psi = {rows[0]['psi']:,} parameters\n")
print(" N  stage   params    grads  optimizer    total  formula  measured/formula")
for r in rows:
    print(f"{r['N']:2d}  {r['stage']:5d}  {r['params'] / MB:6.2f}MB {r['grads'] / MB:6.2f}MB  "
          f"{r['optimizer'] / MB:7.2f}MB {r['total'] / MB:6.2f}MB {r['formula'] / MB:6.2f}MB"
          f"  {r['total'] / r['formula']:.4f}")

# %%
fig, axes = plt.subplots(1, len(SIZES), figsize=(5.5 * len(SIZES), 4), layout="constrained", sharey=True,
                         squeeze=False)
colors = {"params": "C0", "grads": "C1", "optimizer": "C2"}
for ax, n in zip(axes[0], SIZES):
    sel = [r for r in rows if r["N"] == n]
    bottom = [0.0] * len(sel)
    for cat in ("params", "grads", "optimizer"):
        values = [r[cat] / MB for r in sel]
        ax.bar([f"stage {r['stage']}" for r in sel], values, bottom=bottom, color=colors[cat], label=cat)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.scatter([f"stage {r['stage']}" for r in sel], [r["formula"] / MB for r in sel], marker="_", s=900,
               color="k", zorder=3, label="ZeRO formula")
    ax.set_title(f"model state per rank, N = {n}")
    ax.set_ylabel("MB")
_ = axes[0][0].legend()

# %% [markdown]
# Stage 1 removes most of the optimizer's `8 psi`, stage 2 the gradients' `4 psi` too, and
# stage 3 leaves `1/N` of everything. The small excess over the formula is padding (each flat
# buffer is rounded up to a multiple of `N`) and Adam's 4-byte step counter per tensor.
#
# ## 2. Communication per step
#
# The same runs, bytes sent per rank during one step, divided by data parallelism's
# `2 psi (N-1)/N` float32 elements:

# %%
for r in rows:
    print(f"N={r['N']} stage {r['stage']}: {r['sent'] / MB:6.2f} MB sent = "
          f"{r['sent'] / (4 * 2 * r['psi'] * (r['N'] - 1) / r['N']):.3f} x 2 psi (N-1)/N")
fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
for i, n in enumerate(SIZES):
    sel = [r for r in rows if r["N"] == n]
    ax.bar([s + 0.38 * i for s in range(4)], [r["sent"] / MB for r in sel], width=0.36, label=f"N = {n}")
ax.set_xticks([s + 0.19 for s in range(4)], [f"stage {s}" for s in range(4)])
ax.set_ylabel("MB sent per rank per step")
ax.set_title("stage 3 sends 1.5x: the parameters are gathered twice")
_ = ax.legend()

# %% [markdown]
# ## 3. Peak memory during a step
#
# Model state is what stays between steps; the peak also holds activations and, at stage 3,
# the units being gathered (our gathered units are plain tensors, so they count as
# `activations`; FSDP2's are parameters). `MemoryMeter` records the peak of live tensors during
# one training step (batch 4 x 128 tokens per rank), for every stage and for PyTorch's FSDP2
# `fully_shard` (a block per unit, like ours).

# %%
# NBVAL_IGNORE_OUTPUT
def peak_memory():
    from torch.distributed.fsdp import fully_shard

    x = torch.randint(0, 65, (4, 128), generator=torch.Generator().manual_seed(dist.get_rank()))
    out = {}
    for name in ("stage 0", "stage 1", "stage 2", "stage 3", "FSDP2"):
        torch.manual_seed(0)
        module = GPT(GPTConfig.preset("small"))
        if name == "FSDP2":
            for block in module.blocks:
                fully_shard(block)
            fully_shard(module)
            model, optimizer = module, torch.optim.AdamW(module.parameters(), lr=1e-3)
        else:
            model, optimizer = zero(module, torch.optim.AdamW, int(name[-1]), lr=1e-3)
        model(x, x)[1].backward()   # a first step creates the optimizer state
        optimizer.step()
        optimizer.zero_grad()
        with MemoryMeter(x) as meter:
            model(x, x)[1].backward()
            optimizer.step()
            optimizer.zero_grad()
        out[name] = {"peak": meter.peak_bytes, "by_category": meter.peak_by_category}
    return everyone(out)


peaks = workbench.launch(peak_memory, world_size=2)[0]
print("           peak MB per rank   " + "  ".join(f"{c:>11}" for c in peaks[0]["stage 0"]["by_category"]))
for name in peaks[0]:
    p = peaks[0][name]
    print(f"{name:>8}: {p['peak'] / MB:8.1f} " + "  ".join(f"{v / MB:11.1f}" for v in p["by_category"].values()))
rows_mem = [{"strategy": name, "peak_by_category": [peaks[r][name]["by_category"] for r in range(2)]}
            for name in peaks[0]]
fig = plots.memory_breakdown(rows_mem)

# %% [markdown]
# ## 4. Inside ZeRO-3: a timeline of one step
#
# `FullyShardedDataParallel` records, when `model.events` is a list, when each collective was in
# flight (from issue to the end of its wait) and when each block ran forward and backward. Look
# for: the next block's all-gather issued while the current block computes (prefetch); every
# block gathered a second time during backward; each block's reduce-scatter issued as soon as
# backward leaves it, running under the next block's backward.

# %%
# NBVAL_IGNORE_OUTPUT
def fsdp_timeline(steps=3):
    torch.manual_seed(0)
    model, optimizer = zero(GPT(GPTConfig.preset("small")), torch.optim.AdamW, 3, lr=1e-3)
    x = torch.randint(0, 65, (8, 128), generator=torch.Generator().manual_seed(dist.get_rank()))
    for step in range(steps):
        if step == steps - 1:
            dist.barrier()
            model.events = []
        model(x, x)[1].backward()
        optimizer.step()
        optimizer.zero_grad()
    return everyone(model.events)


timeline = workbench.launch(fsdp_timeline, world_size=2)[0]
events = [e for per_rank in timeline for e in per_rank]
fig, ax = plt.subplots(figsize=(11, 3.2), layout="constrained")
_ = plots.timeline(ax, events, title="ZeRO-3, one step of GPT small on 2 ranks: collectives in flight and block compute")

# %% [markdown]
# ## 5. When is ZeRO-3 worth its extra 50%?
#
# The paper's example: 7.5 B parameters on 64 GPUs. The float32 formulas above give per rank
# (the paper, with mixed precision: 2-byte parameters and gradients plus `K = 12` bytes of
# float32 master weights and moments, quotes 120, 31.4, 16.6 and 1.9 GB):

# %%
psi_big, n_big = 7.5e9, 64
for stage in range(4):
    print(f"stage {stage}: {FORMULA[stage](psi_big, n_big) / 1e9:6.1f} GB of model state per GPU")

# %% [markdown]
# Only stage 3 fits that model on a 16 GB card, and only stage 3 keeps shrinking as `N`
# grows: stages 1 and 2 never go below `8 psi` and `4 psi` (mixed precision: `4 psi` and
# `2 psi`). So:
#
# * **If the model state fits with stage 2, use stage 2**: same bytes on the wire as DDP, most
#   of the memory saved, no extra gathers.
# * **Use stage 3 when it does not fit**, or when the memory it frees buys something worth more
#   than 50% more communication: a larger micro-batch (fewer steps, better kernel efficiency)
#   or no activation recomputation.
# * **Stage 3's extra all-gather is cheap when it hides.** A block of `psi_u` parameters computes
#   about `2 psi_u` FLOPs per token forward, and gathering it moves `2 psi_u (N-1)/N` bytes in
#   bf16. The prefetched gather hides behind the previous block's compute when
#   `tokens per rank x 2 psi_u / FLOPS  >=  2 psi_u / bandwidth`, that is when the tokens per
#   rank per step exceed `FLOPS / bandwidth`: about 400e12 / 50e9 = 8000 tokens on an H100
#   with a 400 Gb/s network, about 900 inside an NVLink node (450 GB/s). Below that, ZeRO-3 is
#   communication-bound and its 1.5x shows up in the step time.
#
# `workbench bench zero` measures the step time of stages 0-3 against PyTorch's
# `ZeroRedundancyOptimizer` and FSDP2 on this machine.
#
# ## Check
#
# * model state per rank is within [1.00, 1.05] of the ZeRO formula for every stage at N = 2, 4;
# * bytes sent per step are 1.0x (stages 0-2) and 1.5x (stage 3) of `2 psi (N-1)/N`, within 2%;
# * in the timeline, every block is all-gathered twice and reduce-scattered once per step, and
#   each block's forward starts only after its all-gather finished.

# %%
for r in rows:
    assert 1.0 <= r["total"] / r["formula"] <= 1.05, r
    assert abs(r["sent"] / r["sent_formula"] - 1) <= 0.02, r
for rank_events in timeline:
    blocks = sorted({e["unit"] for e in rank_events if e["unit"] != "root"})
    assert len(blocks) == 4, blocks
    for unit in blocks + ["root"]:
        mine = [e for e in rank_events if e["unit"] == unit]
        assert sum(e["name"] == "all-gather" for e in mine) == 2, (unit, mine)
        assert sum(e["name"] == "reduce-scatter" for e in mine) == 1, (unit, mine)
        if unit != "root":
            gather = min((e for e in mine if e["name"] == "all-gather"), key=lambda e: e["start"])
            forward = next(e for e in mine if e["name"] == "forward")
            assert gather["end"] <= forward["start"] + 1e-4, (unit, gather, forward)
print("check passed: memory matches the ZeRO formulas, stage 3 moves 1.5x, every unit gathered twice")
