"""The search space: every configuration worth predicting, and why some cannot run.

A configuration (:class:`~workbench.advise.plan.Config`) uses every device: ``dp x tp x pp =
nodes x devices_per_node``. Around that split, the levers that trade memory for time:

=====================  ===================================================================
lever                  values tried (``configurations(...)``'s keyword to narrow them)
=====================  ===================================================================
ZeRO stage over dp     0 (DDP), 1, 2, 3; only 0 when ``dp = 1`` (nothing to shard);
                       on a GPU cluster those its framework offers (Megatron-LM,
                       nanotron: 0, 1; FSDP: 0, 2, 3)                          ``zero=``
pipeline schedule      gpipe, 1f1b, interleaved (2 chunks per rank), zb-h1, zbv; when
                       ``pp > 1``; on a GPU cluster those its framework runs
                       (Megatron-LM: 1f1b, interleaved; nanotron: gpipe, 1f1b)  ``schedules=``
micro-batches m        ``pp, 2 pp, 4 pp, 8 pp`` and micro-batches of 8, 4, 2 and 1
                       sequences (Megatron-LM's usual micro-batch of one: the smallest
                       bubble), each dividing the rows of each data-parallel rank (and 1,
                       2, 4 below ``pp`` for the schedules that take them; GPipe's not
                       where the framework's 1F1B takes them: the same time with no more
                       memory);
                       without a pipeline, gradient accumulation over every power of two
                       up to the rows of a data-parallel rank and the rows themselves:
                       down to one sequence per micro-batch (one gradient reduction per
                       step)                                                 ``microbatches=``
sequence parallelism   off, on (with ``tp > 1``)                       ``sequence_parallel=``
precision              fp32, bf16 (bf16 compute, fp32 masters)               ``precisions=``
recomputation          none, selective, full; with ``advise(..., partial_recompute=True)``
                       also full on each stage's first k layers, the fewest that fit
                       (:mod:`workbench.advise.choose`)                         ``recompute=``
tensor-parallel size   powers of two up to ``max_tp`` (default: every divisor) ``max_tp=``
hybrid sharding        off; with ``hybrid=True``, each ZeRO-3 configuration whose data-
                       parallel ranks span nodes also sharded over the data-parallel ranks
                       of one node and of 2, 4, .. nodes, replicated across the groups
                       (HSDP, ``Config(shard_group=s)``)                         ``hybrid=``
=====================  ===================================================================

Infeasible (:func:`infeasible_reason` says which rule, with the numbers): the sizes do not fill
the cluster; ``tp`` does not divide the heads (each rank takes ``heads/tp``), the key/value
heads, the MLP's units or (sequence parallelism) the sequence; more pipeline stages (times
chunks) than layers; the global batch not divisible into ``dp x m`` equal micro-batches; 1F1B and
ZB-H1 with fewer micro-batches than stages (:func:`~workbench.parallel.pipeline_schedules.min_microbatches`;
on a GPU cluster the framework's rule, :meth:`~workbench.advise.framework.Framework.min_microbatches`:
Megatron-LM's 1F1B takes any number, nanotron's ``p - 1``), a schedule the cluster's framework does not
implement (:attr:`~workbench.advise.framework.Framework.schedules`), ZeRO over one data-parallel rank (the workbench's
runtime; a GPU framework runs it, sharding over one rank: nothing),
interleaved off torch's round rule (``m`` a multiple of ``max(1, m // pp)``; Megatron-LM's: ``m`` a
multiple of ``pp``, at least ``pp``); the predicted memory
(:func:`~workbench.advise.memory_model.memory_per_device`) larger than the device's. A vocabulary that
``tp`` does not divide is padded (:class:`~workbench.parallel.tensor.VocabParallelEmbedding`),
not refused. A ``tp`` larger than a node is allowed: its all-reduces then cross the network,
which the timing model prices (``tp_across_nodes=False`` leaves such configurations out).
"""
from __future__ import annotations

from dataclasses import replace
from itertools import product

from workbench.measure.memory_meter import format_bytes
from workbench.parallel.pipeline_schedules import min_microbatches
from workbench.parallel.recompute import POLICIES

