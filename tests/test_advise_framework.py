"""The framework layer of the GPU model (workbench/advise/framework.py) and the terms it brings:
eager PyTorch's unfused operators, per-operator selective checkpointing (time and memory), Megatron's
overlapped tensor-parallel collectives, float32 gradient reduction, FSDP2's copies, foreach Adam,
NCCL-priced pipeline messages, gradient accumulation down to one sequence per micro-batch, and the
public rows that check them. Pure Python, no launches."""
from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from workbench.advise import Cluster, Config, ModelShape, predict
from workbench.advise import device as dev
from workbench.advise import published, space, timing
from workbench.advise.framework import (COMPILED, EAGER, EAGER_FUSED, FRAMEWORKS, MEGATRON, MEGATRON_2022,
                                        OPTIMIZER_BYTES, Framework)
from workbench.advise.runtime_memory import eager_layer_extra_bytes, op_checkpoint_bytes

LLAMA = ModelShape.preset("llama3-8b")
H100 = dev.PROFILES["h100-sxm-80gb"].with_(kernel_fixed_s=0.0)   # each kernel's fixed GPU cost out of the way (test_device_model)


def test_framework_is_validated_and_sets_one_attention_kernel():
    for bad in (dict(attention="sdpa"), dict(selective="layer"), dict(optimizer="sgd"), dict(loss_float32_copies=0),
                dict(sm_share=1.0), dict(grad_reduce_bytes=3), dict(elementwise_efficiency=0.0),
                dict(elementwise_efficiency=1.5), dict(fused_norm="yes"), dict(compiled=1),
                dict(complex_rotary="no"), dict(compiled=True, fused=True), dict(pipeline="gpipe"),
                dict(fsdp="fsdp3"), dict(schedules=("1f1b", "dualpipe")), dict(schedules=()),
                dict(schedules=["1f1b"]), dict(schedules=("1f1b", "1f1b")), dict(zero_stages=(0, 4)),
                dict(zero_stages=()), dict(zero_stages=(True,)), dict(zero_stages=[0, 1]), dict(tp_async=1),
                dict(tp_async=True, tp_comm_overlap=True)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            Framework("x", **bad)
    assert Cluster.preset("dgx-h100").framework is EAGER_FUSED
    assert {Cluster.preset(n).framework for n in ("dgx-a100", "p4d-a100", "a2-ultra-100g")} == {MEGATRON_2022}
    for fw in FRAMEWORKS.values():   # the compute and the memory model read the framework's kernel and policy
        c = Cluster.preset("dgx-a100").with_(framework=fw)
        assert c.device.attention == c.runtime_memory.attention == fw.attention
        assert (c.runtime_memory.selective, c.runtime_memory.loss_float32_copies) == (fw.selective,
                                                                                      fw.loss_float32_copies)
        assert c.runtime_memory.compiled is fw.compiled
    with pytest.raises(ValueError, match="framework"):
        Cluster.preset("dgx-h100").with_(framework="eager")


def test_a_gpu_cluster_searches_and_prices_only_the_schedules_its_framework_runs():
    """Megatron-LM runs 1F1B and interleaved 1F1B; nanotron and picotron, whose kernels
    ``eager-fused`` prices, GPipe (``afab``) and 1F1B; torch's pipelining (torchtitan) all five. The
    search tries a framework's own schedules; ``predict`` refuses another, naming the framework, its
    schedules and the way to price it; a schedule asked for by name is kept with that reason; this
    machine's clusters (no framework: the workbench's runtime) keep every schedule."""
    from workbench.advise import advise
    from workbench.advise.plan import SCHEDULES
    assert EAGER_FUSED.schedules == ("gpipe", "1f1b")
    assert MEGATRON.schedules == MEGATRON_2022.schedules == ("1f1b", "interleaved")
    assert EAGER.schedules == COMPILED.schedules == SCHEDULES == Framework("x").schedules
    shape = ModelShape(layers=8, hidden=1024, heads=8, kv_heads=8, ffn=4096, vocab=32000, seq=2048, gated=True,
                       tied=False, bias=False, positions="rope", norm="rmsnorm")
    h100 = Cluster.preset("dgx-h100")

    def searched(cluster, **opts):
        return {c.schedule for c in space.configurations(shape, cluster, 32, precisions=("bf16",), recompute=("none",),
                                                         **opts) if c.pp > 1}

    assert searched(h100) == {"gpipe", "1f1b"}
    assert searched(h100.with_(framework=MEGATRON)) == {"1f1b", "interleaved"}
    assert searched(h100.with_(framework=EAGER)) == set(SCHEDULES)
    from workbench.comm.topology import Link
    no_framework = Cluster(nodes=1, devices_per_node=8, memory_bytes=80 * 2**30, flops=100e12, intra=Link(2e-6, 100e9),
                           inter=Link(10e-6, 5e9), name="no framework")
    assert no_framework.framework is None and searched(no_framework) == set(SCHEDULES)
    assert searched(h100, schedules=("zbv", "1f1b")) == {"1f1b"}          # the framework's rule leaves zbv out
    for schedule in ("interleaved", "zb-h1", "zbv"):
        config = Config(dp=2, pp=4, schedule=schedule, microbatches=8, precision="bf16")
        refused = predict(shape, h100, 16, config)
        assert not refused.feasible and refused.reason == (
            f"framework 'eager-fused' runs the pipeline schedules gpipe, 1f1b, not {schedule!r}; choose one of those, "
            "or price it under a framework that runs it (cluster.with_(framework=FRAMEWORKS['eager']): torch's "
            "pipelining, every schedule)")
        assert predict(shape, h100.with_(framework=EAGER), 16, config).feasible
    assert predict(shape, h100, 16, Config(dp=8, schedule="zbv", precision="bf16")).feasible    # no pipeline
    # Megatron-LM's interleaving runs the micro-batches in groups of pp: m a multiple of pp, at least pp;
    # torch's in rounds of max(1, m // pp) dividing m
    megatron, torch_pipe = h100.with_(framework=MEGATRON), h100.with_(framework=EAGER)
    for m, megatron_reason, torch_reason in (
            (2, "interleaved needs at least 4 micro-batches for 4 stages, got m = 2", ""),
            (6, "Megatron-LM's interleaved schedule needs m a multiple of pp = 4 (its groups of pp micro-batches), "
                "got m = 6", ""),
            (9, "Megatron-LM's interleaved schedule needs m a multiple of pp = 4 (its groups of pp micro-batches), "
                "got m = 9", "interleaved needs m a multiple of max(1, m // pp) = 2 (torch's rounds), got m = 9"),
            (8, "", "")):
        config = Config(dp=2, pp=4, schedule="interleaved", microbatches=m, precision="bf16")
        assert predict(shape, megatron, 2 * m, config).reason == megatron_reason
        assert predict(shape, torch_pipe, 2 * m, config).reason == torch_reason
    assert all(c.microbatches % c.pp == 0 for c in space.configurations(shape, megatron, 32, precisions=("bf16",))
               if c.schedule == "interleaved" and c.pp > 1)
    plans = advise(shape, h100, 32, precisions=("bf16",), recompute=("none",), schedules=("zbv",))
    piped = [p for p in plans if p.config.pp > 1]
    assert piped and not any(p.feasible for p in piped)
    assert any("runs the pipeline schedules gpipe, 1f1b, not 'zbv'" in p.reason for p in piped)
    assert any(p.feasible for p in plans)                                 # the layouts without a pipeline


def test_a_gpu_cluster_searches_the_zero_stages_its_framework_offers_and_prices_any():
    """Megatron-LM's distributed optimizer and nanotron's ZeroDistributedOptimizer shard the optimizer
    state (ZeRO-1); FSDP shards everything (ZeRO-3) or all but the parameters during backward
    (ZeRO-2). The search tries the framework's stages by default and any stage asked for; ``predict``
    prices every stage, and a plan on a stage its framework does not offer says so among its facts."""
    from workbench.advise import advise
    assert EAGER_FUSED.zero_stages == MEGATRON.zero_stages == MEGATRON_2022.zero_stages == (0, 1)
    assert EAGER.zero_stages == COMPILED.zero_stages == (0, 2, 3) and Framework("x").zero_stages == (0, 1, 2, 3)
    shape = ModelShape.preset("llama3-8b")
    h100 = Cluster.preset("dgx-h100", nodes=2)

    def stages(cluster, **opts):
        return {c.zero for c in space.configurations(shape, cluster, 64, precisions=("bf16",), recompute=("full",),
                                                     **opts)}

    assert stages(h100) == {0, 1} and stages(h100.with_(framework=EAGER)) == {0, 2, 3}
    assert stages(h100, zero=(2, 3)) == {0, 2, 3}           # asked for (0: the layouts with one replica)
    config = Config(dp=16, zero=3, precision="bf16", recompute="full", microbatches=4)
    fsdp_there, fsdp_torch = predict(shape, h100, 64, config), predict(shape, h100.with_(framework=EAGER), 64, config)
    assert fsdp_there.feasible and fsdp_torch.feasible
    note = "framework 'eager-fused' offers ZeRO-0, ZeRO-1, not ZeRO-3: priced on this hardware as a framework that offers it"
    assert any(note in n for n in fsdp_there.notes) and not any("offers ZeRO" in n for n in fsdp_torch.notes)
    assert all(p.config.zero in (0, 1) for p in advise(shape, h100, 64, precisions=("bf16",), recompute=("full",)))


def test_asynchronous_linear_layers_hide_their_collectives_behind_the_multiplies_issued_beside_them():
    """nanotron's tp_linear_async_communication (``Framework.tp_async``, eager-fused's): with sequence
    parallelism, per block, the column layer's forward all-gather beside its own rows' multiply
    (1/t of it), its backward re-gather beside the input-gradient multiply and its reduce-scatter
    beside the weight-gradient multiply, the row layer's backward all-gather beside its own rows'
    input-gradient multiply, each up to the multiply's time; without it the column layer's backward
    all-reduce beside the weight gradient; full recomputation hides the forward's share again. A
    step differs from the synchronous one by exactly that, per layer, less the SMs the collectives
    take."""
    from workbench.advise.device import linear_seconds
    from workbench.advise.timing import async_tp_hidden
    part = {"forward": 8.0, "dgrad": 8.0, "wgrad": 8.0}
    linears = {"attention": {"column": dict(part), "row": {"forward": 4.0, "dgrad": 4.0, "wgrad": 4.0}},
               "mlp": {"column": dict(part), "row": dict(part)}}
    price = {"all_gather": 3.0, "reduce_scatter": 3.0, "all_reduce": 5.0}
    # forward: min(3, 8/4) per block; backward: min(3, 8) + min(3, 8) + min(3, row dgrad / 4) per block
    assert async_tp_hidden(linears, 4, True, price) == (2 * 2.0, (3 + 3 + 1) + (3 + 3 + 2))
    assert async_tp_hidden(linears, 4, True, price, recompute_full=True) == (4.0, 15.0 + 4.0)
    assert async_tp_hidden(linears, 4, False, price) == (0.0, 2 * 5.0)
    assert async_tp_hidden(linears, 2, True, {"all_gather": 1.0, "reduce_scatter": 1.0, "all_reduce": 1.0}) == (
        2.0, 6.0)                                               # every collective shorter than its multiply
    # the layer's multiplies by block and role: qkv and gate-up column-parallel, out and down row-parallel
    lin = linear_seconds(H100, LLAMA, 1, 4, True, "bf16", EAGER_FUSED)
    h, f, kv = LLAMA.hidden, LLAMA.ffn, LLAMA.kv_heads * LLAMA.hidden // LLAMA.heads
    assert lin["mlp"]["column"]["forward"] == dev.gemm_seconds(H100, LLAMA.seq, 2 * f // 4, h, "bf16")
    assert lin["attention"]["column"]["forward"] == dev.gemm_seconds(H100, LLAMA.seq, (h + 2 * kv) // 4, h, "bf16")
    assert lin["attention"]["row"]["wgrad"] == dev.gemm_seconds(H100, h // 4, h, LLAMA.seq, "bf16")
    # the step: eager-fused prices it, the same framework without it waits for every collective
    h100 = Cluster.preset("dgx-h100")
    synchronous = h100.with_(framework=replace(EAGER_FUSED, tp_async=False))
    assert EAGER_FUSED.tp_async and not any(f.tp_async for f in (EAGER, COMPILED, MEGATRON, MEGATRON_2022))
    for sp, recompute in ((True, "none"), (False, "none"), (True, "full")):
        config = Config(dp=2, tp=4, zero=1, microbatches=4, sequence_parallel=sp, precision="bf16",
                        recompute=recompute)
        fast, slow = predict(LLAMA, h100, 16, config), predict(LLAMA, synchronous, 16, config)
        assert fast.time["compute"] == slow.time["compute"] and fast.memory == slow.memory
        rows = 16 // 2 // 4
        lin = linear_seconds(h100.device, LLAMA, rows, 4, sp, "bf16", EAGER_FUSED)
        n = rows * LLAMA.seq * LLAMA.hidden * 2
        ctx = timing._step(LLAMA, h100, config, 16)               # the tp group's links, NCCL's model
        prices = {c: timing._price(c, n, 4, ctx.machine, ctx.topo["tp"])
                  for c in ("all_gather", "reduce_scatter", "all_reduce")}
        hidden_f, hidden_b = async_tp_hidden(lin, 4, sp, prices, recompute == "full")
        keep = 1 - EAGER_FUSED.sm_share_on(h100.device)
        want = 4 * LLAMA.layers * (hidden_f + hidden_b) * keep        # 4 micro-batches of every layer
        assert slow.time["tp"] - fast.time["tp"] == pytest.approx(want, rel=1e-9), (sp, recompute)
        assert 0 < fast.time["tp"] < slow.time["tp"]
        calls = ("2 all-gathers and 2 reduce-scatters forward, 4 all-gathers and 2 reduce-scatters backward" if sp
                 else "2 all-reduces forward and 2 backward")
        assert any(n.startswith(f"TP 4 inside each node") and calls in n and n.endswith("left exposed beside the "
                                                                                           "multiplies")
                   for n in fast.notes), fast.notes
        assert any(n.endswith("per step left exposed") for n in slow.notes), slow.notes


def test_eager_operators_move_their_real_bytes_in_more_kernels():
    fused = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=MEGATRON)}
    eager = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=EAGER)}
    tokens, h, e = LLAMA.seq, LLAMA.hidden, 2
    # RMSNorm in float32: 28 + 4e bytes per element forward in 7 kernels, at eager's share of the copy
    # bandwidth, against one read and one write fused
    share = EAGER.elementwise_efficiency
    assert share == 0.8 and MEGATRON.elementwise_efficiency == 1.0
    assert eager["input norm", "forward"] == (pytest.approx((28 + 4 * e) * tokens * h / H100.memory_bandwidth / share),
                                              7)
    assert fused["input norm", "forward"] == (pytest.approx(2 * e * tokens * h / H100.memory_bandwidth), 1)
    assert ("repeat_kv", "forward") in eager and ("repeat_kv", "forward") not in fused   # GQA's copies
    assert dev.layer_operators(H100, LLAMA, 1) == dev.layer_operators(H100, LLAMA, 1, framework=MEGATRON)
    k_eager = dev.kernels_per_layer(H100, LLAMA, framework=EAGER)
    k_fused = dev.kernels_per_layer(H100, LLAMA, framework=MEGATRON)
    assert k_eager["forward"] > 2 * k_fused["forward"] and k_eager["backward"] > 2 * k_fused["backward"]
    slow = dev.layer_seconds(H100, LLAMA, 1, framework=EAGER)["total"]
    assert slow > 1.1 * dev.layer_seconds(H100, LLAMA, 1, framework=MEGATRON)["total"]
    # the heads: an eager RMSNorm and cross_entropy(logits.float()) (20 + e and 24 + e bytes per logit), or
    # Megatron's norm and its in-place vocabulary-parallel loss (36 + e and 12 + e)
    n, v = LLAMA.seq, LLAMA.vocab
    matmuls = dev.gemm_seconds(H100, n, v, h, "bf16") + dev.gemm_seconds(H100, n, h, v, "bf16") \
        + dev.gemm_seconds(H100, h, v, n, "bf16")
    eager_head = dev.head_seconds(H100, LLAMA, 1, framework=EAGER)["head"]
    fused_head = dev.head_seconds(H100, LLAMA, 1, framework=MEGATRON)["head"]
    assert eager_head == pytest.approx(matmuls + (3 * (28 + 4 * e) * n * h + (44 + 2 * e) * n * v) / H100.memory_bandwidth)
    assert fused_head == pytest.approx(matmuls + (6 * e * n * h + (48 + 2 * e) * n * v) / H100.memory_bandwidth)


