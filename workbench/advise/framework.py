"""The training framework as the advisor prices it: which kernels run, what is saved, what overlaps.

The same GPU runs the same layer at different speeds and memory under different frameworks, and
the held-out question -- which layout is fastest -- depends on it: a framework that fuses its
elementwise operators and overlaps its tensor-parallel collectives with the matrix multiplies
favours tensor parallelism more than one that launches every operator on its own. A
:class:`Framework` on a :class:`~workbench.advise.cluster.Cluster` says which:

``attention``
    ``"flash"`` (FlashAttention-2, PyTorch's fused SDPA, TransformerEngine: no ``s^2`` tensor kept,
    the scores recomputed in backward) or ``"math"`` (Megatron-LM's fused scale-mask-softmax over
    materialised scores, as in its 2021-2022 A100 runs). The one choice both the compute model
    (:mod:`workbench.advise.device`) and the memory model (:mod:`workbench.advise.runtime_memory`)
    read: a cluster built with a framework passes its kernel to both (:class:`Cluster` aligns them).
``fused``
    Megatron-style fused elementwise kernels (a norm, bias-GeLU or SwiGLU, bias-dropout-add,
    rotary: one kernel each, one read and one write of the tensor) or eager PyTorch's separate
    kernels with their real passes (:func:`workbench.advise.device.layer_operators`: an RMSNorm in
    float32 is seven kernels and about 36 bytes per element, not 4; the rotary embedding three per
    tensor through complex float32; SwiGLU two; GQA's ``repeat_kv`` copies; the attention output
    made contiguous).
``fused_norm``
    the norm one fused kernel in a framework whose other elementwise operators are eager:
    torchtitan's ``norm_type = "fused_rmsnorm"`` (a Triton RMSNorm: forward one kernel reading the
    input and writing the output and the per-row statistic; backward one, the weight's gradient
    reduced after), which its Llama 2 13B and Llama 3 8B configurations of April 2024 set
    (``train_configs/llama2_13b.toml``, ``llama3_8b.toml``), and its 70B ones did not.
``compiled``
    ``torch.compile`` (TorchInductor) over each transformer block, on eager PyTorch's operators
    (``fused`` False): the matrix multiplies stay cuBLAS calls and the attention its SDPA kernel
    (Inductor calls them as extern kernels), and the elementwise operators around them -- the
    norms, the SwiGLU, the residual adds, the copies -- become generated kernels that read each
    input once and write each output once, at the copy's bandwidth, as a fused kernel does
    (:func:`workbench.advise.device.layer_operators`); a compiled block's wrapper calls each kernel
    once, with no views or autograd node per operator around it (``host_ops_per_kernel`` 1). The
    model's edges (embedding, final norm, output, loss) stay eager: torchtitan compiles each
    ``TransformerBlock`` (``apply_compile``) and leaves its loss uncompiled (``train.py``, December
    2024: ``torch.compile(loss_fn)`` commented out), and fms-fsdp computes its loss outside the
    compiled model (it compiles the rest whole: its final norm, priced eager here, is one norm of
    the model's). Activation memory under per-operator checkpointing keeps what the partitioner
    keeps: only what the backward graph reads, so not ``w2``'s output, which eager's checkpoint
    caches (:func:`workbench.advise.runtime_memory.op_checkpoint_bytes`); without checkpointing
    what a fused layer keeps but the SiLU's output, which the fused SwiGLU recomputes from the gate
    (eager keeps more: :func:`workbench.advise.runtime_memory.eager_layer_extra_bytes`).
``complex_rotary``
    the model's rotary embedding multiplies complex numbers (Meta's Llama and torchtitan's
    ``apply_rotary_emb``: ``torch.view_as_complex``, the default). Under ``compiled`` it stays
    eager's kernels: Inductor generates no code for complex operators and falls back to ATen's
    (``torch/_inductor/lowering.py``: "Torchinductor does not support code generation for complex
    operators. Performance may be worse than eager."). False: a real-valued rotary, which
    compiles into one kernel per tensor (fms's ``RotaryEmbedding``, which "avoids complex numbers,
    and so can be used with torch.compile"; IBM and Meta's PyTorch blog 'Maximizing Training
    Throughput Using PyTorch FSDP and Torch.compile', 2024: "We implemented RoPE using einops").
``tp_comm_overlap``
    tensor-parallel all-gathers and reduce-scatters overlapped with the matrix multiplies that
    consume or produce them (Megatron-Core's ``--tp-comm-overlap``, TransformerEngine's userbuffers,
    in its published H100 runs) rather than waited for.
``tp_async``
    the linear layers' tensor-parallel collectives issued asynchronously beside the multiplies that
    do not need their result (nanotron's ``tp_linear_async_communication``, set in its example and
    benchmark configurations; ``src/nanotron/parallel/tensor_parallel/functional.py``, adapted from
    Megatron-LM's ``LinearWithGradAccumulationAndAsyncCommunication``). With sequence parallelism a
    column-parallel layer's forward all-gather runs beside the multiply of the rank's own rows, its
    backward re-gather beside the input-gradient multiply and its input gradient's reduce-scatter
    beside the weight-gradient multiply; a row-parallel layer's backward all-gather beside its own
    rows' input-gradient multiply; the row-parallel forward reduce-scatter is waited for. Without
    it, the column-parallel backward all-reduce runs beside the weight-gradient multiply.
    :func:`workbench.advise.timing.async_tp_hidden` prices it.
``selective``
    what ``Config(recompute="selective")`` means: ``"attention"``, the attention core recomputed
    (Korthikanti et al. 2022, Megatron's ``--recompute-granularity selective``), or ``"op"``,
    torchtitan's per-operator selective checkpointing (``activation_checkpoint.mode = "selective"``,
    ``selective_ac_option = "op"``: the outputs of the matrix multiplies are saved except every
    second one, the attention kernel's output is saved, every other operator recomputed).
``optimizer``
    ``"fused"`` (Megatron's/Apex's fused Adam, one pass: 34 bytes per parameter in mixed precision)
    or ``"foreach"`` (``torch.optim.AdamW``'s default multi-tensor path: one pass per operation,
    about 92 bytes per parameter with gradient clipping; :data:`OPTIMIZER_BYTES`).
``loss_float32_copies``
    float32 logits-sized tensors at the loss's busiest moment (Megatron's in-place
    vocabulary-parallel loss: 1; ``cross_entropy(logits.float())``: 3).
``grad_reduce_bytes``
    bytes of a gradient element data parallelism reduces: 4 (float32) by default -- Megatron-LM
    sets ``accumulate_allreduce_grads_in_fp32`` whenever it trains in bf16 unless
    ``--grad-reduce-in-bf16`` (``megatron/training/arguments.py``), torchtitan's FSDP2 reduces in
    ``MixedPrecisionPolicy(reduce_dtype=torch.float32)`` (its ``mixed_precision_reduce`` default)
    -- so reduce-scatters and all-reduces move twice a 16-bit gradient's bytes while parameter
    all-gathers move 16 bits. 0 (the compute precision) for ``megatron``: its README's 32B row (TP
    8, 48 replicas, one per node) reached 460 TFLOP/s per GPU, a step of about 0.89 s, which float32
    gradients cannot (16 GB of them reduce-scattered over one 400 Gb/s rail per GPU take 0.33 s
    beside 0.11 s of the last micro-batch's backward), so those benchmarks reduced in bf16: an
    inference, said here and in the evidence.
``overlap_grad_reduce``
    the gradient reduction and the ZeRO-1/2 parameter gather overlapped with backward and the next
    forward (DDP's buckets, FSDP, Megatron-Core's ``--overlap-grad-reduce`` and
    ``--overlap-param-gather``); off for ``megatron-2022``, whose ``LocalDDP`` all-reduced the
    gradient buffer once the pipeline had flushed.
``dp_bucket_params``
    gradient buckets in parameters: Megatron's ``max(40 M, 1 M x d)``; 0, the strategy's own
    (DDP's 25 MB).
``nccl_channels``, ``sm_share``
    the share of the streaming multiprocessors a communication kernel running beside compute takes
    from it: NCCL runs one CTA per channel, 16-32 channels on NVLink (``NCCL_MIN_NCHANNELS`` /
    ``NCCL_MAX_NCHANNELS``), so an overlapped collective slows the compute it hides behind by about
    ``channels / SMs`` of the device it runs on (:meth:`Framework.sm_share_on`): 16 of 132 on an
    H100 SXM, 0.12; 16 of 108 on an A100, 0.15. ``sm_share`` set (not 0) overrides it.

``elementwise_efficiency``
    the bandwidth a layer's elementwise operators achieve, over the device's ``memory_bandwidth``
    (a large copy's): the bytes :func:`workbench.advise.device.layer_operators` counts move at this
    share of it. Eager: 0.8, measured on torchtitan-style Llama layers kernel by kernel
    (``docs/benchmarks/2026-11-28-h200-layers.md``): below the copy's rate, as PyTorch's
    TensorIterator kernels run broadcasts (the RMSNorm's ``rsqrt`` column, the
    ``* weight`` row), strided copies (``repeat_kv``, ``.contiguous()``, ``.float()`` of a view) and
    complex multiplies (the rotary) without vectorized loads. Fused frameworks: 1, an assumption (a
    fused kernel reads and writes each tensor once, contiguously, as the copy does).
``host_ops_per_kernel``
    operators the host dispatches for each kernel the device model counts
    (:func:`workbench.advise.device.layer_operators`), each at the device profile's
    ``kernel_overhead_s``: an eager layer's kernels come with views, transposes, casts' bookkeeping
    and autograd's gradient accumulation, which cost the host a dispatch but the GPU nothing. Eager:
    2.25, counted (``torch.utils._python_dispatch.TorchDispatchMode``, on a CPU) over Hugging Face's
    ``LlamaDecoderLayer`` in bf16 with SDPA, forward and backward with gradients accumulating: 223
    ATen operators for the 99 kernels the model counts for that layer under eager accounting
    (``tests/test_advise_framework.py`` recounts it). Eager PyTorch launching fused kernels
    (``eager-fused``): 2.8, counted the same way (fewer kernels, the same views and transposes
    around each multiply). Megatron's TransformerEngine modules: 1, an assumption (they launch their
    kernels from C++, past the dispatcher).

``pipeline``
    whose pipeline schedules run it, which decides the fewest micro-batches a schedule takes:
    ``"megatron"`` (Megatron-LM's ``forward_backward_pipelining_without_interleaving``: each rank
    runs ``min(p - r - 1, m)`` warm-up forwards, so 1F1B takes any ``m >= 1`` and with ``m < p`` is
    a fill and a drain, GPipe's time with at most ``m`` micro-batches in flight; picotron's
    ``train_step_pipeline_1f1b`` the same), ``"nanotron"`` (its
    ``OneForwardOneBackwardPipelineEngine`` asserts ``m >= p - 1``: each rank runs ``p - r - 1``
    warm-up forwards, so ``m = p - 1`` is a fill and a drain; its ``afab`` engine, GPipe, takes any
    ``m``) or ``"torch"`` (``torch.distributed.pipelining``, which torchtitan runs:
    ``Schedule1F1B`` raises for fewer micro-batches than stages, as the workbench's own pipeline
    does). A cluster without a framework (this machine's) takes the workbench's rules.

``schedules``
    the pipeline schedules the framework implements, which the search tries and ``predict`` prices
    on its cluster (another is refused with a reason): torch's ``torch.distributed.pipelining``
    has all five (``ScheduleGPipe``, ``Schedule1F1B``, ``ScheduleInterleaved1F1B``,
    ``ScheduleInterleavedZeroBubble``, ``ScheduleZBVZeroBubble``), as does the workbench's own
    pipeline; Megatron-LM's ``get_forward_backward_func`` chooses between 1F1B
    (``forward_backward_pipelining_without_interleaving``) and interleaved 1F1B (``..._with_interleaving``,
    a virtual pipeline size) and nothing else; nanotron's engines
    (``src/nanotron/parallel/pipeline_parallel/engine.py``) and picotron's schedules
    (``train_step_pipeline_afab``, ``train_step_pipeline_1f1b``) are ``afab`` (all forward, all
    backward: GPipe) and ``1f1b``. So ``eager-fused`` runs gpipe and
    1f1b, as nanotron and picotron do (Megatron-LM with local layers also runs interleaved 1F1B:
    price it under ``megatron``, or ``replace(EAGER_FUSED, schedules=...)``), ``megatron`` and
    ``megatron-2022`` 1f1b and interleaved, ``eager`` and ``compiled`` (torchtitan) every schedule.

``zero_stages``
    the ZeRO stages its data parallelism offers, which the search tries by default (``predict``
    prices any stage: the data-parallel wrapper is the one part of a stack users swap, and the
    plan's facts say when the framework does not offer it): Megatron-LM's distributed optimizer
    (``--use-distributed-optimizer``) and nanotron's ``ZeroDistributedOptimizer``
    (``optimizer.zero_stage > 0``, ``src/nanotron/helpers.py``) shard the optimizer state, ZeRO-1,
    beside plain data parallelism; torch's FSDP (torchtitan's ``fully_shard``, fms-fsdp's
    ``FullyShardedDataParallel``) shards everything (ZeRO-3), or keeps the gathered parameters
    through backward (``reshard_after_forward=False``, ``SHARD_GRAD_OP``: ZeRO-2), beside DDP. So
    ``eager-fused``, ``megatron`` and ``megatron-2022`` offer 0 and 1, ``eager`` and ``compiled``
    0, 2 and 3.

``fsdp``
    which FSDP shards the model under ZeRO-3: ``"fsdp2"`` (``fully_shard``, per-parameter
    DTensors: each gather copies its output into the parameters and each reduce-scatter copies the
    gradients into one input, torchtitan) or ``"fsdp1"`` (``FullyShardedDataParallel``, a flat
    parameter per unit: the gather lands in the buffer the parameters view, the gradients arrive
    concatenated and are divided in place, fms-fsdp); the copies' bytes are
    :func:`workbench.advise.device.fsdp_copy_seconds`'s.

The per-operator and per-micro-batch host costs are the device profile's (a calibration measures
them); how many operators a layer dispatches is the framework's.

Presets (:data:`FRAMEWORKS`):

``"eager-fused"``
    eager PyTorch launching Megatron-style fused kernels: what the issue that built this model asks
    of a framework-dependent figure by default, and the ``dgx-h100`` preset's framework. Every
    operator is dispatched from Python one at a time (no CUDA graphs, no ``torch.compile``, no
    TransformerEngine launching from C++), each kernel with the views, transposes and gradient
    accumulations around it: 2.8 dispatched operators per counted kernel, counted (with
    ``torch.utils._python_dispatch.TorchDispatchMode``, on a CPU) over a Llama layer so written
    -- a fused RMSNorm, one QKV and one gate-up projection, a fused rotary embedding and SwiGLU,
    SDPA flash attention, a residual add -- forward and backward with gradients accumulating: 96
    operators for the 34 kernels the device model counts for it (``tests/test_advise_framework.py``
    recounts it). The kernels and the bookkeeping are Megatron's: flash attention, the fused
    elementwise kernels, selective recomputation of the attention core (Korthikanti et al. 2022),
    the in-place vocabulary-parallel float32 loss, fused Adam, float32 main gradients reduced in
    float32, Megatron's buckets; no tensor-parallel communication overlap (that is
    TransformerEngine's). Frameworks built this way: nanotron (``TritonRMSNorm``, ``qkv_proj`` and
    ``gate_up_proj``, flash-attn's attention and rotary kernels, in ``src/nanotron/models/llama.py``),
    Megatron-LM with its local (not TransformerEngine) layers, picotron with flash-attn. What it runs
    is nanotron's: GPipe (``afab``) and 1F1B from ``p - 1`` micro-batches, data parallelism with
    ZeRO-0 or ZeRO-1 (``pipeline``, ``schedules``, ``zero_stages``).
``"eager"``
    PyTorch without ``torch.compile`` as torchtitan and Hugging Face's models write a layer: flash
    attention through SDPA, separate elementwise kernels (RMSNorm in float32, rotary through complex
    numbers, SwiGLU, GQA's ``repeat_kv``), separate q, k, v and gate, up projections, per-operator
    selective checkpointing, foreach AdamW, torchtitan's ``cross_entropy(logits.float())``.
``"compiled"``
    ``"eager"`` under ``torch.compile`` as torchtitan compiles it (each block, ``fullgraph=True``;
    the rotary through complex numbers left to ATen's kernels; the loss uncompiled).
``"megatron"``
    Megatron-Core with TransformerEngine, as in the Megatron-LM README's H100 table: flash
    attention, fused kernels, TP communication overlap, fused Adam.
``"megatron-2022"``
    Megatron-LM as in Korthikanti et al. 2022 and Narayanan et al. 2021 on A100: fused kernels,
    math attention, no TP overlap.

The ``dgx-h100`` preset defaults to ``eager-fused``; the A100 presets to ``megatron-2022``, the
framework of the published A100 runs at scale. Change it with
``cluster.with_(framework=FRAMEWORKS["eager"])`` (or ``workbench advise --framework eager``).
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.parallel.pipeline_schedules import min_microbatches

__all__ = ["Framework", "FRAMEWORKS", "EAGER", "EAGER_FUSED", "COMPILED", "MEGATRON", "MEGATRON_2022", "OPTIMIZER_BYTES"]

# bytes Adam moves per parameter it updates, mixed precision (bf16/fp16 compute, float32 state):
# fused: master weights, float32 gradient and two moments read (16), master and moments written (12),
# the 16-bit copy written (2), the gradient zeroed (4): 34. foreach (torch.optim.AdamW, foreach=True,
# float32 parameters as FSDP2 keeps them): weight decay mul_ (r4 w4), lerp_ of the first moment (r8 w4),
# mul_ and addcmul_ of the second (r4 w4, r8 w4), sqrt, div_ and add_ of the denominator (3 x r4 w4),
# addcdiv_ of the parameter (r12 w4): 80; clip_grad_norm_'s norm (r4) and scaling mul_ (r4 w4): 12
# whose pipeline schedules a framework runs (``Framework.pipeline``)
PIPELINES = ("megatron", "nanotron", "torch")
# the pipeline schedules the advisor prices (workbench.advise.plan.SCHEDULES), of which a framework runs some
ALL_SCHEDULES = ("gpipe", "1f1b", "interleaved", "zb-h1", "zbv")
OPTIMIZER_BYTES = {"fused": {"fp32": 32, "bf16": 34, "fp16": 34}, "foreach": {"fp32": 92, "bf16": 92, "fp16": 92}}


def interleaved_rounds(m: int, p: int) -> str:
    """Why ``m`` micro-batches cannot run interleaved over ``p`` pipeline ranks under torch's
    ``ScheduleInterleaved1F1B`` and the workbench's pipeline ("" if they can): they run rounds of
    ``max(1, m // p)`` micro-batches, which must divide ``m``."""
    rounds = max(1, m // p)
    return "" if m % rounds == 0 else (f"interleaved needs m a multiple of max(1, m // pp) = {rounds} (torch's "
                                       f"rounds), got m = {m}")


@dataclass(frozen=True)
class Framework:
    """A training framework's choices (see the module docstring for each field and its source)."""

    name: str
    attention: str = "flash"
    fused: bool = True
    fused_norm: bool = False
    compiled: bool = False
    complex_rotary: bool = True
    tp_comm_overlap: bool = False
    tp_async: bool = False
    selective: str = "attention"
    optimizer: str = "fused"
    loss_float32_copies: int = 1
    dp_bucket_params: float = 0.0
    nccl_channels: int = 16
    sm_share: float = 0.0
    grad_reduce_bytes: int = 4
    overlap_grad_reduce: bool = True
    host_ops_per_kernel: float = 1.0
    elementwise_efficiency: float = 1.0
    pipeline: str = "megatron"
    schedules: tuple = ALL_SCHEDULES
    zero_stages: tuple = (0, 1, 2, 3)
    fsdp: str = "fsdp2"
    source: str = ""

    def __post_init__(self) -> None:
        if self.attention not in ("flash", "math"):
            raise ValueError(f"Framework(attention={self.attention!r}): use 'flash' or 'math'")
        if self.selective not in ("attention", "op"):
            raise ValueError(f"Framework(selective={self.selective!r}): use 'attention' (Korthikanti et al.) or "
                             "'op' (torchtitan's per-operator checkpointing)")
        if self.optimizer not in OPTIMIZER_BYTES:
            raise ValueError(f"Framework(optimizer={self.optimizer!r}): use one of {sorted(OPTIMIZER_BYTES)}")
        if self.grad_reduce_bytes not in (0, 2, 4) or isinstance(self.grad_reduce_bytes, bool):
            raise ValueError(f"Framework(grad_reduce_bytes={self.grad_reduce_bytes!r}): 4 (float32), 2 (16-bit) or 0 "
                             "(the compute precision's)")
        if isinstance(self.loss_float32_copies, bool) or self.loss_float32_copies not in (1, 2, 3, 4):
            raise ValueError(f"Framework(loss_float32_copies={self.loss_float32_copies!r}): a whole number 1-4")
        if isinstance(self.host_ops_per_kernel, bool) or not isinstance(self.host_ops_per_kernel, (int, float)) \
                or self.host_ops_per_kernel < 1:
            raise ValueError(f"Framework(host_ops_per_kernel={self.host_ops_per_kernel!r}): operators the host "
                             "dispatches per counted kernel, a number >= 1 (eager PyTorch: about 2.25)")
        if not isinstance(self.fused_norm, bool):
            raise ValueError(f"Framework(fused_norm={self.fused_norm!r}): True (the norm one fused kernel, as "
                             "torchtitan's 'fused_rmsnorm') or False")
        if self.pipeline not in PIPELINES:
            raise ValueError(f"Framework(pipeline={self.pipeline!r}): use 'megatron' (1F1B with any number of "
                             "micro-batches, Megatron-LM and picotron), 'nanotron' (1F1B with at least pp - 1) or "
                             "'torch' (torch.distributed.pipelining: 1F1B needs as many micro-batches as stages)")
        if (not isinstance(self.schedules, tuple) or not self.schedules
                or any(s not in ALL_SCHEDULES for s in self.schedules) or len(set(self.schedules)) != len(self.schedules)):
            raise ValueError(f"Framework(schedules={self.schedules!r}): a tuple of the pipeline schedules it runs, "
                             f"each once, from {ALL_SCHEDULES} (Megatron-LM: ('1f1b', 'interleaved'))")
        if (not isinstance(self.zero_stages, tuple) or not self.zero_stages
                or any(isinstance(z, bool) or z not in (0, 1, 2, 3) for z in self.zero_stages)
                or len(set(self.zero_stages)) != len(self.zero_stages)):
            raise ValueError(f"Framework(zero_stages={self.zero_stages!r}): a tuple of the ZeRO stages its data "
                             "parallelism offers, each once, from (0, 1, 2, 3) (Megatron-LM: (0, 1); FSDP: (0, 2, 3))")
        if self.fsdp not in ("fsdp1", "fsdp2"):
            raise ValueError(f"Framework(fsdp={self.fsdp!r}): use 'fsdp2' (fully_shard, per-parameter shards) or "
                             "'fsdp1' (FullyShardedDataParallel, a flat parameter per unit)")
        if not isinstance(self.tp_async, bool):
            raise ValueError(f"Framework(tp_async={self.tp_async!r}): True (nanotron's asynchronous linear "
                             "collectives) or False")
        if self.tp_async and self.tp_comm_overlap:
            raise ValueError("Framework(tp_async=True, tp_comm_overlap=True): tp_comm_overlap already overlaps every "
                             "tensor-parallel collective with its multiply (TransformerEngine); choose one")
        for name in ("compiled", "complex_rotary"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"Framework({name}={getattr(self, name)!r}): True or False")
        if self.compiled and self.fused:
            raise ValueError("Framework(compiled=True, fused=True): compiled prices torch.compile over eager "
                             "PyTorch's operators; fused already means Megatron's fused kernels. Set fused=False "
                             "with compiled=True, or compiled=False")
        v = self.elementwise_efficiency
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
            raise ValueError(f"Framework(elementwise_efficiency={v!r}): the share of the copy bandwidth its "
                             "elementwise kernels reach, in (0, 1] (eager PyTorch: 0.8)")
        for name in ("dp_bucket_params", "sm_share"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0 or (name == "sm_share" and v >= 1):
                raise ValueError(f"Framework({name}={v!r}): must be >= 0" + (" and < 1" if name == "sm_share" else ""))
        if isinstance(self.nccl_channels, bool) or not isinstance(self.nccl_channels, int) or self.nccl_channels < 1:
            raise ValueError(f"Framework(nccl_channels={self.nccl_channels!r}): NCCL's channels, a whole number >= 1 "
                             "(16 by default on NVLink)")

    def sm_share_on(self, device) -> float:
        """The share of ``device``'s SMs an overlapped collective takes: ``sm_share`` where set, else
        ``nccl_channels / device.sms`` (a device without SMs, such as a CPU: 0)."""
        if self.sm_share:
            return self.sm_share
        sms = getattr(device, "sms", 0)
        return min(0.5, self.nccl_channels / sms) if sms else 0.0

    def min_microbatches(self, schedule: str, p: int) -> int:
        """The fewest micro-batches ``schedule`` (a key of
        :func:`workbench.parallel.pipeline_schedules.min_microbatches`) takes over ``p`` stages under
        this framework's pipeline: Megatron-LM's 1F1B any (its warm-up is ``min(p - r - 1, m)``
        forwards), nanotron's ``p - 1``; Megatron-LM's interleaved schedule ``p`` (it runs the
        micro-batches in groups of ``microbatch_group_size_per_vp_stage``, ``p`` by default, which
        must lie in ``[p, m]``; :meth:`interleaved_rounds` the rest of its rule); every other case
        the workbench's and torch's rule."""
        if self.pipeline == "megatron" and schedule == "1f1b":
            return 1
        if self.pipeline == "nanotron" and schedule == "1f1b":
            return max(1, p - 1)
        if self.pipeline == "megatron" and schedule == "interleaved":
            return p
        return min_microbatches(schedule, p)

    def interleaved_rounds(self, m: int, p: int) -> str:
        """Why ``m`` micro-batches cannot run interleaved over ``p`` pipeline ranks under this
        framework ("" if they can): Megatron-LM (``megatron/core/pipeline_parallel/schedules.py``)
        needs ``m`` a multiple of its group of ``p`` micro-batches (a remainder smaller than ``p``
        raises: "dependency bubbles"); elsewhere torch's rule (:func:`interleaved_rounds`)."""
        if self.pipeline == "megatron":
            return "" if m % p == 0 else (f"Megatron-LM's interleaved schedule needs m a multiple of pp = {p} (its "
                                          f"groups of pp micro-batches), got m = {m}")
        return interleaved_rounds(m, p)

    def optimizer_bytes(self, precision: str) -> int:
        """Bytes the optimizer's step moves per parameter it updates (:data:`OPTIMIZER_BYTES`)."""
        return OPTIMIZER_BYTES[self.optimizer][precision]


EAGER = Framework(
    "eager", attention="flash", fused=False, tp_comm_overlap=False, selective="op", optimizer="foreach",
    loss_float32_copies=3, dp_bucket_params=0.0, host_ops_per_kernel=2.25, elementwise_efficiency=0.8,
    pipeline="torch", zero_stages=(0, 2, 3),
    source="PyTorch eager without torch.compile, as torchtitan runs it (pytorch/torchtitan: models/llama3 "
           "RMSNorm, apply_rotary_emb, repeat_kv, F.silu(w1(x)) * w3(x); activation_checkpoint.mode selective, "
           "selective_ac_option 'op'; cross_entropy(pred.float()); AdamW foreach); elementwise kernels at 0.8 of "
           "the copy bandwidth, measured on an H200 (docs/benchmarks/2026-11-28-h200-layers.md)")
EAGER_FUSED = Framework(
    "eager-fused", attention="flash", fused=True, tp_comm_overlap=False, tp_async=True, selective="attention",
    optimizer="fused",
    loss_float32_copies=1, dp_bucket_params=40e6, grad_reduce_bytes=4, host_ops_per_kernel=2.8,
    schedules=("gpipe", "1f1b"), zero_stages=(0, 1), pipeline="nanotron",
    source="eager PyTorch launching Megatron-style fused kernels (fused norm, one QKV and one gate-up projection, "
           "fused rotary and SwiGLU, flash attention, vocabulary-parallel float32 loss, fused Adam, float32 main "
           "gradients): nanotron's Llama (TritonRMSNorm, qkv_proj, gate_up_proj, flash-attn), Megatron-LM's local "
           "layers; 2.8 operators dispatched per counted kernel, counted over such a layer")
COMPILED = Framework(
    "compiled", attention="flash", fused=False, compiled=True, tp_comm_overlap=False, selective="op",
    optimizer="foreach", loss_float32_copies=3, dp_bucket_params=0.0, host_ops_per_kernel=1.0,
    elementwise_efficiency=0.8, pipeline="torch", zero_stages=(0, 2, 3),
    source="PyTorch with torch.compile over each TransformerBlock, as torchtitan runs it (pytorch/torchtitan "
           "parallelize_llama.py apply_compile: torch.compile(transformer_block, fullgraph=True)): eager's layer with "
           "its elementwise operators fused by Inductor, the complex rotary left to ATen, the loss uncompiled; "
           "elementwise_efficiency 0.8 is eager's, for the kernels Inductor leaves to ATen")
MEGATRON = Framework(
    "megatron", attention="flash", fused=True, tp_comm_overlap=True, selective="attention", optimizer="fused",
    loss_float32_copies=1, dp_bucket_params=40e6, grad_reduce_bytes=0, schedules=("1f1b", "interleaved"),
    zero_stages=(0, 1),
    source="Megatron-Core with TransformerEngine (NVIDIA/Megatron-LM README, H100 weak scaling: "
           "--tp-comm-overlap, fused kernels, flash attention, distributed optimizer buckets of 40 M parameters, "
           "gradients reduced in bf16 (--grad-reduce-in-bf16): inferred, see the module docstring)")
MEGATRON_2022 = Framework(
    "megatron-2022", attention="math", fused=True, tp_comm_overlap=False, selective="attention", optimizer="fused",
    loss_float32_copies=1, dp_bucket_params=40e6, overlap_grad_reduce=False, schedules=("1f1b", "interleaved"),
    zero_stages=(0, 1),
    source="Megatron-LM on A100 as in Narayanan et al. 2021 and Korthikanti et al. 2022 (fused scale-mask-softmax "
           "over materialised scores, fused bias-GeLU and bias-dropout-add, no TP overlap; its LocalDDP all-reduces "
           "the contiguous gradient buffer once the pipeline has flushed, megatron/model/distributed.py "
           "allreduce_gradients, before --overlap-grad-reduce existed)")
FRAMEWORKS: dict[str, Framework] = {f.name: f for f in (EAGER_FUSED, EAGER, COMPILED, MEGATRON, MEGATRON_2022)}
