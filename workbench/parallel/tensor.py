"""Tensor parallelism (Megatron-LM) and sequence parallelism: one layer split over ``t`` ranks.

The idea (Shoeybi et al. 2019): a linear layer ``Y = X A`` can be split by the columns of ``A``
(each rank computes a slice of ``Y``, nothing to add up) or by its rows (each rank multiplies its
slice of ``X`` by its rows of ``A``, and the partial ``Y``\\ s are summed). Put a column-parallel
layer first and a row-parallel one second and the slice the first leaves on each rank is exactly
the input the second needs: a whole MLP (or attention block, split by heads) costs *one*
all-reduce forward, ``g``, and one backward, ``f`` (see :mod:`workbench.parallel.tp_ops`)::

         X (replicated)                                            Y = sum_r Y_r (replicated)
         |  f: identity fwd, all-reduce bwd                        ^  g: all-reduce fwd, identity bwd
         +--> X A_1 -> GELU -> (.) B_1 --> Y_1 (partial) ----------+
         +--> X A_2 -> GELU -> (.) B_2 --> Y_2 (partial) ----------+
              column-parallel A = [A_1 A_2]   row-parallel B = [B_1; B_2]

Per transformer layer: 2 all-reduces forward and 2 backward of ``b s h`` elements each
(``b`` batch, ``s`` sequence, ``h`` hidden). Attention splits by heads: rank ``r`` holds heads
``r n_head/t .. (r+1) n_head/t - 1``, i.e. its slice of q, of k and of v (``c_attn`` is one fused
``h x 3h`` matrix, so its output rows are taken in three chunks). Row-parallel biases are added
once, after the reduction.

Vocabulary. The token embedding holds a contiguous ``1/t`` of the rows (:class:`VocabParallelEmbedding`:
ids outside a rank's range look up zeros, and the partial embeddings are all-reduced); the head
``lm_head`` is column-parallel over the same rows (tied or not), so each rank has ``1/t`` of the
logits, and :func:`vocab_parallel_cross_entropy` computes the loss from those shards with two
small all-reduces (the max, then the target logit and the sum of exponentials): the full
``b s V`` logits never exist anywhere. A vocabulary not divisible by ``t`` (65 characters on 2 or
4 ranks) is padded to the next multiple: padding rows start at zero, are never looked up, and the
loss ignores their logits, so padding never changes the loss.

Sequence parallelism (Korthikanti et al. 2022). Between a row-parallel layer and the next
column-parallel one sit the layer norms, the dropouts and the residual adds, replicated on every
rank under plain tensor parallelism. Split them by sequence instead: ``g`` becomes a
reduce-scatter (each rank keeps ``s/t`` positions of the summed output) and ``f`` an all-gather
(before the next column-parallel layer), the same bytes as the all-reduce they replace, and the
norms work on ``1/t`` of the tokens. Their parameters are replicated but see only ``1/t`` of the
tokens, so their gradients are all-reduced (they enter through ``f``). The column-parallel layers
keep only the input *shard* for backward and all-gather it again there (Megatron's choice: one
more all-gather per column-parallel layer in backward buys the ``1/t`` activation memory).

Memory and communication per rank (``psi`` parameters per layer ``12 h^2 + 13 h``)
--------------------------------------------------------------------------------------
* Parameters: the four weight matrices and the column-parallel biases ``(12 h^2 + 7 h)/t``, plus
  the replicated norms and row-parallel biases ``6 h``; the (padded) vocabulary ``V_p h / t`` per
  embedding/head matrix; positions ``T_max h`` replicated.
* Communication (float32, per layer and step): 4 all-reduces of ``b s h`` elements; with sequence
  parallelism 4 all-gathers and 4 reduce-scatters of ``b s h`` gathered elements (each pair one
  all-reduce's worth), plus 2 re-gathers in backward, plus 6 gradient all-reduces of ``h``
  (two norms' weights and biases, two row-parallel biases). Exact lists:
  :func:`communication_per_layer`, :func:`communication_per_step`; activation memory:
  :func:`activation_bytes_per_layer`.

Usage::

    model = tensor_parallel(GPT(cfg), sequence_parallel=True)     # in every rank, same seed/weights
    logits, loss = model(idx, targets)                             # every rank: the same idx
    loss.backward(); optimizer.step()
    full_state_dict(model)                                          # the single-process names and shapes
"""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench import comm
from workbench.parallel import tp_ops
from workbench.parallel.tp_ops import (copy_to_parallel, group_rank, group_size, linear_with_sequence_gather,
                                       reduce_from_parallel, scatter_to_parallel, scatter_to_sequence,
                                       gather_from_parallel)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ParallelSelfAttention", "SequenceParallelLayerNorm", "tensor_parallel", "full_state_dict",
           "is_tensor_parallel", "activation_bytes_per_layer", "parameters_per_rank", "communication_per_layer",
           "communication_per_step"]

SEQUENCE_DIM = 1  # tensors are (batch, sequence, hidden)


