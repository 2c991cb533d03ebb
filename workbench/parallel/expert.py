"""Expert parallelism: each rank holds E/P of a mixture-of-experts layer's experts, and tokens travel
to their expert's rank and back by all-to-all (GShard, Lepikhin et al. 2020; Switch; DeepSpeed-MoE).

The layer is :class:`~workbench.models.moe.MoE`; this file replaces only the middle of its forward,
``run_experts`` (the rows sorted by expert -> the experts' outputs in the same order). Rank r holds
experts ``[r E/P, (r+1) E/P)``; the router, the attention, the norms and the embeddings stay
replicated, and every rank feeds its own share of the batch (expert parallelism over the
data-parallel ranks, ep = dp, or over groups of ep of them, as torchtitan and DeepSpeed place it)::

    route      every rank: its N tokens -> k experts each, rows sorted by expert (as one process)
    counts     all-to-all of the per-expert counts (E int64 per rank): rank j learns how many rows
               each rank sends to each of its experts, hence its receive sizes
    dispatch   all_to_all_single(rows, input_split_sizes = rows for rank 0's experts, rank 1's, ...)
    experts    the rows that arrived (grouped by source rank, then expert) regrouped by expert; each
               local expert runs once on all its rows, from every rank; then back in arrival order
    combine    the reverse all-to-all (the splits swapped): every row returns to its token's rank,
               where the router's weights add them up exactly as on one process

Backward: the all-to-all is linear and moves row i of block j to rank j, so its gradient moves the
gradient of that row back, the reverse all-to-all with the splits swapped (:class:`_AllToAll`).
The count exchange carries integers and has no gradient.

Gradients and loss scaling (P ranks, each with B/P of a global batch B, loss_r = its mean
cross-entropy + the load-balancing loss of the global counts, equal on every rank):

* the objective is the mean over ranks, ``(1/P) sum_r loss_r`` = one process's loss on B;
* replicated (non-expert) parameters: rank r's gradient is ``d loss_r``, so they are averaged over
  the group as in data parallelism (one all-reduce of all of them at the end of backward, then
  ``/ P``). Not the package's DistributedDataParallel: it would broadcast rank 0's experts over the
  others' (same shapes, different experts) and average the expert gradients, and it has no way to
  leave parameters out. The explicit all-reduce is a few lines and composes with the rest;
* an expert's parameters live on one rank and see the rows of every rank: the backward all-to-all
  brings ``d loss_s / d expert`` from every rank s, so their gradient is already the SUM over
  ranks, ``P`` times the objective's. No all-reduce (no other rank holds that expert: with ep = dp
  there are no replicas to agree with), only the ``1 / P`` (a gradient hook), the same factor the
  averaged parameters get;
* with ep < dp (``Mesh(dp=4, ep=2)``: the batch over dp ranks, each expert on one rank of every
  group of ep, so ``dp / ep`` replicas of it), the backward all-to-all sums the gradients of the
  ep ranks of its group; the replicas' sums are added by one all-reduce over the ranks holding the
  same expert (Megatron's expert-data-parallel group) and divided by dp: the objective's gradient,
  ``(1/dp) sum`` over every data-parallel rank. The load-balancing loss counts all dp ranks' tokens.

Communication per rank, per MoE layer, per direction (rows_{r->j}: the rows r sends to rank j's
experts, D = n_embd, b bytes per element)::

    dispatch   sent  sum_{j != r} rows_{r->j} D b      received  sum_{j != r} rows_{j->r} D b
    combine    the same with sent and received swapped
    counts     (E - E/P) 8 bytes each way (all-to-all of int64), forward only
    backward   the dispatch's and combine's bytes again (each the other's reverse)
    aux loss   an all-reduce of 2E + 1 numbers forward, and its gradient backward

Dropless, ``rows`` = the rank's N tokens x k; under uniform routing a row stays home with probability
1/P, so ``N k D b (P-1)/P`` is sent per direction in expectation. With a capacity, rows_{r->j} <= E/P
``C`` with ``C = ceil(N k c / E)`` per expert per source rank (this file sends only the kept rows;
a padded implementation would send exactly ``E/P C`` rows per destination).

Memory per rank (psi_e parameters per expert, psi_r everything else, L MoE layers; float32 Adam
keeps 16 bytes per parameter with its gradient and moments): ``16 (psi_r + L (E/P) psi_e)`` instead
of one process's ``16 (psi_r + L E psi_e)`` (:func:`parameters_per_rank`; a GPT expert has
``psi_e = 8 C^2 + 5 C`` with biases, and psi_r includes each layer's ``C E`` router), P = ep. With
ZeRO-1 (:class:`ExpertShardedOptimizer`: Adam's 8 bytes sharded over dp for the replicated
parameters and over the dp/ep copies for the experts): ``8 (psi_r + L (E/ep) psi_e) + 8 psi_r / dp
+ 8 L (E/ep) psi_e ep / dp``. The experts' activations scale with the rows that arrive: about N k
on average, more on a rank whose experts are popular (what the load-balancing loss evens out).

Usage::

    torch.manual_seed(0); model = GPT(GPTConfig.preset("tiny", n_experts=4))   # same on every rank
    model = expert_parallel(model)                  # rank r keeps experts 2r, 2r+1 (P = 2)
    logits, loss = model(x_shard, y_shard)          # this rank's share of the batch
    loss.backward(); optimizer.step()               # gradients already averaged / scaled
    full_state_dict(model)                          # the single model's names and tensors
    parallelize(GPT(config), Mesh(dp=4, ep=2), zero_stage=1)  # on a mesh: experts over pairs, two copies each
"""
from __future__ import annotations

