"""Public GPU measurements the advisor is checked against: predicted beside published, row by row.

``workbench advise --validate-published`` (:func:`validate`, :func:`report`) predicts every row
below with the advisor's public API (:func:`workbench.advise.predict` on the row's cluster preset,
or the preset's :class:`~workbench.advise.nccl.NcclModel` for an nccl-tests row) and prints the
prediction beside the published figure, their ratio and the source; ``docs/advisor-evidence.md``
is that output (``workbench advise --validate-published > docs/advisor-evidence.md``).

Each row is a run someone else made and published, with what they published about it: the model's
shape (:class:`ModelShape`), the cluster (the nearest preset and the number of nodes), the global
batch, the layout as a :class:`Config`, and one figure:

==================  ==========================================================================
``tflops_per_gpu``  model FLOP/s per GPU as Megatron counts them (:func:`megatron_flops`: no
                    recomputation, attention counted whole), in TFLOP/s
``mfu``             the same over the GPU's dense bf16 peak (:data:`PEAK_BF16`), in percent
``tokens_per_gpu``  tokens per second per GPU (torchtitan's WPS / TPS)
``memory_gib``      peak memory per GPU in GiB (the advisor's ``memory["total"]``)
``busbw_GBps``      an nccl-tests bus bandwidth in GB/s (:meth:`NcclModel.busbw`)
``step_s``          seconds per training step (iteration time)
``fits``            1 where the run fit in the GPU's memory, 0 where it was reported out of
                    memory; predicted: the plan's ``feasible``
==================  ==========================================================================

A training row that ran is within only where it is also predicted to fit; a ``fits`` row is
within where the prediction agrees (its ratio is then 1, else 0).

``role``: ``calibrated`` where a figure of the model was taken from that very row (its ratio
shows the model reproduces its own input, nothing more), ``checked`` where nothing was fitted on
it. What a published row leaves unsaid (micro-batch size, schedule, recomputation) is an
assumption, said in its ``note``.

Held out, never used here: the Ultra-Scale Playbook's benchmark results and Table 1 of Narayanan
et al. 2021; the checks that use them are run by others.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from workbench.comm.topology import Link

from .choose import predict
from .cluster import GiB, Cluster
from .device import PROFILES
from .framework import COMPILED, EAGER, FRAMEWORKS, Framework
from .nccl import NcclModel
from .nccl import PRESETS as NCCL_PRESETS
from .plan import Config
from .shape import ModelShape
from .shape import PRESETS as SHAPES

__all__ = ["Published", "ROWS", "PEAK_BF16", "TOLERANCE", "megatron_flops", "predicted", "validate", "report",
           "summary"]

TOLERANCE = 0.15
PEAK_BF16 = {"h100": 989e12, "a100": 312e12}   # dense bf16 (H100 SXM, A100 datasheets), what MFU divides by

MEGATRON = ("NVIDIA/Megatron-LM README, 'Training Speed and Scalability', images/model_table.png (H100 weak "
            "scaling, Megatron-Core r0.8.0): https://github.com/NVIDIA/Megatron-LM#training-speed-and-scalability")
TITAN_A100 = ("pytorch/torchtitan docs/performance.md (2024, 64 A100 80GB, FSDP2, local batch as listed): "
              "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md")
TITAN_H100 = ("pytorch/torchtitan docs/performance.md (Dec 2024, Grand Teton H100), Table {}: "
              "https://github.com/pytorch/torchtitan/blob/main/docs/performance.md")
KORTHIKANTI = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models' "
               "(MLSys 2023), abstract: 530B on 2240 A100 https://arxiv.org/abs/2205.05198")
NCCL_212 = "NVIDIA/nccl-tests#212 (S. Jeaugey, NVIDIA): https://github.com/NVIDIA/nccl-tests/issues/212"
NCCL_290 = "NVIDIA/nccl-tests#290 (NVIDIA): https://github.com/NVIDIA/nccl-tests/issues/290"
NCCL_119 = "NVIDIA/nccl-tests#119 (3 x 8 A100, 4 HDR per node): https://github.com/NVIDIA/nccl-tests/issues/119"
SENDRECV = "li-plus/playground cuda/nccl.md (sendrecv_perf, 8 A100): https://github.com/li-plus/playground"
IBM = ("PyTorch blog, 'Maximizing training throughput using PyTorch FSDP' (IBM and Meta, 2024), Table 1 (A100 80GB: "
       "128 GPUs, 400 Gbps; H100 80GB: 96 GPUs, 800 Gbps; batch 2 per GPU, sequences of 4,096): "
       "https://pytorch.org/blog/maximizing-training/")
FMS_COMPILE = ("foundation-model-stack/fms-fsdp README at ed74fd5 (2024-05-09, 'numbers are updated with "
               "torch.compile'): 7b HSDP no AC, 34b and 70b FSDP 'Selective AC', compile, batch 2 per GPU, with MFU "
               "and HFU; A100 80G, 128 GPUs with 400Gbps; H100, 96 GPUs with 800 Gbps: "
               "https://github.com/foundation-model-stack/fms-fsdp")
FMS_README = ("foundation-model-stack/fms-fsdp README, training throughput on 128 A100 (sharding strategy, activation "
              "checkpointing and batch per GPU as listed): https://github.com/foundation-model-stack/fms-fsdp")


@dataclass(frozen=True)
class Published:
    """One published measurement (see the module docstring). Training rows give ``model``,
    ``cluster``, ``nodes``, ``global_batch`` and ``config``; an nccl-tests row gives
    ``collective``, ``nbytes``, ``ranks`` and ``per_node`` (and ``nccl``, the model to price it
    with, when it is not the preset's)."""

    name: str
    source: str
    metric: str
    value: float
    cluster: str
    nodes: int = 1
    model: ModelShape | None = None
    global_batch: int = 0
    config: Config | None = None
    collective: str = ""
    nbytes: float = 0.0
    ranks: int = 0
    per_node: int = 0
    nccl: NcclModel | None = None
    role: str = "checked"
    note: str = ""
    framework: str | Framework = ""   # the run's framework (a name in FRAMEWORKS, or one), "" the preset's
    device: str = ""        # the run's GPU when it is not the preset's (workbench.advise.device.PROFILES)
    network_gbps: float = 0.0   # the run's network per node, Gb/s, where the source gives it; 0: the preset's


def _gpt(name: str, layers: int, hidden: int, heads: int, vocab: int, seq: int) -> ModelShape:
    """A Megatron GPT: ``ffn = 4 h``, GELU, biases, LayerNorm."""
    return ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, ffn=4 * hidden,
                      name=name, source="as published")


