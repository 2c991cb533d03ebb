"""Pipeline schedules as data: the list of actions each rank runs, and what the lists predict.

A schedule is nothing but an order. Every schedule does the same work -- for every stage ``s``
and micro-batch ``i`` one forward ``F(s, i)``, one backward, and the messages between stages --
and differs from the others only in the order each rank does it. So each builder here returns,
for every rank, a plain list of :class:`Action`::

    F  forward of one micro-batch through one stage (keeps its activations for the backward)
    B  backward: the full backward, or, in the zero-bubble schedules, only the input-gradient
       half (dL/dx, which the previous stage is waiting for)
    W  the weight-gradient half (dL/dW), which nobody waits for, so it can fill idle time
    send / recv   the activation (forward) or gradient (backward) crossing a stage boundary

and one interpreter (:mod:`workbench.parallel.pipeline`) runs any such list. Builders name their
phases the way papers and picotron do, so a reader can follow one rank through them:

``gpipe``        all m forwards, then all m backwards. Activations of m micro-batches alive.
``one_f_one_b``  warm-up: ``p - s - 1`` forwards on stage s; steady: one forward, one backward;
                 cool-down: the remaining backwards. At most ``p - s`` micro-batches alive on
                 stage s (so the first stage holds the most), and it needs ``m >= p``.
``interleaved``  v stages ("chunks") per rank, rank r holding stages r, r+p, r+2p...; 1F1B over
                 the v*m (chunk, micro-batch) pairs, chunks taken in rounds of p micro-batches
                 (Narayanan et al. 2021; torch's round rule: ``m`` a multiple of ``max(1, m // p)``).
``zero_bubble_h1``  ZB-H1 (Qi et al. 2023) on one stage per rank: 1F1B's order with every
                 backward split into B and W; stage s defers its W by s steady-state slots, so
                 the B's (the critical path) run back-to-back through the cool-down and the W's
                 fill the bubble. Stage s keeps p - s micro-batches between F and B (their
                 activations, M_B each) and up to s between B and W (what W reads, M_W each):
                 (p - s) M_B + s M_W, at most 1F1B's first-stage peak p M_B (Qi et al.).
``zbv``          the V-shaped zero-bubble schedule: 2 stages per rank, rank r holding stages r
                 and 2p-1-r, so the first and last stages share rank 0 (same phases as torch's
                 ``ScheduleZBVZeroBubble``).
``dualpipev``    DeepSeek's DualPipeV on the same V: steady state pairs one chunk's forward with
                 the other's full backward; B/W splits only in the ramps (torch's
                 ``ScheduleDualPipeV``). Needs m >= 2p.

Idle fraction ("bubble") with p stages, m micro-batches, F, B, W taking equal time (t each):

=================  ==================================  ====================================
schedule           bubble                               first stage's live micro-batches
=================  ==================================  ====================================
GPipe, 1F1B        (p-1) / (m + p - 1)                  m (GPipe), p (1F1B)
interleaved (v)    (p-1) / (v m + p - 1), m >= p        see :func:`live_microbatches`
ZB-H1              (p-1) / (3 m + p - 1)                p (on every stage)
ZBV (m >= 2p)      (p-1) / (6 m + p - 1)                2p chunk micro-batches (half a stage each)
DualPipeV          (p-1) / (6 m + p - 1), m >= 2p       see :func:`live_microbatches`
=================  ==================================  ====================================

:func:`simulate` replays the lists with fixed costs per action (every message instant) and gives
the planned start and end of every action: the "planned" grid the plots draw, the predicted
bubble, and a proof that the lists cannot deadlock (it raises if some rank would wait forever).
It is the one event loop (:class:`Replay`) that the advisor also replays schedules with, there
with timed work, message delays and ranks sharing a CPU's cores (:func:`workbench.advise.timing.simulate`).
"""
from __future__ import annotations

from typing import NamedTuple

__all__ = ["Action", "gpipe", "one_f_one_b", "interleaved", "zero_bubble_h1", "zbv", "dualpipev", "with_comms",
           "stage_to_rank", "inputs", "work_keys", "Replay", "simulate", "bubble", "bubble_formula",
           "live_microbatches", "peak_live_bytes", "min_microbatches"]


