"""Figures of the advisor's predictions: every plan's time against its memory, and the breakdowns.

``time_memory(plans)``: one point per feasible plan (predicted step time against predicted memory
per device), coloured by its tensor-parallel size, marked by its pipeline size, the chosen plan
(the first) starred, the device's memory drawn as a line; plans over it (infeasible for memory)
as grey crosses when ``infeasible=True``. ``breakdown(plans)``: the best few plans' memory by
category and time by part, side by side, the stacks the tables print.
"""
from __future__ import annotations

import math
from typing import Sequence

from .cluster import GiB
from .plan import MEMORY_CATEGORIES, TIME_PARTS, Plan

__all__ = ["time_memory", "breakdown"]

_MARKERS = "o^sDvP*Xh"


def _timed(plan: Plan) -> bool:
    """``plan``'s memory and time were predicted (finite): not a configuration that cannot run, nor
    one ``advise`` left untimed because it does not fit."""
    return bool(plan.memory and plan.time) and math.isfinite(plan.memory["total"]) and math.isfinite(plan.time["total"])


def _axes(ax, figsize):
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=figsize)
    return ax


def time_memory(plans: Sequence[Plan], ax=None, *, memory_limit: float | None = None, infeasible: bool = True,
                title: str | None = None):
    """Predicted step time (y, seconds) against memory per device (x, GiB) of every feasible plan,
    the chosen one (``plans[0]`` when feasible) starred and labelled. Returns the axes."""
    import matplotlib.pyplot as plt

    import matplotlib.ticker as mticker
    from matplotlib.lines import Line2D

    ax = _axes(ax, (7.5, 4.5))
    feasible = [p for p in plans if p.feasible and _timed(p)]
    tps = sorted({p.config.tp for p in feasible}) or [1]
    pps = sorted({p.config.pp for p in feasible}) or [1]
    cmap = plt.get_cmap("viridis")
    color = {tp: cmap(i / max(1, len(tps) - 1)) for i, tp in enumerate(tps)}
    marker = {pp: _MARKERS[j % len(_MARKERS)] for j, pp in enumerate(pps)}
    for tp in tps:
        for pp in pps:
            pts = [p for p in feasible if p.config.tp == tp and p.config.pp == pp]
            if pts:
                ax.scatter([p.memory["total"] / GiB for p in pts], [p.time["total"] for p in pts], s=14, alpha=0.6,
                           color=color[tp], marker=marker[pp])
    handles = [Line2D([], [], ls="", marker="o", color=color[tp], label=f"tp {tp}") for tp in tps] + \
        [Line2D([], [], ls="", marker=marker[pp], color="0.4", label=f"pp {pp}") for pp in pps]
    if infeasible:
        over = [p for p in plans if not p.feasible and _timed(p)]
        if over:
            ax.scatter([p.memory["total"] / GiB for p in over], [p.time["total"] for p in over], s=10, color="0.75",
                       marker="x")
            handles.append(Line2D([], [], ls="", marker="x", color="0.75", label="does not fit"))
    if memory_limit:
        ax.axvline(memory_limit / GiB, color="crimson", lw=1, ls="--")
        handles.append(Line2D([], [], color="crimson", lw=1, ls="--", label="device memory"))
    if feasible and plans[0] is feasible[0]:
        best = feasible[0]
        ax.scatter([best.memory["total"] / GiB], [best.time["total"]], s=260, marker="*", color="crimson",
                   edgecolor="black", zorder=5)
        handles.append(Line2D([], [], ls="", marker="*", markersize=13, color="crimson", markeredgecolor="black",
                              label="chosen: " + best.config.label()))
    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(mticker.FormatStrFormatter("%g"))
    times = [p.time["total"] for p in plans if _timed(p)]
    if times and max(times) < 10 * min(times):     # less than a decade: label the minor ticks too
        ax.yaxis.set_minor_formatter(mticker.FormatStrFormatter("%g"))
        ax.tick_params(axis="y", which="minor", labelsize=7)
    else:
        ax.yaxis.set_minor_formatter(mticker.NullFormatter())
    ax.set_xlabel("predicted memory per device (GiB)")
    ax.set_ylabel("predicted step time (s)")
    ax.set_title(title or f"{len(feasible)} feasible plans: time against memory")
    ax.legend(handles=handles, fontsize=7, ncol=2, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return ax


def breakdown(plans: Sequence[Plan], axes=None, *, top: int = 8):
    """Stacked bars for the ``top`` first plans: memory per device by category (left) and step time by
    part (right). Returns the two axes."""
    import matplotlib.pyplot as plt

    shown = [p for p in plans if _timed(p)][:top]
    if axes is None:
        _, axes = plt.subplots(1, 2, figsize=(11, 0.45 * max(3, len(shown)) + 1.2))
    labels = [p.config.label() + ("" if p.feasible else " (x)") for p in shown]
    y = list(range(len(shown)))[::-1]
    for ax, keys, scale, unit, what in ((axes[0], MEMORY_CATEGORIES, GiB, "GiB", "memory"),
                                        (axes[1], TIME_PARTS, 1.0, "s", "time")):
        left = [0.0] * len(shown)
        for k in keys:
            vals = [(p.memory if what == "memory" else p.time)[k] / scale for p in shown]
            ax.barh(y, vals, left=left, label=k)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_xlabel(f"predicted {what} ({unit})")
        ax.legend(fontsize=7, loc="lower right")
    axes[0].set_yticks(y, labels, fontsize=7)
    axes[1].set_yticks(y, [""] * len(y))
    return axes