def test_a_fused_norm_in_an_eager_framework_is_one_kernel_at_the_full_bandwidth():
    """torchtitan's ``fused_rmsnorm``: the norms (the layer's two and the final one) move the fused
    kernel's bytes in one kernel each way, the rest of the layer stays eager."""
    from dataclasses import replace

    fused_norm = replace(EAGER, name="eager, fused norm", fused_norm=True)
    ops = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=fused_norm)}
    eager = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=EAGER)}
    tokens, h, e = LLAMA.seq, LLAMA.hidden, 2
    assert ops["input norm", "forward"] == (pytest.approx(2 * e * tokens * h / H100.memory_bandwidth), 1)
    assert ops["post-attention norm", "backward"][1] == 2
    assert ops["rotary", "forward"] == eager["rotary", "forward"]          # everything else as eager
    assert dev.layer_seconds(H100, LLAMA, 1, framework=fused_norm)["total"] < \
        dev.layer_seconds(H100, LLAMA, 1, framework=EAGER)["total"]
    head = dev.head_seconds(H100, LLAMA, 1, framework=fused_norm)["head"]
    assert head < dev.head_seconds(H100, LLAMA, 1, framework=EAGER)["head"]


def test_torch_compile_fuses_eager_s_elementwise_operators_but_not_a_complex_rotary():
    """``compiled``: the same multiplies as eager (separate q, k, v and gate, up), each elementwise
    operator one generated kernel each way at the copy's bandwidth (a norm one pass, SwiGLU reading
    both halves once), the complex rotary left to ATen's kernels at eager's cost; a real-valued
    rotary compiles into one kernel per tensor. The host dispatches one operator per kernel and the
    model's edges stay eager."""
    tokens, h, f, kv, e = LLAMA.seq, LLAMA.hidden, LLAMA.ffn, LLAMA.kv_dim, 2
    eager = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=EAGER)}
    comp = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=COMPILED)}
    real = replace(COMPILED, name="compiled, real rotary", complex_rotary=False)
    rope = {(n, p): (s, k) for n, p, s, k in dev.layer_operators(H100, LLAMA, 1, framework=real)}
    assert comp.keys() == eager.keys()
    for name, phase, seconds, kernels, kind in dev._operators(H100, LLAMA, 1, 1, False, "bf16", EAGER):
        if kind != "memory":
            assert comp[name, phase] == (seconds, kernels)                     # multiplies and attention as eager
    assert comp["input norm", "forward"] == (pytest.approx(2 * e * tokens * h / H100.memory_bandwidth), 1)
    assert comp["silu, mul", "forward"] == (pytest.approx(3 * e * tokens * f / H100.memory_bandwidth), 1)
    assert comp["residual add", "backward"][1] == 1 < eager["input norm", "backward"][1]
    assert comp["rotary", "forward"] == eager["rotary", "forward"]             # Inductor falls back to ATen
    assert rope["rotary", "forward"] == (pytest.approx(2 * e * tokens * (h + kv) / H100.memory_bandwidth), 2)
    k_comp, k_eager = (dev.kernels_per_layer(H100, LLAMA, framework=fw) for fw in (COMPILED, EAGER))
    assert k_comp["forward"] < k_eager["forward"] - 10 and COMPILED.host_ops_per_kernel == 1.0
    times = [dev.layer_seconds(H100, LLAMA, 1, recompute="selective", framework=fw)["total"]
             for fw in (EAGER, COMPILED, real)]
    assert times[0] > times[1] > times[2]
    assert dev.head_seconds(H100, LLAMA, 1, framework=COMPILED) == dev.head_seconds(H100, LLAMA, 1, framework=EAGER)
    assert FRAMEWORKS["compiled"] is COMPILED


