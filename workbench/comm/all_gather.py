"""All-gather: every rank contributes one block; every rank ends up with all of them, in rank order.

::

    before          after
    rank 0: a0      rank 0: a0 a1 a2 a3
    rank 1: a1      rank 1: a0 a1 a2 a3
    rank 2: a2      rank 2: a0 a1 a2 a3
    rank 3: a3      rank 3: a0 a1 a2 a3

Algorithms (n = bytes of the gathered result, p ranks):

* ``ring``: p-1 steps; in each, every rank passes the block it got last to its right neighbour.
  ``(p-1) alpha + ((p-1)/p) n beta`` (bandwidth-optimal; messages are pipelined in segments).
* ``recursive_doubling``: lg p steps; partners ``rank xor 2^k`` swap everything they hold, so the
  held part doubles each step. ``lg p alpha + ((p-1)/p) n beta`` for a power of two; other sizes
  fold in and out (:class:`~workbench.comm.group.Fold`), adding ``2 alpha + (n/p + n) beta``.
* ``bruck``: ceil(lg p) steps for ANY p; in step k each rank sends the first ``min(2^k, p-2^k)``
  blocks it holds to ``rank - 2^k`` and receives as many from ``rank + 2^k``; a final local
  rotation puts the blocks in rank order. ``ceil(lg p) alpha + ((p-1)/p) n beta``.
* ``hierarchical`` (needs a topology, :mod:`workbench.comm.topology`): a ring across nodes
  between ranks of the same local index, then a ring inside each node.
  ``(N-1)(alpha_e + n/p beta_e) + (L-1)(alpha_i + n/L beta_i)`` for N nodes of L ranks.
* ``native``: ``torch.distributed.all_gather``.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workbench.comm import checks
from workbench.comm.dispatch import flat_buffer, nbytes, run_algorithm, run_native
from workbench.comm.group import Comm, Fold, scratch, segment, segment_count


class RingAllGather:
    """Ring all-gather of ``blocks`` (1-D tensors, ``blocks[i]`` = the block at ring position i).

    The rank at position ``me`` holds block ``me``; at step s it sends block ``me - s`` to the
    right and receives block ``me - s - 1`` from the left, straight into place::

        step 0:  0 --a0--> 1 --a1--> 2 --a2--> 3 --a3--> 0
        step 1:  0 --a3--> 1 --a0--> 2 --a1--> 3 --a2--> 0
        step 2:  0 --a2--> 1 --a3--> 2 --a0--> 3 --a1--> 0

    Each block travels in segments (see :func:`~workbench.comm.group.segment_count`), and a
    segment is forwarded as soon as it arrives, so a large message flows through the ring like a
    pipeline. Every receive is posted up front (each has its own place; messages carry their own
    ``tag`` so they never match another phase's), so no extra buffer is needed.

    In three parts so that ring all-reduce can start sending a segment of its own block the moment
    its reduce-scatter finishes reducing it: ``RingAllGather(...)`` posts the receives,
    ``send_own(j)`` sends segment j of block ``me``, ``finish()`` forwards the rest and waits.
    """

    def __init__(self, c: Comm, blocks: list[torch.Tensor], me: int, right: int, left: int,
                 tag: int = 0) -> None:
        self.c, self.blocks, self.me, self.right, self.left, self.tag = c, blocks, me, right, left, tag
        self.p = len(blocks)
        self.nseg = segment_count(blocks) if self.p > 1 else 0
        self.recvs = [[c.irecv(self.seg(me - s - 1, j), left, tag) for j in range(self.nseg)]
                      for s in range(self.p - 1)]
        self.sends: list = []

    def seg(self, block: int, j: int) -> torch.Tensor:
        return segment(self.blocks[block % self.p], self.nseg, j)

    def send_own(self, j: int) -> None:
        self.sends.append(self.c.isend(self.seg(self.me, j), self.right, self.tag))

    def finish(self) -> None:
        for s in range(self.p - 1):
            for j in range(self.nseg):
                self.recvs[s][j].wait()
                if s < self.p - 2:
                    self.sends.append(self.c.isend(self.seg(self.me - s - 1, j), self.right, self.tag))
        for h in self.sends:
            h.wait()


def ring_all_gather(c: Comm, blocks: list[torch.Tensor], me: int, right: int, left: int, tag: int = 0) -> None:
    """Ring all-gather (see :class:`RingAllGather`): ``(p-1) alpha + ((p-1)/p) n beta``."""
    ring = RingAllGather(c, blocks, me, right, left, tag)
    for j in range(ring.nseg):
        ring.send_own(j)
    ring.finish()


def doubling_all_gather(c: Comm, buf: torch.Tensor, units: list[int], me: int, real) -> None:
    """Recursive doubling over ``len(units) - 1`` (a power of two) units of ``buf``.

    Unit i is ``buf[units[i]:units[i+1]]``; the survivor ``me`` holds unit ``me``. At step k it swaps
    its ``2^k`` aligned units with partner ``me xor 2^k``::

        step 0:  0 <-> 1,  2 <-> 3      hold 2 units each
        step 1:  0 <-> 2,  1 <-> 3      hold 4 units each

    ``real(new_rank)`` gives a survivor's rank in the group.
    """
    pp = len(units) - 1
    mask = 1
    while mask < pp:
        partner = me ^ mask
        mine, theirs = (me // mask) * mask, (partner // mask) * mask
        c.sendrecv(buf[units[mine]:units[mine + mask]], real(partner),
                   buf[units[theirs]:units[theirs + mask]], real(partner))
        mask <<= 1


def ring(c: Comm, blocks: list[torch.Tensor]) -> None:
    """Ring: see :class:`RingAllGather`. ``(p-1) alpha + ((p-1)/p) n beta``. Receives go straight
    into the caller's output tensors (no staging buffer, no copy)."""
    p, r = c.size, c.rank
    ring_all_gather(c, blocks, me=r, right=(r + 1) % p, left=(r - 1) % p)


def _in_one_buffer(blocks: list[torch.Tensor], rank: int) -> torch.Tensor:
    """The algorithms below send runs of adjacent blocks in one message: stage them in one buffer."""
    m = blocks[rank].numel()
    full = scratch(len(blocks) * m, blocks[rank].dtype, "stage", device=blocks[rank].device)
    full[rank * m:(rank + 1) * m].copy_(blocks[rank])
    return full


def _out_of_one_buffer(full: torch.Tensor, blocks: list[torch.Tensor]) -> None:
    m = blocks[0].numel()
    for i, b in enumerate(blocks):
        b.copy_(full[i * m:(i + 1) * m])


def recursive_doubling(c: Comm, blocks: list[torch.Tensor]) -> None:
    """Recursive doubling, folded for non-powers of two::

        p = 3:  fold in   0 --a0--> 1                    (1 now holds a0 a1)
                doubling  1 <-> 2  (new ranks 0 <-> 1)    (1 and 2 hold a0 a1 a2)
                fold out  1 --a0 a1 a2--> 0

    Power of two: ``lg p alpha + ((p-1)/p) n beta``.
    """
    fold, r = Fold(c.size), c.rank
    full, m = _in_one_buffer(blocks, r), blocks[r].numel()
    block = lambda i: full[i * m:(i + 1) * m]  # noqa: E731
    if r < 2 * fold.rem:  # fold in: the even rank hands its block to the odd one
        if r % 2 == 0:
            c.send(block(r), r + 1)
        else:
            c.recv(block(r - 1), r - 1)
    me = fold.new_rank(r)
    if me is not None:
        units = [fold.first_block(i) * m for i in range(fold.pp)] + [c.size * m]
        doubling_all_gather(c, full, units, me, fold.old_rank)
    if r < 2 * fold.rem:  # fold out: the odd rank hands everything back
        if r % 2:
            c.send(full, r - 1)
        else:
            c.recv(full, r + 1)
    _out_of_one_buffer(full, blocks)


def bruck(c: Comm, blocks: list[torch.Tensor]) -> None:
    """Bruck et al. (1997): ceil(lg p) steps for any p.

    Work in a buffer rotated so that this rank's block comes first (``tmp[i]`` = block of rank
    ``rank + i``). At step k (distance d = 2^k) send the first ``min(d, p - d)`` blocks to
    ``rank - d`` and append as many received from ``rank + d``::

        p = 3, rank 0:  tmp = [a0]  --(d=1)-->  [a0 a1]  --(d=2)-->  [a0 a1 a2]

    Then copy each block to its rank's place. ``ceil(lg p) alpha + ((p-1)/p) n beta``.
    """
    p, r, m = c.size, c.rank, blocks[c.rank].numel()
    tmp = scratch(p * m, blocks[r].dtype, "stage", device=blocks[r].device)
    tmp[:m].copy_(blocks[r])
    d = 1
    while d < p:
        count = min(d, p - d)
        c.sendrecv(tmp[:count * m], (r - d) % p, tmp[d * m:(d + count) * m], (r + d) % p)
        d <<= 1
    for i in range(1, p):  # tmp[i] is rank (r + i)'s block
        blocks[(r + i) % p].copy_(tmp[i * m:(i + 1) * m])


def hierarchical(c: Comm, blocks: list[torch.Tensor]) -> None:
    """Two levels (needs a topology): a ring across nodes, then a ring inside each node::

        2 nodes x 2:  node 0 = ranks 0 1, node 1 = ranks 2 3
        across:  0 <-a0,a2-> 2,  1 <-a1,a3-> 3     each rank holds its column: 0 and 2 hold a0 a2
        inside:  0 <-(a0 a2),(a1 a3)-> 1, 2 <-> 3   each rank holds everything

    Across nodes each rank sends only its own block, so the slow links carry ``(N-1)/p n`` per
    rank (N nodes, L ranks per node, p = N L); inside a node each rank's column (N blocks) is staged
    in one buffer and goes round the node's ring as one message per step. Cost:
    ``(N-1)(alpha_inter + n/p beta_inter) + (L-1)(alpha_intra + n/L beta_intra)`` plus the copies
    in and out of the staging buffer (n bytes).
    """
    h = checks.hierarchy("all_gather", c.view)
    col, row, k, i = h.column, h.row, h.node, h.local
    n_nodes, per_node, m = len(col), len(row), blocks[c.rank].numel()
    ring_all_gather(c, [blocks[g] for g in col], me=k, right=col[(k + 1) % n_nodes],
                    left=col[(k - 1) % n_nodes], tag=TAG_INTER)
    if per_node == 1:
        return
    own = blocks[c.rank]
    stage = scratch(per_node * n_nodes * m, own.dtype, "hier", device=own.device).view(per_node, n_nodes * m)
    for kk, node in enumerate(h.nodes):
        stage[i, kk * m:(kk + 1) * m].copy_(blocks[node[i]])
    ring_all_gather(c, list(stage), me=i, right=row[(i + 1) % per_node], left=row[(i - 1) % per_node],
                    tag=TAG_INTRA)
    for ii in range(per_node):
        if ii != i:
            for kk, node in enumerate(h.nodes):
                blocks[node[ii]].copy_(stage[ii, kk * m:(kk + 1) * m])


# tags of the hierarchical algorithms' phases (rings use tag and tag + 1)
TAG_INTRA, TAG_INTER, TAG_GATHER = 2, 4, 6

ALGORITHMS = {"native": None, "ring": ring, "recursive_doubling": recursive_doubling, "bruck": bruck,
              "hierarchical": hierarchical}


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None,
               async_op: bool = False, algorithm: str = "native"):
    """Like ``torch.distributed.all_gather``: ``tensor_list[i]`` receives rank i's ``tensor``."""
    view = checks.enter("all_gather", algorithm, ALGORITHMS, tensor, "tensor", group)
    if view is None:
        return None
    algorithm = checks.run_as("all_gather", algorithm, view)  # native under an emulated topology
    checks.check_list(tensor_list, "tensor_list", view.size, tensor, "tensor")
    if algorithm == "hierarchical":
        checks.hierarchy("all_gather", view)
    if algorithm == "native":
        moved = (view.size - 1) * nbytes(tensor)
        return run_native("all_gather",
                          lambda a: dist.all_gather(list(tensor_list), tensor, group=view.pg, async_op=a),
                          sent=moved, received=moved, async_op=async_op)
    algo = ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        pairs = [flat_buffer(t) for t in tensor_list]  # the outputs themselves when contiguous
        blocks = [b for b, _ in pairs]
        blocks[c.rank].copy_(tensor.reshape(-1))
        algo(c, blocks)
        for _, write_back in pairs:
            write_back()

    return run_algorithm("all_gather", algorithm, view, body, async_op)
