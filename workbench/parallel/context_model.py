"""Context parallelism on a model: each rank runs the whole model on its shard of the sequence.

:mod:`workbench.parallel.context` splits one attention call over the ``P`` ranks of a group. A
transformer needs three more things to train on sequence shards, and this file adds them to a
GPT (or a tensor-parallel one, or a pipeline stage of either) without touching its code:

1. **The batch.** Every rank of the group takes its ``S/P`` positions of each sequence, inputs and
   targets alike (:func:`shard_batch`, the layout of :func:`~workbench.parallel.context.shard_sequence`).
   Every layer except attention works token by token, so it runs unchanged on the shard.
2. **Positions.** The model's ``wpe(arange(T))`` would look up rows ``0..S/P-1`` on every rank.
   :class:`GlobalPositionEmbedding` keeps the same Parameter and looks up the positions this rank
   holds (:func:`~workbench.parallel.context.sequence_positions`): rank 1 of 2 under ``"zigzag"``
   with ``S = 16`` reads rows 4-11, as one process reading that part of the sequence does.
3. **Attention.** While a layer runs, every ``F.scaled_dot_product_attention`` call is sent to
   :func:`~workbench.parallel.context.ring_attention` or
   :func:`~workbench.parallel.context.ulysses_attention` over the group (found with a
   ``TorchFunctionMode``, as :mod:`workbench.parallel.recompute` finds it: any model that calls it
   is covered, whatever its attention module). The layer's forward is replaced on the instance, so
   activation recomputation wrapped around it later runs the ring again in backward.

Loss and gradients. Each rank's loss is the mean over its own tokens; all ranks hold the same
number, so the global batch's mean is the mean of the ranks' means. Each rank's backward gives
the gradient of the *sum* of the ranks' losses with respect to its own uses of every parameter
(the attention backward carries the other ranks' dK and dV home), so the parameters' gradients,
summed over the group and divided by ``P`` -- averaged, as data parallelism averages them -- are
exactly the gradient of the global mean. The parameters are replicated over the group: the mesh
averages gradients over ``dp x cp`` (:mod:`workbench.parallel.mesh`).

Cost per layer and rank: the attention method's messages (see :mod:`workbench.parallel.context`);
nothing else moves. Activation memory per rank falls as ``1/P`` (every activation is ``S/P``
positions long), except the ring's score block ``B H (S/P)^2`` or Ulysses' ``B (H/P) S^2``.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from workbench.parallel import context
from workbench.parallel.recompute import find_layers

__all__ = ["context_parallel", "shard_batch", "GlobalPositionEmbedding", "METHODS"]

METHODS = ("ring", "ulysses")


def check_args(method, layout) -> None:
    """Refuse an unknown method or layout (before any message)."""
    if method not in METHODS:
        raise ValueError(f"context parallelism: cp_method={method!r} is not known: use 'ring' (K/V blocks round a "
                         "ring) or 'ulysses' (all-to-all to head shards)")
    if layout not in context.LAYOUTS:
        raise ValueError(f"context parallelism: cp_layout={layout!r} is not known: use one of {context.LAYOUTS}")


def shard_batch(t: torch.Tensor, group, layout: str = "zigzag") -> torch.Tensor:
    """This rank's positions of every sequence of ``t`` ``(B, S, ...)``; a ValueError naming the
    sizes when ``S`` does not split (before any message)."""
    p = torch.distributed.get_world_size(group)
    chunks = p if layout == "contiguous" else 2 * p
    if t.dim() < 2 or t.shape[1] % chunks:
        raise ValueError(f"context parallelism: sequence length {t.shape[1] if t.dim() > 1 else None} (batch.shape[1]) "
                         f"does not split into {chunks} equal chunks for cp={p}, cp_layout={layout!r}: use a "
                         f"multiple of {chunks}")
    return context.shard_sequence(t, group=group, dim=1, layout=layout)


class GlobalPositionEmbedding(nn.Embedding):
    """``wpe`` of a context-parallel model: called with ``arange(S/P)``, as the model's forward
    does, it looks up the global positions this rank holds (the same Parameter, same name)."""

    def __init__(self, wpe: nn.Embedding, group, layout: str):
        super().__init__(wpe.num_embeddings, wpe.embedding_dim, device=wpe.weight.device, dtype=wpe.weight.dtype)
        self.weight = wpe.weight
        self.group, self.layout = group, layout

    def forward(self, pos: torch.Tensor) -> torch.Tensor:
        p = torch.distributed.get_world_size(self.group)
        mine = context.sequence_positions(pos.numel() * p, group=self.group, layout=self.layout).to(pos.device)
        return super().forward(mine[pos])


class _ContextParallelAttention(TorchFunctionMode):
    """While a layer runs: every ``F.scaled_dot_product_attention`` call on this rank's sequence
    shard becomes the context-parallel attention over the group."""

    def __init__(self, group, method: str, layout: str):
        super().__init__()
        self.group, self.layout = group, layout
        self.attend = context.ring_attention if method == "ring" else context.ulysses_attention

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        extra = dict(zip(("attn_mask", "dropout_p", "is_causal", "scale"), args[3:]), **kwargs)
        if extra.get("attn_mask") is not None or extra.get("dropout_p", 0.0) or extra.get("enable_gqa", False):
            raise ValueError("context parallelism: the model's attention passes attn_mask, dropout_p > 0 or "
                             "enable_gqa, which ring and Ulysses attention do not take: use is_causal (and "
                             "dropout=0)")
        return self.attend(q, k, v, self.group, is_causal=bool(extra.get("is_causal", False)),
                           scale=extra.get("scale"), layout=self.layout)


def context_parallel(model: nn.Module, group, *, method: str = "ring", layout: str = "zigzag") -> nn.Module:
    """Make ``model`` (a GPT, tensor-parallel or not, or a pipeline stage of one) run on sequence
    shards over ``group``, in place; returns it. Feed it :func:`shard_batch` of every batch.

    Its position embedding (when it has one) reads global positions; each repeated layer's
    attention runs through ``method`` ("ring" or "ulysses") in ``layout``. Parameters stay
    replicated: average their gradients over the group (with data parallelism, over ``dp x cp``).
    """
    check_args(method, layout)
    p = torch.distributed.get_world_size(group)
    config = getattr(model, "config", None)
    if getattr(config, "dropout", 0.0):
        raise ValueError(f"context parallelism: the model has dropout={config.dropout}, which ring and Ulysses "
                         "attention do not apply: build it with dropout=0")
    layers = find_layers(model)
    if method == "ulysses":
        for layer in layers:
            attn = getattr(layer, "attn", None)
            heads = getattr(attn, "n_local_heads", getattr(attn, "n_head", None))
            if heads is not None and heads % p:
                raise ValueError(f"context parallelism: cp_method='ulysses' needs this rank's heads ({heads}) "
                                 f"divisible by cp={p}: use cp_method='ring', or a cp that divides {heads}")
    wpe = getattr(model, "wpe", None)
    if isinstance(wpe, nn.Embedding) and not isinstance(wpe, GlobalPositionEmbedding):
        model.wpe = GlobalPositionEmbedding(wpe, group, layout)
    for layer in layers:
        forward = layer.forward

        def sharded(*args, _forward=forward, **kwargs):
            with _ContextParallelAttention(group, method, layout):
                return _forward(*args, **kwargs)

        layer.forward = sharded
    return model
