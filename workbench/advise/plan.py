"""One point of the search space (:class:`Config`), what is predicted for it (:class:`Plan`), and why a plan wins.

A configuration places ``dp x tp x pp`` ranks (Megatron's order: tensor-parallel ranks adjacent,
then data, then pipeline) and chooses the levers that trade memory for time: the ZeRO stage over
the data-parallel ranks, the pipeline schedule and its micro-batch count, sequence parallelism,
the precision and the recomputation policy.

A plan holds the prediction, each figure split the way a reader asks about it:

- ``memory``: bytes per device by category -- ``parameters``, ``gradients``, ``optimizer``
  (float32 masters and Adam moments), ``activations`` (the peak of the schedule's in-flight
  micro-batches), ``buffers`` (communication buckets, gathered ZeRO-3 units, NCCL communicators);
  ``total`` is their sum. The worst device (a pipeline's first stage) is the one reported.
- ``time``: seconds per step -- ``compute`` (forward + backward [+ recomputation] at the device's
  achieved FLOP/s), ``tp``, ``dp``, ``pp`` (the communication of each dimension left exposed, not
  hidden behind compute), ``bubble`` (pipeline idle time); ``total`` is their sum.

Why the winner won (:meth:`Plan.explain`): a plan knows the facts of its own layout (which links
each group crosses, how many bytes each dimension moves per step, how much memory each category
takes) and, once ranked, its rivals: for each decision -- the tensor-parallel size, the pipeline
size, the ZeRO stage, the schedule and micro-batches, sequence parallelism, the precision, the
recomputation -- the best plan that decided otherwise, and what that one loses by: it does not fit
(how many GiB it needs), or which part of the step grows, and by how much. Those are the deciding
facts, in plain words::

    TP 8 inside each node (2us@450GB/s): its 4 all-reduces per layer and micro-batch would cross the
    9x slower network otherwise (TP 16: +41% step time, tensor-parallel communication +0.61 s).
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from workbench.parallel.recompute import POLICIES

from .cluster import GiB, Cluster, link_text
from .framework import ALL_SCHEDULES
from .shape import ModelShape

__all__ = ["Config", "Plan", "MEMORY_CATEGORIES", "TIME_PARTS", "SCHEDULES", "PRECISIONS", "check_config",
           "DECISIONS", "explain", "layout_facts"]

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
TIME_PARTS = ("compute", "tp", "dp", "pp", "bubble")
SCHEDULES = ALL_SCHEDULES
PRECISIONS = ("fp32", "bf16", "fp16")


@dataclass(frozen=True)
class Config:
    """One configuration. ``dp * tp * pp`` is the number of devices it uses.

    ``virtual_stages`` is read by the interleaved schedule only: the ``v`` chunks of consecutive
    layers each pipeline rank holds (stage ``c p + r`` on rank ``r``; Narayanan et al. 2021). More
    chunks shrink the bubble to ``(p - 1) / (v m + p - 1)`` and the first rank's in-flight
    activations, for ``v`` times the pipeline's messages. Megatron-LM needs ``v`` to divide the
    layers per rank (``--num-layers-per-virtual-pipeline-stage``); the workbench's own pipeline
    splits them unevenly where it does not.

    ``shard_group`` (with ``zero=3``): hybrid sharding (HSDP; PyTorch FSDP's ``HYBRID_SHARD``,
    ``FullyShardedDataParallel(replicate_group=...)`` here): the state is sharded over groups of
    ``shard_group`` consecutive data-parallel ranks (a node, typically) and replicated across the
    ``dp / shard_group`` groups. Each unit's gathers and reduce-scatters stay inside the group;
    each gradient shard is then all-reduced across the replicas. 0 (or ``dp``): plain ZeRO-3.

    ``recompute_layers`` (with ``recompute="full"``): only the first that many layers of each
    pipeline stage (of each model chunk, under the interleaved schedule) are recomputed, the
    others keep everything (Megatron-LM's ``--recompute-method block --recompute-num-layers``;
    :func:`workbench.parallel.recompute.recompute`'s ``layers``): ``k / L`` of full recomputation's
    extra forward for ``k / L`` of its saving. 0: every layer."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                    # ZeRO stage over dp: 0 (DDP), 1, 2, 3 (FSDP)
    schedule: str = "1f1b"           # pipeline schedule when pp > 1: "gpipe", "1f1b", "interleaved", "zb-h1", "zbv"
    microbatches: int = 1            # per data-parallel rank: the pipeline's m; with pp == 1, gradient-accumulation steps
    sequence_parallel: bool = False  # needs tp > 1
    precision: str = "fp32"          # "fp32", "bf16" (bf16 compute, fp32 masters), "fp16"
    recompute: str = "none"          # "none", "selective", "full"
    virtual_stages: int = 2          # interleaved: stages (model chunks) per pipeline rank, Megatron's v
    shard_group: int = 0             # ZeRO-3 over groups of this many dp ranks, replicated across them (HSDP); 0: all
    recompute_layers: int = 0        # recompute="full" on the first this many layers of each stage only; 0: all

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def shard_size(self) -> int:
        """Data-parallel ranks one copy of the state is sharded over: ``shard_group`` under hybrid
        sharding (ZeRO-3 with ``0 < shard_group < dp``), else ``dp``."""
        return self.shard_group if self.zero == 3 and 0 < self.shard_group < self.dp else self.dp

    @property
    def stages_per_rank(self) -> int:
        """Pipeline stages each pipeline rank holds: ``virtual_stages`` under the interleaved
        schedule, 2 under ZBV (its V), else 1."""
        if self.pp == 1:
            return 1
        return self.virtual_stages if self.schedule == "interleaved" else 2 if self.schedule == "zbv" else 1

    def label(self) -> str:
        """Short name, e.g. ``dp2-tp2-pp2 zero1 1f1b m4 sp bf16 selective``."""
        parts = [f"dp{self.dp}-tp{self.tp}-pp{self.pp}"]
        if self.dp > 1:
            parts.append(f"zero{self.zero}" + (f" hsdp{self.shard_size}" if self.shard_size < self.dp else ""))
        if self.pp > 1:
            v = f" v{self.virtual_stages}" if self.schedule == "interleaved" and self.virtual_stages != 2 else ""
            parts.append(f"{self.schedule}{v} m{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"accum m{self.microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(self.precision)
        if self.recompute != "none":
            parts.append(self.recompute + (f"({self.recompute_layers})" if self.recompute_layers else ""))
        return " ".join(parts)


def _whole(value, name: str, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"Config.{name}={value!r}: must be a whole number >= {minimum}")


def check_config(config: Config) -> None:
    """Raise ValueError (naming the field, the value and the fix) for a configuration that is
    malformed whatever the model and cluster; :func:`~workbench.advise.space.infeasible_reason`
    judges the rest."""
    if not isinstance(config, Config):
        raise ValueError(f"config={config!r}: pass a workbench.advise.Config(dp=, tp=, pp=, ...)")
    for name in ("dp", "tp", "pp", "microbatches"):
        _whole(getattr(config, name), name)
    if config.zero not in (0, 1, 2, 3) or isinstance(config.zero, bool):
        raise ValueError(f"Config.zero={config.zero!r}: the ZeRO stage is 0 (DDP), 1, 2 or 3")
    if config.schedule not in SCHEDULES:
        raise ValueError(f"Config.schedule={config.schedule!r}: use one of {SCHEDULES}")
    _whole(config.virtual_stages, "virtual_stages", 2)
    _whole(config.shard_group, "shard_group", 0)
    if config.shard_group and (config.dp % config.shard_group or config.zero != 3):
        raise ValueError(f"Config.shard_group={config.shard_group}: hybrid sharding shards ZeRO-3's state over groups "
                         f"of shard_group data-parallel ranks and replicates it across them; use zero=3 and a "
                         f"divisor of dp={config.dp}, or shard_group=0 (shard over every data-parallel rank)")
    if not isinstance(config.sequence_parallel, bool):
        raise ValueError(f"Config.sequence_parallel={config.sequence_parallel!r}: must be True or False")
    if config.sequence_parallel and config.tp == 1:
        raise ValueError("Config.sequence_parallel=True splits norms and residuals over the tensor-parallel ranks "
                         "and needs tp > 1; set tp >= 2 or sequence_parallel=False")
    if config.precision not in PRECISIONS:
        raise ValueError(f"Config.precision={config.precision!r}: use one of {PRECISIONS}")
    if config.recompute not in POLICIES:
        raise ValueError(f"Config.recompute={config.recompute!r}: use one of {POLICIES}")
    _whole(config.recompute_layers, "recompute_layers", 0)
    if config.recompute_layers and config.recompute != "full":
        raise ValueError(f"Config.recompute_layers={config.recompute_layers}: recomputes the first that many layers of "
                         f"each pipeline stage whole; use it with recompute='full' (got {config.recompute!r}), or "
                         "recompute_layers=0")


@dataclass
class Plan:
    """A configuration and its prediction; ``feasible`` False with ``reason`` when it cannot run.
    ``memory`` and ``time`` hold every category and part and their ``"total"``, infinite where the
    configuration cannot run at all, and ``time``'s where ``advise`` found it does not fit and did
    not time it (:func:`workbench.advise.choose.predict`)."""

    config: Config
    memory: dict[str, float] = field(default_factory=dict)   # MEMORY_CATEGORIES + "total", bytes per device
    time: dict[str, float] = field(default_factory=dict)     # TIME_PARTS + "total", seconds per step
    feasible: bool = True
    reason: str = ""                 # why not, when infeasible ("needs 93.1 GiB per device, has 80")
    notes: list[str] = field(default_factory=list)  # the facts explain() draws on
    what_ifs: list[str] = field(default_factory=list)  # how the choice fares if an input is off (advise's best)

    def explain(self) -> str:
        """Why this plan, in plain words: the deciding facts (see :func:`explain`)."""
        return explain(self)

    def as_dict(self) -> dict:
        """The plan as plain data (JSON-able): a part that is infinite (a plan that cannot run, or
        does not fit and was not timed) is ``None``."""
        d = asdict(self)
        d["config"]["label"] = self.config.label()
        for part in ("memory", "time"):
            d[part] = {k: v if math.isfinite(v) else None for k, v in d[part].items()}
        return d


# ==================================================================================== why a plan wins
# the decisions a plan makes, each with how to read it off a Config
DECISIONS = {
    "tp": lambda c: c.tp,
    "pp": lambda c: c.pp,
    "zero": lambda c: (c.zero, c.shard_size if c.shard_size < c.dp else 0) if c.dp > 1 else (0, 0),
    "schedule": lambda c: (c.schedule if c.pp > 1 else "accumulate", c.microbatches),
    "sequence_parallel": lambda c: c.sequence_parallel,
    "precision": lambda c: c.precision,
    "recompute": lambda c: (c.recompute, c.recompute_layers),
}
_PART_WORDS = {"compute": "compute", "tp": "tensor-parallel communication", "dp": "data-parallel communication",
               "pp": "pipeline messages", "bubble": "pipeline bubble"}


def _gib(n: float) -> str:
    if n >= 100 * GiB:
        return f"{n / GiB:,.0f} GiB"
    return f"{n / GiB:.3g} GiB" if n >= 0.1 * GiB else f"{n / 2 ** 20:.3g} MiB"


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else (f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us")


def layout_facts(shape: ModelShape, cluster: Cluster, config: Config, plan: Plan) -> list[str]:
    """What a plan's own numbers say about each of its dimensions (no rivals needed)."""
    facts = []
    dpn, ratio = cluster.devices_per_node, cluster.link_ratio
    t, d, p = config.tp, config.dp, config.pp
    time, memory = plan.time, plan.memory
    framework = getattr(cluster, "framework", None)
    if t > 1:
        where = (f"inside each node ({link_text(cluster.intra)})" if t <= dpn else
                 f"across {-(-t // dpn)} nodes, on the {ratio:.3g}x slower network ({link_text(cluster.inter)})")
        calls = ("2 all-gathers and 2 reduce-scatters forward, 4 all-gathers and 2 reduce-scatters backward"
                 if config.sequence_parallel else "2 all-reduces forward and 2 backward")
        beside = (" beside the multiplies" if framework is not None and (framework.tp_comm_overlap or framework.tp_async)
                  else "")
        facts.append(f"TP {t} {where}: {calls} per layer and micro-batch, "
                     f"{_seconds(time.get('tp', 0.0))} per step left exposed{beside}")
    if p > 1:
        spans = d * t >= dpn and cluster.nodes > 1
        link = f"across nodes ({link_text(cluster.inter)})" if spans else f"inside a node ({link_text(cluster.intra)})"
        bubble = time.get("bubble", 0.0) / time["total"] if time.get("total") else 0.0
        facts.append(f"PP {p} {link}: one message per micro-batch per boundary "
                     f"({_seconds(time.get('pp', 0.0))} per step); {config.schedule} over m = {config.microbatches} "
                     f"micro-batches idles {bubble:.0%} of the step")
    if d > 1:
        crosses = d * t > dpn and cluster.nodes > 1
        link = f"across nodes ({link_text(cluster.inter)})" if crosses else f"inside a node ({link_text(cluster.intra)})"
        zero = {0: "DDP (ZeRO-0)", 1: "ZeRO-1 (optimizer state sharded)", 2: "ZeRO-2 (optimizer state and gradients "
                "sharded)", 3: "ZeRO-3 (parameters sharded too)"}[config.zero]
        if config.shard_size < d:
            zero = (f"hybrid sharding (ZeRO-3 over groups of {config.shard_size} ranks, each gradient shard "
                    f"all-reduced across the {d // config.shard_size} groups)")
        facts.append(f"DP {d} {link} with {zero}: {_seconds(time.get('dp', 0.0))} of gradient traffic left exposed")
        if framework is not None and config.zero not in framework.zero_stages:
            facts.append(f"framework {framework.name!r} offers ZeRO-{', ZeRO-'.join(map(str, framework.zero_stages))}, "
                         f"not ZeRO-{config.zero}: priced on this hardware as a framework that offers it would run it")
    if memory:
        state = memory["parameters"] + memory["gradients"] + memory["optimizer"]
        facts.append(f"memory {_gib(memory['total'])} of {_gib(cluster.memory_bytes)} per device: model state "
                     f"{_gib(state)}, activations {_gib(memory['activations'])}")
    return facts


def _describe(decision: str, config: Config) -> str:
    if decision == "tp":
        return f"TP {config.tp}"
    if decision == "pp":
        return f"PP {config.pp}"
    if decision == "zero":
        if config.dp > 1 and config.shard_size < config.dp:
            return f"hybrid sharding over {config.shard_size} (ZeRO-3 in groups of {config.shard_size}, replicated)"
        return f"ZeRO-{config.zero if config.dp > 1 else 0}"
    if decision == "schedule":
        if config.pp > 1:
            return f"{config.schedule} m = {config.microbatches}"
        return f"{config.microbatches} accumulation steps" if config.microbatches > 1 else "one pass per step"
    if decision == "sequence_parallel":
        return "sequence parallelism" if config.sequence_parallel else "no sequence parallelism"
    if decision == "precision":
        return config.precision
    if config.recompute_layers:
        return f"recompute full on the first {config.recompute_layers} layers of each stage"
    return f"recompute {config.recompute}"


def _loss(rival: Plan, chosen: Plan) -> str:
    """What ``rival`` loses by against ``chosen``: it does not fit, or the part of the step that grows."""
    if not rival.feasible:
        return rival.reason
    if rival.time["total"] < chosen.time["total"]:
        save = {k: chosen.time[k] - rival.time[k] for k in TIME_PARTS}
        part = max(save, key=save.get)
        return (f"{rival.time['total'] / chosen.time['total'] - 1:+.0%} step time "
                f"({_PART_WORDS[part]} {-save[part]:+.3g} s)")
    grow = {k: rival.time[k] - chosen.time[k] for k in TIME_PARTS}
    part = max(grow, key=grow.get)
    extra = rival.time["total"] / chosen.time["total"] - 1
    return f"{extra:+.0%} step time ({_PART_WORDS[part]} {grow[part]:+.3g} s)"


# the Config fields each decision sets (dp follows from tp and pp: every device is used)
_FIELDS = {"tp": ("tp", "dp"), "pp": ("pp", "dp", "schedule", "microbatches"), "zero": ("zero", "shard_group"),
           "schedule": ("schedule", "microbatches"), "sequence_parallel": ("sequence_parallel",),
           "precision": ("precision",), "recompute": ("recompute", "recompute_layers")}
_ALL = ("dp", "tp", "pp", "zero", "shard_group", "schedule", "microbatches", "sequence_parallel", "precision",
        "recompute", "recompute_layers")


def _distance(a: Config, b: Config, free: tuple[str, ...]) -> int:
    return sum(getattr(a, f) != getattr(b, f) for f in _ALL if f not in free)


def _rivals(chosen: Plan, plans: list[Plan]) -> list[str]:
    """For each decision of ``chosen``: the plans that decided otherwise -- for each other value the
    one closest to ``chosen`` (all else equal where such a plan exists, else the fewest other
    changes; ties: the faster) -- and what they lose (or gain) by."""
    out = []
    rank = {id(p): k for k, p in enumerate(plans)}
    for decision, read in DECISIONS.items():
        if decision == "zero" and chosen.config.dp == 1:
            continue   # one data-parallel rank: no ZeRO to choose
        mine = read(chosen.config)
        best: dict = {}
        for plan in plans:
            value = read(plan.config)
            if value == mine or (plan.feasible and not math.isfinite(plan.time.get("total", math.inf))):
                continue
            if decision == "zero" and plan.config.dp == 1:
                continue   # its ZeRO-0 is not a choice but its tp and pp's (they are rivals of those decisions)
            key = (_distance(plan.config, chosen.config, _FIELDS[decision]), rank[id(plan)])
            if value not in best or key < best[value][0]:
                best[value] = (key, plan)
        if not best:
            continue
        closest = sorted(best.values(), key=lambda kp: kp[0])[:2]
        parts = [f"{_describe(decision, p.config)}: {_loss(p, chosen)}" for _, p in closest]
        out.append(f"{_describe(decision, chosen.config)} rather than " + "; ".join(parts))
    return out


def _why(chosen: Plan, plans: list[Plan], cluster: Cluster, shape: ModelShape) -> list[str]:
    """The headline reasons, in the words of the field, for the decisions that mattered most."""
    why = []
    ratio = cluster.link_ratio
    cfg = chosen.config
    dpn = cluster.devices_per_node
    psi = shape.parameters()
    state = 16 * psi       # mixed-precision or fp32 Adam: 16 bytes per parameter, unsharded
    if state > cluster.memory_bytes:
        why.append(f"the model's {psi / 1e9:.3g} B parameters need {_gib(state)} of model state (16 bytes each), "
                   f"more than one device's {_gib(cluster.memory_bytes)}: it must be split")
    # tensor parallelism's collectives: 2 all-reduces forward and 2 backward per layer and micro-batch, or with
    # sequence parallelism an all-gather and a reduce-scatter in place of each forward one (more backward)
    kind, count = (("all-gathers and reduce-scatters", "4 per layer and micro-batch forward") if cfg.sequence_parallel
                   else ("all-reduces", "4 per layer and micro-batch"))
    if cfg.tp > 1 and cfg.tp <= dpn and cluster.nodes > 1:
        why.append(f"TP {cfg.tp} inside each node: its {kind} ({count}) would cross the "
                   f"{ratio:.3g}x slower network otherwise")
    elif cfg.tp > 1 and cfg.tp <= dpn:
        why.append(f"TP {cfg.tp} inside the node ({link_text(cluster.intra)}), where its {kind} are cheap")
    elif cfg.tp > dpn:
        why.append(f"TP {cfg.tp} spans nodes, so its {kind} pay the {ratio:.3g}x slower network: nothing cheaper fits")
    if cfg.pp > 1:
        across = cfg.dp * cfg.tp >= dpn and cluster.nodes > 1
        why.append(f"PP {cfg.pp} {'across nodes' if across else 'inside the node'}: one message per micro-batch "
                   f"per boundary, the least traffic of any split{' to put on the slow network' if across else ''}")
    if cfg.dp > 1:
        zero = (f"ZeRO-3 in groups of {cfg.shard_size} (hybrid sharding)" if cfg.shard_size < cfg.dp
                else f"ZeRO-{cfg.zero}")
        why.append(f"DP {cfg.dp} with {zero} over the rest: data parallelism adds no work per device, "
                   f"and its gradient traffic leaves {_seconds(chosen.time['dp'])} exposed after overlapping backward")
    return why


def explain(plan: Plan) -> str:
    """Why this plan, in plain words: the headline reasons, then each decision against its best rival."""
    lines = []
    if not plan.feasible:
        lines.append(f"{plan.config.label()}: infeasible: {plan.reason}.")
    else:
        lines.append(f"{plan.config.label()}: {_seconds(plan.time['total'])} per step, "
                     f"{_gib(plan.memory['total'])} per device.")
    context = getattr(plan, "_context", None)
    ranked = getattr(plan, "_ranked", None)
    if context is not None and ranked is not None and plan.feasible:
        shape, cluster, _ = context
        feasible = sum(1 for p in ranked if p.feasible)
        if ranked and ranked[0] is plan:
            runner = next((p for p in ranked[1:] if p.feasible), None)
            tail = (f"; the next, {runner.config.label()}, takes {_seconds(runner.time['total'])}" if runner else "")
            lines.append(f"Chosen: the fastest of {feasible} feasible plans on {cluster.name} "
                         f"({cluster.nodes} x {cluster.devices_per_node} devices){tail}.")
        lines += [f"Why: {w}." for w in _why(plan, ranked, cluster, shape)]
        lines += [f"Against: {r}." for r in _rivals(plan, ranked)]
    lines += [f"If: {w}." for w in plan.what_ifs]
    lines += [f"Fact: {n}." for n in plan.notes]
    return "\n".join(lines)
