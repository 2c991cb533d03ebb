"""Mixture of experts: a top-k router sends each token to k of E MLPs (Shazeer et al. 2017; GShard,
Lepikhin et al. 2020; Switch, Fedus et al. 2021), the layer Mixtral, DeepSeek-V3 and Llama 4 use
in place of the transformer's MLP.

The layer, for N tokens of C channels (``x`` flattened to ``(N, C)``)::

    router      logits = x W_r (C -> E, no bias); probs = softmax(logits) over the E experts
    top-k       the k largest probs per token; weights = those k renormalised to sum to 1
    capacity    (optional) expert e keeps at most  C_e = ceil(N k c / E)  of its assignments, the
                ones with the largest weights; the rest are dropped (Megatron's
                moe_token_drop_policy="probs"): the token gets nothing from that expert
    dispatch    the kept (token, expert) assignments sorted by expert: rows of x, expert 0's first
    experts     expert e (an MLP shaped like the GPT's: C -> 4C, GELU, 4C -> C) runs on its rows
    combine     y[t] = sum over t's kept assignments of weight * expert(x[t])

Dropless by default (``capacity_factor=None``): every assignment is kept, so an expert may get any
number of rows. With a capacity the work per expert is bounded, at the price of dropped tokens:
``dropped`` (on the module, after each forward) counts the dropped assignments,
``sum_e max(0, n_e - C_e)`` for ``n_e`` assignments routed to expert e. When the layer is spread
over ranks (:mod:`workbench.parallel.expert`) the capacity applies per source rank, with N the
rank's own tokens.

Load balancing (Switch/GShard). Left alone, the router collapses onto a few experts. The auxiliary
loss ``alpha E sum_i f_i P_i``, with ``f_i`` the fraction of the N k assignments routed to expert i
(counted before capacity drops, as the router chose) and ``P_i`` the mean router probability of
expert i over the N tokens, is smallest (``alpha``) when both are uniform; its gradient flows
through ``P_i`` only. It is computed from GLOBAL sums: with a ``group`` the per-expert counts,
the probability sums and N are all-reduced over the data-parallel ranks first (one all-reduce of
2E + 1 numbers per layer forward, and one of its gradient backward), so the loss equals one
process's on the whole batch. The mean of per-rank losses would not: ``sum f_i P_i`` is not
linear in the batch.

Why the backward all-reduce: every rank computes the same loss from the reduced sums, and the data-
parallel gradient average divides by P, so rank s must contribute P times its local share
``dL/dP_sum^s``; the all-reduce's backward (a sum of every rank's equal upstream gradient) is
exactly that.

Memory: E experts of ``8 C^2 + 5 C`` parameters each (with biases) plus the router's ``C E``, so
``E`` times the dense MLP's parameters for about ``k`` times its FLOPs per token.
"""
from __future__ import annotations

import math
from numbers import Real
from typing import Callable

import torch
import torch.nn as nn

from workbench import comm

__all__ = ["MoE", "capacity", "check_moe_args"]


def capacity(tokens: int, top_k: int, capacity_factor: float, n_experts: int) -> int:
    """Most assignments one expert keeps: ``ceil(tokens k c / E)`` (``tokens``: this rank's)."""
    return math.ceil(tokens * top_k * capacity_factor / n_experts)


