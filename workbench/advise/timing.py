"""Predicted step time of one configuration: compute, exposed communication per dimension, bubble.

``step_time(shape, cluster, config, global_batch)`` returns seconds per training step split into
:data:`~workbench.advise.plan.TIME_PARTS` (``compute``, ``tp``, ``dp``, ``pp``, ``bubble``) and
their ``total``. Every term is a formula a reader can check by hand; the machine enters only
through the :class:`~workbench.advise.cluster.Cluster`'s numbers (achieved FLOP/s, the links) and,
for a calibrated cluster (:mod:`workbench.advise.calibrate`), a few measured overheads.

Notation: ``B`` global batch (sequences), ``s`` sequence length, ``h`` hidden size, ``L`` layers,
``V`` vocabulary, ``d, t, p`` the data, tensor and pipeline sizes, ``m`` micro-batches per
data-parallel rank, ``b = B / d`` rows per data-parallel rank, ``e`` bytes per element of the
compute precision (4 for fp32, 2 for bf16/fp16).

Compute (the slowest pipeline stage)
------------------------------------
Forward FLOPs per token: ``2 x`` the weights a token is multiplied by (each layer's attention
``4 h^2`` and MLP ``2 h f``, or ``3 h f`` gated; the head ``h V``), plus the attention itself,
``Q K^T`` and ``A V``: ``2 x 2 s h`` per layer, halved because a causal kernel skips the masked
half. Backward costs twice the forward (the input and the weight gradients), so a step is the
familiar ``6 x parameters x tokens`` plus attention. Recomputation adds forward work: ``full``
one more forward of every layer, ``selective`` the attention core again; ``full`` on each stage's
first ``k`` layers only (``Config.recompute_layers``) ``k / L`` of what ``full`` adds to the stage
(:func:`_partial_recompute_stages`: every cost of a stage is a sum over its layers). Tensor parallelism
divides the layers' and the head's work by ``t``; pipeline parallelism gives each stage
``L/p`` layers (balanced as :func:`workbench.parallel.pipeline.partition` does), the last one
the head too. A stage's work over ``b s`` tokens runs at the cluster's achieved FLOP/s
(``cluster.flops``; ``cluster.fp32_flops`` for float32 where a cluster gives it).

On a GPU (a cluster with a ``device``: every GPU preset) the FLOP count above is not the price:
:func:`device_compute` prices a micro-batch operator by operator with
:mod:`workbench.advise.device` -- each matrix multiply at the efficiency its shape gets (tile and
wave quantization), the norms, activations, residual adds, cross-entropy and the optimizer's step
at the achieved memory bandwidth, attention by its kernel, eager PyTorch's launch cost per kernel
and a fixed cost per micro-batch -- remembered per ``(rows, t, sequence parallelism,
recomputation, precision)``, so a search pays for each shape once. None of the terms below that
exist for ranks sharing CPU cores applies there. The cluster's ``framework``
(:mod:`workbench.advise.framework`) decides the rest of what a GPU step pays: which kernels run
(eager or fused), what selective recomputation repeats, the optimizer's passes (foreach or fused
Adam), whether tensor-parallel collectives overlap their multiplies (:func:`tp_overlap`: all but
one chunk of ``t`` hidden), the gradients' bytes on the wire (float32 reductions) and whether
they overlap backward, its buckets, and the SMs an overlapped collective takes from compute
(``Framework.sm_share_on``: :func:`prefetch_wait` hides ``1 - sm_share`` of what compute covers);
FSDP's copies around each unit's collectives (FSDP2's or FSDP1's, ``Framework.fsdp``) are GPU work
(:func:`workbench.advise.device.fsdp_copy_seconds`), and a pipeline's messages are NCCL
send/recv at the achieved point-to-point bandwidth of their link class.

Small models on a CPU spend as long in fixed per-operator costs (Python, dispatch, a kernel's
start) and memory-bound operators (norms, GELU, softmax, residual adds) as in matmuls, so a
calibrated cluster (:func:`workbench.advise.calibrate.calibrate`) carries more numbers, all 0 or
absent for the datasheet presets, where they vanish beside the arithmetic of a real model:
``layer_overhead_s`` per layer and micro-batch, ``activation_s_per_byte`` per byte of the
activations a layer keeps (:func:`workbench.parallel.tensor.activation_bytes_per_layer`, which
shrinks with tensor and sequence parallelism as that work does), ``microbatch_overhead_s`` per
micro-batch and stage (embedding, head, loss), ``step_overhead_s`` per step (the optimizer's
per-tensor cost), and ``sync_by_size``: what a collective costs beyond its bytes when it follows
compute and the ranks outnumber the cores (they drift apart within the OS's time slices; paid
by the first collective after compute, not by those that follow it back to back), per
group size and interpolated at the compute that precedes it (a quarter of a layer for a
tensor-parallel collective; a stage's whole pass for a pipeline message or a gradient bucket).
After a pipeline's schedule the stage that finishes last computes alone while the others wait,
so its gradient reduction pays that price only as far as its ``d x t`` ranks still outnumber the
cores (:func:`_crowding`).
Where a calibrated cluster timed the model's own layers at a configuration's micro-batch shape
(``layer_costs``, keyed by rows per micro-batch, ``t`` and sequence parallelism; vTrain's way:
profile the layers, not a FLOP rate), those timings replace the formulas above
(:func:`measured_layer`): a layer's forward + backward (the model with all its layers less the
model with none, over the layers) and the edges (embedding, head, loss: the model with none) as
measured; with ``t > 1`` the layer and the edges include their collectives, of which the
formulas' compute is the compute and the rest the ``tp`` part (split forward/backward, and
layers/edges, as the formulas split it). Per-operator costs
and the collectives' waits on an oversubscribed machine are then inside the measured cost. The
layers are timed without recomputation: a recomputing configuration scales the timed compute by
the formulas' ratio (full: one more forward, a third more, which repeats the forward's
memory-bound work and per-operator costs as well as its FLOPs; selective: the attention core's
FLOPs) and, with full recomputation, runs each layer's forward collectives again in backward.
The optimizer's update is memory-bound: ``update_s_per_param`` seconds per parameter it updates
(the local shard under ZeRO), by default 28 bytes (Adam reads parameter, gradient and two
moments, writes three) at a memory bandwidth of ``flops / 300`` bytes/s (H100: 989 TFLOP/s
bf16, 3.35 TB/s).

Ranks that outnumber the cores (``cluster.cores``, a calibrated cluster's: 4 ranks on 2 cores)
share them; every term of that contention (time sharing, drift before a collective, the scheduler's
time slice, the CPU of messages, of the schedule's loop and of ZeRO-3's collectives, no overlap) is
in :mod:`workbench.advise.shared_cores` and applies only to a cluster that carries its figures
(:func:`workbench.advise.shared_cores.of`). While every rank computes, each runs ``world / cores``
times slower than alone. A pipeline is not always all busy -- in its ramp-up and drain a stage computes alone, and fast --
so its step is the schedule's own action lists replayed (:func:`simulate`) with the cores shared
among the ranks computing at each moment. A tensor-parallel stage alone gains less than sharing
says -- its ranks wait for each other within every layer, and no core speeds that up -- so where a
calibrated cluster timed its group alone (``layer_costs``' ``alone``: the group's time alone over
its time with every rank busy), the replay runs it at that ratio of its crowded time whenever it
computes alone. On a cluster whose every rank has its own device (``cores`` None) the replay is
not needed and the closed forms below hold.

Communication, on the link each group crosses
---------------------------------------------
The mesh is Megatron's (:func:`workbench.parallel.mesh.layout`): ``t`` adjacent ranks, then
``d``, then ``p``, nodes of ``devices_per_node`` consecutive ranks. Each group is priced by
:func:`workbench.comm.cost.predict` on a :class:`~workbench.comm.topology.Topology` made from the
cluster's links and the nodes the group touches, so a ring crossing the slow network is paced
by it (``cost._ring_on_links``).

* ``tp``: per micro-batch, 2 all-reduces of ``(b/m) s h`` forward and 2 backward per layer of
  the stage, plus the embedding, the head and the loss
  (:func:`workbench.parallel.tensor.communication_per_layer`; with sequence parallelism each
  all-reduce is an all-gather plus a reduce-scatter, and backward re-gathers the inputs of the
  column-parallel layers). All of it is exposed: every layer waits for its result; on a GPU
  cluster whose framework overlaps them (``tp_comm_overlap``: :func:`tp_overlap`; ``tp_async``,
  nanotron's asynchronous linear layers: :func:`async_tp_hidden`) what the multiplies beside them
  leave.
* ``pp``: one message of ``(b/m) s h e`` bytes (``/ t`` with sequence parallelism) per
  micro-batch, direction and stage boundary. On the critical path: the first micro-batch's
  ``p-1`` boundaries forward and back, and one forward and one backward message for each of
  the other ``m-1`` on the slowest boundary: ``2 sum_k c_k + 2 (m-1) max_k c_k``, ``c_k`` a
  message's time on the link boundary ``k`` crosses; plus the tied
  embedding's gradient exchanged between the first and the last stage, the loss broadcast, and
  the three small collectives :mod:`workbench.parallel.pipeline` runs per step (it lines the
  ranks up before the step and gathers the measured timeline after it; the line-up and the
  gather each pay ``sync_by_size`` after the optimizer's step, a short compute: before the
  gather the ranks finish the schedule one after another and wait idle, which frees the cores
  for the last, a wait the replay's span already holds). A message costs its
  link's time only, not the price of a collective after compute (``sync_by_size`` below): its
  receiver waits idle, its core given to the ranks that compute. Where the ranks share cores (a
  calibrated CPU cluster), each message's two ends also cost their ranks CPU (``message_cpu``:
  posting, a sleeping thread woken, copying): the
  replay charges it to the action that receives its input or sends its output (F: the
  activations, B: the gradients), as work sharing the cores, and reports it under ``pp``; and
  every action costs the schedule's own loop CPU beyond its work and its message
  (``pipeline_action_s``: posting, bookkeeping, the timeline; calibrated as a 2-stage pipeline
  of a block against the same forwards and backwards run directly), charged and reported the
  same way. On a
  calibrated cluster whose links are all this machine's own, a message that lands while every
  core computes waits half the scheduler's time slice more on average (``time_slice_s``):
  its rank, and gloo's network thread that reads it, get a core when a running rank's slice ends
  (:mod:`workbench.runtime.gloo_threads`); the replay decides it per message (``simulate``'s ``late``).
* ``dp``: each rank's gradients (``psi_rank e`` bytes) all-reduced over ``d`` (ZeRO-0), or
  reduce-scattered and the updated parameters all-gathered (ZeRO-1/2: the same volume), or
  ZeRO-3's all-gather in forward, again in backward, and reduce-scatter, for every micro-batch
  (the units are freed after each). The gradients are reduced in buckets (DDP's 25 MB after a
  1 MB first one, ZeRO's 5 MB) as the last micro-batch's backward fills them (ZeRO-1: all of
  them in its step, after backward): every bucket but
  the last (the first layers', filled when backward ends) hides behind that backward, ``overlap
  x`` of it (``cluster.overlap``: 1 by default, as NCCL on its own streams; 0 on a calibrated
  cluster, where gloo's thread competes for the rank's core). On a GPU, ZeRO-1 is Megatron's
  distributed optimizer with ``--overlap-grad-reduce`` and ``--overlap-param-gather``: its
  reduce-scatters hide behind backward as ZeRO-2's do, its parameter all-gathers behind the next
  step's first forward (all but the first bucket), in Megatron's buckets of ``max(40 M, 1 M x d)``
  parameters. ZeRO-3's units are FSDP's: each
  layer, and the root (embedding, head), each gathered whole. It gathers each layer one layer
  ahead (prefetch): a layer's gather runs beside the previous layer's forward, and in backward
  its gather and the next layer's reduce-scatter beside that layer's backward; the root's
  gathers and the first layer's of each pass are waited for, and the last two reduce-scatters.
  Beside ``c`` seconds of compute, ``g`` seconds of traffic wait ``g - hides x min(g, c)``
  (:func:`prefetch_wait`; ``hides`` is ``overlap``, or what a calibrated cluster's ``prefetch``
  probe measured: 0 on this machine's own links, up to about a half on an emulated link, whose
  held-back time the sender sleeps through). Where the ranks share cores, ZeRO-3's traffic is
  also bounded below by its CPU: each of the ``3 (L/p + 1)`` collectives per micro-batch costs
  every rank's process CPU (``collective_cpu``: the rank's thread, gloo's, the communication
  thread's, which can exceed the gather's time on idle links),
  which all the ranks share with compute, so the traffic costs at least that CPU times
  ``world / cores`` (:func:`zero3_cpu`). The ZeRO-1/2 parameter all-gather after the step is exposed.

Bubble
------
The pipeline's idle time with the schedule's formula
(:func:`workbench.parallel.pipeline_schedules.bubble_formula`): an idle fraction ``f`` of the
step means ``busy x f / (1 - f)`` idle seconds, ``busy`` being the slowest stage's ``m``
micro-batches of compute and tensor-parallel communication. For GPipe and 1F1B that is
``(p-1) x`` one micro-batch's time. Where the ranks share cores, the replay gives the span;
its idle time on the busiest rank is the messages on the critical path (up to the closed form
above) and the bubble.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

from workbench.advise import shared_cores
from workbench.advise.device import (fsdp_copy_seconds, head_seconds, layer_seconds, linear_seconds,
                                     optimizer_seconds)
from workbench.advise.nccl import NcclModel
from workbench.advise.plan import TIME_PARTS, Config
from workbench.comm import cost
from workbench.comm.topology import Topology
from workbench.parallel import pipeline_schedules as plans
from workbench.parallel.buckets import DDP_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MB, ZERO_BUCKET_CAP_MB
from workbench.parallel.pipeline_schedules import bubble_formula, stage_to_rank
from workbench.parallel.pipeline_split import balanced
from workbench.parallel.tensor import activation_bytes_per_layer, communication_per_layer

__all__ = ["step_time", "flops_per_token", "message_cpu", "zero3_cpu", "stage_layers", "group_topology", "measured_layer",
           "prefetch_wait", "tp_overlap", "async_tp_hidden", "ELEMENT_BYTES", "SCHEDULE_NAMES"]

ELEMENT_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Config.schedule -> the name pipeline_schedules.bubble_formula uses
SCHEDULE_NAMES = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zb-h1": "zb_h1",
                  "zb_h1": "zb_h1", "zbv": "zbv"}
CAUSAL = 0.5          # a causal attention kernel computes about half the score matrix
ADAM_BYTES = 28       # bytes an Adam update moves per parameter (reads p, g, m, v; writes p, m, v)
PIPELINE_STEP_COLLECTIVES = 3  # workbench.parallel.pipeline: line-up all-reduce, timeline all-gathers
FLOPS_PER_BYTE = 300  # default device: FLOP/s over memory bytes/s (H100: 989e12 / 3.35e12)


def _flops(cluster, precision: str) -> float:
    """Achieved FLOP/s in ``precision`` (:meth:`Cluster.flops_for`: ``fp32_flops`` for float32 where given)."""
    if hasattr(cluster, "flops_for"):
        return float(cluster.flops_for(precision))
    return float(cluster.flops)


def stage_layers(layers: int, pp: int) -> list[int]:
    """Layers per pipeline stage, balanced as :func:`workbench.parallel.pipeline.partition` cuts them."""
    return balanced(layers, pp)


def flops_per_token(shape, *, tp: int = 1, recompute: str = "none") -> dict[str, float]:
    """Forward and backward FLOPs per token on one tensor-parallel rank: ``{"layer": one layer's
    forward + backward (+ recomputation), "head": the head's forward + backward, "weight_grad": a
    layer's weight-gradient products (what a zero-bubble W computes)}``."""
    h, s, f = shape.hidden, shape.seq, shape.ffn
    k = getattr(shape, "kv_dim", h)                 # keys and values (narrower with grouped-query attention)
    mlp = (3 if shape.gated else 2) * h * f
    weights = h * (h + 2 * k) + h * h + mlp
    attention = 2 * 2 * s * h * CAUSAL
    forward = 2 * weights + attention
    extra = {"none": 0.0, "selective": attention, "full": forward}[recompute]
    vocab = -(-shape.vocab // tp) * tp
    return {"layer": (3 * forward + extra) / tp, "head": 3 * 2 * h * vocab / tp, "weight_grad": 2 * weights / tp}


def group_topology(ranks: list[int], devices_per_node: int, intra, inter) -> Topology:
    """The links a group of global ``ranks`` crosses, as :func:`workbench.comm.cost.predict` sees
    a group of ``len(ranks)`` ranks (:meth:`Topology.of_group`; a group spread unevenly over
    nodes is priced on the slow link throughout)."""
    return Topology(devices_per_node, intra=intra, inter=inter).of_group(ranks, uneven="slowest")


def _machine(cluster):
    """The machine's own cost model (calibrated clusters) and the links to price messages on:
    a calibrated cluster keeps the emulated topology's links, None where a link is this machine's.
    A GPU cluster's collectives are priced as NCCL runs them (its ``nccl``: :mod:`workbench.advise.nccl`)."""
    machine = getattr(cluster, "machine", None) or getattr(cluster, "nccl", None) \
        or cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0)
    links = getattr(cluster, "links", None)
    if links is not None:
        return machine, links.intra, links.inter
    return machine, cluster.intra, cluster.inter


@lru_cache(maxsize=1 << 16)
def _remembered_price(collective: str, nbytes: float, group: int, machine, topology) -> float:
    if isinstance(machine, NcclModel):   # NCCL's algorithms on NVLink and the network, the group's ranks per node
        return machine.time(collective, nbytes, group, min(topology.ranks_per_node, group))
    return cost.predict(collective, "native", nbytes, group, machine, topology=topology)


def _price(collective: str, nbytes: float, group: int, machine, topology) -> float:
    """Seconds of ``collective`` (its native algorithm) of ``nbytes`` among ``group`` ranks on
    ``topology``: :func:`workbench.comm.cost.predict`, remembered. A search prices the same few
    collectives for thousands of configurations, and a ring on mixed links is replayed step by step
    (``cost._ring_on_links``: ``2 (group - 1)`` steps of ``group`` messages each, most of a search's
    time before), so each distinct call is computed once: the prediction is a pure function of these
    arguments (the machine and the topology are frozen values, compared by value). A machine with
    measured curves (a calibrated one: its tables are dicts, not hashable) is priced afresh."""
    try:
        return _remembered_price(collective, nbytes, group, machine, topology)
    except TypeError:
        return cost.predict(collective, "native", nbytes, group, machine, topology=topology)


def _groups(config: Config) -> dict[str, list[int]]:
    """The first group of each dimension, in Megatron's order (tp adjacent, then dp, then pp); under
    hybrid sharding also the first shard group (``shard``: consecutive data-parallel ranks) and the
    first replicas' group (``replicate``: one rank of each shard group)."""
    d, t, p, s = config.dp, config.tp, config.pp, config.shard_size
    groups = {"tp": list(range(t)), "dp": [k * t for k in range(d)], "pp": [k * d * t for k in range(p)]}
    if s < d:
        groups["shard"], groups["replicate"] = [k * t for k in range(s)], [k * s * t for k in range(d // s)]
    return groups


def _check(shape, cluster, config: Config, global_batch: int) -> None:
    if not isinstance(config, Config):
        raise ValueError(f"step_time(config={config!r}): pass a workbench.advise.Config")
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"step_time(global_batch={global_batch!r}): must be a whole number of sequences >= 1")
    if config.precision not in ELEMENT_BYTES:
        raise ValueError(f"step_time: config.precision={config.precision!r} is not one of {sorted(ELEMENT_BYTES)}")
    if config.recompute not in ("none", "selective", "full"):
        raise ValueError(f"step_time: config.recompute={config.recompute!r} must be 'none', 'selective' or 'full'")
    if config.pp > 1 and config.schedule not in SCHEDULE_NAMES:
        raise ValueError(f"step_time: config.schedule={config.schedule!r} is not one of {sorted(set(SCHEDULE_NAMES))}")
    if config.pp > shape.layers:
        raise ValueError(f"step_time: pp={config.pp} stages but the model has {shape.layers} layers; use pp <= "
                         f"{shape.layers}")
    if global_batch % (config.dp * config.microbatches):
        raise ValueError(f"step_time: global_batch={global_batch} does not split into dp={config.dp} x "
                         f"microbatches={config.microbatches} equal micro-batches; use a multiple of "
                         f"{config.dp * config.microbatches}")


def _tp_time(rows: int, shape, config: Config, layers: int, first: bool, last: bool, e: int, topo,
             machine, sync: float = 0.0) -> tuple[float, float]:
    """Seconds of tensor-parallel collectives for one micro-batch of ``rows`` on one stage:
    ``(forward, backward)`` (:func:`workbench.parallel.tensor.communication_per_layer`, and the
    model's edges as :func:`workbench.parallel.tensor.communication_per_step` lists them).
    Remembered where the machine is a frozen value: only the tensor-parallel fields of ``config``
    enter, so the configurations of a search that differ elsewhere share it."""
    key = (rows, shape, config.tp, config.sequence_parallel, config.recompute, layers, first, last, e, topo,
           machine, sync)
    try:
        return _remembered_tp_time(key)
    except TypeError:   # a calibrated machine (its tables are dicts): priced afresh
        return _tp_time_of(*key)


@lru_cache(maxsize=1 << 16)
def _remembered_tp_time(key: tuple) -> tuple[float, float]:
    return _tp_time_of(*key)


def _tp_time_of(rows: int, shape, t: int, sequence_parallel: bool, recompute: str, layers: int, first: bool,
                last: bool, e: int, topo, machine, sync: float) -> tuple[float, float]:
    config = Config(tp=t, sequence_parallel=sequence_parallel, recompute=recompute)
    s, h = shape.seq, shape.hidden
    if t == 1:
        return 0.0, 0.0
    n = rows * s * h
    calls: dict[str, list[tuple[str, int]]] = {"forward": [], "backward": []}
    for phase, collectives in communication_per_layer(rows, s, h, config.sequence_parallel, shape.bias).items():
        for collective, sizes in collectives.items():
            calls[phase] += [(collective, k) for k in sizes] * layers
            if phase == "forward" and config.recompute == "full":   # backward runs each layer's forward again
                calls["backward"] += [(collective, k) for k in sizes] * layers
    if config.sequence_parallel:
        if first:   # embedding: reduce-scattered forward, all-gathered backward (and the positions)
            calls["forward"].append(("reduce_scatter", n))
            calls["backward"] += [("all_gather", n), ("all_gather", s * h)]
        if last:    # head input gathered forward, reduce-scattered and re-gathered backward; ln_f's grads
            calls["forward"].append(("all_gather", n))
            calls["backward"] += [("reduce_scatter", n), ("all_gather", n)]
            calls["backward"] += [("all_reduce", h)] * (2 if shape.bias else 1)
    else:
        if first:
            calls["forward"].append(("all_reduce", n))
        if last:
            calls["backward"].append(("all_reduce", n))
    if last:        # the vocabulary-parallel loss: the maximum, then the sums
        calls["forward"] += [("all_reduce", rows * s), ("all_reduce", 2 * rows * s)]
    out = []
    for phase in ("forward", "backward"):
        counts: dict[tuple[str, int], int] = {}
        for call in calls[phase]:          # price each distinct collective once
            counts[call] = counts.get(call, 0) + 1
        out.append(sum(n * (_price(c, k * e, t, machine, topo) + sync)
                       for (c, k), n in counts.items()))
    return out[0], out[1]


def _schedule(config: Config, p: int, m: int):
    """The schedule's compute actions per rank, its number of stages and their placement style."""
    name = SCHEDULE_NAMES[config.schedule]
    if name == "gpipe":
        return plans.gpipe(p, m), p, "loop"
    if name == "1f1b":
        return plans.one_f_one_b(p, m), p, "loop"
    if name == "zb_h1":
        return plans.zero_bubble_h1(p, m), p, "loop"
    if name == "interleaved":
        v = config.virtual_stages
        return plans.interleaved(p, v, m), v * p, "loop"
    return plans.zbv(p, m), 2 * p, "v"


@lru_cache(maxsize=4096)
def _bubble_share(schedule: str, p: int, m: int, v: int = 2) -> float:
    """:func:`~workbench.parallel.pipeline_schedules.bubble_formula`, remembered: for the interleaved
    and ZBV schedules it replays the schedule's action lists, the same for every configuration
    that shares ``(schedule, p, m, v)``."""
    return bubble_formula(schedule, p, m, v)


def _placement(config: Config, p: int) -> tuple[int, str]:
    """The schedule's number of stages and their placement style (:func:`_schedule` without
    building its action lists, which only the replay reads)."""
    name = SCHEDULE_NAMES[config.schedule] if p > 1 else "1f1b"
    return config.stages_per_rank * p, ("v" if name == "zbv" else "loop")


def simulate(actions, num_stages: int, work: dict, comm: dict, *, message=0.0, style: str = "loop",
             cores: float | None = None, replicas: int = 1, trace: list | None = None, late=0.0) -> dict:
    """Replay a schedule's per-rank action lists with each action's ``work[(kind, stage)]`` seconds of
    compute (at one rank's full speed) followed by ``comm[(kind, stage)]`` seconds of tensor-parallel
    communication, and ``message`` seconds for an activation or gradient to reach another rank
    (one number, or one per stage boundary: ``message[k]`` between stages ``k`` and ``k + 1``).

    ``cores``: the machine runs at most this many ranks' compute at once, shared evenly among the
    ranks computing at each moment (processor sharing; each pipeline rank stands for ``replicas``
    ranks doing the same, its data- and tensor-parallel peers); None: every rank its own device.
    Returns ``{"span", "busy": [per rank], "compute": [per rank], "comm": [per rank]}`` in seconds.
    ``late``: with ``cores``, the seconds more a message waits when it lands while every core
    computes (one number, or one per stage boundary as ``message``): the rank it wakes, and the
    thread that reads it out of its socket, get a core only when a running rank's time slice ends
    (:mod:`workbench.runtime.gloo_threads`), half a slice later on average. Decided when the message is
    sent, after the ranks that can start then have started (the sender's next action among them).
    ``trace``: a list each action is appended to as it ends, in the records of a pipeline's
    measured ``schedule.timeline`` (``{"rank", "stage", "kind", "microbatch", "start", "end"}``,
    seconds from the step's start), so the replay can be drawn beside a run
    (:func:`workbench.measure.plots.pipeline_schedule` draws both).

    The one schedule replay (:class:`workbench.parallel.pipeline_schedules.Replay`: each round starts
    every action whose inputs have arrived, moves the clock to the next event -- a compute or a
    communication ending, an input arriving -- and ends what ended), with what ranks sharing cores
    change in it (:class:`_SharedCores`): compute advancing at the rate the cores give, and the waits
    of the messages just sent decided before the clock moves.
    """
    return _SharedCores(actions, num_stages, work, comm, message, style, cores, replicas, trace, late).run()


class _SharedCores(plans.Replay):
    """:func:`simulate`'s replay: the schedule replay with the ranks' compute sharing ``cores``
    (processor sharing) and a message's wait for a core (``late``).

    Processor sharing: while ``n`` ranks compute, each standing for ``replicas`` ranks, each runs at
    ``rate = min(1, cores / (n x replicas))`` of full speed, so ``remaining`` holds each computing
    rank's compute seconds left at full speed, and the next compute end is ``remaining / rate``
    away -- until the number computing changes, which is an event. A message's late wait is
    decided when it is sent, once the ranks that can start then have started (the sender's next
    action among them): ``held`` until then, so no action reads it, then ``extra`` (``late[k]`` if
    every core computes, else nothing)."""

    deadlock = "simulate: the schedule deadlocks at {stuck}"

    def __init__(self, actions, num_stages, work, comm, message, style, cores, replicas, trace, late):
        super().__init__(actions, num_stages, work, comm, message=message, style=style, trace=trace)
        self.cores, self.replicas = cores, replicas
        self.wait = list(late) if isinstance(late, (list, tuple)) else [late] * max(1, num_stages - 1)
        self.extra: dict[tuple, float] = {}    # a sent message's wait for a core (decided once the senders went on)
        self.rate = 1.0                        # each computing rank's share of full speed, until the next event

    def _decide(self, computing: list[int]) -> None:
        """The messages sent now wait ``late`` more if every core computes (the rank they wake and its
        network thread get one only when a time slice ends), nothing if one is free."""
        full = len(computing) * self.replicas >= self.cores - 1e-9
        for key, boundary in self.held.items():
            self.extra[key] = self.wait[boundary] if full else 0.0
        self.held.clear()

    def _ready_at(self, inputs) -> float | None:
        """When an action with these ``inputs`` can start: their ends, plus a message's hop and its
        wait for a core where an input comes from another rank; None while an input is missing or its
        wait is undecided."""
        t = 0.0
        done, held = self.done, self.held
        for d, boundary in inputs:
            if d not in done or d in held:
                return None
            t = max(t, done[d] + (self.hop[boundary] + self.extra.get(d, 0.0) if boundary is not None else 0.0))
        return t

    def _sent(self, key: tuple, boundary: int) -> None:
        """Hold a message for a wait decision where it could find every core busy."""
        if self.cores and self.wait[boundary] > 0:
            self.held[key] = boundary

    def _compute_ends(self, computing: list[int]) -> list[float]:
        """Each computing rank's end at the rate the cores give now (one for all: ``cores`` over the
        ranks computing, each standing for ``replicas``; full speed without ``cores``)."""
        cores, now, remaining = self.cores, self.now, self.remaining
        self.rate = rate = 1.0 if not cores else min(1.0, cores / (len(computing) * self.replicas)) if computing \
            else 1.0
        return [now + remaining[r] / rate for r in computing]

    def _advance(self, computing: list[int], elapsed: float, now: float) -> list[int]:
        """Each computing rank computed for ``elapsed`` seconds (counted in ``busy_c``) at the current
        rate, which comes off its compute: those done (to a picosecond of full-speed work)."""
        remaining, rate, busy_c = self.remaining, self.rate, self.busy_c
        ended = []
        for r in computing:
            busy_c[r] += elapsed
            remaining[r] -= elapsed * rate
            if remaining[r] <= 1e-12:
                ended.append(r)
        return ended


def _cpu_compute(shape, cluster, config: Config, rows: int, rate: float, oversubscription: float, contention):
    """A micro-batch's compute without a device model (a CPU cluster, or a datasheet one): the FLOPs
    at the cluster's achieved rate plus a calibrated cluster's per-layer and per-byte costs, or its
    own layers as timed (:func:`measured_layer`). ``(layer_s, head_s, edges_s, step_overhead_s,
    tp_sync, timed, tp_layer, tp_edges)``: one layer's forward + backward, the head's, the edges'
    (head, embedding, loss), the step's fixed cost, a tensor-parallel collective's drift price, the
    timing of the layers at this shape (None where not timed), and, where the layers were timed with
    their collectives, the timed part beyond the formulas' compute."""
    t, e = config.tp, ELEMENT_BYTES[config.precision]
    s, h = shape.seq, shape.hidden
    tokens = rows * s
    fpt = flops_per_token(shape, tp=t, recompute=config.recompute)
    fpt_plain = flops_per_token(shape, tp=t)                     # without recomputation
    act_s = float(getattr(cluster, "activation_s_per_byte", 0.0))
    act = activation_bytes_per_layer(rows, s, h, shape.heads, t, config.sequence_parallel, e) if act_s else 0
    # full recomputation runs each layer's whole forward again: its memory-bound work and its per-operator
    # costs as well as its FLOPs (a forward is a third of a layer's forward + backward, as the FLOPs say)
    again_rest = fpt["layer"] / fpt_plain["layer"] if config.recompute == "full" else 1.0
    layer_s = tokens * fpt["layer"] / rate + (act * act_s + float(getattr(cluster, "layer_overhead_s", 0.0))) * again_rest
    head_s = tokens * fpt["head"] / rate                          # the last stage's
    edges_s = head_s + float(getattr(cluster, "microbatch_overhead_s", 0.0))   # embedding, head, loss
    step_over = float(getattr(cluster, "step_overhead_s", 0.0))
    # a tensor-parallel collective follows a quarter of a layer's forward + backward (crowded speed)
    sync = shared_cores.sync_price(contention, t, layer_s * oversubscription / 4) if contention and t > 1 else 0.0
    # the model's own layers timed at this shape (a calibrated cluster): their cost replaces the formulas',
    # the part beyond the formulas' compute being the tensor-parallel collectives (and their waits)
    timed = measured_layer(cluster, rows, config)
    tp_layer = tp_edges = None
    if timed is not None:
        # timed without recomputation: its compute grows by what recomputation repeats (the formulas'
        # ratio), its collectives by the forward's, which _tp_time adds to backward
        plain = tokens * fpt_plain["layer"] / rate + act * act_s \
            + float(getattr(cluster, "layer_overhead_s", 0.0))
        again = layer_s / plain
        layer_c, edges_c = min(plain * oversubscription, timed["layer"]), min(edges_s * oversubscription, timed["edges"])
        if t == 1:
            layer_c, edges_c = timed["layer"], timed["edges"]
        else:
            tp_layer, tp_edges = timed["layer"] - layer_c, timed["edges"] - edges_c
        layer_c *= again
        layer_s, edges_s = layer_c / oversubscription, edges_c / oversubscription
        head_s = min(head_s, edges_s)

    return layer_s, head_s, edges_s, step_over, sync, timed, tp_layer, tp_edges


def device_compute(device, shape, rows: int, config: Config, framework=None) -> tuple[float, float, float]:
    """A micro-batch's compute on a GPU (:mod:`workbench.advise.device`), on one tensor-parallel
    rank: ``(layer_s, head_s, edges_s)``, one layer's forward + backward (+ recomputation), the
    head's (final norm, output multiply, cross-entropy), and the edges' (the head, the embedding
    and the fixed cost per micro-batch), under ``framework`` (:mod:`workbench.advise.framework`;
    None: Megatron's fused kernels). Remembered per ``(rows, tp, sp, recompute, precision)``."""
    sp = bool(config.sequence_parallel and config.tp > 1)
    if framework is None:   # (the calls without it, as before: their results are remembered by these arguments)
        layer = layer_seconds(device, shape, rows, config.tp, sp, config.recompute, config.precision)["total"]
        edges = head_seconds(device, shape, rows, config.tp, sp, config.precision)
    else:
        layer = layer_seconds(device, shape, rows, config.tp, sp, config.recompute, config.precision,
                              framework)["total"]
        edges = head_seconds(device, shape, rows, config.tp, sp, config.precision, framework)
    return layer, edges["head"], edges["total"]


def tp_overlap(comm: float, gemm: float, sm_share: float, tp: int = 1) -> float:
    """Seconds of ``comm`` seconds of tensor-parallel collectives a rank still waits for when they are
    overlapped with ``gemm`` seconds of the matrix multiplies beside them (Megatron-Core's
    ``--tp-comm-overlap``: each all-gather split into chunks that the column-parallel multiply
    consumes as they land, each reduce-scatter fed by the row-parallel one as it produces): the
    part the multiplies cannot cover -- at least one of the ``tp`` chunks each collective is split
    into: the first chunk's multiply waits for nothing but the last chunk's transfer (an all-gather)
    or reduction (a reduce-scatter) has no multiply left beside it -- plus the compute the
    communication kernels slow by taking ``sm_share`` of the streaming multiprocessors while they
    run beside it."""
    hidden = min(comm - comm / tp, gemm)
    return comm - hidden + sm_share * hidden


@dataclass(slots=True)
class _Step:
    """What every part of one step's price reads (:func:`_step`): the configuration's sizes, the
    machine and the links each dimension's group crosses, and how crowded the cores are where ranks
    share them (a calibrated CPU cluster; the neutral values elsewhere)."""

    shape: object
    cluster: object
    config: Config
    d: int                  # data-parallel size
    t: int                  # tensor-parallel size
    p: int                  # pipeline stages (ranks)
    m: int                  # micro-batches per data-parallel rank
    e: int                  # bytes per element of the compute precision
    rows: int               # sequences per micro-batch
    machine: object         # the collectives' cost model: NCCL's on a GPU, this machine's, or a zero one
    intra: object           # the links between ranks of a node and between nodes
    inter: object
    groups: dict            # the first group of each dimension, global ranks (:func:`_groups`)
    topo: dict              # each dimension's group as cost.predict sees it (:func:`group_topology`)
    contention: object      # shared_cores.of(cluster): the cluster where ranks share cores, else None
    device: object          # a GPU's device model, None on a CPU or datasheet cluster
    framework: object       # the GPU's training framework (None off a GPU)
    cores: float | None     # ranks' worth of compute the machine runs at once (shared cores only)
    world: int
    oversubscription: float       # how many times slower a rank computes with every rank computing
    end_oversubscription: float   # a drift price's share when one pipeline stage computes alone


def _step(shape, cluster, config: Config, global_batch: int) -> _Step:
    """The :class:`_Step` of ``config`` on ``cluster``: the Megatron mesh's groups and their links,
    the micro-batch's rows, and the contention figures where the ranks share CPU cores."""
    d, t, p, m = config.dp, config.tp, config.pp, max(1, config.microbatches)
    machine, intra, inter = _machine(cluster)
    groups = _groups(config)
    topo = {dim: group_topology(r, cluster.devices_per_node, intra, inter) for dim, r in groups.items()}
    # ranks sharing CPU cores (a calibrated CPU cluster; None for a GPU or a datasheet cluster): the
    # contention terms of workbench.advise.shared_cores apply only then
    contention = shared_cores.of(cluster)
    device = getattr(cluster, "device", None)
    world = d * t * p
    return _Step(
        shape=shape, cluster=cluster, config=config, d=d, t=t, p=p, m=m, e=ELEMENT_BYTES[config.precision],
        rows=global_batch // d // m, machine=machine, intra=intra, inter=inter, groups=groups, topo=topo,
        contention=contention, device=device,
        framework=getattr(cluster, "framework", None) if device is not None else None,
        cores=getattr(contention, "cores", None), world=world,
        # every rank computing at once
        oversubscription=shared_cores.oversubscription(contention, world) if contention else 1.0,
        # a pipeline's step ends with one stage computing (its d x t ranks) while the others wait: what a
        # collective then pays for ranks drifting apart, as a share of its price with every rank busy
        end_oversubscription=shared_cores.crowding(contention, d * t, world) if contention and p > 1 else 1.0)


def step_time(shape, cluster, config: Config, global_batch: int, *, trace: list | None = None) -> dict[str, float]:
    """Seconds per training step of ``config`` for ``shape`` on ``cluster`` with ``global_batch``
    sequences: ``{"compute", "tp", "dp", "pp", "bubble", "total"}`` (see the module docstring).

    ``trace``: for a pipeline, a list to receive the schedule's replay, one record per action of
    the first pipeline (:func:`simulate`'s ``trace``): the replay the time comes from where the
    ranks share cores, else the same actions each on its own device (drawn, not summed: the
    closed forms give the time).

    In order: a micro-batch's compute (:func:`device_compute` on a GPU, :func:`_cpu_compute`
    elsewhere), each pipeline stage's compute and tensor-parallel communication
    (:func:`_stage_costs`), the optimizer's update (:func:`_optimizer_time`), the pipeline's
    messages (:func:`_message_hops`, :func:`_pipeline_step_extras`), the step's compute, tp, pp
    and bubble from the schedule replayed (:func:`_replay`, :func:`_replayed_parts`) where ranks
    share cores, else from the closed forms (:func:`_closed_form_parts`), and the data-parallel
    traffic left exposed (:func:`_data_parallel`)."""
    _check(shape, cluster, config, global_batch)
    ctx = _step(shape, cluster, config, global_batch)
    p, m = ctx.p, ctx.m
    num_stages, style = _placement(config, p)
    if config.recompute == "full" and config.recompute_layers:
        per_stage, (layer_s, head_s, edges_s, step_over, tp_sync, timed, tp_layer, tp_edges) = \
            _partial_recompute_stages(ctx, num_stages)
    else:
        layer_s, head_s, edges_s, step_over, tp_sync, timed, tp_layer, tp_edges = _compute(ctx)
        per_stage = _stage_costs(ctx, num_stages, layer_s, head_s, edges_s, tp_sync, tp_layer, tp_edges)
    slowest = _slowest_rank(per_stage, num_stages, style, p, ctx.oversubscription)
    psi_rank = _parameters_on_rank(shape, ctx.t, p)
    optimizer_s = _optimizer_time(ctx, psi_rank, step_over)

    # an activation or its gradient, between stages
    msg_bytes = ctx.rows * shape.seq * shape.hidden * ctx.e / (ctx.t if config.sequence_parallel else 1)
    hops, pp_extra = [0.0], 0.0
    if p > 1:
        hops = _message_hops(ctx, num_stages, style, msg_bytes)
        pp_extra = _pipeline_step_extras(ctx, optimizer_s)
    critical_messages = 2 * sum(hops) + 2 * (m - 1) * max(hops) if p > 1 else 0.0

    if p > 1 and (ctx.cores or trace is not None):
        replay = _replay(ctx, per_stage, num_stages, style, hops, msg_bytes, timed, tp_layer, trace)
    if p > 1 and ctx.cores:
        compute, tp_total, pp_total, bubble = _replayed_parts(replay, p, m, critical_messages)
    else:
        compute, tp_total, pp_total, bubble = _closed_form_parts(ctx, slowest, critical_messages)
    pp_total += pp_extra

    compute += optimizer_s   # the optimizer's update

    dp_total = 0.0
    if ctx.d > 1:
        dp_total, fsdp_copies = _data_parallel(ctx, psi_rank, slowest, layer_s, edges_s)
        if fsdp_copies is not None:
            compute += fsdp_copies

    out = {"compute": compute, "tp": tp_total, "dp": dp_total, "pp": pp_total, "bubble": bubble}
    out["total"] = sum(out[k] for k in TIME_PARTS)
    return out


def _compute(ctx: _Step) -> tuple:
    """A micro-batch's compute for ``ctx.config``: ``(layer_s, head_s, edges_s, step_overhead_s, tp_sync,
    timed, tp_layer, tp_edges)`` (:func:`device_compute` on a GPU, :func:`_cpu_compute` elsewhere)."""
    config = ctx.config
    if ctx.device is not None:   # a GPU: the layer priced operator by operator (workbench.advise.device)
        layer_s, head_s, edges_s = device_compute(ctx.device, ctx.shape, ctx.rows, config, ctx.framework)
        return layer_s, head_s, edges_s, 0.0, 0.0, None, None, None
    return _cpu_compute(ctx.shape, ctx.cluster, config, ctx.rows, _flops(ctx.cluster, config.precision),
                        ctx.oversubscription, ctx.contention)


def _partial_recompute_stages(ctx: _Step, num_stages: int) -> tuple[list[dict], tuple]:
    """Each stage's costs (:func:`_stage_costs`) when only the first ``k = recompute_layers`` of its
    ``n`` layers are recomputed: every cost of a stage is a sum over its layers, so it is the stage
    without recomputation plus ``min(k, n) / n`` of what full recomputation adds to it (the compute
    of the forwards run again, their tensor-parallel collectives). Returns the stages and
    :func:`_compute`'s figures, ``layer_s`` the layer of the stage with the most layers at that
    share (what data parallelism's overlap reads)."""
    k, counts = ctx.config.recompute_layers, stage_layers(ctx.shape.layers, num_stages)
    priced = []
    for variant in (replace(ctx.config, recompute="none", recompute_layers=0), replace(ctx.config, recompute_layers=0)):
        vctx = replace(ctx, config=variant)
        parts = _compute(vctx)
        layer_s, head_s, edges_s, _, tp_sync, _, tp_layer, tp_edges = parts
        priced.append((parts, _stage_costs(vctx, num_stages, layer_s, head_s, edges_s, tp_sync, tp_layer, tp_edges)))
    (plain, plain_stages), (full, full_stages) = priced
    per_stage = [{key: a[key] + min(k, n) / n * (b[key] - a[key]) for key in a}
                 for n, a, b in zip(counts, plain_stages, full_stages)]
    share = min(k, max(counts)) / max(counts)
    return per_stage, (plain[0] + share * (full[0] - plain[0]),) + tuple(full[1:])


# -- each pipeline stage: one micro-batch's compute (full speed) and tensor-parallel communication

def _stage_costs(ctx: _Step, num_stages: int, layer_s: float, head_s: float, edges_s: float, tp_sync: float,
                 tp_layer: float | None, tp_edges: float | None) -> list[dict]:
    """Each (virtual) stage's one micro-batch: ``{"compute", "tp_f", "tp_b", "split"}``, its compute
    at full speed (its layers, the head on the last stage, each stage's share of the per-micro-batch
    overheads, a zero-bubble B/W split's graph walk) and its tensor-parallel collectives forward and
    backward (:func:`_stage_tp`). The stages in between hold as many layers and share their price."""
    shape, config, p = ctx.shape, ctx.config, ctx.p
    per_stage = []
    # the edges' collectives alone (embedding, head, loss), for timed layers' split of their collectives
    edge_tp = sum(_tp_time(ctx.rows, shape, config, 0, True, True, ctx.e, ctx.topo["tp"], ctx.machine, tp_sync)) \
        if tp_layer is not None else 0.0
    stage_tp: dict[tuple[int, bool, bool], tuple[float, float]] = {}
    for k, n_layers in enumerate(stage_layers(shape.layers, num_stages)):
        first, last = k == 0, k == num_stages - 1
        # the head's FLOPs on the last stage; the per-micro-batch overheads on every stage
        compute = n_layers * layer_s + (head_s if last else 0.0) + (edges_s - head_s) / (num_stages // p)
        split = 0.0
        if k > 0 and SCHEDULE_NAMES[config.schedule] in ("zb_h1", "zbv"):
            # a stage fed activations splits its backward into B and W: the split walks the graph
            # (the first stage has no input gradient: its W is a plain backward)
            split = n_layers * float(getattr(ctx.cluster, "split_overhead_s", 0.0))
            compute += split
        if (n_layers, first, last) not in stage_tp:
            stage_tp[n_layers, first, last] = _stage_tp(ctx, n_layers, first, last, tp_sync, tp_layer, tp_edges,
                                                        edge_tp)
        tp_f, tp_b = stage_tp[n_layers, first, last]
        per_stage.append({"compute": compute, "tp_f": tp_f, "tp_b": tp_b, "split": split})
    return per_stage


def _stage_tp(ctx: _Step, n_layers: int, first: bool, last: bool, tp_sync: float, tp_layer: float | None,
              tp_edges: float | None, edge_tp: float) -> tuple[float, float]:
    """A stage's tensor-parallel seconds per micro-batch, ``(forward, backward)``: the formulas'
    collectives (:func:`_tp_time`); where the layers were timed with their collectives, the timed
    part beyond compute split as the formulas split it (:func:`_timed_tp`); under a framework that
    overlaps them with the multiplies, what the multiplies leave exposed (:func:`_overlapped_tp`)."""
    tp_f, tp_b = _tp_time(ctx.rows, ctx.shape, ctx.config, n_layers, first, last, ctx.e, ctx.topo["tp"],
                          ctx.machine, tp_sync)
    if tp_layer is not None:
        tp_f, tp_b = _timed_tp(ctx, n_layers, tp_f, tp_b, tp_sync, tp_layer, tp_edges, edge_tp)
    framework = ctx.framework
    if framework is not None and framework.tp_comm_overlap and ctx.t > 1:
        tp_f, tp_b = _overlapped_tp(ctx, n_layers, first, last, tp_f, tp_b, tp_sync)
    elif framework is not None and framework.tp_async and ctx.t > 1 and n_layers:
        config, device = ctx.config, ctx.device
        n = ctx.rows * ctx.shape.seq * ctx.shape.hidden * ctx.e
        price = {c: _price(c, n, ctx.t, ctx.machine, ctx.topo["tp"]) + tp_sync
                 for c in ("all_gather", "reduce_scatter", "all_reduce")}
        lin = linear_seconds(device, ctx.shape, ctx.rows, ctx.t, bool(config.sequence_parallel), config.precision,
                             framework)
        hidden_f, hidden_b = async_tp_hidden(lin, ctx.t, bool(config.sequence_parallel), price,
                                             config.recompute == "full")
        keep = 1.0 - framework.sm_share_on(device)     # the collectives' kernels slow what they run beside
        tp_f = max(0.0, tp_f - n_layers * hidden_f * keep)
        tp_b = max(0.0, tp_b - n_layers * hidden_b * keep)
    return tp_f, tp_b


def async_tp_hidden(linears: dict, t: int, sequence_parallel: bool, price: dict, recompute_full: bool = False
                    ) -> tuple[float, float]:
    """Seconds of one layer's tensor-parallel collectives that asynchronous linear layers hide per
    micro-batch, ``(forward, backward)`` (:attr:`Framework.tp_async
    <workbench.advise.framework.Framework.tp_async>`: nanotron's ``tp_linear_async_communication``).
    ``linears``: :func:`workbench.advise.device.linear_seconds`; ``price``: one collective's seconds
    of a micro-batch's activations, by name. Each collective hides behind the multiply issued beside
    it, up to that multiply's time. With sequence parallelism, per block (attention, MLP): the
    column-parallel layer's forward all-gather beside the multiply of the rank's own ``1/t`` of the
    rows; in backward its input's re-gather beside the input-gradient multiply, the input
    gradient's reduce-scatter beside the weight-gradient multiply, and the row-parallel layer's
    all-gather of the output gradient beside its own rows' input-gradient multiply; the
    row-parallel forward reduce-scatter is waited for. Without it, the column-parallel backward
    all-reduce beside the weight-gradient multiply. Full recomputation runs the forward again in
    backward, with its hiding."""
    forward = backward = 0.0
    for block in linears.values():
        column, row = block["column"], block["row"]
        if sequence_parallel:
            forward += min(price["all_gather"], column["forward"] / t)
            backward += (min(price["all_gather"], column["dgrad"]) + min(price["reduce_scatter"], column["wgrad"])
                         + min(price["all_gather"], row["dgrad"] / t))
        else:
            backward += min(price["all_reduce"], column["wgrad"])
    if recompute_full:
        backward += forward
    return forward, backward


def _timed_tp(ctx: _Step, n_layers: int, tp_f: float, tp_b: float, tp_sync: float, tp_layer: float,
              tp_edges: float, edge_tp: float) -> tuple[float, float]:
    """The measured collectives (a timed layer's part beyond compute, ``tp_layer``, and the edges',
    ``tp_edges``), split forward/backward and layers/edges as the formulas split them. The timing ran
    without recomputation, so the layers' scale is the formulas' without it; what full recomputation
    repeats rides on top, scaled alike."""
    rows, shape, config, e, topo, machine = ctx.rows, ctx.shape, ctx.config, ctx.e, ctx.topo["tp"], ctx.machine
    layers_f, layers_b = _tp_time(rows, shape, config, n_layers, False, False, e, topo, machine, tp_sync)
    ef, eb = tp_f - layers_f, tp_b - layers_b
    total = sum(_tp_time(rows, shape, replace(config, recompute="none"), n_layers, False, False, e, topo, machine,
                         tp_sync))
    scale_l = n_layers * tp_layer / total if total > 0 else 0.0
    scale_e = tp_edges / edge_tp if edge_tp > 0 else 0.0
    return layers_f * scale_l + ef * scale_e, layers_b * scale_l + eb * scale_e


def _overlapped_tp(ctx: _Step, n_layers: int, first: bool, last: bool, tp_f: float, tp_b: float,
                   tp_sync: float) -> tuple[float, float]:
    """The layers' collectives behind their multiplies (:func:`tp_overlap`; forward beside a third
    of the multiplies' time, backward beside two thirds), the edges' exposed."""
    device, config, framework = ctx.device, ctx.config, ctx.framework
    gemm = n_layers * layer_seconds(device, ctx.shape, ctx.rows, ctx.t, bool(config.sequence_parallel),
                                    config.recompute, config.precision, framework)["gemm"]
    edge_f, edge_b = _tp_time(ctx.rows, ctx.shape, config, 0, first, last, ctx.e, ctx.topo["tp"], ctx.machine,
                              tp_sync)
    share = framework.sm_share_on(ctx.device)
    return (edge_f + tp_overlap(tp_f - edge_f, gemm / 3, share, ctx.t),
            edge_b + tp_overlap(tp_b - edge_b, gemm * 2 / 3, share, ctx.t))


def _slowest_rank(per_stage: list[dict], num_stages: int, style: str, p: int, oversubscription: float) -> dict:
    """The pipeline rank whose micro-batch takes longest, ``{"compute", "tp"}`` summed over the
    stages it holds (two under the interleaved and ZBV schedules)."""
    per_rank = [{"compute": 0.0, "tp": 0.0} for _ in range(p)]
    for k, owner in enumerate(stage_to_rank(num_stages, p, style)):
        per_rank[owner]["compute"] += per_stage[k]["compute"]
        per_rank[owner]["tp"] += per_stage[k]["tp_f"] + per_stage[k]["tp_b"]
    return max(per_rank, key=lambda r: r["compute"] * oversubscription + r["tp"])


def _optimizer_time(ctx: _Step, psi_rank: float, step_over: float) -> float:
    """The optimizer's update of this rank's parameters (its shard under ZeRO), every rank at once:
    on a GPU the bytes Adam moves at the achieved bandwidth (:func:`optimizer_seconds`); elsewhere
    ``update_s_per_param`` per parameter (by default :data:`ADAM_BYTES` at ``flops /``
    :data:`FLOPS_PER_BYTE` bytes/s) plus the step's fixed cost for this stage's share of the layers."""
    config, cluster, device, framework = ctx.config, ctx.cluster, ctx.device, ctx.framework
    updated = psi_rank / config.shard_size if (config.zero >= 1 and config.shard_size > 1) else psi_rank
    if device is not None:   # memory-bound: the bytes Adam moves per parameter at the achieved bandwidth
        return optimizer_seconds(device, updated, config.precision, framework) if framework is not None \
            else optimizer_seconds(device, updated, config.precision)
    update_s = getattr(cluster, "update_s_per_param", None)
    if update_s is None:
        update_s = ADAM_BYTES / (cluster.flops / FLOPS_PER_BYTE)   # flops: the 16-bit rate of a GPU
    shape = ctx.shape
    return (updated * float(update_s) + step_over * max(stage_layers(shape.layers, ctx.p)) / shape.layers) \
        * ctx.oversubscription


# -- the pipeline's messages

def _message_hops(ctx: _Step, num_stages: int, style: str, msg_bytes: float) -> list[float]:
    """Seconds one activation (or its gradient) takes across each stage boundary: 0 between two
    stages of one rank, else the link's time only -- its receiver is idle, its core given to the
    ranks computing (the replay shares the cores among those), not drifting apart from a peer as
    after a collective."""
    owner, pp = stage_to_rank(num_stages, ctx.p, style), ctx.groups["pp"]
    dpn = ctx.cluster.devices_per_node
    return [0.0 if owner[k] == owner[k + 1] else _link_time(
        pp[owner[k]], pp[owner[k + 1]], dpn, ctx.intra, ctx.inter, ctx.machine, msg_bytes)
        for k in range(num_stages - 1)]


def _pipeline_step_extras(ctx: _Step, optimizer_s: float) -> float:
    """A pipeline's communication once per step: the tied embedding's gradient between the first and
    the last stage, the loss broadcast, and the three small collectives workbench's pipeline runs
    (it lines its ranks up before a step and gathers the measured timeline after it: an all-reduce
    of one float, two small all-gathers). Where ranks share cores, the price of ranks drifted apart
    is paid by a collective that follows compute: the line-up (after the previous step's optimizer)
    and the timeline's gather (after the schedule); the loss broadcast and the other gather follow
    those back to back and find the ranks lined up. Both at the price after the optimizer's step, a
    short compute: before the gather the ranks finish the schedule one after another, idle as they
    wait, which frees the cores for the last (the replay's span holds that wait)."""
    shape, machine, topo, pp = ctx.shape, ctx.machine, ctx.topo["pp"], ctx.groups["pp"]
    extra = 0.0
    if shape.tied:
        tied_bytes = (-(-shape.vocab // ctx.t) * ctx.t) * shape.hidden // ctx.t * ctx.e
        extra += _link_time(pp[0], pp[-1], ctx.cluster.devices_per_node, ctx.intra, ctx.inter, machine, tied_bytes)
    extra += _price("broadcast", 4, ctx.p, machine, topo)
    extra += PIPELINE_STEP_COLLECTIVES * _price("all_reduce", 8, ctx.p, machine, topo)
    if ctx.contention:
        extra += 2 * shared_cores.sync_price(ctx.contention, ctx.p, optimizer_s)
    return extra


# -- the schedule replayed where ranks share cores

def _replay(ctx: _Step, per_stage: list[dict], num_stages: int, style: str, hops: list[float], msg_bytes: float,
            timed: dict | None, tp_layer: float | None, trace: list | None) -> dict:
    """The schedule's action lists replayed (:func:`simulate`) with the machine's cores shared among
    the ranks computing: ``{"sim", "actions", "work", "msg_work", "tp_work", "owner", "shared",
    "late"}``, what :func:`_replayed_parts` reads back.

    Timed tensor-parallel layers: their collectives' cost beyond the formulas is mostly waiting for
    a peer to get a core, which shrinks as the cores do when fewer ranks compute (ramp-up, drain),
    so it is shared like compute (``shared``): replayed as work at the crowded rate, and reported as
    tp in proportion."""
    p = ctx.p
    actions = _schedule(ctx.config, p, ctx.m)[0]
    shared = tp_layer is not None and bool(ctx.cores)
    sim_cores, speed = _replay_speed(ctx, timed, shared)
    owner = stage_to_rank(num_stages, p, style)
    work, comm, msg_work, tp_work = _action_costs(ctx, per_stage, num_stages, owner, msg_bytes, shared, speed)
    # on this machine's own links (no emulated ones), a message that lands while every core computes
    # waits for a time slice to end, half a slice on average (with an emulated link the ranks sleep
    # through its held-back messages and their network threads are promoted meanwhile: not seen there)
    half = shared_cores.late_message(ctx.contention) if ctx.contention else 0.0
    late = [0.0 if owner[k] == owner[k + 1] else half for k in range(num_stages - 1)] or [0.0]
    sim = simulate(actions, num_stages, work, comm, message=hops, style=style, cores=sim_cores,
                   replicas=ctx.d * ctx.t, trace=trace, late=late)
    return {"sim": sim, "actions": actions, "work": work, "msg_work": msg_work, "tp_work": tp_work, "owner": owner,
            "shared": shared, "late": late}


def _replay_speed(ctx: _Step, timed: dict | None, shared: bool) -> tuple[float | None, float]:
    """The cores the replay shares and the factor on each action's work: ``(cores, 1)``, or where a
    timed tensor-parallel stage's time alone is known, ``(alone x world, alone x oversubscription)``.

    Alone, such a stage is faster only as far as its group's own time alone says: processor sharing
    makes it ``p`` times faster than with every stage busy (its d x t ranks outnumber the cores), but
    its ranks also wait for each other within every layer, which no core speeds up. ``alone``: that
    ratio, timed (the model's first tensor-parallel group alone, the others asleep). The replay runs a
    stage at full speed alone and at ``alone`` of it with every stage busy: each action's work is its
    time alone, and the cores ``alone x world``; ``alone`` is never taken under ``1 / p``, what sharing
    the cores alone gives (a stage's ranks outnumbering the cores). With those cores a stage alone does
    not fill them, so a message landing then is not held for a time slice (``late``): its ranks spend
    most of the stage waiting for each other, their cores free."""
    alone = timed.get("alone") if shared and timed is not None else None
    if alone is None:
        return ctx.cores, 1.0
    alone = max(float(alone), ctx.d * ctx.t / ctx.world)
    return alone * ctx.world, alone * ctx.oversubscription


def _action_costs(ctx: _Step, per_stage: list[dict], num_stages: int, owner: list[int], msg_bytes: float,
                  shared: bool, speed: float) -> tuple[dict, dict, dict, list[float]]:
    """Each schedule action's cost for :func:`simulate`, keyed ``(kind, stage)``: ``work`` (compute
    at ``speed``, plus the CPU of its message ends and the schedule's loop), ``comm`` (tensor-parallel
    seconds after it, where not ``shared`` as work), ``msg_work`` (the part of ``work`` that is the
    messages' and the loop's CPU) and, per rank, ``tp_work``: the tensor-parallel share of its stages'
    work, summed over its stages.

    Each message's two ends cost their ranks' CPU (posting, waking up, copying), shared like compute:
    F receives its input and sends its output, B (or the full backward) the gradients the other way;
    and every action costs the schedule's own loop some CPU beyond its work and its message
    (calibrated: a 2-stage pipeline against the same work run directly), also shared like compute."""
    contention, oversubscription = ctx.contention, ctx.oversubscription
    end_cpu = shared_cores.message_cpu(contention, msg_bytes) if contention else 0.0
    loop = float(getattr(contention, "pipeline_action_s", 0.0) or 0.0)
    w_share = _split_w_share(ctx)
    work, comm, msg_work, tp_work = {}, {}, {}, [0.0] * ctx.p
    for k, st in enumerate(per_stage):
        f = (st["compute"] - st["split"]) / 3
        back = 2 * f + st["split"]
        # the first stage (fed tokens) has no input gradient: B is nothing, W the whole backward
        w = w_share * back if k > 0 else back
        tf, tb = (st["tp_f"] / oversubscription, st["tp_b"] / oversubscription) if shared else (0.0, 0.0)
        ends = sum(1 for j in (k - 1, k + 1) if 0 <= j < num_stages and owner[j] != owner[k]) * end_cpu
        msg_work[("F", k)] = msg_work[("Bfull", k)] = msg_work[("B", k)] = ends + loop
        msg_work[("W", k)] = loop
        work[("F", k)], work[("Bfull", k)], work[("B", k)], work[("W", k)] = \
            (f + tf) * speed + ends + loop, (back + tb) * speed + ends + loop, \
            (back - w + tb) * speed + ends + loop, w * speed + loop
        cf, cb = (0.0, 0.0) if shared else (st["tp_f"], st["tp_b"])
        comm[("F", k)], comm[("Bfull", k)], comm[("B", k)], comm[("W", k)] = cf, cb, cb, 0.0
        tp_work[owner[k]] += (tf + tb) / (st["compute"] + tf + tb) if st["compute"] + tf + tb > 0 else 0.0
    return work, comm, msg_work, tp_work


def _split_w_share(ctx: _Step) -> float:
    """A split backward's W share (zero-bubble schedules): calibrated where each phase was timed,
    else the FLOPs' -- W computes the weight-gradient products, B the input gradients and the
    attention core's backward."""
    w_share = getattr(ctx.cluster, "split_w_share", None)
    if w_share is None:
        plain = flops_per_token(ctx.shape, tp=ctx.t)
        w_share = plain["weight_grad"] / (plain["layer"] * 2 / 3)
    return w_share


def _replayed_parts(replay: dict, p: int, m: int, critical_messages: float) -> tuple[float, float, float, float]:
    """``(compute, tp, pp, bubble)`` of the busiest rank of the replay: its compute less the share that
    was its messages' and loop's CPU (reported as pp) and, where the collectives were replayed as
    work, their share (reported as tp); its idle time split into the messages on the critical path
    (up to the closed form, with their waits for a core) and the bubble."""
    sim, work, msg_work, late = replay["sim"], replay["work"], replay["msg_work"], replay["late"]
    r = max(range(p), key=lambda i: sim["busy"][i])
    compute, tp_total = sim["compute"][r], sim["comm"][r]
    # the share of the replayed work that was the messages' CPU: reported as pipeline communication
    keys = plans.work_keys(replay["actions"])[r]
    mine = sum(work[key] for key in keys)
    msg_cpu = compute * sum(msg_work[key] for key in keys) / mine if mine > 0 else 0.0
    compute -= msg_cpu
    if replay["shared"]:   # the share of the replayed work that was tensor-parallel communication
        stages_r = sum(1 for o in replay["owner"] if o == r)
        tp_total = compute * replay["tp_work"][r] / max(1, stages_r)
        compute -= tp_total
    idle = max(0.0, sim["span"] - sim["busy"][r])
    # the messages on the critical path, and their waits for a core where they had to
    pp_total = min(idle, critical_messages + 2 * sum(late) + 2 * (m - 1) * max(late))
    bubble = idle - pp_total
    pp_total += msg_cpu
    return compute, tp_total, pp_total, bubble


def _closed_form_parts(ctx: _Step, slowest: dict, critical_messages: float) -> tuple[float, float, float, float]:
    """``(compute, tp, pp, bubble)`` with every rank its own device: the slowest rank's ``m``
    micro-batches, the messages on the critical path, and the schedule's idle fraction ``f`` of the
    step as ``busy x f / (1 - f)`` idle seconds (:func:`_bubble_share`)."""
    m, p = ctx.m, ctx.p
    compute, tp_total = m * slowest["compute"] * ctx.oversubscription, m * slowest["tp"]
    bubble = 0.0
    if p > 1:
        f = _bubble_share(SCHEDULE_NAMES[ctx.config.schedule], p, m, ctx.config.virtual_stages)
        bubble = (compute + tp_total) * f / (1 - f)
    return compute, tp_total, critical_messages, bubble


# -- data parallelism: gradient reduction and ZeRO traffic, the hidden part subtracted

def _data_parallel(ctx: _Step, psi_rank: float, slowest: dict, layer_s: float,
                   edges_s: float) -> tuple[float, float | None]:
    """``(dp seconds exposed, FSDP2's copies' compute or None)``: ZeRO-3's gathers and
    reduce-scatters per micro-batch (:func:`_zero3_time`; under hybrid sharding inside the shard
    group, each reduced shard then all-reduced across the replicas), or the gradients' buckets and,
    for ZeRO-1/2, the parameters' all-gather (:func:`_bucketed_time`); then the loss's all-reduce.

    After a pipeline's schedule the stage that finishes last computes alone, its peers idle: its
    gradient reduction and the loss's all-reduce find the cores free, at a fraction
    (``end_oversubscription``) of the drift price with every rank busy."""
    d, machine, topo = ctx.d, ctx.machine, ctx.topo["dp"]
    overlap, hides = _dp_overlap(ctx)
    sync = shared_cores.sync_price(ctx.contention, d) * ctx.end_oversubscription if ctx.contention else 0.0
    # the state's collectives: over every data-parallel rank, or (hybrid sharding) over the shard group,
    # each gradient shard then all-reduced across the replicas
    hybrid = "shard" in ctx.topo
    s = ctx.config.shard_size
    group, group_topo = (s, ctx.topo["shard"]) if hybrid else (d, topo)

    def price(collective: str, nbytes: float) -> float:
        return _price(collective, nbytes, group, machine, group_topo)

    def replicate(unit_bytes: float) -> float:
        return _price("all_reduce", unit_bytes / s, d // s, machine, ctx.topo["replicate"])

    copies = None
    if ctx.config.zero == 3:
        dp_total, copies = _zero3_time(ctx, psi_rank, layer_s, edges_s, hides, sync, price,
                                       replicate if hybrid else None)
    else:                  # in buckets: DDP's and ZeRO-1/2's own bucket_cap_mb
        mb_compute = slowest["compute"] * ctx.oversubscription
        dp_total = _bucketed_time(ctx, psi_rank * ctx.e, overlap, mb_compute, sync, price)
    dp_total += _price("all_reduce", 4, d, machine, topo) + sync  # the loss
    return dp_total, copies


def _dp_overlap(ctx: _Step) -> tuple[float, float]:
    """``(overlap, hides)``: the share of compute that hides the gradients' reduction, and ZeRO-3's
    gathers. 1 on devices with their own copy engines; on a calibrated CPU cluster what it measured
    (the collectives' threads need the cores, and the GIL, compute has); under a GPU framework
    ``1 - sm_share`` (NCCL's kernels take that share of the SMs from the compute they hide behind),
    and no overlap for gradients reduced after backward (ZeRO-3's are not)."""
    overlap, hides = shared_cores.overlap(ctx.contention) if ctx.contention else (1.0, 1.0)
    framework = ctx.framework
    if framework is not None:
        overlap = hides = 1.0 - framework.sm_share_on(ctx.device)
        if not framework.overlap_grad_reduce:
            overlap = 0.0
    return overlap, hides


def _zero3_time(ctx: _Step, psi_rank: float, layer_s: float, edges_s: float, hides: float, sync: float,
                price, replicate=None) -> tuple[float, float | None]:
    """ZeRO-3's exposed traffic over the ``m`` micro-batches (:func:`_zero3_exposed`; FSDP2 reduces in
    float32: its ``grad_reduce_bytes`` over ``e`` scales the reduce-scatters), at least its
    collectives' CPU where ranks share cores (:func:`shared_cores.zero3_cpu`); and FSDP2's copy-in and
    copy-out around each unit's collectives, GPU compute (None off a framework). ``replicate``:
    under hybrid sharding, the seconds of the replicas' all-reduce of a unit's gradient shard."""
    shape, config, e, m, o = ctx.shape, ctx.config, ctx.e, ctx.m, ctx.oversubscription
    framework = ctx.framework
    scale = framework.grad_reduce_bytes / e if framework is not None and framework.grad_reduce_bytes else 1.0
    dp_total = m * _zero3_exposed(shape, config, psi_rank, e, layer_s * o, edges_s * o, hides, sync, price, scale,
                                  replicate)
    copies = m * fsdp_copy_seconds(ctx.device, psi_rank, config.shard_size, flat=framework.fsdp == "fsdp1") \
        if framework is not None else None
    if ctx.contention:
        dp_total = max(dp_total, m * shared_cores.zero3_cpu(ctx.contention, shape, config) * o)
    return dp_total, copies


def _gradient_buckets(ctx: _Step, grad_bytes: float) -> list[tuple[float, int]]:
    """The gradient buckets, ``[(bytes, how many), ...]``: the first (DDP's small first bucket), the
    full ones, and the rest in the last. Capacity: DDP's 25 MB or ZeRO's 5 MB, or Megatron's
    ``max(40 M, 1 M x d)`` parameters (a framework's ``dp_bucket_params``; a GPU without one, ZeRO)."""
    config, d, e, framework = ctx.config, ctx.d, ctx.e, ctx.framework
    cap = (DDP_BUCKET_CAP_MB if config.zero == 0 else ZERO_BUCKET_CAP_MB) * MB
    if framework is not None:   # the framework's buckets: Megatron's max(40 M, 1 M x d) parameters
        if framework.dp_bucket_params:
            cap = max(framework.dp_bucket_params, 1e6 * d) * e
    elif ctx.device is not None and config.zero:   # Megatron's buckets: max(40 M, 1 M x d) parameters
        cap = max(40e6, 1e6 * d) * e
    first = FIRST_BUCKET_BYTES if config.zero == 0 else cap     # DDP's small first bucket
    head = min(first, grad_bytes)
    full, rest = divmod(max(0.0, grad_bytes - head), cap)
    return [(head, 1)] + ([(cap, int(full))] if full else []) + ([(rest, 1)] if rest > 0.5 else [])


def _bucketed_time(ctx: _Step, grad_bytes: float, overlap: float, mb_compute: float, sync: float, price) -> float:
    """Exposed seconds of the gradients' buckets (each kind of bucket priced once), reduced as backward
    fills them: all but the last (the first layers') behind the last micro-batch's backward
    (``overlap`` of its two thirds of ``mb_compute``); they go back to back, so only the first wait,
    after compute, pays the drift price (ZeRO-1 reduces them all in its step, after backward; on a
    GPU, ZeRO-1 is Megatron's distributed optimizer with ``--overlap-grad-reduce``, as ZeRO-2). A
    framework reduces gradients in float32 (``grad_reduce_bytes``: ``4/e`` times the bucket's bytes).
    ZeRO-1/2 then all-gather the updated parameters (:func:`_parameter_gather`)."""
    config, e, framework = ctx.config, ctx.e, ctx.framework
    sizes = _gradient_buckets(ctx, grad_bytes)
    kind = "all_reduce" if config.zero == 0 else "reduce_scatter"
    g = framework.grad_reduce_bytes / e if framework is not None and framework.grad_reduce_bytes else 1.0
    every = sum(k * price(kind, n * g) for n, k in sizes)
    last = price(kind, sizes[-1][0] * g)
    hidden = overlap * mb_compute * 2 / 3 if config.zero != 1 or ctx.device is not None else 0.0
    dp_total = last + max(0.0, every - last - hidden) + sync
    if config.zero in (1, 2):   # the updated parameters, all-gathered after the step
        dp_total += _parameter_gather(ctx, sizes, overlap, mb_compute, price) + sync
    return dp_total


def _parameter_gather(ctx: _Step, sizes: list[tuple[float, int]], overlap: float, mb_compute: float,
                      price) -> float:
    """ZeRO-1/2's all-gather of the updated parameters after the step, bucket by bucket; on a GPU
    (Megatron's ``--overlap-param-gather``) all but the first bucket beside the next step's first
    forward (a third of ``mb_compute``, ``overlap`` of it)."""
    gather = sum(k * price("all_gather", n) for n, k in sizes)
    if ctx.device is not None and overlap > 0:
        gather = max(price("all_gather", sizes[0][0]), gather - overlap * mb_compute / 3)
    return gather


def prefetch_wait(g: float, compute: float, hides: float, drift: float) -> float:
    """Seconds a rank waits for a collective of ``g`` seconds issued before ``compute`` seconds of
    compute and waited for after it: ``g - hides x min(g, compute)``, plus the drift price (the
    ranks' wait for each other after compute) in the share of the wait the compute is."""
    return max(0.0, g - hides * min(g, compute)) + drift * (min(1.0, compute / g) if g > 0 else 1.0)


def _zero3_exposed(shape, config: Config, psi_rank: float, e: int, layer_c: float, edges_c: float,
                   hides: float, sync: float, price, reduce_scale: float = 1.0, replicate=None) -> float:
    """Seconds of ZeRO-3 traffic one micro-batch waits for (:mod:`workbench.parallel.fsdp`).

    Units as FSDP wraps them: each layer of the stage (``layer_parameters`` x ``e`` bytes) and the
    root (the rest: embedding, final norm, head). Forward: the root and the first layer are
    gathered before anything runs; each later layer's gather was started one layer ahead and runs
    beside that layer's forward (a third of ``layer_c``). Backward: the root again, and the last
    layer beside the head's backward; then each layer's gather and the previous layer's
    reduce-scatter, which queue on the one communication thread, beside a layer's backward (two
    thirds); the last reduce-scatters (the first layer's and the root's) are waited for at the
    end. A collective of ``g`` seconds beside ``c`` seconds of compute waits ``g - hides x min(g,
    c)``: ``hides`` is 1 on devices whose copy engines move bytes while the cores compute, and on a
    calibrated CPU cluster what its ``prefetch`` probe measured (a gather beside a layer). The
    drift price (``sync``) is paid by each wait that follows compute, in the share of the wait
    the compute is: ranks held up by a slow link are lined up by it, not by each other's cores.
    ``reduce_scale``: the reduce-scatters' bytes over the gathers' (2 where gradients are reduced in
    float32 and parameters gathered in 16 bits). ``replicate`` (hybrid sharding): seconds of the
    all-reduce across replicas that follows each reduce-scatter, given the unit's reduced bytes."""
    layers = max(stage_layers(shape.layers, config.pp))
    layer_b = shape.layer_parameters(config.tp) * e
    root_b = max(0.0, psi_rank * e - layers * layer_b)

    def size(kind: str, nbytes: float) -> float:
        return nbytes * reduce_scale if (kind == "reduce_scatter" and reduce_scale != 1.0) else nbytes

    def cost(kind: str, nbytes: float) -> float:   # a reduce-scatter, then (hybrid) the replicas' all-reduce
        seconds = price(kind, size(kind, nbytes))
        if kind == "reduce_scatter" and replicate is not None:
            seconds += replicate(size(kind, nbytes))
        return seconds

    def wait(kinds, compute: float) -> float:
        return prefetch_wait(sum(cost(k, layer_b) for k in kinds), compute, hides, sync)

    gather, both = ("all_gather",), ("all_gather", "reduce_scatter")
    forward = price("all_gather", root_b) + price("all_gather", layer_b) + sync \
        + (layers - 1) * wait(gather, layer_c / 3)
    backward = price("all_gather", root_b) + wait(gather, edges_c * 2 / 3) \
        + (layers - 1) * wait(both, layer_c * 2 / 3) \
        + cost("reduce_scatter", layer_b) + cost("reduce_scatter", root_b) + sync
    return forward + backward


def measured_layer(cluster, rows: int, config: Config) -> dict | None:
    """A calibrated cluster's timing of the model's own layer at this configuration's micro-batch
    shape (``rows`` sequences, ``config.tp``, sequence parallelism), every rank busy:
    ``{"layer": s, "edges": s}`` (:func:`workbench.advise.calibrate.layer_costs`), or None where
    that shape was not timed (or the configuration runs another precision). Timed without
    recomputation: :func:`step_time` adds what recomputation repeats."""
    costs = getattr(cluster, "layer_costs", None)
    if not costs or config.precision != "fp32":
        return None
    return costs.get((rows, config.tp, bool(config.sequence_parallel and config.tp > 1)))


# the contention terms moved to shared_cores; their old names, for callers that import them from here
message_cpu, zero3_cpu = shared_cores.message_cpu, shared_cores.zero3_cpu
_sync, _crowding = shared_cores.sync_price, shared_cores.crowding


def _link_time(a: int, b: int, dpn: int, intra, inter, machine, nbytes: float) -> float:
    """One message of ``nbytes`` from global rank ``a`` to ``b``: as NCCL's send/recv runs it on a GPU
    cluster (its ``nccl`` model: the achieved point-to-point bandwidth and latency of the link class,
    e.g. about 370 GB/s and 10-20 us on NVLink 4, not the line rate), else the link between them, or
    this machine's own one-way time where that link is not emulated."""
    if isinstance(machine, NcclModel):
        return machine.time("send_recv", nbytes, 2, 2 if a // dpn == b // dpn else 1)
    link = intra if a // dpn == b // dpn else inter
    return link.time(nbytes) if link is not None else machine.one_way(nbytes)


@lru_cache(maxsize=4096)
def _parameters_on_rank(shape, t: int, p: int) -> float:
    """Parameters on the most loaded rank: its stage's layers split by ``t`` (norms and row
    biases replicated), the embedding (first stage) or the head (last stage) split by vocabulary
    (:meth:`ModelShape.stage_parameters`)."""
    return float(max(shape.stage_parameters(p, s, t) for s in range(p)))
