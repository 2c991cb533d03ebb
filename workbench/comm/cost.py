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
    all_to_all_single  pairwise     (p-1) a + (p-1)/p n b
                bruck               lg p a + (lg p/2) n b           (power of two; even splits)

``n`` is the size nccl-tests reports: the whole vector for all-reduce, broadcast and reduce,
the whole *gathered* (or scattered) buffer for all-gather, reduce-scatter, gather and scatter,
one rank's whole input for all-to-all (even splits).
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

The numbers and where they come from
------------------------------------
:mod:`workbench.measure.probes` measures them (inside a launch; ``probes.measure()`` starts one):

* alpha, beta: one message, ``t(m) = alpha + m beta``, from a ping-pong between two ranks.
* gamma: seconds per byte of a local ``a.add_(b)``, on one thread like a rank.
* alpha_duplex, beta_duplex: one *exchange* step (both ranks send and receive at once), the
  step every ring, recursive-doubling and Rabenseifner round is made of. The textbook assumes
  full-duplex links, so an exchange costs no more than one message. Two processes on a shared
  CPU talking over loopback TCP are not full duplex: every byte is copied by the CPU on both
  ends, so when both directions run at once each goes slower (``beta_duplex``); and a large
  exchange pays more than a ping-pong's latency per step (``alpha_duplex``): gloo's rendezvous
  (a receive-ready notice must reach the sender before the data moves, and a message bigger than
  the socket buffer is handed over in pieces by gloo's I/O thread). The formulas use
  ``alpha_duplex`` and ``beta_duplex`` for exchange steps and ``alpha``, ``beta`` for one-way
  steps (trees, flat, fold-in/out). ``None`` for either is the textbook model.
* delta: seconds per byte of a local ``dst.copy_(src)``. The textbook algorithms move bytes only
  over the network, but an implementation behind torch's interface also copies: a list of output
  tensors has to be laid out in one buffer for recursive doubling and Bruck to send runs of
  blocks in one message, and back; reduce-scatter must not modify its inputs, so it reduces a
  copy; a tree reduce works on a private copy of a non-root's input. :data:`COPIES` lists the
  bytes each of these algorithms copies, and ``predict`` adds them at ``delta`` per byte
  (``delta=None``: the textbook, no copies). A copy of many MiB costs a share of sending the
  same bytes, which is why it is priced at all.

Measured curves (``CostModel.tables``)
--------------------------------------
The lines above are the textbook model, and what :func:`crossover` and the lesson reason with.
But a message's cost over loopback TCP is not a straight line in its size: up to the socket
buffer an exchange costs about the same, beyond it each byte costs more, and past the caches
more again, so one line fitted over 8 KiB .. 64 MiB misses some sizes by far (figures:
``docs/benchmarks/2026-11-23-collectives-and-placement-2vcpu.md``). So a model may also carry
the measured points, one per size by x2 steps (in the manner of PLogP, Kielmann et al. 2000,
which measures LogP's parameters as functions of the message size), and ``predict`` then prices
every step of an algorithm at the *measured* cost of a message of that step's size,
interpolated between the two nearest sizes:

* ``one_way``: a *stream*: rank 0 sends, rank 1 receives, back to back. Each receive is posted
  only when the previous one is done, as in a tree, so each message pays gloo's receive-ready
  notice and its data: about two ping-pong latencies.
* ``exchange``: the exchange above. ``reduction`` and ``copy``: the local timings of gamma and delta.

With curves the model has one more term, the ``overheads`` (LogP's *o*): the Python a hand-written
collective runs per call besides its messages (checks, group lookup, schedule, counters), per
algorithm. ``workbench bench collectives`` goes one step further: it times the exchange and the
stream at the sizes each swept size sends *inside the same interleaved trials* as the
collectives (``probes.Probe``), so that the curves and the measurements they are compared with
share the machine's mood of the moment (:func:`with_curves` adds those points to a model).

More ranks than cores: curves timed between ranks 0 and 1 while the others wait miss that in a
ring or recursive-doubling step *every* rank sends and receives at once; with more ranks than
cores each message then gets only its share of a core at each end, and one pair's curves predict
the collective too fast by about that share. ``probes.fit(..., all_pairs=True)`` times the
exchange and the stream with every pair of ranks (2k, 2k+1) stepping at once.

Still, no curve knows about caches filled by the collective's own buffers, nor about two
messages overlapping inside one algorithm: :func:`compare` shows how far off the model is, size
by size.

Under a topology (per-link alpha-beta)
--------------------------------------
``predict(..., topology=Topology(L, intra=Link, inter=Link))`` prices each message on the link it
crosses: ``latency + m / bandwidth`` of an emulated link, this machine's own curves (the model's
``exchange``/``one_way``) on a link that is not emulated; reductions, copies and call overheads
stay the machine's. The world is taken as ``N = p / L`` nodes of ``L`` consecutive ranks.
``algorithm="hierarchical"`` is priced phase by phase (N nodes of L ranks, ``t_i``/``t_e`` the
intra/inter link's time for one message, ``g`` the reduction)::

    all_reduce      (L-1)(t_i(n/L) + g(n/L)) + 2(N-1) t_e(n/p) + (N-1) g(n/p) + (L-1) t_i(n/L)
    all_gather      (N-1) t_e(n/p) + (L-1) t_i(n/L)                  (+ copying n bytes)
    reduce_scatter  (L-1)(t_i(n/L) + g(n/L)) + (N-1)(t_e(n/p) + g(n/p))   (+ copying n bytes)

The flat ``ring`` (all-reduce, all-gather, reduce-scatter) is priced by stepping through its
schedule (:func:`_ring_on_links`): rank r sends step s once step s-1 has arrived, each rank's
link sends one message after another, and a message's latency overlaps the next one's transfer
(as a NIC, and the emulator, do). With a slow link in the ring its queue sets the pace:
``2(p-1) n/p beta_e + alpha_e`` for a bandwidth-bound all-reduce, a little less than the
textbook's ``2(p-1)(alpha_e + n/p beta_e)``. Every other algorithm is priced with each of its steps
on the slowest link of the world (the inter-node one when there are two nodes or more): an upper
bound for recursive doubling and the trees, whose steps between near ranks stay inside a node.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Iterable, Sequence

# the algorithm gloo runs for ``algorithm="native"`` (on CPU); see the module docstring
NATIVE_AS = {"all_reduce": "ring", "all_gather": "ring", "reduce_scatter": "ring", "broadcast": "binomial",
             "reduce": "binomial", "gather": "flat", "scatter": "flat", "all_to_all_single": "pairwise"}

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
    ("all_to_all_single", "pairwise"): "(p-1) a + (p-1)/p n b",
    ("all_to_all_single", "bruck"): "lg p a + (lg p/2) n b",
    # needs a topology: N nodes of L ranks, a_i/b_i and a_e/b_e the intra- and inter-node links
    ("all_reduce", "hierarchical"): "2(L-1)(a_i + n/L b_i) + 2(N-1)(a_e + n/p b_e) + ((L-1)/L + (N-1)/p) n g",
    ("all_gather", "hierarchical"): "(N-1)(a_e + n/p b_e) + (L-1)(a_i + n/L b_i)",
    ("reduce_scatter", "hierarchical"): "(L-1)(a_i + n/L (b_i + g)) + (N-1)(a_e + n/p (b_e + g))",
}


# Bytes each hand-written algorithm copies locally on the slowest rank (n: nccl-tests bytes, p ranks;
# see ``delta`` in the module docstring). Absent: no copy. ``native`` (gloo) is not listed: it is
# torch's code, and its copies are not known here.
COPIES = {
    ("all_gather", "recursive_doubling"): lambda n, p: n + n / p,  # own block in, every block out
    ("all_gather", "bruck"): lambda n, p: n,  # own block in, the p-1 others out
    ("reduce_scatter", "recursive_halving"): lambda n, p: n + n / p,  # the inputs in, this rank's block out
    ("reduce", "flat"): lambda n, p: n,  # a non-root's private copy
    ("reduce", "binomial"): lambda n, p: n,
    # the root's own block, and the runs of several blocks it lays out in (or takes out of) one message
    ("gather", "binomial"): lambda n, p: (1 + _runs_of_several(p)) * n / p,
    ("gather", "flat"): lambda n, p: n / p,
    ("scatter", "binomial"): lambda n, p: (1 + _runs_of_several(p)) * n / p,
    ("scatter", "flat"): lambda n, p: n / p,
    ("all_to_all_single", "pairwise"): lambda n, p: n / p,  # this rank's own block, input to output
    # every round's slots packed into one message, and every slot rotated into the output
    ("all_to_all_single", "bruck"): lambda n, p: n + _bruck_blocks(p) * n / p,
    ("all_gather", "hierarchical"): lambda n, p: n,  # this rank's column in, the other columns out
    ("reduce_scatter", "hierarchical"): lambda n, p: n,  # the inputs laid out by node and local index
}


def _bruck_blocks(p: int) -> int:
    """Blocks Bruck's all-to-all sends per rank, ``sum_i popcount(i)`` over slots i < p: slot i hops
    once per bit set. p = 2: 1, 3: 2, 4: 4, 8: 12 (``p lg p / 2`` for a power of two)."""
    return sum(bin(i).count("1") for i in range(p))


def _runs_of_several(p: int) -> int:
    """Blocks a binomial tree's root sends (or receives) in runs of two or more: p = 2: 0, 4: 2, 8: 6."""
    total, mask = 0, 1
    while mask < p:
        run = min(mask, p - mask)
        total += run if run >= 2 else 0
        mask <<= 1
    return total


TABLES = ("one_way", "exchange", "reduction", "copy")


def _interpolate(points: list[tuple[float, float]], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by size); the end segments extend beyond them."""
    i = 1
    while i < len(points) - 1 and points[i][0] < x:
        i += 1
    (x0, t0), (x1, t1) = points[i - 1], points[i]
    t = t0 + (t1 - t0) * (x - x0) / (x1 - x0) if x1 != x0 else t0
    return max(t, 0.0)


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
    ``alpha_duplex`` (s per exchange step; None: the same as ``alpha``), and ``delta`` (s per
    byte copied locally, for the copies in :data:`COPIES`; None: no copies, as in the textbook).
    ``predict`` turns them into a collective's time."""

    alpha: float
    beta: float
    gamma: float
    beta_duplex: float | None = None
    alpha_duplex: float | None = None
    delta: float | None = None
    # measured (bytes, seconds) per primitive, interpolated between sizes (see "Measured curves")
    tables: dict | None = None
    # seconds of Python a hand-written collective spends per call besides its messages (LogP's o):
    # per "collective/algorithm" in ``overheads``, ``overhead`` for any other
    overhead: float | None = None
    overheads: dict | None = None

    def __post_init__(self):
        optional = ("beta_duplex", "alpha_duplex", "delta", "overhead")
        if self.overheads is not None and any(not isinstance(v, (int, float)) or v < 0 for v in self.overheads.values()):
            raise ValueError(f"overheads={self.overheads!r}: every value must be a non-negative number of seconds")
        if self.tables is not None:
            unknown = set(self.tables) - set(TABLES)
            if unknown:
                raise ValueError(f"tables={sorted(unknown)} are not primitives: use any of {', '.join(TABLES)}")
            for name, points in self.tables.items():
                if len(points) < 2 or any(t < 0 or b < 0 for b, t in points):
                    raise ValueError(f"tables[{name!r}] needs at least 2 (bytes, seconds) points, none negative")
            # frozen dataclass: store sorted tuples so the model stays hashable-free but immutable
            object.__setattr__(self, "tables", {k: [(float(b), float(t)) for b, t in sorted(v)]
                                                for k, v in self.tables.items()})
        for name in ("alpha", "beta", "gamma") + optional:
            value = getattr(self, name)
            if name in optional and value is None:
                continue
            if not isinstance(value, (int, float)) or math.isnan(value) or value < 0:
                raise ValueError(f"{name}={value!r} must be a non-negative number of seconds "
                                 f"({'per message' if name.startswith('alpha') else 'per byte'})")

    def one_way(self, nbytes: float) -> float:
        """Seconds of one message of ``nbytes`` from one rank to another: ``alpha + nbytes beta``,
        or the measured curve where there is one."""
        return self._cost("one_way", nbytes, self.alpha, self.beta)

    def exchange(self, nbytes: float) -> float:
        """Seconds of one exchange step (send ``nbytes`` to a peer while receiving as many):
        ``alpha_duplex + nbytes beta_duplex`` (the one-way line where those are None), or the
        measured curve."""
        e = self.alpha if self.alpha_duplex is None else self.alpha_duplex
        x = self.beta if self.beta_duplex is None else self.beta_duplex
        return self._cost("exchange", nbytes, e, x)

    def reduction(self, nbytes: float) -> float:
        """Seconds to reduce ``nbytes`` into a buffer: ``nbytes gamma``, or the measured curve."""
        return self._cost("reduction", nbytes, 0.0, self.gamma) if nbytes > 0 else 0.0

    def copy(self, nbytes: float) -> float:
        """Seconds to copy ``nbytes`` locally: ``nbytes delta`` (0 when ``delta`` is None)."""
        if self.delta is None or nbytes <= 0:
            return 0.0
        return self._cost("copy", nbytes, 0.0, self.delta)

    def _cost(self, name: str, nbytes: float, intercept: float, slope: float) -> float:
        points = (self.tables or {}).get(name)
        if not points:
            return intercept + nbytes * slope
        return _interpolate(points, nbytes)

    def predict(self, collective: str, algorithm: str, nbytes: int, world_size: int, topology=None) -> float:
        """Predicted seconds; see :func:`predict`."""
        return predict(collective, algorithm, nbytes, world_size, self, topology=topology)

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
        text += (f", gamma = {self.gamma * 1e9:.3f} ns/B "
                 f"({(1 / self.gamma if self.gamma else math.inf) / 1e9:.2f} GB/s)")
        if self.delta is not None:
            text += f", delta = {self.delta * 1e9:.3f} ns/B"
        if self.overhead is not None:
            text += f", overhead = {self.overhead * 1e6:.1f} us/call"
        if self.tables:
            text += f"; measured curves: {', '.join(self.tables)}"
        return text


def predict(collective: str, algorithm: str, nbytes: int, world_size: int, model: CostModel,
            topology=None) -> float:
    """Seconds ``algorithm`` takes for ``collective`` of ``nbytes`` on ``world_size`` ranks.

    ``nbytes`` follows nccl-tests (the whole gathered buffer for all_gather, reduce_scatter,
    gather and scatter). ``algorithm="native"`` is predicted as :data:`NATIVE_AS` (network terms
    only: gloo's own copies are not known). With ``model.delta`` set, the local copies the
    hand-written algorithm makes (:data:`COPIES`) are added at ``delta`` per byte. ``topology``:
    price each message on the link it crosses (see "Under a topology" in the module docstring);
    ``algorithm="hierarchical"`` needs one.
    """
    native = algorithm == "native"
    t = _network_time(collective, algorithm, nbytes, world_size, model, topology)
    if not native and world_size > 1:
        if (collective, algorithm) in COPIES:
            t += model.copy(COPIES[(collective, algorithm)](float(nbytes), world_size))
        t += (model.overheads or {}).get(f"{collective}/{algorithm}", model.overhead or 0.0)
    return t


def _checked_algorithm(collective: str, algorithm: str, nbytes: int, world_size: int, model: CostModel,
                       topology) -> str:
    """The algorithm to price (``native`` mapped to :data:`NATIVE_AS`), after refusing what has no cost:
    a model that is not a :class:`CostModel`, a bad world size or size, an unknown collective or
    algorithm, ``hierarchical`` without a topology."""
    if not isinstance(model, CostModel):
        raise TypeError(f"model={model!r} must be a CostModel: fit one with workbench.measure.probes.measure() or "
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
    if algorithm == "hierarchical" and topology is None:
        raise ValueError(f"{collective}: algorithm='hierarchical' has no cost without a topology: pass "
                         "topology=Topology(ranks_per_node, intra=Link(...), inter=Link(...))")
    return algorithm


def _network_time(collective: str, algorithm: str, nbytes: int, world_size: int, model: CostModel,
                  topology=None) -> float:
    """The alpha-beta-gamma terms of :func:`predict` (messages and reductions, no local copies).

    Without a topology every message costs this machine's ``one_way`` or ``exchange``. Under one, the
    hierarchical algorithms and the rings are replayed on their links; every other algorithm has each
    of its steps priced on the slowest link of the world (see "Under a topology" in the module docstring).
    """
    algorithm = _checked_algorithm(collective, algorithm, nbytes, world_size, model, topology)
    one, ex = model.one_way, model.exchange  # seconds of one message / one exchange step of m bytes
    p, n = world_size, float(nbytes)
    if p == 1:
        return 0.0
    if topology is not None:
        per_node = min(topology.ranks_per_node, p)
        if p % per_node:
            raise ValueError(f"world_size={p} does not fill nodes of ranks_per_node={topology.ranks_per_node}")
        nodes = p // per_node
        if algorithm == "hierarchical":
            return _hierarchical_time(collective, n, per_node, nodes, topology, model)
        if algorithm == "ring" and collective in ("all_reduce", "all_gather", "reduce_scatter"):
            reduce_steps = {"all_reduce": p - 1, "all_gather": 0, "reduce_scatter": p - 1}[collective]
            gather_steps = {"all_reduce": p - 1, "all_gather": p - 1, "reduce_scatter": 0}[collective]
            return _ring_on_links(p, per_node, n / p, reduce_steps, gather_steps, topology, model)
        slow = "inter" if nodes > 1 else "intra"  # each step waits for its slowest message
        one = lambda m: _on_link(topology, slow, m, model.one_way)  # noqa: E731
        ex = lambda m: _on_link(topology, slow, m, model.exchange)  # noqa: E731
    return _schedule_time(collective, algorithm, n, p, one, ex, model.reduction)


def _halving(total: float, steps: int, step) -> float:
    """``steps`` rounds whose messages halve each round and add up to ``total`` bytes
    (n/2, n/4, ... n/p for a power of two), each priced by ``step(bytes)``."""
    return sum(step(total * 2 ** (steps - k) / (2 ** steps - 1)) for k in range(1, steps + 1))


def _schedule_time(collective: str, algorithm: str, n: float, p: int, one, ex, g) -> float:
    """Seconds of ``algorithm``'s rounds for ``collective`` of ``n`` bytes on ``p`` > 1 ranks, with
    ``one(m)``, ``ex(m)`` and ``g(m)`` the seconds of one message, one exchange step and one reduction
    of ``m`` bytes.

    Every step is priced at the size of the message it sends: exchange steps (ring, recursive
    doubling/halving, Rabenseifner, Bruck) at ex(m), one-way steps (trees, flat, folds) at one(m).
    With straight lines these sums are exactly the textbook formulas of the module docstring. Where
    ``p`` is not a power of two, the recursive algorithms fold the extra ranks in and out.
    """
    lg = _lg(p)
    share = (p - 1) / p * n  # the bytes a bandwidth-optimal algorithm moves per rank
    q, odd = _fold(p)
    lgq = _lg(q)
    fold_in = (one(n) + g(n)) if odd else 0.0  # an extra rank hands its vector to a partner
    fold_out = one(n) if odd else 0.0  # and gets the result back at the end
    if collective == "all_reduce":
        if algorithm == "ring":
            return 2 * (p - 1) * ex(n / p) + (p - 1) * g(n / p)
        if algorithm == "recursive_doubling":
            return fold_in + lgq * (ex(n) + g(n)) + fold_out
        if algorithm == "rabenseifner":
            sq = (q - 1) / q * n
            return fold_in + 2 * _halving(sq, lgq, ex) + _halving(sq, lgq, g) + fold_out
        if algorithm == "reduce_broadcast":
            return lg * (2 * one(n) + g(n))
    if collective == "all_gather":
        if algorithm == "ring":
            return (p - 1) * ex(n / p)
        steps, d = 0.0, 1  # recursive_doubling, bruck: runs of 1, 2, 4, ... blocks
        while d < p:
            steps += ex(min(d, p - d) * n / p)
            d <<= 1
        return steps
    if collective == "reduce_scatter":
        if algorithm == "ring":
            return (p - 1) * (ex(n / p) + g(n / p))
        folds = (one(n) + g(n) + one(n / p)) if odd else 0.0  # whole input in, one block back out
        return _halving(share, lgq, ex) + _halving(share, lgq, g) + folds
    if collective == "broadcast":
        if algorithm == "flat":
            return (p - 1) * one(n)
        if algorithm == "binomial":
            return lg * one(n)
        return _halving(share, lg, one) + (p - 1) * ex(n / p)  # scatter_allgather: tree scatter, ring all-gather
    if collective == "reduce":
        if algorithm == "flat":
            return (p - 1) * (one(n) + g(n))
        return lg * (one(n) + g(n))
    if collective == "all_to_all_single":
        if algorithm == "bruck":  # lg p exchanges of the slots with bit k set (half of them for 2^k ranks)
            return sum(ex(sum(1 for i in range(p) if i & (1 << k)) * n / p) for k in range(lg))
        return (p - 1) * ex(n / p)  # pairwise: p-1 exchanges of one block each
    # scatter, gather
    if algorithm == "flat":
        return (p - 1) * one(n / p)
    return _halving(share, lg, one)


def _on_link(topology, link_class: str, nbytes: float, machine) -> float:
    """One message of ``nbytes`` on ``link_class``: the emulated link's time, or ``machine(nbytes)``
    (this machine's curve) where that link is not emulated."""
    link = topology.link(link_class)
    return link.time(nbytes) if link is not None else machine(nbytes)


def _ring_on_links(p: int, per_node: int, m: float, reduce_steps: int, gather_steps: int, topology,
                   model: CostModel) -> float:
    """A ring of ``p`` ranks (rank r sends to r + 1) on the topology's links, step by step.

    Rank r sends its step-s message of ``m`` bytes once it has received (and, in the
    reduce-scatter steps, reduced) step s-1's, and its link sends one message after another
    (``free``), as the emulator does: a message's latency overlaps the next one's transfer. With
    one kind of link this is the textbook ``steps (alpha + m beta) + reduce_steps m gamma``; with a
    slow link in the ring, that link's queue sets the pace. A link that is not emulated costs
    this machine's exchange time.

    Every node's ranks see the same links (its last rank's leads to the next node), and the ring
    starts with every rank idle, so each step leaves rank ``r`` where it leaves rank ``r + per_node``:
    one node's ranks are replayed, the ring closing on the node itself -- the same additions and
    maxima on the same numbers, ``p / per_node`` times fewer.
    """
    k = per_node if p % per_node == 0 else p   # ranks replayed: one node's, or all of them
    cost = []
    for r in range(k):
        link = topology.link("intra" if r // per_node == ((r + 1) % p) // per_node else "inter")
        cost.append((link.latency_s, m / link.bandwidth_Bps) if link is not None else (0.0, model.exchange(m)))
    g = model.reduction(m)
    ready, free = [0.0] * k, [0.0] * k
    for s in range(reduce_steps + gather_steps):
        arrive = [0.0] * k
        for r in range(k):
            latency, busy = cost[r]
            start = max(ready[r], free[r])
            free[r] = start + busy
            arrive[(r + 1) % k] = free[r] + latency
        ready = [t + (g if s < reduce_steps else 0.0) for t in arrive]
    return max(ready)


def _hierarchical_time(collective: str, n: float, per_node: int, nodes: int, topology, model: CostModel) -> float:
    """The hierarchical algorithms, phase by phase (see "Under a topology" in the module docstring)."""
    L, N, p = per_node, nodes, per_node * nodes
    intra = lambda m: _on_link(topology, "intra", m, model.exchange)  # noqa: E731
    inter = lambda m: _on_link(topology, "inter", m, model.exchange)  # noqa: E731
    g = model.reduction
    if collective == "all_reduce":
        return (L - 1) * (intra(n / L) + g(n / L)) + 2 * (N - 1) * inter(n / p) + (N - 1) * g(n / p) \
            + (L - 1) * intra(n / L)
    if collective == "all_gather":
        return (N - 1) * inter(n / p) + (L - 1) * intra(n / L)
    return (L - 1) * (intra(n / L) + g(n / L)) + (N - 1) * (inter(n / p) + g(n / p))  # reduce_scatter


def crossover(collective: str, small: str, large: str, world_size: int, model: CostModel,
              lo: int = 1, hi: int = 1 << 34) -> float:
    """Smallest size (bytes) from which ``large`` is predicted at least as fast as ``small``, for good.

    ``math.inf`` if ``large`` is slower at ``hi``; ``lo`` if it is never slower. With straight
    lines the two costs cross once; measured curves are a little jagged and may cross back and
    forth around the crossing, so the sizes are scanned (8 steps per doubling) for the last one
    where ``large`` is still slower, and the crossing is found by bisection just above it.
    """
    def faster(n):
        return predict(collective, large, n, world_size, model) <= predict(collective, small, n, world_size, model)

    if not faster(hi):
        return math.inf
    grid, k = [], 0
    while lo * 2 ** (k / 8) < hi:
        grid.append(int(lo * 2 ** (k / 8)))
        k += 1
    slower = [n for n in grid if not faster(n)]
    if not slower:
        return float(lo)
    a = slower[-1]
    b = next((n for n in grid if n > a), hi)
    while b - a > 1:
        mid = (a + b) // 2
        a, b = (a, mid) if faster(mid) else (mid, b)
    return float(b)


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


def with_curves(model: CostModel, **points: Sequence[tuple[float, float]]) -> CostModel:
    """``model`` with measured points added to its curves (``one_way=[(bytes, s), ...]``, ...):
    a new point replaces the model's own at the same size."""
    tables = {k: dict(v) for k, v in (model.tables or {}).items()}
    for name, pts in points.items():
        if pts:
            tables.setdefault(name, {}).update({float(b): float(t) for b, t in pts})
    return replace(model, tables={k: sorted(v.items()) for k, v in tables.items()})



def compare(model: CostModel, measurements: Iterable[dict], topology=None) -> list[dict]:
    """Predicted against measured, one row per measurement.

    Each measurement is a dict with ``collective``, ``algorithm``, ``bytes``, ``world_size`` and
    ``time_s`` (e.g. the rows ``workbench bench collectives`` writes); the returned rows add
    ``predicted_s`` and ``error`` = predicted / measured - 1 (0.25 means 25% too slow a guess).
    """
    rows = []
    for m in measurements:
        pred = predict(m["collective"], m["algorithm"], int(m["bytes"]), int(m["world_size"]), model,
                       topology=topology)
        meas = float(m["time_s"])
        rows.append({**m, "predicted_s": pred, "error": (pred / meas - 1.0) if meas > 0 else math.nan})
    return rows
