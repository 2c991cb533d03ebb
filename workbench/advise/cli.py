"""``workbench advise``: the ranked table, the choice and why, as text, JSON and a figure.

::

    workbench advise --model small --cluster dgx-h100 --nodes 4 --batch 512
    workbench advise --model llama-70b --cluster a2-ultra-100g --nodes 16 --batch 1024 --precision bf16 \\
                     --json plans.json --plot plans.png
    workbench advise --model medium --layers 12 --hidden 768 ...      # a preset, changed
    workbench advise --cluster dgx-h100 --nodes 2 --inter 5us@12.5GB/s # a preset's links changed
    workbench advise --calibrate [--world-size 4 --topology SPEC]     # this machine, measured, as the cluster
    workbench advise --calibrate --device cuda --profile h100.json    # this GPU, measured into a profile
    workbench advise --profile h100.json --nodes 16 --model llama3-8b # advise with a measured profile
    workbench advise --validate [ARGS...]                             # run a sample here: predicted beside measured
    workbench advise --validate-published                             # public GPU runs: predicted beside published

``--calibrate`` measures this machine with :func:`workbench.advise.calibrate.calibrate` and advises
for it; ``--validate`` hands every argument after it to :func:`workbench.advise.validate.main`
(``workbench advise --validate --help`` lists them). ``--validate-published`` predicts every public
GPU measurement of :mod:`workbench.advise.published` and prints the table ``docs/advisor-evidence.md`` holds.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict

from workbench.comm.topology import Topology

from . import calibrate, published, validate
from .calibrate_cuda import calibrate_cuda
from .choose import advise
from .cluster import GiB, Cluster
from .cluster import PRESETS as CLUSTERS
from .figure import time_memory
from .framework import FRAMEWORKS
from .plan import MEMORY_CATEGORIES, TIME_PARTS, Plan
from .shape import ModelShape
from .shape import PRESETS as LLAMAS
from .space import PRECISIONS, SCHEDULES

__all__ = ["add_arguments", "main", "table", "build"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    m = parser.add_argument_group("model")
    m.add_argument("--model", default="small",
                   help=f"a preset: tiny, small, medium (our GPT) or {', '.join(LLAMAS)} (default small)")
    for name, what in (("layers", "layers"), ("hidden", "hidden size"), ("heads", "attention heads"),
                       ("kv-heads", "key/value heads (GQA)"), ("vocab", "vocabulary"), ("seq", "sequence length"),
                       ("ffn", "MLP units")):
        m.add_argument(f"--{name}", type=int, default=None, help=f"change the preset's {what}")
    c = parser.add_argument_group("cluster")
    c.add_argument("--cluster", default="dgx-h100", help=f"a preset: {', '.join(CLUSTERS)} (default dgx-h100)")
    c.add_argument("--nodes", type=int, default=None, help="nodes (default 1)")
    c.add_argument("--devices-per-node", type=int, default=None)
    c.add_argument("--memory-gib", type=float, default=None, help="device memory in GiB")
    c.add_argument("--tflops", type=float, default=None, help="achieved TFLOP/s per device (16-bit); compute "
                   "priced as FLOPs at this rate instead of the preset's device model")
    c.add_argument("--intra", default=None, help="link inside a node, LATENCY@BANDWIDTH, e.g. 2us@450GB/s")
    c.add_argument("--inter", default=None, help="link between nodes, e.g. 5us@50GB/s")
    c.add_argument("--framework", default=None, choices=sorted(FRAMEWORKS),
                   help="the training framework a GPU preset is priced for (default: the preset's; dgx-h100, dgx-h200: eager-fused, "
                        "the A100 presets: megatron-2022)")
    s = parser.add_argument_group("space")
    s.add_argument("--batch", type=int, default=512, help="global batch in sequences (default 512)")
    s.add_argument("--precision", nargs="+", default=None, choices=PRECISIONS, help="precisions to try (fp32 bf16)")
    s.add_argument("--zero", nargs="+", type=int, default=None, choices=(0, 1, 2, 3),
                   help="ZeRO stages to try (default: those the cluster's framework offers; all four on a cluster "
                        "without a framework)")
    s.add_argument("--schedule", nargs="+", default=None, choices=SCHEDULES,
                   help="pipeline schedules to try (default: those the cluster's framework runs; every one on a "
                        "cluster without a framework)")
    s.add_argument("--recompute", nargs="+", default=None, choices=("none", "selective", "full"))
    s.add_argument("--max-tp", type=int, default=None, help="largest tensor-parallel size to try")
    s.add_argument("--hybrid-sharding", action="store_true",
                   help="also try hybrid sharding (HSDP: ZeRO-3 inside a node or a few, replicated across them)")
    s.add_argument("--partial-recompute", action="store_true",
                   help="also try recomputing only the first layers of each stage, the fewest that fit, where "
                        "recomputing every layer fits and none does not")
    o = parser.add_argument_group("output")
    o.add_argument("--top", type=int, default=10, help="rows of the ranked table (default 10)")
    o.add_argument("--json", default=None, metavar="FILE", help="write every plan as JSON ('-': standard output)")
    o.add_argument("--plot", default=None, metavar="FILE", help="write the time-against-memory figure (PNG)")
    k = parser.add_argument_group("this machine")
    k.add_argument("--calibrate", action="store_true",
                   help="measure this machine (matmul rate, links) and advise for it instead of --cluster")
    k.add_argument("--world-size", type=int, default=4, help="ranks to calibrate with (default 4)")
    k.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                   help="what --calibrate measures: this machine's CPU ranks (default) or this node's GPU "
                        "(a device profile on --cluster's preset, written to --profile FILE)")
    k.add_argument("--profile", default=None, metavar="FILE",
                   help="a device profile (JSON): written by --calibrate --device cuda, else loaded as the cluster")
    k.add_argument("--topology", default=None, help="emulated topology spec to calibrate under, "
                                                    "e.g. 'ranks_per_node=2,inter=1ms@20MB/s'")
    k.add_argument("--validate", nargs=argparse.REMAINDER, default=None, metavar="ARGS",
                   help="run a sample of configurations on this machine, predicted beside measured; "
                        "the --validate-* options may come before or after it")
    k.add_argument("--validate-published", action="store_true",
                   help="predict every published GPU measurement (workbench/advise/published.py): predicted beside "
                        "published, the ratio and the source, as docs/advisor-evidence.md holds them")

    validate.add_arguments(parser.add_argument_group("validation (with --validate)"))


def _links(intra: str | None, inter: str | None, base: Cluster) -> dict:
    spec = f"ranks_per_node=1,intra={intra or base.intra},inter={inter or base.inter}"
    try:
        topo = Topology.parse(spec)
    except ValueError as e:
        raise ValueError(f"--intra/--inter: {e}") from None
    return {"intra": topo.intra, "inter": topo.inter}


def build(args: argparse.Namespace) -> tuple[ModelShape, Cluster]:
    """The model and the cluster the arguments describe (the cluster measured with ``--calibrate``)."""
    shape = ModelShape.coerce(args.model, "--model")
    changes = {f: getattr(args, f.replace("-", "_")) for f in ("layers", "hidden", "heads", "vocab", "seq", "ffn")}
    changes["kv_heads"] = args.kv_heads
    changes = {k: v for k, v in changes.items() if v is not None}
    if changes:
        shape = shape.with_(name=f"{shape.name}*", **changes)
    if args.calibrate and getattr(args, "device", "cpu") == "cuda":
        cluster = calibrate_cuda(base=args.cluster, path=args.profile)
    elif args.calibrate:
        topology = Topology.parse(args.topology) if args.topology else None
        cluster = calibrate.calibrate(world_size=args.world_size, topology=topology)
    elif getattr(args, "profile", None):
        cluster = Cluster.from_profile(args.profile)
    else:
        cluster = Cluster.preset(args.cluster)
    changes = {"nodes": args.nodes, "devices_per_node": args.devices_per_node,
               "memory_bytes": args.memory_gib * GiB if args.memory_gib is not None else None,
               "flops": args.tflops * 1e12 if args.tflops is not None else None}
    changes = {k: v for k, v in changes.items() if v is not None}
    if args.tflops is not None:   # one achieved rate for every multiply: the device model set aside
        changes["device"] = None
    if getattr(args, "framework", None):
        changes["framework"] = FRAMEWORKS[args.framework]
    if args.intra or args.inter:
        changes.update(_links(args.intra, args.inter, cluster))
    return shape, cluster.with_(**changes) if changes else cluster


def _space(args) -> dict:
    opts = {"precisions": args.precision, "zero": args.zero, "schedules": args.schedule,
            "recompute": args.recompute, "max_tp": args.max_tp, "hybrid": args.hybrid_sharding or None,
            "partial_recompute": args.partial_recompute or None}
    return {k: v for k, v in opts.items() if v is not None}


def _s(t: float) -> str:
    return f"{t:.3g}"


def table(plans: list[Plan], top: int = 10) -> str:
    """The ranked feasible plans as a text table: time by part (s) and memory by category (GiB, or
    MiB when every plan is under 1 GiB)."""
    shown = [p for p in plans if p.feasible][:top]
    unit, scale = ("GiB", GiB) if any(p.memory["total"] >= GiB for p in shown) else ("MiB", 2.0 ** 20)
    head = ["#", "configuration", "step s"] + list(TIME_PARTS) + [f"mem {unit}"] + \
        ["params", "grads", "optim", "activ", "buffers"]
    rows = []
    for k, p in enumerate(shown):
        rows.append([str(k + 1), p.config.label(), _s(p.time["total"])] + [_s(p.time[t]) for t in TIME_PARTS] +
                    [f"{p.memory['total'] / scale:.2f}"] + [f"{p.memory[c] / scale:.2f}" for c in MEMORY_CATEGORIES])
    widths = [max(len(r[i]) for r in [head] + rows) for i in range(len(head))]
    line = lambda r: "  ".join(c.rjust(w) if i != 1 else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths)))  # noqa: E731
    return "\n".join([line(head), line(["-" * w for w in widths])] + [line(r) for r in rows])


def _infeasible_summary(plans: list[Plan], show: int = 5) -> str:
    bad = [p for p in plans if not p.feasible]
    if not bad:
        return "Every configuration tried is feasible."
    lines = [f"{len(bad)} infeasible configurations, for example:"]
    seen = set()
    for p in bad:
        kind = "".join(ch for ch in p.reason if not ch.isdigit() and ch != ".")    # one example per rule
        if kind in seen:
            continue
        seen.add(kind)
        lines.append(f"  {p.config.label()}: {p.reason}")
        if len(lines) > show:
            break
    return "\n".join(lines)


def as_json(shape: ModelShape, cluster: Cluster, global_batch: int, plans: list[Plan]) -> dict:
    c = asdict(cluster)
    c["intra"], c["inter"] = str(cluster.intra), str(cluster.inter)
    chosen = plans[0] if plans and plans[0].feasible else None
    return {"model": asdict(shape), "parameters": shape.parameters(), "cluster": c, "global_batch": global_batch,
            "chosen": chosen.config.label() if chosen else None,
            "explanation": chosen.explain() if chosen else None,
            "plans": [p.as_dict() for p in plans]}


def main(args: argparse.Namespace) -> int:
    if getattr(args, "validate_published", False):
        return published.main()
    if args.validate is not None:
        vparser = argparse.ArgumentParser(prog="workbench advise --validate",
                                          description="run a sample of configurations here: predicted beside measured")
        validate.add_arguments(vparser)
        vparser.set_defaults(**vars(args))      # options given before --validate, then those after it
        return int(validate.main(vparser.parse_args(args.validate)) or 0)
    try:   # bad input: one line naming the argument, as argparse's own errors, not a traceback
        shape, cluster = build(args)
        plans = advise(shape, cluster, args.batch, **_space(args))
    except ValueError as e:
        print(f"workbench advise: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        doc = json.dumps(as_json(shape, cluster, args.batch, plans), indent=1)
        if args.json == "-":
            print(doc)
            return 0 if plans and plans[0].feasible else 1
        with open(args.json, "w") as f:
            f.write(doc)
    print(f"model   {shape.describe()}")
    print(f"cluster {cluster.describe()}")
    print(f"batch   {args.batch} sequences of {shape.seq} tokens per step\n")
    feasible = [p for p in plans if p.feasible]
    if feasible:
        print(table(plans, args.top))
        print()
        print(feasible[0].explain())
    else:
        print("No configuration fits: every one is infeasible.")
    print()
    print(_infeasible_summary(plans))
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(11, 5), layout="constrained")
        time_memory(plans, ax, memory_limit=cluster.memory_bytes,
                    title=f"{shape.name} on {cluster.nodes} x {cluster.devices_per_node} {cluster.name}, "
                          f"batch {args.batch}")
        fig.savefig(args.plot, dpi=110)
        print(f"\nfigure: {args.plot}")
    if args.json and args.json != "-":
        print(f"JSON: {args.json}")
    return 0 if feasible else 1


if __name__ == "__main__":   # python -m workbench.advise.cli
    p = argparse.ArgumentParser(prog="workbench advise")
    add_arguments(p)
    sys.exit(main(p.parse_args()))
