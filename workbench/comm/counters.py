"""Count what the collectives move: ``with workbench.comm.counters() as c: ...``.

Every call of a :mod:`workbench.comm` collective made while a counter is open is recorded, per
``(collective, algorithm)`` key, in a :class:`Stat`::

    with workbench.comm.counters() as c:
        comm.all_reduce(t, algorithm="ring")
    s = c.stats[("all_reduce", "ring")]
    s.calls, s.bytes_sent, s.bytes_received, s.seconds
    c.total_bytes_sent, c.total_bytes_received, c.total_calls, c.total_seconds
    print(c.table())                 # one readable line per (collective, algorithm)
    c.as_dict()                      # {"all_reduce/ring": {"calls": 1, ...}} (picklable, JSON-able)

What is counted
---------------
* ``bytes_sent`` / ``bytes_received``: bytes this rank put on / took off the wire.
  For the hand-written algorithms these are the real point-to-point messages (every ``isend``
  and ``irecv`` the algorithm posts; empty messages are skipped and count 0).
  For ``algorithm="native"`` we cannot see inside gloo/NCCL, so we count what the bandwidth-optimal
  algorithm would move per rank (n = bytes of the full buffer, p = group size):
  all-reduce ring ``2 (p-1)/p n`` each way; all-gather and reduce-scatter ring ``(p-1)/p n`` each
  way (n = the gathered / the un-scattered size); broadcast and scatter flat tree: the root sends
  ``(p-1)`` copies of what each other rank receives; reduce and gather flat tree: the mirror image.
* ``seconds``: wall time of the collective on this rank. For a synchronous call, the call; for an
  ``async_op=True`` hand-written call, the time the communication thread spent running it; for an
  ``async_op=True`` native call, from issue until the first ``wait()`` returned (so a native
  async call is recorded when it is waited on: wait on your handles).
* ``links``: the hand-written algorithms' traffic split by link class, ``"intra"`` (between
  ranks of one node) and ``"inter"`` (between nodes), per the emulated topology or, without one,
  the real layout (:func:`workbench.comm.emulation.layout`): a :class:`LinkStat` each, with the
  messages sent, the bytes sent and received, and ``seconds``, the time this rank spent waiting
  for that class's messages (receives and sends; under an emulated topology that includes the
  hold-back). ``c.by_link()`` adds them up over every collective. Native calls are not split
  (gloo's messages are not seen).
* ``calls``: one per public collective call. An algorithm built from other collectives (all-reduce
  ``reduce_broadcast``) is one call of the outer collective: its inner messages are counted there
  and nowhere else.

Counters are per process (each rank counts its own traffic; gather them yourself to compare ranks)
and nest: a call made inside two open counters is recorded once in each, never twice in one.
Counters opened in another process (a parent before fork) are not inherited.
"""
from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

__all__ = ["counters", "Counters", "Stat", "LinkStat"]


@dataclass
class LinkStat:
    """One link class's share of the traffic (see ``links`` in the module docstring)."""

    messages: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0

    def add(self, other: "LinkStat") -> None:
        self.messages += other.messages
        self.bytes_sent += other.bytes_sent
        self.bytes_received += other.bytes_received
        self.seconds += other.seconds

    def as_dict(self) -> dict:
        return {"messages": self.messages, "bytes_sent": self.bytes_sent,
                "bytes_received": self.bytes_received, "seconds": self.seconds}


@dataclass
class Stat:
    """Totals for one ``(collective, algorithm)`` on this rank; ``links`` by link class."""

    calls: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    links: dict[str, LinkStat] = field(default_factory=dict)

    def as_dict(self) -> dict:
        out = {"calls": self.calls, "bytes_sent": self.bytes_sent,
               "bytes_received": self.bytes_received, "seconds": self.seconds}
        if self.links:
            out["links"] = {k: v.as_dict() for k, v in sorted(self.links.items())}
        return out


