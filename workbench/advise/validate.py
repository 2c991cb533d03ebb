"""Prove the advisor by runs: predicted memory and step time beside what this machine measures.

``workbench advise --validate`` trains a sample of configurations of the mesh
(:func:`workbench.parallel.mesh.parallelize`: data x tensor x pipeline, ZeRO stage, schedule and
micro-batches, sequence parallelism) under :func:`workbench.launch` at world size 4, for several
*settings* (a GPT preset, a global batch, and a cluster: this machine as it is, or an emulated
2-node cluster whose inter-node link is at least 10x slower than the loopback), and prints each
configuration's prediction beside its measurement:

* **memory per rank** by category: model state (parameters, gradients, optimizer state:
  :func:`workbench.measure.metrics.model_state_bytes` after a step) and the peak of the step
  (:class:`workbench.measure.memory_meter.MemoryMeter`: activations, communication buffers, and as buffers the
  gradients alive at the peak beyond those kept after the step: ZeRO-1's reduced chunk), each rank against
  :func:`workbench.advise.memory_model.memory_by_rank` for its pipeline stage. Model state is compared
  exactly (Adam's 4-byte step counter per tensor it updates is measured beside it,
  ``step_counters``, and is part of the prediction); activations together with buffers, since
  the meter files what no code tags (ZeRO-3's gathered units, received messages) under
  activations;
* **step time**: the median over interleaved trials of the slowest rank's step, against
  :func:`workbench.advise.timing.step_time` on the machine measured in the same launch
  (:class:`workbench.advise.calibrate.Calibration`, one more candidate of the trials, so its
  probes see the same load as the runs);
* per setting, whether the configuration predicted fastest is the measured fastest, or within
  5% of it;
* for a pipeline, its schedule twice: as the timing model replays it and as the run measured it
  (the median trial's last step), for :func:`timeline_figure` to draw one above the other.

One launch per setting: every configuration of the setting is built once (same seed, so the
same model), warmed up, measured for memory, then timed in trials whose order rotates
(``workbench.measure.measuring.interleaved_trials``), the calibration probes last in each trial, so that the configuration
that follows them (and runs slower for it) changes from trial to trial.

The bar: memory within 3% (model state exactly, activations within 5%), step time within 15%,
the predicted best the measured best (or within 5%) in 9 of 10 settings. On a machine shared with
other work the timings drift with its load; the load average seen is printed with every setting
(runs: ``docs/benchmarks/2026-11-24-advisor-validation-2vcpu.md``).
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict, dataclass
import warnings

import torch
import torch.distributed as dist

import workbench
from workbench.measure import measuring, plots
from workbench.advise.calibrate import Calibration, _shape, cluster_from, load_average
from workbench.advise.memory_model import memory_by_rank
from workbench.advise.plan import MEMORY_CATEGORIES, Config
from workbench.advise.timing import step_time
from workbench.comm.topology import Topology
from workbench.measure.memory_meter import MemoryMeter
from workbench.measure.metrics import model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel.mesh import Mesh, parallelize

__all__ = ["Setting", "SETTINGS", "measure", "measure_memory", "validate", "validate_memory", "memory_summary",
           "memory_report", "summary", "report", "figure",
           "memory_errors", "timeline_figure", "add_arguments", "main", "DEFAULT_TOPOLOGY"]

WORLD = 4
# 2 nodes of 2 ranks; inside a node this machine's own loopback (not emulated), between nodes
# 1 ms and 50 MB/s: well above loopback's latency and below its bandwidth, as a network is
DEFAULT_TOPOLOGY = "ranks_per_node=2,inter=1ms@50MB/s"
SLOW_TOPOLOGY = "ranks_per_node=2,inter=2ms@20MB/s"
TIME_TOLERANCE = 0.15
MEMORY_TOLERANCE = 0.03
ACTIVATION_TOLERANCE = 0.05
BEST_TOLERANCE = 0.05


@dataclass(frozen=True)
class Setting:
    """A model, a global batch and a cluster (this machine, or an emulated topology), and the
    configurations to run on it."""

    model: str
    batch: int
    topology: str | None
    configs: tuple[Config, ...]
    name: str = ""

    def label(self) -> str:
        return self.name or f"{self.model} B={self.batch} {'2 nodes ' + self.topology if self.topology else '1 node'}"


def _c(dp=1, tp=1, pp=1, zero=0, schedule="1f1b", m=1, sp=False, recompute="none") -> Config:
    return Config(dp=dp, tp=tp, pp=pp, zero=zero, schedule=schedule, microbatches=m, sequence_parallel=sp,
                  recompute=recompute)


# the configurations tried; each setting runs a subset chosen so that the winner changes with the
# setting, and every lever the mesh runs appears: ZeRO 0-3, GPipe / 1F1B / ZB-H1, sequence
# parallelism, full recomputation
_FLAT = (_c(dp=4), _c(dp=2, tp=2), _c(tp=4), _c(dp=2, pp=2, m=2), _c(pp=4, m=4), _c(tp=2, pp=2, m=2, schedule="gpipe"),
         _c(dp=2, pp=2, m=4, schedule="zb-h1"))
_ZERO = (_c(dp=4, zero=1), _c(dp=4, zero=3), _c(dp=2, tp=2, zero=2, sp=True), _c(dp=2, pp=2, zero=1, m=4),
         _c(tp=2, pp=2, m=4, sp=True), _c(pp=2, dp=2, m=2, schedule="gpipe"), _c(dp=4, zero=1, recompute="full"))

SETTINGS: tuple[Setting, ...] = (
    Setting("tiny", 16, None, _FLAT),
    Setting("tiny", 16, DEFAULT_TOPOLOGY, _FLAT),
    Setting("tiny", 64, None, _ZERO),
    Setting("tiny", 64, DEFAULT_TOPOLOGY, _ZERO),
    Setting("small", 8, None, _FLAT),
    Setting("small", 8, DEFAULT_TOPOLOGY, _FLAT),
    Setting("small", 32, None, _ZERO),
    Setting("small", 32, DEFAULT_TOPOLOGY, _ZERO),
    Setting("tiny", 32, SLOW_TOPOLOGY, _FLAT),
    Setting("small", 16, SLOW_TOPOLOGY, _ZERO),
)


# ============================================================================= inside the ranks

def _build(config, c: Config):
    torch.manual_seed(0)
    return parallelize(GPT(config), Mesh(dp=c.dp, tp=c.tp, pp=c.pp), zero_stage=c.zero, schedule=c.schedule,
                       n_microbatches=c.microbatches if c.pp > 1 else None, sequence_parallel=c.sequence_parallel,
                       recompute=c.recompute, recompute_layers=c.recompute_layers or None, lr=1e-3)


def _memory(trained, x, y) -> dict[str, int]:
    """This rank's bytes by category for one step: model state after it (exact), the step's peak
    split by the meter (activations, communication buffers)."""
    with MemoryMeter(trained.module, trained.optimizer) as meter:
        trained.step(x, y)
    state = model_state_bytes(trained.module, trained.optimizer)
    peak = meter.peak_by_category
    counters = sum(s["step"].numel() * s["step"].element_size() for s in _optimizer_states(trained.optimizer)
                   if isinstance(s.get("step"), torch.Tensor))
    # gradients alive at the peak beyond those kept after the step are temporaries (ZeRO-1's reduced
    # chunk, the ``.grad`` of its flat shard during the step): buffers
    excess = max(0, peak.get("grads", 0) - state["grads"])
    return {"parameters": state["params"], "gradients": state["grads"], "optimizer": state["optimizer"],
            "activations": peak.get("activations", 0), "buffers": peak.get("comm", 0) + excess,
            "peak": meter.peak_bytes, "step_counters": counters}


def _optimizer_states(optimizer):
    """The per-tensor states of ``optimizer`` (the inner optimizer's for a sharded one)."""
    inner = getattr(optimizer, "optimizer", None) or getattr(optimizer, "_optimizer", None)
    states = list(optimizer.state.values())
    if not states and inner is not None:
        states = list(inner.state.values())
    return states


def _run_setting(model: str, batch: int, configs: tuple[Config, ...], trials: int, steps: int, warmup: int,
                 calibrate: bool, rows: tuple[int, int], tp_shapes=()) -> dict:
    warnings.filterwarnings("ignore", message=".*cannot be held back.*")
    config = GPTConfig.preset(model)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(config.vocab_size, (batch, config.block_size), generator=gen)
    y = torch.randint(config.vocab_size, (batch, config.block_size), generator=gen)
    loads = [load_average()]
    labels = [c.label() for c in configs]
    built = {}
    memory = {}
    for label, c in zip(labels, configs):
        built[label] = _build(config, c)
        for _ in range(warmup):
            built[label].step(x, y)
        memory[label] = _memory(built[label], x, y)
    cal = Calibration(config, rows, tp_shapes=tp_shapes) if calibrate else None
    timelines: dict[str, list] = {label: [] for label in labels if built[label].schedule is not None}

    def one(name: str) -> float:
        if name == "calibration":
            cal.once()
            return 0.0
        trained = built[name]
        seconds = measuring.max_over_ranks(measuring.timed(lambda: trained.step(x, y), steps))
        if name in timelines:   # the trial's last step, as this rank's pipeline measured it
            timelines[name].append(list(trained.schedule.timeline))
        return seconds

    # each trial: the configurations in rotating order, then the calibration. What runs right after the
    # calibration's seconds of probes is slower (figures: docs/benchmarks/2026-11-27-figures-from-the-
    # code-2vcpu.md); rotated with the configurations, the same one could follow it in most trials: here
    # a different one follows it in each trial, and no median takes that twice
    after = ["calibration"] if calibrate else []
    samples = measuring.interleaved_trials(labels, trials, one, after=after) if trials \
        else {k: [] for k in labels + after}
    loads.append(load_average())
    # every rank's memory, on every rank
    rows_mem = {}
    for label in labels:
        keys = (*MEMORY_CATEGORIES, "peak", "step_counters")
        mine = torch.tensor([float(memory[label][k]) for k in keys], dtype=torch.float64)
        everyone = [torch.zeros_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        rows_mem[label] = {k: [float(t[i]) for t in everyone] for i, k in enumerate(keys)}
    return {"time": {label: measuring.median(samples[label]) for label in labels},
            "samples": {label: samples[label] for label in labels}, "timelines": timelines, "memory": rows_mem,
            "calibration": cal.result() if cal is not None else None, "load": loads}


def _launch(setting: Setting, trials: int, steps: int, warmup: int, calibrate: bool = True,
            world_size: int = WORLD) -> dict:
    rows = _calibration_rows(setting)
    topo = Topology.parse(setting.topology) if setting.topology else None
    out = workbench.launch(_run_setting, world_size=world_size, topology=topo, timeout=900,
                           args=(setting.model, setting.batch, setting.configs, trials, steps, warmup, calibrate,
                                 rows, _calibration_tp_shapes(setting)))[0]
    out["rows"] = rows
    return out


def _calibration_rows(setting: Setting) -> tuple[int, ...]:
    """The block's line is timed at one row and at every micro-batch size of the setting."""
    sizes = {setting.batch // c.dp // max(1, c.microbatches) for c in setting.configs}
    return tuple(sorted({1, max(2, max(sizes))} | sizes))


def _calibration_tp_shapes(setting: Setting) -> tuple[tuple[int, int, bool], ...]:
    """The tensor-parallel layers are timed at each (micro-batch rows, tp, sequence parallel) of the setting."""
    return tuple(sorted({(setting.batch // c.dp // max(1, c.microbatches), c.tp, c.sequence_parallel)
                         for c in setting.configs if c.tp > 1}))


# ============================================================================= the parent

def measure(model: str, config: Config, global_batch: int, *, topology: str | None = None, steps: int = 2,
            trials: int = 3, warmup: int = 2) -> dict:
    """Run ``config`` on its ``dp x tp x pp`` ranks (under ``topology``'s emulated links, if given)
    and return ``{"memory": {category: [bytes per rank]}, "time": seconds per step (median over
    trials, slowest rank), "load": [load average before, after]}``."""
    _check_config(config, world_size=config.devices)
    setting = Setting(model, global_batch, topology, (config,))
    out = _launch(setting, trials, steps, warmup, calibrate=False, world_size=config.devices)
    label = config.label()
    return {"memory": out["memory"][label], "time": out["time"][label], "load": out["load"]}


def measure_memory(model: str, configs, global_batch: int, *, world_size: int = WORLD, warmup: int = 2,
                   topology: str | None = None) -> dict:
    """Bytes by category per rank of each configuration (``{label: {category: [per rank]}}``), all
    run in one launch of ``world_size`` ranks (under ``topology``'s emulated links, if given: the
    collectives that cross a slowed link run a hand-written algorithm, whose buffers count), no
    timing (what the tests pin)."""
    configs = tuple(configs)
    for c in configs:
        _check_config(c, world_size=world_size)
    setting = Setting(model, global_batch, topology, configs)
    return _launch(setting, 0, 1, warmup, calibrate=False, world_size=world_size)["memory"]


def _check_config(c: Config, world_size: int = WORLD) -> None:
    if not isinstance(c, Config):
        raise ValueError(f"config={c!r}: pass a workbench.advise.Config")
    if c.devices != world_size:
        raise ValueError(f"config {c.label()}: dp x tp x pp = {c.devices}, but validation runs {world_size} ranks; "
                         f"choose sizes whose product is {world_size}")
    if c.devices > 8:
        raise ValueError(f"config {c.label()}: {c.devices} ranks is more than this machine runs (at most 8)")
    if c.precision != "fp32":
        raise ValueError(f"config {c.label()}: the mesh runs float32; validate with precision='fp32'")
    if c.schedule not in ("gpipe", "1f1b", "zb-h1") and c.pp > 1:
        raise ValueError(f"config {c.label()}: the mesh runs schedule 'gpipe', '1f1b' or 'zb-h1', not {c.schedule!r}")
    if c.schedule == "zb-h1" and c.pp > 1 and c.recompute != "none":
        raise ValueError(f"config {c.label()}: the mesh runs zb-h1 without recomputation")


def _predict_memory(shape, c: Config, batch: int) -> list[dict] | None:
    """Predicted bytes by category for each of the 4 ranks (a rank's pipeline stage decides)."""
    stages = memory_by_rank(shape, c, batch)
    return [stages[r // (c.dp * c.tp)] for r in range(c.devices)]


def _median_trial(timelines: list, samples: list[float]) -> list[dict]:
    """The measured pipeline timeline of the trial whose time is the median (the one reported)."""
    if not timelines:
        return []
    order = sorted(range(len(timelines)), key=lambda k: samples[k] if k < len(samples) else math.inf)
    return timelines[order[(len(order) - 1) // 2]]


def _worst(values: list[float]) -> float:
    return max(values) if values else float("nan")


def _checked(settings) -> tuple:
    """The settings to run (None: all of :data:`SETTINGS`), every configuration checked before any
    rank starts."""
    settings = SETTINGS if settings is None else tuple(settings)
    for s in settings:
        for c in s.configs:
            _check_config(c)
    return settings


def validate(settings=None, *, trials: int = 5, steps: int = 2, warmup: int = 2, progress=print) -> list[dict]:
    """Run every setting (default :data:`SETTINGS`) and return one row per configuration: the
    prediction, the measurement, their errors, and per setting whether the predicted best is the
    measured best (within 5%). ``progress``: called with a line per setting (None: quiet)."""
    settings = _checked(settings)
    rows = []
    for k, setting in enumerate(settings):
        start = time.time()
        out = _launch(setting, trials, steps, warmup)
        topo = Topology.parse(setting.topology) if setting.topology else None
        load = sum(out["load"]) / len(out["load"])
        cluster = cluster_from(out["calibration"], setting.model, out["rows"], WORLD, topo, load=load)
        shape = _shape(GPTConfig.preset(setting.model))
        these = []
        for c in setting.configs:
            label = c.label()
            replay: list = []
            predicted = step_time(shape, cluster, c, setting.batch, trace=replay)
            measured = out["time"][label]
            mem = out["memory"][label]
            row = {"setting": k, "setting_label": setting.label(), "model": setting.model, "batch": setting.batch,
                   "topology": setting.topology, "config": label, "config_fields": asdict(c),
                   "predicted_s": predicted["total"], "predicted_parts": predicted, "measured_s": measured,
                   "time_error": predicted["total"] / measured - 1, "samples_s": out["samples"][label],
                   "memory_measured": mem, "load": load,
                   # the probes' medians and row counts: the prediction can be made again from the JSON
                   # (calibrate.cluster_from), e.g. after a change to the timing model
                   "probes": out["calibration"], "probe_rows": list(out["rows"])}
            if label in out.get("timelines", {}):
                row["timeline_predicted"] = replay
                row["timeline_measured"] = _median_trial(out["timelines"][label], out["samples"][label])
            pm = _predict_memory(shape, c, setting.batch)
            if pm is not None:
                row["memory_predicted"] = pm
                row["memory_error"] = memory_errors(pm, mem)
            these.append(row)
        best_pred = min(these, key=lambda r: r["predicted_s"])
        best_meas = min(these, key=lambda r: r["measured_s"])
        ok = best_pred["measured_s"] <= (1 + BEST_TOLERANCE) * best_meas["measured_s"]
        for r in these:
            r.update(best_predicted=best_pred["config"], best_measured=best_meas["config"], best_ok=ok,
                     calibration={k2: getattr(cluster, k2) for k2 in ("fp32_flops", "flops", "cores", "sync_s", "layer_overhead_s",
                                                                     "microbatch_overhead_s", "step_overhead_s",
                                                                     "update_s_per_param", "activation_s_per_byte",
                                                                     "message_cpu", "collective_cpu")})
        rows += these
        if progress is not None:
            progress(report(these, title=f"setting {k + 1}/{len(settings)}: {setting.label()}, load average "
                                         f"{load:.2f}, {time.time() - start:.0f} s"))
    return rows


def memory_errors(predicted: list[dict], measured: dict[str, list[float]]) -> dict[str, float]:
    """Relative errors, predicted / measured - 1, each the worst over the ranks (largest in size):
    per category, model state (parameters + gradients + optimizer) and the total."""
    def err(p: float, m: float) -> float:
        return (p / m - 1) if m else (0.0 if not p else math.inf)

    out = {}
    ranks = range(len(predicted))
    state = ("parameters", "gradients", "optimizer")
    for cat in MEMORY_CATEGORIES:
        out[cat] = max((err(predicted[r][cat], measured[cat][r]) for r in ranks), key=abs)
    out["model_state"] = max((err(sum(predicted[r][c] for c in state), sum(measured[c][r] for c in state))
                              for r in ranks), key=abs)
    # MemoryMeter files what no code tags (ZeRO-3's gathered units, received messages) under
    # activations: the two transient categories together compare like with like
    out["activations+buffers"] = max((err(predicted[r]["activations"] + predicted[r]["buffers"],
                                          measured["activations"][r] + measured["buffers"][r]) for r in ranks), key=abs)
    out["total"] = max((err(sum(predicted[r][c] for c in MEMORY_CATEGORIES),
                            sum(measured[c][r] for c in MEMORY_CATEGORIES)) for r in ranks), key=abs)
    return out


def summary(rows: list[dict]) -> dict:
    """The issue's figures over ``rows``."""
    n = len(rows)
    within = sum(abs(r["time_error"]) <= TIME_TOLERANCE for r in rows)
    mape = sum(abs(r["time_error"]) for r in rows) / n if n else math.nan
    settings = {}
    for r in rows:
        settings[r["setting"]] = r["best_ok"]
    out = {"configurations": n, "time_within_15": within, "time_mape": mape,
           "settings": len(settings), "best_ok": sum(settings.values()),
           "load": sum(r["load"] for r in rows) / n if n else math.nan}
    out.update(memory_summary(rows))
    return out


def memory_summary(rows: list[dict]) -> dict:
    """The issue's memory figures over the ``rows`` that have a prediction: ``memory_rows``,
    ``model_state_exact``, ``activations_within_5`` (activations with buffers), ``total_within_3``."""
    mem = [r for r in rows if "memory_error" in r]
    if not mem:
        return {}
    return {"memory_rows": len(mem),
            "model_state_exact": sum(abs(r["memory_error"]["model_state"]) < 1e-9 for r in mem),
            "activations_within_5": sum(abs(r["memory_error"]["activations+buffers"]) <= ACTIVATION_TOLERANCE
                                        for r in mem),
            "total_within_3": sum(abs(r["memory_error"]["total"]) <= MEMORY_TOLERANCE for r in mem)}


def validate_memory(settings=None, *, warmup: int = 2, progress=print) -> list[dict]:
    """Memory only, no timing: every setting's configurations measured in one launch each
    (:func:`measure_memory` under the setting's topology; byte counts, so the machine's load
    does not change them) and one row per configuration with the prediction and its errors, as
    :func:`validate` gives them."""
    settings = _checked(settings)
    rows = []
    for k, setting in enumerate(settings):
        start = time.time()
        measured = measure_memory(setting.model, setting.configs, setting.batch, warmup=warmup,
                                  topology=setting.topology)
        shape = _shape(GPTConfig.preset(setting.model))
        these = []
        for c in setting.configs:
            mem = measured[c.label()]
            pm = _predict_memory(shape, c, setting.batch)
            these.append({"setting": k, "setting_label": setting.label(), "model": setting.model,
                          "batch": setting.batch, "topology": setting.topology, "config": c.label(),
                          "config_fields": asdict(c), "memory_measured": mem, "memory_predicted": pm,
                          "memory_error": memory_errors(pm, mem)})
        rows += these
        if progress is not None:
            progress(memory_report(these, title=f"setting {k + 1}/{len(settings)}: {setting.label()}, "
                                                f"{time.time() - start:.0f} s"))
    return rows


def memory_report(rows: list[dict], title: str = "") -> str:
    """Predicted beside measured memory per configuration: the worst rank's total (MiB) and the
    errors by category (``predicted / measured - 1``, the worst rank's)."""
    table = []
    for r in rows:
        mem, err = r["memory_measured"], r["memory_error"]
        ranks = range(len(mem["parameters"]))
        table.append({"config": r["config"],
                      "pred": max(sum(p[c] for c in MEMORY_CATEGORIES) for p in r["memory_predicted"]) / 2**20,
                      "meas": max(sum(mem[c][k] for c in MEMORY_CATEGORIES) for k in ranks) / 2**20,
                      "act": max(mem["activations"][k] + mem["buffers"][k] for k in ranks) / 2**20,
                      "state_err": 100 * err["model_state"], "act_err": 100 * err["activations+buffers"],
                      "total_err": 100 * err["total"]})
    return measuring.format_table(table, [
        ("config", "configuration", "s"), ("pred", "pred MiB", "{:.2f}"), ("meas", "meas MiB", "{:.2f}"),
        ("act", "meas act+buf MiB", "{:.2f}"), ("state_err", "state err %", "{:+.2f}"),
        ("act_err", "act+buf err %", "{:+.2f}"), ("total_err", "total err %", "{:+.2f}")], title=title)


def report(rows: list[dict], title: str = "") -> str:
    table = []
    for r in rows:
        p = r["predicted_parts"]
        line = {"config": r["config"], "pred": r["predicted_s"] * 1e3, "meas": r["measured_s"] * 1e3,
                "err": 100 * r["time_error"], "compute": p["compute"] * 1e3, "tp": p["tp"] * 1e3, "dp": p["dp"] * 1e3,
                "pp": p["pp"] * 1e3, "bubble": p["bubble"] * 1e3,
                "mem": max(sum(r["memory_measured"][c][k] for c in MEMORY_CATEGORIES)
                           for k in range(len(r["memory_measured"]["parameters"]))) / 2**20}
        if "memory_error" in r:
            line["mem_pred"] = max(sum(p[c] for c in MEMORY_CATEGORIES) for p in r["memory_predicted"]) / 2**20
            line["state_err"] = 100 * r["memory_error"]["model_state"]
            line["act_err"] = 100 * r["memory_error"]["activations+buffers"]
        table.append(line)
    text = measuring.format_table(table, [
        ("config", "configuration", "s"), ("pred", "pred ms", "{:.1f}"), ("meas", "meas ms", "{:.1f}"),
        ("err", "err %", "{:+.0f}"), ("compute", "compute", "{:.1f}"), ("tp", "tp", "{:.1f}"), ("dp", "dp", "{:.1f}"),
        ("pp", "pp", "{:.1f}"), ("bubble", "bubble", "{:.1f}"), ("mem_pred", "pred MiB", "{:.2f}"),
        ("mem", "meas MiB", "{:.2f}"), ("state_err", "state err %", "{:+.2f}"), ("act_err", "act+buf err %", "{:+.1f}")],
        title=title)
    if rows:
        r = rows[0]
        text += (f"\n# predicted best {r['best_predicted']}, measured best {r['best_measured']}: "
                 f"{'OK' if r['best_ok'] else 'MISS'}")
    return text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of ``workbench advise --validate`` (prefixed, beside the advisor's own)."""
    parser.add_argument("--validate-settings", type=int, default=None, metavar="N",
                        help=f"run the first N of the {len(SETTINGS)} settings (default all)")
    parser.add_argument("--validate-select", default=None, metavar="K,K,...",
                        help=f"run only these settings, numbered 1-{len(SETTINGS)} as printed (e.g. 3,4)")
    parser.add_argument("--validate-trials", type=int, default=5, metavar="T",
                        help="interleaved timing trials per configuration (default 5)")
    parser.add_argument("--validate-steps", type=int, default=2, metavar="S",
                        help="training steps per trial (default 2)")
    parser.add_argument("--validate-memory", action="store_true",
                        help="memory only: measure every configuration's bytes by category, no timing (~4 min)")
    parser.add_argument("--validate-json", default=None, metavar="FILE", help="write the rows as JSON")
    parser.add_argument("--validate-plot", default=None, metavar="FILE",
                        help="draw predicted against measured step time (png)")


def _print_memory(s: dict) -> None:
    n = s["memory_rows"]
    print(f"# memory: model state exact {s['model_state_exact']}/{n}, activations (+ buffers) within 5% "
          f"{s['activations_within_5']}/{n}, total within 3% {s['total_within_3']}/{n}")


def _save_json(path: str | None, rows: list[dict], s: dict) -> None:
    if path:
        with open(path, "w") as f:
            json.dump({"rows": rows, "summary": s}, f, indent=1, default=str)
        print(f"wrote {path}")


def _chosen(args: argparse.Namespace) -> tuple[tuple, int, int]:
    """The settings, trials and steps the ``--validate-*`` options ask for; ValueError naming the
    option where one is out of range."""
    n = getattr(args, "validate_settings", None)
    trials = getattr(args, "validate_trials", 5)
    steps = getattr(args, "validate_steps", 2)
    for name, value in (("--validate-trials", trials), ("--validate-steps", steps)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}={value!r} must be a whole number >= 1")
    if n is not None and not 1 <= n <= len(SETTINGS):
        raise ValueError(f"--validate-settings={n} must be between 1 and {len(SETTINGS)}")
    settings = SETTINGS[:n] if n else SETTINGS
    select = getattr(args, "validate_select", None)
    if select:
        try:
            picked = [int(k) for k in str(select).split(",")]
        except ValueError:
            picked = []
        if not picked or not all(1 <= k <= len(SETTINGS) for k in picked):
            raise ValueError(f"--validate-select={select!r}: give setting numbers between 1 and {len(SETTINGS)} "
                             "separated by commas, e.g. 3,4")
        settings = tuple(SETTINGS[k - 1] for k in picked)
    return settings, trials, steps


def main(args: argparse.Namespace) -> int:
    """``workbench advise --validate``: run, print, and return 0 if the issue's figures are met (2 for
    an option out of range, with one line naming it)."""
    try:
        settings, trials, steps = _chosen(args)
    except ValueError as e:
        print(f"workbench advise --validate: error: {e}", file=sys.stderr)
        return 2
    start = time.time()
    if getattr(args, "validate_memory", False):
        rows = validate_memory(settings)
        s = memory_summary(rows)
        k = s["memory_rows"]
        print(f"# {k} configurations in {len({r['setting'] for r in rows})} settings, {time.time() - start:.0f} s")
        _print_memory(s)
        _save_json(getattr(args, "validate_json", None), rows, s)
        return 0 if s["model_state_exact"] == s["total_within_3"] == s["activations_within_5"] == k else 1
    rows = validate(settings, trials=trials, steps=steps)
    s = summary(rows)
    print(f"# {s['configurations']} configurations in {s['settings']} settings, {time.time() - start:.0f} s, "
          f"mean load average {s['load']:.2f}")
    print(f"# step time within {TIME_TOLERANCE:.0%}: {s['time_within_15']}/{s['configurations']} "
          f"(mean absolute error {s['time_mape']:.1%})")
    print(f"# predicted best = measured best (within {BEST_TOLERANCE:.0%}): {s['best_ok']}/{s['settings']} settings")
    if "memory_rows" in s:
        _print_memory(s)
    _save_json(getattr(args, "validate_json", None), rows, s)
    plot_path = getattr(args, "validate_plot", None)
    if plot_path:
        figure(rows).savefig(plot_path, dpi=120)
        print(f"wrote {plot_path}")
    ok = s["time_within_15"] >= 0.9 * s["configurations"] and s["best_ok"] >= 0.9 * s["settings"]
    return 0 if ok else 1


def timeline_figure(row: dict, axes=None):
    """A pipeline configuration's step as the timing model replayed it (``timeline_predicted``:
    :func:`workbench.advise.timing.step_time`'s ``trace``) above the same step as the run measured
    it (``timeline_measured``: the first pipeline's ``schedule.timeline`` in the trial whose time
    was the median), one row per pipeline rank, on one time axis in ms. The schedule only: the
    step's line-up before it and its gradient reduction and optimizer after it are not drawn."""
    import matplotlib.pyplot as plt

    if not row.get("timeline_measured") or not row.get("timeline_predicted"):
        raise ValueError(f"timeline_figure: row {row.get('config')!r} has no pipeline timelines (a configuration "
                         "with pp > 1, from validate() since timelines are recorded)")
    if axes is None:
        _, axes = plt.subplots(2, 1, figsize=(10, 4.2), sharex=True, layout="constrained")
    measured = [r for r in row["timeline_measured"] if r["kind"] in ("F", "B", "W")]
    predicted = row["timeline_predicted"]

    def span(records):
        return (max(r["end"] for r in records) - min(r["start"] for r in records)) * 1e3

    label = f"{row['setting_label']}, {row['config']}"
    plots.pipeline_schedule(predicted, ax=axes[0], title=f"predicted (the timing model's replay): schedule "
                            f"{span(predicted):.1f} ms of a {row['predicted_s'] * 1e3:.1f} ms step -- {label}")
    plots.pipeline_schedule(measured, ax=axes[1], title=f"measured: schedule {span(measured):.1f} ms of a "
                            f"{row['measured_s'] * 1e3:.1f} ms step (median trial)")
    right = max(span(predicted), span(measured)) * 1.02
    for ax in axes:
        ax.set_xlim(0, right)
        ax.title.set_fontsize(9)
    return axes[0].figure


def figure(rows: list[dict], ax=None):
    """Predicted against measured step time, one point per configuration, the 15% band shaded."""
    import matplotlib.pyplot as plt

    if ax is None:
        _, ax = plt.subplots(figsize=(5.5, 5), layout="constrained")
    meas = [r["measured_s"] * 1e3 for r in rows]
    pred = [r["predicted_s"] * 1e3 for r in rows]
    lo, hi = min(meas + pred) * 0.8, max(meas + pred) * 1.2
    xs = [lo, hi]
    ax.fill_between(xs, [v * (1 - TIME_TOLERANCE) for v in xs], [v * (1 + TIME_TOLERANCE) for v in xs],
                    color="#dddddd", label="within 15%")
    ax.plot(xs, xs, color="k", lw=1)
    for topo, marker in ((None, "o"), ("2 nodes", "s")):
        sel = [r for r in rows if (r["topology"] is None) == (topo is None)]
        if sel:
            ax.scatter([r["measured_s"] * 1e3 for r in sel], [r["predicted_s"] * 1e3 for r in sel], marker=marker,
                       label="1 node" if topo is None else "2 emulated nodes")
    from matplotlib.ticker import FuncFormatter

    ax.set_xscale("log")
    ax.set_yscale("log")
    label = FuncFormatter(lambda v, _: f"{v:g}" if f"{v:g}"[0] in "125" else "")   # 10, 20, 50, 100, ...
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(label)
        axis.set_minor_formatter(label)
    ax.set_xlabel("measured ms per step")
    ax.set_ylabel("predicted ms per step")
    loads = [r["load"] for r in rows]
    ax.set_title(f"step time, {len(rows)} configurations (load average {min(loads):.1f}-{max(loads):.1f})",
                 fontsize=9)
    ax.legend(fontsize=8)
    return ax.figure
