"""Expert parallelism: experts sharded over the ranks against replicated, and the all-to-all that routes tokens.

``workbench bench experts`` trains a mixture-of-experts GPT (``--preset tiny`` with ``--experts 4``,
top-2 by default; every rank its own ``--batch-size`` sequences) four ways in one launch:

=============  ===================================================================================
candidate      what it is
=============  ===================================================================================
replicated     every rank holds all E experts: data parallelism (our DistributedDataParallel,
               ``find_unused_parameters``), each rank's tokens to its own copies of the experts
ep-native      ``expert_parallel(model)``: E/P experts per rank, tokens routed there and back by
               ``comm.all_to_all_single`` with ``algorithm="native"`` (gloo's alltoallv)
ep-pairwise    the same with the hand-written pairwise all-to-all (P-1 exchange rounds)
ep-bruck       the same with Bruck's all-to-all (ceil(lg P) rounds, more bytes)
=============  ===================================================================================

Both kinds compute the load-balancing loss over every rank's tokens (one small all-reduce per
layer), so they train the same model on the same data.

Reported (``workbench.measure.measuring``: interleaved trials in rotating order, the slowest rank,
the median):

* **step time** of each candidate, with the ratio to ``replicated`` and, for the hand-written
  all-to-alls, to ``ep-native``, all measured in the same run; the parameters each rank holds
  (:func:`workbench.parallel.expert.parameters_per_rank`).
* **dispatch + combine** of the first MoE layer alone, each algorithm on the row splits that
  routing produced (rank r sends ``rows_{r->j}`` rows of ``D = n_embd`` floats to rank j, and the
  combine sends them back), timed beside the prediction of :mod:`workbench.comm.cost` for that
  many bytes under even splits (``(P-1) alpha + (P-1)/P n beta`` pairwise, Bruck's rounds; native
  priced as pairwise), with a cost model fitted in the same launch on sizes around the message.
* **bytes** every rank sent during one forward (``comm.counters()``, all MoE layers) against the
  formula of :mod:`workbench.parallel.expert` for the routing that happened: per layer
  ``sum_{j != r} rows_{r->j} D b`` for the dispatch, the received rows for the combine, and
  ``(E - E/P) 8`` bytes of counts; and against the expectation under uniform routing,
  ``N k D b (P-1)/P`` per direction. Bruck's forwarded blocks and headers make it send more.
* **load balance**: per layer the tokens each expert received over all ranks, their max / mean
  (1.0 is perfect balance) and, with ``--capacity-factor``, the dropped assignments.

CPU timings are noisy while anything else runs: read the ratios, and repeat with more
``--trials`` before trusting a difference of a few percent. On a CPU the experts' matrices are
small and the messages go through loopback TCP, so expert parallelism's gain here is memory
(E/P experts per rank), not time.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring, probes
from workbench.comm import cost
from workbench.models.data import synthetic_batch
from workbench.models import GPT, GPTConfig
from workbench.models.moe import MoE
from workbench.parallel.ddp import DistributedDataParallel
from workbench.parallel.expert import all_to_all_bytes, expert_parallel, parameters_per_rank

CANDIDATES = ("replicated", "ep-native", "ep-pairwise", "ep-bruck")
ALGORITHMS = ("native", "pairwise", "bruck")
ADAMW = dict(lr=1e-3, eps=1e-6)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", default="tiny", help="GPT preset (default: tiny)")
    parser.add_argument("--experts", type=int, default=4, help="experts per MoE layer, a multiple of the world size "
                                                               "(default 4)")
    parser.add_argument("--top-k", type=int, default=2, help="experts per token (default 2)")
    parser.add_argument("--capacity-factor", type=float, default=None,
                        help="each expert keeps ceil(N k c / E) tokens per source rank (default: dropless)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    parser.add_argument("--world-size", type=int, default=2, help="ranks (default 2)")
    parser.add_argument("--trials", type=int, default=5, help="interleaved trials per candidate (default 5)")
    parser.add_argument("--steps", type=int, default=3, help="timed training steps per trial (default 3)")
    parser.add_argument("--iters", type=int, default=20, help="dispatch + combine pairs per trial (default 20)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps per candidate first (default 1)")
    parser.add_argument("--out", default=None, help="folder for experts.json and experts.png "
                                                    "(default runs/experts-<time>)")
    parser.add_argument("--no-plot", action="store_true", help="do not draw experts.png")


def _build(candidate: str, base):
    """``(model, optimizer)`` for one candidate, from an identically initialised MoE GPT."""
    model = copy.deepcopy(base)
    if candidate == "replicated":
        for moe in (m for m in model.modules() if isinstance(m, MoE)):
            moe.group = dist.group.WORLD  # the load-balancing loss over every rank's tokens, as EP's
        model = DistributedDataParallel(model, find_unused_parameters=True)
    else:
        model = expert_parallel(model, algorithm=candidate.split("-", 1)[1])
    return model, torch.optim.AdamW(model.parameters(), **ADAMW)


def _gather(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _count_one_forward(built: dict, x, y) -> tuple[dict, list]:
    """One forward of each expert-parallel candidate under ``comm.counters()``: ``(bytes its all-to-alls
    sent per algorithm, the routing of the native forward)``, the routing one ``(tokens per expert,
    dropped, send rows, recv rows)`` per MoE layer. Every algorithm routes alike (same model, same data)."""
    counted, layers = {}, None
    for a in ALGORITHMS:
        model = built[f"ep-{a}"][0]
        with torch.no_grad(), comm.counters() as c:
            model(x, y)
        stat = c.stats.get(("all_to_all_single", a))
        counted[a] = stat.bytes_sent if stat is not None else 0
        if a == "native":
            layers = [(moe.tokens_per_expert.tolist(), moe.dropped, list(moe.send_rows), list(moe.recv_rows))
                      for moe in model.modules() if isinstance(moe, MoE)]
    return counted, layers


def _formula_bytes(every: list, r: int, p: int, D: int, E: int, L: int, elt: int) -> int:
    """Bytes rank ``r`` sends in one forward by :func:`workbench.parallel.expert.all_to_all_bytes`, summed
    over the ``L`` MoE layers, for the rows every rank routed (``every[i][layer][2]``)."""
    formula = 0
    for layer in range(L):
        rows = [every[i][layer][2] for i in range(p)]
        formula += sum(s for s, _ in all_to_all_bytes(rows, r, D, E, elt).values())
    return formula


def _time_dispatch_combine(send: list, recv: list, D: int, trials: int, iters: int) -> dict:
    """Layer 0's dispatch + combine alone on the splits routing gave it: ``{algorithm: seconds per pair,
    one per trial}`` (interleaved trials, the slowest rank), after one untimed pair each."""
    rows_in = torch.randn(sum(send), D)
    rows_out = torch.empty(sum(recv), D)

    def pair(a):
        comm.all_to_all_single(rows_out, rows_in, recv, send, algorithm=a)
        comm.all_to_all_single(rows_in, rows_out, send, recv, algorithm=a)

    for a in ALGORITHMS:
        pair(a)
    return measuring.interleaved_trials(ALGORITHMS, trials, lambda a: measuring.max_over_ranks(
        measuring.timed(lambda: pair(a), iters)))


def _fit_around(nbytes: int, p: int):
    """A cost model (alpha, beta and their exchange variants) fitted on sizes around one block of an
    all-to-all of ``nbytes`` per rank, so its lines are straight where the prediction is read."""
    sizes = sorted({max(8, nbytes // (p * 4)), max(16, nbytes // p), max(32, 4 * nbytes // p)})
    return probes.fit(sizes, sizes, sizes, copies=False, curves=False)["model"]


def _step_rows(built: dict, samples: dict, tokens_per_step: int) -> list[dict]:
    """One row per candidate: its median step, its parameters on this rank, and the ratios to
    ``replicated`` and (expert-parallel ones) to ``ep-native``."""
    rows = []
    for c in CANDIDATES:
        held = sum(q.numel() for q in built[c][0].parameters())
        rows.append({"candidate": c, "step_ms": 1e3 * measuring.median(samples[c]),
                     "samples_ms": [1e3 * s for s in samples[c]], "parameters": held,
                     "tokens_per_s": tokens_per_step / measuring.median(samples[c])})
    by = {row["candidate"]: row for row in rows}
    for row in rows:
        row["x_replicated"] = row["step_ms"] / by["replicated"]["step_ms"]
        row["x_native"] = row["step_ms"] / by["ep-native"]["step_ms"] if row["candidate"] != "replicated" else None
    return rows


def _all_to_all_rows(a2a: dict, counted: dict, formula: int, uniform: float, nbytes: int, p: int,
                     cost_model) -> list[dict]:
    """One row per algorithm: dispatch + combine measured and predicted (two all-to-alls of ``nbytes``),
    and the bytes one forward sent against the routing's formula and uniform routing's expectation."""
    a2a_rows = []
    for a in ALGORITHMS:
        ms = 1e3 * measuring.median(a2a[a])
        predicted = (2e3 * cost.predict("all_to_all_single", a, nbytes, p, cost_model) if cost_model is not None
                     else None)
        a2a_rows.append({"algorithm": a, "ms": ms, "samples_ms": [1e3 * s for s in a2a[a]], "predicted_ms": predicted,
                         "measured_over_predicted": ms / predicted if predicted else None,
                         "x_native": None, "bytes_sent": counted[a], "bytes_formula": formula,
                         "bytes_uniform": uniform, "counted_over_formula": counted[a] / formula if formula else None})
    for row in a2a_rows:
        row["x_native"] = row["ms"] / a2a_rows[0]["ms"]
    return a2a_rows


def _balance(every: list, p: int, E: int, L: int) -> list[dict]:
    """Per layer: the tokens each expert received over all ranks, max / mean, and the dropped assignments."""
    tokens = [[sum(every[i][layer][0][e] for i in range(p)) for e in range(E)] for layer in range(L)]
    return [{"layer": layer, "tokens_per_expert": t, "max_over_mean": max(t) / (sum(t) / E),
             "dropped": sum(every[i][layer][1] for i in range(p))} for layer, t in enumerate(tokens)]


def run(preset: str = "tiny", experts: int = 4, top_k: int = 2, capacity_factor: float | None = None,
        batch_size: int = 8, trials: int = 5, steps: int = 3, iters: int = 20, warmup: int = 1,
        predict: bool = True) -> dict:
    """Inside every rank: build the candidates, count one forward's bytes and the routing, time the
    steps and the dispatch + combine (interleaved trials), fit the cost model (``predict``)."""
    p, r = dist.get_world_size(), dist.get_rank()
    config = GPTConfig.preset(preset, n_experts=experts, top_k=top_k, capacity_factor=capacity_factor)
    torch.manual_seed(0)
    base = GPT(config)
    x, y = synthetic_batch(batch_size, block_size=config.block_size, seed=r)
    built = {c: _build(c, base) for c in CANDIDATES}

    def step(c):
        model, optimizer = built[c]
        loss = model(x, y)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        return loss

    for c in CANDIDATES:
        for _ in range(warmup):
            step(c)

    # one forward of each expert-parallel candidate, counted; the routing it made, from every rank
    D, E, L, elt = config.n_embd, experts, config.n_layer, 4
    counted, layers = _count_one_forward(built, x, y)
    every = _gather(layers)  # every[i][layer] = rank i's (tokens per expert, dropped, send rows, recv rows)
    formula = _formula_bytes(every, r, p, D, E, L, elt)
    uniform = 2 * L * batch_size * config.block_size * top_k * D * elt * (p - 1) / p + L * (E - E // p) * 8

    # step times
    def time_step(c):
        return measuring.max_over_ranks(measuring.timed(lambda: step(c), steps))

    samples = measuring.interleaved_trials(CANDIDATES, trials, time_step)

    # dispatch + combine of layer 0 alone, on the splits it had
    send = every[r][0][2]
    a2a = _time_dispatch_combine(send, every[r][0][3], D, trials, iters)
    nbytes = sum(send) * D * elt  # this rank's whole input (nccl-tests' n)
    cost_model = _fit_around(nbytes, p) if predict else None

    rows = _step_rows(built, samples, p * batch_size * config.block_size)
    a2a_rows = _all_to_all_rows(a2a, counted, formula, uniform, nbytes, p, cost_model)
    return {"rows": rows, "all_to_all": a2a_rows, "balance": _balance(every, p, E, L), "rank": r,
            "bytes_by_rank": _gather({a: counted[a] for a in ALGORITHMS}),
            "formula_by_rank": _gather(formula), "rows_by_rank": [e[0][2] for e in every],
            "parameters_per_rank": parameters_per_rank(config, p), "parameters": base.num_parameters(),
            "cost_model": str(cost_model) if cost_model is not None else None, "preset": preset, "experts": E,
            "top_k": top_k, "capacity_factor": capacity_factor, "world_size": p, "batch_size": batch_size,
            "block_size": config.block_size, "n_embd": D}


def check_arguments(args: argparse.Namespace) -> None:
    """The ValueErrors of bad options, before anything is launched."""
    for name in ("world_size", "trials", "steps", "iters", "batch_size", "experts", "top_k"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')}={getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        raise ValueError(f"--warmup={args.warmup} must be >= 0")
    if args.experts % args.world_size:
        raise ValueError(f"--experts={args.experts} does not split over --world-size={args.world_size} ranks: use a "
                         f"multiple of {args.world_size}")
    if args.top_k > args.experts:
        raise ValueError(f"--top-k={args.top_k} is more than --experts={args.experts}: use top_k <= {args.experts}")
    if args.capacity_factor is not None and not args.capacity_factor > 0:
        raise ValueError(f"--capacity-factor={args.capacity_factor} must be > 0 (or left out: dropless)")


def report(res: dict) -> str:
    """The command's text: the step table, the all-to-all table, the load balance."""
    title = (f"bench experts: GPT {res['preset']} with {res['experts']} experts, top-{res['top_k']}, "
             f"{'dropless' if res['capacity_factor'] is None else 'capacity factor ' + str(res['capacity_factor'])}; "
             f"world size {res['world_size']}, batch {res['batch_size']} x {res['block_size']} tokens per rank, "
             f"AdamW; median of interleaved trials, slowest rank\n"
             f"parameters: {res['parameters']:,} in the model, {res['parameters_per_rank']:,} per rank with "
             f"experts sharded (parameters_per_rank)")
    text = [measuring.format_table(res["rows"], [
        ("candidate", "candidate", "s"), ("step_ms", "step ms", "{:.1f}"), ("x_replicated", "x replicated", "{:.3f}"),
        ("x_native", "x ep-native", "{:.3f}"), ("parameters", "params/rank", "{:,}"),
        ("tokens_per_s", "tokens/s", "{:.0f}")], title=title)]
    for row in res["all_to_all"]:
        row["sent_kib"], row["formula_kib"] = row["bytes_sent"] / 1024, row["bytes_formula"] / 1024
        row["uniform_kib"] = row["bytes_uniform"] / 1024
    text.append(measuring.format_table(res["all_to_all"], [
        ("algorithm", "algorithm", "s"), ("ms", "disp+comb ms", "{:.3f}"), ("x_native", "x native", "{:.3f}"),
        ("predicted_ms", "predicted ms", "{:.3f}"), ("measured_over_predicted", "meas/pred", "{:.2f}"),
        ("sent_kib", "sent KiB", "{:.1f}"), ("formula_kib", "formula KiB", "{:.1f}"),
        ("counted_over_formula", "sent/formula", "{:.3f}"), ("uniform_kib", "uniform KiB", "{:.1f}")],
        title=(f"layer 0's dispatch + combine alone on its routing (rank {res['rank']} sends rows "
               f"{res['rows_by_rank'][res['rank']]}; predicted: comm.cost, even splits); bytes: one forward, "
               f"every layer, rank {res['rank']}, against expert.all_to_all_bytes and N k D b (P-1)/P\n"
               f"cost model: {res['cost_model']}")))
    lines = ["# load balance (tokens each expert received, all ranks; max / mean, 1.0 = even)"]
    for b in res["balance"]:
        lines.append(f"  layer {b['layer']}: {b['tokens_per_expert']}  max/mean {b['max_over_mean']:.2f}  "
                     f"dropped {b['dropped']}")
    text.append("\n".join(lines))
    return "\n".join(text)


