"""A transformer's sizes, which is all the advisor needs to know about a model.

A decoder-only transformer is a stack of ``L`` identical layers of width ``h`` plus its edges (the
token embedding, the position table if it learns one, the final norm and the output head). Its
parameters, per layer, split into what tensor parallelism shards over ``t`` ranks (Megatron's
column- and row-parallel matrices, and the column-parallel biases) and what every tensor-parallel
rank keeps whole (the norms, the row-parallel biases)::

    attention   q, k, v   h x (h + 2 k)            k = kv_heads x head_dim (= h without GQA)
                out       h x h
    MLP         gated     3 x h x ffn              gate, up (column), down (row): SwiGLU, Llama
                plain     2 x h x ffn              c_fc (column), c_proj (row): GELU, GPT-2
    biases      column    (h + 2 k) + ffn (x2 gated)         sharded with their matrices
                row       2 h                                 replicated (added after the sum)
    norms       2 per layer: LayerNorm 2 h (h without bias), RMSNorm h

    edges       token embedding V_p h / t (V_p: V padded to a multiple of t, as
                VocabParallelEmbedding does), positions T h (learned) or nothing (RoPE),
                final norm, and an untied head V_p h / t

So our GPT (``ffn = 4h``, biases, LayerNorm, learned positions, tied head) has ``12 h^2 + 13 h``
per layer, and :meth:`ModelShape.parameters` equals ``sum(p.numel())`` of
:class:`~workbench.models.GPT` (the tied matrix counted once) and, with ``tp``, what
:func:`workbench.parallel.tensor.parameters_per_rank` says one rank holds (tests pin both).
Pipeline stages take the layers as :func:`workbench.parallel.pipeline.partition` cuts them (the
first ``L mod p`` stages one more), the first stage the embeddings, the last the final norm and the
head; a tied head is then a *copy* of the embedding on the last stage (its gradients summed
between the two), so it counts on both.

Presets: our GPT's ``tiny``/``small``/``medium`` (:meth:`GPTConfig.preset`), and Llama-shaped
models whose counts are the published ones (:data:`PRESETS`, sources beside them).
"""
from __future__ import annotations

from dataclasses import dataclass, fields, replace

from workbench.models import GPTConfig
from workbench.parallel.pipeline_split import balanced

__all__ = ["ModelShape", "PRESETS"]

_NORMS = ("layernorm", "rmsnorm")
_POSITIONS = ("learned", "rope")


