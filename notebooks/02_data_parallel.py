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
# # 02 · Data parallelism: DataParallel (threads) against DDP (processes)
#
# **Why data parallelism.** The gradient of a mean loss over a batch is the mean of the
# gradients over its parts. So `n` workers, each holding the whole model, can each take `1/n`
# of the batch, compute their gradient, and average: the result is exactly the big-batch
# gradient, computed `n` times faster (if the averaging is cheap). Two designs:
#
# * `DataParallel`: **one process, one thread per replica.** Each step it scatters the batch,
#   copies the model to every device, runs the replicas in threads, gathers the outputs onto one
#   device and sums the gradients back there.
# * `DistributedDataParallel`: **one process per replica.** The model is copied once; each
#   step only the gradients cross, as an all-reduce.
#
# Both are written out in `workbench.parallel` (`dp.py`, `ddp.py`). On this CPU machine
# `DataParallel(model, device_ids=["cpu"] * n)` gives `n` replicas in `n` threads.

# %%
import copy
import os
import statistics
import threading
import time

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from torch import nn

import workbench
from workbench.memory import MemoryMeter
from workbench.models import GPT, MLP, GPTConfig
from workbench.parallel import DataParallel, DistributedDataParallel

torch.set_num_threads(1)  # one core per replica, whichever design runs it


def everyone(value):
    """Every rank's ``value`` as a list, on every rank (so results[0] is the same everywhere)."""
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


# %% [markdown]
# ## 1. Both give the big-batch gradient
#
# An MLP, a batch of 16. `DataParallel` with 2 replicas and DDP on 2 ranks (8 samples each)
# must both reproduce the gradient of the plain model on all 16 samples.

# %%
torch.manual_seed(0)
model = MLP(width=32, depth=4)
x = torch.randn(16, 32)
reference = copy.deepcopy(model)
reference(x).square().mean().backward()

dp_model = copy.deepcopy(model)
DataParallel(dp_model, device_ids=["cpu", "cpu"])(x).square().mean().backward()
dp_diff = max((a.grad - b.grad).abs().max().item() for a, b in zip(dp_model.parameters(), reference.parameters()))


def ddp_gradients(model, x):
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp = DistributedDataParallel(copy.deepcopy(model))
    shard = x.chunk(world)[rank]
    ddp(shard).square().mean().backward()
    return everyone([p.grad for p in ddp.module.parameters()])[0]


ddp_grads = workbench.launch(ddp_gradients, world_size=2, args=(model, x))[0]
ddp_diff = max((a - b.grad).abs().max().item() for a, b in zip(ddp_grads, reference.parameters()))
print(f"DataParallel (2 threads) matches the big-batch gradient: {dp_diff < 1e-6}")
print(f"DDP (2 processes) matches the big-batch gradient:       {ddp_diff < 1e-6}")

# %% [markdown]
# ## 2. Throughput against the number of replicas, and the GIL
#
# Two models, same question: how many samples per second does a training step (forward and
# backward) process with 1 and 2 replicas? Each replica always gets the same batch (weak scaling:
# the global batch grows with the replicas), so perfect scaling doubles the samples per second.
#
# * **compute-bound**: 4 layers of 512 x 512, 128 samples per replica. Each matrix product is
#   big, and PyTorch releases the GIL inside it, so two threads can compute at once.
# * **Python-bound**: 64 layers of 8 x 8, 32 samples per replica. Each operator is a few
#   microseconds of arithmetic and much more of Python (module calls, autograd bookkeeping), and
#   Python runs one thread at a time under the GIL. DataParallel adds its own Python per step:
#   replicating 128 parameters, starting threads, gathering.
#
# DDP runs the same work in separate processes, each with its own interpreter (and GIL).

# %%
# NBVAL_IGNORE_OUTPUT
MODELS = {"compute-bound": (lambda: MLP(width=512, depth=4), 128, 512),  # (model, batch per replica, width)
          "Python-bound": (lambda: MLP(width=8, depth=64), 32, 8)}
