"""The GPU runtime's memory terms (workbench.advise.runtime_memory) and the fixes of issue 37, each
against its source: Korthikanti et al. 2022's activation formulas, Megatron-LM's bytes per parameter,
the ZeRO paper's Table 1, the pipeline schedules' micro-batches in flight; and the CPU path (no
runtime) bit for bit as it was. Pure Python, no launches."""
import math
from dataclasses import replace

import pytest

from workbench.advise import Cluster, Config, ModelShape
from workbench.advise import memory_model as advise_memory
from workbench.advise.memory_model import activation_bytes_per_microbatch, memory_by_rank, memory_per_device
from workbench.advise.runtime_memory import MEGATRON, RuntimeMemory, korthikanti_layer_bytes, model_state
from workbench.advise.validate import SETTINGS
from workbench.parallel import pipeline_schedules as schedules

# what memory_by_rank predicted for the validation's configurations (tiny and small, this machine)
# before the GPU runtime's terms existed: per rank (total, activations + buffers), bit for bit
GOLDEN = {
    ('tiny', 16, 'dp4-tp1-pp1 zero0 fp32'): ((8037072.0, 4703744.0),),
    ('tiny', 16, 'dp2-tp2-pp1 zero0 fp32'): ((7550928.0, 5837568.0),),
    ('tiny', 16, 'dp1-tp4-pp1 fp32'): ((9268432.0, 8365056.0),),
    ('tiny', 16, 'dp2-tp1-pp2 zero0 1f1b m2 fp32'): ((6548840.0, 4817152.0), (4373868.0, 2705664.0)),
    ('tiny', 16, 'dp1-tp1-pp4 1f1b m4 fp32'):
        ((5814328.0, 4882432.0), (4691248.0, 3891456.0), (3568944.0, 2769152.0), (2650428.0, 1782016.0)),
    ('tiny', 16, 'dp1-tp2-pp2 gpipe m2 fp32'): ((6993000.0, 6087680.0), (7072364.0, 6230528.0)),
    ('tiny', 16, 'dp2-tp1-pp2 zero0 zb-h1 m4 fp32'): ((4173160.0, 2441472.0), (4859500.0, 3191296.0)),
    ('tiny', 64, 'dp4-tp1-pp1 zero1 fp32'): ((20588932.0, 18505728.0),),
    ('tiny', 64, 'dp4-tp1-pp1 zero3 fp32'): ((19834388.0, 19001088.0),),
    ('tiny', 64, 'dp2-tp2-pp1 zero2 sp fp32'): ((20818052.0, 19747328.0),),
    ('tiny', 64, 'dp2-tp1-pp2 zero1 1f1b m4 fp32'): ((10867204.0, 9568512.0), (6862852.0, 5611776.0)),
    ('tiny', 64, 'dp1-tp2-pp2 1f1b m4 sp fp32'): ((10721640.0, 9816320.0), (6805868.0, 5964032.0)),
    ('tiny', 64, 'dp2-tp1-pp2 zero0 gpipe m2 fp32'): ((20802920.0, 19071232.0), (21284204.0, 19616000.0)),
    ('tiny', 64, 'dp4-tp1-pp1 zero1 fp32 full'): ((8690308.0, 6607104.0),),
    ('small', 8, 'dp4-tp1-pp1 zero0 fp32'): ((70646992.0, 19303424.0),),
    ('small', 8, 'dp2-tp2-pp1 zero0 fp32'): ((49214160.0, 23224832.0),),
    ('small', 8, 'dp1-tp4-pp1 fp32'): ((46056656.0, 32744448.0),),
    ('small', 8, 'dp2-tp1-pp2 zero0 1f1b m2 fp32'): ((46019688.0, 19956736.0), (36707436.0, 11160576.0)),
    ('small', 8, 'dp1-tp1-pp4 1f1b m4 fp32'):
        ((32858168.0, 19431424.0), (28914736.0, 16278528.0), (24450096.0, 11813888.0), (20197436.0, 7286784.0)),
    ('small', 8, 'dp1-tp2-pp2 gpipe m2 fp32'): ((37495912.0, 24175616.0), (36729452.0, 23925248.0)),
    ('small', 8, 'dp2-tp1-pp2 zero0 zb-h1 m4 fp32'): ((36566120.0, 10503168.0), (37585516.0, 12038656.0)),
    ('small', 32, 'dp4-tp1-pp1 zero1 fp32'): ((104838672.0, 72749056.0),),
    ('small', 32, 'dp4-tp1-pp1 zero3 fp32'): ((93218836.0, 80382976.0),),
    ('small', 32, 'dp2-tp2-pp1 zero2 sp fp32'): ((92724748.0, 76481536.0),),
    ('small', 32, 'dp2-tp1-pp2 zero1 1f1b m4 fp32'): ((58411020.0, 38863872.0), (41089036.0, 21928960.0)),
    ('small', 32, 'dp1-tp2-pp2 1f1b m4 sp fp32'): ((52726888.0, 39406592.0), (35263596.0, 22459392.0)),
    ('small', 32, 'dp2-tp1-pp2 zero0 gpipe m2 fp32'): ((102741096.0, 76678144.0), (101983340.0, 76436480.0)),
    ('small', 32, 'dp4-tp1-pp1 zero1 fp32 full'): ((54475280.0, 22385664.0),),
}