from .cluster import Cluster
from .framework import interleaved_rounds
from .memory_model import memory_per_device
from .plan import PRECISIONS, SCHEDULES, Config, _whole, check_config
from .shape import ModelShape

__all__ = ["SCHEDULES", "PRECISIONS", "check_config", "configurations", "shard_groups", "infeasible_reason",
           "structural_reason", "memory_reason"]

def _check_batch(global_batch) -> None:
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: must be a whole number of sequences >= 1")


def structural_reason(shape: ModelShape, cluster: Cluster, config: Config, global_batch: int) -> str:
    """Why ``config`` cannot run on ``cluster`` whatever the memory ("" if it can)."""
    check_config(config)
    dp, tp, pp, m = config.dp, config.tp, config.pp, config.microbatches
    if config.devices != cluster.devices:
        return (f"dp x tp x pp = {dp} x {tp} x {pp} = {config.devices} devices, but the cluster has "
                f"{cluster.nodes} x {cluster.devices_per_node} = {cluster.devices}")
    framework = getattr(cluster, "framework", None)   # a GPU framework's rules, else the workbench's
    if config.zero and dp == 1 and framework is None:
        return f"ZeRO-{config.zero} shards over the data-parallel ranks, and dp = 1 has nothing to shard"
    if config.zero == 2 and pp > 1 and dp > 1 and shape.tied:
        return ("ZeRO-2 with a pipeline and a tied embedding: ZeRO-2 frees each gradient during backward, before "
                "the first and last stages can add their halves of the tied one (workbench's parallelize refuses "
                "it); use ZeRO-1 or 3, or an untied head")
    if shape.heads % tp:
        return f"tp = {tp} does not divide the {shape.heads} attention heads (each rank takes heads / tp)"
    kv = shape.kv_heads or shape.heads
    if kv % tp:
        return f"tp = {tp} does not divide the {kv} key/value heads (grouped-query attention)"
    if shape.ffn % tp:
        return f"tp = {tp} does not divide the MLP's {shape.ffn} units"
    if config.sequence_parallel and shape.seq % tp:
        return f"sequence parallelism splits the {shape.seq} positions over tp = {tp}, which does not divide them"
    per_rank = config.stages_per_rank
    stages = pp * per_rank
    if stages > shape.layers:
        chunk = f" ({pp} ranks x {per_rank} chunks)" if stages != pp else ""
        return f"{stages} pipeline stages{chunk} but only {shape.layers} layers: each stage needs at least one"
    if pp > 1 and framework is not None and config.schedule not in framework.schedules:
        return (f"framework {framework.name!r} runs the pipeline schedules {', '.join(framework.schedules)}, not "
                f"{config.schedule!r}; choose one of those, or price it under a framework that runs it "
                "(cluster.with_(framework=FRAMEWORKS['eager']): torch's pipelining, every schedule)")
    if pp > 1:
        key = "zb_h1" if config.schedule == "zb-h1" else config.schedule
        least = framework.min_microbatches(key, pp) if framework is not None else min_microbatches(key, pp)
        if m < least:
            return f"{config.schedule} needs at least {least} micro-batches for {pp} stages, got m = {m}"
        if config.schedule == "interleaved":
            rounds = framework.interleaved_rounds(m, pp) if framework is not None else interleaved_rounds(m, pp)
            if rounds:
                return rounds
    if global_batch % (dp * m):
        return f"the global batch of {global_batch} does not split into dp x m = {dp} x {m} equal micro-batches"
    return ""


def memory_reason(memory: dict, cluster: Cluster) -> str:
    """"" if ``memory["total"]`` fits the device, else how much it needs against what it has."""
    if memory["total"] <= cluster.memory_bytes:
        return ""
    worst = max(("parameters", "gradients", "optimizer", "activations", "buffers"), key=lambda k: memory[k])
    need, have = format_bytes(memory["total"]), format_bytes(cluster.memory_bytes)
    if need == have:     # over by less than the rounding: say by how much
        need += f" ({format_bytes(memory['total'] - cluster.memory_bytes)} more)"
    return f"needs {need} per device, has {have} (largest: {worst} {format_bytes(memory[worst])})"