def _check_algorithm(algorithm: str, where: str) -> None:
    for name in ("all_reduce", "all_gather", "reduce_scatter"):
        if algorithm not in comm.ALGORITHMS[name]:
            ok = sorted(set(comm.ALGORITHMS["all_reduce"]) & set(comm.ALGORITHMS["all_gather"])
                        & set(comm.ALGORITHMS["reduce_scatter"]))
            raise ValueError(f"{where}: algorithm={algorithm!r} is not available for {name}; "
                             f"use one of {ok}")


def _mark(p: nn.Parameter, dim: int | None, chunks: int = 1, vocab: int | None = None) -> nn.Parameter:
    """Remember how ``p`` is split: along ``dim`` (None: replicated), in ``chunks`` interleaved
    blocks (q, k, v), with rows past ``vocab`` being padding. :func:`full_state_dict` reads it."""
    p._tp_dim, p._tp_chunks, p._tp_vocab = dim, chunks, vocab
    return p


_SKIP_INIT: list[bool] = []  # non-empty inside from_linear/from_embedding: weights are copied in anyway


def _linear_init(out_features, in_features, bias, device, dtype):
    w = torch.empty(out_features, in_features, device=device, dtype=dtype)
    b = torch.empty(out_features, device=device, dtype=dtype) if bias else None
    if not _SKIP_INIT:  # nn.Linear's kaiming-uniform(a=sqrt(5)): uniform(+-1/sqrt(in_features))
        bound = 1 / math.sqrt(in_features)
        w.uniform_(-bound, bound)
        if b is not None:
            b.uniform_(-bound, bound)
    return w, b


@contextlib.contextmanager
def _skip_init():
    """Build a layer without drawing random numbers (its weights are about to be copied in)."""
    _SKIP_INIT.append(True)
    try:
        yield
    finally:
        _SKIP_INIT.pop()


def _shard_rows(w: torch.Tensor, t: int, r: int, chunks: int = 1) -> torch.Tensor:
    """Rank ``r``'s rows of ``w``: of each of ``chunks`` stacked blocks, the ``r``-th of ``t`` slices."""
    return torch.cat([c.chunk(t, 0)[r] for c in w.chunk(chunks, 0)], 0)


# ==================================================================================== the layers
class ColumnParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s output rows (``Y``'s columns) split over the group.

    ``weight`` is ``(out_features/t, in_features)``, this rank's rows; ``bias`` its slice. The
    input is replicated (it enters through ``f``: all-reduce of its gradient in backward), or with
    ``sequence_parallel=True`` split along the sequence (all-gathered here, gradient
    reduce-scattered). The output is this rank's ``out_features/t`` columns, or all of them with
    ``gather_output=True`` (an all-gather; the layer after a column-parallel one is usually a
    row-parallel one that wants the slice).
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, gather_output: bool = False,
                 group=None, sequence_parallel: bool = False, algorithm: str = "native",
                 device=None, dtype=None):
        super().__init__()
        t = group_size(group)
        if out_features % t:
            raise ValueError(f"ColumnParallelLinear: out_features={out_features} is not divisible by the "
                             f"group size t={t}: pick out_features a multiple of {t}")
        _check_algorithm(algorithm, "ColumnParallelLinear")
        if sequence_parallel and gather_output:
            raise ValueError("ColumnParallelLinear: gather_output=True with sequence_parallel=True is not "
                             "supported: the next layer should be row-parallel (gather_output=False)")
        self.in_features, self.out_features = in_features, out_features
        self.gather_output, self.group, self.algorithm = gather_output, group, algorithm
        self.sequence_parallel = sequence_parallel
        # nn.Linear's init of the whole matrix, then this rank's rows (Megatron's master-weight init):
        # every rank draws the same numbers, so the random stream stays in step across ranks
        w, b = _linear_init(out_features, in_features, bias, device, dtype)
        r = group_rank(group)
        self.weight = _mark(nn.Parameter(w.chunk(t, 0)[r].clone()), 0)
        if bias:
            self.bias = _mark(nn.Parameter(b.chunk(t, 0)[r].clone()), 0)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, chunks: int = 1, gather_output: bool = False,
                    sequence_parallel: bool = False, algorithm: str = "native") -> "ColumnParallelLinear":
        """This rank's rows of an existing ``nn.Linear`` (copied: parity runs start from its weights).

        ``chunks``: the output is that many stacked blocks, each split over the group (``c_attn``'s
        q, k, v: ``chunks=3``, so each rank gets its heads' slice of each).
        """
        t, r = group_size(group), group_rank(group)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"ColumnParallelLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        if linear.out_features % (t * chunks):
            raise ValueError(f"ColumnParallelLinear.from_linear: out_features={linear.out_features} is not "
                             f"divisible by chunks x t = {chunks} x {t}")
        with _skip_init():
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        gather_output=gather_output, group=group, sequence_parallel=sequence_parallel,
                        algorithm=algorithm, device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(_shard_rows(linear.weight, t, r, chunks))
            if linear.bias is not None:
                layer.bias.copy_(_shard_rows(linear.bias, t, r, chunks))
        layer.weight._tp_chunks = chunks
        if layer.bias is not None:
            layer.bias._tp_chunks = chunks
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.sequence_parallel:
            y = linear_with_sequence_gather(x, self.weight, self.bias, SEQUENCE_DIM, self.group, self.algorithm)
        else:
            y = F.linear(copy_to_parallel(x, self.group, self.algorithm), self.weight, self.bias)
        if self.gather_output:
            y = gather_from_parallel(y, self.group, self.algorithm)
        return y

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features} (/{group_size(self.group)}), "
                f"bias={self.bias is not None}, gather_output={self.gather_output}, "
                f"sequence_parallel={self.sequence_parallel}")


