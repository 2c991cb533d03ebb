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
# # 03 · Inside DDP: buckets, overlap and `no_sync`
#
# DistributedDataParallel keeps one full replica per rank and, after every backward, replaces
# each gradient by its average over the ranks: an all-reduce of `4 psi` bytes per step. *When*
# those bytes move decides how much they cost:
#
# * **Buckets.** Gradients are grouped, in reverse parameter order (the order backward produces
#   them), into flat buffers of about `bucket_cap_mb` MB; one all-reduce per bucket. Small
#   buckets pay the latency `alpha` many times; one huge bucket cannot start before backward ends.
# * **Overlap.** A bucket's all-reduce starts, asynchronously, from an autograd hook the moment
#   its last gradient is ready, while backward keeps computing the earlier layers.
# * **`no_sync()`.** With gradient accumulation, only the last micro-batch needs the average:
#   the others skip communication entirely.
#
# Everything below runs `workbench.parallel.DistributedDataParallel` (our implementation, which
# talks through `workbench.comm`) on 2 ranks.

# %%
import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import workbench
from workbench import comm, plots
from workbench.bench import _common
from workbench.models import MLP
from workbench.parallel import DistributedDataParallel

WORLD = 2


def everyone(value):
    """The list of every rank's ``value``, on every rank (so results[0] holds all of it)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# %% [markdown]
# ## 1. The buckets
#
# An MLP of 8 layers of 512 x 512 (2.1 M parameters, 8.4 MB of gradients) with a 1 MB cap.
# Bucket 0 holds the *last* layer: its gradient is the first one backward produces.

# %%
def bucket_layout():
    torch.manual_seed(0)
    ddp = DistributedDataParallel(MLP(width=512, depth=8), bucket_cap_mb=1)
    return everyone([(b.index, b.names, b.nbytes) for b in ddp.buckets])[0]


layout = workbench.launch(bucket_layout, world_size=WORLD)[0]
for index, names, nbytes in layout:
    print(f"bucket {index}: {nbytes / 2**20:5.2f} MB  {', '.join(names)}")

# %% [markdown]
# ## 2. A timeline of one step
#
# Each rank trains a few steps and keeps, per bucket, when its last gradient was ready and when
# its all-reduce started and ended. The chart shows the last step: the `backward` bar is the
# autograd engine computing gradients, the `all-reduce` bars are the buckets in flight. The
# first buckets run *under* the backward bar (hidden), the last one after it (exposed). An
# all-reduce is a meeting point: it cannot finish before the slowest rank has joined it, so a
# rank that reaches backward early (rank skew) sees its first buckets take longer, waiting.
# (End times are stamped when a hook or the final wait first sees the bucket done, so a bar may
# end a little late.)

# %%
# NBVAL_IGNORE_OUTPUT
def timeline_run(overlap=True, steps=4):
    torch.manual_seed(0)
    ddp = DistributedDataParallel(MLP(width=512, depth=8), bucket_cap_mb=1, overlap=overlap)
    opt = torch.optim.SGD(ddp.parameters(), lr=1e-3)
    x = torch.randn(32, 512)
    for _ in range(steps):
        ddp(x).square().mean().backward()
        opt.step()
        opt.zero_grad()
    dist.barrier()
    return everyone({"events": ddp.timeline_events(steps=1), "record": ddp.events[-1],
                     "hidden": ddp.hidden_communication_fraction()})


runs = {overlap: workbench.launch(timeline_run, world_size=WORLD, kwargs={"overlap": overlap})[0]
        for overlap in (True, False)}
fig, axes = plt.subplots(2, 1, figsize=(10, 5.5), layout="constrained")
for ax, overlap in zip(axes, (True, False)):
    events = [e for rank_data in runs[overlap] for e in rank_data["events"]]
    hidden = sum(r["hidden"] for r in runs[overlap]) / WORLD
    plots.timeline(ax, events, title=f"overlap={overlap}: {hidden:.0%} of all-reduce time hidden behind backward")

# %% [markdown]
# ## 3. Step time against bucket size
#
# The same model, wider (8 x Linear(1024, 1024), 33.5 MB of gradients, batch 32 per rank), with
# bucket caps from "one all-reduce per parameter" (0) to 100 MB, and with overlap switched off.
# Candidates take turns inside each trial (interleaved), and we plot the median. On 2 CPU cores
# the all-reduce thread competes with backward for the same core, so overlap helps less than on
# a GPU, where communication has its own engine; the numbers also move with whatever else runs.

# %%
# NBVAL_IGNORE_OUTPUT
CAPS = [0, 0.25, 1, 5, 25, 100]


def sweep(trials=5, steps=3):
    torch.manual_seed(0)
    base = MLP(width=1024, depth=8)
    x = torch.randn(32, 1024)
    names = [f"cap={c}" for c in CAPS] + ["cap=25, no overlap"]
    models = {n: DistributedDataParallel(MLP(width=1024, depth=8), bucket_cap_mb=c)
              for n, c in zip(names, CAPS)}
    models["cap=25, no overlap"] = DistributedDataParallel(MLP(width=1024, depth=8), overlap=False)
    for m in models.values():
        m.module.load_state_dict(base.state_dict())

    def step(name):
        models[name](x).square().mean().backward()
        for p in models[name].parameters():
            p.grad = None

    for n in names:
        step(n)  # warm-up
    samples = _common.interleaved_trials(
        names, trials, lambda n: _common.max_over_ranks(_common.timed(lambda: step(n), steps)))
    buckets = {n: len(m.buckets) for n, m in models.items()}
    return everyone({n: (1e3 * _common.median(samples[n]), buckets[n]) for n in names})[0]


times = workbench.launch(sweep, world_size=WORLD)[0]
for name, (ms, nb) in times.items():
    print(f"{name:>20}: {nb:3d} buckets, {ms:6.1f} ms per forward+backward")
fig, ax = plt.subplots(figsize=(6, 3.5), layout="constrained")
xs = [max(c, 0.1) for c in CAPS]
ax.plot(xs, [times[f"cap={c}"][0] for c in CAPS], "o-", label="overlap=True")
ax.axhline(times["cap=25, no overlap"][0], color="C3", ls="--", label="cap=25, overlap=False")
ax.set_xscale("log")
ax.set_xticks(xs, ["per param"] + [str(c) for c in CAPS[1:]])
ax.set_xlabel("bucket_cap_mb")
ax.set_ylabel("ms per step (median)")
ax.set_title("DDP step time against bucket size (2 ranks, 33.5 MB of gradients)")
_ = ax.legend()

# %% [markdown]
# ## 4. Gradient accumulation with `no_sync`
#
# Four micro-batches of 8 per rank. Inside `no_sync()` backward only accumulates into the
# buckets; the last backward, outside it, all-reduces the sum once. The result must equal one
# backward over the whole batch of 4 x 8 x 2 samples (with the loss scaled to match), and the
# counters of `workbench.comm` show the communication saved.

# %%
def accumulate(micro_batches=4):
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(0)
    model = MLP(width=64, depth=4)
    reference = MLP(width=64, depth=4)
    reference.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, bucket_cap_mb=0.01)
    g = torch.Generator().manual_seed(1)
    data = torch.randn(micro_batches, world, 8, 64, generator=g)  # [micro-batch, rank, sample, feature]
    calls = {}
    for use_no_sync in (True, False):
        model.zero_grad()
        with comm.counters() as c:
            for m in range(micro_batches):
                last = m == micro_batches - 1
                if use_no_sync and not last:
                    with ddp.no_sync():
                        (ddp(data[m, rank]).square().mean() / micro_batches).backward()
                else:
                    (ddp(data[m, rank]).square().mean() / micro_batches).backward()
        calls[use_no_sync] = c.stats[("all_reduce", "native")].calls
        if use_no_sync:
            accumulated = [p.grad.clone() for p in model.parameters()]
    reference(data.reshape(-1, 64)).square().mean().backward()  # one big batch, one process
    diff = max((a - p.grad).abs().max().item() for a, p in zip(accumulated, reference.parameters()))
    return everyone({"diff": diff, "calls_no_sync": calls[True], "calls_every_step": calls[False],
                     "buckets": len(ddp.buckets)})[0]


acc = workbench.launch(accumulate, world_size=WORLD)[0]
print(f"{acc['buckets']} buckets; all-reduce calls over 4 micro-batches: "
      f"{acc['calls_no_sync']} with no_sync, {acc['calls_every_step']} without")
print(f"max |accumulated gradient - big-batch gradient| < 1e-6: {acc['diff'] < 1e-6}")

# %% [markdown]
# ## Check
#
# * every bucket's all-reduce starts once its gradients are ready and ends after it starts;
#   with overlap the first bucket starts *before* backward ends, without overlap none does;
# * `no_sync` accumulation equals big-batch training and communicates once instead of 4 times.

# %%
for overlap, per_rank in runs.items():
    for record in (r["record"] for r in per_rank):
        bks = record["buckets"]
        assert all(b["ready"] <= b["start"] <= b["end"] for b in bks), bks
        if overlap:
            assert bks[0]["start"] < record["backward_end"], "overlap: bucket 0 should start inside backward"
        else:
            assert all(b["start"] >= record["backward_end"] for b in bks), "no overlap: all after backward"
assert acc["diff"] < 1e-6, acc
assert acc["calls_no_sync"] == acc["buckets"] and acc["calls_every_step"] == 4 * acc["buckets"], acc
print("check passed: buckets overlap backward, no_sync equals big-batch training at 1/4 of the all-reduces")
