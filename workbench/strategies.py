"""The registry of training strategies that ``workbench compare`` runs side by side.

A strategy is one way of spreading the same training over ranks. It is described by a
:class:`Strategy` whose ``wrap(model, make_optimizer)`` is called inside every rank on an
identically initialised model and returns the ``(model, optimizer)`` pair the common training
loop (:mod:`workbench.train`) drives, unchanged for every strategy::

    model, optimizer = strategy.wrap(model, make_optimizer)
    for step in range(steps):
        _, loss = model(x_shard, y_shard)          # this rank's slice of the global batch
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()

so whatever a strategy does (all-reducing gradients, sharding optimizer state, gathering
parameters) happens inside the wrapped model's forward/backward and the optimizer's step.
``distributed=False`` means one process trains on the whole global batch (the reference).

Adding a strategy is one call, typically at the end of the module that implements it::

    register(Strategy("zero1", "ZeRO-1: optimizer state sharded", True, wrap_zero1))

Built in: ``single`` (the reference), and PyTorch's own ``torch-ddp`` and ``torch-fsdp``, so
every strategy of ours is measured beside PyTorch's in the same table.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.nn as nn

__all__ = ["Strategy", "OptimizerFactory", "register", "get", "names", "all_strategies"]

OptimizerFactory = Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]


@dataclass
class Strategy:
    """One entry of the registry.

    ``name``: what ``--strategies`` and the report call it. ``description``: one line for the
    report. ``distributed``: False for one process on the whole global batch, True for one
    process per rank on its shard. ``wrap(model, make_optimizer) -> (model, optimizer)``.
    """

    name: str
    description: str
    distributed: bool
    wrap: Callable[[nn.Module, OptimizerFactory], tuple[nn.Module, torch.optim.Optimizer]]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name or any(c.isspace() or c == "," for c in self.name):
            raise ValueError(f"Strategy name={self.name!r} must be a non-empty string without spaces or "
                             "commas (it is typed on the command line), e.g. 'zero1'")
        if not callable(self.wrap):
            raise TypeError(f"Strategy {self.name!r}: wrap={self.wrap!r} must be a callable "
                            "wrap(model, make_optimizer) -> (model, optimizer)")


_REGISTRY: dict[str, Strategy] = {}


def register(strategy: Strategy, *, replace: bool = False) -> Strategy:
    """Add ``strategy`` to the registry (``replace=True`` to overwrite an entry of that name)."""
    if not isinstance(strategy, Strategy):
        raise TypeError(f"register(strategy={strategy!r}): pass a workbench.strategies.Strategy")
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

def _wrap_single(model: nn.Module, make_optimizer: OptimizerFactory):
    """Nothing to wrap: one process, whole batch. The reference every other strategy must match."""
    return model, make_optimizer(model.parameters())


def _wrap_torch_ddp(model: nn.Module, make_optimizer: OptimizerFactory):
    """PyTorch's DistributedDataParallel: replicas, gradients all-reduced (averaged) in buckets
    during backward. Memory per rank: the full model state (16 psi bytes with Adam)."""
    from torch.nn.parallel import DistributedDataParallel

    from workbench import runtime

    dev = runtime.device()
    model = model.to(dev)
    ddp = DistributedDataParallel(model, device_ids=[dev.index] if dev.type == "cuda" else None)
    return ddp, make_optimizer(ddp.parameters())


def _wrap_torch_fsdp(model: nn.Module, make_optimizer: OptimizerFactory):
    """PyTorch's FSDP2 (``fully_shard``): each transformer block is a unit whose parameters,
    gradients and optimizer state are sharded over ranks (ZeRO-3), all-gathered for its forward
    and backward and reduce-scattered after. The root unit takes the embeddings and head."""
    from torch.distributed.fsdp import fully_shard

    from workbench import runtime

    model = model.to(runtime.device())
    for block in getattr(model, "blocks", None) or getattr(model, "layers", None) or []:
        if any(True for _ in block.parameters()):
            fully_shard(block)
    fully_shard(model)
    return model, make_optimizer(model.parameters())


register(Strategy("single", "one process trains on the whole global batch (the reference)", False, _wrap_single))
register(Strategy("torch-ddp", "PyTorch DistributedDataParallel: replicated model, bucketed gradient all-reduce",
                  True, _wrap_torch_ddp))
register(Strategy("torch-fsdp", "PyTorch FSDP2 fully_shard per block: parameters, gradients and optimizer "
                  "state sharded (ZeRO-3)", True, _wrap_torch_fsdp))


def _wrap_ddp(model: nn.Module, make_optimizer: OptimizerFactory):
    """Ours (workbench.parallel.DistributedDataParallel): the same algorithm as torch-ddp, in Python,
    talking through workbench.comm. Memory per rank: the full model state, as torch-ddp."""
    from workbench import runtime
    from workbench.parallel import DistributedDataParallel

    ddp = DistributedDataParallel(model.to(runtime.device()))
    return ddp, make_optimizer(ddp.parameters())


register(Strategy("ddp", "ours: DistributedDataParallel from scratch (buckets, overlapped all-reduce via "
                  "workbench.comm)", True, _wrap_ddp))


def _wrap_zero(stage: int):
    """Ours (workbench.parallel.zero): ZeRO stage 1 or 2 (ShardedOptimizer around the optimizer
    make_optimizer builds), or 3 (FullyShardedDataParallel, optimizer on the local shards)."""
    def wrap(model: nn.Module, make_optimizer: OptimizerFactory):
        from workbench import runtime
        from workbench.parallel import FullyShardedDataParallel, ShardedOptimizer

        model = model.to(runtime.device())
        if stage == 3:
            model = FullyShardedDataParallel(model)
            return model, make_optimizer(model.parameters())
        return model, ShardedOptimizer(model.parameters(), make_optimizer, shard_gradients=stage == 2)
    return wrap


register(Strategy("zero1", "ours: ZeRO-1, optimizer state sharded (reduce-scatter, step a shard, all-gather)",
                  True, _wrap_zero(1)))
register(Strategy("zero2", "ours: ZeRO-2, optimizer state and gradients sharded (reduce-scatter in backward)",
                  True, _wrap_zero(2)))
register(Strategy("zero3", "ours: ZeRO-3 (FSDP-style), parameters too: units all-gathered just in time",
                  True, _wrap_zero(3)))
