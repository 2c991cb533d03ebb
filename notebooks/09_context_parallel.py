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
# # 09 · Context parallelism: one sequence split over several ranks
#
# Data, tensor and pipeline parallelism split the batch, the layers' matrices and the layers. None
# of them splits the **sequence**, and a transformer's activations grow with it: every layer keeps
# `16 s b h` numbers for backward (lesson 04b), and attention computed without a fused kernel keeps
# its `a s^2 b` scores too. Double the context and each layer's activations double, or worse.
#
# **Context parallelism** gives each of `P` ranks `S/P` positions of every sequence. Every
# operation of a layer works token by token except attention, where a query needs every earlier
# key. Two ways to give it them, both in `workbench.parallel.context`:
#
# * **ring attention**: each rank keeps its queries and passes its K/V block round a ring; in `P`
#   steps every block visits every rank, and the partial softmaxes are merged with their
#   log-sum-exp (flash attention's online softmax);
# * **DeepSpeed-Ulysses**: an all-to-all turns "all heads, `S/P` positions" into "`H/P` heads, all
#   positions"; each rank runs ordinary attention on its heads, and an all-to-all turns it back.
#
# This lesson: the two methods drawn below; memory per rank against the sequence length, the
# zigzag layout that balances causal work (counted), the messages of both methods counted against
# their formulas, parity with one process, the ring's timeline, a GPT trained on a
# context-parallel mesh, and when to pick which.

# %%
import json
from pathlib import Path

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist
from matplotlib.patches import Patch
import torch.nn.functional as F

import workbench
from workbench import comm, everyone
from workbench.measure import trace
from workbench.models import GPT, GPTConfig
from workbench.parallel import context as cp
from workbench.parallel.mesh import Mesh, parallelize
from workbench.parallel.recompute import activation_bytes

plt.rcParams["figure.dpi"] = 80  # keeps the stored notebook small
MiB = 2**20
WORLD = 4  # ranks asked for (under torchrun: torchrun's world, 2)


# %%
def draw_methods(p=4):
    """Left: which K/V block each rank holds at each ring step. Right: Ulysses' all-to-all, from
    (all heads, this rank's positions) to (this rank's heads, all positions); H = P heads."""
    colors = plt.get_cmap("tab10")
    fig, axes = plt.subplots(1, 3, figsize=(11, 2.9), layout="constrained")
    def ring_cell(r, j):  # at step j rank r holds the K/V block of rank r - j
        return (r - j) % p, f"K{(r - j) % p}V{(r - j) % p}"

    panels = [(axes[0], "ring: K/V block held at each step", ring_cell, "step"),
              (axes[1], "Ulysses before: all heads, S/P positions", lambda r, j: (r, f"h{j} S{r}"), "head"),
              (axes[2], "Ulysses after: H/P heads, all positions", lambda r, j: (j, f"h{r} S{j}"), "positions")]
    for ax, title, cell, xlabel in panels:
        for r in range(p):
            for j in range(p):
                owner, text = cell(r, j)
                ax.add_patch(plt.Rectangle((j, -r), 0.95, 0.9, color=colors(owner), alpha=0.45))
                ax.text(j + 0.47, -r + 0.45, text, ha="center", va="center", fontsize=8)
        ax.set(xlim=(0, p), ylim=(-p + 1, 1), title=title, xlabel=xlabel)
        ax.set_xticks([j + 0.47 for j in range(p)], [str(j) for j in range(p)] if xlabel != "positions" else
                      [f"S{j}" for j in range(p)])
        ax.set_yticks([-r + 0.45 for r in range(p)], [f"rank {r}" for r in range(p)])
        ax.tick_params(length=0)
    fig.suptitle("colour: the rank whose positions (or K/V block) it is", fontsize=9)
    return fig


_ = draw_methods()

# %% [markdown]
# ## 1. Why long sequences need it: activations per layer against the sequence length
#
# `activation_bytes` (lesson 04b's derivation) gives what one layer of the GPT keeps for backward.
# With context parallelism over `cp` ranks each rank holds `s/cp` positions, so it keeps the same
# layer at `s/cp`; with the *math* attention kernel (this package's ring computes its blocks that
# way) the scores term falls from `a s^2 b` to `a (s/cp)^2 b` per ring step.

