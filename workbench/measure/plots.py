"""Figures from measurements: throughput, memory breakdown, loss curves, per-rank timelines.

Every function takes plain data (lists of dicts, as :func:`workbench.apps.train.summarize` and
``workbench.report`` records give them), draws on ``ax`` (a new figure when None) and returns
the ``matplotlib`` Figure, with a title, axis units and a legend, so a lesson cell is one line::

    plots.throughput(rows)                 # bars: tokens/s per strategy
    plots.memory_breakdown(rows)           # stacked bars: peak bytes per rank, by category
    plots.loss_curves({"single": losses, "torch-ddp": ddp_losses})
    plots.timeline(None, events)           # Gantt chart: what each rank did when
    plots.pipeline_schedule(schedule.actions, num_stages=4)   # a pipeline's planned grid
    plots.pipeline_schedule(schedule.timeline)                # ... and the measured one

matplotlib is imported when a function is called, so importing the workbench stays cheap and
works where no display exists (set ``MPLBACKEND=Agg`` to draw to files).
"""
from __future__ import annotations

from typing import Iterable, Mapping, Sequence

from workbench.parallel import pipeline_schedules as plans
from workbench.parallel.zero_memory import STAGES, model_state_per_rank

__all__ = ["throughput", "memory_breakdown", "loss_curves", "timeline", "pipeline_schedule", "zero_model_state",
           "holdings", "CATEGORY_COLORS"]

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


def holdings(ax, rows: Sequence[Sequence[float | None] | None], title: str, highlight: Mapping[int, int] | None = None):
    """Who holds what: one rank per row, one element per column, the value written in its cell
    (``rows[r]`` is rank r's values; None or a None element: nothing held there). ``highlight``
    ``{rank: column}`` outlines one cell per rank in red (e.g. the block a ring step sends)."""
    import matplotlib.pyplot as plt

    width = max((len(v) for v in rows if v), default=1)
    for r, values in enumerate(rows):
        for j in range(width):
            held = values is not None and j < len(values) and values[j] is not None
            edge = "crimson" if highlight and highlight.get(r) == j else "0.6"
            ax.add_patch(plt.Rectangle((j, -r - 1), 1, 1, facecolor=f"C{j % 10}" if held else "white",
                                       alpha=0.35 if held else 1.0, edgecolor=edge,
                                       lw=2.5 if edge == "crimson" else 0.8))
            if held:
                ax.text(j + 0.5, -r - 0.5, f"{values[j]:g}", ha="center", va="center", fontsize=8)
    ax.set_xlim(0, width)
    ax.set_ylim(-len(rows), 0)
    ax.set_yticks([-r - 0.5 for r in range(len(rows))], [f"rank {r}" for r in range(len(rows))], fontsize=8)
    ax.set_xticks([])
    ax.set_title(title, fontsize=9)
    for side in ax.spines.values():
        side.set_visible(False)
    return ax


PIPELINE_COLORS = {"F": "#4c72b0", "B": "#55a868", "W": "#dd8452", "send": "#8172b3", "recv": "#b0b0b0"}