from dataclasses import replace

import torch
import torch.distributed as dist
import torch.nn as nn

from workbench import comm
from workbench.models.gpt import GPT
from workbench.models.moe import MoE
from workbench.parallel.zero import ShardedOptimizer

__all__ = ["expert_parallel", "full_state_dict", "is_expert_parallel", "ExpertParallelMoE", "ExpertShardedOptimizer",
           "all_to_all_bytes", "parameters_per_rank"]


class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all_single`` of rows with the given splits; backward: the reverse all-to-all."""

    @staticmethod
    def forward(ctx, x, output_split_sizes, input_split_sizes, group, algorithm):
        ctx.splits, ctx.group, ctx.algorithm = (output_split_sizes, input_split_sizes), group, algorithm
        return _all_to_all(x, output_split_sizes, input_split_sizes, group, algorithm)

    @staticmethod
    def backward(ctx, grad):
        out_splits, in_splits = ctx.splits
        return _all_to_all(grad, in_splits, out_splits, ctx.group, ctx.algorithm), None, None, None, None


def _all_to_all(x, output_split_sizes, input_split_sizes, group, algorithm):
    out = x.new_empty((sum(output_split_sizes),) + tuple(x.shape[1:]))
    comm.all_to_all_single(out, x.contiguous(), output_split_sizes, input_split_sizes, group=group,
                           algorithm=algorithm)
    return out


class ExpertParallelMoE(MoE):
    """An :class:`MoE` whose ``experts`` hold only this rank's ``E/P``; ``run_experts`` sends the
    rows to their experts' ranks and back (see the module docstring). After each forward:
    ``send_rows`` / ``recv_rows`` (rows to / from each rank in the dispatch)."""

    def run_experts(self, rows: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        group, p, local, alg = self.ep_group, self.ep_size, self.experts_per_rank, self.algorithm
        first = self.ep_rank * local
        # 1. counts: rank j receives, from each rank, how many rows it sends to each of j's experts
        recv_counts = torch.empty(p, local, dtype=torch.int64, device=counts.device)
        comm.all_to_all_single(recv_counts, counts.view(p, local).contiguous(), group=group, algorithm=alg)
        self.send_rows = counts.view(p, local).sum(dim=1).tolist()
        self.recv_rows = recv_counts.sum(dim=1).tolist()
        # 2. dispatch
        got = _AllToAll.apply(rows, self.recv_rows, self.send_rows, group, alg)
        # 3. regroup by local expert (arrival order is by source rank, then expert), run, restore the order
        expert_of_row = torch.arange(local, device=rows.device).repeat(p).repeat_interleave(recv_counts.flatten())
        order = torch.argsort(expert_of_row, stable=True)
        chunks = got[order].split(recv_counts.sum(dim=0).tolist())
        out = torch.cat([self.experts[str(first + e)](chunk) for e, chunk in enumerate(chunks)])
        out = out[torch.argsort(order)]
        # 4. combine: the reverse all-to-all
        return _AllToAll.apply(out, self.send_rows, self.recv_rows, group, alg)


def is_expert_parallel(model: nn.Module) -> bool:
    return any(isinstance(m, ExpertParallelMoE) for m in model.modules())


def _moe_layers(model: nn.Module) -> list[tuple[str, MoE]]:
    return [(n, m) for n, m in model.named_modules() if isinstance(m, MoE)]


def expert_parallel(model: nn.Module, group=None, *, algorithm: str = "native", data_parallel_group=None,
                    expert_data_parallel_group=None, average_gradients: bool = True) -> nn.Module:
    """Spread every MoE layer's experts over the ranks of ``group`` (default: all) in place; return
    ``model``. Call it on every rank with identical models (same seed). Rank r of ``group`` keeps
    experts ``[r E/P, (r+1) E/P)``; the other parameters are made equal to rank 0's of the
    data-parallel group (a broadcast) and their gradients are averaged over it at the end of each
    backward. ``algorithm``: the all-to-all's (``comm.ALGORITHMS["all_to_all_single"]``).

    ``data_parallel_group``: the ranks the batch is split over (default: ``group``, ep = dp). With
    more ranks than ``group`` (``dp = ep x d``, as ``Mesh(dp=..., ep=...)`` lays them out), each
    expert has ``d`` replicas, one in each of the ``dp / ep`` expert-parallel groups, and
    ``expert_data_parallel_group`` (Megatron's name) holds this rank's expert's replicas: the
    experts' gradients are summed over it and divided by ``dp`` (the backward all-to-all already
    summed those of the ``ep`` ranks of ``group``). The load-balancing loss counts the tokens of
    the whole data-parallel group. ``average_gradients=False`` leaves each rank's gradients as
    they are (the experts' divided by ``ep``, the size of ``group``) for an optimizer that averages
    them itself: :class:`ExpertShardedOptimizer` (ZeRO-1). Every check runs before the first message."""
    layers = _check_model(model, algorithm)
    p, r, dp_group, dp, replicas = _check_groups(layers, group, data_parallel_group, expert_data_parallel_group)

    expert_ids = {id(q) for _, moe in layers for q in moe.experts.parameters()}
    replicated = [q for q in model.parameters() if id(q) not in expert_ids]
    _broadcast_from_first_rank(replicated + list(model.buffers()), dp_group)  # replicas start equal
    # ZeRO-1 (average_gradients=False) then averages over the dp/ep replicas itself
    experts = _keep_local_experts(layers, group, dp_group, p, r, algorithm, scale=dp if average_gradients else p)
    if replicas > 1:  # an expert's replicas start equal too
        _broadcast_from_first_rank(experts, expert_data_parallel_group)

    if average_gradients:
        _reduce_after_backward([(replicated, dp_group, dp),
                                (experts if replicas > 1 else [], expert_data_parallel_group, 1)])
    model._expert_parallel = {"group": group, "size": p, "rank": r, "algorithm": algorithm, "dp_group": dp_group,
                              "edp_group": expert_data_parallel_group}
    return model


def _check_model(model: nn.Module, algorithm: str) -> list[tuple[str, MoE]]:
    """The model's mixture-of-experts layers, checked: a module with some, not split already, a
    process group to split them over and a known all-to-all algorithm."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model={model!r} must be an nn.Module")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("expert_parallel needs a process group: call it inside workbench.launch(...) or torchrun")
    layers = _moe_layers(model)
    if not layers:
        raise ValueError("expert_parallel: model has no mixture-of-experts layer: build it with experts, "
                         "e.g. GPT(GPTConfig.preset('tiny', n_experts=4))")
    if is_expert_parallel(model):
        raise ValueError("expert_parallel: model is already expert-parallel: call it once, on the whole model")
    if algorithm not in comm.ALGORITHMS["all_to_all_single"]:
        raise ValueError(f"expert_parallel: algorithm={algorithm!r} is not an all-to-all algorithm: use one of "
                         f"{comm.ALGORITHMS['all_to_all_single']}")
    return layers


