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
# # 10 · Expert parallelism: a mixture of experts, tokens sent to their experts by all-to-all
#
# A mixture-of-experts layer (Shazeer et al. 2017; GShard; Switch; Mixtral, DeepSeek-V3, Llama 4)
# replaces the transformer's MLP by `E` MLPs, the **experts**, and a small **router** that sends
# each token to `k` of them. The model holds `E` times the MLP's parameters but each token pays
# for only `k` MLPs: more parameters for the same compute per token.
#
# **Expert parallelism** spreads the experts over the `P` ranks (`E/P` each) and keeps everything
# else replicated, as data parallelism does. Each rank routes its own tokens; the tokens then
# travel to the ranks holding their experts and back: an **all-to-all** each way (every rank sends
# a different block to every rank), written out in `workbench.comm.all_to_all_single`.
#
# This lesson: the router and top-k; the load-balancing loss and what it does to the experts' load
# over a few hundred steps of tiny Shakespeare; capacity and dropped tokens; the all-to-all's bytes
# against the formula, the hand-written all-to-alls against the native one; memory per rank; and
# parity of expert parallelism with one process.

# %%
import copy

import matplotlib.pyplot as plt
import torch
import torch.distributed as dist

import workbench
from workbench import comm, everyone
from workbench.models.data import CharTokenizer, get_batch, load_corpus
from workbench.models import GPT, FeedForward, GPTConfig
from workbench.models.moe import MoE, capacity
from workbench.parallel.expert import all_to_all_bytes, expert_parallel, full_state_dict, parameters_per_rank

SMOKE = workbench.smoke_test()  # the test suite's quick run: a few training steps, no load claim asserted
torch.set_num_threads(1)  # one intra-op thread, as every rank runs
KiB = 1024

# %% [markdown]
# ## 1. The router and top-k
#
# For `N` tokens `x` (`N x C`), the router is one matrix `W_r` (`C x E`, no bias):
#
# * `probs = softmax(x W_r)` over the `E` experts;
# * each token keeps its `k` largest probabilities, **renormalised** to sum to 1 (its weights);
# * the token's output is the weighted sum of its `k` experts' outputs.
#
# Nothing makes the router spread the tokens evenly: left alone it tends to favour the experts
# that happen to learn first, which then get more tokens and learn faster (the rich get richer).
# Switch and GShard add a **load-balancing loss** `alpha E sum_i f_i P_i`, with `f_i` the fraction
# of the `N k` assignments routed to expert `i` and `P_i` the mean router probability of expert `i`.
# It is smallest, `alpha`, when both are uniform; its gradient flows through `P_i` (the counts are
# not differentiable). With several ranks, `f_i` and `P_i` must come from **every** rank's tokens:
# `sum_i f_i P_i` is not linear in the batch, so the mean of per-rank losses is not the loss of the
# whole batch (the package all-reduces the counts and probability sums first).

# %%
cfg = GPTConfig.preset("tiny", n_embd=32, n_head=2, block_size=32, n_experts=4, top_k=2)
torch.manual_seed(0)
moe = MoE(cfg.n_embd, 4, lambda: FeedForward(cfg), top_k=2)
tokens = torch.randn(12, cfg.n_embd)
probs, weights, experts = moe.route(tokens)
moe(tokens)
f = torch.bincount(experts.flatten(), minlength=4) / (12 * 2)
P = probs.detach().mean(0)
by_hand = 0.01 * 4 * float((f * P).sum())
print("experts of the first 4 tokens:", experts[:4].tolist())
print("tokens per expert (12 tokens x top-2):", moe.tokens_per_expert.tolist())
print(f"load-balancing loss: module {moe.aux_loss.item():.6f}, by hand {by_hand:.6f}, "
      f"|diff| {abs(moe.aux_loss.item() - by_hand):.1e} (alpha = 0.01: uniform gives 0.01)")

# %% [markdown]
# ## 2. What the load-balancing loss does, over a few hundred steps
#
# The same small MoE GPT (one block, 8 experts, top-2) trained on tiny Shakespeare with and
# without the auxiliary loss (`alpha = 0.1`, strong enough to act within a few hundred steps; 0.01
# is Switch's, for runs of many thousands). The figure shows each expert's share of the
# assignments at every step (even load: `1/8` each), and the router's choice for a line of text at
# the end.

# %%
# NBVAL_IGNORE_OUTPUT
STEPS = 20 if SMOKE else 200
E_BAL = 8


