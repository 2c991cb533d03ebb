"""A pipeline stage that sleeps instead of computing: for timing schedules on a small machine.

:class:`SleepStage` takes a fixed time in forward, in the input-gradient backward and in the
weight-gradient backward, without using a core (``time.sleep`` releases it), so 8 stages on a
2-core laptop show a schedule's real bubble. Its output is its input plus a learnable scalar,
so gradients flow and a pipeline's messages have the input's size.

Forward and backward are two autograd nodes on purpose::

    out = _SleepInput(x) + _SleepWeight(w)

``torch.autograd.grad(out, x)`` (a zero-bubble B) runs only ``_SleepInput``'s backward
(``backward_s``); ``backward(out, inputs=[w])`` (a W) runs only ``_SleepWeight``'s (``weight_s``);
a full backward runs both. The forward sleeps ``forward_s``. ``w`` is a 1 x 1 matrix: like a
Linear's weight, its gradient is one a zero-bubble schedule defers to W (vectors' gradients are
computed in B, see :mod:`workbench.parallel.pipeline_backward`).
"""
from __future__ import annotations

import time

import torch
import torch.nn as nn

__all__ = ["SleepStage"]


class _SleepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, forward_s, backward_s):
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.backward_s)
        return grad, None, None


class _SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, weight_s):
        ctx.weight_s = weight_s
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.weight_s)
        return grad, None


class SleepStage(nn.Module):
    """``forward(x) = x + w``, sleeping ``forward_s`` in forward, ``backward_s`` in the input
    gradient and ``weight_s`` in the weight gradient (a full backward: both)."""

    def __init__(self, forward_s: float = 0.01, backward_s: float | None = None,
                 weight_s: float | None = None):
        super().__init__()
        for name, value in (("forward_s", forward_s), ("backward_s", backward_s), ("weight_s", weight_s)):
            if value is not None and not value >= 0:
                raise ValueError(f"SleepStage({name}={value!r}): a time in seconds must be >= 0")
        self.forward_s = forward_s
        self.backward_s = forward_s if backward_s is None else backward_s
        self.weight_s = forward_s if weight_s is None else weight_s
        self.w = nn.Parameter(torch.zeros(1, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _SleepInput.apply(x, self.forward_s, self.backward_s) + _SleepWeight.apply(self.w, self.weight_s).squeeze()