class Action(NamedTuple):
    """One step of one rank: ``kind`` in F, B, W, send, recv; ``peer`` is the stage at the other
    end of a message (``stage - 1`` for activations, ``stage + 1`` for gradients)."""

    kind: str
    stage: int
    microbatch: int
    peer: int | None = None

    def __str__(self) -> str:
        if self.kind in ("F", "B", "W"):
            return f"{self.kind}{self.stage}.{self.microbatch}"
        arrow = "->" if self.kind == "send" else "<-"
        return f"{self.kind}{self.stage}.{self.microbatch}{arrow}{self.peer}"

    __repr__ = __str__


def stage_to_rank(num_stages: int, ranks: int, style: str = "loop") -> list[int]:
    """Which rank holds each stage: ``loop`` (stage s on rank s % p) or ``v`` (rank r holds r
    and 2p-1-r)."""
    if style == "v":
        return [s if s < ranks else 2 * ranks - 1 - s for s in range(num_stages)]
    return [s % ranks for s in range(num_stages)]


# ----------------------------------------------------------------------------- single stage per rank

def gpipe(p: int, m: int) -> list[list[Action]]:
    """GPipe (Huang et al. 2019): all forwards, then all backwards."""
    return [[Action("F", s, i) for i in range(m)] + [Action("B", s, i) for i in range(m)]
            for s in range(p)]


def one_f_one_b(p: int, m: int) -> list[list[Action]]:
    """1F1B (PipeDream-flush, Megatron): warm-up, steady one-forward-one-backward, cool-down."""
    ranks = []
    for s in range(p):
        warmup = min(p - s - 1, m)                         # forwards before the first backward
        acts = [Action("F", s, i) for i in range(warmup)]
        for i in range(m - warmup):                        # steady: F(warmup + i), then B(i)
            acts += [Action("F", s, warmup + i), Action("B", s, i)]
        acts += [Action("B", s, i) for i in range(m - warmup, m)]   # cool-down
        ranks.append(acts)
    return ranks


def zero_bubble_h1(p: int, m: int) -> list[list[Action]]:
    """ZB-H1 (Qi et al. 2023, "Zero Bubble Pipeline Parallelism", Fig. 3).

    1F1B with each backward split into B (input gradient) and W (weight gradient). Warm-up:
    ``p - s - 1`` forwards. Steady: F, B, and a W -- except that stage s holds back its first
    ``s`` W's (the last stage holds back the most), so the B's go up the pipeline one right after
    the other; cool-down: the remaining B's, each followed by one held-back W, then the rest.
    Memory: stage s holds ``p - s`` micro-batches between F and B and up to ``s`` between B and
    W, so ``p`` are alive at once on every stage -- but a pending W holds only what it reads
    (M_W <= M_B, see ``pipeline_backward``), so the peak is ``(p - s) M_B + s M_W``, at most
    1F1B's first-stage peak (:func:`peak_live_bytes`).
    """
    ranks = []
    for s in range(p):
        warmup = min(p - s - 1, m)
        acts = [Action("F", s, i) for i in range(warmup)]
        held = 0          # W's not yet done
        next_w = 0
        for i in range(m - warmup):
            acts += [Action("F", s, warmup + i), Action("B", s, i)]
            held += 1
            if held > s:  # stage s defers s weight passes
                acts.append(Action("W", s, next_w))
                next_w += 1
                held -= 1
        for i in range(m - warmup, m):
            acts.append(Action("B", s, i))
            held += 1
            if held > s:
                acts.append(Action("W", s, next_w))
                next_w += 1
                held -= 1
        acts += [Action("W", s, i) for i in range(next_w, m)]
        ranks.append(acts)
    return ranks


# ----------------------------------------------------------------------------- several stages per rank

