"""Groups and point-to-point messages: what every hand-written algorithm is built from.

A collective runs on a process group (the default group, or one made by
``torch.distributed.new_group``). Inside an algorithm every rank is named by its rank *in the
group* (0 .. p-1), as in the textbooks; :class:`GroupView` translates, and :class:`Comm` sends
and receives in group numbering with ``torch.distributed.isend/irecv(group_dst=/group_src=)``,
counting every byte that goes through it, by link class (``"intra"`` or ``"inter"`` node, from
the topology: :mod:`workbench.comm.topology`). Empty tensors are not sent at all (both sides know
the size, so both skip the message). Under an emulated topology every message on a slowed link is
held back here, once for every algorithm (:mod:`workbench.comm.emulation`).

Also here, because several collectives share them: :func:`block_bounds` (split n elements into p
near-equal blocks), :class:`Fold` (fold a non-power-of-two group onto a power of two, for
recursive doubling and halving), :func:`segment_count` / :func:`segment` (cut ring blocks into
pipeline segments), and :func:`scratch` (a receive buffer reused from call to call).
"""
from __future__ import annotations

import threading
import time
import weakref
from dataclasses import dataclass

import torch
import torch.distributed as dist

from workbench.runtime import gloo_threads
from workbench.comm import emulation
from workbench.comm.counters import LinkStat

__all__ = ["GroupView", "Comm", "resolve_group", "block_bounds", "Fold", "segment_count", "segment",
           "scratch"]


@dataclass(frozen=True)
class GroupView:
    """A process group seen from this rank: ``rank`` and ``size`` in group numbering."""

    pg: dist.ProcessGroup
    rank: int
    size: int

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self.pg, group_rank)

    def group_rank(self, global_rank: int) -> int:
        return dist.get_group_rank(self.pg, global_rank)


_seen_groups: weakref.WeakSet = weakref.WeakSet()  # the groups already met (see gloo_threads.py)


def resolve_group(group) -> GroupView | None:
    """The view of ``group`` (None = default group), or None if this rank is not in it."""
    if not dist.is_initialized():
        raise RuntimeError("workbench.comm needs an initialised process group: run inside "
                           "workbench.launch(fn, world_size=...) or under torchrun")
    if group is None:
        group = dist.group.WORLD
    if group == dist.GroupMember.NON_GROUP_MEMBER:
        return None
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group={group!r} is not a ProcessGroup: pass None (every rank) or a group "
                        "made by torch.distributed.new_group(ranks)")
    if group not in _seen_groups:  # a new gloo group has its own network thread: demote it too
        _seen_groups.add(group)
        gloo_threads.demote_loop_threads()
    return GroupView(group, dist.get_rank(group), dist.get_world_size(group))


def wire_device(group=None) -> torch.device:
    """Where a small message of the library's own (a shape, an order, a timeline) lives on
    ``group``: the CPU under gloo, which moves host memory; this rank's GPU under NCCL, which
    moves only device memory."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


class _Done:
    """The handle of a message that was not sent because it was empty."""

    def wait(self) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Timed:
    """A message's handle that adds the time spent waiting for it to its link's counter."""

    __slots__ = ("works", "stat", "until", "stamp", "keep", "done", "unstage")

    def __init__(self, works, stat: LinkStat | None, until: float | None = None, stamp: torch.Tensor | None = None,
                 keep=None, unstage: tuple[torch.Tensor, torch.Tensor] | None = None):
        self.works, self.stat, self.until, self.stamp, self.done = works, stat, until, stamp, False
        self.keep = keep  # a sent stamp (or host copy) stays alive until its send is done
        self.unstage = unstage  # (device tensor, host copy): a staged receive copies back once done

    def wait(self) -> bool:
        if not self.done:
            start = time.perf_counter()
            if self.until is None and self.stamp is None or all(w.is_completed() for w in self.works):
                for w in self.works:
                    w.wait()
            else:  # a held-back message: let gloo's network thread move its bytes (see gloo_threads.py)
                with gloo_threads.promoted():
                    for w in self.works:
                        w.wait()
            if self.stamp is not None:  # a held-back receive: its due time came with it
                self.until = float(self.stamp[0])
            if self.until is not None:
                emulation._sleep_until(self.until)
            if self.unstage is not None:
                self.unstage[0].copy_(self.unstage[1])
            if self.stat is not None:
                self.stat.seconds += time.perf_counter() - start
            self.done = True
        return True

    def is_completed(self) -> bool:
        if self.done:
            return True
        if not all(w.is_completed() for w in self.works):
            return False
        until = float(self.stamp[0]) if self.stamp is not None else self.until
        return until is None or time.monotonic() >= until


class _AnySource(_Timed):
    """A staged receive from any source: torch's handle, which knows the sender, plus the copy back."""

    __slots__ = ()

    def __init__(self, work, unstage) -> None:
        super().__init__((work,), None, unstage=unstage)

    def _source_rank(self) -> int:
        return self.works[0]._source_rank()


