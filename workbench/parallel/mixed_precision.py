"""Mixed precision: compute and communicate in 16 bits, keep float32 master weights and state.

A float32 parameter costs 4 bytes, its gradient 4 more, Adam's two moments 8: ``16 psi`` bytes
for ``psi`` parameters. Mixed-precision training (Micikevicius et al. 2018) runs forward and
backward on a 16-bit copy of the weights (``param_dtype``: bfloat16 or float16), which halves
the activations and the bytes on the wire, while the optimizer keeps a float32 *master* copy,
because adding a small update ``lr * m / sqrt(v)`` to a bfloat16 weight (8 bits of mantissa)
would round most updates away. The policy, one object for every strategy::

    MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None)

(the names of PyTorch FSDP2's ``MixedPrecisionPolicy``), passed as ``mp_policy=`` to
:class:`~workbench.parallel.DistributedDataParallel`, :class:`~workbench.parallel.ShardedOptimizer`
(ZeRO-1/2), :class:`~workbench.parallel.FullyShardedDataParallel` (ZeRO-3) and :func:`zero`:

* ``param_dtype``: the dtype of the weights forward and backward run on, hence of the
  activations, the parameter all-gathers and the gradients autograd produces. Floating inputs
  of the wrapped module's forward are cast to it (FSDP2's ``cast_forward_inputs=True``).
* ``reduce_dtype``: the dtype gradients are summed over ranks in. ``None`` means
  ``param_dtype`` (FSDP2's default): bytes on the wire halve against float32, exactly.
  ``torch.float32`` sums bfloat16 gradients without rounding at each hop (safer with many
  ranks) at twice the bytes, and makes ZeRO-2's gradient shard ``4 psi / N`` instead of
  ``2 psi / N``.
* ``output_dtype``: cast floating outputs of forward to it (``None``: leave them in
  ``param_dtype``).

Where each strategy keeps what (``psi`` parameters, ``N`` ranks, Adam, bytes per rank; the
ZeRO paper's ``2 + 2 + K``, ``K = 12``):

=========  ==========================================  =====================================
strategy   held between steps                           formula
=========  ==========================================  =====================================
DDP        fp32 master 4 + fp32 grad 4 + Adam 8          16 psi (16-bit copies live only in
                                                        forward/backward, as PyTorch DDP)
ZeRO-1     16-bit params 2 + 16-bit grads 2 + 12/N       4 psi + 12 psi / N
ZeRO-2     16-bit params 2 + grad shard 2/N + 12/N       2 psi + 14 psi / N
ZeRO-3     fp32 shard 4/N + grad shard 4/N + Adam 8/N    16 psi / N
=========  ==========================================  =====================================

(ZeRO-1/2: the float32 master copy of this rank's shard and its gradient live in the
optimizer, the gradient only inside ``step()``.)

float16 has 5 exponent bits: gradients below ``6e-8`` flush to zero. A :class:`DynamicLossScaler`
multiplies the loss by ``S`` (say ``2**16``) so the gradients are ``S`` times larger, divides the
float32 gradients by ``S`` before the update, and if any gradient on *any* rank is inf or nan
(the scaled values overflowed) skips the step on every rank and halves ``S``; after
``growth_interval`` good steps it doubles ``S`` again (``torch.amp.GradScaler``'s rule). With
sharded gradients each rank sees only its shard, so the inf check is all-reduced (MAX).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench import comm

__all__ = ["MixedPrecision", "DynamicLossScaler", "cast_floats", "resolve_policy"]


@dataclass(frozen=True)
class MixedPrecision:
    """The mixed-precision policy: ``param_dtype`` for compute and parameter communication,
    ``reduce_dtype`` for gradient reduction (``None``: ``param_dtype``), ``output_dtype`` for
    forward's outputs (``None``: no cast). See the module docstring."""

    param_dtype: torch.dtype | None = torch.bfloat16
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None

    def __post_init__(self) -> None:
        for name in ("param_dtype", "reduce_dtype", "output_dtype"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"MixedPrecision({name}={value!r}): pass a floating-point torch.dtype such as "
                                 "torch.bfloat16, torch.float16 or torch.float32, or None")


def resolve_policy(mp_policy, owner: str) -> MixedPrecision | None:
    """``mp_policy`` checked: a :class:`MixedPrecision` or ``None``."""
    if mp_policy is None or isinstance(mp_policy, MixedPrecision):
        return mp_policy
    raise TypeError(f"{owner}(mp_policy={mp_policy!r}): pass workbench.parallel.MixedPrecision("
                    "param_dtype=torch.bfloat16) or None")


