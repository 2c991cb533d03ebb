"""Our pipeline schedules against torch.distributed.pipelining, and against the formulas.

``workbench bench pipeline`` measures three things, each in its own launch:

1. **Step time** (``--parts time``): GPT ``small`` cut into stages, world size 2, the same
   batch through our schedule and torch's (``ScheduleGPipe``, ``Schedule1F1B``,
   ``ScheduleInterleaved1F1B``, ``ScheduleZBVZeroBubble``, ``ScheduleDualPipeV``; ZB-H1 has no
   torch twin and is timed alone) for m = 4 and 8 micro-batches. Candidates take turns inside every trial in rotating
   order; a trial's number is the slowest rank's mean step time (forward, backward, AdamW step);
   the report gives the median over trials and ours / torch. Target: <= 1.10x. Beside it, the
   same ratio of CPU time (the slowest rank's main thread, ``time.thread_time``): the work each
   implementation does, which other processes on the machine do not inflate the way they
   inflate waiting. Before timing, ours and torch's gradients are compared on the same weights
   and batch.
2. **Bubble** (``--parts bubble``): stages that sleep a fixed time in forward, input-gradient
   and weight-gradient backward (:class:`~workbench.models.sleep.SleepStage`; a full backward
   sleeps both), so p = 2, 4, 8 ranks give real schedules on 2 cores. For every schedule, p and
   m in {1, 2, 4, 8, 16} (where allowed), the idle fraction measured from ``schedule.timeline``
   (the least idle of ``--bubble-steps`` steps: noise only adds idle time) against
   ``pipeline_schedules.bubble_formula``. Target: within 0.03.
3. **Activation memory and bytes** (``--parts memory``): real GPT stages (``tiny``, 8 blocks),
   p = 2 and 4 (``--memory-stages``), m = 8. Per rank, the peak *live activation bytes*: what
   :class:`~workbench.measure.memory_meter.MemoryMeter` counts as activations at the end of each action of
   the step (between actions no forward or backward is running, so what is alive is what the
   micro-batches in flight hold), against the schedule's count: the plan's micro-batches in
   flight, each weighted by what it holds -- M_B from its forward to its backward, and for the
   zero-bubble schedules M_W from B to W (the inputs of the deferred matrix products and their
   output gradients; Qi et al.), both measured on one micro-batch run alone
   (``pipeline_schedules.peak_live_bytes``). Target 1.00-1.10 on every rank. Reported beside
   it: the backward's temporaries (the step's overall peak minus that: gradients in flight
   inside one backward, for a moment), and the bytes each boundary carried in one step
   (``comm.counters()``) against 2 x m x one micro-batch's boundary activation (exact). Steps
   run with ``return_outputs=False``; with ``True`` the last stage also keeps m micro-batches'
   logits to return them (``returned_outputs_bytes``).

Writes ``pipeline.json`` and ``pipeline.png`` (ratios; measured bubbles on the formula curves;
activation memory per stage). CPU timings are noisy while other processes run: the load
average is recorded with the results; read the ratios, not the milliseconds.
"""
from __future__ import annotations

import argparse
import copy
import os
import time
import bisect

import torch
import torch.nn.functional as F
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring
from workbench.models.data import synthetic_batch
from workbench.measure.memory_meter import MemoryMeter
from workbench.models import GPT, GPTConfig
from workbench.models.sleep import SleepStage
from workbench.parallel import pipeline as pp
from workbench.parallel import pipeline_backward as split_backward
from workbench.parallel import pipeline_schedules as plans

SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb_h1", "zbv", "dualpipev")
TORCH_TWIN = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved": "ScheduleInterleaved1F1B",
              "zbv": "ScheduleZBVZeroBubble", "dualpipev": "ScheduleDualPipeV"}
PARTS = ("time", "bubble", "memory")
TARGET_RATIO = 1.10
BUBBLE_TOLERANCE = 0.03


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--parts", default=",".join(PARTS), help="comma-separated: time, bubble, memory")
    parser.add_argument("--schedules", default=",".join(SCHEDULES), help=f"subset of {', '.join(SCHEDULES)}")
    parser.add_argument("--microbatches", default="4,8", help="m for the step-time part (default 4,8)")
    parser.add_argument("--batch", type=int, default=16, help="global batch (sequences of 128 tokens) for timing")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per trial (default 3)")
    parser.add_argument("--stages", default="2,4,8", help="p for the bubble part (default 2,4,8)")
    parser.add_argument("--bubble-m", default="1,2,4,8,16", help="m for the bubble part")
    parser.add_argument("--bubble-steps", type=int, default=3,
                        help="steps per bubble point; the least idle one is reported (default 3)")
    parser.add_argument("--sleep-ms", type=float, default=40.0,
                        help="forward time of a whole sleeping stage, ms (B and W the same; default 40: "
                             "each action's fraction of a millisecond of Python and messaging then stays "
                             "small beside the sleep; shorter sleeps let that overhead show as bubble)")
    parser.add_argument("--memory-stages", default="2,4", help="p for the memory part (default 2,4)")
    parser.add_argument("--out", default=None, help="folder for pipeline.json/png (default runs/pipeline-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw pipeline.png")