def _check_groups(layers: list[tuple[str, MoE]], group, data_parallel_group, expert_data_parallel_group
                  ) -> tuple[int, int, object, int, int]:
    """The three groups, checked against each other and the experts: this rank in ``group`` (ep),
    every layer's experts splitting evenly over it, and ``dp = ep x replicas``. Returns
    ``(ep size, this rank in it, the data-parallel group, its size, replicas of each expert)``."""
    p, r = dist.get_world_size(group), dist.get_rank(group)
    if r < 0:
        raise ValueError("expert_parallel: this rank is not in group: call it only on the group's ranks")
    for name, moe in layers:
        if moe.n_experts % p:
            raise ValueError(f"expert_parallel: {name} has n_experts={moe.n_experts}, which does not split over "
                             f"the group's {p} ranks: use a multiple of {p} experts (or a group of a divisor "
                             f"of {moe.n_experts} ranks)")
    dp_group = group if data_parallel_group is None else data_parallel_group
    dp = dist.get_world_size(dp_group)
    replicas = dist.get_world_size(expert_data_parallel_group) if expert_data_parallel_group is not None else 1
    if dp != p * replicas:
        raise ValueError(f"expert_parallel: data_parallel_group has {dp} ranks but group has {p} and "
                         f"expert_data_parallel_group {replicas}: the data-parallel ranks must be ep x (replicas of "
                         f"each expert); pass expert_data_parallel_group with {dp // p if dp % p == 0 else '?'} ranks "
                         "(Mesh(dp=..., ep=...) builds all three)")
    return p, r, dp_group, dp, replicas


