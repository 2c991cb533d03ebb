"""Activation recomputation: keep less of forward, recompute it in backward.

Backward needs tensors from forward (a linear layer's input for its weight gradient, softmax's
output for its own gradient); autograd keeps them from the forward of a layer until that layer's
backward, so at the start of backward every layer's activations are alive at once. Recomputation
(Chen et al. 2016, "checkpointing") keeps only some of them and runs the forward again, inside
backward, to get the others back. Two policies (Korthikanti et al. 2022)::

    recompute(model, policy="full")        each layer keeps only its input; backward re-runs
                                           the whole layer first (one extra forward)
    recompute(model, policy="selective")   each layer keeps everything except the attention
                                           core (scores, softmax, dropout, scores x V), which
                                           is large (a s^2 per sequence) but cheap to recompute
    recompute(model, "full", layers=k)     only the first k layers recomputed whole, the others
                                           keep everything: between the two, k / L of full's
                                           extra forward for k / L of its saving

Both use ``torch.utils.checkpoint`` (non-reentrant). ``full`` checkpoints each layer;
``selective`` checkpoints, inside each layer, every call of
``torch.nn.functional.scaled_dot_product_attention`` (found with a ``TorchFunctionMode`` while
the layer runs, so any model that calls it is covered, a Hugging Face one included): the call
keeps only its inputs q, k, v, which are views of the QKV projection that autograd keeps anyway.
(PyTorch's operator-level selective checkpointing, ``create_selective_checkpoint_contexts``, is
not used: a saved operator keeps its outputs whether or not backward needs them, views and sums
included, so it can keep more than no checkpointing at all.)

Memory: the derivation (float32, this repository's GPT)
--------------------------------------------------------
``s`` sequence length, ``b`` micro-batch, ``h`` width, ``a`` heads, ``L`` layers, ``V``
vocabulary, 4 bytes per element. What autograd keeps of one pre-norm block
``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))`` (no dropout, so no masks), counting each
storage once:

===============================  ===============================================  ============
operator                         tensors it keeps                                 elements
===============================  ===============================================  ============
ln_1                             its input x; mean and rstd                       sbh + 2sb
c_attn (h -> 3h)                 its input ln_1(x)                                sbh
attention core, fused kernel     q, k, v (views of c_attn's output)               3sbh
                                 its output (a view of it is c_proj's input)      sbh
                                 log-sum-exp                                      asb
c_proj (h -> h)                  its input: the fused output, no new storage      0
ln_2                             its input (the residual sum); mean and rstd      sbh + 2sb
c_fc (h -> 4h)                   its input                                        sbh
GELU                             its input (c_fc's output)                        4sbh
mlp.c_proj (4h -> h)             its input (GELU's output)                        4sbh
===============================  ===============================================  ============

per layer, fused kernel: ``16 sbh + 4 sb + a s b`` elements, ``sbh (64 + 16/h + 4a/h)`` bytes.
(The paper's half-precision ``34 sbh`` is the same table in 2 bytes, plus dropout masks.)

The *math* kernel computes ``softmax(q k^T * scale + causal mask) v`` in separate operators:
it keeps ``q * scale`` (``sbh``, a new tensor) and the softmax output (``a s^2 b``, used by
softmax's backward and by the second matmul), has no log-sum-exp, and its output's head-merge
is a copy that c_proj keeps (``sbh``) in place of the fused output: ``16 sbh + 4 sb + a s^2 b``
elements per layer, the ``a s^2 b`` term being the paper's ``5 a s / h`` (softmax output,
dropout mask and dropout output in half precision).

* ``selective``: the attention call keeps only q, k, v. Fused: the log-sum-exp goes (the output
  stays, c_proj keeps it); math: ``q * scale`` and the scores go, the head-merge copy stays.
  Both: ``16 sbh + 4 sb`` per layer. With the fused kernel on the CPU this saves almost
  nothing (``asb``); with the math kernel it saves the ``a s^2 b`` term.
* ``full``: each layer keeps its input, ``sbh`` (the paper's ``2 sbh`` in half precision).
* ``full`` on the first ``k`` layers only (Megatron-LM's ``--recompute-method block
  --recompute-num-layers k``, per pipeline stage; torchtitan checkpoints every n-th layer and
  fms-fsdp a fraction of them, the same count spread out): those keep their input, the other
  ``L - k`` everything, ``k sbh + (L - k) layer(none)`` per micro-batch. Backward meets the
  layers that kept everything first, and frees their tensors before it recomputes the first
  checkpointed one; then the gradient flowing in and the one the layer above left on the residual
  stream are both alive (two gradients, as with ``selective``).

Around the layers: ``ln_f`` keeps its input and statistics (``sbh + 2 sb``), the head its
input (``sbh``), the loss the log-softmax (``s b V``), and the caller holds the logits
(``s b V``). So what forward leaves for backward (``kept``)::

    kept = L * layer + 2 sbh + 2 sb + 2 sbV          (layer: the per-layer term of the policy)

The *peak* over forward and backward: without recomputation the kept activations plus
backward's transient gradients (a few percent; measured, not modelled). With ``full``, the
first recomputation in backward: every layer's input, one layer's full working set (the
``none`` term), the gradient flowing into it (``sbh``) and the logits. With ``selective``, the
last layer's attention recomputed (its core, ``core = layer(none) - layer(selective) + sbh``)
beside every layer's kept tensors, two gradients (``2 sbh``) and the logits, the head's own
tensors being freed by then::

    peak(none)      = kept
    peak(full)      = L sbh + layer(none) + sbh + sbV
    peak(full, k)   = max(kept, k sbh + layer(none) + 2 sbh + sbV)    (k < L)
    peak(selective) = max(kept, L layer(selective) + core + 2 sbh + sbV)

In 16 bits (mixed precision) every term halves except the attention kernels' float32 parts:
the fused kernel's log-sum-exp, and the math kernel, which by default computes bfloat16 and
float16 attention in float32, so its copies of q, k, v and its softmax stay 4 bytes: the
math layer is ``2 (13 sbh + 4 sb) + 4 (3 sbh + a s^2 b)`` bytes.

:func:`activation_bytes` evaluates these; ``tests/test_recompute.py`` and
``workbench bench recompute`` compare them with :class:`~workbench.measure.metrics.MemoryMeter`.

Cost: ``full`` runs every block's forward twice (about 4/3 of the step's compute, the paper's
33%); ``full`` on ``k`` of ``L`` layers ``k / L`` of that; ``selective`` re-runs only the attention
core (a few percent).
"""
from __future__ import annotations

