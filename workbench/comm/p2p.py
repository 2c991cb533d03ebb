"""Point-to-point messages: ``send``, ``recv``, ``isend``, ``irecv``, counted like every collective.

The same signatures as ``torch.distributed``::

    comm.send(t, dst=1)                         # blocks until t may be reused
    sender = comm.recv(t, src=0)                # blocks until t holds the message; returns src
    h = comm.isend(t, dst=1); ...; h.wait()     # returns a handle (wait before touching t)
    h = comm.irecv(t, src=0); ...; h.wait()
    comm.send(t, group=g, group_dst=1)          # group_dst / group_src: rank inside ``group``

``dst``/``src`` are global ranks and ``group_dst``/``group_src`` ranks in ``group``, exactly as in
torch; ``recv``/``irecv`` without a source take a message from any rank (``recv`` returns the
sender's global rank). Messages between the same pair of ranks with the same ``tag`` are matched
in posting order, which is what lets a pipeline post its receives ahead of time.

Cost in the alpha-beta model: ``alpha + n beta`` per message of ``n`` bytes. A blocking ``send``
may return before the receiver has the data (gloo buffers the message), but a ``send`` and a
``recv`` that wait on each other from both ends of a link deadlock if each rank first blocks on
its send to the other and neither has posted the receive: post receives with ``irecv`` first, or
order the pair (lower rank sends first) -- the pipeline interpreter does the former.

Counting (see :mod:`workbench.comm.counters`): each call is one ``calls`` of its own name
(``("send", "native")``, ``("isend", "native")``, ...) with the message's bytes in
``bytes_sent`` (sends) or ``bytes_received`` (receives). A blocking call is recorded when it
returns, an ``isend``/``irecv`` when its handle is first waited on (so wait on your handles).
Empty tensors are not sent at all (both ends know the size), as in the collectives.

A point-to-point message is posted at once from the caller's thread, never queued on the
communication thread that runs asynchronous collectives (:mod:`workbench.comm.work`): a
pipeline posts a receive from one neighbour and a send to the other and waits on them in any
order, and torch matches messages by (peer, tag), not by issue order, so nothing needs the
queue's ordering, and queueing a blocking send behind a receive could deadlock.

Non-contiguous tensors work: a send copies into a contiguous buffer, a receive receives into one
and copies back into the caller's tensor when the message has arrived. A rank that is not in
``group`` does nothing and gets None, with torch's warning.
"""
from __future__ import annotations

import threading
import time
import warnings
from typing import Callable

import torch
import torch.distributed as dist

from workbench.comm import checks
from workbench.comm.counters import active as active_counters, record
from workbench.comm.dispatch import flat_buffer, nbytes
from workbench.comm.group import Comm, GroupView, resolve_group
from workbench.comm.work import Work

__all__ = ["send", "recv", "isend", "irecv"]


def _peer(function: str, tensor, group, rank, group_rank, name: str,
          any_source: bool) -> tuple[GroupView | None, int | None]:
    """Check the arguments; return this rank's group view and the peer's rank in the group.

    The peer is None for a receive from any source. The view is None (with torch's warning) if
    this rank is not in ``group``.
    """
    checks.check_tensor(tensor, "tensor")
    view = resolve_group(group)
    if view is None:
        warnings.warn(f"Running {function} on global rank {dist.get_rank()} which does not belong "
                      "to the given group.", stacklevel=3)
        return None, None
    if any_source and rank is None and group_rank is None:
        return view, None
    peer = checks.check_root(view, rank, group_rank, name, default_to_zero=False)
    if peer == view.rank:
        raise ValueError(f"{function}: {name}={view.global_rank(peer)} (group_{name}={peer}) is this "
                         f"rank itself: a rank cannot {'send to' if name == 'dst' else 'receive from'} "
                         "itself; pick another rank of the group")
    return view, peer


def _check_tag(function: str, tag) -> None:
    if isinstance(tag, bool) or not isinstance(tag, int) or tag < 0:
        raise ValueError(f"{function}: tag={tag!r} must be a whole number >= 0 (messages with the same "
                         "tag between the same two ranks match in posting order)")


def isend(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
          group_dst: int | None = None):
    """Like ``torch.distributed.isend``: start sending ``tensor``; returns a handle to ``wait()``."""
    _check_tag("isend", tag)
    view, peer = _peer("isend", tensor, group, dst, group_dst, "dst", any_source=False)
    if view is None:
        return None
    return _isend(view, tensor, peer, tag, "isend", async_op=True)


