"""Tensor parallelism placed inside a node against across nodes: measured and predicted step times.

``workbench bench placement`` trains the GPT on a mesh ``dp=2 x tp=2`` (4 ranks) on an emulated
cluster of 2 nodes x 2 ranks (:class:`workbench.comm.Topology`), in two placements:

==========  ===========================  ================================  =========================
placement   ``Mesh(order=...)``          tp groups / dp groups             crosses the slow link
==========  ===========================  ================================  =========================
inside      ``("pp", "dp", "tp")``       {0,1} {2,3} / {0,2} {1,3}         DDP's gradient all-reduce
            (Megatron's, the default)
across      ``("pp", "tp", "dp")``       {0,2} {1,3} / {0,1} {2,3}         every TP activation
==========  ===========================  ================================  =========================

Tensor parallelism all-reduces ``b s h`` activations 4 times per layer (plus the embedding, the
head and the loss: :func:`workbench.parallel.tensor.communication_per_step`); data parallelism
all-reduces each rank's ``psi / tp`` gradients once per step (DDP's buckets). Which of the two
crosses the slow link decides the step time, and that is what the placement chooses.

The prediction, per placement: the step measured with no link slowed down (the same mesh, the
same ranks, launched without a topology: compute plus this machine's own message time), plus
what :mod:`workbench.comm.cost` predicts for every collective of the step on the emulated link
its group crosses (the TP collectives over ``tp``, DDP's buckets and the loss over ``dp``;
``algorithm="native"`` runs as the ring on a slowed link). Two biases, both making the
prediction too long, neither large where the slowed links dominate: the baseline already holds
this machine's own time for those messages (under emulation the bytes move at once and the
receiver sleeps until the link's time is due, so that time is replaced, not added), and the
model charges no overlap, where DDP's last bucket all-reduce waits only for the end of backward.
Results on one machine: ``docs/benchmarks/2026-11-23-collectives-and-placement-2vcpu.md``.

Timing: both placements built in one launch, interleaved trials of ``--steps`` training steps
each, median, the slowest rank's time. The report: each placement's measured and predicted
step time, the across / inside ratio measured against predicted, and the bytes each placement
moved per step over intra- and inter-node links (``comm.counters()``, summed over ranks).
"""
from __future__ import annotations

import argparse
import time
import warnings

import torch

import workbench
from workbench import comm
from workbench.measure import measuring
from workbench.comm import Topology, cost, emulation
from workbench.models import GPT, GPTConfig
from workbench.parallel.mesh import Mesh, parallelize
from workbench.parallel.tensor import communication_per_step

PLACEMENTS = {"inside": ("pp", "dp", "tp"), "across": ("pp", "tp", "dp")}
DEFAULT_TOPOLOGY = "ranks_per_node=2,intra=500us@200MB/s,inter=500us@20MB/s"
TOLERANCE = 0.15  # the figure: measured ratio within 15% of the predicted one


def group_topology(topology, ranks: list[int]):
    """The topology as a group of ``ranks`` sees it, renumbered 0..len-1: one node when they share
    one, one rank per node when each sits on its own (:meth:`workbench.comm.Topology.of_group`)."""
    return topology.of_group(ranks)


def step_collectives(config, batch: int, dp: int, bucket_bytes: list[int], *, element_size: int = 4) -> dict:
    """Every collective of one step of the ``dp x tp`` mesh (pp = 1), per group:
    ``{"tp": [(collective, nbytes), ...], "dp": [...]}``. TP: the model's collectives on this
    data-parallel rank's ``batch / dp`` rows; DP: DDP's buckets and the loss's one float."""
    b = batch // dp
    tp = [(c, n * element_size) for c, sizes in communication_per_step(b, config.block_size, config).items()
          for n in sizes]
    return {"tp": tp, "dp": [("all_reduce", int(n)) for n in bucket_bytes] + [("all_reduce", element_size)]}


def predict_communication(collectives: dict, groups: dict, topology, model=None) -> dict[str, float]:
    """Seconds the emulated links add to one step, per dimension: ``comm.cost.predict`` of each
    collective on its group's links. ``groups``: ``{"tp": ranks, "dp": ranks}`` (one group of
    each; the others are alike). ``model``: the machine's cost model; by default a free machine
    (``CostModel(0, 0, 0)``): its own time is in the measured step without slowed links."""
    model = model or cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0)
    out = {}
    for dim, calls in collectives.items():
        ranks = groups[dim]
        if len(ranks) == 1:
            out[dim] = 0.0
            continue
        topo = group_topology(topology, ranks)
        out[dim] = sum(cost.predict(c, "native", n, len(ranks), model, topology=topo) for c, n in calls)
    return out


