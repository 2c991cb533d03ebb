"""What a GPU training process holds beyond the formulas: the runtime's share of device memory.

:mod:`workbench.advise.memory_model` counts, exactly, what the workbench's own strategies hold on this
machine (float32, gloo, no device). A GPU framework holds more, and some things differently. A
:class:`RuntimeMemory` on a :class:`~workbench.advise.cluster.Cluster` (the GPU presets carry
one; a CPU cluster has ``None``, and its predictions stay the formulas', bit for bit) switches
the memory model to the conventions of a GPU framework -- Megatron-LM's by default, named below
-- and adds the runtime's own terms. Each term, its size and its source:

**The CUDA context** (``context_bytes``, per process, outside PyTorch's allocator): the driver's
state and the kernels loaded into it. About 300-400 MB with CUDA >= 11.7, whose lazy module
loading loads a kernel only when first launched (before 11.7 every kernel of every library was
loaded: > 1 GB) [pytorch#107667, pytorch#109888]; plus what a training step loads lazily (the
attention, norm, optimizer and NCCL kernels) and cuBLAS's workspaces (PyTorch gives each
handle and stream ``CUBLAS_WORKSPACE_CONFIG``'s default, 4 MiB x 8 on Hopper [PyTorch,
"Reproducibility" / "CUDA semantics"]). Default 512 MiB.

**NCCL's communicators**: each communicator's own buffers, also outside the allocator, are
:attr:`Cluster.communicator_bytes` (sources there) times the communicators a rank creates --
:func:`communicators`: the world group (a barrier at start, the loss's all-reduce), each of
its data-, tensor- and pipeline-parallel groups of more than one rank that is not the world, and
a two-rank communicator per pipeline neighbour (PyTorch's ``isend``/``irecv`` outside a batch
create one per peer pair). NCCL creates a communicator at its group's first collective, so a
group the step never uses costs nothing; every group counted here is used every step.

**The caching allocator's reserve** (``allocator_overhead``): PyTorch keeps freed blocks cached
and cannot move live ones, so what it reserves from the device exceeds the peak of live tensors
(``max_memory_reserved`` against ``max_memory_allocated``). Measured on LLM training with the
default allocator: GMLake (Guo et al., ASPLOS 2024) removes 9.2 GB on average (up to 25 GB) of an
80 GB A100's reservation and up to 33% fragmentation; STWeaver (Huang et al. 2025) finds up to 43%
wasted with virtual pipelines and recomputation. Default 10% of the allocated peak: the average
case, not the worst.

**Model state in mixed precision** (:func:`model_state`): Megatron-LM's convention (its
"Distributed Optimizer" guide, bytes per parameter: bf16 parameters with float32 gradients, 18
without and ``6 + 12/d`` with the distributed optimizer): 16-bit parameters (2), the gradients
where backward accumulates them across micro-batches (``main_grad_bytes``: 4, Megatron's float32
``main_grad`` buffer; 2 for frameworks that keep 16-bit gradients, as the ZeRO paper's ``2 + 2 +
12``), and in the optimizer a float32 master copy and Adam's two float32 moments (12). ZeRO shards
the optimizer (stage 1: Megatron's distributed optimizer, which reduces and gathers in place in
its contiguous buffers: no flat buffers beside them), then the gradients (2), then the parameters
(3), over ``d`` data-parallel ranks. Float32 training keeps the formulas' exact count.

**The loss in float32, vocabulary-parallel at any tensor-parallel size**: Megatron computes the
cross-entropy with ``vocab_parallel_cross_entropy`` on the logits cast to float32, also on one
tensor-parallel rank; it keeps the float32 softmax of this rank's ``V/t`` columns (``4 s b V/t``
bytes) and the target mask and local ids for backward. Its forward turns the float32 copy into the
softmax in place, beside the 16-bit logits, and its backward turns the softmax into the logits'
gradient in place and casts it to 16 bits: ``(2 + 4) s b V/t`` bytes at once
(``loss_float32_copies = 1``). Losses that make more float32 copies say how many (nanotron's
subtracts the maximum out of place: 2; torchtitan's ``cross_entropy(logits.float())``: 3). The
16-bit logits themselves are no one's saved tensor: the caller does not keep them
(``hold_logits`` off) and a pipeline's last stage keeps each micro-batch's loss, not its logits.

**Activations by attention kernel** (Korthikanti et al. 2022, "Reducing Activation Recomputation
in Large Transformer Models", Sec. 4): per layer ``sbh (34 + 5 a s / h)`` bytes of 16-bit
activations, ``sbh (10 + 24/t + 5as/(ht))`` with tensor parallelism and ``sbh/t (34 + 5as/h)``
with sequence parallelism as well (:func:`korthikanti_layer_bytes`). Its ``5 a s^2 b`` is the
attention core's (scores' softmax 2, dropout mask 1, dropout output 2 bytes per element): the
``math`` kernel keeps it (``attention="math"``); a flash kernel (FlashAttention, PyTorch's fused
SDPA, the default ``"flash"``) recomputes the scores in its backward and keeps only one float32
log-sum-exp per row and head (``4 a s b``). Selective recomputation recomputes exactly the
attention core (``sbh 34/t`` with sequence parallelism); full recomputation keeps each layer's
input (``2 sbh``, ``/t`` with sequence parallelism).

**Backward's temporaries**, in :mod:`workbench.advise.memory_model` for both paths: the first
recomputed layer's whole working set under full recomputation, ZeRO-3's gathered units (the one
running and the one prefetched), a unit's flat gradient being assembled and reduce-scattered,
ZeRO-2's open gradient buckets, the loss's and the head's backward.

Where a figure is the framework's rather than the hardware's, the default is eager PyTorch with
Megatron-style kernels and bookkeeping (flash attention, vocabulary-parallel float32 loss, float32
main gradients, the distributed optimizer for ZeRO-1).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["RuntimeMemory", "MEGATRON", "ATTENTION_KERNELS", "korthikanti_layer_bytes", "attention_core_bytes",
           "op_checkpoint_bytes", "eager_layer_extra_bytes",
           "model_state", "communicators", "MiB"]

MiB = float(2 ** 20)
ATTENTION_KERNELS = ("flash", "math")
MASTER_AND_ADAM_BYTES = 12          # float32 master copy 4 + Adam's two float32 moments 8, per parameter


@dataclass(frozen=True)
class RuntimeMemory:
    """The runtime's share of a GPU's memory and the framework's conventions (module docstring).

    ``context_bytes``: the CUDA context and loaded kernels per process (outside the allocator);
    ``allocator_overhead``: the caching allocator's reserve beyond its peak of live tensors, as a
    fraction of that peak; ``main_grad_bytes``: bytes of a gradient kept from backward to the
    step in mixed precision (4: float32, Megatron; 2: 16-bit, the ZeRO paper); ``attention``:
    ``"flash"`` (no ``s^2`` term) or ``"math"`` (the ``5 a s^2 b`` of Korthikanti et al.);
    ``loss_float32_copies``: float32 logits-sized tensors alive at once at the loss's busiest
    moment (Megatron's in-place ``vocab_parallel_cross_entropy``: 1; a loss that subtracts the
    maximum out of place, as nanotron's: 2; ``cross_entropy(logits.float())``, as torchtitan's,
    whose log-softmax also writes its output anew: 3); ``selective``: what selective
    recomputation keeps, ``"attention"`` (Korthikanti et al.) or ``"op"`` (torchtitan's per-operator
    checkpointing: :func:`op_checkpoint_bytes`); ``compiled``: the blocks run under
    ``torch.compile``, whose partitioner keeps only what backward reads (:func:`op_checkpoint_bytes`);
    ``float32_norms`` and ``repeat_kv``: eager PyTorch's unfused layer, what it keeps beyond the
    fused layer's tensors (:func:`eager_layer_extra_bytes`); ``dtensor_tp``: tensor parallelism as
    PyTorch's DTensor runs it (torchtitan's plan), whose multiplies keep what they are handed --
    with sequence parallelism the all-gathered input, and under per-operator checkpointing the
    row-parallel multiply's partial sum at full width and the reduce-scatter's output
    (:func:`eager_layer_extra_bytes`, :func:`op_checkpoint_bytes`); Megatron-LM and nanotron keep
    the input's shard and gather it again in backward. A cluster with a
    :class:`~workbench.advise.framework.Framework` sets ``attention``, ``loss_float32_copies``,
    ``selective``, ``compiled``, ``float32_norms``, ``repeat_kv`` and ``dtensor_tp`` from it, so its
    compute and memory models read one kernel and one policy.
    """

    context_bytes: float = 512 * MiB
    allocator_overhead: float = 0.10
    main_grad_bytes: int = 4
    attention: str = "flash"
    loss_float32_copies: int = 1
    source: str = "Megatron-LM conventions; CUDA context: pytorch#107667, #109888; allocator: GMLake (ASPLOS 2024)"
    selective: str = "attention"
    compiled: bool = False
    float32_norms: bool = False
    repeat_kv: bool = False
    dtensor_tp: bool = False

    def __post_init__(self) -> None:
        for name in ("context_bytes", "allocator_overhead"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
                raise ValueError(f"RuntimeMemory({name}={value!r}): must be a finite number >= 0, "
                                 f"e.g. context_bytes=512 * 2**20 or allocator_overhead=0.1")
        if self.main_grad_bytes not in (2, 4) or isinstance(self.main_grad_bytes, bool):
            raise ValueError(f"RuntimeMemory(main_grad_bytes={self.main_grad_bytes!r}): use 4 (float32 gradients, "
                             "Megatron's main_grad) or 2 (16-bit gradients)")
        if isinstance(self.loss_float32_copies, bool) or self.loss_float32_copies not in (1, 2, 3, 4):
            raise ValueError(f"RuntimeMemory(loss_float32_copies={self.loss_float32_copies!r}): a whole number "
                             "1-4 (Megatron's in-place loss: 1)")
        if self.attention not in ATTENTION_KERNELS:
            raise ValueError(f"RuntimeMemory(attention={self.attention!r}): use one of {ATTENTION_KERNELS}")
        for name in ("compiled", "float32_norms", "repeat_kv", "dtensor_tp"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"RuntimeMemory({name}={getattr(self, name)!r}): True or False (see the class "
                                 "docstring)")
        if self.selective not in ("attention", "op"):
            raise ValueError(f"RuntimeMemory(selective={self.selective!r}): use 'attention' (Korthikanti et al.: the "
                             "attention core recomputed) or 'op' (torchtitan's per-operator checkpointing)")


MEGATRON = RuntimeMemory()
"""The GPU presets' runtime: eager PyTorch with Megatron-LM's conventions and a flash kernel."""


def korthikanti_layer_bytes(s: int, b: float, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                            recompute: str = "none") -> float:
    """Korthikanti et al. 2022's activation bytes of one GPT layer (16-bit activations, 1-byte
    dropout masks, the math attention kernel) per tensor-parallel rank: Table 2.

    ``none``: ``sbh (10 + 24/t + 5as/(ht))``, with sequence parallelism ``sbh/t (34 + 5as/h)``;
    ``selective`` drops the attention core's ``5as/h`` term; ``full``: the layer's input, ``2 sbh``
    (``/t`` with sequence parallelism)."""
    sbh = s * b * h
    core = 5 * a * s / h
    if recompute == "full":
        return 2 * sbh / (t if sequence_parallel else 1)
    if recompute not in ("none", "selective"):
        raise ValueError(f"korthikanti_layer_bytes(recompute={recompute!r}): use 'none', 'selective' or 'full'")
    kept_core = core if recompute == "none" else 0.0
    if sequence_parallel:
        return sbh / t * (34 + kept_core)
    return sbh * (10 + 24 / t + kept_core / t)


def op_checkpoint_bytes(shape, b: float, t: int = 1, sequence_parallel: bool = False, e: int = 2,
                        compiled: bool = False, dtensor_tp: bool = False) -> float:
    """Bytes one layer keeps per tensor-parallel rank under torchtitan's per-operator selective
    checkpointing (``selective_ac_option = "op"``: ``_save_list`` holds ``aten.mm``, the SDPA kernels
    and ``reduce_scatter``; every second ``mm`` is recomputed), for ``b`` sequences: the layer's
    input (the checkpoint's), the outputs of the 1st, 3rd, 5th ... matrix multiply in forward order
    (Llama: ``wq, wk, wv, wo, w1, w3, w2``, so ``q``, ``v``, ``w1 x`` and ``w2``'s output; a GPT:
    the fused ``qkv`` and the MLP's first), the attention output and its float32 log-sum-exp per
    head. Column-parallel outputs are ``/t``, row-parallel ones and the input ``/t`` only with
    sequence parallelism. Every norm, activation, rotary and residual add is recomputed.

    Eager, the checkpoint caches every output the policy saves, read or not. ``compiled``: under
    ``torch.compile`` the policy only marks what may be saved; AOTAutograd's partitioner keeps what
    the backward graph reads, and a row-parallel projection's output (``wo``, ``w2``) goes only into
    the residual add, whose backward reads nothing: Llama's ``w2`` output is not kept. Measured on
    the CPU (``docs/benchmarks/2026-11-28-compiled-activations.md``): eager keeps the formula's bytes,
    compiled one ``e sbh`` less per layer.

    ``dtensor_tp`` with sequence parallelism (torchtitan's plan: each row-parallel layer's output
    reduce-scattered to ``Shard(1)``): a row-parallel multiply's output is its partial sum, ``h``
    wide before the reduce-scatter, and the reduce-scatters' outputs (``h/t``) are on the save list.
    Eager keeps both reduce-scatter outputs; compiled only the attention's, from which backward
    recomputes the residual stream the MLP's norm reads (two ranks on the CPU,
    ``docs/benchmarks/2026-11-28-tp-activations.md``)."""
    s, h, a, f = shape.seq, shape.hidden, shape.heads, shape.ffn
    kv = getattr(shape, "kv_dim", h)
    rep = t if sequence_parallel else 1
    scattered = dtensor_tp and sequence_parallel and t > 1
    row = h if scattered else h / rep              # a row-parallel multiply's output (a partial sum if scattered)
    if shape.gated:
        outputs = [h / t, kv / t, kv / t, row, f / t, f / t, row]
        residual = (3, 6)                # wo, w2: row-parallel, read by the residual add only
    else:
        outputs = [(h + 2 * kv) / t, row, f / t, row]
        residual = (1, 3)
    kept = [i for i in range(0, len(outputs), 2) if not (compiled and i in residual)]
    saved = sum(outputs[i] for i in kept)
    if scattered:                        # the reduce-scatters' outputs: both eager, the attention's compiled
        saved += (1 if compiled else 2) * h / t
    return s * b * (e * (h / rep + saved + h / t) + 4 * a / t)


def eager_layer_extra_bytes(shape, b: float, t: int = 1, sequence_parallel: bool = False, e: int = 2, *,
                            float32_norms: bool = False, repeat_kv: bool = False,
                            gathered_inputs: bool = False) -> float:
    """Bytes an eager PyTorch layer keeps for backward beyond the fused layer's (Korthikanti et al.'s
    tensors: each norm's input, each multiply's input, the activation's), per tensor-parallel rank,
    for ``b`` sequences, without recomputation. Read off autograd's saved tensors of torchtitan's
    eager Llama layer (``docs/benchmarks/2026-11-28-compiled-activations.md``):

    * ``float32_norms``: an RMSNorm written as ``(x.float() * rsqrt(mean(x^2) + eps)).type_as(x) *
      weight`` (torchtitan's, fms-fsdp's) keeps the float32 copy of its input (``pow`` and ``mul``
      save it) where a fused norm keeps the input, and the normalised tensor (``* weight`` saves
      it) beside its output: ``(4 - e) + e = 4`` bytes per element more, two norms a layer,
      ``/t`` with sequence parallelism. (``F.layer_norm`` is one operator: nothing more.)
    * ``repeat_kv``: grouped-query attention through torchtitan's ``repeat_kv`` (``expand`` then
      ``reshape``, a copy when a rank holds more than one key/value head) hands SDPA keys and values
      at the queries' width, and SDPA keeps those: ``2 e s b (h - kv) / t`` more.
    * ``gathered_inputs``: with sequence parallelism under DTensor (``dtensor_tp``), the attention's
      and the MLP's column-parallel multiplies keep the all-gathered input they were handed, ``h``
      wide, where Megatron-LM keeps the ``h/t`` shard and gathers it again in backward:
      ``2 e s b h (1 - 1/t)`` more, eager or compiled (the partitioner does not recompute a
      collective; two ranks on the CPU: ``docs/benchmarks/2026-11-28-tp-activations.md``)."""
    s, h = shape.seq, shape.hidden
    sb = s * b
    extra = 0.0
    if float32_norms and getattr(shape, "norm", "layernorm") == "rmsnorm":
        extra += 2 * 4 * sb * h / (t if sequence_parallel else 1)
    kv = getattr(shape, "kv_dim", h)
    local_kv_heads = (getattr(shape, "kv_heads", 0) or shape.heads) / t
    if repeat_kv and kv < h and local_kv_heads > 1:
        extra += 2 * e * sb * (h - kv) / t
    if gathered_inputs and sequence_parallel and t > 1:
        extra += 2 * e * sb * h * (1 - 1 / t)
    return extra


def attention_core_bytes(s: int, b: float, a: int, t: int, kernel: str) -> float:
    """Bytes the attention core keeps per layer beyond its inputs and output, per tensor-parallel
    rank: the math kernel's ``5 a s^2 b / t`` (Korthikanti et al.: softmax output 2, dropout mask
    1, dropout output 2 bytes per score), or 0 for a flash kernel, whose float32 log-sum-exp
    (``4 a s b / t``) the formulas already count."""
    if kernel not in ATTENTION_KERNELS:
        raise ValueError(f"attention_core_bytes(kernel={kernel!r}): use one of {ATTENTION_KERNELS}")
    return 5.0 * a * s * s * b / t if kernel == "math" else 0.0


def model_state(psi: float, dp: int, zero: int, runtime: RuntimeMemory) -> dict[str, float]:
    """Bytes of mixed-precision model state (Adam) on a rank holding ``psi`` parameters, ZeRO
    stage ``zero`` over ``dp`` ranks: 16-bit parameters (2), gradients of ``main_grad_bytes``, and
    the float32 master copy and Adam moments (12) as ``optimizer``; stage 1 shards the optimizer,
    2 the gradients too, 3 the parameters too (Megatron-LM's "Distributed Optimizer" table: 18
    bytes per parameter, ``6 + 12/d`` with the distributed optimizer)."""
    n = dp if dp > 1 else 1
    stage = zero if n > 1 else 0
    return {"parameters": 2.0 * psi / (n if stage >= 3 else 1),
            "gradients": float(runtime.main_grad_bytes) * psi / (n if stage >= 2 else 1),
            "optimizer": float(MASTER_AND_ADAM_BYTES) * psi / (n if stage >= 1 else 1)}


def communicators(dp: int, tp: int, pp: int) -> int:
    """NCCL communicators one rank creates: the world group, each data-, tensor- and
    pipeline-parallel group of more than one rank that is not the whole world, and one two-rank
    communicator per pipeline neighbour (at most two)."""
    world = dp * tp * pp
    groups = 1 if world > 1 else 0
    groups += sum(1 for n in (dp, tp, pp) if 1 < n < world)
    groups += min(2, pp - 1) if pp > 1 else 0
    return groups
