"""Holding messages back so that one machine behaves like the cluster a :class:`Topology` describes.

Every hand-written collective (and every point-to-point ``send``/``recv`` of ``workbench.comm``)
moves its bytes through :class:`workbench.comm.group.Comm`, so this is done there, once, for
every algorithm. A message of ``m`` bytes from rank ``a`` to rank ``b`` on an emulated link
(``topology.link(class)``, the class being ``"intra"`` or ``"inter"``) is scheduled like a NIC
would send it::

    start = max(now, when a's outgoing link of that class is free)   bytes leave one after another
    free  = start + m / bandwidth                                     the link is busy until then
    due   = start + latency + m / bandwidth                           the message has arrived

The data itself goes at once, at this machine's speed, together with an 8-byte *stamp* (the
``due`` time, on a tag of its own); the receiver's ``wait()`` returns when both have arrived and
the clock has reached ``due``; the sender's ``wait()`` when its data is out and the clock has
reached ``free``. So a message takes ``latency + m / bandwidth``, its real time hidden beneath,
as long as the real time is shorter: emulation can only slow messages down. :func:`emulate`
therefore measures this machine's floor first (a ping-pong between ranks 0 and 1: the fastest
8-byte message and the fastest 1 MiB one) and refuses a link faster than it.

What is and is not modelled: latency overlaps with the transfer of the next message (a NIC
pipelines), a rank's messages of one class share one outgoing link (the ring's segments queue
behind each other), a link carries as much each way (full duplex). Not modelled: several ranks
contending for one NIC or switch, a receiver's incoming link (incast), congestion. Waiting is
sleeping, so the emulated time barely depends on the load of the machine, but a rank that is
descheduled when its message is due wakes up late (see "Late wake-ups" below), and reductions and
copies run at the machine's (loaded) speed: keep emulated messages well above a millisecond.
The bytes themselves still cross loopback, read and written by gloo's network thread; while a
thread waits for them that thread runs in the normal scheduling class, not its usual idle one
(``workbench.runtime.gloo_threads.promoted``), so they move while the rank computes, as a NIC's would. The stamps are not counted as traffic. The
ranks must share one clock (one machine; ``time.monotonic`` is system-wide on Linux), which is
also the only setting in which emulating a cluster makes sense.

Late wake-ups: on a loaded machine a sleeping rank wakes up late (a few milliseconds with three
times more runnable threads than cores), and an algorithm made of dependent phases (the
hierarchical ones) would add that lateness phase after phase, where the emulated cluster has none.
So each thread remembers how late its last hold-back woke up and dates the messages it sends
next that much earlier (``start`` above uses ``now - late``): the message it sends right after
waking is stamped as if it had woken on time, and time spent computing since then still counts.
The lateness is replaced at every wake-up, never accumulated, so it shifts a rank's clock by at
most one wake-up, and a message still cannot be received before its bytes really arrive.

``torch.distributed``'s own collectives (``algorithm="native"``) send their messages inside
gloo or NCCL, where nothing can hold them back. So on a group that crosses a slowed link,
``algorithm="native"`` is **not** torch's: it runs the hand-written algorithm gloo itself uses
(``comm.cost.NATIVE_AS``: ring all-reduce, all-gather and reduce-scatter, binomial broadcast and
reduce, flat scatter and gather), whose messages are held back, and says so once per collective
with a warning; counters record it under that algorithm's name. The results are the same (the
hand-written algorithms are checked against torch's), the speed is ours on the emulated links,
and DDP, ZeRO and FSDP, which call ``native`` by default, run on the emulated cluster unchanged.
A group that stays on links that are not emulated (inside a node with ``intra=None``) still runs
torch's own. Counters split the traffic of the hand-written algorithms by link class
(``"intra"``, ``"inter"``), whether or not it is slowed.
"""
from __future__ import annotations

import math
import os
import threading
import time
import warnings
import weakref

import torch
import torch.distributed as dist

from workbench import runtime
from workbench.comm.cost import NATIVE_AS
from workbench.comm.topology import ENV, Link, Topology

__all__ = ["emulate", "clear", "current", "layout", "node_groups", "floor", "measure_floor", "native_stand_in",
           "lateness", "STAMP_TAG"]

# Stamps travel on tag + STAMP_TAG, so they never match a data message (algorithms use small tags).
STAMP_TAG = 1 << 20