@dataclass(frozen=True)
class ModelShape:
    """``layers`` blocks of width ``hidden`` with ``heads`` heads, a ``vocab``-entry embedding, sequences
    of ``seq`` tokens, an MLP of ``ffn`` units (4 x hidden for GPT-2, about 8/3 x hidden x 2 matrices
    for a Llama gated MLP: ``gated=True``), tied or untied head.

    Beyond those: ``kv_heads`` (grouped-query attention: fewer key/value heads than query heads; 0
    means ``heads``), ``positions`` (``"learned"``: a ``seq x hidden`` table, as GPT-2; ``"rope"``:
    rotary, no parameters), ``norm`` (``"layernorm"`` or ``"rmsnorm"``), ``source`` (where the
    figures come from).
    """

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
    kv_heads: int = 0
    positions: str = "learned"
    norm: str = "layernorm"
    source: str = ""

    def __post_init__(self) -> None:
        for name in ("layers", "hidden", "heads", "vocab", "seq", "ffn"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ModelShape({name}={value!r}): must be a whole number >= 1")
        if self.hidden % self.heads:
            raise ValueError(f"ModelShape(hidden={self.hidden}, heads={self.heads}): hidden must be a multiple of "
                             f"heads (each head gets hidden / heads channels); pick heads dividing {self.hidden}")
        kv = self.kv_heads
        if isinstance(kv, bool) or not isinstance(kv, int) or kv < 0:
            raise ValueError(f"ModelShape(kv_heads={kv!r}): must be a whole number >= 0 (0: as many as heads)")
        if kv and self.heads % kv:
            raise ValueError(f"ModelShape(kv_heads={kv}, heads={self.heads}): grouped-query attention shares each "
                             f"key/value head among heads / kv_heads query heads; pick kv_heads dividing {self.heads}")
        for name in ("gated", "tied", "bias"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"ModelShape({name}={getattr(self, name)!r}): must be True or False")
        if self.norm not in _NORMS:
            raise ValueError(f"ModelShape(norm={self.norm!r}): use one of {_NORMS}")
        if self.positions not in _POSITIONS:
            raise ValueError(f"ModelShape(positions={self.positions!r}): use 'learned' (a seq x hidden table, "
                             "GPT-2) or 'rope' (rotary, no parameters)")

    # -------------------------------------------------------------------------------- constructors
    @classmethod
    def from_gpt(cls, config, name: str = "custom") -> "ModelShape":
        """The shape of ``workbench.models.GPT(config)`` (a :class:`~workbench.models.GPTConfig`)."""
        if not isinstance(config, GPTConfig):
            raise ValueError(f"ModelShape.from_gpt(config={config!r}): pass a workbench.models.GPTConfig, "
                             "e.g. GPTConfig.preset('small')")
        return cls(layers=config.n_layer, hidden=config.n_embd, heads=config.n_head, vocab=config.vocab_size,
                   seq=config.block_size, ffn=4 * config.n_embd, gated=False, tied=config.tie_weights,
                   bias=config.bias, name=name, source="workbench.models.GPT")

    @classmethod
    def preset(cls, name: str) -> "ModelShape":
        """A named shape: our GPT's ``"tiny"``, ``"small"``, ``"medium"``, or a Llama-shaped model
        (``"llama-7b"``, ``"llama-13b"``, ``"llama-70b"``: Llama 2; ``"llama3-8b"``, ``"llama3-70b"``)."""
        if name in GPTConfig.PRESETS:
            return cls.from_gpt(GPTConfig.preset(name), name=name)
        if name not in PRESETS:
            raise ValueError(f"ModelShape.preset({name!r}): unknown; use one of "
                             f"{sorted(GPTConfig.PRESETS) + sorted(PRESETS)}, or build ModelShape(layers=..., "
                             "hidden=..., heads=..., vocab=..., seq=..., ffn=...)")
        return PRESETS[name]

    @classmethod
    def coerce(cls, model, argument: str = "model") -> "ModelShape":
        """A :class:`ModelShape` from what a user passes: itself, a ``GPTConfig`` or a preset name."""
        if isinstance(model, ModelShape):   # first: a search coerces the same shape for every configuration
            return model

        if isinstance(model, GPTConfig):
            return cls.from_gpt(model)
        if isinstance(model, str):
            return cls.preset(model)
        raise ValueError(f"{argument}={model!r}: pass a preset name ('small', 'llama-7b', ...), a GPTConfig or a "
                         "ModelShape(layers=, hidden=, heads=, vocab=, seq=, ffn=)")

    def with_(self, **changes) -> "ModelShape":
        """A copy with some fields changed (validated again), e.g. ``shape.with_(seq=2048)``."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise ValueError(f"ModelShape.with_: unknown field(s) {bad}; fields are {sorted(known)}")
        return replace(self, **changes)

    # -------------------------------------------------------------------------------- derived sizes
    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    @property
    def kv_dim(self) -> int:
        """Width of the keys (and of the values): ``kv_heads x head_dim`` (``hidden`` without GQA)."""
        return (self.kv_heads or self.heads) * self.head_dim

    def padded_vocab(self, tp: int = 1) -> int:
        """The vocabulary padded to a multiple of ``tp`` (what a vocabulary-parallel embedding holds)."""
        return -(-self.vocab // tp) * tp

    def _norm_parameters(self) -> int:
        return 2 * self.hidden if (self.norm == "layernorm" and self.bias) else self.hidden

    def layer_parameters(self, tp: int = 1) -> int:
        """Parameters of one transformer layer on one of ``tp`` tensor-parallel ranks."""
        _check_positive(tp, "tp")
        h, k, f = self.hidden, self.kv_dim, self.ffn
        matrices = h * (h + 2 * k) + h * h + (3 if self.gated else 2) * h * f
        column_bias = (h + 2 * k) + f * (2 if self.gated else 1) if self.bias else 0
        replicated = 2 * self._norm_parameters() + (2 * h if self.bias else 0)   # two norms, two row biases
        return (matrices + column_bias) // tp + replicated

    def embedding_parameters(self, tp: int = 1) -> int:
        """The first stage's edge: token embedding (vocabulary-parallel) and learned positions."""
        _check_positive(tp, "tp")
        return self.padded_vocab(tp) * self.hidden // tp + (self.seq * self.hidden if self.positions == "learned" else 0)

    def head_parameters(self, tp: int = 1, pipeline: bool = False) -> int:
        """The last stage's edge: final norm and output head. A tied head adds nothing on one stage
        and a copy of the embedding matrix when the last stage is not the first (``pipeline``)."""
        _check_positive(tp, "tp")
        head = self.padded_vocab(tp) * self.hidden // tp
        return self._norm_parameters() + (head if (not self.tied or pipeline) else 0)

    def parameters(self, tp: int = 1) -> int:
        """Parameters on one of ``tp`` tensor-parallel ranks; ``tp=1``: the model's count, a tied
        matrix counted once (``sum(p.numel() for p in GPT(cfg).parameters())`` for our GPT)."""
        return self.layers * self.layer_parameters(tp) + self.embedding_parameters(tp) + self.head_parameters(tp)

    def layers_per_stage(self, pp: int) -> list[int]:
        """How :func:`workbench.parallel.pipeline.partition` cuts the layers into ``pp`` stages."""
        _check_positive(pp, "pp")
        if pp > self.layers:
            raise ValueError(f"pp={pp} stages but the model has {self.layers} layers: each stage needs at least one; "
                             f"use pp <= {self.layers}")
        return balanced(self.layers, pp)

    def stage_parameters(self, pp: int, stage: int, tp: int = 1) -> int:
        """Parameters one rank of pipeline stage ``stage`` (of ``pp``) holds, on one of ``tp`` ranks."""
        counts = self.layers_per_stage(pp)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
            raise ValueError(f"stage={stage!r}: must be a stage index in 0..{pp - 1}")
        n = counts[stage] * self.layer_parameters(tp)
        if stage == 0:
            n += self.embedding_parameters(tp)
        if stage == pp - 1:
            n += self.head_parameters(tp, pipeline=pp > 1)
        return n

    def layer_tensors(self, tp: int = 1) -> list[int]:
        """Sizes of one layer's parameter tensors on one of ``tp`` ranks, in our GPT block's order
        (``ln_1``, ``c_attn`` with q, k, v fused, ``c_proj``, ``ln_2``, ``c_fc`` -- gate and up fused
        when gated -- and the MLP's ``c_proj``; weights then biases). A model laid out otherwise
        (separate q, k, v) has more, smaller tensors and the same total."""
        _check_positive(tp, "tp")
        h, k, f = self.hidden, self.kv_dim, self.ffn * (2 if self.gated else 1)
        norm = [h, h] if (self.norm == "layernorm" and self.bias) else [h]
        col_attn, col_mlp = (h + 2 * k) // tp, f // tp

        def linear(rows: int, cols: int, bias: int) -> list[int]:
            return [rows * cols] + ([bias] if self.bias else [])

        return (norm + linear(col_attn, h, col_attn) + linear(h, h // tp, h) + norm +
                linear(col_mlp, h, col_mlp) + linear(h, self.ffn // tp, h))

    def stage_tensors(self, pp: int, stage: int, tp: int = 1) -> list[int]:
        """Sizes of the parameter tensors of pipeline stage ``stage`` (of ``pp``) on one of ``tp``
        ranks, in ``parameters()`` order (embeddings, the stage's layers, final norm, head); they
        add up to :meth:`stage_parameters`. What ZeRO's flat buckets and units are cut from."""
        counts = self.layers_per_stage(pp)
        if isinstance(stage, bool) or not isinstance(stage, int) or not 0 <= stage < pp:
            raise ValueError(f"stage={stage!r}: must be a stage index in 0..{pp - 1}")
        vocab = self.padded_vocab(tp) * self.hidden // tp
        out: list[int] = []
        if stage == 0:
            out += [vocab] + ([self.seq * self.hidden] if self.positions == "learned" else [])
        out += self.layer_tensors(tp) * counts[stage]
        if stage == pp - 1:
            out += [self.hidden, self.hidden] if (self.norm == "layernorm" and self.bias) else [self.hidden]
            if not self.tied or pp > 1:
                out.append(vocab)
        return out

    def describe(self) -> str:
        """One line: name, parameter count and the sizes."""
        p = self.parameters()
        count = f"{p / 1e9:.2f} B" if p >= 1e9 else f"{p / 1e6:.2f} M"
        extra = [f"ffn {self.ffn}" + (" gated" if self.gated else "")]
        if self.kv_heads and self.kv_heads != self.heads:
            extra.append(f"kv_heads {self.kv_heads}")
        return (f"{self.name}: {count} parameters, {self.layers} layers, hidden {self.hidden}, {self.heads} heads, "
                f"vocab {self.vocab}, seq {self.seq}, " + ", ".join(extra))


def _check_positive(value, name: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r}: must be a whole number >= 1")


def _llama(name, layers, hidden, heads, kv_heads, ffn, vocab, seq, source) -> ModelShape:
    return ModelShape(layers=layers, hidden=hidden, heads=heads, vocab=vocab, seq=seq, ffn=ffn, gated=True,
                      tied=False, bias=False, name=name, kv_heads=kv_heads, positions="rope", norm="rmsnorm",
                      source=source)


_LLAMA2 = ("Touvron et al. 2023, 'Llama 2: Open Foundation and Fine-Tuned Chat Models', Table 1 (context 4096); "
           "config.json of meta-llama/Llama-2-{}-hf (hidden, intermediate size, heads, kv heads, vocab 32000)")
_LLAMA3 = ("Meta, 'The Llama 3 Herd of Models' (2024), Table 3; config.json of meta-llama/Meta-Llama-3-{} "
           "(vocab 128256, context 8192)")

# Llama-shaped presets: gated SwiGLU MLP, RMSNorm, RoPE, no biases, untied head. Counts (tests pin
# them): llama-7b 6,738,415,616; llama-13b 13,015,864,320; llama-70b 68,976,648,192 (GQA, 8 kv
# heads); llama3-8b 8,030,261,248; llama3-70b 70,553,706,496.
PRESETS: dict[str, ModelShape] = {
    "llama-7b": _llama("llama-7b", 32, 4096, 32, 32, 11008, 32000, 4096, _LLAMA2.format("7b")),
    "llama-13b": _llama("llama-13b", 40, 5120, 40, 40, 13824, 32000, 4096, _LLAMA2.format("13b")),
    "llama-70b": _llama("llama-70b", 80, 8192, 64, 8, 28672, 32000, 4096, _LLAMA2.format("70b")),
    "llama3-8b": _llama("llama3-8b", 32, 4096, 32, 8, 14336, 128256, 8192, _LLAMA3.format("8B")),
    "llama3-70b": _llama("llama3-70b", 80, 8192, 64, 8, 28672, 128256, 8192, _LLAMA3.format("70B")),
}
