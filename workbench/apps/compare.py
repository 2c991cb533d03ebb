"""``workbench compare``: train one model with every registered strategy and write one report.

    workbench compare [--model tiny|small|medium] [--world-size 2] [--steps N]
                      [--strategies single torch-ddp ...] [--out DIR]
                      [--precision fp32|bf16] [--recompute none|selective|full]

For each strategy the common loop (:func:`workbench.apps.train.train`) runs in fresh ranks started by
:func:`workbench.launch` -- one process for a non-distributed strategy, ``--world-size`` for the
others -- from the same seed-initialised model on the same global batches. The report
(``runs/<timestamp>/`` or ``--out``) holds:

* ``report.md``: one row per strategy -- world size, tokens/s (all ranks together), peak live
  memory of each rank on a steady-state step, final loss, and the largest difference from the
  ``single`` reference's loss over all steps (data parallel strategies should show ~1e-7: the
  same arithmetic in another order);
* ``throughput.png``, ``memory.png`` (stacked by category, per rank), ``loss.png``;
* ``results.json``: every number, for notebooks and tests.

Strategies come from :mod:`workbench.apps.strategies`, the one registry.
"""
from __future__ import annotations

import argparse
import datetime as _dt
import json
import math
import os
import sys
from dataclasses import asdict
from pathlib import Path

import workbench
from workbench import runtime
from workbench.measure import plots
from workbench.apps import strategies
from workbench.measure.memory_meter import format_bytes
from workbench.models import GPTConfig
from workbench.apps.train import TrainConfig, preload, summarize, train

__all__ = ["add_arguments", "main", "run", "format_table", "write_report"]

REFERENCE = "single"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = TrainConfig()
    parser.add_argument("--model", default=d.model, choices=sorted(GPTConfig.PRESETS),
                        help=f"GPT preset to train (default: {d.model})")
    parser.add_argument("--world-size", type=int, default=2,
                        help="ranks for the distributed strategies (default: 2)")
    parser.add_argument("--steps", type=int, default=d.steps, help=f"training steps (default: {d.steps})")
    parser.add_argument("--batch-size", type=int, default=d.batch_size,
                        help=f"global batch size, a multiple of the world size (default: {d.batch_size})")
    parser.add_argument("--lr", type=float, default=d.lr, help=f"AdamW learning rate (default: {d.lr})")
    parser.add_argument("--seed", type=int, default=d.seed, help=f"seed of the weights and batches (default: {d.seed})")
    parser.add_argument("--strategies", nargs="+", default=None, metavar="NAME",
                        help="strategies to run, space- or comma-separated (default: every registered one "
                             "except those registered with default=False, such as 3d)")
    parser.add_argument("--out", default=None, help="report directory (default: runs/<timestamp>)")
    parser.add_argument("--precision", default=d.precision, choices=["fp32", "bf16"],
                        help="fp32, or bf16: MixedPrecision(param_dtype=bfloat16) for every strategy, float32 "
                             f"master weights (default: {d.precision})")
    parser.add_argument("--recompute", default=d.recompute, choices=["none", "selective", "full"],
                        help=f"activation recomputation for every strategy (default: {d.recompute})")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds allowed per strategy (default: 600)")
    parser.add_argument("--device", default=None, choices=["cpu", "cuda"],
                        help="where the ranks compute (default: one GPU per rank over NCCL when there are "
                             "enough GPUs, else the CPU over gloo); cuda with fewer GPUs than ranks shares "
                             "them, over gloo")


def _selected(requested: list[str] | None) -> list[strategies.Strategy]:
    if not requested:
        return [s for s in strategies.all_strategies() if s.default]
    names = [n for item in requested for n in item.split(",") if n]
    chosen = [strategies.get(n) for n in names]  # ValueError listing the registered ones
    if len(set(names)) != len(names):
        raise ValueError(f"--strategies lists a strategy twice: {names}")
    return chosen