# The README names no virtual pipeline size, and two of its pipelined layouts admit no interleaving with
# two chunks per rank: Megatron-LM needs the layers per pipeline rank to be a multiple of the layers per
# virtual stage (megatron/training/arguments.py, core_r0.8.0), and 119B (92 layers over p = 4) and 462B
# (112 over 16) have 23 and 7, odd. Megatron's schedule without --num-layers-per-virtual-pipeline-stage
# is 1F1B, taken for all five; Config(schedule="interleaved", virtual_stages=v) prices the others.
_MEGATRON_SCHEDULE_NOTE = ("; 1F1B assumed, Megatron's schedule without a virtual pipeline size (none is "
                           "published, and 119B's 23 and 462B's 7 layers per rank admit no interleaving "
                           "with two chunks per rank)")


def _megatron(size: str, heads: int, hidden: int, layers: int, tp: int, pp: int, gpus: int, batch: int,
              tflops: float) -> Published:
    dp = gpus // (tp * pp)
    return Published(
        name=f"Megatron GPT {size}, {gpus} H100", source=MEGATRON, metric="tflops_per_gpu", value=tflops,
        cluster="dgx-h100", nodes=gpus // 8, model=_gpt(f"gpt-{size.lower()}", layers, hidden, heads, 131072, 4096),
        global_batch=batch,
        config=Config(dp=dp, tp=tp, pp=pp, zero=1, schedule="1f1b", microbatches=batch // dp,
                      sequence_parallel=tp > 1, precision="bf16", recompute="selective"),
        framework="megatron",
        note="micro-batch 1, distributed optimizer (ZeRO-1) and flash attention (priced as selective "
             "recomputation: its backward recomputes the scores) assumed: the table gives t, p, d, batch; "
             "Megatron-Core's kernels and --tp-comm-overlap (framework 'megatron')"
             + (_MEGATRON_SCHEDULE_NOTE if pp > 1 else ""))


_TITAN_NOTE = ("FSDP2 = ZeRO-3 over 64 GPUs on 8 nodes, eager PyTorch (framework 'eager': SDPA flash attention, "
               "unfused norms and rotary, per-op selective AC); the table names no network: torchtitan's multi-node "
               "launcher at that commit is 'optimized for AWS with EFA' (FI_PROVIDER=efa, 'Enable for A100'), and "
               "AWS's 8 x A100 80 GB instance (p4de.24xlarge) has 400 Gb/s of EFA per node: dgx-a100's GPUs and "
               "NVSwitch with 400 Gb/s per node")
_H100_NOTE = ("H100 96 GB HBM2e, 2.4 TB/s, at 500 W (device 'h100-sxm-96gb-500w'), 400 Gb/s per GPU; FSDP = ZeRO-3, "
              "no torch.compile, no Float8 (framework 'eager'); selective activation checkpointing is torchtitan's "
              "per-op policy (its default)")
_H100_COMPILE_NOTE = ("H100 96 GB HBM2e, 2.4 TB/s, at 500 W (device 'h100-sxm-96gb-500w'), 400 Gb/s per GPU; FSDP = "
                      "ZeRO-3 with torch.compile over each block, no Float8 (framework 'compiled': the complex rotary "
                      "left to ATen, the loss uncompiled, activation memory priced as eager's); torchtitan's per-op "
                      "selective activation checkpointing")


# torchtitan's A100 cluster: its multinode_trainer.slurm when the table was published (pytorch/torchtitan 20f10b5f1,
# 2024-04-16, the commit that added docs/performance.md) opens "This script is optimized for AWS with EFA" and sets
# FI_PROVIDER="efa" under "# Enable for A100" (NCCL_IB_DISABLE=1); AWS's instance of 8 A100 80 GB is the
# p4de.24xlarge, 4 x 100 Gb/s EFA (AWS, "Amazon EC2 P4 instances"); a user says as much in torchtitan#394 ("your
# AWS cluster brings 400 ... with EFA"). Before this was found the rows assumed dgx-a100's 8 x 200 Gb/s
TITAN_A100_GBPS = 400

