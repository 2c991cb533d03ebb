"""Choose: predict every configuration, rank the feasible ones by step time, say why the first won.

``predict(model, cluster, global_batch, config) -> Plan`` puts the two predictions side by side:
memory per device by category (:func:`workbench.advise.memory.memory_per_device`) and step time by
part (:func:`workbench.advise.timing.step_time`), and marks the configuration infeasible, with the
rule it breaks, when it cannot run (:func:`workbench.advise.space.infeasible_reason`).

``advise(model, cluster, global_batch, **space_opts) -> list[Plan]`` does it for every
configuration of the space (:func:`workbench.advise.space.configurations`; the keyword arguments
narrow it), returns the feasible plans fastest first (ties: less memory first), then the
infeasible ones (least memory first), each with its reason. The splits ``dp x tp x pp`` that no
lever can make runnable (heads not divisible, too many stages...) appear once, with that reason.

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

from .cluster import GiB, Cluster, link_text
from .memory import memory_per_device
from .plan import TIME_PARTS, Config, Plan
from .shape import ModelShape
from .space import check_config, configurations, memory_reason, structural_reason

__all__ = ["predict", "advise", "explain", "DECISIONS"]

# the decisions a plan makes, each with how to read it off a Config
DECISIONS = {
    "tp": lambda c: c.tp,
    "pp": lambda c: c.pp,
    "zero": lambda c: c.zero if c.dp > 1 else 0,
    "schedule": lambda c: (c.schedule if c.pp > 1 else "accumulate", c.microbatches),
    "sequence_parallel": lambda c: c.sequence_parallel,
    "precision": lambda c: c.precision,
    "recompute": lambda c: c.recompute,
}
_PART_WORDS = {"compute": "compute", "tp": "tensor-parallel communication", "dp": "data-parallel communication",
               "pp": "pipeline messages", "bubble": "pipeline bubble"}


def _cluster(cluster) -> Cluster:
    if isinstance(cluster, str):
        return Cluster.preset(cluster)
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r}: pass a workbench.advise.Cluster or a preset name "
                         "(Cluster.preset('dgx-h100', nodes=4))")
    return cluster


def _gib(n: float) -> str:
    if n >= 100 * GiB:
        return f"{n / GiB:,.0f} GiB"
    return f"{n / GiB:.3g} GiB" if n >= 0.1 * GiB else f"{n / 2 ** 20:.3g} MiB"


def _seconds(t: float) -> str:
    return f"{t:.3g} s" if t >= 1 else (f"{t * 1e3:.3g} ms" if t >= 1e-3 else f"{t * 1e6:.3g} us")


def _layout_facts(shape: ModelShape, cluster: Cluster, config: Config, plan: Plan) -> list[str]:
    """What a plan's own numbers say about each of its dimensions (no rivals needed)."""
    facts = []
    dpn, ratio = cluster.devices_per_node, cluster.link_ratio
    t, d, p = config.tp, config.dp, config.pp
    time, memory = plan.time, plan.memory
    if t > 1:
        where = (f"inside each node ({link_text(cluster.intra)})" if t <= dpn else
                 f"across {-(-t // dpn)} nodes, on the {ratio:.3g}x slower network ({link_text(cluster.inter)})")
        facts.append(f"TP {t} {where}: 4 all-reduces per layer and micro-batch, "
                     f"{_seconds(time.get('tp', 0.0))} per step")
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
        facts.append(f"DP {d} {link} with {zero}: {_seconds(time.get('dp', 0.0))} of gradient traffic left exposed")
    if memory:
        state = memory["parameters"] + memory["gradients"] + memory["optimizer"]
        facts.append(f"memory {_gib(memory['total'])} of {_gib(cluster.memory_bytes)} per device: model state "
                     f"{_gib(state)}, activations {_gib(memory['activations'])}")
    return facts


def predict(model, cluster, global_batch: int, config: Config, *, time_infeasible: bool = True) -> Plan:
    """Memory and time of ``config`` for ``model`` (GPTConfig, preset name or ModelShape) on
    ``cluster`` with ``global_batch`` sequences per step, as a :class:`Plan`. A configuration that
    cannot run has ``feasible=False`` and the ``reason``; its memory (and, unless
    ``time_infeasible=False``, its time) is still predicted when the sizes allow."""
    from .timing import step_time

    shape = ModelShape.coerce(model, "model")
    cluster = _cluster(cluster)
    check_config(config)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: must be a whole number of sequences >= 1")
    plan = Plan(config=config)
    plan._context = (shape, cluster, global_batch)
    reason = structural_reason(shape, cluster, config, global_batch)
    if reason:
        plan.feasible, plan.reason = False, reason
        return plan
    plan.memory = memory_per_device(shape, config, global_batch, cluster)
    reason = memory_reason(plan.memory, cluster)
    if reason:
        plan.feasible, plan.reason = False, reason
    if reason and not time_infeasible:
        return plan
    plan.time = step_time(shape, cluster, config, global_batch)
    plan.notes = _layout_facts(shape, cluster, config, plan)
    return plan


