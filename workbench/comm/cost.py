"""The alpha-beta-gamma cost model: predict a collective's time from three numbers per machine.

The model (Hockney; Thakur, Rabenseifner and Gropp 2005)
--------------------------------------------------------
Sending one message of ``m`` bytes between two ranks costs ``alpha + m * beta``: ``alpha`` is
the latency (the fixed price of a message: system calls, the backend's bookkeeping, waking the
peer), ``beta`` the inverse bandwidth in seconds per byte. Reducing ``m`` bytes into a buffer
(``a += b``) costs ``m * gamma``. An algorithm is a schedule of rounds of messages, so its time
is a sum of such terms; with ``n`` bytes and ``p`` ranks (``lg p`` rounded up)::

    all_reduce  ring                2(p-1) a + 2(p-1)/p n b + (p-1)/p n g
                recursive_doubling  lg p (a + n b + n g)
                rabenseifner        2 lg p a + 2(p-1)/p n b + (p-1)/p n g
                reduce_broadcast    lg p (2 a + 2 n b + n g)       (binomial reduce, then broadcast)
    all_gather  ring                (p-1) a + (p-1)/p n b
                recursive_doubling  lg p a + (p-1)/p n b           (bruck: the same, any p)
    reduce_scatter ring             (p-1) a + (p-1)/p n (b + g)
                recursive_halving   lg p a + (p-1)/p n (b + g)
    broadcast   flat                (p-1)(a + n b)
                binomial            lg p (a + n b)
                scatter_allgather   (lg p + p - 1) a + 2(p-1)/p n b   (van de Geijn)
    reduce      flat                (p-1)(a + n b + n g)
                binomial            lg p (a + n b + n g)
    scatter, gather  flat           (p-1) a + (p-1)/p n b
                binomial            lg p a + (p-1)/p n b

``n`` is the size nccl-tests reports: the whole vector for all-reduce, broadcast and reduce,
the whole *gathered* (or scattered) buffer for all-gather, reduce-scatter, gather and scatter.
Recursive doubling/halving and Rabenseifner on a world size that is not a power of two first
fold the ``p - 2^k`` extra ranks into partners (one message of the vector and a reduction) and
unfold at the end (one more message): those terms are added. ``native`` is predicted as the
algorithm gloo uses (:data:`NATIVE_AS`); that is an assumption about gloo, not a measurement.

Why the best algorithm changes with size: the ``alpha`` terms count messages, the ``beta`` terms
count bytes. Recursive doubling sends the *whole* vector ``lg p`` times but only ``lg p``
messages; the ring sends only ``2(p-1)/p`` of the vector but ``2(p-1)`` messages. Small
messages are all latency, so few rounds win; large ones are all bandwidth, so few bytes win.
At ``p = 4`` recursive doubling costs ``2a + 2n b + 2n g`` and the ring ``6a + 1.5n b + 0.75n g``:
the ring wins from ``n = 4a / (0.5 b + 1.25 g)`` bytes up (:func:`crossover` finds it for any pair).

Fitting the three numbers (:func:`fit`, inside a launch)
---------------------------------------------------------
* alpha, beta: a ping-pong between ranks 0 and 1 over sizes from 8 B up; half the round trip is
  one message, ``t(m) = alpha + m beta``, fitted by least squares on the *relative* error so
  that the 8-byte and the 16-MiB points count alike.
* gamma: the slope of a local ``a.add_(b)`` timed over sizes, on one thread like a rank.

* alpha_duplex, beta_duplex: the same two ranks *exchange* messages (both send and receive at
  once), the step every ring, recursive-doubling and Rabenseifner round is made of, over the
  sizes collectives send (64 KiB up). The textbook assumes full-duplex links, so an exchange
  costs no more than one message. Two processes on a shared CPU talking over loopback TCP are
  not full duplex: every byte is copied by the CPU on both ends, so when both directions run at
  once each goes slower (``beta_duplex``, the slope). And a large exchange pays more than a
  ping-pong's latency per step (``alpha_duplex``, the intercept, about twice ``alpha`` here):
  gloo's rendezvous (a receive-ready notice must reach the sender before the data moves, and a
  message bigger than the socket buffer is handed over in pieces by gloo's I/O thread), and on
  a 2-vCPU VM a rank that blocks waiting may find its idle vCPU slow to wake. The ping-pong, a
  tight loop of small round trips, sees little of this. The formulas use ``alpha_duplex`` and
  ``beta_duplex`` for exchange steps and ``alpha``, ``beta`` for one-way steps (trees, flat,
  fold-in/out). ``None`` for either is the textbook model.

The model is a straight line through a machine that is not a straight line (caches, TCP
segmenting, another process on the core): :func:`compare` shows how far off it is, size by size.
"""
from __future__ import annotations

