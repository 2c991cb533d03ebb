"""Mixture of experts (workbench.models.moe) and expert parallelism (workbench.parallel.expert).

One process: the router's weights, dropless routing, capacity drops by weight, the load-balancing
loss by hand, the GPT's loss, bad configurations. Two ranks, ONE launch running every check:
3 AdamW steps of an expert-parallel tiny GPT (4 experts, 2 per rank) on the global batch split
over the ranks, every step's loss and the full state against one process on the whole batch; the
all-to-all bytes counted against the docstring's formula for the routing that happened; the
hand-written all-to-alls give the same forward; bad input refused before any message; and
``parallelize`` on ``Mesh(dp=2, ep=2)`` and ``Mesh(dp=2)`` (experts replicated, ZeRO 0 and 3) against
the same one process. Four ranks, one launch: ``Mesh(dp=4, ep=2)`` (two copies of each expert) with
ZeRO 0 and 1 against one process, its groups, and the mesh's bad input before any message.
"""
from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import workbench
from workbench import comm
from workbench.models import GPT, FeedForward, GPTConfig
from workbench.models.moe import MoE, capacity
from workbench.parallel.expert import all_to_all_bytes, expert_parallel, full_state_dict, parameters_per_rank
from workbench.parallel.mesh import Mesh, parallelize

E, K = 4, 2
STEPS, B, T = 3, 4, 16  # global batch B sequences of T tokens
# eps 1e-6: a gradient that is zero but for rounding (the key bias of attention) is not blown up to
# lr-sized updates in random directions, as Adam's default 1e-8 would (as in test_ddp.py)
ADAMW = dict(lr=3e-3, eps=1e-6)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """One intra-op thread, as every rank runs (docs/design.md): tiny matrices gain nothing from two, and on
    a loaded 2-core machine two threads spinning for each other made the reference 10x slower."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _tiny(**kw) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset("tiny", n_experts=E, top_k=K, **kw))


def _by_hand(moe: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """y[t] = sum over t's kept assignments of weight * expert(x[t]), one token at a time."""
    _, weights, experts = moe.route(x)
    y = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(moe.top_k):
            if keep is None or keep[t, j]:
                y[t] += weights[t, j] * moe.experts[str(int(experts[t, j]))](x[t:t + 1])[0]
    return y


# ----------------------------------------------------------------------------------- one process

def test_router_dropless_output_and_aux_loss_by_hand():
    model = _tiny()
    moe = model.blocks[0].mlp
    assert isinstance(moe, MoE) and sorted(moe.experts) == ["0", "1", "2", "3"]
    assert moe.experts["0"].c_fc.weight.shape == model.blocks[0].mlp.experts["3"].c_fc.weight.shape == (256, 64)
    torch.manual_seed(1)
    x = torch.randn(24, 64)
    probs, weights, experts = moe.route(x)
    assert torch.allclose(weights.sum(-1), torch.ones(24), atol=1e-6)  # renormalised over the k
    assert torch.equal(experts, probs.topk(K, dim=-1).indices)
    assert all(len(set(row.tolist())) == K for row in experts)
    y = moe(x)
    assert moe.dropped == 0 and int(moe.tokens_per_expert.sum()) == 24 * K  # dropless keeps every assignment
    assert torch.equal(moe.tokens_per_expert, torch.bincount(experts.flatten(), minlength=E))
    assert (y - _by_hand(moe, x)).abs().max() < 1e-6
    f = torch.tensor([(experts == i).sum().item() / (24 * K) for i in range(E)])
    P = probs.detach().mean(0)
    assert abs(moe.aux_loss.detach().item() - 0.01 * E * float((f * P).sum())) < 1e-7
    # the GPT's loss: cross-entropy + the layers' auxiliary losses
    idx = torch.randint(0, 65, (2, 16))
    logits, loss = model(idx, idx)
    ce = F.cross_entropy(logits.reshape(-1, 65), idx.reshape(-1))
    aux = sum(b.mlp.aux_loss for b in model.blocks)
    assert 0.01 * 0.99 < aux.item() / 4 < 0.01 * 1.5  # near-uniform routing at init: about alpha per layer
    assert torch.allclose(loss, ce + aux)
    loss.backward()
    assert all(q.grad is not None for q in model.parameters())