def _describe(decision: str, config: Config) -> str:
    if decision == "tp":
        return f"TP {config.tp}"
    if decision == "pp":
        return f"PP {config.pp}"
    if decision == "zero":
        return f"ZeRO-{config.zero if config.dp > 1 else 0}"
    if decision == "schedule":
        if config.pp > 1:
            return f"{config.schedule} m = {config.microbatches}"
        return f"{config.microbatches} accumulation steps" if config.microbatches > 1 else "one pass per step"
    if decision == "sequence_parallel":
        return "sequence parallelism" if config.sequence_parallel else "no sequence parallelism"
    if decision == "precision":
        return config.precision
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
_FIELDS = {"tp": ("tp", "dp"), "pp": ("pp", "dp", "schedule", "microbatches"), "zero": ("zero",),
           "schedule": ("schedule", "microbatches"), "sequence_parallel": ("sequence_parallel",),
           "precision": ("precision",), "recompute": ("recompute",)}
_ALL = ("dp", "tp", "pp", "zero", "schedule", "microbatches", "sequence_parallel", "precision", "recompute")


def _distance(a: Config, b: Config, free: tuple[str, ...]) -> int:
    return sum(getattr(a, f) != getattr(b, f) for f in _ALL if f not in free)


def _rivals(chosen: Plan, plans: list[Plan]) -> list[str]:
    """For each decision of ``chosen``: the plans that decided otherwise -- for each other value the
    one closest to ``chosen`` (all else equal where such a plan exists, else the fewest other
    changes; ties: the faster) -- and what they lose (or gain) by."""
    out = []
    rank = {id(p): k for k, p in enumerate(plans)}
    for decision, read in DECISIONS.items():
        mine = read(chosen.config)
        best: dict = {}
        for plan in plans:
            value = read(plan.config)
            if value == mine or (not plan.time and plan.feasible):
                continue
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
    if cfg.tp > 1 and cfg.tp <= dpn and cluster.nodes > 1:
        why.append(f"TP {cfg.tp} inside each node: its all-reduces (4 per layer and micro-batch) would cross the "
                   f"{ratio:.3g}x slower network otherwise")
    elif cfg.tp > 1 and cfg.tp <= dpn:
        why.append(f"TP {cfg.tp} inside the node ({link_text(cluster.intra)}), where its all-reduces are cheap")
    elif cfg.tp > dpn:
        why.append(f"TP {cfg.tp} spans nodes, so its all-reduces pay the {ratio:.3g}x slower network: "
                   "nothing cheaper fits")
    if cfg.pp > 1:
        across = cfg.dp * cfg.tp >= dpn and cluster.nodes > 1
        why.append(f"PP {cfg.pp} {'across nodes' if across else 'inside the node'}: one message per micro-batch "
                   f"per boundary, the least traffic of any split{' to put on the slow network' if across else ''}")
    if cfg.dp > 1:
        why.append(f"DP {cfg.dp} with ZeRO-{cfg.zero} over the rest: data parallelism adds no work per device, "
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
    lines += [f"Fact: {n}." for n in plan.notes]
    return "\n".join(lines)


def advise(model, cluster, global_batch: int, **space_opts) -> list[Plan]:
    """Every configuration of the space predicted: feasible plans fastest first, then infeasible ones
    with their reasons. ``model``: a GPTConfig, a preset name ("small", "llama-7b") or a ModelShape;
    ``cluster``: a :class:`Cluster` or a preset name; ``space_opts``: see
    :func:`workbench.advise.space.configurations` (``zero=``, ``schedules=``, ``precisions=``, ...)."""
    shape = ModelShape.coerce(model, "model")
    cluster = _cluster(cluster)
    space_opts.pop("structural", None)
    candidates = configurations(shape, cluster, global_batch, structural=False, **space_opts)
    plans, dead_splits = [], {}
    runnable_splits = set()
    for config in candidates:
        split = (config.dp, config.tp, config.pp)
        reason = structural_reason(shape, cluster, config, global_batch)
        if reason:
            dead_splits.setdefault(split, (config, reason))
            continue
        runnable_splits.add(split)
        plans.append(predict(shape, cluster, global_batch, config, time_infeasible=False))
    feasible = sorted((p for p in plans if p.feasible), key=lambda p: (p.time["total"], p.memory["total"]))
    infeasible = sorted((p for p in plans if not p.feasible), key=lambda p: p.memory["total"])
    for split, (config, reason) in dead_splits.items():
        if split not in runnable_splits:
            plan = Plan(config=config, feasible=False, reason=reason)
            plan._context = (shape, cluster, global_batch)
            infeasible.append(plan)
    ranked = feasible + infeasible
    for p in ranked:
        p._ranked = ranked
    return ranked