class Comm:
    """Point-to-point messages inside one collective call, in group numbering, counted.

    ``bytes_sent`` / ``bytes_received`` add up the payload of every message this rank posted;
    ``links`` splits them by link class (``{"intra": LinkStat, "inter": LinkStat}``), with the
    time this rank spent waiting for each class's messages.
    """

    def __init__(self, view: GroupView) -> None:
        self.view = view
        self.pg = view.pg
        self.rank = view.rank
        self.size = view.size
        self.bytes_sent = 0
        self.bytes_received = 0
        self.links: dict[str, LinkStat] = {}
        self.topology = emulation.layout()
        self._ranks = emulation.global_ranks(self.pg)
        self._host_only = dist.get_backend(self.pg) == "gloo"

    def _link(self, peer: int) -> tuple[LinkStat, str, object]:
        cls = self.topology.link_class(self._ranks[self.rank], self._ranks[peer])
        stat = self.links.get(cls)
        if stat is None:
            stat = self.links[cls] = LinkStat()
        return stat, cls, self.topology.link(cls)

    def _staged(self, tensor: torch.Tensor) -> bool:
        """gloo moves host memory only: its point-to-point calls would read a CUDA tensor's
        device address as if it were host memory ("writev: Bad address"). A CUDA tensor on a
        gloo group therefore travels through a host copy: one device-to-host copy before a send,
        one host-to-device copy after a receive (each ``n / PCIe bandwidth`` on top of the
        message, and ``n`` host bytes while in flight). NCCL sends device memory directly."""
        return self._host_only and tensor.device.type != "cpu"

    def isend(self, tensor: torch.Tensor, peer: int, tag: int = 0):
        if tensor.numel() == 0:
            return _Done()
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_sent += nbytes
        stat, cls, link = self._link(peer)
        stat.messages += 1
        stat.bytes_sent += nbytes
        staged = self._staged(tensor)
        wire = tensor.to("cpu") if staged else tensor
        if link is None:
            return _Timed((dist.isend(wire, group=self.pg, group_dst=peer, tag=tag),), stat,
                          keep=wire if staged else None)
        due, free = emulation.schedule(cls, link, nbytes)  # held back: see emulation.py
        stamp = torch.tensor([due], dtype=torch.float64, device=wire.device)
        works = (dist.isend(stamp, group=self.pg, group_dst=peer, tag=tag + emulation.STAMP_TAG),
                 dist.isend(wire, group=self.pg, group_dst=peer, tag=tag))
        return _Timed(works, stat, until=free, keep=(stamp, wire))

    def irecv(self, tensor: torch.Tensor, peer: int | None, tag: int = 0):
        """Receive from ``peer`` (None: from any rank of the group). Messages with the same
        (peer, tag) match in posting order."""
        if tensor.numel() == 0:
            return _Done()
        nbytes = tensor.numel() * tensor.element_size()
        self.bytes_received += nbytes
        staged = self._staged(tensor)
        wire = torch.empty(tensor.shape, dtype=tensor.dtype) if staged else tensor
        unstage = (tensor, wire) if staged else None
        if peer is None:  # from any source: the link is unknown until the message arrives
            if self.topology.emulated:
                raise ValueError("a receive from any source (src=None) cannot be emulated on a topology with "
                                 "slowed links: name the sender (src= or group_src=)")
            work = dist.irecv(wire, group=self.pg, tag=tag)
            return work if not staged else _AnySource(work, unstage)
        stat, cls, link = self._link(peer)
        stat.bytes_received += nbytes
        if link is None:
            return _Timed((dist.irecv(wire, group=self.pg, group_src=peer, tag=tag),), stat, unstage=unstage)
        stamp = torch.empty(1, dtype=torch.float64, device=wire.device)
        works = (dist.irecv(stamp, group=self.pg, group_src=peer, tag=tag + emulation.STAMP_TAG),
                 dist.irecv(wire, group=self.pg, group_src=peer, tag=tag))
        return _Timed(works, stat, stamp=stamp, unstage=unstage)

    def send(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        self.isend(tensor, peer, tag).wait()

    def recv(self, tensor: torch.Tensor, peer: int, tag: int = 0) -> None:
        self.irecv(tensor, peer, tag).wait()

    def sendrecv(self, send: torch.Tensor, dst: int, recv: torch.Tensor, src: int) -> None:
        """Send to ``dst`` and receive from ``src`` at the same time (both posted, then waited)."""
        r = self.irecv(recv, src)
        s = self.isend(send, dst)
        r.wait()
        s.wait()


def block_bounds(numel: int, parts: int) -> list[int]:
    """Split ``numel`` elements into ``parts`` contiguous blocks as evenly as possible.

    Block ``i`` is ``[bounds[i], bounds[i+1])``; sizes differ by at most one, and blocks are empty
    when ``numel < parts``. Every rank computes the same bounds, so sizes never need sending.
    """
    return [i * numel // parts for i in range(parts + 1)]


class Fold:
    """Fold a group of any size ``p`` onto the largest power of two ``pp <= p``, and back.

    Algorithms that pair ranks by flipping one bit (recursive doubling and halving) need a power
    of two. The standard fix (Thakur et al. 2005): ``rem = p - pp`` pairs of ranks ``(2i, 2i+1)``
    for ``i < rem`` merge first ("fold in": the even rank hands its data to the odd one and sits
    out), the ``pp`` survivors run the algorithm with new ranks ``0..pp-1``, and the odd ranks hand
    the result back ("fold out")::

        p = 6, pp = 4, rem = 2        rank:      0   1   2   3   4   5
                                       fold in:  0-->1   2-->3
                                       new rank:     0       1   2   3

    It costs two extra messages of the whole buffer on the folded pairs.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self.pp = 1 << (size.bit_length() - 1)
        self.rem = size - self.pp

    def new_rank(self, rank: int) -> int | None:
        """The survivor number of ``rank``, or None if it sits out (an even rank < 2 rem)."""
        if rank < 2 * self.rem:
            return rank // 2 if rank % 2 else None
        return rank - self.rem

    def old_rank(self, new_rank: int) -> int:
        return 2 * new_rank + 1 if new_rank < self.rem else new_rank + self.rem

    def first_block(self, new_rank: int) -> int:
        """The first of the original ranks a survivor stands for (they are contiguous)."""
        return 2 * new_rank if new_rank < self.rem else new_rank + self.rem


# Gloo's ring cuts each rank's block into segments of at most 1 MiB, and at least two, so that
# sending one overlaps reducing another. Over loopback TCP every extra message is one more
# rendezvous, whose latency (the exchange curve's flat part up to the socket buffer, see
# comm.cost) can cost more than the overlap saves, so the ring algorithms here send each block as
# ONE message up to SEGMENT_BYTES and cut only larger blocks into segments of at most SEGMENT_BYTES
# (1 MiB all-reduce on 2 ranks: one 512 KiB message per phase; 64 MiB: 16 segments of 2 MiB).
# Larger segments need more buffer, and so more cache. The sizes were chosen by timing
# all-reduces on a 2-vCPU machine (docs/benchmarks/2026-11-27-figures-from-the-code-2vcpu.md). Module variables: change them to
# experiment (MIN_SEGMENTS=2, PIPELINE_BYTES=256K and SEGMENT_BYTES=1M is gloo's policy).
SEGMENT_BYTES = 2 << 20
MIN_SEGMENTS = 1
PIPELINE_BYTES = 256 << 10


def segment_count(blocks: list[torch.Tensor]) -> int:
    """Pipeline segments per block: enough that none exceeds ``SEGMENT_BYTES``, and at least
    ``MIN_SEGMENTS`` for blocks of ``PIPELINE_BYTES`` or more.

    Every block of a ring is cut into the same number of segments (the largest block decides), so
    both neighbours agree on every message's size and segment j of any block fits in the same
    preallocated receive row.
    """
    biggest = max(b.numel() for b in blocks)
    nbytes = biggest * blocks[0].element_size()
    return max(1, -(-nbytes // SEGMENT_BYTES), MIN_SEGMENTS if nbytes >= PIPELINE_BYTES else 1)


def segment(block: torch.Tensor, nseg: int, j: int) -> torch.Tensor:
    """Segment ``j`` of ``nseg`` of a 1-D ``block`` (sizes differ by at most one element)."""
    n = block.numel()
    return block[j * n // nseg:(j + 1) * n // nseg]


_scratch = threading.local()


def scratch(numel: int, dtype: torch.dtype, slot: str = "recv", *, device: torch.device | None = None) -> torch.Tensor:
    """A 1-D work buffer of ``numel`` elements of ``dtype``, reused from call to call.

    A fresh multi-MiB buffer per call costs page faults: the allocator hands big blocks back to
    the system, so every call would map and zero new pages (on this VM a 32 MiB reduce spent 3/4
    of its time there, and gloo's own all_gather still does). So each thread keeps one buffer
    per ``(slot, dtype)``, grown when a bigger one is asked for, and kept for the life of the
    thread (at most the largest message it ever handled, per slot). Its contents are garbage.
    It stays valid until the next ``scratch`` call with the same slot on this thread, so an
    algorithm takes each slot once per call and must not hold on to it afterwards.

    Slots in use: ``"recv"`` (incoming data about to be reduced), ``"stage"`` (a whole gathered
    or scattered vector laid out in one piece), ``"input"`` (a private copy of the caller's input),
    ``"hier"`` (the hierarchical algorithms' blocks laid out by node and local index).
    ``device``: where the buffer lives, the device of the tensors it works with (default CPU).
    """
    device = torch.device(device or "cpu")
    buffers = getattr(_scratch, "buffers", None)
    if buffers is None:
        buffers = _scratch.buffers = {}
    buf = buffers.get((slot, dtype, device))
    if buf is None or buf.numel() < numel:
        buf = buffers[(slot, dtype, device)] = torch.empty(numel, dtype=dtype, device=device)
    return buf[:numel]
