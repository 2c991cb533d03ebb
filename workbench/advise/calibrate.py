"""Measure this machine into a :class:`Cluster`, under the concurrency of the runs it predicts.

This is the CPU calibration (``workbench advise --calibrate``): ranks on this machine's cores, their
contention measured as well (:mod:`workbench.advise.shared_cores` prices it). A GPU is measured by
:mod:`workbench.advise.calibrate_cuda` (``workbench advise --calibrate --device cuda``) into a
device profile instead.

A prediction validated against a run takes its machine constants in that same run, interleaved
with the runs it predicts (docs/design.md, "Predictions calibrate where they are checked"): on a
shared CPU the achieved speed drifts with the load, so constants measured a minute earlier
miss. :class:`Calibration` is therefore a set of *probes* that run inside the ranks of a launch,
each probe once per call of :meth:`Calibration.once`, so that :mod:`workbench.advise.validate`
can call it as one more candidate of its interleaved trials; :meth:`Calibration.result` takes
each probe's median. :func:`calibrate` does the same on its own (``workbench advise --calibrate``).

What is measured (every rank runs the same probes at once, as in the runs; the one exception,
"alone", is rank 0 computing while the others wait in a barrier, asleep)
----------------------------------------------------------------------------------------------
Each number is turned into what one rank achieves with the machine to itself (times
``world / cores``, the share of the cores each rank had), which is what
:mod:`workbench.advise.timing` expects.

``flops``                 a matmul shaped like the model's MLP, ``(r2 s, h) @ (h, 4h)``, in
                          bfloat16 (``flops``) and float32 (``fp32_flops``).
``layer``                 one transformer block's forward + backward on each of ``rows``: a
                          straight line in the tokens (least squares). Its intercept is the fixed cost
                          per layer and micro-batch (``layer_overhead_s``: Python, dispatch); its
                          slope, less the matmuls' FLOPs at ``flops``, is the memory-bound work
                          (norms, GELU, softmax, residual adds, copies), charged per byte of the
                          activations the layer keeps (``activation_s_per_byte``; the bytes of
                          :func:`workbench.parallel.tensor.activation_bytes_per_layer`, which
                          shrink with tensor and sequence parallelism as that work does).
``cores``                 the block on ``r2`` rows alone and on every rank at once: ``world x
                          alone / all`` is how many ranks' worth of compute the machine runs at once
                          (2 on an idle 2-core machine; less when other work shares it).
                          :mod:`workbench.advise.timing` shares them among the ranks computing
                          at each moment, so a pipeline stage working alone in a bubble runs
                          at full speed, as it does when the other ranks wait.
``sync_by_size``          every rank computes then all-reduces one float (over all ranks, and over
                          pairs), less the two timed apart (the long compute in turns with the
                          compute and the collective, in one loop, so that both see the same load): what a collective costs beyond its
                          bytes when it follows compute and the ranks outnumber the cores (they
                          drift apart within the OS's time slices, and the collective waits for
                          the last one to be scheduled again). Timed after a short compute (a
                          128 x 128 matmul) and a long one (a block on ``r1`` rows): the price
                          grows with the compute in between, up to a time slice or so.
                          :mod:`workbench.advise.timing` charges it per collective and message,
                          interpolated at the compute that precedes each.
``message_cpu``           a block on ``r1`` rows, then one message each way with the pair's other
                          rank (64 KiB and 1 MiB, as a pipeline stage passes activations and
                          gradients): the CPU seconds (``time.thread_time``) the rank's thread spends
                          per message end, posting, waiting (a sleeping thread woken) and copying.
                          After compute that is several times the cost of the same message sent
                          back to back. :mod:`workbench.advise.timing` charges each end to the
                          pipeline action that sends or receives it, as work that shares the cores.
                          (One machine's figures for this and the probes below:
                          ``docs/benchmarks/2026-11-27-figures-from-the-code-2vcpu.md``.)
``time_slice_s``          every rank spins on small matmuls, reading the clock, for ``SLICE_SPIN_S``:
                          the median gap between two readings longer than 0.2 ms is how long a rank
                          stays off a core while the others run, the scheduler's time slice (4 ranks
                          on 2 cores: each runs one slice, then waits about one). A
                          message that lands while every core computes reaches its waiting rank
                          when a running rank's slice ends, half a slice later on average:
                          :func:`workbench.advise.timing.simulate` charges that to pipeline
                          messages on this machine's own links.
``collective_cpu``        a block on ``r2`` rows, then an all-gather (or a reduce-scatter) of one
                          block's parameters sharded over every rank, as ZeRO-3 gathers and reduces a
                          unit: the CPU seconds of the whole process (``getrusage``: the rank's
                          thread, gloo's, the communication thread) per collective. Where ranks
                          share cores it can exceed what the message curves price the same
                          collective at: :mod:`workbench.advise.timing` bounds ZeRO-3's traffic
                          below by it.
``split_overhead_s``      the block on ``r1`` rows with its backward split into B (input gradient)
                          and W (weight gradient) as a zero-bubble pipeline stage runs it, less the
                          block unsplit, timed in turns: the split's walk of the autograd graph, per
                          layer and micro-batch (for a small model, comparable to the block's own
                          forward and backward).
``split_w_share``         in the same loop, W's share of the split backward (B + W), each phase
                          timed: where a zero-bubble replay puts the backward's time. It can be
                          well below the FLOPs' share (``weights / forward`` per layer): B keeps the
                          attention core's backward, the elementwise work and most of the walk.
``pipeline_action_s``     each pair of ranks runs the block as a 2-stage 1F1B pipeline
                          (:mod:`workbench.parallel.pipeline`, ``PIPELINE_PROBE_MICROBATCHES``
                          micro-batches of ``r1`` rows) and, in turns, the same forwards and backwards
                          directly: the thread CPU the pipeline spends beyond them, per action, less
                          the action's message end (``message_cpu``, charged apart) -- the schedule's
                          own loop (posting, bookkeeping, its timeline, the line-up) and the actions
                          run slower between messages than back to back.
``microbatch_overhead_s`` the whole model's forward + backward on ``r1`` rows, less its layers:
                          embedding, head, loss, per micro-batch.
``layer_costs``           the model's own layers at the runs' real micro-batch shapes (vTrain's way:
                          profile the layers, not a FLOP rate): for every row count ``r`` of ``rows``
                          the whole model, and for every ``(r, t, sequence_parallel)`` of
                          ``tp_shapes`` the model split by
                          :func:`workbench.parallel.tensor.tensor_parallel` over groups of ``t``
                          adjacent ranks (as the mesh lays them out), each timed with all its layers
                          and with none (the edges: embedding, head, loss; the difference over the
                          layers: one layer, its collectives included). The whole model, not the
                          block above times its layers: each of its layers has its own weights and
                          activations, which a block timed over and over keeps in cache, so the
                          model takes longer than its layers timed as one block. Per-operator
                          costs (Python, dispatch, small kernels below the matmul rate) and the
                          collectives' waits are inside; :mod:`workbench.advise.timing` uses these
                          where a configuration's shape was timed, and the formulas elsewhere.
                          The tensor-parallel model with all its layers is also timed with its first
                          group of ``t`` ranks alone, the others asleep (``alone``: that time over
                          the time with every rank busy), as a pipeline stage computes in its
                          ramp-up and drain: its ranks wait for each other within every layer,
                          which no core speeds up (so ``alone`` is above what sharing the cores
                          alone would give, ``1 / groups``).
``prefetch_overlap``      ZeRO-3's prefetch: a block's parameters all-gathered (asynchronously) while
                          a block's forward + backward runs on ``r2`` rows, timed in turns with the
                          block alone and the gather alone. The pair's excess over the block is the
                          wait; :func:`workbench.advise.timing.prefetch_wait` solved for the share of
                          the gather that hid (0: the gather's messages wait while the ranks compute,
                          as on this machine's own links, where its thread needs a core they hold;
                          up to about a half on an emulated link, whose held-back time the sender sleeps).
``update_s_per_param``    AdamW's step on the model's own tensors, per parameter, its per-tensor
                          costs included (gradients of training's size: gradients of zeros
                          decay the moments into denormal numbers, several times slower; and
                          one flat tensor of the model's size allocates temporaries as large,
                          whose page faults can cost several times the step);
``step_overhead_s``       a whole training step on ``r1`` rows (``zero_grad(set_to_none=True)``,
                          forward, backward, AdamW's step) less its forward and backward (timed in
                          turns in one loop) and the update: the gradients' allocation and
                          whatever else a step does once.
``machine``               a :class:`~workbench.comm.cost.CostModel` whose curves are this
                          machine's messages, timed with every pair of ranks exchanging at once
                          (:class:`workbench.measure.probes.Probe` with ``all_pairs``): the cost of a
                          link that is not emulated.
``links``                 the emulated topology's links, where one is given: a message on an
                          emulated link costs ``latency + bytes / bandwidth`` whatever the load.

The :class:`CalibratedCluster` returned is a :class:`Cluster` (``flops``, ``intra``, ``inter``:
the emulated links, or the loopback's straight line where a link is not emulated) with these
numbers added, and the load average seen.
"""
from __future__ import annotations