# torchtitan's configurations when its A100 table was published (April 2024, pytorch/torchtitan 1ea476e9f):
# train_configs/llama2_13b.toml and llama3_8b.toml set norm_type = "fused_rmsnorm" (a Triton RMSNorm),
# llama2_70b.toml and llama3_70b.toml norm_type = "rmsnorm" (eager); compile = false in all four
_TITAN_FUSED_NORM = replace(EAGER, name="eager (torchtitan, fused RMSNorm)", fused_norm=True,
                            source="torchtitan April 2024: eager PyTorch with norm_type = 'fused_rmsnorm' (Triton)")
_FUSED_NORM_NOTE = "; its configuration's norm_type = 'fused_rmsnorm' (a Triton kernel: framework 'eager' with fused_norm)"


# torchtitan's "selective layer" checkpointing then: selective_ac_option = "2" by default ("2 = checkpoint every
# other layer", torchtitan/config_manager.py at 20f10b5f1; parallelize_llama.py wraps every 2nd block in a whole
# checkpoint): half the blocks recomputed in full, Config(recompute="full", recompute_layers=layers // 2)
_LAYER_AC_NOTE = ("; 'selective layer' AC: torchtitan's default selective_ac_option '2' then, every other block "
                  "checkpointed whole (recompute='full' on half the layers)")


def _titan_a100(model: str, lbs: int, recompute: str, wps: float, label: str, every_other: bool = False) -> Published:
    fused_norm = model in ("llama3-8b", "llama-13b")
    layers = SHAPES[model].layers // 2 if every_other else 0
    return Published(name=f"torchtitan {SHAPES[model].name} {label}, 64 A100", source=TITAN_A100,
                     metric="tokens_per_gpu", value=wps, cluster="dgx-a100", nodes=8, model=SHAPES[model],
                     global_batch=64 * lbs,
                     config=Config(dp=64, zero=3, precision="bf16", recompute=recompute, recompute_layers=layers),
                     note=_TITAN_NOTE + (_FUSED_NORM_NOTE if fused_norm else "") + (_LAYER_AC_NOTE if layers else ""),
                     framework=_TITAN_FUSED_NORM if fused_norm else "eager", network_gbps=TITAN_A100_GBPS)


# fms-fsdp (IBM's Foundation Model Stack on FSDP): eager PyTorch (RMSNorm, rotary through complex numbers, SDPA
# flash attention), FSDP with MixedPrecision bf16 parameters and bf16 gradient reduction (fms_fsdp/policies/
# mixed_precision.py: bfSixteen), full activation checkpointing of every block for 34B and 70B (the table's "Yes";
# scripts/34b.sh, 70b.sh: fsdp_activation_checkpointing=True, selective_checkpointing=1, sharding_strategy=fsdp);
# 7B without checkpointing, sharded inside each node and replicated across them (scripts/7b.sh:
# sharding_strategy=hsdp: Config(shard_group=8)). The 13B row checkpoints a share of the blocks, half of them by
# its HFU over MFU (below): Config(recompute="full", recompute_layers=20).
_FMS = replace(EAGER, name="eager (fms-fsdp)", grad_reduce_bytes=2, fsdp="fsdp1",
               source="fms-fsdp: eager PyTorch, FSDP1 (FullyShardedDataParallel, flat parameters) with "
                      "MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)")
_LLAMA2_34B = ModelShape(layers=48, hidden=8192, heads=64, kv_heads=8, ffn=22016, vocab=32000, seq=4096, gated=True,
                         tied=False, bias=False, positions="rope", norm="rmsnorm", name="llama2-34b (fms-fsdp)",
                         source="fms-fsdp get_model_config('llama2_34b'): emb 8192, 64 heads, 8 kv heads, 48 "
                                "layers, hidden 22016; Llama 2's vocabulary of 32,000")
# fms-fsdp with torch.compile (its README from 2024-05-09): torch.compile(model) over the FSDP-wrapped model, the loss
# computed outside it (main_training.py, fms_fsdp/utils/train_utils.py), and a rotary embedding without complex numbers
# (IBM and Meta's blog 'Maximizing Training Throughput Using PyTorch FSDP and Torch.compile': "We implemented RoPE
# using einops"). Its 34B and 70B A100 rows checkpoint every block (below); its 13B rows and the H100 34B and 70B a
# share of the blocks that is not published: left out
_FMS_COMPILED = replace(_FMS, name="compiled (fms-fsdp)", compiled=True, complex_rotary=False,
                        host_ops_per_kernel=COMPILED.host_ops_per_kernel,
                        source="fms-fsdp with torch.compile: eager's layer under Inductor, a real-valued rotary, "
                               "FSDP1 with MixedPrecision(param_dtype=bf16, reduce_dtype=bf16)")
_FMS_COMPILE_NOTE = ("torch.compile over the model, its rotary real-valued (framework 'compiled (fms-fsdp)': "
                     "elementwise operators fused, FSDP1's flat parameters, bf16 gradient reduction, the loss "
                     "uncompiled); the network is the README's figure, taken as per node")
_IBM_NOTE = ("FSDP1's flat parameters, bf16 gradient reduction (framework 'eager (fms-fsdp)'); the network is the "
             "blog's figure, taken as per node")
_FMS_README_NOTE = ("FSDP1's flat parameters, bf16 gradient reduction (framework 'eager (fms-fsdp)'); the README "
                    "gives no network: the blog's 400 Gb/s per node for its 128 A100 assumed")


