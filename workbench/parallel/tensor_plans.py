"""Tensor-parallel plans: which layer of a model is split how, written as data.

A plan maps module names to *styles*, the way ``torch.distributed.tensor.parallel.parallelize_module``
and torchtitan's ``parallelize_llama`` do. Names are glob patterns matched one dotted part at a
time (``"model.layers.*.self_attn.q_proj"``: ``*`` stands for one part, such as a layer number).
:func:`workbench.parallel.tensor.tensor_parallel` swaps each matched layer in place for its split
twin; the model's own forward then runs on the twins unchanged.

=================  =====================================  =============================================
style              layer                                  what rank r keeps and says
=================  =====================================  =============================================
``colwise``        ``nn.Linear`` or GPT-2's ``Conv1D``    rows r of the output (``chunks=3``: of q, k
                                                          and v each); input gradient all-reduced (f)
``rowwise``        ``nn.Linear`` or ``Conv1D``            columns r of the input; output all-reduced (g)
``vocab``          ``nn.Embedding``                       rows r of the vocabulary; output all-reduced
``colwise_gather`` the head (``nn.Linear``)               rows r of the vocabulary; the logits
                                                          all-gathered (or, where the loss is ours,
                                                          left split for the vocabulary-parallel
                                                          cross-entropy: the full logits never exist)
``sequence``       a norm or a dropout                    with ``sequence_parallel=True``: a norm on
                                                          ``s/t`` positions, its weight's gradient
                                                          all-reduced; otherwise nothing
=================  =====================================  =============================================

Sequence parallelism in a model whose forward is left alone (Hugging Face's) covers the blocks:
the plan's ``sequence_blocks`` names the block list, whose input is split by sequence on entering
the first block and all-gathered on leaving the last, so the model still computes its positions,
rotary tables and causal mask for the whole sequence.

A column-parallel layer leaves each rank its own heads (attention) or hidden units (MLP), so a
model whose attention reads its head count from an attribute needs that count divided by ``t``:
a plan's ``heads`` names those attention modules and attributes (GPT-2's ``split_size`` and
``num_heads``). Llama's attention reshapes by ``head_dim`` alone and needs nothing, but with
grouped-query attention each rank must hold whole key/value heads: ``t`` must divide
``num_key_value_heads``. Our GPT's attention splits its fused q, k, v by the input width, so
its attention module is replaced by :class:`~workbench.parallel.tp_layers.ParallelSelfAttention`.

Cost and memory are those of the styles (see :mod:`workbench.parallel.tensor`): per transformer
layer two all-reduces of ``b s h`` forward and two backward; a gathered head adds an all-gather
of the ``b s V`` logits forward (each rank then holds all of them: ``b s V`` floats), which the
vocabulary-parallel cross-entropy avoids.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Callable, Mapping

import torch.nn as nn

from workbench.parallel.tp_layers import ParallelSelfAttention

__all__ = ["STYLES", "Style", "TensorParallelPlan", "PLANS", "plan_for", "detect", "match", "is_conv1d",
           "gpt_plan", "GPT2_PLAN", "LLAMA_PLAN"]

STYLES = ("colwise", "rowwise", "vocab", "colwise_gather", "sequence")


@dataclass(frozen=True)
class Style:
    """How one layer is split. ``chunks``: the output of a ``colwise`` layer is that many stacked
    blocks (GPT-2's ``c_attn`` packs q, k and v: ``chunks=3``), each split over the ranks."""

    kind: str
    chunks: int = 1

    def __post_init__(self):
        if self.kind not in STYLES:
            raise ValueError(f"tensor_parallel(plan=...): unknown style {self.kind!r}; the styles are {list(STYLES)}")
        if isinstance(self.chunks, bool) or not isinstance(self.chunks, int) or self.chunks < 1:
            raise ValueError(f"Style({self.kind!r}, chunks={self.chunks!r}): chunks must be a whole number >= 1")
        if self.chunks > 1 and self.kind != "colwise":
            raise ValueError(f"Style({self.kind!r}, chunks={self.chunks}): only a colwise layer has packed outputs")


@dataclass(frozen=True)
class TensorParallelPlan:
    """A model family's plan.

    ``layers``: module glob -> style (a name from :data:`STYLES` or a :class:`Style`).
    ``heads``: attention-module glob -> the integer attributes to divide by ``t`` where present
    (or a callable ``(module, t) -> replacement``). ``kv_heads``: the config attribute that ``t``
    must divide (grouped-query attention). ``loss_parallel``: the model's loss is ours (our GPT),
    so a ``colwise_gather`` head keeps its logits split and the loss is computed from the shards.
    ``sequence_blocks``: the block list that sequence parallelism splits by sequence, for a model
    whose forward is left alone (its input is split on entering the first block and gathered on
    leaving the last one).
    """

    name: str
    layers: Mapping[str, str | Style]
    heads: Mapping[str, tuple[str, ...] | Callable] = field(default_factory=dict)
    kv_heads: str | None = None
    loss_parallel: bool = False
    sequence_blocks: str | None = None

    def styles(self) -> dict[str, Style]:
        out = {}
        for pattern, style in self.layers.items():
            if not isinstance(pattern, str) or not pattern:
                raise ValueError(f"tensor_parallel(plan=...): module names must be non-empty strings, got {pattern!r}")
            out[pattern] = style if isinstance(style, Style) else Style(style) if isinstance(style, str) else \
                _bad_style(pattern, style)
        return out


def _bad_style(pattern, style):
    raise ValueError(f"tensor_parallel(plan=...): {pattern!r} maps to {style!r}; a style is one of {list(STYLES)} "
                     "or a Style(...)")


# ==================================================================================== the plans
def _gpt_attention(module: nn.Module, t: int) -> nn.Module:
    """Our GPT's attention on this rank's heads (its forward splits q, k, v by the full width)."""
    return ParallelSelfAttention(module.c_attn, module.c_proj, module.n_head, t, float(getattr(module, "dropout", 0.0)),
                                 getattr(module, "resid_dropout", None))


def gpt_plan(experts: bool = False) -> TensorParallelPlan:
    """Our GPT (:class:`workbench.models.GPT`): Megatron's split, the loss vocabulary-parallel.
    ``experts``: every expert's MLP of a mixture-of-experts GPT is split instead of one MLP."""
    mlp = "blocks.*.mlp.experts.*" if experts else "blocks.*.mlp"
    return TensorParallelPlan("gpt", {
        "wte": "vocab",
        "blocks.*.ln_1": "sequence",
        "blocks.*.attn.c_attn": Style("colwise", chunks=3),
        "blocks.*.attn.c_proj": "rowwise",
        "blocks.*.ln_2": "sequence",
        f"{mlp}.c_fc": "colwise",
        f"{mlp}.c_proj": "rowwise",
        "ln_f": "sequence",
        "lm_head": "colwise_gather",
    }, heads={"blocks.*.attn": _gpt_attention}, loss_parallel=True)


# Hugging Face GPT2LMHeadModel: Conv1D layers (weights stored transposed), q, k, v packed in c_attn
GPT2_PLAN = TensorParallelPlan("gpt2", {
    "transformer.wte": "vocab",
    "transformer.h.*.ln_1": "sequence",
    "transformer.h.*.attn.c_attn": Style("colwise", chunks=3),
    "transformer.h.*.attn.c_proj": "rowwise",
    "transformer.h.*.ln_2": "sequence",
    "transformer.h.*.mlp.c_fc": "colwise",
    "transformer.h.*.mlp.c_proj": "rowwise",
    "lm_head": "colwise_gather",
}, heads={"transformer.h.*.attn": ("num_heads", "split_size")}, kv_heads="n_head", sequence_blocks="transformer.h")

# Hugging Face LlamaForCausalLM (torchtitan's parallelize_llama)
LLAMA_PLAN = TensorParallelPlan("llama", {
    "model.embed_tokens": "vocab",
    "model.layers.*.input_layernorm": "sequence",
    "model.layers.*.self_attn.q_proj": "colwise",
    "model.layers.*.self_attn.k_proj": "colwise",
    "model.layers.*.self_attn.v_proj": "colwise",
    "model.layers.*.self_attn.o_proj": "rowwise",
    "model.layers.*.post_attention_layernorm": "sequence",
    "model.layers.*.mlp.gate_proj": "colwise",
    "model.layers.*.mlp.up_proj": "colwise",
    "model.layers.*.mlp.down_proj": "rowwise",
    "lm_head": "colwise_gather",
}, heads={"model.layers.*.self_attn": ("num_heads", "num_key_value_heads", "hidden_size")},
    kv_heads="num_key_value_heads", sequence_blocks="model.layers")

PLANS = {"gpt": gpt_plan(), "gpt2": GPT2_PLAN, "llama": LLAMA_PLAN}

_GPT_LAYERS = ("wte", "wpe", "blocks", "ln_f", "lm_head")


def detect(model: nn.Module) -> str | None:
    """The shipped plan's name for ``model`` (``"gpt"``, ``"gpt2"``, ``"llama"``), or None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ("gpt2", "llama") and hasattr(model, "lm_head"):
        return model_type
    if all(hasattr(model, n) for n in _GPT_LAYERS):
        return "gpt"
    return None


def plan_for(model: nn.Module, plan) -> TensorParallelPlan:
    """Resolve ``plan`` (None: detected; a name; a dict of globs to styles; a plan) for ``model``.
    A dict keeps the detected family's head adjustments and loss."""
    if isinstance(plan, TensorParallelPlan):
        return plan
    family = detect(model)
    if isinstance(plan, str):
        if plan not in PLANS:
            raise ValueError(f"tensor_parallel(plan={plan!r}): no such plan; the shipped plans are {sorted(PLANS)}, "
                             "or pass a dict of module globs to styles")
        plan, family = None, plan
    base = None
    if family == "gpt":
        experts = bool(getattr(getattr(model, "config", None), "n_experts", 0))
        base = gpt_plan(experts)
    elif family is not None:
        base = PLANS[family]
    if plan is None:
        if base is None:
            raise ValueError(f"tensor_parallel(model={type(model).__name__}): the model lacks the layers it expects "
                             f"for a shipped plan (our GPT: {', '.join(_GPT_LAYERS)}; Hugging Face GPT-2 or Llama: "
                             "config.model_type 'gpt2' or 'llama'); pass plan={'module.glob': 'colwise', ...}")
        return base
    if not isinstance(plan, Mapping):
        raise ValueError(f"tensor_parallel(plan={plan!r}): pass None, a plan name {sorted(PLANS)}, a dict of module "
                         "globs to styles or a TensorParallelPlan")
    if base is None:
        return TensorParallelPlan("custom", dict(plan))
    return TensorParallelPlan(f"custom ({base.name})", dict(plan), base.heads, base.kv_heads, base.loss_parallel,
                              base.sequence_blocks)


# ==================================================================================== matching
def _matches(pattern: str, name: str) -> bool:
    parts, want = name.split("."), pattern.split(".")
    return len(parts) == len(want) and all(fnmatchcase(p, w) for p, w in zip(parts, want))


def _families(names) -> list[str]:
    """Module names with layer numbers folded into ``*``: a short list of what exists."""
    out = []
    for n in names:
        folded = re.sub(r"(?<=\.)\d+(?=\.|$)", "*", n)
        if folded not in out:
            out.append(folded)
    return out


def is_conv1d(module: nn.Module) -> bool:
    """Hugging Face's ``Conv1D`` (a linear layer whose weight is stored ``(in, out)``)."""
    return type(module).__name__ == "Conv1D" and hasattr(module, "nf") and getattr(module, "weight", None) is not None


def _fits(style: Style, module: nn.Module) -> bool:
    if style.kind in ("colwise", "rowwise", "colwise_gather"):
        return isinstance(module, nn.Linear) or is_conv1d(module)
    if style.kind == "vocab":
        return isinstance(module, nn.Embedding)
    return isinstance(module, nn.Dropout) or "norm" in type(module).__name__.lower()


def match(model: nn.Module, plan: TensorParallelPlan, where: str = "tensor_parallel") -> dict[str, Style]:
    """``{module name: style}`` for every module the plan names; a ``ValueError`` (before any
    message is sent) for a pattern that matches nothing, a module matched twice, or a style that
    does not fit the module's type. The errors list what matched and what exists."""
    styles = plan.styles()
    names = [n for n, _ in model.named_modules() if n]
    modules = dict(model.named_modules())
    found: dict[str, tuple[str, Style]] = {}
    counts = {}
    for pattern, style in styles.items():
        hits = [n for n in names if _matches(pattern, n)]
        counts[pattern] = len(hits)
        for n in hits:
            if n in found:
                raise ValueError(f"{where}(plan={plan.name!r}): module {n!r} is matched by both {found[n][0]!r} and "
                                 f"{pattern!r}: give each module one style")
            found[n] = (pattern, style)
    missing = [p for p, c in counts.items() if c == 0]
    if missing:
        matched = ", ".join(f"{p!r} ({c})" for p, c in counts.items() if c) or "nothing"
        raise ValueError(f"{where}(plan={plan.name!r}): {', '.join(map(repr, missing))} matches no module of "
                         f"{type(model).__name__}; matched: {matched}; modules that exist: "
                         f"{', '.join(_families(names))}: fix the name (globs match one dotted part per '*')")
    for n, (pattern, style) in found.items():
        if not _fits(style, modules[n]):
            raise ValueError(f"{where}(plan={plan.name!r}): {n!r} is a {type(modules[n]).__name__}, which style "
                             f"{style.kind!r} cannot split ({pattern!r}); colwise/rowwise/colwise_gather take "
                             "nn.Linear or Conv1D, vocab nn.Embedding, sequence a norm or a dropout")
    return {n: s for n, (_, s) in found.items()}


def head_modules(model: nn.Module, plan: TensorParallelPlan) -> list[tuple[str, nn.Module, tuple | Callable]]:
    """The attention modules whose head counts the plan adjusts, with what to do to each."""
    out = []
    for name, module in model.named_modules():
        for pattern, what in plan.heads.items():
            if name and _matches(pattern, name):
                out.append((name, module, what))
                break
    return out