def run(config: TrainConfig, names: list[str] | None = None, world_size: int = 2, timeout: float = 600.0,
        log=print, device: str | None = None) -> list[dict]:
    """Train with each strategy and return one summary row each (see :func:`workbench.apps.train.summarize`).

    The reference ``single`` runs first when selected; the others' ``loss_diff`` is measured
    against it (None without it). ``device``: see ``workbench.launch``; ``"cuda"`` runs every
    strategy's ranks on this machine's GPUs, over NCCL where each rank has its own GPU, else over
    gloo (several ranks on one GPU).
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"--world-size {world_size!r} must be a whole number >= 1")
    chosen = _selected(names)
    config.check_world_size(world_size)
    runtime.check_device(device, runtime.default_backend(world_size) if device != "cpu" else "gloo")
    if config.precision != "fp32":
        device_type = device or ("cuda" if runtime.default_backend(world_size) == "nccl" else "cpu")
        tied = config.gpt_config().tie_weights
        why = {s.name: strategies.mixed_precision_refusal(s, device_type, tied) for s in chosen}
        unable = [s for s in chosen if why[s.name]]
        if unable and names:   # asked for by name: say why it cannot run
            raise ValueError(f"--precision {config.precision}: " + "; ".join(
                f"{s.name} cannot train in mixed precision on {device_type}: {why[s.name]}" for s in unable)
                + "; leave it out of --strategies")
        for s in unable:       # the default set: run the others, say which were left out
            log(f"skipping {s.name} on {device_type}: {why[s.name]}")
        chosen = [s for s in chosen if s not in unable]
    chosen.sort(key=lambda s: s.name != REFERENCE)  # stable: the reference first, the rest in order
    preload()  # imports and the tokenized corpus, inherited by every forked rank
    rows, reference = [], None
    for i, strategy in enumerate(chosen):
        n = strategy.ranks(world_size)
        config.check_world_size(n)
        log(f"[{i + 1}/{len(chosen)}] {strategy.name} on {n} rank(s): {strategy.description}")
        backend = None
        if device is not None:  # NCCL where every rank has its own GPU; else gloo, on the device asked for
            backend = "nccl" if device == "cuda" and runtime.default_backend(n) == "nccl" else "gloo"
        result = workbench.launch(train, world_size=n, args=(strategy.name, config), timeout=timeout,
                                  backend=backend, device=None if backend == "nccl" else device)
        row = summarize(list(result), reference)
        row["description"] = strategy.description
        if strategy.name == REFERENCE:
            reference = row["losses"]
        rows.append(row)
    return rows


def format_table(rows: list[dict]) -> str:
    """The report's Markdown table."""
    lines = ["| strategy | world size | tokens/s | peak memory per rank | final loss | max abs loss diff vs single |",
             "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        diff = "reference" if r["strategy"] == REFERENCE else ("n/a" if r["loss_diff"] is None else f"{r['loss_diff']:.2e}")
        tps = "n/a" if math.isnan(r["tokens_per_s"]) else f"{r['tokens_per_s']:,.0f}"
        memory = " / ".join(format_bytes(b) for b in r["peak_bytes"])
        lines.append(f"| {r['strategy']} | {r['world_size']} | {tps} | {memory} | {r['final_loss']:.6f} | {diff} |")
    return "\n".join(lines)


def write_report(rows: list[dict], out: Path, config: TrainConfig, world_size: int) -> Path:
    """Write ``report.md``, ``results.json`` and the figures into ``out``; return the report's path."""
    import matplotlib  # heavy, and its backend is chosen here: imported only to write a report

    if "matplotlib.pyplot" not in sys.modules:
        matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out.mkdir(parents=True, exist_ok=True)
    figures = {
        "throughput.png": plots.throughput(rows),
        "memory.png": plots.memory_breakdown(rows),
        "loss.png": plots.loss_curves({r["strategy"]: r["losses"] for r in rows}),
    }
    for name, fig in figures.items():
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
    params = rows[0]["parameters"] if rows else 0
    T = config.sequence_length
    text = [
        "# workbench compare",
        "",
        f"Model: GPT `{config.model}` ({params:,} parameters, context {T}); global batch {config.batch_size} x {T} "
        f"tokens; {config.steps} steps of AdamW (lr {config.lr}); seed {config.seed}; distributed strategies on "
        f"{world_size} ranks; precision {config.precision}, activation recomputation {config.recompute}. Throughput leaves out the first {config.warmup} steps and the memory-measuring "
        f"step {config.memory_step}; memory is the peak of live tensors during step {config.memory_step}.",
        "",
        format_table(rows),
        "",
        "## Strategies",
        "",
        *[f"- `{r['strategy']}`: {r.get('description', '')}" for r in rows],
        "",
        "## Figures",
        "",
        "![throughput](throughput.png)",
        "",
        "![memory](memory.png)",
        "",
        "![loss](loss.png)",
        "",
    ]
    path = out / "report.md"
    path.write_text("\n".join(text))
    (out / "results.json").write_text(json.dumps({"config": asdict(config), "world_size": world_size, "rows": rows},
                                                 indent=1, default=str))
    return path


def _default_out() -> Path:
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    out, k = Path("runs") / stamp, 1
    while out.exists():
        k += 1
        out = Path("runs") / f"{stamp}-{k}"
    return out


def main(args: argparse.Namespace) -> int:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    try:
        config = TrainConfig(model=args.model, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
                             seed=args.seed, precision=getattr(args, "precision", "fp32"),
                             recompute=getattr(args, "recompute", "none"))
        rows = run(config, args.strategies, args.world_size, timeout=args.timeout,
                   device=getattr(args, "device", None))
    except ValueError as e:
        print(f"workbench compare: error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else _default_out()
    path = write_report(rows, out, config, args.world_size)
    print()
    print(format_table(rows))
    print()
    print(f"report: {path}")
    return 0