def cast_floats(obj, dtype: torch.dtype | None):
    """``obj`` with every floating-point tensor inside (tuples, lists, dicts) cast to ``dtype``."""
    if dtype is None:
        return obj
    if isinstance(obj, torch.Tensor):
        return obj.to(dtype) if obj.is_floating_point() else obj
    if isinstance(obj, tuple):
        return tuple(cast_floats(o, dtype) for o in obj)
    if isinstance(obj, list):
        return [cast_floats(o, dtype) for o in obj]
    if isinstance(obj, dict):
        return {k: cast_floats(v, dtype) for k, v in obj.items()}
    return obj


class DynamicLossScaler:
    """``torch.amp.GradScaler``'s dynamic loss scaling, for replicated or sharded gradients::

        scaler = DynamicLossScaler()
        scaler.scale(loss).backward()
        scaler.step(optimizer)      # unscales; skips the step if any rank saw inf/nan
        scaler.update()             # halve the scale after a skip, double it after growth_interval

    ``optimizer``: a plain optimizer over DDP's or FSDP's parameters (float32 masters or
    shards) or a :class:`~workbench.parallel.ShardedOptimizer` (its gradients are reduced into
    the float32 master shards first). The inf/nan check is all-reduced over ``process_group``
    (default: all ranks), so every rank skips the same steps. ``skipped`` lists the steps
    skipped so far (counted by :meth:`update` calls).
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0, backoff_factor: float = 0.5,
                 growth_interval: int = 2000, process_group=None):
        if not init_scale > 0:
            raise ValueError(f"DynamicLossScaler(init_scale={init_scale!r}): must be > 0, e.g. 2**16")
        if not growth_factor > 1:
            raise ValueError(f"DynamicLossScaler(growth_factor={growth_factor!r}): must be > 1, e.g. 2.0")
        if not 0 < backoff_factor < 1:
            raise ValueError(f"DynamicLossScaler(backoff_factor={backoff_factor!r}): must be in (0, 1), e.g. 0.5")
        if isinstance(growth_interval, bool) or not isinstance(growth_interval, int) or growth_interval < 1:
            raise ValueError(f"DynamicLossScaler(growth_interval={growth_interval!r}): must be a whole number >= 1")
        self.scale_value = float(init_scale)
        self.growth_factor = growth_factor
        self.backoff_factor = backoff_factor
        self.growth_interval = growth_interval
        self.process_group = process_group
        self.skipped: list[int] = []
        self._steps = 0
        self._good = 0
        self._found_inf: bool | None = None   # set by unscale_, consumed by step/update

    def get_scale(self) -> float:
        return self.scale_value

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        return loss * self.scale_value

    @torch.no_grad()
    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divide the optimizer's gradients by the scale and decide, over all ranks, whether any
        is inf or nan. Call before clipping; :meth:`step` calls it if you did not."""
        if self._found_inf is not None:
            return
        reduce = getattr(optimizer, "reduce_gradients", None)
        if callable(reduce):   # ShardedOptimizer: reduce-scatter into the float32 master shards first
            reduce()
        grads = [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        device = grads[0].device if grads else torch.device("cpu")
        found = torch.zeros(1, dtype=torch.float32, device=device)
        inv = 1.0 / self.scale_value
        for g in grads:
            g.mul_(inv)
            found = torch.maximum(found, (~torch.isfinite(g)).any().float().reshape(1))
        if dist.is_initialized():
            comm.all_reduce(found, op=comm.ReduceOp.MAX, group=self.process_group)
        self._found_inf = bool(found.item())

    def step(self, optimizer: torch.optim.Optimizer, *args, **kwargs):
        """``optimizer.step()`` unless a gradient on some rank was inf/nan (then nothing changes)."""
        self.unscale_(optimizer)
        if self._found_inf:
            discard = getattr(optimizer, "discard_gradients", None)
            if callable(discard):
                discard()
            return None
        return optimizer.step(*args, **kwargs)

    def update(self) -> None:
        """Adjust the scale after a step: ``* backoff_factor`` if it was skipped, ``* growth_factor``
        after ``growth_interval`` consecutive good steps."""
        if self._found_inf is None:
            raise RuntimeError("DynamicLossScaler.update(): call scaler.step(optimizer) (or unscale_) first")
        if self._found_inf:
            self.scale_value *= self.backoff_factor
            self.skipped.append(self._steps)
            self._good = 0
        else:
            self._good += 1
            if self._good == self.growth_interval:
                self.scale_value *= self.growth_factor
                self._good = 0
        self._steps += 1
        self._found_inf = None