def _broadcast_from_first_rank(tensors: list[torch.Tensor], group) -> None:
    """Make ``tensors`` equal to those of ``group``'s first rank (the default group's rank 0 for
    None), in place: one broadcast per tensor, in order."""
    with torch.no_grad():
        src = dist.get_global_rank(group, 0) if group is not None else 0
        for q in tensors:
            comm.broadcast(q.data, src=src, group=group)


def _keep_local_experts(layers: list[tuple[str, MoE]], group, dp_group, p: int, r: int, algorithm: str,
                        scale: int) -> list[nn.Parameter]:
    """Turn every MoE layer into an :class:`ExpertParallelMoE` holding experts ``[r E/p, (r+1) E/p)``
    (the others deleted) and return their parameters. Each expert's gradient is divided by
    ``scale`` by a hook: the backward all-to-all has summed the gradients of ``group``'s ranks."""
    experts = []
    for _, moe in layers:
        local = moe.n_experts // p
        keep = {str(e) for e in range(r * local, (r + 1) * local)}
        for key in [k for k in moe.experts if k not in keep]:
            del moe.experts[key]
        moe.__class__ = ExpertParallelMoE
        # the load-balancing loss counts every data-parallel rank's tokens (group=None: this rank's only)
        moe.group = dp_group if dp_group is not None else dist.group.WORLD
        moe.ep_group, moe.algorithm = group if group is not None else dist.group.WORLD, algorithm
        moe.ep_size, moe.ep_rank, moe.experts_per_rank = p, r, local
        moe.send_rows, moe.recv_rows = None, None
        for q in moe.experts.parameters():  # the backward all-to-all summed the gradients of group's ranks
            q.register_hook(lambda g, scale=scale: g / scale)
            experts.append(q)
    return experts


def _reduce_after_backward(parts: list[tuple[list[torch.Tensor], object, int]]) -> None:
    """At the end of every backward, for each ``(params, group, divisor)``: all-reduce the gradients
    of ``params`` over ``group`` and divide by ``divisor``. The replicated parameters: data
    parallelism's average over ``dp``; the experts' replicas: a sum (each gradient already divided
    by ``dp``). One flat message per group; a parameter without a gradient here sends zeros, and
    one flag per parameter rides in the same message, so that a parameter no rank of the group
    gave a gradient (an expert no token chose) keeps ``grad = None``, as on one process."""
    parts = [([q for q in params if q.requires_grad], group, divisor) for params, group, divisor in parts]
    parts = [part for part in parts if part[0]]
    state = {"queued": False}

    def reduce() -> None:
        state["queued"] = False
        for params, group, divisor in parts:
            grads = [q.grad if q.grad is not None else torch.zeros_like(q) for q in params]
            had = torch.tensor([q.grad is not None for q in params], dtype=grads[0].dtype, device=grads[0].device)
            flat = torch.cat([g.reshape(-1) for g in grads] + [had])
            comm.all_reduce(flat, group=group)
            flat, had = flat[:-len(params)], flat[-len(params):]
            if divisor != 1:
                flat /= divisor
            for q, g, n in zip(params, flat.split([q.numel() for q in params]), had.tolist()):
                q.grad = g.view_as(q).clone() if n > 0 else None

    def hook(_param) -> None:
        if not state["queued"]:
            state["queued"] = True
            torch.autograd.Variable._execution_engine.queue_callback(reduce)

    for params, _, _ in parts:
        for q in params:
            q.register_post_accumulate_grad_hook(hook)


