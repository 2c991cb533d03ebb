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

Any model: a plan. Which layer is split how is data, a dict of module globs to styles
(``{"model.layers.*.self_attn.q_proj": "colwise", ...}``, what torch's ``parallelize_module``
takes), and :func:`tensor_parallel` swaps each matched layer for its split twin in place. Plans
ship for our GPT (the default), Hugging Face GPT-2 (its ``Conv1D`` weights are stored
``(in, out)``: split as the equivalent linear, stored back transposed by :func:`full_state_dict`)
and Llama (grouped-query attention: ``t`` must divide the key/value heads); see
:mod:`~workbench.parallel.tensor_plans`. A Hugging Face model keeps its own forward and loss: its
head all-gathers the logits (one all-gather forward, ``b s V`` floats on every rank), where our
GPT's loss is computed from the shards.

Usage::

    model = tensor_parallel(GPT(cfg), sequence_parallel=True)     # in every rank, same seed/weights
    logits, loss = model(idx, targets)                             # every rank: the same idx
    loss.backward(); optimizer.step()
    full_state_dict(model)                                          # the single-process names and shapes
    hf = tensor_parallel(LlamaForCausalLM(config), plan="llama")   # or detected; its forward unchanged
    hf(input_ids=idx, labels=targets).loss.backward()

Where things are: :mod:`~workbench.parallel.tp_ops` the f/g and sequence operators (every
message), :mod:`~workbench.parallel.tp_layers` the layers and the loss,
:mod:`~workbench.parallel.tensor_plans` the plans and their matching, this module the
transformation (layers swapped by the plan, attention by heads, sequence-parallel norms, our
GPT's forward), the gathered state dict and the formulas the tests and lesson 06 check.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F

from workbench.parallel import tensor_plans as plans
from workbench.parallel import tp_ops
from workbench.parallel.tp_layers import (ColumnParallelLinear, ParallelSelfAttention, RowParallelLinear,
                                          SequenceParallelLayerNorm, VocabParallelEmbedding,
                                          _check_algorithm, _skip_init, vocab_parallel_cross_entropy)
from workbench.parallel.tp_ops import group_rank, group_size, scatter_to_parallel

__all__ = ["ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "vocab_parallel_cross_entropy",
           "GatheredColumnParallelLinear", "ParallelSelfAttention", "SequenceParallelLayerNorm", "tensor_parallel",
           "full_state_dict",
           "is_tensor_parallel", "activation_bytes_per_layer", "parameters_per_rank", "communication_per_layer",
           "communication_per_step"]


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
    plan: str = "gpt"
    loss_parallel: bool = True  # the loss is ours: computed from the head's vocabulary shards


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


def tensor_parallel(model: nn.Module, group=None, plan=None, sequence_parallel: bool = False, *,
                    algorithm: str = "native") -> nn.Module:
    """Split ``model`` over the ranks of ``group`` (default: all) in place, by ``plan``; return it.

    Call it in every rank of the group on identical models (same seed). ``plan``: None (the
    shipped plan of the detected family: our GPT, Hugging Face GPT-2 or Llama), a name
    (``"gpt"``, ``"gpt2"``, ``"llama"``), a dict of module globs to styles (``"colwise"``,
    ``"rowwise"``, ``"vocab"``, ``"colwise_gather"``, ``"sequence"``; see
    :mod:`~workbench.parallel.tensor_plans`) or a :class:`~workbench.parallel.tensor_plans.TensorParallelPlan`.
    Each matched layer is swapped for its split twin (GPT-2's ``Conv1D`` weights transposed on
    the way), tied weights stay tied, attention head counts are divided where the family needs it,
    and the model's own forward runs on the result: every rank passes the same input and gets the
    same output (a ``colwise_gather`` head all-gathers the logits).

    Our GPT (``plan=None``) is Megatron's split: each attention module splits by heads, each MLP
    by its hidden units, the token embedding and the head (tied or not) by vocabulary (padded to
    a multiple of ``t``), and its loss is ours, so it becomes :func:`vocab_parallel_cross_entropy`
    on the head's shards: ``model(idx, targets)`` keeps its signature; ``logits`` is this rank's
    vocabulary slice ``(B, T, V_padded/t)``. ``sequence_parallel=True`` splits norms, dropouts
    and residuals by sequence (``T`` must then be divisible by ``t``); in a Hugging Face model,
    whose forward derives positions and masks from the embedding's length, the blocks' region
    only (the hidden states split entering the first block, gathered leaving the last).
    ``algorithm``: the :mod:`workbench.comm` algorithm of every collective ("native", "ring", ...).

    Dropout: the ranks' random generators run in step (same seed), so a dropout on a replicated
    tensor draws the same mask on every rank, as it must. Inside the split regions (attention
    probabilities of each rank's heads) and on sequence shards each rank should draw its own
    masks, for which Megatron forks a per-rank generator; this module does not, so with
    ``dropout > 0`` those masks repeat across ranks. Parity with one process holds for
    ``dropout=0`` (``GPTConfig``'s default).
    """
    _check_call(model, sequence_parallel, algorithm)
    t, r = group_size(group), group_rank(group)
    plan, layers, heads = _resolve_plan(model, plan, t, sequence_parallel, algorithm)
    sp, kw = sequence_parallel, dict(group=group, algorithm=algorithm)
    ties = _ties(model, layers)

    vocab, padded = _swap_layers(model, plan, layers, t, sp, kw)
    for first, second in ties:  # both halves are split the same way over the padded vocabulary
        model.get_submodule(second).weight = model.get_submodule(first).weight
    _divide_heads(model, heads, t)
    if sp and not plan.loss_parallel:
        parents = sorted({n.rpartition(".")[0] for n, s in layers.items() if s.kind == "colwise"})
        _sequence_region(model, plan.sequence_blocks, parents, t, **kw)
    split_head = any(s.kind == "colwise_gather" for s in layers.values())
    model._tensor_parallel = TensorParallelInfo(group, t, r, sp, algorithm, vocab, padded, plan.name,
                                                plan.loss_parallel and split_head)
    if plan.loss_parallel:
        model.__class__ = _tensor_parallel_class(type(model))
    return model


def _check_call(model: nn.Module, sequence_parallel, algorithm: str) -> None:
    """The arguments that need no plan: a module not split already, a known algorithm, a flag."""
    if not isinstance(model, nn.Module):
        raise ValueError(f"tensor_parallel(model={type(model).__name__}): pass an nn.Module such as workbench's GPT")
    if is_tensor_parallel(model):
        raise ValueError("tensor_parallel(model): this model is already tensor-parallel "
                         f"(t={model._tensor_parallel.size}); build a fresh model to split it again")
    _check_algorithm(algorithm, "tensor_parallel")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"tensor_parallel: sequence_parallel={sequence_parallel!r} must be True or False")


