"""Context parallelism against one process: ring and Ulysses attention over sequence lengths.

``workbench bench context`` runs causal attention on ``(B, H, S, D)`` float32 tensors for each
total sequence length ``S``, forward and backward, in one launch of ``P`` ranks:

================  ==============================================================================
candidate         what it is
================  ==============================================================================
sdpa              ``F.scaled_dot_product_attention`` on the whole sequence in one process (every
                  rank runs it alone, on its own core; the slowest rank's time counts)
ring              :func:`workbench.parallel.context.ring_attention`, zigzag layout, over P ranks
ring-contiguous   the same ring on the contiguous layout (causal work unbalanced: the last rank
                  has about ``2P-1`` times the first one's; the others wait for it)
ulysses           :func:`workbench.parallel.context.ulysses_attention`, zigzag layout
torch-ring        PyTorch's private ring attention
                  (``torch.distributed.tensor.experimental._context_parallel._attention.
                  _templated_ring_attention``) with the CPU flash kernel, its load-balanced
                  layout (our zigzag), **forward only** (its backward needs a kernel's own
                  backward op); skipped, with the reason, where this torch lacks it
================  ==============================================================================

Every candidate runs in the same interleaved trials (the order rotates from trial to trial), the
median is shown. Columns, per rank: ``fwd ms`` and ``fwd+bwd ms``; ``x sdpa`` = fwd+bwd time over
one process's (forward only for ``torch-ring``); ``x ideal`` = the time over ``sdpa / P`` (the
work split P ways with nothing lost); bytes this rank sent forward and backward, counted by
``comm.counters()`` on one call outside the timed loop, and ``= formula``: whether they equal
:mod:`workbench.parallel.context`'s formulas exactly (in blocks of ``B (S/P) H D 4`` bytes: ring
forward ``2 (P-1)``, backward ``2 (P-1) + 2 P``; Ulysses ``4 (P-1)/P`` each way); ``scores MiB``:
attention scores held at once per rank by the formula (``B H (S/P)^2`` per ring step, ``B (H/P)
S^2`` for Ulysses, ``B H S^2`` for one process's math kernel: the flash kernels hold none); and
``max |diff|``: the output's and gradients' largest difference from one process, checked once.
A summary line sets our ring's forward against torch's.

Run it::

    workbench bench context                                  # 2 ranks, S = 512 .. 2048
    workbench bench context --world-size 4 --seq-lens 1024,4096 --heads 8
"""
from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring
from workbench.parallel import context as cp

CANDIDATES = ("sdpa", "ring", "ring-contiguous", "ulysses", "torch-ring")