import math
import os
import statistics
import time
from dataclasses import dataclass, field, replace
from types import SimpleNamespace
import resource
import warnings

import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import probes as measure
from workbench.advise.cluster import Cluster
from workbench.advise.shape import ModelShape
from workbench.advise.shared_cores import message_cpu, sync_price
from workbench.advise.timing import flops_per_token, group_topology, prefetch_wait
from workbench.comm import cost
from workbench.comm.topology import Link, Topology
from workbench.models import GPT, GPTConfig
from workbench.models.gpt import Block
from workbench.parallel import pipeline_backward as split_backward
from workbench.parallel.pipeline import PipelineStage, Schedule1F1B
from workbench.parallel.tensor import activation_bytes_per_layer, parameters_per_rank, tensor_parallel
from workbench.measure.probes import Probe

__all__ = ["Calibration", "CalibratedCluster", "calibrate", "load_average"]

# message sizes the comm probes time (bytes, x4 steps): the curves are interpolated between them
PROBE_SIZES = tuple(16 << (2 * k) for k in range(11))   # 16 B .. 16 MiB
# the message sizes whose CPU per endpoint is timed after compute (a pipeline's activations: tiny
# to small models' micro-batches); the cost is a straight line through them
MESSAGE_CPU_SIZES = (64 << 10, 1 << 20)
MESSAGE_CPU_CALLS = 8   # block + exchange pairs per size and call of once()
COLLECTIVE_CPU_CALLS = 4   # block + collective pairs per kind and call of once()
PIPELINE_PROBE_MICROBATCHES = 4   # the pipeline probe's micro-batches per step (2 stages, 1F1B)
PIPELINE_CPU_CALLS = 4     # pipeline steps, each beside the same work run directly, per call of once()
SLICE_SPIN_S = 0.3         # seconds every rank spins to see the scheduler's time slice, per call of once()
SLICE_GAP_S = 2e-4         # a gap between two clock readings longer than this: the rank was off its core