def _resolve_plan(model: nn.Module, plan, t: int, sequence_parallel: bool, algorithm: str) -> tuple:
    """The plan for ``model`` (see :func:`~workbench.parallel.tensor_plans.plan_for`), the layers
    it matches (name -> style) and the head counts it divides, checked against ``t`` and the
    model before anything is changed: ``(plan, layers, heads)``.

    A plan with our loss (``loss_parallel``) needs our GPT's shape; sequence parallelism needs,
    with our forward, a vocabulary-parallel embedding (it hands out the sequence shard), else the
    plan's block list (where the shard is cut and gathered again)."""
    plan = plans.plan_for(model, plan)
    if plan.loss_parallel:
        _validate(model, t, algorithm)
    elif sequence_parallel and plan.sequence_blocks is None:
        raise ValueError(f"tensor_parallel(plan={plan.name!r}, sequence_parallel=True): the plan names no block list "
                         "to split by sequence; pass a TensorParallelPlan(..., sequence_blocks='model.layers') or "
                         "sequence_parallel=False")
    layers = plans.match(model, plan)
    if sequence_parallel and plan.loss_parallel and "vocab" not in {s.kind for s in layers.values()}:
        raise ValueError(f"tensor_parallel(plan={plan.name!r}, sequence_parallel=True): our GPT's forward takes the "
                         "sequence shard from a vocabulary-parallel embedding, and the plan splits none; add "
                         "'wte': 'vocab' to the plan or pass sequence_parallel=False")
    heads = plans.head_modules(model, plan)
    _check_divisible(model, plan, layers, heads, t)
    return plan, layers, heads