def _ints(text: str, what: str) -> list[int]:
    try:
        values = [int(s) for s in text.split(",") if s.strip()]
    except ValueError:
        values = []
    if not values or any(v < 1 for v in values):
        raise ValueError(f"--{what}={text!r}: give whole numbers >= 1, comma-separated")
    return values


def loss_fn(logits, target):
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _ours(name: str):
    return pp.SCHEDULES[name]


def _local(name: str, p: int, rank: int) -> tuple[int, list[int]]:
    cls = _ours(name)
    S = (2 if cls.multi else 1) * p
    owner = plans.stage_to_rank(S, p, cls.style)
    return S, [s for s in range(S) if owner[s] == rank]


def _pipeline(name: str, model, p: int, rank: int, m: int, impl: str):
    """(schedule, local stage modules, S, local ids) for ``impl`` = "ours" or "torch"."""
    S, local = _local(name, p, rank)
    parts = pp.partition(model, S)
    if impl == "ours":
        stages = [pp.PipelineStage(parts[s], s, S) for s in local]
        cls = _ours(name)
    else:
        from torch.distributed import pipelining as tp

        stages = [tp.PipelineStage(parts[s], s, S, torch.device("cpu")) for s in local]
        cls = getattr(tp, TORCH_TWIN[name])
    schedule = cls(stages if len(stages) > 1 else stages[0], m, loss_fn=loss_fn)
    return schedule, [parts[s] for s in local], S, local


def _step(schedule, S, local, x, y, losses=None, return_outputs=True):
    return schedule.step(*((x,) if 0 in local else ()), target=y if S - 1 in local else None,
                         losses=losses, return_outputs=return_outputs)


# ------------------------------------------------------------------------------------- 1. time

def _time_rank(schedules, ms, batch, trials, steps) -> dict:
    rank, p = dist.get_rank(), dist.get_world_size()
    # untied head: torch's pipelining does not sum a tied embedding's two gradients (ours does)
    config = GPTConfig.preset("small", tie_weights=False)
    x, y = synthetic_batch(batch, block_size=config.block_size, seed=0)
    rows = []
    for m in ms:
        candidates, runs = [], {}
        for name in schedules:
            for impl in ("torch", "ours"):
                if impl == "torch" and name not in TORCH_TWIN:
                    continue
                torch.manual_seed(0)
                model = GPT(config)
                schedule, mods, S, local = _pipeline(name, model, p, rank, m, impl)
                params = list({id(q): q for mod in mods for q in mod.parameters()}.values())
                runs[(name, impl)] = (schedule, mods, S, local, torch.optim.AdamW(params, lr=1e-4))
                candidates.append(f"{impl}:{name}")
        # same weights, same batch: our gradients against torch's, before any update
        grad_diff = {}
        for name in schedules:
            if name not in TORCH_TWIN:
                continue
            for impl in ("ours", "torch"):
                schedule, mods, S, local, _ = runs[(name, impl)]
                _step(schedule, S, local, x, y)
            ours = [q.grad for mod in runs[(name, "ours")][1] for q in mod.parameters()]
            theirs = [q.grad for mod in runs[(name, "torch")][1] for q in mod.parameters()]
            diff = max((a - b).abs().max().item() for a, b in zip(ours, theirs))
            grad_diff[name] = measuring.max_over_ranks(diff)

        def train_step(key):
            schedule, mods, S, local, opt = runs[key]
            _step(schedule, S, local, x, y)
            opt.step()
            opt.zero_grad(set_to_none=True)

        for key in runs:  # warm-up
            train_step(key)

        cpu: dict[str, list[float]] = {c: [] for c in candidates}

        def measure(c):
            impl, name = c.split(":")
            c0 = time.thread_time()
            wall = measuring.timed(lambda: train_step((name, impl)), steps)
            cpu[c].append(measuring.max_over_ranks((time.thread_time() - c0) / steps))
            return measuring.max_over_ranks(wall)

        samples = measuring.interleaved_trials(candidates, trials, measure)
        for name in schedules:
            row = {"m": m, "schedule": name, "ours_ms": 1e3 * measuring.median(samples[f"ours:{name}"]),
                   "ours_samples_ms": [1e3 * s for s in samples[f"ours:{name}"]]}
            if name in TORCH_TWIN:
                row["torch_ms"] = 1e3 * measuring.median(samples[f"torch:{name}"])
                row["torch_samples_ms"] = [1e3 * s for s in samples[f"torch:{name}"]]
                row["ratio"] = row["ours_ms"] / row["torch_ms"]
                row["cpu_ratio"] = measuring.median(cpu[f"ours:{name}"]) / measuring.median(cpu[f"torch:{name}"])
                row["max_grad_diff_vs_torch"] = grad_diff[name]
            rows.append(row)
        del runs
    return {"rows": rows, "load": os.getloadavg()}


