"""Measure a GPU into a device profile: ``workbench advise --calibrate --device cuda --profile FILE``.

The published profiles (:data:`workbench.advise.device.PROFILES`) carry public figures; this module
measures the same figures on the GPU at hand, so the advisor prices a step with that GPU's own
numbers. Every GPU timing is taken with CUDA events around the work, after warm-up launches, with
``torch.cuda.synchronize()`` before reading them (kernel launches are asynchronous: a wall clock
around a launch times the launch, not the kernel); the multiplies are replayed from a CUDA graph
(a small one launched eagerly takes the host longer than the GPU, which then idles between them).

What is measured, and which :class:`~workbench.advise.device.Device` figure it gives:

==========================  ===================================================================
probe                       figure
==========================  ===================================================================
matrix multiplies over      ``gemm_ceiling`` and ``kernel_fixed_s``: the pair with which the tile,
shapes (:data:`GEMM_SHAPES`) wave and epilogue model prices every shape best (:func:`fit_gemms`)
a large copy                ``memory_bandwidth``: bytes read + written per second
tiny GPTs' micro-batches    ``kernel_overhead_s`` and ``microbatch_overhead_s``: the host's time per
at three depths             ATen operator a training micro-batch dispatches and beyond them per
                            micro-batch, a line through wall time against operators counted
                            (:func:`_host_fit`, :func:`dispatched_operators`; the GPU idles); a
                            tiny block's steps (:func:`_host_per_operator`) and bare one-element
                            adds (``launch_s``) kept beside
causal attention            ``flash_efficiency``: ``F.scaled_dot_product_attention``'s FLOPs over
(``scaled_dot_product_      its time, over the peak, forward + backward
attention``)
GPT blocks over shapes      kept beside the device model's prediction of them (``measured
(:data:`LAYER_SHAPES`)      ["layers"]``), the check of the whole model on this GPU
NCCL all-reduce (>= 2 GPUs) bus bandwidth inside the node (``measured["nccl"]``, and ``intra``)
``torch.cuda`` properties   ``sms``, ``memory_bytes``, the name
==========================  ===================================================================

The peaks are not measured: they are the datasheet's, taken from the published profile of the
same GPU (by name), or, for a GPU the profiles do not know, the best rate measured (ceiling 1).
:func:`device_from_measurements` turns the measurements into a :class:`Device` without a GPU (the
tests check it on CPU); :func:`measure` needs one. The profile JSON
(:meth:`workbench.advise.cluster.Cluster.to_profile`) keeps the raw measurements beside the figures.
Time: about a minute on one GPU; memory: the largest multiply's three matrices (3 x 8,192^2 bf16,
400 MB) and a 1 GiB copy.
"""
from __future__ import annotations

import json
import math
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import workbench
from workbench.comm.topology import Link
from workbench.models import GPT, GPTConfig
from workbench.models.gpt import Block

from .cluster import Cluster
from .cluster import PRESETS as CLUSTERS
from .device import FLASH_SEQ_HALF, PROFILES, Device, gemm_seconds, kernels_per_layer, layer_seconds
from .shape import ModelShape

__all__ = ["GEMM_SHAPES", "measure", "device_from_measurements", "calibrate_cuda", "profile_for"]

# (m, n, k): large squares (the ceiling), transformer-shaped ones (tokens x hidden x hidden/ffn at
# tensor-parallel shards), and small ones far from the ceiling (tile and wave quantization)
GEMM_SHAPES = ((8192, 8192, 8192), (4096, 4096, 4096), (16384, 8192, 1024), (4096, 14336, 4096),
               (4096, 4096, 14336), (2048, 3072, 1024), (4096, 1024, 4096), (1024, 1024, 1024),
               (512, 512, 512), (2048, 2048, 128), (256, 4096, 4096), (8192, 1664, 8192))
LARGE = 3                         # the first shapes: large enough to give the ceiling
COPY_BYTES = 1 << 30
LAUNCHES = 2000
GEMM_INNER = 20                   # multiplies per CUDA graph timed (see _graphed)
# (hidden, heads, seq, rows): GPT blocks timed forward + backward beside the device model's price
LAYER_SHAPES = ((2048, 16, 4096, 1), (4096, 32, 4096, 1), (4096, 32, 4096, 4), (8192, 64, 4096, 1))
HOST_STEPS = 50                   # forward + backward steps of a tiny block timed for the host's cost
HOST_DEPTHS = (2, 8, 16)          # layers of the tiny GPTs whose micro-batches fit the host's line