class _State:
    def __init__(self, topology: Topology | None = None, floor: Link | None = None) -> None:
        self.topology = topology
        self.floor = floor
        self.free: dict[str, float] = {}  # link class -> when this rank's outgoing link is free
        self.late: dict[int, float] = {}  # thread id -> how late its last hold-back woke up
        self.lock = threading.Lock()
        self.pid = os.getpid()


_state = _State()


def _get() -> _State:
    global _state
    if _state.pid != os.getpid():  # a forked child starts with nothing emulated
        _state = _State()
    return _state


def current() -> Topology | None:
    """The topology set by :func:`emulate` (or ``launch(..., topology=)``) in this process, or None."""
    return _get().topology


def floor() -> Link | None:
    """The floor measured when the current topology was set (None if nothing is emulated)."""
    return _get().floor


def layout() -> Topology:
    """The current topology, or the real layout if none is set: one node per machine
    (``LOCAL_WORLD_SIZE`` ranks each, as torchrun sets it; the whole world otherwise), no link slowed."""
    topo = current()
    if topo is not None:
        return topo
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world) or world)
    return Topology(max(1, min(local, world)))


def node_groups(topology: Topology | None = None):
    """``(node_group, column_group)`` of this rank, made with ``torch.distributed.new_group``:
    the ranks of its node, and the ranks with its local index on every node (the groups hybrid
    sharding uses: shard inside a node, replicate across nodes). Call on every rank (each
    ``new_group`` is collective). ``topology``: default the emulated one (or the real layout)."""
    topo = topology or layout()
    world, me = dist.get_world_size(), dist.get_rank()
    topo.check_world(world)
    rpn, nodes = topo.ranks_per_node, world // topo.ranks_per_node
    mine_row = mine_col = None
    for k in range(nodes):  # every rank creates every group, in the same order
        g = dist.new_group(list(range(k * rpn, (k + 1) * rpn)))
        if topo.node_of(me) == k:
            mine_row = g
    for i in range(rpn):
        g = dist.new_group([k * rpn + i for k in range(nodes)])
        if topo.local_index(me) == i:
            mine_col = g
    return mine_row, mine_col


def clear() -> None:
    """Stop emulating: messages go at this machine's speed again (not collective)."""
    global _state
    _state = _State()


def emulate(topology: Topology | str | None) -> Link | None:
    """Emulate ``topology`` from now on, in this process; call on every rank of the world.

    Checks that the world fills whole nodes, measures this machine's floor (when a link is
    emulated) and refuses, on every rank alike, a link faster than it. Returns the floor.
    ``None`` stops emulating.
    """
    if topology is None:
        clear()
        return None
    if isinstance(topology, str):
        topology = Topology.parse(topology)
    if not isinstance(topology, Topology):
        raise TypeError(f"topology={topology!r}: pass a workbench.comm.Topology, a spec string "
                        f"(see {ENV}) or None")
    if not dist.is_initialized():
        raise RuntimeError("workbench.comm.emulate needs an initialised process group: run inside "
                           "workbench.launch(fn, world_size, topology=...) or under torchrun")
    topology.check_world(dist.get_world_size())
    measured = None
    if topology.emulated and dist.get_world_size() > 1:
        measured = measure_floor()
        # A busy machine measures slower than it can go (a rank waits for a core): before refusing
        # a link, measure again, longer, keeping the best of all (every rank gets rank 0's numbers,
        # so every rank takes the same branch).
        for _ in range(FLOOR_RETRIES):
            if _faster_than(topology, measured) is None:
                break
            again = measure_floor(repeats=50)
            measured = Link(min(measured.latency_s, again.latency_s), max(measured.bandwidth_Bps, again.bandwidth_Bps))
        cls = _faster_than(topology, measured)
        if cls is not None:
            link = topology.link(cls)
            raise ValueError(
                f"topology {cls}={link} is faster than this machine's own messages (measured just now "
                f"between ranks 0 and 1, best of {1 + FLOOR_RETRIES} measurements: {measured.latency_s * 1e6:.0f} us "
                f"per message, {measured.bandwidth_Bps / 1e6:.0f} MB/s; a machine busy with other work measures "
                f"slower): emulation can only slow messages down. "
                f"Give the {cls}-node link latency_s >= {measured.latency_s:.2g} and bandwidth_Bps <= "
                f"{measured.bandwidth_Bps:.2g}, or use Topology.preset(name, slowdown=...) with a "
                "larger slowdown")
    global _state
    _state = _State(topology, measured)
    return measured