# a Llama-shaped model small enough to be quick (GQA, gated MLP, RMSNorm, untied head)
LLAMA = ModelShape(layers=8, hidden=512, heads=8, kv_heads=2, ffn=1536, vocab=32000, seq=1024, gated=True, tied=False,
                   bias=False, positions="rope", norm="rmsnorm")
# a GPT-shaped one (Korthikanti's model: MLP 4h, q/k/v of width h, LayerNorm with biases)
GPT = ModelShape(layers=4, hidden=1024, heads=16, kv_heads=16, ffn=4096, vocab=32000, seq=2048, gated=False,
                 tied=True, bias=True, positions="learned", norm="layernorm")
NO_EXTRAS = RuntimeMemory(context_bytes=0.0, allocator_overhead=0.0)


def _gpu(runtime=MEGATRON, nodes=1):
    """dgx-h100 with ``runtime`` as given (no framework: a framework would set its kernel and loss)."""
    return Cluster.preset("dgx-h100", nodes=nodes).with_(framework=None, runtime_memory=runtime)


def test_cpu_predictions_are_unchanged_bit_for_bit():
    seen = set()
    for setting in SETTINGS:
        shape = ModelShape.preset(setting.model)
        for c in setting.configs:
            key = (setting.model, setting.batch, c.label())
            if key in GOLDEN:
                rows = memory_by_rank(shape, c, setting.batch)
                assert tuple((r["total"], r["activations"] + r["buffers"]) for r in rows) == GOLDEN[key], key
                seen.add(key)
    assert seen == set(GOLDEN)
    # a cluster without a runtime (a CPU one) is the formulas alone, as no cluster
    cpu = _gpu(runtime=None).with_(communicator_bytes=0.0)
    for c in (Config(dp=4, precision="bf16"), Config(pp=4, microbatches=8, precision="bf16")):
        assert memory_by_rank(LLAMA, c, 32, cpu) == memory_by_rank(LLAMA, c, 32)


def test_presets_carry_the_runtime_and_bad_runtimes_are_refused():
    for name in ("dgx-h100", "p4d-a100", "a2-ultra-100g", "dgx-a100"):
        c = Cluster.preset(name)   # Megatron's terms, with the framework's kernel, loss and policy
        fw = c.framework
        assert c.runtime_memory == replace(MEGATRON, attention=fw.attention, loss_float32_copies=fw.loss_float32_copies,
                                           selective=fw.selective)
        assert c.runtime_memory.attention == c.device.attention == fw.attention
    for bad in (dict(context_bytes=-1.0), dict(allocator_overhead=math.nan), dict(main_grad_bytes=3),
                dict(attention="sdpa"), dict(selective="layer")):
        with pytest.raises(ValueError, match=next(iter(bad))):
            RuntimeMemory(**bad)
    with pytest.raises(ValueError, match="runtime_memory"):
        _gpu(runtime="megatron")


def test_context_and_allocator_reserve_are_added_once_as_buffers():
    c = Config(dp=8, zero=1, precision="bf16", microbatches=2)
    base = memory_per_device(LLAMA, c, 16, _gpu(NO_EXTRAS))
    ctx = memory_per_device(LLAMA, c, 16, _gpu(RuntimeMemory(context_bytes=512 * 2 ** 20, allocator_overhead=0.0)))
    assert ctx["buffers"] - base["buffers"] == 512 * 2 ** 20
    reserve = memory_per_device(LLAMA, c, 16, _gpu(RuntimeMemory(context_bytes=0.0, allocator_overhead=0.1)))
    comms = advise_memory._communicators(c) * _gpu().communicator_bytes
    allocated = base["total"] - comms            # the NCCL buffers live outside the allocator
    assert reserve["total"] - base["total"] == pytest.approx(0.1 * allocated, rel=1e-12)


