"""A GPU as the advisor prices it: one transformer layer, operator by operator.

A datasheet gives two peaks, FLOP/s and memory bytes/s. A training step reaches neither: its
matrix multiplies run at an efficiency that depends on their shape, its elementwise operators
are bound by memory bandwidth, and in eager PyTorch every operator costs the host some
microseconds to launch, which a small kernel cannot hide. :class:`Device` holds the figures that
decide those three regimes, and the functions below price a layer's forward and backward with
them, one operator at a time, the way a profiler's trace would list them.

Matrix multiplies (``gemm_seconds``)
------------------------------------
cuBLAS computes ``C[m, n] = A[m, k] B[k, n]`` in tiles of ``C`` (a CTA tile, 128 x 256 for large
Hopper/Ampere bf16 kernels), each tile on one streaming multiprocessor (SM), the tiles in *waves*
of ``sms`` at a time (NVIDIA, "Matrix Multiplication Background User's Guide": tile and wave
quantization). So the efficiency of a multiply is the product of

* ``ceiling``: the fraction of the dense peak a large, well-shaped multiply reaches (power and
  clock limits, the epilogue): measured, not a datasheet figure;
* tile quantization: ``m n`` over the tiled area ``ceil(m / tm) tm x ceil(n / tn) tn``;
* wave quantization: the tiles over ``ceil(tiles / sms) x sms`` (the last wave runs part-empty);
* the epilogue, ``k / (k + k_half)``: a tile computes its ``tm x tn`` outputs over a main loop
  of ``2 k`` FLOPs each, then writes them (``e`` bytes each) once, whatever ``k``; where the write
  does not overlap the main loop, a multiply's time is ``2 m n k / rate + m n e / bandwidth``,
  i.e. the rate times ``k / (k + k_half)`` with ``k_half = e x rate / (2 x bandwidth)``
  (:func:`epilogue_k`: about 250 on an H100 in bf16, 150 on an A100), the reduction length at
  which writing the result takes as long as computing it. Short reductions (a 128-long one, the
  weight gradient of a few tokens) run far below the ceiling;

and every kernel costs ``kernel_fixed_s`` of GPU time beyond its work (the launch reaching the
GPU, the prologue, the last wave draining: :func:`kernel_seconds`), which a multiply of a few
microseconds cannot hide. On the H100 the two together took the twelve multiplies the calibration
timed (a 512 cube to an 8,192 cube) from 0.33-1.24x of the model's time to 0.86-1.17x
(``docs/benchmarks/2026-11-27-h100-calibration.md``); ``--calibrate --device cuda`` fits the
ceiling and the fixed cost over every shape it times.

best over a few tiles (cuBLAS's heuristics pick smaller tiles for small problems, which fill
the SMs at a lower per-SM rate: :data:`TILES`). A 4,096 x 4,096 x 4,096 multiply lands near the
ceiling; a tensor-parallel shard of a small model's MLP at one sequence, far below it.

Memory-bound operators (``memory_seconds``)
-------------------------------------------
Norms, activations (GeLU, SwiGLU), residual adds with dropout, rotary embeddings, softmax (math
attention), the cross-entropy over the vocabulary, casts and the optimizer's step move bytes and
do little arithmetic: ``bytes / memory_bandwidth`` (the *achieved* bandwidth, a STREAM-like
figure, not the datasheet's). Each operator's bytes are written beside it in
:func:`layer_operators`: forward reads its inputs and writes its output; backward reads the
output's gradient and what forward saved and writes the input's gradient (about twice forward).

Which elementwise kernels run is the framework's (:mod:`workbench.advise.framework`): with
Megatron-style fused kernels (``framework`` None or ``fused``) a norm, an activation or a residual
add is one kernel and one pass; under eager PyTorch each is the separate operators its code calls,
with their real passes (:data:`EAGER_NORM`, :data:`EAGER_ROTARY`: an RMSNorm in float32 moves
about nine times a fused one's bytes in seven kernels), the gated MLP's and the attention's inputs
as separate multiplies, GQA's ``repeat_kv`` copies, and the attention output made contiguous; the
framework's ``selective`` policy says what selective recomputation runs again
(:func:`layer_seconds`). Under ``torch.compile`` (a framework's ``compiled``) the operators are
eager's, but each elementwise one becomes a single generated kernel each way, one pass over its
bytes at the full bandwidth; a rotary through complex numbers stays ATen's kernels, which
Inductor does not generate (``complex_rotary``).

Attention by kernel
-------------------
``flash`` (FlashAttention-2, what Megatron and torchtitan run): one kernel forward, one backward;
its FLOPs (``Q K^T`` and ``A V``, ``4 s^2 h`` per sequence, halved by the causal mask; backward
2.5x forward, as the kernel recomputes the scores) at ``flash_efficiency`` of the peak, lower for
short sequences. ``math``: the scores materialised, two batched multiplies priced as multiplies
over the whole ``s x s`` (no causal skip), a softmax and a dropout over ``heads x s^2`` elements
at memory bandwidth.

Launch overhead
---------------
Each operator eager PyTorch dispatches costs the host ``kernel_overhead_s`` (Python, the
dispatcher, autograd's bookkeeping: Horace He, "Making Deep Learning Go Brrrr From First
Principles", 2022, the *overhead* regime; the CUDA graphs post on the PyTorch blog, 2021). The
profiles take 20 microseconds per operator, from a small GPT block's forward and backward timed on
an H100 host, whose GPU work is negligible, over the 106 ATen operators it dispatched: 21 us
(``docs/benchmarks/2026-11-27-h100-calibration.md``; ``--calibrate --device cuda`` measures it).
Not every dispatched operator is a kernel: views, transposes and gradient accumulation come with
them, so a framework dispatches ``host_ops_per_kernel`` operators per kernel counted here (eager
PyTorch about 2.25, :mod:`workbench.advise.framework`). Launches are asynchronous: the host queues
kernels while the GPU runs earlier ones, so a pass (a layer's forward, its backward) takes
``max(GPU time, kernels x host_ops_per_kernel x kernel_overhead_s)`` (:func:`kernel_seconds`): the
launches hide behind large kernels and set the pace when the kernels are shorter than their launch.
Every micro-batch pays ``microbatch_overhead_s`` more (the training loop's Python per micro-batch,
the loss's scalar, the schedule's bookkeeping). Both are eager PyTorch's figures, not hardware
ones, and shrink under CUDA graphs or ``torch.compile``. This is what makes one sequence per
micro-batch slow, above all where tensor parallelism has already made each kernel small: the same
dispatches, for a sixteenth of the work.

Recomputation, tensor and sequence parallelism
----------------------------------------------
The policies of :mod:`workbench.parallel.recompute`: ``none``; ``selective`` (Korthikanti et al.
2022) runs the attention core's forward again in backward; ``full`` runs the whole layer's
forward again. Tensor parallelism over ``t`` divides every multiply's output (column-parallel)
or reduction (row-parallel) dimension by ``t`` and the heads, the MLP's activation and the
attention by ``t``; the norms, dropouts and residual adds stay on every row unless sequence
parallelism puts them on ``s / t`` rows. The collectives themselves are priced by
:mod:`workbench.advise.timing`, not here.

The profiles (:data:`PROFILES`) cite their figures beside them. Memory: the module prices time
only; what a layer holds is :mod:`workbench.advise.memory_model`'s.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields, replace
from functools import lru_cache

__all__ = ["Device", "PROFILES", "TILES", "epilogue_k", "gemm_efficiency", "gemm_seconds", "memory_seconds", "kernel_seconds",
           "layer_operators", "layer_seconds", "linear_seconds", "head_seconds", "optimizer_seconds", "kernels_per_layer",
           "fsdp_copy_seconds", "EAGER_NORM", "EAGER_ROTARY"]

# (tile rows, tile columns, per-SM rate relative to the large tile): cuBLAS's large Hopper/Ampere
# bf16 tiles, and the smaller ones its heuristics fall back to when the large ones leave SMs idle
# (less reuse of each loaded operand, so a lower rate per SM)
TILES = ((128, 256, 1.0), (256, 128, 1.0), (128, 128, 0.9), (64, 128, 0.75))
# GPU seconds a kernel costs beyond its work: fitted with the ceiling on the H100 calibration's twelve multiplies
# (docs/benchmarks/2026-11-27-h100-calibration.md); the A100 profiles take the same figure
KERNEL_FIXED_S = 2e-6
# eager PyTorch's host time per dispatched ATen operator, and per micro-batch beyond them: the slope
# and intercept of micro-batch time against operators dispatched, the mean of two GPU hosts' lines
# (docs/benchmarks/2026-11-28-h200-layers.md); a one-block probe reads higher, as it carries its own
# loop's per-step costs on few operators
HOST_PER_OPERATOR_S = 16e-6
MICROBATCH_S = 0.6e-3
CAUSAL = 0.5          # a causal flash kernel skips about half the score matrix
# flash attention's efficiency at sequence s: flash_efficiency x s / (s + FLASH_SEQ_HALF). The FlashAttention-2
# release's forward + backward charts (Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png and
# flash2_h100_fwd_bwd_benchmark.png, the paper's Figure 4; causal, head dim 128, 16k tokens a batch) follow this
# curve with 530 (A100: 155, 173, 182, 189 TFLOP/s at 2k, 4k, 8k, 16k) and 580 (H100: 265, 294, 308, 328)
FLASH_SEQ_HALF = 550
FLASH_BACKWARD = 2.5  # flash backward's FLOPs over forward's (it recomputes the scores: 5 products, not 2)
BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
# Device memory a process can use, not the name's "80 GB": an H100 SXM "80 GB" has 80 GiB of HBM3, of which
# nvidia-smi lists 81,559 MiB (e.g. 'NVIDIA H100 80GB HBM3 ... 1MiB / 81559MiB', in many public logs); an A100
# SXM4 80 GB reports torch.cuda.get_device_properties(0).total_memory = 85,056,798,720 bytes, 0.990 of 80 GiB,
# and the same share is taken of the A100 40 GB's and the 96 GB H100's GiB
H100_80GB_BYTES = 81559 * 2**20
A100_80GB_BYTES = 85_056_798_720
# an H200 "141 GB": torch.cuda.get_device_properties(0).total_memory on one H200 SXM
# (docs/benchmarks/2026-11-28-h200-profile.json, measured by workbench advise --calibrate --device cuda)
H200_141GB_BYTES = 150_109_880_320
VISIBLE = A100_80GB_BYTES / (80 * 2**30)
# the optimizer's bytes per parameter it updates (mixed precision as Megatron keeps it: fp32 master
# weights, fp32 gradients and two fp32 Adam moments read, master and moments written, the bf16 copy
# written, the gradient zeroed): 16 + 12 + 2 + 4; in float32 no copy: 32
OPTIMIZER_BYTES = {"fp32": 32, "bf16": 34, "fp16": 34}


@dataclass(frozen=True)
class Device:
    """One accelerator: its peaks, what it achieves, and eager PyTorch's fixed costs on it.

    ``bf16_flops``/``fp16_flops``: dense tensor-core peaks; ``fp32_flops``: float32 without tensor
    cores (PyTorch's default, TF32 off); ``tf32_flops``: with TF32 (0: not used). ``sms``: streaming
    multiprocessors (wave quantization). ``gemm_ceiling``: the fraction of the peak a large, well-shaped
    multiply achieves. ``memory_bandwidth``: achieved HBM bytes/s. ``flash_efficiency``: the fraction
    of the 16-bit peak flash attention achieves at long sequences. ``k_half``: the reduction length at
    which a tile's epilogue takes as long as its main loop (0: derived from the rate and the
    bandwidth, :func:`epilogue_k`). ``kernel_fixed_s``: GPU time every kernel costs beyond its work.
    ``kernel_overhead_s``: the host's
    cost per operator it dispatches (eager PyTorch; a framework dispatches
    :attr:`~workbench.advise.framework.Framework.host_ops_per_kernel` of them per kernel counted
    here). ``microbatch_overhead_s``: fixed cost per micro-batch
    (framework). ``memory_bytes``: device memory. ``attention``: ``"flash"`` or ``"math"``.
    ``source``: where each figure comes from.
    """

    name: str
    bf16_flops: float
    fp16_flops: float
    fp32_flops: float
    sms: int
    gemm_ceiling: float
    memory_bandwidth: float
    memory_bytes: float
    flash_efficiency: float
    kernel_overhead_s: float = HOST_PER_OPERATOR_S
    microbatch_overhead_s: float = MICROBATCH_S
    tf32_flops: float = 0.0
    k_half: float = 0.0
    kernel_fixed_s: float = KERNEL_FIXED_S
    attention: str = "flash"
    source: tuple = ()

    def __post_init__(self) -> None:
        for f in ("bf16_flops", "fp16_flops", "fp32_flops", "memory_bandwidth", "memory_bytes"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"Device({f}={v!r}): must be a finite number > 0, e.g. 989e12 FLOP/s or 3.35e12 B/s")
        for f in ("gemm_ceiling", "flash_efficiency"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 < v <= 1:
                raise ValueError(f"Device({f}={v!r}): a fraction of the peak in (0, 1], e.g. 0.75")
        for f in ("kernel_overhead_s", "microbatch_overhead_s", "tf32_flops", "k_half", "kernel_fixed_s"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"Device({f}={v!r}): must be a finite number >= 0")
        if isinstance(self.sms, bool) or not isinstance(self.sms, int) or self.sms < 1:
            raise ValueError(f"Device(sms={self.sms!r}): the streaming multiprocessors, a whole number >= 1 (H100 "
                             "SXM: 132)")
        if self.attention not in ("flash", "math"):
            raise ValueError(f"Device(attention={self.attention!r}): use 'flash' or 'math'")
        if isinstance(self.source, str):
            object.__setattr__(self, "source", (self.source,))
        object.__setattr__(self, "source", tuple(str(s) for s in self.source))

    def peak(self, precision: str) -> float:
        """Dense peak FLOP/s of a multiply in ``precision`` ("bf16", "fp16", "fp32", "tf32")."""
        if precision == "tf32":
            return self.tf32_flops or self.fp32_flops
        try:
            return {"bf16": self.bf16_flops, "fp16": self.fp16_flops, "fp32": self.fp32_flops}[precision]
        except KeyError:
            raise ValueError(f"Device.peak(precision={precision!r}): use bf16, fp16, fp32 or tf32") from None

    def achieved(self, precision: str) -> float:
        """FLOP/s of a large, well-shaped multiply: the peak times ``gemm_ceiling``."""
        return self.peak(precision) * self.gemm_ceiling

    def with_(self, **changes) -> "Device":
        """A copy with some fields changed (validated again)."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise ValueError(f"Device.with_: unknown field(s) {bad}; fields are {sorted(known)}")
        return replace(self, **changes)

    def to_json(self) -> str:
        """The device as a JSON object (every field; :meth:`from_json` reads it back)."""
        d = asdict(self)
        d["source"] = list(self.source)
        return json.dumps(d, indent=1)

    @classmethod
    def from_json(cls, text) -> "Device":
        """A device from :meth:`to_json`'s text (or the dict it holds)."""
        d = json.loads(text) if isinstance(text, str) else dict(text)
        known = {f.name for f in fields(cls)}
        bad = sorted(set(d) - known)
        if bad:
            raise ValueError(f"Device.from_json: unknown field(s) {bad}; fields are {sorted(known)}")
        d["source"] = tuple(d.get("source", ()))
        return cls(**d)


