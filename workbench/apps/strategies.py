"""The registry of training strategies that ``workbench compare`` runs side by side.

A strategy is one way of spreading the same training over ranks. The common training loop
(:mod:`workbench.apps.train`) asks it three questions, and never special-cases one:

1. **How is the model wrapped?** ``wrap(model, make_optimizer) -> (model, optimizer)`` is called
   inside every rank on an identically initialised model.
2. **How does the global batch reach this rank?** ``batch(x, y, rank, world_size) -> (x, y)``.
   Data parallelism keeps rank r's rows of the global batch (:func:`shard_rows`, the default);
   tensor-parallel ranks all see the whole batch (:func:`whole_batch`); a pipeline feeds the
   inputs to its first stage and the targets to its last; a mesh does all three.
3. **How does one step run?** ``step(model, optimizer, x, y) -> loss`` runs forward, backward
   and the optimizer update (the loop then measures the model state and zeroes the gradients), and
   returns this rank's loss tensor, or None on a rank that computes no loss (a pipeline's middle
   stages). ``global_loss(loss, world_size) -> float`` turns the ranks' losses into the loss of
   the global batch, the same number on every rank (every rank must call it: it may communicate).

The defaults are data parallelism's answers::

    model, optimizer = strategy.wrap(model, make_optimizer)
    for step in range(steps):
        x, y = strategy.batch(*global_batch(step), rank, world_size)   # shard_rows
        loss = strategy.step(model, optimizer, x, y)                    # data_parallel_step
        optimizer.zero_grad()
        report(strategy.global_loss(loss, world_size))                  # mean_over_ranks

so whatever a data-parallel strategy does (all-reducing gradients, sharding optimizer state,
gathering parameters) happens inside the wrapped model's forward/backward and the optimizer's
step. ``distributed=False`` means one process trains on the whole global batch (the reference).
``world_size`` pins the number of ranks a strategy needs (a 2 x 2 mesh needs 4), whatever
``--world-size`` says; None uses ``--world-size``. ``default=False`` leaves a strategy out of a
``workbench compare`` run that names none (one too slow for every run, e.g. 8 ranks on 2 cores);
``--strategies NAME`` still runs it.

Adding a strategy is one call in this module, the one place that names them (a strategy's own
module in :mod:`workbench.parallel` registers nothing: the registry is the app's, a layer above)::

    register(Strategy("zero1", "ZeRO-1: optimizer state sharded", True, wrap_zero1))
    register(Strategy("tp", "tensor parallel", True, wrap_tp, batch=whole_batch))

Built in: ``single`` (the reference), and PyTorch's own ``torch-ddp`` and ``torch-fsdp``, so
every strategy of ours is measured beside PyTorch's in the same table.

Mixed precision (``workbench compare --precision bf16``): a strategy that accepts it takes a
keyword ``mp_policy`` (a :class:`workbench.parallel.MixedPrecision`) in ``wrap``; the loop
passes it only when the precision is not float32, and refuses a strategy whose ``wrap`` has
no such argument (:func:`supports_mixed_precision`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Optional
import inspect

import torch
import torch.distributed as dist
import torch.nn as nn

from workbench import runtime
from workbench.models.data import shard_batch
from workbench.parallel import DistributedDataParallel, FullyShardedDataParallel, ShardedOptimizer
from workbench.parallel.mesh import Mesh, ParallelModel, parallelize
from workbench.parallel.pipeline import PipelineStage, Schedule1F1B, partition
from workbench.parallel.tensor import tensor_parallel

__all__ = ["Strategy", "OptimizerFactory", "register", "get", "names", "all_strategies",
           "shard_rows", "whole_batch", "data_parallel_step", "mean_over_ranks", "same_on_every_rank",
           "supports_mixed_precision", "mixed_precision_refusal"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


# ------------------------------------------------------------- the loop's questions, answered for DP

def shard_rows(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Data parallelism: rank r keeps rows ``[r B/N, (r+1) B/N)`` of the global batch."""
    return tuple(shard_batch((x, y), rank, world_size))