def infeasible_reason(shape, cluster: Cluster, config: Config, global_batch: int) -> str:
    """Why ``config`` cannot train ``shape`` with ``global_batch`` on ``cluster``, in words; ""
    when it can. ``shape``: a ModelShape, a GPTConfig or a preset name."""
    shape = ModelShape.coerce(shape, "shape")
    _check_batch(global_batch)
    reason = structural_reason(shape, cluster, config, global_batch)
    if reason:
        return reason
    return memory_reason(memory_per_device(shape, config, global_batch, cluster), cluster)


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _tuple(value, name: str, allowed) -> tuple:
    values = (value,) if isinstance(value, (str, int, bool)) else tuple(value)
    bad = [v for v in values if v not in allowed]
    if bad or not values:
        raise ValueError(f"configurations({name}={value!r}): choose from {tuple(allowed)}")
    return values


def _accumulation_counts(rows: int) -> tuple[int, ...]:
    """Gradient-accumulation steps tried for ``rows`` sequences per data-parallel rank: every power of
    two up to ``rows`` and ``rows`` itself (one sequence per micro-batch); 1 .. 32 where the batch does
    not divide (``rows`` 0: the configurations kept only to say why they cannot run)."""
    if rows < 1:
        return (1, 2, 4, 8, 16, 32)
    return tuple(sorted({1 << k for k in range(rows.bit_length()) if 1 << k <= rows} | {rows}))


