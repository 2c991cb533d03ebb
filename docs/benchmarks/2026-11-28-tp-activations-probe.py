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
leaves allocated (glibc's ``mallinfo2``), less the output; the least of three forwards (another
thread's allocation, gloo's or autograd's, can land inside one).
"""
import importlib.util
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel,
                                               parallelize_module)

# the norm, the rotary, the checkpointing (torchtitan's per-operator policy) and the measurement: the
# compiled-activations probe's
_spec = importlib.util.spec_from_file_location(
    "compiled_probe", Path(__file__).with_name("2026-11-28-compiled-activations-probe.py"))
_probe = sys.modules["compiled_probe"] = importlib.util.module_from_spec(_spec)   # (torch.compile looks it up)
_spec.loader.exec_module(_probe)
RMSNorm, rotary, measure, Checkpointed = _probe.RMSNorm, _probe.rotary, _probe.measure, _probe.Checkpointed

H, HEADS, KVH, FFN, SEQ, ROWS, LAYERS = 512, 4, 2, 1792, 512, 2, 4
HD = H // HEADS


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.wq, self.wo = nn.Linear(H, H, bias=False), nn.Linear(H, H, bias=False)
        self.wk, self.wv = nn.Linear(H, KVH * HD, bias=False), nn.Linear(H, KVH * HD, bias=False)

    def forward(self, x, freqs):
        b, s, _ = x.shape   # the heads are this rank's (-1): the projections are column-parallel
        q = rotary(self.wq(x).view(b, s, -1, HD), freqs)
        k = rotary(self.wk(x).view(b, s, -1, HD), freqs)
        v = self.wv(x).view(b, s, -1, HD)
        heads, kv_heads = q.shape[2], k.shape[2]
        rep = heads // kv_heads     # torchtitan's repeat_kv
        k = k[:, :, :, None].expand(b, s, kv_heads, rep, HD).reshape(b, s, heads, HD)
        v = v[:, :, :, None].expand(b, s, kv_heads, rep, HD).reshape(b, s, heads, HD)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(H, FFN, bias=False), nn.Linear(H, FFN, bias=False)
        self.w2 = nn.Linear(FFN, H, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    """torchtitan's TransformerBlock: the module names its tensor-parallel plan refers to."""

    def __init__(self):
        super().__init__()
        self.attention_norm, self.ffn_norm = RMSNorm(H), RMSNorm(H)
        self.attention, self.feed_forward = Attention(), FeedForward()

    def forward(self, x, freqs):
        h = x + self.attention(self.attention_norm(x), freqs)
        return h + self.feed_forward(self.ffn_norm(h))


PLAN = {   # torchtitan's apply_tp for each TransformerBlock (December 2024)
    "attention_norm": SequenceParallel(),
    "attention": PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None)),
    "attention.wq": ColwiseParallel(), "attention.wk": ColwiseParallel(), "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(output_layouts=Shard(1)),
    "ffn_norm": SequenceParallel(),
    "feed_forward": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
    "feed_forward.w1": ColwiseParallel(), "feed_forward.w2": RowwiseParallel(output_layouts=Shard(1)),
    "feed_forward.w3": ColwiseParallel(),
}


def run(rank: int, world: int, path: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))
    kept = {}
    for policy, compiled in (("none", False), ("op", False), ("none", True), ("op", True)):
        torch.manual_seed(0)
        layers = nn.ModuleList(Checkpointed(policy, Block()) for _ in range(LAYERS)).to(torch.bfloat16)
        for layer in layers:
            parallelize_module(layer.layer, mesh, PLAN)
        if compiled:   # torchtitan's order: tensor parallelism, checkpointing, then compile
            for i, layer in enumerate(layers):
                layers[i] = torch.compile(layer)
        x0 = torch.randn(ROWS, SEQ // world, H, dtype=torch.bfloat16)   # this rank's sequence shard
        angles = torch.randn(SEQ, HD // 2)
        measured = measure(layers, x0, torch.polar(torch.ones_like(angles), angles)[None, :, None, :])
        kept[f"{policy} {'compiled' if compiled else 'eager'}"] = measured
    if rank == 0:
        shape = {"hidden": H, "heads": HEADS, "kv_heads": KVH, "ffn": FFN, "seq": SEQ, "rows": ROWS, "layers": LAYERS}
        with open(out, "w") as f:
            json.dump({"world": world, "torch": torch.__version__, "shape": shape, "kept_bytes": kept}, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    mp.spawn(run, args=(2, tempfile.mktemp(), sys.argv[1]), nprocs=2)   # a file store's rendezvous path
    with open(sys.argv[1]) as f:
        result = json.load(f)
    unit = ROWS * SEQ * H * 2
    for name, values in result["kept_bytes"].items():
        print(f"{name:14s} kept per layer and rank: {min(values) / LAYERS / unit:.3f} x (2 s b h) bytes")