def test_model_state_follows_megatron_and_the_zero_paper():
    psi, d = 7.5e9, 64
    # Megatron-LM, "Distributed Optimizer": bf16 parameters, fp32 gradients: 18 bytes, 6 + 12/d distributed
    assert sum(model_state(psi, d, 0, MEGATRON).values()) == 18 * psi
    assert sum(model_state(psi, d, 1, MEGATRON).values()) == pytest.approx((6 + 12 / d) * psi)
    # ZeRO (Rajbhandari et al. 2020), Table 1: 7.5B parameters, K = 12, Nd = 64: 120, 31.4, 16.6, 1.88 GB
    zero_paper = RuntimeMemory(main_grad_bytes=2)
    for stage, gb in ((0, 120), (1, 31.4), (2, 16.6), (3, 1.88)):
        assert sum(model_state(psi, d, stage, zero_paper).values()) / 1e9 == pytest.approx(gb, rel=0.01)
    # on a GPU preset, bf16 Adam model state is Megatron's; float32 keeps the formulas' exact count
    got = memory_per_device(LLAMA, Config(dp=8, zero=1, precision="bf16"), 8, _gpu())
    psi = LLAMA.parameters()
    assert (got["parameters"], got["gradients"], got["optimizer"]) == (2.0 * psi, 4.0 * psi, 12.0 * psi / 8)
    fp32 = Config(dp=8, zero=1)
    assert memory_per_device(LLAMA, fp32, 8, _gpu())["optimizer"] == memory_per_device(LLAMA, fp32, 8)["optimizer"]


def test_the_loss_keeps_float32_softmax_and_the_caller_drops_the_logits():
    c = Config(precision="bf16")
    sb, vp = LLAMA.seq * 2, LLAMA.padded_vocab(1)
    plain = activation_bytes_per_microbatch(LLAMA, c, 2, 0)["kept"]
    gpu = activation_bytes_per_microbatch(LLAMA, c, 2, 0, MEGATRON)["kept"]
    # formulas: log_softmax's bf16 output and the caller's bf16 logits; runtime: the float32 softmax,
    # the target mask and local ids (Megatron's vocab_parallel_cross_entropy, also at tp = 1)
    assert gpu - plain == (4 * sb * vp + 9 * sb) - 2 * 2 * sb * vp
    # the loss's busiest moment: the 16-bit logits beside float32 copies of them, as many as the loss makes
    peak = lambda copies: activation_bytes_per_microbatch(  # noqa: E731
        LLAMA, c, 2, 0, RuntimeMemory(loss_float32_copies=copies))["peak"]
    assert peak(1) == gpu + 2 * sb * vp + 4 * sb * vp + 8 * sb - (4 * sb * vp + 9 * sb)
    assert peak(3) - peak(1) == 2 * 4 * sb * vp
    # under tensor parallelism both are vocabulary-parallel: the runtime only lets the logits go
    tp = Config(tp=2, precision="bf16")
    assert activation_bytes_per_microbatch(LLAMA, tp, 2, 0)["kept"] - \
        activation_bytes_per_microbatch(LLAMA, tp, 2, 0, MEGATRON)["kept"] == 2 * sb * LLAMA.padded_vocab(2) / 2


@pytest.mark.parametrize("t,sp", [(1, False), (4, False), (4, True)])
def test_activations_per_layer_are_korthikantis(t, sp):
    """Korthikanti et al. 2022, Table 2: sbh (10 + 24/t + 5as/(ht)), sbh/t (34 + 5as/h) with sequence
    parallelism; our layers have no dropout, so less its two one-byte masks (2 sbh, /t with SP) and
    plus the norms' statistics (2 per row, ``e`` bytes each, 4 sb elements)."""
    s, b, h, a = GPT.seq, 2, GPT.hidden, GPT.heads
    masks = 2 * s * b * h / (t if sp else 1)
    stats = 2 * 4 * s * b / (t if sp else 1)
    for kernel in ("math", "flash"):
        layer = advise_memory._layer_bytes(GPT, b, t, sp, 2, kernel)
        for policy in ("none", "selective", "full"):
            want = korthikanti_layer_bytes(s, b, h, a, t, sp, policy)
            if policy != "full":
                want += stats - masks
            if policy == "none" and kernel == "flash":   # no s^2 scores: one float32 log-sum-exp per row and head
                want += 4 * a * s * b / t - 5 * a * s * s * b / t
            assert layer[policy] == pytest.approx(want, rel=1e-12), (kernel, policy)