def whole_batch(x: torch.Tensor, y: torch.Tensor, rank: int, world_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Model parallelism (tensor, pipeline): every rank receives the whole global batch."""
    return x, y


def data_parallel_step(model: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor,
                       y: torch.Tensor) -> torch.Tensor:
    """Forward, backward, update: ``model(x, y) -> (logits, loss)``. Returns this rank's loss."""
    _, loss = model(x, y)
    loss.backward()
    optimizer.step()
    return loss


def mean_over_ranks(loss: Optional[torch.Tensor], world_size: int) -> float:
    """The global batch's mean loss when every rank holds the mean over an equal share of it:
    the ranks' losses all-reduced and divided by N (bookkeeping outside the timed step, so it
    calls ``torch.distributed`` directly)."""
    if world_size == 1 or not dist.is_initialized():
        return float(loss)
    value = loss.detach().clone().float()
    dist.all_reduce(value)
    return float(value) / world_size


@dataclass
class Strategy:
    """One entry of the registry.

    ``name``: what ``--strategies`` and the report call it. ``description``: one line for the
    report. ``distributed``: False for one process on the whole global batch, True for several
    ranks. ``wrap(model, make_optimizer) -> (model, optimizer)``. ``batch``, ``step`` and
    ``global_loss``: see the module docstring (defaults: data parallelism). ``world_size``: the
    ranks this strategy needs, or None for the command line's ``--world-size``. ``default``: whether
    ``workbench compare`` without ``--strategies`` runs it.
    """

    name: str
    description: str
    distributed: bool
    wrap: Callable[[nn.Module, OptimizerFactory], tuple[Any, torch.optim.Optimizer]]
    batch: Callable[[torch.Tensor, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor]] = shard_rows
    step: Callable[[Any, torch.optim.Optimizer, torch.Tensor, torch.Tensor], Optional[torch.Tensor]] = \
        data_parallel_step
    global_loss: Callable[[Optional[torch.Tensor], int], float] = mean_over_ranks
    world_size: Optional[int] = None
    default: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() or c == "," for c in self.name):
            raise ValueError(f"Strategy name={self.name!r} must be a non-empty string without spaces or "
                             "commas (it is typed on the command line), e.g. 'zero1'")
        for field, signature in (("wrap", "wrap(model, make_optimizer) -> (model, optimizer)"),
                                 ("batch", "batch(x, y, rank, world_size) -> (x, y)"),
                                 ("step", "step(model, optimizer, x, y) -> loss or None"),
                                 ("global_loss", "global_loss(loss, world_size) -> float")):
            if not callable(getattr(self, field)):
                raise TypeError(f"Strategy {self.name!r}: {field}={getattr(self, field)!r} must be a callable "
                                f"{signature}")
        if self.world_size is not None and (isinstance(self.world_size, bool) or not isinstance(self.world_size, int)
                                            or self.world_size < 1):
            raise ValueError(f"Strategy {self.name!r}: world_size={self.world_size!r} must be a whole number >= 1 "
                             "or None (use --world-size)")
        if not isinstance(self.default, bool):
            raise TypeError(f"Strategy {self.name!r}: default={self.default!r} must be True or False")
        if not self.distributed and self.world_size not in (None, 1):
            raise ValueError(f"Strategy {self.name!r}: distributed=False trains in one process, so "
                             f"world_size={self.world_size} must be 1 or None")

    def ranks(self, requested: int) -> int:
        """How many ranks to launch when the command line asks for ``requested``."""
        if not self.distributed:
            return 1
        return self.world_size or requested


def mixed_precision_refusal(strategy: Strategy, device_type: str = "cpu", tied: bool = False) -> str | None:
    """Why ``strategy`` cannot train in mixed precision on ``device_type`` (a model with a
    parameter used twice if ``tied``), or None if it can: its ``wrap`` must take ``mp_policy=``,
    and may narrow that with ``mixed_precision_devices`` and ``mixed_precision_untied_only``."""
    try:
        accepts = "mp_policy" in inspect.signature(strategy.wrap).parameters
    except (TypeError, ValueError):
        accepts = False
    if not accepts:
        return "its wrap takes no mixed-precision policy"
    devices = getattr(strategy.wrap, "mixed_precision_devices", None)
    if devices is not None and device_type not in devices:
        return f"its mixed precision runs only on {', '.join(devices)}"
    if tied and getattr(strategy.wrap, "mixed_precision_untied_only", None):
        return strategy.wrap.mixed_precision_untied_only
    return None