# ----------------------------------------------------------------------------------- 2. bubble

def sleeping_pipeline(name: str, m: int, sleep_s: float, steps: int) -> dict:
    """Call on every rank: schedule ``name`` (``p`` = the world size, two stages per rank for
    the multi-stage ones) on stages that sleep ``sleep_s`` per forward and per backward half of
    a whole stage (:class:`~workbench.models.sleep.SleepStage`), ``m`` micro-batches; runs
    ``steps + 1`` steps and returns ``timelines`` (those of the last ``steps``: the first also
    sends the shapes), the schedule's ``actions`` and its ``planned`` timeline. Sleeping releases
    the core, so 4-8 stages on 2 cores show the schedule's own bubble; noise (a rank waiting for a core, a late wake-up) only ever adds idle time."""
    cls = _ours(name)
    v = 2 if cls.multi else 1
    S, local = _local(name, dist.get_world_size(), dist.get_rank())
    stages = [pp.PipelineStage(SleepStage(sleep_s / v), s, S) for s in local]
    schedule = cls(stages if cls.multi else stages[0], m, loss_fn=lambda out, tgt: out.sum())
    x = torch.zeros(m, 4, requires_grad=True)
    timelines = []
    for i in range(steps + 1):
        _step(schedule, S, local, x, x.detach())
        if i:
            timelines.append(schedule.timeline)
    return {"timelines": timelines, "actions": schedule.actions, "planned": schedule.planned_timeline()}


def _bubble_rank(schedules, ms, sleep_s, steps) -> list[dict]:
    p = dist.get_world_size()
    rows = []
    for name in schedules:
        for m in ms:
            if m < plans.min_microbatches(name, p):
                continue
            # the least idle of the steps is the best estimate of the schedule's own bubble
            run = sleeping_pipeline(name, m, sleep_s, steps)
            measured = min(plans.bubble(t, p) for t in run["timelines"])
            rows.append({"schedule": name, "p": p, "m": m, "measured": measured,
                         "formula": plans.bubble_formula(name, p, m),
                         "planned": plans.bubble(run["planned"], p)})
    return rows


# ----------------------------------------------------------------------------------- 3. memory

def _lone_microbatch(mod, s: int, S: int, split: bool, x, y, m: int, config,
                     input_is_previous_output: bool = False) -> tuple[int, int, int]:
    """One micro-batch through stage ``s`` alone, the way the interpreter runs it: (M_B, M_W,
    backward temporaries) in bytes. M_B: what its forward leaves alive (the saved activations,
    its input and output); M_W (split backward only): what is left for W after B; temporaries:
    the most its backward allocates on top of that, transiently. With
    ``input_is_previous_output`` (the tip of ZBV's V: stage s-1 is on the same rank) the input
    is the previous stage's output, already counted there, so it is made outside the meter."""
    params = [q for q in mod.parameters() if q.requires_grad]
    shape = (*x.shape, config.n_embd)
    inp = torch.zeros(*shape, requires_grad=True) if input_is_previous_output else None
    with MemoryMeter(device="cpu") as meter:
        if inp is None:
            inp = x if s == 0 else torch.zeros(*shape, requires_grad=True)
        saved = split_backward.SavedActivations() if split else None
        if saved is not None:
            with saved:
                out = mod(inp)
        else:
            out = mod(inp)
        if s == S - 1:
            out = loss_fn(out, y) / m
        one = meter.current_by_category.get("activations", 0)
        g = None if s == S - 1 else torch.ones_like(out)
        held = one
        if split:
            grads, state = split_backward.backward_input(out, g, [inp] if s > 0 else [], params, saved)
            del out, inp, grads, g
            held = meter.current_by_category.get("activations", 0)
            split_backward.backward_weight(state, params)
            del state
        else:
            out.backward(g)
    temporaries = meter.peak_by_category.get("activations", 0) - one
    mod.zero_grad(set_to_none=True)
    return one, held, temporaries


