"""Reduce-scatter: combine every rank's p blocks with ``op``; rank i keeps only block i of the result.

::

    before                       after
    rank 0: a0 a1 a2 a3          rank 0: a0+b0+c0+d0
    rank 1: b0 b1 b2 b3          rank 1: a1+b1+c1+d1
    rank 2: c0 c1 c2 c3          rank 2: a2+b2+c2+d2
    rank 3: d0 d1 d2 d3          rank 3: a3+b3+c3+d3

Algorithms (n = bytes of one rank's whole input, p ranks):

* ``ring``: p-1 steps; each rank passes a partial sum to the right, which adds its own block and
  passes it on. ``(p-1) alpha + ((p-1)/p) n (beta + gamma)``; blocks over 2 MiB are pipelined in
  segments (:func:`~workbench.comm.group.segment_count`).
* ``recursive_halving``: lg p steps; partners ``rank xor 2^k`` swap half of what is left and
  each keeps (and reduces) the other half. ``lg p alpha + ((p-1)/p) n (beta + gamma)`` for a
  power of two; other sizes fold in and out (:class:`~workbench.comm.group.Fold`).
* ``hierarchical`` (needs a topology, :mod:`workbench.comm.topology`): a ring inside each node,
  then a ring across nodes between ranks of the same local index, so that only partial sums
  cross the slow links. ``(L-1)(alpha_i + n/L (beta_i + gamma)) + (N-1)(alpha_e + n/p (beta_e + gamma))``.
* ``native``: ``torch.distributed.reduce_scatter``.

``AVG`` reduces with ``SUM`` and divides the kept block by p.
"""
from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist

from workbench.comm import checks, ops
from workbench.comm.dispatch import flat_buffer, nbytes, run_algorithm, run_native
from workbench.comm.group import Comm, Fold, scratch, segment, segment_count

ReduceOp = dist.ReduceOp

# Receive rows in flight in the ring reduce-scatter (segments of at most SEGMENT_BYTES each), as
# gloo: 2 (more buffers in flight mean more cache misses; see group.SEGMENT_BYTES for the sizes).
RECV_WINDOW = 2