def supports_mixed_precision(strategy: Strategy, device_type: str = "cpu", tied: bool = False) -> bool:
    """Whether :func:`mixed_precision_refusal` finds nothing against it."""
    return mixed_precision_refusal(strategy, device_type, tied) is None


_REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Add ``strategy`` to the registry (``replace=True`` to overwrite an entry of that name)."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"register(strategy={strategy!r}): pass a workbench.apps.strategies.Strategy")
    if strategy.name in _REGISTRY and not replace:
        raise ValueError(f"a strategy named {strategy.name!r} is already registered: pick another name, "
                         "or pass replace=True to overwrite it")
    _REGISTRY[strategy.name] = strategy
    return strategy


def get(name: str) -> Strategy:
    """The strategy called ``name``; ValueError listing the registered names if there is none."""
    try:
        return _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown strategy {name!r}: registered strategies are {', '.join(names())}") from None


def names() -> list[str]:
    """Registered strategy names, in registration order (the order of the report)."""
    return list(_REGISTRY)


def all_strategies() -> list[Strategy]:
    """Registered strategies, in registration order."""
    return list(_REGISTRY.values())


# ------------------------------------------------------------------------------------ built-ins

def _wrap_single(model: nn.Module, make_optimizer: OptimizerFactory, mp_policy=None):
    """Nothing to wrap: one process, whole batch. The reference every other strategy must match.
    With ``mp_policy``: our DDP on this one rank, which applies the policy (16-bit compute on
    copies of float32 masters) and communicates nothing but one-rank reductions."""
    if mp_policy is not None:
        ddp = DistributedDataParallel(model, mp_policy=mp_policy)
        return ddp, make_optimizer(ddp.parameters())
    return model, make_optimizer(model.parameters())


def _wrap_torch_ddp(model: nn.Module, make_optimizer: OptimizerFactory, mp_policy=None):
    """PyTorch's DistributedDataParallel: replicas, gradients all-reduced (averaged) in buckets
    during backward. Memory per rank: the full model state (16 psi bytes with Adam). With
    ``mp_policy``: DDP's own ``mixed_precision`` (``_MixedPrecision``, the same three dtypes)."""
    dev = runtime.device()
    model = model.to(dev)
    extra = {}
    if mp_policy is not None:
        from torch.nn.parallel.distributed import _MixedPrecision

        shared = _shared_parameter_names(model)
        if shared:
            raise ValueError(f"torch-ddp: {_wrap_torch_ddp.mixed_precision_untied_only} ({', '.join(shared)}): "
                             "train it in fp32, or untie the parameters")
        extra["mixed_precision"] = _MixedPrecision(param_dtype=mp_policy.param_dtype,
                                                   reduce_dtype=mp_policy.reduce_dtype or mp_policy.param_dtype)
    ddp = torch.nn.parallel.DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None,
                                                    **extra)
    return ddp, make_optimizer(ddp.parameters())


_wrap_torch_ddp.mixed_precision_devices = ("cuda",)  # its mixed_precision records CUDA events
# DDP's private _MixedPrecision hooks every use of a parameter's low-precision copy, so a tied one
# is "marked ready twice" and DDP stops; static_graph=True, its error's advice, trains but does not
# match a single process (docs/benchmarks/2026-11-23-cuda-h100.md), where our DDP, ZeRO and FSDP do.
_wrap_torch_ddp.mixed_precision_untied_only = ("PyTorch DDP's mixed precision (_MixedPrecision) cannot train a "
                                               "parameter used twice, such as a head tied to the embedding")


def _shared_parameter_names(model: nn.Module) -> list[str]:
    """Names under which an already-seen parameter appears again (a tied weight's second name)."""
    seen, shared = set(), []
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            shared.append(name)
        seen.add(id(p))
    return shared