def send(tensor: torch.Tensor, dst: int | None = None, group=None, tag: int = 0,
         group_dst: int | None = None) -> None:
    """Like ``torch.distributed.send``: send ``tensor`` and return when it may be reused."""
    _check_tag("send", tag)
    view, peer = _peer("send", tensor, group, dst, group_dst, "dst", any_source=False)
    if view is None:
        return None
    _isend(view, tensor, peer, tag, "send", async_op=False)
    return None


def irecv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
          group_src: int | None = None):
    """Like ``torch.distributed.irecv``: start receiving into ``tensor``; returns a handle.

    Without ``src``/``group_src`` the message may come from any rank of the group."""
    _check_tag("irecv", tag)
    view, peer = _peer("irecv", tensor, group, src, group_src, "src", any_source=True)
    if view is None:
        return None
    return _irecv(view, tensor, peer, tag, "irecv", async_op=True)[0]


def recv(tensor: torch.Tensor, src: int | None = None, group=None, tag: int = 0,
         group_src: int | None = None) -> int:
    """Like ``torch.distributed.recv``: receive into ``tensor``; returns the sender's global rank.

    Without ``src``/``group_src`` the message may come from any rank of the group (returns -1 on
    a rank that is not in ``group``, as torch does)."""
    _check_tag("recv", tag)
    view, peer = _peer("recv", tensor, group, src, group_src, "src", any_source=True)
    if view is None:
        return -1
    return _irecv(view, tensor, peer, tag, "recv", async_op=False)[1]


class P2PWork(Work):
    """The handle of a posted message (the point-to-point layer's own), shaped like :class:`Work`.

    ``finish`` runs once, after the first successful ``wait()`` (copy-back into a non-contiguous
    tensor, the counters). ``started`` is when the message was posted, ``ended`` when it was
    first seen done.
    """

    def __init__(self, handle, finish: Callable[[], None]) -> None:
        super().__init__()
        self._handle = handle
        self._finish_fn = finish
        self._lock = threading.Lock()
        self.started = self.issued

    def is_completed(self) -> bool:
        return self._done.is_set() or self._handle.is_completed()

    def wait(self, timeout: float | None = None) -> bool:
        with self._lock:
            if not self._done.is_set():
                try:
                    self._handle.wait()
                    self._finish_fn()
                except BaseException as error:  # noqa: BLE001 -- re-raised below and on every later wait
                    self._finish(error)
                else:
                    self.ended = time.perf_counter()
                    self._finish()
        return super().wait(timeout)


def _post(name: str, start: Callable[[], object], sent: int, received: int, async_op: bool,
          finish: Callable[[], None] | None = None):
    """Post one message (``start()`` returns the point-to-point layer's handle); count it when done."""
    sinks = active_counters()
    t0 = time.perf_counter()

    def done() -> None:
        if finish is not None:
            finish()
        record(sinks, name, "native", sent, received, time.perf_counter() - t0)

    handle = P2PWork(start(), done)
    if async_op:
        return handle
    handle.wait()
    return None


def _isend(view: GroupView, tensor: torch.Tensor, peer: int, tag: int, name: str, async_op: bool):
    """Send through the counted point-to-point layer (:class:`~workbench.comm.group.Comm`)."""
    buf, _ = flat_buffer(tensor)  # a copy for a non-contiguous tensor; sending never writes back
    c = Comm(view)
    return _post(name, lambda: c.isend(buf, peer, tag), sent=nbytes(tensor), received=0, async_op=async_op)


def _irecv(view: GroupView, tensor: torch.Tensor, peer: int | None, tag: int, name: str, async_op: bool):
    """Post the receive; return (handle or None, the sender's global rank or -1 if not known)."""
    buf, write_back = flat_buffer(tensor)
    c = Comm(view)
    source = [view.global_rank(peer) if peer is not None else -1]

    posted = []

    def finish() -> None:
        write_back()
        if peer is None and hasattr(posted[0], "_source_rank"):  # torch's any-source receive
            source[0] = view.global_rank(posted[0]._source_rank())

    def start():
        posted.append(c.irecv(buf, peer, tag))
        return posted[0]

    handle = _post(name, start, sent=0, received=nbytes(tensor), async_op=async_op, finish=finish)
    return handle, source[0]