# %%
config = GPTConfig.preset("small")  # h = 256, 4 heads
SEQS = [1024, 2048, 4096, 8192]
per_rank = {cp_size: [activation_bytes(config, 1, seq=s // cp_size, kernel="math")["per_layer"] for s in SEQS]
            for cp_size in (1, 2, 4)}
print(f"GPT small (h={config.n_embd}, a={config.n_head}), batch 1, float32: MiB one layer keeps per rank")
print("      s " + "".join(f"   cp={c}" for c in per_rank))
for i, s in enumerate(SEQS):
    print(f"{s:7d} " + "".join(f"{per_rank[c][i] / MiB:8.1f}" for c in per_rank))

fig, ax = plt.subplots(figsize=(6, 3.2), layout="constrained")
for c, values in per_rank.items():
    ax.plot(SEQS, [v / MiB for v in values], "o-", label=f"cp = {c}")
ax.set(xscale="log", yscale="log", xlabel="sequence length s", ylabel="MiB per layer per rank",
       title="activations one layer keeps, per rank (math attention)")
ax.set_xscale("log", base=2)
_ = ax.legend()

# %% [markdown]
# Read the table down a column: doubling `s` more than doubles a layer's activations once the
# `a s^2 b` scores dominate. Across a row, each doubling of `cp` divides them by at least two.
#
# ## 2. Who holds which positions: contiguous and zigzag
#
# Cut the sequence into `P` pieces, rank `r` holding piece `r` (**contiguous**), and a causal
# mask gives rank 0's queries one triangle of keys to look at while the last rank's look at
# almost everything: about `2P - 1` times the work. **Zigzag** cuts it into `2P` chunks and gives
# rank `r` chunks `r` and `2P-1-r`, an early one and a late one, so every rank's queries see the
# same number of keys. `sequence_positions` says which positions a rank holds; the work is counted
# below as unmasked (query, key) pairs, position `q` seeing `q + 1` keys.

# %%
S_PICTURE, S_WORK = 16, 4096


def layouts():
    """Every rank's positions under each layout, and its causal work at S_WORK (unmasked pairs)."""
    out = {}
    for layout in cp.LAYOUTS:
        pos = cp.sequence_positions(S_PICTURE, layout=layout).tolist()
        work = int((cp.sequence_positions(S_WORK, layout=layout) + 1).sum())
        out[layout] = {"positions": pos, "work": work}
    return everyone(out)


held = workbench.launch(layouts, world_size=WORLD)[0]
P = len(held)
for layout in cp.LAYOUTS:
    work = [h[layout]["work"] for h in held]
    print(f"{layout:10s} positions of S={S_PICTURE}: " + "  ".join(f"rank {r}: {h[layout]['positions']}"
                                                                 for r, h in enumerate(held)))
    print(f"{'':10s} causal work at S={S_WORK} (pairs): {work}, max/min = {max(work) / min(work):.3f}")

fig, axes = plt.subplots(1, 2, figsize=(8, 3.8), layout="constrained")
colors = plt.get_cmap("tab10")
for ax, layout in zip(axes, cp.LAYOUTS):
    owner = torch.empty(S_PICTURE, dtype=torch.long)
    for r, h in enumerate(held):
        owner[h[layout]["positions"]] = r
    picture = torch.ones(S_PICTURE, S_PICTURE, 3)
    for q in range(S_PICTURE):
        picture[q, : q + 1] = torch.tensor(colors(int(owner[q]))[:3])  # the keys query q sees, in its rank's colour
    ax.imshow(picture.numpy())
    ax.set(title=f"{layout}: rows = queries, by rank", xlabel="key position", ylabel="query position")
for r in range(P):
    axes[1].plot([], [], "s", color=colors(r), label=f"rank {r}")
_ = axes[1].legend(fontsize=8, loc="upper right")

# %% [markdown]
# Under contiguous the last rank's rows are long and the first rank's short; under zigzag each
# rank owns a short (early) and a long (late) band. The ring skips blocks whose every pair is
# masked, so under contiguous the early ranks finish first and wait for the last.
#
# ## 3. Ring and Ulysses on `P` ranks: parity with one process, and the bytes
#
# Each rank takes its shard of the same `q, k, v` (`shard_sequence`), runs both methods in both
# layouts, forward and backward, and compares its output and the gradients of its `q, k, v`
# shards with `F.scaled_dot_product_attention` on the whole sequence in one process.
# `comm.counters()` counts the bytes each rank sends. The formulas (module docstring), in blocks of
# one rank's K (`B (S/P) H D` floats): the ring sends `2 (P-1)` forward (its K and V block, `P-1`
# hops) and `2 (P-1) + 2P` backward (the blocks again, and the dK/dV sums travelling home);
# Ulysses `4 (P-1)/P` each way (q, k, v in, the output back: every all-to-all keeps `1/P` at home).

# %%
B, H, S, D = 1, 4, 32, 8


def attention_on_ranks():
    g = torch.Generator().manual_seed(0)
    q, k, v, w = (torch.randn(B, H, S, D, generator=g) for _ in range(4))
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    want = F.scaled_dot_product_attention(*ref, is_causal=True)
    (want * w).sum().backward()
    rows = []
    for method in (cp.ring_attention, cp.ulysses_attention):
        for layout in cp.LAYOUTS:
            mine = [cp.shard_sequence(t, layout=layout).requires_grad_() for t in (q, k, v)]
            with comm.counters() as fwd:
                out = method(*mine, is_causal=True, layout=layout)
            with comm.counters() as bwd:
                (out * cp.shard_sequence(w, layout=layout)).sum().backward()
            got = [out] + [t.grad for t in mine]
            expected = [want] + [t.grad for t in ref]
            diff = max((a.detach() - cp.shard_sequence(b.detach(), layout=layout)).abs().max().item()
                       for a, b in zip(got, expected))
            rows.append({"method": method.__name__, "layout": layout, "diff": diff,
                         "fwd": fwd.total_bytes_sent, "bwd": bwd.total_bytes_sent, "msgs": fwd.total_calls})
    return everyone(rows)


ranks = workbench.launch(attention_on_ranks, world_size=WORLD)[0]
P = len(ranks)
block = B * (S // P) * H * D * 4
formula = {"ring_attention": (2 * (P - 1) * block, (2 * (P - 1) + 2 * P) * block),
           "ulysses_attention": (4 * block * (P - 1) // P, 4 * block * (P - 1) // P)}
print(f"P = {P} ranks, B={B} H={H} S={S} D={D}: one block = {block} bytes")
print(f"{'method':18s} {'layout':10s} {'max |diff|':>10s} {'fwd bytes':>9s} {'bwd bytes':>9s}  formula (fwd, bwd)")
for i, row in enumerate(ranks[0]):
    worst = max(r[i]["diff"] for r in ranks)
    same = all((r[i]["fwd"], r[i]["bwd"]) == formula[row["method"]] for r in ranks)
    print(f"{row['method']:18s} {row['layout']:10s} {worst:10.1e} {row['fwd']:9d} {row['bwd']:9d}  "
          f"{formula[row['method']]} {'= on every rank' if same else 'DIFFERS'}")

# %% [markdown]
# Both methods agree with one process to float32 rounding, in both layouts. In bytes, Ulysses'
# forward sends `4 (P-1)/P` blocks where the ring sends `2 (P-1)`: the same at `P = 2`, `P/2`
# times fewer beyond. The ring's bytes, though, travel one block at a time while the next block
# is computed (it posts the next receive and send *before* computing the current block), so on a
# fast link they hide under the attention; Ulysses' all-to-alls sit between the projections and
# the attention, with nothing to hide under.
#
# ## 4. The ring's timeline: the next block travels while this one is computed
#
# `ring_timeline()` records what the ring's forward does on each rank: at each step it *posts*
# the next block's receive and send, *computes* attention against the block it holds, then
# *waits* for the next block to have arrived. When a block's attention takes longer than its
# message, the wait is short: the message travelled during the compute. Two ranks (one core
# each), a longer sequence:

# %%
# NBVAL_IGNORE_OUTPUT
S_TIME = 256 if workbench.smoke_test() else 1024


def ring_steps():
    g = torch.Generator().manual_seed(0)
    q, k, v = (cp.shard_sequence(torch.randn(1, 8, S_TIME, 64, generator=g)) for _ in range(3))
    cp.ring_attention(q, k, v)  # warm-up
    dist.barrier()
    with cp.ring_timeline() as events:
        cp.ring_attention(q, k, v)
    return everyone(events)


timeline = workbench.launch(ring_steps, world_size=2)[0]
origin = min(e[2] for rank in timeline for e in rank)
fig, ax = plt.subplots(figsize=(8, 1.2 + 0.5 * len(timeline)), layout="constrained")
colors = {"post": "#999999", "compute": "#4c72b0", "wait": "#c44e52"}
for r, events in enumerate(timeline):
    for step, what, start, end in events:
        ax.barh(r, 1e3 * (end - start), left=1e3 * (start - origin), color=colors[what], edgecolor="k", lw=0.3)
        if what == "compute":
            ax.text(1e3 * (start + end - 2 * origin) / 2, r, f"step {step}", ha="center", va="center", fontsize=8)
ax.set(yticks=range(len(timeline)), yticklabels=[f"rank {r}" for r in range(len(timeline))], xlabel="ms",
       title=f"ring attention forward, S = {S_TIME}, H = 8, D = 64, {len(timeline)} ranks")
ax.invert_yaxis()
_ = ax.legend(handles=[Patch(color=color, label=what) for what, color in colors.items()], fontsize=8, ncol=3,
              loc="lower right")
for r, events in enumerate(timeline):
    spent = {what: sum(e - s for _, w, s, e in events if w == what) for what in colors}
    print(f"rank {r}: " + ", ".join(f"{what} {1e3 * t:.2f} ms" for what, t in spent.items()))
# the same timeline as a Chrome trace: open it at https://ui.perfetto.dev (or chrome://tracing)
trace_file = trace.export(Path("runs") / "09_context_parallel" / "ring.json", timeline)
print("wrote", trace_file)

# %% [markdown]
# The trace file holds the same events, one rank per row: open it at ui.perfetto.dev (drag the
# file in) or `chrome://tracing` to zoom into a step. Read the red bars against the blue ones: a wait much shorter than the compute before it means
# the block arrived while that compute ran (on a loaded machine a rank may also wait for its
# partner to reach the step). The first step is the rank's own block under the causal mask; a
# later step under zigzag is half a block with no mask (the ring trims each block to the queries
# that see its keys and the keys they see), about half the work.
#
# ## 5. On the model: `Mesh(cp=P)`
#
# `parallelize(model, Mesh(cp=P), cp_method=..., cp_layout=...)` gives each rank its positions of
# every sequence, makes the position embedding read those global positions, and runs every
# attention call through the chosen method; the loss is each rank's mean over its tokens, and the
# gradients are averaged over the ranks (parameters stay replicated). Three AdamW steps of a tiny
# GPT against one process on the same batches:

# %%
TINY = GPTConfig(vocab_size=65, block_size=16, n_layer=2, n_head=4, n_embd=32)


def batches(steps=3):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 65, (4, 16), generator=g), torch.randint(0, 65, (4, 16), generator=g))
            for _ in range(steps)]


def one_process(steps=3):
    torch.manual_seed(0)
    model = GPT(TINY).double()  # float64: AdamW turns float32 rounding in tiny gradients into lr-sized steps
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for x, y in batches(steps):
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def on_the_mesh():
    p = dist.get_world_size()
    out = {}
    for method, layout in (("ring", "zigzag"), ("ulysses", "contiguous")):
        torch.manual_seed(0)
        trained = parallelize(GPT(TINY).double(), Mesh(cp=p), cp_method=method, cp_layout=layout, lr=1e-2)
        out[f"{method}, {layout}"] = [trained.step(x, y).item() for x, y in batches()]
    return out


reference = one_process()
mesh = workbench.launch(on_the_mesh, world_size=WORLD)[0]
print("one process             : " + "  ".join(f"{v:.6f}" for v in reference))
for name, losses in mesh.items():
    print(f"cp={P} {name:19s}: " + "  ".join(f"{v:.6f}" for v in losses)
          + f"   max |diff| {max(abs(a - b) for a, b in zip(losses, reference)):.1e}")

# %% [markdown]
# ## 6. Which one when
#
# * **Ulysses** needs the heads to split: `H % P == 0` (per tensor-parallel rank, `H/t % P`), so
#   it stops at `P = H`; it sends `P/2` times fewer bytes than the ring's forward, in four
#   all-to-alls that cannot overlap the attention; its scores are `B (H/P) S^2` per rank, the
#   whole sequence for its heads.
# * **The ring** works for any number of heads and any `P` (the sequence a multiple of `2P` for
#   zigzag), holds one `(S/P)^2` block of scores at a time, and hides its messages under the
#   blocks' compute when a block's attention takes longer than its message, which long
#   sequences give it.
# * Either way, with a causal mask use **zigzag**: contiguous leaves ranks idle.
#
# Real systems combine them (Ulysses inside a node, a ring across nodes). `workbench bench context`
# times both against one process and against PyTorch's private ring attention over sequence lengths.

# %%
for row in (r for rank in ranks for r in rank):
    assert row["diff"] <= 1e-5, row
    assert (row["fwd"], row["bwd"]) == formula[row["method"]], row
work = {layout: [h[layout]["work"] for h in held] for layout in cp.LAYOUTS}
assert len(set(work["zigzag"])) == 1, work  # zigzag: the same causal work on every rank
c = S_WORK // P  # contiguous: rank r sees r whole blocks and a triangle
assert work["contiguous"] == [r * c * c + c * (c + 1) // 2 for r in range(P)], work
assert max(work["contiguous"]) / min(work["contiguous"]) > 2 * P - 1.1, work
for losses in mesh.values():
    assert max(abs(a - b) for a, b in zip(losses, reference)) <= 1e-5, (losses, reference)
for i in range(len(SEQS)):
    assert per_rank[1][i] >= 2 * per_rank[2][i] >= 4 * per_rank[4][i], per_rank
for events in timeline:  # each step: post the next block, compute this one, wait; the last step computes only
    assert [(s, w) for s, w, _, _ in events] == [(0, "post"), (0, "compute"), (0, "wait"), (1, "compute")], events
traced = [e for e in json.loads(trace_file.read_text())["traceEvents"] if e["ph"] == "X"]
assert len(traced) == sum(len(events) for events in timeline) and {e["pid"] for e in traced} == {0, 1}, traced
print(f"check passed: ring and Ulysses equal one process on {P} ranks, bytes = formulas, zigzag balances "
      "causal work, the cp mesh trains as one process, the trace file holds the ring's timeline")
