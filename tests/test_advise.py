"""``workbench.advise``: shapes, clusters, memory per device, the space, the choice and its explanation, the CLI.

Single process, no ranks: the parameter counts against the real GPT (whole, tensor-parallel
formula, pipeline stages as ``partition`` cuts them) and the published Llama counts; memory
against the formulas the strategies were checked against and against ``model_state_bytes`` /
``MemoryMeter`` on the real model; the pipelines' live micro-batches; every infeasibility rule;
the explanation naming the deciding fact on a single fast node and on many nodes behind a slow
network; the ``workbench advise`` command (text, JSON, figure, and its delegation to the
calibrate/validate modules). Runs measured against predicted at world 2 and 4 are in
tests/test_advise_validate.py.
"""
from __future__ import annotations

import dataclasses
import itertools
import json
import math
import random
import types

from dataclasses import replace

import pytest
import torch

from workbench.advise import Cluster, Config, ModelShape, advise, configurations, infeasible_reason, \
    memory_per_device, predict
from workbench.advise.cluster import GiB
from workbench.advise import memory_model as advise_memory
from workbench.advise import timing as advise_timing
from workbench.advise.memory_model import activation_bytes_per_microbatch, memory_by_rank
from workbench.advise.plan import MEMORY_CATEGORIES, TIME_PARTS
from workbench.advise.space import shard_groups
from workbench.comm import Link, cost
from workbench.comm.topology import Topology
from workbench.measure.metrics import MemoryMeter, model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel.pipeline import partition
from workbench.parallel.recompute import activation_bytes
from workbench.parallel.tensor import activation_bytes_per_layer, parameters_per_rank
from workbench.parallel.zero_memory import model_state_per_rank

GPT_VARIANTS = [GPTConfig.preset("tiny"), GPTConfig.preset("small"), GPTConfig.preset("medium"),
                GPTConfig.preset("tiny", bias=False), GPTConfig.preset("tiny", tie_weights=False, vocab_size=67)]


def _cluster(devices_per_node=4, nodes=1, memory_gib=80.0, inter_GBps=5.0):
    return Cluster(nodes=nodes, devices_per_node=devices_per_node, memory_bytes=memory_gib * GiB, flops=100e12,
                   intra=Link(2e-6, 100e9), inter=Link(10e-6, inter_GBps * 1e9), name="test")


# ----------------------------------------------------------------------------------- shapes
@pytest.mark.parametrize("config", GPT_VARIANTS, ids=lambda c: f"L{c.n_layer}h{c.n_embd}b{c.bias}t{c.tie_weights}")
def test_parameter_count_is_the_real_gpts_whole_per_tp_rank_and_per_stage(config):
    shape = ModelShape.from_gpt(config)
    model = GPT(config)
    assert shape.parameters() == sum(p.numel() for p in model.parameters()) == model.num_parameters()
    for t in (2, 4):
        assert shape.parameters(tp=t) == parameters_per_rank(config, t)
    for pp in (2, 3):
        if pp > config.n_layer:
            continue
        stages = partition(GPT(config), pp)
        # each stage's own parameters; a tied embedding is held by the first and the last stage
        assert [shape.stage_parameters(pp, s) for s in range(pp)] == \
            [sum(p.numel() for p in st.parameters()) for st in stages]


