"""Measure every collective and algorithm against PyTorch's, nccl-tests style.

What one row means
------------------
For each collective, size and algorithm (``native`` = ``torch.distributed``, the baseline)::

    size    bytes moved, counted as nccl-tests does: the whole vector for all_reduce, broadcast
            and reduce; the whole gathered (scattered) buffer for all_gather, reduce_scatter,
            gather and scatter, so each rank contributes size / world_size; one rank's whole
            input for all_to_all_single (size / world_size to each rank, its own block included)
    time    seconds per call: each rank times ``iters`` back-to-back calls after a barrier, the
            slowest rank's time counts; the median over ``--trials`` trials is shown
    algbw   size / time
    busbw   algbw * factor, the per-link bandwidth a bandwidth-optimal algorithm needs:
            2(n-1)/n for all_reduce, (n-1)/n for all_gather, reduce_scatter, gather, scatter and
            all_to_all_single, 1 for broadcast and reduce. busbw can be compared across collectives and world sizes
    #wrong  elements that differ from the expected result in a check run outside the timed loop
            (exact small integers, so any reduction order gives the same bits), summed over ranks
    ratio   our busbw / native busbw, same size, same placement

Every size runs **out-of-place** and **in-place**. Where ``torch.distributed`` has separate
input and output buffers (all_gather, reduce_scatter, gather, scatter) in-place means the input
*is* this rank's slot of the output, as in ``all_gather(out, out[rank])``. all_reduce, broadcast
and reduce only exist in place in PyTorch; their out-of-place form copies the input into the
output first (``out.copy_(x); all_reduce(out)``), which is what a caller who must keep ``x``
pays, so that column includes one local copy. all_to_all_single only exists out of place (a
block may not be overwritten before it is sent); its in-place form, the result in the caller's
buffer, copies that buffer aside first (``tmp.copy_(buf); all_to_all_single(buf, tmp)``), so its
in-place column includes one local copy.

Fair comparison
---------------
All algorithms of a collective, ``native`` included, run in the same trials, in an order that
rotates from trial to trial (``workbench.measure.measuring.interleaved_trials``), so machine noise
falls on all of them alike; the ratio compares medians. Big messages run fewer iterations
(at most ``--budget`` bytes per measurement, at least one): the ``iters`` column says how many.
The defaults (7 trials of 50 calls, at most 256 MiB per trial: 4 calls of 64 MiB) are set for a
machine with fewer cores than ranks and threads, where a call now and then takes a few
milliseconds longer (a descheduled rank): a median needs several calls of even the largest size
per trial, and enough trials that one slow trial does not move it (how far the ratios moved with
fewer: ``docs/benchmarks/2026-11-27-figures-from-the-code-2vcpu.md``). Gloo's network thread is demoted
(``workbench/runtime/gloo_threads.py``), without which slow calls are a large share of all calls.

Predictions (``pred``, ``err%``)
--------------------------------
Unless ``--no-predict``, the cost model is fitted after the sweep (``workbench.measure.probes.fit``, over its
sizes up to the sweep's largest, 1 MiB at least), and an
exchange and a one-way message of size/p and size bytes are timed *inside* each size's trials as
extra candidates (``workbench.measure.probes.Probe``), so the model's curves come from the same moments as the
collectives they predict. ``err%`` = predicted / measured in-place time - 1.

Under an emulated cluster (``--topology``)
-----------------------------------------
``--topology SPEC`` (a :class:`~workbench.comm.Topology` spec or preset, as ``WORKBENCH_TOPOLOGY``)
runs the sweep on emulated nodes with slowed links (:mod:`workbench.comm.emulation`) and adds
the algorithms that need a topology (``hierarchical``). ``native`` is left out when a link is
emulated (torch's messages cannot be held back, so it would run the ring again: see
:mod:`workbench.comm.emulation`); the ratio column then compares with ``ring``. The cost model
prices each message on its link (``comm.cost.predict(..., topology=)``), with this machine's
reductions and copies measured after the sweep (a ping-pong and local timings per size, no
exchange probes: exchanges would go through the emulated links), and a last table sets the
measured speed-up of ``hierarchical`` over ``ring`` beside the predicted one. Emulated links are
slow, so keep the sizes and the budget small::

    workbench bench collectives --world-size 4 --collectives all_reduce --algorithms ring hierarchical \
        --topology "ranks_per_node=2,intra=500us@200MB/s,inter=500us@20MB/s" \
        --min-bytes 1M --max-bytes 16M --budget 32M --trials 5

Run it::

    workbench bench collectives                                   # all collectives, 2 ranks
    workbench bench collectives --collectives all_reduce --algorithms ring --world-size 4
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable
import concurrent.futures
import resource

import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring
from workbench.measure import probes as probing
from workbench.comm import Topology, cost

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all_single")
PLACEMENTS = ("out-of-place", "in-place")
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int32": torch.int32, "int64": torch.int64}
ROOT = 0  # src/dst of the rooted collectives


def bus_factor(collective: str, world_size: int) -> float:
    """nccl-tests' busbw / algbw for ``collective`` on ``world_size`` ranks."""
    n = world_size
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all_single"):
        return (n - 1) / n
    if collective in ("broadcast", "reduce"):
        return 1.0
    raise ValueError(f"collective={collective!r} is not known: use one of {', '.join(COLLECTIVES)}")


