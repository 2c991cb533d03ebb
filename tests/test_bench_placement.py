"""``workbench bench placement``: tensor parallelism placed inside a node against across nodes.

No timing is asserted. One tiny run (two 4-rank launches, one step per trial) checks the
machinery: each placement lays its groups out as intended, moves exactly its tensor-parallel
bytes over the link class the placement says (counted per link by ``comm.counters()``), the
data-parallel bytes (DDP's buckets and the loss) over the other, trains the same loss, and the
prediction adds the model's link time to the measured baseline.
"""
from __future__ import annotations

import argparse
import json

import pytest

from workbench.apps.bench import placement
from workbench.comm import Link, Topology
from workbench.models import GPTConfig

TOPO = Topology.parse(placement.DEFAULT_TOPOLOGY)


def test_group_topology_and_prediction_follow_the_links():
    inside = placement.group_topology(TOPO, [0, 1])
    across = placement.group_topology(TOPO, [0, 2])
    assert inside.ranks_per_node == 2 and across.ranks_per_node == 1
    with pytest.raises(ValueError, match="span"):
        placement.group_topology(TOPO, [0, 1, 2])
    cfg = GPTConfig.preset("tiny")
    calls = placement.step_collectives(cfg, 8, 2, [1 << 20])
    # tiny: 4 layers x 4 all-reduces + embedding + head + 2 loss all-reduces
    assert len(calls["tp"]) == 4 * 4 + 2 + 2 and calls["dp"] == [("all_reduce", 1 << 20), ("all_reduce", 4)]
    t_in = placement.predict_communication(calls, {"tp": [0, 1], "dp": [0, 2]}, TOPO)
    t_across = placement.predict_communication(calls, {"tp": [0, 2], "dp": [0, 1]}, TOPO)
    # a 2-rank ring all-reduce of n bytes: 2 messages of n/2, each latency + n/2 / bandwidth
    n = 4 * 4 * 64 * 64
    one = Link(500e-6, 20e6)
    assert placement.predict_communication({"tp": [("all_reduce", n)]}, {"tp": [0, 2]}, TOPO)["tp"] == \
        pytest.approx(2 * one.time(n / 2))
    assert t_across["tp"] > 2 * t_in["tp"] and t_in["dp"] > 2 * t_across["dp"]  # 10x the bandwidth, same latency


def test_bad_arguments_are_refused_before_launching():
    with pytest.raises(ValueError, match="batch=3"):
        placement.run("tiny", 3)
    with pytest.raises(ValueError, match="ranks_per_node"):
        placement.run("tiny", 4, "ranks_per_node=4,inter=500us@20MB/s")
    with pytest.raises(ValueError, match="trials=0"):
        placement.run("tiny", 4, trials=0)


@pytest.fixture(scope="module")
def result():
    return placement.run("tiny", 4, trials=1, steps=1, warmup=1, launch_kwargs={"timeout": 240})


def test_each_placement_moves_its_bytes_over_its_links(result):
    by = {r["placement"]: r for r in result["rows"]}
    assert by["inside"]["tp_group"] == [0, 1] and by["inside"]["dp_group"] == [0, 2]
    assert by["across"]["tp_group"] == [0, 2] and by["across"]["dp_group"] == [0, 1]
    # a 2-rank ring all-reduce sends its whole buffer from each rank: 4 ranks x the TP bytes
    tp_bytes = 4 * round(by["inside"]["tp_MiB"] * 2**20)
    assert by["across"]["bytes_by_link"]["inter"] == tp_bytes
    assert by["inside"]["bytes_by_link"]["intra"] == tp_bytes
    dp_bytes = by["inside"]["bytes_by_link"]["inter"]
    assert by["across"]["bytes_by_link"]["intra"] == dp_bytes > 0
    assert dp_bytes < tp_bytes
    assert by["inside"]["loss"] == pytest.approx(by["across"]["loss"], abs=1e-5)
    for r in result["rows"]:
        assert r["predicted_ms"] == pytest.approx(r["baseline_ms"] + r["tp_link_ms"] + r["dp_link_ms"])
        assert r["measured_ms"] > 0 and r["baseline_ms"] > 0
    assert by["across"]["tp_link_ms"] > by["inside"]["tp_link_ms"]
    assert result["ratio_predicted"] == pytest.approx(by["across"]["predicted_ms"] / by["inside"]["predicted_ms"])


def test_command_writes_json_and_figure(result, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(placement, "run", lambda *a, **k: result)
    parser = argparse.ArgumentParser()
    placement.add_arguments(parser)
    args = parser.parse_args(["--preset", "tiny", "--out", str(tmp_path)])
    code = placement.main(args)
    out = capsys.readouterr().out
    assert "TP across / inside nodes: measured" in out and code in (0, 1)
    saved = json.loads((tmp_path / "placement.json").read_text())
    assert saved["results"]["ratio_predicted"] == pytest.approx(result["ratio_predicted"])
    assert (tmp_path / "placement.png").stat().st_size > 0
