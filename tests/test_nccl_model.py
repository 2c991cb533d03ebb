"""The NCCL communication model of the advisor (workbench.advise.nccl) and its public evidence
(workbench.advise.published, ``workbench advise --validate-published``). Pure Python: no launch."""
from __future__ import annotations

import argparse

import pytest

from workbench.advise import cli, published, timing
from workbench.advise.cluster import Cluster
from workbench.advise.nccl import PRESETS, NcclModel, bus_factor
from workbench.advise.plan import Config
from workbench.advise.shape import ModelShape
from workbench.comm import cost
from workbench.comm.topology import Link, Topology

H100, A100 = PRESETS["dgx-h100"], PRESETS["dgx-a100"]
GB = 1e9


def test_bus_factors_are_nccl_tests():
    assert bus_factor("all_reduce", 8) == pytest.approx(2 * 7 / 8)
    for name in ("reduce_scatter", "all_gather", "all_to_all", "all_to_all_single"):
        assert bus_factor(name, 8) == pytest.approx(7 / 8)
    for name in ("broadcast", "reduce", "send_recv"):
        assert bus_factor(name, 8) == 1.0
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="scatter"):
        bus_factor("scatter", 8)
    with pytest.raises(ValueError, match="n=0"):
        bus_factor("all_reduce", 0)


def test_bus_bandwidth_grows_with_the_message_towards_the_peak():
    sizes = [2 ** k for k in range(10, 34, 2)]
    for model, collective, peak in ((H100, "all_reduce", H100.nvls_busbw), (H100, "all_gather", H100.nvlink_busbw),
                                    (A100, "all_reduce", A100.nvlink_busbw)):
        bw = [model.busbw(collective, s, 8) for s in sizes]
        assert all(b2 >= b1 for b1, b2 in zip(bw, bw[1:])), bw
        assert bw[0] < 0.05 * peak and 0.97 * peak < bw[-1] <= peak
    # the time itself: latency plus bytes over the bus bandwidth, never below either
    t = H100.time("all_gather", 1 << 30, 8)
    assert t > 7 / 8 * (1 << 30) / H100.nvlink_busbw


def test_latency_dominates_tiny_messages():
    tiny, small = H100.time("all_reduce", 8, 8), H100.time("all_reduce", 1024, 8)
    assert 5e-6 < tiny < 50e-6 and small == pytest.approx(tiny, rel=0.05)
    # across nodes a ring pays a network step per node crossed: 64 nodes cost more than 2
    assert H100.time("all_gather", 1024, 512, 8) > 5 * H100.time("all_gather", 1024, 16, 8)
    # and at many nodes a tree (log2 of the nodes) beats the ring's 2 (n - 1) steps for a medium all-reduce
    algos = H100.algorithms("all_reduce", 4 << 20, 512, 8)
    assert min(algos, key=algos.get).startswith("tree")
    large = H100.algorithms("all_reduce", 4 << 30, 16, 8)
    assert min(large, key=large.get) == "ring/simple"


def test_a_group_inside_a_node_is_priced_on_nvlink_and_across_nodes_on_the_network():
    big = 1 << 33
    inside = H100.busbw("all_gather", big, 8, 8)
    one_per_node = H100.busbw("all_gather", big, 8, 1)       # e.g. data parallelism with t = 8
    full_nodes = H100.busbw("all_gather", big, 16, 8)        # 8 ranks of each node share their 8 NICs
    assert inside == pytest.approx(H100.nvlink_busbw, rel=0.02)
    assert one_per_node == pytest.approx(H100.network_Bps, rel=0.02)
    assert full_nodes == pytest.approx(min(H100.nvlink_busbw, 8 * H100.network_Bps), rel=0.02)
    assert H100.busbw("all_gather", big, 8, 2) == pytest.approx(2 * H100.network_Bps, rel=0.02)
    # NVLS only inside a node; across nodes the all-reduce runs a ring or a tree
    assert "nvls/simple" in H100.algorithms("all_reduce", big, 8, 8)
    assert "nvls/simple" not in H100.algorithms("all_reduce", big, 16, 8)
    assert "nvls/simple" not in A100.algorithms("all_reduce", big, 8, 8)
    # point to point: NVLink inside a node, the GPU's own NIC across
    assert H100.busbw("send_recv", big, 2, 2) == pytest.approx(H100.p2p_Bps, rel=0.02)
    assert H100.busbw("send_recv", big, 2, 1) == pytest.approx(H100.network_Bps, rel=0.02)
    # all-to-all across nodes: each rank's off-node share over its own NIC
    assert H100.time("all_to_all", big, 16, 8) == pytest.approx(big * 8 / 16 / H100.network_Bps, rel=0.02)
    with pytest.raises(ValueError, match="per_node=3"):
        H100.time("all_gather", 1024, 8, 3)
    with pytest.raises(ValueError, match="nvlink_busbw"):
        NcclModel("bad", nvlink_busbw=0, network_Bps=1e9, p2p_Bps=1e9)


