"""Time the layers of the published rows the advisor misses, on one GPU, kernel by kernel.

A one-off measurement (2026-11-28), kept with its results so it can be run again:

    PYTHONPATH=. python3 docs/benchmarks/2026-11-28-layer-probe.py OUT.json

Each case is a stack of real layers at a published row's shape (bf16 weights, as FSDP's and
Megatron's mixed precision compute with), forward and backward with CUDA events (median of 5 after
3), the wall clock beside (host-bound when it exceeds the GPU time), and one step under
``torch.profiler``: every kernel's GPU time and every ATen multiply and attention call with its
input shapes. The layers are written as the frameworks write them: torchtitan's eager Llama
(float32 RMSNorm, complex rotary, three projections, repeat_kv for GQA, SDPA, SwiGLU as two
multiplies), and ``workbench.models.GPT``'s block (fused LayerNorm, one QKV multiply, GELU) for the
Megatron GPT shape. The output head and loss (``cross_entropy(logits.float())``) are timed alone.
"""
from __future__ import annotations

import json
import os
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile
from torch.utils.checkpoint import checkpoint

SMALL = os.environ.get("PROBE_SMALL") == "1"      # a CPU dry run at toy sizes
DEV = "cpu" if SMALL else "cuda"
DT = torch.bfloat16


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def rotary(x, freqs):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs).flatten(3).type_as(x)


class LlamaLayer(nn.Module):
    def __init__(self, h: int, heads: int, kv: int, ffn: int):
        super().__init__()
        self.heads, self.kvh, self.hd = heads, kv, h // heads
        self.attention_norm, self.ffn_norm = RMSNorm(h), RMSNorm(h)
        self.wq = nn.Linear(h, h, bias=False)
        self.wk = nn.Linear(h, kv * self.hd, bias=False)
        self.wv = nn.Linear(h, kv * self.hd, bias=False)
        self.wo = nn.Linear(h, h, bias=False)
        self.w1 = nn.Linear(h, ffn, bias=False)
        self.w3 = nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)

    def attention(self, x, freqs):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, self.heads, self.hd)
        k = self.wk(x).view(b, s, self.kvh, self.hd)
        v = self.wv(x).view(b, s, self.kvh, self.hd)
        q, k = rotary(q, freqs), rotary(k, freqs)
        rep = self.heads // self.kvh
        if rep > 1:   # torchtitan's repeat_kv
            k = k[:, :, :, None, :].expand(b, s, self.kvh, rep, self.hd).reshape(b, s, self.heads, self.hd)
            v = v[:, :, :, None, :].expand(b, s, self.kvh, rep, self.hd).reshape(b, s, self.heads, self.hd)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        z = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(z)) * self.w3(z))


