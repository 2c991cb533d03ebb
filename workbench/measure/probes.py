"""Timing this machine's messages, reductions and copies, and fitting the cost model to them.

:mod:`workbench.comm.cost` is the model: formulas in three numbers per machine (plus measured
curves). This module measures those numbers. Everything here but :func:`measure` runs inside a
launch, on every rank; :func:`measure` starts the ranks itself. (Measuring is the caller's job:
comm holds the model and never starts ranks.)

Fitting the three numbers (:func:`fit`, inside a launch)
---------------------------------------------------------
* alpha, beta: a ping-pong between ranks 0 and 1 (:func:`pingpong`) over sizes from 8 B up;
  half the round trip is one message, ``t(m) = alpha + m beta``, fitted by least squares on the
  *relative* error (:func:`workbench.comm.cost.fit_line`) so that the 8-byte and the 16-MiB points
  count alike.
* gamma: the slope of a local ``a.add_(b)`` timed over sizes, on one thread like a rank
  (:func:`reduction_time`).
* alpha_duplex, beta_duplex: the same two ranks *exchange* messages (:func:`exchange`: both
  send and receive at once), the step every ring, recursive-doubling and Rabenseifner round is
  made of, over the sizes collectives send (64 KiB up): the slope and the intercept.
* delta: the slope of a local ``dst.copy_(src)`` (:func:`copy_time`) over sizes up to 64 MiB,
  fitted on the copies of 1 MiB and more (out of cache: the copies that matter are big).
* The measured curves (``CostModel.tables``): the exchange, a one-way *stream*
  (:func:`stream`), the reductions and the copies, one point per size by x2 steps; and the
  per-call overheads (:func:`call_overheads`: a hand-written call on empty tensors).

Every timing is a median over repeats after one warm-up round; a pair's timing is the slower of
its two ranks, and every rank gets the same numbers (rank 0's local timings, broadcast). Cost:
about ``len(sizes) x repeats x iterations`` messages per curve; memory: two buffers of the
largest size per rank. ``all_pairs=True`` times the exchange and the stream with every pair of
ranks (2k, 2k+1) stepping at once, as a collective's steps do (:class:`Probe`): where ranks
outnumber cores each message then gets its share of a core, as it does inside the collective.
"""
from __future__ import annotations

import statistics
import time
from typing import Sequence

import torch
import torch.distributed as dist

from workbench import comm
from workbench.comm.cost import CostModel, fit_line
from workbench.comm.group import Comm, resolve_group
from workbench.ranks.launch import launch

__all__ = ["Probe", "pingpong", "stream", "exchange", "call_overheads", "reduction_time", "copy_time", "fit",
           "measure", "DEFAULT_PINGPONG_SIZES", "DEFAULT_REDUCTION_SIZES", "DEFAULT_EXCHANGE_SIZES"]