class ExpertShardedOptimizer:
    """ZeRO-1 for an expert-parallel model (made with ``average_gradients=False``): the replicated
    parameters' optimizer state sharded over the data-parallel group, each expert's over the ranks
    holding it (the expert-data-parallel group; a plain optimizer where there is none, ep = dp).
    Two :class:`~workbench.parallel.zero.ShardedOptimizer`, each averaging its gradients over its
    group: the replicated parameters' mean over dp, the experts' mean over their dp/ep replicas of
    gradients already summed over ep and divided by ep, hence ``(1/dp) sum`` over every rank.
    ``make_optimizer(params)`` builds the inner optimizer (element-wise, as ZeRO needs). As with any
    ShardedOptimizer, a parameter without a gradient counts as a zero gradient: an expert that no
    token of the whole batch chose is stepped with zeros (one process would skip it; AdamW's moments
    and weight decay then move it)."""

    def __init__(self, model: nn.Module, make_optimizer):
        info = getattr(model, "_expert_parallel", None)
        if info is None:
            raise ValueError("ExpertShardedOptimizer: model is not expert-parallel: call expert_parallel(model, "
                             "..., average_gradients=False) first")
        expert_ids = {id(q) for _, moe in _moe_layers(model) for q in moe.experts.parameters()}
        experts = [q for q in model.parameters() if id(q) in expert_ids]
        replicated = [q for q in model.parameters() if id(q) not in expert_ids]
        self.optimizers = [ShardedOptimizer(replicated, make_optimizer, process_group=info["dp_group"])]
        edp = info["edp_group"]
        self.optimizers.append(ShardedOptimizer(experts, make_optimizer, process_group=edp) if edp is not None
                               else make_optimizer(experts))

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The single model's state dict (its keys, in its order, and tensors), on every rank: the
    experts gathered from their ranks (one all-gather per expert tensor and layer)."""
    info = getattr(model, "_expert_parallel", None)
    if info is None:
        raise ValueError("full_state_dict: model is not expert-parallel: call expert_parallel(model) first")
    return gather_experts({k: v.detach() for k, v in model.state_dict().items()}, model, info["group"])


def gather_experts(state: dict[str, torch.Tensor], model: nn.Module, group) -> dict[str, torch.Tensor]:
    """``state`` (this rank's, with only its experts, under the single model's names) with every
    expert of every MoE layer of ``model`` gathered over ``group`` (the ranks that together hold
    one copy of each), keys in the single model's order: expert ``e``'s entries where the layer's
    first expert's are, experts in number order."""
    gathered: dict[str, dict[str, torch.Tensor]] = {}  # layer -> its experts' entries, expert 0's first
    for name, moe in _moe_layers(model):
        local, p = moe.experts_per_rank, moe.ep_size
        mine = [moe.experts[str(moe.ep_rank * local + e)].state_dict() for e in range(local)]
        blocks = {}
        for key in mine[0]:
            stacked = torch.stack([m[key] for m in mine]).contiguous()
            parts = [torch.empty_like(stacked) for _ in range(p)]
            comm.all_gather(parts, stacked, group=group)
            blocks[key] = parts
        gathered[f"{name}.experts."] = {f"{name}.experts.{rank * local + e}.{key}": parts[rank][e].clone()
                                        for rank in range(p) for e in range(local) for key, parts in blocks.items()}
    out: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        prefix = next((pre for pre in gathered if key.startswith(pre)), None)
        if prefix is None:
            out[key] = value.clone()
        elif key not in out:  # the layer's first expert entry: every expert of the layer goes here
            out.update(gathered[prefix])
    return out


def all_to_all_bytes(rows: list[list[int]], rank: int, n_embd: int, n_experts: int,
                     element_size: int = 4) -> dict[str, tuple[int, int]]:
    """The docstring's bytes for one MoE layer's forward on ``rank``, from ``rows[i][j]`` (the rows rank
    i sends rank j's experts), ``n_experts`` for the count exchange: each direction's bytes sent and
    received (the backward moves the dispatch's and combine's again, reversed)."""
    p = len(rows)
    out = sum(rows[rank][j] for j in range(p) if j != rank) * n_embd * element_size
    back = sum(rows[j][rank] for j in range(p) if j != rank) * n_embd * element_size
    counts = (n_experts - n_experts // p) * 8
    return {"counts": (counts, counts), "dispatch": (out, back), "combine": (back, out)}


def parameters_per_rank(config, p: int) -> int:
    """Parameters one rank holds when a GPT of ``config`` (``n_experts > 0``) is spread over ``p``
    ranks: everything but the experts, plus ``E/P`` experts of ``8 C^2 + 5 C`` (``4 C^2 + 4 C`` +
    ``4 C^2 + C``; ``8 C^2`` without biases) in each of the ``n_layer`` blocks."""
    C, E, L = config.n_embd, config.n_experts, config.n_layer
    if E < 1 or E % p:
        raise ValueError(f"parameters_per_rank: n_experts={E} must be a positive multiple of p={p}")
    expert = 8 * C * C + (5 * C if config.bias else 0)
    dense = replace(config, n_experts=0)  # the same model with one dense MLP per block
    everything_else = GPT(dense).num_parameters() - L * expert + L * C * E  # minus the MLPs, plus the routers
    return everything_else + L * (E // p) * expert