def _between_actions(history, timeline, origin: float, rank: int) -> int:
    """The most activation bytes alive at the end of any of ``rank``'s actions: between two
    actions no forward or backward is running, so no temporaries exist -- what is alive is what
    the micro-batches in flight hold (plus messages waiting to leave or posted to arrive)."""
    times = [h[0] for h in history]
    peak = 0
    for rec in timeline:
        if rec["rank"] != rank:
            continue
        k = bisect.bisect_right(times, origin + rec["end"]) - 1
        if k >= 0:
            peak = max(peak, history[k][2])
    return peak


def activation_memory(schedules=SCHEDULES, m: int = 8, n_layer: int = 8, microbatch: int = 4) -> list[dict]:
    """Run on every rank of a launch (world size p): per schedule, this rank's peak live
    activation bytes during one step of real GPT ``tiny`` stages (``n_layer`` blocks) against
    the schedule's count. Returns one row per schedule for this rank.

    * measured: :class:`~workbench.measure.memory_meter.MemoryMeter`'s activation bytes at the end of every
      action of the step (``history`` read at the ``schedule.timeline`` ends), the largest;
    * count: ``pipeline_schedules.peak_live_bytes`` of this rank's action list, with M_B and M_W
      of each stage measured on one micro-batch alone (:func:`_lone_microbatch`);
    * temporaries: the meter's peak over the whole step minus the measured value: what one
      backward allocates on top, for a moment (not an activation of anything in flight).

    Steps run with ``return_outputs=False``: with ``True`` the last stage also keeps the m
    micro-batches' logits to return them (reported as ``returned_outputs_bytes``).
    """
    rank, p = dist.get_rank(), dist.get_world_size()
    config = GPTConfig.preset("tiny", n_layer=n_layer, tie_weights=False)
    batch = microbatch * m
    x, y = synthetic_batch(batch, block_size=config.block_size, seed=0)
    rows = []
    for name in schedules:
        if m < plans.min_microbatches(name, p) or (_ours(name).multi and 2 * p > n_layer):
            continue
        torch.manual_seed(0)
        model = GPT(config)
        schedule, mods, S, local = _pipeline(name, model, p, rank, m, "ours")
        _step(schedule, S, local, x, y, return_outputs=False)  # shapes, warm-up
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        split = {a.stage for a in schedule.actions[rank] if a.kind == "W"}
        one, held, temporaries = {}, {}, {}
        for s, mod in zip(local, mods):
            one[s], held[s], temporaries[s] = _lone_microbatch(mod, s, S, s in split, x[:microbatch],
                                                               y[:microbatch], m, config, s - 1 in local)
        with comm.counters() as c, MemoryMeter(device="cpu", history=True) as meter:
            _step(schedule, S, local, x, y, return_outputs=False)
        for mod in mods:
            mod.zero_grad(set_to_none=True)
        live = plans.live_microbatches(schedule.actions[rank])
        count = plans.peak_live_bytes(schedule.actions[rank], one, held)
        measured = _between_actions(meter.history, schedule.timeline, schedule.timeline_origin, rank)
        boundary = microbatch * config.block_size * config.n_embd * 4
        sent = c.stats[("isend", "native")].bytes_sent if ("isend", "native") in c.stats else 0
        # messages this rank sends: m activations over each boundary to a later stage on another
        # rank, m gradients over each boundary to an earlier one
        boundaries_sent = sum(1 for s in local if s + 1 < S and s + 1 not in local) \
            + sum(1 for s in local if s > 0 and s - 1 not in local)
        rows.append({"schedule": name, "p": p, "m": m, "rank": rank, "stages": local,
                     "live": {str(s): live[s] for s in local},
                     "one_microbatch_bytes": {str(s): one[s] for s in local},
                     "held_for_w_bytes": {str(s): held[s] for s in local if s in split},
                     "count_bytes": count, "live_activation_bytes": measured,
                     "ratio": measured / count if count else float("nan"),
                     "step_peak_bytes": meter.peak_by_category.get("activations", 0),
                     "temporaries_bytes": meter.peak_by_category.get("activations", 0) - measured,
                     "returned_outputs_bytes": (batch * config.block_size * config.vocab_size * 4
                                                if S - 1 in local else 0),
                     "bytes_sent": sent, "bytes_expected": boundaries_sent * m * boundary})
    return rows


