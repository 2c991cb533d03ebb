"""The emulated cluster (``comm.Topology``, ``comm.Link``, ``launch(topology=)``), the hierarchical
collectives, the cost model under a topology, ``bench collectives --topology`` and hybrid sharding
(against one process and against PyTorch's HSDP, FSDP2 on a 2-D mesh), at 4 ranks.

One 4-rank launch (2 emulated nodes x 2 ranks) checks the hierarchical algorithms against
``torch.distributed`` (called directly: our ``native`` is refused across slowed links), the split
of the counters by link class, that messages are held back at least ``latency + bytes/bandwidth``
(a lower bound, which load cannot break), and the errors. Timing *ratios* are the benchmark's job.
"""
from __future__ import annotations

import argparse
import copy
import time

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.apps.bench import collectives as bc
from workbench.comm import Link, Topology, cost

R = dist.ReduceOp
INTRA, INTER = Link(1e-3, 100e6), Link(2e-3, 10e6)  # far above this machine's floor (~40 us, GB/s)
TOPO = Topology(2, intra=INTRA, inter=INTER)


# ----------------------------------------------------------------------------- no launch needed

def test_link_and_topology_refuse_bad_values():
    with pytest.raises(ValueError, match="latency_s"):
        Link(-1, 1e6)
    with pytest.raises(ValueError, match="bandwidth_Bps=0"):
        Link(1e-3, 0)
    with pytest.raises(ValueError, match="ranks_per_node"):
        Topology(0, inter=INTER)
    with pytest.raises(TypeError, match="inter"):
        Topology(2, inter=(1e-3, 1e6))
    with pytest.raises(ValueError, match="multiple of 2"):
        TOPO.check_world(3)


def test_spec_strings_and_presets():
    spec = Topology.parse("ranks_per_node=2, intra=1ms@100MB/s, inter=2ms@80Mb/s")
    assert spec == Topology(2, intra=Link(1e-3, 100e6), inter=Link(2e-3, 10e6))  # 80 Mb/s = 10 MB/s
    assert Topology.parse(str(spec)) == spec
    assert Topology.parse("ranks_per_node=4") == Topology(4)  # a layout, nothing slowed
    assert not Topology(4).emulated and TOPO.emulated
    for name, real in comm.topology.PRESETS.items():
        assert real.ranks_per_node == 8
        slow = Topology.preset(name, ranks_per_node=2)
        assert Topology.parse(str(slow)) == slow
        assert Topology.parse(f"{name},ranks_per_node=2") == slow
        # slowed by one factor: the link ratio and each link's latency x bandwidth are the real ones
        assert slow.intra.bandwidth_Bps / slow.inter.bandwidth_Bps == pytest.approx(
            real.intra.bandwidth_Bps / real.inter.bandwidth_Bps)
        for a, b in ((slow.intra, real.intra), (slow.inter, real.inter)):
            assert a.latency_s == pytest.approx(b.latency_s * comm.topology.SLOWDOWN)
            assert a.latency_s * a.bandwidth_Bps == pytest.approx(b.latency_s * b.bandwidth_Bps)
    assert Topology.preset("nvlink-3.2tbps", slowdown=1).inter.bandwidth_Bps == 50e9  # 3.2 Tb/s over 8 GPUs
    for bad, match in (("ranks_per_node=2,inter=fast", "LATENCY@BANDWIDTH"), ("nosuch", "not a preset"),
                       ("ranks_per_node=2,inter=1ms@lots", "not a rate"), ("intra=1ms@1MB/s", "ranks_per_node"),
                       ("ranks_per_node=2,colour=red", "colour"), ("", "empty")):
        with pytest.raises(ValueError, match=match):
            Topology.parse(bad)


def _never_called():
    raise AssertionError("no rank may start")


