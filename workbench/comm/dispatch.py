"""Running one collective call: a hand-written algorithm or torch's own, counted either way."""
from __future__ import annotations

import time
from typing import Callable

import torch

from workbench.comm import counters, work
from workbench.comm.group import Comm, GroupView


def run_algorithm(collective: str, algorithm: str, view: GroupView,
                  body: Callable[[Comm], None], async_op: bool):
    """Run ``body(comm)`` in issue order (inline, or on the communication thread if async)."""
    sinks = counters.active()

    def task() -> None:
        comm = Comm(view)
        start = time.perf_counter()
        body(comm)
        counters.record(sinks, collective, algorithm, comm.bytes_sent, comm.bytes_received,
                        time.perf_counter() - start, comm.links)

    return work.submit(task, async_op)


def run_native(collective: str, start: Callable[[bool], object], sent: int, received: int,
               async_op: bool):
    """Call torch.distributed (``start(False)``, synchronous); count the bytes its algorithm would
    move (torch reports none, so ``sent``/``received`` come from the call's sizes).

    With ``async_op=True`` the synchronous call runs on the communication thread, in issue order
    with every other asynchronous collective, and the handle records when it ran.
    """
    sinks = counters.active()

    def task() -> None:
        t0 = time.perf_counter()
        start(False)
        counters.record(sinks, collective, "native", sent, received, time.perf_counter() - t0)

    return work.submit(task, async_op)


def flat_buffer(tensor: torch.Tensor) -> tuple[torch.Tensor, Callable[[], None]]:
    """A contiguous 1-D buffer holding ``tensor``'s data, and the function that writes it back.

    A contiguous tensor is its own buffer (no copy, nothing to write back); a non-contiguous one
    is copied, and the result copied back into the caller's tensor: in-place semantics hold.
    """
    if tensor.is_contiguous():
        return tensor.view(-1), _nothing
    buf = tensor.contiguous().view(-1)
    return buf, lambda: tensor.copy_(buf.view(tensor.shape))


def _nothing() -> None:
    return None


def nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()