def test_math_attention_costs_the_s2_core_on_a_gpu_runtime():
    c = Config(precision="bf16")
    flash = memory_per_device(GPT, c, 2, _gpu(NO_EXTRAS))["activations"]
    math_ = memory_per_device(GPT, c, 2, _gpu(RuntimeMemory(context_bytes=0.0, allocator_overhead=0.0,
                                                            attention="math")))["activations"]
    s, a, b = GPT.seq, GPT.heads, 2
    assert math_ - flash == pytest.approx(GPT.layers * (5 * a * s * s * b - 4 * a * s * b), rel=1e-9)
    sel = Config(precision="bf16", recompute="selective")
    assert memory_per_device(GPT, sel, 2, _gpu(NO_EXTRAS)) == \
        memory_per_device(GPT, sel, 2, _gpu(RuntimeMemory(context_bytes=0.0, allocator_overhead=0.0, attention="math")))


def test_1f1b_holds_p_minus_stage_microbatches_and_gpipe_all():
    p, m = 4, 16
    for rank in range(p):
        assert advise_memory._live("1f1b", p, m, rank) == {rank: p - rank}
        assert advise_memory._live("gpipe", p, m, rank) == {rank: m}
    gpu = _gpu(NO_EXTRAS)

    def one(schedule):
        return memory_by_rank(LLAMA, Config(pp=p, schedule=schedule, microbatches=m, precision="bf16"), 32, gpu)

    first = activation_bytes_per_microbatch(LLAMA, Config(pp=p, microbatches=m, precision="bf16"), 32, 0, MEGATRON)
    f1b, gpipe = one("1f1b"), one("gpipe")
    # the first stage: p micro-batches kept (one of them at its backward's peak), plus the receives posted
    assert p * first["kept"] <= f1b[0]["activations"] <= (p - 1) * first["kept"] + first["peak"] + 0.05 * first["kept"]
    assert gpipe[0]["activations"] >= m * first["kept"]
    # stages of as many layers hold fewer micro-batches the later they come (the last adds the loss)
    assert f1b[0]["activations"] > f1b[1]["activations"] > f1b[2]["activations"]


def test_the_last_stage_keeps_no_logits_beyond_the_one_in_its_loss():
    def last(cluster, m):   # one sequence per micro-batch
        return memory_by_rank(LLAMA, Config(pp=2, microbatches=m, precision="bf16"), m, cluster)[-1]["activations"]

    # the formulas (the workbench's pipeline returns every micro-batch's logits) grow with m ...
    logits = 2 * LLAMA.seq * LLAMA.padded_vocab(1)
    assert last(None, 32) - last(None, 8) == pytest.approx(24 * logits, rel=1e-9)
    # ... a GPU framework's last stage, one micro-batch in flight, does not
    assert last(_gpu(NO_EXTRAS), 32) == last(_gpu(NO_EXTRAS), 8)
    for schedule in ("interleaved", "zbv"):
        config = Config(pp=2, schedule=schedule, microbatches=8, precision="bf16")
        rows = memory_by_rank(LLAMA, config, 64, _gpu(NO_EXTRAS))
        formulas = memory_by_rank(LLAMA, config, 64)
        b = 64 / 8
        logits = 8 * 2 * LLAMA.seq * b * LLAMA.padded_vocab(1)
        holder = 0 if schedule == "zbv" else 1       # the rank holding the last virtual stage
        # (less what the float32 softmax of the micro-batches in flight adds)
        assert formulas[holder]["activations"] - rows[holder]["activations"] >= 0.9 * logits


def test_zero_bubble_under_zero3_frees_each_microbatch_once():
    """ZeRO-3 defers no weight gradient, so a W after B frees nothing: the replay used to free the
    micro-batch again at its W on every stage after the first (live counts fell below zero)."""
    p, m = 4, 16
    for rank in range(1, p):
        _, moments = advise_memory._replay_counts("zb-h1", p, m, rank, False)
        lives = [x[2] for x in moments]
        assert min(lives) >= 1 and max(lives) == p - rank
    config = lambda sched: Config(dp=2, pp=p, zero=3, schedule=sched, microbatches=m, precision="bf16")  # noqa: E731
    zb = memory_by_rank(LLAMA, config("zb-h1"), 64, _gpu(NO_EXTRAS))
    f1b = memory_by_rank(LLAMA, config("1f1b"), 64, _gpu(NO_EXTRAS))
    for a, b in zip(zb, f1b):
        assert a["activations"] == pytest.approx(b["activations"], rel=0.02)


def test_communicators_count_each_group_a_rank_uses():
    assert advise_memory._communicators(Config(dp=8)) == 1                 # the world is the data-parallel group
    assert advise_memory._communicators(Config(dp=2, tp=4)) == 3           # world, dp, tp
    assert advise_memory._communicators(Config(dp=2, tp=2, pp=4)) == 6     # world, dp, tp, pp, two neighbours
    assert advise_memory._communicators(Config(pp=2)) == 1 + 1             # world (= pp), one neighbour