def formula_bytes(candidate: str, batch: int, heads: int, seq_len: int, head_dim: int, p: int,
                  element_size: int = 4) -> tuple[float, float] | None:
    """Bytes one rank sends for one attention call, ``(forward, backward)``, by the formulas of
    :mod:`workbench.parallel.context` (None where nothing is counted)."""
    block = batch * (seq_len // p) * heads * head_dim * element_size
    if candidate.startswith("ring"):
        return 2 * (p - 1) * block, 2 * (p - 1) * block + 2 * p * block
    if candidate == "ulysses":
        return 4 * block * (p - 1) / p, 4 * block * (p - 1) / p
    return None


def scores_bytes(candidate: str, batch: int, heads: int, seq_len: int, p: int) -> float:
    """Float32 attention scores one rank holds at once, by the formula."""
    if candidate.startswith("ring") or candidate == "torch-ring":
        return 4 * batch * heads * (seq_len // p) ** 2
    if candidate == "ulysses":
        return 4 * batch * (heads // p) * seq_len ** 2
    return 4 * batch * heads * seq_len ** 2


def _torch_ring():
    """``(forward(q, k, v) -> out, None)`` with torch's private ring attention, or ``(None, why)``."""
    try:
        from torch.distributed.tensor.experimental._context_parallel import _attention
        ring = _attention._templated_ring_attention
        kernel = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    except (ImportError, AttributeError) as e:
        return None, f"torch {torch.__version__} has no private ring attention on CPU ({e})"

    def op(q, k, v, *args, is_causal=False, **kwargs):
        return kernel(q, k, v, is_causal=is_causal)

    def forward(q, k, v):
        return ring(dist.group.WORLD, 2, op, q, k, v, is_causal=True)[0]

    return forward, None


# the layout each sharded candidate's inputs are cut in
_LAYOUT = {"ring": "zigzag", "ring-contiguous": "contiguous", "ulysses": "zigzag", "torch-ring": "zigzag"}


def _inputs(names, q, k, v, w) -> tuple[dict, dict]:
    """``(args, weights)`` per candidate: leaf copies of ``q, k, v`` that collect gradients (the whole
    sequence for sdpa, this rank's shard in the candidate's layout for the others), and the weights
    ``w`` the output is summed against for backward, cut the same way."""
    args = {"sdpa": [t.clone().requires_grad_() for t in (q, k, v)]}
    for c in names:
        if c != "sdpa":
            args[c] = [cp.shard_sequence(t, layout=_LAYOUT[c]).requires_grad_() for t in (q, k, v)]
    weights = {c: w if c == "sdpa" else cp.shard_sequence(w, layout=_LAYOUT[c]) for c in names}
    return args, weights


def _attend(c: str, args: dict, torch_forward):
    """Candidate ``c``'s causal attention on its own inputs."""
    if c == "sdpa":
        return F.scaled_dot_product_attention(*args[c], is_causal=True)
    if c == "torch-ring":
        return torch_forward(*args[c])
    method = cp.ulysses_attention if c == "ulysses" else cp.ring_attention
    return method(*args[c], is_causal=True, layout=_LAYOUT[c])


def _count_and_check(names, args: dict, weights: dict, w, attention) -> tuple[dict, dict]:
    """One call of each candidate outside the timed loop: ``(bytes sent (forward, backward), largest
    difference from one process over the output and gradients, the largest over ranks)`` per candidate
    (torch-ring: forward only, no bytes). The reference is one process's sdpa on the whole sequence."""
    reference = F.scaled_dot_product_attention(*args["sdpa"], is_causal=True)
    (reference * w).sum().backward()
    want = [reference.detach()] + [t.grad.clone() for t in args["sdpa"]]
    counted, diff = {}, {}
    for c in names:
        for t in args[c]:
            t.grad = None
        with comm.counters() as fwd:
            out = attention(c)
        if c == "torch-ring":
            got, wanted = [out.detach()], want[:1]
        else:
            with comm.counters() as bwd:
                (out * weights[c]).sum().backward()
            got, wanted = [out.detach()] + [t.grad for t in args[c]], want
            counted[c] = (fwd.total_bytes_sent, bwd.total_bytes_sent)
        if c != "sdpa":
            wanted = [cp.shard_sequence(t, layout=_LAYOUT[c]) for t in wanted]
        diff[c] = measuring.max_over_ranks(max((a - b).abs().max().item() for a, b in zip(got, wanted)))
    return counted, diff


def _time_candidates(names, weights: dict, attention, trials: int, steps: int, warmup: int) -> dict:
    """Seconds per call of each candidate's forward (``"c|fwd"``, no gradients) and forward + backward
    (``"c|fwd+bwd"``, not torch-ring): ``warmup`` untimed calls each, then interleaved trials, the
    slowest rank."""
    def forward(c):
        with torch.no_grad():
            attention(c)

    def forward_backward(c):
        (attention(c) * weights[c]).sum().backward()

    timed = [f"{c}|fwd" for c in names] + [f"{c}|fwd+bwd" for c in names if c != "torch-ring"]
    run = {name: (forward if name.endswith("|fwd") else forward_backward) for name in timed}
    for name in timed:
        for _ in range(warmup):
            run[name](name.split("|")[0])

    def time_one(name):
        c = name.split("|")[0]
        return measuring.max_over_ranks(measuring.timed(lambda: run[name](c), steps))

    return measuring.interleaved_trials(timed, trials, time_one)


def _row(c: str, s: int, samples: dict, counted: dict, diff: dict, batch: int, heads: int, head_dim: int,
         p: int) -> dict:
    """Candidate ``c``'s row at sequence length ``s``: medians, scores by the formula, the check, and the
    counted bytes against the formula's."""
    row = {"seq_len": s, "candidate": c, "fwd_ms": 1e3 * measuring.median(samples[f"{c}|fwd"]),
           "fwd_samples_ms": [1e3 * x for x in samples[f"{c}|fwd"]],
           "scores_MiB": scores_bytes(c, batch, heads, s, p) / 2**20, "max_diff": diff[c]}
    if c != "torch-ring":
        row["total_ms"] = 1e3 * measuring.median(samples[f"{c}|fwd+bwd"])
        row["total_samples_ms"] = [1e3 * x for x in samples[f"{c}|fwd+bwd"]]
    formula = formula_bytes(c, batch, heads, s, head_dim, p)
    if c in counted and formula is not None:
        row["sent_fwd"], row["sent_bwd"] = counted[c]
        row["formula_fwd"], row["formula_bwd"] = formula
        row["bytes_match"] = tuple(counted[c]) == formula
    return row


def _add_ratios(rows: list[dict], s: int, p: int) -> None:
    """``vs_sdpa`` and ``vs_ideal`` (over ``sdpa / P``) for the rows of sequence length ``s``: fwd+bwd
    times, forward for torch-ring; NaN without an sdpa row."""
    sdpa = next((r for r in rows if r["seq_len"] == s and r["candidate"] == "sdpa"), None)
    for r in (r for r in rows if r["seq_len"] == s):
        key = "fwd_ms" if r["candidate"] == "torch-ring" else "total_ms"
        r["vs_sdpa"] = r[key] / sdpa[key] if sdpa else float("nan")
        r["vs_ideal"] = r[key] / (sdpa[key] / p) if sdpa and r["candidate"] != "sdpa" else float("nan")


def measure(seq_lens, batch: int, heads: int, head_dim: int, candidates, trials: int, steps: int,
            warmup: int) -> dict:
    """In every rank: time every candidate at every sequence length (interleaved trials, slowest
    rank), count bytes, check against one process; ``{"rows", "skipped"}`` (the same on every rank)."""
    p = dist.get_world_size()
    skipped = {}
    torch_forward = None
    if "torch-ring" in candidates:
        torch_forward, why = _torch_ring()
        if torch_forward is None:
            skipped["torch-ring"] = why
    names = [c for c in candidates if c not in skipped]
    rows = []
    for s in seq_lens:
        g = torch.Generator().manual_seed(s)
        q, k, v, w = (torch.randn(batch, heads, s, head_dim, generator=g) for _ in range(4))
        args, weights = _inputs(names, q, k, v, w)

        def attention(c):
            return _attend(c, args, torch_forward)

        counted, diff = _count_and_check(names, args, weights, w, attention)
        samples = _time_candidates(names, weights, attention, trials, steps, warmup)
        rows.extend(_row(c, s, samples, counted, diff, batch, heads, head_dim, p) for c in names)
        _add_ratios(rows, s, p)
    return {"rows": rows, "skipped": skipped, "world_size": p}


def _rank_main(config: dict) -> dict:
    return measure(**config)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.description = __doc__.split("\n")[0]
    parser.add_argument("--world-size", type=int, default=2, help="ranks P (default 2)")
    parser.add_argument("--seq-lens", default="512,1024,2048",
                        help="total sequence lengths, comma-separated, multiples of 2P (default 512,1024,2048)")
    parser.add_argument("--batch", type=int, default=1, help="sequences B (default 1)")
    parser.add_argument("--heads", type=int, default=8, help="heads H, a multiple of P for Ulysses (default 8)")
    parser.add_argument("--head-dim", type=int, default=64, help="head size D (default 64)")
    parser.add_argument("--candidates", default=",".join(CANDIDATES),
                        help=f"comma-separated, from {', '.join(CANDIDATES)} (default: all; sdpa always runs)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials, median shown (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="calls per trial (default 3)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed calls per candidate first (default 1)")
    parser.add_argument("--out", default=None, help="folder for context.json and context.png "
                                                    "(default runs/context-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw context.png")


def configure(args: argparse.Namespace) -> dict:
    """Check the options (a ValueError naming the option and the fix); the measurement's arguments."""
    for name in ("world_size", "trials", "steps", "batch", "heads", "head_dim"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.world_size < 2:
        raise ValueError(f"--world-size={args.world_size}: context parallelism needs at least 2 ranks")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    items = measuring.choices(args.candidates, CANDIDATES, "candidates")
    candidates = ["sdpa"] + [c for c in CANDIDATES if c in items and c != "sdpa"]
    try:
        seq_lens = [int(x) for x in args.seq_lens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--seq-lens={args.seq_lens!r}: give whole numbers separated by commas, e.g. 512,1024") \
            from None
    p = args.world_size
    odd = [s for s in seq_lens if s < 1 or s % (2 * p)]
    if odd or not seq_lens:
        raise ValueError(f"--seq-lens={args.seq_lens!r}: {odd or 'none given'} not a multiple of 2 x {p} ranks = "
                         f"{2 * p} (the zigzag layout's chunks); use multiples of {2 * p}")
    if "ulysses" in candidates and args.heads % p:
        raise ValueError(f"--heads={args.heads} does not split over --world-size={p} ranks, which Ulysses needs: "
                         f"use a multiple of {p}, or leave ulysses out of --candidates")
    return {"seq_lens": seq_lens, "batch": args.batch, "heads": args.heads, "head_dim": args.head_dim,
            "candidates": candidates, "trials": args.trials, "steps": args.steps, "warmup": args.warmup}


def table(res: dict) -> str:
    """The report: one row per (sequence length, candidate)."""
    flat = []
    for r in res["rows"]:
        cells = dict(r)
        for key in ("sent_fwd", "sent_bwd", "formula_fwd"):
            cells[key] = measuring.format_bytes(r[key]) if key in r else None
        cells["match"] = {True: "yes", False: "NO"}.get(r.get("bytes_match"))
        flat.append(cells)
    columns = [("seq_len", "S", "{:d}"), ("candidate", "candidate", "s"), ("fwd_ms", "fwd ms", "{:.2f}"),
               ("total_ms", "fwd+bwd ms", "{:.2f}"), ("vs_sdpa", "x sdpa", "{:.2f}"), ("vs_ideal", "x ideal", "{:.2f}"),
               ("sent_fwd", "sent fwd", "s"), ("sent_bwd", "sent bwd", "s"), ("formula_fwd", "formula fwd", "s"),
               ("match", "= formula", "s"), ("scores_MiB", "scores MiB", "{:.2f}"),
               ("max_diff", "max |diff|", "{:.1e}")]
    c = res["config"]
    title = (f"bench context: causal attention, B={c['batch']} H={c['heads']} D={c['head_dim']} float32, "
             f"P = {res['world_size']} ranks, median of {c['trials']} interleaved trials x {c['steps']} calls; "
             "time = slowest rank; x ideal = time / (sdpa / P)")
    return measuring.format_table(flat, columns, title=title)


def summary(res: dict) -> list[str]:
    """One line per sequence length: our ring's forward against torch's; the skip reasons."""
    lines = []
    by = {(r["seq_len"], r["candidate"]): r for r in res["rows"]}
    for s in res["config"]["seq_lens"]:
        ours, theirs = by.get((s, "ring")), by.get((s, "torch-ring"))
        if ours and theirs:
            lines.append(f"# S={s}: ring forward / torch-ring forward = {ours['fwd_ms'] / theirs['fwd_ms']:.2f}")
    lines += [f"# {c} skipped: {why}" for c, why in res["skipped"].items()]
    wrong = [f"{r['candidate']} at S={r['seq_len']}" for r in res["rows"] if r.get("bytes_match") is False]
    lines.append("# bytes sent equal the formulas: " + ("yes, every row" if not wrong else f"NO: {', '.join(wrong)}"))
    return lines


def main(args: argparse.Namespace) -> int:
    try:
        config = configure(args)
    except ValueError as e:
        print(f"workbench bench context: error: {e}")
        return 2
    start = time.time()
    res = workbench.launch(_rank_main, world_size=args.world_size, args=(config,), timeout=3600)[0]
    res["config"] = config
    if workbench.rank() != 0:  # under torchrun only rank 0 reports
        return 0
    print(table(res))
    lines = summary(res)
    print("\n".join(lines))
    measuring.save_outputs(args, "context", {"results": res, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(res)))
    return 0 if all(r.get("bytes_match", True) for r in res["rows"]) else 1


def plot(res: dict):
    """Left: fwd+bwd time per rank against the sequence length. Right: bytes sent per rank."""
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    for c in res["config"]["candidates"]:
        rows = [r for r in res["rows"] if r["candidate"] == c]
        key = "fwd_ms" if c == "torch-ring" else "total_ms"
        if rows:
            a1.plot([r["seq_len"] for r in rows], [r[key] for r in rows], "o-",
                    label=c + (" (forward only)" if c == "torch-ring" else ""))
        sent = [r for r in rows if "sent_fwd" in r]
        if sent:
            a2.plot([r["seq_len"] for r in sent], [(r["sent_fwd"] + r["sent_bwd"]) / 2**20 for r in sent], "o-",
                    label=c)
    for ax in (a1, a2):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("sequence length S")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a1.set_yscale("log")
    a1.set_ylabel("ms per call (slowest rank)")
    a1.set_title(f"causal attention, forward + backward, P = {res['world_size']}")
    a2.set_ylabel("MiB sent per rank (fwd + bwd)")
    a2.set_title("bytes per rank: counted (equal to the formulas)")
    return fig