def profile_for(name: str, memory_bytes: float) -> Device | None:
    """The published profile of a GPU named ``name`` (``torch.cuda.get_device_name``), or None: its
    peaks are the datasheet's, the rest is measured. An H200 is the H100's GH100 chip (the same 132
    SMs and 989 TFLOP/s dense bf16 peak, NVIDIA's H200 datasheet) with 141 GB of HBM3e at 4.8 TB/s."""
    upper = name.upper()
    if "H200" in upper:
        return PROFILES["h200-sxm-141gb"]
    if "H100" in upper:
        return PROFILES["h100-sxm-80gb"]
    if "A100" in upper:
        return PROFILES["a100-sxm-80gb" if memory_bytes > 60e9 else "a100-sxm-40gb"]
    return None


def _timed(fn, repeats: int = 10, warmup: int = 3, inner: int = 1) -> float:
    """Median seconds of ``fn()`` on the current stream: ``inner`` calls back to back between two
    CUDA events, over ``inner``. One call of a small kernel between two events times the host's
    launch, not the kernel (the GPU waits for the host); back to back, the launches run ahead."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / inner)
    return sorted(times)[len(times) // 2]


def _graphed(fn, inner: int) -> float:
    """Median seconds of one ``fn()`` replayed from a CUDA graph of ``inner`` calls: the GPU's own
    time, with no host launch between the kernels (an eager launch of a small multiply takes the
    host longer than the GPU takes to run it, so eager timing measures the host). Falls back to
    eager timing (``_timed``) where capture is not supported."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):   # warm up off the capturing stream, as capture requires
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(inner):
                fn()
    except RuntimeError:
        return _timed(fn, inner=inner)
    return _timed(graph.replay) / inner


def _gemms(dtype) -> list[dict]:
    out = []
    for m, n, k in GEMM_SHAPES:
        a = torch.randn(m, k, device="cuda", dtype=dtype)
        b = torch.randn(k, n, device="cuda", dtype=dtype)
        c = torch.empty(m, n, device="cuda", dtype=dtype)
        s = _graphed(lambda: torch.matmul(a, b, out=c), GEMM_INNER)
        out.append({"m": m, "n": n, "k": k, "seconds": s, "flops": 2 * m * n * k / s})
        del a, b, c
    return out