import contextlib
from functools import partial

import torch
from torch import nn
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils.checkpoint import checkpoint

__all__ = ["recompute", "find_layers", "activation_bytes", "POLICIES"]

POLICIES = ("none", "selective", "full")



def find_layers(model: nn.Module) -> list[nn.Module]:
    """The repeated layers of ``model``: the children of ``model.blocks`` or ``model.layers`` (a
    list, a ``Sequential``, or the ``nn.ModuleDict`` a pipeline stage keeps its blocks in, under
    their indices in the whole model), else of the first ``nn.ModuleList`` whose children all have
    one class (``transformer.h`` of a Hugging Face GPT-2, ``model.layers`` of a Llama). A
    wrapper's ``.module`` is looked into."""
    for attr in ("blocks", "layers"):
        container = getattr(model, attr, None)
        if isinstance(container, (nn.ModuleList, nn.Sequential)) and len(container):
            return list(container)
        if isinstance(container, nn.ModuleDict) and len(container):
            return list(container.values())
    for _, sub in model.named_modules():
        if isinstance(sub, nn.ModuleList) and len(sub) and len({type(c) for c in sub}) == 1:
            return list(sub)
    inner = getattr(model, "module", None)
    if isinstance(inner, nn.Module) and inner is not model:
        return find_layers(inner)
    return []


