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

With more runnable threads than cores, which is the normal case here (2 ranks x main thread,
network thread and gloo worker on 2 vCPUs), the scheduler sometimes takes the core away from the
sender while it holds the lock and gives it to the spinning network threads. Nothing progresses
until their time slice ends: about 3-5 ms. ``perf sched timehist`` shows both ranks'
``gloo_tcp_loop`` running for 5.1 ms while both main threads wait, and ``perf record`` shows those
5 ms spent in ``epoll_wait``. Measured on this 2-vCPU machine, 2 ranks, 100 calls each:

=====================  ========================  ========================
all_reduce             median, calls > 2 ms      median, calls > 2 ms
                       (network thread normal)   (network thread SCHED_IDLE)
=====================  ========================  ========================
64 KiB, torch gloo     2965 us, 56 %             326 us, 1 %
1 MiB,  torch gloo      696 us, 33 %             357 us, 2 %
1 MiB,  our ring       3526 us, 58 %             433 us, 1 %
16 MiB, torch gloo    10124 us                   7609 us
=====================  ========================  ========================

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
thread gets almost no CPU, so messages move only when a rank waits. Set the environment
variable ``WORKBENCH_GLOO_LOOP=normal`` to leave gloo's threads as they are (to see the stall, or
on a machine with cores to spare). Linux only; elsewhere, or without ``/proc``, it does nothing.
"""
from __future__ import annotations

import os

__all__ = ["LOOP_THREAD", "ENV", "demote_loop_threads", "enabled"]

LOOP_THREAD = "gloo_tcp_loop"
ENV = "WORKBENCH_GLOO_LOOP"
_CHOICES = ("idle", "normal")


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
    moved = 0
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                if f.read().strip() != LOOP_THREAD:
                    continue
            if os.sched_getscheduler(int(tid)) != os.SCHED_IDLE:
                os.sched_setscheduler(int(tid), os.SCHED_IDLE, os.sched_param(0))
                moved += 1
        except (OSError, ValueError):  # the thread ended meanwhile, or the system refuses: leave it
            continue
    return moved