import math
import statistics
import time
from dataclasses import asdict, dataclass
from typing import Iterable, Sequence

import torch

# the algorithm gloo runs for ``algorithm="native"`` (on CPU); see the module docstring
NATIVE_AS = {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring", "broadcast": "binomial",
             "reduce": "binomial", "gather": "flat", "scatter": "flat"}

# the textbook formula of each algorithm, as shown in tables and the lesson
FORMULAS = {
    ("all_reduce", "ring"): "2(p-1) a + 2(p-1)/p n b + (p-1)/p n g",
    ("all_reduce", "recursive_doubling"): "lg p (a + n b + n g)",
    ("all_reduce", "rabenseifner"): "2 lg p a + 2(p-1)/p n b + (p-1)/p n g",
    ("all_reduce", "reduce_broadcast"): "lg p (2a + 2n b + n g)",
    ("all_gather", "ring"): "(p-1) a + (p-1)/p n b",
    ("all_gather", "recursive_doubling"): "lg p a + (p-1)/p n b",
    ("all_gather", "bruck"): "lg p a + (p-1)/p n b",
    ("reduce_scatter", "ring"): "(p-1) a + (p-1)/p n (b + g)",
    ("reduce_scatter", "recursive_halving"): "lg p a + (p-1)/p n (b + g)",
    ("broadcast", "flat"): "(p-1)(a + n b)",
    ("broadcast", "binomial"): "lg p (a + n b)",
    ("broadcast", "scatter_allgather"): "(lg p + p - 1) a + 2(p-1)/p n b",
    ("reduce", "flat"): "(p-1)(a + n b + n g)",
    ("reduce", "binomial"): "lg p (a + n b + n g)",
    ("scatter", "flat"): "(p-1) a + (p-1)/p n b",
    ("scatter", "binomial"): "lg p a + (p-1)/p n b",
    ("gather", "flat"): "(p-1) a + (p-1)/p n b",
    ("gather", "binomial"): "lg p a + (p-1)/p n b",
}


def _lg(p: int) -> int:
    return (p - 1).bit_length()  # ceil(log2 p); 0 for p = 1


def _fold(p: int) -> tuple[int, bool]:
    """Largest power of two <= p, and whether p is not one (extra ranks fold in and out)."""
    q = 1 << (p.bit_length() - 1)
    return q, q != p


@dataclass(frozen=True)
class CostModel:
    """Three numbers for a machine: ``alpha`` (s per message), ``beta`` (s per byte sent),
    ``gamma`` (s per byte reduced), and optionally ``beta_duplex`` (s per byte sent while also
    receiving, in exchange steps; None: the same as ``beta``, as in the textbook) and
    ``alpha_duplex`` (s per exchange step; None: the same as ``alpha``).
    ``predict`` turns them into a collective's time."""

    alpha: float
    beta: float
    gamma: float
    beta_duplex: float | None = None
    alpha_duplex: float | None = None

    def __post_init__(self):
        for name in ("alpha", "beta", "gamma", "beta_duplex", "alpha_duplex"):
            value = getattr(self, name)
            if name.endswith("_duplex") and value is None:
                continue
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative number of seconds "
                                 f"({'per message' if name.startswith('alpha') else 'per byte'})")

    def predict(self, collective: str, algorithm: str, nbytes: int, world_size: int) -> float:
        """Predicted seconds; see :func:`predict`."""
        return predict(collective, algorithm, nbytes, world_size, self)

    @property
    def bandwidth(self) -> float:
        """1 / beta, bytes per second."""
        return 1.0 / self.beta if self.beta > 0 else math.inf

    def as_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        text = (f"alpha = {self.alpha * 1e6:.1f} us, beta = {self.beta * 1e9:.3f} ns/B "
                f"({self.bandwidth / 1e9:.2f} GB/s)")
        if self.alpha_duplex is not None:
            text += f", alpha_duplex = {self.alpha_duplex * 1e6:.1f} us"
        if self.beta_duplex is not None:
            text += f", beta_duplex = {self.beta_duplex * 1e9:.3f} ns/B"
        return text + (f", gamma = {self.gamma * 1e9:.3f} ns/B "
                       f"({(1 / self.gamma if self.gamma else math.inf) / 1e9:.2f} GB/s)")