@dataclass(eq=False)  # compared by identity: each open counter is its own sink
class Counters:
    """What the collectives did while this counter was open (see the module docstring)."""

    stats: dict[tuple[str, str], Stat] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _add(self, collective: str, algorithm: str, sent: int, received: int, seconds: float,
             links: dict[str, LinkStat] | None = None) -> None:
        with self._lock:
            stat = self.stats.setdefault((collective, algorithm), Stat())
            stat.calls += 1
            stat.bytes_sent += int(sent)
            stat.bytes_received += int(received)
            stat.seconds += float(seconds)
            for cls, link in (links or {}).items():
                stat.links.setdefault(cls, LinkStat()).add(link)

    def by_link(self) -> dict[str, LinkStat]:
        """The hand-written algorithms' traffic by link class, added up over every collective."""
        out: dict[str, LinkStat] = {}
        for s in self.stats.values():
            for cls, link in s.links.items():
                out.setdefault(cls, LinkStat()).add(link)
        return dict(sorted(out.items()))

    @property
    def total_calls(self) -> int:
        return sum(s.calls for s in self.stats.values())

    @property
    def total_bytes_sent(self) -> int:
        return sum(s.bytes_sent for s in self.stats.values())

    @property
    def total_bytes_received(self) -> int:
        return sum(s.bytes_received for s in self.stats.values())

    @property
    def total_seconds(self) -> float:
        return sum(s.seconds for s in self.stats.values())

    def as_dict(self) -> dict[str, dict]:
        """``{"collective/algorithm": {"calls", "bytes_sent", "bytes_received", "seconds"}}``."""
        return {f"{c}/{a}": s.as_dict() for (c, a), s in sorted(self.stats.items())}

    def table(self) -> str:
        """A fixed-width table, one row per (collective, algorithm), plus a total row."""
        head = f"{'collective':<16}{'algorithm':<20}{'calls':>7}{'sent':>12}{'received':>12}{'time':>11}"
        rows = [head, "-" * len(head)]
        for (c, a), s in sorted(self.stats.items()):
            rows.append(f"{c:<16}{a:<20}{s.calls:>7}{_human(s.bytes_sent):>12}"
                        f"{_human(s.bytes_received):>12}{s.seconds * 1e3:>9.2f}ms")
        rows.append(f"{'total':<36}{self.total_calls:>7}{_human(self.total_bytes_sent):>12}"
                    f"{_human(self.total_bytes_received):>12}{self.total_seconds * 1e3:>9.2f}ms")
        links = self.by_link()
        if links:
            rows.append(f"{'by link class':<36}{'msgs':>7}{'sent':>12}{'received':>12}{'waited':>11}")
            for cls, s in links.items():
                rows.append(f"  {cls:<34}{s.messages:>7}{_human(s.bytes_sent):>12}"
                            f"{_human(s.bytes_received):>12}{s.seconds * 1e3:>9.2f}ms")
        return "\n".join(rows)

    def __enter__(self) -> "Counters":
        _open().append(self)
        return self

    def __exit__(self, *exc) -> None:
        stack = _open()
        if self in stack:
            stack.remove(self)

    def __str__(self) -> str:
        return self.table()


def counters() -> Counters:
    """Open a counter: ``with workbench.comm.counters() as c: ...`` (see the module docstring)."""
    return Counters()


def _human(n: int) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return str(n)


# The counters open in this process. Keyed by pid: a forked child starts with none open.
_stack: list[Counters] = []
_stack_pid: int = os.getpid()


def _open() -> list[Counters]:
    global _stack, _stack_pid
    if _stack_pid != os.getpid():
        _stack, _stack_pid = [], os.getpid()
    return _stack


def active() -> tuple[Counters, ...]:
    """The counters open right now (captured when a collective is issued)."""
    return tuple(_open())


def record(sinks: tuple[Counters, ...], collective: str, algorithm: str,
           sent: int, received: int, seconds: float, links: dict[str, LinkStat] | None = None) -> None:
    """Add one call to each counter that was open when it was issued (each exactly once)."""
    for sink in dict.fromkeys(sinks):
        sink._add(collective, algorithm, sent, received, seconds, links)
