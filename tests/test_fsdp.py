"""ZeRO-3: ``FullyShardedDataParallel`` on gloo with 2 and 3 ranks.

Parity against one process training on the global batch (AdamW and SGD, gradients too),
against PyTorch's FSDP2 ``fully_shard`` (same units), and, with ``mp_policy``, against one
process that casts its weights the same way. Also: the optimizer sees exactly the local flat
shards (padded when the world size does not divide a unit), nothing stays gathered after a step,
``full_state_dict()`` is keyed like the original module, and bad input is refused clearly.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import workbench
from workbench.models import GPT, GPTConfig, MLP
from workbench.parallel import FullyShardedDataParallel, MixedPrecision

from sharded_common import ADAMW, GLOBAL_BATCH
from sharded_common import batches as _batches, local as _local, max_diff as _max_diff


def _flat_chunk(unit, tensors: list[torch.Tensor]) -> torch.Tensor:
    """This rank's chunk of ``tensors`` laid out as ``unit`` flattens its parameters."""
    flat = torch.zeros(unit.padded_numel, dtype=tensors[0].dtype)
    torch.cat([t.reshape(-1) for t in tensors], out=flat[:unit.numel])
    return flat.chunk(workbench.world_size())[workbench.rank()]


def _parity_with_single_process():
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny"))
    names = [n for n, _ in base.named_parameters()]
    out = {}
    for opt_name, opt_cls, kwargs, steps in (("adamw", torch.optim.AdamW, ADAMW, 5),
                                             ("sgd", torch.optim.SGD, dict(lr=0.5), 2)):
        ref = copy.deepcopy(base)
        ref_opt = opt_cls(ref.parameters(), **kwargs)
        model = FullyShardedDataParallel(copy.deepcopy(base))
        model.events = []
        opt = opt_cls(model.parameters(), **kwargs)
        for step, (x, y) in enumerate(_batches(steps)):
            model(_local(x), _local(y))[1].backward()
            ref(x, y)[1].backward()
            if step == 0:
                # Gradients: each shard's .grad is the chunk of the global-batch gradient.
                ref_grads = dict(zip(names, (p.grad for p in ref.parameters())))
                grad_err = 0.0
                for unit in model.units:
                    expected = _flat_chunk(unit, [ref_grads[uses[0][2]] for uses in unit.uses])
                    grad_err = max(grad_err, (unit.shard.grad - expected).abs().max().item())
                out[(opt_name, "grads")] = grad_err
                before = [p.grad.clone() for p in model.parameters()]
                model.finish_gradient_synchronization()   # already done by backward: a no-op
                out[(opt_name, "idempotent")] = all(torch.equal(a, p.grad) for a, p in zip(before, model.parameters()))
                out[(opt_name, "freed")] = all(u.full is None for u in model.units) and \
                    model.module.blocks[0].attn.c_attn.weight is None
            opt.step()
            opt.zero_grad()
            ref_opt.step()
            ref_opt.zero_grad()
        # The comm events are when the communication thread ran each collective: after its issue,
        # and one at a time (one thread), so a rank's comm bars never overlap.
        comm_events = sorted((e for e in model.events if e["lane"] == "comm"), key=lambda e: e["start"])
        out[(opt_name, "comm events")] = len(comm_events) == 15 * steps and all(
            e["issued"] <= e["start"] <= e["end"] for e in comm_events) and all(
            a["end"] <= b["start"] for a, b in zip(comm_events, comm_events[1:]))
        full = model.full_state_dict()
        out[(opt_name, "params")] = _max_diff(full, {k: v.detach() for k, v in ref.state_dict().items()})
    # What the optimizer sees: one float32 shard per unit (root + 4 blocks), ceil(n_unit / N) long.
    n = workbench.world_size()
    out["shards"] = [(p.dtype, p.numel()) for p in model.parameters()]
    out["expected_shards"] = [(torch.float32, -(-u.numel // n)) for u in model.units]
    out["units"] = [u.name for u in model.units]
    out["padded"] = any(u.padded_numel != u.numel for u in model.units)
    out["psi"] = base.num_parameters()
    out["tied_key"] = torch.equal(full["wte.weight"], full["lm_head.weight"])
    return out


@pytest.mark.parametrize("world_size", [2, 3])
def test_matches_single_process_training(world_size):
    for out in workbench.launch(_parity_with_single_process, world_size=world_size):
        for opt_name in ("adamw", "sgd"):
            assert out[(opt_name, "grads")] <= 1e-7
            assert out[(opt_name, "params")] <= 1e-6, (opt_name, out[(opt_name, "params")])
            assert out[(opt_name, "idempotent")] and out[(opt_name, "freed")] and out[(opt_name, "comm events")]
        assert out["shards"] == out["expected_shards"]
        assert out["units"] == ["root", "blocks.0", "blocks.1", "blocks.2", "blocks.3"]
        assert out["psi"] / world_size <= sum(numel for _, numel in out["shards"]) < out["psi"] / world_size + 5
        assert out["tied_key"]
        if world_size == 3:
            assert out["padded"], "world size 3 must exercise the padding of uneven units"


def _parity_with_fully_shard():
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny"))
    theirs = copy.deepcopy(base)
    for block in theirs.blocks:
        fully_shard(block)
    fully_shard(theirs)
    ours = FullyShardedDataParallel(copy.deepcopy(base))
    their_opt = torch.optim.AdamW(theirs.parameters(), **ADAMW)
    our_opt = torch.optim.AdamW(ours.parameters(), **ADAMW)
    for x, y in _batches(5):
        for model, opt in ((theirs, their_opt), (ours, our_opt)):
            model(_local(x), _local(y))[1].backward()
            opt.step()
            opt.zero_grad()
    their_full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
    return _max_diff(ours.full_state_dict(), their_full)


def test_matches_torch_fully_shard():
    assert max(workbench.launch(_parity_with_fully_shard, world_size=2)) <= 1e-6


def _parity_with_casting_reference(dtype):
    """One process keeps float32 master weights, casts them to ``dtype`` for each rank's slice
    of the batch, adds the per-rank gradients in ``dtype`` (as the reduce-scatter does), divides
    in float32 and steps the masters; FSDP with ``MixedPrecision(param_dtype=dtype)`` must do the same."""
    torch.manual_seed(0)
    master = GPT(GPTConfig.preset("tiny"))
    model = FullyShardedDataParallel(copy.deepcopy(master), mp_policy=MixedPrecision(param_dtype=dtype))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    ref_opt = torch.optim.AdamW(master.parameters(), **ADAMW)
    n = workbench.world_size()
    losses = []
    for x, y in _batches(3):
        _, loss = model(_local(x), _local(y))
        losses.append(loss.dtype)
        loss.backward()
        opt.step()
        opt.zero_grad()
        low = copy.deepcopy(master).to(dtype)
        total = None
        b = GLOBAL_BATCH // n
        for r in range(n):
            low.zero_grad()
            low(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1].backward()
            grads = [p.grad.clone() for p in low.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(master.parameters(), total):
            p.grad = g.float() / n
        ref_opt.step()
        ref_opt.zero_grad()
    return {"err": _max_diff(model.full_state_dict(), {k: v.detach() for k, v in master.state_dict().items()}),
            "shard_dtypes": {p.dtype for p in model.parameters()},
            "state_dtypes": {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"},
            "loss_dtypes": set(losses)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_mixed_precision_matches_a_model_cast_the_same_way(dtype):
    for out in workbench.launch(_parity_with_casting_reference, args=(dtype,), world_size=2):
        assert out["err"] <= 1e-6
        assert out["shard_dtypes"] == {torch.float32} and out["state_dtypes"] == {torch.float32}
        assert out["loss_dtypes"] == {dtype}


class _SharedAcrossUnits(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.layers[1].weight = self.layers[0].weight


def _errors_and_other_models():
    out = {}
    for key, make in (("dtype", lambda: FullyShardedDataParallel(nn.Linear(2, 2), compute_dtype=torch.int64)),
                      ("dtype_str", lambda: FullyShardedDataParallel(nn.Linear(2, 2), compute_dtype="bfloat16")),
                      ("shared", lambda: FullyShardedDataParallel(_SharedAcrossUnits())),
                      ("module", lambda: FullyShardedDataParallel(lambda x: x))):
        try:
            make()
            out[key] = None
        except (ValueError, TypeError) as e:
            out[key] = f"{type(e).__name__}: {e}"
    # An MLP (units: its layers) with an uneven width trains like the unsharded one.
    torch.manual_seed(0)
    ref = MLP(width=9, depth=3, in_features=5, out_features=3)
    model = FullyShardedDataParallel(copy.deepcopy(ref))
    x = torch.randn(4, 5)
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        inp = x if m is ref else _local(x)
        m(inp).pow(2).mean().backward()
        opt.step()
    with torch.no_grad():   # forward without autograd (evaluation) gathers and frees too
        y_ref, y = ref(x), model(x)
    out["mlp"] = _max_diff(model.full_state_dict(), ref.state_dict())
    out["mlp_eval"] = (y - y_ref).abs().max().item()
    out["mlp_units"] = len(model.units)
    # a gradient hook registered on a parameter before wrapping runs on its slice of the unit's gradient
    torch.manual_seed(1)
    ref = MLP(width=9, depth=3, in_features=5, out_features=3)
    hooked = copy.deepcopy(ref)
    for m in (ref, hooked):
        m.layers[2].weight.register_hook(lambda g: 3 * g)
    model = FullyShardedDataParallel(hooked)
    for m in (ref, model):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        m(x if m is ref else _local(x)).pow(2).mean().backward()
        opt.step()
    out["hooked"] = _max_diff(model.full_state_dict(), ref.state_dict())
    out["hook_counts"] = sum(len(h) for u in model.units for _, h in u.grad_hooks)
    return out


def test_bad_input_is_refused_and_other_models_shard():
    out = workbench.launch(_errors_and_other_models, world_size=2)[0]
    assert out["dtype"].startswith("ValueError") and "torch.int64" in out["dtype"] and "bfloat16" in out["dtype"]
    assert out["dtype_str"].startswith("ValueError") and "'bfloat16'" in out["dtype_str"]
    assert out["shared"].startswith("ValueError") and "layers.1.weight" in out["shared"] and "Untie" in out["shared"]
    assert out["module"].startswith("TypeError")
    assert out["mlp"] <= 1e-6 and out["mlp_eval"] <= 1e-6
    assert out["mlp_units"] == 3
    assert out["hooked"] <= 1e-6 and out["hook_counts"] == 1


def test_a_pipeline_stage_is_cut_into_its_blocks():
    """A pipeline stage keeps its blocks in a dict under their model indices: each is a unit of its
    own (gathered one at a time, as without a pipeline), the embeddings or the head the root."""
    from workbench.parallel.fsdp import find_units
    from workbench.parallel.pipeline import partition

    stages = partition(GPT(GPTConfig.preset("tiny")), 3)
    assert [[name for name, _ in find_units(st)] for st in stages] == [
        ["blocks.0", "blocks.1"], ["blocks.2"], ["blocks.3"]]
    assert all(sub is st.blocks[name.split(".")[1]] for st in stages for name, sub in find_units(st))
