"""3D (4D) parallelism: one mesh of ranks, data x context x tensor x pipeline, the strategies composed on it.

The mesh (picotron's process-group manager, torch's ``init_device_mesh`` with named dimensions)
lays the ``N = pp x dp x cp x tp`` ranks out in one grid, in Megatron's order -- tensor-parallel
ranks adjacent (they exchange activations in every layer, so they belong on one node and its
fast links), then context-parallel (K/V blocks or all-to-alls in every layer), then data-parallel,
then pipeline (one point-to-point message per micro-batch and stage boundary is the cheapest
traffic, so it may cross the slowest links)::

    grid = torch.arange(N).view(pp, dp, cp, tp)   # grid[p, d, c, t] is the rank at those coordinates

    dp=2, tp=2, pp=2:  stage 0  [[0, 1],        tp groups: rows     {0,1} {2,3} {4,5} {6,7}
                                 [2, 3]]        dp groups: columns  {0,2} {1,3} {4,6} {5,7}
                       stage 1  [[4, 5],        pp groups: across   {0,4} {1,5} {2,6} {3,7}
                                 [6, 7]]

(With ``cp = 1``, the default, the ``cp`` axis has length 1 and the drawing above is the grid.)
A rank belongs to exactly one group of each dimension: the ranks that differ from it in that
coordinate only; ``dp_cp`` is the ranks that differ in ``dp`` or ``cp`` (they hold the same
parameters, so they average gradients together). :func:`layout` gives the groups without a
process group (for figures: :func:`workbench.measure.plots.mesh_grid`).

Composition (:func:`parallelize`), innermost first, each step the existing strategy given its
group, nothing re-implemented:

1. **Tensor parallelism** over ``tp`` (:func:`workbench.parallel.tensor.tensor_parallel`, by the
   model's plan, ``tp_plan``: our GPT's, Hugging Face GPT-2's and Llama's ship): heads, MLP units
   and vocabulary split; our GPT's loss the vocabulary-parallel cross-entropy, a Hugging Face
   model's own loss on the gathered logits.
2. **Pipeline parallelism** over ``pp`` (:func:`workbench.parallel.pipeline.partition` by the
   model's split, ``pp_split``, and a schedule: GPipe, 1F1B or ZB-H1): the tensor-parallel model
   is cut into stages, so every stage's layers are already split; the ``tp`` ranks of a stage run
   the same schedule in lockstep, each on its shard, and each sends its activation to the rank of
   the next stage with the same ``(dp, tp)`` coordinates. The tied embedding's two copies (first
   and last stage) have their gradients summed between those ranks, shard by shard.
3. **Context parallelism** over ``cp`` (:func:`workbench.parallel.context_model.context_parallel`):
   each rank of a ``cp`` group holds ``S/cp`` positions of every sequence (``cp_layout``
   "zigzag" or "contiguous"), its position embedding reads those global positions, and every
   attention call runs as ring or Ulysses attention over the group (``cp_method``). Parameters
   stay replicated over ``cp``.
4. **Data parallelism** over ``dp x cp`` (the ``dp_cp`` group) on this rank's stage: ZeRO-0
   (:class:`DistributedDataParallel`, the micro-batches' gradients accumulated under ``no_sync``
   and averaged once after the schedule), ZeRO-1/2 (:class:`ShardedOptimizer`) or ZeRO-3
   (:class:`FullyShardedDataParallel`). Each rank's loss is the mean over its own tokens, all
   ranks hold as many, so averaging over ``dp x cp`` gives the global batch's mean and its gradient.

**Expert parallelism** (``Mesh(dp=4, ep=2)``, ``ep`` dividing ``dp``; a model with mixture-of-experts
layers, :mod:`workbench.parallel.expert`) is not an axis of the grid: it splits each data-parallel
group into groups of ``ep`` adjacent ranks (``"ep"``: dp ranks {0,1} {2,3}), each holding every
expert once, ``E/ep`` per rank, and the ranks with the same experts form ``"edp"`` ({0,2} {1,3}:
``dp/ep`` copies of each expert). Every rank feeds its own rows, tokens go to their experts' ranks
by all-to-all inside its ``ep`` group, the parameters outside the experts are averaged over ``dp``
and the experts' gradients summed over ``edp`` (each already the sum over its ``ep`` group, then
divided by ``dp``); the load-balancing loss counts every dp rank's tokens. It composes with data
parallelism and ZeRO-1 (the replicated parameters' optimizer state sharded over ``dp``, each
expert's over ``edp``); with tp, pp, cp, ZeRO-2 or ZeRO-3 it is refused, with the reason.

Activation recomputation (``recompute="full"`` or ``"selective"``,
:func:`workbench.parallel.recompute.recompute`) checkpoints this rank's blocks after steps 1-2, so
it composes with all three: a block recomputed in backward runs its tensor-parallel collectives
again (Megatron's full recomputation does the same), and under ZeRO-3 gathers its unit again.

One step: data-parallel rank ``d`` takes rows ``[d B/dp, (d+1) B/dp)`` of the global batch, and
context-parallel rank ``c`` its ``S/cp`` positions of them; its pipeline splits them into ``m``
micro-batches; every ``tp`` rank sees them whole. The returned loss is the global batch's mean
(the last stage's micro-batch means averaged, sent to the other stages, averaged over
``dp x cp``) on every rank; the gradients are those of that mean, so training
equals one process on the global batch.

Cost per step and rank (``psi`` parameters, ``b`` rows per data-parallel rank, ``s`` sequence,
``h`` hidden, ``L`` layers): tensor parallelism 4 all-reduces of ``b s h`` per layer of its stage
(``L/pp`` layers) over ``tp``; the pipeline ``2 m`` messages of ``b s h / m`` per stage boundary
(``b s h / tp`` with sequence parallelism) and a bubble ``(pp-1)/(m+pp-1)``; data parallelism
``2 (dp-1)/dp`` times this rank's ``psi / (tp pp)`` parameters (ZeRO-3: 3x instead of 2x; with
context parallelism over ``dp cp`` ranks); context parallelism the attention method's messages
per layer (:mod:`workbench.parallel.context`) on ``B S/cp`` tokens.
Model state per rank (float32 Adam): ``16 psi / (tp pp)`` bytes, divided by ``dp`` as ZeRO
shards it (see :mod:`workbench.parallel.zero`), plus the replicated norms and positions.
"""
from __future__ import annotations