def test_llama_presets_have_the_published_counts():
    published = {"llama-7b": 6_738_415_616, "llama-13b": 13_015_864_320, "llama-70b": 68_976_648_192,
                 "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496}
    for name, count in published.items():
        shape = ModelShape.preset(name)
        assert shape.parameters() == count, name
        assert shape.source and shape.gated and not shape.tied
    # tp splits the matrices, keeps the norms: 7B on 8 ranks is a little over 1/8
    seven = ModelShape.preset("llama-7b")
    assert seven.parameters() / 8 < seven.parameters(tp=8) < seven.parameters() / 8 * 1.001


@pytest.mark.parametrize("kwargs, match", [
    (dict(layers=0), "layers=0"), (dict(hidden=100, heads=3), "multiple of heads"),
    (dict(kv_heads=3), "kv_heads=3"), (dict(norm="batchnorm"), "norm="), (dict(positions="alibi"), "positions=")])
def test_bad_shapes_are_named(kwargs, match):
    base = dict(layers=2, hidden=64, heads=4, vocab=65, seq=16, ffn=256)
    with pytest.raises(ValueError, match=match):
        ModelShape(**{**base, **kwargs})
    with pytest.raises(ValueError, match="unknown"):
        ModelShape.preset("gpt-5")
    with pytest.raises(ValueError, match="model="):
        ModelShape.coerce(3.5)


def test_cluster_presets_validation_and_changes():
    dgx = Cluster.preset("dgx-h100", nodes=4)
    assert (dgx.devices, dgx.intra.bandwidth_Bps, dgx.inter.bandwidth_Bps) == (32, 450e9, 50e9)
    assert dgx.link_ratio == 9 and dgx.source and dgx.flops_for("fp32") < dgx.flops_for("bf16")
    assert Cluster.preset("p4d-a100").link_ratio == 48
    assert Cluster.preset("a2-ultra-100g").link_ratio > 100
    dgx_a100 = Cluster.preset("dgx-a100", nodes=2)   # NVSwitch 300 GB/s each way; 8 x 200 Gb/s HDR per node
    assert (dgx_a100.devices, dgx_a100.memory_bytes, dgx_a100.intra.bandwidth_Bps, dgx_a100.inter.bandwidth_Bps) \
        == (16, 85_056_798_720, 300e9, 25e9)        # what CUDA reports of an A100 80 GB, not 80e9
    dgx_h200 = Cluster.preset("dgx-h200", nodes=4)   # the DGX H100's links and NICs, an H200's memory
    assert (dgx_h200.intra, dgx_h200.inter, dgx_h200.framework) == (dgx.intra, dgx.inter, dgx.framework)
    assert replace(dgx_h200.nccl, name="", source="") == replace(dgx.nccl, name="", source="")
    assert dgx_h200.memory_bytes == 150_109_880_320 > 1.7 * dgx.memory_bytes   # what CUDA reports of an H200
    assert dgx_h200.flops_for("bf16") == dgx.flops_for("bf16")                   # the H100's chip
    with pytest.raises(ValueError, match="nodes=0"):
        dgx.with_(nodes=0)
    with pytest.raises(ValueError, match="memory_bytes"):
        dgx.with_(memory_bytes=-1)
    with pytest.raises(ValueError, match="intra"):
        dgx.with_(intra="fast")
    with pytest.raises(ValueError, match="unknown"):
        Cluster.preset("my-laptop")


# ----------------------------------------------------------------------------------- memory
@pytest.mark.parametrize("zero", [0, 1, 2, 3])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_model_state_is_the_zero_formula_of_the_stage_shard(zero, precision):
    """bf16: the paper's formula exactly; fp32: the formula plus what the strategies hold beyond it
    (flat buffers padded to a multiple of dp, Adam's 4-byte step counter per tensor it updates)."""
    shape = ModelShape.preset("small")
    for dp, tp, pp in ((4, 1, 1), (2, 2, 1), (2, 1, 2), (3, 1, 1)):
        config = Config(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=pp, precision=precision)
        rows = memory_by_rank(shape, config, 12)
        for stage, row in enumerate(rows):
            psi = shape.stage_parameters(pp, stage, tp)
            want = model_state_per_rank(psi, dp, zero, "adam", "fp32" if precision == "fp32" else "mixed")
            got = (row["parameters"], row["gradients"], row["optimizer"])
            if precision == "bf16":
                assert got == (want["params"], want["grads"], want["optimizer"])
                continue
            tensors = len(shape.stage_tensors(pp, stage, tp))
            slack = 4 * dp * (tensors + shape.layers + 1)   # padding: under dp elements per bucket or unit
            assert 0 <= got[0] - want["params"] <= slack and 0 <= got[1] - want["grads"] <= slack
            assert 0 < got[2] - want["optimizer"] <= 4 * tensors + slack
            if zero == 0:
                assert got == (want["params"], want["grads"], want["optimizer"] + 4 * tensors)
    # float32 Adam, one replica: 16 bytes per parameter and the step counters
    state = memory_per_device("small", Config(), 8)
    assert state["parameters"] + state["gradients"] == 8 * shape.parameters()


def test_model_state_matches_model_state_bytes_of_the_real_model_and_stages():
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny")
    x, y = (torch.randint(0, 65, (2, config.block_size)) for _ in range(2))
    model = GPT(config)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(x, y)[1].backward()
    opt.step()
    measured = model_state_bytes(model, opt)
    predicted = memory_per_device(config, Config(), 2)
    assert measured["params"] == predicted["parameters"] and measured["grads"] == predicted["gradients"]
    assert measured["optimizer"] == predicted["optimizer"]   # Adam's moments and its 4-byte step counters
    # pipeline stages: each stage's own model state (the tied embedding on both ends)
    stages = partition(GPT(config), 2)
    rows = memory_by_rank(config, Config(pp=2, microbatches=2), 4)
    for stage, row in zip(stages, rows):
        params = list(stage.parameters())
        assert sum(p.numel() * 4 for p in params) == row["parameters"]


@pytest.mark.parametrize("precision, dtype", [("fp32", torch.float32), ("bf16", torch.bfloat16)])
@pytest.mark.parametrize("policy", ["none", "selective", "full"])
def test_activations_without_parallelism_are_recompute_activation_bytes(precision, dtype, policy):
    """recompute.activation_bytes's peak, plus backward's working set at its two busiest moments: the
    last layer's first matrix product (the gradient flowing in, the MLP's 4h-wide gradient, the
    weight's and bias's new gradients and the tied head's waiting one when they are temporaries;
    the head's tensors freed) and the loss's backward (two logits-sized gradients)."""
    cfg = GPTConfig.preset("small")
    e = 4 if precision == "fp32" else 2
    b, s, h, V = 6, cfg.block_size, cfg.n_embd, cfg.vocab_size

    def want(batch, accumulating=False):
        formula = activation_bytes(cfg, batch, policy=policy, dtype=dtype)
        sbh, sb = s * batch * h, s * batch
        loss = formula["kept"] + 2 * e * sb * V      # nll_loss's and log_softmax's gradients
        head = formula["kept"] + e * sbh + (e * V * h if accumulating else 0)
        work = e * (sbh + sb * 4 * h) - e * (2 * sbh + 2 * sb + sb * V)
        if accumulating:     # the MLP weight's and bias's new gradients beside their .grad, the tied head's
            work += e * (h * 4 * h + h) + e * V * h
        if policy == "full":
            if not accumulating:
                # the gradients become .grad as backward goes: the peak (with them) at the last layer
                # if an input outweighs a layer's gradients, else at the first (no other input kept)
                none = activation_bytes(cfg, batch, policy="none", dtype=dtype)["per_layer"]
                grads = e * (12 * h * h + 13 * h)
                others = (cfg.n_layer - 1) * formula["per_layer"] if formula["per_layer"] >= grads else 0
                alive = others + none + e * sb * V + e * sbh + e * sb * 4 * h + e * V * h
                return max(formula["kept"], alive, loss, head)
            # the recomputed last layer's backward: its whole working set in place of its input
            none = activation_bytes(cfg, batch, policy="none", dtype=dtype)["per_layer"]
            alive = formula["kept"] - formula["per_layer"] + none
            return max(formula["peak"], alive + max(0, work), loss, head)
        return max(formula["peak"], formula["kept"] + max(0, work), loss, head)

    got = memory_per_device(cfg, Config(precision=precision, recompute=policy), b)["activations"]
    assert got == want(b)
    # gradient accumulation: each of m micro-batches alone
    acc = memory_per_device(cfg, Config(dp=1, microbatches=3, precision=precision, recompute=policy), b)
    assert acc["activations"] == want(2, accumulating=True)


def test_activations_measured_on_the_real_model():
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny")
    model = GPT(config)
    x, y = (torch.randint(0, 65, (4, config.block_size)) for _ in range(2))
    with MemoryMeter(model, x, y, device="cpu") as meter:
        model(x, y)[1].backward()
    predicted = memory_per_device(config, Config(), 4)["activations"]
    assert abs(meter.peak_by_category["activations"] / predicted - 1) <= 0.02


def test_tensor_parallel_layer_is_tensor_py_formula_and_sequence_parallel_shards_the_rest():
    shape = ModelShape.preset("small")
    base = activation_bytes_per_microbatch(shape, Config(dp=1, tp=1), 4, 0)["kept"]
    for sp in (False, True):
        config = Config(tp=4, sequence_parallel=sp)
        kept = activation_bytes_per_microbatch(shape, config, 4, 0)["kept"]
        layers = shape.layers * activation_bytes_per_layer(4, shape.seq, shape.hidden, shape.heads, 4, sp)
        edge = kept - layers      # final norm, head input, logits: the vocabulary-parallel head's share
        assert 0 < edge < base - shape.layers * activation_bytes_per_layer(4, shape.seq, shape.hidden, shape.heads)
    assert activation_bytes_per_microbatch(shape, Config(tp=4, sequence_parallel=True), 4, 0)["kept"] < \
        activation_bytes_per_microbatch(shape, Config(tp=4), 4, 0)["kept"]


def test_pipeline_ranks_keep_the_schedules_live_microbatches():
    """GPipe and 1F1B replay the rank's action list: the live micro-batches kept whole, the one in
    backward at its peak (its weight gradients accumulate into .grad after the rank's first
    backward), the receive posted for the next compute action, the input gradient sent by the
    previous backward, and on the last stage the logits of every micro-batch forwarded so far.
    ZB-H1: a split B also keeps the output gradients of the products whose W it defers (per GPT
    layer 3h + h + 4h + h wide: query/key/value, attention projection, MLP up and down)."""
    shape = ModelShape.preset("small").with_(layers=8)
    one = lambda config, stage: activation_bytes_per_microbatch(shape, config, 16, stage)  # noqa: E731
    msg = 4 * shape.seq * 2 * shape.hidden          # one micro-batch of 2 sequences, float32
    logits = 4 * shape.seq * 2 * shape.vocab
    for schedule, live in (("gpipe", [8, 8, 8, 8]), ("1f1b", [4, 3, 2, 1]), ("zb-h1", [4, 4, 4, 4])):
        config = Config(pp=4, schedule=schedule, microbatches=8)
        rows = memory_by_rank(shape, config, 16)
        for r in range(4):
            kept, acc = one(config, r)["kept"], one(config, r)["peak"]
            first = activation_bytes_per_microbatch(shape, Config(pp=4, schedule="gpipe", microbatches=1), 2, r)
            assert first["kept"] == kept and first["peak"] < acc      # accumulating: the weights' new gradients
            got = rows[r]["activations"]
            if schedule == "gpipe":     # the first backward, all 8 alive; the next output gradient posted
                assert got == 7 * kept + first["peak"] + (msg if r < 3 else 0) + (8 * logits if r == 3 else 0)
            elif schedule == "1f1b" and r < 3:   # all alive; a receive posted; (r > 0) the last gradient sent
                assert got == (live[r] - 1) * kept + acc + (2 * msg if r > 0 else msg), (r, got)
            elif schedule == "1f1b":    # one alive; the last-but-one backward, 7 micro-batches' logits
                assert got == acc + 2 * msg + 7 * logits
            elif r == 0:                # zb-h1's first stage: B has nothing to do, W the whole backward
                low = live[r] * kept + acc - kept
                assert low <= got <= low + 2 * msg + 8 * logits, (r, got, low)
            else:   # a split B ends holding its micro-batch and every deferred product's output gradient
                w_grads = 2 * 4 * shape.seq * 2 * 9 * shape.hidden + (logits if r == 3 else 0)
                low = live[r] * kept + w_grads
                assert low <= got <= low + 3 * msg + 2 * msg + 8 * logits, (r, got, low)
    # interleaved: two chunks per rank, each half a stage's layers
    inter = memory_by_rank(shape, Config(pp=2, schedule="interleaved", microbatches=4), 16)
    assert len(inter) == 2 and inter[0]["activations"] > inter[1]["activations"]


def test_hybrid_sharding_shards_over_its_group_and_all_reduces_across_replicas():
    """``Config(zero=3, shard_group=s)`` (HSDP): the model state of ZeRO-3 over ``s`` ranks (each
    rank's share of it as plain ZeRO-3 with ``dp = s`` holds), the gathers and reduce-scatters inside
    the shard group's links, then each gradient shard all-reduced across the ``dp / s`` replicas:
    across a slow network less traffic than ZeRO-3 over every rank. ``shard_group`` 0 or ``dp``:
    plain ZeRO-3, to the bit."""
    shape = ModelShape(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024, ffn=4096)
    slow = Cluster(nodes=4, devices_per_node=4, memory_bytes=80e9, flops=100e12, intra=Link(2e-6, 200e9),
                   inter=Link(30e-6, 1e9))
    plain = Config(dp=16, zero=3, precision="bf16", microbatches=2)
    hybrid = dataclasses.replace(plain, shard_group=4)
    assert hybrid.shard_size == 4 and plain.shard_size == 16 and dataclasses.replace(plain, shard_group=16).shard_size == 16
    assert hybrid.label() == "dp16-tp1-pp1 zero3 hsdp4 accum m2 bf16" and "hsdp" not in plain.label()
    four = memory_per_device(shape, Config(dp=4, zero=3, precision="bf16", microbatches=2), 8)
    mem = memory_per_device(shape, hybrid, 32)
    assert all(mem[k] == four[k] for k in ("parameters", "gradients", "optimizer")), (mem, four)
    assert mem["parameters"] > memory_per_device(shape, plain, 32)["parameters"]
    groups = advise_timing._groups(dataclasses.replace(hybrid, dp=8, tp=2, shard_group=4))
    assert groups["shard"] == [0, 2, 4, 6] and groups["replicate"] == [0, 8] and "shard" not in advise_timing._groups(plain)
    t_plain, t_hybrid = (predict(shape, slow, 32, c).time for c in (plain, hybrid))
    assert t_hybrid["dp"] < 0.5 * t_plain["dp"]
    assert predict(shape, slow, 32, dataclasses.replace(plain, shard_group=16)).time == t_plain
    for bad in (dict(shard_group=3), dict(zero=1, shard_group=4)):
        with pytest.raises(ValueError, match="shard_group"):
            predict(shape, slow, 32, dataclasses.replace(plain, **bad))


def test_hybrid_sharding_is_searched_when_asked():
    """``advise(..., hybrid=True)`` (``--hybrid-sharding``) also tries each ZeRO-3 configuration whose
    data-parallel ranks span nodes sharded over the data-parallel ranks of one node, then 2, 4, ..
    nodes (``shard_groups``); nothing else changes, and by default the space is as it was. Across a
    slow network a hybrid plan beats plain ZeRO-3 of the same layout, and the search ranks it so."""
    shape = ModelShape(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024, ffn=4096)
    slow = Cluster(nodes=4, devices_per_node=4, memory_bytes=80e9, flops=100e12, intra=Link(2e-6, 200e9),
                   inter=Link(30e-6, 1e9))
    assert [shard_groups(slow, 16, 1), shard_groups(slow, 8, 2), shard_groups(slow, 4, 4), shard_groups(slow, 2, 8),
            shard_groups(slow, 12, 1), shard_groups(slow, 4, 3)] == [[4, 8], [2, 4], [1, 2], [], [4], []]
    plain = configurations(shape, slow, 32)
    both = configurations(shape, slow, 32, hybrid=True)
    added = [c for c in both if c.shard_group]
    assert not any(c.shard_group for c in plain) and [c for c in both if not c.shard_group] == plain
    assert added and all(c.zero == 3 and c.shard_size < c.dp and c.shard_size in shard_groups(slow, c.dp, c.tp)
                         for c in added)
    assert len(added) == sum(len(shard_groups(slow, c.dp, c.tp)) for c in plain if c.zero == 3)
    narrow = dict(precisions=("bf16",), zero=(3,), schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,))
    ranked = [p for p in advise(shape, slow, 32, hybrid=True, **narrow) if p.feasible]
    best_plain = next(p for p in ranked if p.config.dp == 16 and not p.config.shard_group)
    best_hybrid = next(p for p in ranked if p.config.dp == 16 and p.config.shard_group)
    assert best_hybrid.time["total"] < best_plain.time["total"]
    assert ranked.index(best_hybrid) < ranked.index(best_plain)
    assert best_hybrid.time == predict(shape, slow, 32, best_hybrid.config).time
    with pytest.raises(ValueError, match="hybrid="):
        configurations(shape, slow, 32, hybrid="yes")


