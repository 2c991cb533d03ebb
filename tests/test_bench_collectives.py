"""``workbench bench collectives``, its shared helpers, and the alpha-beta cost model.

Timing figures are not asserted (they depend on the machine and its load): these tests check the
structure of what the benchmark measures and reports, the nccl-tests conventions (sizes, busbw
factors), the correctness check (#wrong is 0 for every algorithm, and is not 0 when the
collective did not run), and the cost formulas against the closed forms of the formula sheet.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import statistics

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.measure import measuring, probes
from workbench.apps.bench import collectives as bc
from workbench.apps.bench import ddp as bench_ddp
from workbench.apps.bench import pipeline as bench_pipeline
from workbench.apps.bench import zero as bench_zero
from workbench.comm import cost

# ------------------------------------------------------------------------------- measuring helpers


def test_parse_and_format_bytes():
    assert measuring.parse_bytes("8") == 8
    assert measuring.parse_bytes("4K") == 4096
    assert measuring.parse_bytes("64M") == 64 << 20
    assert measuring.parse_bytes("1g") == 1 << 30
    assert measuring.parse_bytes(12) == 12
    for bad in ("", "12X", "-3", "1.5M"):
        with pytest.raises(ValueError, match="size"):
            measuring.parse_bytes(bad)
    assert measuring.format_bytes(64 << 20) == "64M"
    assert measuring.format_bytes(1536) == "1.5K"
    assert measuring.format_bytes(8) == "8"


def test_a_benchmark_option_lists_its_choices():
    assert measuring.choices(" ddp, zero1 ,", ("ddp", "zero1", "zero3"), "candidates") == ["ddp", "zero1"]
    with pytest.raises(ValueError, match=r"--candidates='ddp,zer0': unknown \['zer0'\]; choose from ddp, zero1"):
        measuring.choices("ddp,zer0", ("ddp", "zero1"), "candidates")
    with pytest.raises(ValueError, match=r"--parts=' , ': unknown empty list"):
        measuring.choices(" , ", ("time",), "parts")
    # every benchmark that takes a list reads it this way, so a typo fails before any rank starts
    for module, option, value in ((bench_ddp, "candidates", "nope"), (bench_pipeline, "schedules", "nope"),
                                  (bench_zero, "candidates", "nope")):
        parser = argparse.ArgumentParser()
        module.add_arguments(parser)
        with pytest.raises(ValueError, match=f"--{option}='nope': unknown"):
            module.main(parser.parse_args([f"--{option}", value]))


def test_size_sweep_is_nccl_tests_b_e_f():
    sizes = measuring.size_sweep(8, 64 << 20, 4)
    # 8 * 4^11 = 32M, the next step (128M) is past the end: 64M itself closes the sweep
    assert sizes[0] == 8 and sizes[-2:] == [32 << 20, 64 << 20] and len(sizes) == 13
    assert all(b == 4 * a for a, b in zip(sizes[:-1], sizes[1:-1]))
    assert measuring.size_sweep(8, 128 << 20, 4) == [8 * 4 ** k for k in range(13)]
    with pytest.raises(ValueError, match="max_bytes"):
        measuring.size_sweep(64, 8, 4)
    with pytest.raises(ValueError, match="factor"):
        measuring.size_sweep(8, 64, 1)


def test_scaled_iterations():
    assert measuring.scaled_iterations(8, 20, 64 << 20) == 20
    assert measuring.scaled_iterations(16 << 20, 20, 64 << 20) == 4
    assert measuring.scaled_iterations(256 << 20, 20, 64 << 20) == 1


def test_interleaved_trials_rotate_the_order():
    calls = []
    samples = measuring.interleaved_trials(["a", "b", "c"], 6, lambda name: calls.append(name) or len(calls))
    assert calls[:3] == ["a", "b", "c"] and calls[3:6] == ["b", "c", "a"] and calls[6:9] == ["c", "a", "b"]
    # every candidate runs first, second and third equally often
    for name in "abc":
        positions = [calls[3 * t:3 * t + 3].index(name) for t in range(6)]
        assert sorted(positions) == [0, 0, 1, 1, 2, 2]
    assert {k: len(v) for k, v in samples.items()} == {"a": 6, "b": 6, "c": 6}
    assert measuring.median([3.0, 1.0, 2.0, float("nan")]) == 2.0
    with pytest.raises(ValueError, match="trials"):
        measuring.interleaved_trials(["a"], 0, lambda name: 0.0)


def test_interleaved_trials_run_after_last_so_a_different_candidate_follows_it():
    """``after`` runs once per trial after the rotating candidates: what follows it (the next
    trial's first candidate) changes from trial to trial, where rotating it with the others put
    the same candidate after it in every trial but one."""
    calls = []
    samples = measuring.interleaved_trials(["a", "b", "c"], 4, lambda name: calls.append(name) or 0.0, after=["cal"])
    assert calls == ["a", "b", "c", "cal", "b", "c", "a", "cal", "c", "a", "b", "cal", "a", "b", "c", "cal"]
    followers = [calls[k + 1] for k in range(len(calls) - 1) if calls[k] == "cal"]
    assert followers == ["b", "c", "a"]
    assert {k: len(v) for k, v in samples.items()} == {"a": 4, "b": 4, "c": 4, "cal": 4}
    # the plain rotation with "cal" among the candidates: "a" follows it in every trial but the first
    calls.clear()
    measuring.interleaved_trials(["a", "b", "c", "cal"], 4, lambda name: calls.append(name) or 0.0)
    assert [calls[k + 1] for k in range(len(calls) - 1) if calls[k] == "cal"] == ["b", "a", "a", "a"]


def test_format_table_aligns_and_marks_missing():
    text = measuring.format_table([{"x": 1, "y": 2.5}, {"x": 100, "y": float("nan")}],
                                  [("x", "size", "{:d}"), ("y", "busbw", "{:.2f}")], title="t")
    lines = text.splitlines()
    assert lines[0] == "# t" and lines[1].startswith("#") and "busbw" in lines[1]
    assert lines[2].split() == ["1", "2.50"] and lines[3].split() == ["100", "-"]
    assert len({len(line) for line in lines[1:]}) == 1  # fixed width


# ------------------------------------------------------------------------ nccl-tests conventions


def test_bus_factors_and_counts():
    assert bc.bus_factor("all_reduce", 4) == pytest.approx(1.5)
    for c in ("all_gather", "reduce_scatter", "gather", "scatter", "all_to_all_single"):
        assert bc.bus_factor(c, 4) == pytest.approx(0.75)
    assert bc.bus_factor("broadcast", 4) == bc.bus_factor("reduce", 4) == 1.0
    with pytest.raises(ValueError, match="collective"):
        bc.bus_factor("all_to_all", 2)
    # the size is the whole vector (all_reduce) or the whole gathered buffer (all_gather)
    assert bc.counts("all_reduce", 1000, 3, 4) == (250, 1000)
    assert bc.counts("all_gather", 1000, 3, 4) == (83, 996)
    assert bc.counts("reduce_scatter", 8, 4, 4) == (0, 0)  # too small: skipped
    assert bc.counts("all_to_all_single", 1000, 3, 4) == (249, 996)  # one rank's input: 3 blocks of 83


# ------------------------------------------------------------------------- the sweep on 2, 3 ranks

SIZES = [8, 1000, 48 << 10]  # one element, a size no world size divides, a multi-segment-free medium size


def _sweep_all(sizes):
    algorithms = {c: ["native"] + [a for a in comm.ALGORITHMS[c] if a != "native"] for c in bc.COLLECTIVES}
    rows = bc.sweep(bc.COLLECTIVES, algorithms, sizes, trials=2, warmup=1, iters=2, progress=False)
    # the check must be able to fail: inputs filled, collective *not* called -> wrong elements
    unrun = {}
    for c in ("all_reduce", "all_gather", "broadcast", "all_to_all_single"):
        case = bc._make_case(c, 16 if c != "all_to_all_single" else 16 * dist.get_world_size(), "out-of-place",
                             torch.float32)
        case.fill()
        unrun[c] = int(measuring.sum_over_ranks(case.wrong()))
    return {"rows": rows, "unrun": unrun, "algorithms": algorithms}


@pytest.fixture(scope="module")
def swept():
    return {n: workbench.launch(_sweep_all, n, args=(SIZES,), timeout=240)[0] for n in (2, 3)}


@pytest.mark.parametrize("world", [2, 3])
def test_every_algorithm_is_measured_and_correct(swept, world):
    out = swept[world]
    rows, algorithms = out["rows"], out["algorithms"]
    for c in bc.COLLECTIVES:
        for size in SIZES:
            per_rank, reported = bc.counts(c, size, world, 4)
            got = [r for r in rows if r["collective"] == c and r["bytes"] == reported]
            if per_rank == 0:
                assert not got
                continue
            assert [r["algorithm"] for r in got] == algorithms[c]  # native first, then ours
            for r in got:
                assert r["world_size"] == world and r["count"] == per_rank and r["iters"] == 2
                for p in bc.PLACEMENTS:
                    m = r[p]
                    assert m["wrong"] == 0, (c, r["algorithm"], size, p)
                    assert len(m["trials_s"]) == 2 and all(t > 0 for t in m["trials_s"])
                    assert m["time_s"] == pytest.approx(sorted(m["trials_s"])[0] / 2 + sorted(m["trials_s"])[1] / 2)
                    assert m["algbw"] == pytest.approx(reported / m["time_s"])
                    assert m["busbw"] == pytest.approx(m["algbw"] * bc.bus_factor(c, world))
                    if r["algorithm"] == "native":
                        assert m["ratio"] == pytest.approx(1.0)
                    else:
                        native = got[0][p]["busbw"]
                        assert m["ratio"] == pytest.approx(m["busbw"] / native)
    # an output nobody computed is caught (all_gather: the whole zeroed output of every rank;
    # broadcast: every rank but the root, which already holds the answer)
    assert out["unrun"]["all_reduce"] == 16 * world
    assert out["unrun"]["all_gather"] == 16 * world * world
    assert out["unrun"]["broadcast"] == 16 * (world - 1)
    assert out["unrun"]["all_to_all_single"] == 16 * world * world


# ----------------------------------------------------------------------------------------- CLI


def _parse(argv):
    parser = argparse.ArgumentParser()
    bc.add_arguments(parser)
    return parser.parse_args(argv)


def test_cli_is_discovered_and_defaults_match_the_issue():
    from workbench.apps import cli

    assert "collectives" in cli._benchmarks()
    args = _parse([])
    assert (args.world_size, args.min_bytes, args.max_bytes, args.factor) == (2, "8", "64M", 4)
    assert args.trials >= 5
    config = bc.configure(args)
    assert config["sizes"] == measuring.size_sweep(8, 64 << 20, 4)
    assert config["collectives"] == list(bc.COLLECTIVES)
    for c in bc.COLLECTIVES:
        assert config["algorithms"][c][0] == "native"
        assert set(config["algorithms"][c]) == set(comm.ALGORITHMS[c]) | {"native"}


def test_cli_rejects_bad_input(capsys):
    with pytest.raises(ValueError, match="all_to_all"):
        bc.configure(_parse(["--collectives", "all_to_all"]))
    with pytest.raises(ValueError, match="--algorithms nosuch"):
        bc.configure(_parse(["--collectives", "all_reduce", "--algorithms", "nosuch"]))
    with pytest.raises(ValueError, match="--world-size 1"):
        bc.configure(_parse(["--world-size", "1"]))
    with pytest.raises(ValueError, match="size"):
        bc.configure(_parse(["--max-bytes", "lots"]))
    assert bc.main(_parse(["--trials", "0"])) == 2
    assert "--trials 0" in capsys.readouterr().out


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    ring = [a for a in comm.ALGORITHMS["all_reduce"] if a != "native"][:1]
    argv = ["--collectives", "all_reduce,all_gather", "--max-bytes", "2K", "--factor", "16", "--trials", "2",
            "--iters", "2", "--warmup", "1", "--out", str(tmp_path)] + (["--algorithms"] + ring if ring else [])
    assert bc.main(_parse(argv)) == 0
    printed = capsys.readouterr().out
    assert "# all_reduce  world size 2" in printed and "#wrong" in printed and "x native" in printed
    assert "pred(us)" in printed and "# cost model: alpha" in printed
    data = json.loads((tmp_path / "results.json").read_text())
    assert data["config"]["sizes"] == [8, 128, 2048]
    # the model is fitted up to the sweep's largest size, 1 MiB at least: not up to 64 MiB
    assert max(n for n, _ in data["cost"]["pingpong"]) == 1 << 20
    assert max(n for n, _ in data["cost"]["reduction"]) == 1 << 20
    assert {r["collective"] for r in data["rows"]} == {"all_reduce", "all_gather"}
    assert all(r[p]["wrong"] == 0 for r in data["rows"] for p in bc.PLACEMENTS)
    model = data["cost"]["model"]
    assert set(model) == {"alpha", "beta", "gamma", "beta_duplex", "alpha_duplex", "delta", "tables", "overhead",
                          "overheads"}
    assert set(model["tables"]) == {"one_way", "exchange", "reduction", "copy"}
    # the probes timed inside each collective's trials (size/p and size of every swept size) go
    # into that collective's curves
    probes = data["cost"]["probes"]
    assert set(probes) == {"all_reduce", "all_gather"}
    probed = {m: t for m, t in probes["all_reduce"]["exchange"]}
    assert set(probed) == {4, 8, 64, 128, 1024, 2048}
    models = bc.models_for(cost.CostModel(**model), probes)
    assert all(models["all_reduce"].exchange(m) == pytest.approx(t) for m, t in probed.items())
    assert models["all_reduce"].predict("all_reduce", "ring", 2048, 2) > 0
    assert (tmp_path / "busbw.png").stat().st_size > 10_000


# ---------------------------------------------------------------------------------- cost model

M = cost.CostModel(alpha=1e-5, beta=1e-9, gamma=2e-10)


def test_cost_formulas_match_the_formula_sheet():
    a, b, g = M.alpha, M.beta, M.gamma
    n = 1 << 20
    # world size 2: ring and recursive doubling both send half / all of the vector once
    assert M.predict("all_reduce", "ring", n, 2) == pytest.approx(2 * a + n * b + 0.5 * n * g)
    assert M.predict("all_reduce", "recursive_doubling", n, 2) == pytest.approx(a + n * b + n * g)
    p = 8
    assert M.predict("all_reduce", "ring", n, p) == pytest.approx(2 * 7 * a + 2 * 7 / 8 * n * b + 7 / 8 * n * g)
    assert M.predict("all_reduce", "rabenseifner", n, p) == pytest.approx(6 * a + 2 * 7 / 8 * n * b + 7 / 8 * n * g)
    assert M.predict("all_reduce", "recursive_doubling", n, p) == pytest.approx(3 * (a + n * b + n * g))
    assert M.predict("all_gather", "ring", n, p) == pytest.approx(7 * a + 7 / 8 * n * b)
    assert M.predict("all_gather", "recursive_doubling", n, p) == pytest.approx(3 * a + 7 / 8 * n * b)
    assert M.predict("reduce_scatter", "recursive_halving", n, p) == pytest.approx(3 * a + 7 / 8 * n * (b + g))
    assert M.predict("broadcast", "binomial", n, p) == pytest.approx(3 * (a + n * b))
    assert M.predict("broadcast", "scatter_allgather", n, p) == pytest.approx(10 * a + 2 * 7 / 8 * n * b)
    assert M.predict("reduce", "binomial", n, p) == pytest.approx(3 * (a + n * b + n * g))
    # a non-power of two pays for folding the extra rank in and out
    assert M.predict("all_reduce", "recursive_doubling", n, 3) == pytest.approx(
        (a + n * b + n * g) + (a + n * b + n * g) + (a + n * b))
    assert M.predict("all_reduce", "native", n, p) == M.predict("all_reduce", "ring", n, p)
    assert M.predict("all_reduce", "ring", n, 1) == 0.0


def test_beta_duplex_prices_exchange_steps_only():
    d = cost.CostModel(alpha=M.alpha, beta=M.beta, gamma=M.gamma, beta_duplex=3 * M.beta)
    a, b, g, x = d.alpha, d.beta, d.gamma, d.beta_duplex
    n, p = 1 << 20, 4
    assert d.predict("all_reduce", "ring", n, p) == pytest.approx(6 * a + 1.5 * n * x + 0.75 * n * g)
    assert d.predict("all_gather", "bruck", n, p) == pytest.approx(2 * a + 0.75 * n * x)
    assert d.predict("reduce_scatter", "ring", n, p) == pytest.approx(3 * a + 0.75 * n * (x + g))
    assert d.predict("broadcast", "scatter_allgather", n, p) == pytest.approx(5 * a + 0.75 * n * (b + x))
    for c, alg in (("broadcast", "binomial"), ("reduce", "flat"), ("gather", "binomial"),
                   ("all_reduce", "reduce_broadcast")):  # one-way trees keep beta
        assert d.predict(c, alg, n, p) == M.predict(c, alg, n, p)


def test_alpha_duplex_prices_exchange_steps_only():
    d = cost.CostModel(alpha=M.alpha, beta=M.beta, gamma=M.gamma, alpha_duplex=5 * M.alpha)
    a, b, g, e = d.alpha, d.beta, d.gamma, d.alpha_duplex
    n, p = 1 << 20, 4
    assert d.predict("all_reduce", "ring", n, p) == pytest.approx(6 * e + 1.5 * n * b + 0.75 * n * g)
    assert d.predict("all_reduce", "recursive_doubling", n, p) == pytest.approx(2 * (e + n * b + n * g))
    assert d.predict("all_gather", "bruck", n, p) == pytest.approx(2 * e + 0.75 * n * b)
    assert d.predict("broadcast", "scatter_allgather", n, p) == pytest.approx(2 * a + 3 * e + 1.5 * n * b)
    # p = 3 folds: the fold-in and fold-out messages are one-way, the halving step an exchange
    assert d.predict("reduce_scatter", "recursive_halving", 3 * n, 3) == pytest.approx(
        e + 2 * n * (b + g) + (a + 3 * n * (b + g)) + (a + n * b))  # fold in: all 3n; fold out: one block
    for c, alg in (("broadcast", "binomial"), ("reduce", "flat"), ("all_reduce", "reduce_broadcast")):
        assert d.predict(c, alg, n, p) == M.predict(c, alg, n, p)
    with pytest.raises(ValueError, match="alpha_duplex"):
        cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0, alpha_duplex=-1.0)


def test_delta_prices_the_local_copies_of_each_algorithm():
    d = cost.CostModel(alpha=M.alpha, beta=M.beta, gamma=M.gamma, delta=3e-10)
    n, p = 1 << 20, 4
    copied = {("all_gather", "recursive_doubling"): n + n / p, ("all_gather", "bruck"): n,
              ("reduce_scatter", "recursive_halving"): n + n / p, ("reduce", "binomial"): n,
              ("scatter", "flat"): n / p, ("scatter", "binomial"): 3 * n / p, ("gather", "binomial"): 3 * n / p}
    for (c, alg), nbytes in copied.items():
        assert d.predict(c, alg, n, p) == pytest.approx(M.predict(c, alg, n, p) + 3e-10 * nbytes), (c, alg)
    # no copies: the ring all-reduce and all-gather work in the caller's buffers; native is gloo's code
    for c, alg in (("all_reduce", "ring"), ("all_gather", "ring"), ("broadcast", "binomial"),
                   ("reduce_scatter", "ring"), ("reduce_scatter", "native")):
        assert d.predict(c, alg, n, p) == M.predict(c, alg, n, p), (c, alg)
    assert d.predict("reduce", "flat", n, 1) == 0.0
    assert d.predict("scatter", "binomial", n, 2) == pytest.approx(M.predict("scatter", "binomial", n, 2) + 3e-10 * n / 2)
    assert [cost._runs_of_several(p) for p in (2, 3, 4, 5, 8)] == [0, 0, 2, 2, 6]
    assert "delta = 0.300 ns/B" in str(d)
    with pytest.raises(ValueError, match="delta"):
        cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0, delta=-1.0)


def test_every_algorithm_has_a_prediction():
    for c, algs in comm.ALGORITHMS.items():
        for alg in algs:
            for p in (2, 3, 4, 5):
                t = M.predict(c, alg, 1 << 16, p)
                assert t > 0 and math.isfinite(t), (c, alg, p)


def test_crossover_recursive_doubling_to_ring():
    a, b, g = M.alpha, M.beta, M.gamma
    x = cost.crossover("all_reduce", "recursive_doubling", "ring", 4, M)
    assert x == pytest.approx(4 * a / (0.5 * b + 1.25 * g), rel=1e-6, abs=1)
    below, above = int(x * 0.9), int(x * 1.1)
    assert M.predict("all_reduce", "recursive_doubling", below, 4) < M.predict("all_reduce", "ring", below, 4)
    assert M.predict("all_reduce", "ring", above, 4) < M.predict("all_reduce", "recursive_doubling", above, 4)
    # at p = 2 both send the vector once; the ring wins only by reducing half of it: from 2a/g up
    assert cost.crossover("all_reduce", "recursive_doubling", "ring", 2, M) == pytest.approx(2 * a / g, abs=1)
    # recursive doubling is faster than the ring only below 2a/g: not from any size on
    assert cost.crossover("all_reduce", "ring", "recursive_doubling", 2, M) == math.inf
    assert cost.crossover("broadcast", "flat", "binomial", 4, M) == 1.0  # never slower: lo
    # a jagged measured curve that dips below the crossing and back still gives the last crossing
    jag = cost.CostModel(alpha=M.alpha, beta=M.beta, gamma=M.gamma, tables={"exchange": [
        (1e3, 1e-4), (1e5, 1e-4), (2e5, 5e-5), (4e5, 4e-4), (1e7, 1e-2)]})
    x = cost.crossover("all_reduce", "recursive_doubling", "ring", 4, jag)
    sizes = [int(x * f) for f in (1.01, 2, 10, 100)]
    assert all(jag.predict("all_reduce", "ring", n, 4) <= jag.predict("all_reduce", "recursive_doubling", n, 4)
               for n in sizes)
    assert jag.predict("all_reduce", "ring", int(x * 0.99), 4) > jag.predict("all_reduce", "recursive_doubling", int(x * 0.99), 4)
    assert cost.crossover("broadcast", "binomial", "flat", 4, M) == math.inf  # flat never catches up


def test_cost_bad_input():
    with pytest.raises(ValueError, match="algorithm='nosuch'"):
        M.predict("all_reduce", "nosuch", 8, 2)
    with pytest.raises(ValueError, match="collective='all_to_all'"):
        M.predict("all_to_all", "ring", 8, 2)
    with pytest.raises(ValueError, match="world_size"):
        M.predict("all_reduce", "ring", 8, 0)
    with pytest.raises(ValueError, match="beta"):
        cost.CostModel(alpha=0.0, beta=-1.0, gamma=0.0)
    with pytest.raises(TypeError, match="model"):
        cost.predict("all_reduce", "ring", 8, 2, model=None)


def test_fit_line_recovers_a_line():
    pts = [(x, 3e-5 + 2e-9 * x) for x in (8, 1024, 1 << 16, 1 << 20, 1 << 24)]
    alpha, beta = cost.fit_line(pts)
    assert alpha == pytest.approx(3e-5, rel=1e-6) and beta == pytest.approx(2e-9, rel=1e-6)
    with pytest.raises(ValueError, match="at least 2"):
        cost.fit_line([(8, 1.0)])


def _fit_tiny():
    return probes.fit(pingpong_sizes=(8, 4096, 1 << 18), reduction_sizes=(1 << 16, 1 << 18, 1 << 20),
                      exchange_sizes=(1 << 12, 1 << 16))


def test_fit_on_ranks_and_compare():
    res = workbench.launch(_fit_tiny, 2, timeout=120)
    a, b = res
    assert a["model"] == b["model"]  # every rank returns rank 0's fit
    model = a["model"]
    assert [n for n, _ in a["pingpong"]] == [8, 4096, 1 << 18] and all(t > 0 for _, t in a["pingpong"])
    assert [n for n, _ in a["reduction"]] == [1 << 16, 1 << 18, 1 << 20] and all(t > 0 for _, t in a["reduction"])
    # the model is the relative-error line through exactly these points (no timing figure asserted)
    assert (model.alpha, model.beta) == cost.fit_line(a["pingpong"])
    assert model.gamma == cost.fit_line(a["reduction"])[1]
    assert [n for n, _ in a["exchange"]] == [1 << 12, 1 << 16]
    assert (model.alpha_duplex, model.beta_duplex) == cost.fit_line(a["exchange"])
    # the measured curves are the very points timed, and the stream covers the ping-pong's sizes
    assert [n for n, _ in a["stream"]] == [8, 4096, 1 << 18] and all(t > 0 for _, t in a["stream"])
    assert model.tables["one_way"] == [(float(n), t) for n, t in a["stream"]]
    assert model.tables["exchange"] == [(float(n), t) for n, t in a["exchange"]]
    assert model.tables["copy"] == [(float(n), t) for n, t in a["copy"]]
    assert model.delta == cost.fit_line(a["copy"])[1]  # (fewer than 2 copies of 1 MiB or more: all of them)
    assert 0 < model.overhead < 0.01 and model.overhead == statistics.median(model.overheads.values())
    assert model.predict("all_reduce", "ring", 1 << 16, 2) - model.overheads["all_reduce/ring"] == pytest.approx(
        2 * model.exchange(1 << 15) + model.reduction(1 << 15))
    assert model.exchange(1 << 12) == pytest.approx(a["exchange"][0][1])
    rows = cost.compare(model, [{"collective": "all_reduce", "algorithm": "ring", "bytes": 1 << 20,
                                 "world_size": 2, "time_s": 1e-3}])
    pred = model.predict("all_reduce", "ring", 1 << 20, 2)
    assert rows[0]["predicted_s"] == pred and rows[0]["error"] == pytest.approx(pred / 1e-3 - 1)


def _fit_quick():
    """probes.fit(iterations=3, repeats=2), recording what each probe it calls was asked for."""
    seen, real = [], {n: getattr(probes, n) for n in ("pingpong", "exchange", "stream", "call_overheads")}

    def recording(name, fn):
        def probe(*args, **kwargs):
            seen.append((name, kwargs.get("iterations", kwargs.get("calls")), kwargs["repeats"]))
            return fn(*args, **kwargs)
        return probe

    for name, fn in real.items():
        setattr(probes, name, recording(name, fn))
    try:
        fitted = probes.fit(pingpong_sizes=(8, 4096), reduction_sizes=(1 << 16, 1 << 18),
                            exchange_sizes=(1 << 12, 1 << 16), iterations=3, repeats=2)
    finally:
        for name, fn in real.items():
            setattr(probes, name, fn)
    return seen, fitted["model"].beta


def test_fit_takes_its_iterations_and_repeats():
    """Every probe of a quick fit runs ``iterations`` messages (the call overheads twice as many
    calls) ``repeats`` times; bad counts are refused before any message is sent."""
    seen, beta = workbench.launch(_fit_quick, 2, timeout=120)[0]
    assert seen == [("pingpong", 3, 2), ("exchange", 3, 2), ("stream", 3, 2), ("call_overheads", 6, 2)], seen
    assert beta is not None
    for bad in (dict(iterations=0), dict(repeats=-1), dict(iterations=2.5), dict(repeats=True)):
        with pytest.raises(ValueError, match=f"fit\\({next(iter(bad))}="):
            probes.fit(**bad)


def test_measured_curves_price_each_step_at_the_size_it_sends():
    ex = [(1000.0, 1e-4), (3000.0, 5e-4)]  # 2e-7 s per byte between the points
    d = cost.CostModel(alpha=M.alpha, beta=M.beta, gamma=M.gamma,
                       tables={"exchange": ex, "one_way": [(8, 1e-5), (1 << 30, 2.0)]}, overhead=3e-5)
    assert d.exchange(2000) == pytest.approx(3e-4)  # between the points: interpolated
    assert d.exchange(4000) == pytest.approx(7e-4)  # beyond them: the end segment continues
    assert d.exchange(0) == 0.0  # never negative
    # ring all-reduce on 2 ranks of 4000 B: two exchange steps of 2000 B, a reduction, the overhead
    assert d.predict("all_reduce", "ring", 4000, 2) == pytest.approx(2 * 3e-4 + 2000 * M.gamma + 3e-5)
    # recursive doubling sends the whole 4000 B once; torch's own code pays no workbench overhead
    assert d.predict("all_reduce", "recursive_doubling", 4000, 2) == pytest.approx(7e-4 + 4000 * M.gamma + 3e-5)
    assert d.predict("all_reduce", "native", 4000, 2) == pytest.approx(2 * 3e-4 + 2000 * M.gamma)
    per = cost.CostModel(alpha=M.alpha, beta=M.beta, gamma=M.gamma, tables={"exchange": ex}, overhead=3e-5,
                         overheads={"all_reduce/ring": 1e-3})
    assert per.predict("all_reduce", "ring", 4000, 2) == pytest.approx(2 * 3e-4 + 2000 * M.gamma + 1e-3)
    assert per.predict("all_reduce", "rabenseifner", 4000, 2) == pytest.approx(2 * 3e-4 + 2000 * M.gamma + 3e-5)
    with pytest.raises(ValueError, match="overheads"):
        cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0, overheads={"all_reduce/ring": -1.0})
    more = cost.with_curves(d, exchange=[(2000, 1e-3)])
    assert more.exchange(2000) == pytest.approx(1e-3) and more.exchange(1000) == pytest.approx(1e-4)
    assert d.exchange(2000) == pytest.approx(3e-4)  # the original is unchanged
    with pytest.raises(ValueError, match="not primitives"):
        cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0, tables={"latency": ex})
    with pytest.raises(ValueError, match="at least 2"):
        cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0, tables={"exchange": ex[:1]})
    with pytest.raises(ValueError, match="overhead"):
        cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0, overhead=-1.0)


def _probe_on_three_ranks():
    out = {}
    for kind in probes.Probe.KINDS:
        probe = probes.Probe(kind, 4096)
        probe()
        out[kind] = (probe.peer, probe.comm.bytes_sent if probe.comm else 0, probe.comm.bytes_received if probe.comm else 0)
    return out, probes.call_overheads(calls=3, repeats=2)


def test_probe_runs_between_ranks_0_and_1_only():
    res = workbench.launch(_probe_on_three_ranks, 3, timeout=120)
    (r0, o0), (r1, o1), (r2, o2) = res
    assert r0 == {"exchange": (1, 4096, 4096), "one_way": (1, 4096, 0)}
    assert r1 == {"exchange": (0, 4096, 4096), "one_way": (0, 0, 4096)}
    assert r2 == {"exchange": (None, 0, 0), "one_way": (None, 0, 0)}  # the third rank sends nothing
    assert o0 == o1 == o2  # the slowest rank's overheads, on every rank
    assert set(o0) == {f"{c}/{a}" for c, algs in comm.ALGORITHMS.items() for a in algs if a != "native"}
    assert all(0 < t < 0.01 for t in o0.values())
    with pytest.raises(ValueError, match="kind='broadcast'"):
        probes.Probe("broadcast", 8)


def _probes_all_pairs_and_faults():
    out = {}
    for kind in probes.Probe.KINDS:
        probe = probes.Probe(kind, 4096, all_pairs=True)
        probe()
        out[kind] = (probe.peer, probe.comm.bytes_sent if probe.comm else 0, probe.comm.bytes_received if probe.comm else 0)
    ex = probes.exchange([1024, 4096], iterations=2, repeats=1, all_pairs=True)
    faults = bc.page_faults(["all_gather"], {"all_gather": ["native", "ring"]}, 1 << 16, calls=2)
    return out, ex, faults


def test_all_pairs_probes_pair_every_rank_and_page_faults_are_counted():
    res = workbench.launch(_probes_all_pairs_and_faults, 3, timeout=120)
    (r0, ex0, f0), (r1, ex1, f1), (r2, ex2, f2) = res
    assert r0 == {"exchange": (1, 4096, 4096), "one_way": (1, 4096, 0)}
    assert r1 == {"exchange": (0, 4096, 4096), "one_way": (0, 0, 4096)}
    assert r2 == {"exchange": (None, 0, 0), "one_way": (None, 0, 0)}  # odd rank out: no partner
    assert ex0 == ex1 == ex2 and [n for n, _ in ex0] == [1024, 4096] and all(t > 0 for _, t in ex0)
    assert f0 == f1 == f2 and [(f["collective"], f["algorithm"]) for f in f0] == [("all_gather", "native"),
                                                                              ("all_gather", "ring")]
    for f in f0:  # no timing figure asserted: counts are counts, times are positive
        assert f["faults_per_call"] >= 0 and f["time_s"] > 0 and f["fault_s"] >= 0
        assert f["faulting_s"] == pytest.approx(f["faults_per_call"] * f["fault_s"])
        assert f["bytes"] == (1 << 16) // 12 * 12  # 3 ranks of whole float32 elements


def _gloo_structure():
    return bc.gloo_structure(1 << 20, calls=2, trials=2)


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="bytes sent are read from Linux's /proc/self/io")
def test_gloo_structure_counts_the_bytes_each_variant_sends():
    """gloo's reduce-scatter is one all-reduce per block: twice the ring's bytes on the wire (exact
    counts of socket writes); its all-gather sends what the ring sends; the rebuilt structures send
    what gloo's own calls send."""
    rows = workbench.launch(_gloo_structure, 2, timeout=120)[0]
    by = {(r["collective"], r["variant"]): r for r in rows}
    assert list(by) == [("all_gather", "native"), ("all_gather", "ring"), ("all_gather", "ring as torch runs gloo's"),
                        ("reduce_scatter", "native"), ("reduce_scatter", "ring"),
                        ("reduce_scatter", "one native all-reduce per block")]
    shard = (1 << 20) // 2  # bytes each rank contributes
    for r in rows:
        assert r["time_s"] > 0 and r["faults_per_call"] >= 0 and r["bytes"] == 1 << 20
        # the payload, plus a few bytes of gloo's headers
        assert r["sent_bytes"] >= shard * (2 if r["variant"] in ("native", "one native all-reduce per block")
                                           and r["collective"] == "reduce_scatter" else 1), r
    ag = [by[("all_gather", v)]["sent_bytes"] for v in ("native", "ring", "ring as torch runs gloo's")]
    assert max(ag) < 1.05 * shard, ag
    rs = {v: by[("reduce_scatter", v)]["sent_bytes"] for v in ("native", "ring", "one native all-reduce per block")}
    assert rs["ring"] < 1.05 * shard and rs["native"] >= 2 * shard and rs["one native all-reduce per block"] >= 2 * shard, rs