# fms-fsdp's compiled 34b and 70b rows say "Selective AC": a share p of the blocks checkpointed
# (fms_fsdp/policies/ac_handler.py), p = 1 by default (fms_fsdp/config/training.py at ed74fd5). The same README's
# HFU over MFU counts the recomputed forward: (3 + p) / 3. On A100 0.74 / 0.55 = 1.35 for both, p = 0.97-1.10 within
# the figures' rounding: every block, as full checkpointing (Config(recompute="full")). On H100 0.49 / 0.38 and
# 0.47 / 0.38 give p = 0.78-0.96 and 0.62-0.80, a share not published: those two rows are left out, as is 13b
# (p 0.34-0.45 on A100, 0.14-0.28 on H100)
_FMS_EVERY_BLOCK_NOTE = ("; 'Selective AC' as every block: fms-fsdp's selective_checkpointing defaults to 1, and the "
                         "README's HFU / MFU on A100, 0.74 / 0.55, is full recomputation's (3 + 1) / 3 within its "
                         "rounding")


# The blog's 13b row, "Selective AC": its HFU over MFU, 0.59 / 0.51 on A100 and 0.40 / 0.35 on H100 (the fms-fsdp
# README of 2024-03-13, 5e522b4, gives both), is (3 + p) / 3 with p = 0.41-0.53 and 0.34-0.52 within the rounding:
# half the blocks (fms-fsdp's ac_handler with p = 1/2 checkpoints every other block), as the same ratio gives
# p = 0.99-1.18 for the 34b and 70b rows whose checkpointing is full. Priced once, after the inference
_FMS_HALF_NOTE = ("; 'Selective AC' as every other block: the README's HFU / MFU (0.59 / 0.51 on A100, 0.40 / 0.35 "
                  "on H100) is (3 + p) / 3 with p = 1/2 within its rounding (fms-fsdp's ac_handler checkpoints every "
                  "other block at p = 1/2; recompute='full' on half the layers)")


