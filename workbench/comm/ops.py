"""Reduction operators: apply ``op`` element-wise, in place, with no extra copy.

``SUM``, ``PRODUCT``, ``MIN`` and ``MAX`` combine two buffers (``acc = acc op other``) with
``torch``'s ``out=`` / in-place kernels. ``AVG`` is not a combining operator: every algorithm
reduces with ``SUM`` and divides once at the end (by the group size), which is also how it works
on backends that lack it. Integer ``AVG`` would not be an integer, so it is refused (torch's
gloo raises a casting error for it).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

ReduceOp = dist.ReduceOp

SUPPORTED_OPS = {ReduceOp.SUM: "SUM", ReduceOp.PRODUCT: "PRODUCT", ReduceOp.MIN: "MIN",
                 ReduceOp.MAX: "MAX", ReduceOp.AVG: "AVG"}
# Dtypes the hand-written reductions accept (the ones gloo reduces).
REDUCE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64,
                 torch.int8, torch.uint8, torch.int32, torch.int64)


def op_name(op) -> str:
    """``"ReduceOp.SUM"`` for ``ReduceOp.SUM`` (for messages)."""
    name = getattr(op, "name", None)
    return f"ReduceOp.{name}" if name else repr(op)


def combining_op(op):
    """The operator the algorithm combines with: SUM for AVG, ``op`` otherwise."""
    return ReduceOp.SUM if op == ReduceOp.AVG else op


def reduce_into(acc: torch.Tensor, other: torch.Tensor, op) -> None:
    """``acc = acc op other``, in place (``acc`` and ``other`` have the same shape)."""
    combine_into(acc, acc, other, op)


def combine_into(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, op) -> None:
    """``out = a op b``; ``a`` and ``b`` are only read (``out`` may be ``a``: then it is ``a op= b``)."""
    if out.numel() == 0:
        return
    if op == ReduceOp.SUM:
        torch.add(a, b, out=out)
    elif op == ReduceOp.PRODUCT:
        torch.mul(a, b, out=out)
    elif op == ReduceOp.MIN:
        torch.minimum(a, b, out=out)
    elif op == ReduceOp.MAX:
        torch.maximum(a, b, out=out)
    else:  # validated before anything is sent; reaching here is a bug
        raise AssertionError(f"combine_into: unexpected op {op!r}")


def finish_avg(tensor: torch.Tensor, op, group_size: int) -> None:
    """After a SUM that stood for AVG, divide by the group size in place."""
    if op == ReduceOp.AVG and tensor.numel():
        tensor.div_(group_size)