def load_average() -> float:
    """The machine's 1-minute load average (NaN where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


@dataclass(frozen=True)
class CalibratedCluster(Cluster):
    """A :class:`Cluster` measured on this machine (see the module docstring for each number)."""

    cores: float | None = None                 # ranks' worth of compute the machine runs at once
    sync_s: float = 0.0                        # price of a synchronisation after compute (see docstring)
    sync_by_size: dict | None = None           # per group size, [(compute before it s, price s), ...]
    layer_overhead_s: float = 0.0
    split_overhead_s: float = 0.0              # per layer and micro-batch: a zero-bubble B/W split's graph walk
    split_w_share: float | None = None         # W's share of a split backward (None: the FLOPs')
    pipeline_action_s: float = 0.0             # per pipeline action: the schedule's own CPU beyond the
                                               # stage's work and the action's message end
    microbatch_overhead_s: float = 0.0
    step_overhead_s: float = 0.0
    update_s_per_param: float | None = None
    activation_s_per_byte: float = 0.0
    layer_costs: dict | None = None            # (rows, t, sp) -> {"layer": s, "edges": s}, all ranks busy
    message_cpu: tuple | None = None           # ((bytes, CPU s per message end after compute), ...)
    time_slice_s: float = 0.0                  # the scheduler's time slice with every rank busy
    collective_cpu: dict | None = None         # {"all_gather", "reduce_scatter": process CPU s per
                                               # ZeRO-3 unit's collective after compute}
    overlap: float = 0.0                       # share of compute that hides data-parallel traffic
    prefetch_overlap: float | None = None      # share of a gather beside compute that hides (ZeRO-3;
                                               # None: ``overlap``)
    machine: object = None                     # comm.cost.CostModel of the links not emulated
    links: Topology | None = None              # the emulated links (None: this machine's own)
    load: float = float("nan")                 # load average while measuring
    measured: dict = field(default_factory=dict, compare=False)


def _gpt_config(model):
    if isinstance(model, GPTConfig):
        return model
    if isinstance(model, str):
        return GPTConfig.preset(model)
    raise ValueError(f"calibrate(model={model!r}): pass a GPTConfig or a preset name ('tiny', 'small', 'medium')")


class Calibration:
    """The probes, run inside every rank of a launch: ``once()`` times each probe once (a
    collective: call it on every rank), ``result()`` gives the medians (the same on every rank).

    ``model``: the GPT whose blocks are timed (a :class:`GPTConfig` or preset); ``rows``: two or
    more row counts of the block's line (use the micro-batch sizes the runs use; the smallest is
    ``r1``, the largest ``r2``);
    ``tp_shapes``: ``(rows, t, sequence_parallel)`` of the tensor-parallel runs to time the model's
    layers at (``t`` must divide the world size; the row count need not be in ``rows``);
    ``sizes``: message sizes for the comm probes; ``iterations``: the fewest calls per timing, more
    where they take less than ``budget_s`` (up to 200).
    """

    def __init__(self, model="small", rows: tuple[int, int] = (1, 4), *, tp_shapes=(), sizes=PROBE_SIZES,
                 iterations: int = 2, budget_s: float = 0.1, seed: int = 0):
        rows = tuple(sorted(set(rows))) if isinstance(rows, (tuple, list)) else rows
        if not isinstance(rows, tuple) or len(rows) < 2 or not all(
                isinstance(r, int) and not isinstance(r, bool) and r >= 1 for r in rows):
            raise ValueError(f"Calibration(rows={rows!r}): give two or more different row counts >= 1 "
                             "(the micro-batch sizes the runs use), e.g. (1, 4)")
        r1, r2 = rows[0], rows[-1]
        self.config = _gpt_config(model)
        self.rows, self.iterations = rows, iterations
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        self.tp_shapes = _check_tp_shapes(tp_shapes, self.world)
        c = self.config
        g = torch.Generator().manual_seed(seed)
        torch.manual_seed(seed)
        self.block = Block(c)
        self.gpt = GPT(c)
        self.inputs = {r: torch.randn(r, c.block_size, c.n_embd, generator=g, requires_grad=True) for r in rows}
        every = sorted(set(rows) | {r for r, _, _ in self.tp_shapes})
        self.token_rows = {r: torch.randint(c.vocab_size, (r, c.block_size), generator=g) for r in every}
        self.tokens = self.token_rows[r1]
        self.edges = _gpt(c, 0, None, False, seed)   # the model without its blocks
        self.a = torch.randn(r2 * c.block_size, c.n_embd, generator=g)
        self.b = torch.randn(c.n_embd, 4 * c.n_embd, generator=g)
        self.a16, self.b16 = self.a.to(torch.bfloat16), self.b.to(torch.bfloat16)
        psi = sum(p.numel() for p in self.gpt.parameters())
        # AdamW's step on the model's own tensors, with gradients of training's magnitude: gradients of
        # zeros decay its moments into denormal numbers, several times slower; one flat tensor of the
        # model's size allocates temporaries of its size, whose page faults cost more than the step
        self.gpt_opt = torch.optim.AdamW(self.gpt.parameters(), lr=1e-3)
        for p in self.gpt.parameters():
            p.grad = torch.randn(p.shape, generator=g) * 1e-2
        self.psi = psi
        self.one = torch.zeros(1)
        # one block's parameters, sharded over every rank as ZeRO-3 shards a unit: what it gathers
        unit = -(-sum(p.numel() for p in self.block.parameters()) // self.world)
        self.unit_shard, self.unit_full = torch.randn(unit, generator=g), torch.zeros(unit * self.world)
        self.unit_reduced = torch.empty(unit)   # a reduce-scatter's output (the shard stays as it is)
        self.s1, self.s2 = torch.randn(128, 128, generator=g), torch.randn(128, 128, generator=g)
        self.wire = {n: (torch.zeros(n // 4), torch.empty(n // 4)) for n in MESSAGE_CPU_SIZES}
        self.pair = None   # ranks (2k, 2k+1): a group of two, as a tensor-parallel pair or a stage boundary
        for k in range(self.world // 2):
            pair = dist.new_group([2 * k, 2 * k + 1])
            if self.rank // 2 == k:
                self.pair = pair
        # the block as a 2-stage pipeline over the pair (stage = the rank's place in it), for
        # _pipeline_action_cpu: the first stage fed a batch that needs no gradient, the last a loss
        self.pipe = None
        if self.pair is not None:
            m, me = PIPELINE_PROBE_MICROBATCHES, dist.get_rank(self.pair)
            self.pipe = Schedule1F1B(PipelineStage(self.block, me, 2, group=self.pair), m,
                                     loss_fn=lambda out, target: out.pow(2).mean())
            x = self.inputs[r1].detach()
            self.pipe_batch = torch.cat([x] * m)
            self.pipe_first = me == 0
            self.pipe_input = x if me == 0 else self.inputs[r1]   # the last stage's input needs a gradient
        # the model split by tensor parallelism over groups of t adjacent ranks (the mesh's tp groups),
        # with all its layers and with none: per (t, sp), built once and timed at each row count
        self.tp_models: dict[tuple[int, bool], tuple] = {}
        for t in sorted({t for _, t, _ in self.tp_shapes}):
            mine = None
            for k in range(self.world // t):
                grp = dist.new_group(list(range(k * t, (k + 1) * t))) if t < self.world else None
                if self.rank // t == k:
                    mine = grp
            for sp in sorted({sp for _, t2, sp in self.tp_shapes if t2 == t}):
                self.tp_models[(t, sp)] = tuple(_gpt(c, layers, mine, sp, seed, t) for layers in (c.n_layer, 0))
        self.sizes = tuple(sizes)
        self.probes = {(kind, n): Probe(kind, n, all_pairs=True) for kind in Probe.KINDS for n in self.sizes}
        self.samples: dict[str, list[float]] = {}
        for _ in range(2):  # warm up: pages, allocator, Adam's state
            self._layer(r2)
            self.gpt_opt.step()
            self._model()
        self.budget_s = budget_s
        self.split_phases = [0.0, 0.0]
        self.counts: dict[str, int] = {}   # calls per timing of each probe, the same on every rank

    # -- the probes' bodies
    def _layer(self, rows: int) -> None:
        self.block(self.inputs[rows]).sum().backward()

    def _split_layer(self, rows: int) -> None:
        """The block's forward and backward split into B and W as a zero-bubble pipeline stage runs
        them (:mod:`workbench.parallel.pipeline_backward`): the same work and a walk of the graph."""
        x = self.inputs[rows]
        params = list(self.block.parameters())
        with split_backward.SavedActivations() as saved:
            out = self.block(x)
        start = time.perf_counter()
        _, state = split_backward.backward_input(out, torch.ones_like(out), [x], params, saved)
        middle = time.perf_counter()
        split_backward.backward_weight(state, params)
        self.split_phases[0] += middle - start
        self.split_phases[1] += time.perf_counter() - middle

    def _model(self) -> None:
        _, loss = self.gpt(self.tokens, self.tokens)
        loss.backward()

    def _run_model(self, model, rows: int) -> None:
        tokens = self.token_rows[rows]
        _, loss = model(tokens, tokens)
        loss.backward()

    def _sync(self, group=None) -> None:
        comm.all_reduce(self.one, group=group)   # the door the strategies' collectives go through

    def _gather(self):
        return comm.all_gather(list(self.unit_full.chunk(self.world)), self.unit_shard, async_op=True)

    def _gather_alone(self) -> None:
        self._gather().wait()

    def _gather_beside(self, rows: int) -> None:
        work = self._gather()   # ZeRO-3's prefetch: the next unit's gather while this unit computes
        self._layer(rows)
        work.wait()

    def _message_cpu(self, nbytes: int, rows: int) -> float:
        """CPU seconds of this thread per message end (a send or a receive, posted and waited
        for) when the message follows compute: a block on ``rows``, then one message each way with
        the pair's other rank, as a pipeline stage sends its output and receives the next input.
        The mean over every rank."""
        out, into = self.wire[nbytes]
        peer = 1 - dist.get_rank(self.pair)
        spent = 0.0
        dist.barrier()
        for _ in range(MESSAGE_CPU_CALLS):
            self._layer(rows)
            start = time.thread_time()
            if peer:   # the pair's first rank sends first, the second receives first
                sent = comm.isend(out, group=self.pair, group_dst=peer)
                comm.irecv(into, group=self.pair, group_src=peer).wait()
            else:
                comm.irecv(into, group=self.pair, group_src=peer).wait()
                sent = comm.isend(out, group=self.pair, group_dst=peer)
            sent.wait()
            spent += time.thread_time() - start
        t = torch.tensor([spent / (2 * MESSAGE_CPU_CALLS)], dtype=torch.float64)
        dist.all_reduce(t)
        return float(t[0]) / self.world

    def _pipeline_step(self) -> None:
        if self.pipe_first:
            self.pipe.step(self.pipe_batch)
        else:
            self.pipe.step(target=self.pipe_batch)

    def _pipeline_direct(self) -> None:
        """The pipeline step's forwards and backwards, run back to back with no schedule around them."""
        for _ in range(PIPELINE_PROBE_MICROBATCHES):
            out = self.block(self.pipe_input)
            if self.pipe_first:
                out.backward(torch.ones_like(out))
            else:
                (out.pow(2).mean() / PIPELINE_PROBE_MICROBATCHES).backward()

    def _pipeline_action_cpu(self) -> float:
        """CPU seconds of this thread per action that a 2-stage 1F1B pipeline step of the block
        spends beyond its stage's forwards and backwards run directly (timed in turns), its
        message end included; the pair's two ranks each hold a stage. The mean over the ranks
        that have a pair (a rank without one runs the direct loop, to keep the cores as busy)."""
        spent = torch.zeros(2, dtype=torch.float64)
        dist.barrier()
        for _ in range(PIPELINE_CPU_CALLS):
            if self.pipe is not None:
                start = time.thread_time()
                self._pipeline_step()
                middle = time.thread_time()
                self._pipeline_direct()
                spent[0] += (middle - start) - (time.thread_time() - middle)
                spent[1] += 1
            else:
                self._layer(self.rows[0])
        dist.all_reduce(spent)
        return float(spent[0] / max(1.0, float(spent[1]))) / (2 * PIPELINE_PROBE_MICROBATCHES)

    def _collective_cpu(self, rows: int) -> tuple[float, float]:
        """CPU seconds of this process (every thread: the rank's own, gloo's, the communication
        thread's) per all-gather and per reduce-scatter of one block's parameters, sharded over
        every rank as ZeRO-3 shards a unit, each issued after a block on ``rows`` and waited for.
        The mean over every rank."""
        def cpu() -> float:
            r = resource.getrusage(resource.RUSAGE_SELF)
            return r.ru_utime + r.ru_stime

        chunks = list(self.unit_full.chunk(self.world))
        spent = [0.0, 0.0]
        dist.barrier()
        for k, run in enumerate((lambda: self._gather().wait(),
                                 lambda: comm.reduce_scatter(self.unit_reduced, chunks, async_op=True).wait())):
            for _ in range(COLLECTIVE_CPU_CALLS):
                self._layer(rows)
                start = cpu()
                run()
                spent[k] += cpu() - start
        t = torch.tensor(spent, dtype=torch.float64) / COLLECTIVE_CPU_CALLS
        dist.all_reduce(t)
        return float(t[0]) / self.world, float(t[1]) / self.world

    def _time_slice(self) -> float:
        """The scheduler's time slice with every rank busy: every rank spins on small matmuls for
        ``SLICE_SPIN_S``, reading the clock; a gap longer than ``SLICE_GAP_S`` between two readings
        is a time the rank was off its core while another ran. The median gap over every rank (0
        where no rank was ever taken off its core: a core each)."""
        gaps = []
        dist.barrier()
        start = last = time.monotonic()
        while last - start < SLICE_SPIN_S:
            self._short()
            now = time.monotonic()
            if now - last > SLICE_GAP_S:
                gaps.append(now - last)
            last = now
        everyone = [None] * self.world
        dist.all_gather_object(everyone, gaps)
        every = [g for mine in everyone for g in mine]
        return statistics.median(every) if every else 0.0

    def _short(self) -> None:
        torch.mm(self.s1, self.s2)

    def _matmul(self) -> None:
        torch.mm(self.a, self.b)

    def _matmul_bf16(self) -> None:
        torch.mm(self.a16, self.b16)

    def _gpt_step(self) -> None:
        self.gpt_opt.step()

    def _train(self) -> None:
        self.gpt_opt.zero_grad(set_to_none=True)
        self._model()
        self.gpt_opt.step()

    def _time(self, fn, *, alone: bool | int, iterations: int | None = None, key: str | None = None,
              span: bool = True) -> float:
        """Seconds per call of ``fn``: on rank 0 alone (the others asleep in a barrier; ``alone=k``:
        ranks ``0 .. k-1``, a group of ``k``, the slowest one's), or on every
        rank at once (the span from the first start to the last end, over the calls; ``span=False``:
        the slowest rank's own time, for probes whose messages line the ranks up). The same number
        on every rank. ``key``: the probe's
        name; its first timing sets how many calls fill ``budget_s`` (short timings favour ranks
        that just woke up over the machine's other work, long runs do not)."""
        n = iterations or self.iterations
        if key is not None and iterations is None:
            if key not in self.counts:
                one = self._time(fn, alone=alone, iterations=1)
                self.counts[key] = max(self.iterations, min(200, math.ceil(self.budget_s / max(one, 1e-6))))
            n = self.counts[key]
        dist.barrier()
        if alone or not span:
            t = torch.zeros(1, dtype=torch.float64)
            if not alone or self.rank < int(alone):
                start = time.perf_counter()
                for _ in range(n):
                    fn()
                t[0] = (time.perf_counter() - start) / n
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            return float(t[0])
        # every rank at once: from the first rank's start to the last rank's end (one clock for all the
        # ranks of a machine), so that ranks leaving the barrier late -- a rank that runs its loop
        # before the others wake up has the cores to itself -- do not make the oversubscription look smaller
        ends = torch.zeros(2, dtype=torch.float64)
        ends[0] = -time.monotonic()
        for _ in range(n):
            fn()
        ends[1] = time.monotonic()
        dist.all_reduce(ends, op=dist.ReduceOp.MAX)
        return float(ends[1] + ends[0]) / n

    def _time_paired(self, *fns, key: str, budget: float = 3.0, least: int = 0) -> tuple[float, ...]:
        """Seconds per call of each of ``fns``, timed in turns in one loop on every rank (the
        slowest rank's each), so that all see the same load: their differences are not the load's
        drift between probes. ``budget``: times ``budget_s`` (a difference needs more calls:
        what a collective waits for a peer's core varies from call to call by whole time slices,
        and a step pays the mean of many); ``least``: the fewest calls, however long they take."""
        if key not in self.counts:
            one = self._time(fns[-1], alone=False, iterations=1)
            self.counts[key] = max(self.iterations, least,
                                   min(200, math.ceil(budget * self.budget_s / len(fns) / max(one, 1e-6))))
        n = self.counts[key]
        dist.barrier()
        t = torch.zeros(len(fns), dtype=torch.float64)
        for _ in range(n):
            for i, fn in enumerate(fns):
                start = time.perf_counter()
                fn()
                t[i] += time.perf_counter() - start
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return tuple(float(v) / n for v in t)

    def _add(self, key: str, value: float) -> None:
        self.samples.setdefault(key, []).append(value)

    def once(self) -> None:
        """Every probe once (call on every rank)."""
        r1, r2 = self.rows[0], self.rows[-1]
        layer1, layer2 = (lambda: self._layer(r1)), (lambda: self._layer(r2))
        probes = {"layer_r2_alone": (layer2, True), "layer_r2": (layer2, False), "layer_r1": (layer1, False),
                  **{f"layer_rows{r}": ((lambda r=r: self._layer(r)), False) for r in self.rows[1:-1]},
                  "matmul": (self._matmul, False), "matmul_bf16": (self._matmul_bf16, False),
                  "adam_model": (self._gpt_step, False),
                  "short": (self._short, False),
                  **{_tp_key(r, 1, False, "none"): ((lambda r=r: self._run_model(self.edges, r)), False)
                     for r in self.rows},
                  **{_tp_key(r, 1, False, "all"): ((lambda r=r: self._run_model(self.gpt, r)), False)
                     for r in self.rows}}
        for r, t, sp in self.tp_shapes:
            for name, m in zip(("all", "none"), self.tp_models[(t, sp)]):
                probes[_tp_key(r, t, sp, name)] = ((lambda m=m, r=r: self._run_model(m, r)), False)
            if t < self.world:   # the first group alone, the others asleep: a pipeline stage in its ramp-up
                probes[_tp_key(r, t, sp, "all") + "_alone"] = ((lambda m=self.tp_models[(t, sp)][0], r=r:
                                                                self._run_model(m, r)), t)
        for g, group in (("world", None), ("pair", self.pair)):
            probes[f"sync_{g}"] = ((lambda group=group: self._sync(group)), False)
            probes[f"short_sync_{g}"] = ((lambda group=group: (self._short(), self._sync(group))), False)
        for key, (fn, alone) in probes.items():   # the collectives' loops line the ranks up themselves
            self._add(key, self._time(fn, alone=alone, key=key, span="sync" not in key))
        a, b = self._time_paired(self._model, self._train, key="train_r1")
        self._add("model_before_train_r1", a)
        self._add("train_r1", b)
        self.split_phases = [0.0, 0.0]   # B's seconds, W's, over the loop's calls
        a, b = self._time_paired(layer1, lambda: self._split_layer(r1), key="split_r1")
        self._add("layer_r1_before_split", a)
        self._add("split_r1", b)
        phases = torch.tensor(self.split_phases, dtype=torch.float64)
        dist.all_reduce(phases, op=dist.ReduceOp.MAX)
        self._add("split_w_share_r1", float(phases[1] / max(1e-12, phases.sum())))
        for g, group in (("world", None), ("pair", self.pair)):   # a block, then a block and a collective
            a, b = self._time_paired(layer1, lambda group=group: (self._layer(r1), self._sync(group)),
                                     key=f"layer_r1_sync_{g}")
            self._add(f"layer_r1_before_sync_{g}", a)
            self._add(f"layer_r1_sync_{g}", b)
        for n in MESSAGE_CPU_SIZES:
            self._add(f"message_cpu:{n}", self._message_cpu(n, r1))
        self._add("time_slice", self._time_slice())
        gather, scatter = self._collective_cpu(r2)
        self._add("pipeline_action_cpu", self._pipeline_action_cpu())
        self._add("gather_cpu", gather)
        self._add("reduce_scatter_cpu", scatter)
        a, b, c = self._time_paired(layer2, self._gather_alone, lambda: self._gather_beside(r2), key="prefetch",
                                    least=4)   # a share of a difference: noisier than a time
        self._add("prefetch_layer", a)
        self._add("prefetch_gather", b)
        self._add("prefetch_both", c)
        for (kind, n), probe in self.probes.items():
            iters = max(2, min(10, (4 << 20) // max(n, 1)))
            self._add(f"{kind}:{n}", self._time(probe, alone=False, iterations=iters, span=False))
        for n, t in measure.reduction_time([n for n in self.sizes if n >= 1024], iterations=5, repeats=1):
            self._add(f"reduction:{n}", max_over(t))

    def result(self) -> dict[str, float]:
        """Each probe's median over the calls of :meth:`once` so far."""
        return {k: statistics.median(v) for k, v in self.samples.items()}


def _check_tp_shapes(tp_shapes, world: int) -> tuple[tuple[int, int, bool], ...]:
    out = []
    for shape in tp_shapes or ():
        if not (isinstance(shape, (tuple, list)) and len(shape) == 3):
            raise ValueError(f"Calibration(tp_shapes=...): {shape!r} is not (rows, t, sequence_parallel), e.g. (8, 2, False)")
        r, t, sp = shape
        if isinstance(r, bool) or not isinstance(r, int) or r < 1 or isinstance(t, bool) or not isinstance(t, int) \
                or t < 2 or world % t:
            raise ValueError(f"Calibration(tp_shapes=...): {shape!r} needs rows >= 1 and a tensor-parallel size t >= 2 "
                             f"dividing the world size {world}")
        out.append((r, t, bool(sp)))
    return tuple(sorted(set(out)))


def _tp_key(rows: int, t: int, sp: bool, which: str) -> str:
    """A layer probe's name: ``which`` is "all" (the model with all its layers) or "none" (with none)."""
    return f"tp{t}{'sp' if sp else ''}_rows{rows}_{which}"


def _gpt(config, layers: int, group, sequence_parallel: bool, seed: int, t: int = 1):
    """``GPT(config)`` with ``layers`` blocks (0: embedding, final norm, head and loss only), split
    by tensor parallelism over ``group`` where ``t > 1``."""
    torch.manual_seed(seed)
    model = GPT(replace(config, n_layer=max(1, layers)))
    if t > 1:
        model = tensor_parallel(model, group=group, sequence_parallel=sequence_parallel)
    if layers == 0:
        model.blocks = torch.nn.ModuleList()
    return model


def max_over(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t[0])


def layer_costs(result: dict[str, float], rows: tuple[int, ...], layers: int) -> dict:
    """The model's layers at each shape the probes timed, in seconds with every rank busy:
    ``{(rows, t, sequence_parallel): {"layer": one layer's forward + backward (its tensor-parallel
    collectives included), "edges": the rest of a micro-batch (embedding, head, loss)}}``: the
    model with all its layers less the model with none, over the layers, where both were timed
    (a result without the whole model at ``t = 1``: the block as timed). Where that difference is not
    positive (the layers lost in the noise of two runs timed apart), a ``t > 1`` layer is the ``t = 1``
    layer over ``t``. With ``t > 1``, where it
    was timed, ``"alone"``: the whole model's time with its first tensor-parallel group computing
    and the other ranks asleep, over its time with every rank busy."""
    rows = tuple(sorted(set(rows)))
    out = {}
    for r in rows:
        layer = result.get("layer_r1" if r == rows[0] else "layer_r2" if r == rows[-1] else f"layer_rows{r}")
        edges = result.get(_tp_key(r, 1, False, "none"))
        if layer is not None and edges is not None:
            out[(r, 1, False)] = {"layer": layer, "edges": edges}
    whole = {}   # (rows, t, sequence_parallel) -> the whole model's probe
    for key in result:
        if key.startswith("tp") and key.endswith("_all"):
            head, r = key[:-len("_all")].split("_rows")
            whole[(int(r), int(head[2:].replace("sp", "")), head.endswith("sp"))] = key
    for shape, key in sorted(whole.items(), key=lambda item: item[0][1]):   # t = 1 first
        none = result.get(_tp_key(*shape, "none"))
        if none is None:
            continue
        layer = (result[key] - none) / layers
        if layer <= 0 and (shape[0], 1, False) in out:
            # the layers lost in the noise of two runs timed apart (a tiny model on busy cores):
            # the layer at t = 1 split t ways, its collectives left out
            layer = out[(shape[0], 1, False)]["layer"] / shape[1]
        out[shape] = {"layer": max(0.0, layer), "edges": none}
        if key + "_alone" in result and result[key] > 0:
            out[shape]["alone"] = result[key + "_alone"] / result[key]
    return out


def cluster_from(result: dict[str, float], config, rows: tuple[int, ...], world_size: int,
                 topology: Topology | None = None, *, load: float = float("nan")) -> CalibratedCluster:
    """The :class:`CalibratedCluster` the probes' medians (``Calibration.result()``) describe."""
    c = _gpt_config(config)
    rows = tuple(sorted(set(rows)))
    r1, r2 = rows[0], rows[-1]
    s, h, a = c.block_size, c.n_embd, c.n_head
    # everything was timed with every rank busy; one rank alone runs ``oversubscription`` times faster
    cores = min(float(world_size), max(1.0, world_size * result["layer_r2_alone"] / result["layer_r2"]))
    oversubscription = world_size / cores
    flops = oversubscription * 2 * r2 * s * h * 4 * h / result["matmul"]
    flops16 = oversubscription * 2 * r2 * s * h * 4 * h / result["matmul_bf16"] if "matmul_bf16" in result else flops
    # one block's forward + backward: t(rows) = overhead + rows s (FLOPs/token / flops + bytes/token x c)
    # least squares through every row count timed (the smallest and largest, and any between)
    points = [(r * s, result["layer_r1"] if r == r1 else result["layer_r2"] if r == r2 else result[f"layer_rows{r}"])
              for r in rows]
    mx = sum(x for x, _ in points) / len(points)
    my = sum(y for _, y in points) / len(points)
    slope = sum((x - mx) * (y - my) for x, y in points) / sum((x - mx) ** 2 for x, _ in points)
    overhead = max(0.0, (my - slope * mx) / oversubscription)
    slope = max(slope, 0.0) / oversubscription
    shape = _shape(c)
    per_token_flops = flops_per_token(shape)["layer"]
    act_per_token = activation_bytes_per_layer(1, s, h, a) / s
    act_s = max(0.0, (slope - per_token_flops / flops) / act_per_token)
    head_flops = flops_per_token(shape)["head"] * r1 * s
    # the whole model on r1 rows (results saved before it was timed at every row count call it model_r1)
    model_r1 = result.get(_tp_key(r1, 1, False, "all"), result.get("model_r1"))
    mb_overhead = max(0.0, (model_r1 - c.n_layer * result["layer_r1"]) / oversubscription - head_flops / flops)
    # the price of a synchronisation, after a short compute (a 128 x 128 matmul) and a long one (a block)
    sync = {n: [(result["short"], max(0.0, result[f"short_sync_{g}"] - result["short"] - result[f"sync_{g}"])),
                (result["layer_r1"], max(0.0, result[f"layer_r1_sync_{g}"] - result.get(f"layer_r1_before_sync_{g}",
                                                                                         result["layer_r1"])
                                         - result[f"sync_{g}"]))]
            for n, g in ((2, "pair"), (world_size, "world"))}
    update = result["adam_model"] / oversubscription / max(1, _psi(c))
    # the whole step less its forward and backward (timed in turns) and its update
    step_overhead = max(0.0, (result["train_r1"] - result["model_before_train_r1"]) / oversubscription - update * _psi(c))
    # a block's backward split into B and W, less the same block unsplit (timed in turns)
    split = max(0.0, (result["split_r1"] - result["layer_r1_before_split"]) / oversubscription) if "split_r1" in result else 0.0
    w_share = result.get("split_w_share_r1")
    points = {kind: sorted((float(n), result[f"{kind}:{n}"]) for n in _sizes(result, kind))
              for kind in ("exchange", "one_way", "reduction")}
    alpha, beta = cost.fit_line(points["one_way"])
    _, gamma = cost.fit_line(points["reduction"]) if len(points["reduction"]) >= 2 else (0.0, 0.0)
    machine = cost.CostModel(alpha=alpha, beta=beta, gamma=gamma,
                             tables={k: v for k, v in points.items() if len(v) >= 2} or None)
    own = Link(float(f"{max(alpha, 0.0):.3g}"), float(f"{1.0 / beta if beta > 0 else 1e12:.3g}"))  # the loopback
    links = topology if topology is not None and topology.emulated else None
    rpn = topology.ranks_per_node if topology is not None else world_size
    intra = (links.intra if links is not None and links.intra is not None else own)
    inter = (links.inter if links is not None and links.inter is not None else own)
    memory = _memory_bytes() / world_size
    prefetch = _prefetch_overlap(result, c, world_size, machine, topology if links is not None else None, sync)
    cluster = CalibratedCluster(
        nodes=max(1, world_size // rpn), devices_per_node=rpn, memory_bytes=memory, flops=flops16, fp32_flops=flops,
        intra=intra, inter=inter, name="this machine" + (f" ({topology})" if links is not None else ""),
        source=f"calibrated: {world_size} ranks, load average {load:.2f}",
        cores=cores, sync_s=sync[world_size][-1][1], sync_by_size=sync, layer_overhead_s=overhead,
        split_overhead_s=split, split_w_share=w_share,
        microbatch_overhead_s=mb_overhead, step_overhead_s=step_overhead,
        update_s_per_param=update, activation_s_per_byte=act_s, layer_costs=layer_costs(result, rows, c.n_layer),
        message_cpu=tuple(sorted((n, result[f"message_cpu:{n}"]) for n in _sizes(result, "message_cpu"))) or None,
        time_slice_s=float(result.get("time_slice", 0.0)),
        collective_cpu={"all_gather": result["gather_cpu"], "reduce_scatter": result["reduce_scatter_cpu"]}
        if "gather_cpu" in result else None,
        overlap=0.0, prefetch_overlap=prefetch,
        machine=machine, links=links,
        load=load, measured=dict(result))
    if "pipeline_action_cpu" in result:   # less the action's message end, which the timing charges apart
        end = message_cpu(cluster, r1 * s * h * 4)   # the probe's messages: r1 rows of float32 activations
        cluster = replace(cluster, pipeline_action_s=max(0.0, result["pipeline_action_cpu"] - end))
    return cluster


def _prefetch_overlap(result: dict, config, world_size: int, machine, topology, sync) -> float:
    """The share of a gather's time that hides behind the compute it runs beside (ZeRO-3's
    prefetch), from the ``prefetch`` probe: a block's gather issued before a block's forward and
    backward and waited for after it makes the pair take ``X = both - layer`` longer than the
    block alone. :func:`workbench.advise.timing.prefetch_wait` says ``X = g - hides x min(g, c)
    + drift x min(1, c / g)``, ``g`` the gather's price on these links, ``c`` the block's compute,
    ``drift`` the price of a wait after compute (``sync_by_size``); solved for ``hides``, kept
    between 0 (the gather's messages wait while the ranks compute: its thread needs a core they
    hold) and 1 (they move beside the compute, as a GPU's copy engines move them)."""
    if "prefetch_both" not in result:
        return 0.0
    c, x = result["prefetch_layer"], result["prefetch_both"] - result["prefetch_layer"]
    unit = -(-_shape(config).layer_parameters() // world_size) * world_size * 4   # a block, padded as FSDP pads
    topo = None
    if topology is not None:
        topo = group_topology(list(range(world_size)), topology.ranks_per_node, topology.intra, topology.inter)
    g = cost.predict("all_gather", "native", unit, world_size, machine, topology=topo)
    drift = sync_price(SimpleNamespace(sync_by_size=sync), world_size)
    if min(g, c) <= 0:
        return 0.0
    none = prefetch_wait(g, c, 0.0, drift)          # linear in hides: what hides = 1 takes off
    return min(1.0, max(0.0, (none - x) / (none - prefetch_wait(g, c, 1.0, drift))))


def _sizes(result: dict, kind: str) -> list[int]:
    return sorted(int(k.split(":")[1]) for k in result if k.startswith(kind + ":"))


def _psi(config) -> int:
    return parameters_per_rank(config, 1)


def _shape(config):
    """The advisor's view of a GPTConfig (ModelShape.from_gpt where it exists)."""
    if hasattr(ModelShape, "from_gpt"):
        return ModelShape.from_gpt(config)
    return ModelShape(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, vocab=config.vocab_size,
                      seq=config.block_size, ffn=4 * config.n_embd, tied=config.tie_weights, bias=config.bias,
                      name="gpt")


def _memory_bytes() -> float:
    try:
        import psutil

        return float(psutil.virtual_memory().total)
    except Exception:   # psutil missing: a page count
        return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def _run(model, rows, trials: int, topology, tp_shapes=()) -> dict:
    warnings.filterwarnings("ignore", message=".*cannot be held back.*")
    cal = Calibration(model, rows, tp_shapes=tp_shapes)
    for _ in range(trials):
        cal.once()
    return {"result": cal.result(), "load": load_average()}


def calibrate(world_size: int = 4, topology: Topology | str | None = None, *, model="small",
              rows: tuple[int, ...] = (1, 2, 4), tp_shapes=(), trials: int = 5,
              launch_kwargs: dict | None = None) -> CalibratedCluster:
    """Measure this machine with ``world_size`` ranks (on ``topology``'s emulated links, if given)
    and return it as a :class:`CalibratedCluster`; ``model``: the GPT whose blocks are timed;
    ``rows``: micro-batch sizes to time its layers at; ``tp_shapes``: ``(rows, t, sequence_parallel)``
    to time its tensor-parallel layers at; ``trials``: calls of every probe (the median is kept)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 2:
        raise ValueError(f"calibrate(world_size={world_size!r}): must be a whole number >= 2 (the links need a pair)")
    if isinstance(trials, bool) or not isinstance(trials, int) or trials < 1:
        raise ValueError(f"calibrate(trials={trials!r}): must be a whole number >= 1")
    topo = Topology.parse(topology) if isinstance(topology, str) else topology
    out = workbench.launch(_run, world_size=world_size, args=(model, tuple(rows), trials, topo, tuple(tp_shapes)), topology=topo,
                           timeout=600, **(launch_kwargs or {}))[0]
    return cluster_from(out["result"], model, tuple(rows), world_size, topo, load=out["load"])