class RowParallelLinear(nn.Module):
    """``Y = X A^T + b`` with ``A``'s input columns (``X``'s last dimension) split over the group.

    ``weight`` is ``(out_features, in_features/t)``; ``bias`` is replicated and added after the
    reduction. The input is this rank's slice (``input_is_parallel=True``, what a column-parallel
    layer leaves), or the whole input, sliced here. The partial products are all-reduced (``g``)
    or, with ``sequence_parallel=True``, reduce-scattered along the sequence.
    """

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, input_is_parallel: bool = True,
                 group=None, sequence_parallel: bool = False, algorithm: str = "native", device=None, dtype=None):
        super().__init__()
        t = group_size(group)
        if in_features % t:
            raise ValueError(f"RowParallelLinear: in_features={in_features} is not divisible by the group "
                             f"size t={t}: pick in_features a multiple of {t}")
        _check_algorithm(algorithm, "RowParallelLinear")
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True needs input_is_parallel=True "
                             "(the input is a column-parallel layer's slice)")
        self.in_features, self.out_features = in_features, out_features
        self.input_is_parallel, self.group, self.algorithm = input_is_parallel, group, algorithm
        self.sequence_parallel = sequence_parallel
        w, b = _linear_init(out_features, in_features, bias, device, dtype)
        self.weight = _mark(nn.Parameter(w.chunk(t, 1)[group_rank(group)].clone()), 1)
        if bias:
            self.bias = _mark(nn.Parameter(b), None)
        else:
            self.register_parameter("bias", None)

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, input_is_parallel: bool = True,
                    sequence_parallel: bool = False, algorithm: str = "native") -> "RowParallelLinear":
        """This rank's input columns of an existing ``nn.Linear`` (and its whole bias), copied."""
        t, r = group_size(group), group_rank(group)
        if not isinstance(linear, nn.Linear):
            raise ValueError(f"RowParallelLinear.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        with _skip_init():
            layer = cls(linear.in_features, linear.out_features, linear.bias is not None,
                        input_is_parallel=input_is_parallel, group=group, sequence_parallel=sequence_parallel,
                        algorithm=algorithm, device=linear.weight.device, dtype=linear.weight.dtype)
        with torch.no_grad():
            layer.weight.copy_(linear.weight.chunk(t, 1)[r])
            if linear.bias is not None:
                layer.bias.copy_(linear.bias)
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = scatter_to_parallel(x, self.group, self.algorithm)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = scatter_to_sequence(y, SEQUENCE_DIM, self.group, self.algorithm)
            # the bias meets only this rank's positions: its gradient is summed over the group (f)
            bias = None if self.bias is None else copy_to_parallel(self.bias, self.group, self.algorithm)
        else:
            y = reduce_from_parallel(y, self.group, self.algorithm)
            bias = self.bias
        return y if bias is None else y + bias

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features} (/{group_size(self.group)}), out_features={self.out_features}, "
                f"bias={self.bias is not None}, input_is_parallel={self.input_is_parallel}, "
                f"sequence_parallel={self.sequence_parallel}")