def test_published_torch_compile_gains_are_predicted_within_a_tenth():
    """The six published runs measured with and without ``torch.compile`` (torchtitan's Llama 3.1
    8B on 8 and 128 H100; fms-fsdp's Llama 2 7B on 128 A100 and 96 H100, 34B and 70B on 128 A100):
    each compiled run is priced under a compiled framework, and the speed-up compile brought is
    predicted within 10% of the published one."""
    def key(r):
        return r.model.name, r.cluster, r.nodes, r.metric

    compiled = [r for r in published.ROWS if "torch.compile" in r.name and r.metric == "tokens_per_gpu"]
    assert len(compiled) == 6
    eager_rows = {key(r): r for r in published.ROWS if "torch.compile" not in r.name and r.metric == "tokens_per_gpu"
                  and r.source in (published.IBM, published.TITAN_H100.format(1), published.TITAN_H100.format(3))}
    for row in compiled:
        framework = published.row_cluster(row).framework
        assert framework.compiled and not framework.fused
        assert framework.complex_rotary == (row.source != published.FMS_COMPILE)   # fms-fsdp's rotary is real
        base = eager_rows[key(row)]
        assert not published.row_cluster(base).framework.compiled
        gain = published.predicted(row)["value"] / published.predicted(base)["value"]
        assert gain == pytest.approx(row.value / base.value, rel=0.10), row.name


