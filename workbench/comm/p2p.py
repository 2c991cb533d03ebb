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

Non-contiguous tensors work: a send copies into a contiguous buffer, a receive receives into one
and copies back into the caller's tensor when the message has arrived. A rank that is not in
``group`` does nothing and gets None, with torch's warning.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from workbench.comm import checks
from workbench.comm.dispatch import flat_buffer, nbytes, run_native
from workbench.comm.group import Comm, GroupView, resolve_group

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


def _isend(view: GroupView, tensor: torch.Tensor, peer: int, tag: int, name: str, async_op: bool):
    """Send through the counted point-to-point layer (:class:`~workbench.comm.group.Comm`)."""
    buf, _ = flat_buffer(tensor)  # a copy for a non-contiguous tensor; sending never writes back
    c = Comm(view)

    def start(a: bool):
        work = c.isend(buf, peer, tag)
        if a:
            return work
        work.wait()
        return None

    return run_native(name, start, sent=nbytes(tensor), received=0, async_op=async_op)


def _irecv(view: GroupView, tensor: torch.Tensor, peer: int | None, tag: int, name: str, async_op: bool):
    """Post the receive; return (handle or None, the sender's global rank or -1 if not known)."""
    buf, write_back = flat_buffer(tensor)
    c = Comm(view)
    source = [view.global_rank(peer) if peer is not None else -1]

    def start(a: bool):
        work = c.irecv(buf, peer, tag)
        if a:
            return work
        work.wait()
        if peer is None and hasattr(work, "_source_rank"):  # torch's any-source receive
            source[0] = view.global_rank(work._source_rank())
        return None

    handle = run_native(name, start, sent=0, received=nbytes(tensor), async_op=async_op,
                        finish=write_back)
    return handle, source[0]