class Stack(nn.Module):
    def __init__(self, layers, full_ac: bool = False):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        self.full_ac = full_ac

    def forward(self, x, *extra):
        for layer in self.layers:
            x = checkpoint(layer, x, *extra, use_reentrant=False) if self.full_ac else layer(x, *extra)
        return x


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def timed(step, repeats: int = 5, warmup: int = 3) -> dict:
    for _ in range(warmup):
        step()
    sync()
    gpu, wall = [], []
    for _ in range(repeats):
        if DEV == "cuda":
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
        t0 = time.perf_counter()
        step()
        if DEV == "cuda":
            b.record()
        sync()
        wall.append(time.perf_counter() - t0)
        gpu.append(a.elapsed_time(b) / 1e3 if DEV == "cuda" else wall[-1])
    return {"gpu_s": sorted(gpu)[len(gpu) // 2], "wall_s": sorted(wall)[len(wall) // 2]}


def profiled(step) -> dict:
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
    with profile(activities=acts, record_shapes=True) as prof:
        step()
        sync()
    kernels, ops = {}, []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t and str(getattr(e, "device_type", "")).endswith("CUDA"):
            kernels[e.key] = {"us": t, "count": e.count}
    for e in prof.key_averages(group_by_input_shape=True):
        if any(w in e.key for w in ("mm", "attention", "linear")) and e.key.startswith("aten::"):
            ops.append({"op": e.key, "shapes": str(e.input_shapes), "count": e.count,
                        "device_us": getattr(e, "device_time_total", getattr(e, "cuda_time_total", 0)),
                        "cpu_us": e.cpu_time_total})
    return {"kernels": kernels, "ops": ops}


def _backend(name):
    """A context running SDPA on one backend (``torch.nn.attention.SDPBackend`` name), or none."""
    import contextlib
    if not name:
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel([getattr(SDPBackend, name)])


def llama_case(name, h, heads, kv, ffn, rows, seq, layers, full_ac=False, backend=None) -> dict:
    torch.manual_seed(0)
    stack = Stack([LlamaLayer(h, heads, kv, ffn) for _ in range(layers)], full_ac).to(DEV, DT)
    hd = h // heads
    inv = 1.0 / (500000.0 ** (torch.arange(0, hd, 2, device=DEV).float() / hd))
    freqs = torch.polar(torch.ones(seq, hd // 2, device=DEV), torch.outer(torch.arange(seq, device=DEV).float(), inv))
    freqs = freqs.view(1, seq, 1, hd // 2)
    x = torch.randn(rows, seq, h, device=DEV, dtype=DT, requires_grad=True)
    g = torch.randn_like(x)

    def forward():
        with torch.no_grad(), _backend(backend):
            stack(x, freqs)

    def step():
        with _backend(backend):
            stack(x, freqs).backward(g)

    out = {"case": name, "kind": "llama", "hidden": h, "heads": heads, "kv_heads": kv, "ffn": ffn, "rows": rows,
           "seq": seq, "layers": layers, "full_ac": full_ac, "backend": backend or "default",
           "forward": timed(forward), "step": timed(step)}
    out["profile"] = profiled(step)
    del stack, x, g
    return out


def gpt_case(name, h, heads, rows, seq, layers) -> dict:
    from workbench.models import GPTConfig
    from workbench.models.gpt import Block
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=1, n_head=heads, n_embd=h, block_size=seq)
    stack = nn.Sequential(*[Block(cfg) for _ in range(layers)]).to(DEV, DT)
    x = torch.randn(rows, seq, h, device=DEV, dtype=DT, requires_grad=True)
    g = torch.randn_like(x)

    def forward():
        with torch.no_grad():
            stack(x)

    def step():
        stack(x).backward(g)

    out = {"case": name, "kind": "gpt", "hidden": h, "heads": heads, "rows": rows, "seq": seq, "layers": layers,
           "forward": timed(forward), "step": timed(step)}
    out["profile"] = profiled(step)
    del stack, x, g
    return out


def head_case(name, h, vocab, tokens) -> dict:
    torch.manual_seed(0)
    w = (torch.randn(vocab, h, device=DEV, dtype=DT) * 0.02).requires_grad_()
    x = torch.randn(tokens, h, device=DEV, dtype=DT, requires_grad=True)
    y = torch.randint(0, vocab, (tokens,), device=DEV)

    def logits_only():
        (x @ w.t()).backward(torch.ones(tokens, vocab, device=DEV, dtype=DT))

    def step():
        F.cross_entropy((x @ w.t()).float(), y).backward()

    out = {"case": name, "kind": "head", "hidden": h, "vocab": vocab, "tokens": tokens,
           "multiplies": timed(logits_only), "step": timed(step)}
    out["profile"] = profiled(step)
    return out


CASES = [
    # row 24: fms-fsdp Llama 2 7B, batch 2 x 4,096, no checkpointing
    lambda: llama_case("llama2-7b b2", 4096, 32, 32, 11008, 2, 4096, 4),
    # rows 25/28 (34B: GQA 64/8, ffn 22,016) and 26/29 (70B: ffn 28,672), full checkpointing, batch 2
    lambda: llama_case("llama2-34b b2 full AC", 8192, 64, 8, 22016, 2, 4096, 2, full_ac=True),
    lambda: llama_case("llama2-34b b2", 8192, 64, 8, 22016, 2, 4096, 2),
    lambda: llama_case("llama2-70b b2 full AC", 8192, 64, 8, 28672, 2, 4096, 2, full_ac=True),
    # row 1: Megatron GPT 1.7B (hidden 2,048, 16 heads, 4,096 tokens, one sequence), and its 131,072 head
    lambda: gpt_case("gpt 2048 b1", 2048, 16, 1, 4096, 8),
    lambda: head_case("head 2048 x 131072", 2048, 131072, 4096),
    lambda: head_case("head 4096 x 32000 b2", 4096, 32000, 8192),
    # row 2's tensor-parallel shard (7.1B: hidden 4,096, t 2) as a single-GPU GPT block is not a shard;
    # the full 4,096 block at one sequence stands beside the earlier H100 measurement
    lambda: gpt_case("gpt 4096 b1", 4096, 32, 1, 4096, 4),
    # the 7B layer again with SDPA held to FlashAttention-2 (the 2024 runs' kernel) rather than its default
    lambda: llama_case("llama2-7b b2 FA2", 4096, 32, 32, 11008, 2, 4096, 4, backend="FLASH_ATTENTION"),
]
ONLY = os.environ.get("PROBE_CASES")   # run only these (indices into CASES, comma-separated)
if ONLY:
    CASES = [CASES[int(i)] for i in ONLY.split(",")]

if SMALL:
    CASES = [lambda: llama_case("toy", 64, 4, 2, 128, 2, 32, 2),
             lambda: llama_case("toy ac", 64, 4, 2, 128, 2, 32, 2, full_ac=True),
             lambda: gpt_case("toy gpt", 64, 4, 1, 32, 2), lambda: head_case("toy head", 64, 100, 32)]


def main(path: str) -> None:
    meta = {"torch": torch.__version__}
    if DEV == "cuda":
        p = torch.cuda.get_device_properties(0)
        meta.update(name=torch.cuda.get_device_name(0), sms=p.multi_processor_count, memory=p.total_memory,
                    cuda=torch.version.cuda)
    results = {"meta": meta, "cases": []}
    for case in CASES:
        t0 = time.perf_counter()
        try:
            r = case()
        except Exception as exc:   # keep going: one case's failure must not lose the others
            r = {"error": repr(exc)}
        r["probe_s"] = time.perf_counter() - t0
        if DEV == "cuda":
            r["max_allocated"] = torch.cuda.max_memory_allocated()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        results["cases"].append(r)
        print(r.get("case", r.get("error")), {k: r[k] for k in ("forward", "step", "multiplies") if k in r},
              f"{r['probe_s']:.1f}s", flush=True)
        with open(path, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "layer-probe.json")