def test_launch_refuses_a_bad_topology_before_starting(monkeypatch):
    monkeypatch.setenv("WORKBENCH_TOPOLOGY", "ranks_per_node=2,inter=soon")
    with pytest.raises(ValueError, match="WORKBENCH_TOPOLOGY"):
        workbench.launch(_never_called, world_size=2)
    monkeypatch.delenv("WORKBENCH_TOPOLOGY")
    with pytest.raises(ValueError, match="multiple of 2"):
        workbench.launch(_never_called, world_size=3, topology=TOPO)
    with pytest.raises(TypeError, match="topology"):
        workbench.launch(_never_called, world_size=2, topology=42)


def test_cost_model_prices_each_message_on_its_link():
    none = cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0)  # the machine costs nothing: links only
    n, p = 1 << 20, 4
    # flat ring: the slow link's queue sets the pace (6 messages back to back, one latency at the
    # end); hierarchical: phases on their own links
    assert cost.predict("all_reduce", "ring", n, p, none, topology=TOPO) == pytest.approx(
        6 * (n / 4) / INTER.bandwidth_Bps + INTER.latency_s)
    assert cost.predict("all_gather", "ring", n, p, none, topology=TOPO) == pytest.approx(
        3 * (n / 4) / INTER.bandwidth_Bps + INTER.latency_s)
    assert cost.predict("all_reduce", "hierarchical", n, p, none, topology=TOPO) == pytest.approx(
        2 * INTRA.time(n / 2) + 2 * INTER.time(n / 4))
    assert cost.predict("all_gather", "hierarchical", n, p, none, topology=TOPO) == pytest.approx(
        INTER.time(n / 4) + INTRA.time(n / 2))
    assert cost.predict("reduce_scatter", "hierarchical", n, p, none, topology=TOPO) == pytest.approx(
        INTRA.time(n / 2) + INTER.time(n / 4))
    # one node: nothing crosses the slow link
    assert cost.predict("all_reduce", "ring", n, 2, none, topology=TOPO) == pytest.approx(2 * INTRA.time(n / 2))
    with pytest.raises(ValueError, match="topology"):
        cost.predict("all_reduce", "hierarchical", n, p, none)


def _parse(argv):
    parser = argparse.ArgumentParser()
    bc.add_arguments(parser)
    return parser.parse_args(argv)


def test_bench_configure_under_a_topology():
    config = bc.configure(_parse(["--world-size", "4", "--topology", str(TOPO)]))
    assert config["collectives"] == ["all_reduce", "all_gather", "reduce_scatter"]
    for c in config["collectives"]:
        assert "native" not in config["algorithms"][c]  # cannot be slowed down
        assert config["algorithms"][c][0] == "ring" and "hierarchical" in config["algorithms"][c]
    layout_only = bc.configure(_parse(["--world-size", "4", "--topology", "ranks_per_node=2"]))
    assert layout_only["algorithms"]["all_reduce"][0] == "native"  # nothing slowed: native runs
    with pytest.raises(ValueError, match="--topology"):
        bc.configure(_parse(["--algorithms", "hierarchical"]))
    with pytest.raises(ValueError, match="multiple of 2"):
        bc.configure(_parse(["--world-size", "3", "--topology", str(TOPO)]))
    rows = [{"collective": "all_reduce", "algorithm": a, "bytes": 1 << 20, "world_size": 4,
             "in-place": {"time_s": t}} for a, t in (("ring", 0.06), ("hierarchical", 0.03))]
    none = cost.CostModel(alpha=0.0, beta=0.0, gamma=0.0)
    [s] = bc.speedups(rows, none, TOPO)
    assert s["measured"] == pytest.approx(2.0)
    assert s["predicted"] == pytest.approx((6 * (1 << 18) / INTER.bandwidth_Bps + INTER.latency_s)
                                           / (2 * INTRA.time(1 << 19) + 2 * INTER.time(1 << 18)))
    assert "measured x" in bc.speedup_table([s])


# ------------------------------------------------------------------------ 2 emulated nodes x 2