def _wrap_torch_fsdp(model: nn.Module, make_optimizer: OptimizerFactory, mp_policy=None):
    """PyTorch's FSDP2 (``fully_shard``): each transformer block is a unit whose parameters,
    gradients and optimizer state are sharded over ranks (ZeRO-3), all-gathered for its forward
    and backward and reduce-scattered after. The root unit takes the embeddings and head."""
    from torch.distributed.fsdp import fully_shard  # torch's FSDP2, imported only when it runs

    model = model.to(runtime.device())
    extra = {}
    if mp_policy is not None:
        from torch.distributed.fsdp import MixedPrecisionPolicy

        extra["mp_policy"] = MixedPrecisionPolicy(param_dtype=mp_policy.param_dtype,
                                                  reduce_dtype=mp_policy.reduce_dtype,
                                                  output_dtype=mp_policy.output_dtype)
    for block in getattr(model, "blocks", None) or getattr(model, "layers", None) or []:
        if any(True for _ in block.parameters()):
            fully_shard(block, **extra)
    fully_shard(model, **extra)
    return model, make_optimizer(model.parameters())


register(Strategy("single", "one process trains on the whole global batch (the reference)", False, _wrap_single))
register(Strategy("torch-ddp", "PyTorch DistributedDataParallel: replicated model, bucketed gradient all-reduce",
                  True, _wrap_torch_ddp))
register(Strategy("torch-fsdp", "PyTorch FSDP2 fully_shard per block: parameters, gradients and optimizer "
                  "state sharded (ZeRO-3)", True, _wrap_torch_fsdp))


def _wrap_ddp(model: nn.Module, make_optimizer: OptimizerFactory, mp_policy=None):
    """Ours (workbench.parallel.DistributedDataParallel): the same algorithm as torch-ddp, in Python,
    talking through workbench.comm. Memory per rank: the full model state, as torch-ddp."""
    ddp = DistributedDataParallel(model.to(runtime.device()), mp_policy=mp_policy)
    return ddp, make_optimizer(ddp.parameters())


register(Strategy("ddp", "ours: DistributedDataParallel from scratch (buckets, overlapped all-reduce via "
                  "workbench.comm)", True, _wrap_ddp))


def _wrap_zero(stage: int):
    """Ours (workbench.parallel.zero): ZeRO stage 1 or 2 (ShardedOptimizer around the optimizer
    make_optimizer builds), or 3 (FullyShardedDataParallel, optimizer on the local shards)."""
    def wrap(model: nn.Module, make_optimizer: OptimizerFactory, mp_policy=None):
        model = model.to(runtime.device())
        if stage == 3:
            model = FullyShardedDataParallel(model, mp_policy=mp_policy)
            return model, make_optimizer(model.parameters())
        return model, ShardedOptimizer(model.parameters(), make_optimizer, shard_gradients=stage == 2,
                                       mp_policy=mp_policy)
    return wrap


register(Strategy("zero1", "ours: ZeRO-1, optimizer state sharded (reduce-scatter, step a shard, all-gather)",
                  True, _wrap_zero(1)))
register(Strategy("zero2", "ours: ZeRO-2, optimizer state and gradients sharded (reduce-scatter in backward)",
                  True, _wrap_zero(2)))
register(Strategy("zero3", "ours: ZeRO-3 (FSDP-style), parameters too: units all-gathered just in time",
                  True, _wrap_zero(3)))


def _wrap_tp(sequence_parallel: bool):
    """Ours (workbench.parallel.tensor): Megatron tensor parallelism over all ranks of the launch,
    heads, MLP units and vocabulary split t ways (with ``sequence_parallel``, norms and residuals
    split by sequence too). Every rank sees the whole batch. Memory per rank: about 1/t of the
    model state (norms, biases and positions stay replicated)."""
    def wrap(model: nn.Module, make_optimizer: OptimizerFactory):
        model = tensor_parallel(model.to(runtime.device()), sequence_parallel=sequence_parallel)
        return model, make_optimizer(model.parameters())
    return wrap


