"""The advisor's step-time formulas, and its memory predictions against runs (issue 15).

No timed test: the timing tests check formulas (the bubble's share is the schedule's, each
group's collectives are priced on the link it crosses, the FLOPs are the 6 N rule). The memory
tests run tiny configurations of the mesh at world 2 and 4 and pin the prediction to what the
ranks hold: model state exactly, activations (with buffers) within a margin.
"""
from __future__ import annotations

import math

import pytest

from workbench.advise.calibrate import CalibratedCluster
from workbench.advise.cluster import Cluster
from workbench.advise.plan import MEMORY_CATEGORIES, TIME_PARTS, Config
from workbench.advise.shape import ModelShape
from workbench.advise import timing
from workbench.comm import cost
from workbench.comm.topology import Link
from workbench.parallel.pipeline_schedules import bubble_formula

FAST, SLOW = Link(1e-6, 100e9), Link(10e-6, 1e9)


def _cluster(nodes=2, per_node=4, **kw) -> CalibratedCluster:
    """A cluster whose only costs are the ones a test looks at (no optimizer, no overheads)."""
    base = dict(nodes=nodes, devices_per_node=per_node, memory_bytes=80e9, flops=100e12, intra=FAST, inter=SLOW,
                update_s_per_param=0.0)
    base.update(kw)
    return CalibratedCluster(**base)


SHAPE = ModelShape(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024, ffn=4096, name="test")


def test_parts_add_up_and_checks():
    t = timing.step_time(SHAPE, _cluster(), Config(dp=2, tp=2, pp=2, microbatches=4), 64)
    assert set(t) == set(TIME_PARTS) | {"total"}
    assert t["total"] == pytest.approx(sum(t[k] for k in TIME_PARTS))
    assert all(t[k] >= 0 for k in TIME_PARTS)
    with pytest.raises(ValueError, match="global_batch=30"):
        timing.step_time(SHAPE, _cluster(), Config(dp=4, pp=2, microbatches=2), 30)
    with pytest.raises(ValueError, match="precision"):
        timing.step_time(SHAPE, _cluster(), Config(precision="fp8"), 8)


def test_compute_is_six_n_tokens_plus_attention():
    cl = _cluster(nodes=1, per_node=1, inter=FAST)
    t = timing.step_time(SHAPE, cl, Config(), 8)
    h, s, L, V = SHAPE.hidden, SHAPE.seq, SHAPE.layers, SHAPE.vocab
    matmul_params = L * 12 * h * h + h * V
    attention = L * 3 * 2 * s * h          # 4 s h forward, causal half, x3 with backward
    assert t["compute"] == pytest.approx(8 * s * (6 * matmul_params + attention) / cl.flops, rel=1e-9)
    # tensor parallelism divides the work; full recomputation adds one forward of the layers
    tp = timing.step_time(SHAPE, _cluster(nodes=1, per_node=2), Config(tp=2), 8)
    assert tp["compute"] == pytest.approx(t["compute"] / 2, rel=1e-6)
    full = timing.step_time(SHAPE, cl, Config(recompute="full"), 8)
    layers = 8 * s * L * (24 * h * h + 2 * s * h) / cl.flops   # one more forward of every layer
    assert full["compute"] - t["compute"] == pytest.approx(layers, rel=1e-9)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("p,m", [(2, 4), (4, 4), (4, 16)])
def test_bubble_share_is_the_schedule_formula(schedule, p, m):
    """No communication, equal stages (the head's work is negligible): the idle share of the
    pipeline phase is (p-1)/(m+p-1)."""
    shape = ModelShape(layers=8, hidden=1024, heads=16, vocab=8, seq=1024, ffn=4096, name="no head")
    t = timing.step_time(shape, _cluster(nodes=1, per_node=8, intra=Link(0, 1e18), inter=Link(0, 1e18)),
                         Config(pp=p, microbatches=m, schedule=schedule), 8 * m)
    share = t["bubble"] / (t["compute"] + t["bubble"])
    assert share == pytest.approx(bubble_formula(schedule, p, m), rel=2e-3)


@pytest.mark.parametrize("schedule,name", [("gpipe", "gpipe"), ("1f1b", "1f1b"), ("zb-h1", "zb_h1"),
                                           ("interleaved", "interleaved"), ("zbv", "zbv")])
def test_replayed_schedule_matches_formula_and_cores_shrink_the_bubble(schedule, name):
    p, m = 4, 8
    actions, stages, style = timing._schedule(Config(pp=p, microbatches=m, schedule=schedule), p, m)
    f = p / stages
    work = {(k, s): w * f for s in range(stages) for k, w in (("F", 1), ("Bfull", 2), ("B", 1), ("W", 1))}
    comm = {key: 0.0 for key in work}
    free = timing.simulate(actions, stages, work, comm, style=style)
    assert 1 - sum(free["busy"]) / (p * free["span"]) == pytest.approx(bubble_formula(name, p, m), abs=1e-9)
    # one core for four ranks: a stage working alone in the ramp runs four times faster than in the
    # steady state, so the span is shorter than four times the free one
    crowded = timing.simulate(actions, stages, work, comm, style=style, cores=1)
    assert crowded["span"] < p * free["span"]
    assert crowded["span"] >= sum(free["busy"]) - 1e-9   # one core does all the work


def test_replay_trace_is_the_schedule_it_times():
    """The replay's trace: one record per action, each rank's records adding up to its busy time
    and ending at the span, every action after what it needs (its input, and the message's hop
    when that came from another rank)."""
    p, m, hop = 2, 4, 0.25
    actions, stages, style = timing._schedule(Config(pp=p, microbatches=m, schedule="1f1b"), p, m)
    work = {(k, s): w for s in range(stages) for k, w in (("F", 1.0), ("Bfull", 2.0), ("B", 1.0), ("W", 1.0))}
    comm = {key: 0.0 for key in work}
    trace: list = []
    sim = timing.simulate(actions, stages, work, comm, message=hop, style=style, cores=1.5, trace=trace)
    assert len(trace) == sum(len(a) for a in actions)
    assert max(r["end"] for r in trace) == pytest.approx(sim["span"])
    for rank in range(p):
        mine = [r for r in trace if r["rank"] == rank]
        assert sum(r["end"] - r["start"] for r in mine) == pytest.approx(sim["busy"][rank])
        assert all(a["end"] <= b["start"] + 1e-12 for a, b in zip(mine, mine[1:]))   # one action at a time
    end = {(r["kind"], r["stage"], r["microbatch"]): r["end"] for r in trace}
    for r in trace:
        s, i = r["stage"], r["microbatch"]
        if r["kind"] == "F" and s > 0:
            assert r["start"] >= end[("F", s - 1, i)] + hop - 1e-12
        if r["kind"] == "B" and s < p - 1:
            assert r["start"] >= end[("B", s + 1, i)] + hop - 1e-12


def test_a_message_landing_on_busy_cores_waits_for_a_core():
    """With every core computing when a message is sent, its receiver starts ``late`` after the
    message's link time; with a core free, right after it. GPipe over 2 stages: stage 0 goes on
    to its second forward as it sends its first."""
    p, m, hop, late = 2, 2, 0.1, 0.5
    actions, stages, style = timing._schedule(Config(pp=p, microbatches=m, schedule="gpipe"), p, m)
    work = {(k, s): w for s in range(stages) for k, w in (("F", 1.0), ("Bfull", 2.0), ("B", 1.0), ("W", 1.0))}
    comm = {key: 0.0 for key in work}

    def first_forward_of_stage_1(cores, wait):
        trace: list = []
        timing.simulate(actions, stages, work, comm, message=hop, style=style, cores=cores, trace=trace, late=wait)
        return next(r["start"] for r in trace if r["stage"] == 1 and r["kind"] == "F" and r["microbatch"] == 0)

    assert first_forward_of_stage_1(1.0, late) == pytest.approx(1.0 + hop + late)   # the one core is busy
    assert first_forward_of_stage_1(2.0, late) == pytest.approx(1.0 + hop)          # a core is free
    assert first_forward_of_stage_1(1.0, 0.0) == pytest.approx(1.0 + hop)