def ring_reduce_scatter(c: Comm, blocks: list[torch.Tensor], op, me: int, right: int, left: int,
                        on_reduced: Callable[[int], None] | None = None,
                        out: torch.Tensor | None = None, tag: int = 0) -> None:
    """Ring reduce-scatter of ``blocks`` (1-D tensors, one per ring position): block ``me``,
    reduced over all ranks, ends in ``blocks[me]`` (``out=None``) or in ``out``.

    At step s the rank at position ``me`` sends its partial block ``me - s - 1`` to the right and
    receives block ``me - s - 2`` from the left, which it combines with its own copy::

        p = 4, step 0:  0 --a3--> 1 --b0--> 2 --c1--> 3 --d2--> 0
               step 1:  0 --a2+d2--> 1 --b3+a3--> 2 --c0+b0--> 3 --d1+c1--> 0
               step 2:  ... after p-1 steps rank i holds block i reduced over all ranks

    Pipelining: blocks over ``SEGMENT_BYTES`` (2 MiB) are cut into segments. Receives land in a
    small ring of ``RECV_WINDOW`` rows (reused from call to call:
    :func:`~workbench.comm.group.scratch`); as soon as a segment arrives it is combined and sent
    on as the next step's segment, and its row takes the next receive, while later segments are
    still in flight: the network and the adder work at the same time. ``on_reduced(j)`` is
    called as soon as segment j of the result is final (ring all-reduce starts its all-gather there).

    Where the partial sums go:

    * ``out=None`` (all-reduce): into the blocks themselves (``a += incoming``); the other blocks
      of the buffer end up holding partial results.
    * ``out`` given (reduce-scatter, whose inputs must not change): into a small accumulator
      (``acc = a op incoming``; rows alternate between two steps, a row is reused only once its
      send is done), and at the last step straight into ``out``. Step 0 sends from the caller's
      block. Nothing is copied: the memory traffic is that of the in-place ring.
    """
    p = len(blocks)
    if p == 1:
        if out is not None:
            out.copy_(blocks[0])
        return
    nseg = segment_count(blocks)
    rows = min(RECV_WINDOW, (p - 1) * nseg)
    width = -(-max(b.numel() for b in blocks) // nseg)
    dtype = blocks[0].dtype
    tmp = scratch(rows * width, dtype, device=blocks[0].device).view(rows, width)
    acc = None
    if out is not None and p > 2:
        acc = scratch(2 * nseg * width, dtype, "stage", device=blocks[0].device).view(2, nseg, width)
    seg = lambda block, j: segment(blocks[block % p], nseg, j)  # noqa: E731

    # Receives, in the order the left neighbour sends them: (step s, segment j), s-major.
    order = [(s, j) for s in range(p - 1) for j in range(nseg)]

    def post(k: int):
        s, j = order[k]
        return c.irecv(tmp[k % rows, :seg(me - s - 2, j).numel()], left, tag)

    recvs = [post(k) for k in range(rows)]  # receives first: gloo sends once the receiver is ready
    sends = [c.isend(seg(me - 1, j), right, tag) for j in range(nseg)]
    acc_sent: dict[tuple[int, int], object] = {}  # accumulator row -> its send
    for k, (s, j) in enumerate(order):
        recvs[k % rows].wait()
        mine = seg(me - s - 2, j)
        if out is None:
            dst = mine
        elif s == p - 2:  # block ``me``: the result
            dst = segment(out, nseg, j)
        else:
            if (s % 2, j) in acc_sent:  # this row went out two steps ago: its send must be done
                acc_sent.pop((s % 2, j)).wait()
            dst = acc[s % 2, j, :mine.numel()]
        ops.combine_into(dst, mine, tmp[k % rows, :mine.numel()], op)
        if k + rows < len(order):
            recvs[k % rows] = post(k + rows)
        if s < p - 2:
            h = c.isend(dst, right, tag)
            if out is None:
                sends.append(h)
            else:
                acc_sent[(s % 2, j)] = h
        elif on_reduced is not None:
            on_reduced(j)
    for h in sends + list(acc_sent.values()):
        h.wait()


def halving_reduce_scatter(c: Comm, buf: torch.Tensor, units: list[int], op, me: int, real) -> None:
    """Recursive halving over ``len(units) - 1`` (a power of two) units of ``buf``.

    Unit i is ``buf[units[i]:units[i+1]]``. At each step the survivor ``me`` and its partner
    ``me xor mask`` (mask = pp/2, pp/4, ..., 1) split the units they are still responsible for:
    the one with the bit set keeps the upper half, sends the lower half, and reduces what it
    receives into the half it keeps::

        pp = 4, step 0:  0 <-> 2, 1 <-> 3  (swap halves: 0,1 keep units 0-1, 2,3 keep units 2-3)
                step 1:  0 <-> 1, 2 <-> 3  (swap quarters: survivor i keeps unit i)

    ``real(new_rank)`` gives a survivor's rank in the group.
    """
    pp = len(units) - 1
    lo, hi, mask = 0, pp, pp // 2
    tmp = None
    while mask >= 1:
        mid, partner = lo + mask, me ^ mask
        keep, give = ((mid, hi), (lo, mid)) if me & mask else ((lo, mid), (mid, hi))
        k0, k1 = units[keep[0]], units[keep[1]]
        if tmp is None:  # the first kept half is the largest
            tmp = scratch(max(units[mid] - units[lo], units[hi] - units[mid]), buf.dtype, device=buf.device)
        incoming = tmp[:k1 - k0]
        c.sendrecv(buf[units[give[0]]:units[give[1]]], real(partner), incoming, real(partner))
        ops.reduce_into(buf[k0:k1], incoming, op)
        lo, hi = keep
        mask //= 2


def ring(c: Comm, inputs: list[torch.Tensor], out: torch.Tensor, op) -> None:
    """Ring: see :func:`ring_reduce_scatter`. ``(p-1) alpha + ((p-1)/p) n (beta + gamma)``."""
    p, r = c.size, c.rank
    ring_reduce_scatter(c, inputs, op, me=r, right=(r + 1) % p, left=(r - 1) % p, out=out)


def recursive_halving(c: Comm, inputs: list[torch.Tensor], out: torch.Tensor, op) -> None:
    """Recursive halving swaps runs of adjacent blocks, and reduces into them: it works on a copy
    of the inputs laid out in one buffer (see :func:`_recursive_halving`)."""
    m = out.numel()
    full = scratch(c.size * m, out.dtype, "stage", device=out.device)  # the inputs are not to be modified
    for i, t in enumerate(inputs):
        full[i * m:(i + 1) * m].copy_(t)
    _recursive_halving(c, full, m, op)
    out.copy_(full[c.rank * m:(c.rank + 1) * m])


def _recursive_halving(c: Comm, full: torch.Tensor, m: int, op) -> None:
    """Recursive halving, folded for non-powers of two::

        p = 3:  fold in   0 --a0 a1 a2--> 1        (1 reduces it into its own input)
                halving   1 <-> 2 (new ranks 0, 1): 1 keeps blocks 0-1, 2 keeps block 2
                fold out  1 --block 0--> 0

    Power of two: ``lg p alpha + ((p-1)/p) n (beta + gamma)``.
    """
    fold, r = Fold(c.size), c.rank
    if r < 2 * fold.rem:  # fold in: the even rank hands its whole input to the odd one
        if r % 2 == 0:
            c.send(full, r + 1)
        else:
            tmp = scratch(full.numel(), full.dtype, device=full.device)
            c.recv(tmp, r - 1)
            ops.reduce_into(full, tmp, op)
    me = fold.new_rank(r)
    if me is not None:  # survivor i answers for the blocks of the ranks it stands for
        units = [fold.first_block(i) * m for i in range(fold.pp)] + [c.size * m]
        halving_reduce_scatter(c, full, units, op, me, fold.old_rank)
    if r < 2 * fold.rem:  # fold out: the odd rank hands the even one its block
        if r % 2:
            c.send(full[(r - 1) * m:r * m], r - 1)
        else:
            c.recv(full[r * m:(r + 1) * m], r + 1)


def hierarchical(c: Comm, inputs: list[torch.Tensor], out: torch.Tensor, op) -> None:
    """Two levels (needs a topology): a ring inside each node, then a ring across nodes::

        2 nodes x 2:  node 0 = ranks 0 1, node 1 = ranks 2 3
        inside:  0 <-> 1, 2 <-> 3   rank 0 keeps the node's partial sums of blocks 0 and 2
                                    (its column), rank 1 of blocks 1 and 3
        across:  0 <-> 2, 1 <-> 3   rank 0 keeps block 0 summed over all ranks, rank 2 block 2

    Each rank lays its inputs out in one buffer, one row per local index holding that column's
    N blocks (N nodes, L ranks per node, p = N L), so the node's ring moves a row per step. Across
    nodes only the node's partial sums travel: ``(N-1)/p n`` per rank on the slow links. Cost:
    ``(L-1)(alpha_i + n/L (beta_i + gamma)) + (N-1)(alpha_e + n/p (beta_e + gamma))`` plus
    copying the n input bytes into the buffer (the inputs are not modified).
    """
    h = checks.hierarchy("reduce_scatter", c.view)
    col, row, k, i = h.column, h.row, h.node, h.local
    n_nodes, per_node, m = len(col), len(row), out.numel()
    stage = scratch(per_node * n_nodes * m, out.dtype, "hier", device=out.device).view(per_node, n_nodes * m)
    for ii in range(per_node):
        for kk, node in enumerate(h.nodes):
            stage[ii, kk * m:(kk + 1) * m].copy_(inputs[node[ii]])
    ring_reduce_scatter(c, list(stage), op, me=i, right=row[(i + 1) % per_node], left=row[(i - 1) % per_node],
                        tag=TAG_INTRA)
    mine = stage[i]
    ring_reduce_scatter(c, [mine[kk * m:(kk + 1) * m] for kk in range(n_nodes)], op, me=k,
                        right=col[(k + 1) % n_nodes], left=col[(k - 1) % n_nodes], out=out, tag=TAG_INTER)


# tags of the hierarchical phases (kept apart from each other's messages)
TAG_INTRA, TAG_INTER = 2, 4

ALGORITHMS = {"native": None, "ring": ring, "recursive_halving": recursive_halving, "hierarchical": hierarchical}


def reduce_scatter(output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None,
                   async_op: bool = False, algorithm: str = "native"):
    """Like ``torch.distributed.reduce_scatter``: ``output`` on rank i receives
    ``op`` over every rank's ``input_list[i]``. ``input_list`` is not modified."""
    view = checks.enter("reduce_scatter", algorithm, ALGORITHMS, output, "output", group)
    if view is None:
        return None
    algorithm = checks.run_as("reduce_scatter", algorithm, view)  # native under an emulated topology
    checks.check_op("reduce_scatter", op, output.dtype, algorithm)
    checks.check_list(input_list, "input_list", view.size, output, "output")
    if algorithm == "hierarchical":
        checks.hierarchy("reduce_scatter", view)
    if algorithm == "native":
        moved = (view.size - 1) * nbytes(output)
        return run_native("reduce_scatter",
                          lambda a: dist.reduce_scatter(output, list(input_list), op=op, group=view.pg, async_op=a),
                          sent=moved, received=moved, async_op=async_op)
    algo, m = ALGORITHMS[algorithm], output.numel()

    def body(c: Comm) -> None:
        inputs = [t.reshape(-1) if t.is_contiguous() else t.contiguous().view(-1) for t in input_list]
        out, write_back = flat_buffer(output)
        algo(c, inputs, out, ops.combining_op(op))
        ops.finish_avg(out, op, c.size)
        write_back()

    return run_algorithm("reduce_scatter", algorithm, view, body, async_op)
