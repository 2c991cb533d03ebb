"""Whole training steps of ``workbench.models.GPT`` on one GPU, for the device model to price.

A one-off measurement (2026-11-28), kept with its results so it can be run again:

    PYTHONPATH=. python3 docs/benchmarks/2026-11-28-step-probe.py OUT.json

The ten steps of the 2026-11-27 H100 run (docs/benchmarks/2026-11-27-h100-calibration.md), written
again: bf16 weights, fused AdamW, vocabulary 32,000, tied head, learned positions, heads of 128
channels (of 64 below hidden 512); every micro-batch's forward and backward (its loss divided by
the micro-batches), then the optimizer. CUDA events around each step, median of 5 after 2, and the
wall clock beside.
"""
from __future__ import annotations

import json
import sys
import time

import torch

from workbench.models import GPT, GPTConfig

# (layers, hidden, tokens, batch, sequences per micro-batch)
STEPS = [(8, 2048, 4096, 8, 1), (8, 2048, 4096, 8, 2), (8, 2048, 4096, 8, 4), (8, 2048, 4096, 8, 8),
         (8, 4096, 4096, 8, 1), (8, 4096, 4096, 8, 2), (8, 4096, 4096, 8, 4),
         (4, 1024, 2048, 16, 1), (4, 1024, 2048, 16, 4), (4, 1024, 2048, 16, 16),
         (16, 256, 512, 16, 1), (16, 256, 512, 16, 16)]


def one(layers: int, hidden: int, seq: int, batch: int, mbs: int) -> dict:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=layers, n_head=max(1, hidden // 128), n_embd=hidden, block_size=seq, vocab_size=32000)
    model = GPT(config).cuda().to(torch.bfloat16)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    x = torch.randint(0, 32000, (batch, seq), device="cuda")
    m = batch // mbs

    def step():
        for i in range(m):
            xs = x[i * mbs:(i + 1) * mbs]
            (model(xs, xs)[1] / m).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    gpu, wall = [], []
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        step()
        b.record()
        torch.cuda.synchronize()
        wall.append(time.perf_counter() - t0)
        gpu.append(a.elapsed_time(b) / 1e3)
    del model, opt
    torch.cuda.empty_cache()
    return {"layers": layers, "hidden": hidden, "seq": seq, "batch": batch, "mbs": mbs,
            "seconds": sorted(gpu)[2], "wall_seconds": sorted(wall)[2]}


def main(path: str) -> None:
    out = {"name": torch.cuda.get_device_name(0), "torch": torch.__version__, "steps": []}
    for args in STEPS:
        out["steps"].append(one(*args))
        print(out["steps"][-1], flush=True)
        with open(path, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "step-probe.json")