def counts(collective: str, nbytes: int, world_size: int, element_size: int) -> tuple[int, int]:
    """``(elements per call argument, bytes reported)`` for a requested size, nccl-tests style.

    Sharded collectives round down so that every rank holds the same whole number of elements;
    0 elements means the size is too small for this world size (the row is skipped).
    """
    total = nbytes // element_size
    if collective in ("all_gather", "reduce_scatter", "gather", "scatter"):
        per_rank = total // world_size
        return per_rank, per_rank * world_size * element_size
    if collective == "all_to_all_single":  # the input: one equal block per rank
        per_block = total // world_size
        return per_block * world_size, per_block * world_size * element_size
    return total, total * element_size


# ----------------------------------------------------------------------------- one measurement

def _pattern(rank: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """Rank ``rank``'s check data: small integers (exact in every dtype, in any summation order)."""
    return ((torch.arange(numel) % 7) + 1 + 3 * rank).to(dtype)


@dataclass
class _Case:
    """Buffers for one (collective, size, placement) on this rank, how to call it, how to check it."""

    call: Callable[[str], None]  # run the collective once with the given algorithm
    fill: Callable[[], None]  # put the check data in the inputs
    wrong: Callable[[], int]  # elements of this rank's output that differ from the expected result


def _mismatches(got, want) -> int:
    """Elements of ``got`` that differ from ``want`` (exact: the check data are small integers)."""
    return int((got != want).sum().item())


def _one_buffer_case(collective: str, numel: int, inplace: bool, dtype: torch.dtype, r: int, n: int) -> _Case:
    """all_reduce, reduce, broadcast: PyTorch has them in place only, so out of place copies the input into
    the output before every call (what a caller who must keep ``x`` pays). reduce is checked on the root."""
    x = _pattern(r, numel, dtype)
    out = x if inplace else torch.empty_like(x)
    if collective == "all_reduce":
        run = lambda a: comm.all_reduce(out, algorithm=a)  # noqa: E731
        expected = lambda: sum(_pattern(q, numel, dtype) for q in range(n))  # noqa: E731
        checked = True
    elif collective == "reduce":
        run = lambda a: comm.reduce(out, ROOT, algorithm=a)  # noqa: E731
        expected = lambda: sum(_pattern(q, numel, dtype) for q in range(n))  # noqa: E731
        checked = r == ROOT
    else:
        run = lambda a: comm.broadcast(out, ROOT, algorithm=a)  # noqa: E731
        expected = lambda: _pattern(ROOT, numel, dtype)  # noqa: E731
        checked = True

    def call(a):
        if not inplace:
            out.copy_(x)
        run(a)

    def fill():
        out.copy_(_pattern(r, numel, dtype))
        if not inplace:
            x.copy_(_pattern(r, numel, dtype))

    return _Case(call, fill, lambda: _mismatches(out, expected()) if checked else 0)


def _all_gather_case(numel: int, inplace: bool, dtype: torch.dtype, r: int, n: int) -> _Case:
    """all_gather into one flat buffer of ``n`` slots; in place, the input *is* this rank's slot."""
    flat = torch.zeros(n * numel, dtype=dtype)
    outs = list(flat.chunk(n)) if numel else [flat[:0] for _ in range(n)]
    x = outs[r] if inplace else _pattern(r, numel, dtype)

    def fill():
        flat.zero_()
        x.copy_(_pattern(r, numel, dtype))

    want = lambda: torch.cat([_pattern(q, numel, dtype) for q in range(n)])  # noqa: E731
    return _Case(lambda a: comm.all_gather(outs, x, algorithm=a), fill, lambda: _mismatches(flat, want()))


def _reduce_scatter_case(numel: int, inplace: bool, dtype: torch.dtype, r: int, n: int) -> _Case:
    """reduce_scatter of a flat input of ``n`` blocks; in place, the output *is* this rank's input block."""
    flat = _pattern(r, n * numel, dtype)
    ins = list(flat.chunk(n))
    out = ins[r] if inplace else torch.zeros(numel, dtype=dtype)

    def fill():
        flat.copy_(_pattern(r, n * numel, dtype))
        if not inplace:
            out.zero_()

    def want():
        return sum(_pattern(q, n * numel, dtype) for q in range(n))[r * numel:(r + 1) * numel]

    return _Case(lambda a: comm.reduce_scatter(out, ins, algorithm=a), fill, lambda: _mismatches(out, want()))


def _gather_case(numel: int, inplace: bool, dtype: torch.dtype, r: int, n: int) -> _Case:
    """gather to ``ROOT``, the only rank with an output (and the only one checked); in place, the root's
    input is its own slot of the output."""
    flat = torch.zeros(n * numel, dtype=dtype) if r == ROOT else None
    outs = list(flat.chunk(n)) if r == ROOT else None
    x = outs[ROOT] if (inplace and r == ROOT) else _pattern(r, numel, dtype)

    def fill():
        if flat is not None:
            flat.zero_()
        x.copy_(_pattern(r, numel, dtype))

    def wrong():
        if r != ROOT:
            return 0
        return _mismatches(flat, torch.cat([_pattern(q, numel, dtype) for q in range(n)]))

    return _Case(lambda a: comm.gather(x, outs, dst=ROOT, algorithm=a), fill, wrong)


def _scatter_case(numel: int, inplace: bool, dtype: torch.dtype, r: int, n: int) -> _Case:
    """scatter from ``ROOT``, the only rank with an input; in place, the root's output is its own slot of
    the input."""
    flat = torch.cat([_pattern(q, numel, dtype) for q in range(n)]) if r == ROOT else None
    ins = list(flat.chunk(n)) if r == ROOT else None
    out = ins[ROOT] if (inplace and r == ROOT) else torch.zeros(numel, dtype=dtype)

    def fill():
        if flat is not None:
            flat.copy_(torch.cat([_pattern(q, numel, dtype) for q in range(n)]))
        if not (inplace and r == ROOT):
            out.zero_()

    return _Case(lambda a: comm.scatter(out, ins, src=ROOT, algorithm=a), fill,
                 lambda: _mismatches(out, _pattern(r, numel, dtype)))


def _all_to_all_case(numel: int, inplace: bool, dtype: torch.dtype, r: int, n: int) -> _Case:
    """all_to_all_single: block j of rank i's input lands in block i of rank j's output. It exists out of
    place only; in place (the result in the caller's buffer) copies that buffer aside before every call."""
    x = _pattern(r, numel, dtype)
    out = torch.zeros(numel, dtype=dtype)
    aside = torch.empty_like(out) if inplace else None

    def call(a):
        if inplace:  # the result replaces the caller's buffer: it is copied aside first
            aside.copy_(out)
            comm.all_to_all_single(out, aside, algorithm=a)
        else:
            comm.all_to_all_single(out, x, algorithm=a)

    def fill():
        if inplace:
            out.copy_(x)
        else:
            out.zero_()

    want = lambda: torch.cat([_pattern(q, numel, dtype).chunk(n)[r] for q in range(n)])  # noqa: E731
    return _Case(call, fill, lambda: _mismatches(out, want()))


# the collectives with separate input and output buffers, each its own builder
_SHARDED_CASES = {"all_gather": _all_gather_case, "reduce_scatter": _reduce_scatter_case, "gather": _gather_case,
                  "scatter": _scatter_case, "all_to_all_single": _all_to_all_case}


def _make_case(collective: str, numel: int, placement: str, dtype: torch.dtype) -> _Case:
    """This rank's buffers for ``collective`` of ``numel`` elements per call argument, ``placement``
    ``"in-place"`` or ``"out-of-place"`` (see the module docstring for what each means per collective)."""
    r, n = dist.get_rank(), dist.get_world_size()
    inplace = placement == "in-place"
    if collective in ("all_reduce", "broadcast", "reduce"):
        return _one_buffer_case(collective, numel, inplace, dtype, r, n)
    if collective in _SHARDED_CASES:
        return _SHARDED_CASES[collective](numel, inplace, dtype, r, n)
    raise ValueError(f"collective={collective!r} is not known: use one of {', '.join(COLLECTIVES)}")


# ----------------------------------------------------------------------------------- the sweep

def sweep(collectives, algorithms, sizes, *, trials=7, warmup=5, iters=50, budget_bytes=256 << 20,
          dtype="float32", progress=True, probes: dict | None = None, baseline: str = "native") -> list[dict]:
    """Run inside every rank of a launch; returns the rows (the same list on every rank).

    ``algorithms``: ``{collective: [algorithm, ...]}``, ``native`` first. For each collective and
    size, every (algorithm, placement) is warmed up, timed in ``trials`` interleaved trials and
    checked once; times are the slowest rank's.

    ``probes``: a dict to fill with the cost model's primitives timed in the same trials: for
    each collective and size, an exchange and a one-way message (:class:`~workbench.measure.probes.Probe`)
    of the sizes its algorithms send (size/p and size) join the candidates, and their medians are
    added as ``probes[collective]["exchange"]`` and ``probes[collective]["one_way"]``, lists of
    ``(bytes, seconds)`` (see :func:`models_for`).

    ``baseline``: the algorithm the ratios compare with (``native``; ``ring`` under an emulated
    topology, where native is not run).
    """
    world = dist.get_world_size()
    torch_dtype = DTYPES[dtype]
    esize = torch.tensor([], dtype=torch_dtype).element_size()
    plan = [(c, s) for c in collectives for s in sizes if counts(c, s, world, esize)[0] > 0]
    rows = []
    for step, (collective, nbytes) in enumerate(plan):
        numel, reported = counts(collective, nbytes, world, esize)
        n_iter = measuring.scaled_iterations(reported, iters, budget_bytes)
        n_warm = measuring.scaled_iterations(reported, warmup, budget_bytes) if warmup else 0
        cases = {p: _make_case(collective, numel, p, torch_dtype) for p in PLACEMENTS}
        candidates = [f"{a}|{p}" for a in algorithms[collective] for p in PLACEMENTS]
        calls = {cand: (lambda a, p: lambda: cases[p].call(a))(*cand.split("|")) for cand in candidates}
        if probes is not None:
            for m in sorted({max(reported // world, 1), reported}):
                for kind in probing.Probe.KINDS:
                    calls[f"probe|{kind}|{m}"] = probing.Probe(kind, m)
            candidates = list(calls)
        for cand in candidates:  # warm-up: first calls pay for buffers, connections, pages
            for _ in range(n_warm):
                calls[cand]()

        def measure(cand):
            return measuring.max_over_ranks(measuring.timed(calls[cand], n_iter))

        samples = measuring.interleaved_trials(candidates, trials, measure)
        for cand in candidates:
            if cand.startswith("probe|"):
                _, kind, m = cand.split("|")
                probes.setdefault(collective, {}).setdefault(kind, []).append(
                    (int(m), measuring.median(samples[cand])))
        wrong = {}
        for cand in (c for c in candidates if not c.startswith("probe|")):  # the check, outside the timed loop
            a, p = cand.split("|")
            cases[p].fill()
            dist.barrier()
            cases[p].call(a)
            wrong[cand] = int(measuring.sum_over_ranks(cases[p].wrong()))
        del cases, calls
        for a in algorithms[collective]:
            row = {"collective": collective, "algorithm": a, "bytes": reported, "count": numel,
                   "dtype": dtype, "world_size": world, "iters": n_iter}
            for p in PLACEMENTS:
                times = samples[f"{a}|{p}"]
                t = measuring.median(times)
                algbw = reported / t if t > 0 else math.nan
                row[p] = {"time_s": t, "trials_s": times, "algbw": algbw,
                          "busbw": algbw * bus_factor(collective, world), "wrong": wrong[f"{a}|{p}"]}
            rows.append(row)
        group = rows[-len(algorithms[collective]):]
        base = next((x for x in group if x["algorithm"] == baseline), None)  # no baseline: no ratio
        for row in group:
            for p in PLACEMENTS:
                ok = base is not None and base[p]["busbw"] > 0
                row[p]["ratio"] = row[p]["busbw"] / base[p]["busbw"] if ok else math.nan
        if progress:
            workbench.report(step=step, total=len(plan), collective=collective, bytes=reported)
    return rows


def page_faults(collectives, algorithms, nbytes: int, *, calls: int = 10, placement: str = "in-place",
                dtype: str = "float32") -> list[dict]:
    """Minor page faults and seconds per call of each algorithm at one size; call on every rank.

    A page fault is the kernel handing a process a fresh page of memory the first time it is
    touched (a few hundred nanoseconds to a microsecond per 4 KiB page, zeroing included).
    A collective that allocates its working buffers on every call, and whose allocator returns
    them to the kernel between calls, pays a fault for every page of them on every call; one
    that works in the caller's buffers, or keeps its own, pays none once warm. Counted for the
    whole process (``getrusage``: gloo's own threads included) over ``calls`` calls after two
    warm-up calls, for the rank with the most. Returns one row per (collective, algorithm):
    ``faults_per_call``, ``time_s`` (the slowest rank's), ``fault_s`` (seconds per fault on
    this machine, from :func:`fault_cost`) and ``faulting_s`` = faults x seconds per fault.
    """
    world = dist.get_world_size()
    torch_dtype = DTYPES[dtype]
    esize = torch.tensor([], dtype=torch_dtype).element_size()
    per_fault = measuring.max_over_ranks(fault_cost())
    rows = []
    for collective in collectives:
        numel, reported = counts(collective, nbytes, world, esize)
        case = _make_case(collective, numel, placement, torch_dtype)
        for a in algorithms[collective]:
            for _ in range(2):  # warm-up: connections, first-touch of the caller's buffers
                case.call(a)
            dist.barrier()
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds = measuring.timed(lambda: case.call(a), calls)
            faults = (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / calls
            faults = measuring.max_over_ranks(faults)
            rows.append({"collective": collective, "algorithm": a, "bytes": reported, "placement": placement,
                         "faults_per_call": faults, "time_s": measuring.max_over_ranks(seconds),
                         "fault_s": per_fault, "faulting_s": faults * per_fault})
    return rows


def _bytes_written() -> int | None:
    """Bytes this process has handed to ``write``-like system calls (``/proc/self/io`` wchar:
    every socket send of every thread, gloo's included), or None where Linux's counter is missing."""
    try:
        with open("/proc/self/io") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("wchar:"))
    except (OSError, StopIteration, ValueError):
        return None


def gloo_structure(nbytes: int, *, calls: int = 10, trials: int = 7) -> list[dict]:
    """Why gloo's own all-gather and reduce-scatter are slower than our rings; call on every rank.

    Reading ``ProcessGroupGloo`` (torch) and ``gloo/allgather.cc``: gloo's all-gather is a ring
    too, but torch runs it on its worker thread into a fresh flat ``p n`` buffer and then copies
    that into the caller's ``p`` output tensors; gloo has no reduce-scatter, so torch copies this
    rank's block into the output, clones the others and runs **one all-reduce per block**: ``p``
    all-reduces of ``n`` bytes, twice the bytes of a ring reduce-scatter on the wire and every
    block reduced. This rebuilds each structure from parts whose cost is known, beside ``native``
    and our ``ring``, in the same interleaved trials, at ``nbytes`` (nccl-tests size: the whole
    gathered or scattered buffer, float32)::

        all_gather      native | ring | ring as torch runs gloo's (worker thread, fresh flat
                        output, copied out)
        reduce_scatter  native | ring | one native all-reduce per block (own block into the
                        output, the others cloned)

    Returns one row per (collective, variant): ``time_s`` (median over trials of the slowest
    rank's mean), ``sent_bytes`` (bytes this rank wrote to its sockets per call, rank 0's,
    None without ``/proc/self/io``) and ``faults_per_call`` (rank 0's minor page faults).
    """
    world, rank = dist.get_world_size(), dist.get_rank()
    n = counts("all_gather", nbytes, world, 4)[0]
    x, out = torch.randn(n), torch.empty(n)
    outs, ins = [torch.empty(n) for _ in range(world)], [torch.randn(n) for _ in range(world)]
    worker = concurrent.futures.ThreadPoolExecutor(1)  # plays torch's gloo worker thread

    def gather_as_gloo() -> None:
        flat = torch.empty(world * n)  # fresh on every call, as torch's AsyncAllgatherWork does
        comm.all_gather(list(flat.chunk(world)), x, algorithm="ring")
        for i, o in enumerate(outs):
            o.copy_(flat[i * n:(i + 1) * n])

    def scatter_as_gloo() -> None:
        blocks = [out.copy_(ins[i]) if i == rank else ins[i].clone() for i in range(world)]
        for b in blocks:
            comm.all_reduce(b)  # native: gloo's own ring all-reduce

    variants = {
        ("all_gather", "native"): lambda: comm.all_gather(outs, x),
        ("all_gather", "ring"): lambda: comm.all_gather(outs, x, algorithm="ring"),
        ("all_gather", "ring as torch runs gloo's"): lambda: worker.submit(gather_as_gloo).result(),
        ("reduce_scatter", "native"): lambda: comm.reduce_scatter(out, ins),
        ("reduce_scatter", "ring"): lambda: comm.reduce_scatter(out, ins, algorithm="ring"),
        ("reduce_scatter", "one native all-reduce per block"): scatter_as_gloo,
    }
    sent = {k: 0.0 for k in variants}
    faults = {k: 0.0 for k in variants}
    try:
        for f in variants.values():
            for _ in range(2):  # warm-up
                f()

        def measure(key) -> float:
            w0, f0 = _bytes_written(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            seconds = measuring.timed(variants[key], calls)
            w1, f1 = _bytes_written(), resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            sent[key] = None if w0 is None or w1 is None else (w1 - w0) / calls
            faults[key] += (f1 - f0) / calls / trials
            return measuring.max_over_ranks(seconds)

        samples = measuring.interleaved_trials(list(variants), trials, measure)
    finally:
        worker.shutdown()
    return [{"collective": c, "variant": v, "bytes": counts(c, nbytes, world, 4)[1],
             "time_s": measuring.median(samples[(c, v)]), "sent_bytes": sent[(c, v)],
             "faults_per_call": faults[(c, v)]} for c, v in variants]


def fault_cost(nbytes: int = 64 << 20) -> float:
    """Seconds per minor page fault on this machine: the first touch of a fresh ``nbytes`` buffer
    (``mmap``-backed at this size, so every page faults) less a second touch of the same pages,
    divided by the faults counted. Timed in this thread's CPU time (``time.thread_time``, kernel
    time included), one intra-op thread, so that other processes' load does not count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    samples = []
    try:
        for _ in range(3):
            buf = torch.empty(nbytes, dtype=torch.uint8)
            before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.thread_time()
            buf.fill_(1)
            first = time.thread_time() - start
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
            start = time.thread_time()
            buf.fill_(2)
            second = time.thread_time() - start
            del buf
            if faults > 0:
                samples.append(max(first - second, 0.0) / faults)
    finally:
        torch.set_num_threads(threads)
    return measuring.median(samples) if samples else 0.0


def _rank_main(config: dict) -> dict:
    emulated = _emulated(config)
    probes = {} if config["predict"] and not emulated else None
    out = {"rows": sweep(config["collectives"], config["algorithms"], config["sizes"],
                         trials=config["trials"], warmup=config["warmup"], iters=config["iters"],
                         budget_bytes=config["budget"], dtype=config["dtype"], probes=probes,
                         baseline="ring" if emulated else "native")}
    if config["predict"]:
        if emulated:  # the links come from the topology; the fit gives the machine's reductions and copies
            fitted = probing.fit(pingpong_sizes=tuple(8 << k for k in range(0, 19, 3)), exchange_sizes=None,
                                 curves=False)
            # reductions and copies at their measured cost per size (a line fitted from 8 KiB up
            # prices an 8 MiB reduction at the speed of a cache-hot one)
            fitted["model"] = cost.with_curves(fitted["model"], reduction=fitted["reduction"], copy=fitted["copy"])
        else:   # the model's sizes up to the sweep's largest (1 MiB at least, for the bandwidth term's range)
            top = max(max(config["sizes"]), 1 << 20)
            fitted = probing.fit(pingpong_sizes=[n for n in probing.DEFAULT_PINGPONG_SIZES if n <= top],
                                 reduction_sizes=[n for n in probing.DEFAULT_REDUCTION_SIZES if n <= top],
                                 exchange_sizes=[n for n in probing.DEFAULT_EXCHANGE_SIZES if n <= top])
        fitted["probes"] = probes
        out["cost"] = fitted
    return out


def _topology(config: dict):
    return Topology.parse(config["topology"]) if config.get("topology") else None


def _emulated(config: dict) -> bool:
    topo = _topology(config)
    return topo is not None and topo.emulated


def models_for(model, probes: dict | None) -> dict:
    """``{collective: model}``: ``model`` with the primitives probed in that collective's trials
    put in its curves (they replace the fit's own points at the same sizes).

    A message costs more while a big collective keeps the caches busy than in the fit's quiet
    loop, so each collective is predicted from what its own trials measured.
    """
    return {c: cost.with_curves(model, **kinds) for c, kinds in (probes or {}).items()}


# -------------------------------------------------------------------------------------- report

def table(rows: list[dict], collective: str, model=None, topology=None, baseline: str = "native") -> str:
    """The nccl-tests-style table of one collective's rows; ``model``: the cost model to predict
    them with (the pred and err% columns; see :func:`models_for`), or None; ``topology``: the
    emulated cluster the rows ran on (predictions price each message on its link)."""
    flat = []
    for row in (r for r in rows if r["collective"] == collective):
        cells = {"size": row["bytes"], "count": row["count"], "algorithm": row["algorithm"], "iters": row["iters"]}
        for p, tag in zip(PLACEMENTS, ("o", "i")):
            m = row[p]
            cells.update({f"{tag}time": m["time_s"] * 1e6, f"{tag}algbw": m["algbw"] / 1e9,
                          f"{tag}busbw": m["busbw"] / 1e9, f"{tag}wrong": m["wrong"],
                          f"{tag}ratio": None if row["algorithm"] == baseline else m.get("ratio")})
        if model is not None:
            pred = model.predict(collective, row["algorithm"], row["bytes"], row["world_size"], topology=topology)
            cells["pred"] = pred * 1e6
            cells["err"] = 100 * (pred / row["in-place"]["time_s"] - 1)
        flat.append(cells)
    columns = [("size", "size(B)", "{:d}"), ("count", "count", "{:d}"), ("algorithm", "algorithm", "s"),
               ("iters", "iters", "{:d}")]
    for tag, name in (("o", "out"), ("i", "in")):
        columns += [(f"{tag}time", f"{name}:time(us)", "{:.1f}"), (f"{tag}algbw", "algbw(GB/s)", "{:.3f}"),
                    (f"{tag}busbw", "busbw(GB/s)", "{:.3f}"), (f"{tag}wrong", "#wrong", "{:d}"),
                    (f"{tag}ratio", f"x {baseline}", "{:.2f}")]
    if model is not None:
        columns += [("pred", "pred(us)", "{:.1f}"), ("err", "err%", "{:+.0f}")]
    world = rows[0]["world_size"] if rows else 0
    title = (f"{collective}  world size {world}  dtype {rows[0]['dtype'] if rows else ''}  "
             f"busbw factor {bus_factor(collective, world):.3g}  median of trials; time = slowest rank")
    if topology is not None:
        title += f"\ntopology {topology}"
    return measuring.format_table(flat, columns, title=title)


def speedups(rows: list[dict], model, topology, fast: str = "hierarchical", slow: str = "ring") -> list[dict]:
    """Measured against predicted speed-up of ``fast`` over ``slow`` (in-place times), one row per
    collective and size where both ran: ``{"collective", "bytes", "measured", "predicted", "error"}``."""
    out = []
    index = {(r["collective"], r["algorithm"], r["bytes"]): r for r in rows}
    for (c, a, n), r in index.items():
        other = index.get((c, slow, n))
        if a != fast or other is None:
            continue
        measured = other["in-place"]["time_s"] / r["in-place"]["time_s"]
        predicted = (model.predict(c, slow, n, r["world_size"], topology=topology)
                     / model.predict(c, fast, n, r["world_size"], topology=topology))
        out.append({"collective": c, "bytes": n, "slow_s": other["in-place"]["time_s"],
                    "fast_s": r["in-place"]["time_s"], "measured": measured, "predicted": predicted,
                    "error": measured / predicted - 1.0})
    return out


def speedup_table(rows: list[dict], fast: str = "hierarchical", slow: str = "ring") -> str:
    columns = [("collective", "collective", "s"), ("bytes", "size(B)", "{:d}"),
               ("slow_us", f"{slow}(us)", "{:.0f}"), ("fast_us", f"{fast}(us)", "{:.0f}"),
               ("measured", "measured x", "{:.2f}"), ("predicted", "predicted x", "{:.2f}"),
               ("err", "err%", "{:+.0f}")]
    flat = [{**r, "slow_us": r["slow_s"] * 1e6, "fast_us": r["fast_s"] * 1e6, "err": 100 * r["error"]} for r in rows]
    return measuring.format_table(flat, columns, title=f"{fast} against {slow}: speed-up measured (in-place "
                                                      "medians) and predicted by the cost model")


def plot(rows: list[dict], path, placement: str = "in-place", cols: int = 2):
    """busbw against size (log x), one panel per collective (``cols`` per row), one line per algorithm."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    if isinstance(cols, bool) or not isinstance(cols, int) or cols < 1:
        raise ValueError(f"cols={cols!r} must be a whole number of panels per row, at least 1")
    collectives = [c for c in COLLECTIVES if any(r["collective"] == c for r in rows)]
    cols = min(len(collectives), cols) or 1
    nrows = math.ceil(len(collectives) / cols) or 1
    fig, axes = plt.subplots(nrows, cols, figsize=(6.0 * cols, 4.2 * nrows), squeeze=False)
    for ax, c in zip(axes.flat, collectives):
        algs = list(dict.fromkeys(r["algorithm"] for r in rows if r["collective"] == c))
        for a in algs:
            pts = [(r["bytes"], r[placement]["busbw"] / 1e9) for r in rows
                   if r["collective"] == c and r["algorithm"] == a]
            ax.plot(*zip(*pts), marker="o", ms=3, lw=2.5 if a == "native" else 1.3,
                    color="black" if a == "native" else None, label=a)
        ax.set_xscale("log", base=2)
        ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: measuring.format_bytes(v)))
        ax.set_title(f"{c} ({rows[0]['world_size']} ranks)")
        ax.set_xlabel("size (bytes)")
        ax.set_ylabel("busbw (GB/s)")
        ax.grid(alpha=0.3)
        ax.set_ylim(bottom=0)
        ax.legend(fontsize=9)
    for ax in list(axes.flat)[len(collectives):]:
        ax.axis("off")
    fig.suptitle(f"busbw, {placement}, median of trials", fontsize=12)
    fig.tight_layout()
    if path is not None:
        fig.savefig(path, dpi=110)
    return fig


# ------------------------------------------------------------------------------------------ CLI

def _names(values: list[str] | None) -> list[str] | None:
    if values is None:
        return None
    return [v for item in values for v in item.split(",") if v]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--collectives", nargs="+", metavar="NAME",
                        help=f"which collectives (default: all of {', '.join(COLLECTIVES)})")
    parser.add_argument("--algorithms", nargs="+", metavar="NAME",
                        help="which of our algorithms, by name (default: every one the collective has); "
                             "native is always measured as the baseline")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--min-bytes", default="8", help="smallest size, e.g. 8, 1K (default 8)")
    parser.add_argument("--max-bytes", default="64M", help="largest size (default 64M)")
    parser.add_argument("--factor", type=int, default=4, help="size multiplier between rows (default 4)")
    parser.add_argument("--trials", type=int, default=7, help="interleaved trials per size, median shown (default 7)")
    parser.add_argument("--warmup", type=int, default=5, help="warm-up calls per algorithm and size (default 5)")
    parser.add_argument("--iters", type=int, default=50, help="timed calls per trial for small sizes (default 50)")
    parser.add_argument("--budget", default="256M",
                        help="bytes one trial may move: big sizes run budget/size iterations, at least 1 (default 256M)")
    parser.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="element type (default float32)")
    parser.add_argument("--topology", default=None, metavar="SPEC",
                        help="run on an emulated cluster: a topology spec or preset, e.g. "
                             "'ranks_per_node=2,intra=500us@200MB/s,inter=500us@20MB/s' or 'nvlink-3.2tbps,"
                             "ranks_per_node=2' (adds the hierarchical algorithms; see workbench.comm.topology)")
    parser.add_argument("--no-predict", dest="predict", action="store_false",
                        help="skip fitting the alpha-beta cost model (pred/err columns)")
    parser.add_argument("--out", default=None, help="folder for results.json and busbw.png "
                                                    "(default runs/bench-collectives-<timestamp>/)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds before the ranks are stopped")


def configure(args: argparse.Namespace) -> dict:
    """Validate the parsed arguments against ``comm.ALGORITHMS``; return the sweep's config."""
    topology = None
    if getattr(args, "topology", None):
        try:
            topology = comm.Topology.parse(args.topology)
        except (ValueError, TypeError) as e:
            raise ValueError(f"--topology {args.topology!r}: {e}") from None
        topology.check_world(args.world_size)
    default = ["all_reduce", "all_gather", "reduce_scatter"] if topology is not None else list(COLLECTIVES)
    collectives = _names(args.collectives) or default
    for c in collectives:
        if c not in COLLECTIVES:
            raise ValueError(f"--collectives {c!r} is not a collective: use any of {', '.join(COLLECTIVES)}")
    wanted = _names(args.algorithms)
    algorithms = {}
    extra = comm.TOPOLOGY_ALGORITHMS if topology is not None else {}
    baseline = [] if topology is not None and topology.emulated else ["native"]  # it would be the ring again
    for c in collectives:
        have = [a for a in comm.ALGORITHMS.get(c, ()) + extra.get(c, ()) if a != "native"]
        if wanted is None:
            chosen = have
        else:
            chosen = [a for a in wanted if a in have and a != "native"]
        if not baseline and "ring" in have:  # the baseline of the ratios comes first
            chosen = ["ring"] + [a for a in chosen if a != "ring"]
        algorithms[c] = baseline + chosen
    if wanted is not None:
        needs = sorted({a for a in wanted for c in collectives if a in comm.TOPOLOGY_ALGORITHMS.get(c, ())})
        if needs and topology is None:
            raise ValueError(f"--algorithms {' '.join(needs)} needs to know which ranks share a node: "
                             "add --topology, e.g. --topology ranks_per_node=2")
        known = {a for c in collectives for a in comm.ALGORITHMS.get(c, ()) + comm.TOPOLOGY_ALGORITHMS.get(c, ())}
        unknown = [a for a in wanted if a not in known]
        if unknown:
            raise ValueError(f"--algorithms {' '.join(unknown)}: no such algorithm for "
                             f"{', '.join(collectives)}; known: {', '.join(sorted(known))}")
    if args.world_size < 2:
        raise ValueError(f"--world-size {args.world_size}: a collective needs at least 2 ranks")
    for name in ("trials", "iters"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name} {getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup {args.warmup} must be >= 0")
    sizes = measuring.size_sweep(measuring.parse_bytes(args.min_bytes), measuring.parse_bytes(args.max_bytes), args.factor)
    return {"collectives": collectives, "algorithms": algorithms, "sizes": sizes, "trials": args.trials,
            "warmup": args.warmup, "iters": args.iters, "budget": measuring.parse_bytes(args.budget),
            "dtype": args.dtype, "world_size": args.world_size, "predict": args.predict,
            "topology": str(topology) if topology is not None else None}


def run(config: dict, timeout: float = 1800.0) -> dict:
    """Launch the sweep; returns ``{"config", "machine", "rows", "cost"?}``."""
    start = time.time()
    result = workbench.launch(_rank_main, config["world_size"], args=(config,), timeout=timeout,
                              topology=_topology(config))[0]
    out = {"config": config, "machine": measuring.machine_info(), "elapsed_s": time.time() - start,
           "rows": result["rows"]}
    if "cost" in result:
        out["cost"] = dict(result["cost"])  # model, pingpong, exchange, reduction
    return out


def main(args: argparse.Namespace) -> int:
    try:
        config = configure(args)
    except ValueError as e:
        print(f"workbench bench collectives: error: {e}")
        return 2
    result = run(config, timeout=args.timeout)
    if workbench.rank() != 0:  # under torchrun only rank 0 reports
        return 0
    model = result.get("cost", {}).get("model")
    models = models_for(model, result.get("cost", {}).get("probes")) if model is not None else {}
    topology = _topology(config)
    baseline = "ring" if _emulated(config) else "native"
    for c in config["collectives"]:
        print(table(result["rows"], c, models.get(c, model), topology=topology, baseline=baseline))
        print()
    if topology is not None and model is not None:
        result["speedups"] = speedups(result["rows"], model, topology)
        if result["speedups"]:
            print(speedup_table(result["speedups"]))
            print()
    worst = sum(r[p]["wrong"] for r in result["rows"] for p in PLACEMENTS)
    if model is not None:
        print(f"# cost model: {model}")
    print(f"# #wrong total: {worst}   elapsed {result['elapsed_s']:.0f} s   "
          f"load average at end {result['machine'].get('load_average')}")
    out = Path(args.out) if args.out else measuring.default_out_dir("bench-collectives")
    out.mkdir(parents=True, exist_ok=True)
    data = dict(result)
    if model is not None:
        data["cost"] = dict(result["cost"], model=model.as_dict())
    measuring.write_json(out / "results.json", data)
    import matplotlib.pyplot as plt

    plt.close(plot(result["rows"], out / "busbw.png"))
    print(f"# wrote {out / 'results.json'} and {out / 'busbw.png'}")
    return 1 if worst else 0