def test_op_selective_recomputes_every_second_matmul_and_the_elementwise_operators():
    ops = dev._operators(H100, LLAMA, 2, 1, False, "bf16", EAGER)
    forward_gemms = [s for _, p, s, _, kind in ops if p == "forward" and kind == "gemm"]
    assert len(forward_gemms) == 7                                    # wq wk wv wo w1 w3 w2
    again = sum(forward_gemms[1::2]) + sum(s for _, p, s, _, kind in ops if p == "forward" and kind == "memory")
    sel = dev.layer_seconds(H100, LLAMA, 2, recompute="selective", framework=EAGER)
    assert sel["recompute"] == pytest.approx(again)                    # GPU-bound at two sequences
    # Megatron's selective: the attention core again
    att = dev.layer_seconds(H100, LLAMA, 2, recompute="selective", framework=MEGATRON)
    assert att["recompute"] == pytest.approx(sum(s for _, p, s, _, kind in
                                                 dev._operators(H100, LLAMA, 2, 1, False, "bf16", MEGATRON)
                                                 if p == "attention"))


def test_op_checkpoint_keeps_input_every_other_matmul_output_and_attention_output():
    s, b, h, kv, f, a = LLAMA.seq, 2, LLAMA.hidden, LLAMA.kv_dim, LLAMA.ffn, LLAMA.heads
    # input, q, v, w1 x, w2's output, attention output (2 bytes each) and the float32 log-sum-exp per head
    assert op_checkpoint_bytes(LLAMA, b) == s * b * (2 * (h + h + kv + f + h + h) + 4 * a)
    assert op_checkpoint_bytes(LLAMA, b, t=2) < op_checkpoint_bytes(LLAMA, b)
    # torchtitan's Llama 3.1 8B on 8 H100 (96 GB, 500 W), local batch 2: published 82.4 GiB, within 15%
    row = next(r for r in published.ROWS if r.metric == "memory_gib" and r.nodes == 1)
    assert abs(published.predicted(row)["value"] / row.value - 1) < 0.15


