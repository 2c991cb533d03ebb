"""Predicted memory per device, by category: the formulas the strategies were checked against, composed.

A device of a ``dp x tp x pp`` configuration holds one tensor-parallel shard of one pipeline
stage (two with the interleaved and ZBV schedules) of one data-parallel replica. Its bytes, in the
categories :class:`~workbench.measure.metrics.MemoryMeter` uses (``params``, ``grads``, ``optimizer``,
``activations``, ``comm``; here spelt as :data:`~workbench.advise.plan.MEMORY_CATEGORIES`):

**Model state** (``parameters``, ``gradients``, ``optimizer``). ``psi`` = the parameters of this
rank's stage(s) on one tensor-parallel rank, counted exactly by
:meth:`ModelShape.stage_parameters` (the layers :func:`~workbench.parallel.pipeline.partition`
gives the stage, the embedding on the first, final norm and head on the last -- a tied head is a
second copy there). Then the ZeRO formulas over the ``dp`` ranks
(:func:`workbench.parallel.zero_memory.model_state_per_rank`): float32 Adam ``4 + 4 + 8`` bytes
per parameter (``16 psi`` for DDP, ``4 + 4 + 8/N``, ``4 + 4/N + 8/N``, ``16/N`` for ZeRO-1/2/3);
bf16/fp16 the paper's mixed precision ``2 + 2 + 12`` (a float32 master copy beside the two
moments). In float32 :func:`model_state` is exact for the workbench's strategies: it adds what
they hold beyond the formula, the padding of each flat bucket (ZeRO-1/2, cut by their own
:func:`~workbench.parallel.buckets.assign_buckets`) or unit (ZeRO-3) to a multiple of ``N``, and
Adam's 4-byte step counter per tensor it updates.

**Activations**, per micro-batch of ``b = global_batch / (dp m)`` sequences (without a pipeline
``m`` is the number of gradient-accumulation steps, each freeing its activations before the next) of ``s`` tokens,
``h`` wide, ``a`` heads, ``e`` bytes per element (4 in float32, 2 in 16 bits), ``t = tp``:

* one layer, no recomputation: :func:`workbench.parallel.tensor.activation_bytes_per_layer`
  (Korthikanti et al. 2022 for our float32 GPT with the fused attention kernel:
  ``e (sbh (4 + 12/t) + asb/t + 4 sb)``, the replicated ``4 sbh + 4 sb`` split by ``t`` too with
  sequence parallelism), its log-sum-exp kept in float32 also in 16 bits
  (:func:`workbench.parallel.recompute.activation_bytes`). Shapes other than GPT-2's change three
  rows of that table: keys and values of width ``k`` (GQA) instead of ``h`` (``2 sb (k - h)/t``),
  an MLP of ``ffn`` units keeping ``2 ffn`` (plain: the GELU's input and output) or ``4 ffn``
  (gated: gate, up, SiLU output, product) elements per token instead of ``8 h``, and RMSNorm's one
  statistic per row instead of LayerNorm's two;
* ``selective`` drops the attention core's float32 log-sum-exp (``4 asb/t``); ``full`` keeps the
  layer's input only, ``e sbh`` (``/t`` with sequence parallelism);
* the last stage adds the final norm's input, output and statistics (``e (2 sbh + 2 sb)``, ``/t``
  with sequence parallelism) and what the loss saves: log_softmax's output (``e s b V_p``), or
  with the vocabulary-parallel loss its float32 softmax (``4 s b V_p / t``), the local target ids
  (int64) and the mask of targets this rank holds (bool); without a pipeline the caller's logits
  (``e s b V_p / t``) are alive through backward too. The vocabulary-parallel embedding keeps its
  local ids and mask (``9 sb`` bytes) on the first stage.

**Backward's peak** (one micro-batch, beside everything kept), the larger of its busiest moments,
each a sum of tensors alive at once (measured op by op with :class:`~workbench.measure.memory_meter.MemoryMeter`):

* the last layer's first product (the MLP's output projection): the head's tensors are freed (all
  but the caller's logits); alive are the gradient flowing in (``e sbh/r``, ``r = t`` with
  sequence parallelism), its all-gathered copy (sequence parallel: ``e sbh``), the gradient of the
  ``ffn``-wide input (``e sb ffn/t``) and, where the strategy copies a new weight gradient instead
  of making it ``.grad`` (DDP into its bucket view, ZeRO-2 into the bucket's flat buffer, ZeRO-3
  into the unit's flat gradient, and any accumulation into an existing ``.grad``), the projection's
  weight and bias gradients (``g (h ffn/t + h)``, ``g``: bytes of a gradient) and a tied head's
  gradient, which waits in autograd's input buffer for the embedding's (``g V_p h/t``). A new
  gradient that becomes ``.grad`` is model state: the meter files it under gradients;
* the loss's backward: nll_loss's and log_softmax's gradients (``2 e s b V_p``); vocabulary
  parallel: the float32 gradient of the logits and the int64 row indices;
* the head's backward: the logits' gradient, the input's gradient (``e sbh``, all of it) and with
  sequence parallelism its contiguous sequence blocks for the reduce-scatter and that one's output
  (``e sbh + e sbh/t``), plus the head's weight gradient if the strategy copies it.

With ``selective`` the last layer's attention core is recomputed beside the kept tensors and two
gradients; with ``full`` the first recomputed layer's whole working set, the gradient flowing into
it and the caller's logits, and where the strategy copies the new weight gradients (or they
accumulate over micro-batches) the first moment above inside that layer: the other layers' inputs
and the recomputed layer whole in place of everything kept. Where the new gradients become
``.grad`` (one replica, ZeRO-1), they are model state made as backward goes, and the peak with them
is at that moment in the last layer if a layer's input outweighs its gradients (the other inputs
all kept), else in the first (no other input left): the recomputed layer, the gradient flowing in,
the ffn-wide one, the logits and a tied head's gradient waiting for the embedding's. With ``full``
on the first ``k`` layers of a stage only (``Config.recompute_layers``), the other layers keep
everything: the last layer's backward begins as without recomputation, and the first recomputation
follows a layer that kept everything, whose input gradient is alive beside the one flowing in;
where the gradients become ``.grad``, the peak is the moment with the most activations less the
gradients still to come (:func:`_partial_moment`), and ZeRO-1's step is weighed against it so. On GPT tiny
and small these put the prediction within 0.3% of ``MemoryMeter``'s peak on one process and in
every data-, tensor- and sequence-parallel layout that
:func:`workbench.advise.validate.measure_memory` runs.

**Pipelines.** A pipeline stage also keeps its output for the backward (``e sbh``, ``/t`` with
sequence parallelism). For GPipe and 1F1B each rank's action list (with its messages,
:func:`~workbench.parallel.pipeline_schedules.with_comms`) is replayed: at each backward, the
micro-batches still alive kept whole, the one in backward at its peak (its weight gradients are
temporaries after the rank's first backward: they accumulate into ``.grad``), the receives the
pipeline has posted for the next compute action (``e sbh/r`` each), on a stage after the first the
input gradient the previous backward sent (held until the pipeline sees it delivered, which it
checks between compute actions), and on the last stage the logits of every micro-batch forwarded
so far (the step returns them). ZB-H1 is replayed the same way, with backward split
(:mod:`workbench.parallel.pipeline_backward`): on a stage fed activations a B ends holding its
micro-batch and the output gradient of every product whose W it defers (per GPT layer ``3h + h +
4h + h`` wide, ``/t`` for the column-parallel ones; the head's logits gradient on the last stage);
from then until W the micro-batch holds ``M_W`` (Qi et al.): those gradients and the deferred
products' inputs (per layer ``h + h/t + h + 4h/t``, the two ``h`` sequence shards ``h/t`` under
sequence parallelism), not its whole activations; the first stage's B has nothing to compute, so
it holds the gradient it received until its W runs the whole backward; under ZeRO-3 FSDP's flat
1-D parameters leave nothing to defer, as 1F1B. The interleaved and ZBV schedules use
:func:`~workbench.parallel.pipeline_schedules.peak_live_bytes` on their action lists with each
stage's kept bytes per micro-batch, plus one micro-batch's backward peak and the two receives
posted ahead.

**Buffers** (``comm``): ZeRO-3 holds gathered units while backward runs -- two blocks (the one
running and the one prefetched) and, on the rank holding the head, the root unit (embedding,
final norm and head; gathered for the head's backward, held until its gradient is reduced at the
end; a first pipeline stage's root, its embeddings, is not gathered again: their backward needs
only the token ids), in the compute dtype; a unit's flat gradient is only
built once backward has left the unit (its activations freed), so it is not alive at the peak.
ZeRO-2 allocates a bucket's flat gradient buffer at the bucket's first gradient and frees them all
at the end of backward (:class:`~workbench.parallel.zero.ShardedOptimizer`): at the last layer's
peak only the buckets holding the final norm's (and an untied head's) gradients are open. ZeRO-1
reduces in its step: each bucket's gradients copied into a flat buffer (built while the previous
one is still being reduced: two at once) and reduce-scattered into a chunk kept until the update;
where that moment outweighs backward's (full recomputation keeps little), it is the peak: the
buffers and chunks beside the caller's logits. DDP holds nothing more (gradients are views of its
buckets). And on NCCL each communicator's own
buffers (``cluster.communicator_bytes``): the world group, each of this rank's groups of more than
one rank, and a pair per pipeline neighbour for send/recv.

**On a GPU** (``cluster.runtime_memory``, a :class:`~workbench.advise.runtime_memory.RuntimeMemory`:
the GPU presets; every term above stays as it is without one, bit for bit) the model follows a GPU
framework's conventions (Megatron-LM's by default; each with its source in
:mod:`~workbench.advise.runtime_memory`) where they differ from the workbench's strategies, and adds
what the runtime holds:

* model state in mixed precision: 16-bit parameters, float32 gradients and the float32 master copy
  and Adam moments (Megatron's 18 bytes per parameter, ``6 + 12/d`` with its distributed optimizer,
  which reduces in place: no ZeRO-1 step buffers);
* the loss in float32 and vocabulary-parallel at any ``t`` (its float32 softmax kept, its busiest
  moment the 16-bit logits beside ``loss_float32_copies`` float32 copies); no one holds the logits
  afterwards: neither the caller nor a pipeline's last stage, which keeps each micro-batch's loss
  (the workbench's pipeline returns every micro-batch's logits, ``m`` of them: with a vocabulary of
  128k and a few dozen micro-batches, tens of GB it counted on the last stage);
* the attention kernel: a flash kernel (the default) as above, or the math kernel's ``5 a s^2 b``
  per layer (Korthikanti et al.), which selective recomputation drops;
* in ``buffers``, beside NCCL's communicators: the CUDA context per process and the caching
  allocator's reserve, a fraction of the allocated peak.

The pipeline schedules' micro-batches in flight are those of their action lists on both paths:
1F1B holds ``p - r`` on stage ``r``, GPipe all ``m``, ZB-H1 ``p - r`` whole plus ``M_W`` each for
those between B and W (under ZeRO-3, with nothing deferred, a W frees nothing more).

The worst device is reported: every pipeline rank is evaluated (the first stage holds the
embedding and the most live micro-batches, the last the head and the logits, which win for a large
vocabulary) and the one with the largest total returned.

**A search** (:func:`~workbench.advise.choose.advise`) asks this of tens of thousands of
configurations that share most of their parts, so the parts are remembered by what they read:
model state and the ZeRO buffers per rank of a layout (:func:`_state_config`: not the
micro-batches, sequence parallelism or recomputation), a micro-batch per kind of stage (its layers,
first, last), and a pipeline replay's counts per schedule, size, micro-batches and rank, of which
only the moments that can be the peak are summed (:func:`_replay_frontier`). Each is a pure
function of its key, and every sum keeps its order of operations: the figures are the same, bit
for bit, as computing each configuration alone (tests/test_advise.py checks both).
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

from workbench.parallel import pipeline_schedules as schedules
from workbench.parallel.buckets import MB, ZERO_BUCKET_CAP_MB, assign_buckets
from workbench.parallel.tensor import activation_bytes_per_layer
from workbench.parallel.zero_memory import model_state_per_rank

from . import runtime_memory as runtime
from .cluster import Cluster
from .plan import MEMORY_CATEGORIES, Config, check_config
from .runtime_memory import RuntimeMemory
from .shape import ModelShape

__all__ = ["memory_per_device", "memory_by_rank", "model_state", "activation_bytes_per_microbatch", "ELEMENT_SIZE",
           "ZERO2_BUCKET_BYTES", "chunks", "rank_stages", "microbatch_size"]

ELEMENT_SIZE = {"fp32": 4, "bf16": 2, "fp16": 2}       # bytes of an activation / compute-dtype weight
_ZERO_PRECISION = {"fp32": "fp32", "bf16": "mixed", "fp16": "mixed"}
ZERO2_BUCKET_BYTES = ZERO_BUCKET_CAP_MB * MB           # ShardedOptimizer's default bucket_cap_mb
STEP_BYTES = 4                                         # torch Adam's step counter: a float32 per tensor it updates
_SCHEDULE_KEY = {"gpipe": "gpipe", "1f1b": "1f1b", "interleaved": "interleaved", "zb-h1": "zb_h1", "zbv": "zbv"}


# ----------------------------------------------------------------------------------- layout of stages
def chunks(config: Config) -> int:
    """Stages per pipeline rank (:attr:`Config.stages_per_rank`)."""
    return config.stages_per_rank


def rank_stages(config: Config, rank: int) -> list[int]:
    """The (virtual) stages pipeline rank ``rank`` holds: ``[r]``; interleaved ``[r, r + p]``;
    ZBV ``[r, 2p - 1 - r]`` (:func:`~workbench.parallel.pipeline_schedules.stage_to_rank`)."""
    return list(_stages_by_rank(config.pp, chunks(config), "v" if config.schedule == "zbv" else "loop")[rank])


@lru_cache(maxsize=1024)
def _stages_by_rank(p: int, v: int, style: str) -> tuple[tuple[int, ...], ...]:
    """:func:`rank_stages` of every rank, per placement (a search asks for each rank of thousands of
    configurations that share a few placements)."""
    owner = schedules.stage_to_rank(p * v, p, style)
    return tuple(tuple(s for s in range(p * v) if owner[s] == rank) for rank in range(p))


@lru_cache(maxsize=4096)
def _layer_counts(shape: ModelShape, n_stages: int) -> tuple[int, ...]:
    """:meth:`ModelShape.layers_per_stage`, remembered: asked for per rank and micro-batch kind."""
    return tuple(shape.layers_per_stage(n_stages))


def microbatch_size(config: Config, global_batch: int) -> float:
    """Sequences per micro-batch: ``global_batch / (dp m)`` (``m``: the pipeline's micro-batches, or
    the gradient-accumulation steps without a pipeline)."""
    return global_batch / (config.dp * config.microbatches)


@lru_cache(maxsize=4096)
def _actions(schedule: str, p: int, m: int, v: int = 2) -> tuple[tuple, ...]:
    key = _SCHEDULE_KEY[schedule]
    if key == "gpipe":
        lists = schedules.gpipe(p, m)
    elif key == "1f1b":
        lists = schedules.one_f_one_b(p, m)
    elif key == "zb_h1":
        lists = schedules.zero_bubble_h1(p, m)
    elif key == "interleaved":
        lists = schedules.interleaved(p, v, m)
    else:
        lists = schedules.zbv(p, m)
    return tuple(tuple(a) for a in lists)


@lru_cache(maxsize=1 << 15)
def _peak_live(schedule: str, p: int, m: int, rank: int, kept: tuple[tuple[int, float], ...], v: int = 2) -> float:
    """:func:`~workbench.parallel.pipeline_schedules.peak_live_bytes` of rank ``rank``'s list with
    ``kept`` bytes per micro-batch on each of its stages (``(stage, bytes)`` pairs), remembered: the
    configurations that differ only in the ZeRO stage keep the same bytes per micro-batch."""
    return schedules.peak_live_bytes(list(_actions(schedule, p, m, v)[rank]), dict(kept))


@lru_cache(maxsize=4096)
def _live(schedule: str, p: int, m: int, rank: int) -> dict[int, int]:
    """Most micro-batches alive at once per stage of ``rank``
    (:func:`~workbench.parallel.pipeline_schedules.live_microbatches`)."""
    return schedules.live_microbatches(list(_actions(schedule, p, m)[rank]))


# ----------------------------------------------------------------------------------- activations
def _layer_bytes(shape: ModelShape, b: float, t: int, sp: bool, e: int, attention: str = "flash",
                 policy: str = "attention", compiled: bool = False, float32_norms: bool = False,
                 repeat_kv: bool = False, dtensor_tp: bool = False) -> dict[str, float]:
    """One layer's kept bytes per policy (and ``none``'s working set), for ``b`` sequences; the
    ``math`` attention kernel keeps the core's ``5 a s^2 b`` (Korthikanti et al., in 16-bit bytes:
    scaled by ``e/2``) in place of the flash kernel's float32 log-sum-exp. ``float32_norms``,
    ``repeat_kv`` and ``dtensor_tp``: eager PyTorch's unfused layer and DTensor's tensor parallelism
    (:class:`~workbench.advise.runtime_memory.RuntimeMemory`).
    ``compiled``: the blocks under ``torch.compile``, whose partitioner keeps only what backward
    reads: under per-operator checkpointing not ``w2``'s output (:func:`~workbench.advise.
    runtime_memory.op_checkpoint_bytes`), without checkpointing not the SiLU's output, which the
    fused SwiGLU's backward recomputes from the gate (the gate, the up projection and their product
    kept: ``docs/benchmarks/2026-11-28-compiled-activations.md``)."""
    s, h, a = shape.seq, shape.hidden, shape.heads
    rep = t if sp else 1
    sb = s * b
    # tensor.py's table for our GPT (q, k, v of width h; MLP 8 sbh; two LayerNorm statistics)
    gpt = activation_bytes_per_layer(1, s, h, a, t, sp, element_size=e) * b
    # ... adapted to this shape: keys/values of width kv_dim, the MLP's own units, RMSNorm's one statistic
    qkv = 2 * sb * (shape.kv_dim - h) / t
    mlp = (sb * shape.ffn * (4 if shape.gated else 2) - 8 * sb * h) / t
    stats = -2 * sb / rep if shape.norm == "rmsnorm" else 0.0
    lse_fp32 = (4 - e) * a * sb / t                  # the fused kernel's log-sum-exp stays float32
    none = gpt + e * (qkv + mlp + stats) + lse_fp32 + runtime.eager_layer_extra_bytes(
        shape, b, t, sp, e, float32_norms=float32_norms, repeat_kv=repeat_kv,
        gathered_inputs=dtensor_tp)
    if compiled and shape.gated:   # Inductor's SwiGLU kernel recomputes the SiLU from the gate in its backward
        none -= e * sb * shape.ffn / t
    selective = none - 4 * a * sb / t                # the attention core recomputed: no log-sum-exp kept
    if attention == "math":
        none = selective + runtime.attention_core_bytes(s, b, a, t, "math") * e / 2
    if policy == "op":   # torchtitan's per-operator checkpointing (runtime_memory.op_checkpoint_bytes)
        selective = runtime.op_checkpoint_bytes(shape, b, t, sp, e, compiled, dtensor_tp)
    return {"none": none, "selective": selective, "full": e * sb * h / rep}


def _grads_are_transient(config: Config) -> bool:
    """Whether a weight's gradient, when backward makes it, is a temporary beside the model state
    rather than becoming ``.grad`` itself: DDP copies it into its bucket view, ZeRO-2 adds it into
    the bucket's flat buffer and ZeRO-3 into the unit's flat gradient; plain ``.grad`` (one
    replica, ZeRO-1) takes the new tensor over, unless it is accumulating into an existing one."""
    return config.dp > 1 and config.zero in (0, 2, 3)


def _microbatch(shape: ModelShape, config: Config, global_batch: int, stage: int, *,
                transient_grads: bool, hold_logits: bool, unit: tuple[float, int] | None = None,
                rt: RuntimeMemory | None = None) -> dict[str, float]:
    """``{"kept", "peak"}`` of one micro-batch on (virtual) ``stage``; see the module docstring.
    ``transient_grads``: the weight gradients backward makes are temporaries (not ``.grad``);
    ``unit``: ZeRO-3's ``(elements of a unit, layers in it)``, whose flat gradient backward assembles;
    ``hold_logits``: the caller holds this micro-batch's logits through backward (counted in kept);
    ``rt``: a GPU runtime's conventions (:mod:`~workbench.advise.runtime_memory`: its attention
    kernel, the float32 vocabulary-parallel loss at any ``tp``), None for the workbench's own.
    The returned dict is shared (remembered): read it, do not change it."""
    n_stages = config.pp * chunks(config)
    return _stage_microbatch(shape, config, global_batch, _layer_counts(shape, n_stages)[stage], stage == 0,
                             stage == n_stages - 1, n_stages > 1, transient_grads, hold_logits, unit, rt)


@lru_cache(maxsize=4096)
def _stage_microbatch(shape: ModelShape, config: Config, global_batch: int, n_layers: int, first: bool,
                      last: bool, piped: bool, transient_grads: bool, hold_logits: bool,
                      unit: tuple[float, int] | None, rt: RuntimeMemory | None = None) -> dict[str, float]:
    """:func:`_microbatch` on a stage of ``n_layers`` layers, the first and / or the last of a
    pipeline (``piped``) or not: all it reads of the stage, so the stages of a pipeline that hold
    as many layers (every one but the first and the last, most often) share one computation.

    Kept: the layers' saved tensors under the recomputation policy (:func:`_layer_bytes`), the
    stage's edges (:func:`_edge_bytes`) and the caller's logits. Peak: the largest of kept and
    backward's busiest moments (the module docstring's list), each a sum of tensors alive at once:
    recomputation's (:func:`_recompute_peak`), the last layer's backward beginning
    (:func:`_backward_start_peak`, with ZeRO-3's unit assembly), the loss's and the head's backward
    (:func:`_loss_backward_peak`)."""
    e, t, sp = ELEMENT_SIZE[config.precision], config.tp, config.sequence_parallel
    g = 4 if config.precision == "fp32" else 2      # a gradient made by backward: the compute dtype
    rep = t if sp else 1
    b = microbatch_size(config, global_batch)
    sb = shape.seq * b
    sbh = sb * shape.hidden
    layer = _layer_bytes(shape, b, t, sp, e, rt.attention if rt is not None else "flash",
                         rt.selective if rt is not None else "attention", rt is not None and rt.compiled,
                         rt is not None and rt.float32_norms, rt is not None and rt.repeat_kv,
                         rt is not None and rt.dtensor_tp)
    policy = config.recompute
    # the vocabulary-parallel loss (float32 softmax): with tensor parallelism, and on a GPU runtime
    # at any tp (Megatron casts the logits to float32 and calls vocab_parallel_cross_entropy)
    vocab_parallel = t > 1 or rt is not None
    vt = shape.padded_vocab(t) / t                   # this rank's vocabulary columns
    logits = e * sb * vt
    # the loss's saved tensors: log_softmax's output; vocabulary-parallel: the float32 softmax,
    # the local target ids (int64) and the mask of the targets this rank holds (bool)
    loss_saved = 4 * sb * vt + 9 * sb if vocab_parallel else logits
    head, edge = _edge_bytes(shape, e, t, sb, sbh, rep, loss_saved, first, last, piped)
    held = logits if (last and hold_logits) else 0.0   # the caller's logits, alive through backward
    # full recomputation of the first k layers only (Config.recompute_layers): the others keep everything
    k = min(config.recompute_layers, n_layers) if policy == "full" and config.recompute_layers else n_layers
    partial = k < n_layers
    kept = k * layer[policy] + (n_layers - k) * layer["none"] + edge + held
    grad_in = e * sbh / rep            # the gradient flowing into the stage's last layer
    # at a layer's MLP output projection: the gradient flowing in, (sequence parallel) its all-gathered
    # copy and the gradient of the ffn-wide input
    work = grad_in + (e * sbh if sp else 0.0) + e * sb * shape.ffn / t
    # a tied head's gradient, waiting in autograd's input buffer for the embedding's
    tied_grad = g * vt * shape.hidden if (shape.tied and first and last) else 0.0
    missing = 0.0   # (partial recomputation, gradients becoming .grad) gradient bytes not yet made at the peak
    if partial and not transient_grads:
        peak, missing = _partial_moment(shape, layer, k, n_layers, kept, edge, head, held, grad_in, work, g, t,
                                        tied_grad)
    elif partial:   # the recomputed layers' moments once backward has left the others (their tensors freed)
        peak = max(kept, _recompute_peak(shape, layer, policy, transient_grads, k, kept - (n_layers - k) * layer["none"],
                                         edge, head, held, grad_in, work, g, t, tied_grad, after_kept=True))
    else:
        peak = _recompute_peak(shape, layer, policy, transient_grads, n_layers, kept, edge, head, held, grad_in,
                               work, g, t, tied_grad)
    if policy != "full" or transient_grads:
        # what the last layer's backward finds kept: everything, or with full recomputation the other
        # layers' inputs and the last layer recomputed whole
        alive = kept if (policy != "full" or partial) else kept - layer["full"] + layer["none"]
        per_layer = layer["none"] if partial else layer[policy]
        peak = _backward_start_peak(shape, config, per_layer, n_layers, kept, alive, head, grad_in, work, g,
                                    tied_grad if transient_grads else 0.0, first, piped, transient_grads, unit, peak)
    if last and partial and not transient_grads:   # the loss's backward too, by activations less gradients to come
        loss = _loss_backward_peak(config, shape.hidden, sb, vt, logits, loss_saved, vocab_parallel, g,
                                   transient_grads, rt, kept, 0.0)
        every = n_layers * g * sum(shape.layer_tensors(t))   # no gradient made yet
        if loss - every > peak - missing:
            peak, missing = loss, every
    elif last:
        peak = _loss_backward_peak(config, shape.hidden, sb, vt, logits, loss_saved, vocab_parallel, g,
                                   transient_grads, rt, kept, peak)
    return {"kept": kept, "peak": peak, "missing": missing}


def _partial_moment(shape: ModelShape, layer: dict[str, float], k: int, n_layers: int, kept: float, edge: float,
                    head: float, held: float, grad_in: float, work: float, g: int, t: int,
                    tied_grad: float) -> tuple[float, float]:
    """``(activations, gradient bytes not yet made)`` at the busiest moment of a stage whose first
    ``k`` of ``n_layers`` layers are recomputed whole, where the new gradients become ``.grad`` as
    backward goes (model state made along the way): of the end of forward, the last layer's
    backward beginning (it kept everything), the last recomputed layer's backward (the layers after
    it freed, their gradients made, the gradient they left beside the one flowing in) and the first
    layer's, the one with the most in all -- activations less the gradients still to come."""
    g_layer = g * sum(shape.layer_tensors(t))
    every = n_layers * g_layer
    recomputed = layer["none"] + edge - head + held + work + tied_grad
    moments = [(kept, every), (kept - head + work, every),
               ((k - 1) * layer["full"] + recomputed + grad_in, k * g_layer),
               (recomputed + (grad_in if k == 1 else 0.0), g_layer)]
    return max(moments, key=lambda moment: moment[0] - moment[1])


def _edge_bytes(shape: ModelShape, e: int, t: int, sb: float, sbh: float, rep: int, loss_saved: float,
                first: bool, last: bool, piped: bool) -> tuple[float, float]:
    """``(head, edge)``: what the head keeps on the last stage (the final norm's input, output and
    statistics, and the loss's saved tensors), and all the stage keeps beyond its layers -- the
    head's, a pipeline stage's output kept for its backward, the vocabulary-parallel embedding's
    local ids (int64) and mask (bool) on the first stage."""
    stats = (2 if shape.norm == "layernorm" else 1) * e * sb / rep
    head = (e * 2 * sbh / rep + stats + loss_saved) if last else 0.0   # final norm's input, output, statistics
    edge = head
    if piped and not last:
        edge += e * sbh / rep          # the pipeline keeps the stage's output for its backward
    if first and t > 1:
        edge += 9 * sb                 # the vocabulary-parallel embedding's local ids (int64) and mask (bool)
    return head, edge


def _recompute_peak(shape: ModelShape, layer: dict[str, float], policy: str, transient_grads: bool, n_layers: int,
                    kept: float, edge: float, head: float, held: float, grad_in: float, work: float, g: int, t: int,
                    tied_grad: float, after_kept: bool = False) -> float:
    """Backward's busiest moment where it recomputes (``kept`` where it does not). Full, gradients
    becoming ``.grad``: a recomputed layer's backward (its MLP's first product, ``work``) beside the
    other layers' inputs and a tied head's gradient waiting for the embedding's. New gradients become
    model state as backward goes, so the meter's peak is where activations and the gradients made so
    far are largest together: at the last layer if a layer's input outweighs its gradients (then every
    other input is still kept), else at the first (no other input left; the other layers' gradients
    made). Full, transient gradients: every layer's input, the first recomputed layer and the gradient
    into it. Selective: the last layer's attention core recomputed beside the kept tensors.
    ``after_kept`` (transient gradients, full recomputation of the first ``n_layers`` layers only,
    the layers after them keeping everything): backward reaches the first recomputation from a
    layer that kept everything, whose input gradient is then alive beside the one flowing in
    (with gradients becoming ``.grad``, :func:`_partial_moment` weighs the moments instead)."""
    if policy == "full" and not transient_grads:
        g_layer = g * sum(shape.layer_tensors(t))
        others = (n_layers - 1) * layer["full"] if layer["full"] >= g_layer else 0.0
        return max(kept, others + layer["none"] + edge - head + held + work + tied_grad)
    if policy == "full":
        extra = grad_in if after_kept else 0.0
        return max(kept, n_layers * layer["full"] + layer["none"] + grad_in + edge - head + held + extra)
    if policy == "selective":
        core = layer["none"] - layer["selective"] + grad_in
        return max(kept, kept - head + core + 2 * grad_in)
    return kept


def _backward_start_peak(shape: ModelShape, config: Config, per_layer: float, n_layers: int, kept: float,
                         alive: float, head: float, grad_in: float, work: float, g: int, waiting: float, first: bool,
                         piped: bool, transient_grads: bool, unit: tuple | None, peak: float) -> float:
    """``peak`` raised to the last layer's backward beginning (the MLP's output projection): beside
    everything ``alive`` but the head's tensors, the gradient flowing in, (sequence parallel) its
    all-gathered copy, the gradient of the ffn-wide input (``work``) and -- when they are temporaries
    -- the weight's and bias's new gradients and the tied head's gradient ``waiting`` for the
    embedding's (a Llama-shaped model has no biases); then ZeRO-3's unit assembly
    (:func:`_zero3_assembly_peak`). ``per_layer``: a layer's kept bytes under the policy."""
    h, ffn, t = shape.hidden, shape.ffn, config.tp
    if transient_grads:
        work += g * (h * ffn / t + (h if shape.bias else 0)) + waiting
    peak = max(peak, alive - head + work)
    if unit is not None and config.dp > 1:
        peak = _zero3_assembly_peak(per_layer, n_layers, kept, alive, head, grad_in, work, g, waiting, unit, first,
                                    piped, peak)
    return peak


def _zero3_assembly_peak(per_layer: float, n_layers: int, kept: float, alive: float, head: float, grad_in: float,
                         work: float, g: int, waiting: float, unit: tuple, first: bool, piped: bool,
                         peak: float) -> float:
    """``peak`` raised to ZeRO-3's assembly of a unit's flat gradient, once backward has left the unit
    (autograd runs the slices' backward after the unit's own nodes, whose sequence numbers are
    higher): its layers' activations are freed (a pipeline stage's received input is not: the
    schedule holds it until the backward ends); alive are the gradient flowing on, the unit's weight
    gradients not yet placed (all but its last two tensors', placed first), and three unit-sized flat
    tensors (the running sum, the next zero-padded slice, their sum). The unit before it in
    backward's order may still be in its asynchronous reduce-scatter, its flat gradient with it: so
    also the next unit's moments, one layer fewer kept, plus that gradient. ``unit``: ``(elements,
    layers in it, elements placed first)``."""
    u, per_unit, placed = g * unit[0], unit[1], g * unit[2]
    rest = kept - head - per_unit * per_layer + (grad_in if (piped and not first) else 0.0)
    assembly = rest + grad_in + 3 * u + (u - placed) + waiting
    peak = max(peak, assembly)
    if n_layers > per_unit:
        fewer = per_unit * per_layer
        peak = max(peak, assembly - fewer + u, alive - head + work - fewer + u)
    return peak


def _loss_backward_peak(config: Config, h: int, sb: float, vt: float, logits: float, loss_saved: float,
                        vocab_parallel: bool, g: int, transient_grads: bool, rt: RuntimeMemory | None, kept: float,
                        peak: float) -> float:
    """``peak`` raised to the last stage's loss and head backward. The loss's: vocabulary-parallel,
    the float32 gradient of the logits and the row indices (int64); else nll_loss's gradient and
    log_softmax's, both logits-sized; on a GPU runtime its busiest moment in place of what it saved:
    the logits in the compute dtype beside the float32 logits-sized tensors alive at once
    (``rt.loss_float32_copies``: Megatron 1, the cast that becomes the saved softmax in place and, in
    backward, the logits' gradient in place, cast back to 16 bits: the same bytes) and the row
    indices. Then the head's: the logits' gradient, the input's gradient (all of it) and, with
    sequence parallelism, its sequence blocks made contiguous for the reduce-scatter and that one's
    output (the input re-gathered for the weight's gradient comes after them and is no larger); the
    head's weight gradient if transient."""
    e, t, sp = ELEMENT_SIZE[config.precision], config.tp, config.sequence_parallel
    sbh = sb * h
    loss_work = (4 * sb * vt + 8 * sb + (e * sb * vt if e != 4 else 0.0)) if vocab_parallel else 2 * logits
    if rt is not None:
        copies = rt.loss_float32_copies - (1 if e == 4 else 0)    # float32 logits need no cast
        loss_work = e * sb * vt + 4 * copies * sb * vt + 8 * sb - loss_saved
    head_work = logits + e * sbh + (e * sbh + e * sbh / t if sp else 0.0) + (g * vt * h if transient_grads else 0.0)
    return max(peak, kept + loss_work, kept - loss_saved + head_work)


def activation_bytes_per_microbatch(shape: ModelShape, config: Config, global_batch: int,
                                    stage: int, runtime_memory: RuntimeMemory | None = None) -> dict[str, float]:
    """``{"kept", "peak"}``: bytes one micro-batch leaves on (virtual) ``stage`` for its backward,
    and the most it needs at once during that backward (see the module docstring). Its weight
    gradients are temporaries when the strategy copies them (:func:`_grads_are_transient`) or
    when they accumulate over micro-batches; without a pipeline the caller's logits are kept --
    except on a GPU runtime (``runtime_memory``, :mod:`~workbench.advise.runtime_memory`), whose
    loss keeps its float32 softmax and whose caller lets the logits go."""
    shape = ModelShape.coerce(shape, "shape")
    accumulating = config.microbatches > 1
    hold = config.pp == 1 and runtime_memory is None
    return dict(_microbatch(shape, config, global_batch, stage,
                            transient_grads=_grads_are_transient(config) or accumulating, hold_logits=hold,
                            unit=_zero3_unit(shape, config), rt=runtime_memory))


def _zero3_unit(shape: ModelShape, config: Config) -> tuple[float, int, float] | None:
    """ZeRO-3's unit whose flat gradient backward assembles at a layer: ``(elements, layers in it,
    elements of its last two tensors)`` (None without ZeRO-3): a block, with or without a pipeline
    (see :func:`_fsdp_units`)."""
    if config.zero != 3 or config.dp == 1:
        return None
    return _block_unit(shape, config.tp)


@lru_cache(maxsize=1024)
def _block_unit(shape: ModelShape, tp: int) -> tuple[float, int, float]:
    """:func:`_zero3_unit` of a block on one of ``tp`` ranks, remembered (asked for per stage)."""
    tensors = shape.layer_tensors(tp)
    return float(sum(tensors)), 1, float(sum(tensors[-2:]))


def _weight_gradient_inputs(shape: ModelShape, config: Config, global_batch: int, stage: int) -> float:
    """Bytes a zero-bubble B keeps for its W beyond the activations
    (:mod:`workbench.parallel.pipeline_backward`): the gradient flowing out of every deferred
    matrix product -- per layer the query/key/value projection's (``(h + 2k)/t`` wide), the
    attention projection's (``h``: a row-parallel product's output is whole, its gradient
    all-gathered under sequence parallelism), the MLP's up projection's (``ffn/t``, twice gated)
    and its down projection's (``h``) -- and on the last stage the head's
    (the logits' gradient, float32 when vocabulary-parallel), held from B until W."""
    e, t = ELEMENT_SIZE[config.precision], config.tp
    sb = shape.seq * microbatch_size(config, global_batch)
    h = shape.hidden
    # (a row-parallel product's output is the full h wide, its gradient all-gathered under sequence parallelism)
    per_layer = e * sb * ((h + 2 * shape.kv_dim) / t + 2 * h + (2 if shape.gated else 1) * shape.ffn / t)
    n_stages = config.pp * chunks(config)
    out = _layer_counts(shape, n_stages)[stage] * per_layer
    if stage == n_stages - 1:
        out += (4 if t > 1 else e) * sb * shape.padded_vocab(t) / t
    return out


def _deferred_weight_bytes(shape: ModelShape, config: Config, global_batch: int, stage: int) -> float:
    """``M_W``: what a micro-batch holds between its B and its W (Qi et al. 2023's ``M_W``). After B
    the pipeline lets go of every saved tensor W does not read, keeping the inputs of the deferred
    products -- per layer the query/key/value projection's and the MLP's up projection's (the norms'
    outputs: ``h``, or this rank's ``h/t`` sequence shard under sequence parallelism, which W
    all-gathers again), the attention projection's (``h/t``) and the down projection's
    (``ffn/t``), and on the last stage the head's (the final norm's output) -- beside the gradients
    of their outputs (:func:`_weight_gradient_inputs`)."""
    e, t = ELEMENT_SIZE[config.precision], config.tp
    rep = t if config.sequence_parallel else 1
    sb = shape.seq * microbatch_size(config, global_batch)
    h = shape.hidden
    n_stages = config.pp * chunks(config)
    inputs = _layer_counts(shape, n_stages)[stage] * e * sb * (2 * h / rep + h / t + shape.ffn / t)
    if stage == n_stages - 1:
        inputs += e * sb * h / rep
    return inputs + _weight_gradient_inputs(shape, config, global_batch, stage)


def _pipeline_activations(shape: ModelShape, config: Config, global_batch: int,
                          rt: RuntimeMemory | None = None) -> list[float]:
    """Most bytes of activations on each pipeline rank of a one-stage-per-rank schedule: the
    rank's action list (with its messages, :func:`~workbench.parallel.pipeline_schedules.with_comms`)
    replayed. At each backward: the micro-batches still alive (forwarded, not yet backwarded) kept
    whole, the one in backward at its peak (its weight gradients temporaries unless they become
    ``.grad``: the rank's first backward with plain gradients), the receives the pipeline has
    posted for the next compute action (``e sbh`` each, ``/t`` with sequence parallelism), on a
    stage after the first the input gradient the previous backward sent (held until the pipeline
    sees it delivered, which it checks between compute actions), and on the last stage the logits
    of every micro-batch forwarded so far (the step returns them). What a rank keeps per
    micro-batch depends on its layers and on whether it is the first or the last, so it is
    computed once for the ranks in between that hold as many layers (most of them). On a GPU
    runtime (``rt``) the last stage computes each micro-batch's loss and keeps the loss, not the
    logits: no logits beyond the one micro-batch in its loss."""
    e = ELEMENT_SIZE[config.precision]
    rep = config.tp if config.sequence_parallel else 1
    b = microbatch_size(config, global_batch)
    message = e * shape.seq * b * shape.hidden / rep
    logits = e * shape.seq * b * shape.padded_vocab(config.tp) / config.tp if rt is None else 0.0
    transient = _grads_are_transient(config)
    unit = _zero3_unit(shape, config)
    # the end of a split B, at the first layer's first product (where MemoryMeter finds the peak): beside the kept
    # tensors, the gradient along the residual stream and -- one rank -- the query, key and value
    # gradients before they are joined; with tensor parallelism the gradient flowing into the norm
    # and dX = dY W, whole before its all-reduce (or reduce-scatter under sequence parallelism)
    sbh = e * shape.seq * b * shape.hidden
    b_end = sbh + e * shape.seq * b * (shape.hidden + 2 * shape.kv_dim) if config.tp == 1 else 3 * sbh
    layers = _layer_counts(shape, config.pp)
    kinds: dict[tuple[int, bool, bool], tuple] = {}   # (layers, first rank, last rank) -> its sizes
    out = []
    for rank in range(config.pp):
        last = rank == config.pp - 1
        kind = (layers[rank], rank == 0, last)
        if kind not in kinds:
            mb = {first: _microbatch(shape, config, global_batch, rank, transient_grads=transient or not first,
                                     hold_logits=False, unit=unit, rt=rt) for first in (True, False)}
            # a zero-bubble B on a stage fed activations ends holding every deferred product's output
            # gradient beside its activations, then M_W until its W (the first stage's B has no input
            # gradient to compute: its W is the whole backward)
            w_grads = _weight_gradient_inputs(shape, config, global_batch, rank) if rank > 0 else 0.0
            if config.zero == 3 and config.dp > 1:
                # FSDP's parameters are flat 1-D shards, and the split defers only matrices: B does the
                # whole backward, as in 1F1B
                w_grads = 0.0
            m_w = _deferred_weight_bytes(shape, config, global_batch, rank) if w_grads else 0.0
            # every count multiplies one of these: where none is negative (always, for a real shape) only
            # the moments that may be the peak are summed, else every moment of the replay
            grows = (mb[True]["kept"], mb[False]["kept"], m_w, message, logits)
            rest = (mb[True]["peak"], mb[False]["peak"], w_grads, b_end)
            monotone = all(0.0 <= c < math.inf for c in grows) and all(math.isfinite(x) for x in rest)
            kinds[kind] = (mb, w_grads, m_w, _replay_frontier if monotone else _replay_counts)
        mb, w_grads, m_w, replay = kinds[kind]
        counts = replay(config.schedule, config.pp, config.microbatches, rank, bool(w_grads))
        out.append(_replay_peak(counts, mb, message, logits, last, m_w, w_grads, b_end))
    return out


def _replay_peak(counts: tuple, mb: dict, message: float, logits: float, last: bool, m_w: float,
                 w_grads: float, b_end: float) -> float:
    """The largest of the replay's moments (:func:`_replay_counts`), each summed in the replay's
    order of operations; ``0.0`` if none is larger."""
    held_ops, moments = counts
    held = [0.0]
    for op in held_ops:   # the first stage's received gradients, added and let go one by one
        held.append(held[-1] + message if op > 0 else held[-1] - message)
    peak = 0.0
    for moment, first, live, pending, posted, sent, forwarded, h in moments:
        posted *= message
        if moment == "F":
            value = live * mb[True]["kept"] + pending * m_w + posted + held[h] \
                + (forwarded * logits if last else 0.0)
        elif moment == "W":
            one = mb[first]
            value = (live - 1) * one["kept"] + one["peak"] + posted + held[h]
        else:
            one = mb[first]
            others = pending * m_w + posted + (message if sent else 0.0) + (forwarded * logits if last else 0.0)
            if moment == "B":
                value = (live - 1) * one["kept"] + one["peak"] + others
            else:     # "B end": ``live`` counts the micro-batch whose B just ended
                value = live * one["kept"] + w_grads + b_end + others
        peak = max(peak, value)
    return peak


def _replay_counts(schedule: str, p: int, m: int, rank: int, split_w: bool) -> tuple[tuple, tuple]:
    """Rank ``rank``'s replay (:func:`_pipeline_activations`) as counts, the same for every model and
    batch: ``(held_ops, moments)``. ``held_ops``: +1 / -1 where the first stage takes in / lets go of
    a received gradient (``held``); ``moments``: for each moment that may be the peak, ``(kind,
    first, live, pending, posted, sent, forwarded, held_id)`` -- ``"F"`` (a forward: ``live``
    micro-batches kept whole), ``"W"`` (the first stage's W: the whole backward), ``"B"`` (a
    backward at its peak), ``"B end"`` (the end of a split B); ``first``: the rank's first backward
    (its gradients become ``.grad``); ``pending``: micro-batches between their B and their W;
    ``posted``: receives posted; ``sent``: the previous backward's input gradient not yet seen
    delivered; ``forwarded``: micro-batches forwarded so far (their logits, on the last stage);
    ``held_id``: how many of ``held_ops`` are done. ``split_w``: the stage defers W's products (a
    zero-bubble schedule fed activations, not under ZeRO-3)."""
    last = rank == p - 1
    live = forwarded = 0
    pending = 0      # micro-batches between their B and their W, M_W bytes each
    held_ops: list[int] = []   # the first stage's output gradients received for a W still to run
    first = True
    moments = []
    for kind, posted, deferred in _replay_events(schedule, p, m, rank):
        if kind == "F":
            live += 1
            forwarded += 1
            moments.append(("F", True, live, pending, posted, False, forwarded if last else 0, len(held_ops)))
        elif kind == "B" and deferred and rank == 0:
            held_ops.append(1)    # nothing to do yet: W will run the whole backward from this gradient
        elif kind == "W" and rank == 0:
            held_ops.append(-1)   # its own: the gradient flowing in, inside its backward's peak
            moments.append(("W", first, live, 0, posted, False, 0, len(held_ops)))
            live -= 1
            first = False
        elif kind == "B":
            # a stage after the first sent the previous backward's input gradient; the pipeline lets
            # go of a sent tensor only once it sees it delivered, between compute actions
            sent = rank > 0 and not first
            seen = forwarded if last else 0
            moments.append(("B", first, live, pending, posted, sent, seen, 0))
            live -= 1
            if deferred and split_w:
                # the end of a split B (the first layer's query, key and value gradients being joined
                # into its projection's): all it was given, and the gradients W needs; then it keeps
                # only M_W until its W (none deferred under ZeRO-3)
                moments.append(("B end", first, live + 1, pending, posted, sent, seen, 0))
                pending += 1
            first = False
        elif kind == "W" and split_w:
            pending -= 1
        # else a W after an unsplit B (ZeRO-3: nothing deferred): the B freed the micro-batch already
    return tuple(held_ops), tuple(moments)


def _counts_at_most(a: tuple, b: tuple) -> bool:
    """Whether every count of moment ``a`` (live, pending, posted, sent, forwarded) is at most ``b``'s."""
    return a[2] <= b[2] and a[3] <= b[3] and a[4] <= b[4] and a[5] <= b[5] and a[6] <= b[6]


@lru_cache(maxsize=1 << 14)
def _replay_frontier(schedule: str, p: int, m: int, rank: int, split_w: bool) -> tuple[tuple, tuple]:
    """:func:`_replay_counts` without the moments that cannot be the peak where every count
    multiplies a finite byte count >= 0 (what :func:`_pipeline_activations` checks): among the
    moments of one kind, first backward or not and ``held`` state, one whose every count is at most
    another's sums no more bytes -- floating-point addition and multiplication by a number >= 0
    never decrease as an operand grows -- so the largest sum, the peak, is the same bit for bit.
    A rank's thousand events come down to a handful; computed once per schedule, pipeline size,
    micro-batch count and rank, as :func:`_replay_events`."""
    held_ops, moments = _replay_counts(schedule, p, m, rank, split_w)
    groups: dict[tuple, list[tuple]] = {}
    for moment in sorted(set(moments)):
        groups.setdefault((moment[0], moment[1], moment[7]), []).append(moment)
    kept = []
    for group in groups.values():
        frontier: list[tuple] = []
        for moment in sorted(group, key=lambda x: x[2:7], reverse=True):   # a dominating one comes first
            if not any(_counts_at_most(moment, other) for other in frontier):
                frontier.append(moment)
        kept += frontier
    used = max((x[7] for x in kept), default=0)
    return held_ops[:used], tuple(kept)


@lru_cache(maxsize=4096)
def _replay_events(schedule: str, p: int, m: int, rank: int) -> tuple[tuple[str, int, bool], ...]:
    """Rank ``rank``'s compute actions as the memory replay reads them: ``(kind, receives posted
    before the next compute action, whether its W comes later)``. The same for every model and
    batch, so computed once per schedule, pipeline size and micro-batch count (a search prices
    thousands of configurations that share a few of these)."""
    actions = _actions_with_comms(schedule, p, m)[rank]
    compute = [j for j, a in enumerate(actions) if a.kind in ("F", "B", "W")]
    split = {a.microbatch for a in actions if a.kind == "W"}    # zero bubble: W frees what B left
    events = []
    for k, j in enumerate(compute):
        nxt = compute[k + 1] if k + 1 < len(compute) else len(actions)
        posted = sum(1 for x in actions[j + 1:nxt] if x.kind == "recv")
        events.append((actions[j].kind, posted, actions[j].microbatch in split))
    return tuple(events)


@lru_cache(maxsize=512)
def _actions_with_comms(schedule: str, p: int, m: int) -> tuple[tuple, ...]:
    return tuple(tuple(a) for a in schedules.with_comms([list(a) for a in _actions(schedule, p, m)], p))


# ----------------------------------------------------------------------------------- model state
@lru_cache(maxsize=1024)
def _zero_buckets(tensors: tuple[int, ...]) -> tuple[int, ...]:
    """Sizes of :class:`~workbench.parallel.zero.ShardedOptimizer`'s flat buckets (elements): its
    own :func:`~workbench.parallel.buckets.assign_buckets` on the tensors (meta tensors: no memory)."""
    params = [torch.empty(n, device="meta") for n in tensors]
    return tuple(sum(tensors[i] for i in idx) for idx in assign_buckets(params, ZERO2_BUCKET_BYTES))


@lru_cache(maxsize=4096)
def _zero2_open_buckets(shape: ModelShape, config: Config, stages: tuple[int, ...], n_stages: int) -> int:
    """Elements of ZeRO-2's flat gradient buffers alive when the last layer's backward begins:
    :class:`~workbench.parallel.zero.ShardedOptimizer` allocates a bucket's buffer (padded to a
    multiple of ``dp``) at its first gradient and frees them all at the end of backward; by then
    only the final norm's (and an untied head's) gradients are complete, on the last stage."""
    tensors = [n for s in stages for n in shape.stage_tensors(n_stages, s, config.tp)]
    if n_stages - 1 not in stages:
        return 0
    norms = 2 if (shape.norm == "layernorm" and shape.bias) else 1
    trailing = norms + (1 if (not shape.tied or n_stages > 1) else 0)    # stage_tensors ends with them
    done = set(range(len(tensors) - trailing, len(tensors)))
    params = [torch.empty(n, device="meta") for n in tensors]
    n = config.dp
    return sum(math.ceil(sum(tensors[i] for i in idx) / n) * n
               for idx in assign_buckets(params, ZERO2_BUCKET_BYTES) if done & set(idx))


@lru_cache(maxsize=4096)
def _zero1_step_buffers(shape: ModelShape, config: Config, stages: tuple[int, ...], n_stages: int) -> int:
    """Elements of ZeRO-1's flat buffers at the busiest moment of its step
    (:meth:`~workbench.parallel.zero.ShardedOptimizer.reduce_gradients`): each bucket's gradients
    are copied into a flat buffer (padded to a multiple of ``dp``) and reduce-scattered into this
    rank's chunk, which stays until the update; a bucket's flat buffer is built while the previous
    one is still being reduced. So at bucket ``i + 1``: two flat buffers and the chunks so far."""
    tensors = [n for s in stages for n in shape.stage_tensors(n_stages, s, config.tp)]
    n = config.dp
    flats = [math.ceil(b / n) * n for b in _zero_buckets(tuple(tensors))]
    busiest = 0
    for i, flat in enumerate(flats):
        previous = flats[i - 1] if i else 0            # still being reduced
        chunks = sum(flats[:i + 1]) // n                # this rank's reduced chunks so far
        busiest = max(busiest, previous + flat + chunks)
    return busiest


@lru_cache(maxsize=4096)
def _fsdp_units(shape: ModelShape, config: Config, stages: tuple[int, ...], n_stages: int) -> tuple[int, ...]:
    """Sizes of :class:`~workbench.parallel.fsdp.FullyShardedDataParallel`'s units (elements), the
    root first: each block of the wrapped module one unit, the rest (embeddings, final norm, head)
    the root -- 0 on a pipeline stage that holds only blocks, which then has no root unit."""
    layer = sum(shape.layer_tensors(config.tp))
    if config.pp > 1:
        counts = shape.layers_per_stage(n_stages)
        root = sum(sum(shape.stage_tensors(n_stages, s, config.tp)) - counts[s] * layer for s in stages)
        return (root,) + (layer,) * sum(counts[s] for s in stages)
    return (shape.parameters(config.tp) - shape.layers * layer,) + (layer,) * shape.layers


def model_state(shape: ModelShape, config: Config, stages: list[int], optimizer: str = "adam") -> dict[str, float]:
    """Bytes of parameters, gradients and optimizer state on a rank holding (virtual) ``stages``.

    float32 Adam: exactly what the workbench's strategies hold -- the ZeRO formula on the rank's
    tensors, plus the padding of each flat bucket (ZeRO-1/2) or unit (ZeRO-3) to a multiple of
    ``dp`` and Adam's 4-byte step counter per tensor it updates (a module's tensors, or one flat
    chunk per bucket or unit). Otherwise :func:`~workbench.parallel.zero_memory.model_state_per_rank`
    (mixed precision: the paper's ``2 + 2 + 12`` bytes per parameter)."""
    return dict(_model_state(shape, _state_config(config), tuple(stages), optimizer))


def _state_config(config: Config) -> Config:
    """``config`` as model state and the ZeRO buffers read it (:func:`_model_state`,
    :func:`_fsdp_units`, :func:`_zero1_step_buffers`, :func:`_zero2_open_buckets`): the data,
    tensor and pipeline sizes, the ZeRO stage, the precision and how the schedule places stages
    (one per rank, interleaved or ZBV); micro-batches, sequence parallelism and recomputation at
    their defaults. Their caches then hold one entry for the configurations that differ only in
    those, the dozen a search tries for every split and ZeRO stage."""
    placement = config.schedule if config.schedule in ("interleaved", "zbv") else "1f1b"
    v = config.virtual_stages if placement == "interleaved" else 2
    return Config(dp=config.dp, tp=config.tp, pp=config.pp, zero=config.zero, schedule=placement,
                  precision=config.precision, virtual_stages=v, shard_group=config.shard_group)


@lru_cache(maxsize=4096)
def _model_state(shape: ModelShape, config: Config, stages: tuple[int, ...], optimizer: str) -> dict[str, float]:
    """:func:`model_state`, remembered per :func:`_state_config`; the dict is shared: read it only."""
    n_stages = config.pp * chunks(config)
    tensors = [n for s in stages for n in shape.stage_tensors(n_stages, s, config.tp)]
    psi, n = sum(tensors), config.shard_size       # ZeRO-3 under hybrid sharding: the shard group
    zero = config.zero if n > 1 else 0
    if config.precision != "fp32" or optimizer != "adam":
        state = model_state_per_rank(psi, n, zero, optimizer, _ZERO_PRECISION[config.precision])
        return {"parameters": state["params"], "gradients": state["grads"], "optimizer": state["optimizer"]}
    if zero == 0:
        return {"parameters": 4.0 * psi, "gradients": 4.0 * psi, "optimizer": 8.0 * psi + STEP_BYTES * len(tensors)}
    if zero in (1, 2):
        shards = [math.ceil(b / n) for b in _zero_buckets(tuple(tensors))]
        return {"parameters": 4.0 * n * sum(shards),                   # the padded flat buffers
                "gradients": 4.0 * (psi if zero == 1 else sum(shards)),
                "optimizer": 8.0 * sum(shards) + STEP_BYTES * len(shards)}
    shards = [math.ceil(u / n) for u in _fsdp_units(shape, config, stages, n_stages) if u > 0]
    return {"parameters": 4.0 * sum(shards), "gradients": 4.0 * sum(shards),
            "optimizer": 8.0 * sum(shards) + STEP_BYTES * len(shards)}


# ----------------------------------------------------------------------------------- per rank
@lru_cache(maxsize=1024)
def _rank_states(shape: ModelShape, layout: Config, optimizer: str) -> tuple[tuple[tuple[int, ...], dict, int], ...]:
    """Per pipeline rank of ``layout`` (a :func:`_state_config`): ``(its stages, its model state
    (:func:`model_state`), the elements its ZeRO stage holds in buffers)`` -- ZeRO-3's gathered
    units, ZeRO-2's open gradient buckets, ZeRO-1's step buffers, 0 for DDP. None of it depends
    on the micro-batches: one entry per layout, shared by the configurations that differ only in
    micro-batches, sequence parallelism or recomputation (the dicts too: read them only)."""
    n_stages = layout.pp * chunks(layout)
    zero = layout.zero if layout.dp > 1 else 0
    out = []
    for stages in _stages_by_rank(layout.pp, chunks(layout), "v" if layout.schedule == "zbv" else "loop"):
        if zero == 3:
            units = _fsdp_units(shape, layout, stages, n_stages)
            root, block = units[0], max(units[1:], default=0)
            # gathered while backward runs: two blocks (the one running and the one prefetched; a
            # stage of one block has one), and the root where it holds the head, whose backward
            # needs the weight (gathered first, it stays until the root's gradient is reduced at
            # the end); a first pipeline stage's root is its embeddings, whose backward needs only
            # the token ids, so it stays sharded
            head_here = n_stages - 1 in stages
            elements = (root if head_here else 0) + min(2, len(units) - 1) * block
        elif zero == 2:
            elements = _zero2_open_buckets(shape, layout, stages, n_stages)
        elif zero == 1:
            elements = _zero1_step_buffers(shape, layout, stages, n_stages)
        else:
            elements = 0
        out.append((stages, _model_state(shape, layout, stages, optimizer), elements))
    return tuple(out)


def _communicators(config: Config) -> int:
    """NCCL communicators a rank of ``config`` creates (:func:`~workbench.advise.runtime_memory.communicators`)."""
    hybrid = 1 if config.shard_size < config.dp else 0   # HSDP: the shard group and the replicas' group
    return runtime.communicators(config.dp, config.tp, config.pp) + hybrid


@lru_cache(maxsize=4096)
def _rank_parameters(shape: ModelShape, n_stages: int, stages: tuple[int, ...], tp: int) -> int:
    """Parameters a rank holding (virtual) ``stages`` keeps on one of ``tp`` ranks."""
    return sum(n for s in stages for n in shape.stage_tensors(n_stages, s, tp))


def memory_by_rank(shape, config: Config, global_batch: int, cluster: Cluster | None = None,
                   optimizer: str = "adam") -> list[dict[str, float]]:
    """Bytes per device by category (and ``"total"``) for each pipeline rank ``0 .. pp-1``."""
    shape = ModelShape.coerce(shape, "shape")
    check_config(config)
    if isinstance(global_batch, bool) or not isinstance(global_batch, int) or global_batch < 1:
        raise ValueError(f"global_batch={global_batch!r}: must be a whole number of sequences >= 1")
    n_stages = config.pp * chunks(config)
    shape.layers_per_stage(n_stages)     # raises when there are more stages than layers
    e = ELEMENT_SIZE[config.precision]
    m = config.microbatches if config.pp > 1 else 1
    piped = config.pp > 1
    several = piped and chunks(config) > 1   # stages per rank
    rt = getattr(cluster, "runtime_memory", None)   # a GPU runtime's terms and conventions, or None
    # each stage's micro-batch, for all but the schedules of one stage per rank (those replay their own)
    per_stage = [activation_bytes_per_microbatch(shape, config, global_batch, s, rt) for s in range(n_stages)] \
        if not piped or several else []
    replayed = _pipeline_activations(shape, config, global_batch, rt) if piped and not several else []
    comms = _communicators(config) * (cluster.communicator_bytes if cluster is not None else 0.0)
    mixed_state = rt is not None and config.precision != "fp32" and optimizer == "adam"
    rows = []
    for r, (stages, state, zero_elements) in enumerate(_rank_states(shape, _state_config(config), optimizer)):
        if mixed_state:   # the framework's mixed precision (runtime_memory.model_state), not the paper's 2 + 2 + 12
            psi = _rank_parameters(shape, n_stages, stages, config.tp)
            state = runtime.model_state(psi, config.shard_size, config.zero, rt)
        if not piped:
            activations = per_stage[0]["peak"]
        elif not several:        # one stage per rank: replay its action list
            activations = replayed[r]
        else:                    # several: their peaks need not coincide, so replay the list
            kept = tuple((s, per_stage[s]["kept"]) for s in stages)
            activations = _peak_live(config.schedule, config.pp, m, r, kept, chunks(config))
            activations += max(per_stage[s]["peak"] - per_stage[s]["kept"] for s in stages)
            b = microbatch_size(config, global_batch)
            sbh = shape.seq * b * shape.hidden / (config.tp if config.sequence_parallel else 1)
            if n_stages - 1 in stages and rt is None:   # the last stage keeps every micro-batch's output
                activations += m * e * shape.seq * b * shape.padded_vocab(config.tp) / config.tp
            if r > 0:                    # the receives posted ahead: the next input, the next output gradient
                activations += e * sbh * (1 if n_stages - 1 in stages else 2)
        buffers = comms
        if config.dp > 1 and config.zero in (2, 3):   # ZeRO-3's gathered units, ZeRO-2's open buckets
            buffers += e * zero_elements
        elif config.dp > 1 and config.zero == 1 and rt is None:
            # the step's reduction (flat buffers, reduced chunks) beside what backward left: the
            # caller's logits (no pipeline). (A GPU runtime's distributed optimizer reduce-scatters
            # and gathers in place in its contiguous buffers: nothing beside them.)
            held = 0.0 if piped else e * shape.seq * microbatch_size(config, global_batch) \
                * shape.padded_vocab(config.tp) / config.tp
            step = e * zero_elements
            # (partial recomputation: less the gradients backward had not made at its peak, which the step has)
            missing = per_stage[0].get("missing", 0.0) if not piped else 0.0
            if held + step > activations + buffers - comms - missing:
                activations, buffers = held, comms + step
        row = {"parameters": state["parameters"], "gradients": state["gradients"], "optimizer": state["optimizer"],
               "activations": float(activations), "buffers": float(buffers)}
        if rt is not None:
            # outside the formulas, filed under buffers: the CUDA context and the caching allocator's
            # reserve beyond its peak of live tensors (NCCL's buffers are in ``comms`` already)
            allocated = row["parameters"] + row["gradients"] + row["optimizer"] + row["activations"] \
                + (row["buffers"] - comms)
            row["buffers"] += rt.context_bytes + rt.allocator_overhead * allocated
        row["total"] = sum(row[c] for c in MEMORY_CATEGORIES)
        rows.append(row)
    return rows


def memory_per_device(shape, config: Config, global_batch: int, cluster: Cluster | None = None,
                      optimizer: str = "adam") -> dict[str, float]:
    """Bytes per device by category (:data:`MEMORY_CATEGORIES`) and ``"total"``, on the worst
    device (the pipeline rank with the largest total). ``shape``: a :class:`ModelShape`, a
    ``GPTConfig`` or a preset name; ``cluster``: for the NCCL communicators' bytes and, where it
    carries one, its GPU runtime's terms (None: neither)."""
    return max(memory_by_rank(shape, config, global_batch, cluster, optimizer), key=lambda row: row["total"])
