"""A transformer's sizes, which is all the advisor needs to know about a model.

(skeleton: fields fixed here; constructors from GPTConfig / presets / Llama shapes to be written)
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ModelShape"]


@dataclass(frozen=True)
class ModelShape:
    """``layers`` blocks of width ``hidden`` with ``heads`` heads, a ``vocab``-entry embedding, sequences
    of ``seq`` tokens, an MLP of ``ffn`` units (4 x hidden for GPT-2, about 8/3 x hidden x 2 matrices
    for a Llama gated MLP: ``gated=True``), tied or untied head."""

    layers: int
    hidden: int
    heads: int
    vocab: int
    seq: int
    ffn: int
    gated: bool = False
    tied: bool = True
    bias: bool = True
    name: str = "custom"
