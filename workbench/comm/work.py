"""Asynchronous collectives: the handle (:class:`Work`) and the communication thread.

``async_op=True`` must let DDP overlap communication with backward, so a hand-written collective
cannot run in the caller's thread. Each process has ONE background communication thread with a
FIFO queue, which plays the role of a CUDA stream::

    caller thread                       communication thread (one per process)
    -------------                       --------------------------------------
    all_reduce(a, async_op=True) ---->  queue: [a]            runs a's sends/recvs
    all_reduce(b, async_op=True) ---->  queue: [a, b]         then b's ...
    backward continues ...
    h_a.wait()   <------------------------------------------  a done (or a's error re-raised)

Every rank issues its collectives in the same order (as torch.distributed requires), and every
rank's thread runs them in issue order, so the messages of two collectives never cross and nothing
deadlocks. A synchronous call made while the thread still has work queued goes through the queue
too (and waits), so it runs after them; with nothing queued it runs directly in the caller.

``torch.distributed``'s own collectives (``algorithm="native"``) called with ``async_op=True`` go
through the same queue: the thread makes the synchronous torch call. So every asynchronous
collective of a process, hand-written or native, runs on this one thread, one at a time, in issue
order, and its handle can say when it *ran*, not only when it was issued or waited for::

    work.issued    the caller queued it              (time.perf_counter() seconds)
    work.started   the thread began running it       (issued..started: waiting in the queue)
    work.ended     the thread finished it            (started..ended: the transfer itself)

Timelines (DDP's buckets, FSDP's gathers) draw ``started..ended``: a bar from issue to wait would
also count the time a collective sat in the queue behind others, and the time it sat finished
until someone waited for it. (On NCCL the thread's synchronous call returns once the collective is
queued on the GPU's communication stream, so there these stamps time the issue, not the transfer.)
Because the thread issues native collectives while the caller goes on, a caller must not call
``torch.distributed`` directly (outside ``workbench.comm``) on the same group while asynchronous
work is still pending: ranks could then issue the two in different orders.

The thread is a daemon (it never keeps the process alive at exit), is created lazily on first
use, and is re-created in a forked child (a fork copies no threads; the child makes its own).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from typing import Callable

__all__ = ["Work", "submit"]


class Work:
    """Handle of an asynchronous collective, like ``torch.distributed.Work``.

    ``wait()`` blocks until the collective is done (the caller's tensors then hold the result) and
    re-raises, on the caller's thread, any error the collective hit; ``is_completed()`` polls.
    ``issued``, ``started`` and ``ended`` (``time.perf_counter()`` seconds, ``None`` until they
    happen) say when it was queued, and when the communication thread began and finished it.
    """

    def __init__(self) -> None:
        self._done = threading.Event()
        self._error: BaseException | None = None
        self.issued: float | None = time.perf_counter()
        self.started: float | None = None
        self.ended: float | None = None

    def _finish(self, error: BaseException | None = None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def is_success(self) -> bool:
        return self._done.is_set() and self._error is None

    def exception(self) -> BaseException | None:
        return self._error

    def wait(self, timeout: float | None = None) -> bool:
        if not self._done.wait(timeout):
            raise TimeoutError(f"collective did not finish within timeout={timeout} s")
        if self._error is not None:
            raise self._error
        return True


class _Worker:
    """The communication thread of one process and its FIFO queue."""

    def __init__(self) -> None:
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.pending = 0  # tasks queued or running
        self.lock = threading.Lock()
        self.thread = threading.Thread(target=self._loop, name="workbench-comm", daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while True:
            task, work = self.queue.get()
            error = None
            work.started = time.perf_counter()
            try:
                task()
            except BaseException as e:  # noqa: BLE001 -- handed to the caller through wait()
                error = e
            work.ended = time.perf_counter()
            # let go of the finished task before the caller wakes: its closure holds the
            # collective's tensors, which would otherwise stay alive until the next task arrives
            task = None
            with self.lock:  # idle again before the caller wakes: its next sync call runs inline
                self.pending -= 1
            work._finish(error)

    def submit(self, task: Callable[[], None]) -> Work:
        work = Work()
        with self.lock:
            self.pending += 1
        self.queue.put((task, work))
        return work

    def idle(self) -> bool:
        with self.lock:
            return self.pending == 0


_worker: _Worker | None = None
_worker_pid: int | None = None
_create_lock = threading.Lock()


def _get_worker() -> _Worker:
    global _worker, _worker_pid, _create_lock
    if _worker_pid != os.getpid():  # first use, or a forked child holding its parent's copy
        _worker, _worker_pid, _create_lock = None, os.getpid(), threading.Lock()
    with _create_lock:
        if _worker is None:
            _worker = _Worker()
    return _worker


def submit(task: Callable[[], None], async_op: bool) -> Work | None:
    """Run ``task`` after every collective issued before it; return a handle if ``async_op``."""
    if not async_op and (_worker_pid != os.getpid() or _worker is None or _worker.idle()):
        task()  # nothing queued: run here, without a thread hand-off
        return None
    work = _get_worker().submit(task)
    if async_op:
        return work
    work.wait()
    return None
