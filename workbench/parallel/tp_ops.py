"""Megatron's conjugate communication operators: the only places tensor parallelism talks.

A tensor-parallel layer computes on a slice of a weight; what connects the slices is a handful
of operators, each the identity in one direction and a collective in the other. They come in
conjugate pairs: the backward of one is the forward of the other (Shoeybi et al. 2019, fig. 3;
Korthikanti et al. 2022, fig. 5). ``t`` is the size of the tensor-parallel group::

    tensor parallelism                           sequence parallelism (sequence dim split by t)

    f  copy_to_parallel                          g-bar  gather_from_sequence
       forward : identity (X on every rank)             forward : all-gather   X_r  -> X
       backward: all-reduce dX                          backward: reduce-scatter dX -> dX_r
    g  reduce_from_parallel                      g      scatter_to_sequence
       forward : all-reduce Y_r -> Y                    forward : reduce-scatter Y_r -> Y_s
       backward: identity                               backward: all-gather   dY_s -> dY

A column-parallel linear opens with ``f`` (or ``g-bar``), a row-parallel one closes with ``g``
(or its reduce-scatter): per MLP or attention block one all-reduce forward (``g``) and one
backward (``f``), two of each per transformer layer, each of ``b s h`` elements. An all-reduce is
a reduce-scatter plus an all-gather of the same bytes, so sequence parallelism's forward moves no
more data than tensor parallelism's: it only keeps the tensor between the two halves (the norms,
dropouts and residual adds) split by sequence, ``1/t`` of it per rank. Its backward moves more
when the column-parallel layers keep only their input shard and all-gather it again for the
weight gradient (Megatron's choice, :mod:`workbench.parallel.tensor`).

Two helpers complete the set: :func:`gather_from_parallel` (all-gather the last dimension
forward, keep this rank's slice backward: ``ColumnParallelLinear(gather_output=True)``) and
:func:`scatter_to_parallel` (keep this rank's slice of the last dimension forward, all-gather
backward: ``RowParallelLinear(input_is_parallel=False)``).

:func:`linear_with_sequence_gather` is Megatron's fused column-parallel linear under sequence
parallelism: it all-gathers the sequence-sharded input, multiplies, and keeps only the *shard*
for backward, all-gathering it again there for the weight gradient. That re-gather is what lets
activation memory fall to ``1/t`` (Korthikanti et al. 2022, sec. 4.2.2), at one more all-gather
per column-parallel layer in backward.

Every message goes through :mod:`workbench.comm` (counted, with an ``algorithm=`` choice), on the
process group ``group`` (None: the whole world). Sequence operators split dimension ``dim``
(default 1: our tensors are ``(batch, sequence, hidden)``) into ``t`` equal blocks, block ``r``
on group rank ``r``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench import comm

__all__ = ["copy_to_parallel", "reduce_from_parallel", "gather_from_sequence", "scatter_to_sequence",
           "gather_from_parallel", "scatter_to_parallel", "linear_with_sequence_gather",
           "group_size", "group_rank"]


def group_size(group=None) -> int:
    return dist.get_world_size(group)


def group_rank(group=None) -> int:
    return dist.get_rank(group)


# ---------------------------------------------------------------------------- the collectives
def _all_reduce(x: torch.Tensor, group, algorithm: str) -> torch.Tensor:
    out = x.clone(memory_format=torch.contiguous_format)  # a new tensor: autograd's x stays intact
    comm.all_reduce(out, group=group, algorithm=algorithm)
    return out


def _all_gather(x: torch.Tensor, dim: int, group, algorithm: str) -> torch.Tensor:
    """Concatenate every rank's ``x`` along ``dim`` (rank order)."""
    t = group_size(group)
    x = x.contiguous()
    shape = list(x.shape)
    if dim == 0 or all(s == 1 for s in shape[:dim]):  # blocks are contiguous slices of the output
        shape[dim] *= t
        out = torch.empty(shape, dtype=x.dtype, device=x.device)
        comm.all_gather(list(out.chunk(t, dim)), x, group=group, algorithm=algorithm)
        return out
    # Gather into a rank-major buffer (t, *shape), then move the rank axis next to ``dim``.
    buf = torch.empty([t] + shape, dtype=x.dtype, device=x.device)
    comm.all_gather(list(buf.unbind(0)), x, group=group, algorithm=algorithm)
    return buf.movedim(0, dim).reshape(shape[:dim] + [t * shape[dim]] + shape[dim + 1:])


def _reduce_scatter(x: torch.Tensor, dim: int, group, algorithm: str) -> torch.Tensor:
    """Sum over ranks, then keep this rank's block of ``dim``."""
    t = group_size(group)
    if x.shape[dim] % t:
        raise ValueError(f"reduce-scatter along dim {dim}: size {x.shape[dim]} is not divisible by the "
                         f"tensor-parallel group size {t}")
    blocks = [b.contiguous() for b in x.chunk(t, dim)]
    out = torch.empty_like(blocks[0])
    comm.reduce_scatter(out, blocks, group=group, algorithm=algorithm)
    return out


def _split(x: torch.Tensor, dim: int, group) -> torch.Tensor:
    t, r = group_size(group), group_rank(group)
    if x.shape[dim] % t:
        raise ValueError(f"split along dim {dim}: size {x.shape[dim]} is not divisible by the "
                         f"tensor-parallel group size {t}")
    return x.chunk(t, dim)[r].contiguous()