def test_compiled_op_checkpoint_keeps_what_backward_reads_as_measured():
    s, b, h = LLAMA.seq, 2, LLAMA.hidden
    # torch.compile's partitioner drops the one saved output no backward reads: w2's, into the residual add
    assert op_checkpoint_bytes(LLAMA, b) - op_checkpoint_bytes(LLAMA, b, compiled=True) == 2 * s * b * h
    assert op_checkpoint_bytes(LLAMA, b, t=2, sequence_parallel=True) \
        - op_checkpoint_bytes(LLAMA, b, t=2, sequence_parallel=True, compiled=True) == 2 * s * b * h / 2
    gpt = ModelShape(layers=2, hidden=1024, heads=16, vocab=32768, seq=2048, ffn=4096)   # qkv and fc1 kept: read
    assert op_checkpoint_bytes(gpt, b, compiled=True) == op_checkpoint_bytes(gpt, b)
    # the probe's stack of torchtitan Llama layers, kept bytes measured on a CPU (eager and compiled)
    root = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    probe = json.loads((root / "2026-11-28-compiled-activations.json").read_text())
    d = probe["shape"]
    shape = ModelShape(layers=d["layers"], hidden=d["hidden"], heads=d["heads"], kv_heads=d["kv_heads"],
                       ffn=d["ffn"], vocab=1000, seq=d["seq"], gated=True, tied=False, bias=False,
                       positions="rope", norm="rmsnorm")
    for compiled in (False, True):
        measured = min(probe["kept_bytes"][f"op {'compiled' if compiled else 'eager'}"]) / d["layers"]
        assert measured == pytest.approx(op_checkpoint_bytes(shape, d["rows"], compiled=compiled), rel=0.02)
    # without recomputation, eager PyTorch's unfused layer keeps its float32 norms' copies and repeat_kv's copies too
    # (a view with one key/value head, a copy with two): priced within 2%
    from workbench.advise import memory_model

    for name, kv_heads in (("none eager", 1), ("none eager, 2 kv heads", 2)):
        gqa = replace(shape, kv_heads=kv_heads)
        priced = memory_model._layer_bytes(gqa, d["rows"], 1, False, 2, float32_norms=True, repeat_kv=True)["none"]
        assert min(probe["kept_bytes"][name]) / d["layers"] == pytest.approx(priced, rel=0.02), name
    plain = memory_model._layer_bytes(shape, d["rows"], 1, False, 2)["none"]
    # compiled, the fused SwiGLU's backward recomputes the SiLU from the gate: one ffn-wide tensor less
    compiled = memory_model._layer_bytes(shape, d["rows"], 1, False, 2, compiled=True)["none"]
    assert plain - compiled == 2 * d["seq"] * d["rows"] * d["ffn"]
    assert min(probe["kept_bytes"]["none compiled"]) / d["layers"] == pytest.approx(compiled, rel=0.02)
    assert eager_layer_extra_bytes(shape, d["rows"], float32_norms=True) == 8 * d["seq"] * d["rows"] * d["hidden"]
    assert eager_layer_extra_bytes(shape, d["rows"], repeat_kv=True) == 0               # one kv head: a view
    assert min(probe["kept_bytes"]["none eager"]) / d["layers"] > 1.15 * plain        # what the fused layer keeps
    assert Cluster.preset("dgx-h100").with_(framework=EAGER).runtime_memory.float32_norms
    assert not Cluster.preset("dgx-h100").with_(framework=COMPILED).runtime_memory.repeat_kv
    # and torchtitan's published compiled memory (77 and 62 GiB) within 10%, its eager (82.4, 67) as before
    for row in (r for r in published.ROWS if r.metric == "memory_gib"):
        assert abs(published.predicted(row)["value"] / row.value - 1) < (0.10 if "compile" in row.name else 0.15)


def test_dtensor_tensor_parallelism_keeps_gathered_inputs_partial_sums_and_scatters_as_measured():
    """torchtitan's TP plan on two CPU ranks (docs/benchmarks/2026-11-28-tp-activations.md): each
    policy's kept bytes per layer and rank, eager and compiled, priced within 2%."""
    from workbench.advise import memory_model

    root = Path(__file__).resolve().parents[1] / "docs" / "benchmarks"
    probe = json.loads((root / "2026-11-28-tp-activations.json").read_text())
    d, t = probe["shape"], probe["world"]
    shape = ModelShape(layers=d["layers"], hidden=d["hidden"], heads=d["heads"], kv_heads=d["kv_heads"],
                       ffn=d["ffn"], vocab=1000, seq=d["seq"], gated=True, tied=False, bias=False,
                       positions="rope", norm="rmsnorm")
    for name, measured in probe["kept_bytes"].items():
        policy, mode = name.split()
        compiled = mode == "compiled"
        layer = memory_model._layer_bytes(shape, d["rows"], t, True, 2, "flash", "op", compiled,
                                          float32_norms=not compiled, repeat_kv=not compiled, dtensor_tp=True)
        priced = layer["none" if policy == "none" else "selective"]
        assert min(measured) / d["layers"] == pytest.approx(priced, rel=0.02), name
    # the terms: the all-gathered inputs (2 e s b h (1 - 1/t)), the partial sum at full width and two scatters
    s, b, h = d["seq"], d["rows"], d["hidden"]
    assert eager_layer_extra_bytes(shape, b, t, True, gathered_inputs=True) == 2 * 2 * s * b * h * (1 - 1 / t)
    assert eager_layer_extra_bytes(shape, b, t, False, gathered_inputs=True) == 0   # no SP: inputs replicated
    dtensor = op_checkpoint_bytes(shape, b, t, True, dtensor_tp=True)
    assert dtensor - op_checkpoint_bytes(shape, b, t, True) == 2 * s * b * (h - h / t + 2 * h / t)
    # Megatron-LM and nanotron keep the shard and gather again (Korthikanti et al.): fused frameworks are not DTensor
    assert Cluster.preset("dgx-h100").runtime_memory.dtensor_tp is False
    assert Cluster.preset("dgx-h100").with_(framework=COMPILED).runtime_memory.dtensor_tp is True


def test_tp_overlap_leaves_one_chunk_and_the_sms_it_takes():
    assert timing.tp_overlap(1.0, 0.0, 0.12, 8) == 1.0                 # nothing to hide behind
    assert timing.tp_overlap(1.0, 10.0, 0.0, 8) == pytest.approx(1 / 8)  # one chunk of eight exposed
    assert timing.tp_overlap(1.0, 10.0, 0.12, 8) == pytest.approx(1 / 8 + 0.12 * 7 / 8)
    # NCCL's 16 channels take 16 of the device's SMs: 16/132 on an H100, 16/108 on an A100; set, the share wins
    assert EAGER.sm_share_on(dev.PROFILES["h100-sxm-80gb"]) == pytest.approx(16 / 132)
    assert EAGER.sm_share_on(dev.PROFILES["a100-sxm-80gb"]) == pytest.approx(16 / 108)
    assert replace(EAGER, nccl_channels=32).sm_share_on(dev.PROFILES["a100-sxm-80gb"]) == pytest.approx(32 / 108)
    assert replace(EAGER, sm_share=0.2).sm_share_on(dev.PROFILES["a100-sxm-80gb"]) == 0.2
    with pytest.raises(ValueError, match="nccl_channels=0"):
        Framework("x", nccl_channels=0)
    # an overlapped data-parallel collective: what compute covers, less the SMs NCCL takes from it
    assert timing.prefetch_wait(1.0, 0.5, 1 - 0.1, 0.0) == pytest.approx(0.5 + 0.05)
    shape = ModelShape(layers=8, hidden=8192, heads=64, vocab=32768, seq=4096, ffn=32768)
    c = Config(tp=8, sequence_parallel=True, microbatches=4, precision="bf16", recompute="selective")
    on = predict(shape, Cluster.preset("dgx-h100").with_(framework=MEGATRON), 4, c).time
    off = predict(shape, Cluster.preset("dgx-h100").with_(framework=replace(MEGATRON, tp_comm_overlap=False)), 4,
                  c).time
    assert on["tp"] < 0.5 * off["tp"] and on["compute"] == off["compute"]