def test_capacity_drops_the_smallest_weights_and_counts_them():
    torch.manual_seed(2)
    cfg = GPTConfig.preset("tiny", n_experts=E, top_k=K)
    moe = MoE(64, E, lambda: FeedForward(cfg), top_k=K, capacity_factor=0.5)
    with torch.no_grad():
        moe.router.weight[0] += 0.5  # skew the router: expert 0 is popular
    x = torch.randn(32, 64)
    cap = capacity(32, K, 0.5, E)
    assert cap == math.ceil(32 * K * 0.5 / E) == 8
    _, weights, experts = moe.route(x)
    keep = moe.keep_within_capacity(weights, experts)
    y = moe(x)
    routed = torch.bincount(experts.flatten(), minlength=E)
    assert routed.max() > cap  # the test drops something
    assert moe.dropped == int(sum(max(0, int(n) - cap) for n in routed)) == int((~keep).sum())
    assert torch.equal(moe.tokens_per_expert, torch.clamp(routed, max=cap))
    for e in range(E):
        mine = experts == e
        kept, dropped = weights[mine & keep], weights[mine & ~keep]
        if dropped.numel():
            assert kept.min() >= dropped.max()  # the lowest-probability assignments go
    assert (y - _by_hand(moe, x, keep)).abs().max() < 1e-6
    assert moe(x).shape == x.shape
    # the loss counts the router's choice, before the drops
    probs = moe.route(x)[0].detach()
    by_choice = 0.01 * E * float((routed / (32 * K) * probs.mean(0)).sum())
    assert abs(moe.aux_loss.detach().item() - by_choice) < 1e-7


def test_dense_default_unchanged_and_bad_configurations():
    c = GPTConfig.preset("tiny")
    assert (c.n_experts, c.top_k, c.capacity_factor, c.aux_loss_coeff) == (0, 2, None, 0.01)
    assert type(GPT(c).blocks[0].mlp) is FeedForward
    for kw, name in [(dict(n_experts=2, top_k=3), "top_k=3"), (dict(n_experts=4, capacity_factor=0), "capacity_factor=0"),
                     (dict(n_experts=4, capacity_factor=-1.0), "capacity_factor=-1.0"), (dict(n_experts=-1), "n_experts=-1"),
                     (dict(n_experts=4, top_k=0), "top_k=0"), (dict(n_experts=4, aux_loss_coeff=-0.1), "aux_loss_coeff")]:
        with pytest.raises(ValueError, match=name):
            GPTConfig.preset("tiny", **kw)
    with pytest.raises(ValueError, match="top_k=5"):
        MoE(8, 4, lambda: torch.nn.Linear(8, 8), top_k=5)


# ------------------------------------------------------------------------ expert parallelism, P = 2

def _batch():
    g = torch.Generator().manual_seed(3)
    return torch.randint(0, 65, (B, T), generator=g), torch.randint(0, 65, (B, T), generator=g)


