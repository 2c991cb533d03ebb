"""The ZeRO formulas: model-state bytes per rank and bytes sent per step, for every stage.

Rajbhandari et al. (2020) count the *model state* a data-parallel rank holds between steps:
parameters, gradients and the optimizer's state. With ``psi`` parameters on ``N`` ranks, and
per parameter ``P`` bytes of parameter, ``G`` of gradient and ``K`` of optimizer state::

    stage 0 (DDP)           P psi   + G psi   + K psi        nothing sharded
    stage 1 (optimizer)     P psi   + G psi   + K psi / N
    stage 2 (+ gradients)   P psi   + G psi/N + K psi / N
    stage 3 (+ parameters)  P psi/N + G psi/N + K psi / N

float32 Adam: ``P = G = 4`` and ``K = 8`` (two moments), the ``16 psi`` of DDP. Mixed precision
(the paper's case): ``P = G = 2`` and ``K = 12`` (a float32 master copy plus the two moments).
SGD with momentum keeps 4 bytes of state per parameter (``K = 4``, 8 with mixed precision's
master copy), plain SGD none.

Communication per rank and step (ring algorithms): stages 0-2 move ``2 psi (N-1)/N`` elements
(an all-reduce, or a reduce-scatter plus an all-gather, which is the same thing split in two);
stage 3 gathers the parameters twice (forward and backward) and reduce-scatters the gradients:
``3 psi (N-1)/N``, 1.5x.

Not counted: activations, the units stage 3 holds gathered while they compute, padding to a
multiple of ``N``, communication buffers, and (on NCCL) each communicator's own memory.
"""
from __future__ import annotations

from numbers import Real

__all__ = ["OPTIMIZER_STATE_BYTES", "PRECISIONS", "STAGES", "model_state_per_rank", "elements_moved",
           "bytes_sent_per_rank"]

STAGES = (0, 1, 2, 3)
# bytes of optimizer state per parameter, in float32, before any master copy
OPTIMIZER_STATE_BYTES = {"adam": 8, "sgd-momentum": 4, "sgd": 0}
# (parameter bytes, gradient bytes, master-copy bytes) per parameter
PRECISIONS = {"fp32": (4, 4, 0), "mixed": (2, 2, 4)}
_VOLUME = {0: 2, 1: 2, 2: 2, 3: 3}  # elements moved per step, in units of psi (N-1)/N


def _check(psi, world_size, stage) -> None:
    if isinstance(psi, bool) or not isinstance(psi, Real) or psi < 0:
        raise ValueError(f"psi={psi!r} must be a number of parameters >= 0")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be an integer >= 1 (the number of data-parallel ranks)")
    if stage not in STAGES:
        raise ValueError(f"stage={stage!r} is not a ZeRO stage: use 0 (DDP), 1, 2 or 3")


def model_state_per_rank(psi: float, world_size: int, stage: int, optimizer: str = "adam",
                         precision: str = "fp32") -> dict[str, float]:
    """``{"params", "grads", "optimizer", "total"}``: bytes of model state per rank.

    ``optimizer``: one of :data:`OPTIMIZER_STATE_BYTES`; ``precision``: ``"fp32"`` or
    ``"mixed"`` (2-byte parameters and gradients, a float32 master copy in the optimizer state).
    """
    _check(psi, world_size, stage)
    if optimizer not in OPTIMIZER_STATE_BYTES:
        raise ValueError(f"optimizer={optimizer!r} is not known: use one of {sorted(OPTIMIZER_STATE_BYTES)}")
    if precision not in PRECISIONS:
        raise ValueError(f"precision={precision!r} is not known: use one of {sorted(PRECISIONS)}")
    p, g, master = PRECISIONS[precision]
    k = OPTIMIZER_STATE_BYTES[optimizer] + master
    n = world_size
    out = {"params": p * psi / (n if stage >= 3 else 1),
           "grads": g * psi / (n if stage >= 2 else 1),
           "optimizer": k * psi / (n if stage >= 1 else 1)}
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


def elements_moved(psi: float, world_size: int, stage: int) -> float:
    """Elements each rank sends per training step: ``2 psi (N-1)/N``, or ``3 psi (N-1)/N`` at stage 3."""
    _check(psi, world_size, stage)
    return _VOLUME[stage] * psi * (world_size - 1) / world_size


def bytes_sent_per_rank(psi: float, world_size: int, stage: int, bytes_per_element: int = 4) -> float:
    """:func:`elements_moved` times the size of an element on the wire (4: float32)."""
    return bytes_per_element * elements_moved(psi, world_size, stage)
