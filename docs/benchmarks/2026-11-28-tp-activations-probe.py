"""What a stack of torchtitan-style Llama layers keeps for backward under tensor and sequence
parallelism as DTensor runs it: torchtitan's plan, eager and compiled, without recomputation and
with its per-operator selective checkpointing.

A one-off measurement (2026-11-28), kept with its results so it can be run again:

    PYTHONPATH=. python3 docs/benchmarks/2026-11-28-tp-activations-probe.py OUT.json

Two ranks on the CPU (gloo), one intra-op thread each. The layer is
``2026-11-28-compiled-activations-probe.py``'s (float32 RMSNorm, complex rotary, ``repeat_kv``, SDPA,
SwiGLU), with two key/value heads of four, so each rank holds one (``repeat_kv`` a view). The plan
is torchtitan's ``apply_tp`` of December 2024 (``torchtitan/parallelisms/parallelize_llama.py``):
``SequenceParallel`` norms, ``PrepareModuleInput`` all-gathering the attention's and the MLP's
inputs, ``ColwiseParallel`` ``wq, wk, wv, w1, w3``, ``RowwiseParallel(output_layouts=Shard(1))``
``wo, w2``. The per-operator policy is torchtitan's ``_save_list`` (``aten.mm`` but every second,
the SDPA kernels, ``_c10d_functional.reduce_scatter_tensor``). "Kept": the bytes a rank's forward
leaves allocated (glibc's ``mallinfo2``), less the output.
"""
import os, sys, json, ctypes, gc, tempfile
from collections import defaultdict
import torch, torch.nn as nn, torch.nn.functional as F
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel, SequenceParallel, PrepareModuleInput,
                                               parallelize_module)

H, HEADS, KVH, FFN, SEQ, ROWS, LAYERS = 512, 4, 2, 1792, 512, 2, 4
HD = H // HEADS

class RMSNorm(nn.Module):
    def __init__(s, d): super().__init__(); s.weight = nn.Parameter(torch.ones(d))
    def forward(s, x):
        y = x.float(); return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(x) * s.weight

def rotary(x, f):
    z = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(z * f).flatten(3).type_as(x)

class Attention(nn.Module):
    def __init__(s):
        super().__init__()
        s.wq, s.wo = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        s.wk, s.wv = nn.Linear(H, KVH * HD, bias=False), nn.Linear(H, KVH * HD, bias=False)
    def forward(s, x, f):
        b, sq, _ = x.shape
        q = rotary(s.wq(x).view(b, sq, -1, HD), f); k = rotary(s.wk(x).view(b, sq, -1, HD), f); v = s.wv(x).view(b, sq, -1, HD)
        nh, nkv = q.shape[2], k.shape[2]; rep = nh // nkv
        k = k[:, :, :, None].expand(b, sq, nkv, rep, HD).reshape(b, sq, nh, HD)
        v = v[:, :, :, None].expand(b, sq, nkv, rep, HD).reshape(b, sq, nh, HD)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return s.wo(o.transpose(1, 2).reshape(b, sq, -1))

class FeedForward(nn.Module):
    def __init__(s):
        super().__init__()
        s.w1, s.w3, s.w2 = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False), nn.Linear(FFN, H, bias=False)
    def forward(s, x): return s.w2(F.silu(s.w1(x)) * s.w3(x))

class Block(nn.Module):
    def __init__(s):
        super().__init__()
        s.attention_norm, s.ffn_norm, s.attention, s.feed_forward = RMSNorm(H), RMSNorm(H), Attention(), FeedForward()
    def forward(s, x, f):
        h = x + s.attention(s.attention_norm(x), f)
        return h + s.feed_forward(s.ffn_norm(h))

SAVE = {torch.ops.aten.mm.default, torch.ops._c10d_functional.reduce_scatter_tensor.default,
        *[getattr(torch.ops.aten, n).default for n in ("_scaled_dot_product_flash_attention",
          "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu") if hasattr(torch.ops.aten, n)]}

def op_policy():
    counts = defaultdict(int)
    def policy(ctx, func, *a, **k):
        mode = "recompute" if ctx.is_recompute else "forward"
        if func == torch.ops.aten.mm.default: counts[mode] += 1
        save = func in SAVE and not (func == torch.ops.aten.mm.default and counts[mode] % 2 == 0)
        return CheckpointPolicy.MUST_SAVE if save else CheckpointPolicy.PREFER_RECOMPUTE
    return create_selective_checkpoint_contexts(policy)

class Wrapped(nn.Module):
    def __init__(s, pol): super().__init__(); s.block, s.pol = Block(), pol
    def forward(s, x, f):
        if s.pol == "none": return s.block(x, f)
        return checkpoint(s.block, x, f, use_reentrant=False, **({"context_fn": op_policy} if s.pol == "op" else {}))

class MI(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
def in_use():
    gc.collect(); libc = ctypes.CDLL("libc.so.6"); libc.mallinfo2.restype = MI; m = libc.mallinfo2(); return m.uordblks + m.hblkhd

def run(rank, world, path, out):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    res = {}
    for pol, compiled in (("none", False), ("op", False), ("none", True), ("op", True)):
        torch.manual_seed(0)
        layers = nn.ModuleList(Wrapped(pol) for _ in range(LAYERS)).to(torch.bfloat16)
        for l in layers:
            parallelize_module(l.block, mesh, {
                "attention_norm": SequenceParallel(),
                "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
                "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
                "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
                "ffn_norm": SequenceParallel(),
                "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
                "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
                "feed_forward.w3": ColwiseParallel()})
        if compiled:
            for i, l in enumerate(layers):
                layers[i] = torch.compile(l)
        x0 = torch.randn(ROWS, SEQ // world, H, dtype=torch.bfloat16)
        ang = torch.randn(SEQ, HD // 2); f = torch.polar(torch.ones_like(ang), ang)[None, :, None, :]
        def fwd():
            x = x0.clone()
            for l in layers: x = l(x, f)
            return x
        for _ in range(2): fwd().float().sum().backward()
        vals = []
        for _ in range(2):
            for p in layers.parameters(): p.grad = None
            before = in_use(); y = fwd(); yb = y.to_local() if hasattr(y, "to_local") else y
            vals.append(in_use() - before - yb.numel() * yb.element_size())
            y.float().sum().backward(); del y, yb
        res[f"{pol} {'compiled' if compiled else 'eager'}"] = vals
    if rank == 0:
        json.dump({"world": world, "shape": dict(hidden=H, heads=HEADS, kv_heads=KVH, ffn=FFN, seq=SEQ, rows=ROWS, layers=LAYERS), "kept_bytes": res}, open(out, "w"), indent=1)
    dist.destroy_process_group()

if __name__ == "__main__":
    path = tempfile.mktemp()      # the file store's rendezvous
    mp.spawn(run, args=(2, path, sys.argv[1]), nprocs=2)
    d = json.load(open(sys.argv[1])); unit = ROWS * SEQ * H * 2
    for k, v in d["kept_bytes"].items():
        print(f"{k:14s} kept per layer and rank: {v[-1] / LAYERS / unit:.3f} x (2 s b h) bytes")