def same_on_every_rank(loss: Optional[torch.Tensor], world_size: int) -> float:
    """Model parallelism on the whole batch: every rank already holds the global batch's loss."""
    return float(loss)


register(Strategy("tp", "ours: tensor parallelism (Megatron), t=2: heads, MLP and vocabulary split, "
                  "2+2 all-reduces of activations per layer", True, _wrap_tp(False), batch=whole_batch,
                  global_loss=same_on_every_rank, world_size=2))
register(Strategy("tp-sp", "ours: tensor + sequence parallelism, t=2: norms and residuals split by sequence, "
                  "all-gather + reduce-scatter", True, _wrap_tp(True), batch=whole_batch,
                  global_loss=same_on_every_rank, world_size=2))


def _wrap_pp(model: nn.Module, make_optimizer: OptimizerFactory):
    """Ours (workbench.parallel.pipeline): the GPT cut into one stage per rank (rank r runs stage
    r), 1F1B over 4 micro-batches; each rank's optimizer updates its own stage (the tied
    embedding on the first and last, with the summed gradient). Returns this rank's stage
    module, carrying its schedule. Memory per rank: its stage's model state, plus the
    activations of up to p - r micro-batches."""
    rank, world = runtime.rank(), runtime.world_size()
    stage = partition(model.to(runtime.device()), world)[rank]
    stage.pipeline_schedule = Schedule1F1B(PipelineStage(stage, rank, world), 4, loss_fn=_gpt_loss)
    return stage, make_optimizer(stage.parameters())


def _gpt_loss(logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _pp_step(stage: Any, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor):
    """One pipeline step: the first stage feeds x, the last gets y and returns the batch's mean
    loss (the mean of the equal micro-batches' means); middle stages return None."""
    losses: list[torch.Tensor] = []
    stage.pipeline_schedule.step(*((x,) if stage.first else ()), target=y if stage.last else None,
                                 losses=losses, return_outputs=False)  # the logits are not used
    optimizer.step()
    return torch.stack(losses).mean() if losses else None


def _pp_global_loss(loss: Optional[torch.Tensor], world_size: int) -> float:
    """The last stage holds the global batch's loss: broadcast it to every rank."""
    value = torch.zeros(1, dtype=torch.float64) if loss is None else loss.detach().double().reshape(1).cpu()
    dist.broadcast(value, src=world_size - 1)
    return float(value)


register(Strategy("pp", "ours: pipeline parallel, 2 stages (one per rank), 1F1B over 4 micro-batches "
                  "(activations through workbench.comm isend/irecv)", True, _wrap_pp, batch=whole_batch,
                  step=_pp_step, global_loss=_pp_global_loss, world_size=2))


def _wrap_mesh(dp: int, tp: int, pp: int, zero_stage: int):
    """Ours (workbench.parallel.mesh): the mesh over all ranks of the launch, the optimizer the
    loop gives."""
    def wrap(model: nn.Module, make_optimizer: OptimizerFactory):
        trained = parallelize(model, Mesh(dp=dp, tp=tp, pp=pp), zero_stage=zero_stage,
                              optimizer_cls=lambda params: make_optimizer(params))
        return trained, trained.optimizer
    return wrap


def _mesh_step(model: ParallelModel, optimizer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The mesh takes the whole global batch and returns its mean loss on every rank."""
    return model.step(x, y)


_MESH = dict(batch=whole_batch, step=_mesh_step, global_loss=same_on_every_rank)
register(Strategy("2d", "ours: mesh dp=2 x tp=2 (4 ranks): tensor parallelism inside pairs of adjacent ranks, DDP "
                  "across them", True, _wrap_mesh(2, 2, 1, 0), world_size=4, **_MESH))
register(Strategy("3d", "ours: mesh dp=2 x tp=2 x pp=2 (8 ranks): 1F1B over 2 stages of tensor-parallel pairs, ZeRO-1 "
                  "across replicas", True, _wrap_mesh(2, 2, 2, 1), world_size=8, default=False, **_MESH))