def predict(collective: str, algorithm: str, nbytes: int, world_size: int, model: CostModel) -> float:
    """Seconds ``algorithm`` takes for ``collective`` of ``nbytes`` on ``world_size`` ranks.

    ``nbytes`` follows nccl-tests (the whole gathered buffer for all_gather, reduce_scatter,
    gather and scatter). ``algorithm="native"`` is predicted as :data:`NATIVE_AS`.
    """
    if not isinstance(model, CostModel):
        raise TypeError(f"model={model!r} must be a CostModel: fit one with cost.measure() or "
                        "build one with CostModel(alpha=..., beta=..., gamma=...)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a whole number >= 1")
    if nbytes < 0:
        raise ValueError(f"nbytes={nbytes!r} must be >= 0")
    if algorithm == "native":
        if collective not in NATIVE_AS:
            raise ValueError(f"collective={collective!r} is not known: use one of {sorted(NATIVE_AS)}")
        algorithm = NATIVE_AS[collective]
    if (collective, algorithm) not in FORMULAS:
        known = sorted(a for c, a in FORMULAS if c == collective)
        if not known:
            raise ValueError(f"collective={collective!r} is not known: use one of {sorted(NATIVE_AS)}")
        raise ValueError(f"algorithm={algorithm!r} has no cost formula for {collective}: use one of "
                         f"{known + ['native']}")
    a, b, g = model.alpha, model.beta, model.gamma
    x = model.beta if model.beta_duplex is None else model.beta_duplex  # bytes of exchange steps
    e = model.alpha if model.alpha_duplex is None else model.alpha_duplex  # latency of exchange steps
    p, n = world_size, float(nbytes)
    if p == 1:
        return 0.0
    lg = _lg(p)
    share = (p - 1) / p * n  # the bytes a bandwidth-optimal algorithm moves per rank
    q, odd = _fold(p)
    lgq = _lg(q)
    fold_in = (a + n * b + n * g) if odd else 0.0  # an extra rank hands its vector to a partner
    fold_out = (a + n * b) if odd else 0.0  # and gets the result back at the end

    # exchange steps (ring, recursive doubling/halving, Rabenseifner, Bruck) cost e + bytes * x,
    # one-way steps (trees, flat, fold-in/out) a + bytes * b
    if collective == "all_reduce":
        if algorithm == "ring":
            return 2 * (p - 1) * e + 2 * share * x + share * g
        if algorithm == "recursive_doubling":
            return fold_in + lgq * (e + n * x + n * g) + fold_out
        if algorithm == "rabenseifner":
            sq = (q - 1) / q * n
            return fold_in + 2 * lgq * e + 2 * sq * x + sq * g + fold_out
        if algorithm == "reduce_broadcast":
            return lg * (2 * a + 2 * n * b + n * g)
    if collective == "all_gather":
        if algorithm == "ring":
            return (p - 1) * e + share * x
        return lg * e + share * x  # recursive_doubling, bruck
    if collective == "reduce_scatter":
        if algorithm == "ring":
            return (p - 1) * e + share * (x + g)
        return lgq * e + share * (x + g) + ((2 * a + n * b + n * g) if odd else 0.0)  # fold in and out
    if collective == "broadcast":
        if algorithm == "flat":
            return (p - 1) * (a + n * b)
        if algorithm == "binomial":
            return lg * (a + n * b)
        return lg * a + (p - 1) * e + share * b + share * x  # scatter_allgather: tree scatter, ring all-gather
    if collective == "reduce":
        if algorithm == "flat":
            return (p - 1) * (a + n * b + n * g)
        return lg * (a + n * b + n * g)
    # scatter, gather
    if algorithm == "flat":
        return (p - 1) * a + share * b
    return lg * a + share * b


def crossover(collective: str, small: str, large: str, world_size: int, model: CostModel,
              lo: int = 1, hi: int = 1 << 34) -> float:
    """Smallest size (bytes) from which ``large`` is predicted at least as fast as ``small``.

    ``math.inf`` if ``large`` never catches up below ``hi``; ``lo`` if it is never slower.
    Found by bisection on sizes, since both costs are straight lines in ``n``.
    """
    def faster(n):
        return predict(collective, large, n, world_size, model) <= predict(collective, small, n, world_size, model)

    if faster(lo):
        return float(lo)
    if not faster(hi):
        return math.inf
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if faster(mid) else (mid, hi)
    return float(hi)