def _pipeline_counts(pp: int, rows: int) -> tuple[int, ...]:
    """Micro-batch counts tried for a pipeline of ``pp`` stages over ``rows`` sequences per
    data-parallel rank: ``pp, 2 pp, 4 pp, 8 pp``, 1, 2 and 4 below ``pp``, and the counts that make
    micro-batches of 8, 4, 2 and 1 sequences (``rows / 8`` .. ``rows``; the bubble,
    ``(p - 1) / (m + p - 1)`` of the step, is smallest at one sequence per micro-batch, where the
    multiplies are thinnest: the price weighs the two). ``rows`` 0: the batch does not divide."""
    counts = {pp * k for k in (1, 2, 4, 8)} | {k for k in (1, 2, 4) if k < pp}
    counts |= {rows // size for size in (1, 2, 4, 8) if rows and rows % size == 0}
    return tuple(sorted(counts))


def _short_gpipe_dominated(cluster: Cluster, schedule: str, m: int, pp: int, schedules: tuple) -> bool:
    """GPipe with ``m < pp`` micro-batches where the cluster's framework runs 1F1B with as few
    (:meth:`~workbench.advise.framework.Framework.min_microbatches`) and 1F1B is searched: 1F1B is
    then a fill and a drain too, in the same time with at most ``m`` micro-batches in flight on a
    rank (never more memory), so the GPipe plan could only rank behind it."""
    framework = getattr(cluster, "framework", None)
    return (schedule == "gpipe" and m < pp and "1f1b" in schedules and framework is not None
            and framework.min_microbatches("1f1b", pp) <= m)


def configurations(shape, cluster: Cluster, global_batch: int, *, zero=None, schedules=None,
                   microbatches=None, sequence_parallel=(False, True), precisions=("fp32", "bf16"),
                   recompute=POLICIES, max_tp: int | None = None, tp_across_nodes: bool = True,
                   hybrid: bool = False, structural: bool = True) -> list[Config]:
    """Every configuration of the space on ``cluster`` (module docstring), in a stable order.

    ``structural=True`` (default) leaves out those that cannot run whatever the memory (sizes that do
    not divide, too few micro-batches); ``False`` keeps them, for :func:`infeasible_reason` to say why.
    Memory is not judged here. ``zero``: the ZeRO stages to try; by default those the cluster's
    framework offers (:attr:`~workbench.advise.framework.Framework.zero_stages`), all four without
    a framework. ``schedules``: the pipeline schedules to try; by default those the
    cluster's framework runs (:attr:`~workbench.advise.framework.Framework.schedules`), every one on a
    cluster without a framework (this machine's runtime runs them all); one named here that the
    framework does not run is kept only with ``structural=False``, to say why it cannot run.
    ``microbatches``: an iterable of counts to try instead of the default.
    ``hybrid``: also try hybrid sharding (:func:`shard_groups`) where ZeRO-3 spans nodes; off by default,
    which keeps the space (and its search time) as it was.
    """
    shape = ModelShape.coerce(shape, "shape")
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r}: pass a workbench.advise.Cluster or Cluster.preset(name, nodes=)")
    _check_batch(global_batch)
    framework = getattr(cluster, "framework", None)
    if zero is None:
        zero = framework.zero_stages if framework is not None else (0, 1, 2, 3)
    zero = _tuple(zero, "zero", (0, 1, 2, 3))
    if schedules is None:
        schedules = framework.schedules if framework is not None else SCHEDULES
    schedules = _tuple(schedules, "schedules", SCHEDULES)
    sequence_parallel = _tuple(sequence_parallel, "sequence_parallel", (False, True))
    precisions = _tuple(precisions, "precisions", PRECISIONS)
    recompute = _tuple(recompute, "recompute", POLICIES)
    if max_tp is not None:
        _whole(max_tp, "max_tp")
    if not isinstance(hybrid, bool):
        raise ValueError(f"configurations(hybrid={hybrid!r}): True (also try hybrid sharding, HSDP) or False")
    if microbatches is not None:
        microbatches = tuple(microbatches)
        for m in microbatches:
            _whole(m, "microbatches")
    n = cluster.devices
    out = []
    for tp in _divisors(n):
        if max_tp is not None and tp > max_tp:
            continue
        if not tp_across_nodes and tp > cluster.devices_per_node:
            continue
        for pp in _divisors(n // tp):
            dp = n // (tp * pp)
            rows = global_batch // dp if global_batch % dp == 0 else 0
            if pp == 1:    # gradient accumulation: m micro-batches one after the other, one reduction,
                # down to one sequence per micro-batch (m = rows) wherever the batch allows
                counts = microbatches or _accumulation_counts(rows)
                pipes = [("1f1b", m) for m in counts if not rows or rows % m == 0 or not structural]
            else:
                counts = microbatches or _pipeline_counts(pp, rows)
                pipes = [(sch, m) for sch in schedules for m in counts if (not rows or rows % m == 0 or not structural)
                         and not _short_gpipe_dominated(cluster, sch, m, pp, schedules)]
            for z, (sch, m), sp, prec, rc in product(zero if dp > 1 else (0,), pipes,
                                                      sequence_parallel if tp > 1 else (False,), precisions, recompute):
                c = Config(dp=dp, tp=tp, pp=pp, zero=z, schedule=sch, microbatches=m, sequence_parallel=sp,
                           precision=prec, recompute=rc)
                if structural and structural_reason(shape, cluster, c, global_batch):
                    continue
                out.append(c)
                if hybrid and z == 3:
                    out.extend(replace(c, shard_group=g) for g in shard_groups(cluster, dp, tp))
    return out


def shard_groups(cluster: Cluster, dp: int, tp: int) -> list[int]:
    """The hybrid-sharding group sizes tried for ``dp`` data-parallel ranks of ``tp`` devices each:
    the data-parallel ranks of one node (``devices_per_node // tp``; ranks are laid out tensor-parallel
    first, then data-parallel), then of 2, 4, .. nodes, each dividing ``dp`` and smaller than it (a
    group of every rank is plain ZeRO-3). None where one node holds every data-parallel rank, or
    where tensor-parallel groups do not tile a node (one spans nodes, or ``tp`` does not divide the
    devices per node): no group of data-parallel ranks is then a node's."""
    per_node = cluster.devices_per_node // tp if cluster.devices_per_node % tp == 0 else 0
    sizes, g = [], per_node
    while 1 <= g < dp:
        if dp % g == 0:
            sizes.append(g)
        g *= 2
    return sizes