REPLICAS = (1, 2)


def seconds_per_step(step, steps=10, repeats=7):
    step()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - start) / steps)
    return statistics.median(times)


def dp_throughput(name, n):
    make, batch, width = MODELS[name]
    torch.manual_seed(0)
    dp = DataParallel(make(), device_ids=["cpu"] * n)
    x = torch.randn(batch * n, width)

    def step():
        dp(x).square().mean().backward()
    return batch * n / seconds_per_step(step)


def ddp_throughput(name):
    make, batch, width = MODELS[name]
    torch.manual_seed(0)
    world = dist.get_world_size()
    ddp = DistributedDataParallel(make())
    x = torch.randn(batch, width)

    def step():
        ddp(x).square().mean().backward()
    seconds = torch.tensor(seconds_per_step(step))
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)  # the step ends when the slowest rank ends
    return everyone((world, batch * world / seconds.item()))[0]


throughput = {}
for name in MODELS:
    for n in REPLICAS:
        throughput[("DataParallel", name, n)] = dp_throughput(name, n)
        world, samples_per_s = workbench.launch(ddp_throughput, world_size=n, args=(name,))[0]
        throughput[("DDP", name, world)] = samples_per_s

fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), layout="constrained")
for ax, name in zip(axes, MODELS):
    for design, color in (("DataParallel", "C0"), ("DDP", "C1")):
        ns = [n for n in REPLICAS if (design, name, n) in throughput]
        ax.plot(ns, [throughput[(design, name, n)] for n in ns], "o-", color=color, label=design)
    base = throughput[("DDP", name, 1)] if ("DDP", name, 1) in throughput else throughput[("DataParallel", name, 1)]
    ax.plot(REPLICAS, [base * n for n in REPLICAS], ":", color="gray", label="perfect scaling")
    ax.set_xticks(REPLICAS)
    ax.set_xlabel("replicas (threads or processes)")
    ax.set_ylabel("samples / s")
    ax.set_title(name)
    ax.legend(fontsize=8)
fig.suptitle("Throughput of one training step on 2 CPU cores (median of 7; noisy if the machine is busy)")
for (design, name, n), value in sorted(throughput.items()):
    print(f"{design:>12} {name:>13} x{n}: {value:9.0f} samples/s")
print("load average while measuring (1, 5, 15 min): %.1f %.1f %.1f on %d cores" % (*os.getloadavg(), os.cpu_count()))

# %% [markdown]
# What to look for. On the Python-bound model DataParallel's second thread buys nothing: it
# waits for the GIL, and replicating 128 parameters every step adds more Python, so the two
# threads together are *slower* than one. A second DDP process runs its own interpreter and can
# use the second core. On the compute-bound model both designs can gain, DataParallel because the
# matrix products release the GIL. Two replicas can only scale if two cores are free: the load
# average printed above says how busy the machine was (the stored run was made while other jobs
# shared the 2 cores, which flattens every curve; run it on an idle machine to see the gap).
#
# ## 3. Memory per device: the output device carries more
#
# A GPT with a 2048-token vocabulary, batch 16 of 64 tokens, two replicas. We measure, per
# device (DataParallel) or rank (DDP): the parameters it holds, the gradients, the activations
# of its forward (with `workbench.memory.MemoryMeter`, inside each replica's own thread), and the
# outputs gathered onto it. DataParallel's output device holds the original model, all the
# gradients (replicate's backward sums them there) and the logits of the *whole* batch; the other
# device holds a fresh copy of the parameters every step. A DDP rank holds its model, its
# gradients and its half of the activations, and every rank looks the same.

# %%
CONFIG = GPTConfig.preset("tiny", vocab_size=2048)
BATCH = 16


class Metered(nn.Module):
    """Runs ``inner`` under a MemoryMeter and files the peak under the running thread's name."""

    def __init__(self, inner, log):
        super().__init__()
        self.inner, self.log = inner, log

    def forward(self, *args):
        with MemoryMeter(device="cpu") as meter:
            out = self.inner(*args)
        self.log[threading.current_thread().name] = meter.peak_by_category["activations"]
        return out