def test_half_a_time_slice_per_message_only_on_this_machines_own_links():
    """A calibrated one-node cluster's time slice makes its pipelines slower (messages landing on
    busy cores); the same cluster with an emulated link, or with a core per rank, does not."""
    from dataclasses import replace

    from workbench.comm.topology import Topology

    shape = ModelShape.preset("tiny")
    config = Config(dp=2, pp=2, microbatches=4)
    own = _timed_cluster(None, flops=100e9, cores=2.0)
    plain = timing.step_time(shape, own, config, 16)["total"]
    sliced = timing.step_time(shape, replace(own, time_slice_s=0.004), config, 16)
    assert sliced["total"] > plain + 0.002 and sliced["pp"] > timing.step_time(shape, own, config, 16)["pp"]
    emulated = replace(own, time_slice_s=0.004, links=Topology(2, inter=SLOW))
    assert timing.step_time(shape, emulated, config, 16)["total"] == pytest.approx(
        timing.step_time(shape, replace(emulated, time_slice_s=0.0), config, 16)["total"])
    devices = replace(own, time_slice_s=0.004, cores=None)
    assert timing.step_time(shape, devices, config, 16) == timing.step_time(shape, replace(devices, time_slice_s=0.0),
                                                                              config, 16)


def test_step_time_gives_the_replay_without_changing_the_time():
    """A pipeline's trace comes with the same step time as without one, on a calibrated cluster
    (whose time is the replay's) and on a datasheet one (closed forms; the trace drawn on devices
    of their own); no trace without a pipeline."""
    shape = ModelShape.preset("tiny")
    config = Config(dp=2, pp=2, microbatches=2)
    for cl in (_timed_cluster(None, flops=100e9, cores=2.0), _cluster(nodes=1, per_node=4)):
        trace: list = []
        assert timing.step_time(shape, cl, config, 16, trace=trace) == timing.step_time(shape, cl, config, 16)
        assert sorted({(r["rank"], r["kind"]) for r in trace}) == [(0, "B"), (0, "F"), (1, "B"), (1, "F")]
        assert len(trace) == 2 * 2 * 2
    flat: list = []
    timing.step_time(shape, _cluster(nodes=1, per_node=4), Config(dp=4), 16, trace=flat)
    assert flat == []


def test_timeline_figure_draws_the_replay_above_the_run():
    import matplotlib

    matplotlib.use("Agg")
    from workbench.advise import validate

    rec = lambda rank, kind, i, a, b: {"rank": rank, "stage": rank, "kind": kind, "microbatch": i,  # noqa: E731
                                       "start": a, "end": b}
    row = {"setting_label": "tiny B=16 1 node", "config": "dp1-tp1-pp2 1f1b m1 fp32", "predicted_s": 0.010,
           "measured_s": 0.012,
           "timeline_predicted": [rec(0, "F", 0, 0.0, 0.001), rec(1, "F", 0, 0.001, 0.002),
                                  rec(1, "B", 0, 0.002, 0.004), rec(0, "B", 0, 0.004, 0.006)],
           "timeline_measured": [rec(0, "F", 0, 0.0, 0.001), rec(0, "send", 0, 0.001, 0.0011),
                                 rec(1, "F", 0, 0.002, 0.003), rec(1, "B", 0, 0.003, 0.005),
                                 rec(0, "B", 0, 0.006, 0.008)]}
    fig = validate.timeline_figure(row)
    top, bottom = fig.axes[:2]
    assert "predicted" in top.get_title() and "6.0 ms" in top.get_title()
    assert "measured" in bottom.get_title() and "8.0 ms" in bottom.get_title()
    assert len(top.patches) == 4 and len(bottom.patches) == 4     # the send is not drawn
    assert top.get_xlim() == bottom.get_xlim()
    with pytest.raises(ValueError, match="no pipeline timelines"):
        validate.timeline_figure({**row, "timeline_measured": []})


def test_validation_records_each_pipeline_trial_timeline():
    """Structure, not speed: a pipeline configuration's trials each keep the last step's timeline
    (the first pipeline's ranks, F and B of every micro-batch); a configuration without a
    pipeline keeps none."""
    from workbench.advise import validate

    pipe, flat = Config(dp=2, pp=2, microbatches=2), Config(dp=4)
    out = validate._launch(validate.Setting("tiny", 8, None, (pipe, flat)), trials=2, steps=1, warmup=1,
                           calibrate=False)
    assert set(out["timelines"]) == {pipe.label()}
    assert len(out["timelines"][pipe.label()]) == 2
    for timeline in out["timelines"][pipe.label()]:
        computed = {(r["rank"], r["kind"], r["microbatch"]) for r in timeline if r["kind"] in ("F", "B")}
        assert computed == {(rank, kind, i) for rank in (0, 1) for kind in ("F", "B") for i in (0, 1)}
        assert all(r["end"] >= r["start"] for r in timeline)
    first = validate._median_trial(out["timelines"][pipe.label()], out["samples"][pipe.label()])
    assert first in out["timelines"][pipe.label()]


def _tp_seconds(link: Link, t: int, rows: int) -> float:
    """Tensor-parallel collectives of one step of SHAPE priced by hand on ``link`` (ring all-reduces)."""
    topo = timing.Topology(t, intra=link, inter=link)
    free = cost.CostModel(0, 0, 0)
    n = rows * SHAPE.seq * SHAPE.hidden * 4
    ar = lambda nbytes: cost.predict("all_reduce", "native", nbytes, t, free, topology=topo)  # noqa: E731
    return (4 * SHAPE.layers + 2) * ar(n) + ar(rows * SHAPE.seq * 4) + ar(2 * rows * SHAPE.seq * 4)


def test_tensor_parallel_collectives_on_the_link_their_group_crosses():
    inside = timing.step_time(SHAPE, _cluster(nodes=2, per_node=2), Config(dp=2, tp=2), 8)
    across = timing.step_time(SHAPE, _cluster(nodes=4, per_node=1), Config(dp=2, tp=2), 8)
    assert inside["tp"] == pytest.approx(_tp_seconds(FAST, 2, 4), rel=1e-9)
    assert across["tp"] == pytest.approx(_tp_seconds(SLOW, 2, 4), rel=1e-9)
    assert across["tp"] > 50 * inside["tp"]
    # sequence parallelism: each all-reduce becomes an all-gather and a reduce-scatter (the same
    # bytes), and backward re-gathers the two column-parallel inputs: 10 half-all-reduces a layer
    # instead of 8 (workbench.parallel.tensor.communication_per_layer)
    sp = timing.step_time(SHAPE, _cluster(nodes=2, per_node=2), Config(dp=2, tp=2, sequence_parallel=True), 8)
    assert sp["tp"] / inside["tp"] == pytest.approx(10 / 8, rel=0.03)