def test_gpu_presets_carry_nccl_and_the_advisor_prices_their_collectives_with_it():
    for name in ("dgx-h100", "p4d-a100", "a2-ultra-100g", "dgx-a100"):
        assert Cluster.preset(name).nccl is PRESETS[name]
    assert PRESETS["dgx-a100"].network_Bps > PRESETS["p4d-a100"].network_Bps > PRESETS["a2-ultra-100g"].network_Bps
    with pytest.raises(ValueError, match="nccl="):
        Cluster.preset("dgx-h100", nccl="fast")
    dgx = Cluster.preset("dgx-h100", nodes=2)
    machine, intra, inter = timing._machine(dgx)
    assert machine is H100
    topo = timing.group_topology(list(range(16)), 8, intra, inter)
    assert timing._price("all_reduce", 1 << 28, 16, machine, topo) == H100.time("all_reduce", 1 << 28, 16, 8)
    # data parallelism over two full nodes: NCCL's rings use all 8 NICs, not one ring on one NIC
    shape = ModelShape(layers=8, hidden=2048, heads=16, vocab=32000, seq=2048, ffn=8192)
    config = Config(dp=16, zero=1, precision="bf16")
    with_nccl = timing.step_time(shape, dgx, config, 32)
    without = timing.step_time(shape, dgx.with_(nccl=None), config, 32)
    assert with_nccl["compute"] == without["compute"] and with_nccl["dp"] < without["dp"]


def test_cpu_clusters_keep_the_alpha_beta_pricing():
    # no nccl: collectives priced by workbench.comm.cost on the links, as before
    cpu = Cluster(nodes=2, devices_per_node=2, memory_bytes=8e9, flops=50e9, intra=Link(1e-6, 100e9),
                  inter=Link(10e-6, 1e9))
    assert cpu.nccl is None
    machine, intra, inter = timing._machine(cpu)
    assert isinstance(machine, cost.CostModel)
    topo = Topology(2, intra=intra, inter=inter)
    assert timing._price("all_reduce", 1 << 20, 4, machine, topo) == \
        cost.predict("all_reduce", "native", 1 << 20, 4, machine, topology=topo)


def test_validate_published_prints_every_row_with_its_source(capsys):
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    rc = cli.main(parser.parse_args(["--validate-published"]))
    out = capsys.readouterr().out
    table = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert len(table) == len(published.ROWS) >= 10
    for line, row in zip(table, published.ROWS):
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1] == row.name and float(cells[4]) == pytest.approx(row.value, rel=1e-3)
        ref = int(cells[-1].strip("[]"))
        assert f"\n{ref}. {row.source}" in out
    assert "rows within 15%" in out and rc in (0, 1)
    # every training row names its layout, every source a place to read it
    assert all(r.config is not None or r.collective for r in published.ROWS)
    assert all("http" in r.source for r in published.ROWS)


def test_a_published_run_counts_only_where_it_is_also_predicted_to_fit():
    """A training row that ran is within only where the plan is predicted to fit as well; a ``fits``
    row (torchtitan's out-of-memory footnote) is within where the prediction agrees."""
    results = published.validate()
    for r in results:
        row = r["row"]
        if row.metric == "fits":
            assert r["within"] == (r["predicted"] == row.value) and r["ratio"] in (0.0, 1.0)
        elif row.config is not None and row.metric != "memory_gib" and not r["feasible"]:
            assert not r["within"], row.name
    oom = next(r for r in results if r["row"].metric == "fits" and r["row"].value == 0)
    assert not oom["feasible"] and oom["within"]