# ------------------------------------------------------------------------------------- fitting

def fit_line(points: Iterable[tuple[float, float]]) -> tuple[float, float]:
    """``(intercept, slope)`` of ``t = intercept + slope * x`` minimising the *relative* error.

    Weighted least squares with weights ``1/t^2``: each point's error is counted as a fraction of
    its own time, so microsecond points are not drowned by millisecond ones. Both numbers are
    clamped at zero (a negative latency or bandwidth cost is a fit artefact, not a machine).
    """
    pts = [(float(x), float(t)) for x, t in points if t > 0]
    if len(pts) < 2:
        raise ValueError(f"need at least 2 timed points with t > 0 to fit a line, got {len(pts)}")
    sw = sx = sy = sxx = sxy = 0.0
    for x, t in pts:
        w = 1.0 / (t * t)
        sw, sx, sy = sw + w, sx + w * x, sy + w * t
        sxx, sxy = sxx + w * x * x, sxy + w * x * t
    det = sw * sxx - sx * sx
    if det <= 0:
        raise ValueError("the points have a single x value: time at least two different sizes")
    slope = (sw * sxy - sx * sy) / det
    intercept = (sy - slope * sx) / sw
    if slope < 0:  # refit a constant
        slope, intercept = 0.0, sy / sw
    if intercept < 0:  # refit through the origin
        intercept, slope = 0.0, sxy / sxx
    return intercept, slope


