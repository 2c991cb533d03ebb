"""Shared pieces of the ZeRO and FSDP parity tests: the optimizer settings, the global batches,
each rank's slice of them, and the largest difference between two state dicts."""
from __future__ import annotations

import torch

import workbench

# eps=1e-5, not 1e-8: with near-zero gradients Adam turns the last-bit differences of a different
# summation order into whole steps (1e-8 lets a single process with the same gradients summed in
# another order drift by 2e-6 at world size 3; 1e-5 keeps it under 4e-7).
ADAMW = dict(lr=1e-3, eps=1e-5, weight_decay=0.1)
GLOBAL_BATCH = 6


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, 65, (GLOBAL_BATCH, 16), generator=g),
             torch.randint(0, 65, (GLOBAL_BATCH, 16), generator=g)) for _ in range(steps)]


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's contiguous slice of the global batch."""
    b = t.shape[0] // workbench.world_size()
    return t[workbench.rank() * b:(workbench.rank() + 1) * b]


def max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b), (sorted(a), sorted(b))
    return max((a[k] - b[k]).abs().max().item() for k in a)
