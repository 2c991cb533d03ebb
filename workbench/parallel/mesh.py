"""3D parallelism: one mesh of ranks, data x tensor x pipeline, and the strategies composed on it.

The mesh (picotron's process-group manager, torch's ``init_device_mesh`` with named dimensions)
lays the ``N = pp x dp x tp`` ranks out in one grid, in Megatron's order -- tensor-parallel
ranks adjacent (they exchange activations in every layer, so they belong on one node and its
fast links), then data-parallel, then pipeline (one point-to-point message per micro-batch and
stage boundary is the cheapest traffic, so it may cross the slowest links)::

    grid = torch.arange(N).view(pp, dp, tp)     # grid[p, d, t] is the rank at those coordinates

    dp=2, tp=2, pp=2:  stage 0  [[0, 1],        tp groups: rows     {0,1} {2,3} {4,5} {6,7}
                                 [2, 3]]        dp groups: columns  {0,2} {1,3} {4,6} {5,7}
                       stage 1  [[4, 5],        pp groups: across   {0,4} {1,5} {2,6} {3,7}
                                 [6, 7]]

A rank belongs to exactly one group of each dimension: the ranks that differ from it in that
coordinate only. :func:`layout` gives the groups without a process group (for figures:
:func:`workbench.plots.mesh_grid`).

Composition (:func:`parallelize`), innermost first, each step the existing strategy given its
group, nothing re-implemented:

1. **Tensor parallelism** over ``tp`` (:func:`workbench.parallel.tensor.tensor_parallel`): heads,
   MLP units and vocabulary split, the loss the vocabulary-parallel cross-entropy.
2. **Pipeline parallelism** over ``pp`` (:func:`workbench.parallel.pipeline.partition` and a
   schedule: GPipe, 1F1B or ZB-H1): the tensor-parallel model is cut into stages, so every stage's
   layers are already split; the ``tp`` ranks of a stage run the same schedule in lockstep, each on
   its shard, and each sends its activation to the rank of the next stage with the same ``(dp,
   tp)`` coordinates. The tied embedding's two copies (first and last stage) have their gradients
   summed between those ranks, shard by shard.
3. **Data parallelism** over ``dp`` on this rank's stage: ZeRO-0 (:class:`DistributedDataParallel`,
   the micro-batches' gradients accumulated under ``no_sync`` and averaged once after the
   schedule), ZeRO-1/2 (:class:`ShardedOptimizer`) or ZeRO-3 (:class:`FullyShardedDataParallel`).

Activation recomputation (``recompute="full"`` or ``"selective"``,
:func:`workbench.parallel.recompute.recompute`) checkpoints this rank's blocks after steps 1-2, so
it composes with all three: a block recomputed in backward runs its tensor-parallel collectives
again (Megatron's full recomputation does the same), and under ZeRO-3 gathers its unit again.

One step: data-parallel rank ``d`` takes rows ``[d B/dp, (d+1) B/dp)`` of the global batch; its
pipeline splits them into ``m`` micro-batches; every ``tp`` rank sees them whole. The returned
loss is the global batch's mean (the last stage's micro-batch means averaged, sent to the other
stages, averaged over ``dp``) on every rank; the gradients are those of that mean, so training
equals one process on the global batch.

Cost per step and rank (``psi`` parameters, ``b`` rows per data-parallel rank, ``s`` sequence,
``h`` hidden, ``L`` layers): tensor parallelism 4 all-reduces of ``b s h`` per layer of its stage
(``L/pp`` layers) over ``tp``; the pipeline ``2 m`` messages of ``b s h / m`` per stage boundary
(``b s h / tp`` with sequence parallelism) and a bubble ``(pp-1)/(m+pp-1)``; data parallelism
``2 (dp-1)/dp`` times this rank's ``psi / (tp pp)`` parameters (ZeRO-3: 3x instead of 2x).
Model state per rank (float32 Adam): ``16 psi / (tp pp)`` bytes, divided by ``dp`` as ZeRO
shards it (see :mod:`workbench.parallel.zero`), plus the replicated norms and positions.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from workbench import comm
from workbench.comm.group import resolve_group

__all__ = ["Mesh", "layout", "parallelize", "ParallelModel", "DIMS", "SCHEDULES"]

DIMS = ("pp", "dp", "tp")  # the grid's axes, outermost first (Megatron's order)
_TIE_TAG = 1 << 24  # tags of the ZeRO-3 tied-gradient swap between the first and the last stage
SCHEDULES = ("gpipe", "1f1b", "zb-h1")


def _check_sizes(**sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"Mesh: {name}={value!r} must be a whole number >= 1")


def _check_order(order) -> tuple[str, ...]:
    if not isinstance(order, (tuple, list)) or sorted(order) != sorted(DIMS):
        raise ValueError(f"Mesh: order={order!r} must name 'pp', 'dp' and 'tp' once each, outermost first "
                         f"(Megatron's, the default: {DIMS})")
    return tuple(order)


def layout(dp: int = 1, tp: int = 1, pp: int = 1, *, order=DIMS) -> dict[str, Any]:
    """The mesh's grid and groups, computed without any process group (for figures and checks).

    Returns ``{"grid": tensor (pp, dp, tp), "order", "tp": [[ranks], ...], "dp": [...], "pp": [...]}``:
    ``grid[p, d, t]`` is the rank at those coordinates, and each list holds every group of that
    dimension, each group's ranks in coordinate order. ``order``: the dimensions from outermost
    (ranks furthest apart) to innermost (adjacent ranks); Megatron's ``("pp", "dp", "tp")`` by
    default, ``("pp", "tp", "dp")`` to place tensor parallelism across nodes instead, for example.
    """
    _check_sizes(dp=dp, tp=tp, pp=pp)
    order = _check_order(order)
    sizes = {"dp": dp, "tp": tp, "pp": pp}
    grid = torch.arange(pp * dp * tp).view(*(sizes[d] for d in order))   # the layout, in one line
    grid = grid.permute(*(order.index(d) for d in DIMS))                  # indexed [pp, dp, tp]
    return {"grid": grid, "order": order,
            "tp": grid.reshape(-1, tp).tolist(),                     # last axis varies: rows
            "dp": grid.permute(0, 2, 1).reshape(-1, dp).tolist(),    # middle axis varies
            "pp": grid.permute(1, 2, 0).reshape(-1, pp).tolist()}    # first axis varies


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
    """The 3D process-group manager: ``Mesh(dp=2, tp=2, pp=2)`` on 8 ranks.

    ``group``: the ranks to lay out (default: all); ranks below are numbered in that group.
    Every rank of ``group`` must build the same mesh (creating the sub-groups is collective).
    ``coords``: this rank's ``{"dp", "tp", "pp"}``; ``group(dim)``: its group along ``dim``;
    ``rank_of(dp=, tp=, pp=)``: the rank at those coordinates; ``size(dim)``: the dimension's size.
    ``order``: outermost dimension first (see :func:`layout`); Megatron's by default.
    """

    def __init__(self, dp: int = 1, tp: int = 1, pp: int = 1, *, group=None, order=DIMS):
        _check_sizes(dp=dp, tp=tp, pp=pp)
        order = _check_order(order)
        view = resolve_group(group)
        if view is None:
            raise ValueError("Mesh(group=...): this rank is not in group; build the mesh on the group's ranks only")
        if dp * tp * pp != view.size:
            raise ValueError(f"Mesh(dp={dp}, tp={tp}, pp={pp}): dp x tp x pp = {dp * tp * pp} but the group has "
                             f"{view.size} ranks; choose sizes whose product is {view.size} "
                             f"(e.g. dp={view.size // (tp * pp) if view.size % (tp * pp) == 0 else view.size}, "
                             f"or launch {dp * tp * pp} ranks)")
        self.shape = {"dp": dp, "tp": tp, "pp": pp}
        self.parent = group
        self.rank = view.rank
        self.order = order
        groups = layout(dp, tp, pp, order=order)
        self.grid = groups["grid"]
        p, d, t = (self.grid == self.rank).nonzero()[0].tolist()
        self.coords = {"dp": d, "tp": t, "pp": p}
        self._groups: dict[str, dist.ProcessGroup] = {}
        whole = group is None or group == dist.group.WORLD
        for dim in ("tp", "dp", "pp"):
            for ranks in groups[dim]:
                if whole or self.rank in ranks:
                    pg = _new_group([view.global_rank(r) for r in ranks], local=not whole)
                    if self.rank in ranks:
                        self._groups[dim] = pg
        self.groups = {dim: groups[dim] for dim in ("tp", "dp", "pp")}

    def _dim(self, dim: str) -> str:
        if dim not in self.shape:
            raise ValueError(f"Mesh: unknown dimension {dim!r}: use one of 'dp', 'tp', 'pp'")
        return dim

    def group(self, dim: str) -> dist.ProcessGroup:
        """This rank's process group along ``dim`` ("dp", "tp" or "pp")."""
        return self._groups[self._dim(dim)]

    def size(self, dim: str) -> int:
        return self.shape[self._dim(dim)]

    def rank_of(self, *, dp: int = 0, tp: int = 0, pp: int = 0) -> int:
        """The rank (in the mesh's group) at coordinates ``dp, tp, pp``: in Megatron's order
        ``(pp dp_size + dp) tp_size + tp``."""
        for name, value in (("dp", dp), ("tp", tp), ("pp", pp)):
            if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < self.shape[name]:
                raise ValueError(f"Mesh.rank_of: {name}={value!r} is out of range 0..{self.shape[name] - 1}")
        return int(self.grid[pp, dp, tp])

    def __repr__(self) -> str:
        return (f"Mesh(dp={self.shape['dp']}, tp={self.shape['tp']}, pp={self.shape['pp']}; rank {self.rank} "
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
        from workbench.parallel.tp_ops import scatter_to_parallel

        return scatter_to_parallel(super().forward(pos), self.group, self.algorithm, dim=0)


def _cross_entropy(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


class ParallelModel(nn.Module):
    """What :func:`parallelize` returns: this rank's part of the model, its optimizer, and the step.

    ``step(batch, targets) -> loss``: one training step on the *global* batch (every rank passes
    the same tensors; the mesh takes its rows), returning the global batch's mean loss on every
    rank. ``full_state_dict()``: every parameter, unsharded, under the single model's names, on
    every rank (a collective). ``module``: the wrapped stage this rank runs; ``optimizer``: its
    optimizer (the training loop may call ``zero_grad`` on it).
    """

    def __init__(self, module: nn.Module, optimizer: torch.optim.Optimizer, mesh: Mesh, *, zero_stage: int,
                 schedule, stage_module: nn.Module, owners: dict[str, int], shapes: dict, tp_info,
                 tp_marks: dict[str, dict], sharded_ties: dict):
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
        return t.chunk(dp)[d]

    def step(self, batch: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, backward and optimizer update on the global batch; the global mean loss."""
        if not isinstance(targets, torch.Tensor) or not isinstance(batch, torch.Tensor) \
                or targets.shape[:1] != batch.shape[:1]:
            raise ValueError("ParallelModel.step(batch, targets): pass two tensors with the same batch size")
        x = self._local_rows(batch, "batch").to(self._device)
        y = self._local_rows(targets, "targets").to(self._device)
        self.optimizer.zero_grad(set_to_none=True)
        from workbench.parallel.ddp import DistributedDataParallel

        ddp = self.module if isinstance(self.module, DistributedDataParallel) else None
        if self.schedule is None:
            _, loss = self.module(x, y)
            loss.backward()
        else:
            loss = self._pipeline_step(x, y, ddp)
        self.optimizer.step()
        loss = loss.detach().clone().reshape(1)
        if self.mesh.size("dp") > 1:
            comm.all_reduce(loss, group=self.mesh.group("dp"))
            loss /= self.mesh.size("dp")
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
        from workbench.parallel import tensor
        from workbench.parallel.fsdp import FullyShardedDataParallel

        if isinstance(self.module, FullyShardedDataParallel):
            local = self.module.full_state_dict()
            if self._tp_info is not None:  # mark the gathered tensors as the originals were split
                for name, value in local.items():
                    for attr in ("_tp_dim", "_tp_chunks", "_tp_vocab"):
                        setattr(value, attr, self._tp_marks.get(name, {}).get(attr))
                local = tensor.full_state_dict(_StateView(local, self._tp_info))
        elif self._tp_info is not None:
            local = tensor.full_state_dict(self._stage_module)
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
                optimizer_cls=torch.optim.AdamW, **optimizer_kwargs) -> ParallelModel:
    """Compose tensor, pipeline and data parallelism (ZeRO ``zero_stage``) on ``model`` over ``mesh``.

    ``model``: a workbench GPT (``wte, wpe, blocks, ln_f, lm_head``), built identically on every
    rank (same seed); it is split in place (tensor parallelism replaces its layers) and this rank
    keeps its stage: drop your own reference to ``model`` so the other stages' layers are freed.
    ``schedule``:
    ``"1f1b"``, ``"gpipe"`` or ``"zb-h1"`` (with ``pp > 1``; zero-bubble H1, backward split into
    the input gradient B and the weight gradient W; not with recomputation);
    ``n_microbatches``: per data-parallel rank (default ``pp``; 1F1B and ZB-H1 need ``>= pp``).
    ``sequence_parallel``: split norms and residuals by sequence too (needs ``tp > 1``).
    ``zero_stage``: 0 DDP, 1-2 :class:`ShardedOptimizer`, 3 :class:`FullyShardedDataParallel`, over
    ``dp`` (with ``dp = 1`` there is nothing to shard and it has no effect). ``recompute``:
    ``"none"``, ``"full"`` (each block keeps its input and runs again in backward) or
    ``"selective"`` (only the attention core runs again).
    ``optimizer_cls(params, **optimizer_kwargs)`` builds the optimizer.
    Returns a :class:`ParallelModel`.
    """
    from workbench import runtime
    from workbench.parallel.ddp import DistributedDataParallel
    from workbench.parallel.fsdp import FullyShardedDataParallel
    from workbench.parallel.pipeline import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble, partition
    from workbench.parallel.tensor import tensor_parallel, vocab_parallel_cross_entropy
    from workbench.parallel.zero import ShardedOptimizer

    # -- every check before any message
    if not isinstance(mesh, Mesh):
        raise ValueError(f"parallelize(mesh={mesh!r}): pass a workbench.parallel.mesh.Mesh")
    if not isinstance(model, nn.Module) or not all(hasattr(model, a) for a in ("wte", "wpe", "blocks", "lm_head")):
        raise ValueError(f"parallelize(model={type(model).__name__}): pass a GPT-shaped model (wte, wpe, blocks, "
                         "ln_f, lm_head), built identically on every rank")
    if zero_stage not in (0, 1, 2, 3) or isinstance(zero_stage, bool):
        raise ValueError(f"parallelize: zero_stage={zero_stage!r} must be 0 (DDP), 1, 2 (ShardedOptimizer) or "
                         "3 (FullyShardedDataParallel)")
    if schedule not in SCHEDULES:
        raise ValueError(f"parallelize: schedule={schedule!r} is not one of {SCHEDULES}")
    dp, tp, pp = mesh.size("dp"), mesh.size("tp"), mesh.size("pp")
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
    from workbench.parallel.recompute import POLICIES
    from workbench.parallel.recompute import recompute as checkpoint_blocks

    if recompute not in POLICIES:
        raise ValueError(f"parallelize: recompute={recompute!r} must be one of {POLICIES}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"parallelize: sequence_parallel={sequence_parallel!r} must be True or False")
    if sequence_parallel and tp == 1:
        raise ValueError("parallelize: sequence_parallel=True splits by sequence over the tp ranks and needs "
                         "tp > 1; build the mesh with tp >= 2 or pass sequence_parallel=False")
    if schedule == "zb-h1" and pp > 1 and recompute != "none":
        raise ValueError(f"parallelize: schedule='zb-h1' with recompute={recompute!r} is not supported: B recomputes "
                         "each block and keeps what it recomputed for W (measured on GPT tiny, dp2 x pp2: 16.8 MB "
                         "of activations on the last stage against 0.9 MB with 1f1b), which defeats recomputation; "
                         "use schedule='1f1b' with recomputation, or zb-h1 without it")
    if pp > len(model.blocks):
        raise ValueError(f"parallelize: pp={pp} stages but the model has {len(model.blocks)} blocks; each stage "
                         "needs one: use a smaller pp or a deeper model")
    tied = model.lm_head.weight is model.wte.weight
    if pp > 1 and tied and zero_stage == 2 and dp > 1:
        raise ValueError("parallelize: zero_stage=2 with pp > 1 and a tied embedding is not supported (ZeRO-2 "
                         "frees each gradient during backward, before the first and last stage can add their "
                         "halves of the tied one); use zero_stage=1 or 3, or GPTConfig(tie_weights=False)")
    make_optimizer = _optimizer_factory(optimizer_cls, optimizer_kwargs)

    model = model.to(runtime.device())
    device = next(model.parameters()).device
    shapes = {n: (v.shape, v.dtype, v.device) for n, v in model.state_dict().items()}

    # 1. tensor parallelism over tp, on the whole model (every stage's layers are then split)
    tp_info = None
    if tp > 1:
        model = tensor_parallel(model, group=mesh.group("tp"), sequence_parallel=sequence_parallel)
        tp_info = model._tensor_parallel

    # 2. pipeline over pp: this rank keeps its stage
    owners = {name: 0 for name in shapes}
    if pp > 1:
        stages = partition(model, pp)
        for k, st in enumerate(stages):
            for name in st.state_dict():
                owners[name] = k
        s = mesh.coords["pp"]
        stage_module = stages[s]
        if tp_info is not None:
            stage_module._tensor_parallel = tp_info  # so tensor.full_state_dict gathers the stage
            if sequence_parallel and s == 0:
                stage_module.wpe = _SequenceShardedPositions(stage_module.wpe, tp_info.group, tp_info.algorithm)
        del stages
    else:
        stage_module = model
    if recompute != "none":   # this rank's blocks, before data parallelism wraps them (its hooks rerun)
        checkpoint_blocks(stage_module, recompute)
    marks = {name: {a: getattr(p, a, None) for a in ("_tp_dim", "_tp_chunks", "_tp_vocab")}
             for name, p in stage_module.named_parameters(remove_duplicate=False)}

    # the tied tensors, under this stage's name for them (the last stage calls wte.weight lm_head.weight)
    ties = {_name_in(stage_module, name): holders
            for name, (_, holders) in getattr(stage_module, "shared_parameters", {}).items()}

    # 3. data parallelism over dp, on this rank's stage
    wrapped = stage_module
    if dp > 1 and zero_stage == 0:
        wrapped = DistributedDataParallel(stage_module, process_group=mesh.group("dp"))
        optimizer = make_optimizer(wrapped.parameters())
    elif dp > 1 and zero_stage == 3:
        wrapped = FullyShardedDataParallel(stage_module, process_group=mesh.group("dp"))
        optimizer = make_optimizer(wrapped.parameters())
    elif dp > 1:
        optimizer = ShardedOptimizer(stage_module.parameters(), lambda params: make_optimizer(params),
                                     process_group=mesh.group("dp"), shard_gradients=zero_stage == 2)
    else:
        optimizer = make_optimizer(stage_module.parameters())
    sharded_ties = {}
    if isinstance(wrapped, FullyShardedDataParallel):  # FSDP replaced the parameters: mesh sums the ties
        sharded_ties = ties
    elif wrapped is not stage_module and hasattr(stage_module, "shared_parameters"):
        wrapped.shared_parameters = stage_module.shared_parameters  # the pipeline sums tied gradients by it

    pipeline = None
    if pp > 1 and schedule == "zb-h1" and isinstance(wrapped, FullyShardedDataParallel):
        import warnings

        warnings.warn("parallelize: schedule='zb-h1' with zero_stage=3 defers no weight gradient: FSDP's "
                      "parameters are flat 1-D shards, and the split defers only matrices, so B runs the whole "
                      "backward (1F1B's work and memory in ZB-H1's order); use zero_stage=1 to defer W",
                      stacklevel=2)
    if pp > 1:
        if tp_info is not None:
            def loss_fn(logits, target):
                return vocab_parallel_cross_entropy(logits, target, tp_info.group, vocab_size=tp_info.vocab_size,
                                                    algorithm=tp_info.algorithm)
        else:
            loss_fn = _cross_entropy
        cls = {"1f1b": Schedule1F1B, "gpipe": ScheduleGPipe, "zb-h1": ScheduleZeroBubble}[schedule]
        pipeline = cls(PipelineStage(wrapped, mesh.coords["pp"], pp, device=device, group=mesh.group("pp")),
                       n_microbatches, loss_fn=loss_fn)
    return ParallelModel(wrapped, optimizer, mesh, zero_stage=zero_stage, schedule=pipeline,
                         stage_module=stage_module, owners=owners, shapes=shapes, tp_info=tp_info,
                         tp_marks=marks, sharded_ties=sharded_ties)


def _name_in(module: nn.Module, name: str) -> str:
    """The first name under which ``module`` holds the parameter another module calls ``name``
    (the shared-parameter entries of a stage name the tensor as the first stage does)."""
    param = dict(module.named_parameters(remove_duplicate=False)).get(name)
    if param is not None:
        return name
    shared = module.shared_parameters[name][0]
    return next(n for n, p in module.named_parameters(remove_duplicate=False) if p is shared)


# ==================================================================================== workbench compare

def _wrap_mesh(dp: int, tp: int, pp: int, zero_stage: int):
    """A strategy of the registry: the mesh over all ranks of the launch, the optimizer the loop gives."""
    def wrap(model: nn.Module, make_optimizer):
        trained = parallelize(model, Mesh(dp=dp, tp=tp, pp=pp), zero_stage=zero_stage,
                              optimizer_cls=lambda params: make_optimizer(params))
        return trained, trained.optimizer
    return wrap


def _mesh_step(model: ParallelModel, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mesh takes the whole global batch and returns its mean loss on every rank."""
    return model.step(x, y)


def _register() -> None:
    from workbench import strategies

    common = dict(batch=strategies.whole_batch, step=_mesh_step, global_loss=strategies.same_on_every_rank)
    strategies.register(strategies.Strategy(
        "2d", "ours: mesh dp=2 x tp=2 (4 ranks): tensor parallelism inside pairs of adjacent ranks, DDP across "
        "them", True, _wrap_mesh(2, 2, 1, 0), world_size=4, **common))
    strategies.register(strategies.Strategy(
        "3d", "ours: mesh dp=2 x tp=2 x pp=2 (8 ranks): 1F1B over 2 stages of tensor-parallel pairs, ZeRO-1 "
        "across replicas", True, _wrap_mesh(2, 2, 2, 1), world_size=8, default=False, **common))


_register()
