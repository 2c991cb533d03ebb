"""All-reduce: combine every rank's buffer with ``op``; every rank ends up with the result.

::

    before          after
    rank 0: a       rank 0: a+b+c+d
    rank 1: b       rank 1: a+b+c+d
    rank 2: c       rank 2: a+b+c+d
    rank 3: d       rank 3: a+b+c+d

Algorithms (alpha latency, beta seconds per byte, gamma reduction seconds per byte, n bytes,
p ranks; Thakur, Rabenseifner and Gropp 2005):

=====================  ================================================================
``reduce_broadcast``   binomial reduce to rank 0, then binomial broadcast:
                       ``2 lg p (alpha + n beta) + lg p n gamma``
``ring``               ring reduce-scatter, then ring all-gather:
                       ``2 (p-1) alpha + 2 ((p-1)/p) n beta + ((p-1)/p) n gamma``
``recursive_doubling`` partners ``rank xor 2^k`` swap everything and both reduce:
                       ``lg p (alpha + n beta + n gamma)``
``rabenseifner``       recursive-halving reduce-scatter, then recursive-doubling all-gather:
                       ``2 lg p alpha + 2 ((p-1)/p) n beta + ((p-1)/p) n gamma``
``hierarchical``       needs a topology (:mod:`workbench.comm.topology`): ring reduce-scatter
                       inside each node, ring all-reduce across nodes between ranks of the
                       same local index, ring all-gather inside each node (N nodes of L):
                       ``2(L-1)(alpha_i + n/L beta_i) + 2(N-1)(alpha_e + n/(NL) beta_e) + ...``
``native``             ``torch.distributed.all_reduce`` (gloo: a segmented ring)
=====================  ================================================================

Small messages are latency-bound (fewest rounds wins: recursive doubling); large ones are
bandwidth-bound (least data per rank wins: ring or Rabenseifner, which reach the lower bound
``2 ((p-1)/p) n beta``). Non-powers of two fold in and out (:class:`~workbench.comm.group.Fold`).
``AVG`` reduces with ``SUM`` and divides by p at the end. Every rank gets bitwise the same result.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.comm import checks, ops
from workbench.comm.all_gather import RingAllGather, doubling_all_gather, ring_all_gather
from workbench.comm.broadcast import binomial as binomial_broadcast
from workbench.comm.dispatch import flat_buffer, nbytes, run_algorithm, run_native
from workbench.comm.group import Comm, Fold, block_bounds, scratch
from workbench.comm.reduce import binomial as binomial_reduce
from workbench.comm.reduce_scatter import halving_reduce_scatter, ring_reduce_scatter

ReduceOp = dist.ReduceOp


def reduce_broadcast(c: Comm, buf: torch.Tensor, op) -> None:
    """Binomial reduce to rank 0, then binomial broadcast from it::

        reduce:     1 -> 0, 3 -> 2;  2 -> 0          broadcast:  0 -> 2;  0 -> 1, 2 -> 3

    ``2 lg p (alpha + n beta) + lg p n gamma``: simple, but every round moves the whole buffer.
    """
    binomial_reduce(c, buf, 0, op)
    binomial_broadcast(c, buf, 0)


def ring(c: Comm, buf: torch.Tensor, op) -> None:
    """Ring reduce-scatter (p-1 steps) then ring all-gather (p-1 steps) of p blocks::

        reduce-scatter: after p-1 steps rank i holds block i of the sum   (see reduce_scatter.py)
        all-gather:     after p-1 more steps every rank holds every block  (see all_gather.py)

    Each rank sends and receives ``2 (p-1)/p n`` bytes, the lower bound: the cost is
    ``2 (p-1) alpha + 2 ((p-1)/p) n beta + ((p-1)/p) n gamma``. Blocks over 2 MiB are cut into
    segments so that transfer and reduction overlap (gloo cuts at 1 MiB and at least 2 segments;
    over loopback TCP fewer, bigger messages pay fewer rendezvous: see ``group.SEGMENT_BYTES``).
    """
    ring_over(c, buf, op, list(range(c.size)), c.rank)


def ring_over(c: Comm, buf: torch.Tensor, op, members, me: int, tag: int = 0) -> None:
    """Ring all-reduce of ``buf`` among the group ranks ``members`` (this rank is ``members[me]``);
    messages use tags ``tag`` and ``tag + 1``."""
    p = len(members)
    bounds = block_bounds(buf.numel(), p)
    blocks = [buf[bounds[i]:bounds[i + 1]] for i in range(p)]
    right, left = members[(me + 1) % p], members[(me - 1) % p]
    # The all-gather's receives are posted first (tag + 1 keeps them apart from the reduce-scatter's),
    # and each segment of this rank's block leaves as soon as the reduce-scatter has finished it.
    gather = RingAllGather(c, blocks, me=me, right=right, left=left, tag=tag + 1)
    ring_reduce_scatter(c, blocks, op, me=me, right=right, left=left, on_reduced=gather.send_own, tag=tag)
    gather.finish()


def recursive_doubling(c: Comm, buf: torch.Tensor, op) -> None:
    """Partners ``rank xor 2^k`` exchange their whole buffers and both reduce::

        step 0:  0 <-> 1,  2 <-> 3      each holds a pair's sum
        step 1:  0 <-> 2,  1 <-> 3      each holds the total

    ``lg p (alpha + n beta + n gamma)``: the fewest rounds, the most bytes. Non-powers of two
    fold in (the even rank of each extra pair sends to the odd one) and out (the result goes back).
    """
    fold, r = Fold(c.size), c.rank
    tmp = scratch(buf.numel(), buf.dtype, device=buf.device) if c.size > 1 else None  # reused: no page faults per call
    _fold_in(c, buf, tmp, fold, op)
    me = fold.new_rank(r)
    if me is not None:
        mask = 1
        while mask < fold.pp:
            partner = fold.old_rank(me ^ mask)
            c.sendrecv(buf, partner, tmp, partner)
            ops.reduce_into(buf, tmp, op)
            mask <<= 1
    _fold_out(c, buf, fold)


def rabenseifner(c: Comm, buf: torch.Tensor, op) -> None:
    """Rabenseifner: recursive-halving reduce-scatter, then recursive-doubling all-gather::

        pp = 4, halving:   0 <-> 2, 1 <-> 3 (swap halves);  0 <-> 1, 2 <-> 3 (swap quarters)
                doubling:  0 <-> 1, 2 <-> 3 (swap quarters); 0 <-> 2, 1 <-> 3 (swap halves)

    ``2 lg p alpha + 2 ((p-1)/p) n beta + ((p-1)/p) n gamma``: the ring's bandwidth with
    ``lg p`` instead of ``p-1`` rounds. Non-powers of two fold in and out.
    """
    fold, r = Fold(c.size), c.rank
    _fold_in(c, buf, None, fold, op)
    me = fold.new_rank(r)
    if me is not None:
        units = block_bounds(buf.numel(), fold.pp)
        halving_reduce_scatter(c, buf, units, op, me, fold.old_rank)
        doubling_all_gather(c, buf, units, me, fold.old_rank)
    _fold_out(c, buf, fold)


def _fold_in(c: Comm, buf: torch.Tensor, tmp, fold: Fold, op) -> None:
    r = c.rank
    if r < 2 * fold.rem:
        if r % 2 == 0:
            c.send(buf, r + 1)
        else:
            tmp = scratch(buf.numel(), buf.dtype, device=buf.device) if tmp is None else tmp
            c.recv(tmp, r - 1)
            ops.reduce_into(buf, tmp, op)


def _fold_out(c: Comm, buf: torch.Tensor, fold: Fold) -> None:
    r = c.rank
    if r < 2 * fold.rem:
        if r % 2:
            c.send(buf, r - 1)
        else:
            c.recv(buf, r + 1)


def hierarchical(c: Comm, buf: torch.Tensor, op) -> None:
    """Two levels (needs a topology; N nodes of L ranks, p = N L)::

        2 nodes x 2:  node 0 = ranks 0 1, node 1 = ranks 2 3; the vector in 2 halves h0 h1
        1. reduce-scatter inside each node (ring):   rank 0 and 2 hold their node's sum of h0,
                                                     rank 1 and 3 of h1
        2. all-reduce across nodes between ranks of the same local index (ring): 0 <-> 2 on h0,
                                                     1 <-> 3 on h1: each holds the total of its half
        3. all-gather inside each node (ring):       every rank holds the whole total

    The scheme of NCCL's trees and SageMaker's data parallel library: the slow links between
    nodes carry ``2 (N-1)/N n/L`` per rank, L times less than a flat ring asks of its slowest
    link, and all L ranks of a node use their own inter-node link at once. Cost::

        (L-1)(alpha_i + n/L beta_i + n/L gamma)                      reduce-scatter inside
        + 2(N-1)(alpha_e + n/(N L) beta_e) + (N-1) n/(N L) gamma     all-reduce across
        + (L-1)(alpha_i + n/L beta_i)                                all-gather inside
    """
    h = checks.hierarchy("all_reduce", c.view)
    row, col, i, k = h.row, h.column, h.local, h.node
    per_node = len(row)
    bounds = block_bounds(buf.numel(), per_node)
    blocks = [buf[bounds[j]:bounds[j + 1]] for j in range(per_node)]
    right, left = row[(i + 1) % per_node], row[(i - 1) % per_node]
    ring_reduce_scatter(c, blocks, op, me=i, right=right, left=left, tag=TAG_INTRA)
    ring_over(c, blocks[i], op, col, k, tag=TAG_INTER)
    ring_all_gather(c, blocks, me=i, right=right, left=left, tag=TAG_GATHER)


# tags of the hierarchical phases (ring_over uses TAG_INTER and TAG_INTER + 1)
TAG_INTRA, TAG_INTER, TAG_GATHER = 2, 4, 6

ALGORITHMS = {"native": None, "reduce_broadcast": reduce_broadcast, "ring": ring,
              "recursive_doubling": recursive_doubling, "rabenseifner": rabenseifner,
              "hierarchical": hierarchical}


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, async_op: bool = False,
               algorithm: str = "native"):
    """Like ``torch.distributed.all_reduce`` (in place on ``tensor``), plus ``algorithm=``."""
    view = checks.enter("all_reduce", algorithm, ALGORITHMS, tensor, "tensor", group)
    if view is None:
        return None
    algorithm = checks.run_as("all_reduce", algorithm, view)  # native under an emulated topology
    checks.check_op("all_reduce", op, tensor.dtype, algorithm)
    if algorithm == "hierarchical":
        checks.hierarchy("all_reduce", view)
    if algorithm == "native":
        p = view.size
        moved = 2 * (p - 1) * nbytes(tensor) // p
        return run_native("all_reduce",
                          lambda a: dist.all_reduce(tensor, op=op, group=view.pg, async_op=a),
                          sent=moved, received=moved, async_op=async_op)
    algo = ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        buf, write_back = flat_buffer(tensor)
        algo(c, buf, ops.combining_op(op))
        ops.finish_avg(buf, op, c.size)
        write_back()

    return run_algorithm("all_reduce", algorithm, view, body, async_op)
