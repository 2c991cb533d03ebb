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
# # 00b · Live ranks: a process group you can poke at
#
# Lesson 00 started a fresh group of ranks for one function and got back what they returned. Here
# the ranks stay up between cells, so you can work with them the way you work with any Python
# object: run a cell on every rank, look at each rank's tensors, change something, run the next
# cell on the same live processes (the idea of ipyparallel's `%%px`).
#
# | command | what it does |
# | --- | --- |
# | `%load_ext workbench` | registers the magics |
# | `%ranks start N` | starts N ranks, each in an initialised process group (`--backend`, `--timeout`) |
# | `%%ranks` | runs the cell on every rank (`--ranks 0,2`: on some); output comes back `[rank k]`-prefixed |
# | `%ranks pull NAME` | a list of NAME's value on each rank, into the notebook |
# | `%ranks push NAME` | sends the notebook's NAME to every rank |
# | `%ranks stop` | ends the ranks |
#
# This notebook's script (`00b_live_ranks.py`) also runs under
# `torchrun --standalone --nproc-per-node 2`: there the magic lines are comments, every process is
# a rank and runs the bodies of the `%%ranks` cells itself, and the notebook-only cells are skipped.

# %%
# %load_ext workbench
# %ranks start 2

# %% [markdown]
# ## Every rank runs the cell
#
# Each rank is its own process with its own memory. The cell below runs on both; the names it
# defines (`x`, `rank`) live on each rank separately and are there for the next `%%ranks` cell.
# The value of the last expression is shown per rank, like `Out[...]` in a notebook. (The `if`
# joins the process group when there is none yet, which happens only under torchrun; in the
# notebook `%ranks start` already did.)

# %%
# %%ranks
import atexit

import torch
import torch.distributed as dist
import workbench

if not dist.is_initialized():  # under torchrun (the paired script); %ranks start made it here
    dist.init_process_group("gloo")
    atexit.register(dist.destroy_process_group)
rank = workbench.rank()
x = torch.arange(4.0) + 10 * rank
before = x.clone()
print(f"rank {rank} of {dist.get_world_size()} made its own x")
x

# %% [markdown]
# ## All-reduce, then look at every rank's copy
#
# `all_reduce` sums `x` element-wise over the ranks and leaves the sum *in every rank's own `x`*.
# `%ranks pull x` brings each rank's copy back into the notebook as a list (index = rank), so you
# can check with your own eyes that the copies agree.

# %%
# %%ranks
dist.all_reduce(x)
x

# %% active="ipynb"
# %ranks pull x

# %% active="ipynb"
# import torch
#
# torch.stack(x)  # in the notebook: one row per rank, and the rows are identical

# %% [markdown]
# A figure drawn on a rank is sent back and shown here: each rank plots its `x` before and
# after the all-reduce.

# %%
# %%ranks
import matplotlib.pyplot as plt

fig, ax = plt.subplots(figsize=(4.5, 2.0))
ax.bar(torch.arange(4) - 0.2, before, width=0.4, label="before")
ax.bar(torch.arange(4) + 0.2, x, width=0.4, label="after all_reduce")
ax.set_title(f"rank {rank}: its own copy of x")
ax.legend(loc="upper left", fontsize=8);

# %% [markdown]
# `--ranks` runs a cell on some ranks only. Don't call a collective there: the ranks left out
# would never join it.

# %%
# %%ranks --ranks 0
print("only rank 0 runs this; rank 0's x is", x.tolist())

# %% [markdown]
# ## Break a collective on purpose
#
# Here rank 1 raises before it reaches the all-reduce, so rank 0 would wait for it forever. The
# magic interrupts rank 0, raises `workbench.RankFailed` naming rank 1 with rank 1's own traceback,
# and puts every rank in a fresh process group: the ranks and their names (`x`, `rank`, ...) are
# kept. (A rank that *dies* takes its names with it: then the ranks are restarted, and the message
# says so. A cell still running after `--timeout` seconds raises `workbench.LaunchTimeout` with the
# stack each rank was stuck in.)

# %% tags=["raises-exception"] active="ipynb"
# %%ranks
# if rank == 1:
#     raise ValueError("rank 1 found a NaN in its shard and gave up")
# dist.all_reduce(x)

# %% [markdown]
# The group is still usable, with the names kept: one more all-reduce of the same `x`.

# %%
# %%ranks
dist.all_reduce(x)
x

# %% [markdown]
# ## Check
#
# Every rank holds the same tensor, and it is what two all-reduces make: the first leaves the sum
# S of the ranks' starting copies on every rank, the second sums `world` copies of S. The broken
# cell in between changed nothing.

# %%
# %%ranks
world = dist.get_world_size()
copies = [torch.zeros_like(x) for _ in range(world)]
dist.all_gather(copies, x)
start_sum = sum(torch.arange(4.0) + 10 * r for r in range(world))
assert all(torch.equal(c, copies[0]) for c in copies), "every rank holds the same x"
assert torch.equal(x, start_sum * world), "all_reduce twice: the starting sum, times world"
print("all checks passed")

# %% active="ipynb"
# %ranks stop