def nbytes(tensors):
    seen = {}
    for t in tensors:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


torch.manual_seed(0)
idx = torch.randint(0, CONFIG.vocab_size, (BATCH, CONFIG.block_size))
gpt = GPT(CONFIG)
log = {}
dp = DataParallel(Metered(gpt, log), device_ids=["cpu", "cpu"])
from workbench.parallel.dp import replicate  # noqa: E402 - to look at one step's replicas

replica_1 = replicate(gpt, [torch.device("cpu")] * 2)[1]
param_copy_bytes = nbytes(replica_1.parameters())  # storage that is not the original's
logits, losses = dp(idx, idx)
losses.mean().backward()
P = nbytes(gpt.parameters())
memory = {
    "DP device 0 (output)": {"params": P, "grads": nbytes(p.grad for p in gpt.parameters()),
                             "activations": log["dp-replica-0"],
                             "gathered outputs": logits.numel() * logits.element_size()},
    "DP device 1": {"params": param_copy_bytes, "grads": 0, "activations": log["dp-replica-1"],
                    "gathered outputs": 0},
}


def ddp_memory():
    rank = dist.get_rank()
    torch.manual_seed(0)
    mlog = {}
    ddp = DistributedDataParallel(Metered(GPT(CONFIG), mlog))
    shard = idx.chunk(dist.get_world_size())[rank]
    _, loss = ddp(shard, shard)
    loss.backward()
    m = ddp.module.inner
    return everyone({"params": nbytes(m.parameters()), "grads": nbytes(p.grad for p in m.parameters()),
                     "activations": next(iter(mlog.values())), "gathered outputs": 0})


for rank, row in enumerate(workbench.launch(ddp_memory, world_size=2)[0]):
    memory[f"DDP rank {rank}"] = row

# %%
# NBVAL_IGNORE_OUTPUT
CATS = ("params", "grads", "activations", "gathered outputs")
fig, ax = plt.subplots(figsize=(7, 3.4), layout="constrained")
left = [0.0] * len(memory)
for cat, color in zip(CATS, ("#4c72b0", "#dd8452", "#c44e52", "#8172b3")):
    values = [row[cat] / 2**20 for row in memory.values()]
    ax.barh(list(memory)[::-1], values[::-1], left=left[::-1], color=color, label=cat)
    left = [a + b for a, b in zip(left, values)]
ax.set_xlabel("MiB")
ax.set_title("Memory per device / rank (GPT, vocab 2048, batch 16 x 64, 2 replicas)")
ax.legend(fontsize=8)
for name, row in memory.items():
    print(f"{name:>22}: " + ", ".join(f"{c} {row[c] / 2**20:5.2f} MiB" for c in CATS))

# %% [markdown]
# ## Check
#
# * both designs give the big-batch gradient;
# * DataParallel's output device holds more than the other device, by at least the gathered
#   logits of the whole batch, and more than a DDP rank; DDP ranks hold the same;
# * on the Python-bound model, a second DataParallel thread does not come near doubling
#   throughput (the GIL): less than 1.5x.

# %%
assert dp_diff < 1e-6 and ddp_diff < 1e-6, (dp_diff, ddp_diff)
total = {name: sum(row.values()) for name, row in memory.items()}
gathered = memory["DP device 0 (output)"]["gathered outputs"]
assert total["DP device 0 (output)"] >= total["DP device 1"] + gathered, total
assert total["DP device 0 (output)"] > total["DDP rank 0"], total
assert memory["DDP rank 0"] == memory["DDP rank 1"], memory
gil_speedup = throughput[("DataParallel", "Python-bound", 2)] / throughput[("DataParallel", "Python-bound", 1)]
assert gil_speedup < 1.5, gil_speedup
print("check passed: same gradients; the output device carries the gathered outputs; threads do not scale "
      "a Python-bound model")