import warnings
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from workbench import comm, runtime
from workbench.comm.group import resolve_group
from workbench.models.moe import MoE
from workbench.parallel import expert, pipeline_split, tensor, tensor_plans
from workbench.parallel.context_model import check_args as check_cp_args
from workbench.parallel.context_model import context_parallel, shard_batch
from workbench.parallel.ddp import DistributedDataParallel
from workbench.parallel.expert import ExpertShardedOptimizer, expert_parallel
from workbench.parallel.fsdp import FullyShardedDataParallel
from workbench.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble, partition
from workbench.parallel.recompute import POLICIES
from workbench.parallel.recompute import recompute as checkpoint_blocks
from workbench.parallel.tensor import tensor_parallel, vocab_parallel_cross_entropy
from workbench.parallel.tp_ops import scatter_to_parallel
from workbench.parallel.zero import ShardedOptimizer

__all__ = ["Mesh", "layout", "parallelize", "ParallelModel", "DIMS", "SCHEDULES"]

DIMS = ("pp", "dp", "cp", "tp")  # the grid's axes, outermost first (Megatron's order)
_TIE_TAG = 1 << 24  # tags of the ZeRO-3 tied-gradient swap between the first and the last stage
SCHEDULES = ("gpipe", "1f1b", "zb-h1")
_TP_MARKS = ("_tp_dim", "_tp_chunks", "_tp_vocab", "_tp_transposed")  # how tensor parallelism split a parameter


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Mesh: {name}={value!r} must be a whole number >= 1")


def _check_order(order) -> tuple[str, ...]:
    if isinstance(order, (tuple, list)) and "cp" not in order and sorted(order) == ["dp", "pp", "tp"]:
        order = list(order)
        order.insert(order.index("tp"), "cp")  # context parallelism just outside tensor parallelism
    if not isinstance(order, (tuple, list)) or sorted(order) != sorted(DIMS):
        raise ValueError(f"Mesh: order={order!r} must name 'pp', 'dp' and 'tp' once each, outermost first, and "
                         f"'cp' or not (then it sits just outside 'tp') (Megatron's, the default: {DIMS})")
    return tuple(order)


def layout(dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, *, order=DIMS) -> dict[str, Any]:
    """The mesh's grid and groups, computed without any process group (for figures and checks).

    Returns ``{"grid": tensor (pp, dp, cp, tp), "order", "tp": [[ranks], ...], "cp", "dp", "pp",
    "dp_cp"}``: ``grid[p, d, c, t]`` is the rank at those coordinates, and each list holds every
    group of that dimension, each group's ranks in coordinate order (``dp_cp``: dp-major). ``order``:
    the dimensions from outermost (ranks furthest apart) to innermost (adjacent ranks); Megatron's
    ``("pp", "dp", "cp", "tp")`` by default, ``("pp", "tp", "dp")`` to place tensor parallelism
    across nodes instead, for example (an order without ``"cp"`` puts it just outside ``"tp"``).
    """
    _check_sizes(dp=dp, tp=tp, pp=pp, cp=cp)
    order = _check_order(order)
    sizes = {"dp": dp, "tp": tp, "pp": pp, "cp": cp}
    grid = torch.arange(pp * dp * cp * tp).view(*(sizes[d] for d in order))   # the layout, in one line
    grid = grid.permute(*(order.index(d) for d in DIMS))                       # indexed [pp, dp, cp, tp]
    return {"grid": grid, "order": order,
            "tp": grid.reshape(-1, tp).tolist(),                               # last axis varies: rows
            "cp": grid.permute(0, 1, 3, 2).reshape(-1, cp).tolist(),
            "dp": grid.permute(0, 2, 3, 1).reshape(-1, dp).tolist(),
            "pp": grid.permute(1, 2, 3, 0).reshape(-1, pp).tolist(),           # first axis varies
            "dp_cp": grid.permute(0, 3, 1, 2).reshape(-1, dp * cp).tolist()}   # dp and cp vary


# the groups made so far, per world (its default group, held weakly): shared by meshes, and let go
# with the world, so that ``destroy_process_group`` frees them (and a new world makes its own)
_GROUPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _new_group(ranks: list[int], local: bool) -> dist.ProcessGroup:
    """``torch.distributed.new_group(ranks)``, once per set of ranks. Over the whole world every
    rank creates every group, in the same order (torch's rule); inside a sub-group only the
    members do (``use_local_synchronization``, which names a group by its ranks: hence made once)."""
    made = _GROUPS.setdefault(dist.group.WORLD, {})
    key = tuple(ranks)
    if key not in made:
        made[key] = dist.new_group(ranks, use_local_synchronization=local) if local else dist.new_group(ranks)
    return made[key]


