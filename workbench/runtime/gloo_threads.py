"""Stop gloo's network thread from stalling every message on a machine with few cores.

The stall
---------
Each gloo process group has one network thread, ``gloo_tcp_loop``, that waits in ``epoll`` for
its sockets and then, for every ready socket, *tries* to take that connection's lock
(``Pair::handleEvents`` uses ``try_lock`` so that it can never deadlock with a sending thread).
If the lock is taken, it gives up and calls ``epoll_wait`` again, which returns at once, since
the socket is still ready: it spins until the lock is free. The lock is held by the thread that
sends, which writes the message into the socket itself: the rank's main thread for
``isend``/``irecv`` (every hand-written collective), a ``pt_gloo_runloop`` worker for
torch's own collectives.

With more runnable threads than cores, the normal case where ranks share a few cores (each
rank runs a main thread, a network thread and a gloo worker), the scheduler sometimes takes the core away from the
sender while it holds the lock and gives it to the spinning network threads. Nothing progresses
until their time slice ends, a few milliseconds. ``perf sched timehist`` shows both ranks'
``gloo_tcp_loop`` running a whole time slice while both main threads wait, and ``perf record``
shows that time spent in ``epoll_wait``. The stalls and what demoting the thread changes, on one
2-vCPU machine: ``docs/benchmarks/2026-11-23-collectives-and-placement-2vcpu.md``.

The fix
-------
:func:`demote_loop_threads` puts every ``gloo_tcp_loop`` thread of this process in the
``SCHED_IDLE`` class: it still runs whenever a core is free (and a rank blocked on a message
leaves its core free), but a thread of normal priority that wakes up takes the core from it at
once, so a spinning network thread can no longer keep the lock holder off the core. Lowering a
thread's own priority needs no privilege. :func:`workbench.launch` applies it in every rank after
the process group is made, and ``workbench.comm`` applies it again the first time it meets a group
made by ``torch.distributed.new_group`` (each gloo group starts its own network thread). It
changes the scheduling of torch's own collectives exactly as it does ours, so comparisons stay fair.

The cost: while every core is busy with normal-priority work (all ranks computing), the network
thread gets almost no CPU, so messages move only when a rank waits. That holds for the receiver
too: a rank blocked in a receive gets its message only once a core is free to read it out of the
socket: a message to a rank blocked in its receive, whose sender then computes beside other busy
ranks, arrives about when the sender's computation ends (figures in the same file). A pipeline stage whose ranks
fill the cores therefore delivers its gradient to the stage before it only when it next waits.
Set the environment variable ``WORKBENCH_GLOO_LOOP=normal`` to leave gloo's threads as they are
(to see the stall, or on a machine with cores to spare). Linux only; elsewhere, or without ``/proc``, it does nothing.

While a rank waits for an emulated message
------------------------------------------
That cost matters when a rank computes while its messages are in flight: DDP's bucket all-reduces
run on ``workbench.comm``'s communication thread while backward keeps the rank's core busy, and the
idle network thread, which reads the incoming bytes out of the socket (and writes what did not fit
into it), then runs only once backward ends. On an emulated cluster (:mod:`workbench.comm.emulation`)
that would hold every message until the end of backward, which no NIC does: a NIC moves the bytes
while the GPU computes. So :func:`promoted` gives the network threads the normal class back while
a thread of this process waits for a held-back message (``workbench.comm.group`` does so around the
wait for the bytes of every message on an emulated link, not around its emulated hold-back, which
sleeps): they then take their fair share of the core, as moving the bytes over loopback costs
real CPU, and a waiting thread holds no connection lock, so nothing spins on one. Messages that are not
emulated keep the idle class throughout: on loopback, moving the bytes costs the same core that
backward needs (lesson 03 measures both).
"""
from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["LOOP_THREAD", "ENV", "demote_loop_threads", "enabled", "promoted"]

LOOP_THREAD = "gloo_tcp_loop"
ENV = "WORKBENCH_GLOO_LOOP"
_CHOICES = ("idle", "normal")

_loop_tids: set[int] = set()  # this process's network threads, as demote_loop_threads last found them
_promotions = [0]  # threads of this process inside promoted() right now
_lock = threading.Lock()
_pid = os.getpid()


def enabled() -> bool:
    """True unless ``WORKBENCH_GLOO_LOOP=normal``; a value other than idle/normal is an error."""
    value = os.environ.get(ENV, "idle").strip().lower() or "idle"
    if value not in _CHOICES:
        raise ValueError(f"{ENV}={os.environ[ENV]!r} is not understood: use 'idle' (default: gloo's "
                         f"network thread yields to every other thread) or 'normal' (leave it alone)")
    return value == "idle"


def demote_loop_threads() -> int:
    """Move this process's ``gloo_tcp_loop`` threads to ``SCHED_IDLE``; return how many moved.

    Idempotent and cheap (one directory listing of ``/proc/self/task``). Does nothing when
    :func:`enabled` is False or the platform has no ``SCHED_IDLE``.
    """
    if not enabled() or not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"):
        return 0
    global _pid
    if _pid != os.getpid():  # a forked child has other threads, and no promoted() block running
        _pid, _promotions[0] = os.getpid(), 0
    _loop_tids.clear()  # found afresh: a thread id of an ended thread may be reused by another
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != LOOP_THREAD:
                    continue
            _loop_tids.add(int(tid))
            if os.sched_getscheduler(int(tid)) != os.SCHED_IDLE and not _promotions[0]:  # promoted: later
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                moved += 1
        except (OSError, ValueError):  # the thread ended meanwhile, or the system refuses: leave it
            continue
    return moved


def _set_class(policy: int) -> None:
    for tid in list(_loop_tids):
        try:
            os.sched_setscheduler(tid, policy, os.sched_param(0))
        except OSError:  # the thread ended (its group was destroyed): forget it
            _loop_tids.discard(tid)


@contextlib.contextmanager
def promoted():
    """Run the block with gloo's network threads in the normal class, then back to ``SCHED_IDLE``.

    For a thread that waits for a message while other threads of the rank compute (see "While a
    rank waits for an emulated message" above). Nests and may be entered by several threads at once:
    the threads go back to idle when the last one leaves. One system call per network thread on
    entry and one on exit; nothing happens when the threads were never demoted.
    """
    if not _loop_tids or _pid != os.getpid():
        yield
        return
    with _lock:
        _promotions[0] += 1
        if _promotions[0] == 1:
            _set_class(os.SCHED_OTHER)
    try:
        yield
    finally:
        with _lock:
            _promotions[0] -= 1
            if _promotions[0] == 0:
                _set_class(os.SCHED_IDLE)
