"""Reduce: combine every rank's buffer with ``op``; the result lands on the root only.

::

    before                      after
    rank 0 (root): a0           rank 0: a0 + a1 + a2 + a3
    rank 1:        a1           rank 1: a1   (unchanged here; torch leaves it unspecified)
    rank 2:        a2           rank 2: a2
    rank 3:        a3           rank 3: a3

Algorithms (alpha latency, beta seconds per byte, gamma reduction seconds per byte, n bytes):

* ``flat``: every rank sends its buffer to the root, which combines them one by one.
  ``(p-1)(alpha + n beta + n gamma)``, all at the root.
* ``binomial``: a binomial tree, the broadcast tree run backwards; partial results meet halfway.
  ``ceil(lg p)(alpha + n beta + n gamma)``.
* ``native``: ``torch.distributed.reduce``.

``AVG`` reduces with ``SUM`` and the root divides by p. The callers' buffers on the other ranks
are left as they were (the algorithms accumulate in a scratch copy).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.comm import checks, ops
from workbench.comm.dispatch import flat_buffer, nbytes, run_algorithm, run_native
from workbench.comm.group import Comm, scratch

ReduceOp = dist.ReduceOp


def flat(c: Comm, buf: torch.Tensor, root: int, op) -> None:
    """Every rank sends to the root, which combines in rank order::

        1 --a1--> root,  2 --a2--> root,  3 --a3--> root     (p-1)(alpha + n beta + n gamma)
    """
    if c.rank != root:
        c.send(buf, root)
        return
    tmp = scratch(buf.numel(), buf.dtype, device=buf.device)
    for peer in range(c.size):
        if peer != root:
            c.recv(tmp, peer)
            ops.reduce_into(buf, tmp, op)


def binomial(c: Comm, buf: torch.Tensor, root: int, op) -> None:
    """Binomial tree towards the root, relative ranks v = (rank - root) mod p::

        round 1:  1 -> 0,  3 -> 2,  5 -> 4,  7 -> 6      (p = 8: ceil(lg p) rounds,
        round 2:  2 -> 0,  6 -> 4                          each alpha + n beta + n gamma)
        round 3:  4 -> 0

    ``buf`` accumulates the partial result of the rank's subtree (it is clobbered off the root).
    """
    p, v = c.size, (c.rank - root) % c.size
    real = lambda rel: (rel + root) % p  # noqa: E731
    tmp = None
    mask = 1
    while mask < p:
        if v & mask:
            c.send(buf, real(v - mask))
            return
        if v + mask < p:
            if tmp is None:
                tmp = scratch(buf.numel(), buf.dtype, device=buf.device)
            c.recv(tmp, real(v + mask))
            ops.reduce_into(buf, tmp, op)
        mask <<= 1


ALGORITHMS = {"native": None, "flat": flat, "binomial": binomial}


def reduce(tensor: torch.Tensor, dst: int | None = None, op=ReduceOp.SUM, group=None,
           async_op: bool = False, group_dst: int | None = None, algorithm: str = "native"):
    """Like ``torch.distributed.reduce`` (``dst`` global, ``group_dst`` in the group), plus
    ``algorithm=``. The result is in ``tensor`` on the destination rank."""
    view = checks.enter("reduce", algorithm, ALGORITHMS, tensor, "tensor", group)
    if view is None:
        return None
    algorithm = checks.run_as("reduce", algorithm, view)  # native under an emulated topology
    checks.check_op("reduce", op, tensor.dtype, algorithm)
    root = checks.check_root(view, dst, group_dst, "dst", default_to_zero=False)
    is_root = view.rank == root
    if algorithm == "native":
        n, p = nbytes(tensor), view.size
        return run_native("reduce",
                          lambda a: dist.reduce(tensor, op=op, group=view.pg, async_op=a, group_dst=root),
                          sent=0 if is_root else n, received=(p - 1) * n if is_root else 0,
                          async_op=async_op)
    algo = ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        if is_root:
            buf, write_back = flat_buffer(tensor)
        else:
            buf, write_back = scratch(tensor.numel(), tensor.dtype, "input", device=tensor.device), (lambda: None)
            buf.view(tensor.shape).copy_(tensor)  # a private copy: the tree clobbers it
        algo(c, buf, root, ops.combining_op(op))
        if is_root:
            ops.finish_avg(buf, op, c.size)
            write_back()

    return run_algorithm("reduce", algorithm, view, body, async_op)