class Mesh:
    """The process-group manager: ``Mesh(dp=2, tp=2, pp=2)`` on 8 ranks, ``Mesh(dp=2, cp=2)`` on 4.

    ``group``: the ranks to lay out (default: all); ranks below are numbered in that group.
    Every rank of ``group`` must build the same mesh (creating the sub-groups is collective).
    ``coords``: this rank's ``{"dp", "tp", "pp", "cp"}``; ``group(dim)``: its group along ``dim``
    (or ``"dp_cp"``, the ranks that average gradients together); ``rank_of(dp=, tp=, pp=, cp=)``:
    the rank at those coordinates; ``size(dim)``: the dimension's size.
    ``order``: outermost dimension first (see :func:`layout`); Megatron's by default.
    ``ep``: experts sharded over groups of ``ep`` adjacent data-parallel ranks (must divide ``dp``;
    not an axis of the grid, so not in ``coords``: a rank's place in its group is ``dp % ep``), see
    "Expert parallelism" in the module docstring.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, cp: int = 1, *, ep: int = 1, group=None, order=DIMS):
        _check_sizes(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        if dp % ep:
            raise ValueError(f"Mesh(dp={dp}, ep={ep}): ep={ep} must divide dp={dp}: the experts are sharded over "
                             f"groups of ep data-parallel ranks, dp/ep copies of each; use an ep that divides {dp}")
        order = _check_order(order)
        view = resolve_group(group)
        if view is None:
            raise ValueError("Mesh(group=...): this rank is not in group; build the mesh on the group's ranks only")
        n = dp * tp * pp * cp
        if n != view.size:
            rest = tp * pp * cp
            with_cp = f", cp={cp}" if cp > 1 else ""
            raise ValueError(f"Mesh(dp={dp}, tp={tp}, pp={pp}{with_cp}): dp x tp x pp{' x cp' if cp > 1 else ''} = "
                             f"{n} but the group has {view.size} ranks; choose sizes whose product is {view.size} "
                             f"(e.g. dp={view.size // rest if view.size % rest == 0 else view.size}, "
                             f"or launch {n} ranks)")
        self.shape = {"dp": dp, "tp": tp, "pp": pp, "cp": cp, "ep": ep}
        self.parent = group
        self.rank = view.rank
        self.order = order
        groups = layout(dp, tp, pp, cp, order=order)
        self.grid = groups["grid"]
        p, d, c, t = (self.grid == self.rank).nonzero()[0].tolist()
        self.coords = {"dp": d, "tp": t, "pp": p, "cp": c}
        self._groups: dict[str, dist.ProcessGroup] = {}
        whole = group is None or group == dist.group.WORLD
        for dim in ("tp", "cp", "dp", "pp", "dp_cp"):  # dp_cp is dp's group when cp = 1 (made once)
            for ranks in groups[dim]:
                if whole or self.rank in ranks:
                    pg = _new_group([view.global_rank(r) for r in ranks], local=not whole)
                    if self.rank in ranks:
                        self._groups[dim] = pg
        self.groups = {dim: groups[dim] for dim in ("tp", "cp", "dp", "pp", "dp_cp")}
        if ep > 1:  # experts over ep adjacent data-parallel ranks ("ep"); the ranks with the same experts ("edp")
            self.groups["ep"] = [ranks[i:i + ep] for ranks in groups["dp"] for i in range(0, dp, ep)]
            self.groups["edp"] = [ranks[j::ep] for ranks in groups["dp"] for j in range(ep)] if dp > ep else []
            for dim in ("ep", "edp"):
                for ranks in self.groups[dim]:
                    if whole or self.rank in ranks:
                        pg = _new_group([view.global_rank(r) for r in ranks], local=not whole)
                        if self.rank in ranks:
                            self._groups[dim] = pg

    def _dim(self, dim: str) -> str:
        if dim not in self._groups:
            known = "'dp', 'tp', 'pp', 'cp', 'dp_cp'" + (", 'ep'" if self.shape["ep"] > 1 else "") + \
                (", 'edp'" if "edp" in self._groups else "")
            raise ValueError(f"Mesh: unknown dimension {dim!r} here: use one of {known}")
        return dim

    def group(self, dim: str) -> dist.ProcessGroup:
        """This rank's process group along ``dim`` ("dp", "tp", "pp", "cp", or "dp_cp"; with ``ep > 1``
        "ep", and "edp" where ``dp > ep``)."""
        return self._groups[self._dim(dim)]

    def size(self, dim: str) -> int:
        if dim in ("ep", "edp"):  # sizes even where no group is made (ep = 1; edp when dp = ep)
            return self.shape["ep"] if dim == "ep" else self.shape["dp"] // self.shape["ep"]
        dim = self._dim(dim)
        return self.shape["dp"] * self.shape["cp"] if dim == "dp_cp" else self.shape[dim]

    def rank_of(self, *, dp: int = 0, tp: int = 0, pp: int = 0, cp: int = 0) -> int:
        """The rank (in the mesh's group) at coordinates ``dp, tp, pp, cp``: in Megatron's order
        ``((pp dp_size + dp) cp_size + cp) tp_size + tp``."""
        for name, value in (("dp", dp), ("tp", tp), ("pp", pp), ("cp", cp)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.shape[name]:
                raise ValueError(f"Mesh.rank_of: {name}={value!r} is out of range 0..{self.shape[name] - 1}")
        return int(self.grid[pp, dp, cp, tp])

    def __repr__(self) -> str:
        cp = f", cp={self.shape['cp']}" if self.shape["cp"] > 1 else ""
        cp += f", ep={self.shape['ep']}" if self.shape["ep"] > 1 else ""
        return (f"Mesh(dp={self.shape['dp']}, tp={self.shape['tp']}, pp={self.shape['pp']}{cp}; rank {self.rank} "
                f"at {self.coords})")


# ==================================================================================== the composition

class _SequenceShardedPositions(nn.Embedding):
    """The position embedding of a sequence-parallel first stage: this rank's ``T/t`` positions,
    as the tensor-parallel GPT's forward takes them (the same Parameter, so names are kept)."""

    def __init__(self, wpe: nn.Embedding, group, algorithm: str):
        super().__init__(wpe.num_embeddings, wpe.embedding_dim, device=wpe.weight.device, dtype=wpe.weight.dtype)
        self.weight = wpe.weight
        self.group, self.algorithm = group, algorithm

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        return scatter_to_parallel(super().forward(pos), self.group, self.algorithm, dim=0)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class ParallelModel(nn.Module):
    """What :func:`parallelize` returns: this rank's part of the model, its optimizer, and the step.

    ``step(batch, targets) -> loss``: one training step on the *global* batch (every rank passes
    the same tensors; the mesh takes its rows), returning the global batch's mean loss on every
    rank (for a Hugging Face model ``batch`` is its ``input_ids`` and ``targets`` its ``labels``,
    shifted inside; each rank's mean is over its own tokens, so labels of -100 spread unevenly
    over the ranks make the result differ from the batch's mean). ``full_state_dict()``: every parameter, unsharded, under the single model's names, on
    every rank (a collective). ``module``: the wrapped stage this rank runs; ``optimizer``: its
    optimizer (the training loop may call ``zero_grad`` on it).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, *, zero_stage: int,
                 schedule, stage_module: nn.Module, owners: dict[str, int], shapes: dict, tp_info,
                 tp_marks: dict[str, dict], sharded_ties: dict, cp_layout: str = "zigzag",
                 hugging_face: bool = False):
        super().__init__()
        self.module = module            # this rank's stage, wrapped for data parallelism
        self.optimizer = optimizer
        self.mesh = mesh
        self.zero_stage = zero_stage
        self.schedule = schedule        # the pipeline schedule (None when pp = 1)
        self._stage_module = stage_module                 # the stage unwrapped (tensor-parallel layers)
        self._owners = owners           # parameter name -> the stage holding it
        self._shapes = shapes           # name -> (shape, dtype, device) in the single model
        self._tp_info, self._tp_marks = tp_info, tp_marks  # how each parameter is split over tp
        self._sharded_ties = sharded_ties                 # tied name -> its stages (ZeRO-3 sums them here)
        self.cp_layout = cp_layout      # which positions of each sequence a cp rank holds
        self._hugging_face = hugging_face  # model(input_ids=, labels=).loss, not our GPT's (logits, loss)
        _, self._dtype, self._device = next(iter(shapes.values()))

    def forward(self, *args, **kwargs):
        raise RuntimeError("ParallelModel runs whole training steps: call step(batch, targets)")

    def _local_rows(self, t: torch.Tensor, what: str) -> torch.Tensor:
        dp, d = self.mesh.size("dp"), self.mesh.coords["dp"]
        m = self.schedule.n_microbatches if self.schedule is not None else 1
        if not isinstance(t, torch.Tensor) or t.dim() < 1 or t.shape[0] % (dp * m):
            raise ValueError(f"ParallelModel.step: {what} has batch size "
                             f"{t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else t!r}, which must split "
                             f"into dp={dp} ranks x n_microbatches={m}: use a multiple of {dp * m}")
        rows = t.chunk(dp)[d]
        if self.mesh.size("cp") > 1:  # this rank's positions of each sequence
            rows = shard_batch(rows, self.mesh.group("cp"), self.cp_layout)
        return rows

    def step(self, batch: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward and optimizer update on the global batch; the global mean loss."""
        if not isinstance(targets, torch.Tensor) or not isinstance(batch, torch.Tensor) \
                or targets.shape[:1] != batch.shape[:1]:
            raise ValueError("ParallelModel.step(batch, targets): pass two tensors with the same batch size")
        x = self._local_rows(batch, "batch").to(self._device)
        y = self._local_rows(targets, "targets").to(self._device)
        self.optimizer.zero_grad(set_to_none=True)
        ddp = self.module if isinstance(self.module, DistributedDataParallel) else None
        if self.schedule is None:
            if self._hugging_face:  # labels shifted inside: the pipeline's causal_lm_loss
                loss = self.module(input_ids=x, labels=y).loss
            else:
                _, loss = self.module(x, y)
            loss.backward()
        else:
            loss = self._pipeline_step(x, y, ddp)
        self.optimizer.step()
        loss = loss.detach().clone().reshape(1)
        if self.mesh.size("dp_cp") > 1:  # each rank's mean over as many tokens: their mean is the batch's
            comm.all_reduce(loss, group=self.mesh.group("dp_cp"))
            loss /= self.mesh.size("dp_cp")
        return loss[0]

    def _pipeline_step(self, x, y, ddp) -> torch.Tensor:
        p, s = self.mesh.size("pp"), self.mesh.coords["pp"]
        losses: list[torch.Tensor] = []
        args = (x,) if s == 0 else ()
        target = y if s == p - 1 else None
        if ddp is not None:  # accumulate the micro-batches' gradients, average them once
            with ddp.no_sync():
                self.schedule.step(*args, target=target, losses=losses)
            ddp.synchronize_accumulated_gradients()
        else:
            self.schedule.step(*args, target=target, losses=losses)
        if self._sharded_ties:
            self._sum_sharded_ties()
        loss = torch.stack(losses).mean() if losses else torch.zeros((), dtype=self._dtype, device=self._device)
        comm.broadcast(loss, group=self.mesh.group("pp"), group_src=p - 1)  # the last stage's, to every stage
        return loss

    @torch.no_grad()
    def _sum_sharded_ties(self) -> None:
        """ZeRO-3's version of the pipeline's tied-gradient sum: the tied embedding's gradient is
        a slice of a flat unit sharded over ``dp``, laid out differently on the first and the last
        stage. Gather the unit's averaged gradient over ``dp``, swap the tied slice with the other
        stage's rank of the same ``(dp, tp)``, add, and keep this rank's shard of the sum."""
        fsdp = self.module
        fsdp.finish_gradient_synchronization()
        pp_group = self.mesh.group("pp")
        for k, (name, holders) in enumerate(sorted(self._sharded_ties.items())):
            unit, i = next((u, i) for u in fsdp.units for i, uses in enumerate(u.uses)
                           if any(n == name for _, _, n in uses))
            if unit.shard.grad is None:
                unit.shard.grad = torch.zeros_like(unit.shard)
            full = torch.empty(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
            comm.all_gather(list(full.chunk(unit.world)), unit.shard.grad, group=fsdp.process_group)
            mine = full[unit.offsets[i]:unit.offsets[i] + unit.numels[i]]
            peer = next(h for h in holders if h != self.mesh.coords["pp"])
            theirs = torch.empty_like(mine)
            works = [comm.irecv(theirs, group=pp_group, group_src=peer, tag=_TIE_TAG + k),
                     comm.isend(mine.clone(), group=pp_group, group_dst=peer, tag=_TIE_TAG + k)]
            for w in works:
                w.wait()
            mine += theirs
            unit.shard.grad.copy_(full.chunk(unit.world)[fsdp.rank])

    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter and buffer of the original model, unsharded, on every rank (collective:
        gathered over ``dp`` (ZeRO-3), then ``tp``, then sent from the stage that holds it)."""
        if isinstance(self.module, FullyShardedDataParallel):
            local = self.module.full_state_dict()
            if self._tp_info is not None:  # mark the gathered tensors as the originals were split
                for name, value in local.items():
                    for attr in _TP_MARKS:
                        setattr(value, attr, self._tp_marks.get(name, {}).get(attr))
                local = tensor.full_state_dict(_StateView(local, self._tp_info))
        elif self._tp_info is not None:
            local = tensor.full_state_dict(self._stage_module)
        elif self.mesh.size("ep") > 1:  # the experts gathered from the ep group
            local = expert.full_state_dict(self._stage_module)
        else:
            local = {k: v.detach().clone() for k, v in self._stage_module.state_dict().items()}
        if self.mesh.size("pp") == 1:
            return {name: local[name] for name in self._shapes}
        out = {}
        s = self.mesh.coords["pp"]
        for name, (shape, dtype, device) in self._shapes.items():
            owner = self._owners[name]
            value = local[name].contiguous() if owner == s else torch.empty(shape, dtype=dtype, device=device)
            comm.broadcast(value, group=self.mesh.group("pp"), group_src=owner)
            out[name] = value
        return out


class _StateView:
    """A state dict that :func:`workbench.parallel.tensor.full_state_dict` can gather over ``tp``."""

    def __init__(self, state: dict, tp_info):
        self._state, self._tensor_parallel = state, tp_info

    def state_dict(self, keep_vars: bool = False) -> dict:
        return self._state


def _optimizer_factory(optimizer_cls, kwargs) -> Callable:
    if isinstance(optimizer_cls, torch.optim.Optimizer) or not callable(optimizer_cls):
        raise ValueError(f"parallelize: optimizer_cls={optimizer_cls!r} must be an optimizer class such as "
                         "torch.optim.AdamW (not an instance), with its arguments as keywords (lr=1e-3)")
    return lambda params: optimizer_cls(params, **kwargs)


def parallelize(model: nn.Module, mesh: Mesh, *, zero_stage: int = 0, schedule: str = "1f1b",
                n_microbatches: int | None = None, sequence_parallel: bool = False, recompute: str = "none",
                recompute_layers: int | None = None, cp_method: str = "ring", cp_layout: str = "zigzag",
                tp_plan=None, pp_split=None, optimizer_cls=torch.optim.AdamW, **optimizer_kwargs) -> ParallelModel:
    """Compose tensor, pipeline, context and data parallelism (ZeRO ``zero_stage``) on ``model`` over ``mesh``.

    ``model``: a workbench GPT (``wte, wpe, blocks, ln_f, lm_head``) or a Hugging Face causal LM
    (``GPT2LMHeadModel``, ``LlamaForCausalLM``, or any with a plan and a split), built identically
    on every rank (same seed); it is split in place (tensor parallelism replaces its layers) and
    this rank keeps its stage: drop your own reference to ``model`` so the other stages' layers
    are freed. Our GPT trains as ``model(x, y) -> (logits, loss)``, any other model as Hugging
    Face's ``model(input_ids=x, labels=y).loss`` (labels shifted inside; its pipeline's loss
    :func:`~workbench.parallel.pipeline_split.causal_lm_loss`, the same).
    ``tp_plan`` (with ``tp > 1``): the ``plan`` of :func:`~workbench.parallel.tensor.tensor_parallel`
    (None: the shipped plan of the detected family, our GPT, ``"gpt2"`` or ``"llama"``; a name; a
    dict of module globs to styles). ``pp_split`` (with ``pp > 1``): the ``split`` of
    :func:`~workbench.parallel.pipeline.partition` (None: the built-in split, blocks balanced; the
    module names each later stage begins at, ``["model.layers.2"]``; or a callable returning the
    stages).
    ``schedule``:
    ``"1f1b"``, ``"gpipe"`` or ``"zb-h1"`` (with ``pp > 1``; zero-bubble H1, backward split into
    the input gradient B and the weight gradient W; not with recomputation);
    ``n_microbatches``: per data-parallel rank (default ``pp``; 1F1B and ZB-H1 need ``>= pp``).
    ``sequence_parallel``: split norms and residuals by sequence too (needs ``tp > 1``; with
    ZeRO-3 over ``dp > 1`` only where the norms are ``nn.LayerNorm``: not Llama's RMSNorm).
    ``zero_stage``: 0 DDP, 1-2 :class:`ShardedOptimizer`, 3 :class:`FullyShardedDataParallel`, over
    ``dp x cp`` (with ``dp = cp = 1`` there is nothing to shard and it has no effect).
    ``cp_method``: with ``mesh.size("cp") > 1``, attention over the cp group by ``"ring"`` or
    ``"ulysses"`` (heads per tensor-parallel rank divisible by cp); ``cp_layout``: ``"zigzag"``
    (sequence length a multiple of ``2 cp``, causal work balanced) or ``"contiguous"`` (a multiple
    of ``cp``). ``recompute``:
    ``"none"``, ``"full"`` (each block keeps its input and runs again in backward) or
    ``"selective"`` (only the attention core runs again); ``recompute_layers`` (with ``"full"``):
    only the first that many blocks of each pipeline stage run again, the others keep everything
    (Megatron-LM's ``--recompute-method block --recompute-num-layers``; None: every block).
    With ``mesh.size("ep") > 1`` the model's experts are sharded as the module docstring says
    (``zero_stage`` 0 or 1, tp = pp = cp = 1); a model with experts on a mesh with ``ep = 1`` is plain
    data parallelism, its load-balancing loss counted over every data-parallel rank's tokens.
    ``optimizer_cls(params, **optimizer_kwargs)`` builds the optimizer.
    Returns a :class:`ParallelModel`.
    """
    # -- every check before any message
    setup = _validate(model, mesh, zero_stage=zero_stage, schedule=schedule, n_microbatches=n_microbatches,
                      sequence_parallel=sequence_parallel, recompute=recompute, recompute_layers=recompute_layers,
                      cp_method=cp_method, cp_layout=cp_layout, tp_plan=tp_plan, pp_split=pp_split)
    make_optimizer = _optimizer_factory(optimizer_cls, optimizer_kwargs)

    model = model.to(runtime.device())
    device = next(model.parameters()).device
    shapes = {n: (v.shape, v.dtype, v.device) for n, v in model.state_dict().items()}

    # 1. tensor parallelism over tp, on the whole model (every stage's layers are then split)
    tp_info = None
    if setup.tp > 1:
        model = tensor_parallel(model, group=mesh.group("tp"), plan=tp_plan, sequence_parallel=sequence_parallel)
        tp_info = model._tensor_parallel
    # 2. pipeline over pp: this rank keeps its stage
    stage_module, owners = _take_stage(model, mesh, setup, pp_split, tp_info, sequence_parallel, shapes)
    # 3. context parallelism over cp: sequence shards, global positions, ring or Ulysses attention
    if setup.cp > 1:
        context_parallel(stage_module, mesh.group("cp"), method=cp_method, layout=cp_layout)
    if recompute != "none":   # this rank's blocks, before data parallelism wraps them (its hooks rerun)
        _recompute_blocks(model, stage_module, recompute, setup.ours, recompute_layers)
    marks = {name: {a: getattr(p, a, None) for a in _TP_MARKS}
             for name, p in stage_module.named_parameters(remove_duplicate=False)}
    # the tied tensors, under this stage's name for them (the last stage calls wte.weight lm_head.weight)
    ties = {_name_in(stage_module, name): holders
            for name, (_, holders) in getattr(stage_module, "shared_parameters", {}).items()}

    # 4. data parallelism over dp x cp, on this rank's stage
    wrapped, optimizer = _data_parallel(stage_module, mesh, setup, zero_stage, make_optimizer)
    sharded_ties = _who_sums_ties(wrapped, stage_module, ties)

    pipeline = _pipeline_schedule(wrapped, mesh, setup, schedule, tp_info, device) if setup.pp > 1 else None
    return ParallelModel(wrapped, optimizer, mesh, zero_stage=zero_stage, schedule=pipeline,
                         stage_module=stage_module, owners=owners, shapes=shapes, tp_info=tp_info,
                         tp_marks=marks, sharded_ties=sharded_ties, cp_layout=cp_layout, hugging_face=not setup.ours)


# ------------------------------------------------------------------ parallelize: the checks

@dataclass(frozen=True)
class _Setup:
    """What :func:`_validate` established about one call of :func:`parallelize`: the mesh's
    sizes, the model's family (``ours``: our GPT, ``model(x, y) -> (logits, loss)``; else Hugging
    Face's ``model(input_ids=, labels=).loss``), its experts and tie, and the micro-batch count."""

    ours: bool
    dp: int
    tp: int
    pp: int
    cp: int
    ep: int
    n_experts: int
    n_microbatches: int
    tied: bool  # a tied embedding and head: one Parameter reached under two names

    @property
    def dpc(self) -> int:
        """The ranks holding the same parameters (``dp x cp``): gradients are averaged over them."""
        return self.dp * self.cp


def _validate(model: nn.Module, mesh: Mesh, *, zero_stage, schedule, n_microbatches, sequence_parallel,
              recompute, cp_method, cp_layout, tp_plan, pp_split, recompute_layers=None) -> _Setup:
    """Every check of :func:`parallelize`'s arguments, in one fixed order, before any message.

    Each rank runs the same checks on the same arguments, so a bad call raises the same
    ``ValueError`` on every rank before any of them has sent anything: no rank is left waiting
    in a collective that the others never reach. Nothing here sends: ``mesh.size`` reads the
    mesh's shape, and the split and plan checks only read the model."""
    if not isinstance(mesh, Mesh):
        raise ValueError(f"parallelize(mesh={mesh!r}): pass a workbench.parallel.mesh.Mesh")
    if not isinstance(model, nn.Module):
        raise ValueError(f"parallelize(model={type(model).__name__}): pass an nn.Module (our GPT or a Hugging Face "
                         "causal LM), built identically on every rank")
    ours = tensor_plans.detect(model) == "gpt"  # model(x, y) -> (logits, loss); else model(input_ids=, labels=).loss
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"parallelize: zero_stage={zero_stage!r} must be 0 (DDP), 1, 2 (ShardedOptimizer) or "
                         "3 (FullyShardedDataParallel)")
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelize: schedule={schedule!r} is not one of {SCHEDULES}")
    dp, tp, pp, cp = mesh.size("dp"), mesh.size("tp"), mesh.size("pp"), mesh.size("cp")
    _check_context(model, ours, tp, cp, cp_method, cp_layout)
    n_microbatches = _check_microbatches(n_microbatches, schedule, pp)
    _check_recompute_and_sequence_parallel(recompute, sequence_parallel, schedule, tp, pp, recompute_layers)
    if pp > 1:
        _check_split(model, pp, pp_split)
    tied = len(list(model.named_parameters(remove_duplicate=False))) > len(list(model.parameters()))
    _check_zero(zero_stage, pp, tied, dp * cp)
    ep, n_experts = mesh.size("ep"), getattr(getattr(model, "config", None), "n_experts", 0)
    if ep > 1:
        _check_experts(ep, n_experts, zero_stage, tp, pp, cp)
    return _Setup(ours=ours, dp=dp, tp=tp, pp=pp, cp=cp, ep=ep, n_experts=n_experts,
                  n_microbatches=n_microbatches, tied=tied)


def _check_context(model: nn.Module, ours: bool, tp: int, cp: int, cp_method: str, cp_layout: str) -> None:
    """Context parallelism's arguments, and what it needs of the model: our GPT (a Hugging Face
    model derives positions and mask from the whole sequence), the heads of each tp rank divisible
    by ``cp`` for Ulysses (its all-to-all trades sequence shards for head shards), no dropout."""
    check_cp_args(cp_method, cp_layout)
    if cp > 1 and not ours:
        raise ValueError(f"parallelize: cp={cp} on {type(model).__name__}: context parallelism here shards our GPT's "
                         "positions and attention, and a Hugging Face model computes its own positions and mask from "
                         "the whole sequence; use cp=1 (tp, pp and dp/ZeRO work on it)")
    if cp > 1:
        config = getattr(model, "config", None)
        heads = getattr(config, "n_head", None)
        if cp_method == "ulysses" and heads is not None and (heads % tp or (heads // tp) % cp):
            raise ValueError(f"parallelize: cp_method='ulysses' needs the heads of each tp rank divisible by cp: "
                             f"n_head={heads}, tp={tp}, cp={cp} (n_head / tp = {heads / tp:g}); use "
                             "cp_method='ring', or a cp that divides the heads per tp rank")
        if getattr(config, "dropout", 0.0):
            raise ValueError(f"parallelize: cp={cp} with dropout={config.dropout}: ring and Ulysses attention apply "
                             "no dropout; build the model with GPTConfig(dropout=0)")


def _check_microbatches(n_microbatches, schedule: str, pp: int) -> int:
    """The micro-batches per data-parallel rank (default: ``pp``, one per stage), checked: a whole
    number, 1 without a pipeline, and ``>= pp`` for 1F1B and ZB-H1 (their steady state needs a
    micro-batch in every stage)."""
    if n_microbatches is None:
        n_microbatches = pp
    if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
        raise ValueError(f"parallelize: n_microbatches={n_microbatches!r} must be a whole number >= 1")
    if pp == 1 and n_microbatches != 1:
        raise ValueError(f"parallelize: n_microbatches={n_microbatches} needs a pipeline (pp > 1); with pp=1 "
                         "leave it None")
    if schedule in ("1f1b", "zb-h1") and pp > 1 and n_microbatches < pp:
        name = {"1f1b": "1F1B", "zb-h1": "ZB-H1"}[schedule]
        raise ValueError(f"parallelize: {name} needs n_microbatches >= pp stages: got {n_microbatches} < {pp}; "
                         "use more micro-batches or schedule='gpipe'")
    return n_microbatches


def _check_recompute_and_sequence_parallel(recompute: str, sequence_parallel, schedule: str, tp: int,
                                           pp: int, recompute_layers=None) -> None:
    """The activation-memory options: a known recomputation policy (some blocks only with ``full``),
    sequence parallelism only
    over ``tp > 1`` ranks, and no recomputation under ZB-H1 (its deferred W would keep what B
    recomputed alive until W runs, undoing the saving)."""
    if recompute not in POLICIES:
        raise ValueError(f"parallelize: recompute={recompute!r} must be one of {POLICIES}")
    if recompute_layers is not None and (isinstance(recompute_layers, bool) or not isinstance(recompute_layers, int)
                                         or recompute_layers < 1 or recompute != "full"):
        raise ValueError(f"parallelize: recompute_layers={recompute_layers!r} recomputes the first that many blocks "
                         f"of each stage whole: a whole number >= 1 with recompute='full' (got recompute={recompute!r}); "
                         "None recomputes every block")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"parallelize: sequence_parallel={sequence_parallel!r} must be True or False")
    if sequence_parallel and tp == 1:
        raise ValueError("parallelize: sequence_parallel=True splits by sequence over the tp ranks and needs "
                         "tp > 1; build the mesh with tp >= 2 or pass sequence_parallel=False")
    if schedule == "zb-h1" and pp > 1 and recompute != "none":
        raise ValueError(f"parallelize: schedule='zb-h1' with recompute={recompute!r} is not supported: B recomputes "
                         "each block and keeps what it recomputed until W runs, so the activations recomputation "
                         "frees come back, for longer; use schedule='1f1b' with recomputation, or zb-h1 without it")


def _check_zero(zero_stage: int, pp: int, tied: bool, dpc: int) -> None:
    """The ZeRO stage that cannot compose here: ZeRO-2 with a tied embedding cut across stages (it
    frees each gradient in backward, before the two stages add their halves)."""
    if pp > 1 and tied and zero_stage == 2 and dpc > 1:
        raise ValueError("parallelize: zero_stage=2 with pp > 1 and a tied embedding is not supported (ZeRO-2 "
                         "frees each gradient during backward, before the first and last stage can add their "
                         "halves of the tied one); use zero_stage=1 or 3, or untie it (GPTConfig(tie_weights=False), "
                         "Hugging Face's tie_word_embeddings=False)")


def _check_experts(ep: int, n_experts: int, zero_stage: int, tp: int, pp: int, cp: int) -> None:
    """Expert parallelism (``ep > 1``): a model with experts, ``ep`` dividing their number, and only
    data parallelism with ZeRO 0 or 1 beside it (see "Expert parallelism" in the module docstring)."""
    if not n_experts:
        raise ValueError(f"parallelize: the mesh has ep={ep} but the model has no experts: build it with "
                         "GPTConfig(n_experts=...) or use a mesh with ep=1")
    if n_experts % ep:
        raise ValueError(f"parallelize: n_experts={n_experts} does not split over ep={ep} ranks: use a multiple "
                         f"of {ep} experts, or an ep that divides {n_experts}")
    if tp > 1 or pp > 1 or cp > 1:
        raise ValueError(f"parallelize: ep={ep} with tp={tp}, pp={pp}, cp={cp} is not supported: expert "
                         "parallelism composes here with data parallelism only (a pipeline's load-balancing "
                         "loss would be per micro-batch, not the batch's); use Mesh(dp=..., ep=...)")
    if zero_stage > 1:
        raise ValueError(f"parallelize: zero_stage={zero_stage} with ep={ep} is not supported: ZeRO-{zero_stage} "
                         "shards the gradients (and ZeRO-3 the parameters) of every parameter over the dp ranks "
                         "as if they all held it, but with ep > 1 they hold different experts (each held by "
                         "dp/ep of them); use zero_stage=1 (optimizer state: the replicated parameters' over "
                         "dp, each expert's over its replicas) or 0")


# ------------------------------------------------------------------ parallelize: the steps

def _take_stage(model: nn.Module, mesh: Mesh, setup: _Setup, pp_split, tp_info, sequence_parallel: bool,
                shapes: dict) -> tuple[nn.Module, dict[str, int]]:
    """Step 2: cut the (tensor-parallel) model into ``pp`` stages and keep this rank's; returns it
    and, for every name of the single model's state, the stage that holds it (all 0 without a
    pipeline). The other stages are dropped here: their layers are freed once the caller lets go
    of ``model``. A sequence-parallel first stage of our GPT takes its ``T/t`` positions."""
    owners = {name: 0 for name in shapes}
    if setup.pp == 1:
        return model, owners
    stages = partition(model, setup.pp, pp_split)
    for k, st in enumerate(stages):
        for name in st.state_dict():
            owners[name] = k
    s = mesh.coords["pp"]
    stage_module = stages[s]
    if tp_info is not None:
        stage_module._tensor_parallel = tp_info  # so tensor.full_state_dict gathers the stage
        if sequence_parallel and s == 0 and setup.ours:  # (a Hugging Face model's hooks split its blocks' input)
            stage_module.wpe = _SequenceShardedPositions(stage_module.wpe, tp_info.group, tp_info.algorithm)
    return stage_module, owners


def _recompute_blocks(model: nn.Module, stage_module: nn.Module, recompute: str, ours: bool,
                      layers: int | None = None) -> None:
    """Activation recomputation on this rank's blocks (the first ``layers`` of them, or all), in
    place, before data parallelism wraps them (so its hooks run again with the recomputed forward)."""
    family = pipeline_split.detect(model)
    if ours or family is None:  # our GPT (or its stage) keeps them in .blocks; else recompute finds them
        checkpoint_blocks(stage_module, recompute, layers)
    else:  # the split's block list: the model's ModuleList, or a stage's ModuleDict of its blocks
        blocks = stage_module.get_submodule(pipeline_split.SPLITS[family].blocks)
        blocks = blocks.values() if isinstance(blocks, nn.ModuleDict) else blocks
        checkpoint_blocks(nn.ModuleList(blocks), recompute, layers)  # the same block objects, changed in place


def _data_parallel(stage_module: nn.Module, mesh: Mesh, setup: _Setup, zero_stage: int,
                   make_optimizer: Callable) -> tuple[nn.Module, Any]:
    """Step 4: data parallelism over ``dp x cp`` on this rank's stage; returns the module the step
    runs (the stage itself, or its DDP / FSDP wrapper) and its optimizer.

    Experts (``ep > 1``) get no DDP, which would average each expert with another rank's: their
    gradients are reduced by :func:`expert_parallel` (ZeRO-0) or :class:`ExpertShardedOptimizer`
    (ZeRO-1). Otherwise ZeRO-0 is DDP, ZeRO-3 FSDP, ZeRO-1/2 a :class:`ShardedOptimizer` on the
    bare stage; with one rank per replica group, a plain optimizer."""
    dpc = setup.dpc
    wrapped = stage_module
    if setup.n_experts and dpc > 1:  # the load-balancing loss counts every data-parallel rank's tokens
        for layer in stage_module.modules():
            if isinstance(layer, MoE):
                layer.group = mesh.group("dp_cp")
    if setup.ep > 1:  # experts over the ep group; no DDP, which would average every expert with another one
        expert_parallel(stage_module, mesh.group("ep"), data_parallel_group=mesh.group("dp"),
                        expert_data_parallel_group=mesh.group("edp") if setup.dp > setup.ep else None,
                        average_gradients=zero_stage == 0)
        optimizer = (ExpertShardedOptimizer(stage_module, make_optimizer) if zero_stage == 1
                     else make_optimizer(stage_module.parameters()))
    elif dpc > 1 and zero_stage == 0:  # an expert no token chose this step has no gradient: zeros
        wrapped = DistributedDataParallel(stage_module, process_group=mesh.group("dp_cp"),
                                          find_unused_parameters=bool(setup.n_experts))
        optimizer = make_optimizer(wrapped.parameters())
    elif dpc > 1 and zero_stage == 3:
        wrapped = FullyShardedDataParallel(stage_module, process_group=mesh.group("dp_cp"))
        optimizer = make_optimizer(wrapped.parameters())
    elif dpc > 1:
        optimizer = ShardedOptimizer(stage_module.parameters(), lambda params: make_optimizer(params),
                                     process_group=mesh.group("dp_cp"), shard_gradients=zero_stage == 2)
    else:
        optimizer = make_optimizer(stage_module.parameters())
    return wrapped, optimizer


def _who_sums_ties(wrapped: nn.Module, stage_module: nn.Module, ties: dict) -> dict:
    """Who sums the tied embedding's gradient between the first and the last stage. Under FSDP
    the mesh does (the parameters are flat shards: :meth:`ParallelModel._sum_sharded_ties`), so
    the ties are returned for it; otherwise the pipeline does, by the ``shared_parameters`` of
    the module it runs, so a wrapper (DDP) is given the stage's. Returns ``{}`` then."""
    if isinstance(wrapped, FullyShardedDataParallel):  # FSDP replaced the parameters: mesh sums the ties
        return ties
    if wrapped is not stage_module and hasattr(stage_module, "shared_parameters"):
        wrapped.shared_parameters = stage_module.shared_parameters  # the pipeline sums tied gradients by it
    return {}


def _pipeline_schedule(wrapped: nn.Module, mesh: Mesh, setup: _Setup, schedule: str, tp_info, device):
    """The schedule running this rank's (wrapped) stage over the ``pp`` group, with the stage's loss:
    vocabulary-parallel cross-entropy on our GPT's tensor-parallel head shards, else the loss on
    whole logits (our GPT's, or Hugging Face's with labels shifted by one)."""
    if schedule == "zb-h1" and isinstance(wrapped, FullyShardedDataParallel):
        warnings.warn("parallelize: schedule='zb-h1' with zero_stage=3 defers no weight gradient: FSDP's "
                      "parameters are flat 1-D shards, and the split defers only matrices, so B runs the whole "
                      "backward (1F1B's work and memory in ZB-H1's order); use zero_stage=1 to defer W",
                      stacklevel=3)  # the caller of parallelize
    if tp_info is not None and tp_info.loss_parallel:  # our GPT's head: this rank's vocabulary shard
        def loss_fn(logits, target):
            return vocab_parallel_cross_entropy(logits, target, tp_info.group, vocab_size=tp_info.vocab_size,
                                                algorithm=tp_info.algorithm)
    else:  # whole logits: our GPT's loss, or Hugging Face's (labels shifted by one)
        loss_fn = _cross_entropy if setup.ours else pipeline_split.causal_lm_loss
    cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "zb-h1": ScheduleZeroBubble}[schedule]
    return cls(PipelineStage(wrapped, mesh.coords["pp"], setup.pp, device=device, group=mesh.group("pp")),
               setup.n_microbatches, loss_fn=loss_fn)


def _check_split(model: nn.Module, pp: int, split) -> None:
    """The pipeline's split, checked before tensor parallelism changes the model (partition
    checks it again); a callable split is the user's and is checked by partition."""
    if callable(split) and not isinstance(split, str):
        return
    family = pipeline_split.detect(model)
    if family is None:
        raise ValueError(f"parallelize(model={type(model).__name__}): pp={pp} cuts the model into stages, and it has "
                         "no built-in split (our GPT, Hugging Face GPT-2 and Llama have one): pass "
                         "pp_split=callable(model, num_stages) returning the stages, or use pp=1")
    blocks = len(model.get_submodule(pipeline_split.SPLITS[family].blocks))
    if pp > blocks:
        raise ValueError(f"parallelize: pp={pp} stages but the model has {blocks} blocks; each stage "
                         "needs one: use a smaller pp or a deeper model")
    if split is not None and not isinstance(split, (list, tuple)):
        raise ValueError(f"parallelize: pp_split={split!r} must be None, a list of the module names later stages "
                         f"begin at (for example {pipeline_split.boundaries(model, family)[:1]}) or a callable")
    if split is not None:
        pipeline_split.split_points(model, family, pp, split)


def _name_in(module: nn.Module, name: str) -> str:
    """The first name under which ``module`` holds the parameter another module calls ``name``
    (the shared-parameter entries of a stage name the tensor as the first stage does)."""
    param = dict(module.named_parameters(remove_duplicate=False)).get(name)
    if param is not None:
        return name
    shared = module.shared_parameters[name][0]
    return next(n for n, p in module.named_parameters(remove_duplicate=False) if p is shared)
