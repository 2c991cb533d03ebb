"""Scatter and gather: the root hands out one block to each rank, or collects one from each.

::

    scatter                                 gather
    before              after               before          after
    root: a0 a1 a2 a3   rank 0: a0          rank 0: a0      root: a0 a1 a2 a3
                        rank 1: a1          rank 1: a1
                        rank 2: a2          rank 2: a2
                        rank 3: a3          rank 3: a3

Algorithms (n = bytes of all p blocks together, p ranks):

* ``flat``: the root exchanges one message with each rank. ``(p-1) alpha + ((p-1)/p) n beta``.
* ``binomial``: a binomial tree; a rank forwards (scatter) or collects (gather) the blocks of its
  whole subtree in one message. ``ceil(lg p) alpha + ((p-1)/p) n beta``: same bytes through the
  root, far fewer rounds.
* ``native``: ``torch.distributed.scatter`` / ``torch.distributed.gather``.

The tree works in ranks relative to the root (v = (rank - root) mod p), where the subtree of v
is the contiguous range ``[v, v + lowest set bit of v)``; the root lays its blocks out in that
relative order (one local copy) so each forwarded range is one contiguous message.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.comm import checks
from workbench.comm.dispatch import flat_buffer, nbytes, run_algorithm, run_native
from workbench.comm.group import Comm, scratch


def scatter_flat(c: Comm, out: torch.Tensor, blocks: list[torch.Tensor] | None, root: int) -> None:
    """Root sends block i to rank i, one message each::

        root --a1--> 1,  root --a2--> 2,  root --a3--> 3     (p-1) alpha + ((p-1)/p) n beta
    """
    if c.rank != root:
        c.recv(out, root)
        return
    handles = [c.isend(blocks[peer], peer) for peer in range(c.size) if peer != root]
    out.copy_(blocks[root])
    for h in handles:
        h.wait()


def scatter_binomial(c: Comm, out: torch.Tensor, blocks: list[torch.Tensor] | None, root: int) -> None:
    """Binomial-tree scatter (relative ranks)::

        round 1:  0 --a4..a7--> 4              (p = 8)
        round 2:  0 --a2 a3--> 2,  4 --a6 a7--> 6
        round 3:  0 --a1--> 1,  2 --a3--> 3,  4 --a5--> 5,  6 --a7--> 7

    ``ceil(lg p) alpha + ((p-1)/p) n beta``. Each subtree's blocks travel as one message. The
    root sends a single block straight from the caller's tensor and lays out only runs of several
    blocks in a buffer; a leaf receives straight into its output. (On 2 ranks nothing is copied.)
    """
    p, v, m = c.size, (c.rank - root) % c.size, out.numel()
    real = lambda rel: (rel + root) % p  # noqa: E731
    mask = 1
    held = None  # my subtree's blocks [v, v + size), in one buffer (not at the root)
    if v == 0:
        mask = 1 << (p - 1).bit_length()
    else:
        while not v & mask:
            mask <<= 1
        size = min(mask, p - v)
        held = out if size == 1 else scratch(size * m, out.dtype, "stage", device=out.device)
        c.recv(held, real(v - mask))
    mask >>= 1
    while mask > 0:
        if v + mask < p:  # child v + mask owns [v + mask, v + 2 mask)
            lo, hi = mask, min(2 * mask, p - v)
            if held is not None:
                run = held[lo * m:hi * m]
            elif hi - lo == 1:
                run = blocks[real(lo)]
            else:  # the root lays several blocks out in one message (sent before the buffer is reused)
                run = scratch((hi - lo) * m, out.dtype, "stage", device=out.device)
                for k in range(lo, hi):
                    run[(k - lo) * m:(k - lo + 1) * m].copy_(blocks[real(k)])
            c.send(run, real(v + mask))
        mask >>= 1
    if v == 0:
        out.copy_(blocks[root])
    elif held is not out:
        out.copy_(held[:m])


def gather_flat(c: Comm, inp: torch.Tensor, blocks: list[torch.Tensor] | None, root: int) -> None:
    """Every rank sends its block to the root, which receives them all at once::

        1 --a1--> root,  2 --a2--> root,  3 --a3--> root     (p-1) alpha + ((p-1)/p) n beta
    """
    if c.rank != root:
        c.send(inp, root)
        return
    handles = [c.irecv(blocks[peer], peer) for peer in range(c.size) if peer != root]
    blocks[root].copy_(inp)
    for h in handles:
        h.wait()


def gather_binomial(c: Comm, inp: torch.Tensor, blocks: list[torch.Tensor] | None, root: int) -> None:
    """Binomial-tree gather (relative ranks): scatter's tree, run backwards::

        round 1:  1 --a1--> 0,  3 --a3--> 2,  5 --a5--> 4,  7 --a7--> 6      (p = 8)
        round 2:  2 --a2 a3--> 0,  6 --a6 a7--> 4
        round 3:  4 --a4..a7--> 0

    ``ceil(lg p) alpha + ((p-1)/p) n beta``. A leaf sends its input as it is; the root receives a
    single block straight into the caller's tensor and only runs of several blocks into a buffer.
    """
    p, v, m = c.size, (c.rank - root) % c.size, inp.numel()
    real = lambda rel: (rel + root) % p  # noqa: E731
    mask = 1
    while mask < p and not v & mask:
        mask <<= 1
    size = min(mask, p - v)  # my subtree: relative ranks [v, v + size)
    if v != 0 and size == 1:  # a leaf
        c.send(inp, real(v - mask))
        return
    held = None if v == 0 else scratch(size * m, inp.dtype, "stage", device=inp.device)
    if held is not None:
        held[:m].copy_(inp)
    else:
        blocks[root].copy_(inp)
    child = 1
    while child < mask and v + child < p:  # children v + 1, v + 2, v + 4, ... in that order
        hi = min(2 * child, p - v)
        if held is not None:
            c.recv(held[child * m:hi * m], real(v + child))
        elif hi - child == 1:
            c.recv(blocks[real(child)], real(v + child))
        else:  # several blocks in one message: receive, then put each in its place
            run = scratch((hi - child) * m, inp.dtype, "stage", device=inp.device)
            c.recv(run, real(v + child))
            for k in range(child, hi):
                blocks[real(k)].copy_(run[(k - child) * m:(k - child + 1) * m])
        child <<= 1
    if held is not None:
        c.send(held, real(v - mask))


SCATTER_ALGORITHMS = {"native": None, "flat": scatter_flat, "binomial": scatter_binomial}
GATHER_ALGORITHMS = {"native": None, "flat": gather_flat, "binomial": gather_binomial}


def _check_root_list(lst, name: str, is_root: bool, size: int, like: torch.Tensor, like_name: str) -> None:
    if is_root:
        if not lst:
            raise ValueError(f"{name} must be given on the root rank: a list of {size} tensors "
                             f"shaped like {like_name}")
        checks.check_list(lst, name, size, like, like_name)
    elif lst:
        raise ValueError(f"{name} must be None (or empty) on ranks other than the root, as in "
                         "torch.distributed: only the root holds the list")


def scatter(tensor: torch.Tensor, scatter_list: list[torch.Tensor] | None = None, src: int | None = None,
            group=None, async_op: bool = False, group_src: int | None = None, algorithm: str = "native"):
    """Like ``torch.distributed.scatter``: rank i's ``tensor`` receives ``scatter_list[i]`` from the
    source (``src`` global, ``group_src`` in the group; default global rank 0)."""
    view = checks.enter("scatter", algorithm, SCATTER_ALGORITHMS, tensor, "tensor", group)
    if view is None:
        return None
    algorithm = checks.run_as("scatter", algorithm, view)  # native under an emulated topology
    root = checks.check_root(view, src, group_src, "src", default_to_zero=True)
    is_root = view.rank == root
    _check_root_list(scatter_list, "scatter_list", is_root, view.size, tensor, "tensor")
    if algorithm == "native":
        n = nbytes(tensor)
        return run_native("scatter",
                          lambda a: dist.scatter(tensor, list(scatter_list) if is_root else None,
                                                 group=view.pg, async_op=a, group_src=root),
                          sent=(view.size - 1) * n if is_root else 0, received=0 if is_root else n,
                          async_op=async_op)
    algo = SCATTER_ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        out, write_back = flat_buffer(tensor)
        blocks = [t.contiguous().view(-1) for t in scatter_list] if is_root else None
        algo(c, out, blocks, root)
        write_back()

    return run_algorithm("scatter", algorithm, view, body, async_op)


def gather(tensor: torch.Tensor, gather_list: list[torch.Tensor] | None = None, dst: int | None = None,
           group=None, async_op: bool = False, group_dst: int | None = None, algorithm: str = "native"):
    """Like ``torch.distributed.gather``: on the destination (``dst`` global, ``group_dst`` in the
    group; default global rank 0) ``gather_list[i]`` receives rank i's ``tensor``."""
    view = checks.enter("gather", algorithm, GATHER_ALGORITHMS, tensor, "tensor", group)
    if view is None:
        return None
    algorithm = checks.run_as("gather", algorithm, view)  # native under an emulated topology
    root = checks.check_root(view, dst, group_dst, "dst", default_to_zero=True)
    is_root = view.rank == root
    _check_root_list(gather_list, "gather_list", is_root, view.size, tensor, "tensor")
    if algorithm == "native":
        n = nbytes(tensor)
        return run_native("gather",
                          lambda a: dist.gather(tensor, list(gather_list) if is_root else None,
                                                group=view.pg, async_op=a, group_dst=root),
                          sent=0 if is_root else n, received=(view.size - 1) * n if is_root else 0,
                          async_op=async_op)
    algo = GATHER_ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        inp = tensor.contiguous().view(-1)
        if is_root:
            pairs = [flat_buffer(t) for t in gather_list]
            algo(c, inp, [b for b, _ in pairs], root)
            for _, write_back in pairs:
                write_back()
        else:
            algo(c, inp, None, root)

    return run_algorithm("gather", algorithm, view, body, async_op)
