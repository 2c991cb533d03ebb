"""Our tensor parallelism against PyTorch's DTensor, and against data parallelism.

``workbench bench tensor`` trains the GPT ``small`` preset (4 layers, C=256, T=128) with t=2
ranks in one launch and times whole training steps (forward, backward, AdamW step, zero_grad):

================  ==============================================================================
candidate         what it is
================  ==============================================================================
dtensor           PyTorch: ``parallelize_module`` with ``ColwiseParallel``/``RowwiseParallel``
                  (:func:`torch_tensor_parallel`), logits gathered, plain cross-entropy
dtensor-sp        the same plus ``SequenceParallel`` norms and ``loss_parallel``
ours              ``workbench.parallel.tensor_parallel`` (``algorithm="native"``)
ours-sp           ``tensor_parallel(..., sequence_parallel=True)``
ours-ring         ours with the hand-written ring collectives (``algorithm="ring"``)
ours-sp-ring      sequence parallel with the ring collectives
ddp               data parallelism at the same world size: torch DDP, each rank half the batch
================  ==============================================================================

Every candidate sees the same global batch: the tensor-parallel ones the whole batch on every
rank, ``ddp`` its half. The report gives the median step time over interleaved trials, the ratio
to DTensor measured in the same run (``ours`` / ``dtensor``, ``ours-sp`` / ``dtensor-sp``), the
tokens per second, and the model-state bytes per rank (parameters, gradients, AdamW moments);
``ours`` and ``dtensor`` must give the same loss (checked outside the timed loop).

Why ours can be faster on a CPU: DTensor routes every operator on a distributed tensor through
its sharding propagation (Python, per operator, per step); ours runs plain local tensors and
names each collective in the code, so its overhead is a few autograd functions per layer.
"""
from __future__ import annotations

import argparse
import copy
import time

import torch
from torch import nn

from workbench.bench import _common

CANDIDATES = ("dtensor", "ours", "dtensor-sp", "ours-sp", "ours-ring", "ours-sp-ring", "ddp")
PAIRS = {"ours": "dtensor", "ours-sp": "dtensor-sp", "ours-ring": "dtensor", "ours-sp-ring": "dtensor-sp",
         "ddp": "dtensor"}
TARGET_RATIO = 1.10


# ------------------------------------------------------------------------------ PyTorch's TP
def torch_tensor_parallel(model: nn.Module, *, sequence_parallel: bool = False, mesh=None) -> nn.Module:
    """PyTorch's tensor parallelism on a copy of workbench's GPT: the reference ours is checked against.

    ``parallelize_module`` with ``ColwiseParallel`` for ``c_attn``/``c_fc`` and ``RowwiseParallel``
    for the ``c_proj`` layers and the token embedding; with ``sequence_parallel`` the norms are
    ``SequenceParallel``, the blocks all-gather their input (``PrepareModuleInput``), the
    row-parallel layers reduce-scatter (``output_layouts=Shard(1)``), the position embedding is
    split by sequence, and the head leaves vocabulary-sharded logits for ``loss_parallel``. Run
    forward and backward inside ``torch.distributed.tensor.parallel.loss_parallel()``.

    Two things are not DTensor's to decide and are prepared here: ``c_attn`` is one fused
    ``[q | k | v]`` matrix, which ``ColwiseParallel`` would cut into contiguous row blocks (rank 0
    would get q and half of k), so its rows are reordered rank-major ``[q_0 k_0 v_0 | q_1 k_1 v_1]``
    first; and the attention must run on ``n_head/t`` local heads, so each attention module is
    replaced by our :class:`~workbench.parallel.tensor.ParallelSelfAttention`, local arithmetic
    only (DTensor does every message). A tied head is re-tied after parallelising.
    """
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel, parallelize_module)

    from workbench import runtime
    from workbench.parallel.tensor import ParallelSelfAttention

    t = dist.get_world_size()
    if mesh is None:
        mesh = init_device_mesh(runtime.device().type, (t,))
    tied = model.lm_head.weight is model.wte.weight
    for block in model.blocks:
        a = block.attn
        with torch.no_grad():
            for p in (a.c_attn.weight, a.c_attn.bias):
                if p is not None:
                    q, k, v = p.chunk(3, 0)
                    p.copy_(torch.cat([torch.cat([u.chunk(t, 0)[r] for u in (q, k, v)]) for r in range(t)]))
        block.attn = ParallelSelfAttention(a.c_attn, a.c_proj, a.n_head, t, a.dropout, a.resid_dropout)
    sp = sequence_parallel
    residual = Shard(1) if sp else Replicate()
    plan = {"wte": RowwiseParallel(input_layouts=Replicate(), output_layouts=residual)}
    if sp:
        plan["wpe"] = PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(0))
        plan["ln_f"] = SequenceParallel()
        plan["lm_head"] = ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    else:
        plan["lm_head"] = ColwiseParallel(output_layouts=Replicate())
    for i in range(len(model.blocks)):
        b = f"blocks.{i}."
        plan[b + "attn.c_attn"] = ColwiseParallel()
        plan[b + "attn.c_proj"] = RowwiseParallel(output_layouts=residual)
        plan[b + "mlp.c_fc"] = ColwiseParallel()
        plan[b + "mlp.c_proj"] = RowwiseParallel(output_layouts=residual)
        if sp:
            plan[b + "ln_1"] = SequenceParallel()
            plan[b + "ln_2"] = SequenceParallel()
            plan[b + "attn"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
            plan[b + "mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    parallelize_module(model, mesh, plan)
    if tied:
        model.lm_head.weight = model.wte.weight
    return model


def torch_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Forward of a :func:`torch_tensor_parallel` model inside ``loss_parallel`` (a plain tensor)."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        _, loss = model(x, y)
    return loss


def torch_step(model: nn.Module, optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One training step of a DTensor model: forward and backward inside ``loss_parallel``."""
    from torch.distributed.tensor.parallel import loss_parallel

    with loss_parallel():
        _, loss = model(x, y)
        loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return _as_float(loss)


def _as_float(loss) -> float:
    return float(loss.full_tensor().item()) if hasattr(loss, "full_tensor") else float(loss.item())