def interleaved(p: int, v: int, m: int) -> list[list[Action]]:
    """Interleaved 1F1B (Narayanan et al. 2021): v chunks per rank, stage of chunk c on rank r is
    ``c p + r``. Forwards go through the chunks in rounds of ``m / rounds`` micro-batches (torch's
    flexible rule, Megatron's when m is a multiple of p); backwards in the reverse chunk order.

    Warm-up on rank r: ``(v - 1) * per_round + 2 (p - 1 - r)`` forwards (capped at v m), then
    steady 1F1B over (chunk, micro-batch) pairs, then cool-down.
    """
    rounds = max(1, m // p)
    per_round = m // rounds
    total = v * m
    ranks = []
    for r in range(p):
        warmup = min((v - 1) * per_round + 2 * (p - 1 - r), total)

        def fwd(k: int) -> Action:
            chunk = (k // per_round) % v
            return Action("F", chunk * p + r, (k // (per_round * v)) * per_round + k % per_round)

        def bwd(k: int) -> Action:
            chunk = v - 1 - (k // per_round) % v
            return Action("B", chunk * p + r, (k // (per_round * v)) * per_round + k % per_round)

        acts = [fwd(k) for k in range(warmup)]
        for k in range(total - warmup):
            acts += [fwd(warmup + k), bwd(k)]
        acts += [bwd(k) for k in range(total - warmup, total)]
        ranks.append(acts)
    return ranks


def zbv(p: int, m: int) -> list[list[Action]]:
    """ZB-V (Qi et al. 2023, section 6): rank r holds stages r (chunk 0) and 2p-1-r (chunk 1).

    Warm-up: ``2(p - r) - 1`` forwards of chunk 0, then r pairs (chunk-1 forward, chunk-0
    forward), then ``p - r`` triples (F, B, W) of chunk 1. Steady: chunk-0 F, B, W then chunk-1
    F, B, W. Cool-down: B's of both chunks, then B+W of chunk 0, then the W's left. Built for
    ``max(m, 2p - 1)`` micro-batches and cut back to m (as torch does), so any m works.
    """
    n = max(2 * p - 1, m)
    S = 2 * p
    ranks = []
    for r in range(p):
        c0, c1 = r, S - 1 - r
        f0 = f1 = b0 = b1 = 0
        acts: list[Action] = []
        for _ in range(2 * (p - r) - 1):
            acts.append(Action("F", c0, f0)); f0 += 1
        for _ in range(r):
            acts.append(Action("F", c1, f1)); f1 += 1
            acts.append(Action("F", c0, f0)); f0 += 1
        for _ in range(p - r):
            acts += [Action("F", c1, f1), Action("B", c1, b1), Action("W", c1, b1)]
            f1 += 1; b1 += 1
        while f1 < f0 or f0 < n:
            if f0 < n:
                acts.append(Action("F", c0, f0)); f0 += 1
            acts += [Action("B", c0, b0), Action("W", c0, b0)]; b0 += 1
            acts += [Action("F", c1, f1), Action("B", c1, b1), Action("W", c1, b1)]
            f1 += 1; b1 += 1
        w0, w1 = b0, b1
        for _ in range(r):
            acts += [Action("B", c0, b0), Action("B", c1, b1)]; b0 += 1; b1 += 1
        for _ in range(p - r):
            acts += [Action("B", c0, b0), Action("W", c0, w0)]; b0 += 1; w0 += 1
        acts += [Action("W", c1, i) for i in range(w1, b1)]
        acts += [Action("W", c0, i) for i in range(w0, b0)]
        ranks.append([a for a in acts if a.microbatch < m])
    return ranks


def dualpipev(p: int, m: int) -> list[list[Action]]:
    """DualPipeV (DeepSeek-V3's DualPipe cut in half; torch's ``ScheduleDualPipeV``): the V of
    ZBV (rank r holds stages r and 2p-1-r), with the steady state pairing the forward of one
    chunk with the full backward of the other ("F&B", which DualPipe overlaps with the other's
    communication; here they run one after the other), and zero-bubble B/W splits only where
    they fill the ramps. Phases per rank, as in DeepSeek's and torch's code:

    1. ``2(p - r - 1)`` forwards of chunk 0; 2. ``r + 1`` pairs F0 F1;
    3. ``p - r - 1`` times B1, a pending W, F1; 4. (main) ``m - 2p + r + 1`` times F0&B1, F1&B0
    (the last rank's first F0, B1 not paired); 5. ``p - r - 1`` times B1, F1&B0;
    6. ``r + 1`` times B1 B0, the second half split (B now, W later); 7. ``p - r - 1`` times a
    pending W, then B0; 8. the W's left. Needs ``m >= 2p``.
    """
    if m < 2 * p:
        raise ValueError(f"dualpipev: m={m} < 2p={2 * p}: DualPipeV needs at least as many "
                         "micro-batches as stages")
    S = 2 * p
    ranks = []
    for r in range(p):
        c0, c1 = r, S - 1 - r
        nf = {c0: 0, c1: 0}        # next forward's micro-batch per chunk
        nb = {c0: 0, c1: 0}        # next backward's
        pending_w: list[tuple[int, int]] = []
        acts: list[Action] = []

        def f(c: int) -> None:
            acts.append(Action("F", c, nf[c]))
            nf[c] += 1

        def b(c: int, split: bool = False) -> None:
            acts.append(Action("B", c, nb[c]))
            if split:
                pending_w.append((c, nb[c]))
            nb[c] += 1

        def w() -> None:
            if pending_w:
                c, i = pending_w.pop(0)
                acts.append(Action("W", c, i))

        for _ in range(2 * (p - r - 1)):                   # 1
            f(c0)
        for _ in range(r + 1):                             # 2
            f(c0)
            f(c1)
        for _ in range(p - r - 1):                         # 3
            b(c1, split=True)
            w()
            f(c1)
        for i in range(m - 2 * p + r + 1):                 # 4
            f(c0)
            b(c1)
            f(c1)
            b(c0)
        for _ in range(p - r - 1):                         # 5
            b(c1)
            f(c1)
            b(c0)
        zb = False                                         # 6
        for i in range(r + 1):
            if i == (r + 1) // 2 and r % 2 == 1:
                zb = True
            b(c1, split=zb)
            if i == (r + 1) // 2 and r % 2 == 0:
                zb = True
            b(c0, split=zb)
        for _ in range(p - r - 1):                         # 7
            w()
            b(c0, split=zb)
        while pending_w:                                   # 8
            w()
        ranks.append(acts)
    return ranks


def min_microbatches(schedule: str, p: int, v: int = 1) -> int:
    """The fewest micro-batches a schedule accepts (1F1B and ZB-H1: p, so that the steady state
    exists: a stage cannot start backward i before forwards reached the last stage)."""
    return {"gpipe": 1, "1f1b": p, "zb_h1": p, "interleaved": 1, "zbv": 1, "dualpipev": 2 * p}[schedule]


# ----------------------------------------------------------------------------- messages

def with_comms(compute: list[list[Action]], num_stages: int, style: str = "loop") -> list[list[Action]]:
    """Insert the messages: a ``recv`` right before the action that needs it, a ``send`` right
    after the action that produced it. A boundary between two stages of the same rank (the tip of
    ZBV's V) needs no message."""
    owner = stage_to_rank(num_stages, len(compute), style)
    out = []
    for r, acts in enumerate(compute):
        full = []
        for a in acts:
            s, i = a.stage, a.microbatch
            if a.kind == "F":
                if s > 0 and owner[s - 1] != r:
                    full.append(Action("recv", s, i, s - 1))
                full.append(a)
                if s < num_stages - 1 and owner[s + 1] != r:
                    full.append(Action("send", s, i, s + 1))
            elif a.kind == "B":
                if s < num_stages - 1 and owner[s + 1] != r:
                    full.append(Action("recv", s, i, s + 1))
                full.append(a)
                if s > 0 and owner[s - 1] != r:
                    full.append(Action("send", s, i, s - 1))
            else:
                full.append(a)
        out.append(full)
    return out


# ----------------------------------------------------------------------------- what a plan predicts

def inputs(action: Action, num_stages: int) -> list[tuple[str, int, int]]:
    """The actions whose outputs ``action`` needs, as ``(kind, stage, microbatch)``: a forward the
    previous stage's forward; a backward the next stage's backward (the last stage: its own
    forward); a weight-gradient W its own stage's B. The replay of a schedule (:class:`Replay`:
    :func:`simulate` here, the advisor's timed one, :func:`workbench.advise.timing.simulate`) orders
    actions by these rules, and the interpreter (:mod:`workbench.parallel.pipeline`) meets them by
    its messages."""
    s, i = action.stage, action.microbatch
    if action.kind == "F":
        return [("F", s - 1, i)] if s > 0 else []
    if action.kind == "B":
        return [("B", s + 1, i)] if s < num_stages - 1 else [("F", s, i)]
    return [("B", s, i)]


def work_keys(actions: list[list[Action]]) -> list[list[tuple[str, int]]]:
    """Each action's key in a replay's ``work`` and ``comm`` costs, per rank: ``(kind, stage)``, a
    backward that is not split into B and W (no W of its stage and micro-batch in any list) being
    ``"Bfull"`` -- it does both halves, so it costs what B and W cost together."""
    split = {(a.stage, a.microbatch) for acts in actions for a in acts if a.kind == "W"}
    keys: dict[tuple, tuple] = {}   # one tuple per key, shared by the actions that have it
    return [[keys.setdefault(k, k) for k in
             (("Bfull" if a.kind == "B" and (a.stage, a.microbatch) not in split else a.kind, a.stage) for a in acts)]
            for acts in actions]


class Replay:
    """The schedule replay: every rank walks its list of compute actions in order, in time.

    An action starts once its inputs (:func:`inputs`) have arrived -- an input made on another rank
    ``hop[k]`` seconds after it ended, ``k`` the stage boundary it crosses (``message``: one number, or
    one per boundary) -- and its rank is idle. It then computes ``work[key]`` seconds (``key`` from
    :func:`work_keys`), then communicates ``comm[key]`` seconds (a tensor-parallel collective its rank
    waits for), and ends. The loop (:meth:`run`) alternates two moves: start every action that can
    start now, then move the clock to the next event (a compute or a communication ending, an input
    arriving) and end what ended. Each round costs O(ranks), and there are at most a few events per
    action. Nothing running and nothing to wait for while actions are left is a deadlock: some rank
    waits for an input that no list will ever make (raised with :attr:`deadlock`, naming each rank's
    stuck action).

    Here compute runs at full speed, so it ends ``work`` seconds after it started, and a message takes
    its hop. The hooks a subclass overrides to change that (the advisor's ranks sharing a CPU's cores,
    :func:`workbench.advise.timing.simulate`): how compute advances (:meth:`_compute_ends`,
    :meth:`_advance`), when an action's inputs are in (:meth:`_ready_at`), what a message leaving for
    another rank does (:meth:`_sent`: it may hold it in ``held``, its delay to be decided), and the
    decision on the held messages, taken once the actions that can start now have started, before the
    clock moves (:meth:`_decide`).

    State per rank: ``pos`` (its next action), ``state`` (``idle``, ``compute``, ``comm``),
    ``started`` (when its action began), ``remaining`` (its compute's seconds at full speed),
    ``comm_s`` and ``comm_until`` (its communication's seconds and end), ``busy_c``/``busy_m``
    (seconds computing/communicating so far); ``done`` maps each ended action's ``(kind, stage,
    microbatch)`` to its end. ``trace``: a list each action is appended to as it ends, ``{"rank",
    "stage", "kind", "microbatch", "start", "end"}``.
    """

    deadlock = "the schedule deadlocks: ranks wait forever at {stuck}"

    def __init__(self, actions: list[list[Action]], num_stages: int, work: dict, comm: dict, *,
                 message: float | list[float] = 0.0, style: str = "loop", trace: list | None = None):
        ranks = len(actions)
        self.actions, self.num_stages, self.work, self.comm = actions, num_stages, work, comm
        self.trace, self.ranks = trace, ranks
        self.owner = stage_to_rank(num_stages, ranks, style)
        self.steps = self._steps(actions)
        self.hop = list(message) if isinstance(message, (list, tuple)) else [message] * max(1, num_stages - 1)
        self.done: dict[tuple, float] = {}
        self.held: dict[tuple, int] = {}       # messages just sent whose delay is still to be decided
        self.pos = [0] * ranks
        self.state = ["idle"] * ranks
        self.remaining = [0.0] * ranks
        self.comm_s, self.comm_until = [0.0] * ranks, [0.0] * ranks
        self.busy_c, self.busy_m = [0.0] * ranks, [0.0] * ranks
        self.started = [0.0] * ranks
        self.now = 0.0
        self.left = sum(len(a) for a in actions)

    def _steps(self, actions: list[list[Action]]) -> list[list[tuple]]:
        """What each action reads of the schedule, worked out once before the loop: per rank, per
        action, ``(action, its key in work/comm, its id (kind, stage, microbatch), [(an input's id, the
        boundary it crossed, or None where its stage is on the action's rank)], the boundary its output
        crosses to another rank or None)``."""
        owner, n = self.owner, self.num_stages
        out = []
        for acts, keys in zip(actions, work_keys(actions)):
            out.append([(a, key, (a.kind, a.stage, a.microbatch),
                         [(d, min(d[1], a.stage) if owner[d[1]] != owner[a.stage] else None) for d in inputs(a, n)],
                         self._crossing(a)) for a, key in zip(acts, keys)])
        return out

    def _crossing(self, a: Action) -> int | None:
        """The stage boundary an action's output crosses to another rank (a forward's activations to
        the next stage, a backward's gradients to the previous one), or None."""
        peer = a.stage + 1 if a.kind == "F" else a.stage - 1 if a.kind == "B" else None
        if peer is None or not 0 <= peer < self.num_stages or self.owner[peer] == self.owner[a.stage]:
            return None
        return min(peer, a.stage)

    def run(self) -> dict:
        """Rounds until every action has ended: start each idle rank's next action where its inputs
        are in by now (:meth:`_ready_at`; an input that arrives later is an event to move the clock
        to), decide the delays of the messages just sent where some are held (:meth:`_decide`, then
        look again: their receivers' readiness is known), else move to the next event
        (:meth:`_next_event`). Returns ``{"span", "busy": [per rank], "compute": [per rank], "comm":
        [per rank]}`` in seconds. (The start pass is written out here, not a method: it runs every
        round, and a call per round is a good part of a replay's time.)"""
        steps, state, pos, ranks = self.steps, self.state, self.pos, range(self.ranks)
        started, remaining, comm_s, work, comm = self.started, self.remaining, self.comm_s, self.work, self.comm
        while self.left:
            waits, now = [], self.now
            for r in ranks:
                while state[r] == "idle" and pos[r] < len(steps[r]):
                    step = steps[r][pos[r]]
                    t = self._ready_at(step[3])
                    if t is None:
                        break
                    if t > now + 1e-15:   # its input arrives later: an event
                        waits.append(t)
                        break
                    started[r], state[r], remaining[r], comm_s[r] = now, "compute", work[step[1]], comm[step[1]]
            computing = [r for r in ranks if state[r] == "compute"]
            if self.held:
                self._decide(computing)
                continue
            self._next_event(computing, waits)
        return {"span": self.now, "busy": [c + m for c, m in zip(self.busy_c, self.busy_m)],
                "compute": self.busy_c, "comm": self.busy_m}

    def _ready_at(self, inputs: list[tuple]) -> float | None:
        """When an action with these ``inputs`` can start: their ends, plus a message's hop where an
        input comes from another rank; None while an input is missing."""
        t = 0.0
        done = self.done
        for d, boundary in inputs:
            if d not in done:
                return None
            t = max(t, done[d] + (self.hop[boundary] if boundary is not None else 0.0))
        return t

    def _next_event(self, computing: list[int], waits: list[float]) -> None:
        """Move the clock to the next event (the earliest of the inputs awaited, the computes' ends
        (:meth:`_compute_ends`) and the communications' ends); then the computes that ended
        (:meth:`_advance`) go on to their communication, and the communications that ended end their
        action (:meth:`_end_action`), rank by rank. No event while actions are left: the lists deadlock."""
        now, state, comm_until = self.now, self.state, self.comm_until
        events = waits + self._compute_ends(computing) + \
            [comm_until[r] for r in range(self.ranks) if state[r] == "comm"]
        if not events:
            stuck = {r: str(self.actions[r][self.pos[r]]) for r in range(self.ranks)
                     if self.pos[r] < len(self.actions[r])}
            raise RuntimeError(self.deadlock.format(stuck=stuck))
        nxt = max(min(events), now)
        busy_m, comm_s = self.busy_m, self.comm_s
        for r in self._advance(computing, nxt - now, nxt):
            state[r], comm_until[r] = "comm", nxt + comm_s[r]
            busy_m[r] += comm_s[r]
        self.now = nxt
        for r in range(self.ranks):
            if state[r] == "comm" and comm_until[r] <= nxt + 1e-15:
                self._end_action(r)

    def _end_action(self, r: int) -> None:
        """Rank ``r``'s action ends now: record it (``done``, ``trace``), tell :meth:`_sent` where its
        output crosses to another rank, and move the rank to its next action."""
        a, _, done_key, _, boundary = self.steps[r][self.pos[r]]
        self.done[done_key] = self.now
        if boundary is not None:
            self._sent(done_key, boundary)
        if self.trace is not None:
            self.trace.append({"rank": r, "stage": a.stage, "kind": a.kind, "microbatch": a.microbatch,
                               "start": self.started[r], "end": self.now})
        self.state[r] = "idle"
        self.pos[r] += 1
        self.left -= 1

    # -- hooks: compute at full speed, messages that only take their hop

    def _compute_ends(self, computing: list[int]) -> list[float]:
        """When each computing rank's compute would end if nothing changed until then: at full speed,
        its start plus its work."""
        started, remaining = self.started, self.remaining
        return [started[r] + remaining[r] for r in computing]

    def _advance(self, computing: list[int], elapsed: float, now: float) -> list[int]:
        """The computing ranks computed for ``elapsed`` seconds, up to ``now`` (each counts them in
        ``busy_c``): those whose compute has ended (at full speed the ends are known from the start,
        nothing to count down)."""
        started, remaining, busy_c = self.started, self.remaining, self.busy_c
        for r in computing:
            busy_c[r] += elapsed
        return [r for r in computing if started[r] + remaining[r] <= now]

    def _sent(self, key: tuple, boundary: int) -> None:
        """The output of action ``key`` leaves for another rank across stage ``boundary``, now."""

    def _decide(self, computing: list[int]) -> None:
        """Decide the delays of the ``held`` messages and empty it, with the ranks that compute now
        (called once the actions that can start have started, before the clock moves). Nothing is
        held here; a subclass that holds messages decides them."""
        self.held.clear()


def _sweep_order(replay: Replay, records: list[dict]) -> list[dict]:
    """The replay's records (in the order the actions ended) put in the order of a sweep over the
    ranks: round after round, rank 0 runs every action it can, then rank 1, and so on, an input
    made on a higher rank being seen only in the next round. An action's round is the latest of
    its rank's previous action's and of its inputs' (one more for an input from a higher rank),
    each input's read from ``mark`` (round x ranks + rank, the position it sorts by). The order
    :func:`simulate` has always listed its plans in; the times are the replay's."""
    ranks, steps = replay.ranks, replay.steps
    mark: dict[tuple, int] = {}
    nxt, last = [0] * ranks, [0] * ranks
    order = []
    for rec in records:   # in the order of their ends: every input before the actions that read it
        r = rec["rank"]
        step = steps[r][nxt[r]]
        nxt[r] += 1
        k = last[r]
        for d, _ in step[3]:
            k = max(k, mark[d] // ranks + (mark[d] % ranks > r))
        last[r] = k
        mark[step[2]] = k * ranks + r
        order.append(k * ranks + r)
    return [records[j] for j in sorted(range(len(records)), key=order.__getitem__)]


def simulate(actions: list[list[Action]], num_stages: int, *, f: float = 1.0, b: float | None = None,
             w: float = 1.0, style: str = "loop") -> list[dict]:
    """Replay the per-rank lists with fixed costs (messages instant): one record per compute
    action, ``{"rank", "stage", "kind", "microbatch", "start", "end"}`` -- a planned timeline.

    The one replay (:class:`Replay`) with every F costing ``f``, a split B ``b``, a full one ``b``
    (default ``f`` for a split backward and ``f + w`` for a full one), every W ``w``, no tensor-
    parallel communication and no message delay: each action starts when its rank is free and its
    inputs have ended. The send/recv actions of :func:`with_comms` lists are skipped (instant).
    Records are listed round by round, rank by rank (:func:`_sweep_order`). Raises ``RuntimeError``
    naming the stuck actions if the lists would deadlock.
    """
    compute = [[a for a in acts if a.kind in ("F", "B", "W")] for acts in actions]
    split_b, full_b = (b if b is not None else f), (b if b is not None else f + w)
    work = {}
    for s in range(num_stages):
        work[("F", s)], work[("B", s)], work[("Bfull", s)], work[("W", s)] = f, split_b, full_b, w
    records: list[dict] = []
    replay = Replay(compute, num_stages, work, dict.fromkeys(work, 0.0), style=style, trace=records)
    replay.run()
    return _sweep_order(replay, records)


def bubble(timeline: list[dict], ranks: int | None = None) -> float:
    """Idle fraction of a (planned or measured) timeline: 1 - busy / (ranks x span), where busy
    is the time in F, B and W and span runs from the first start to the last end of any rank."""
    comp = [t for t in timeline if t["kind"] in ("F", "B", "W")]
    if not comp:
        return 0.0
    if ranks is None:
        ranks = len({t["rank"] for t in timeline})
    span = max(t["end"] for t in comp) - min(t["start"] for t in comp)
    busy = sum(t["end"] - t["start"] for t in comp)
    return 1.0 - busy / (ranks * span)


def bubble_formula(schedule: str, p: int, m: int, v: int = 2) -> float:
    """The idle fraction with equal F, B and W times (full backward B + W = 2 F).

    (p-1)/(m+p-1) for GPipe and 1F1B; (p-1)/(v m + p-1) for interleaved (m >= p: every round
    fills the p ranks); (p-1)/(3m + p-1) for ZB-H1 (Qi et al.: bubble (p-1)(T_F + T_B - T_W)
    against 3 m T of work); (p-1)/(6m + p-1) for ZBV with m >= 2p (each chunk costs half a
    stage, so the only idle time left is the chunk-forward ramp of the V, (p-1) T_F / 2, against
    3 m T of work) and for DualPipeV (m >= 2p, which it needs: with equal F, B and W its plan
    idles exactly as long as ZBV's; DualPipe's gain is overlapping the paired F and B with each
    other's communication, which equal-cost sleeping stages do not model). Where a closed form does not apply (interleaved with m < p, ZBV with m < 2p)
    the plan's own value, from :func:`simulate`, is returned.
    """
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule == "interleaved":
        if m >= p:
            return (p - 1) / (v * m + p - 1)
        return bubble(simulate(with_comms(interleaved(p, v, m), v * p), v * p, f=1 / v, w=1 / v), p)
    if schedule == "zb_h1":
        return (p - 1) / (3 * m + p - 1)
    if schedule == "zbv":
        if m >= 2 * p:
            return (p - 1) / (6 * m + p - 1)
        return bubble(simulate(with_comms(zbv(p, m), 2 * p, "v"), 2 * p, f=0.5, w=0.5, style="v"), p)
    if schedule == "dualpipev":  # m >= 2p always: with equal F, B, W the same idle time as ZBV
        return (p - 1) / (6 * m + p - 1)
    raise ValueError(f"bubble_formula: schedule={schedule!r} is not known: use gpipe, 1f1b, "
                     "interleaved, zb_h1, zbv or dualpipev")


def peak_live_bytes(actions: list[Action], one: dict[int, float],
                    held_by_w: dict[int, float] | None = None) -> float:
    """The most activation bytes one rank's list keeps alive at once: the schedule's count of
    micro-batches in flight, weighted by what each holds.

    ``one[stage]``: the bytes a micro-batch's forward keeps until its backward (M_B). A full
    backward frees them. A split one (a W follows) goes from M_B to ``held_by_w[stage]`` (M_W:
    the inputs of the deferred matrix products and their output gradients, see
    ``pipeline_backward``; default M_B, as if B freed nothing), which its W frees. So 1F1B on
    stage s peaks at (p - s) M_B, GPipe at m M_B, and ZB-H1 on stage s at (p - s) M_B + s M_W
    -- at most 1F1B's p M_B when M_W <= M_B, the paper's claim. With several stages per rank
    their peaks need not coincide, so this is at most ``sum(live[s] * one[s])``.
    """
    split = {(a.stage, a.microbatch) for a in actions if a.kind == "W"}
    held = one if held_by_w is None else held_by_w
    total = peak = 0.0
    for a in actions:
        if a.kind == "F":
            total += one[a.stage]
            peak = max(peak, total)
        elif a.kind == "B":
            total -= one[a.stage]
            if (a.stage, a.microbatch) in split:
                total += held[a.stage]
                peak = max(peak, total)
        elif a.kind == "W":
            total -= held[a.stage]
    return peak


def live_microbatches(actions: list[Action]) -> dict[int, int]:
    """Per stage of one rank's list: the most micro-batches whose activations are alive at once
    (a forward makes them, the backward -- or the W, when the backward is split -- frees them)."""
    split = {(a.stage, a.microbatch) for a in actions if a.kind == "W"}
    live: dict[int, int] = {}
    peak: dict[int, int] = {}
    for a in actions:
        if a.kind == "F":
            live[a.stage] = live.get(a.stage, 0) + 1
            peak[a.stage] = max(peak.get(a.stage, 0), live[a.stage])
        elif (a.kind == "B" and (a.stage, a.microbatch) not in split) or a.kind == "W":
            live[a.stage] -= 1
    return peak