def _data(k: int, rank: int, shape, dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * k + rank)
    return torch.randint(-4, 5, tuple(shape), generator=g).to(dtype)


def _on_emulated_cluster():
    from workbench.comm.group import Comm, resolve_group

    me, p = dist.get_rank(), dist.get_world_size()
    bad: list[str] = []
    shapes = [(0,), (1,), (5,), (17,), (2, 3)]
    cases = [(dtype, op) for dtype in (torch.float32, torch.int64) for op in ("SUM", "MAX")] + \
            [(torch.float32, "AVG")]
    k = 0
    for dtype, op in cases:
        for shape in shapes:
            k += 1
            x = _data(k, me, shape, dtype)
            noncontig = len(shape) == 2
            # all-reduce (in place, non-contiguous when 2-D)
            got = x.t().contiguous().t() if noncontig else x.clone()
            want = x.clone()
            dist.all_reduce(want, op=getattr(R, op))
            comm.all_reduce(got, op=getattr(R, op), algorithm="hierarchical")
            if not torch.allclose(got.double(), want.double()):
                bad.append(f"all_reduce {op} {dtype} {shape}: {got} != {want}")
            # reduce-scatter: every rank's p blocks
            ins = [_data(k, 10 * me + i, shape, dtype) for i in range(p)]
            kept = [t.clone() for t in ins]
            out, ref = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            if op != "AVG":
                dist.reduce_scatter(ref, [t.clone() for t in ins], op=getattr(R, op))
            else:
                dist.reduce_scatter(ref, [t.clone() for t in ins], op=R.SUM)
                ref /= p
            comm.reduce_scatter(out, ins, op=getattr(R, op), algorithm="hierarchical")
            if not torch.allclose(out.double(), ref.double()) or not all(map(torch.equal, ins, kept)):
                bad.append(f"reduce_scatter {op} {dtype} {shape}: {out} != {ref}")
        # all-gather
        x = _data(k, me, (7,), dtype)
        outs, refs = [torch.zeros(7, dtype=dtype) for _ in range(p)], [torch.zeros(7, dtype=dtype) for _ in range(p)]
        dist.all_gather(refs, x)
        comm.all_gather(outs, x, algorithm="hierarchical")
        if not all(map(torch.equal, outs, refs)):
            bad.append(f"all_gather {dtype}: {outs} != {refs}")

    # a group with one rank per node (L = 1, N = 2) works; one with 2 + 1 ranks is refused
    column = dist.new_group([0, 2])
    uneven = dist.new_group([0, 1, 2])
    if me in (0, 2):
        t = torch.full((5,), float(me))
        comm.all_reduce(t, group=column, algorithm="hierarchical")
        if not torch.equal(t, torch.full((5,), 2.0)):
            bad.append(f"column group: {t}")
    errors = {}
    if me in (0, 1, 2):
        try:
            comm.all_reduce(torch.ones(3), group=uneven, algorithm="hierarchical")
        except ValueError as e:
            errors["uneven"] = str(e)

    # counters split by link class: per rank, n bytes of all-reduce, m per rank of all-gather
    n, m = 4096 * 4, 1024 * 4
    with comm.counters() as c:
        comm.all_reduce(torch.ones(4096), algorithm="hierarchical")
        comm.all_reduce(torch.ones(4096), algorithm="ring")
        comm.all_gather([torch.zeros(1024) for _ in range(p)], torch.ones(1024), algorithm="hierarchical")
        comm.reduce_scatter(torch.zeros(1024), [torch.ones(1024) for _ in range(p)], algorithm="hierarchical")
    links = {key: {cls: (s.bytes_sent, s.bytes_received, s.messages) for cls, s in stat.links.items()}
             for key, stat in c.stats.items()}
    waited = {cls: s.seconds for cls, s in c.by_link().items()}
    table = c.table()

    # messages are held back: at least latency + bytes / bandwidth, queued on a busy link
    view = resolve_group(None)
    held = {}
    buf = torch.zeros(300_000, dtype=torch.uint8)
    for name, peer in (("intra", me ^ 1), ("inter", me ^ 2)):
        early = comm.emulation.lateness()  # a sender dates its messages this much earlier
        start = time.perf_counter()  # before the barrier: the sender cannot send before this
        dist.barrier()
        c2 = Comm(view)
        if me < peer:
            hs = [c2.isend(buf, peer), c2.isend(buf, peer)]
        else:
            hs = [c2.irecv(torch.empty_like(buf), peer), c2.irecv(torch.empty_like(buf), peer)]
        for h in hs:
            h.wait()
        held[name] = ("send" if me < peer else "recv", time.perf_counter() - start, early)

    # algorithm="native" across slowed links runs the ring gloo uses (held back), with a warning
    import warnings

    t = torch.full((6,), float(me))
    with warnings.catch_warnings(record=True) as caught, comm.counters() as native:
        warnings.simplefilter("always")
        comm.all_reduce(t)
    errors["native"] = (torch.equal(t, torch.full((6,), 6.0)), [str(w.message) for w in caught],
                        sorted(native.stats), sorted(native.by_link()))
    # without a topology, hierarchical is refused clearly
    comm.emulate(None)
    try:
        comm.all_reduce(torch.ones(3), algorithm="hierarchical")
    except ValueError as e:
        errors["none"] = str(e)
    return {"bad": bad, "links": links, "waited": waited, "table": table, "held": held, "errors": errors,
            "n": n, "m": m}