class VocabParallelEmbedding(nn.Module):
    """An embedding whose rows (the vocabulary) are split over the group, ``ceil(V/t)`` each.

    Rank ``r`` holds ids ``[r n, (r+1) n)`` with ``n = ceil(num_embeddings / t)``; rows past
    ``num_embeddings`` on the last rank are padding (zero, never looked up). Each rank looks up
    the ids it holds, zeros for the others, and the partial embeddings are summed: all-reduced,
    or with ``sequence_parallel=True`` reduce-scattered along the sequence (each rank keeps
    ``s/t`` positions). The backward of either sends each rank the gradient of its own rows only.
    """

    def __init__(self, num_embeddings: int, embedding_dim: int, *, group=None, sequence_parallel: bool = False,
                 algorithm: str = "native", device=None, dtype=None):
        super().__init__()
        t, r = group_size(group), group_rank(group)
        _check_algorithm(algorithm, "VocabParallelEmbedding")
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        self.group, self.algorithm, self.sequence_parallel = group, algorithm, sequence_parallel
        self.padded_num_embeddings = -(-num_embeddings // t) * t
        n = self.padded_num_embeddings // t
        self.vocab_start, self.vocab_end = r * n, min((r + 1) * n, num_embeddings)
        full = torch.zeros(self.padded_num_embeddings, embedding_dim, device=device, dtype=dtype)
        if not _SKIP_INIT:
            nn.init.normal_(full[:num_embeddings])  # nn.Embedding's init of the whole table, same on every rank
        self.weight = _mark(nn.Parameter(full[r * n:(r + 1) * n].clone()), 0, vocab=num_embeddings)

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, group=None, *, sequence_parallel: bool = False,
                       algorithm: str = "native") -> "VocabParallelEmbedding":
        """This rank's rows of an existing ``nn.Embedding`` (copied), padded with zero rows."""
        if not isinstance(embedding, nn.Embedding):
            raise ValueError(f"VocabParallelEmbedding.from_embedding: expected an nn.Embedding, got "
                             f"{type(embedding).__name__}")
        with _skip_init():
            layer = cls(embedding.num_embeddings, embedding.embedding_dim, group=group,
                        sequence_parallel=sequence_parallel, algorithm=algorithm,
                        device=embedding.weight.device, dtype=embedding.weight.dtype)
        with torch.no_grad():
            layer.weight.zero_()
            rows = embedding.weight[layer.vocab_start:layer.vocab_end]
            layer.weight[:rows.shape[0]].copy_(rows)
        return layer

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        outside = (idx < self.vocab_start) | (idx >= self.vocab_end)
        local = (idx - self.vocab_start).masked_fill(outside, 0)
        partial = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return scatter_to_sequence(partial, SEQUENCE_DIM, self.group, self.algorithm)
        return reduce_from_parallel(partial, self.group, self.algorithm)

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings} (padded {self.padded_num_embeddings}, rows {self.vocab_start}.."
                f"{self.vocab_end - 1} here), {self.embedding_dim}, sequence_parallel={self.sequence_parallel}")