# ---------------------------------------------------------------------------- f and g
class _CopyToParallel(torch.autograd.Function):
    """f: identity forward, all-reduce backward. Opens a column-parallel region: every rank
    uses the whole input, so the input's gradient is the sum of every rank's contribution."""

    @staticmethod
    def forward(ctx, x, group, algorithm):
        ctx.group, ctx.algorithm = group, algorithm
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return _all_reduce(dy, ctx.group, ctx.algorithm), None, None


class _ReduceFromParallel(torch.autograd.Function):
    """g: all-reduce forward, identity backward. Closes a row-parallel region: each rank holds
    a partial sum of the output; every rank's partial gets the same, full gradient."""

    @staticmethod
    def forward(ctx, x, group, algorithm):
        return _all_reduce(x, group, algorithm)

    @staticmethod
    def backward(ctx, dy):
        return dy, None, None


class _GatherFromSequence(torch.autograd.Function):
    """g-bar (sequence parallel): all-gather forward, reduce-scatter backward."""

    @staticmethod
    def forward(ctx, x, dim, group, algorithm):
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return _all_gather(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx, dy):
        return _reduce_scatter(dy, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class _ScatterToSequence(torch.autograd.Function):
    """g (sequence parallel): reduce-scatter forward, all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group, algorithm):
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return _reduce_scatter(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class _GatherFromParallel(torch.autograd.Function):
    """All-gather along ``dim`` forward; backward keeps this rank's slice (no message)."""

    @staticmethod
    def forward(ctx, x, dim, group, algorithm):
        ctx.dim, ctx.group = dim, group
        return _all_gather(x, dim, group, algorithm)

    @staticmethod
    def backward(ctx, dy):
        return _split(dy, ctx.dim, ctx.group), None, None, None


class _ScatterToParallel(torch.autograd.Function):
    """Keep this rank's slice along ``dim`` forward (no message); all-gather backward."""

    @staticmethod
    def forward(ctx, x, dim, group, algorithm):
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx, dy):
        return _all_gather(dy, ctx.dim, ctx.group, ctx.algorithm), None, None, None


class _LinearWithSequenceGather(torch.autograd.Function):
    """``F.linear(all_gather(x_shard), W, b)`` that saves ``x_shard``, not the gathered input.

    backward: dX = dY W (then reduce-scattered to the sequence shards), dW = dY^T X with X
    all-gathered again. Megatron's ``LinearWithGradAccumulationAndAsyncCommunication``.
    """

    @staticmethod
    def forward(ctx, x, weight, bias, dim, group, algorithm):
        ctx.dim, ctx.group, ctx.algorithm = dim, group, algorithm
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(_all_gather(x, dim, group, algorithm), weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x_shard, weight = ctx.saved_tensors
        dx = _reduce_scatter(dy.matmul(weight), ctx.dim, ctx.group, ctx.algorithm)
        x = _all_gather(x_shard, ctx.dim, ctx.group, ctx.algorithm)  # the re-gather
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        dw = dy2.t().matmul(x2) if ctx.needs_input_grad[1] else None
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, dw, db, None, None, None


# ---------------------------------------------------------------------------- the public calls
def copy_to_parallel(x: torch.Tensor, group=None, algorithm: str = "native") -> torch.Tensor:
    """f: identity forward, all-reduce of the gradient backward."""
    return _CopyToParallel.apply(x, group, algorithm)


def reduce_from_parallel(x: torch.Tensor, group=None, algorithm: str = "native") -> torch.Tensor:
    """g: all-reduce forward, identity backward."""
    return _ReduceFromParallel.apply(x, group, algorithm)


def gather_from_sequence(x: torch.Tensor, dim: int = 1, group=None, algorithm: str = "native") -> torch.Tensor:
    """All-gather the sequence shards along ``dim`` forward; reduce-scatter the gradient backward."""
    return _GatherFromSequence.apply(x, dim % x.dim(), group, algorithm)


def scatter_to_sequence(x: torch.Tensor, dim: int = 1, group=None, algorithm: str = "native") -> torch.Tensor:
    """Reduce-scatter partial sums to sequence shards along ``dim`` forward; all-gather backward."""
    return _ScatterToSequence.apply(x, dim % x.dim(), group, algorithm)


def gather_from_parallel(x: torch.Tensor, group=None, algorithm: str = "native", dim: int = -1) -> torch.Tensor:
    """All-gather along ``dim`` (default the last) forward; this rank's slice of the gradient backward."""
    return _GatherFromParallel.apply(x, dim % x.dim(), group, algorithm)


def scatter_to_parallel(x: torch.Tensor, group=None, algorithm: str = "native", dim: int = -1) -> torch.Tensor:
    """This rank's slice along ``dim`` (default the last) forward; all-gather of the gradient backward."""
    return _ScatterToParallel.apply(x, dim % x.dim(), group, algorithm)


def linear_with_sequence_gather(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                                dim: int = 1, group=None, algorithm: str = "native") -> torch.Tensor:
    """``F.linear(gather_from_sequence(x), weight, bias)`` keeping only the shard for backward."""
    return _LinearWithSequenceGather.apply(x, weight, bias, dim % x.dim(), group, algorithm)
