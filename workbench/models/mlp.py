"""A stack of Linear layers: the model for communication-heavy benchmarks.

``MLP(width, depth)`` holds ``depth`` Linear layers with ReLU between them (none after the last).
With ``in_features = out_features = width`` it has ``depth x (width^2 + width)`` parameters and
costs ``2 x parameters`` FLOPs per sample forward, so a benchmark can dial the ratio of compute
(grows with batch) to gradient bytes (fixed by width and depth) with two numbers. Every layer is
the same shape, which makes it the simplest model to split into pipeline stages or to shard.
"""
from __future__ import annotations

import torch
import torch.nn as nn

__all__ = ["MLP"]


class MLP(nn.Module):
    """``depth`` Linear layers (``in_features -> width -> ... -> width -> out_features``), ReLU between.

    ``in_features`` and ``out_features`` default to ``width``. The layers are ``self.layers``
    (an ``nn.Sequential``), Linear and ReLU modules interleaved.
    """

    def __init__(self, width: int = 1024, depth: int = 8, in_features: int | None = None,
                 out_features: int | None = None, bias: bool = True):
        super().__init__()
        for name, value in (("width", width), ("depth", depth), ("in_features", in_features),
                            ("out_features", out_features)):
            if value is None and name in ("in_features", "out_features"):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"MLP({name}={value!r}): must be a whole number >= 1")
        self.width, self.depth = width, depth
        self.in_features = width if in_features is None else in_features
        self.out_features = width if out_features is None else out_features
        sizes = [self.in_features] + [width] * (depth - 1) + [self.out_features]
        layers: list[nn.Module] = []
        for i in range(depth):
            layers.append(nn.Linear(sizes[i], sizes[i + 1], bias=bias))
            if i < depth - 1:
                layers.append(nn.ReLU())
        self.layers = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"MLP.forward: input has {x.shape[-1]} features in its last dimension but the "
                             f"model expects in_features={self.in_features}")
        return self.layers(x)

    def num_parameters(self) -> int:
        """Number of parameters."""
        return sum(p.numel() for p in self.parameters())