def train(alpha: float):
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny", n_layer=1, n_embd=32, n_head=2, block_size=32, n_experts=E_BAL,
                                 top_k=2, aux_loss_coeff=alpha))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    loads = []
    for step in range(STEPS):
        x, y = get_batch("train", 8, 32, step=step)
        _, loss = model(x, y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        t = model.blocks[0].mlp.tokens_per_expert.float()
        loads.append(t / t.sum())
    return model, torch.stack(loads), loss.item()


runs = {alpha: train(alpha) for alpha in (0.0, 0.1)}
last = min(50, STEPS)
imbalance = {alpha: float(loads[-last:].mean(0).max() * E_BAL) for alpha, (_, loads, _) in runs.items()}
fig, axes = plt.subplots(1, 3, figsize=(13, 3.6), layout="constrained")
for ax, (alpha, (_, loads, loss)) in zip(axes, runs.items()):
    ax.stackplot(range(STEPS), loads.T.numpy(), labels=[f"expert {e}" for e in range(E_BAL)])
    ax.set_title(f"alpha = {alpha}: busiest expert {imbalance[alpha]:.2f}x the mean\n"
                 f"(last {last} steps), loss {loss:.2f}", fontsize=9)
    ax.set_xlabel("step")
    ax.set_ylabel("share of the assignments")
    ax.set_ylim(0, 1)
axes[0].legend(fontsize=6, loc="upper right", ncol=2)
text = "To be, or not to be, that is the"
tok = CharTokenizer(load_corpus())
model = runs[0.1][0]
seen = {}
hook = model.blocks[0].mlp.register_forward_pre_hook(lambda m, args: seen.update(x=args[0]))
with torch.no_grad():
    model(torch.tensor([tok.encode(text)]))
    probs_text, _, chosen = model.blocks[0].mlp.route(seen["x"][0])
hook.remove()
axes[2].imshow(probs_text.T.numpy(), aspect="auto", cmap="Blues")
for t in range(len(text)):
    for e in chosen[t].tolist():
        axes[2].plot(t, e, "o", color="#c44e52", ms=3)
axes[2].set_xticks(range(len(text)), list(text), fontsize=7)
axes[2].set_ylabel("expert")
axes[2].set_title("alpha = 0.1: router probabilities per character,\nits top-2 marked", fontsize=9)
print({f"alpha={a}": f"busiest expert {v:.2f}x the mean load" for a, v in imbalance.items()})

# %% [markdown]
# Without the auxiliary loss a few experts take most of the tokens and the others see few;
# with it the shares stay near `1/E` (the loss printed above each panel includes the auxiliary
# term, at least `alpha`).
# With experts on different ranks, imbalance is also a *time* problem: the rank holding the
# busiest expert receives the most rows and every other rank waits for it at the combine.
#
# ## 3. Capacity and dropped tokens
#
# Dropless routing (the default here, and Megablocks') lets an expert take any number of tokens.
# Many implementations instead fix each expert's **capacity** so that buffers have a static shape:
# `C = ceil(N k c / E)` for `N` tokens and a capacity factor `c` (1.0: each expert takes its even
# share). An expert routed more than `C` assignments keeps the `C` with the largest weights and
# drops the rest (Megatron's `moe_token_drop_policy="probs"`): those tokens get nothing from
# that expert (the residual connection carries them on). Dropped assignments:
# `sum_e max(0, n_e - C)` for `n_e` assignments routed to expert `e`. Below, a router skewed
# towards experts 0 and 1, on 64 tokens:

# %%
torch.manual_seed(2)
skewed = MoE(cfg.n_embd, 4, lambda: FeedForward(cfg), top_k=2)
with torch.no_grad():
    skewed.router.weight[0] += 0.1  # tokens with a positive mean (below) score higher on expert 0
x = torch.randn(64, cfg.n_embd) + 0.5
routed = torch.bincount(skewed.route(x)[2].flatten(), minlength=4).tolist()
print("assignments routed per expert:", routed)
drops = []
for c in (0.5, 1.0, 1.25, 2.0):
    skewed.capacity_factor = c
    skewed(x)
    cap = capacity(64, 2, c, 4)
    formula = sum(max(0, n - cap) for n in routed)
    drops.append((c, cap, skewed.dropped, formula))
    print(f"capacity factor {c}: C = ceil(64 x 2 x {c} / 4) = {cap}, dropped {skewed.dropped} "
          f"(formula {formula}), kept per expert {skewed.tokens_per_expert.tolist()}")

# %% [markdown]
# A capacity bounds the work of the busiest expert, but with an uneven router it drops tokens even
# at capacity factor 1.0, while the experts with few tokens sit partly idle: balance first
# (section 2), then a capacity factor a little above 1 catches what is left.
#
# ## 4. Expert parallelism: counts, dispatch, experts, combine
#
# `expert_parallel(model)` keeps experts `[r E/P, (r+1) E/P)` on rank `r` and, in every MoE layer:
#
# 1. **route** this rank's tokens (as one process), rows sorted by expert;
# 2. **counts**: an all-to-all of the `E` per-expert counts, so every rank learns how many rows it
#    will receive from each rank (its receive sizes);
# 3. **dispatch**: `all_to_all_single(rows, input_split_sizes=...)`, rank `j` gets the rows for its
#    experts;
# 4. the local experts run on the rows of every rank;
# 5. **combine**: the reverse all-to-all; each row returns to its token, weighted as on one process.
#
# Backward is the same two all-to-alls reversed. Bytes sent per rank `r`, per layer, per direction
# (`rows_{r->j}` the rows `r` sends to rank `j`, `D` the width, `b` bytes per element):
# `sum_{j != r} rows_{r->j} D b` for the dispatch (its own rows stay home), the rows received for the
# combine, and `(E - E/P) 8` bytes of counts. Under uniform routing a row stays home with probability
# `1/P`, so the expectation is `N k D b (P-1)/P` per direction. Below: 2 ranks, GPT tiny with 4
# experts, top-2, each rank 2 sequences of 32 tokens: one forward counted by `comm.counters()`
# against the formula for the routing that happened, then 3 AdamW steps against one process on the
# whole batch, and the hand-written all-to-alls (pairwise, Bruck) against the native one.

# %%
EP_CFG = GPTConfig.preset("tiny", n_layer=2, n_embd=32, n_head=2, block_size=32, n_experts=4, top_k=2)
ADAMW = dict(lr=3e-3, eps=1e-6)


def ep_rank():
    p, r = dist.get_world_size(), dist.get_rank()
    g = torch.Generator().manual_seed(3)
    batches = [(torch.randint(0, 65, (2 * p, 32), generator=g), torch.randint(0, 65, (2 * p, 32), generator=g))
               for _ in range(3)]
    torch.manual_seed(0)
    single = GPT(EP_CFG)
    model = expert_parallel(copy.deepcopy(single))
    out = {"rank": r, "experts here": sorted(model.blocks[0].mlp.experts, key=int),
           "parameters": sum(q.numel() for q in model.parameters())}
    x, y = batches[0]
    xs, ys = x.chunk(p)[r], y.chunk(p)[r]
    with torch.no_grad(), comm.counters() as c:
        want = model(xs)[0]
    out["rows sent"] = [b.mlp.send_rows for b in model.blocks]
    out["sent"] = c.stats[("all_to_all_single", "native")].bytes_sent
    out["calls"] = c.stats[("all_to_all_single", "native")].calls
    for alg in ("pairwise", "bruck"):
        for b in model.blocks:
            b.mlp.algorithm = alg
        with torch.no_grad(), comm.counters() as c:
            got = model(xs)[0]
        out[alg] = {"diff": (got - want).abs().max().item(), "sent": c.stats[("all_to_all_single", alg)].bytes_sent}
    for b in model.blocks:
        b.mlp.algorithm = "native"
    # parity: 3 AdamW steps, one process on the whole batch against each rank on its share
    opts = [torch.optim.AdamW(m.parameters(), **ADAMW) for m in (single, model)]
    out["losses"] = []
    for x, y in batches:
        pair = []
        for m, o, (xb, yb) in zip((single, model), opts, ((x, y), (x.chunk(p)[r], y.chunk(p)[r]))):
            o.zero_grad()
            _, loss = m(xb, yb)
            loss.backward()
            o.step()
            pair.append(loss.detach().clone())
        comm.all_reduce(pair[1])  # the global batch's loss: the mean of the ranks' (equal shares)
        out["losses"].append((pair[0].item(), pair[1].item() / p))
    full = full_state_dict(model)
    out["same names, same order"] = list(full) == list(single.state_dict())
    out["state diff"] = max((full[k] - v).abs().max().item() for k, v in single.state_dict().items())
    return everyone(out)


ep = workbench.launch(ep_rank, world_size=2)[0]
P_EP, D, L = 2, EP_CFG.n_embd, EP_CFG.n_layer
for out in ep:
    r = out["rank"]
    formula = 0
    for layer in range(L):
        rows = [ep[i]["rows sent"][layer] for i in range(P_EP)]
        formula += sum(s for s, _ in all_to_all_bytes(rows, r, D, 4).values())
    out["formula"] = formula
    uniform = 2 * L * 2 * 32 * 2 * D * 4 * (P_EP - 1) / P_EP + L * (4 - 4 // P_EP) * 8
    print(f"rank {r}: experts {out['experts here']}; rows it sent each rank per layer {out['rows sent']}; "
          f"one forward: {out['calls']} all-to-alls, {out['sent']} B sent, formula {formula} B, "
          f"uniform routing {uniform:.0f} B expected")
    print(f"        pairwise: {out['pairwise']['sent']} B, Bruck: {out['bruck']['sent']} B sent, "
          f"same output as native (|diff| {max(out['pairwise']['diff'], out['bruck']['diff']):.1e})")

# %% [markdown]
# Three all-to-alls per layer forward (counts, dispatch, combine): the counted bytes are exactly the
# formula's, and close to the uniform-routing expectation because the freshly initialised router
# spreads the tokens almost evenly. The pairwise all-to-all sends the same bytes as the native one
# (every byte but the rank's own block leaves once). Bruck's all-to-all sends, with uneven splits,
# a header of row counts in each of its `ceil(lg P)` rounds, and at more than two ranks forwards
# some blocks through intermediate ranks: more bytes for fewer messages, worth it for small
# messages at large `P` (`workbench bench experts` times the three).
#
# ## 5. Parity with one process, and memory per rank
#
# The expert-parallel model trains exactly like one process on the whole batch: every step's loss
# and, after 3 AdamW steps, every parameter (`full_state_dict` gathers the experts under the single
# model's names). Two details make it exact. Replicated parameters are averaged over the ranks, as
# in data parallelism; an expert's gradient already arrives *summed* over every rank's tokens by the
# backward all-to-all, so it is only divided by `P`. And the load-balancing loss uses the global
# counts (section 1).

# %%
for out in ep:
    worst = max(abs(a - b) for a, b in out["losses"])
    print(f"rank {out['rank']}: losses (one process, expert-parallel) "
          f"{[(f'{a:.6f}', f'{b:.6f}') for a, b in out['losses']]}, largest |diff| {worst:.1e}; "
          f"state after 3 steps |diff| {out['state diff']:.1e}, same names in the same order: "
          f"{out['same names, same order']}")

mem_rows = []
for p in (1, 2, 4):
    psi = parameters_per_rank(EP_CFG, p)
    mem_rows.append((p, psi, 16 * psi))
    print(f"P = {p}: {psi:,} parameters per rank ({16 * psi / KiB:.1f} KiB of float32 AdamW state with gradients)"
          + (f", measured {ep[0]['parameters']:,}" if p == P_EP else ""))

# %% [markdown]
# The experts are most of an MoE model's parameters (here `E` MLPs of `8 C^2 + 5 C` per block
# against the attention's `4 C^2 + 4 C`), so sharding them divides most of the memory by `P`; what
# stays replicated (attention, norms, embeddings, routers) sets the floor.
#
# On a mesh, `parallelize(model, Mesh(dp=4, ep=2))` shards the experts over groups of `ep` adjacent
# data-parallel ranks instead of all of them: 4 ranks, two copies of each expert. The copies average
# their gradients with one all-reduce (the ranks holding the same experts), the rest of the model
# over all `dp` ranks; ZeRO-1 shards the optimizer state over each (`zero_stage=1`). A smaller `ep`
# sends the all-to-all over fewer, closer ranks (inside a node) at the price of more copies.
#
# ## Check
#
# * the router's weights sum to 1 per token and the load-balancing loss equals `alpha E sum f_i P_i`;
# * with the auxiliary loss the busiest expert's load is within 1.3x the mean, without it above
#   1.5x, in the last 50 of 200 steps (not asserted in the test suite's short run);
# * dropped assignments equal `sum_e max(0, n_e - C)` at every capacity factor;
# * one forward's all-to-all bytes equal the formula on every rank, pairwise's equal native's,
#   pairwise and Bruck give the same output;
# * expert parallelism's losses and final state equal one process's (1e-5), parameters per rank
#   equal `parameters_per_rank`.

# %%
assert torch.allclose(weights.sum(-1), torch.ones(12), atol=1e-6)
assert abs(moe.aux_loss.item() - by_hand) < 1e-7
if not SMOKE:
    assert imbalance[0.1] < 1.3 < 1.5 < imbalance[0.0], imbalance
for c, cap, dropped, formula in drops:
    assert dropped == formula, (c, cap, dropped, formula)
assert drops[0][2] > drops[-1][2]  # a larger capacity drops fewer
for out in ep:
    assert out["sent"] == out["formula"] and out["pairwise"]["sent"] == out["sent"], out
    assert out["calls"] == 3 * L and out["bruck"]["sent"] >= out["sent"]
    assert out["pairwise"]["diff"] < 1e-6 and out["bruck"]["diff"] < 1e-6
    assert max(abs(a - b) for a, b in out["losses"]) < 1e-5 and out["state diff"] < 1e-5, out
    assert out["same names, same order"] and out["parameters"] == parameters_per_rank(EP_CFG, P_EP)
print("check passed: load balancing, capacity drops, all-to-all bytes = formula, parity with one process")