def test_data_parallel_ring_crosses_nodes_and_overlap_hides_it():
    # dp=2 x tp=2 on nodes of 2: tp groups {0,1} {2,3} inside, dp groups {0,2} {1,3} across nodes
    cl = _cluster(nodes=2, per_node=2, overlap=0.0)
    t = timing.step_time(SHAPE, cl, Config(dp=2, tp=2), 8)
    psi = max(SHAPE.stage_parameters(1, 0, 2), 0)
    topo = timing.Topology(1, intra=FAST, inter=SLOW)
    free = cost.CostModel(0, 0, 0)
    buckets = 1 + math.ceil((psi * 4 - 2**20) / (25 * 2**20))
    expect = buckets * cost.predict("all_reduce", "native", psi * 4 / buckets, 2, free, topology=topo) \
        + cost.predict("all_reduce", "native", 4, 2, free, topology=topo)
    assert t["dp"] == pytest.approx(expect, rel=1e-9)
    # ZeRO-3 moves 1.5x DDP's bytes; with full overlap DDP's all-reduce hides behind backward
    z3 = timing.step_time(SHAPE, cl, Config(dp=2, tp=2, zero=3), 8)
    assert z3["dp"] > 1.4 * t["dp"]
    hidden = timing.step_time(SHAPE, _cluster(nodes=2, per_node=2, overlap=1.0), Config(dp=2, tp=2), 8)
    assert hidden["dp"] < t["dp"]


def test_buckets_but_the_last_hide_behind_backward_and_zero1_reduces_after_it():
    """Backward fills DDP's buckets in turn: all but the last (the first layers', ready when
    backward ends) hide behind it; ZeRO-1 reduces in its step, so nothing hides; ZeRO-3 hides each
    prefetched layer's gather (not the root's, nor the first layer's of each pass) and every
    reduce-scatter but the last two."""
    free = cost.CostModel(0, 0, 0)
    topo = timing.Topology(1, intra=FAST, inter=SLOW)
    psi = SHAPE.stage_parameters(1, 0, 2)
    sizes = [2**20]
    while sum(sizes) < psi * 4:
        sizes.append(min(25 * 2**20, psi * 4 - sum(sizes)))
    last = cost.predict("all_reduce", "native", sizes[-1], 2, free, topology=topo)
    loss = cost.predict("all_reduce", "native", 4, 2, free, topology=topo)
    on, off = (_cluster(nodes=2, per_node=2, overlap=o) for o in (1.0, 0.0))
    ddp = timing.step_time(SHAPE, on, Config(dp=2, tp=2), 8)
    assert last + loss <= ddp["dp"] < timing.step_time(SHAPE, off, Config(dp=2, tp=2), 8)["dp"]
    # the compute is long beside the other buckets: exactly the last one and the loss remain
    slow = _cluster(nodes=2, per_node=2, overlap=1.0, flops=1e9)
    assert timing.step_time(SHAPE, slow, Config(dp=2, tp=2), 8)["dp"] == pytest.approx(last + loss, rel=1e-9)
    z1 = [timing.step_time(SHAPE, c, Config(dp=2, tp=2, zero=1), 8)["dp"] for c in (on, off)]
    assert z1[0] == pytest.approx(z1[1], rel=1e-12)
    z2 = [timing.step_time(SHAPE, c, Config(dp=2, tp=2, zero=2), 8)["dp"] for c in (on, off)]
    assert z2[0] < z2[1]
    z3 = [timing.step_time(SHAPE, c, Config(dp=2, tp=2, zero=3), 8)["dp"] for c in (slow, off)]
    # FSDP's units: each layer, and the root (embedding, head) gathered before anything runs
    L, layer_b = SHAPE.layers, SHAPE.layer_parameters(2) * 4
    root_b = psi * 4 - L * layer_b
    gl, gr, sl, sr = (cost.predict(k, "native", n, 2, free, topology=topo)
                      for k, n in (("all_gather", layer_b), ("all_gather", root_b), ("reduce_scatter", layer_b),
                                   ("reduce_scatter", root_b)))
    assert z3[1] == pytest.approx(2 * gr + 2 * L * gl + L * sl + sr + loss, rel=1e-9)
    # hidden: every layer's gather but the first of each pass, every reduce-scatter but the last two
    assert z3[0] == pytest.approx(2 * gr + gl + sl + sr + loss, rel=1e-9)


def _timed_cluster(layer_costs, **kw) -> CalibratedCluster:
    """A calibrated 1-node cluster of 4 with one core per rank and no optimizer or link costs,
    whose layers were timed at the shapes ``layer_costs`` gives."""
    base = dict(nodes=1, per_node=4, flops=1e9, update_s_per_param=0.0, intra=FAST, inter=FAST,
                machine=cost.CostModel(0, 0, 0), layer_costs=layer_costs)
    base.update(kw)
    return _cluster(**base)


def test_layer_costs_from_the_probes():
    from workbench.advise.calibrate import _tp_key, layer_costs

    result = {"layer_r1": 0.010, "layer_rows4": 0.020, "layer_r2": 0.040, _tp_key(1, 1, False, "none"): 0.003,
              _tp_key(4, 1, False, "none"): 0.005, _tp_key(8, 1, False, "none"): 0.009,
              _tp_key(4, 2, True, "all"): 0.130, _tp_key(4, 2, True, "none"): 0.010}
    costs = layer_costs(result, (1, 4, 8), layers=4)
    assert costs[(1, 1, False)] == {"layer": 0.010, "edges": 0.003}   # no whole model timed: the block
    assert costs[(4, 1, False)] == {"layer": 0.020, "edges": 0.005}
    assert costs[(8, 1, False)] == {"layer": 0.040, "edges": 0.009}
    assert costs[(4, 2, True)] == pytest.approx({"layer": 0.030, "edges": 0.010})   # (all - none) / layers
    assert set(costs) == {(1, 1, False), (4, 1, False), (8, 1, False), (4, 2, True)}
    # the tensor-parallel model's first group timed alone: its time over the time with every rank busy
    result[_tp_key(4, 2, True, "all") + "_alone"] = 0.078
    assert layer_costs(result, (1, 4, 8), layers=4)[(4, 2, True)]["alone"] == pytest.approx(0.6)
    # the whole model timed at t = 1: its layers are (all - none) / layers, not the block
    result[_tp_key(4, 1, False, "all")] = 0.093
    costs = layer_costs(result, (1, 4, 8), layers=4)
    assert costs[(4, 1, False)] == pytest.approx({"layer": 0.022, "edges": 0.005})
    assert costs[(1, 1, False)] == {"layer": 0.010, "edges": 0.003}
    # layers lost in the noise (the whole model no slower than the model without them): the block at
    # t = 1, and the t = 1 layer over t for a tensor-parallel shape, never a zero-cost layer
    result[_tp_key(4, 1, False, "all")] = 0.004
    result[_tp_key(4, 2, True, "all")] = 0.009
    costs = layer_costs(result, (1, 4, 8), layers=4)
    assert costs[(4, 1, False)] == {"layer": 0.020, "edges": 0.005}
    assert costs[(4, 2, True)]["layer"] == pytest.approx(0.010)