def test_fsdp_copies_foreach_adam_and_float32_reduction():
    assert dev.fsdp_copy_seconds(H100, 1e9, 8) == pytest.approx(1e9 * (2 * (4 + 6 / 8) + 6 + 12 / 8) / 3.0e12)
    assert OPTIMIZER_BYTES["foreach"]["bf16"] == 92 and OPTIMIZER_BYTES["fused"]["bf16"] == 34
    assert dev.optimizer_seconds(H100, 1e9, "bf16", EAGER) == pytest.approx(92e9 / 3.0e12)
    cluster = Cluster.preset("dgx-h100", nodes=2).with_(framework=EAGER)
    c = Config(dp=16, zero=3, precision="bf16", recompute="selective")
    f32 = predict(LLAMA, cluster, 16, c).time
    f16 = predict(LLAMA, cluster.with_(framework=replace(EAGER, grad_reduce_bytes=0)), 16, c).time
    assert f32["dp"] > f16["dp"] and f32["compute"] == f16["compute"]


def test_fsdp1_s_flat_parameters_copy_fewer_bytes_than_fsdp2():
    """FSDP1 gathers into the buffer its parameters view (no copy-out) and receives their gradients
    concatenated, divided in place before and after the reduce-scatter, cast to float32: 8 + 22/dp
    bytes per parameter against FSDP2's 14 + 24/dp. A ZeRO-3 step differs by exactly those copies;
    the fms-fsdp rows (FSDP1) are priced with them."""
    assert dev.fsdp_copy_seconds(H100, 1e9, 8, flat=True) == pytest.approx(1e9 * (8 + 22 / 8) / 3.0e12)
    cluster = Cluster.preset("dgx-h100", nodes=2).with_(framework=EAGER)
    flat = cluster.with_(framework=replace(EAGER, fsdp="fsdp1"))
    c = Config(dp=16, zero=3, precision="bf16", recompute="selective", microbatches=2)
    two, one = predict(LLAMA, cluster, 32, c), predict(LLAMA, flat, 32, c)
    psi, gpu = LLAMA.parameters(), cluster.device
    saved = 2 * (dev.fsdp_copy_seconds(gpu, psi, 16) - dev.fsdp_copy_seconds(gpu, psi, 16, flat=True))
    assert two.time["total"] - one.time["total"] == pytest.approx(saved) and saved > 0
    assert one.time["dp"] == two.time["dp"] and one.memory == two.memory
    assert {r.framework.fsdp for r in published.ROWS if r.name.startswith("fms-fsdp")} == {"fsdp1"}
    for row in published.ROWS:       # torchtitan runs FSDP2
        if row.name.startswith("torchtitan"):
            fw = FRAMEWORKS[row.framework] if isinstance(row.framework, str) else row.framework
            assert fw.fsdp == "fsdp2", row.name


def test_pipeline_messages_are_priced_as_nccl_send_recv():
    cluster = Cluster.preset("dgx-h100", nodes=2)
    nccl = cluster.nccl
    n = 64 * 2 ** 20
    assert timing._link_time(0, 1, 8, cluster.intra, cluster.inter, nccl, n) == nccl.time("send_recv", n, 2, 2)
    assert timing._link_time(0, 8, 8, cluster.intra, cluster.inter, nccl, n) == nccl.time("send_recv", n, 2, 1)
    # achieved, not line rate: slower than the NVLink's 450 GB/s
    assert nccl.time("send_recv", n, 2, 2) > cluster.intra.time(n)


def test_gradient_accumulation_down_to_one_sequence_per_microbatch():
    assert space._accumulation_counts(48) == (1, 2, 4, 8, 16, 32, 48)
    assert space._accumulation_counts(1) == (1,)
    configs = space.configurations("llama-7b", Cluster.preset("dgx-h100"), 512, precisions=("bf16",),
                                   recompute=("none",), zero=(1,), sequence_parallel=(False,))
    assert any(c.pp == 1 and c.dp == 8 and c.microbatches == 64 for c in configs)    # one sequence each
    assert any(c.pp == 1 and c.dp == 2 and c.microbatches == 256 for c in configs)


def test_a_pipeline_tries_micro_batches_of_one_to_eight_sequences():
    # 144 rows per data-parallel rank over 16 stages: 16, 32, 64, 128 stages' multiples, 18, 36, 72, 144 by size
    assert space._pipeline_counts(16, 144) == (1, 2, 4, 16, 18, 32, 36, 64, 72, 128, 144)
    assert space._pipeline_counts(4, 0) == (1, 2, 4, 8, 16, 32)
    # Megatron's usual layout, a micro-batch of one sequence, is searched where it divides: GPT 310B-like
    # on 1,920 A100 (dp 15 x tp 8 x pp 16), 2,160 sequences, interleaved at m = 144
    shape = ModelShape(layers=96, hidden=16384, heads=128, vocab=51200, seq=2048, ffn=4 * 16384)
    cluster = Cluster.preset("dgx-a100", nodes=240)
    configs = space.configurations(shape, cluster, 2160, precisions=("bf16",), recompute=("selective",),
                                   zero=(1,), sequence_parallel=(True,), max_tp=8)
    one = [c for c in configs if (c.dp, c.tp, c.pp, c.schedule, c.microbatches) == (15, 8, 16, "interleaved", 144)]
    assert len(one) == 1
    # ... and priced faster than the same layout at 16 micro-batches of nine sequences (the interleaved bubble,
    # (p - 1) / (v m + p - 1), 15/47 of the step at m = 16 against 15/303 at 144)
    m16 = predict(shape, cluster, 2160, replace(one[0], microbatches=16))
    assert predict(shape, cluster, 2160, one[0]).time["total"] < 0.9 * m16.time["total"]


