"""Our DistributedDataParallel against PyTorch's: step time, bucket sizes, overlap, algorithms.

``workbench bench ddp`` trains the same model with several data-parallel set-ups in one launch
and times whole training steps (forward, backward with its all-reduces, SGD step, zero_grad):

=================  ===========================================================================
candidate          what it is
=================  ===========================================================================
torch              ``torch.nn.parallel.DistributedDataParallel`` (defaults: 25 MB buckets)
ours               ``workbench.parallel.DistributedDataParallel`` (defaults: 25 MB, overlap)
ours-1MB ... 100MB bucket cap sweep (``bucket_cap_mb`` = 1, 5, 100; 25 is ``ours``)
ours-no-overlap    every bucket all-reduced after backward (``overlap=False``)
ours-per-param     one all-reduce per parameter (``bucket_cap_mb=0``)
ours-ring          the hand-written ring all-reduce of ``workbench.comm`` (``algorithm="ring"``)
ours-no-rebuild    ``ours`` keeping its first buckets (reverse parameter order) instead of
                   rebuilding them after the first step in the order gradients became ready
=================  ===========================================================================

on the ``MLP`` (8 x Linear(1024, 1024), batch 64 per rank) and the GPT ``small`` preset (batch 8
of 128 tokens per rank), world size 2. ``--models mlp-reversed`` adds the same MLP with its
layers *defined* in the reverse of the order they run in: reverse parameter order is then the
opposite of the order gradients become ready, the first bucket is ready last, and only the
bucket rebuild (compare ``ours`` with ``ours-no-rebuild``, column "hidden") restores overlap. Discipline (``workbench.measure.measuring``): candidates take
turns inside every trial in rotating order; a trial's number is the slowest rank's mean step
time; the report gives the median over trials and the ratio to ``torch`` measured in the same
run. Each candidate owns its own copy of the model and optimizer; since all of them see the same
data, ``ours`` must end with the same weights as ``torch`` (checked after the timed loop).

"hidden" is the share of all-reduce time that ran while backward was still computing (from the
per-bucket events our DDP records); on a CPU machine the gloo thread shares the rank's core
with backward, so overlapping saves less than on a GPU with its own communication engine.

The numbers are noisy when anything else uses the CPU: read the ratios, not the milliseconds,
and repeat with more ``--trials`` before trusting a difference of a few percent.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP
import torch.distributed as dist

import workbench
from workbench.measure import measuring
from workbench.models.data import synthetic_batch
from workbench.models import GPT, MLP, GPTConfig
from workbench.parallel import DistributedDataParallel

CANDIDATES = ("torch", "ours", "ours-1MB", "ours-5MB", "ours-100MB", "ours-no-overlap", "ours-per-param",
              "ours-ring", "ours-no-rebuild")
MODELS = ("mlp", "gpt", "mlp-reversed")
DEFAULT_MODELS = ("mlp", "gpt")
TARGET_RATIO = 1.10


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--models", default=",".join(DEFAULT_MODELS),
                        help="comma-separated: mlp, gpt, mlp-reversed (default: mlp,gpt)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated subset of {', '.join(CANDIDATES)} (torch is always included)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials per candidate (default 5)")
    parser.add_argument("--steps", type=int, default=4, help="timed training steps per trial (default 4)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate first (default 2)")
    parser.add_argument("--out", default=None, help="folder for ddp.json and ddp.png (default runs/ddp-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw ddp.png")


# ---------------------------------------------------------------------------------- in a rank

class _DefinedBackwards(nn.Module):
    """Linear layers defined in the reverse of the order forward calls them."""

    def __init__(self, width: int, depth: int):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(width, width) for _ in range(depth))

    def forward(self, x):
        for i, layer in enumerate(reversed(self.layers)):
            x = layer(x) if i == len(self.layers) - 1 else torch.relu(layer(x))
        return x


def _model_and_batch(name: str, rank: int):
    torch.manual_seed(0)
    if name == "mlp":
        model = MLP(width=1024, depth=8)
        x, y = synthetic_batch(64, features=1024, seed=rank)
        return model, (lambda m: nn.functional.mse_loss(m(x), y))
    if name == "mlp-reversed":
        model = _DefinedBackwards(1024, 8)
        x, y = synthetic_batch(64, features=1024, seed=rank)
        return model, (lambda m: nn.functional.mse_loss(m(x), y))
    config = GPTConfig.preset("small")
    model = GPT(config)
    x, y = synthetic_batch(8, block_size=config.block_size, seed=rank)
    return model, (lambda m: m(x, y)[1])


def _wrap(candidate: str, model: nn.Module):
    if candidate == "torch":
        return TorchDDP(model)
    options = {"ours": {}, "ours-1MB": {"bucket_cap_mb": 1}, "ours-5MB": {"bucket_cap_mb": 5},
               "ours-100MB": {"bucket_cap_mb": 100}, "ours-no-overlap": {"overlap": False},
               "ours-per-param": {"bucket_cap_mb": 0}, "ours-ring": {"algorithm": "ring"},
               "ours-no-rebuild": {}}[candidate]
    ddp = DistributedDataParallel(model, **options)
    if candidate == "ours-no-rebuild":
        ddp._rebuild_pending = False
    return ddp


def _run(models: list[str], candidates: list[str], trials: int, steps: int, warmup: int) -> dict:
    rank = dist.get_rank()
    out = {}
    for model_name in models:
        base, loss_fn = _model_and_batch(model_name, rank)
        wrapped = {c: _wrap(c, copy.deepcopy(base)) for c in candidates}
        optims = {c: torch.optim.SGD(m.parameters(), lr=1e-3) for c, m in wrapped.items()}

        def step(c):
            loss_fn(wrapped[c]).backward()
            optims[c].step()
            optims[c].zero_grad()

        for c in candidates:
            for _ in range(warmup):
                step(c)
            if c != "torch":
                wrapped[c].events.clear()

        def measure(c):
            seconds = measuring.timed(lambda: step(c), steps)
            return measuring.max_over_ranks(seconds)

        samples = measuring.interleaved_trials(candidates, trials, measure)
        # correctness outside the timed loop: same data, same steps -> same weights as torch's DDP
        diff = max((a - b).abs().max().item() for a, b in zip(wrapped["ours"].module.parameters(),
                                                               wrapped["torch"].module.parameters())) \
            if "ours" in wrapped else float("nan")
        rows = []
        for c in candidates:
            row = {"model": model_name, "candidate": c, "step_ms": 1e3 * measuring.median(samples[c]),
                   "samples_ms": [1e3 * s for s in samples[c]]}
            if c != "torch":
                ddp = wrapped[c]
                row["buckets"] = len(ddp.buckets)
                row["hidden"] = -measuring.max_over_ranks(-ddp.hidden_communication_fraction())  # min over ranks
            rows.append(row)
        torch_ms = rows[candidates.index("torch")]["step_ms"]
        for row in rows:
            row["ratio"] = row["step_ms"] / torch_ms
        params = sum(p.numel() for p in base.parameters())
        out[model_name] = {"rows": rows, "max_weight_diff_vs_torch": diff, "parameters": params}
        del wrapped, optims
    return out


# ----------------------------------------------------------------------------------- report

def main(args: argparse.Namespace) -> int:
    models = measuring.choices(args.models, MODELS, "models")
    candidates = measuring.choices(args.candidates, CANDIDATES, "candidates")
    if "torch" not in candidates:
        candidates.insert(0, "torch")
    for name in ("world_size", "trials", "steps"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    start = time.time()
    results = workbench.launch(_run, world_size=args.world_size,
                               args=(models, candidates, args.trials, args.steps, args.warmup),
                               timeout=3600)[0]
    lines, ok = [], True
    for model_name, res in results.items():
        title = (f"bench ddp: {model_name} ({res['parameters'] / 1e6:.2f} M parameters), world size "
                 f"{args.world_size}, median of {args.trials} interleaved trials x {args.steps} steps\n"
                 f"ours vs torch after training: max |weight difference| = {res['max_weight_diff_vs_torch']:.2g}")
        lines.append(measuring.format_table(res["rows"], [
            ("candidate", "candidate", "s"), ("step_ms", "step ms", "{:.1f}"), ("ratio", "x torch", "{:.3f}"),
            ("buckets", "buckets", "{:d}"), ("hidden", "hidden", "{:.0%}")], title=title))
        ours = next((r for r in res["rows"] if r["candidate"] == "ours"), None)
        if ours is not None:
            verdict = "meets" if ours["ratio"] <= TARGET_RATIO else "MISSES"
            ok &= ours["ratio"] <= TARGET_RATIO
            lines.append(f"# ours / torch = {ours['ratio']:.3f}: {verdict} the target <= {TARGET_RATIO:.2f} "
                         "(CPU timings are noisy while other processes run)")
        lines.append("")
    print("\n".join(lines))
    measuring.save_outputs(args, "ddp", {"results": results, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(results)))
    return 0 if ok else 1


def plot(results: dict):
    """Bars: step time of every candidate relative to torch's DDP, one panel per model."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(5.5 * len(results), 4), layout="constrained", squeeze=False)
    for ax, (model_name, res) in zip(axes[0], results.items()):
        rows = res["rows"]
        names = [r["candidate"] for r in rows]
        ratios = [r["ratio"] for r in rows]
        colors = ["#888888" if n == "torch" else "#4c72b0" for n in names]
        ax.barh(names[::-1], ratios[::-1], color=colors[::-1])
        ax.axvline(1.0, color="k", lw=0.8)
        ax.axvline(TARGET_RATIO, color="#c44e52", ls="--", lw=0.8, label=f"target {TARGET_RATIO:.2f}x")
        for y, r in enumerate(rows[::-1]):
            note = f"{r['step_ms']:.0f} ms" + (f", {r['hidden']:.0%} hidden" if r.get("hidden") is not None else "")
            ax.text(r["ratio"], y, " " + note, va="center", fontsize=8)
        ax.set_xlabel("step time / torch DDP's (lower is better)")
        ax.set_title(f"{model_name}: {res['parameters'] / 1e6:.1f} M parameters")
        ax.set_xlim(0, max(ratios) * 1.45)
        ax.legend(loc="lower right", fontsize=8)
    return fig
