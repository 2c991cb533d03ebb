"""Broadcast: the root's buffer ends up on every rank.

::

    before                 after
    rank 0 (root): A       rank 0: A
    rank 1:        .       rank 1: A
    rank 2:        .       rank 2: A
    rank 3:        .       rank 3: A

Algorithms (alpha: latency per message, beta: seconds per byte, n bytes, p ranks):

* ``flat``: the root sends the whole buffer to each rank in turn. ``(p-1)(alpha + n beta)`` at the
  root, which becomes the bottleneck.
* ``binomial``: a binomial tree; every rank that has the data sends it on, so the number of
  holders doubles each round. ``ceil(lg p)(alpha + n beta)``.
* ``scatter_allgather`` (van de Geijn): scatter p blocks down the binomial tree, then a ring
  all-gather. ``(lg p + p - 1) alpha + 2 ((p-1)/p) n beta``: best for large buffers.
* ``native``: ``torch.distributed.broadcast``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.comm import checks
from workbench.comm.all_gather import ring_all_gather
from workbench.comm.dispatch import flat_buffer, nbytes, run_algorithm, run_native
from workbench.comm.group import Comm, block_bounds


def flat(c: Comm, buf: torch.Tensor, root: int) -> None:
    """Root sends to every other rank directly::

        root --A--> 1
        root --A--> 2        (p-1) (alpha + n beta), all on the root's link
        root --A--> 3
    """
    if c.rank == root:
        handles = [c.isend(buf, peer) for peer in range(c.size) if peer != root]
        for h in handles:
            h.wait()
    else:
        c.recv(buf, root)


def binomial(c: Comm, buf: torch.Tensor, root: int) -> None:
    """Binomial tree, in ranks relative to the root (v = (rank - root) mod p)::

        round 1:  0 -> 4                      (p = 8: ceil(lg p) = 3 rounds,
        round 2:  0 -> 2,  4 -> 6              each round costs alpha + n beta)
        round 3:  0 -> 1,  2 -> 3,  4 -> 5,  6 -> 7

    A rank receives from ``v - m`` where m is its lowest set bit, then sends to ``v + m/2``,
    ``v + m/4``, ... 1 that exist.
    """
    p, v = c.size, (c.rank - root) % c.size
    real = lambda rel: (rel + root) % p  # noqa: E731
    mask = 1
    while mask < p:
        if v & mask:
            c.recv(buf, real(v - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:
            c.send(buf, real(v + mask))
        mask >>= 1


def scatter_allgather(c: Comm, buf: torch.Tensor, root: int) -> None:
    """Van de Geijn: binomial scatter of p blocks, then ring all-gather of the blocks::

        scatter (tree):  root keeps block 0, sends blocks [4,8) to v=4, [2,4) to v=2, [1,2) to v=1;
                         each rank forwards the upper half of what it got, and so on
        all-gather:      ring over v: each step every rank passes one block to v+1

    ``(lg p + p - 1) alpha + 2 ((p-1)/p) n beta``: each rank receives about n bytes twice over,
    whatever p is, against ``lg p`` times n for the binomial tree.
    """
    p, v = c.size, (c.rank - root) % c.size
    real = lambda rel: (rel + root) % p  # noqa: E731
    bounds = block_bounds(buf.numel(), p)  # block k goes to relative rank k
    mask = 1
    while mask < p:
        if v & mask:  # receive my subtree's blocks [v, v + mask)
            c.recv(buf[bounds[v]:bounds[min(v + mask, p)]], real(v - mask))
            break
        mask <<= 1
    mask >>= 1
    while mask > 0:
        if v + mask < p:  # child v + mask owns blocks [v + mask, v + 2 mask)
            c.send(buf[bounds[v + mask]:bounds[min(v + 2 * mask, p)]], real(v + mask))
        mask >>= 1
    ring_all_gather(c, [buf[bounds[k]:bounds[k + 1]] for k in range(p)], me=v, right=real(v + 1), left=real(v - 1))


ALGORITHMS = {"native": None, "flat": flat, "binomial": binomial,
              "scatter_allgather": scatter_allgather}


def broadcast(tensor: torch.Tensor, src: int | None = None, group=None, async_op: bool = False,
              group_src: int | None = None, algorithm: str = "native"):
    """Like ``torch.distributed.broadcast`` (``src`` is a global rank, ``group_src`` a rank in
    ``group``), plus ``algorithm=`` (one of :data:`ALGORITHMS`). Returns a handle if ``async_op``."""
    view = checks.enter("broadcast", algorithm, ALGORITHMS, tensor, "tensor", group)
    if view is None:
        return None
    algorithm = checks.run_as("broadcast", algorithm, view)  # native under an emulated topology
    root = checks.check_root(view, src, group_src, "src", default_to_zero=False)
    if algorithm == "native":
        n, p, is_root = nbytes(tensor), view.size, view.rank == root
        return run_native("broadcast",
                          lambda a: dist.broadcast(tensor, group=view.pg, async_op=a, group_src=root),
                          sent=(p - 1) * n if is_root else 0, received=0 if is_root else n,
                          async_op=async_op)
    algo = ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        buf, write_back = flat_buffer(tensor)
        algo(c, buf, root)
        write_back()

    return run_algorithm("broadcast", algorithm, view, body, async_op)