def _build(order, config, seed: int = 0):
    mesh = Mesh(dp=2, tp=2, order=order)
    torch.manual_seed(seed)
    return parallelize(GPT(config), mesh, zero_stage=0, lr=1e-3)


def measure(preset: str, batch: int, trials: int, steps: int, warmup: int, topology=None) -> dict:
    """Inside a launch of 4 ranks: both placements, interleaved trials; per placement the median
    step time (slowest rank), the bytes per step by link class (summed over ranks), the groups
    and DDP's bucket sizes. Returns the same dict on every rank. ``topology``: the links to
    emulate while measuring (None: none slowed), whatever this process emulated before (under
    torchrun one process runs both launches); the previous state is restored afterwards."""
    previous = emulation.current()
    if previous != topology:
        emulation.emulate(topology)
    try:
        return _measure(preset, batch, trials, steps, warmup)
    finally:
        if emulation.current() != previous:
            emulation.emulate(previous)


def _measure(preset: str, batch: int, trials: int, steps: int, warmup: int) -> dict:
    # on slowed links 'native' collectives run as gloo's algorithm, hand-written: expected here
    warnings.filterwarnings("ignore", message=".*cannot be held back.*")
    config = GPTConfig.preset(preset)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(config.vocab_size, (batch, config.block_size), generator=gen)
    y = torch.randint(config.vocab_size, (batch, config.block_size), generator=gen)
    models = {name: _build(order, config) for name, order in PLACEMENTS.items()}
    losses = {}
    for name, trained in models.items():
        for _ in range(warmup):
            losses[name] = float(trained.step(x, y))

    def time_one(name):
        trained = models[name]
        return measuring.max_over_ranks(measuring.timed(lambda: trained.step(x, y), steps))

    samples = measuring.interleaved_trials(list(models), trials, time_one)
    out = {}
    for name, trained in models.items():
        with comm.counters() as c:
            trained.step(x, y)
        links = {cls: int(measuring.sum_over_ranks(s.bytes_sent)) for cls, s in c.by_link().items()}
        out[name] = {"step_s": measuring.median(samples[name]), "samples_s": samples[name], "bytes_by_link": links,
                     "first_loss": losses.get(name), "tp_group": trained.mesh.groups["tp"][0],
                     "dp_group": trained.mesh.groups["dp"][0],
                     "bucket_bytes": [int(b.nbytes) for b in trained.module.buckets]}
    return {"placements": out, "preset": preset, "batch": batch, "block_size": config.block_size,
            "parameters": sum(p.numel() for p in GPT(config).parameters())}


def run(preset: str = "tiny", batch: int = 16, topology: str = DEFAULT_TOPOLOGY, *, trials: int = 5,
        steps: int = 2, warmup: int = 1, launch_kwargs: dict | None = None) -> dict:
    """Measure both placements with the links slowed (``topology``) and without (the baseline),
    predict each step, and return ``{"rows": [...], "ratio_measured", "ratio_predicted", ...}``."""
    topo = Topology.parse(topology) if isinstance(topology, str) else topology
    if topo.ranks_per_node != 2:
        raise ValueError(f"topology={topology!r}: this benchmark lays out 2 nodes x 2 ranks; use ranks_per_node=2")
    for name, value in (("batch", batch), ("trials", trials), ("steps", steps), ("warmup", warmup)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"placement: {name}={value!r} must be a whole number >= 1")
    if batch % 2:
        raise ValueError(f"placement: batch={batch} must be even (dp = 2 ranks split it)")
    kw = dict(launch_kwargs or {})
    args = (preset, batch, trials, steps, warmup)
    base = workbench.launch(measure, world_size=4, args=args + (None,), **kw)[0]
    slow = workbench.launch(measure, world_size=4, args=args + (topo,), topology=topo, **kw)[0]
    config = GPTConfig.preset(preset)
    rows = []
    for name in PLACEMENTS:
        m = slow["placements"][name]
        calls = step_collectives(config, batch, 2, m["bucket_bytes"])
        comm_s = predict_communication(calls, {"tp": m["tp_group"], "dp": m["dp_group"]}, topo)
        baseline = base["placements"][name]["step_s"]
        rows.append({"placement": name, "tp_group": m["tp_group"], "dp_group": m["dp_group"],
                     "baseline_ms": baseline * 1e3, "tp_link_ms": comm_s["tp"] * 1e3, "dp_link_ms": comm_s["dp"] * 1e3,
                     "predicted_ms": (baseline + comm_s["tp"] + comm_s["dp"]) * 1e3, "measured_ms": m["step_s"] * 1e3,
                     "intra_MiB": m["bytes_by_link"].get("intra", 0) / 2**20,
                     "inter_MiB": m["bytes_by_link"].get("inter", 0) / 2**20,
                     "tp_MiB": sum(n for _, n in calls["tp"]) / 2**20, "bytes_by_link": m["bytes_by_link"],
                     "loss": m["first_loss"]})
    by = {r["placement"]: r for r in rows}
    measured = by["across"]["measured_ms"] / by["inside"]["measured_ms"]
    predicted = by["across"]["predicted_ms"] / by["inside"]["predicted_ms"]
    return {"rows": rows, "ratio_measured": measured, "ratio_predicted": predicted,
            "error": measured / predicted - 1, "topology": str(topo), "preset": preset, "batch": batch,
            "block_size": config.block_size, "parameters": slow["parameters"], "trials": trials, "steps": steps}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="GPT preset (default tiny: 4 layers, C=64, T=64)")
    parser.add_argument("--batch", type=int, default=16, help="global batch in sequences (default 16)")
    parser.add_argument("--topology", default=DEFAULT_TOPOLOGY,
                        help=f"the emulated cluster, 2 ranks per node (default {DEFAULT_TOPOLOGY!r})")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials per placement (default 5)")
    parser.add_argument("--steps", type=int, default=2, help="timed training steps per trial (default 2)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per placement first (default 1)")
    parser.add_argument("--out", default=None, help="folder for placement.json and .png (default runs/placement-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw placement.png")


