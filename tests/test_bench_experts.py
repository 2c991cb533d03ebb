"""``workbench bench experts``: one launch at the smallest size (1 trial, 1 step), no timing asserted.

Checks the machinery: every candidate holds the parameters its layout says, the bytes counted in
one forward equal the formula of ``workbench.parallel.expert`` on every rank (native and pairwise
exactly, Bruck at least that), the tokens per expert add up to every token's k assignments, the
report prints both tables, and bad options are refused before anything is launched.
"""
from __future__ import annotations

import argparse

import pytest

import workbench
from workbench.apps.bench import experts


def test_smallest_run_counts_bytes_parameters_and_tokens():
    res = workbench.launch(experts.run, world_size=2, timeout=120,
                           kwargs=dict(batch_size=1, trials=1, steps=1, iters=1, warmup=0))[0]
    by = {r["candidate"]: r for r in res["rows"]}
    assert by["replicated"]["parameters"] == res["parameters"]
    assert by["ep-native"]["parameters"] == by["ep-bruck"]["parameters"] == res["parameters_per_rank"]
    assert res["parameters_per_rank"] < res["parameters"]
    assert experts.exact_bytes(res)
    assert all(b["bruck"] >= f > 0 for b, f in zip(res["bytes_by_rank"], res["formula_by_rank"]))
    tokens = 2 * 1 * res["block_size"] * res["top_k"]  # 2 ranks x 1 sequence, k assignments per token
    assert all(sum(b["tokens_per_expert"]) == tokens and b["dropped"] == 0 for b in res["balance"])
    assert by["replicated"]["x_replicated"] == 1.0 and by["ep-native"]["x_native"] == 1.0
    assert all(r["predicted_ms"] > 0 for r in res["all_to_all"])
    text = experts.report(res)
    assert "ep-pairwise" in text and "bruck" in text and "max/mean" in text


def test_bad_options_are_refused_before_launching():
    parser = argparse.ArgumentParser()
    experts.add_arguments(parser)
    for argv, name in [(["--experts", "3"], "--experts=3"), (["--top-k", "5"], "--top-k=5"),
                       (["--capacity-factor", "0"], "--capacity-factor=0"), (["--trials", "0"], "--trials=0")]:
        with pytest.raises(ValueError, match=name):
            experts.check_arguments(parser.parse_args(argv))