# ==================================================================================== the loss
class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Mean cross-entropy from logits split by vocabulary (Megatron's ``vocab_parallel_cross_entropy``).

    With rows ``i`` (tokens) and this rank's columns ``j``::

        m_i   = max_j z_ij                         all-reduce MAX   (numerical stability only)
        e_ij  = exp(z_ij - m_i)
        S_i   = sum_j e_ij,  z_i[y_i] - m_i        all-reduce SUM   (one message for both)
        loss  = mean_i (log S_i - (z_i[y_i] - m_i))
        dz_ij = (e_ij / S_i - [j == y_i]) / N      no message

    The rank holding column ``y_i`` contributes the target logit, the others zero.
    """

    @staticmethod
    def forward(ctx, logits, target, vocab_size, group, algorithm):
        r = group_rank(group)
        n = logits.shape[-1]
        z = logits.reshape(-1, n).float()
        y = target.reshape(-1)
        start = r * n
        if vocab_size is not None and start + n > vocab_size:  # padding columns: never a probability
            pad = torch.arange(start, start + n, device=z.device) >= vocab_size
            z = z.masked_fill(pad, float("-inf"))
        m = z.max(dim=1).values.detach()
        comm.all_reduce(m, op=comm.ReduceOp.MAX, group=group, algorithm=algorithm)
        e = z - m.unsqueeze(1)  # a new tensor: ``logits`` is left alone
        mine = (y >= start) & (y < start + n)
        local = (y - start).masked_fill(~mine, 0)
        picked = e.gather(1, local.unsqueeze(1)).squeeze(1).masked_fill(~mine, 0.0)
        e.exp_()
        sums = torch.stack([e.sum(dim=1), picked])
        comm.all_reduce(sums, group=group, algorithm=algorithm)
        total, picked = sums[0], sums[1]
        loss = (total.log() - picked).mean()
        e.div_(total.unsqueeze(1))  # softmax, kept for backward
        ctx.save_for_backward(e, local, mine)
        ctx.shape, ctx.dtype = logits.shape, logits.dtype
        return loss.to(logits.dtype)

    @staticmethod
    def backward(ctx, dloss):
        softmax, local, mine = ctx.saved_tensors
        rows = torch.arange(softmax.shape[0], device=softmax.device)
        grad = softmax.clone()
        grad[rows, local] -= mine.to(grad.dtype)
        grad.mul_(dloss / softmax.shape[0])
        return grad.to(ctx.dtype).reshape(ctx.shape), None, None, None, None


def vocab_parallel_cross_entropy(logits_shard: torch.Tensor, target: torch.Tensor, group=None, *,
                                 vocab_size: int | None = None, algorithm: str = "native") -> torch.Tensor:
    """Mean cross-entropy of ``target`` (global ids) from this rank's vocabulary slice of the logits.

    ``logits_shard``: ``(..., n)``, columns ``[r n, (r+1) n)`` of the full logits on group rank
    ``r``; ``target``: ``(...)``, the same on every rank. Columns at or past ``vocab_size`` are
    padding and ignored. Equals ``F.cross_entropy(full_logits.view(-1, V), target.view(-1))``;
    the full logits are never built. Two all-reduces of ``N`` and ``2N`` floats (``N`` tokens).
    """
    if logits_shard.shape[:-1] != target.shape:
        raise ValueError(f"vocab_parallel_cross_entropy: logits_shard shape {tuple(logits_shard.shape)} must be "
                         f"target shape {tuple(target.shape)} plus a vocabulary dimension")
    return _VocabParallelCrossEntropy.apply(logits_shard, target, vocab_size, group, algorithm)


# ==================================================================================== GPT blocks
class ParallelSelfAttention(nn.Module):
    """Causal self-attention on this rank's ``n_head/t`` heads.

    ``c_attn`` is column-parallel with its output in three chunks (this rank's q, k and v heads),
    ``c_proj`` row-parallel: the heads never talk to each other, so no message is needed between.
    """

    def __init__(self, c_attn: nn.Module, c_proj: nn.Module, n_head: int, t: int, dropout: float = 0.0,
                 resid_dropout: nn.Module | None = None):
        super().__init__()
        self.c_attn, self.c_proj = c_attn, c_proj
        self.n_head, self.n_local_heads = n_head, n_head // t
        self.dropout = dropout
        self.resid_dropout = resid_dropout if resid_dropout is not None else nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        qkv = self.c_attn(x)  # (B, T, 3 C/t), T whole even when x is a sequence shard
        B, T, three_c = qkv.shape
        c = three_c // 3
        q, k, v = (u.view(B, T, self.n_local_heads, c // self.n_local_heads).transpose(1, 2)
                   for u in qkv.split(c, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        y = y.transpose(1, 2).contiguous().view(B, T, c)
        return self.resid_dropout(self.c_proj(y))


class SequenceParallelLayerNorm(nn.LayerNorm):
    """A LayerNorm on a sequence shard: its weight and bias enter through ``f`` (identity forward,
    all-reduce backward), since each rank's gradient covers only its ``s/t`` positions."""

    def __init__(self, norm: nn.LayerNorm, group=None, algorithm: str = "native"):
        super().__init__(norm.normalized_shape, eps=norm.eps, elementwise_affine=norm.elementwise_affine,
                         bias=norm.bias is not None, device=_device_of(norm))
        self.weight, self.bias = norm.weight, norm.bias  # the same Parameters: names and values kept
        self.group, self.algorithm = group, algorithm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = None if self.weight is None else copy_to_parallel(self.weight, self.group, self.algorithm)
        b = None if self.bias is None else copy_to_parallel(self.bias, self.group, self.algorithm)
        return F.layer_norm(x, self.normalized_shape, w, b, self.eps)


def _device_of(module: nn.Module):
    p = next(module.parameters(), None)
    return None if p is None else p.device


# ==================================================================================== the model
@dataclass(frozen=True)
class TensorParallelInfo:
    """What :func:`tensor_parallel` did to a model (``model._tensor_parallel``)."""

    group: object
    size: int
    rank: int
    sequence_parallel: bool
    algorithm: str
    vocab_size: int
    padded_vocab_size: int


_REQUIRED = ("wte", "wpe", "blocks", "ln_f", "lm_head")


def is_tensor_parallel(model: nn.Module) -> bool:
    return getattr(model, "_tensor_parallel", None) is not None


def _roles(model: nn.Module):
    """The attention modules (``c_attn``, ``c_proj``, ``n_head``) and MLPs (``c_fc``, ``c_proj``)."""
    attns, mlps = [], []
    for name, m in model.named_modules():
        if isinstance(getattr(m, "c_attn", None), nn.Linear) and isinstance(getattr(m, "c_proj", None), nn.Linear):
            attns.append((name, m))
        elif isinstance(getattr(m, "c_fc", None), nn.Linear) and isinstance(getattr(m, "c_proj", None), nn.Linear):
            mlps.append((name, m))
    return attns, mlps


def _validate(model: nn.Module, t: int, algorithm: str) -> tuple[list, list]:
    if not isinstance(model, nn.Module):
        raise ValueError(f"tensor_parallel(model={type(model).__name__}): pass an nn.Module such as workbench's GPT")
    if is_tensor_parallel(model):
        raise ValueError("tensor_parallel(model): this model is already tensor-parallel "
                         f"(t={model._tensor_parallel.size}); build a fresh model to split it again")
    missing = [n for n in _REQUIRED if not hasattr(model, n)]
    if missing or not isinstance(model.wte, nn.Embedding) or not isinstance(model.lm_head, nn.Linear):
        raise ValueError(f"tensor_parallel(model={type(model).__name__}): the model lacks the layers it expects "
                         f"({', '.join(missing) or 'wte must be nn.Embedding and lm_head nn.Linear'}); it needs a "
                         "GPT-shaped model: wte, wpe (nn.Embedding), blocks, ln_f, lm_head (nn.Linear), with attention "
                         "modules holding c_attn, c_proj and n_head, and MLPs holding c_fc and c_proj")
    attns, mlps = _roles(model)
    if not attns or not mlps:
        raise ValueError(f"tensor_parallel(model={type(model).__name__}): found {len(attns)} attention modules "
                         f"(c_attn, c_proj, n_head) and {len(mlps)} MLPs (c_fc, c_proj): it needs both")
    _check_algorithm(algorithm, "tensor_parallel")
    for name, attn in attns:
        n_head = getattr(attn, "n_head", None)
        if not isinstance(n_head, int):
            raise ValueError(f"tensor_parallel: attention module {name!r} has no integer n_head")
        if n_head % t:
            raise ValueError(f"tensor_parallel: n_head={n_head} ({name}) is not divisible by the tensor-parallel "
                             f"size t={t}: each rank takes n_head/t heads; use t dividing {n_head}")
    for name, mlp in mlps:
        if mlp.c_fc.out_features % t:
            raise ValueError(f"tensor_parallel: the MLP's hidden size 4C={mlp.c_fc.out_features} ({name}.c_fc) is not "
                             f"divisible by t={t}: pick n_embd so that 4 n_embd is a multiple of {t}")
    return attns, mlps


def tensor_parallel(model: nn.Module, *, group=None, sequence_parallel: bool = False,
                    algorithm: str = "native") -> nn.Module:
    """Split a GPT over the ranks of ``group`` (default: all) in place, Megatron-style; return it.

    Call it in every rank of the group on identical models (same seed). Each attention module
    (``c_attn``, ``c_proj``, ``n_head``) splits by heads, each MLP (``c_fc``, ``c_proj``) by its
    hidden units, the token embedding and the head (tied or not) by vocabulary (padded to a
    multiple of ``t``), and the loss is :func:`vocab_parallel_cross_entropy`. ``model(idx, targets)``
    keeps its signature; every rank passes the same ``idx``; ``logits`` is this rank's vocabulary
    slice ``(B, T, V_padded/t)``. ``sequence_parallel=True`` splits norms, dropouts and residuals by
    sequence (``T`` must then be divisible by ``t``). ``algorithm``: the :mod:`workbench.comm`
    algorithm of every collective ("native", "ring", ...).

    Dropout: the ranks' random generators run in step (same seed), so a dropout on a replicated
    tensor draws the same mask on every rank, as it must. Inside the split regions (attention
    probabilities of each rank's heads) and on sequence shards each rank should draw its own
    masks, for which Megatron forks a per-rank generator; this module does not, so with
    ``dropout > 0`` those masks repeat across ranks. Parity with one process holds for
    ``dropout=0`` (``GPTConfig``'s default).
    """
    t, r = group_size(group), group_rank(group)
    attns, mlps = _validate(model, t, algorithm)
    sp, kw = sequence_parallel, dict(group=group, algorithm=algorithm)
    tied = model.lm_head.weight is model.wte.weight
    vocab = model.wte.num_embeddings

    for name, attn in attns:
        new = ParallelSelfAttention(
            ColumnParallelLinear.from_linear(attn.c_attn, chunks=3, sequence_parallel=sp, **kw),
            RowParallelLinear.from_linear(attn.c_proj, sequence_parallel=sp, **kw),
            attn.n_head, t, float(getattr(attn, "dropout", 0.0)), getattr(attn, "resid_dropout", None))
        _set_submodule(model, name, new)
    for _, mlp in mlps:
        mlp.c_fc = ColumnParallelLinear.from_linear(mlp.c_fc, sequence_parallel=sp, **kw)
        mlp.c_proj = RowParallelLinear.from_linear(mlp.c_proj, sequence_parallel=sp, **kw)
    if sp:
        for name, m in list(model.named_modules()):
            if type(m) is nn.LayerNorm:
                _set_submodule(model, name, SequenceParallelLayerNorm(m, **kw))

    model.wte = VocabParallelEmbedding.from_embedding(model.wte, sequence_parallel=sp, **kw)
    model.lm_head = _vocab_parallel_head(model.lm_head, model.wte.padded_num_embeddings, sp, **kw)
    if tied:
        model.lm_head.weight = model.wte.weight

    model._tensor_parallel = TensorParallelInfo(group, t, r, sp, algorithm, vocab, model.wte.padded_num_embeddings)
    model.__class__ = _tensor_parallel_class(type(model))
    return model


def _vocab_parallel_head(head: nn.Linear, padded_vocab: int, sequence_parallel: bool, group, algorithm: str):
    """``head`` (C -> V) as a column-parallel layer over the padded vocabulary: rank r holds the
    same rows as the embedding's shard; padding rows (and bias entries) are zero."""
    t, r = group_size(group), group_rank(group)
    vocab = head.out_features
    with _skip_init():
        layer = ColumnParallelLinear(head.in_features, padded_vocab, head.bias is not None, group=group,
                                     sequence_parallel=sequence_parallel, algorithm=algorithm,
                                     device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        for mine, full in ((layer.weight, head.weight), (layer.bias, head.bias)):
            if full is not None:
                padded = torch.zeros((padded_vocab,) + tuple(full.shape[1:]), device=full.device, dtype=full.dtype)
                padded[:vocab] = full
                mine.copy_(padded.chunk(t, 0)[r])
                mine._tp_vocab = vocab
    return layer


def _set_submodule(root: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, leaf = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, leaf, module)


def _forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
    """The GPT's forward, tensor-parallel: ``(logits of this rank's vocabulary slice, loss)``."""
    tp: TensorParallelInfo = self._tensor_parallel
    if idx.dim() != 2:
        raise ValueError(f"GPT.forward: idx must be (batch, sequence) token ids, got shape {tuple(idx.shape)}")
    B, T = idx.shape
    block_size = self.wpe.num_embeddings
    if T > block_size:
        raise ValueError(f"GPT.forward: sequence length {T} is longer than the model's block_size={block_size}")
    if tp.sequence_parallel and T % tp.size:
        raise ValueError(f"tensor-parallel GPT.forward: sequence length T={T} is not divisible by t={tp.size}, "
                         f"which sequence parallelism needs (each rank keeps T/t positions): use a multiple of {tp.size}")
    if targets is not None and targets.shape != idx.shape:
        raise ValueError(f"GPT.forward: targets shape {tuple(targets.shape)} must equal idx shape {tuple(idx.shape)}")
    pos = self.wpe(torch.arange(T, device=idx.device))          # (T, C), replicated
    if tp.sequence_parallel:                                     # this rank's positions; grads all-gathered
        pos = scatter_to_parallel(pos, tp.group, tp.algorithm, dim=0)
    x = self.drop(self.wte(idx) + pos)                            # (B, T, C) or (B, T/t, C)
    for block in self.blocks:
        x = block(x)
    logits = self.lm_head(self.ln_f(x))                           # (B, T, V_padded/t)
    loss = None
    if targets is not None:
        loss = vocab_parallel_cross_entropy(logits, targets, tp.group, vocab_size=tp.vocab_size,
                                            algorithm=tp.algorithm)
    return logits, loss


_CLASSES: dict[type, type] = {}


def _tensor_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,),
                             {"forward": _forward, "__module__": __name__, "__doc__": _forward.__doc__})
    return _CLASSES[cls]


# ==================================================================================== state
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters and buffers on every rank, keyed and shaped as in the single GPT.

    Sharded tensors are all-gathered (through :mod:`workbench.comm`), q/k/v chunks put back in
    order, and the vocabulary padding cut off. A collective: call it on every rank of the group.
    """
    tp: TensorParallelInfo | None = getattr(model, "_tensor_parallel", None)
    if tp is None:
        raise ValueError("full_state_dict(model): the model is not tensor-parallel; use model.state_dict()")
    out, done = {}, {}
    for name, value in model.state_dict(keep_vars=True).items():
        if id(value) in done:
            out[name] = done[id(value)]
            continue
        dim = getattr(value, "_tp_dim", None)
        full = value.detach()
        if dim is not None:
            chunks = value._tp_chunks
            parts = tp_ops._all_gather(full.movedim(dim, 0), 0, tp.group, tp.algorithm).movedim(0, dim)
            if chunks > 1:  # rank-major [q_0 k_0 v_0 | q_1 k_1 v_1] -> [q_0 q_1 | k_0 k_1 | v_0 v_1]
                shape = parts.shape
                parts = parts.reshape(tp.size, chunks, -1, *shape[1:]).transpose(0, 1).reshape(shape)
            if value._tp_vocab is not None:
                parts = parts.narrow(0, 0, value._tp_vocab)
            full = parts
        full = full.clone(memory_format=torch.contiguous_format)
        done[id(value)] = full
        out[name] = full
    return out


# ==================================================================================== formulas
def parameters_per_rank(config, t: int) -> int:
    """Exact parameter count on one rank of ``tensor_parallel(GPT(config))`` with group size ``t``."""
    h, L, bias = config.n_embd, config.n_layer, config.bias
    padded = -(-config.vocab_size // t) * t
    sharded = 12 * h * h + (7 * h if bias else 0)           # c_attn, c_fc (+ biases), both c_proj weights
    replicated = (2 * 2 * h if bias else 2 * h) + (2 * h if bias else 0)  # two norms, two row biases
    per_layer = sharded // t + replicated
    vocab = padded * h // t * (1 if config.tie_weights else 2)
    return L * per_layer + vocab + config.block_size * h + (2 * h if bias else h)


def activation_bytes_per_layer(b: int, s: int, h: int, a: int, t: int = 1, sequence_parallel: bool = False,
                               element_size: int = 4) -> int:
    """Bytes one transformer layer keeps for backward, per rank (Korthikanti et al. 2022, adapted).

    Korthikanti et al. count, per layer, in bytes of 16-bit activations with 1-byte dropout masks:
    ``s b h (34 + 5 a s / h)`` = ``sbh (10 + 24/t + 5 a s/(h t))`` with tensor parallelism and
    ``sbh/t (34 + 5 a s/h)`` with sequence parallelism as well. Their 34 is, in elements of 2 bytes:
    norm inputs 2, QKV input 1, Q and K 2, V 1, attention output (projection input) 1, MLP input
    1, GELU input 4 and output 4 (16 elements = 32 bytes), plus 2 one-byte dropout masks; ``5as/h``
    is the ``a s^2 b`` attention scores, softmax and its dropout mask.

    This model, float32, ``dropout=0`` (no masks: ``nn.Dropout(0)`` returns its input) and the
    fused ``scaled_dot_product_attention`` (flash kernel on CPU: it keeps the output and one
    log-sum-exp per row and head, ``a s b`` floats, never the ``a s^2 b`` scores). Elements kept:

    ===========================  ==================  =========================================
    tensor                       elements            split by t?
    ===========================  ==================  =========================================
    layer input (ln_1 keeps it)  sbh                 SP only
    ln_1 output (c_attn input)   sbh                 SP only (c_attn re-gathers it in backward)
    q, k, v (c_attn output)      3 sbh               yes (heads)
    attention output             sbh                 yes; also c_proj's input: the CPU flash
                                                     kernel writes it in (b, s, a, d) order, so
                                                     ``transpose(1, 2).contiguous()`` is free
    log-sum-exp per row and head asb                 yes
    ln_2 input (residual sum)    sbh                 SP only
    ln_2 output (c_fc input)     sbh                 SP only
    GELU input, GELU output      8 sbh               yes
    norm statistics (mean, rstd) 4 sb                SP only
    ===========================  ==================  =========================================

    so ``element_size x (sbh (4 + 12/t) + asb/t + 4 sb)`` without and
    ``element_size x (sbh 16/t + asb/t + 4 sb/t)`` with sequence parallelism: Korthikanti's
    ``10 + 24/t`` and ``34/t`` with 4-byte elements, no masks, and ``asb/t`` for ``5as^2b/t``.
    """
    rep = t if sequence_parallel else 1  # the replicated part is split by sequence under SP
    elements = s * b * h * 4 / rep + s * b * h * 12 / t + a * s * b / t + 4 * s * b / rep
    return int(round(elements * element_size))


def communication_per_layer(b: int, s: int, h: int, sequence_parallel: bool = False,
                            bias: bool = True) -> dict[str, dict[str, list[int]]]:
    """The collectives one transformer layer issues per step: ``{phase: {collective: [elements]}}``.

    One entry per call, its size in elements (of the whole buffer: the all-reduced tensor, the
    gathered output of an all-gather, the input of a reduce-scatter). Tensor parallelism: two
    all-reduces of ``b s h`` forward (``g`` after each row-parallel layer) and two backward
    (``f`` before each column-parallel layer). Sequence parallelism: each of those becomes an
    all-gather or a reduce-scatter of the same ``b s h`` gathered elements (an all-reduce is
    one of each), plus the re-gathers of the two column-parallel inputs in backward, plus the
    gradient all-reduces of the parameters that see a sequence shard (two norms' weights and
    biases, two row-parallel biases: ``h`` each).
    """
    n = b * s * h
    if not sequence_parallel:
        return {"forward": {"all_reduce": [n, n]}, "backward": {"all_reduce": [n, n]}}
    small = [h] * ((4 if bias else 2) + (2 if bias else 0))
    return {"forward": {"all_gather": [n, n], "reduce_scatter": [n, n]},
            "backward": {"reduce_scatter": [n, n], "all_gather": [n, n, n, n], "all_reduce": small}}


def communication_per_step(b: int, s: int, config, sequence_parallel: bool = False) -> dict[str, list[int]]:
    """Every collective of one training step of ``tensor_parallel(GPT(config))``: ``{collective: [elements]}``.

    The layers (:func:`communication_per_layer`, ``n_layer`` times), plus the edges of the model:
    the embedding's all-reduce forward (sequence parallel: a reduce-scatter forward, an all-gather
    backward, and the positions' ``s h`` all-gathered backward), the head's input (``f``: an
    all-reduce backward; sequence parallel: all-gathered forward, reduce-scattered and re-gathered
    backward, and ``ln_f``'s two gradient all-reduces), and the loss's two all-reduces of ``b s``
    and ``2 b s`` floats (the maximum, then the sum of exponentials with the target logit).
    """
    n, h = b * s * config.n_embd, config.n_embd
    out: dict[str, list[int]] = {"all_reduce": [], "all_gather": [], "reduce_scatter": []}
    for phase in communication_per_layer(b, s, h, sequence_parallel, config.bias).values():
        for collective, sizes in phase.items():
            out[collective] += sizes * config.n_layer
    if sequence_parallel:
        out["reduce_scatter"] += [n, n]           # embedding forward, head input backward
        out["all_gather"] += [n, s * h, n, n]     # embedding backward, positions, head input fwd + re-gather
        out["all_reduce"] += [h] * (2 if config.bias else 1)  # ln_f
    else:
        out["all_reduce"] += [n, n]               # embedding forward (g), head input backward (f)
    out["all_reduce"] += [b * s, 2 * b * s]       # the loss
    return {k: v for k, v in out.items() if v}