def _swap_layers(model: nn.Module, plan, layers: dict, t: int, sp: bool, kw: dict) -> tuple[int, int]:
    """Replace every planned layer by its split twin (:func:`_split_layer`), in plan order;
    returns the vocabulary and its padded size (a multiple of ``t``): the vocabulary-parallel
    embedding's, else the split head's outputs (0 when neither is split)."""
    vocab = padded = None
    head_vocab = 0
    for name, style in layers.items():
        module = model.get_submodule(name)
        if style.kind == "colwise_gather":
            head_vocab = _features(module)[0]
        new = _split_layer(module, style, plan.loss_parallel, t, sp, kw)
        if new is None:
            continue
        if style.kind == "vocab":
            vocab, padded = module.num_embeddings, new.padded_num_embeddings
        _set_submodule(model, name, new)
    if vocab is None:  # no vocabulary-parallel embedding: the head's outputs, if it is split
        vocab = head_vocab
        padded = -(-vocab // t) * t
    return vocab, padded


def _split_layer(module: nn.Module, style, loss_parallel: bool, t: int, sp: bool, kw: dict) -> nn.Module | None:
    """One planned layer's split twin, by its style, or None where the layer stays as it is: a
    dropout, a norm without sequence parallelism, or a norm other than ``nn.LayerNorm`` under it
    (its parameters get gradient hooks instead, :func:`_sum_gradients_over_group`).

    ``loss_parallel`` (our GPT's forward): the column-parallel layers and the embedding work on
    sequence shards, and the head stays split for our loss; otherwise the model's own forward
    sees whole sequences there and the head gathers its logits."""
    if style.kind == "colwise":  # (a model whose forward we leave alone gathers before the module)
        return _transposed(module, lambda lin: ColumnParallelLinear.from_linear(
            lin, chunks=style.chunks, sequence_parallel=sp and loss_parallel, **kw))
    if style.kind == "rowwise":
        return _transposed(module, lambda lin: RowParallelLinear.from_linear(lin, sequence_parallel=sp, **kw))
    if style.kind == "vocab":
        # our GPT's forward takes a sequence shard from the embedding; a model whose forward is left
        # alone takes the whole sequence there (its positions and mask follow the embedding's length)
        return VocabParallelEmbedding.from_embedding(module, sequence_parallel=sp and loss_parallel, **kw)
    if style.kind == "colwise_gather" and loss_parallel:
        return _vocab_parallel_head(module, -(-module.out_features // t) * t, sp, **kw)
    if style.kind == "colwise_gather":
        return _transposed(module, lambda lin: GatheredColumnParallelLinear.from_linear(lin, **kw))
    if sp and isinstance(module, nn.LayerNorm):
        return SequenceParallelLayerNorm(module, **kw)
    if sp and style.kind == "sequence" and not isinstance(module, nn.Dropout):  # another norm (RMSNorm)
        _sum_gradients_over_group(module, **kw)
    return None  # "sequence" without sequence parallelism, or a dropout: nothing to split


def _divide_heads(model: nn.Module, heads: list, t: int) -> None:
    """Each rank holds ``1/t`` of the heads: divide the planned head counts by ``t`` (or replace the
    module, where the plan gives a function for it), so attention reshapes by the local count."""
    for name, module, what in heads:
        if callable(what):
            _set_submodule(model, name, what(module, t))
        else:
            for attr in what:
                if isinstance(getattr(module, attr, None), int):
                    setattr(module, attr, getattr(module, attr) // t)


def _sum_gradients_over_group(module: nn.Module, group, algorithm: str) -> None:
    """A norm on a sequence shard whose forward we do not replace: each parameter's gradient
    covers this rank's ``s/t`` positions only, so a gradient hook all-reduces it (``f``'s backward)."""
    for p in module.parameters(recurse=False):
        p.register_hook(lambda g: tp_ops._all_reduce(g, group, algorithm))


def _sequence_region(model: nn.Module, blocks_name: str, parents: list[str], t: int, group, algorithm: str
                     ) -> None:
    """Sequence parallelism for a model whose forward is left alone (Hugging Face's): the hidden
    states are split by sequence on entering the first block (this rank's ``s/t`` positions; the
    gradient all-gathered) and all-gathered on leaving the last one (this rank's slice of the
    gradient), so the model computes its positions, rotary tables and mask from the whole
    sequence and the blocks' norms and residuals work on ``1/t`` of it. Each module holding
    column-parallel layers (``parents``: an attention, an MLP) all-gathers its input on entry, as
    torchtitan's ``PrepareModuleInput`` does, since such a module reads the sequence length from
    its input; its row-parallel layers reduce-scatter. Forward moves what Megatron's sequence
    parallelism moves; backward all-reduces each column-parallel layer's input gradient (as
    without sequence parallelism) where Megatron reduce-scatters it once, the embedding stays an
    all-reduce and the final norm replicated (one all-gather of ``b s h`` more per step)."""
    blocks = model.get_submodule(blocks_name)
    first, last = blocks[0], blocks[len(blocks) - 1]

    def gather_input(module, args, kwargs):  # all-gather forward, this rank's slice of the gradient backward
        if args:
            return (tp_ops.gather_from_parallel(args[0], group, algorithm, dim=1), *args[1:]), kwargs
        kwargs["hidden_states"] = tp_ops.gather_from_parallel(kwargs["hidden_states"], group, algorithm, dim=1)
        return args, kwargs

    def check(length: int) -> None:
        if length % t:
            raise ValueError(f"tensor_parallel(sequence_parallel=True): sequence length T={length} is not divisible "
                             f"by t={t}, which sequence parallelism needs (each rank keeps T/t positions): use a "
                             f"multiple of {t}")

    def model_input(module, args, kwargs):  # before any message
        x = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs_embeds"))
        if isinstance(x, torch.Tensor) and x.dim() >= 2:
            check(x.shape[1])

    def enter(module, args, kwargs):
        if args:
            check(args[0].shape[1])
            return (scatter_to_parallel(args[0], group, algorithm, dim=1), *args[1:]), kwargs
        check(kwargs["hidden_states"].shape[1])
        kwargs["hidden_states"] = scatter_to_parallel(kwargs["hidden_states"], group, algorithm, dim=1)
        return args, kwargs

    def leave(module, args, kwargs, output):
        if isinstance(output, tuple):  # older transformers: (hidden, ...)
            return (tp_ops.gather_from_parallel(output[0], group, algorithm, dim=1), *output[1:])
        return tp_ops.gather_from_parallel(output, group, algorithm, dim=1)

    model.register_forward_pre_hook(model_input, with_kwargs=True)
    first.register_forward_pre_hook(enter, with_kwargs=True)
    last.register_forward_hook(leave, with_kwargs=True)
    for name in parents:
        model.get_submodule(name).register_forward_pre_hook(gather_input, with_kwargs=True)


def _check_divisible(model: nn.Module, plan, layers: dict, heads: list, t: int) -> None:
    """Every split layer and head count divisible by ``t`` (a vocabulary is padded instead)."""
    config = getattr(model, "config", None)
    if plan.kv_heads is not None and config is not None:
        n = getattr(config, plan.kv_heads, None)
        if isinstance(n, int) and n % t:
            raise ValueError(f"tensor_parallel(plan={plan.name!r}): t={t} does not divide the model's {n} key/value "
                             f"heads (config.{plan.kv_heads}={n}): each rank must hold whole heads of every kind; "
                             f"use t dividing {n}")
    for name, module, what in heads:
        for attr in () if callable(what) else what:
            n = getattr(module, attr, None)
            if isinstance(n, int) and n % t:
                raise ValueError(f"tensor_parallel(plan={plan.name!r}): {name}.{attr}={n} is not divisible by t={t}: "
                                 f"use t dividing {n}")
    for name, style in layers.items():
        module = model.get_submodule(name)
        out_features, in_features = _features(module)
        if style.kind == "colwise" and out_features % (t * style.chunks):
            raise ValueError(f"tensor_parallel(plan={plan.name!r}): {name} has {out_features} outputs, not divisible "
                             f"by chunks x t = {style.chunks} x {t} (style colwise): use t dividing "
                             f"{out_features // style.chunks}")
        if style.kind == "rowwise" and in_features % t:
            raise ValueError(f"tensor_parallel(plan={plan.name!r}): {name} has {in_features} inputs, not divisible by "
                             f"t={t} (style rowwise): use t dividing {in_features}")


def _features(module: nn.Module) -> tuple[int, int]:
    if plans.is_conv1d(module):
        return module.weight.shape[1], module.weight.shape[0]
    return getattr(module, "out_features", 0), getattr(module, "in_features", 0)


def _ties(model: nn.Module, layers: dict) -> list[tuple[str, str]]:
    """Pairs of planned modules sharing one weight (a tied embedding and head), first the
    embedding. A tie the split cannot keep is a ``ValueError``."""
    owner: dict[int, str] = {}
    ties = []
    for name, module in model.named_modules():
        w = getattr(module, "weight", None)
        if not isinstance(w, nn.Parameter):
            continue
        if id(w) not in owner:
            owner[id(w)] = name
            continue
        first = owner[id(w)]
        kinds = {layers[n].kind if n in layers else None for n in (first, name)}
        if kinds == {None}:
            continue
        if kinds != {"vocab", "colwise_gather"}:
            raise ValueError(f"tensor_parallel: {first} and {name} share one weight, but the plan splits them as "
                             f"{sorted(map(str, kinds))}: a tied embedding and head must be 'vocab' and "
                             "'colwise_gather' (or both left out)")
        ties.append((first, name) if layers[first].kind == "vocab" else (name, first))
    return ties


def _transposed(module: nn.Module, split: Callable[[nn.Linear], nn.Module]) -> nn.Module:
    """``split(linear)`` for an ``nn.Linear``; for GPT-2's ``Conv1D`` (``y = x W + b`` with ``W``
    stored ``(in, out)``) the same split of the equivalent linear ``W^T``, its parameters marked
    so :func:`full_state_dict` stores them back as ``(in, out)``."""
    if not plans.is_conv1d(module):
        return split(module)
    in_features, out_features = module.weight.shape
    with torch.device("meta"):  # no memory and no random numbers: the weights are replaced next
        linear = nn.Linear(in_features, out_features, bias=module.bias is not None)
    linear.weight = nn.Parameter(module.weight.detach().t(), requires_grad=module.weight.requires_grad)
    if module.bias is not None:
        linear.bias = module.bias
    layer = split(linear)
    layer.weight._tp_transposed = True
    return layer


class GatheredColumnParallelLinear(ColumnParallelLinear):
    """A head split by output rows (padded to a multiple of ``t``) whose output is all-gathered
    and cut back to ``out_features``: every rank gets the full logits, so a model's own loss
    runs on them unchanged. Costs an all-gather of ``b s V`` forward (nothing backward: each
    rank keeps its slice of the gradient) and ``b s V`` floats on every rank."""

    @classmethod
    def from_linear(cls, linear: nn.Linear, group=None, *, algorithm: str = "native"):
        t, r = group_size(group), group_rank(group)
        padded = -(-linear.out_features // t) * t
        with _skip_init():
            layer = cls(linear.in_features, padded, linear.bias is not None, gather_output=True, group=group,
                        algorithm=algorithm, device=linear.weight.device, dtype=linear.weight.dtype)
        layer.true_out_features = linear.out_features
        with torch.no_grad():
            for mine, full in ((layer.weight, linear.weight), (layer.bias, linear.bias)):
                if full is not None:
                    rows = torch.zeros((padded,) + tuple(full.shape[1:]), device=full.device, dtype=full.dtype)
                    rows[:linear.out_features] = full
                    mine.copy_(rows.chunk(t, 0)[r])
                    mine._tp_vocab = linear.out_features
        return layer

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x)[..., :self.true_out_features]


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
    if targets is not None and tp.loss_parallel:
        loss = vocab_parallel_cross_entropy(logits, targets, tp.group, vocab_size=tp.vocab_size,
                                            algorithm=tp.algorithm)
    elif targets is not None:  # a plan that leaves the head whole: the logits are whole
        loss = F.cross_entropy(logits.reshape(B * T, -1), targets.reshape(B * T))
    return logits, loss


_CLASSES: dict[type, type] = {}


def _tensor_parallel_class(cls: type) -> type:
    if cls not in _CLASSES:
        _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (cls,),
                             {"forward": _forward, "__module__": __name__, "__doc__": _forward.__doc__})
    return _CLASSES[cls]


# ==================================================================================== state
def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The unsharded parameters and buffers on every rank, keyed and shaped as in the single model.

    Sharded tensors are all-gathered (through :mod:`workbench.comm`), q/k/v chunks put back in
    order, the vocabulary padding cut off and ``Conv1D`` weights transposed back, for any planned
    model. A collective: call it on every rank of the group.
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
        if getattr(value, "_tp_transposed", False):  # GPT-2's Conv1D stores (in, out)
            full = full.t()
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
