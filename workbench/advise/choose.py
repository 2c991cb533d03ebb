"""Choose: predict every configuration, rank the feasible ones by step time, say why the first won.

``predict(model, cluster, global_batch, config) -> Plan`` puts the two predictions side by side:
memory per device by category (:func:`workbench.advise.memory_model.memory_per_device`) and step time by
part (:func:`workbench.advise.timing.step_time`), and marks the configuration infeasible, with the
rule it breaks, when it cannot run (:func:`workbench.advise.space.infeasible_reason`).

``advise(model, cluster, global_batch, **space_opts) -> list[Plan]`` does it for every
configuration of the space (:func:`workbench.advise.space.configurations`; the keyword arguments
narrow it), returns the feasible plans fastest first (ties: less memory first), then the
infeasible ones (least memory first), each with its reason. The first plan also carries how it
fares if the network between nodes delivers half its bandwidth (``Plan.what_ifs``:
:mod:`workbench.advise.sensitivity`). The splits ``dp x tp x pp`` that no
lever can make runnable (heads not divisible, too many stages...) appear once, with that reason.
``partial_recompute=True`` also tries full recomputation of only the first ``k`` layers of each
stage (``Config.recompute_layers``) where recomputing every layer fits and recomputing none does
not: memory falls and time grows with ``k``, so the fastest such plan is the least ``k`` that fits,
found by bisection (about ``log2`` of the stage's layers predictions of memory per configuration).

Why the winner won: :meth:`Plan.explain` (:mod:`workbench.advise.plan`).
"""
from __future__ import annotations

import math
from dataclasses import replace

from .cluster import Cluster
from .memory_model import memory_per_device
from .plan import DECISIONS, MEMORY_CATEGORIES, TIME_PARTS, Config, Plan, explain, layout_facts
from .sensitivity import network_sensitivity
from .shape import ModelShape
from .space import check_config, configurations, memory_reason, structural_reason
from .timing import step_time

__all__ = ["predict", "advise", "explain", "DECISIONS"]


def _cluster(cluster) -> Cluster:
    if isinstance(cluster, str):
        return Cluster.preset(cluster)
    if not isinstance(cluster, Cluster):
        raise ValueError(f"cluster={cluster!r}: pass a workbench.advise.Cluster or a preset name "
                         "(Cluster.preset('dgx-h100', nodes=4))")
    return cluster


def _never(parts) -> dict[str, float]:
    """Every part and the total infinite: what a plan that cannot run needs, or takes."""
    return dict.fromkeys((*parts, "total"), math.inf)


def predict(model, cluster, global_batch: int, config: Config, *, time_infeasible: bool = True) -> Plan:
    """Memory and time of ``config`` for ``model`` (GPTConfig, preset name or ModelShape) on
    ``cluster`` with ``global_batch`` sequences per step, as a :class:`Plan`. A configuration that
    cannot run has ``feasible=False`` and the ``reason``; its memory (and, unless
    ``time_infeasible=False``, its time) is still predicted when the sizes allow. When they do not
    (a rule of :func:`~workbench.advise.space.structural_reason`: heads that ``tp`` does not divide,
    more stages than layers, too few micro-batches for the schedule...), every part of its memory
    and time is infinite: it needs more than any device holds and never finishes a step, so a
    caller reading ``plan.memory["total"]`` and ``plan.time["total"]`` of any configuration ranks it
    last. With ``time_infeasible=False`` (``advise``'s search) a configuration that does not fit
    is not timed: its time is infinite too (it cannot run a step)."""
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
        plan.memory, plan.time = _never(MEMORY_CATEGORIES), _never(TIME_PARTS)
        return plan
    plan.memory = memory_per_device(shape, config, global_batch, cluster)
    reason = memory_reason(plan.memory, cluster)
    if reason:
        plan.feasible, plan.reason = False, reason
    if reason and not time_infeasible:
        plan.time = _never(TIME_PARTS)
        return plan
    plan.time = step_time(shape, cluster, config, global_batch)
    plan.notes = layout_facts(shape, cluster, config, plan)
    return plan


def advise(model, cluster, global_batch: int, *, partial_recompute: bool = False, **space_opts) -> list[Plan]:
    """Every configuration of the space predicted: feasible plans fastest first, then infeasible ones
    with their reasons. ``model``: a GPTConfig, a preset name ("small", "llama-7b") or a ModelShape;
    ``cluster``: a :class:`Cluster` or a preset name; ``space_opts``: see
    :func:`workbench.advise.space.configurations` (``zero=``, ``schedules=``, ``precisions=``, ...);
    ``partial_recompute``: also the least recomputation that fits (module docstring). Off by default,
    which keeps the space as it was."""
    if not isinstance(partial_recompute, bool):
        raise ValueError(f"advise(partial_recompute={partial_recompute!r}): True (also recompute only the first layers "
                         "of each stage where that fits) or False")
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
    if partial_recompute:
        plans += _least_recompute(shape, cluster, global_batch, plans)
    feasible = sorted((p for p in plans if p.feasible), key=lambda p: (p.time["total"], p.memory["total"]))
    infeasible = sorted((p for p in plans if not p.feasible), key=lambda p: p.memory["total"])
    for split, (config, reason) in dead_splits.items():
        if split not in runnable_splits:
            plan = Plan(config=config, memory=_never(MEMORY_CATEGORIES), time=_never(TIME_PARTS), feasible=False,
                        reason=reason)
            plan._context = (shape, cluster, global_batch)
            infeasible.append(plan)
    ranked = feasible + infeasible
    for p in ranked:
        p._ranked = ranked
    risk = network_sensitivity(ranked[0]) if ranked else None
    if risk is not None:
        ranked[0].what_ifs.append(risk.describe())
    return ranked


def _least_recompute(shape: ModelShape, cluster: Cluster, global_batch: int, plans: list[Plan]) -> list[Plan]:
    """For each plan that fits recomputing every layer (``recompute="full"``) whose twin recomputing
    none does not fit: the plan recomputing the fewest first layers of each stage that fits
    (``recompute_layers``, bisected: memory falls as it grows), where fewer than all do."""
    by_config = {p.config: p for p in plans}
    found = []
    for plan in plans:
        c = plan.config
        plain = by_config.get(replace(c, recompute="none"))
        if c.recompute != "full" or c.recompute_layers or not plan.feasible or plain is None or plain.feasible:
            continue
        low, high, best = 1, max(shape.layers_per_stage(c.pp * c.stages_per_rank)), None
        while low < high:               # the least k in [1, high) that fits; high (every layer) fits
            k = (low + high) // 2
            trial = predict(shape, cluster, global_batch, replace(c, recompute_layers=k), time_infeasible=False)
            if trial.feasible:
                best, high = trial, k
            else:
                low = k + 1
        if best is not None:
            found.append(best)
    return found
