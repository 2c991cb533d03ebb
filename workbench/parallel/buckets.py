"""Gradient buckets: which gradients travel together, and the flat buffers they travel in.

One all-reduce per parameter pays the latency ``alpha`` once per parameter: a GPT has a
hundred-odd parameter tensors, many of them a few hundred bytes (biases, norms). One
all-reduce for the whole model pays it once, but cannot start until the *last* gradient is
ready, that is after backward, so none of it hides behind compute. DDP takes the middle road
(Li et al., VLDB 2020): consecutive gradients are grouped into **buckets** of about
``bucket_cap_mb`` megabytes, and each bucket is all-reduced as soon as all its gradients exist.

* **Reverse parameter order.** Backward visits layers last to first, so gradients become
  ready roughly in reverse order of ``module.parameters()``: buckets are filled in that order,
  and the first bucket (the model's last layers) is ready first.
* **A small first bucket.** The first bucket is capped at 1 MB (PyTorch's
  ``_DEFAULT_FIRST_BUCKET_BYTES``) so communication starts early in backward, as soon as the
  last layer or two are done, instead of waiting for a full 25 MB.
* **A bucket closes once it reaches its cap**, after adding the parameter that crossed it
  (PyTorch's rule), so a bucket can exceed the cap by one tensor and ``bucket_cap_mb=0`` gives
  one bucket per parameter.
* **One dtype and device per bucket**, since a bucket is one flat tensor.
* **Rebuilt after the first step.** Reverse parameter order is only a guess at the order
  backward produces gradients (a module defined first but called last breaks it). PyTorch's
  Reducer records the order gradients actually became ready during the first backward and,
  before the second forward, re-assigns the buckets in that order (rank 0's order, broadcast
  so that every rank agrees), with the same caps; ``assign_buckets(..., order=...)`` does that
  here, and :class:`~workbench.parallel.DistributedDataParallel` calls it.

Each :class:`Bucket` owns a flat ``buffer`` holding all its gradients back to back, and each of
its parameters gets ``param.grad`` as a *view* into that buffer (PyTorch's
``gradient_as_bucket_view=True``): backward accumulates straight into the buffer, the
all-reduce runs in place on it, and the averaged gradient is already where the optimizer reads
it. No gradient is copied, and gradient memory is the ``4 psi`` bytes of the buffers alone.

Cost of a step with ``k`` buckets under the ring all-reduce model:
``sum_k [2(p-1) alpha + 2 (p-1)/p n_k beta]`` = ``2(p-1) k alpha + 2 (p-1)/p N beta``: the
bandwidth term does not depend on the bucketing; the latency term grows with ``k``; overlap
hides whatever part of it fits behind the backward compute still to run.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

__all__ = ["FIRST_BUCKET_BYTES", "Bucket", "assign_buckets"]

MB = 1024 * 1024
FIRST_BUCKET_BYTES = 1 * MB  # PyTorch's dist._DEFAULT_FIRST_BUCKET_BYTES
DDP_BUCKET_CAP_MB = 25.0  # DistributedDataParallel's default bucket_cap_mb, ours and PyTorch's
ZERO_BUCKET_CAP_MB = 5.0  # ShardedOptimizer's (ZeRO-1/2) default bucket_cap_mb


def assign_buckets(params: list[nn.Parameter], cap_bytes: int,
                   first_cap_bytes: int | None = FIRST_BUCKET_BYTES,
                   order: list[int] | None = None) -> list[list[int]]:
    """Group ``params`` (in ``module.parameters()`` order) into buckets; return index lists.

    Parameters are visited in reverse order, or in ``order`` (indices into ``params``: the
    order their gradients became ready, for a rebuild). A bucket is closed as soon as its size reaches
    its cap: ``min(first_cap_bytes, cap_bytes)`` for the first bucket, ``cap_bytes`` for the
    rest. Parameters of different dtype or device go to different buckets. Within a bucket the
    indices are in the order they were added (reverse parameter order).
    """
    first_cap = cap_bytes if first_cap_bytes is None else min(first_cap_bytes, cap_bytes)
    open_buckets: dict[tuple, list[int]] = {}
    open_bytes: dict[tuple, int] = {}
    closed: list[list[int]] = []
    visit = reversed(range(len(params))) if order is None else order
    if order is not None and sorted(order) != list(range(len(params))):
        raise ValueError(f"assign_buckets(order=...): must list each of the {len(params)} parameter indices once")
    for i in visit:
        p = params[i]
        key = (p.dtype, p.device)
        bucket = open_buckets.setdefault(key, [])
        bucket.append(i)
        open_bytes[key] = open_bytes.get(key, 0) + p.numel() * p.element_size()
        if open_bytes[key] >= (first_cap if not closed else cap_bytes):
            closed.append(bucket)
            del open_buckets[key], open_bytes[key]
    closed.extend(b for b in open_buckets.values() if b)
    return closed


@dataclass
class Bucket:
    """A flat gradient buffer shared by some parameters, and the state of its all-reduce."""

    index: int
    params: list[nn.Parameter]
    names: list[str]
    buffer: torch.Tensor = field(init=False)
    views: list[torch.Tensor] = field(init=False)
    pending: int = field(init=False, default=0)  # gradients still to arrive in this backward
    handle: object = field(init=False, default=None)  # the all-reduce in flight, if any
    reduce_buffer: object = field(init=False, default=None)  # what is all-reduced: buffer, or a reduce_dtype copy

    def __post_init__(self) -> None:
        p0 = self.params[0]
        numel = sum(p.numel() for p in self.params)
        self.buffer = torch.zeros(numel, dtype=p0.dtype, device=p0.device)
        self.views, offset = [], 0
        for p in self.params:
            self.views.append(self.buffer[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        self.reset()

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def reset(self) -> None:
        """Expect every parameter's gradient again (start of a backward pass)."""
        self.pending = len(self.params)
        self.handle = None

    def adopt_grad(self, slot: int) -> None:
        """Make ``params[slot].grad`` the bucket's view, copying a gradient that lives elsewhere.

        After ``optimizer.zero_grad()`` (``set_to_none=True``, the default) the autograd engine
        creates a fresh ``.grad``: it is copied into the bucket once, and from then on the
        parameter's ``.grad`` *is* the view, so later accumulation happens in place.
        A missing gradient becomes zeros (a parameter unused in this step).
        """
        p, view = self.params[slot], self.views[slot]
        g = p.grad
        if g is None:
            view.zero_()
        elif g.data_ptr() != view.data_ptr() or g.shape != view.shape:
            view.copy_(g)
        else:
            return
        p.grad = view