def test_timed_layers_are_the_compute_the_timing_uses():
    shape = ModelShape.preset("tiny")
    L = shape.layers
    layer, edges = 0.011, 0.004
    cl = _timed_cluster({(4, 1, False): {"layer": layer, "edges": edges}})
    # dp=4, B=16: 4 rows per rank, one micro-batch: L layers and the edges, as timed
    t = timing.step_time(shape, cl, Config(dp=4), 16)
    assert t["compute"] == pytest.approx(L * layer + edges, rel=1e-12)
    # dp=2 with 2 micro-batches of 4 rows: the same shape, twice
    t2 = timing.step_time(shape, cl, Config(dp=2, pp=2, microbatches=2), 16)
    assert timing.measured_layer(cl, 4, Config(dp=2, pp=2, microbatches=2)) == {"layer": layer, "edges": edges}
    # a shape not timed (8 rows), or another precision, falls back to the formulas
    assert timing.measured_layer(cl, 8, Config(dp=2)) is None
    assert timing.measured_layer(cl, 4, Config(dp=4, precision="bf16")) is None
    assert timing.step_time(shape, cl, Config(dp=2), 16)["compute"] != pytest.approx(2 * (L * layer + edges))
    # every stage of the pipeline runs its half of the layers on each micro-batch, and the edges
    assert t2["compute"] >= 2 * (L // 2 * layer)


def test_timed_tensor_parallel_layers_put_their_collectives_in_tp():
    shape = ModelShape.preset("tiny")
    L = shape.layers
    layer, edges = 0.030, 0.012
    config = Config(dp=2, tp=2, sequence_parallel=True)
    cl = _timed_cluster({(8, 2, True): {"layer": layer, "edges": edges}}, flops=100e9)
    t = timing.step_time(shape, cl, config, 16)
    # compute and tensor-parallel communication add up to the timed model; compute is the formulas'
    assert t["compute"] + t["tp"] == pytest.approx(L * layer + edges, rel=1e-9)
    untimed = timing.step_time(shape, _timed_cluster(None, flops=100e9), config, 16)
    assert t["compute"] == pytest.approx(untimed["compute"], rel=1e-9)
    assert t["tp"] > 0 and t["tp"] != pytest.approx(untimed["tp"])


def test_zero_bubble_stages_pay_the_split_of_their_backward():
    """A zero-bubble stage fed activations splits each layer's backward into B and W, walking the
    autograd graph (``split_overhead_s`` per layer and micro-batch, a calibration probe); the first
    stage has no input gradient and runs W as a plain backward; 1F1B splits nothing."""
    shape = ModelShape.preset("tiny")
    base = dict(flops=100e9, cores=None)
    config = Config(pp=2, schedule="zb-h1", microbatches=4)
    zb0, zb1 = (timing.step_time(shape, _timed_cluster(None, split_overhead_s=x, **base), config, 16)
                for x in (0.0, 0.001))
    one0, one1 = (timing.step_time(shape, _timed_cluster(None, split_overhead_s=x, **base),
                                   Config(pp=2, schedule="1f1b", microbatches=4), 16) for x in (0.0, 0.001))
    assert one1["total"] == pytest.approx(one0["total"])
    # the second stage's 2 layers x 4 micro-batches, on the slowest stage's compute
    assert zb1["compute"] - zb0["compute"] == pytest.approx(4 * 2 * 0.001, rel=1e-6)


def test_zero_bubble_replay_puts_the_backward_where_the_split_runs_it():
    """A split backward's B (input gradients: on the pipeline's critical path) and W (weight
    gradients: deferred into the bubbles) get their measured shares (``split_w_share``, timed by the
    calibration's split probe; else the FLOPs': weights / forward per layer). The less of the
    backward W takes, the longer the critical path and the bubble; the work is the same."""
    shape = ModelShape.preset("tiny")
    config = Config(pp=4, schedule="zb-h1", microbatches=8)
    t = {share: timing.step_time(shape, _timed_cluster(None, flops=100e9, cores=4, split_overhead_s=0.0005,
                                                       split_w_share=share), config, 16)
         for share in (None, 0.1, 0.3, 0.6)}
    assert len({round(v["compute"], 12) for v in t.values()}) == 1
    assert t[0.1]["bubble"] > t[0.3]["bubble"] > t[0.6]["bubble"] > 0
    flops = timing.flops_per_token(shape)
    assert flops["weight_grad"] / (flops["layer"] * 2 / 3) == pytest.approx(0.46, abs=0.01)
    assert t[0.3]["bubble"] > t[None]["bubble"] > t[0.6]["bubble"]


def test_timed_layers_with_recomputation_add_what_is_repeated():
    """The layers are timed without recomputation; a recomputing configuration adds the formulas'
    share of the repeated work to the timed compute (full: one more forward of each layer) and, with
    full recomputation, the layers' forward collectives again in backward (2 of a layer's 4
    all-reduces: half as much again). Measured on GPT small dp2 x tp2 with full recomputation, one
    node: +52% before, +0% to +8% with this."""
    shape = ModelShape.preset("tiny")
    L = shape.layers
    timed = {(8, 2, False): {"layer": 0.030, "edges": 0.012}}
    cl = _timed_cluster(timed, flops=100e9)
    assert timing.measured_layer(cl, 8, Config(dp=2, tp=2, recompute="full")) == timed[(8, 2, False)]
    plain, full, sel = (timing.step_time(shape, cl, Config(dp=2, tp=2, recompute=r), 16)
                        for r in ("none", "full", "selective"))
    fpt = {r: timing.flops_per_token(shape, tp=2, recompute=r)["layer"] for r in ("none", "full", "selective")}
    layer_c = min(8 * shape.seq * fpt["none"] / 100e9, 0.030)      # the timed layer's compute
    tp_layer = 0.030 - layer_c                                        # and its collectives
    assert layer_c > 0 and tp_layer > 0
    assert full["compute"] - plain["compute"] == pytest.approx(L * layer_c * (fpt["full"] / fpt["none"] - 1))
    assert full["tp"] - plain["tp"] == pytest.approx(L * tp_layer / 2)
    assert sel["compute"] - plain["compute"] == pytest.approx(L * layer_c * (fpt["selective"] / fpt["none"] - 1))
    assert sel["tp"] == pytest.approx(plain["tp"])


def test_full_recomputation_repeats_the_forward_s_overheads_too():
    """Full recomputation runs each layer's whole forward again: a third more of its FLOPs, of its
    memory-bound work and of its per-operator cost; selective recomputation repeats only the
    attention core's FLOPs. (GPT tiny, ZeRO-1 with full recomputation, B=64, one node: the FLOPs
    alone priced the recomputation at 8 ms where the runs spent 14 ms.)"""
    from workbench.parallel.tensor import activation_bytes_per_layer

    shape = ModelShape.preset("tiny")
    cl = _timed_cluster(None, flops=100e9, layer_overhead_s=1e-3, activation_s_per_byte=1e-11)
    plain, full, sel = (timing.step_time(shape, cl, Config(dp=4, recompute=r), 16)
                        for r in ("none", "full", "selective"))
    fpt = {r: timing.flops_per_token(shape, recompute=r)["layer"] for r in ("none", "selective")}
    tokens = 4 * shape.seq
    rest = activation_bytes_per_layer(4, shape.seq, shape.hidden, shape.heads, 1, False, 4) * 1e-11 + 1e-3
    layer = tokens * fpt["none"] / 100e9 + rest
    assert full["compute"] - plain["compute"] == pytest.approx(shape.layers * layer / 3)
    assert sel["compute"] - plain["compute"] == pytest.approx(
        shape.layers * tokens * (fpt["selective"] - fpt["none"]) / 100e9)


def test_timed_tensor_parallel_layers_share_the_cores_in_a_pipeline():
    """On an oversubscribed machine the timed collectives' waits shrink when fewer ranks compute:
    in a pipeline they are replayed as shared work, so the step is shorter than with them as fixed
    communication, and never shorter than the compute alone; with every rank busy (no pipeline)
    nothing changes."""
    shape = ModelShape.preset("tiny")
    config = Config(tp=2, pp=2, microbatches=2, schedule="gpipe")
    timed = {(8, 2, False): {"layer": 0.030, "edges": 0.012}}
    shared = timing.step_time(shape, _timed_cluster(timed, flops=100e9, cores=2.0), config, 16)
    plain = timing.step_time(shape, _timed_cluster(None, flops=100e9, cores=2.0), config, 16)
    assert shared["tp"] > 0 and shared["compute"] == pytest.approx(plain["compute"], rel=0.05)
    # the same timed layers at the crowded rate throughout (as every rank busy would run them)
    L = shape.layers
    busy = 2 * (L * 0.030 + 0.012)
    assert shared["compute"] + shared["tp"] < busy + plain["compute"]
    flat = timing.step_time(shape, _timed_cluster(timed, flops=100e9, cores=2.0), Config(dp=2, tp=2), 16)
    assert flat["compute"] + flat["tp"] == pytest.approx(L * 0.030 + 0.012, rel=1e-9)


def test_a_tensor_parallel_stage_alone_runs_at_its_timed_share_of_the_crowded_time():
    """Where the group's time alone was timed (``alone``: over its time with every rank busy), a
    stage computing alone takes that share of its crowded time, and a stage computing beside the
    other its crowded time, whatever ``alone`` says; ``alone = 1/p`` is sharing the cores, the
    replay without it; less than that is taken as that."""
    shape = ModelShape.preset("tiny")
    config = Config(tp=2, pp=2, microbatches=2, schedule="gpipe")

    def replay(alone):
        timed = {(8, 2, False): {"layer": 0.030, "edges": 0.012}}
        if alone is not None:
            timed[(8, 2, False)]["alone"] = alone
        trace = []
        out = timing.step_time(shape, _timed_cluster(timed, flops=100e9, cores=2.0), config, 16, trace=trace)
        first = min(trace, key=lambda a: a["start"])            # stage 0's first forward: alone
        return out["total"], first["end"] - first["start"]

    base, first = replay(None)
    assert replay(0.5) == pytest.approx((base, first), rel=1e-9)   # 1 / p: sharing the cores
    assert replay(0.3) == pytest.approx((base, first), rel=1e-9)   # never faster than sharing them
    total, longer = replay(0.8)
    assert longer == pytest.approx(first * 0.8 / 0.5, rel=1e-9) and total > base
    # alone = 1: no faster alone than with every rank busy, so the step is its two stages' crowded
    # time in turns at best and every action takes its crowded time (twice the sharing's alone)
    _, crowded = replay(1.0)
    assert crowded == pytest.approx(2 * first, rel=1e-9)


def test_pipeline_pays_the_drift_price_twice_per_step_and_not_per_message():
    """A calibrated cluster's price of a collective after compute (``sync``) is paid by the
    pipeline's line-up before the step and its timeline gather after the schedule, not by each
    activation message (whose receiver waits idle) nor by the collectives back to back after those."""
    shape = ModelShape.preset("tiny")
    for config in (Config(pp=2, microbatches=4), Config(pp=4, microbatches=4)):
        base = timing.step_time(shape, _cluster(nodes=1, per_node=4), config, 16)
        synced = timing.step_time(shape, _cluster(nodes=1, per_node=4, sync_s=0.01), config, 16)
        assert synced["pp"] - base["pp"] == pytest.approx(2 * 0.01, rel=1e-9)


def test_tensor_parallel_group_inside_a_node_is_priced_on_this_machines_link():
    """dp=2 x tp=2 on 2 emulated nodes of 2: the tp pairs {0,1}, {2,3} stay inside a node, so their
    collectives cost what they cost on one node (the machine's curves), not the slow link's."""
    from workbench.comm.topology import Topology

    machine = cost.CostModel(2e-5, 1e-9, 1e-10)
    one = _cluster(nodes=1, per_node=4, intra=FAST, inter=FAST, links=Topology(4), machine=machine)
    slow = Link(1e-3, 50e6)
    two = _cluster(nodes=2, per_node=2, intra=FAST, inter=slow, links=Topology(2, inter=slow), machine=machine)
    c = Config(dp=2, tp=2, sequence_parallel=True)
    assert timing.step_time(SHAPE, two, c, 8)["tp"] == pytest.approx(timing.step_time(SHAPE, one, c, 8)["tp"])
    assert timing.step_time(SHAPE, two, c, 8)["dp"] > timing.step_time(SHAPE, one, c, 8)["dp"]


def test_pipeline_messages_on_the_slow_link_when_stages_span_nodes():
    # pp=2 with dp=tp=1: ranks 0 and 1; nodes of 1 put the two stages on two nodes
    inside = timing.step_time(SHAPE, _cluster(nodes=1, per_node=2), Config(pp=2, microbatches=4), 16)
    across = timing.step_time(SHAPE, _cluster(nodes=2, per_node=1), Config(pp=2, microbatches=4), 16)
    msg = 4 * SHAPE.seq * SHAPE.hidden * 4
    critical = 2 * (4 + 2 - 2)
    assert across["pp"] - inside["pp"] == pytest.approx(
        critical * (SLOW.time(msg) - FAST.time(msg))
        + SLOW.time(SHAPE.vocab * SHAPE.hidden * 4) - FAST.time(SHAPE.vocab * SHAPE.hidden * 4)
        # the loss broadcast (one message) and the pipeline's 3 per-step all-reduces (2 ring steps each)
        + (1 + 3 * 2) * (SLOW.time(4) - FAST.time(4)), rel=1e-6)


def test_datasheet_cluster_without_calibration():
    cl = Cluster(nodes=4, devices_per_node=8, memory_bytes=80e9, flops=400e12, intra=FAST, inter=SLOW)
    t = timing.step_time(SHAPE, cl, Config(dp=4, tp=8), 256)
    assert t["total"] > t["compute"] > 0 and t["tp"] > 0


# ------------------------------------------------------------------------ memory against runs

def _configs(world):
    if world == 2:      # DDP (its bucket copies), ZeRO-1 (plain .grad), sequence parallelism, 1F1B's sent gradient
        return [Config(dp=2), Config(dp=2, zero=1), Config(tp=2, sequence_parallel=True),
                Config(pp=2, microbatches=2)]
    # ZeRO-3 (gathered units), ZeRO-2 (open buckets) with tensor parallelism, pipelines with data and tensor parallelism
    return [Config(dp=4, zero=3), Config(dp=2, tp=2, zero=2), Config(dp=2, pp=2, zero=1, microbatches=2),
            Config(tp=2, pp=2, microbatches=2, schedule="gpipe")]


def _pin(measured, configs, batch, world):
    """Model state exactly; activations with buffers on every rank no more than 0.5% above the
    measurement and at most 3% below it. Byte counts do not depend on the load, but on a loaded
    machine a collective's buffers can be freed late -- by another thread than the caller's (most
    likely gloo's worker, which drops its hold on the work after waking the caller: the holder is
    not a Python object) -- so the meter may still see them at the peak
    (1-4% of the transient bytes, on some ranks or all, some runs; on a quiet run every
    configuration here is within 0.4%). That only ever adds, so the bound is one-sided."""
    from workbench.advise.validate import _predict_memory, memory_errors

    shape = ModelShape.preset("tiny")
    for c in configs:
        mem = measured[c.label()]
        predicted = _predict_memory(shape, c, batch)
        for r in range(world):
            # model state exactly, Adam's 4-byte step counter per tensor it updates included
            assert predicted[r]["parameters"] == mem["parameters"][r], (c.label(), r)
            assert predicted[r]["gradients"] == mem["gradients"][r], (c.label(), r)
            assert predicted[r]["optimizer"] == mem["optimizer"][r], (c.label(), r)
            assert mem["step_counters"][r] > 0
        errors = memory_errors(predicted, mem)
        assert errors["model_state"] == pytest.approx(0, abs=1e-12)
        # activations and buffers together (the meter files ZeRO-3's gathered units and the
        # strategies' flat buffers under activations)
        err = [(predicted[r]["activations"] + predicted[r]["buffers"])
               / (mem["activations"][r] + mem["buffers"][r]) - 1 for r in range(world)]
        assert all(-0.03 <= x <= 0.005 for x in err), (c.label(), err)


@pytest.mark.parametrize("world", [2, 4])
def test_memory_predictions_pinned_to_measured(world):
    from workbench.advise.validate import measure_memory

    configs = _configs(world)
    batch = 8
    _pin(measure_memory("tiny", configs, batch, world_size=world), configs, batch, world)


def test_memory_of_small_microbatches_pinned_to_measured():
    """One sequence per rank: ZeRO-3's peak is then the assembly of a unit's flat gradient (three
    unit-sized tensors beside the unit's weight gradients; a block, with or without a pipeline,
    whose first stage's root, its embeddings, is not gathered again in backward), not the last
    layer's first product; tensor parallelism's head moment (the loss's float32 gradient) against
    the layer's."""
    from workbench.advise.validate import measure_memory

    configs = [Config(dp=4, zero=3), Config(dp=2, tp=2, zero=3), Config(dp=2, pp=2, zero=3, microbatches=2),
               Config(tp=4)]
    _pin(measure_memory("tiny", configs, 4, world_size=4), configs, 4, 4)


def test_memory_of_zero3_on_one_block_stages_pinned_to_measured():
    """ZeRO-3 over 4 stages of one block each (8 ranks): FSDP gathers that block alone, no
    prefetched neighbour, and the root only on the last stage (its head)."""
    from workbench.advise.validate import measure_memory

    configs = [Config(dp=2, pp=4, zero=3, microbatches=4)]
    _pin(measure_memory("tiny", configs, 8, world_size=8), configs, 8, 8)


def test_memory_with_recomputation_pinned_to_measured():
    """Activation recomputation under the mesh (``parallelize(recompute=...)``): selective keeps all
    but the attention core; full keeps each block's input, and the recomputed block's backward
    peaks as a block does without recomputation where the strategy copies the new weight
    gradients (DDP's buckets, or accumulation over micro-batches): beside the other blocks' inputs,
    the gradient flowing in, the ffn-wide gradient and those weight gradients. ZeRO-1 with full
    recomputation peaks in its step instead: a bucket's flat gradient buffer and its reduced chunk
    beside the logits. Where the gradients become ``.grad`` as backward goes (ZeRO-1, one
    replica), the peak with them is at the last layer if a layer's input outweighs its gradients,
    else at the first. Left out: full
    recomputation with tensor parallelism, whose recomputed all-reduces sometimes leave one or two
    sequence-sized buffers alive at the peak (measured 5-10% above the prediction on some ranks in
    some runs, exactly on it in others), and ZeRO-3 with full recomputation (see the README)."""
    from workbench.advise.validate import measure_memory

    configs = [Config(dp=4, recompute=policy) for policy in ("selective", "full")]
    configs += [Config(dp=2, pp=2, microbatches=2, recompute="full"), Config(dp=4, zero=1, recompute="full"),
                Config(dp=2, tp=2, recompute="selective"), Config(dp=4, zero=3, recompute="selective"),
                Config(tp=2, pp=2, microbatches=2, schedule="gpipe", recompute="selective")]
    measured = measure_memory("tiny", configs, 8, world_size=4)
    _pin(measured, configs, 8, 4)
    # gradients that become .grad as backward goes (ZeRO-1): 16 rows per rank, where a layer's input
    # outweighs its gradients, peak at the last layer's backward with every other input kept
    big = [Config(dp=4, zero=1, recompute="full")]
    _pin(measure_memory("tiny", big, 64, world_size=4), big, 64, 4)
    peak = {c.label(): max(a + b for a, b in zip(measured[c.label()]["activations"], measured[c.label()]["buffers"]))
            for c in configs}
    assert peak[configs[1].label()] < 0.5 * peak[configs[0].label()]   # full keeps far less than selective


def test_memory_of_partial_recomputation_pinned_to_measured():
    """Full recomputation of each stage's first k layers only (``Config.recompute_layers``,
    ``parallelize(recompute_layers=)``): the other layers keep everything, backward meets them
    first, and the first recomputation follows a layer that kept everything (its input gradient
    alive beside the one flowing in). Under DDP, ZeRO-1, -2 and -3 and on a pipeline. ZeRO-1, whose
    gradients become ``.grad`` as backward goes, peaks at the moment with the most activations less
    the gradients still to come: in its step with 2 sequences per rank, at the last layer's
    backward with 16. Left out, as for full recomputation: tensor parallelism, and ZeRO-3
    recomputing all but the last layer (measured 2-9% above the prediction)."""
    from workbench.advise.validate import measure_memory

    configs = [Config(dp=4, recompute="full", recompute_layers=k) for k in (1, 3)]
    configs += [Config(dp=4, zero=z, recompute="full", recompute_layers=2) for z in (1, 2)]
    configs += [Config(dp=4, zero=3, recompute="full", recompute_layers=1),
                Config(dp=2, pp=2, microbatches=2, recompute="full", recompute_layers=1),
                Config(dp=2, pp=2, zero=1, microbatches=4, recompute="full", recompute_layers=1)]
    _pin(measure_memory("tiny", configs, 8, world_size=4), configs, 8, 4)
    big = [Config(dp=4, zero=1, recompute="full", recompute_layers=k) for k in (1, 2)]
    _pin(measure_memory("tiny", big, 64, world_size=4), big, 64, 4)


def test_memory_of_zero_bubble_pinned_to_measured():
    """ZB-H1 (``parallelize(schedule="zb-h1")``): a stage fed activations ends each split B holding
    everything it was given plus the output gradient of every deferred matrix product (its W's
    input), the first layer's input gradients being formed; from B to W a micro-batch holds M_W
    (those gradients and the deferred products' inputs: under sequence parallelism more than its
    sharded activations); the first stage's B has nothing to do, so it holds the output gradient it
    received until its W runs the whole backward. Left out: ZeRO-3, whose flat parameters defer
    nothing (as 1F1B; the prediction -1.2% to +0.9%)."""
    from workbench.advise.validate import measure_memory

    configs = [Config(dp=2, pp=2, schedule="zb-h1", microbatches=2),
               Config(dp=2, pp=2, zero=1, schedule="zb-h1", microbatches=4),
               Config(tp=2, pp=2, schedule="zb-h1", microbatches=4), Config(pp=4, schedule="zb-h1", microbatches=4),
               Config(tp=2, pp=2, schedule="zb-h1", microbatches=4, sequence_parallel=True)]
    _pin(measure_memory("tiny", configs, 8, world_size=4), configs, 8, 4)


def _calibrate_tiny():
    from workbench.advise.calibrate import Calibration

    cal = Calibration("tiny", (1, 2), tp_shapes=((2, 2, False),), sizes=(64, 4096), budget_s=0.005)
    cal.once()
    return cal.result()


def test_calibration_gives_a_cluster_the_timing_uses():
    """Structure, not speed: every probe ran, and the constants make a cluster step_time prices."""
    import workbench
    from workbench.advise.calibrate import cluster_from

    result = workbench.launch(_calibrate_tiny, world_size=4)[0]
    for key in ("layer_r1", "layer_r2", "layer_r2_alone", "matmul", "matmul_bf16", "adam_model", "sync_world",
                "layer_r1_sync_pair", "layer_r1_before_sync_pair", "train_r1", "model_before_train_r1", "exchange:64",
                "one_way:4096", "message_cpu:65536", "message_cpu:1048576", "gather_cpu", "reduce_scatter_cpu",
                "split_r1", "split_w_share_r1", "tp1_rows1_all", "tp1_rows2_all", "tp1_rows2_none",
                "pipeline_action_cpu",
                "tp2_rows2_all", "tp2_rows2_all_alone"):
        assert result[key] > 0, key
    assert result["time_slice"] >= 0   # 0 where no rank was ever taken off its core
    cl = cluster_from(result, "tiny", (1, 2), 4)
    assert cl.devices == 4 and 1.0 <= cl.cores <= 4.0
    assert cl.time_slice_s == result["time_slice"]
    assert cl.fp32_flops > 0 and cl.flops > 0 and cl.update_s_per_param > 0
    assert 0 < cl.split_w_share < 1
    # a pipeline action's own CPU: what the probe saw less the action's message end
    end = timing.message_cpu(cl, 1 * 64 * 64 * 4)
    assert cl.pipeline_action_s == pytest.approx(max(0.0, result["pipeline_action_cpu"] - end))
    assert set(cl.sync_by_size) == {2, 4}   # pairs and every rank
    assert [n for n, _ in cl.message_cpu] == [65536, 1048576] and all(c > 0 for _, c in cl.message_cpu)
    assert set(cl.collective_cpu) == {"all_gather", "reduce_scatter"} and min(cl.collective_cpu.values()) > 0
    # the model's own layers at each row count, and its tensor-parallel model at (2 rows, t=2)
    assert set(cl.layer_costs) == {(1, 1, False), (2, 1, False), (2, 2, False)}
    assert all(v["layer"] > 0 and v["edges"] > 0 for v in cl.layer_costs.values())
    assert cl.layer_costs[(2, 2, False)]["alone"] > 0 and "alone" not in cl.layer_costs[(2, 1, False)]
    shape = ModelShape.preset("tiny")
    tp = timing.step_time(shape, cl, Config(tp=2), 2)
    timed = cl.layer_costs[(2, 2, False)]
    optimizer = (timing._parameters_on_rank(shape, 2, 1) * cl.update_s_per_param + cl.step_overhead_s) \
        * max(1.0, 2 / cl.cores)
    assert tp["compute"] + tp["tp"] == pytest.approx(shape.layers * timed["layer"] + timed["edges"] + optimizer)
    with pytest.raises(ValueError, match="rows"):
        from workbench.advise.calibrate import Calibration
        Calibration("tiny", (2, 2))


def test_validate_select_refuses_bad_setting_numbers(capsys):
    """Out-of-range options: one line naming the option and exit status 2, before anything runs."""
    import argparse

    from workbench.advise import validate

    for bad in ("0", "x", f"1,{len(validate.SETTINGS) + 1}"):
        with pytest.raises(ValueError, match="--validate-select"):
            validate._chosen(argparse.Namespace(validate_select=bad, validate_trials=1, validate_steps=1))
        assert validate.main(argparse.Namespace(validate_select=bad, validate_trials=1, validate_steps=1)) == 2
        err = capsys.readouterr().err
        assert err.startswith("workbench advise --validate: error: --validate-select=") and err.count("\n") == 1
    assert validate.main(argparse.Namespace(validate_settings=0)) == 2
    assert "--validate-settings=0 must be between 1 and" in capsys.readouterr().err


def test_data_parallel_pays_the_drift_price_once_per_wait_after_compute():
    """DDP's buckets go back to back (one price for all of them, one for the loss's all-reduce);
    ZeRO-3 waits for each layer's gather after compute, forward and backward, for the root's in
    backward, and for its reduce-scatters together: 2 layers + 1 per micro-batch, each in the
    share of the wait the compute before it is (a rank held up by a slow link is lined up by it)."""
    shape = ModelShape.preset("small")
    sync = 0.01
    for flops, link in ((1e9, FAST), (100e12, Link(1e-3, 1e6))):   # compute-bound, then link-bound
        for config, expect in ((Config(dp=4), 2), (Config(dp=4, zero=3), 2 * shape.layers + 1 + 1)):
            kw = dict(nodes=1, per_node=4, overlap=0.0, flops=flops, intra=link)
            base = timing.step_time(shape, _cluster(**kw), config, 8)
            synced = timing.step_time(shape, _cluster(**kw, sync_s=sync), config, 8)
            if link is FAST or config.zero == 0:
                assert synced["dp"] - base["dp"] == pytest.approx(expect * sync, rel=1e-9), config.label()
            else:
                assert 2 * sync < synced["dp"] - base["dp"] < 0.5 * expect * sync, config.label()


def _late_rank(delay: float):
    """``Calibration._time`` on two ranks where rank 1 leaves the barrier ``delay`` s late: rank 0
    runs its loop alone first. Returns (every rank at once, slowest rank's own time) per call."""
    import time
    import types

    import torch.distributed as dist

    from workbench.advise.calibrate import Calibration

    barrier = dist.barrier

    def late_barrier(*a, **k):
        barrier(*a, **k)
        if dist.get_rank() == 1:
            time.sleep(delay)

    dist.barrier = late_barrier
    try:
        me = types.SimpleNamespace(rank=dist.get_rank(), iterations=1, counts={}, budget_s=0.1)
        work = lambda: time.sleep(0.02)  # noqa: E731
        return (Calibration._time(me, work, alone=False, iterations=2),
                Calibration._time(me, work, alone=False, iterations=2, span=False))
    finally:
        dist.barrier = barrier


def test_every_rank_at_once_is_timed_from_the_first_start_to_the_last_end():
    """A rank that leaves the barrier late must not make the others' loops look uncrowded: the
    probe's time per call is the span over all ranks (first start to last end) over the calls."""
    import workbench

    together, own = workbench.launch(_late_rank, world_size=2, args=(0.1,))[0]
    assert own == pytest.approx(0.02, abs=0.015)            # each rank's own loop: 2 x 20 ms
    assert together >= (0.1 + 2 * 0.02) / 2 - 0.005          # 100 ms late + the late rank's 40 ms, over 2 calls


def test_a_pipeline_reduces_its_gradients_with_the_other_stages_idle():
    """After the schedule the stage that finishes last computes alone: its gradient reduction and
    the loss's all-reduce pay the drift price only as far as its d x t ranks still outnumber the
    cores (all of it with every rank busy, none with a core each)."""
    shape = ModelShape.preset("small")
    sync = 0.01
    config = Config(dp=2, pp=2, microbatches=2)
    for cores, share in ((2.0, 0.0), (1.0, (2 / 1 - 1) / (4 / 1 - 1)), (None, 1.0)):
        base = timing.step_time(shape, _cluster(nodes=1, per_node=4, overlap=0.0, cores=cores), config, 8)
        synced = timing.step_time(shape, _cluster(nodes=1, per_node=4, overlap=0.0, cores=cores, sync_s=sync),
                                  config, 8)
        assert synced["dp"] - base["dp"] == pytest.approx(2 * sync * share, abs=1e-12), cores


def test_message_cpu_is_a_line_through_the_probes_points():
    cl = _cluster(message_cpu=((1 << 16, 1e-4), (1 << 20, 3e-4)))
    assert timing.message_cpu(cl, 1 << 16) == pytest.approx(1e-4)
    assert timing.message_cpu(cl, 1 << 20) == pytest.approx(3e-4)
    assert timing.message_cpu(cl, 1024) == pytest.approx(1e-4)            # never below the smallest
    mid = (1 << 16) + ((1 << 20) - (1 << 16)) / 2
    assert timing.message_cpu(cl, mid) == pytest.approx(2e-4)
    assert timing.message_cpu(cl, 2 << 20) == pytest.approx(3e-4 + 2e-4 * (1 << 20) / ((1 << 20) - (1 << 16)))
    assert timing.message_cpu(_cluster(), 1 << 20) == 0.0                  # a datasheet cluster: none


def test_a_pipeline_message_costs_its_ends_cpu_where_ranks_share_cores():
    """Each end of a pipeline message is work of the action that sends or receives it: on shared
    cores the busiest rank's ends (its F and B each receive one message and send one, or one of
    each at the first and last stage) come back under ``pp``, its compute unchanged; on devices
    of their own (``cores`` None) nothing is charged."""
    shape = ModelShape.preset("tiny")
    end = 2e-4
    for config in (Config(dp=2, pp=2, microbatches=4), Config(pp=4, microbatches=4)):
        machine = dict(nodes=1, per_node=4, overlap=0.0, flops=20e9)   # a CPU's speed: ms per micro-batch
        plain = timing.step_time(shape, _cluster(cores=2.0, **machine), config, 16)
        charged = timing.step_time(shape, _cluster(cores=2.0, message_cpu=((1 << 10, end),), **machine), config, 16)
        assert charged["compute"] == pytest.approx(plain["compute"], rel=0.1), config   # shares: approximate
        ends = 2 * config.microbatches * (1 if config.pp == 2 else 2)   # the busiest rank's message ends
        crowd = config.devices / 2.0
        assert end * ends <= charged["pp"] - plain["pp"] <= end * ends * crowd + 1e-9, config
        assert charged["total"] > plain["total"]
        free = [timing.step_time(shape, _cluster(message_cpu=mc, **machine), config, 16)
                for mc in (None, ((1 << 10, end),))]
        assert free[0] == free[1]


def test_every_pipeline_action_costs_the_schedules_own_cpu_where_ranks_share_cores():
    """``pipeline_action_s`` is work of every compute action (F, B, W), shared like compute and
    reported under ``pp``: the busiest rank's 2 m actions (3 m with ZB-H1's W) come back at least
    once; the step grows by at most the critical path's ``m + p - 1`` micro-batches of actions,
    ``world / cores`` times over; devices of their own pay nothing."""
    shape = ModelShape.preset("tiny")
    loop = 3e-4
    machine = dict(nodes=1, per_node=4, overlap=0.0, flops=20e9)
    for config, per_mb in ((Config(dp=2, pp=2, microbatches=4), 2), (Config(pp=4, microbatches=4), 2),
                           (Config(dp=2, pp=2, schedule="zb-h1", microbatches=4), 3)):
        plain = timing.step_time(shape, _cluster(cores=2.0, **machine), config, 16)
        charged = timing.step_time(shape, _cluster(cores=2.0, pipeline_action_s=loop, **machine), config, 16)
        actions = per_mb * config.microbatches
        assert loop * actions <= charged["pp"] - plain["pp"] + 1e-12, config
        path = per_mb * (config.microbatches + config.pp - 1)
        assert charged["total"] - plain["total"] <= loop * path * config.devices / 2.0 + 1e-9, config
        assert charged["total"] > plain["total"]
        free = [timing.step_time(shape, _cluster(pipeline_action_s=x, **machine), config, 16) for x in (0.0, loop)]
        assert free[0] == free[1]
    dp = Config(dp=4)   # no pipeline: no schedule
    assert timing.step_time(shape, _cluster(cores=2.0, pipeline_action_s=loop, **machine), dp, 16) == \
        timing.step_time(shape, _cluster(cores=2.0, **machine), dp, 16)


def test_a_pipelines_line_up_pays_the_drift_after_the_optimizer_not_after_a_stage():
    """The line-up and the timeline's gather are priced at ``sync_by_size`` after the optimizer's
    step (a short compute), not after a stage's whole pass: with a price that grows with the compute
    before it, a slower optimizer makes them dearer, and no compute before them costs the least."""
    shape = ModelShape.preset("tiny")
    by = {2: [(1e-4, 1e-4), (1e-2, 1e-2)], 4: [(1e-4, 1e-4), (1e-2, 1e-2)]}
    machine = dict(nodes=1, per_node=4, overlap=0.0, flops=20e9, sync_by_size=by)
    config = Config(pp=4, microbatches=4)
    costs = [timing.step_time(shape, _cluster(cores=2.0, update_s_per_param=u, **machine), config, 16)
             for u in (0.0, 1e-9, 1e-8)]
    optimizer = [c["compute"] - costs[0]["compute"] for c in costs]
    assert 0 < optimizer[1] < optimizer[2]
    for c, o in zip(costs[1:], optimizer[1:]):   # 2 syncs, each after the optimizer's o seconds
        assert c["pp"] - costs[0]["pp"] == pytest.approx(2 * (timing._sync(_cluster(**machine), 4, o)
                                                              - timing._sync(_cluster(**machine), 4, 0.0)))
    assert 2 * timing._sync(_cluster(**machine), 4, optimizer[2]) < 2 * timing._sync(_cluster(**machine), 4)


def test_zero3_traffic_is_bounded_below_by_its_collectives_cpu_on_shared_cores():
    """FSDP's units are the stage's layers and the root: per micro-batch 2 (L/p + 1) gathers and
    L/p + 1 reduce-scatters, each costing every rank CPU that the ranks share with compute; the
    data-parallel time is the larger of that CPU times world / cores and the exposed waits."""
    shape = ModelShape.preset("tiny")
    cpu = {"all_gather": 1e-3, "reduce_scatter": 4e-3}
    machine = dict(nodes=1, per_node=4, overlap=0.0, flops=20e9)
    for config, units in ((Config(dp=4, zero=3), shape.layers + 1),
                          (Config(dp=2, pp=2, zero=3, microbatches=2), shape.layers // 2 + 1)):
        assert timing.zero3_cpu(_cluster(cores=2.0, collective_cpu=cpu, **machine), shape, config) == \
            pytest.approx(units * (2 * 1e-3 + 4e-3))
        plain = timing.step_time(shape, _cluster(cores=2.0, **machine), config, 16)
        bound = config.microbatches * units * (2 * 1e-3 + 4e-3) * config.devices / 2.0
        charged = timing.step_time(shape, _cluster(cores=2.0, collective_cpu=cpu, **machine), config, 16)
        assert charged["dp"] == pytest.approx(max(plain["dp"], bound), abs=1e-4), config   # + the loss's all-reduce
        assert charged["dp"] > plain["dp"]   # here the CPU bound is the larger
        doubled = timing.step_time(shape, _cluster(cores=2.0, collective_cpu={k: 2 * v for k, v in cpu.items()},
                                                   **machine), config, 16)
        assert doubled["dp"] - charged["dp"] == pytest.approx(bound)
        # a cluster whose devices have their own cores, or no ZeRO-3: nothing changes
        assert timing.zero3_cpu(_cluster(collective_cpu=cpu, **machine), shape, config) == 0.0
    zero1 = Config(dp=4, zero=1)
    assert timing.step_time(shape, _cluster(cores=2.0, collective_cpu=cpu, **machine), zero1, 16) == \
        timing.step_time(shape, _cluster(cores=2.0, **machine), zero1, 16)


def test_prefetch_probe_gives_the_share_of_a_gather_that_hides_behind_compute():
    """The ``prefetch`` probe (a block's gather beside a block's compute) is read back through
    ``timing.prefetch_wait``: whatever share hid in the probe comes back, clamped to 0..1."""
    from workbench.advise.calibrate import _prefetch_overlap
    from workbench.models import GPTConfig

    config = GPTConfig.preset("tiny")
    machine = cost.CostModel(alpha=1e-5, beta=1e-9, gamma=0.0)
    topo = timing.Topology(2, intra=None, inter=Link(1e-3, 50e6))
    sync = {4: [(1e-4, 0.0), (2e-3, 0.003)]}
    unit = -(-ModelShape.from_gpt(config).layer_parameters() // 4) * 4 * 4
    g = cost.predict("all_gather", "native", unit, 4, machine,
                     topology=timing.group_topology([0, 1, 2, 3], 2, None, topo.inter))
    for c in (0.5 * g, 2 * g):   # the block shorter, then longer, than the gather
        for share in (0.0, 0.4, 1.0):
            result = {"prefetch_layer": c, "prefetch_both": c + timing.prefetch_wait(g, c, share, 0.003)}
            assert _prefetch_overlap(result, config, 4, machine, topo, sync) == pytest.approx(share, abs=1e-9)
    # a pair slower than the model's worst (the gather waited for in full): 0; faster than its best: 1
    assert _prefetch_overlap({"prefetch_layer": g, "prefetch_both": 3 * g + 0.01}, config, 4, machine, topo, sync) == 0
    assert _prefetch_overlap({"prefetch_layer": g, "prefetch_both": g}, config, 4, machine, topo, sync) == 1
    assert _prefetch_overlap({}, config, 4, machine, topo, sync) == 0   # a calibration from before the probe