def pipeline_schedule(plan, ax=None, *, num_stages: int | None = None, style: str = "loop",
                      title: str | None = None, messages: bool = False):
    """The classic pipeline grid, one row per rank, each box one action labelled with its
    micro-batch (and stage, when a rank holds several): forwards blue, backwards green, weight
    gradients orange.

    ``plan`` is either a schedule's ``actions`` (a list of action lists, one per rank: drawn
    *planned*, each action laid out by ``pipeline_schedules.simulate`` with F = 1, B = W = 1
    (a full backward 2) for a whole model's share, divided by the stages per rank, ``num_stages`` and ``style`` as the schedule has them) or a
    ``timeline`` (records with rank, stage, kind, microbatch, start, end: drawn *measured*, in
    ms). ``messages=True`` also draws the (thin) send and receive waits of a measured timeline.
    """
    plan = list(plan)
    measured = bool(plan) and isinstance(plan[0], Mapping)
    if measured:
        records = [dict(r) for r in plan if messages or r["kind"] in ("F", "B", "W")]
        scale, unit = 1e3, "time (ms)"
    else:
        if num_stages is None:
            num_stages = 1 + max((a.stage for acts in plan for a in acts), default=0)
        v = max(1, num_stages // max(1, len(plan)))  # stages per rank: each costs 1/v of a stage
        records = plans.simulate(plan, num_stages, f=1 / v, w=1 / v, style=style)
        scale, unit = 1.0, "time (one forward = 1)"
    ranks = sorted({r["rank"] for r in records}) or [0]
    stages_per_rank = {}
    for r in records:
        stages_per_rank.setdefault(r["rank"], set()).add(r["stage"])
    several = any(len(v) > 1 for v in stages_per_rank.values())
    fig, ax = _axes(ax, figsize=(10, 0.6 + 0.45 * len(ranks)))
    t0 = min((r["start"] for r in records), default=0.0)
    for r in records:
        y = len(ranks) - 1 - ranks.index(r["rank"])
        left, width = (r["start"] - t0) * scale, (r["end"] - r["start"]) * scale
        if r["kind"] in ("send", "recv"):
            ax.barh(y - 0.35, width, left=left, height=0.12, color=PIPELINE_COLORS[r["kind"]])
            continue
        ax.barh(y, width, left=left, height=0.8, color=PIPELINE_COLORS[r["kind"]],
                edgecolor="black", linewidth=0.4)
        label = f"{r['microbatch']}" if not several else f"{r['microbatch']}\n s{r['stage']}"
        ax.text(left + width / 2, y, label, ha="center", va="center", fontsize=7, color="white")
    ax.set_yticks([len(ranks) - 1 - i for i in range(len(ranks))], [f"rank {r}" for r in ranks])
    ax.set_xlabel(unit)
    from matplotlib.patches import Patch

    kinds = [k for k in ("F", "B", "W") if any(r["kind"] == k for r in records)]
    names = {"F": "forward", "B": "backward" if "W" not in kinds else "backward (input grad)",
             "W": "backward (weight grad)"}
    ax.legend(handles=[Patch(color=PIPELINE_COLORS[k], label=names[k]) for k in kinds], fontsize=8,
              loc="upper left", bbox_to_anchor=(1.0, 1.0))
    bubble = plans.bubble(records, len(ranks))
    ax.set_title(title or f"{'Measured' if measured else 'Planned'} schedule (idle {bubble:.0%})")
    ax.grid(axis="x", alpha=0.3)
    return fig


def mesh_grid(layout: Mapping, ax=None, *, title: str | None = None, ranks_per_node: int | None = None):
    """The ranks of a 3D mesh and the groups they form (``workbench.parallel.mesh.layout(dp, tp, pp)``).

    ``layout["grid"]`` is the ``(pp, dp, tp)`` array of ranks (a tensor or nested lists), indexed
    by coordinates whatever ``layout["order"]`` placed where. Each
    pipeline stage is a panel of ``dp`` rows by ``tp`` columns; a tensor-parallel group is a row
    (solid box: adjacent ranks, one node's fast links), a data-parallel group a column within a
    stage (dashed box), and a pipeline group the cells at the same place in every stage (arrows
    from stage to stage).

    ``ranks_per_node``: shade the ranks of each node (node ``k`` holds ranks ``k L .. k L + L - 1``,
    as torchrun and ``comm.Topology`` number them), so a group that crosses a shade crosses the
    slow inter-node links. A node whose ranks form a block of the drawing gets one shaded box;
    otherwise each of its ranks is shaded in the node's colour.
    """
    from matplotlib.patches import FancyBboxPatch

    grid = layout["grid"]
    if hasattr(grid, "dim") and grid.dim() == 4:  # (pp, dp, cp, tp): a mesh without context parallelism
        if grid.shape[2] != 1:
            raise ValueError(f"mesh_grid draws dp x tp x pp meshes: this layout has cp={grid.shape[2]}; draw it "
                             "with cp=1")
        grid = grid[:, :, 0]
    grid = grid.tolist() if hasattr(grid, "tolist") else [list(map(list, stage)) for stage in grid]
    pp, dp, tp = len(grid), len(grid[0]), len(grid[0][0])
    fig, ax = _axes(ax, figsize=(1.6 + 1.3 * pp * (tp + 0.8), 1.8 + 1.0 * dp))
    colors = {"tp": "#4c72b0", "dp": "#dd8452", "pp": "#55a868"}
    gap = 1.0  # empty columns between stages

    def x_of(p: int, t: int) -> float:
        return p * (tp + gap) + t

    for p in range(pp):
        for d in range(dp):
            for t in range(tp):
                ax.add_patch(FancyBboxPatch((x_of(p, t) - 0.32, -d - 0.32), 0.64, 0.64,
                                            boxstyle="round,pad=0.02", facecolor="white", edgecolor="black", zorder=2))
                ax.text(x_of(p, t), -d + 0.06, f"rank {grid[p][d][t]}", ha="center", va="center", fontsize=9)
                ax.text(x_of(p, t), -d - 0.16, f"dp{d} tp{t}", ha="center", va="center", fontsize=6, color="0.4")
            ax.add_patch(FancyBboxPatch((x_of(p, 0) - 0.42, -d - 0.42), tp - 1 + 0.84, 0.84,
                                        boxstyle="round,pad=0.02", fill=False, edgecolor=colors["tp"], linewidth=2,
                                        label="tp group" if p == d == 0 else None))
        for t in range(tp):
            ax.add_patch(FancyBboxPatch((x_of(p, t) - 0.47, -(dp - 1) - 0.47), 0.94, dp - 1 + 0.94,
                                        boxstyle="round,pad=0.02", fill=False, edgecolor=colors["dp"], linewidth=1.5,
                                        linestyle="--", label="dp group" if p == t == 0 else None))
        ax.text(x_of(p, (tp - 1) / 2), 0.75, f"pipeline stage {p}", ha="center", fontsize=10)
        if p + 1 < pp:
            for d in range(dp):
                for t in range(tp):
                    ax.annotate("", xy=(x_of(p + 1, t) - 0.2, -d + 0.32), xytext=(x_of(p, t) + 0.2, -d + 0.32),
                                arrowprops=dict(arrowstyle="->", color=colors["pp"], alpha=0.8, linewidth=1.5,
                                                connectionstyle=f"arc3,rad={-0.15 - 0.1 * t}"), zorder=1)
    if pp > 1:
        ax.plot([], [], color=colors["pp"], label="pp group (same place, every stage)")
    if ranks_per_node is not None:
        places = {grid[p][d][t]: (x_of(p, t), -d) for p in range(pp) for d in range(dp) for t in range(tp)}
        _shade_nodes(ax, places, ranks_per_node)
    ax.set_xlim(-0.7, x_of(pp - 1, tp - 1) + 0.7)
    ax.set_ylim(-dp + 0.3, 1.2)
    ax.set_aspect("equal")
    ax.axis("off")
    order = tuple(d for d in layout.get("order", ("pp", "dp", "tp")) if d != "cp")
    formula = f"rank = (pp x {dp} + dp) x {tp} + tp" if order == ("pp", "dp", "tp") else \
        f"order {' > '.join(order)} (outermost first)"
    ax.set_title(title or f"Mesh dp={dp} x tp={tp} x pp={pp}: {formula}")
    ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=3, frameon=False)
    return fig