def exact_bytes(res: dict) -> bool:
    """Every rank's native and pairwise forward sent exactly the formula's bytes."""
    return all(b[a] == f for b, f in zip(res["bytes_by_rank"], res["formula_by_rank"]) for a in ("native", "pairwise"))


def main(args: argparse.Namespace) -> int:
    check_arguments(args)
    start = time.time()
    res = workbench.launch(run, world_size=args.world_size, timeout=3600, args=(
        args.preset, args.experts, args.top_k, args.capacity_factor, args.batch_size, args.trials, args.steps,
        args.iters, args.warmup))[0]
    print(report(res))
    ok = exact_bytes(res)
    print(f"# bytes sent by native and pairwise {'equal' if ok else 'DIFFER FROM'} the formula on every rank")
    measuring.save_outputs(args, "experts", {"results": res, "elapsed_s": time.time() - start},
                           None if args.no_plot else (lambda: plot(res)))
    return 0 if ok else 1


def plot(res: dict):
    """Left: step time relative to replicated experts. Right: tokens per expert, per layer."""
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_b) = plt.subplots(1, 2, figsize=(11, 4), layout="constrained")
    rows = res["rows"]
    names = [r["candidate"] for r in rows]
    ax_t.barh(names[::-1], [r["x_replicated"] for r in rows][::-1],
              color=["#888888" if n == "replicated" else "#4c72b0" for n in names][::-1])
    ax_t.axvline(1.0, color="k", lw=0.8)
    for yy, r in enumerate(rows[::-1]):
        ax_t.text(r["x_replicated"], yy, f" {r['step_ms']:.0f} ms", va="center", fontsize=8)
    ax_t.set_xlabel("step time / replicated experts' (lower is better)")
    E = res["experts"]
    width = 0.8 / len(res["balance"])
    for b in res["balance"]:
        ax_b.bar([e + b["layer"] * width for e in range(E)], b["tokens_per_expert"], width=width,
                 label=f"layer {b['layer']}")
    ax_b.set_xticks([e + 0.4 - width / 2 for e in range(E)], [str(e) for e in range(E)])
    ax_b.set_xlabel("expert")
    ax_b.set_ylabel("tokens routed (all ranks)")
    ax_b.legend(fontsize=8)
    fig.suptitle(f"GPT {res['preset']}, {E} experts, top-{res['top_k']}, {res['world_size']} ranks")
    return fig