@functools.lru_cache(maxsize=1)
def _single_process() -> tuple[list[float], dict]:
    model = _tiny()
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    x, y = _batch()
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        _, loss = model(x, y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model.state_dict()


def _ep_rank() -> dict:
    p, r = dist.get_world_size(), dist.get_rank()
    out: dict = {"bad": {}}
    # bad input first: each refused with a ValueError naming the argument, before any message
    with comm.counters() as before:
        for text, call in [("n_experts=3", lambda: expert_parallel(GPT(GPTConfig.preset("tiny", n_experts=3)))),
                           ("algorithm='tree'", lambda: expert_parallel(_tiny(), algorithm="tree")),
                           ("no mixture-of-experts", lambda: expert_parallel(GPT(GPTConfig.preset("tiny"))))]:
            try:
                call()
                out["bad"][text] = "no error"
            except ValueError as e:
                out["bad"][text] = "ok" if text in str(e) else str(e)
    out["messages_before"] = sum(s.calls for s in before.stats.values())

    model = expert_parallel(_tiny())
    out["experts"] = sorted(model.blocks[0].mlp.experts)
    out["parameters"] = sum(q.numel() for q in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    x, y = _batch()
    share = B // p
    xs, ys = x[r * share:(r + 1) * share], y[r * share:(r + 1) * share]
    losses = []
    for step in range(STEPS):
        opt.zero_grad()
        with comm.counters() as fwd:
            _, loss = model(xs, ys)
        with comm.counters() as bwd:
            loss.backward()
        opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)  # the global batch's mean loss: the mean of the ranks' (equal shares)
        losses.append(total.item() / p)
        if step == 0:
            out["counts"] = [b.mlp.tokens_per_expert.tolist() for b in model.blocks]
            out["fwd"], out["bwd"] = fwd.as_dict(), bwd.as_dict()
    out["losses"] = losses
    out["state"] = full_state_dict(model)
    out["mesh"] = {"ep=2": _on_mesh(Mesh(dp=p, ep=2)), "ep=1": _on_mesh(Mesh(dp=p)),
                   "ep=1, ZeRO-3": _on_mesh(Mesh(dp=p), zero_stage=3)}  # experts replicated: FSDP over dp
    # the hand-written all-to-alls route the same tokens to the same experts: the same forward
    with torch.no_grad():
        want = model(xs)[0]
        for alg in ("pairwise", "bruck"):
            for b in model.blocks:
                b.mlp.algorithm = alg
            out[f"max_diff_{alg}"] = (model(xs)[0] - want).abs().max().item()
    return out


def _on_mesh(mesh: Mesh, zero_stage: int = 0) -> tuple[list[float], dict, list[str]]:
    """``parallelize(_tiny(), mesh)`` trained STEPS steps on the global batch: its losses, its full
    state and the experts of block 0 this rank holds."""
    model = parallelize(_tiny(), mesh, zero_stage=zero_stage, **ADAMW)
    x, y = _batch()
    losses = [model.step(x, y).item() for _ in range(STEPS)]
    return losses, model.full_state_dict(), list(model._stage_module.blocks[0].mlp.experts)


def _same_as_one_process(losses, state, reference) -> None:
    ref_losses, ref_state = reference
    assert max(abs(a - b) for a, b in zip(losses, ref_losses)) < 1e-5, (losses, ref_losses)
    assert list(state) == list(ref_state)  # the single model's names, in its order
    worst = max((state[k] - v).abs().max().item() for k, v in ref_state.items())
    assert worst < 1e-5, worst


def test_expert_parallel_matches_one_process_and_counts_its_bytes():
    p, D, L = 2, 64, 4  # ranks, n_embd, layers
    res = workbench.launch(_ep_rank, world_size=p, timeout=120)
    losses, state = _single_process()
    for r, out in enumerate(res):
        assert all(v == "ok" for v in out["bad"].values()), out["bad"]
        assert out["messages_before"] == 0
        assert out["experts"] == [str(2 * r), str(2 * r + 1)]
        cfg = GPTConfig.preset("tiny", n_experts=E, top_k=K)
        assert out["parameters"] == parameters_per_rank(cfg, p) == _tiny().num_parameters() - 4 * 2 * (8 * D * D + 5 * D)
        assert max(abs(a - b) for a, b in zip(out["losses"], losses)) < 1e-5, (out["losses"], losses)
        assert list(out["state"]) == list(state)  # the single model's names, in its order
        worst = max((out["state"][k] - v).abs().max().item() for k, v in state.items())
        assert worst < 1e-5, worst
        assert out["max_diff_pairwise"] < 1e-6 and out["max_diff_bruck"] < 1e-6
        for mesh, (mesh_losses, mesh_state, experts) in out["mesh"].items():  # parallelize(..., Mesh(dp=2, ep=...))
            _same_as_one_process(mesh_losses, mesh_state, (losses, state))
            if mesh != "ep=1, ZeRO-3":  # (FSDP's flat shards hold no experts by name)
                assert experts == ([str(2 * r), str(2 * r + 1)] if mesh == "ep=2" else ["0", "1", "2", "3"])
    # bytes: from the routing that happened (rows[i][j]: rows rank i sent rank j's experts, per layer)
    for r, out in enumerate(res):
        sent = received = 0
        for layer in range(L):
            rows = [[sum(res[i]["counts"][layer][2 * j:2 * j + 2]) for j in range(p)] for i in range(p)]
            want = all_to_all_bytes(rows, r, D, E)
            assert want["dispatch"][0] == sum(rows[r][j] for j in range(p) if j != r) * D * 4
            sent += sum(s for s, _ in want.values())
            received += sum(v for _, v in want.values())
        fwd, bwd = out["fwd"]["all_to_all_single/native"], out["bwd"]["all_to_all_single/native"]
        assert (fwd["calls"], fwd["bytes_sent"], fwd["bytes_received"]) == (3 * L, sent, received)
        counts = (E - E // p) * 8 * L  # no count exchange backward, and the dispatch/combine reversed
        assert (bwd["calls"], bwd["bytes_sent"], bwd["bytes_received"]) == (2 * L, received - counts,
                                                                            sent - counts)
        assert out["fwd"]["all_reduce/native"]["calls"] == L  # the load-balancing statistics
        assert out["bwd"]["all_reduce/native"]["calls"] == L + 1  # their gradients, then the replicas' average


# ------------------------------------------------------------------------------- the mesh, 4 ranks

def _mesh_rank_of_4() -> dict:
    out: dict = {"bad": {}}
    with comm.counters() as before:
        for text, call in [("ep=3", lambda: Mesh(dp=4, ep=3)),
                           ("zero_stage=3", lambda: parallelize(_tiny(), Mesh(dp=4, ep=2), zero_stage=3)),
                           ("n_experts=6", lambda: parallelize(GPT(GPTConfig.preset("tiny", n_experts=6)),
                                                                  Mesh(dp=4, ep=4))),
                           ("tp=2", lambda: parallelize(_tiny(), Mesh(dp=2, tp=2, ep=2)))]:
            try:
                call()
                out["bad"][text] = "no error"
            except ValueError as e:
                out["bad"][text] = "ok" if text in str(e) else str(e)
    out["messages_before"] = sum(s.calls for s in before.stats.values())
    mesh = Mesh(dp=4, ep=2)
    out["groups"] = {dim: mesh.groups[dim] for dim in ("ep", "edp")}
    out["losses"], out["state"], out["experts"] = _on_mesh(mesh)
    out["zero1"] = _on_mesh(mesh, zero_stage=1)  # ZeRO-1: optimizer state over dp, and over each expert's replicas
    return out


def test_mesh_dp4_ep2_matches_one_process():
    """Mesh(dp=4, ep=2): two copies of each expert, experts 0-1 on dp ranks 0 and 2, 2-3 on 1 and 3;
    with ZeRO 0 and 1 (one launch); bad input refused before any message."""
    res = workbench.launch(_mesh_rank_of_4, world_size=4, timeout=180)
    reference = _single_process()
    for r, out in enumerate(res):
        assert all(v == "ok" for v in out["bad"].values()), out["bad"]
        assert out["messages_before"] == 0
        assert out["groups"] == {"ep": [[0, 1], [2, 3]], "edp": [[0, 2], [1, 3]]}
        assert out["experts"] == (["0", "1"] if r in (0, 2) else ["2", "3"])
        _same_as_one_process(out["losses"], out["state"], reference)
        _same_as_one_process(*out["zero1"][:2], reference)