def _time_pair(sizes, step, messages: int, *, iterations: int, budget_bytes: int, repeats: int,
               group) -> list[tuple[int, float]]:
    """Seconds per message for ``step(x, y, peer)`` run by ranks 0 and 1 on ``bytes``-sized buffers.

    ``step`` carries ``messages`` messages per call on each rank. Each size is timed ``repeats``
    times after one warm-up round (connections, page faults), the median kept and broadcast from
    rank 0, so every rank returns the same numbers. Ranks other than 0 and 1 only take part in the
    barriers.
    """
    import torch.distributed as dist

    rank = dist.get_rank(group)
    peer = {0: 1, 1: 0}.get(rank)
    to_global = (lambda r: dist.get_global_rank(group, r)) if group is not None else (lambda r: r)
    out = []
    for nbytes in sizes:
        x = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
        y = torch.empty_like(x)
        iters = max(2, min(iterations, budget_bytes // max(nbytes, 1)))
        samples = []
        for k in range(repeats + 1):  # the first round warms up and is dropped
            dist.barrier(group=group)
            start = time.perf_counter()
            if peer is not None:
                for _ in range(iters):
                    step(x, y, to_global(peer))
            if k:
                samples.append((time.perf_counter() - start) / (messages * iters))
        t = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        dist.broadcast(t, to_global(0), group=group)
        out.append((nbytes, float(t.item())))
    return out


def pingpong(sizes: Sequence[int], *, iterations: int = 20, budget_bytes: int = 32 << 20,
             repeats: int = 3, group=None) -> list[tuple[int, float]]:
    """One-way message time ``(bytes, seconds)`` per size between ranks 0 and 1 (call on every rank).

    Rank 0 sends, rank 1 sends the same bytes back; half the round trip is one message.
    """
    import torch.distributed as dist

    world = dist.get_world_size(group)
    if world < 2:
        raise ValueError(f"pingpong needs at least 2 ranks, got world size {world}")
    first = dist.get_rank(group) == 0

    def round_trip(x, y, peer):
        if first:
            dist.send(x, peer, group=group)
            dist.recv(x, peer, group=group)
        else:
            dist.recv(x, peer, group=group)
            dist.send(x, peer, group=group)

    return _time_pair(sizes, round_trip, 2, iterations=iterations, budget_bytes=budget_bytes,
                      repeats=repeats, group=group)


def exchange(sizes: Sequence[int], *, iterations: int = 20, budget_bytes: int = 32 << 20,
             repeats: int = 3, group=None) -> list[tuple[int, float]]:
    """Time ``(bytes, seconds)`` of ranks 0 and 1 swapping ``bytes`` at once (call on every rank).

    Both post a receive and a send, then wait for both: one step of a ring or of recursive
    doubling on two ranks. Its slope is ``beta_duplex``, its intercept ``alpha_duplex``.
    """
    import torch.distributed as dist

    def swap(x, y, peer):
        r = dist.irecv(y, peer, group=group)
        s = dist.isend(x, peer, group=group)
        r.wait()
        s.wait()

    return _time_pair(sizes, swap, 1, iterations=iterations, budget_bytes=budget_bytes,
                      repeats=repeats, group=group)


def reduction_time(sizes: Sequence[int], *, dtype: torch.dtype = torch.float32, iterations: int = 20,
                   budget_bytes: int = 64 << 20, repeats: int = 3) -> list[tuple[int, float]]:
    """Seconds of a local ``a.add_(b)`` on ``bytes`` of ``dtype`` (this thread only)."""
    out = []
    esize = torch.tensor([], dtype=dtype).element_size()
    for nbytes in sizes:
        numel = max(nbytes // esize, 1)
        a, b = torch.ones(numel, dtype=dtype), torch.ones(numel, dtype=dtype)
        iters = max(2, min(iterations, budget_bytes // max(nbytes, 1)))
        a.add_(b)  # warm the pages
        samples = []
        for _ in range(repeats):
            start = time.perf_counter()
            for _ in range(iters):
                a.add_(b)
            samples.append((time.perf_counter() - start) / iters)
        out.append((numel * esize, statistics.median(samples)))
    return out


DEFAULT_PINGPONG_SIZES = tuple(8 * 4 ** k for k in range(12))  # 8 B .. 32 MiB
DEFAULT_REDUCTION_SIZES = tuple(64 * 1024 * 4 ** k for k in range(5))  # 64 KiB .. 16 MiB
DEFAULT_EXCHANGE_SIZES = tuple(64 * 1024 * 4 ** k for k in range(5))  # 64 KiB .. 16 MiB: the slope is what counts


def fit(pingpong_sizes: Sequence[int] = DEFAULT_PINGPONG_SIZES,
        reduction_sizes: Sequence[int] = DEFAULT_REDUCTION_SIZES,
        exchange_sizes: Sequence[int] | None = DEFAULT_EXCHANGE_SIZES, *, group=None) -> dict:
    """Fit alpha, beta, gamma (and alpha_duplex, beta_duplex) on this machine; call on every rank.

    Returns ``{"model": CostModel, "pingpong": [(bytes, s)], "exchange": [(bytes, s)],
    "reduction": [(bytes, s)]}``, the same on every rank (rank 0's measurements, broadcast).
    ``exchange_sizes=None`` skips the exchange and leaves ``alpha_duplex`` and ``beta_duplex`` None
    (the textbook model).
    """
    import torch.distributed as dist

    # as many calls per size as the benchmark makes (50, 7 trials): on this VM a message is either
    # fast or pays a wake-up penalty at random, and the fit must see both as often as a collective does
    pp = pingpong(pingpong_sizes, iterations=50, repeats=7, group=group)
    alpha, beta = fit_line(pp)
    ex = exchange(exchange_sizes, iterations=50, repeats=7, group=group) if exchange_sizes else []
    alpha_duplex, beta_duplex = fit_line(ex) if ex else (None, None)
    red = reduction_time(reduction_sizes)
    t = torch.tensor([s for _, s in red], dtype=torch.float64)
    dist.broadcast(t, dist.get_global_rank(group, 0) if group is not None else 0, group=group)
    red = [(n, float(s)) for (n, _), s in zip(red, t.tolist())]
    _, gamma = fit_line(red)
    return {"model": CostModel(alpha=alpha, beta=beta, gamma=gamma, beta_duplex=beta_duplex,
                               alpha_duplex=alpha_duplex),
            "pingpong": pp, "exchange": ex, "reduction": red}


def measure(world_size: int = 2, **kwargs) -> dict:
    """Fit the model from outside a launch: starts ``world_size`` ranks and runs :func:`fit`."""
    from workbench.launch import launch

    return launch(fit, world_size, kwargs=kwargs)[0]


def compare(model: CostModel, measurements: Iterable[dict]) -> list[dict]:
    """Predicted against measured, one row per measurement.

    Each measurement is a dict with ``collective``, ``algorithm``, ``bytes``, ``world_size`` and
    ``time_s`` (e.g. the rows ``workbench bench collectives`` writes); the returned rows add
    ``predicted_s`` and ``error`` = predicted / measured - 1 (0.25 means 25% too slow a guess).
    """
    rows = []
    for m in measurements:
        pred = predict(m["collective"], m["algorithm"], int(m["bytes"]), int(m["world_size"]), model)
        meas = float(m["time_s"])
        rows.append({**m, "predicted_s": pred, "error": (pred / meas - 1.0) if meas > 0 else math.nan})
    return rows
