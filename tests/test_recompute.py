"""Activation recomputation: ``recompute(model, policy)``.

Single process: every policy gives bit-identical gradients to no recomputation, with the fused
and the math attention kernels, and the activation bytes measured by ``MemoryMeter`` match the
formulas derived in ``workbench.parallel.recompute`` within 1.00-1.10. Under DDP (float32 and
bfloat16), ZeRO-1, ZeRO-2 and FSDP on gloo (world 2): training with recomputation ends with the
same weights, bit for bit, as without.
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import workbench
from workbench.measure.metrics import MemoryMeter
from workbench.models import GPT, GPTConfig
from workbench.parallel import MixedPrecision, recompute, zero
from workbench.parallel.recompute import activation_bytes

from sharded_common import ADAMW
from sharded_common import batches as _batches, local as _local

KERNELS = {"fused": SDPBackend.FLASH_ATTENTION, "math": SDPBackend.MATH}


@pytest.mark.parametrize("kernel", ["fused", "math"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_identical_gradients_and_activation_bytes_match_the_formulas(kernel, dtype):
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny", n_embd=128)
    base = GPT(config).to(dtype)
    batch = 4
    x, y = (torch.randint(0, 65, (batch, config.block_size)) for _ in range(2))
    reference = None
    for policy in ("none", "selective", "full"):
        model = recompute(copy.deepcopy(base), policy)
        with sdpa_kernel(KERNELS[kernel]):
            with MemoryMeter(model, x, y, device="cpu") as forward_only:
                logits, loss = model(x, y)
            kept = forward_only.current_by_category["activations"]
            del logits, loss
            with MemoryMeter(model, x, y, device="cpu") as step:
                logits, loss = model(x, y)
                loss.backward()
        grads = [p.grad for p in model.parameters()]
        if reference is None:
            reference = grads
        assert all(torch.equal(g, r) for g, r in zip(grads, reference)), policy
        formula = activation_bytes(config, batch, policy=policy, kernel=kernel, dtype=dtype)
        assert 1.0 <= kept / formula["kept"] <= 1.10, (policy, kept, formula)
        peak = step.peak_by_category["activations"]
        assert 1.0 <= peak / formula["peak"] <= 1.10, (policy, peak, formula)
    # the policies order as the formulas say: selective saves the scores only with the math kernel
    none, sel, full = (activation_bytes(config, batch, policy=p, kernel=kernel, dtype=dtype)["kept"]
                       for p in ("none", "selective", "full"))
    assert full < sel < none
    assert (none - sel) / none < 0.01 if kernel == "fused" else (none - sel) / none > 0.05


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recomputing_the_first_k_layers_keeps_what_the_formula_says(dtype):
    """``recompute(model, "full", layers=k)``: the first k of L layers keep only their input, the
    others everything; gradients identical to no recomputation, the kept activations and the peak
    as ``activation_bytes(..., layers=k)`` says, strictly between none and full."""
    torch.manual_seed(0)
    config = GPTConfig.preset("tiny", n_embd=128, n_layer=4)
    base = GPT(config).to(dtype)
    batch = 4
    x, y = (torch.randint(0, 65, (batch, config.block_size)) for _ in range(2))
    reference = None
    for layers in (None, 1, 3):
        model = recompute(copy.deepcopy(base), "full", layers=layers) if layers else copy.deepcopy(base)
        with MemoryMeter(model, x, y, device="cpu") as forward_only:
            logits, loss = model(x, y)
        kept = forward_only.current_by_category["activations"]
        del logits, loss
        with MemoryMeter(model, x, y, device="cpu") as step:
            logits, loss = model(x, y)      # the caller holds the logits through backward, as the formula says
            loss.backward()
        grads = [p.grad for p in model.parameters()]
        reference = reference or grads
        assert all(torch.equal(g, r) for g, r in zip(grads, reference)), layers
        if layers is None:
            continue
        assert [getattr(b, "_recompute_policy", "none") for b in model.blocks] == ["full"] * layers + \
            ["none"] * (4 - layers)
        formula = activation_bytes(config, batch, policy="full", dtype=dtype, layers=layers)
        assert 1.0 <= kept / formula["kept"] <= 1.10, (layers, kept, formula)
        # the step's busiest moment in all (gradients included) is the end of forward or the first
        # recomputation: with 3 of 4 layers recomputed, the recomputation (the gradients the last layer made
        # outweigh what it kept), with 1 of 4 the end of forward; its activations as that moment's formula says
        peak = step.peak_by_category["activations"]
        moment = formula["first_recompute"] if layers == 3 else formula["kept"]
        assert 1.0 <= peak / moment <= 1.06, (layers, peak, formula)
        none, full = (activation_bytes(config, batch, policy=p, dtype=dtype)["kept"] for p in ("none", "full"))
        assert full < formula["kept"] < none
        assert formula["kept"] == pytest.approx(full + (4 - layers) / 4 * (none - full))
    with pytest.raises(ValueError, match="layers=0"):
        recompute(GPT(config), "full", layers=0)
    with pytest.raises(ValueError, match="policy='selective'"):
        recompute(GPT(config), "selective", layers=2)
    with pytest.raises(ValueError, match="layers=2.*policy='none'"):
        activation_bytes(config, batch, policy="none", layers=2)


def _same_weights_with_and_without():
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny", n_layer=2))
    out = {}
    for name, stage, policy_mp in (("ddp", 0, None), ("ddp-bf16", 0, MixedPrecision()), ("zero1", 1, None),
                                   ("zero2", 2, None), ("fsdp", 3, None), ("fsdp-bf16", 3, MixedPrecision())):
        weights = {}
        for policy in ("none", "selective", "full"):
            module = copy.deepcopy(base)
            if stage != 3:
                recompute(module, policy)
            model, opt = zero(module, torch.optim.AdamW, stage, mp_policy=policy_mp, **ADAMW)
            if stage == 3:
                recompute(model, policy)   # after wrapping works too
            for x, y in _batches(3):
                model(_local(x), _local(y))[1].backward()
                opt.step()
                opt.zero_grad()
            weights[policy] = model.full_state_dict() if stage == 3 else \
                {k: v.detach().clone() for k, v in getattr(model, "module", model).state_dict().items()}
        out[name] = {p: max((weights[p][k] - weights["none"][k]).abs().max().item() for k in weights["none"])
                     for p in ("selective", "full")}
        out[name]["moved"] = max((weights["none"][k].float() - v.float()).abs().max().item()
                                 for k, v in base.state_dict().items())
    return out


def test_recompute_under_ddp_zero_and_fsdp_leaves_identical_weights():
    for out in workbench.launch(_same_weights_with_and_without, world_size=2, timeout=180):
        for name, r in out.items():
            assert r["selective"] == 0.0 and r["full"] == 0.0, (name, r)
            assert r["moved"] > 1e-4, (name, r)   # training did change the weights


def test_bad_policy_and_model_are_refused():
    with pytest.raises(ValueError, match="policy='partial'.*'full'"):
        recompute(GPT(GPTConfig.preset("tiny")), "partial")
    with pytest.raises(ValueError, match="no repeated layers"):
        recompute(torch.nn.Linear(2, 2), "full")
    model = recompute(recompute(GPT(GPTConfig.preset("tiny")), "full"), "none")
    assert all("forward" not in block.__dict__ for block in model.blocks)