def test_an_eager_layer_dispatches_its_host_operators_per_kernel():
    """``EAGER.host_ops_per_kernel`` recounted: Hugging Face's ``LlamaDecoderLayer`` (eager PyTorch:
    float32 RMSNorm, rotary by ``rotate_half``, ``repeat_kv``, SDPA) in bf16, forward and backward
    with gradients accumulating, dispatches that many ATen operators per kernel the device model
    counts for the same layer under eager accounting (within 10%)."""
    transformers = pytest.importorskip("transformers")
    import torch

    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding

    from workbench.advise.calibrate_cuda import dispatched_operators

    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=688, num_attention_heads=8,
                                      num_key_value_heads=2, attn_implementation="sdpa")
    layer = LlamaDecoderLayer(config, 0).to(torch.bfloat16)
    x = torch.randn(1, 64, 256, dtype=torch.bfloat16, requires_grad=True)
    positions = torch.arange(64)[None]
    cos, sin = (t.to(torch.bfloat16) for t in LlamaRotaryEmbedding(config)(x, positions))

    def step():
        out = layer(x, position_embeddings=(cos, sin), attention_mask=None, position_ids=positions)
        (out[0] if isinstance(out, tuple) else out).float().sum().backward()

    step()                                            # the gradients exist: the next step accumulates
    dispatched = dispatched_operators(step)
    shape = ModelShape(layers=1, hidden=256, heads=8, kv_heads=2, ffn=688, vocab=64, seq=64, gated=True,
                       positions="rope", norm="rmsnorm", bias=False)
    kernels = sum(dev.kernels_per_layer(H100, shape, framework=EAGER).values())
    assert dispatched / kernels == pytest.approx(EAGER.host_ops_per_kernel, rel=0.1), (dispatched, kernels)
    assert MEGATRON.host_ops_per_kernel == MEGATRON_2022.host_ops_per_kernel == 1.0
    # per kernel, an eager layer pays the host 2.25 dispatches: a host-bound layer takes that much longer
    tiny = shape.with_(seq=16)
    slow = H100.with_(kernel_overhead_s=1e-3)
    assert dev.layer_seconds(slow, tiny, 1, framework=EAGER)["total"] == pytest.approx(
        EAGER.host_ops_per_kernel * kernels * 1e-3)
    with pytest.raises(ValueError, match="host_ops_per_kernel=0.5"):
        Framework("x", host_ops_per_kernel=0.5)


