"""What a stack of torchtitan-style Llama layers keeps for backward: eager against torch.compile.

A one-off measurement (2026-11-28), kept with its results so it can be run again:

    PYTHONPATH=. python3 docs/benchmarks/2026-11-28-compiled-activations-probe.py OUT.json [cuda]

The layer is torchtitan's eager Llama as of December 2024 (float32 RMSNorm, rotary through complex
numbers, three projections, ``repeat_kv``, SDPA, SwiGLU as two multiplies), at a small shape with
Llama 3 8B's ratios (GQA 4:1, ffn 3.5 h), in bf16. Each recomputation policy is applied as
torchtitan applies it: ``none``; ``op``, its per-operator selective checkpointing (``_save_list``:
``aten.mm`` and the SDPA kernels, every second ``mm`` recomputed, everything else
``PREFER_RECOMPUTE``); ``full``, every layer checkpointed. Then each layer is compiled
(``torch.compile`` over the checkpointed layer, torchtitan's ``apply_compile`` order).

"Kept" is what the forward leaves allocated for the backward: the bytes in use after the forward
less those before it and the output, the least of three forwards. On the CPU the C allocator's count (glibc's ``mallinfo2``,
which PyTorch's CPU allocator draws from); on a GPU ``torch.cuda.memory_allocated``. The input
is a fresh tensor, so each of the L layers' inputs is counted. One more case, without
recomputation and eager, has two key/value heads: ``repeat_kv`` then copies (with one it is a view).
"""
from __future__ import annotations

import ctypes
import gc
import json
import sys
from collections import defaultdict

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

DEV = "cuda" if "cuda" in sys.argv[2:] else "cpu"
H, HEADS, KV_HEADS, FFN, SEQ, ROWS, LAYERS = 512, 4, 1, 1792, 512, 2, 4
HD = H // HEADS


class RMSNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * self.weight


def rotary(x, freqs):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * freqs).flatten(3).type_as(x)


class LlamaLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(H), RMSNorm(H)
        self.wq, self.wo = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.wk, self.wv = nn.Linear(H, KV_HEADS * HD, bias=False), nn.Linear(H, KV_HEADS * HD, bias=False)
        self.w1, self.w3 = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape
        z = self.attention_norm(x)
        q = rotary(self.wq(z).view(b, s, HEADS, HD), freqs)
        k = rotary(self.wk(z).view(b, s, KV_HEADS, HD), freqs)
        v = self.wv(z).view(b, s, KV_HEADS, HD)
        rep = HEADS // KV_HEADS     # torchtitan's repeat_kv
        k = k[:, :, :, None].expand(b, s, KV_HEADS, rep, HD).reshape(b, s, HEADS, HD)
        v = v[:, :, :, None].expand(b, s, KV_HEADS, rep, HD).reshape(b, s, HEADS, HD)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        x = x + self.wo(o.transpose(1, 2).reshape(b, s, H))
        z = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(z)) * self.w3(z))


_SDPA = [getattr(torch.ops.aten, n).default for n in (
    "_scaled_dot_product_flash_attention", "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_cudnn_attention") if hasattr(torch.ops.aten, n)]
SAVE = {torch.ops.aten.mm.default, torch.ops._c10d_functional.reduce_scatter_tensor.default, *_SDPA}


def op_policy():
    """torchtitan's ``_get_custom_policy``: save what ``_save_list`` names, except every second mm."""
    counts = defaultdict(int)

    def policy(ctx, func, *args, **kwargs):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default:
            counts[mode] += 1
        save = func in SAVE and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)


class Checkpointed(nn.Module):
    """``layer`` (a :class:`LlamaLayer` by default) under a recomputation policy, as torchtitan wraps
    each block: ``none``, ``op`` (per-operator) or ``full``."""

    def __init__(self, policy: str, layer: nn.Module | None = None):
        super().__init__()
        self.layer, self.policy = layer if layer is not None else LlamaLayer(), policy

    def forward(self, x, freqs):
        if self.policy == "none":
            return self.layer(x, freqs)
        extra = {"context_fn": op_policy} if self.policy == "op" else {}
        return checkpoint(self.layer, x, freqs, use_reentrant=False, **extra)


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                "fsmblks", "uordblks", "fordblks", "keepcost")]


def in_use() -> int:
    gc.collect()
    if DEV == "cuda":
        torch.cuda.synchronize()
        return torch.cuda.memory_allocated()
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _MallInfo2
    info = libc.mallinfo2()
    return info.uordblks + info.hblkhd


def measure(layers, x0, freqs, trials: int = 3) -> list[int]:
    """Bytes the forward of ``layers`` on ``x0`` leaves allocated, less its output, per trial (after
    two warm-up steps: compilation, the allocator's pools)."""
    def forward():
        x = x0.clone()
        for layer in layers:
            x = layer(x, freqs)
        return x

    for _ in range(2):
        forward().float().sum().backward()
    out = []
    for _ in range(trials):
        for p in layers.parameters():
            p.grad = None
        before = in_use()
        y = forward()
        local = y.to_local() if hasattr(y, "to_local") else y    # a DTensor: this rank's shard
        out.append(in_use() - before - local.numel() * local.element_size())
        y.float().sum().backward()
        del y, local
    return out


def kept(policy: str, compiled: bool) -> list[int]:
    torch.manual_seed(0)
    layers = nn.ModuleList(Checkpointed(policy) for _ in range(LAYERS)).to(DEV, torch.bfloat16)
    if compiled:
        for i, layer in enumerate(layers):
            layers[i] = torch.compile(layer)
    x0 = torch.randn(ROWS, SEQ, H, dtype=torch.bfloat16, device=DEV)
    angles = torch.randn(SEQ, HD // 2, device=DEV)
    return measure(layers, x0, torch.polar(torch.ones_like(angles), angles)[None, :, None, :])


def main() -> int:
    torch.set_num_threads(1)
    result = {"device": DEV, "torch": torch.__version__,
              "shape": {"hidden": H, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN, "seq": SEQ, "rows": ROWS,
                        "layers": LAYERS, "dtype": "bfloat16"},
              "kept_bytes": {}}
    for policy in ("none", "op", "full"):
        for compiled in (False, True):
            name = f"{policy} {'compiled' if compiled else 'eager'}"
            result["kept_bytes"][name] = kept(policy, compiled)
            unit = ROWS * SEQ * H * 2
            print(f"{name:14s} kept per layer: {min(result['kept_bytes'][name]) / LAYERS / unit:.3f} x (2 s b h) bytes")
    globals()["KV_HEADS"] = 2    # read by LlamaLayer when it is built
    result["kept_bytes"]["none eager, 2 kv heads"] = kept("none", False)
    print(f"none eager, 2 kv heads: {min(result['kept_bytes']['none eager, 2 kv heads']) / LAYERS / unit:.3f}")
    with open(sys.argv[1], "w") as f:
        json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