# ----------------------------------------------------------------------------- one operator

def epilogue_k(device: Device, precision: str = "bf16") -> float:
    """The reduction length at which a multiply's epilogue (writing its ``m x n`` result, ``e``
    bytes each, at the memory bandwidth) takes as long as its main loop (``2 k`` FLOPs per output
    at the achieved rate): ``e x peak x ceiling / (2 x memory_bandwidth)``, or the device's own
    ``k_half`` where it sets one."""
    if device.k_half:
        return device.k_half
    return BYTES.get(precision, 2) * device.achieved(precision) / (2 * device.memory_bandwidth)


def gemm_efficiency(device: Device, m: int, n: int, k: int, batch: int = 1, precision: str = "bf16") -> float:
    """The fraction of the peak a ``batch`` of ``(m x k) @ (k x n)`` multiplies reaches: the ceiling
    times the best tile's tile and wave quantization, times the epilogue's ``k / (k + k_half)``
    (:func:`epilogue_k`)."""
    best = 0.0
    for tm, tn, rate in TILES:
        across, down = -(-m // tm), -(-n // tn)
        tiles = batch * across * down
        tile_q = m * n / (across * tm * down * tn)
        wave_q = tiles / (-(-tiles // device.sms) * device.sms)
        best = max(best, rate * tile_q * wave_q)
    return device.gemm_ceiling * best * k / (k + epilogue_k(device, precision))


def gemm_seconds(device: Device, m: int, n: int, k: int, precision: str, batch: int = 1) -> float:
    """GPU seconds of ``batch`` multiplies ``(m x k) @ (k x n)`` (``2 m n k`` FLOPs each)."""
    if min(m, n, k, batch) <= 0:
        return 0.0
    return 2.0 * m * n * k * batch / (device.peak(precision) * gemm_efficiency(device, m, n, k, batch, precision))


def memory_seconds(device: Device, nbytes: float) -> float:
    """GPU seconds of a memory-bound operator moving ``nbytes`` (read + written)."""
    return nbytes / device.memory_bandwidth


def flash_seconds(device: Device, rows: int, seq: int, width: int, precision: str, backward: bool = False) -> float:
    """GPU seconds of flash attention over ``rows`` sequences of ``seq`` tokens with ``width`` query
    channels (heads x head dim, this rank's share): ``4 rows s^2 width`` FLOPs forward, causal half,
    2.5x that backward, at ``flash_efficiency`` (less at short sequences)."""
    flops = 4.0 * rows * seq * seq * width * CAUSAL * (FLASH_BACKWARD if backward else 1.0)
    rate = device.peak(precision if precision != "fp32" else "bf16") * device.flash_efficiency
    if precision == "fp32":   # no fp32 flash kernel: math attention's efficiency is the better guess
        rate = device.achieved("fp32")
    return flops / (rate * seq / (seq + FLASH_SEQ_HALF))


def kernel_seconds(device: Device, gpu_seconds: float, kernels: int, host_ops: float = 1.0) -> float:
    """Wall seconds of ``kernels`` kernels doing ``gpu_seconds`` of GPU work, launched one after the
    other by the host while the GPU runs the earlier ones, the host dispatching ``host_ops``
    operators per kernel (views, transposes and autograd's bookkeeping come with an eager kernel:
    :attr:`Framework.host_ops_per_kernel <workbench.advise.framework.Framework.host_ops_per_kernel>`)
    at ``kernel_overhead_s`` each: the slower of the two, ``max(gpu_seconds + kernels x
    kernel_fixed_s, kernels x host_ops x kernel_overhead_s)`` (each kernel's fixed GPU cost on the
    GPU's side)."""
    kernels = max(0, kernels)
    return max(gpu_seconds + kernels * device.kernel_fixed_s, kernels * host_ops * device.kernel_overhead_s)


# ----------------------------------------------------------------------------- one layer

def layer_operators(device: Device, shape, rows: int, tp: int = 1, sequence_parallel: bool = False,
                    precision: str = "bf16", framework=None) -> list[tuple[str, str, float, int]]:
    """One layer's operators on one tensor-parallel rank for a micro-batch of ``rows`` sequences:
    ``(name, phase, gpu seconds, kernels)``, ``phase`` "forward", "backward" or "attention" (the
    attention core's forward, which selective recomputation repeats; its backward is under
    "backward"). ``framework`` (:class:`workbench.advise.framework.Framework`; None: Megatron's
    fused kernels): its ``fused`` decides the elementwise operators (:func:`_operators`)."""
    return [op[:4] for op in _operators(device, shape, rows, tp, sequence_parallel, precision, framework)]


# the linear layers a tensor-parallel layer shards by their output (column-parallel) or their input
# (row-parallel): the attention block's q, k, v (or one qkv) and output projection, the MLP's gate and
# up (or one gate-up) and down projection, as _LayerOps names them
ROW_PARALLEL = ("attention out", "mlp down")


@lru_cache(maxsize=1 << 12)
def linear_seconds(device: Device, shape, rows: int, tp: int = 1, sequence_parallel: bool = False,
                   precision: str = "bf16", framework=None) -> dict[str, dict[str, float]]:
    """One layer's linear multiplies on one tensor-parallel rank, GPU seconds per micro-batch, by
    block and role: ``{"attention" | "mlp": {"column" | "row": {"forward", "dgrad", "wgrad"}}}``
    (``dgrad`` the input's gradient, ``wgrad`` the weight's), what asynchronous tensor-parallel
    collectives can run beside (:func:`workbench.advise.timing.async_tp_hidden`)."""
    ops = _LayerOps(device, shape, rows, tp, sequence_parallel, precision, framework)
    ops.attention_block()
    ops.mlp_block()
    out = {block: {role: {"forward": 0.0, "dgrad": 0.0, "wgrad": 0.0} for role in ("column", "row")}
           for block in ("attention", "mlp")}
    for name, (forward, dgrad, wgrad) in ops.linears.items():
        part = out["mlp" if name.startswith("mlp") else "attention"]["row" if name in ROW_PARALLEL else "column"]
        part["forward"] += forward
        part["dgrad"] += dgrad
        part["wgrad"] += wgrad
    return out


# eager PyTorch's elementwise operators as torchtitan's Llama writes them, bytes per element moved
# forward (16-bit activations, e bytes) and kernels: RMSNorm in float32 -- x.float() (r e, w 4),
# pow (r4 w4), mean (r4), add eps and rsqrt (two kernels on a column), mul (r4 w4), type_as (r4 w e),
# * weight (r e w e) -- 28 + 4e bytes, 7 kernels; the rotary embedding of q or k through complex
# float32 -- .float() (r e w4), complex mul by freqs_cis (r4 w4), type_as (r4 w e) -- 16 + 2e, 3 kernels;
# SwiGLU F.silu(w1 x) * (w3 x) -- silu (r e w e), mul (r 2e w e) -- 5e per ffn element, 2 kernels;
# a residual add (r 2e w e), 1 kernel; GQA's repeat_kv (expand + reshape: a copy of k and v to every
# head) and the attention output made contiguous (.transpose(1, 2).contiguous()). Backward moves
# about twice forward's bytes in twice the kernels (autograd's backward of each operator).
EAGER_NORM = (28, 4, 7)      # (fixed bytes, bytes per e, kernels) per element
EAGER_ROTARY = (16, 2, 3)


def _operators(device: Device, shape, rows: int, tp: int, sequence_parallel: bool, precision: str,
               framework) -> list[tuple[str, str, float, int, str]]:
    """:func:`layer_operators` with each operator's kind: "gemm", "attention" or "memory". A layer is
    its attention block (a norm, the projections, the rotary embedding, the attention core, the
    output projection and the residual) then its MLP block (a norm, the up and down projections and
    their activation, the residual), as :class:`_LayerOps` lists them."""
    ops = _LayerOps(device, shape, rows, tp, sequence_parallel, precision, framework)
    ops.attention_block()
    ops.mlp_block()
    return ops.ops


class _LayerOps:
    """One layer's operators on one tensor-parallel rank, appended to ``ops`` as ``(name, phase, gpu
    seconds, kernels, kind)``: each multiply priced by its shape (:func:`gemm_seconds`), each
    elementwise operator by its bytes (:func:`memory_seconds`), the attention core by its kernel.
    ``eager`` (a framework that is not ``fused``): eager PyTorch's operators as torchtitan's Llama
    writes them (:data:`EAGER_NORM`, :data:`EAGER_ROTARY`); else Megatron's fused kernels.
    ``compiled`` (an eager framework under ``torch.compile``): eager's operators, each elementwise
    one a single generated kernel each way (:meth:`elementwise`), the norm one pass, the complex
    rotary eager's."""

    def __init__(self, device: Device, shape, rows: int, tp: int, sequence_parallel: bool, precision: str,
                 framework):
        self.device, self.shape, self.rows, self.t, self.precision = device, shape, rows, tp, precision
        self.e = BYTES[precision]
        self.h, self.f = shape.hidden, shape.ffn
        self.kv = getattr(shape, "kv_dim", self.h)
        self.n = rows * shape.seq                                   # tokens of the micro-batch
        self.rows_h = self.n // tp if sequence_parallel else self.n   # rows the norms and residual adds run on
        self.eager = framework is not None and not framework.fused
        # torch.compile: eager's operators, its elementwise ones fused by Inductor (the complex rotary excepted)
        self.compiled = self.eager and framework.compiled
        self.eager_norm = self.eager and not framework.fused_norm and not self.compiled
        self.eager_rotary = self.eager and (not self.compiled or framework.complex_rotary)
        # the share of the copy bandwidth the framework's elementwise kernels reach
        self.bandwidth_share = framework.elementwise_efficiency if framework is not None else 1.0
        self.ops: list[tuple[str, str, float, int, str]] = []
        self.linears: dict[str, tuple[float, float, float]] = {}   # name: (forward, dgrad, wgrad) seconds

    def gemm(self, name: str, m: int, k: int, out: int) -> None:
        """A linear layer ``(m x k) @ (k x out)``: forward; backward the input's gradient
        ``(m x out) @ (out x k)`` and the weight's ``(k x m) @ (m x out)``."""
        device, precision = self.device, self.precision
        forward = gemm_seconds(device, m, out, k, precision)
        dgrad, wgrad = gemm_seconds(device, m, k, out, precision), gemm_seconds(device, k, out, m, precision)
        self.linears[name] = (forward, dgrad, wgrad)
        self.ops.append((name, "forward", forward, 1, "gemm"))
        self.ops.append((name, "backward", dgrad + wgrad, 2, "gemm"))

    def elementwise(self, name: str, nbytes: float, kernels: int = 1, back_kernels: int | None = None,
                    fused: bool = False, aten: bool = False) -> None:
        """A memory-bound operator moving ``nbytes`` forward and twice that backward, at the framework's
        ``elementwise_efficiency`` of the device's bandwidth (``fused``: one fused kernel, at the full
        bandwidth whatever the framework). Under ``compiled`` an eager operator is one generated kernel
        each way, at the full bandwidth (``nbytes`` then its one pass), unless ``aten``: one Inductor
        leaves to ATen's kernels (a complex rotary)."""
        if self.compiled and not fused and not aten:
            kernels, back_kernels, fused = 1, 1, True
        nbytes = nbytes / (1.0 if fused else self.bandwidth_share)
        self.ops.append((name, "forward", memory_seconds(self.device, nbytes), kernels, "memory"))
        self.ops.append((name, "backward", memory_seconds(self.device, 2 * nbytes),
                         kernels if back_kernels is None else back_kernels, "memory"))

    def norm(self, name: str) -> None:
        """A LayerNorm or RMSNorm: fused, its input in and output out (backward ``dx`` and ``dgamma``);
        eager RMSNorm, float32 inside (:data:`EAGER_NORM`)."""
        e, rows_h, h = self.e, self.rows_h, self.h
        if self.eager_norm and getattr(self.shape, "norm", "layernorm") == "rmsnorm":
            fixed, per_e, k = EAGER_NORM
            self.elementwise(name, (fixed + per_e * e) * rows_h * h, k, 2 * k)
        else:
            self.elementwise(name, 2 * rows_h * h * e, 1, 2, fused=True)  # x in, y out; backward dx and dgamma

    def residual(self) -> None:
        """The block's residual add (eager), or Megatron's fused bias-dropout-add with its dropout mask
        (1 byte per element)."""
        e, rows_h, h = self.e, self.rows_h, self.h
        if self.eager:
            self.elementwise("residual add", 3 * rows_h * h * e)
        else:
            self.elementwise("bias-dropout-add", 3 * rows_h * h * e + rows_h * h, 1, 2)

    def attention_block(self) -> None:
        """The norm, the query/key/value projections (eager Llama: three multiplies), the rotary
        embedding, GQA's repeat of keys and values (eager), the attention core
        (:meth:`attention_core`), the output made contiguous (eager), its projection, the residual."""
        shape, n, h, kv, t, e, eager = self.shape, self.n, self.h, self.kv, self.t, self.e, self.eager
        self.norm("input norm")
        if eager and shape.gated:   # torchtitan's Llama: wq, wk, wv as three multiplies
            self.gemm("q", n, h, h // t)
            self.gemm("k", n, h, kv // t)
            self.gemm("v", n, h, kv // t)
        else:
            self.gemm("qkv", n, h, (h + 2 * kv) // t)
        if getattr(shape, "positions", "learned") == "rope":
            if self.eager_rotary:   # eager's, or under compile a complex rotary Inductor leaves to ATen
                fixed, per_e, k = EAGER_ROTARY
                self.elementwise("rotary", (fixed + per_e * e) * n * (h + kv) // t, 2 * k, 4 * k, aten=True)
            else:
                self.elementwise("rotary", 2 * n * (h + kv) // t * e, 2, fused=True)  # q and k rotated
        if eager and kv < h:   # repeat_kv: k and v copied out to every query head
            self.elementwise("repeat_kv", 2 * n * (kv + h) // t * e, 2)
        self.attention_core()
        if eager:              # the attention output made contiguous for the projection
            self.elementwise("attention output copy", 2 * n * h // t * e)
        self.gemm("attention out", n, h // t, h)
        self.residual()

    def attention_core(self) -> None:
        """Softmax(Q K^T) V over this rank's heads: the device's flash kernel (forward one kernel,
        backward three), or the math path -- the scores' batched multiply, scale-mask-softmax fused
        (float32 inside), dropout on the probabilities, the multiply by V, and backward's four
        multiplies and elementwise passes."""
        device, rows, s, precision, e = self.device, self.rows, self.shape.seq, self.precision, self.e
        ops, heads_width = self.ops, self.h // self.t
        if device.attention == "flash":
            ops.append(("flash attention", "attention", flash_seconds(device, rows, s, heads_width, precision), 1,
                        "attention"))
            ops.append(("flash attention", "backward",
                        flash_seconds(device, rows, s, heads_width, precision, backward=True), 3, "attention"))
            return
        heads = max(1, self.shape.heads // self.t)
        d = self.h // self.shape.heads
        scores = rows * heads * s * s
        ops.append(("scores Q K^T", "attention", gemm_seconds(device, s, s, d, precision, rows * heads), 1,
                    "attention"))
        # scale, causal mask and softmax fused (fp32 inside), dropout on the probabilities
        ops.append(("softmax", "attention", memory_seconds(device, 2 * scores * e), 1, "attention"))
        ops.append(("attention dropout", "attention", memory_seconds(device, 2 * scores * e + scores), 1,
                    "attention"))
        ops.append(("probs @ V", "attention", gemm_seconds(device, s, d, s, precision, rows * heads), 1, "attention"))
        ops.append(("math attention", "backward",
                    2 * gemm_seconds(device, s, s, d, precision, rows * heads)
                    + 2 * gemm_seconds(device, s, d, s, precision, rows * heads)
                    + memory_seconds(device, 2 * (4 * scores * e + scores)), 6, "attention"))

    def mlp_block(self) -> None:
        """The norm, the up projection (gated: gate and up; eager Llama as two multiplies), the
        activation (GELU, or SwiGLU reading both halves), the down projection, the residual."""
        shape, n, h, f, t, e = self.shape, self.n, self.h, self.f, self.t, self.e
        self.norm("post-attention norm")
        if self.eager and shape.gated:
            self.gemm("mlp gate (w1)", n, h, f // t)
            self.gemm("mlp up (w3)", n, h, f // t)
            # eager: silu (r e w e), mul (r 2e w e); compiled: one kernel reading both, writing the product
            self.elementwise("silu, mul", (3 if self.compiled else 5) * n * (f // t) * e, 2)
        else:
            self.gemm("mlp up" + (" (gate, up)" if shape.gated else ""), n, h, (2 if shape.gated else 1) * f // t)
            act = (3 if shape.gated else 2) * n * (f // t) * e                   # SwiGLU reads two halves
            self.elementwise("swiglu" if shape.gated else "gelu", act)
        self.gemm("mlp down", n, f // t, h)
        self.residual()


def kernels_per_layer(device: Device, shape, rows: int = 1, tp: int = 1, sequence_parallel: bool = False,
                      precision: str = "bf16", framework=None) -> dict[str, int]:
    """Kernels one layer launches per micro-batch: ``{"forward", "backward"}``."""
    out = {"forward": 0, "backward": 0}
    for _, phase, _, k in layer_operators(device, shape, rows, tp, sequence_parallel, precision, framework):
        out["backward" if phase == "backward" else "forward"] += k
    return out


def _host_ops(framework) -> float:
    """Operators the host dispatches per kernel counted here: the framework's (None: 1)."""
    return 1.0 if framework is None else framework.host_ops_per_kernel


@lru_cache(maxsize=1 << 14)
def layer_seconds(device: Device, shape, rows: int, tp: int = 1, sequence_parallel: bool = False,
                  recompute: str = "none", precision: str = "bf16", framework=None) -> dict[str, float]:
    """One layer's wall seconds per micro-batch on one tensor-parallel rank: ``{"forward", "backward",
    "recompute", "total", "gemm"}``, each pass the slower of its GPU time and its launches
    (:func:`kernel_seconds`); ``recompute``: what the policy runs again in backward (selective:
    the attention core, or under a framework whose ``selective`` is ``"op"`` -- torchtitan's
    per-operator checkpointing -- every second matrix multiply's forward and every elementwise
    operator's, the attention kernel's output being saved); ``gemm``: the GPU seconds of the
    layer's linear multiplies, forward and backward (what tensor-parallel communication can
    overlap with). The collectives are not included. Remembered: a search asks for the same few
    ``(rows, tp, sequence_parallel, recompute)`` thousands of times."""
    if recompute not in ("none", "selective", "full"):
        raise ValueError(f"layer_seconds(recompute={recompute!r}): use 'none', 'selective' or 'full'")
    gpu = {"forward": 0.0, "backward": 0.0, "attention": 0.0}
    kernels = {"forward": 0, "backward": 0, "attention": 0}
    again_gpu, again_kernels, gemms, matmul = 0.0, 0, 0, 0.0
    for _, phase, seconds, k, kind in _operators(device, shape, rows, tp, sequence_parallel, precision, framework):
        gpu[phase] += seconds
        kernels[phase] += k
        if kind == "gemm":
            matmul += seconds
        if phase == "forward" and kind == "gemm":
            gemms += 1
        if phase == "forward" and (kind == "memory" or (kind == "gemm" and gemms % 2 == 0)):
            again_gpu += seconds
            again_kernels += k
    ops = _host_ops(framework)
    forward = kernel_seconds(device, gpu["forward"] + gpu["attention"], kernels["forward"] + kernels["attention"], ops)
    backward = kernel_seconds(device, gpu["backward"], kernels["backward"], ops)
    attention = kernel_seconds(device, gpu["attention"], kernels["attention"], ops)
    if recompute == "selective" and framework is not None and framework.selective == "op":
        again = kernel_seconds(device, again_gpu, again_kernels, ops)
    else:
        again = {"none": 0.0, "selective": attention, "full": forward}[recompute]
    return {"forward": forward, "backward": backward, "recompute": again,
            "total": forward + backward + again, "gemm": matmul}


@lru_cache(maxsize=1 << 12)
def head_seconds(device: Device, shape, rows: int, tp: int = 1, sequence_parallel: bool = False,
                 precision: str = "bf16", framework=None) -> dict[str, float]:
    """The model's edges per micro-batch on one tensor-parallel rank: ``{"head", "embedding",
    "total"}``. ``head``: the final norm, the output multiply over this rank's share of the
    (padded) vocabulary, forward and backward, and Megatron-Core's vocabulary-parallel
    cross-entropy over ``n x V / t`` logits (``tensor_parallel/cross_entropy.py``): forward the cast
    to float32 (r e w4), the maximum (r4), its subtraction, ``exp`` and the division by the sum in
    place (r4 w4 each) and the sum (r4), 36 + e bytes per logit; backward the ``mul_`` by the
    output's gradient (r4 w4) and the cast back (r4 w e), 12 + e; ``embedding``: the lookup, its
    gradient's scatter-add, and
    ``microbatch_overhead_s``. Under an eager ``framework`` (not ``fused``) the final norm is eager
    PyTorch's (:data:`EAGER_NORM`) and the loss ``cross_entropy(logits.float())``: the cast (r e
    w4) and log-softmax forward, whose rows of a large vocabulary do not fit on chip, so it reads
    them three times (the maximum, the sum of exponentials, the output: r12 w4), 20 + e bytes per
    logit; backward the target's gradient scattered into a zeroed float32 tensor (w4),
    log-softmax's backward (the sum of the gradient, then r8 w4) and the cast back (r4 w e),
    24 + e."""
    e = BYTES[precision]
    n, h = rows * shape.seq, shape.hidden
    vocab = -(-shape.vocab // tp)
    rows_h = n // tp if sequence_parallel else n
    if framework is not None and not framework.fused:
        eager_norm = getattr(shape, "norm", "layernorm") == "rmsnorm" and not framework.fused_norm
        fixed, per_e, k = EAGER_NORM if eager_norm else (0, 2, 1)
        forward = memory_seconds(device, (fixed + per_e * e) * rows_h * h + (20 + e) * n * vocab) \
            + gemm_seconds(device, n, vocab, h, precision)
        backward = memory_seconds(device, 2 * (fixed + per_e * e) * rows_h * h + (24 + e) * n * vocab) \
            + gemm_seconds(device, n, h, vocab, precision) + gemm_seconds(device, h, vocab, n, precision)
        ops = _host_ops(framework)
        head = kernel_seconds(device, forward, k + 5, ops) + kernel_seconds(device, backward, 2 * k + 6, ops)
    else:
        forward = memory_seconds(device, 2 * rows_h * h * e + (36 + e) * n * vocab) \
            + gemm_seconds(device, n, vocab, h, precision)                     # norm, logits, loss: 6 kernels
        backward = memory_seconds(device, 4 * rows_h * h * e + (12 + e) * n * vocab) \
            + gemm_seconds(device, n, h, vocab, precision) + gemm_seconds(device, h, vocab, n, precision)   # 6
        head = kernel_seconds(device, forward, 6) + kernel_seconds(device, backward, 6)
    embedding = kernel_seconds(device, memory_seconds(device, n * h * e + n * 8), 1) \
        + kernel_seconds(device, memory_seconds(device, 3 * n * h * 4), 2) + device.microbatch_overhead_s
    return {"head": head, "embedding": embedding, "total": head + embedding}


def optimizer_seconds(device: Device, parameters: float, precision: str = "bf16", framework=None) -> float:
    """Adam's step over ``parameters`` (this rank's, its shard under ZeRO): memory-bound at
    :data:`OPTIMIZER_BYTES` per parameter (fused multi-tensor kernels: their launches are few), or
    the ``framework``'s optimizer's bytes (:meth:`Framework.optimizer_bytes`: foreach AdamW 92)."""
    per = OPTIMIZER_BYTES[precision] if framework is None else framework.optimizer_bytes(precision)
    return parameters * per / device.memory_bandwidth


def fsdp_copy_seconds(device: Device, unit_parameters: float, dp: int, flat: bool = False) -> float:
    """FSDP's copies around one unit's collectives, per micro-batch, at the copy's bandwidth.

    FSDP2 (``flat`` False; PyTorch ``torch.distributed.fsdp.fully_shard`` with
    ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=float32)``, torchtitan's default): each of
    its two all-gathers (forward, and backward after ``reshard_after_forward``) casts this rank's
    float32 shard to 16 bits into the gather's input (r4 w2 per ``1/dp`` of the unit) and copies the
    gathered buffer out into the parameters (r2 w2 per parameter: ``foreach_all_gather_copy_out``);
    the reduce-scatter's input is the 16-bit gradients cast to float32 into one buffer (r2 w4), and
    its output shard added into the float32 gradient (r8 w4 per ``1/dp``): ``14 + 24 / dp`` bytes
    per parameter.

    FSDP1 (``flat`` True; ``FullyShardedDataParallel`` with ``MixedPrecision(param_dtype=bf16,
    reduce_dtype=bf16)``, a ``FlatParameter`` per unit, ``torch/distributed/fsdp/_flat_param.py``
    and ``_runtime_utils.py``): each all-gather casts the shard into its low-precision copy (r4 w2
    per ``1/dp``) and gathers straight into the flat buffer whose views the parameters are (no
    copy-out); backward's gradients of those views reach the flat parameter through the views'
    ``split``, whose backward concatenates them (r2 w2 per parameter); the flat gradient is divided
    in place before the reduce-scatter (``_gradient_predivide_factor``: r2 w2) and its shard after
    it (r2 w2 per ``1/dp``), then cast to float32 for the optimizer (r2 w4 per ``1/dp``):
    ``8 + 22 / dp`` bytes per parameter."""
    per = (8.0 + 22.0 / dp) if flat else 2 * (4.0 + 6.0 / dp) + 6.0 + 12.0 / dp
    return unit_parameters * per / device.memory_bandwidth


# ----------------------------------------------------------------------------- profiles
# Peaks: the datasheets. Achieved figures: public measurements, cited beside each; the GEMM ceiling
# and the bandwidth are hardware figures measured through cuBLAS and a copy kernel, the two overheads
# are eager PyTorch's (framework), flash efficiency FlashAttention-2's.

_LAUNCH = ("kernel_overhead_s 16 us: eager PyTorch's host cost per dispatched operator (Python, dispatcher, "
           "autograd): the slope of micro-batch time against ATen operators dispatched, the mean of an H100 host's "
           "and an H200 host's lines, docs/benchmarks/2026-11-28-h200-layers.md; "
           "the regime is Horace He's 'Making Deep Learning Go Brrrr From First "
           "Principles' (2022); a framework figure")
_MICRO = ("microbatch_overhead_s 0.6 ms: a training micro-batch's host time beyond its operators (the loss, "
          "autograd's engine starting, the model's Python): the same lines' intercepts, their mean; eager "
          "PyTorch, a framework figure")
# The attention kernel is the framework's: the A100 profiles take Megatron-LM's of the A100's published runs
# (Narayanan et al. 2021, Korthikanti et al. 2022: fused scale-mask-softmax over materialised scores, before
# FlashAttention), the H100 profile FlashAttention's, which every H100 framework runs (Megatron-Core's
# TransformerEngine, torchtitan's SDPA, nanotron's flash-attn). On a cluster the framework decides it
# (``cluster.with_(framework=...)``: workbench.advise.framework), for the device and the memory model alike.
_MATH_A100 = ("attention 'math': Megatron-LM's fused scale-mask-softmax, as in its A100 runs (Korthikanti et al. "
              "2022: the 22B-1T iteration times of their Table 5 are predicted within 4% with it, 2-13% too fast "
              "with flash); a framework figure")

PROFILES: dict[str, Device] = {
    "h100-sxm-80gb": Device(
        name="H100 SXM 80 GB", bf16_flops=989e12, fp16_flops=989e12, fp32_flops=67e12, tf32_flops=494e12, sms=132,
        # cuBLAS bf16 on large square shapes reaches about 700-800 TFLOP/s on a 700 W H100 SXM (power
        # and clock limited), e.g. the Transformer Engine and SemiAnalysis GEMM sweeps: 0.75 of the peak
        gemm_ceiling=0.75,
        # STREAM-like copy / BabelStream on H100 SXM5: about 3.0 of the 3.35 TB/s datasheet figure
        memory_bandwidth=3.0e12, memory_bytes=H100_80GB_BYTES,
        # FlashAttention-2 as PyTorch's SDPA bundles it (and flash-attn 2 ships), forward + backward inside a
        # Llama 7B layer on an H200, the H100's chip (docs/benchmarks/2026-11-28-h200-layers.md), before the
        # sequence's s / (s + FLASH_SEQ_HALF), below FA2's own chart (0.338 on that curve, the FlashAttention-3
        # paper's "35%"). cuDNN's kernel (SDPA's default on Hopper from PyTorch 2.11,
        # opt-in before; TE's fused attention) runs faster: calibrate to price it
        flash_efficiency=0.304,
        source=("NVIDIA H100 Tensor Core GPU datasheet (SXM5: 989 TFLOP/s bf16 dense, 67 fp32, 494 tf32, 3.35 TB/s, "
                "132 SMs per the Hopper architecture white paper)",
                "gemm_ceiling 0.75: public cuBLAS bf16 sweeps on H100 SXM (700-800 TFLOP/s on large shapes)",
                "memory_bandwidth 3.0 TB/s: BabelStream/STREAM-like copy on H100 SXM (about 90% of the datasheet)",
                "flash_efficiency 0.304: FlashAttention-2 as PyTorch's SDPA runs it, forward + backward in "
                "a Llama 7B layer on an H200 (the H100's GH100: same SMs and clocks), "
                "docs/benchmarks/2026-11-28-h200-layers.md; FA2 reaches at most 35% of an H100 (Shah et al. 2024, "
                "FlashAttention-3)",
                "attention 'flash': every H100 framework's (TransformerEngine, SDPA, flash-attn); a framework figure",
                _LAUNCH, _MICRO)),
    # The H200 is the H100 SXM's GH100 chip (132 SMs, the same clocks and 700 W, 989 TFLOP/s dense bf16: NVIDIA's
    # H200 datasheet) with 141 GB of HBM3e at 4.8 TB/s. What the chip does is the H100 SXM's (its GEMM ceiling and
    # FlashAttention-2's efficiency, which was itself measured on an H200); the memory is its own: the bandwidth a
    # 1 GiB copy reached on one H200, 4.17 TB/s (0.87 of the datasheet's, as the H100's 3.0 is 0.9 of 3.35), and
    # the bytes CUDA reported there (docs/benchmarks/2026-11-28-h200-profile.json). The same calibration measured
    # a GEMM ceiling of 0.765 on that H200, the H100's 0.75 within 2%
    "h200-sxm-141gb": Device(
        name="H200 SXM 141 GB", bf16_flops=989e12, fp16_flops=989e12, fp32_flops=67e12, tf32_flops=494e12, sms=132,
        gemm_ceiling=0.75, memory_bandwidth=4.17e12, memory_bytes=H200_141GB_BYTES, flash_efficiency=0.304,
        source=("NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, 989 TFLOP/s bf16 dense, 67 "
                "fp32, 494 tf32, 700 W; the H100's GH100 chip, 132 SMs)",
                "gemm_ceiling 0.75 and flash_efficiency 0.304: the H100 SXM's (the same chip, clocks and power); "
                "an H200's calibration measured 0.765 (docs/benchmarks/2026-11-28-h200-profile.json)",
                "memory_bandwidth 4.17 TB/s and memory_bytes: measured on one H200 by workbench advise --calibrate "
                "--device cuda (docs/benchmarks/2026-11-28-h200-profile.json): a 1 GiB copy, CUDA's total memory",
                _LAUNCH, _MICRO)),
    # torchtitan's H100 benchmarks (docs/performance.md, Dec 2024) ran on Meta's Grand Teton hosts: "96GB HBM2e
    # with 2.4 TB/sec peak memory bandwidth" and "the default 500W power limit" (700 W TDP). The SMs and peaks
    # are the H100 SXM's; under a power cap the clock falls until the power fits. Of the power, about 70 W is
    # drawn idle (nvidia-smi on an idle H100 SXM: '70W / 700W' in public logs) and does not scale with the
    # clock; the rest, dynamic, goes as f V^2 with V about proportional to f (DVFS), so as f^3: a multiply
    # limited by power at 700 W runs at ((500 - 70) / (700 - 70))^(1/3) = 0.88 of its clock at 500 W, its
    # efficiency and flash's scaled by that; the bandwidth is the memory's, 0.9 of its peak as for the SXM's
    # HBM3 (3.0 of 3.35 TB/s)
    "h100-sxm-96gb-500w": Device(
        name="H100 96 GB HBM2e at 500 W (Grand Teton)", bf16_flops=989e12, fp16_flops=989e12, fp32_flops=67e12,
        tf32_flops=494e12, sms=132, gemm_ceiling=round(0.75 * (430 / 630) ** (1 / 3), 3),
        memory_bandwidth=2.16e12, memory_bytes=round(96 * 2**30 * VISIBLE),
        flash_efficiency=round(0.304 * (430 / 630) ** (1 / 3), 3),
        source=("pytorch/torchtitan docs/performance.md: Grand Teton, H100 96GB HBM2e, 2.4 TB/s, 500 W power limit",
                "gemm_ceiling and flash_efficiency: the H100 SXM's times ((500 - 70)/(700 - 70))^(1/3), the clock "
                "a 500 W cap leaves a power-limited multiply (dynamic power ~ f V^2, V ~ f; 70 W idle)",
                "memory_bandwidth 2.16 TB/s: 0.9 of the 2.4 TB/s peak (the SXM's achieved/peak)", _LAUNCH, _MICRO)),
    "a100-sxm-80gb": Device(
        name="A100 SXM 80 GB", bf16_flops=312e12, fp16_flops=312e12, fp32_flops=19.5e12, tf32_flops=156e12, sms=108,
        # cuBLAS bf16 on large shapes: about 270-290 of the 312 TFLOP/s (NVIDIA's Deep Learning Performance
        # guide's GEMM plots; Korthikanti et al. 2022 reach 57% hardware FLOP utilisation end to end)
        gemm_ceiling=0.88,
        memory_bandwidth=1.8e12, memory_bytes=A100_80GB_BYTES,      # BabelStream on A100 80 GB: ~1.8 of 2.04 TB/s
        # FlashAttention-2's own forward + backward chart on A100 80 GB SXM4 (causal, head dim 128: 155, 173, 182,
        # 189 TFLOP/s at 2k-16k), on the FLASH_SEQ_HALF curve; not the paper's "225 TFLOP/s (72%)", which is
        # whole GPT models' training rate. Inside a layer SDPA may run below its chart, as it did on the H100
        # (docs/benchmarks/2026-11-28-h200-layers.md); no A100 was at hand to measure it
        flash_efficiency=0.627,
        attention="math",
        source=("NVIDIA A100 Tensor Core GPU datasheet (80 GB SXM: 312 TFLOP/s bf16 dense, 19.5 fp32, 156 tf32, "
                "2,039 GB/s; 108 SMs per the Ampere architecture white paper)",
                "gemm_ceiling 0.88: NVIDIA Deep Learning Performance guide, cuBLAS GEMMs near 280 TFLOP/s",
                "memory_bandwidth 1.8 TB/s: BabelStream on A100 80 GB (about 88% of the datasheet)",
                "flash_efficiency 0.627: FlashAttention-2's forward + backward chart on A100 80 GB (Dao 2023, Figure 4; "
                "Dao-AILab/flash-attention assets/flash2_a100_fwd_bwd_benchmark.png): causal, head dim 128, 155-189 "
                "TFLOP/s at 2k-16k tokens",
                _MATH_A100, _LAUNCH, _MICRO)),
    "a100-sxm-40gb": Device(
        name="A100 SXM 40 GB", bf16_flops=312e12, fp16_flops=312e12, fp32_flops=19.5e12, tf32_flops=156e12, sms=108,
        gemm_ceiling=0.88, memory_bytes=round(40 * 2**30 * VISIBLE),
        memory_bandwidth=1.4e12,   # BabelStream: ~1.4 of 1.555 TB/s
        flash_efficiency=0.627, attention="math",
        source=("NVIDIA A100 Tensor Core GPU datasheet (40 GB SXM: 1,555 GB/s; peaks as the 80 GB)",
                "gemm_ceiling 0.88 and flash_efficiency 0.627 as the A100 80 GB (same SMs and clocks)",
                "memory_bandwidth 1.4 TB/s: BabelStream on A100 40 GB (about 90% of the datasheet)",
                _MATH_A100, _LAUNCH, _MICRO)),
}
