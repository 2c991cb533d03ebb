"""Pipeline stages by a split: where a model is cut, and what each stage must rebuild to run alone.

A decoder-only language model is three parts around a list of blocks: the embeddings, the
blocks, the final norm and head. Cutting it into ``p`` stages puts the embeddings on the first
stage, the norm and head on the last, and a contiguous run of blocks on each; what flows
between stages is one tensor, the hidden states ``(b, s, h)``. Two things every block reads are
not in that tensor, so each stage makes them again from the sequence length: the positions
(GPT-2's learned ``wpe`` on the first stage only; Llama's rotary ``cos``/``sin`` tables on every
stage, from the model's own ``rotary_emb``) and the causal mask (the model's own
``create_causal_mask``; ``None`` where the attention kernel applies causality itself). Both cost
``O(s h)`` work and no message.

A *split* says where the cuts are: module names before which a new stage begins
(``["model.layers.2"]``: stage 0 has layers 0-1, stage 1 the rest), or a callable
``split(model, num_stages) -> stages`` for a model whose stages you write yourself. The
built-in splits (our GPT, Hugging Face GPT-2, Llama) balance the blocks when no names are given.

Each stage holds the *same* submodules as the model (no copy) under the model's own names
(``transformer.h.1.attn.c_attn.weight``), so its parameters can be compared with, and loaded
from, the single model by name. A tied embedding and head (GPT-2) sits on the first and the last
stage; each stage's ``shared_parameters`` lists it, and the pipeline sums its two gradients
between the two ranks after backward (Megatron's embedding group), as for our GPT.

Stages take token ids (first stage) or hidden states and return hidden states or, on the last
stage, the logits ``(b, s, V)``; :func:`causal_lm_loss` is Hugging Face's loss on them (labels
shifted by one inside), so a schedule's loss equals ``model(input_ids, labels=labels).loss``.
"""
from __future__ import annotations

import inspect
from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["SPLITS", "Layout", "GPTStage", "HFStage", "detect", "split_points", "balanced", "causal_lm_loss",
           "boundaries"]


class Layout:
    """Where a family keeps its parts: the block list, what the first and the last stage hold."""

    def __init__(self, name: str, blocks: str, first: Sequence[str], last: Sequence[str],
                 every: Sequence[str] = ()):
        self.name, self.blocks = name, blocks
        self.first, self.last, self.every = tuple(first), tuple(last), tuple(every)


SPLITS = {
    "gpt": Layout("gpt", "blocks", ("wte", "wpe", "drop"), ("ln_f", "lm_head")),
    "gpt2": Layout("gpt2", "transformer.h", ("transformer.wte", "transformer.wpe", "transformer.drop"),
                   ("transformer.ln_f", "lm_head")),
    "llama": Layout("llama", "model.layers", ("model.embed_tokens",), ("model.norm", "lm_head"),
                    every=("model.rotary_emb",)),
}


def detect(model: nn.Module) -> str | None:
    """The built-in split's name for ``model``, or None."""
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if model_type in ("gpt2", "llama") and hasattr(model, "lm_head"):
        return model_type
    if all(hasattr(model, n) for n in ("wte", "blocks", "ln_f", "lm_head")):
        return "gpt"
    return None