def _shade_nodes(ax, places: Mapping[int, tuple[float, float]], ranks_per_node: int) -> None:
    """Shade each node's ranks (``places``: rank -> centre of its cell, cells one unit apart) behind
    the cells and the group boxes: one box around a node whose cells fill a rectangle of the
    drawing, else one box per cell; each node once in the legend."""
    from matplotlib.patches import FancyBboxPatch

    if isinstance(ranks_per_node, bool) or not isinstance(ranks_per_node, int) or ranks_per_node < 1:
        raise ValueError(f"mesh_grid: ranks_per_node={ranks_per_node!r} must be a whole number >= 1 (ranks per node)")
    nodes: dict[int, list[int]] = {}
    for rank in sorted(places):
        nodes.setdefault(rank // ranks_per_node, []).append(rank)
    shades = ["#8172b3", "#937860", "#da8bc3", "#ccb974", "#64b5cd", "#8c8c8c"]  # none of the groups' colours
    half = 0.49  # cells sit one unit apart: neighbouring nodes' shades do not overlap
    for node, ranks in nodes.items():
        xs, ys = [places[r][0] for r in ranks], [places[r][1] for r in ranks]
        inside = [r for r, (x, y) in places.items() if min(xs) <= x <= max(xs) and min(ys) <= y <= max(ys)]
        if sorted(inside) == ranks:  # the node is a block of the drawing: one box around it
            boxes = [(min(xs), min(ys), max(xs), max(ys))]
        else:
            boxes = [(places[r][0], places[r][1], places[r][0], places[r][1]) for r in ranks]
        first, last = ranks[0], ranks[-1]
        label = f"node {node}: rank {first}" if first == last else f"node {node}: ranks {first}-{last}"
        for i, (x0, y0, x1, y1) in enumerate(boxes):
            ax.add_patch(FancyBboxPatch((x0 - half, y0 - half), x1 - x0 + 2 * half, y1 - y0 + 2 * half,
                                        boxstyle="round,pad=0.0,rounding_size=0.12",
                                        facecolor=shades[node % len(shades)], edgecolor="none", alpha=0.4, zorder=0,
                                        label=label if i == 0 else None))


__all__.append("mesh_grid")


def zero_model_state(ax=None, *, psi: float, world_size: int, optimizer: str = "adam", precision: str = "fp32",
                     stage: int | None = None, measured: Sequence[Mapping] | None = None,
                     measured_world_size: int | None = None):
    """Stacked bars of model state per rank for ZeRO stages 0-3, from the ZeRO formulas
    (:func:`workbench.parallel.zero_memory.model_state_per_rank`), in MiB.

    ``stage`` outlines one stage's bar. ``measured``: rows with ``stage``, ``params``, ``grads``
    and ``optimizer`` bytes (``workbench.apps.bench.zero.state_and_traffic``), drawn hatched beside the
    formula's bars, labelled with ``measured_world_size``, so the predictor sits next to a run.
    """
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
