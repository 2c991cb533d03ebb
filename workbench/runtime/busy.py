"""How busy this machine is with other work: the test a timing claim needs before it is asserted.

A lesson that times sleeping pipeline stages or messages held back on an emulated link measures
the schedule and the links only if each rank gets a core as soon as it wakes. Beside other work
that keeps the cores busy (another job, a second notebook) a rank waits for a core after every
sleep and every message, and those waits become idle time and link time the lesson did not cause.
The load average cannot tell the two apart: it counts the lesson's own ranks, and it lags by a
minute. This module reads what the cores did over a short window while the lesson itself is idle
(between its launches): ``/proc/stat``'s per-machine counters of busy and idle time.

``busy_fraction(0.5)`` -> 0.0 on an idle machine, about 0.5 with one other busy process on 2
cores, 1.0 with two; ``None`` where ``/proc/stat`` does not exist (not Linux).
"""
from __future__ import annotations

import time

__all__ = ["busy_fraction", "were_free", "FREE"]

FREE = 0.25  # at most this fraction of the cores' time taken by other work: the cores count as free

_IDLE_FIELDS = (3, 4)  # idle, iowait in /proc/stat's "cpu" line (user nice system idle iowait irq softirq steal)


def _cpu_times() -> tuple[int, int] | None:
    """(idle, total) clock ticks of all cores since boot, or None without /proc/stat."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu":
        return None
    ticks = [int(v) for v in fields[1:9]]
    return sum(ticks[i] for i in _IDLE_FIELDS), sum(ticks)


def busy_fraction(seconds: float = 0.5) -> float | None:
    """The fraction of all cores' time spent busy over the next ``seconds`` (this process sleeps
    meanwhile, so the time is other processes'); None where it cannot be read."""
    if not seconds > 0:
        raise ValueError(f"busy_fraction(seconds={seconds!r}): give a window > 0 seconds, e.g. 0.5")
    start = _cpu_times()
    if start is None:
        return None
    time.sleep(seconds)
    end = _cpu_times()
    idle, total = end[0] - start[0], end[1] - start[1]
    return 0.0 if total <= 0 else max(0.0, 1.0 - idle / total)


def were_free(fractions, threshold: float = FREE) -> bool:
    """Whether other work left the cores free in every window of ``fractions`` (values of
    :func:`busy_fraction`, e.g. just before and just after a timed run): each at most
    ``threshold``. A window that could not be read (None) counts as free: nothing is known to run."""
    return all(b is None or b <= threshold for b in fractions)