def test_recomputing_the_first_layers_of_each_stage_is_priced_in_between():
    """``Config(recompute="full", recompute_layers=k)``: each stage's first k layers recomputed, the
    others keeping everything. Every cost of a stage is a sum over its layers, so the step's compute
    is no recomputation's plus k / L of what full recomputation adds (on a GPU and on a CPU
    cluster, with a pipeline per stage), the memory falls as k grows, and k at or beyond a stage's
    layers is full recomputation; the field is checked and labelled."""
    shape = ModelShape.preset("llama3-8b").with_(seq=4096)
    gpu = Cluster.preset("dgx-h100", nodes=1)
    cpu = Cluster(nodes=1, devices_per_node=8, memory_bytes=80e9, flops=100e12, intra=Link(2e-6, 200e9),
                  inter=Link(2e-6, 200e9))
    for cluster in (gpu, cpu):
        for base, layers in ((Config(dp=8, zero=1, microbatches=4, precision="bf16"), 32),
                             (Config(dp=2, pp=4, microbatches=8, precision="bf16"), 8)):
            none = predict(shape, cluster, 32, base)
            full = predict(shape, cluster, 32, dataclasses.replace(base, recompute="full"))
            memory = [none.memory["total"]]
            for k in (1, layers // 2, layers - 1):
                part = predict(shape, cluster, 32, dataclasses.replace(base, recompute="full", recompute_layers=k))
                share = k / layers
                assert part.time["compute"] == pytest.approx(
                    none.time["compute"] + share * (full.time["compute"] - none.time["compute"]), rel=1e-9)
                assert none.time["total"] < part.time["total"] < full.time["total"]
                memory.append(part.memory["total"])
            memory.append(full.memory["total"])
            assert memory == sorted(memory, reverse=True) and len(set(memory)) == len(memory), memory
            for k in (layers, layers + 5):   # a stage's every layer: full recomputation
                same = predict(shape, cluster, 32, dataclasses.replace(base, recompute="full", recompute_layers=k))
                assert same.time == pytest.approx(full.time) and same.memory == full.memory
    assert Config(dp=2, recompute="full", recompute_layers=3).label() == "dp2-tp1-pp1 zero0 fp32 full(3)"
    for bad, match in ((dict(recompute="selective", recompute_layers=2), "recompute_layers=2.*recompute='full'"),
                       (dict(recompute="full", recompute_layers=-1), "recompute_layers=-1")):
        with pytest.raises(ValueError, match=match):
            predict(shape, gpu, 32, Config(dp=8, precision="bf16", **bad))


def test_the_least_recomputation_that_fits_is_searched_when_asked():
    """``advise(..., partial_recompute=True)`` (``--partial-recompute``): where recomputing every layer
    fits and none does not, the plan recomputing the fewest first layers of each stage that fits
    (one fewer does not fit), faster than full recomputation; by default the space is as it was. Llama
    3 8B, sequences of 8,192, on one DGX H100: such a plan is the fastest."""
    shape = ModelShape.preset("llama3-8b")
    one = Cluster.preset("dgx-h100", nodes=1)
    narrow = dict(precisions=("bf16",), zero=(2,), schedules=("1f1b",), sequence_parallel=(False,))
    plain = advise(shape, one, 32, **narrow)
    plans = advise(shape, one, 32, partial_recompute=True, **narrow)
    assert not any(p.config.recompute_layers for p in plain)
    assert [p.config for p in plans if not p.config.recompute_layers] == [p.config for p in plain]
    partial = [p for p in plans if p.config.recompute_layers]
    assert partial and all(p.feasible for p in partial)
    for p in partial:
        c = p.config
        assert not predict(shape, one, 32, dataclasses.replace(c, recompute="none", recompute_layers=0)).feasible
        if c.recompute_layers > 1:
            assert not predict(shape, one, 32, dataclasses.replace(c, recompute_layers=c.recompute_layers - 1)).feasible
        assert p.time["total"] < predict(shape, one, 32, dataclasses.replace(c, recompute_layers=0)).time["total"]
    best = plans[0]
    assert best.config.recompute_layers and best.time["total"] < plain[0].time["total"], best.config.label()
    assert "first" in best.explain() and f"full({best.config.recompute_layers})" in best.config.label()
    with pytest.raises(ValueError, match="partial_recompute="):
        advise(shape, one, 32, partial_recompute="yes")


def test_a_gpu_clusters_nccl_model_follows_its_links():
    """``Cluster.with_(inter=...)`` (``workbench advise --inter``) on a GPU preset scales its NCCL model's
    network bandwidth by the new link's over the old, ``intra=`` its NVLink figures, so a slower
    network slows the collectives priced on it; ``nccl=`` given too wins. (Before, a preset's NCCL
    model priced every collective and the new link changed nothing.)"""
    base = Cluster.preset("dgx-h100", nodes=12)
    quarter = base.with_(inter=Link(base.inter.latency_s, base.inter.bandwidth_Bps / 4))
    assert quarter.nccl.network_Bps == pytest.approx(base.nccl.network_Bps / 4)
    assert quarter.nccl.nvlink_busbw == base.nccl.nvlink_busbw and base.with_(nodes=2).nccl == base.nccl
    half_nvlink = base.with_(intra=Link(base.intra.latency_s, base.intra.bandwidth_Bps / 2))
    assert (half_nvlink.nccl.nvlink_busbw, half_nvlink.nccl.nvls_busbw, half_nvlink.nccl.p2p_Bps) == pytest.approx(
        (base.nccl.nvlink_busbw / 2, base.nccl.nvls_busbw / 2, base.nccl.p2p_Bps / 2))
    assert half_nvlink.nccl.network_Bps == base.nccl.network_Bps
    kept = base.with_(inter=quarter.inter, nccl=base.nccl)
    assert kept.nccl == base.nccl
    config = Config(dp=96, zero=3, precision="bf16", recompute="selective")
    fast, slow = (predict("llama-7b", c, 192, config).time for c in (base, quarter))
    assert slow["dp"] > 2 * fast["dp"] and slow["compute"] == fast["compute"]
    assert predict("llama-7b", kept, 192, config).time == fast
    cpu = _cluster(4, nodes=2)    # no NCCL model: its collectives are priced on the links themselves
    assert cpu.nccl is None and cpu.with_(inter=Link(1e-5, 1e8)).nccl is None


def test_the_explanation_names_hybrid_sharding_and_no_zero_rival_without_data_parallelism():
    """The ZeRO decision is compared only among plans with data parallelism (a plan with dp = 1 has no
    ZeRO to choose: its rival is a tp or pp decision), and a hybrid plan is named as such."""
    shape = ModelShape(layers=8, hidden=1024, heads=16, vocab=32000, seq=1024, ffn=4096)
    slow = Cluster(nodes=4, devices_per_node=4, memory_bytes=80e9, flops=100e12, intra=Link(2e-6, 200e9),
                   inter=Link(30e-6, 1e9))
    narrow = dict(precisions=("bf16",), zero=(3,), schedules=("1f1b",), recompute=("none",), sequence_parallel=(False,))
    for plans in (advise(shape, slow, 32, hybrid=True, **narrow), advise(shape, slow, 32, **narrow)):
        text = plans[0].explain()
        against_zero = [line for line in text.splitlines() if line.startswith("Against: ") and "rather than" in line
                        and line.split(" rather than ")[0].endswith(("ZeRO-3", "replicated)"))]
        assert all("ZeRO-0" not in line for line in against_zero), against_zero
    best = next(p for p in advise(shape, slow, 32, hybrid=True, **narrow) if p.config.shard_group)
    assert f"hybrid sharding (ZeRO-3 over groups of {best.config.shard_size} ranks" in best.explain()


def test_interleaving_with_more_virtual_stages_shrinks_the_bubble_and_the_first_ranks_activations():
    """``Config.virtual_stages`` (Megatron's v): v chunks per rank, stage ``c p + r`` on rank ``r``.
    The replayed bubble is the closed form ``(p - 1) / (v m + p - 1)`` of the step with equal
    stages; the first rank holds ``2 (p - 1) + (v - 1) p + 1`` chunk-micro-batches of ``L / (p v)``
    layers at its peak (Narayanan et al. 2021), fewer layers' worth as ``v`` grows."""
    from workbench.advise import FRAMEWORKS
    shape = ModelShape(layers=24, hidden=256, heads=4, vocab=512, seq=128, ffn=1024)
    cluster = Cluster.preset("dgx-h100", nodes=1).with_(devices_per_node=4, framework=FRAMEWORKS["megatron"])
    plain = Config(pp=4, schedule="1f1b", microbatches=8, precision="bf16")
    by_v = {v: Config(pp=4, schedule="interleaved", microbatches=8, precision="bf16", virtual_stages=v)
            for v in (2, 3, 6)}
    assert by_v[2] == Config(pp=4, schedule="interleaved", microbatches=8, precision="bf16")   # the default
    assert by_v[3].label() == "dp1-tp1-pp4 interleaved v3 m8 bf16" and by_v[2].label() == "dp1-tp1-pp4 interleaved m8 bf16"
    assert [by_v[v].stages_per_rank for v in (2, 3, 6)] == [2, 3, 6] and plain.stages_per_rank == 1
    assert Config(pp=1, schedule="interleaved", virtual_stages=3).stages_per_rank == 1
    for v, config in by_v.items():
        assert advise_timing._bubble_share("interleaved", 4, 8, v) == pytest.approx(3 / (v * 8 + 3))
        assert advise_memory.rank_stages(config, 1) == [1 + 4 * c for c in range(v)]
    first = {v: memory_by_rank(shape, c, 8)[0]["activations"] for v, c in by_v.items()}
    assert first[6] < first[3] < first[2]
    bubble = {v: predict(shape, cluster, 8, c).time["bubble"] for v, c in by_v.items()}
    assert bubble[6] < bubble[3] < bubble[2] < predict(shape, cluster, 8, plain).time["bubble"]
    with pytest.raises(ValueError, match="virtual_stages=1"):
        predict(shape, cluster, 8, dataclasses.replace(by_v[2], virtual_stages=1))
    assert "16 pipeline stages (4 ranks x 4 chunks) but only 12 layers" in infeasible_reason(
        shape.with_(layers=12), cluster, dataclasses.replace(by_v[2], virtual_stages=4), 8)


# ----------------------------------------------------------------------------------- the space
def test_infeasibility_reasons_name_the_rule_and_the_numbers():
    small, four = "small", _cluster(4)
    cases = [
        (Config(dp=1, tp=8), _cluster(8), "does not divide the 4 attention heads"),
        (Config(dp=2), four, "dp x tp x pp = 2 x 1 x 1 = 2 devices, but the cluster has 1 x 4 = 4"),
        (Config(dp=1, pp=8, microbatches=8), _cluster(8), "8 pipeline stages but only 4 layers"),
        (Config(dp=1, pp=4, schedule="1f1b", microbatches=2), four, "1f1b needs at least 4 micro-batches"),
        (Config(dp=1, pp=4, schedule="interleaved", microbatches=4), four, "8 pipeline stages (4 ranks x 2 chunks)"),
        (Config(dp=4, microbatches=3), four, "does not split into dp x m = 4 x 3"),
        (Config(dp=4, zero=0), _cluster(4, memory_gib=0.01), "per device, has 10.24 MiB (largest: "),
        (Config(dp=1, tp=4, zero=2), four, "dp = 1 has nothing to shard"),
    ]
    for config, cluster, want in cases:
        assert want in infeasible_reason(small, cluster, config, 20), (config, infeasible_reason(small, cluster, config, 20))
    assert infeasible_reason(small, four, Config(dp=4, zero=1), 20) == ""
    # over the device by less than the figures' rounding: the reason says by how much
    from workbench.advise.space import memory_reason
    h100 = Cluster.preset("dgx-h100")
    over = dict.fromkeys(("parameters", "gradients", "optimizer", "buffers"), 1.0) | {
        "activations": 40 * GiB, "total": h100.memory_bytes + 2048}
    assert memory_reason(over, h100) == ("needs 79.65 GiB (2.00 KiB more) per device, has 79.65 GiB "
                                         "(largest: activations 40.00 GiB)")
    # a 70B model does not fit one 8 x 40 GB node even fully sharded
    reason = infeasible_reason("llama-70b", Cluster.preset("p4d-a100"), Config(dp=8, zero=3, precision="bf16",
                                                                                recompute="full", microbatches=32), 256)
    assert reason.startswith("needs") and "has 39.61 GiB" in reason   # 0.99 of 40 GiB usable


_LLAMA_8B = ModelShape(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, seq=4096, gated=True,
                       tied=False, bias=False, positions="rope", norm="rmsnorm")


def test_a_gpu_framework_s_1f1b_takes_fewer_micro_batches_than_stages_as_a_fill_and_drain():
    """Megatron-LM's 1F1B runs with m < p (each rank's warm-up is min(p - r - 1, m) forwards),
    nanotron's with m >= p - 1: on a GPU cluster whose framework runs that pipeline it is priced,
    with GPipe's step time (a fill and a drain) and no more activations than GPipe's, and searched
    in GPipe's place; torch's pipelining (torchtitan, framework 'eager') and the workbench's own
    runtime refuse it, naming the rule."""
    from workbench.advise import FRAMEWORKS
    # picotron's engines (afab and 1f1b, its 1F1B's warm-up min(p - r - 1, m) as Megatron-LM's)
    picotron = dataclasses.replace(FRAMEWORKS["eager-fused"], name="picotron", pipeline="megatron")
    h100 = Cluster.preset("dgx-h100").with_(framework=picotron)
    for m in (1, 2, 3):
        one_f, gpipe = (predict(_LLAMA_8B, h100, 2 * m, Config(dp=2, tp=1, pp=4, zero=1, schedule=s, microbatches=m,
                                                               precision="bf16", recompute="selective"))
                        for s in ("1f1b", "gpipe"))
        assert one_f.feasible and gpipe.feasible, (one_f.reason, gpipe.reason)
        assert one_f.time["total"] == pytest.approx(gpipe.time["total"], rel=1e-9)
        assert one_f.memory["activations"] <= gpipe.memory["activations"] * (1 + 1e-9)
    config = Config(dp=2, pp=4, zero=1, microbatches=2, precision="bf16", recompute="selective")
    torch_pipe = predict(_LLAMA_8B, h100.with_(framework=FRAMEWORKS["eager"]), 4, config)
    assert not torch_pipe.feasible
    assert "1f1b needs at least 4 micro-batches for 4 stages, got m = 2" in torch_pipe.reason
    assert "1f1b needs at least 4 micro-batches" in infeasible_reason("small", _cluster(8), config, 16)
    # the search tries it, and leaves out GPipe at the same m (the same time, never less memory); under
    # torch's pipelining it keeps GPipe's short fills
    def short(cluster, schedule):
        return any(c.schedule == schedule and c.microbatches < c.pp for c in
                   configurations(_LLAMA_8B, cluster, 16, precisions=("bf16",), recompute=("selective",)))

    assert short(h100, "1f1b") and not short(h100, "gpipe")
    eager = h100.with_(framework=FRAMEWORKS["eager"])
    assert short(eager, "gpipe") and not short(eager, "1f1b")
    # nanotron (eager-fused, dgx-h100's default): 1F1B from p - 1, its afab (GPipe) below
    nanotron = Cluster.preset("dgx-h100")
    assert nanotron.framework.pipeline == "nanotron"
    for m, fits in ((1, False), (2, False), (3, True)):
        plan = predict(_LLAMA_8B, nanotron, 2 * m, Config(dp=2, pp=4, zero=1, microbatches=m, precision="bf16",
                                                          recompute="selective"))
        assert plan.feasible == fits and (fits or plan.reason == f"1f1b needs at least 3 micro-batches for 4 stages, "
                                                                   f"got m = {m}"), plan.reason
    shorts = {(c.schedule, c.pp, c.microbatches) for c in
              configurations(_LLAMA_8B, nanotron, 16, precisions=("bf16",), recompute=("selective",))
              if c.microbatches < c.pp}
    assert ("1f1b", 2, 1) in shorts and ("gpipe", 2, 1) not in shorts       # m = p - 1: 1F1B in GPipe's place
    assert ("gpipe", 4, 2) in shorts and ("1f1b", 4, 2) not in shorts       # m < p - 1: GPipe (afab) only


def test_zero_over_one_data_parallel_rank_runs_on_a_gpu_framework_and_shards_nothing():
    """Megatron's distributed optimizer, nanotron's ZeRO-1 and FSDP run with one data-parallel rank:
    on a GPU cluster such a configuration is priced exactly as ZeRO-0 (nothing to shard, nothing to
    reduce); the workbench's runtime refuses it, as before."""
    for nodes, tp, pp in ((1, 8, 1), (1, 4, 2), (2, 8, 2)):
        h100 = Cluster.preset("dgx-h100", nodes=nodes)
        plain, zero1 = (predict(_LLAMA_8B, h100, 16, Config(dp=1, tp=tp, pp=pp, zero=z, microbatches=16,
                                                            sequence_parallel=True, precision="bf16",
                                                            recompute="selective")) for z in (0, 1))
        assert zero1.feasible and zero1.memory == plain.memory and zero1.time == plain.time
    assert "dp = 1 has nothing to shard" in infeasible_reason("small", _cluster(4), Config(dp=1, tp=4, zero=1), 20)


@pytest.mark.parametrize("preset", ["dgx-h100", "dgx-a100"])
def test_predict_answers_every_layout_one_can_write_on_a_gpu_cluster(preset):
    """Every split of 16 GPUs into dp x tp x pp (tp up to 16, past the key/value heads; pp not
    dividing the layers), every ZeRO stage and schedule, one to eight micro-batches: ``predict``
    raises for none of them, and each plan has every part of its memory and time -- finite and
    positive where it fits, a reason where it does not."""
    from workbench.advise.plan import SCHEDULES
    shape = ModelShape(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, seq=4096, gated=True,
                       tied=True, bias=False, positions="rope", norm="rmsnorm")
    cluster = Cluster.preset(preset, nodes=2)
    seen = set()
    for tp, pp, zero, schedule, m in itertools.product((1, 2, 4, 8, 16), (1, 2, 3, 4, 8), (0, 1, 3), SCHEDULES,
                                                        (1, 2, 3, 8)):
        if 16 % (tp * pp) or (pp == 1 and schedule != "1f1b"):
            continue
        dp = 16 // (tp * pp)
        plan = predict(shape, cluster, dp * m, Config(dp=dp, tp=tp, pp=pp, zero=zero, schedule=schedule,
                                                      microbatches=m, sequence_parallel=tp > 1, precision="bf16",
                                                      recompute="selective"))
        assert set(plan.memory) == {*MEMORY_CATEGORIES, "total"} and set(plan.time) == {*TIME_PARTS, "total"}
        if plan.feasible:
            assert 0 < plan.time["total"] < math.inf and 0 < plan.memory["total"] < math.inf, plan.config
        else:
            assert plan.reason, plan.config
        seen.add(plan.feasible)
    assert seen == {True, False}


def test_a_configuration_that_cannot_run_has_infinite_memory_and_time():
    """Where the sizes leave nothing to price (``tp`` does not divide the key/value heads, the
    layout does not fill the cluster), every part of the plan's memory and time is infinite, so a
    caller reading ``memory["total"]`` and ``time["total"]`` of any configuration ranks it last;
    ``advise`` leaves a plan that does not fit untimed, its time infinite. As JSON they are null."""
    h100 = Cluster.preset("dgx-h100", nodes=2)
    for config in (Config(dp=1, tp=16, precision="bf16"), Config(dp=8, tp=1, precision="bf16")):
        plan = predict(_LLAMA_8B, h100, 16, config)
        assert not plan.feasible and plan.reason
        assert set(plan.memory) >= {"total", "activations"} and set(plan.time) >= {"total", "compute"}
        assert all(math.isinf(v) for v in (*plan.memory.values(), *plan.time.values()))
        assert all(v is None for part in ("memory", "time") for v in plan.as_dict()[part].values())   # JSON: null
    # advise: every plan carries every part; one that does not fit is not timed (infinite), one that fits is
    plans = advise("tiny", _cluster(4, 2, memory_gib=0.0025), 32)
    for plan in plans:
        assert set(plan.memory) == {"parameters", "gradients", "optimizer", "activations", "buffers", "total"}
        assert set(plan.time) == {"compute", "tp", "dp", "pp", "bubble", "total"}
        assert math.isfinite(plan.time["total"]) == plan.feasible, plan
    assert {math.isfinite(p.memory["total"]) for p in plans if not p.feasible} == {True, False}
    json.loads(json.dumps([p.as_dict() for p in plans], allow_nan=False))


@pytest.mark.parametrize("field, value, match", [
    ("schedule", "1f2b", "schedule='1f2b'"), ("zero", 4, "zero=4"), ("precision", "fp8", "precision='fp8'"),
    ("recompute", "some", "recompute='some'"), ("dp", 0, "dp=0")])
def test_malformed_configs_raise_naming_field_value_and_choices(field, value, match):
    with pytest.raises(ValueError, match=match):
        predict("small", _cluster(4), 8, Config(**{"dp": 4, field: value}))
    with pytest.raises(ValueError, match="sequence_parallel=True"):
        memory_per_device("small", Config(sequence_parallel=True), 8)
    with pytest.raises(ValueError, match="global_batch=0"):
        infeasible_reason("small", _cluster(4), Config(dp=4), 0)


def test_space_uses_every_device_and_only_structurally_possible_configurations():
    cluster = _cluster(4, nodes=2)
    space = configurations("small", cluster, 32)
    assert space and all(c.devices == 8 for c in space)
    assert all(ModelShape.preset("small").heads % c.tp == 0 for c in space)
    assert {c.tp for c in space} == {1, 2, 4} and {c.pp for c in space} == {1, 2, 4}
    assert not any(c.zero and c.dp == 1 for c in space) and not any(c.sequence_parallel and c.tp == 1 for c in space)
    narrow = configurations("small", cluster, 32, precisions="bf16", zero=(1,), recompute=("none",), max_tp=2,
                            tp_across_nodes=False, sequence_parallel=False)
    assert narrow and all(c.precision == "bf16" and c.tp <= 2 and c.recompute == "none" for c in narrow)
    with pytest.raises(ValueError, match="precisions="):
        configurations("small", cluster, 32, precisions=("fp64",))


# ----------------------------------------------------------------------------------- the choice
_NARROW = dict(precisions=("bf16",), zero=(1, 3), schedules=("1f1b",), recompute=("selective", "full"),
               sequence_parallel=(False,))


def test_plans_are_ranked_and_carry_memory_and_time_breakdowns():
    plans = advise("llama-7b", Cluster.preset("dgx-h100"), 256, **_NARROW)
    feasible = [p for p in plans if p.feasible]
    assert feasible and plans[0] is feasible[0]
    assert [p.time["total"] for p in feasible] == sorted(p.time["total"] for p in feasible)
    for p in feasible[:5]:
        assert set(p.memory) == {"parameters", "gradients", "optimizer", "activations", "buffers", "total"}
        assert p.memory["total"] == pytest.approx(sum(v for k, v in p.memory.items() if k != "total"))
        assert p.time["total"] == pytest.approx(sum(v for k, v in p.time.items() if k != "total"))
        assert p.memory["total"] <= Cluster.preset("dgx-h100").memory_bytes
    assert all(p.reason for p in plans if not p.feasible)
    assert plans[-1].reason and not plans[-1].feasible


def test_explanation_names_the_deciding_fact_on_two_contrasting_clusters():
    # one node of fast links: sharded data parallelism hides its traffic (ZeRO-3 by prefetching, ZeRO-1 on a GPU
    # as Megatron's distributed optimizer overlaps its reduce-scatters and gathers); tensor parallelism would only add
    one = advise("llama-7b", Cluster.preset("dgx-h100", nodes=1), 256, **_NARROW)[0]
    assert (one.config.dp, one.config.tp, one.config.pp) == (8, 1, 1) and one.config.zero in (1, 3)
    text = one.explain()
    assert f"DP 8 with ZeRO-{one.config.zero}" in text and "slower network" not in text
    # (under eager PyTorch, the dgx-h100 preset's framework, TP 2 loses more to the unfused norms and adds every
    # rank repeats than to its collectives)
    assert "TP 1 rather than TP 2: +" in text and ("tensor-parallel communication" in text or "compute +" in text)
    # eight nodes behind a 25 Gb/s network (a quarter of a2-ultra's 100 Gb/s per node; NCCL's rings move a
    # node's traffic through all of it, so at 100 Gb/s ZeRO over 64 GPUs still hides behind compute):
    # tensor parallelism stays inside each node, and says why
    a2 = Cluster.preset("a2-ultra-100g", nodes=8)
    slow = a2.with_(inter=Link(a2.inter.latency_s, a2.inter.bandwidth_Bps / 4),
                    nccl=dataclasses.replace(a2.nccl, network_Bps=a2.nccl.network_Bps / 4))
    # (with gradients reduced in float32, as Megatron-LM does in bf16, data parallelism across that network
    # costs twice a 16-bit reduction: one pipeline stage per node, data parallelism inside it, wins)
    best = advise("llama-13b", slow, 256, **_NARROW)[0]
    tp, pp = best.config.tp, best.config.pp
    text = best.explain()
    assert tp <= slow.devices_per_node and best.config.dp <= slow.devices_per_node
    if tp > 1:
        assert f"TP {tp} inside each node: its all-reduces" in text
        assert f"would cross the {slow.link_ratio:.3g}x slower network otherwise" in text
    else:
        assert pp == slow.nodes and f"PP {pp} across nodes" in text and "the slow network" in text
    assert "Chosen: the fastest of" in text
    # a sequence-parallel plan's headline names the collectives it runs instead of all-reduces
    sp = predict("llama-13b", slow, 256, Config(dp=8, tp=4, pp=2, zero=1, microbatches=16, sequence_parallel=True,
                                                precision="bf16", recompute="selective"))
    from workbench.advise.plan import _why
    why = " ".join(_why(sp, [sp], slow, ModelShape.preset("llama-13b")))
    assert "TP 4 inside each node: its all-gathers and reduce-scatters (4 per layer and micro-batch forward)" \
        in why and "its all-reduces" not in why


def test_network_sensitivity_prices_the_choice_and_its_rivals_on_a_slower_network():
    """The chosen plan and the fastest feasible ones priced again with the link between nodes (and
    the NCCL model's network with it) at half its bandwidth: the plan's time is ``predict``'s on
    that cluster, never faster than at full bandwidth; the fastest then is the least of those
    priced; explain() says it; a cluster of one node, or a plan that does not fit, has no answer."""
    from workbench.advise.sensitivity import Sensitivity, network_sensitivity

    cluster = Cluster.preset("dgx-h100", nodes=4)
    ranked = advise("llama-7b", cluster, 128, precisions=("bf16",))
    best = ranked[0]
    risk = network_sensitivity(best)
    half = cluster.with_(inter=Link(cluster.inter.latency_s, cluster.inter.bandwidth_Bps / 2))
    assert half.nccl.network_Bps == cluster.nccl.network_Bps / 2 and risk.network_Bps == half.inter.bandwidth_Bps
    assert risk.slowed_seconds == predict("llama-7b", half, 128, best.config).time["total"] >= best.time["total"]
    assert risk.considered == 21 and risk.seconds == best.time["total"]
    rivals = [p.config for p in ranked if p.feasible][:21]
    assert risk.best_seconds == min(predict("llama-7b", half, 128, c).time["total"] for c in rivals)
    assert f"If: {risk.describe()}." in best.explain()
    full = network_sensitivity(best, factor=1.0)
    assert full.slowdown == 1 and full.best_seconds == best.time["total"]
    # a slower network can only slow a plan, more where more of it crosses the network
    quarter = network_sensitivity(best, factor=0.25)
    assert quarter.slowed_seconds >= risk.slowed_seconds
    # the sentence names another plan when the ranking flips
    other = replace(best.config, dp=best.config.dp // 2, pp=best.config.pp * 2)
    flipped = Sensitivity(0.5, 25e9, best.config, 10.0, 12.0, other, 11.0, 21)
    assert f"{other.label()} would then be the fastest of the 21 fastest plans, 8.3% faster (11 s)" \
        in flipped.describe() and "(+20%)" in flipped.describe()
    one_node = advise("llama-7b", Cluster.preset("dgx-h100", nodes=1), 64, precisions=("bf16",))[0]
    assert network_sensitivity(one_node) is None and "If:" not in one_node.explain()
    too_big = predict("llama-70b", "dgx-h100", 512, Config(dp=8, zero=0, precision="bf16", microbatches=64))
    assert network_sensitivity(too_big) is None
    for bad in (0, 1.5, True, "half"):
        with pytest.raises(ValueError, match="factor="):
            network_sensitivity(best, factor=bad)
    with pytest.raises(ValueError, match="rivals="):
        network_sensitivity(best, rivals=-1)


def test_predict_marks_what_does_not_fit_and_keeps_its_numbers():
    plan = predict("llama-70b", "dgx-h100", 512, Config(dp=8, zero=0, precision="bf16", microbatches=64))
    assert not plan.feasible and plan.reason.startswith("needs") and plan.memory["optimizer"] > 80e9
    assert plan.time["total"] > 0 and "infeasible" in plan.explain()
    json.dumps(plan.as_dict())


# ----------------------------------------------------------------------------------- the search's shortcuts
def _forget() -> None:
    """Empty every result the advisor remembers (its functools caches and the collectives' prices)."""
    for module in (advise_memory, advise_timing):
        for value in vars(module).values():
            if hasattr(value, "cache_clear"):
                value.cache_clear()


_GQA = ModelShape(layers=6, hidden=256, heads=8, kv_heads=2, vocab=1000, seq=128, ffn=688, gated=True, tied=False,
                  bias=False, positions="rope", norm="rmsnorm", name="gqa")


@pytest.mark.parametrize("model,cluster,batch,every", [("tiny", _cluster(4, 2, memory_gib=0.0025), 32, 7),
                                                       (_GQA, _cluster(4, 2, memory_gib=0.05), 64, 11)])
def test_what_a_search_remembers_is_what_each_plan_computes_alone(model, cluster, batch, every):
    """advise() remembers what its configurations share (model state and ZeRO buffers per layout, a
    micro-batch per kind of stage, a pipeline replay's peak moments per schedule and rank, each
    collective's price): every plan is what predict() gives it with nothing remembered, bit for bit."""
    plans = advise(model, cluster, batch)
    sized = [p for p in plans if math.isfinite(p.memory["total"])]   # not the layouts that cannot run at all
    assert {True, False} <= {p.feasible for p in sized}
    shape = ModelShape.coerce(model)
    for plan in sized[::every]:
        _forget()
        alone = predict(model, cluster, batch, plan.config, time_infeasible=False)
        assert (alone.memory, alone.time, alone.feasible, alone.reason, alone.notes) == \
            (plan.memory, plan.time, plan.feasible, plan.reason, plan.notes)
        # model state and the ZeRO buffers are remembered per layout (the fields they read): the same
        # as computed from the whole configuration
        config, layout = plan.config, advise_memory._state_config(plan.config)
        n_stages = config.pp * advise_memory.chunks(config)
        for rank in range(config.pp):
            stages = tuple(advise_memory.rank_stages(config, rank))
            assert advise_memory._model_state(shape, layout, stages, "adam") == \
                advise_memory._model_state.__wrapped__(shape, config, stages, "adam")
            for elements in (advise_memory._fsdp_units, advise_memory._zero1_step_buffers,
                             advise_memory._zero2_open_buckets):
                assert elements(shape, layout, stages, n_stages) == \
                    elements.__wrapped__(shape, config, stages, n_stages)


def _replay_each_event(events, rank: int, mb: dict, message: float, logits: float, last: bool, m_w: float,
                       w_grads: float, b_end: float) -> float:
    """A one-stage-per-rank pipeline's memory replay event by event (advise.memory's loop before it
    counted the moments that can be the peak)."""
    live = forwarded = pending = 0
    held, first, peak = 0.0, True, 0.0
    for kind, posted, deferred in events:
        posted *= message
        if kind == "F":
            live += 1
            forwarded += 1
            peak = max(peak, live * mb[True]["kept"] + pending * m_w + posted + held
                       + (forwarded * logits if last else 0.0))
        elif kind == "B" and deferred and rank == 0:
            held += message
        elif kind == "W" and rank == 0:
            one = mb[first]
            held -= message
            peak = max(peak, (live - 1) * one["kept"] + one["peak"] + posted + held)
            live -= 1
            first = False
        elif kind == "B":
            one = mb[first]
            sent = message if (rank > 0 and not first) else 0.0
            others = pending * m_w + posted + sent + (forwarded * logits if last else 0.0)
            peak = max(peak, (live - 1) * one["kept"] + one["peak"] + others)
            live -= 1
            if deferred and w_grads:
                peak = max(peak, (live + 1) * one["kept"] + w_grads + b_end + others)
                pending += 1
            first = False
        elif kind == "W" and w_grads:
            pending -= 1
        # else a W after an unsplit B (ZeRO-3): its B freed the micro-batch already
    return peak


def test_pipeline_replay_counts_and_its_peak_moments_give_the_event_by_event_peak():
    """The memory replay sums each counted moment in the event loop's order of operations, and its
    frontier drops only moments whose counts another's all exceed: both give the loop's peak bit for
    bit, with sizes that are not whole numbers too (their sums round differently in another order)."""
    rng = random.Random(0)

    def size() -> float:   # bytes, whole or not (a sum's rounding then depends on its order)
        return rng.choice([0.0, 1.0, rng.uniform(0, 1e7), rng.uniform(0, 1) / 3])

    for schedule in ("gpipe", "1f1b", "zb-h1"):
        for p in (2, 3, 4):
            for m in (p, 2 * p, 4 * p, 8 * p):
                for rank in range(p):
                    events = advise_memory._replay_events(schedule, p, m, rank)
                    for split_w in (False, True):
                        for trial in range(4):
                            mb = {f: {"kept": size(), "peak": size() + rng.uniform(-1e6, 1e6)} for f in (True, False)}
                            w_grads = rng.uniform(1.0, 1e7) if split_w else 0.0    # split_w: bool(w_grads)
                            args = (mb, size(), size(), rank == p - 1, size(), w_grads, size())
                            want = _replay_each_event(events, rank, *args)
                            counts = advise_memory._replay_counts(schedule, p, m, rank, split_w)
                            frontier = advise_memory._replay_frontier(schedule, p, m, rank, split_w)
                            assert advise_memory._replay_peak(counts, *args) == want
                            assert advise_memory._replay_peak(frontier, *args) == want
                            assert len(frontier[1]) <= len(counts[1])
                    # a negative size (no real shape has one) falls back on every moment: still the same
                    mb = {True: {"kept": -5.0, "peak": 1.0}, False: {"kept": 3.0, "peak": 2.0}}
                    args = (mb, 0.7, 1.3, rank == p - 1, 0.2, 0.0, 0.4)
                    assert advise_memory._replay_peak(advise_memory._replay_counts(schedule, p, m, rank, False),
                                                      *args) == _replay_each_event(events, rank, *args)


def _whole_ring(p: int, per_node: int, m: float, reduce_steps: int, gather_steps: int, topology, model) -> float:
    """comm.cost's ring on the topology's links, every rank replayed (before it replayed one node's)."""
    per_rank = []
    for r in range(p):
        link = topology.link("intra" if r // per_node == ((r + 1) % p) // per_node else "inter")
        per_rank.append((link.latency_s, m / link.bandwidth_Bps) if link is not None else (0.0, model.exchange(m)))
    g = model.reduction(m)
    ready, free = [0.0] * p, [0.0] * p
    for s in range(reduce_steps + gather_steps):
        arrive = [0.0] * p
        for r in range(p):
            latency, busy = per_rank[r]
            free[r] = max(ready[r], free[r]) + busy
            arrive[(r + 1) % p] = free[r] + latency
        ready = [t + (g if s < reduce_steps else 0.0) for t in arrive]
    return max(ready)


def test_a_ring_on_mixed_links_is_one_node_replayed_bit_for_bit():
    model = cost.CostModel(alpha=3e-5, beta=7e-10, gamma=2e-10)
    for per_node, nodes in ((1, 5), (2, 3), (4, 4), (8, 12), (3, 1)):
        p = per_node * nodes
        for intra, inter in ((Link(2e-6, 450e9), Link(5e-6, 50e9)), (None, Link(3e-5, 1.56e9)),
                             (Link(1e-6, 3e9), None)):
            topology = Topology(per_node, intra=intra, inter=inter)
            for steps in ((p - 1, p - 1), (0, p - 1), (p - 1, 0)):
                for m in (1.0, 1e6 / 3, 123456.789):
                    assert cost._ring_on_links(p, per_node, m, *steps, topology, model) == \
                        _whole_ring(p, per_node, m, *steps, topology, model)


# ----------------------------------------------------------------------------------- the command
def _run(capsys, *argv) -> tuple[int, str]:
    from workbench.apps.cli import main

    rc = main(["advise", *argv])
    return rc, capsys.readouterr().out


def test_cli_text_json_and_figure(tmp_path, capsys):
    out_json, out_png = tmp_path / "plans.json", tmp_path / "plans.png"
    rc, text = _run(capsys, "--model", "small", "--cluster", "dgx-h100", "--nodes", "2", "--batch", "64",
                    "--precision", "bf16", "--recompute", "none", "--json", str(out_json), "--plot", str(out_png))
    assert rc == 0
    assert "step s" in text and "Chosen: the fastest of" in text and "infeasible" in text
    doc = json.loads(out_json.read_text())
    assert doc["parameters"] == ModelShape.preset("small").parameters()
    assert doc["chosen"] == doc["plans"][0]["config"]["label"] and doc["chosen"] in text
    assert doc["plans"][0]["feasible"] and set(doc["plans"][0]["time"]) >= {"compute", "tp", "dp", "pp", "bubble"}
    assert out_png.read_bytes()[:4] == b"\x89PNG"
    rc, text = _run(capsys, "--model", "llama-7b", "--cluster", "p4d-a100", "--layers", "4", "--inter", "15us@1GB/s",
                    "--precision", "bf16", "--zero", "3", "--recompute", "full", "--schedule", "1f1b", "--json", "-")
    doc = json.loads(text)
    assert doc["model"]["layers"] == 4 and doc["cluster"]["inter"] == "15us@1GB/s"
    assert not any("hsdp" in p["config"]["label"] for p in doc["plans"])
    rc, text = _run(capsys, "--model", "llama-7b", "--cluster", "p4d-a100", "--nodes", "2", "--layers", "4",
                    "--precision", "bf16", "--zero", "3", "--recompute", "full", "--schedule", "1f1b",
                    "--hybrid-sharding", "--json", "-")
    assert rc == 0 and any(" hsdp8 " in p["config"]["label"] for p in json.loads(text)["plans"])


def test_cli_bad_input_is_one_line_naming_the_argument(capsys):
    """A wrong model, cluster, link or batch: exit status 2 and one line on stderr that names the
    argument and the way out, as argparse's own errors (no traceback)."""
    from workbench.apps.cli import main

    for argv, words in ((["--model", "gpt5"], ["ModelShape.preset('gpt5')", "llama-7b"]),
                        (["--cluster", "h100-16x8"], ["Cluster.preset('h100-16x8')", "dgx-h100"]),
                        (["--intra", "3us"], ["--intra/--inter", "LATENCY@BANDWIDTH"]),
                        (["--batch", "0"], ["global_batch=0"]),
                        (["--model", "tiny", "--heads", "7"], ["heads=7", "pick heads dividing"])):
        assert main(["advise", *argv]) == 2, argv
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith("workbench advise: error: "), captured
        assert captured.err.count("\n") == 1 and all(w in captured.err for w in words), captured.err


def test_cli_delegates_calibrate_and_validate(monkeypatch, capsys):
    calls = {}
    fake_cal = types.ModuleType("workbench.advise.calibrate")
    fake_cal.calibrate = lambda world_size=4, topology=None: calls.setdefault(
        "cal", (world_size, str(topology))) and _cluster(4)
    fake_val = types.ModuleType("workbench.advise.validate")
    fake_val.add_arguments = lambda p: p.add_argument("--samples", type=int, default=3)
    fake_val.main = lambda args: calls.setdefault("val", args.samples) and 0
    from workbench.advise import cli as advise_cli

    monkeypatch.setattr(advise_cli, "calibrate", fake_cal)   # the modules the CLI hands the work to
    monkeypatch.setattr(advise_cli, "validate", fake_val)
    rc, text = _run(capsys, "--calibrate", "--world-size", "2", "--topology", "ranks_per_node=1,inter=1ms@20MB/s",
                    "--model", "tiny", "--batch", "8", "--precision", "fp32", "--recompute", "none")
    assert rc == 0 and calls["cal"][0] == 2 and "inter=1ms@20MB/s" in calls["cal"][1] and "test: 1 node(s)" in text
    rc, _ = _run(capsys, "--validate", "--samples", "7")
    assert rc == 0 and calls["val"] == 7