# ----------------------------------------------------------------------------------- report

def main(args: argparse.Namespace) -> int:
    parts = measuring.choices(args.parts, PARTS, "parts")
    schedules = measuring.choices(args.schedules, SCHEDULES, "schedules")
    ms = _ints(args.microbatches, "microbatches")
    ps = _ints(args.stages, "stages")
    bubble_ms = _ints(args.bubble_m, "bubble-m")
    memory_ps = _ints(args.memory_stages, "memory-stages")
    for name in ("trials", "steps", "batch", "bubble_steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name}={getattr(args, name)} must be at least 1")
    if any(args.batch % m for m in ms):
        raise ValueError(f"--batch={args.batch} must split into every --microbatches {ms}")
    start = time.time()
    results: dict = {"load_before": os.getloadavg()}
    ok = True
    lines = []
    if "time" in parts:
        res = workbench.launch(_time_rank, world_size=2, args=(schedules, ms, args.batch, args.trials, args.steps),
                               timeout=3600)[0]
        results["time"] = res
        lines.append(measuring.format_table(res["rows"], [
            ("schedule", "schedule", "s"), ("m", "m", "{:d}"), ("ours_ms", "ours ms", "{:.1f}"),
            ("torch_ms", "torch ms", "{:.1f}"), ("ratio", "x torch", "{:.3f}"),
            ("cpu_ratio", "CPU x torch", "{:.3f}"),
            ("max_grad_diff_vs_torch", "grad diff", "{:.1e}")],
            title=f"bench pipeline: GPT small, 2 stages/ranks (4 stages for interleaved, zbv, dualpipev), batch "
                  f"{args.batch}x128, median of {args.trials} interleaved trials x {args.steps} steps; "
                  f"load {res['load'][0]:.1f}"))
        worst = max((r["ratio"] for r in res["rows"] if "ratio" in r), default=float("nan"))
        ok &= worst <= TARGET_RATIO
        lines.append(f"# worst ours / torch = {worst:.3f}: {'meets' if worst <= TARGET_RATIO else 'MISSES'} "
                     f"the target <= {TARGET_RATIO:.2f}\n")
    if "bubble" in parts:
        rows = []
        for p in ps:
            rows += workbench.launch(_bubble_rank, world_size=p,
                                     args=(schedules, bubble_ms, args.sleep_ms / 1e3, args.bubble_steps),
                                     timeout=3600)[0]
        for r in rows:
            r["error"] = r["measured"] - r["formula"]
        results["bubble"] = rows
        lines.append(measuring.format_table(rows, [
            ("schedule", "schedule", "s"), ("p", "p", "{:d}"), ("m", "m", "{:d}"),
            ("formula", "formula", "{:.3f}"), ("planned", "planned", "{:.3f}"),
            ("measured", "measured", "{:.3f}"), ("error", "error", "{:+.3f}")],
            title=f"bubble: sleeping stages ({args.sleep_ms:g} ms per F, B and W of a whole stage), "
                  f"load {os.getloadavg()[0]:.1f}"))
        worst = max(abs(r["error"]) for r in rows)
        ok &= worst <= BUBBLE_TOLERANCE
        lines.append(f"# worst |measured - formula| = {worst:.3f}: "
                     f"{'meets' if worst <= BUBBLE_TOLERANCE else 'MISSES'} the target <= {BUBBLE_TOLERANCE}\n")
    if "memory" in parts:
        rows = [r for p in memory_ps
                for rank_rows in workbench.launch(activation_memory, world_size=p, args=(schedules, 8), timeout=3600)
                for r in rank_rows]
        for r in rows:
            r["temporaries_share"] = r["temporaries_bytes"] / r["count_bytes"]
        results["memory"] = rows
        lines.append(measuring.format_table(rows, [
            ("schedule", "schedule", "s"), ("p", "p", "{:d}"), ("rank", "rank", "{:d}"),
            ("stages", "stages", "s"), ("live", "in flight", "s"), ("count_bytes", "count B", "{:.0f}"),
            ("live_activation_bytes", "live act B", "{:d}"), ("ratio", "live / count", "{:.3f}"),
            ("temporaries_share", "+ bwd temp", "{:.3f}"), ("bytes_sent", "sent B", "{:d}"),
            ("bytes_expected", "2m x act B", "{:d}")],
            title="activation memory and boundary bytes: GPT tiny (8 blocks), m = 8; count = micro-batches "
                  "in flight x M_B (+ pending W's x M_W), measured alone"))
        bytes_ok = all(r["bytes_sent"] == r["bytes_expected"] for r in rows)
        mem_ok = all(1.0 <= r["ratio"] <= 1.10 for r in rows)
        ok &= bytes_ok and mem_ok
        lines.append(f"# bytes: {'exact' if bytes_ok else 'MISMATCH'}; live activations / count: "
                     f"{min(r['ratio'] for r in rows):.3f}-{max(r['ratio'] for r in rows):.3f}, "
                     f"{'within' if mem_ok else 'OUTSIDE'} 1.00-1.10\n")
    results["load_after"] = os.getloadavg()
    print("\n".join(lines))
    measuring.save_outputs(args, "pipeline", {"results": results, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(results)))
    return 0 if ok else 1