def _ibm(model: ModelShape, label: str, gpus: int, gpu: str, tokens: float, hsdp: bool = False, batch: int = 2,
         source: str = IBM, half: bool = False) -> Published:
    """A row of IBM and Meta's fms-fsdp tables: ``hsdp`` sharded inside each node without
    checkpointing, else ZeRO-3 over every GPU with every block checkpointed (``half``: every other
    block)."""
    cluster, gbps = ("dgx-a100", 400) if gpu == "A100" else ("dgx-h100", 800)
    where = ": fms-fsdp's 7B script" if source == IBM else ", as the README lists"
    ac = "selective AC (every other block)" if half else "full AC"
    layout = (f"HSDP (sharded inside each node, replicated across{where}), no activation checkpointing" if hsdp
              else "FSDP over every GPU (ZeRO-3), " + ("activation checkpointing of every other block" if half
                                                        else "full activation checkpointing"))
    note = {IBM: _IBM_NOTE, FMS_COMPILE: _FMS_COMPILE_NOTE}.get(source, _FMS_README_NOTE)
    compiled = source == FMS_COMPILE
    if compiled and not hsdp:
        note += _FMS_EVERY_BLOCK_NOTE
    if half:
        note += _FMS_HALF_NOTE
    return Published(name=f"fms-fsdp {label}, {gpus} {gpu}, batch {batch}, {'HSDP' if hsdp else ac}"
                          + (", torch.compile" if compiled else ""),
                     source=source, metric="tokens_per_gpu", value=tokens, cluster=cluster, nodes=gpus // 8,
                     model=model, global_batch=batch * gpus,
                     config=Config(dp=gpus, zero=3, precision="bf16", recompute="none" if hsdp else "full",
                                   shard_group=8 if hsdp else 0, recompute_layers=model.layers // 2 if half else 0),
                     framework=_FMS_COMPILED if compiled else _FMS, network_gbps=gbps, note=f"{layout}, {note}")


_GPT_530B = _gpt("gpt-530b", 105, 20480, 128, 51200, 2048)
_KORTHIKANTI_NOTE = ("t 8, p 35, d 8 on 280 DGX A100 and a global batch of 1920 (MT-NLG's layout, Smith et al. "
                     "2022) assumed: the abstract gives the GPU count; 1F1B, micro-batch 1")

KORTHIKANTI_T5 = ("Korthikanti et al. 2022, 'Reducing Activation Recomputation in Large Transformer Models', Tables 3 "
                  "and 5 (iteration time, A100 80 GB): https://arxiv.org/abs/2205.05198")


def _korthikanti(name: str, layers: int, hidden: int, heads: int, pp: int, batch: int, recompute: str,
                 seconds: float) -> Published:
    sp = recompute == "selective"
    return Published(
        name=f"Korthikanti GPT {name}, {8 * pp} A100, {'SP + selective' if sp else 'full recomputation'}",
        source=KORTHIKANTI_T5, metric="step_s", value=seconds, cluster="dgx-a100", nodes=pp,
        model=_gpt(f"gpt-{name.lower()}", layers, hidden, heads, 51200, 2048), global_batch=batch,
        config=Config(dp=1, tp=8, pp=pp, schedule="1f1b", microbatches=batch, sequence_parallel=sp,
                      precision="bf16", recompute=recompute),
        note="t 8, micro-batch 1 and one replica as published (Table 3); 1F1B assumed; Megatron-LM of 2022 "
             "(the dgx-a100 preset's framework 'megatron-2022': math attention)")


ROWS: tuple[Published, ...] = (
    # -- Megatron-LM README, H100 weak scaling: model, heads, hidden, layers, t, p, GPUs, batch, TFLOP/s per GPU
    _megatron("1.7B", 16, 2048, 24, 1, 1, 48, 192, 408.8),
    _megatron("7.1B", 32, 4096, 30, 2, 1, 96, 192, 465.9),
    _megatron("16B", 48, 6144, 32, 4, 1, 192, 192, 489.1),
    _megatron("32B", 56, 7168, 48, 8, 1, 384, 192, 459.6),
    _megatron("70B", 64, 8192, 84, 8, 2, 768, 384, 419.7),
    _megatron("119B", 80, 10240, 92, 8, 4, 1536, 768, 420.5),
    _megatron("177B", 96, 12288, 96, 8, 6, 2304, 1152, 432.8),
    _megatron("314B", 128, 16384, 96, 8, 8, 3072, 1536, 474.4),
    _megatron("462B", 144, 18432, 112, 8, 16, 6144, 3072, 459.9),
    # -- torchtitan on 64 A100 80 GB (FSDP2): WPS per GPU
    _titan_a100("llama3-8b", 1, "full", 2904, "local batch 1, selective layer AC", every_other=True),
    _titan_a100("llama3-8b", 1, "selective", 2973, "local batch 1, selective op AC"),
    _titan_a100("llama3-70b", 1, "full", 331, "local batch 1, full AC"),
    _titan_a100("llama-13b", 2, "none", 2162, "local batch 2, no AC"),
    _titan_a100("llama-13b", 2, "full", 1914, "local batch 2, selective layer AC", every_other=True),
    _titan_a100("llama-13b", 2, "selective", 1904, "local batch 2, selective op AC"),
    _titan_a100("llama-70b", 1, "selective", 355, "local batch 1, selective op AC"),
    _titan_a100("llama-70b", 2, "full", 353, "local batch 2, full AC"),
    Published("torchtitan llama-70b local batch 2, selective op AC, 64 A100 (out of memory)", TITAN_A100, "fits", 0,
              "dgx-a100", 8, SHAPES["llama-70b"], 128, Config(dp=64, zero=3, precision="bf16", recompute="selective"),
              note=_TITAN_NOTE + "; the table's footnote: local batch 2 with selective checkpointing ran out of memory",
              framework="eager", network_gbps=TITAN_A100_GBPS),
    Published("torchtitan llama-70b local batch 2, selective layer AC, 64 A100 (out of memory)", TITAN_A100, "fits",
              0, "dgx-a100", 8, SHAPES["llama-70b"], 128,
              Config(dp=64, zero=3, precision="bf16", recompute="full",
                     recompute_layers=SHAPES["llama-70b"].layers // 2),
              note=_TITAN_NOTE + "; the table's footnote: local batch 2 with selective checkpointing ran out of memory "
                                 "(the table's first version lists this row as OOM)" + _LAYER_AC_NOTE,
              framework="eager", network_gbps=TITAN_A100_GBPS),
    # -- torchtitan on H100 (Grand Teton): TPS per GPU and peak memory, FSDP without compile or Float8
    Published("torchtitan Llama 3.1 8B, 8 H100, local batch 2", TITAN_H100.format(1), "tokens_per_gpu", 5762,
              "dgx-h100", 1, SHAPES["llama3-8b"], 16, Config(dp=8, zero=3, precision="bf16", recompute="selective"),
              note=_H100_NOTE, framework="eager", device="h100-sxm-96gb-500w"),
    Published("torchtitan Llama 3.1 8B, 8 H100, local batch 2", TITAN_H100.format(1), "memory_gib", 82.4,
              "dgx-h100", 1, SHAPES["llama3-8b"], 16, Config(dp=8, zero=3, precision="bf16", recompute="selective"),
              note=_H100_NOTE, framework="eager", device="h100-sxm-96gb-500w"),
    Published("torchtitan Llama 3.1 8B, 128 H100, local batch 2", TITAN_H100.format(3), "tokens_per_gpu", 5605,
              "dgx-h100", 16, SHAPES["llama3-8b"], 256,
              Config(dp=128, zero=3, precision="bf16", recompute="selective"), note=_H100_NOTE, framework="eager",
              device="h100-sxm-96gb-500w"),
    Published("torchtitan Llama 3.1 8B, 128 H100, local batch 2", TITAN_H100.format(3), "memory_gib", 67.0,
              "dgx-h100", 16, SHAPES["llama3-8b"], 256,
              Config(dp=128, zero=3, precision="bf16", recompute="selective"), note=_H100_NOTE, framework="eager",
              device="h100-sxm-96gb-500w"),
    # -- the same tables' "FSDP + torch.compile" rows (framework 'compiled')
    Published("torchtitan Llama 3.1 8B, 8 H100, local batch 2, torch.compile", TITAN_H100.format(1), "tokens_per_gpu",
              6667, "dgx-h100", 1, SHAPES["llama3-8b"], 16,
              Config(dp=8, zero=3, precision="bf16", recompute="selective"), note=_H100_COMPILE_NOTE,
              framework="compiled", device="h100-sxm-96gb-500w"),
    Published("torchtitan Llama 3.1 8B, 8 H100, local batch 2, torch.compile", TITAN_H100.format(1), "memory_gib", 77.0,
              "dgx-h100", 1, SHAPES["llama3-8b"], 16, Config(dp=8, zero=3, precision="bf16", recompute="selective"),
              note=_H100_COMPILE_NOTE, framework="compiled", device="h100-sxm-96gb-500w"),
    Published("torchtitan Llama 3.1 8B, 128 H100, local batch 2, torch.compile", TITAN_H100.format(3),
              "tokens_per_gpu", 6514, "dgx-h100", 16, SHAPES["llama3-8b"], 256,
              Config(dp=128, zero=3, precision="bf16", recompute="selective"), note=_H100_COMPILE_NOTE,
              framework="compiled", device="h100-sxm-96gb-500w"),
    Published("torchtitan Llama 3.1 8B, 128 H100, local batch 2, torch.compile", TITAN_H100.format(3), "memory_gib",
              62.0, "dgx-h100", 16, SHAPES["llama3-8b"], 256,
              Config(dp=128, zero=3, precision="bf16", recompute="selective"), note=_H100_COMPILE_NOTE,
              framework="compiled", device="h100-sxm-96gb-500w"),
    # -- IBM and Meta's FSDP blog, Table 1: tokens/s per GPU, FSDP with full activation checkpointing
    _ibm(SHAPES["llama-7b"], "Llama 2 7B", 128, "A100", 3700, hsdp=True),
    _ibm(_LLAMA2_34B, "Llama 2 34B", 128, "A100", 700),
    _ibm(SHAPES["llama-70b"], "Llama 2 70B", 128, "A100", 370),
    _ibm(SHAPES["llama-7b"], "Llama 2 7B", 96, "H100", 7500, hsdp=True),
    _ibm(_LLAMA2_34B, "Llama 2 34B", 96, "H100", 1550),
    _ibm(SHAPES["llama-70b"], "Llama 2 70B", 96, "H100", 800),
    # -- the same table's 13b, every other block checkpointed (inferred from its HFU over MFU, above)
    _ibm(SHAPES["llama-13b"], "Llama 2 13B", 128, "A100", 1800, half=True),
    _ibm(SHAPES["llama-13b"], "Llama 2 13B", 96, "H100", 3800, half=True),
    # -- fms-fsdp's README: tokens/s per GPU on 128 A100 in the layouts it lists (its 7b row is the blog's run)
    _ibm(SHAPES["llama-13b"], "Llama 2 13B", 128, "A100", 1700, hsdp=True, batch=1, source=FMS_README),
    _ibm(_LLAMA2_34B, "Llama 2 34B", 128, "A100", 772, batch=8, source=FMS_README),
    _ibm(SHAPES["llama-70b"], "Llama 2 70B", 128, "A100", 380, batch=6, source=FMS_README),
    # -- fms-fsdp's README with torch.compile: its 7b row on both clusters (the blog's layout)
    _ibm(SHAPES["llama-7b"], "Llama 2 7B", 128, "A100", 4550, hsdp=True, source=FMS_COMPILE),
    _ibm(SHAPES["llama-7b"], "Llama 2 7B", 96, "H100", 9600, hsdp=True, source=FMS_COMPILE),
    _ibm(_LLAMA2_34B, "Llama 2 34B", 128, "A100", 820, source=FMS_COMPILE),
    _ibm(SHAPES["llama-70b"], "Llama 2 70B", 128, "A100", 410, source=FMS_COMPILE),
    # -- Korthikanti et al. 2022: 530B on 2240 A100, MFU with sequence parallelism + selective recomputation,
    #    and with full recomputation
    Published("Korthikanti 530B, 2240 A100, SP + selective", KORTHIKANTI, "mfu", 54.2, "dgx-a100", 280,
              _GPT_530B, 1920, Config(dp=8, tp=8, pp=35, zero=0, schedule="1f1b", microbatches=240,
                                      sequence_parallel=True, precision="bf16", recompute="selective"),
              note=_KORTHIKANTI_NOTE),
    Published("Korthikanti 530B, 2240 A100, full recomputation", KORTHIKANTI, "mfu", 42.1, "dgx-a100", 280,
              _GPT_530B, 1920, Config(dp=8, tp=8, pp=35, zero=0, schedule="1f1b", microbatches=240,
                                      precision="bf16", recompute="full"),
              note=_KORTHIKANTI_NOTE),
    # -- Korthikanti et al. 2022, Tables 3 and 5: iteration time of GPT 22B-1T on DGX A100 80 GB, tensor parallel
    #    8, micro-batch 1, one data-parallel replica; full recomputation, and sequence parallelism + selective
    *(_korthikanti(name, L, h, a, pp, batch, recompute, seconds)
      for name, L, h, a, pp, batch, full_s, sel_s in (("22B", 48, 6144, 64, 1, 4, 1.42, 1.10),
                                                      ("175B", 96, 12288, 96, 8, 64, 18.13, 13.75),
                                                      ("530B", 105, 20480, 128, 35, 280, 49.05, 37.83),
                                                      ("1T", 128, 25600, 160, 64, 512, 94.42, 71.49))
      for recompute, seconds in (("full", full_s), ("selective", sel_s))),
    # -- nccl-tests bus bandwidths (the NCCL model, workbench.advise.nccl)
    Published("all_reduce 4 GiB, 8 H100 (NVLS)", NCCL_212, "busbw_GBps", 480, "dgx-h100", collective="all_reduce",
              nbytes=4 * GiB, ranks=8, per_node=8, role="calibrated", note="'peak busBw of ~480GB/s'"),
    Published("all_reduce 256 MiB, 8 H100 (NVLS)", NCCL_212, "busbw_GBps", 250 * 7 / 4, "dgx-h100",
              collective="all_reduce", nbytes=256 * 2**20, ranks=8, per_node=8,
              note="algbw 'about 250GB/s' at 256M, below the peak ('256M is too small'): busbw = 250 x 2 x 7/8"),
    Published("all_gather 4 GiB, 8 H100 (ring)", NCCL_212, "busbw_GBps", 370, "dgx-h100", collective="all_gather",
              nbytes=4 * GiB, ranks=8, per_node=8, role="calibrated",
              note="'effective NVLink bandwidth of 370GB/s ... non-allreduce operations'"),
    Published("all_reduce 4 GiB, 8 H100, one node", NCCL_290, "busbw_GBps", 476, "dgx-h100",
              collective="all_reduce", nbytes=4 * GiB, ranks=8, per_node=8,
              note="476 GB/s 'in the expected range for H100' (-b 128M -e 4G)"),
    Published("sendrecv 1 GiB, A100 NVLink", SENDRECV, "busbw_GBps", 195.1, "dgx-a100", collective="send_recv",
              nbytes=2**30, ranks=2, per_node=2, role="calibrated"),
    Published("all_reduce 128 MiB, 24 A100 on 3 nodes, 4 HDR each", NCCL_119, "busbw_GBps", 96, "dgx-a100", 3,
              collective="all_reduce", nbytes=128 * 2**20, ranks=24, per_node=8, role="calibrated",
              nccl=NcclModel("a100-4hdr", nvlink_busbw=235e9, network_Bps=4 * 24e9 / 8, p2p_Bps=195e9),
              note="peak of the sweep ('peak performance reaches about 96GB/s'); 4 NICs for 8 GPUs: 12 GB/s per GPU"),
)


def megatron_flops(shape: ModelShape, global_batch: int) -> float:
    """Model FLOPs of one step as Megatron-LM counts them (``num_floating_point_operations``):
    ``12 B s L h^2 ((1 + k/h + s/h) + (ffn/h) (1.5 if gated) + V / (2 L h))``, ``k`` the key/value
    width -- for a GPT with ``ffn = 4h``, ``72 B s L h^2 (1 + s/(6h) + V/(12 L h))``: forward and
    backward of every matmul, attention counted whole, no recomputation."""
    h, s, L = shape.hidden, shape.seq, shape.layers
    kv = getattr(shape, "kv_dim", h) / h
    mlp = shape.ffn / h * (1.5 if shape.gated else 1.0)
    return 12 * global_batch * s * L * h * h * ((1 + kv + s / h) + mlp + shape.vocab / (2 * L * h))


def _gpu(cluster: Cluster) -> str:
    return "h100" if "h100" in cluster.name else "a100"


def row_cluster(row: Published) -> Cluster:
    """The cluster a training row ran on: its preset, ``nodes`` of them, with the row's framework, GPU
    (the GPU's memory with it) and network where it names them. A network of ``g`` Gb/s per node
    gives each GPU ``g / 8 / devices_per_node`` GB/s of link, and NCCL 0.96 of it (as the presets
    on a per-node network, ``p4d-a100`` and ``a2-ultra-100g``)."""
    changes = {}
    if row.framework:
        changes["framework"] = row.framework if isinstance(row.framework, Framework) else FRAMEWORKS[row.framework]
    if row.network_gbps:
        preset = Cluster.preset(row.cluster)
        per_gpu = row.network_gbps * 1e9 / 8 / preset.devices_per_node
        changes["inter"] = Link(preset.inter.latency_s, per_gpu)
        changes["nccl"] = replace(preset.nccl, network_Bps=0.96 * per_gpu)
    if row.device:
        changes["device"] = PROFILES[row.device]
        changes["memory_bytes"] = PROFILES[row.device].memory_bytes
    return Cluster.preset(row.cluster, nodes=row.nodes, **changes)


def predicted(row: Published) -> dict:
    """The advisor's prediction of ``row``'s figure: ``{"value", "feasible", "detail"}``."""
    if row.metric == "busbw_GBps":
        model = row.nccl or NCCL_PRESETS[row.cluster]
        return {"value": model.busbw(row.collective, row.nbytes, row.ranks, row.per_node) / 1e9, "feasible": True,
                "detail": min((t, a) for a, t in model.algorithms(row.collective, row.nbytes, row.ranks,
                                                                  row.per_node).items())[1]}
    cluster = row_cluster(row)
    plan = predict(row.model, cluster, row.global_batch, row.config)
    if row.metric == "fits":
        return {"value": 1.0 if plan.feasible else 0.0, "feasible": plan.feasible, "detail": plan.reason or "fits"}
    if row.metric == "memory_gib":
        return {"value": plan.memory["total"] / GiB, "feasible": plan.feasible, "detail": plan.reason or ""}
    seconds = plan.time["total"]
    devices = row.config.devices
    if row.metric == "step_s":
        return {"value": seconds, "feasible": plan.feasible, "detail": f"step {seconds:.3g} s"}
    if row.metric == "tokens_per_gpu":
        value = row.global_batch * row.model.seq / seconds / devices
    else:
        rate = megatron_flops(row.model, row.global_batch) / seconds / devices
        value = rate / 1e12 if row.metric == "tflops_per_gpu" else 100 * rate / PEAK_BF16[_gpu(cluster)]
    return {"value": value, "feasible": plan.feasible, "detail": f"step {seconds:.3g} s"}


def validate(rows=ROWS) -> list[dict]:
    """Every row predicted: its fields, ``predicted``, ``ratio`` (predicted / published) and ``within``
    (the ratio within :data:`TOLERANCE` of 1)."""
    out = []
    for row in rows:
        p = predicted(row)
        if row.metric == "fits":
            ratio = 1.0 if p["value"] == row.value else 0.0
            within = ratio == 1.0
        else:
            ratio = p["value"] / row.value
            # a training run that ran must also be predicted to fit
            within = abs(ratio - 1) <= TOLERANCE and (row.config is None or row.metric == "memory_gib" or p["feasible"])
        out.append({"row": row, "published": row.value, "predicted": p["value"], "ratio": ratio,
                    "within": within, "feasible": p["feasible"], "detail": p["detail"]})
    return out


def summary(results: list[dict]) -> str:
    ok = sum(r["within"] for r in results)
    checked = [r for r in results if r["row"].role == "checked"]
    return (f"{ok} of {len(results)} rows within {TOLERANCE:.0%} and predicted to fit where they ran "
            f"({sum(r['within'] for r in checked)} of {len(checked)} that nothing was fitted on)")


_UNITS = {"step_s": "s/step", "tflops_per_gpu": "TFLOP/s/GPU", "mfu": "MFU %", "tokens_per_gpu": "tokens/s/GPU",
          "memory_gib": "GiB/GPU", "busbw_GBps": "busbw GB/s", "fits": "fits (1) or not (0)"}


def _figure(value: float) -> str:
    """A figure as the table prints it: four significant digits, whole numbers from 10,000 up."""
    return f"{value:.0f}" if abs(value) >= 1e4 else f"{value:.4g}"


def report(results: list[dict]) -> str:
    """The document ``docs/advisor-evidence.md`` is: how it was made, the table, the summary, the sources
    and each row's assumptions."""
    lines = ["# The advisor against public GPU measurements", "",
             "Generated by `workbench advise --validate-published > docs/advisor-evidence.md` "
             "(`workbench/advise/published.py` holds the rows and their sources). Each row is a run or an "
             "nccl-tests result published by others; *predicted* is `workbench.advise.predict` on the row's "
             "cluster preset (or the preset's NCCL model for a bus bandwidth), with the presets' own figures. "
             f"*ratio* is predicted / published; a row is within when the ratio is within {TOLERANCE:.0%} of 1 "
             "and, for a training run that ran, the plan is predicted to fit; a *fits* row (1: it fit, 0: it ran "
             "out of memory) is within where the prediction agrees. "
             "*role*: `calibrated` rows gave the model a figure (their ratio only shows it reproduces its "
             "input), `checked` rows gave nothing. A row runs on its preset with the framework it was measured "
             "with (`workbench.advise.framework`: `megatron` for the Megatron-LM README's H100 table, `eager` for "
             "torchtitan (`compiled` for its torch.compile rows), `eager` with FSDP1's flat parameters and bf16 "
             "gradient reduction for IBM's fms-fsdp (compiled, with a real-valued rotary, for its torch.compile "
             "rows), the A100 presets' `megatron-2022` for Korthikanti et al.) and, where it names them, its own "
             "GPU (torchtitan's H100 rows: `h100-sxm-96gb-500w`) and network (fms-fsdp's), as its assumptions "
             "below say.", "",
             "| # | run | layout | metric | published | predicted | ratio | within | role | source |",
             "| ---: | --- | --- | --- | ---: | ---: | ---: | --- | --- | --- |"]
    sources: dict[str, int] = {}
    for i, r in enumerate(results, 1):
        row = r["row"]
        ref = sources.setdefault(row.source, len(sources) + 1)
        layout = row.config.label() if row.config else f"{row.ranks} ranks, {row.per_node} per node"
        if row.config and not r["feasible"] and row.metric != "fits":
            layout += " (predicted not to fit)"
        lines.append(f"| {i} | {row.name} | {layout} | {_UNITS[row.metric]} | {_figure(row.value)} | "
                     f"{_figure(r['predicted'])} | {r['ratio']:.2f} | {'yes' if r['within'] else '**no**'} | {row.role} | "
                     f"[{ref}] |")
    lines += ["", f"**{summary(results)}.**", "", "## Sources", ""]
    lines += [f"{n}. {s}" for s, n in sources.items()]
    lines += ["", "## Assumptions per row", ""]
    for i, r in enumerate(results, 1):
        if r["row"].note:
            lines.append(f"- row {i} ({r['row'].name}): {r['row'].note}; {r['detail']}")
    return "\n".join(lines) + "\n"


def main() -> int:
    """Print :func:`report` (``workbench advise --validate-published``); 0 when every row is within."""
    results = validate()
    print(report(results), end="")
    return 0 if all(r["within"] for r in results) else 1