def check_moe_args(n_experts, top_k, capacity_factor, aux_loss_coeff, where: str = "MoE") -> None:
    """The ValueErrors of a bad mixture-of-experts configuration (``where`` prefixes the names)."""
    for name, value in (("n_experts", n_experts), ("top_k", top_k)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{where}.{name}={value!r} must be a whole number >= 1")
    if top_k > n_experts:
        raise ValueError(f"{where}.top_k={top_k} is more than n_experts={n_experts}: each token picks top_k "
                         f"different experts, so use top_k <= {n_experts} (or more experts)")
    if capacity_factor is not None and (isinstance(capacity_factor, bool) or not isinstance(capacity_factor, Real)
                                        or not capacity_factor > 0):
        raise ValueError(f"{where}.capacity_factor={capacity_factor!r} must be a number > 0 (1.0: each expert "
                         "takes its even share N k / E of the assignments) or None (dropless)")
    if isinstance(aux_loss_coeff, bool) or not isinstance(aux_loss_coeff, Real) or not aux_loss_coeff >= 0:
        raise ValueError(f"{where}.aux_loss_coeff={aux_loss_coeff!r} must be a number >= 0 (0.01 is Switch's)")


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group forward; backward the sum of the ranks' gradients (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        out = x.detach().clone()
        comm.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous().clone()
        comm.all_reduce(grad, group=ctx.group)
        return grad, None


class MoE(nn.Module):
    """A mixture-of-experts layer: ``(..., C) -> (..., C)``, see the module docstring.

    ``expert``: a function returning one expert module (called ``n_experts`` times; the GPT passes
    its ``FeedForward``). ``group``: the data-parallel ranks whose tokens the load-balancing loss
    counts together (None: this process's tokens only).

    After each forward: ``aux_loss`` (a scalar tensor, the load-balancing loss),
    ``tokens_per_expert`` (this rank's kept assignments per expert, an int64 tensor of E),
    ``dropped`` (this rank's dropped assignments, an int). Experts live in ``experts``, a
    ``ModuleDict`` keyed by their number (``experts.3.c_fc.weight``), so that a rank holding only
    some of them keeps the single model's names.
    """

    def __init__(self, n_embd: int, n_experts: int, expert: Callable[[], nn.Module], *, top_k: int = 2,
                 capacity_factor: float | None = None, aux_loss_coeff: float = 0.01, group=None):
        super().__init__()
        check_moe_args(n_experts, top_k, capacity_factor, aux_loss_coeff)
        self.n_experts, self.top_k = n_experts, top_k
        self.capacity_factor, self.aux_loss_coeff = capacity_factor, aux_loss_coeff
        self.group = group
        self.router = nn.Linear(n_embd, n_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): expert() for e in range(n_experts)})
        self.aux_loss: torch.Tensor | None = None
        self.tokens_per_expert: torch.Tensor | None = None
        self.dropped = 0

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(probs (N, E), weights (N, k), experts (N, k))`` for tokens ``x`` (N, C)."""
        probs = torch.softmax(self.router(x), dim=-1)
        top, experts = probs.topk(self.top_k, dim=-1)
        return probs, top / top.sum(dim=-1, keepdim=True), experts

    def keep_within_capacity(self, weights: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Which assignments (N, k) are kept: all without a capacity; else, per expert, the
        ``capacity(...)`` ones with the largest weights."""
        keep = torch.ones_like(experts, dtype=torch.bool)
        if self.capacity_factor is None:
            return keep
        cap = capacity(experts.shape[0], self.top_k, self.capacity_factor, self.n_experts)
        for e in range(self.n_experts):
            mine = experts == e
            if int(mine.sum()) > cap:
                score = torch.where(mine, weights.detach(), torch.full_like(weights, -1.0)).flatten()
                kept = torch.zeros(score.numel(), dtype=torch.bool, device=score.device)
                kept[score.topk(cap).indices] = True
                keep &= ~mine | kept.view_as(mine)
        return keep

    def load_balancing_loss(self, probs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """``alpha E sum_i f_i P_i`` over the tokens of every rank of ``group`` (see the module docstring)."""
        E = self.n_experts
        counts = torch.bincount(experts.flatten(), minlength=E).to(probs.dtype)
        n = torch.full((1,), float(probs.shape[0]), dtype=probs.dtype, device=probs.device)
        stats = torch.cat([counts, probs.sum(dim=0), n])
        if self.group is not None:
            stats = _AllReduceSum.apply(stats, self.group)
        counts, prob_sums, n = stats.split([E, E, 1])
        f = counts / (n * self.top_k)  # fraction of the assignments each expert got
        P = prob_sums / n  # mean router probability of each expert
        return self.aux_loss_coeff * E * (f * P).sum()

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert e on its ``counts[e]`` rows (``rows`` sorted by expert); the outputs in the same order.
        :mod:`workbench.parallel.expert` replaces this with the all-to-all dispatch and combine."""
        chunks = rows.split(counts.tolist())
        return torch.cat([self.experts[str(e)](chunk) for e, chunk in enumerate(chunks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        probs, weights, experts = self.route(flat)
        self.aux_loss = self.load_balancing_loss(probs, experts)
        keep = self.keep_within_capacity(weights, experts).flatten()
        self.dropped = int((~keep).sum())
        # dispatch: one row per kept (token, expert) assignment, sorted by expert
        token = torch.arange(flat.shape[0], device=x.device).repeat_interleave(self.top_k)[keep]
        expert, weight = experts.flatten()[keep], weights.flatten()[keep]
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        self.tokens_per_expert = torch.bincount(expert, minlength=self.n_experts)
        out = self.run_experts(flat[token], self.tokens_per_expert)
        # combine: each token's weighted expert outputs, added up
        y = torch.zeros_like(flat).index_add(0, token, out * weight.unsqueeze(1).to(out.dtype))
        return y.view(shape)

    def extra_repr(self) -> str:
        return (f"n_experts={self.n_experts}, top_k={self.top_k}, capacity_factor={self.capacity_factor}, "
                f"aux_loss_coeff={self.aux_loss_coeff}")
