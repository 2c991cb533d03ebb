"""A small decoder-only transformer (nanoGPT-style), the model every strategy trains.

Shape of the network (B batch, T sequence length, C = ``n_embd``, V = ``vocab_size``)::

    idx (B, T) --wte--> (B, T, C) + wpe(0..T-1)          token + learned position embedding
        for each of n_layer Blocks (pre-norm, residual):
            x = x + attn(ln_1(x))                          causal self-attention, n_head heads
            x = x + mlp(ln_2(x))                           Linear C->4C, GELU, Linear 4C->C
        ln_f --> lm_head (C -> V)                          logits (B, T, V); weight tied to wte

Parameter count (biases on, tied head), per block ``12 C^2 + 13 C``:

    ln_1, ln_2      2 x 2C
    attn.c_attn     C x 3C + 3C      (query, key and value in one matrix)
    attn.c_proj     C x C  + C
    mlp.c_fc        C x 4C + 4C
    mlp.c_proj      4C x C + C

plus ``V C`` (token embedding, shared with the head), ``T_max C`` (positions) and ``2 C``
(``ln_f``). Training FLOPs per token are about ``6 x parameters`` (forward 2, backward 4) plus
the attention scores, ``12 n_layer T C`` -- the numbers the throughput plots are read against.

Mixture of experts (``n_experts > 0``): each block's MLP is a :class:`~workbench.models.moe.MoE` of
``n_experts`` such MLPs behind a top-k router, and the loss adds the layers' load-balancing losses
(``aux_loss_coeff E sum_i f_i P_i`` each) to the cross-entropy. ``n_experts=0`` (the default) is the
dense model above, unchanged.

The names (``c_attn``, ``c_proj``, ``c_fc``) follow GPT-2 and nanoGPT, so a reader can match
this file against either, and tensor-parallel code can find the column- and row-parallel layers
by name: ``c_attn``/``c_fc`` split by output columns, ``c_proj`` by input rows.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.models.moe import MoE, check_moe_args

__all__ = ["GPTConfig", "GPT", "Block", "CausalSelfAttention", "FeedForward"]


@dataclass
class GPTConfig:
    """Hyper-parameters of :class:`GPT`. ``GPTConfig.preset(name)`` gives the named sizes."""

    vocab_size: int = 65  # the characters of tiny Shakespeare
    block_size: int = 64  # longest sequence the model accepts (its context)
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0  # 0 keeps every run deterministic, which the parity tests rely on
    bias: bool = True
    tie_weights: bool = True  # lm_head.weight is wte.weight
    n_experts: int = 0  # > 0: every block's MLP is a mixture of this many experts (workbench.models.moe)
    top_k: int = 2  # experts per token
    capacity_factor: float | None = None  # None: dropless; else each expert keeps ceil(T k c / E) tokens
    aux_loss_coeff: float = 0.01  # the load-balancing loss's alpha

    # name -> (n_layer, n_head, n_embd, block_size); parameter counts with vocab_size=65
    PRESETS = {
        "tiny": dict(n_layer=4, n_head=4, n_embd=64, block_size=64),       # 0.21 M
        "small": dict(n_layer=4, n_head=4, n_embd=256, block_size=128),    # 3.2 M
        "medium": dict(n_layer=8, n_head=8, n_embd=512, block_size=256),   # 25.4 M
    }

    def __post_init__(self) -> None:
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig.{name}={value!r} must be a whole number >= 1")
        if self.n_embd % self.n_head:
            raise ValueError(f"GPTConfig.n_embd={self.n_embd} is not divisible by n_head={self.n_head}: "
                             f"each head gets n_embd / n_head channels, so pick n_embd a multiple of n_head")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout={self.dropout!r} must be in [0, 1)")
        if isinstance(self.n_experts, bool) or not isinstance(self.n_experts, int) or self.n_experts < 0:
            raise ValueError(f"GPTConfig.n_experts={self.n_experts!r} must be a whole number >= 0 (0: dense MLPs)")
        if self.n_experts:
            check_moe_args(self.n_experts, self.top_k, self.capacity_factor, self.aux_loss_coeff, "GPTConfig")

    @classmethod
    def preset(cls, name: str, **overrides) -> "GPTConfig":
        """A named size: ``"tiny"`` (~0.2 M parameters), ``"small"`` (~3 M), ``"medium"`` (~25 M).

        Keyword arguments override single fields, e.g. ``GPTConfig.preset("tiny", n_layer=2)``.
        """
        if name not in cls.PRESETS:
            raise ValueError(f"GPTConfig.preset({name!r}): unknown preset; choose one of {sorted(cls.PRESETS)}")
        known = {f.name for f in fields(cls)}
        bad = sorted(set(overrides) - known)
        if bad:
            raise TypeError(f"GPTConfig.preset({name!r}) got unknown field(s) {bad}; fields are {sorted(known)}")
        return replace(cls(**cls.PRESETS[name]), **overrides)


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where position t only sees positions <= t.

    One matrix ``c_attn`` (C -> 3C) makes queries, keys and values for every head at once;
    ``c_proj`` (C -> C) mixes the heads' outputs. Memory of the scores is ``B n_head T^2``
    floats per layer (the fused ``scaled_dot_product_attention`` kernel may avoid storing it).
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        # (B, T, C) -> (B, n_head, T, head_size)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


class FeedForward(nn.Module):
    """The block's MLP: ``c_fc`` (C -> 4C), GELU, ``c_proj`` (4C -> C)."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-norm transformer layer: ``x + attn(ln_1(x))`` then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.n_experts:
            self.mlp = MoE(config.n_embd, config.n_experts, lambda: FeedForward(config), top_k=config.top_k,
                           capacity_factor=config.capacity_factor, aux_loss_coeff=config.aux_loss_coeff)
        else:
            self.mlp = FeedForward(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """A character-level GPT. ``forward(idx, targets=None) -> (logits, loss)``.

    ``idx`` and ``targets`` are ``(B, T)`` integer tensors with ``T <= config.block_size``;
    ``loss`` is the mean cross-entropy over all ``B x T`` positions (None without targets), plus
    with experts the sum of the layers' load-balancing losses.
    Initialisation follows GPT-2: normal(0, 0.02) weights, zero biases, and the residual
    projections (``c_proj``) scaled by ``1/sqrt(2 n_layer)`` so the residual stream's variance
    does not grow with depth. Seed with ``torch.manual_seed`` before building for identical
    replicas on every rank.
    """

    def __init__(self, config: GPTConfig | None = None):
        super().__init__()
        if config is None:
            config = GPTConfig()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPT(config={config!r}): pass a GPTConfig, e.g. GPT(GPTConfig.preset('tiny'))")
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.wpe = nn.Embedding(config.block_size, config.n_embd)
        self.drop = nn.Dropout(config.dropout)
        self.blocks = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # one tensor, two uses (Press & Wolf 2017)
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_parameters(self, exclude_embeddings: bool = False) -> int:
        """Number of parameters, each shared (tied) tensor counted once.

        ``exclude_embeddings=True`` leaves out the position embedding (and the token embedding
        when it is not tied to the head), the convention for the ``6 N`` FLOPs-per-token rule.
        """
        n = sum(p.numel() for p in self.parameters())  # parameters() yields a tied tensor once
        if exclude_embeddings:
            n -= self.wpe.weight.numel()
            if not self.config.tie_weights:
                n -= self.wte.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        if idx.dim() != 2:
            raise ValueError(f"GPT.forward: idx must be (batch, sequence) token ids, got shape {tuple(idx.shape)}")
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"GPT.forward: sequence length {T} is longer than the model's block_size="
                             f"{self.config.block_size}: cut the input to at most {self.config.block_size} "
                             f"tokens or build the model with GPTConfig(block_size={T})")
        if targets is not None and targets.shape != idx.shape:
            raise ValueError(f"GPT.forward: targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
        pos = torch.arange(T, device=idx.device)
        x = self.drop(self.wte(idx) + self.wpe(pos))
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(B * T))
            if self.config.n_experts:
                loss = loss + sum(block.mlp.aux_loss for block in self.blocks)
        return logits, loss