def test_eager_pytorch_launching_fused_kernels_dispatches_its_host_operators_per_kernel():
    """``EAGER_FUSED.host_ops_per_kernel`` recounted: a Llama layer built from Megatron-style fused
    kernels -- each one operator, as a Triton or CUDA extension registered with ``torch.library`` is
    (a fused RMSNorm, rotary embedding and SwiGLU, forward and backward) -- one QKV and one gate-up
    projection and SDPA, launched by eager PyTorch: forward and backward with gradients
    accumulating dispatch that many ATen operators per kernel the device model counts for the same
    layer with fused kernels (within 10%). Fewer kernels than eager's, about as many operators
    around each multiply: so more operators per kernel, far fewer per layer."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    from workbench.advise.calibrate_cuda import dispatched_operators

    ops = _fused_kernels()
    h, ffn, heads, kv, seq = 256, 688, 8, 2, 64
    d = h // heads

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm1, self.norm2 = nn.Parameter(torch.ones(h)), nn.Parameter(torch.ones(h))
            self.qkv, self.out = nn.Linear(h, h + 2 * kv * d, bias=False), nn.Linear(h, h, bias=False)
            self.gate_up, self.down = nn.Linear(h, 2 * ffn, bias=False), nn.Linear(ffn, h, bias=False)

        def forward(self, x):
            b, s, _ = x.shape
            q, k, v = self.qkv(ops.rms_norm(x, self.norm1)).split([h, kv * d, kv * d], -1)
            q, k = ops.rotary(q.reshape(b, s, heads, d)), ops.rotary(k.reshape(b, s, kv, d))
            a = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2),
                                               v.reshape(b, s, kv, d).transpose(1, 2), is_causal=True, enable_gqa=True)
            x = x + self.out(a.transpose(1, 2).reshape(b, s, h))
            return x + self.down(ops.swiglu(self.gate_up(ops.rms_norm(x, self.norm2))))

    layer = Layer().to(torch.bfloat16)
    x = torch.randn(1, seq, h, dtype=torch.bfloat16, requires_grad=True)

    def step():
        layer(x).float().sum().backward()

    step()                                            # the gradients exist: the next step accumulates
    dispatched = dispatched_operators(step)
    shape = ModelShape(layers=1, hidden=h, heads=heads, kv_heads=kv, ffn=ffn, vocab=64, seq=seq, gated=True,
                       positions="rope", norm="rmsnorm", bias=False)
    kernels = sum(dev.kernels_per_layer(H100, shape, framework=EAGER_FUSED).values())
    assert dispatched / kernels == pytest.approx(EAGER_FUSED.host_ops_per_kernel, rel=0.1), (dispatched, kernels)
    eager_kernels = sum(dev.kernels_per_layer(H100, shape, framework=EAGER).values())
    assert kernels < eager_kernels / 2
    assert kernels * EAGER_FUSED.host_ops_per_kernel < 0.5 * eager_kernels * EAGER.host_ops_per_kernel
    # the kernels and their bytes are Megatron's; what differs from Megatron-Core is the host's dispatch and
    # the tensor-parallel collectives, waited for
    assert dev.layer_operators(H100, LLAMA, 1, framework=EAGER_FUSED) == dev.layer_operators(H100, LLAMA, 1,
                                                                                            framework=MEGATRON)
    assert not EAGER_FUSED.tp_comm_overlap and MEGATRON.tp_comm_overlap
    slow = H100.with_(kernel_overhead_s=1e-3)
    tiny = shape.with_(seq=16)
    assert dev.layer_seconds(slow, tiny, 1, framework=EAGER_FUSED)["total"] == pytest.approx(
        EAGER_FUSED.host_ops_per_kernel * kernels * 1e-3)


_FUSED = {}


def _fused_kernels():
    """Three fused kernels as one operator each (forward and backward), registered once per process
    under ``workbench_test_fused``: what the dispatcher sees of a Triton or CUDA extension kernel.
    Their arithmetic is a stand-in; only the count of dispatches is read."""
    if _FUSED:
        return _FUSED["ops"]
    import types

    import torch
    from torch.library import custom_op

    def pair(name, forward, backward, saves_input, schema, backward_schema):
        # (schemas given: this module's annotations are strings, which custom_op cannot read)
        fwd = custom_op(f"workbench_test_fused::{name}", forward, mutates_args=(), schema=schema)
        bwd = custom_op(f"workbench_test_fused::{name}_backward", backward, mutates_args=(), schema=backward_schema)
        fwd.register_autograd(lambda ctx, g: bwd(g, *ctx.saved),
                              setup_context=lambda ctx, inputs, output: setattr(
                                  ctx, "saved", inputs if saves_input else ()))
        return fwd

    def rms_norm(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return x * w

    def rms_norm_backward(g: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return g * w, (g * x).sum(dim=(0, 1))

    def rotary(q: torch.Tensor) -> torch.Tensor:
        return q.clone()

    def rotary_backward(g: torch.Tensor) -> torch.Tensor:
        return g.clone()

    def swiglu(x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, -1)
        return a * b

    def swiglu_backward(g: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        a, b = x.chunk(2, -1)
        return torch.cat([g * b, g * a], -1)

    _FUSED["ops"] = types.SimpleNamespace(
        rms_norm=pair("rms_norm", rms_norm, rms_norm_backward, True, "(Tensor x, Tensor w) -> Tensor",
                      "(Tensor g, Tensor x, Tensor w) -> (Tensor, Tensor)"),
        rotary=pair("rotary", rotary, rotary_backward, False, "(Tensor q) -> Tensor", "(Tensor g) -> Tensor"),
        swiglu=pair("swiglu", swiglu, swiglu_backward, True, "(Tensor x) -> Tensor", "(Tensor g, Tensor x) -> Tensor"))
    return _FUSED["ops"]


def test_public_rows_hold_korthikanti_table_5_and_name_their_frameworks():
    t5 = [r for r in published.ROWS if r.metric == "step_s"]
    assert len(t5) == 8 and {r.config.recompute for r in t5} == {"full", "selective"}
    assert all(r.framework == "megatron" for r in published.ROWS if r.source == published.MEGATRON)
    for row in t5[:2]:   # 22B on one DGX A100: within 15%
        assert abs(published.predicted(row)["value"] / row.value - 1) < 0.15
    # a row on its own network (IBM's blog: 400 Gb/s per A100 node) and framework (bf16 gradient reduction)
    ibm = next(r for r in published.ROWS if r.source == published.IBM and r.cluster == "dgx-a100")
    cluster = published.row_cluster(ibm)
    assert cluster.inter.bandwidth_Bps == pytest.approx(400e9 / 8 / 8)
    assert cluster.nccl.network_Bps == pytest.approx(0.96 * 400e9 / 8 / 8)
    assert cluster.framework.grad_reduce_bytes == 2 and not cluster.framework.fused
    slower = published.predicted(replace(ibm, network_gbps=100))["value"]
    assert slower < published.predicted(ibm)["value"]   # a quarter of the network: FSDP's traffic shows



def test_torchtitan_s_a100_rows_run_on_the_aws_efa_network_its_launcher_names():
    """torchtitan's A100 table (April 2024) names no network; its launcher of the time is for AWS
    with EFA, whose 8 x A100 80 GB instance has 400 Gb/s per node: every torchtitan A100 row, the
    out-of-memory one included, is priced on dgx-a100's GPUs with that network, and the
    communication-bound 70B row is slower on it than on a DGX's 8 x 200 Gb/s."""
    rows = [r for r in published.ROWS if r.source == published.TITAN_A100]
    assert len(rows) == 10 and {r.network_gbps for r in rows} == {published.TITAN_A100_GBPS} == {400}
    for row in rows:
        cluster = published.row_cluster(row)
        assert cluster.device.name.startswith("A100 SXM 80") and cluster.nodes == 8
        assert cluster.inter.bandwidth_Bps == pytest.approx(400e9 / 8 / 8)
    # "selective layer" checkpointing: torchtitan's default then, every other block checkpointed whole
    layer_ac = [r for r in rows if "selective layer" in r.name]
    assert len(layer_ac) == 3 and all(r.config.recompute == "full" and r.config.recompute_layers == r.model.layers // 2
                                      for r in layer_ac)
    assert all(not published.predicted(r)["feasible"] for r in rows if r.metric == "fits")
    bound = next(r for r in rows if r.model.layers == 80 and r.config.recompute == "selective" and r.metric != "fits")
    assert published.predicted(bound)["value"] < published.predicted(replace(bound, network_gbps=1600))["value"]

def test_megatron_2022_reduces_gradients_after_the_flush():
    shape = ModelShape(layers=8, hidden=4096, heads=32, vocab=32768, seq=2048, ffn=16384)
    c = Config(dp=16, tp=1, microbatches=2, precision="bf16")
    cluster = Cluster.preset("dgx-a100", nodes=2)
    after = predict(shape, cluster, 32, c).time
    hidden = predict(shape, cluster.with_(framework=replace(MEGATRON_2022, overlap_grad_reduce=True)), 32, c).time
    assert not MEGATRON_2022.overlap_grad_reduce and EAGER.overlap_grad_reduce and MEGATRON.overlap_grad_reduce
    assert after["dp"] > 2 * hidden["dp"] and after["compute"] == hidden["compute"]



def test_cli_takes_the_framework():
    import argparse

    from workbench.advise import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    _, cluster = cli.build(parser.parse_args(["--cluster", "dgx-h100", "--framework", "megatron"]))
    assert cluster.framework is MEGATRON
    _, cluster = cli.build(parser.parse_args(["--cluster", "dgx-a100"]))
    assert cluster.framework is MEGATRON_2022 and cluster.device.attention == "math"
    with pytest.raises(SystemExit):
        parser.parse_args(["--framework", "jax"])