@pytest.fixture(scope="module")
def cluster():
    return workbench.launch(_on_emulated_cluster, world_size=4, topology=TOPO, timeout=180)


def test_hierarchical_matches_torch(cluster):
    for rank, out in enumerate(cluster):
        assert out["bad"] == [], (rank, out["bad"][:3])
        if rank in (0, 1, 2):
            assert "same number of the group's ranks on every node" in out["errors"]["uneven"]


def test_counters_split_by_link_class(cluster):
    for rank, out in enumerate(cluster):
        n, m, links = out["n"], out["m"], out["links"]
        # hierarchical all-reduce: n/2 reduce-scattered and n/2 gathered inside, n/4 each way across
        assert links[("all_reduce", "hierarchical")] == {"intra": (n, n, 2), "inter": (n // 2, n // 2, 2)}
        # flat ring 0 -> 1 -> 2 -> 3 -> 0: ranks 1 and 3 send across nodes, 0 and 2 receive from across
        ring = links[("all_reduce", "ring")]
        sends, receives = ("inter", "intra") if rank % 2 else ("intra", "inter")
        assert ring[sends][0] == 3 * n // 2 and ring[receives][1] == 3 * n // 2 and ring[sends][2] == 6
        assert ring[sends][1] == 0 and ring[receives][0] == 0
        # all-gather: own block across (m), then the column's 2 blocks inside; reduce-scatter mirrors it
        assert links[("all_gather", "hierarchical")] == {"inter": (m, m, 1), "intra": (2 * m, 2 * m, 1)}
        assert links[("reduce_scatter", "hierarchical")] == {"intra": (2 * m, 2 * m, 1), "inter": (m, m, 1)}
        assert out["waited"]["inter"] > 0 and "by link class" in out["table"]


def test_messages_are_held_back(cluster):
    # two 300 kB messages queued on one link: the second arrives after latency + 2 x 300 kB /
    # bandwidth; the sender is done when both have left (2 x 300 kB / bandwidth). The sender dates
    # its messages back by how late its last wake-up was (emulation.py, "Late wake-ups").
    for rank, out in enumerate(cluster):
        for name, link, sender in (("intra", INTRA, rank & ~1), ("inter", INTER, rank & ~2)):
            role, seconds, _ = out["held"][name]
            least = 6e5 / link.bandwidth_Bps + (link.latency_s if role == "recv" else 0.0)
            assert seconds >= least - cluster[sender]["held"][name][2], (rank, name, role, seconds, least)


def test_native_runs_held_back_and_hierarchical_needs_a_topology(cluster):
    for out in cluster:
        right, warned, keys, links = out["errors"]["native"]
        assert right and keys == [("all_reduce", "ring")] and links == ["inter", "intra"]
        assert len(warned) == 1 and "algorithm='ring'" in warned[0] and "cannot be held back" in warned[0]
        assert "needs a topology" in out["errors"]["none"]


def _idle():
    return None


def test_links_faster_than_the_machine_are_refused():
    fast = Topology(1, inter=Link(1e-9, 1e15))
    with pytest.raises(workbench.RankFailed, match=r"faster than this machine.*best of 4 measurements"):
        workbench.launch(_idle, world_size=2, topology=fast, timeout=60)


def _emulate_after_a_busy_first_measurement():
    """The first floor measured as on a loaded machine (4 ms, 90 MB/s: slower than the link asked
    for), the next as the machine can go: emulate() measures again before refusing, and keeps the best."""
    from workbench.comm import emulation

    floors = iter([Link(4e-3, 90e6), Link(40e-6, 2e9)])
    emulation.measure_floor = lambda repeats=20: next(floors)  # this rank's process only
    floor = comm.emulate(Topology(1, inter=Link(500e-6, 200e6)))
    comm.emulate(None)
    return floor


def test_a_link_is_refused_only_after_the_floor_is_measured_again():
    floors = workbench.launch(_emulate_after_a_busy_first_measurement, world_size=2, timeout=60)
    assert floors == [Link(40e-6, 2e9)] * 2


# ---------------------------------------------------------------------------------------- HSDP
# against one process on the global batch, and against PyTorch's HSDP (FSDP2 on a 2-D mesh)

def _hsdp_parity():
    from workbench.models import GPT, GPTConfig
    from workbench.parallel import FullyShardedDataParallel

    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny"))
    node, column = comm.node_groups(Topology(2))
    model = FullyShardedDataParallel(copy.deepcopy(base), process_group=node, replicate_group=column)
    ref = copy.deepcopy(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    me, world = dist.get_rank(), dist.get_world_size()
    losses = []
    for _ in range(3):
        x = torch.randint(0, 65, (8, 16), generator=g)
        y = torch.randint(0, 65, (8, 16), generator=g)
        b = 8 // world
        loss = model(x[me * b:(me + 1) * b], y[me * b:(me + 1) * b])[1]
        loss.backward()
        ref_loss = ref(x, y)[1]
        ref_loss.backward()
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(abs(mean.item() / world - ref_loss.item()))
    full = model.full_state_dict()
    want = {k: v.detach() for k, v in ref.state_dict().items()}
    diff = max((full[k] - want[k]).abs().max().item() for k in want)
    theirs, moved = _torch_hsdp(base, g_seed=1)
    torch_diff = max((full[k] - theirs[k]).abs().max().item() for k in want)
    shard = sum(p.numel() for p in model.parameters())
    errors = []
    for kwargs in ({"replicate_group": column}, {"process_group": node, "replicate_group": node}):
        try:
            FullyShardedDataParallel(copy.deepcopy(base), **kwargs)
        except ValueError as e:
            errors.append(str(e))
    return {"losses": losses, "diff": diff, "shard": shard, "psi": base.num_parameters(), "errors": errors,
            "replicas": model.replicate_size, "shard_world": model.world_size, "torch_diff": torch_diff,
            "moved": moved}


def _torch_hsdp(base, g_seed: int):
    """PyTorch's HSDP: FSDP2 ``fully_shard`` on a 2-D mesh (replicate across nodes, shard inside),
    trained on the same batches; returns its full state dict and how far it moved from ``base``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    theirs = copy.deepcopy(base)
    for block in theirs.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(theirs, mesh=mesh)
    opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, eps=1e-5, weight_decay=0.1)
    g = torch.Generator().manual_seed(g_seed)
    me, world = dist.get_rank(), dist.get_world_size()
    for _ in range(3):
        x = torch.randint(0, 65, (8, 16), generator=g)
        y = torch.randint(0, 65, (8, 16), generator=g)
        b = 8 // world
        theirs(x[me * b:(me + 1) * b], y[me * b:(me + 1) * b])[1].backward()
        opt.step()
        opt.zero_grad()
    full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    start = base.state_dict()
    return full, max((full[k] - start[k]).abs().max().item() for k in full)


def test_hybrid_sharding_matches_single_process_and_torch():
    for out in workbench.launch(_hsdp_parity, world_size=4, timeout=180):
        assert max(out["losses"]) <= 1e-5 and out["diff"] <= 1e-5, out
        assert out["torch_diff"] <= 1e-6 and out["moved"] > 1e-4, out  # against FSDP2 on a 2-D mesh
        assert (out["shard_world"], out["replicas"]) == (2, 2)
        assert out["psi"] / 2 <= out["shard"] < out["psi"] / 2 + 5  # sharded inside a node only
        assert "needs process_group" in out["errors"][0] and "in common" in out["errors"][1]


# ------------------------------------------------------------------------------- under torchrun

TORCHRUN_SCRIPT = '''
import torch, workbench
from workbench import comm

def main():
    topo = comm.emulation.current()
    t = torch.full((1000,), float(workbench.rank() + 1))
    with comm.counters() as c:
        comm.all_reduce(t, algorithm="hierarchical")
    inter = c.by_link()["inter"]
    ok = topo == comm.Topology(1, inter=comm.Link(1e-3, 50e6)) and torch.equal(t, torch.full((1000,), 3.0)) \\
        and inter.bytes_sent == 4000 and "intra" not in c.by_link()
    print("topology ok" if ok else f"topology wrong: {topo} {t[:3]} {c.table()}")

workbench.launch(main, world_size=2)
'''


def test_scripts_under_torchrun_read_the_environment(tmp_path):
    import os
    import subprocess
    import sys

    script = tmp_path / "topo_script.py"
    script.write_text(TORCHRUN_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", WORKBENCH_TOPOLOGY="ranks_per_node=1,inter=1ms@50MB/s")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.count("topology ok") == 2, proc.stdout[-3000:]


def test_bench_collectives_cli_under_a_topology(tmp_path, capsys):
    import json

    argv = ["--world-size", "4", "--topology", str(TOPO), "--collectives", "all_reduce", "--min-bytes", "4K",
            "--max-bytes", "4K", "--trials", "1", "--iters", "1", "--warmup", "0", "--out", str(tmp_path)]
    assert bc.main(_parse(argv)) == 0
    printed = capsys.readouterr().out
    assert "# topology ranks_per_node=2" in printed and "x ring" in printed and "x native" not in printed
    assert "hierarchical against ring" in printed
    data = json.loads((tmp_path / "results.json").read_text())
    assert {r["algorithm"] for r in data["rows"]} >= {"ring", "hierarchical"}
    assert all(r[p]["wrong"] == 0 for r in data["rows"] for p in bc.PLACEMENTS)
    assert [s["bytes"] for s in data["speedups"]] == [4096]


def test_of_group_sees_its_ranks_per_node():
    topo = Topology(4, inter=Link(1e-3, 50e6))
    assert topo.of_group([0, 1, 2, 3]).ranks_per_node == 4      # one node
    assert topo.of_group([0, 4]).ranks_per_node == 1            # one rank per node
    assert topo.of_group([2, 3, 4, 5]).ranks_per_node == 2      # two on each of two nodes
    assert topo.of_group([0, 1, 2, 4], uneven="slowest").ranks_per_node == 1
    with pytest.raises(ValueError, match="unevenly"):
        topo.of_group([0, 1, 2, 4])
    with pytest.raises(ValueError, match="uneven="):
        topo.of_group([0, 1], uneven="fast")