class _CheckpointAttention(TorchFunctionMode):
    """While a layer runs: every ``F.scaled_dot_product_attention`` call goes through a
    non-reentrant checkpoint, so its internals (scores, softmax, log-sum-exp, output) are not
    kept but recomputed in backward from q, k, v."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention and torch.is_grad_enabled():
            return checkpoint(func, *args, use_reentrant=False, **kwargs)
        return func(*args, **kwargs)


class _RerunHooks:
    """Run ``layer``'s forward pre-hooks on entering and forward hooks on leaving, for the hooks
    that ask for it (``hook.rerun_on_recompute = True``): a sharded strategy's hooks that gather
    the layer's parameters before its forward and free them after, needed again when backward
    recomputes the forward."""

    def __init__(self, layer: nn.Module):
        self.layer = layer

    def __enter__(self):
        for hook in list(self.layer._forward_pre_hooks.values()):
            if getattr(hook, "rerun_on_recompute", False):
                hook(self.layer, ())
        return self

    def __exit__(self, *exc):
        for hook in list(self.layer._forward_hooks.values()):
            if getattr(hook, "rerun_on_recompute", False):
                hook(self.layer, (), None)
        return False


def _contexts(layer: nn.Module):
    return contextlib.nullcontext(), _RerunHooks(layer)


def recompute(model: nn.Module, policy: str = "full", layers: int | None = None) -> nn.Module:
    """Checkpoint every repeated layer of ``model`` (see :func:`find_layers`) with ``policy``:
    ``"full"`` (keep each layer's input, recompute the layer in backward), ``"selective"``
    (recompute only the attention core) or ``"none"`` (undo). In place; returns ``model``.
    ``layers``: with ``"full"``, checkpoint only the first ``layers`` of them (a pipeline stage's
    own, when ``model`` is a stage), the others not recomputed; more than there are: all. None:
    all.

    Apply it to the bare model or to a wrapped one (DDP, FSDP, ZeRO) before or after
    wrapping: it replaces each layer's ``forward`` on the instance, so parameter names, state
    dicts and the strategies' hooks are unchanged. Gradients are identical to training without
    it (recomputation repeats the same operators on the same values).
    """
    if policy not in POLICIES:
        raise ValueError(f"recompute(policy={policy!r}): use 'full' (recompute each layer), 'selective' "
                         "(recompute the attention core only) or 'none'")
    if not isinstance(model, nn.Module):
        raise TypeError(f"recompute(model={model!r}): pass an nn.Module")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1
                               or policy != "full"):
        raise ValueError(f"recompute(layers={layers!r}): the number of layers to recompute whole, a whole number "
                         f">= 1, with policy='full' (got policy={policy!r}); None recomputes every layer")
    found = find_layers(model)
    if not found:
        raise ValueError(f"recompute: found no repeated layers in {type(model).__name__}: the model needs "
                         "model.blocks / model.layers, or an nn.ModuleList of layers of one class")
    for k, layer in enumerate(found):
        original = layer.__dict__.pop("_recompute_original_forward", None)
        if original is not None:
            layer.forward = original
            if "forward" in layer.__dict__ and layer.__dict__["forward"] is original and \
                    getattr(original, "__self__", None) is layer:
                del layer.__dict__["forward"]    # back to the class's forward
        if policy == "none" or (layers is not None and k >= layers):
            continue
        forward = layer.forward
        layer._recompute_original_forward = forward

        def checkpointed(*args, _forward=forward, _layer=layer, **kwargs):
            if not torch.is_grad_enabled():
                return _forward(*args, **kwargs)
            return checkpoint(_forward, *args, use_reentrant=False, context_fn=partial(_contexts, _layer), **kwargs)

        def attention_checkpointed(*args, _forward=forward, **kwargs):
            with _CheckpointAttention():
                return _forward(*args, **kwargs)

        layer.forward = checkpointed if policy == "full" else attention_checkpointed
        layer._recompute_policy = policy
    return model


def activation_bytes(config, batch: int, seq: int | None = None, policy: str = "none",
                     kernel: str = "fused", dtype: torch.dtype = torch.float32,
                     layers: int | None = None) -> dict[str, int]:
    """The derived activation bytes of :class:`~workbench.models.GPT` (module docstring):
    ``{"per_layer", "kept", "peak", "first_recompute"}`` for ``policy``, attention ``kernel`` ("fused" or "math")
    and compute ``dtype`` (float32, or bfloat16/float16 under mixed precision), ``batch``
    sequences of ``seq`` tokens (default ``config.block_size``), with the logits held by the
    caller. ``kept``: what forward leaves for backward; ``peak``: ``kept``, or with ``full``
    the first recomputation (every layer's input plus one layer's working set). ``layers``: with
    ``full``, the first ``layers`` layers recomputed, the others keeping everything; ``peak`` is
    then the larger of ``kept`` and ``first_recompute`` (the activations at the first
    recomputation), and a step's busiest moment in all is the one of the two with more memory,
    gradients included: the recomputation, where the layers above have made theirs, when they
    outweigh what those layers kept.

    In 16 bits every term halves except the attention kernels' float32 parts: the fused
    kernel's log-sum-exp, and the math kernel, which computes half-precision attention in
    float32 (PyTorch's default), so that its q, k, v copies and its softmax stay 4 bytes.
    """
    if kernel not in ("fused", "math"):
        raise ValueError(f"activation_bytes(kernel={kernel!r}): use 'fused' or 'math'")
    if policy not in POLICIES:
        raise ValueError(f"activation_bytes(policy={policy!r}): use one of {POLICIES}")
    if layers is not None and (isinstance(layers, bool) or not isinstance(layers, int) or layers < 1
                               or policy != "full"):
        raise ValueError(f"activation_bytes(layers={layers!r}): layers recomputed whole, a whole number >= 1, with "
                         f"policy='full' (got policy={policy!r}); None: every layer")
    s, b, h, a = seq or config.block_size, batch, config.n_embd, config.n_head
    L, V = config.n_layer, config.vocab_size
    sbh, sb = s * b * h, s * b
    e = torch.empty((), dtype=dtype).element_size()
    if kernel == "fused":
        full_layer = e * (16 * sbh + 4 * sb) + 4 * a * sb
    else:   # float32 q, k, v and softmax; 13 sbh in the compute dtype (the other rows of the table)
        full_layer = e * (13 * sbh + 4 * sb) + 4 * (3 * sbh + a * s * s * b)
    layer = {"none": full_layer, "selective": e * (16 * sbh + 4 * sb), "full": e * sbh}[policy]
    k = L if layers is None else min(layers, L)     # layers recomputed whole (full)
    kept = k * layer + (L - k) * full_layer + e * (2 * sbh + 2 * sb + 2 * sb * V)
    first = kept            # activations at the first recomputation (full): its working set beside the inputs
    if policy == "full" and k == L:   # every layer's input, one working set, a gradient
        peak = first = L * e * sbh + full_layer + e * (sbh + sb * V)
    elif policy == "full":   # after the layers that kept everything: two gradients (as with selective)
        first = k * e * sbh + full_layer + e * (2 * sbh + sb * V)
        peak = max(kept, first)
    elif policy == "selective":   # the last layer's attention recomputed, the head's tensors freed
        core = full_layer - layer + e * sbh
        peak = max(kept, L * layer + core + e * (2 * sbh + sb * V))
    else:
        peak = kept
    return {"per_layer": layer, "kept": kept, "peak": peak, "first_recompute": first}