def plot(results: dict):
    """Left: ours / torch step time. Middle: measured bubbles on the formula curves. Right:
    activation memory per rank over the plan's count."""
    import matplotlib.pyplot as plt

    n_mem = len(results.get("memory", []))
    fig, axes = plt.subplots(1, 3, figsize=(17, max(4.5, 0.16 * n_mem + 1)), layout="constrained")
    ax = axes[0]
    rows = [r for r in results.get("time", {}).get("rows", []) if "ratio" in r]
    if rows:
        labels = [f"{r['schedule']} m={r['m']}" for r in rows]
        ax.barh(labels[::-1], [r["ratio"] for r in rows][::-1], color="#4c72b0")
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(TARGET_RATIO, color="#c44e52", ls="--", lw=0.8, label=f"target {TARGET_RATIO:.2f}x")
        ax.legend(fontsize=8)
    ax.set_xlabel("step time / torch.distributed.pipelining's")
    ax.set_title("GPT small, 2 ranks")
    ax = axes[1]
    colors = dict(zip(SCHEDULES, plt.rcParams["axes.prop_cycle"].by_key()["color"]))
    bubble = results.get("bubble", [])
    for (name, p) in sorted({(r["schedule"], r["p"]) for r in bubble}):
        pts = sorted((r["m"], r["measured"]) for r in bubble if r["schedule"] == name and r["p"] == p)
        ms = list(range(min(m for m, _ in pts), max(m for m, _ in pts) + 1))
        ax.plot(ms, [plans.bubble_formula(name, p, m) for m in ms], color=colors[name], lw=0.8,
                ls=["-", "--", ":"][[2, 4, 8].index(p)] if p in (2, 4, 8) else "-")
        ax.plot([m for m, _ in pts], [b for _, b in pts], "o", color=colors[name], ms=4,
                label=f"{name} p={p}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("micro-batches m")
    ax.set_ylabel("idle fraction")
    ax.set_title("bubble: measured (dots) on the formulas (lines)")
    if bubble:
        ax.legend(fontsize=6, ncol=3)
    plot_memory(results.get("memory", []), axes[2])
    return fig


def plot_memory(rows: list[dict], ax=None):
    """Live activation MiB per rank (bars) against the schedule's count (hatched outline), one
    group per schedule and p; the backward's temporaries stacked light on top."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(7, 0.22 * max(len(rows), 4) + 1), layout="constrained")
    labels = [f"{r['schedule']} p={r['p']} rank {r['rank']}" for r in rows][::-1]
    live = [r["live_activation_bytes"] / 2**20 for r in rows][::-1]
    temp = [r["temporaries_bytes"] / 2**20 for r in rows][::-1]
    count = [r["count_bytes"] / 2**20 for r in rows][::-1]
    ax.barh(labels, live, color="#c44e52", label="live activations (measured)")
    ax.barh(labels, temp, left=live, color="#c44e52", alpha=0.25, label="+ one backward's temporaries")
    ax.barh(labels, count, fill=False, hatch="//", edgecolor="k", lw=0.5, label="count x one micro-batch")
    for y, r in enumerate(rows[::-1]):
        ax.text(r["live_activation_bytes"] / 2**20, y, f" x{r['ratio']:.3f}", va="center", fontsize=6)
    ax.tick_params(axis="y", labelsize=6)
    ax.set_xlabel("activation MiB (one step, m = 8)")
    ax.set_title("activation memory per rank: measured / count")
    ax.legend(fontsize=6, loc="lower right")
    return ax
