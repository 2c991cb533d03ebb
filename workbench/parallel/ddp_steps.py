"""DistributedDataParallel grown in four steps, as picotron's tutorial grows it.

Each class below wraps a module so that, after ``loss.backward()`` and
``model.finish_gradient_synchronization()``, every rank holds the gradient averaged over the
ranks, exactly as :class:`workbench.parallel.ddp.DistributedDataParallel` leaves it. Each step
changes one thing and is short enough to read in one go; lesson 03 shows their source and times
them side by side::

    step                         messages per step      when communication runs
    1 AllReduceAfterBackward     one per parameter      after backward, one after the other
    2 PerParameterHooks          one per parameter      inside backward, but backward waits for each
    3 Buckets                    one per bucket         inside backward, backward waits for each
    4 OverlappedBuckets          one per bucket         on the communication thread, while backward goes on

With ``k`` messages of ``n`` bytes in all on ``p`` ranks, a ring all-reduce costs
``2(p-1) k alpha + 2 (p-1)/p n beta``: steps 1 and 2 pay ``alpha`` once per parameter, step 3
once per bucket, and step 4 hides whatever part of the ``n beta`` term fits behind the backward
computation still to run. None of them adds gradient memory except steps 3-4's buckets, whose
flat buffers *are* the gradients (``param.grad`` is a view into them).

What the full ``DistributedDataParallel`` adds on top of step 4: buffers broadcast before
forward, ``no_sync()`` for gradient accumulation, unused parameters, a timeline of each bucket.
Every step averages as PyTorch does (each gradient times ``1/world``, then a SUM all-reduce), and
talks only through :mod:`workbench.comm` (``algorithm`` picks the all-reduce).
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from workbench import comm
from workbench.parallel.buckets import FIRST_BUCKET_BYTES, MB, Bucket, assign_buckets

__all__ = ["AllReduceAfterBackward", "PerParameterHooks", "Buckets", "OverlappedBuckets", "STEPS"]


class AllReduceAfterBackward(nn.Module):
    """Step 1: after backward, all-reduce every gradient, one parameter at a time."""

    def __init__(self, module: nn.Module, *, algorithm: str = "native", process_group=None):
        super().__init__()
        self.module, self.algorithm, self.group = module, algorithm, process_group
        self.world_size = dist.get_world_size(process_group)
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        with torch.no_grad():  # every replica starts from rank 0's weights
            for tensor in list(module.parameters()) + list(module.buffers()):
                comm.broadcast(tensor, src=src, group=process_group)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def _average(self, grad: torch.Tensor, async_op: bool = False):
        grad.mul_(1.0 / self.world_size)  # sum of grad / world = the average
        return comm.all_reduce(grad, op=comm.ReduceOp.SUM, group=self.group, async_op=async_op,
                               algorithm=self.algorithm)

    def finish_gradient_synchronization(self) -> None:
        for p in self.module.parameters():
            if p.requires_grad and p.grad is not None:
                self._average(p.grad)


class PerParameterHooks(AllReduceAfterBackward):
    """Step 2: all-reduce each gradient from a hook, the moment backward has produced it.

    Communication now happens during backward, but each hook blocks until its all-reduce is
    done, so backward stops for every parameter: nothing overlaps yet.
    """

    def __init__(self, module: nn.Module, **kwargs):
        super().__init__(module, **kwargs)
        for p in module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(lambda param: self._average(param.grad))

    def finish_gradient_synchronization(self) -> None:
        pass  # every gradient was averaged by its hook


class Buckets(AllReduceAfterBackward):
    """Step 3: group gradients into flat buckets (reverse parameter order, ``bucket_cap_mb`` each,
    a 1 MiB first bucket) and all-reduce a whole bucket once its last gradient has arrived:
    one message per bucket instead of one per parameter. Still blocking."""

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = 25.0, **kwargs):
        super().__init__(module, **kwargs)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        params = [p for _, p in named]
        self.buckets = [Bucket(b, [params[i] for i in idx], [named[i][0] for i in idx])
                        for b, idx in enumerate(assign_buckets(params, int(bucket_cap_mb * MB), FIRST_BUCKET_BYTES))]
        self._where = {id(p): (bucket, slot) for bucket in self.buckets for slot, p in enumerate(bucket.params)}
        self._next = 0  # buckets go out in bucket order, the same on every rank
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_grad_ready)

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        bucket, slot = self._where[id(param)]
        bucket.adopt_grad(slot)  # param.grad becomes a view into the bucket's flat buffer
        bucket.pending -= 1
        while self._next < len(self.buckets) and self.buckets[self._next].pending == 0:
            self._launch(self.buckets[self._next])
            self._next += 1

    def _launch(self, bucket: Bucket) -> None:
        self._average(bucket.buffer)

    def finish_gradient_synchronization(self) -> None:
        if self._next < len(self.buckets):
            late = self.buckets[self._next]
            raise RuntimeError(f"bucket {late.index} ({', '.join(late.names)}) never got all its gradients: "
                               "every parameter must take part in the loss (DistributedDataParallel's "
                               "find_unused_parameters=True handles the others)")
        for bucket in self.buckets:
            bucket.reset()
        self._next = 0


class OverlappedBuckets(Buckets):
    """Step 4: launch each bucket's all-reduce asynchronously (``async_op=True``) and let backward
    go on; the communication thread runs it while autograd computes earlier layers. Wait for
    all of them once, at the end of backward."""

    def _launch(self, bucket: Bucket) -> None:
        bucket.handle = self._average(bucket.buffer, async_op=True)

    def finish_gradient_synchronization(self) -> None:
        for bucket in self.buckets:
            if bucket.handle is not None:
                bucket.handle.wait()
        super().finish_gradient_synchronization()


STEPS = [AllReduceAfterBackward, PerParameterHooks, Buckets, OverlappedBuckets]
