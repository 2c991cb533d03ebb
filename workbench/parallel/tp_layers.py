"""The tensor-parallel layers: a linear split by columns or by rows, an embedding and a loss split
by vocabulary. Each holds this rank's slice of the weights and talks only through the conjugate
operators of :mod:`workbench.parallel.tp_ops`; :mod:`workbench.parallel.tensor` explains the
algorithm and assembles them into a tensor-parallel GPT.

===========================  ==========================  ==============================  =========
layer                        weight on rank r            forward messages                backward
===========================  ==========================  ==============================  =========
ColumnParallelLinear         rows r of ``A`` (out/t)     none (SP: all-gather input)     f: all-reduce dX (SP: reduce-scatter + re-gather)
RowParallelLinear            columns r of ``A`` (in/t)   g: all-reduce (SP: red.-scat.)  none (SP: all-gather)
VocabParallelEmbedding       rows of ids [r n, (r+1) n)  all-reduce (SP: reduce-scatter) none (SP: all-gather)
vocab_parallel_cross_entropy columns [r n, (r+1) n)      2 all-reduces of N, 2N floats   none
===========================  ==========================  ==============================  =========

Built standalone, a layer draws the whole matrix with ``nn.Linear``'s (``nn.Embedding``'s) init
and keeps its slice: every rank draws the same numbers, so the ranks' random streams stay in
step. ``from_linear``/``from_embedding`` copy this rank's slice of an existing layer and draw
nothing.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench import comm
from workbench.parallel.tp_ops import (copy_to_parallel, gather_from_parallel, group_rank, group_size,
                                       linear_with_sequence_gather, reduce_from_parallel, scatter_to_parallel,
                                       scatter_to_sequence)

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "ParallelSelfAttention", "SequenceParallelLayerNorm", "SEQUENCE_DIM"]

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
        z = logits.reshape(-1, n).to(torch.promote_types(logits.dtype, torch.float32))  # float32 or wider
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