def _bandwidth() -> float:
    x = torch.empty(COPY_BYTES // 4, device="cuda", dtype=torch.float32)
    y = torch.empty_like(x)
    s = _timed(lambda: y.copy_(x))
    return 2 * COPY_BYTES / s


def _launch_overhead() -> float:
    """Host seconds per bare launch: many one-element adds back to back, timed on the wall clock
    (the GPU finishes each long before the host launches the next), synchronised once. A floor:
    an operator of a training step costs more (autograd's graph, allocation, the module's Python)."""
    x = torch.zeros(1, device="cuda")
    for _ in range(100):
        x.add_(1)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(LAUNCHES):
        x.add_(1)
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / LAUNCHES


def _block(dtype, hidden: int, heads: int, seq: int, rows: int):
    """A :class:`workbench.models.GPT` block held in ``dtype`` (as Megatron-LM and FSDP's mixed
    precision hold the weights a step computes with: no cast per forward), and its input."""
    block = Block(GPTConfig(n_layer=1, n_head=heads, n_embd=hidden, block_size=seq)).cuda().to(dtype)
    x = torch.randn(rows, seq, hidden, device="cuda", dtype=dtype, requires_grad=True)
    return block, x


class _Dispatches(TorchDispatchMode):
    """Counts the ATen operators dispatched while it is active (autograd's backward included)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.count += 1
        return func(*args, **(kwargs or {}))


def dispatched_operators(step) -> int:
    """ATen operators one call of ``step`` dispatches (forward, backward, gradient accumulation,
    views and casts alike): what the host pays for one by one in eager PyTorch. Any device."""
    counter = _Dispatches()
    with counter:
        step()
    return counter.count


def _host_per_operator(dtype, hidden: int = 64, heads: int = 4, seq: int = 64) -> dict:
    """Host seconds per dispatched operator of an eager training step: a block so small that its
    kernels take next to no GPU time, ``HOST_STEPS`` forward + backward passes on the wall clock,
    over the ATen operators one step dispatches (:func:`dispatched_operators`): the
    ``kernel_overhead_s`` of a profile measured without the line through deep micro-batches
    (:func:`_host_fit`, which also separates what a micro-batch costs beyond its operators and is
    taken where measured); a framework says how many operators it dispatches per kernel the model
    counts (``Framework.host_ops_per_kernel``). ``kernels``: the model's count for the block, kept
    beside."""
    block, x = _block(dtype, hidden, heads, seq, 1)

    def step():
        block(x).float().sum().backward()

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(HOST_STEPS):
        step()
    torch.cuda.synchronize()
    seconds = (time.perf_counter() - start) / HOST_STEPS
    dispatched = dispatched_operators(step)
    shape = ModelShape(layers=1, hidden=hidden, heads=heads, vocab=64, seq=seq, ffn=4 * hidden, name="gpt block")
    kernels = sum(kernels_per_layer(PROFILES["h100-sxm-80gb"], shape).values())
    return {"hidden": hidden, "seq": seq, "seconds": seconds, "kernels": kernels, "dispatched": dispatched,
            "per_operator": seconds / dispatched}


def _host_fit(dtype, device: str = "cuda", hidden: int = 64, heads: int = 4, seq: int = 64,
              steps: int = 30) -> dict:
    """The host's cost of a training micro-batch as a line: a :class:`workbench.models.GPT` so
    small that the GPU idles (``hidden``, one sequence of ``seq``), at each depth of
    :data:`HOST_DEPTHS`, one micro-batch (``model(x, y)``, its loss, ``backward()``) timed on the
    wall clock over ``steps``, against the ATen operators one dispatches
    (:func:`dispatched_operators`); least squares of seconds on operators gives the cost per
    dispatched operator (``per_operator``: ``kernel_overhead_s``) and what a micro-batch costs
    beyond them (``per_microbatch``: the loss, autograd's engine starting, the model's Python:
    ``microbatch_overhead_s``). A deep model spreads its per-step costs over many operators, which
    the one-block probe (:func:`_host_per_operator`) cannot. Any device (on a CPU the compute is
    in the line too)."""
    points = []
    for layers in HOST_DEPTHS:
        torch.manual_seed(0)
        config = GPTConfig(n_layer=layers, n_head=heads, n_embd=hidden, block_size=seq, vocab_size=256)
        model = GPT(config).to(device=device, dtype=dtype)
        x = torch.randint(0, 256, (1, seq), device=device)

        def micro():
            model(x, x)[1].backward()

        for _ in range(5):
            micro()
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(steps):
            micro()
        if device == "cuda":
            torch.cuda.synchronize()
        points.append({"layers": layers, "seconds": (time.perf_counter() - start) / steps,
                       "dispatched": dispatched_operators(micro)})
        del model
    n = len(points)
    mx = sum(q["dispatched"] for q in points) / n
    my = sum(q["seconds"] for q in points) / n
    slope = sum((q["dispatched"] - mx) * (q["seconds"] - my) for q in points) \
        / sum((q["dispatched"] - mx) ** 2 for q in points)
    return {"hidden": hidden, "seq": seq, "points": points, "per_operator": slope,
            "per_microbatch": my - slope * mx}


def _attention(dtype, rows: int = 2, heads: int = 16, seq: int = 4096, dim: int = 128) -> dict:
    """Causal ``scaled_dot_product_attention`` forward + backward as a layer calls it: FLOPs (causal
    half, backward 2.5x) over the time. The query, key and value are views of ``(rows, seq, heads,
    dim)`` projections transposed to ``(rows, heads, seq, dim)``, and the gradient a full tensor (SDPA
    picks its kernel and its copies by the strides; a ``.sum().backward()`` gives it an expanded
    gradient of stride 0, which no layer does). ``backends``: the same timed under each backend that
    accepts it (``torch.nn.attention.sdpa_kernel``), for the record."""
    q, k, v = (torch.randn(rows, seq, heads, dim, device="cuda", dtype=dtype).transpose(1, 2).requires_grad_()
               for _ in range(3))
    grad = torch.randn(rows, seq, heads, dim, device="cuda", dtype=dtype).transpose(1, 2)

    def step():
        F.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    flops = 4 * rows * seq * seq * heads * dim * 0.5 * 3.5
    s = _timed(step)
    out = {"rows": rows, "heads": heads, "seq": seq, "dim": dim, "seconds": s, "flops": flops / s, "backends": {}}
    try:
        from torch.nn.attention import SDPBackend, sdpa_kernel
    except ImportError:
        return out
    for backend in ("FLASH_ATTENTION", "CUDNN_ATTENTION", "EFFICIENT_ATTENTION"):
        if not hasattr(SDPBackend, backend):
            continue
        try:
            with sdpa_kernel([getattr(SDPBackend, backend)]):
                out["backends"][backend] = flops / _timed(step)
        except RuntimeError:   # this backend does not take these inputs on this GPU
            continue
    return out


def _layers(dtype) -> list[dict]:
    """GPT blocks over :data:`LAYER_SHAPES`, forward and forward + backward, in ``dtype``."""
    out = []
    for hidden, heads, seq, rows in LAYER_SHAPES:
        block, x = _block(dtype, hidden, heads, seq, rows)

        def forward():
            with torch.no_grad():
                block(x)

        def step():
            block(x).float().sum().backward()

        out.append({"rows": rows, "hidden": hidden, "heads": heads, "seq": seq, "forward_seconds": _timed(forward),
                    "seconds": _timed(step)})
        del block, x
        torch.cuda.empty_cache()
    return out


def _nccl(world: int) -> dict:
    """Bus bandwidth of an NCCL all-reduce over ``world`` GPUs of this node (nccl-tests' busbw:
    ``2 (w - 1) / w x bytes / time``), per message size."""
    return workbench.launch(_nccl_rank, world_size=world, backend="nccl", timeout=300)[0]


def _nccl_rank() -> dict:
    w = dist.get_world_size()
    out = {}
    for nbytes in (1 << 20, 16 << 20, 256 << 20):
        x = torch.ones(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        s = _timed(lambda: dist.all_reduce(x), repeats=5)
        out[str(nbytes)] = {"seconds": s, "bus_bandwidth": 2 * (w - 1) / w * nbytes / s}
    return out


def measure(dtype=torch.bfloat16, nccl: bool = True) -> dict:
    """Every probe on the current GPU (and NCCL across this node's GPUs when there are 2 or more)."""
    if not torch.cuda.is_available():
        raise ValueError("workbench advise --calibrate --device cuda: no CUDA device here; run it on a GPU node, "
                         "or calibrate this machine's CPU with --device cpu")
    props = torch.cuda.get_device_properties(0)
    out = {"name": torch.cuda.get_device_name(0), "sms": props.multi_processor_count,
           "memory_bytes": float(props.total_memory), "torch": torch.__version__,
           "cuda": torch.version.cuda, "dtype": str(dtype).replace("torch.", ""),
           "gemms": _gemms(dtype), "memory_bandwidth": _bandwidth(), "launch_s": _launch_overhead(),
           "host": _host_per_operator(dtype), "host_fit": _host_fit(dtype), "attention": _attention(dtype),
           "layers": _layers(dtype)}
    out["kernel_overhead_s"] = out["host"]["per_operator"]
    if nccl and torch.cuda.device_count() >= 2:
        out["nccl"] = _nccl(min(8, torch.cuda.device_count()))
    return out


def fit_gemms(base: Device, gemms: list[dict], precision: str = "bf16") -> tuple[float, float]:
    """``(gemm_ceiling, kernel_fixed_s)`` that price the timed multiplies best: each ``{"m", "n",
    "k", "seconds"}`` priced as :func:`~workbench.advise.device.gemm_seconds` plus one kernel's fixed
    cost, the two chosen to minimise the squared log ratio of priced to measured seconds over every
    shape (so a 4-microsecond multiply weighs as much as a 1.5-millisecond one). A grid: ceilings
    0.30-1.00 by 0.005, fixed costs 0-10 microseconds by 0.25."""
    best = (math.inf, base.gemm_ceiling, base.kernel_fixed_s)
    for c in range(60, 201):
        probe = base.with_(gemm_ceiling=c / 200, k_half=0.0)
        work = [gemm_seconds(probe, g["m"], g["n"], g["k"], precision) for g in gemms]
        for f in range(41):
            fixed = f * 0.25e-6
            err = sum(math.log((w + fixed) / g["seconds"]) ** 2 for w, g in zip(work, gemms))
            if err < best[0]:
                best = (err, c / 200, fixed)
    return best[1], best[2]


def device_from_measurements(measured: dict, base: Device | None = None) -> Device:
    """The :class:`Device` the measurements describe (pure: no GPU needed). Peaks from ``base``
    (the published profile of the same GPU; None: the best rate measured, ceiling 1), the rest
    measured: the GEMM ceiling and a kernel's fixed cost fitted over every shape, the bandwidth, flash
    attention's efficiency, the host's cost per dispatched operator and, where the deep micro-batches
    were timed (``host_fit``), per micro-batch beyond them (else ``base``'s)."""
    dtype = measured.get("dtype", "bfloat16")
    key = {"bfloat16": "bf16", "float16": "fp16", "float32": "fp32"}.get(dtype, "bf16")
    best = max(g["flops"] for g in measured["gemms"][:LARGE])
    sms = int(measured["sms"])
    if base is None:
        base = Device(name=measured["name"], bf16_flops=best, fp16_flops=best, fp32_flops=best / 16, sms=sms,
                      gemm_ceiling=1.0, memory_bandwidth=measured["memory_bandwidth"],
                      memory_bytes=measured["memory_bytes"], flash_efficiency=0.5)
    peak = base.peak(key)
    ceiling, fixed = fit_gemms(base.with_(sms=sms, memory_bandwidth=float(measured["memory_bandwidth"])),
                               measured["gemms"], key)
    att = measured.get("attention")
    flash = min(1.0, att["flops"] / peak * (att["seq"] + FLASH_SEQ_HALF) / att["seq"]) if att else base.flash_efficiency
    when = time.strftime("%Y-%m-%d")
    host = measured.get("host", {})
    # host seconds per dispatched operator: the line through deep micro-batches where measured (its
    # intercept the cost per micro-batch), else the one-block probe's; a profile measured before the
    # dispatches were counted kept seconds per counted kernel only
    fit = measured.get("host_fit")
    overhead = host["seconds"] / host["dispatched"] if host.get("dispatched") else measured["kernel_overhead_s"]
    micro = base.microbatch_overhead_s
    if fit and fit["per_operator"] > 0:
        overhead, micro = fit["per_operator"], max(0.0, fit["per_microbatch"])
    return base.with_(name=measured["name"], sms=sms, gemm_ceiling=ceiling, kernel_fixed_s=fixed, k_half=0.0,
                      memory_bandwidth=float(measured["memory_bandwidth"]),
                      memory_bytes=float(measured["memory_bytes"]), flash_efficiency=flash,
                      kernel_overhead_s=float(overhead), microbatch_overhead_s=float(micro),
                      source=(f"measured {when} by workbench advise --calibrate --device cuda "
                              f"(torch {measured.get('torch')}, CUDA {measured.get('cuda')}): gemm_ceiling, "
                              "kernel_fixed_s, memory_bandwidth, kernel_overhead_s, flash_efficiency, sms, memory_bytes"
                              + (", microbatch_overhead_s" if fit else ""),
                              f"peaks{'' if fit else ' and microbatch_overhead_s'}: {base.name}'s published profile"))


def calibrate_cuda(base: str = "dgx-h100", path: str | None = None, measured: dict | None = None) -> Cluster:
    """Measure this GPU (unless ``measured`` is given), build the cluster ``base`` (a preset: its
    nodes, network and runtime figures) with this GPU as its device, and write the profile JSON to
    ``path`` (when given) for ``--profile FILE`` / :meth:`Cluster.from_profile` to load."""
    if base not in CLUSTERS:
        raise ValueError(f"calibrate_cuda(base={base!r}): use a preset, one of {sorted(CLUSTERS)}")
    measured = measured if measured is not None else measure()
    device = device_from_measurements(measured, profile_for(measured["name"], measured["memory_bytes"]))
    for layer in measured.get("layers", []):   # the whole model's check on this GPU: each block as the
        # device model prices it, beside its time
        shape = ModelShape(layers=1, hidden=layer["hidden"], heads=layer["heads"], vocab=64, seq=layer["seq"],
                           ffn=4 * layer["hidden"], name="gpt block")
        price = layer_seconds(device.with_(attention="flash"), shape, layer["rows"])
        layer["predicted_seconds"], layer["predicted_forward_seconds"] = price["total"], price["forward"]
    changes = {"device": device, "name": f"{base} ({device.name}, measured)", "memory_bytes": device.memory_bytes,
               "flops": device.achieved("bf16"), "fp32_flops": device.achieved("fp32"),
               "source": device.source[0]}
    nccl = measured.get("nccl")
    if nccl:   # the largest message's bus bandwidth inside the node as the intra-node link

        largest = nccl[max(nccl, key=int)]
        changes["intra"] = Link(CLUSTERS[base].intra.latency_s, largest["bus_bandwidth"])
    cluster = CLUSTERS[base].with_(nccl=CLUSTERS[base].nccl, **changes)   # the measured intra is a bus
    # bandwidth, not a line rate: the NCCL model is not scaled by it
    if path:
        with open(path, "w") as f:
            json.dump(cluster.to_profile(measured=measured, base=base), f, indent=1)
    return cluster