def _time_pair(sizes, make, messages: int, *, iterations: int, budget_bytes: int, repeats: int,
               group, all_pairs: bool = False) -> list[tuple[int, float]]:
    """Seconds per message of ``make(bytes)()`` (a step between ranks 0 and 1, called on every rank).

    A step carries ``messages`` messages per call on each of ranks 0 and 1. Each size is timed
    ``repeats`` times after one warm-up round (connections, page faults); each of ranks 0 and 1
    keeps its median and the larger of the two is returned on every rank (a receiver finishes
    after its sender). Other ranks only take part in the barriers and the maximum, unless
    ``all_pairs`` (every rank steps with its partner, and the slowest pair counts).
    """
    active = all_pairs or dist.get_rank(group) in (0, 1)
    out = []
    for nbytes in sizes:
        step = make(nbytes)
        iters = max(2, min(iterations, budget_bytes // max(nbytes, 1)))
        samples = []
        for k in range(repeats + 1):  # the first round warms up and is dropped
            dist.barrier(group=group)
            start = time.perf_counter()
            if active:
                for _ in range(iters):
                    step()
            if k:
                samples.append((time.perf_counter() - start) / (messages * iters))
        t = torch.tensor([statistics.median(samples) if active else 0.0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        out.append((nbytes, float(t.item())))
    return out


def pingpong(sizes: Sequence[int], *, iterations: int = 20, budget_bytes: int = 32 << 20,
             repeats: int = 3, group=None) -> list[tuple[int, float]]:
    """One-way message time ``(bytes, seconds)`` per size between ranks 0 and 1 (call on every rank).

    Rank 0 sends, rank 1 sends the same bytes back; half the round trip is one message.
    """
    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"pingpong needs at least 2 ranks, got world size {world}")
    rank = dist.get_rank(group)
    peer = {0: 1, 1: 0}.get(rank)
    peer = dist.get_global_rank(group, peer) if group is not None and peer is not None else peer

    def make(nbytes):
        x = torch.zeros(max(nbytes, 1), dtype=torch.uint8)

        def round_trip():
            if rank == 0:
                dist.send(x, peer, group=group)
                dist.recv(x, peer, group=group)
            else:
                dist.recv(x, peer, group=group)
                dist.send(x, peer, group=group)
        return round_trip

    return _time_pair(sizes, make, 2, iterations=iterations, budget_bytes=budget_bytes,
                      repeats=repeats, group=group)


def stream(sizes: Sequence[int], *, iterations: int = 20, budget_bytes: int = 32 << 20,
           repeats: int = 3, group=None, all_pairs: bool = False) -> list[tuple[int, float]]:
    """Time ``(bytes, seconds)`` per message of rank 0 sending to rank 1 back to back (call on every rank).

    Unlike the ping-pong, nobody waits for an answer, but each receive is posted only when the
    previous one is done, as a tree's child posts its receive when its turn comes: with gloo's
    rendezvous every message then pays a receive-ready notice on top of its data, and a stream
    message costs about two ping-pong latencies. The one-way steps of trees and flat algorithms
    (broadcast, reduce, scatter, gather, folds) are priced from this curve. (:class:`Probe`
    ``"one_way"``, timed on its own.)
    """
    return _time_pair(sizes, lambda n: Probe("one_way", n, group, all_pairs=all_pairs), 1,
                      iterations=iterations, budget_bytes=budget_bytes, repeats=repeats, group=group,
                      all_pairs=all_pairs)


def exchange(sizes: Sequence[int], *, iterations: int = 20, budget_bytes: int = 32 << 20,
             repeats: int = 3, group=None, all_pairs: bool = False) -> list[tuple[int, float]]:
    """Time ``(bytes, seconds)`` of ranks 0 and 1 swapping ``bytes`` at once (call on every rank).

    Both post a receive and a send, then wait for both: one step of a ring or of recursive
    doubling on two ranks. Its slope is ``beta_duplex``, its intercept ``alpha_duplex``.
    (:class:`Probe` ``"exchange"``, timed on its own.) ``all_pairs``: every pair of ranks
    (2k, 2k+1) exchanges at the same time, as in a collective's step on more than two ranks.
    """
    return _time_pair(sizes, lambda n: Probe("exchange", n, group, all_pairs=all_pairs), 1,
                      iterations=iterations, budget_bytes=budget_bytes, repeats=repeats, group=group,
                      all_pairs=all_pairs)


class Probe:
    """One primitive step of ``nbytes`` between ranks 0 and 1, to be called on every rank.

    ``kind="exchange"``: both swap ``nbytes`` (a ring or recursive-doubling step);
    ``kind="one_way"``: rank 0 sends, rank 1 receives (a stream message, a tree step). Other
    ranks do nothing, unless ``all_pairs``: then every even rank 2k does the same with 2k+1 at
    the same time, as every rank of a ring or recursive-doubling step does. Where ranks
    outnumber cores, that is what a step of a collective costs: the pairs share the cores.
    ``workbench bench collectives`` times probes in the same interleaved trials as the
    collectives, so the measured curves (``CostModel.tables``) it predicts them with were taken
    under the same conditions, not a minute earlier or later.
    """

    KINDS = ("exchange", "one_way")

    def __init__(self, kind: str, nbytes: int, group=None, *, all_pairs: bool = False) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"kind={kind!r} is not a probe: use one of {self.KINDS}")
        self.kind, self.nbytes = kind, int(nbytes)
        view = resolve_group(group)
        if view is None:
            self.peer = None
        elif all_pairs:  # ranks 2k and 2k+1 pair up, all at once (an odd rank out does nothing)
            peer = view.rank ^ 1
            self.peer = peer if peer < view.size else None
        else:
            self.peer = {0: 1, 1: 0}.get(view.rank)
        self.comm = Comm(view) if self.peer is not None else None  # the algorithms' own message layer
        self.first = self.peer is not None and self.peer > view.rank
        size = max(self.nbytes, 1) if self.peer is not None else 0
        self.x = torch.zeros(size, dtype=torch.uint8)
        self.y = torch.empty_like(self.x)

    def __call__(self) -> None:
        if self.peer is None:
            return
        if self.kind == "exchange":
            self.comm.sendrecv(self.x, self.peer, self.y, self.peer)
        elif self.first:
            self.comm.send(self.x, self.peer)
        else:
            self.comm.recv(self.x, self.peer)


def call_overheads(*, calls: int = 100, repeats: int = 5, group=None) -> dict[str, float]:
    """Seconds of a hand-written call that moves no data, per ``"collective/algorithm"`` (call on
    every rank).

    A call on empty tensors runs everything but the messages: the input checks, the group
    lookup, building the schedule (a ring's blocks, a tree's partners), the counters: the ring,
    which builds its all-gather up front, costs the most, recursive doubling the least. The
    slowest rank's median; the same numbers on every rank.
    """
    p = dist.get_world_size(group)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    is_root = dist.get_rank(group) == 0
    e = torch.empty(0)
    lst = [torch.empty(0) for _ in range(p)]
    call = {
        "all_reduce": lambda a: comm.all_reduce(e, group=group, algorithm=a),
        "all_gather": lambda a: comm.all_gather(lst, e, group=group, algorithm=a),
        "reduce_scatter": lambda a: comm.reduce_scatter(e, lst, group=group, algorithm=a),
        "broadcast": lambda a: comm.broadcast(e, root, group=group, algorithm=a),
        "reduce": lambda a: comm.reduce(e, root, group=group, algorithm=a),
        "scatter": lambda a: comm.scatter(e, lst if is_root else None, src=root, group=group, algorithm=a),
        "gather": lambda a: comm.gather(e, lst if is_root else None, dst=root, group=group, algorithm=a),
        "all_to_all_single": lambda a: comm.all_to_all_single(e, e, group=group, algorithm=a),
    }
    keys, times = [], []
    for collective, algorithms in comm.ALGORITHMS.items():
        for algorithm in algorithms:
            if algorithm == "native" or collective not in call:
                continue
            samples = []
            for _ in range(repeats):
                dist.barrier(group=group)
                start = time.perf_counter()
                for _ in range(calls):
                    call[collective](algorithm)
                samples.append((time.perf_counter() - start) / calls)
            keys.append(f"{collective}/{algorithm}")
            times.append(statistics.median(samples))
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return dict(zip(keys, t.tolist()))


def reduction_time(sizes: Sequence[int], *, dtype: torch.dtype = torch.float32, iterations: int = 20,
                   budget_bytes: int = 64 << 20, repeats: int = 3) -> list[tuple[int, float]]:
    """Seconds of a local ``a.add_(b)`` on ``bytes`` of ``dtype`` (this thread only): gamma's points."""
    return _local_time(sizes, lambda a, b: a.add_(b), dtype, iterations, budget_bytes, repeats)


def copy_time(sizes: Sequence[int], *, dtype: torch.dtype = torch.float32, iterations: int = 20,
              budget_bytes: int = 64 << 20, repeats: int = 3) -> list[tuple[int, float]]:
    """Seconds of a local ``a.copy_(b)`` on ``bytes`` of ``dtype`` (this thread only): delta's points."""
    return _local_time(sizes, lambda a, b: a.copy_(b), dtype, iterations, budget_bytes, repeats)


def _local_time(sizes, step, dtype, iterations, budget_bytes, repeats) -> list[tuple[int, float]]:
    out = []
    esize = torch.tensor([], dtype=dtype).element_size()
    for nbytes in sizes:
        numel = max(nbytes // esize, 1)
        a, b = torch.ones(numel, dtype=dtype), torch.ones(numel, dtype=dtype)
        iters = max(2, min(iterations, budget_bytes // max(nbytes, 1)))
        step(a, b)  # warm the pages
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                step(a, b)
            samples.append((time.perf_counter() - start) / iters)
        out.append((numel * esize, statistics.median(samples)))
    return out


# by x2, so that the measured curves (``tables``) are interpolated over short steps
DEFAULT_PINGPONG_SIZES = tuple(8 << k for k in range(24))  # 8 B .. 64 MiB
DEFAULT_REDUCTION_SIZES = tuple(8192 << k for k in range(14))  # 8 KiB .. 64 MiB (also the copies')
DEFAULT_EXCHANGE_SIZES = tuple(8192 << k for k in range(14))  # 8 KiB .. 64 MiB: the sizes collectives send


def fit(pingpong_sizes: Sequence[int] = DEFAULT_PINGPONG_SIZES,
        reduction_sizes: Sequence[int] = DEFAULT_REDUCTION_SIZES,
        exchange_sizes: Sequence[int] | None = DEFAULT_EXCHANGE_SIZES, *, copies: bool = True,
        curves: bool = True, all_pairs: bool = False, group=None, iterations: int = 50,
        repeats: int = 7) -> dict:
    """Fit alpha, beta, gamma (and alpha_duplex, beta_duplex, delta) on this machine; call on every rank.

    Returns ``{"model": CostModel, "pingpong": [(bytes, s)], "exchange": [(bytes, s)],
    "reduction": [(bytes, s)], "copy": [(bytes, s)]}``, the same on every rank (rank 0's
    measurements, broadcast). ``exchange_sizes=None`` leaves ``alpha_duplex`` and ``beta_duplex``
    None, ``copies=False`` leaves ``delta`` None and ``curves=False`` keeps only the straight
    lines (no measured curves): all three give the textbook model. ``all_pairs``: the exchange
    and the stream are timed with every pair of ranks (2k, 2k+1) stepping at once (see
    :class:`Probe`), which is what a collective's step costs when the ranks outnumber the cores;
    the ping-pong (alpha, beta) stays one pair's. ``iterations`` messages per timing and
    ``repeats`` timings per size (their median); fewer give a quicker, noisier fit.
    """
    for name, value in (("iterations", iterations), ("repeats", repeats)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"fit({name}={value!r}): pass a whole number >= 1 (the defaults: iterations=50, "
                             "repeats=7)")
    # by default as many calls per size as the benchmark makes (50 calls, 5+ trials), so the fit sees
    # the machine's occasional slow call as often as a collective does
    pp = pingpong(pingpong_sizes, iterations=iterations, repeats=repeats, group=group)
    alpha, beta = fit_line(pp)
    ex = (exchange(exchange_sizes, iterations=iterations, repeats=repeats, group=group, all_pairs=all_pairs)
          if exchange_sizes else [])
    alpha_duplex, beta_duplex = fit_line(ex) if ex else (None, None)
    root = dist.get_global_rank(group, 0) if group is not None else 0
    red = _from_rank0(reduction_time(reduction_sizes), root, group)
    _, gamma = fit_line(red)
    cp = _from_rank0(copy_time(reduction_sizes), root, group) if copies else []
    big_copies = [(n, t) for n, t in cp if n >= 1 << 20]  # the copies that matter are big, out of cache
    delta = fit_line(big_copies if len(big_copies) >= 2 else cp)[1] if cp else None
    tables, st = None, []
    if curves:
        st = stream(pingpong_sizes, iterations=iterations, repeats=repeats, group=group, all_pairs=all_pairs)
        tables = {"one_way": st, "reduction": red}
        if ex:
            tables["exchange"] = ex
        if cp:
            tables["copy"] = cp
    overheads = call_overheads(calls=2 * iterations, repeats=min(5, repeats), group=group) if curves else None
    overhead = statistics.median(overheads.values()) if overheads else None
    model = CostModel(alpha=alpha, beta=beta, gamma=gamma, alpha_duplex=alpha_duplex, beta_duplex=beta_duplex,
                      delta=delta, tables=tables, overhead=overhead, overheads=overheads)
    return {"model": model, "pingpong": pp, "stream": st, "exchange": ex, "reduction": red, "copy": cp}


def _from_rank0(points: list[tuple[int, float]], root: int, group) -> list[tuple[int, float]]:
    """Rank 0's local timings on every rank (each rank timed its own; one answer for all)."""
    t = torch.tensor([s for _, s in points], dtype=torch.float64)
    dist.broadcast(t, root, group=group)
    return [(n, float(s)) for (n, _), s in zip(points, t.tolist())]


def measure(world_size: int = 2, **kwargs) -> dict:
    """Fit the model from outside a launch: starts ``world_size`` ranks and runs :func:`fit`."""
    return launch(fit, world_size, kwargs=kwargs)[0]