def balanced(n_layers: int, num_stages: int) -> list[int]:
    """Blocks per stage when no split is given: ``n_layers`` as even as whole blocks allow, the
    first ``n_layers % num_stages`` stages one block more (the advisor prices the same cut)."""
    return [n_layers // num_stages + (1 if k < n_layers % num_stages else 0) for k in range(num_stages)]


def boundaries(model: nn.Module, family: str) -> list[str]:
    """The names a split may cut before: every block but the first."""
    blocks = model.get_submodule(SPLITS[family].blocks)
    return [f"{SPLITS[family].blocks}.{i}" for i in range(1, len(blocks))]


def split_points(model: nn.Module, family: str, num_stages: int, split: Sequence[str] | None) -> list[int]:
    """Blocks per stage from boundary names (None: balanced); a ``ValueError`` names the fix."""
    n = len(model.get_submodule(SPLITS[family].blocks))
    if isinstance(num_stages, bool) or not isinstance(num_stages, int) or not 1 <= num_stages <= n:
        raise ValueError(f"partition: num_stages={num_stages!r} must be between 1 and the model's {n} blocks (each "
                         "stage needs at least one block): use fewer stages or a deeper model")
    if split is None:
        return balanced(n, num_stages)
    allowed = boundaries(model, family)
    split = list(split)
    unknown = [s for s in split if s not in allowed]
    if unknown:
        raise ValueError(f"partition(split={split}): {', '.join(map(repr, unknown))} is not a block a stage can start "
                         f"at; the boundaries of this {type(model).__name__} are {allowed}")
    starts = [0] + [allowed.index(s) + 1 for s in split]
    if len(split) != num_stages - 1 or starts != sorted(set(starts)):
        raise ValueError(f"partition(split={split}): {num_stages} stages need {num_stages - 1} distinct boundaries in "
                         f"increasing order, from {allowed}")
    return [b - a for a, b in zip(starts, starts[1:] + [n])]


def _hold(root: nn.Module, name: str, module: nn.Module) -> None:
    """Put ``module`` at dotted ``name`` under ``root``, making plain containers on the way."""
    *path, leaf = name.split(".")
    for part in path:
        if not hasattr(root, part):
            setattr(root, part, nn.Module())
        root = getattr(root, part)
    setattr(root, leaf, module)


class GPTStage(nn.Module):
    """The part of a :class:`~workbench.models.GPT` one stage runs (torchtitan's way).

    Holds the *same* submodules as the model (no copy): the first stage the embeddings, every
    stage its blocks under their original indices in ``blocks`` (a ``ModuleDict``), the last
    stage ``ln_f`` and ``lm_head``. So ``named_parameters()`` are the whole model's names
    (``blocks.3.attn.c_attn.weight``) and optimizer state can be checkpointed by name.
    ``forward`` takes token ids (first stage) or the previous stage's activation and returns
    the activation (or logits, last stage). ``shared_parameters`` maps a name to
    ``(parameter, stages)`` for parameters another stage holds a copy of (the tied embedding).
    """

    def __init__(self, model: nn.Module, layers: Sequence[int], first: bool, last: bool,
                 stage_index: int, num_stages: int):
        super().__init__()
        self.first, self.last = first, last
        if first:
            self.wte, self.wpe, self.drop = model.wte, model.wpe, model.drop
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.lm_head = model.ln_f, model.lm_head
        self.shared_parameters: dict[str, tuple[nn.Parameter, tuple[int, ...]]] = {}
        if model.config.tie_weights and (first or last) and num_stages > 1:
            self.shared_parameters["wte.weight"] = (model.wte.weight, (0, num_stages - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:
            pos = torch.arange(x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(pos))
        for block in self.blocks.values():
            x = block(x)
        if self.last:
            x = self.lm_head(self.ln_f(x))
        return x


class HFStage(nn.Module):
    """A run of a Hugging Face causal LM's blocks, with the embeddings (first stage) or the final
    norm and head (last stage): ``forward(ids or hidden) -> hidden or logits``. Parameters keep
    the model's names; ``shared_parameters`` lists a tied embedding held by the first and last stage."""

    def __init__(self, model: nn.Module, layout: Layout, layers: Sequence[int], first: bool, last: bool,
                 num_stages: int):
        super().__init__()
        self.family, self.first, self.last = layout.name, first, last
        self.config = model.config
        for name in (layout.first if first else ()) + layout.every:
            _hold(self, name, model.get_submodule(name))
        blocks = model.get_submodule(layout.blocks)  # in the model's order: embeddings, blocks, norm, head
        _hold(self, layout.blocks, nn.ModuleDict({str(i): blocks[i] for i in layers}))
        for name in layout.last if last else ():
            _hold(self, name, model.get_submodule(name))
        self._blocks = layout.blocks
        tp = getattr(model, "_tensor_parallel", None)  # under sequence parallelism, a stage after the first
        self._shards = tp.size if tp is not None and tp.sequence_parallel and not first else 1  # gets s/t positions
        self.shared_parameters: dict[str, tuple[nn.Parameter, tuple[int, ...]]] = {}
        embed = model.get_submodule(layout.first[0]).weight
        if model.lm_head.weight is embed and (first or last) and num_stages > 1:
            self.shared_parameters[f"{layout.first[0]}.weight"] = (embed, (0, num_stages - 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        seq = x.shape[1] * self._shards
        positions = torch.arange(seq, device=x.device).unsqueeze(0)
        if self.family == "gpt2":
            if self.first:
                t = self.transformer
                x = t.drop(t.wte(x) + t.wpe(positions))
            extra = {}
        else:
            if self.first:
                x = self.model.embed_tokens(x)
            extra = {"position_ids": positions, "position_embeddings": self.model.rotary_emb(x, positions)}
        mask = causal_mask(self.config, x[:, :1].expand(-1, seq, -1) if self._shards > 1 else x, positions)
        for block in self.get_submodule(self._blocks).values():
            x = block(x, attention_mask=mask, **extra)
            x = x[0] if isinstance(x, tuple) else x  # older transformers return (hidden, ...)
        if self.last:
            norm = self.transformer.ln_f if self.family == "gpt2" else self.model.norm
            x = self.lm_head(norm(x))
        return x


def causal_mask(config, hidden: torch.Tensor, positions: torch.Tensor):
    """The model's own causal mask for ``hidden``'s length (no padding, no cache), or None where
    the attention kernel applies causality itself. ``create_causal_mask``'s argument names
    changed across transformers versions; each is passed by the name this version uses."""
    try:
        from transformers.masking_utils import create_causal_mask
    except ImportError:  # older transformers: the blocks build it from None
        return None
    params = inspect.signature(create_causal_mask).parameters
    kwargs = {"config": config, "attention_mask": None}
    for name, value in (("inputs_embeds", hidden), ("input_embeds", hidden), ("cache", None),
                        ("past_key_values", None), ("position_ids", positions),
                        ("cache_position", positions[0])):
        if name in params:
            kwargs[name] = value
    return create_causal_mask(**kwargs)


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Hugging Face's causal-LM loss: position ``i`` predicts ``labels[i + 1]``; ``-100`` ignored."""
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1),
                           ignore_index=-100)


def build(model: nn.Module, num_stages: int, split=None, layers_per_stage: Sequence[int] | None = None
          ) -> list[nn.Module]:
    """The stages of ``model`` (see :func:`workbench.parallel.pipeline.partition`)."""
    if callable(split) and not isinstance(split, str):
        stages = split(model, num_stages)
        if not isinstance(stages, (list, tuple)) or len(stages) != num_stages or \
                not all(isinstance(s, nn.Module) for s in stages):
            raise ValueError(f"partition(split={getattr(split, '__name__', split)!r}): the callable must return a list "
                             f"of {num_stages} nn.Modules (one per stage), got {type(stages).__name__}")
        return list(stages)
    family = detect(model)
    if family is None:
        raise TypeError(f"partition() has no built-in split for {type(model).__name__} (built-in: our GPT, Hugging "
                        "Face GPT-2 and Llama): pass split=callable(model, num_stages) returning your stages, or "
                        "write the stages as modules and wrap each in PipelineStage")
    if isinstance(split, str) or (split is not None and not isinstance(split, Sequence)):
        raise ValueError(f"partition(split={split!r}): pass a list of module names to cut before (for example "
                         f"{boundaries(model, family)[:1]}), a callable, or None")
    if split is not None and layers_per_stage is not None:
        raise ValueError("partition: pass split or layers_per_stage, not both")
    counts = split_points(model, family, num_stages, split)
    if layers_per_stage is not None:
        counts = list(layers_per_stage)
        n = len(model.get_submodule(SPLITS[family].blocks))
        if (len(counts) != num_stages or sum(counts) != n
                or any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in counts)):
            raise ValueError(f"partition: layers_per_stage={counts} must be {num_stages} whole "
                             f"numbers >= 1 adding up to the model's {n} blocks")
    stages, start = [], 0
    for k, count in enumerate(counts):
        layers = range(start, start + count)
        first, last = k == 0, k == num_stages - 1
        if family == "gpt":
            stages.append(GPTStage(model, layers, first, last, k, num_stages))
        else:
            stages.append(HFStage(model, SPLITS[family], layers, first, last, num_stages))
        start += count
    return stages
