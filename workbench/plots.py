"""Figures from measurements: throughput, memory breakdown, loss curves, per-rank timelines.

Every function takes plain data (lists of dicts, as :func:`workbench.train.summarize` and
``workbench.report`` records give them), draws on ``ax`` (a new figure when None) and returns
the ``matplotlib`` Figure, with a title, axis units and a legend, so a lesson cell is one line::

    plots.throughput(rows)                 # bars: tokens/s per strategy
    plots.memory_breakdown(rows)           # stacked bars: peak bytes per rank, by category
    plots.loss_curves({"single": losses, "torch-ddp": ddp_losses})
    plots.timeline(None, events)           # Gantt chart: what each rank did when

matplotlib is imported when a function is called, so importing the workbench stays cheap and
works where no display exists (set ``MPLBACKEND=Agg`` to draw to files).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

__all__ = ["throughput", "memory_breakdown", "loss_curves", "timeline", "zero_model_state", "CATEGORY_COLORS"]

CATEGORY_COLORS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868", "activations": "#c44e52",
                   "comm": "#8172b3", "other": "#937860"}
_MIB = 1024 ** 2


def _axes(ax, figsize=(7, 4)):
    import matplotlib.pyplot as plt

    if ax is None:
        fig, ax = plt.subplots(figsize=figsize, layout="constrained")
    return ax.figure, ax


def _colors(n: int) -> list:
    import matplotlib.pyplot as plt

    cycle = plt.rcParams["axes.prop_cycle"].by_key().get("color", ["C0"])
    return [cycle[i % len(cycle)] for i in range(n)]


def throughput(rows: Sequence[Mapping], ax=None, key: str = "tokens_per_s"):
    """Bars of ``key`` (default tokens/s) per strategy; ``rows`` have ``strategy`` and ``key``
    (and optionally ``world_size``, shown in the label)."""
    if not rows:
        raise ValueError("plots.throughput: no rows to plot (pass the compare rows, one per strategy)")
    fig, ax = _axes(ax)
    labels = [f"{r['strategy']}\n(N={r['world_size']})" if "world_size" in r else str(r["strategy"]) for r in rows]
    values = [float(r[key]) for r in rows]
    bars = ax.bar(labels, values, color=_colors(len(rows)), label=[str(r["strategy"]) for r in rows])
    ax.bar_label(bars, labels=[f"{v:,.0f}" for v in values], fontsize=8)
    unit = {"tokens_per_s": "tokens/s", "samples_per_s": "samples/s"}.get(key, key)
    ax.set_ylabel(f"throughput ({unit}, higher is better)")
    ax.set_title(f"Training throughput per strategy ({unit}, all ranks together)")
    ax.legend(title="strategy", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig


def memory_breakdown(rows: Sequence[Mapping], ax=None, key: str = "peak_by_category"):
    """Stacked bars: for each strategy and rank, the peak bytes split by category.

    ``rows[i][key]`` is a list with one ``{category: bytes}`` dict per rank (or one dict).
    """
    if not rows:
        raise ValueError("plots.memory_breakdown: no rows to plot (pass the compare rows, one per strategy)")
    fig, ax = _axes(ax, figsize=(max(7, 0.8 * sum(len(_per_rank(r[key])) for r in rows) + 2), 4.5))
    labels, stacks = [], []
    for r in rows:
        for rank, cats in enumerate(_per_rank(r[key])):
            labels.append(f"{r['strategy']}\nrank {rank}")
            stacks.append(cats)
    categories = [c for c in CATEGORY_COLORS if any(s.get(c, 0) for s in stacks)]
    categories += sorted({c for s in stacks for c in s if s[c] and c not in categories})
    bottom = [0.0] * len(stacks)
    for cat in categories:
        heights = [s.get(cat, 0) / _MIB for s in stacks]
        ax.bar(labels, heights, bottom=bottom, label=cat, color=CATEGORY_COLORS.get(cat))
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("peak live memory (MiB)")
    ax.set_title("Peak memory per rank, by what it holds")
    ax.legend(title="category", fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.tick_params(axis="x", labelsize=8)
    return fig


def _per_rank(value) -> list[Mapping]:
    return [value] if isinstance(value, Mapping) else list(value)


def loss_curves(curves: Mapping[str, Sequence], ax=None):
    """Training loss against step, one line per strategy, overlaid.

    ``curves[name]`` is a list of losses (index = step), or ``workbench.report`` records with
    ``step`` and ``loss`` (rank 0's are used). Lines are drawn thinner and dashed in turn, so
    identical curves (the point of a parity check) stay visible on top of each other.
    """
    if not curves:
        raise ValueError("plots.loss_curves: no curves to plot (pass {strategy: losses})")
    fig, ax = _axes(ax)
    styles = ["-", "--", ":", "-."]
    for i, (name, values) in enumerate(curves.items()):
        values = list(values)
        if values and isinstance(values[0], Mapping):
            pts = sorted((r["step"], r["loss"]) for r in values if r.get("rank", 0) == 0 and "loss" in r)
            steps, losses = [p[0] for p in pts], [p[1] for p in pts]
        else:
            steps, losses = list(range(len(values))), [float(v) for v in values]
        ax.plot(steps, losses, styles[i % len(styles)], linewidth=2.5 - 1.5 * i / max(1, len(curves) - 1),
                label=name)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss (cross-entropy, nats/token)")
    ax.set_title("Loss curves (same data, same initial weights)")
    ax.legend(title="strategy", fontsize=8)
    ax.grid(alpha=0.3)
    return fig


def timeline(ax, events: Iterable[Mapping], *, title: str = "Per-rank timeline", origin: float | None = None,
             queue: bool = True):
    """A per-rank Gantt chart. ``events``: dicts ``{"rank", "lane", "name", "start", "end"}`` (s).

    Each rank gets one row per lane (e.g. "compute", "comm"), rank 0 at the top; each event is
    a bar from ``start`` to ``end`` coloured by ``name``. Times are shown in milliseconds from
    ``origin`` (default: the earliest start). Overlap between a rank's lanes -- communication
    hidden behind compute, or pipeline bubbles -- is what the chart is for.

    An event may also carry ``"issued"`` (a collective queued before the communication thread
    began it, as ``workbench.comm`` handles record): with ``queue=True`` a small triangle above
    the bar marks when it was issued, so the gap to its bar is the time it waited in the queue.
    """
    events = list(events)
    need = ("rank", "lane", "name", "start", "end")
    for e in events:
        missing = [k for k in need if k not in e]
        if missing:
            raise ValueError(f"plots.timeline: event {dict(e)!r} lacks {missing}; each event needs {list(need)}")
        if e["end"] < e["start"]:
            raise ValueError(f"plots.timeline: event {dict(e)!r} ends before it starts")
    fig, ax = _axes(ax, figsize=(9, 1 + 0.5 * max(1, len({(e['rank'], e['lane']) for e in events}))))
    if not events:
        ax.set_title(f"{title} (no events)")
        return fig
    t0 = min(min(e["start"], e.get("issued") or e["start"]) for e in events) if origin is None else origin
    lanes: list[str] = []
    for e in events:
        if e["lane"] not in lanes:
            lanes.append(e["lane"])
    rows = sorted({(e["rank"], lanes.index(e["lane"])) for e in events})
    y_of = {row: len(rows) - 1 - i for i, row in enumerate(rows)}  # rank 0, first lane at the top
    names: list[str] = []
    for e in events:
        if e["name"] not in names:
            names.append(e["name"])
    colors = dict(zip(names, _colors(len(names))))
    labelled: set = set()
    for e in events:
        y = y_of[(e["rank"], lanes.index(e["lane"]))]
        if queue and e.get("issued") is not None:
            ax.plot([(e["issued"] - t0) * 1e3], [y + 0.5], marker="v", markersize=6, color=colors[e["name"]],
                    markeredgecolor="black", markeredgewidth=0.3, linestyle="none", clip_on=False,
                    label=None if "issued" in labelled else "issued (queued until its bar starts)")
            labelled.add("issued")
        ax.barh(y, (e["end"] - e["start"]) * 1e3, left=(e["start"] - t0) * 1e3, height=0.8,
                color=colors[e["name"]], edgecolor="black", linewidth=0.3,
                label=None if e["name"] in labelled else e["name"])
        labelled.add(e["name"])
    ax.set_yticks([y_of[r] for r in rows], [f"rank {r} {lanes[l]}" for r, l in rows])
    ax.set_xlabel("time (ms)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="x", alpha=0.3)
    return fig


def zero_model_state(ax=None, *, psi: float, world_size: int, optimizer: str = "adam", precision: str = "fp32",
                     stage: int | None = None, measured: Sequence[Mapping] | None = None,
                     measured_world_size: int | None = None):
    """Stacked bars of model state per rank for ZeRO stages 0-3, from the ZeRO formulas
    (:func:`workbench.parallel.zero_memory.model_state_per_rank`), in MiB.

    ``stage`` outlines one stage's bar. ``measured``: rows with ``stage``, ``params``, ``grads``
    and ``optimizer`` bytes (``workbench.bench.zero.state_and_traffic``), drawn hatched beside the
    formula's bars, labelled with ``measured_world_size``, so the predictor sits next to a run.
    """
    from workbench.parallel.zero_memory import STAGES, model_state_per_rank

    fig, ax = _axes(ax, figsize=(7, 4))
    cats = ("params", "grads", "optimizer")
    width = 0.38 if measured else 0.7
    formula = [model_state_per_rank(psi, world_size, s, optimizer, precision) for s in STAGES]
    bottom = [0.0] * len(STAGES)
    xs = [s - (width / 2 if measured else 0) for s in STAGES]
    for cat in cats:
        heights = [f[cat] / _MIB for f in formula]
        ax.bar(xs, heights, width, bottom=bottom, color=CATEGORY_COLORS[cat], label=f"{cat} (formula)")
        bottom = [b + h for b, h in zip(bottom, heights)]
    for x, total in zip(xs, bottom):
        ax.annotate(f"{total:,.1f}", (x, total), textcoords="offset points", xytext=(0, 2), ha="center", fontsize=8)
    if stage is not None:
        ax.bar(xs[stage], bottom[stage], width, fill=False, edgecolor="black", linewidth=2, label="selected stage")
    if measured:
        by_stage = {r["stage"]: r for r in measured}
        mbottom = [0.0] * len(STAGES)
        mx = [s + width / 2 for s in STAGES]
        for cat in cats:
            heights = [by_stage[s][cat] / _MIB if s in by_stage else 0.0 for s in STAGES]
            ax.bar(mx, heights, width, bottom=mbottom, color=CATEGORY_COLORS[cat], hatch="//", alpha=0.6,
                   edgecolor="white")
            mbottom = [b + h for b, h in zip(mbottom, heights)]
        from matplotlib.patches import Patch

        measured_label = f"measured, N = {measured_world_size}" if measured_world_size else "measured"
        handles, labels = ax.get_legend_handles_labels()
        ax.legend(handles + [Patch(facecolor="0.75", edgecolor="white", hatch="//")], labels + [measured_label],
                  fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.set_xticks(list(STAGES), [f"stage {s}" for s in STAGES])
    ax.set_ylim(0, None)
    ax.set_ylabel("model state per rank (MiB)")
    ax.set_title(f"ZeRO formula: {psi / 1e6:,.1f} M parameters, N = {world_size}, {optimizer}, {precision}")
    if not measured:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return fig