def report(res: dict) -> str:
    title = (f"bench placement: GPT {res['preset']} ({res['parameters'] / 1e6:.2f} M parameters), mesh dp=2 x tp=2 "
             f"on {res['topology']}, global batch {res['batch']} x {res['block_size']} tokens, median of "
             f"{res['trials']} interleaved trials x {res['steps']} steps")
    table = measuring.format_table(res["rows"], [
        ("placement", "TP placed", "s"), ("baseline_ms", "no slow links ms", "{:.1f}"),
        ("tp_link_ms", "+TP ms", "{:.1f}"), ("dp_link_ms", "+DP ms", "{:.1f}"),
        ("predicted_ms", "predicted ms", "{:.1f}"), ("measured_ms", "measured ms", "{:.1f}"),
        ("intra_MiB", "intra MiB", "{:.2f}"), ("inter_MiB", "inter MiB", "{:.2f}")], title=title)
    ok = abs(res["error"]) <= TOLERANCE
    return (f"{table}\n# TP across / inside nodes: measured {res['ratio_measured']:.2f}x, predicted "
            f"{res['ratio_predicted']:.2f}x ({res['error']:+.0%}): {'within' if ok else 'OUTSIDE'} "
            f"{TOLERANCE:.0%}")


def main(args: argparse.Namespace) -> int:
    start = time.time()
    res = run(args.preset, args.batch, args.topology, trials=args.trials, steps=args.steps, warmup=args.warmup)
    print(report(res))
    measuring.save_outputs(args, "placement", {"results": res, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(res)))
    return 0 if abs(res["error"]) <= TOLERANCE else 1


def plot(res: dict):
    """Measured step time beside the prediction (its parts stacked), per placement."""
    import matplotlib.pyplot as plt

    rows = res["rows"]
    fig, ax = plt.subplots(figsize=(7, 4), layout="constrained")
    x = range(len(rows))
    base = [r["baseline_ms"] for r in rows]
    tp = [r["tp_link_ms"] for r in rows]
    dp = [r["dp_link_ms"] for r in rows]
    ax.bar([i - 0.2 for i in x], base, 0.4, color="#bbbbbb", label="measured, no slowed link")
    ax.bar([i - 0.2 for i in x], tp, 0.4, bottom=base, color="#4c72b0", label="+ TP collectives (model)")
    ax.bar([i - 0.2 for i in x], dp, 0.4, bottom=[a + b for a, b in zip(base, tp)], color="#55a868",
           label="+ DDP all-reduce (model)")
    ax.bar([i + 0.2 for i in x], [r["measured_ms"] for r in rows], 0.4, color="#c44e52", label="measured")
    ax.set_xticks(list(x), [f"TP {r['placement']} nodes\ntp {r['tp_group']}, dp {r['dp_group']}" for r in rows])
    ax.set_ylabel("ms per training step")
    ax.set_title(f"TP across / inside: measured {res['ratio_measured']:.2f}x, predicted {res['ratio_predicted']:.2f}x")
    ax.legend(fontsize=8)
    return fig