FLOOR_RETRIES = 3  # further, longer measurements of the floor before a link is refused as too fast


def _faster_than(topology: Topology, floor: Link) -> str | None:
    """The first link class of ``topology`` faster than ``floor`` (lower latency or higher
    bandwidth), or None."""
    for cls in ("intra", "inter"):
        link = topology.link(cls)
        if link is not None and (link.latency_s < floor.latency_s or link.bandwidth_Bps > floor.bandwidth_Bps):
            return cls
    return None


def measure_floor(small: int = 8, large: int = 1 << 20, repeats: int = 20) -> Link:
    """This machine's fastest message, as a Link: a ping-pong of ``small`` and ``large`` bytes
    between ranks 0 and 1 (``repeats`` round trips each), the fastest round trip halved. Call on
    every rank; every rank gets rank 0's numbers. The minimum, not the median, because a floor is
    what the machine can do at best (a loaded machine's medians are slower, its minimum barely)."""
    rank, device = dist.get_rank(), runtime.device()

    def one_way(nbytes: int) -> float:
        x = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        best = math.inf
        for i in range(repeats + 1):  # the first round trip warms the connection and is dropped
            start = time.perf_counter()
            if rank == 0:
                dist.send(x, 1)
                dist.recv(x, 1)
            else:
                dist.recv(x, 0)
                dist.send(x, 0)
            if i:
                best = min(best, (time.perf_counter() - start) / 2)
        return best

    times = torch.zeros(2, dtype=torch.float64)
    if rank in (0, 1):
        times[0], times[1] = one_way(small), one_way(large)
    times = times.to(device)
    dist.broadcast(times, 0)
    t_small, t_large = times.tolist()
    return Link(t_small, (large - small) / max(t_large - t_small, 1e-12))


_warned: set = set()


def native_stand_in(collective: str, global_ranks: list[int]) -> str | None:
    """The hand-written algorithm that stands in for ``algorithm="native"`` on a group that spans a
    slowed link (see the module docstring), or None where torch's own may run."""
    topo = current()
    if topo is None or not topo.emulated:
        return None
    per_node: dict[int, int] = {}
    for g in global_ranks:
        per_node[topo.node_of(g)] = per_node.get(topo.node_of(g), 0) + 1
    classes = ({"inter"} if len(per_node) > 1 else set()) | ({"intra"} if max(per_node.values()) > 1 else set())
    if not any(topo.link(c) is not None for c in classes):
        return None
    stand_in = NATIVE_AS[collective]
    if (os.getpid(), collective) not in _warned:
        _warned.add((os.getpid(), collective))
        warnings.warn(f"{collective}: algorithm='native' runs inside torch.distributed, whose messages cannot be held "
                      f"back, and this group crosses links the topology slows down ({topo}); running "
                      f"algorithm={stand_in!r} (the one gloo uses) instead, so that they apply. Pass a hand-written "
                      "algorithm to choose another", stacklevel=4)
    return stand_in


# ------------------------------------------------------------------------ per-message hold-back

_group_ranks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def global_ranks(pg) -> list[int]:
    """Global rank of each rank of process group ``pg`` (cached)."""
    ranks = _group_ranks.get(pg)
    if ranks is None:
        ranks = _group_ranks[pg] = list(dist.get_process_group_ranks(pg))
    return ranks


def schedule(link_class: str, link: Link, nbytes: int) -> tuple[float, float]:
    """Book ``nbytes`` on this rank's outgoing ``link_class`` link: ``(due, free)`` on
    ``time.monotonic``'s clock (see the module docstring)."""
    state = _get()
    with state.lock:
        now = time.monotonic() - state.late.get(threading.get_ident(), 0.0)
        start = max(now, state.free.get(link_class, 0.0))
        free = start + nbytes / link.bandwidth_Bps
        state.free[link_class] = free
    return free + link.latency_s, free


def lateness() -> float:
    """How late this thread's last hold-back woke up (seconds): its next messages are dated that
    much earlier (see "Late wake-ups" in the module docstring)."""
    return _get().late.get(threading.get_ident(), 0.0)


def _sleep_until(t: float) -> None:
    """Sleep until ``t`` (monotonic clock); remember how late this thread woke up (see "Late
    wake-ups" in the module docstring)."""
    remaining = t - time.monotonic()
    if remaining > 0:
        time.sleep(remaining)
        state = _get()
        state.late[threading.get_ident()] = max(0.0, time.monotonic() - t)
