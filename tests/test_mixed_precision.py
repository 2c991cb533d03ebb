"""Mixed precision (``MixedPrecision`` as ``mp_policy=``) for DDP, ZeRO-1/2 and FSDP, on gloo, world 2.

Parity: each strategy in bfloat16 against one process that applies the same policy with the
same casts at the same places (float32 masters cast to a bfloat16 model per rank's slice of the
batch, the per-rank bfloat16 gradients summed in bfloat16, averaged, cast to float32, AdamW on
the masters), 5 steps, parameters within 1e-6. float16 with :class:`DynamicLossScaler` against
the same reference stepped by ``torch.amp.GradScaler``: the same steps skipped, same weights.
Figures: model-state bytes against the ZeRO paper's mixed-precision formulas, and bytes on the
wire exactly half of float32's.
"""
from __future__ import annotations

import copy

import pytest
import torch

import workbench
from workbench import comm
from workbench.measure.metrics import model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel import DynamicLossScaler, MixedPrecision, ShardedOptimizer, zero

from sharded_common import ADAMW, GLOBAL_BATCH
from sharded_common import batches as _batches, local as _local

STRATEGIES = ("ddp", "zero1", "zero2", "fsdp")
STAGE = {"ddp": 0, "zero1": 1, "zero2": 2, "fsdp": 3}


class _Reference:
    """One process: float32 masters, a ``dtype`` copy per rank slice, gradients summed in ``dtype``.

    ``prediv``: DDP multiplies each rank's gradient by 1/N before the sum (PyTorch's order); the
    sharded strategies sum, then divide. ``scaler``: a ``torch.amp.GradScaler`` (float16)."""

    def __init__(self, base, dtype, prediv, scaler=None):
        self.master, self.dtype, self.prediv, self.scaler = copy.deepcopy(base), dtype, prediv, scaler
        self.opt = torch.optim.AdamW(self.master.parameters(), **ADAMW)
        self.skipped = []

    def step(self, x, y, index):
        n = workbench.world_size()
        b = GLOBAL_BATCH // n
        total = None
        for r in range(n):
            low = copy.deepcopy(self.master).to(self.dtype)
            loss = low(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1]
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            grads = [p.grad * (1.0 / n) if self.prediv else p.grad for p in low.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(self.master.parameters(), total):
            p.grad = g.float() if self.prediv else g.float() / n
        if self.scaler is None:
            self.opt.step()
        else:
            before = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            if self.scaler.get_scale() < before:
                self.skipped.append(index)
        self.opt.zero_grad()


def _masters_error(name, model, opt, ref_master) -> float:
    """Largest difference between this rank's float32 master weights and the reference's."""
    ref = dict(ref_master.named_parameters())
    if name == "ddp":
        return max((p.detach() - ref[k].detach()).abs().max().item() for k, p in model.module.named_parameters())
    if name == "fsdp":
        full = model.full_state_dict()
        return max((full[k] - ref[k].detach()).abs().max().item() for k in ref)
    # ZeRO-1/2: each bucket's float32 chunk against the same chunk of the reference's flat layout
    by_id = {id(p): k for k, p in model.named_parameters()}
    err = 0.0
    for bucket in opt.buckets:
        flat = torch.zeros(bucket.padded_numel)
        for p, o, numel in zip(bucket.params, bucket.offsets, bucket.numels):
            flat[o:o + numel] = ref[by_id[id(p)]].detach().reshape(-1)
        chunk = flat.chunk(workbench.world_size())[workbench.rank()]
        err = max(err, (bucket.master.detach() - chunk).abs().max().item())
    return err


def _bf16_parity():
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny"))
    out = {}
    for name in STRATEGIES:
        ref = _Reference(base, torch.bfloat16, prediv=name == "ddp")
        model, opt = zero(copy.deepcopy(base), torch.optim.AdamW, STAGE[name],
                          mp_policy=MixedPrecision(param_dtype=torch.bfloat16), **ADAMW)
        for i, (x, y) in enumerate(_batches(5)):
            _, loss = model(_local(x), _local(y))
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref.step(x, y, i)
        out[name] = {"err": _masters_error(name, model, opt, ref.master), "loss": loss.dtype,
                     "state": {v.dtype for s in opt.state.values() for k, v in s.items() if k != "step"},
                     "opt_params": {p.dtype for g in opt.param_groups for p in g["params"]}}
        if name in ("zero1", "zero2"):   # the module's weights are the masters cast to bfloat16
            low = {k: v.detach().to(torch.bfloat16) for k, v in ref.master.named_parameters()}
            out[name]["module"] = max((p.detach().float() - low[k].float()).abs().max().item()
                                      for k, p in model.named_parameters())
            out[name]["module_dtype"] = {p.dtype for p in model.parameters()}
    return out


def test_bf16_every_strategy_matches_a_single_process_with_the_same_casts():
    for out in workbench.launch(_bf16_parity, world_size=2, timeout=180):
        for name in STRATEGIES:
            r = out[name]
            assert r["err"] <= 1e-6, (name, r["err"])
            assert r["loss"] == torch.bfloat16, name
            assert r["state"] == {torch.float32} and r["opt_params"] == {torch.float32}, (name, r)
        for name in ("zero1", "zero2"):
            assert out[name]["module"] <= 1e-6 and out[name]["module_dtype"] == {torch.bfloat16}


def _fp16_scaler_parity():
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny"))
    settings = dict(init_scale=2.0 ** 24, growth_factor=2.0, backoff_factor=2.0 ** -4, growth_interval=2)
    out = {}
    for name in STRATEGIES:
        ref = _Reference(base, torch.float16, prediv=name == "ddp", scaler=torch.amp.GradScaler("cpu", **settings))
        model, opt = zero(copy.deepcopy(base), torch.optim.AdamW, STAGE[name],
                          mp_policy=MixedPrecision(param_dtype=torch.float16), **ADAMW)
        scaler = DynamicLossScaler(**settings)
        for i, (x, y) in enumerate(_batches(6)):
            _, loss = model(_local(x), _local(y))
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            ref.step(x, y, i)
        out[name] = {"skipped": scaler.skipped, "ref_skipped": ref.skipped, "scale": scaler.get_scale(),
                     "ref_scale": ref.scaler.get_scale(), "err": _masters_error(name, model, opt, ref.master)}
    return out


def test_fp16_loss_scaler_skips_the_same_steps_as_the_single_process_reference():
    for out in workbench.launch(_fp16_scaler_parity, world_size=2, timeout=180):
        for name, r in out.items():
            assert r["skipped"] == r["ref_skipped"], (name, r)
            assert 0 < len(r["skipped"]) < 6, (name, r)   # some steps skipped, some taken
            assert r["scale"] == r["ref_scale"] and r["err"] <= 1e-6, (name, r)


# The ZeRO paper's mixed-precision model state: 2 (16-bit params) + 2 (16-bit grads) + 12 (K).
FORMULA = {0: lambda psi, n: 16 * psi, 1: lambda psi, n: 4 * psi + 12 * psi / n,
           2: lambda psi, n: 2 * psi + 14 * psi / n, 3: lambda psi, n: 16 * psi / n}


def _state_bytes_and_wire_bytes():
    n = workbench.world_size()
    out = {}
    x, y = torch.randint(0, 65, (n, 32)), torch.randint(0, 65, (n, 32))
    for stage in range(4):
        sent = {}
        for dtype in (torch.float32, torch.bfloat16):
            torch.manual_seed(0)
            module = GPT(GPTConfig.preset("tiny", n_embd=128))
            psi = module.num_parameters()
            policy = MixedPrecision(param_dtype=torch.bfloat16) if dtype == torch.bfloat16 else None
            model, opt = zero(module, torch.optim.AdamW, stage, mp_policy=policy, lr=1e-3)
            for _ in range(2):   # optimizer state created; DDP rebuilt its buckets (a broadcast)
                model(_local(x), _local(y))[1].backward()
                opt.step()
                opt.zero_grad()
            with comm.counters() as c:   # the third step
                model(_local(x), _local(y))[1].backward()
                opt.step()
            sent[dtype] = c.total_bytes_sent
            if dtype == torch.bfloat16:
                out[stage] = {"ratio": model_state_bytes(model, opt)["total"] / FORMULA[stage](psi, n)}
        out[stage]["wire"] = sent[torch.bfloat16] / sent[torch.float32]
    # reduce_dtype=float32 at ZeRO-2: the gradient chunk is 4 psi / N instead of 2 psi / N
    torch.manual_seed(0)
    module = GPT(GPTConfig.preset("tiny", n_embd=128))
    psi = module.num_parameters()
    model, opt = zero(module, torch.optim.AdamW, 2, lr=1e-3,
                      mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))
    for _ in range(2):
        model(_local(x), _local(y))[1].backward()
        opt.step()
    out["zero2_fp32_reduce"] = model_state_bytes(model, opt)["total"] / (2 * psi + 16 * psi / n)
    return out


def test_model_state_matches_the_mixed_precision_formulas_and_wire_bytes_halve():
    for out in workbench.launch(_state_bytes_and_wire_bytes, world_size=2, timeout=180):
        for stage in range(4):
            assert 1.0 <= out[stage]["ratio"] <= 1.05, (stage, out[stage])
            assert out[stage]["wire"] == 0.5, (stage, out[stage])
        assert 1.0 <= out["zero2_fp32_reduce"] <= 1.05, out["zero2_fp32_reduce"]


def _bad_input():
    model = GPT(GPTConfig.preset("tiny"))
    errors = {}
    for key, call in (("dtype", lambda: MixedPrecision(param_dtype=torch.int8)),
                      ("policy", lambda: zero(model, torch.optim.AdamW, 0, mp_policy=torch.bfloat16)),
                      ("lbfgs", lambda: ShardedOptimizer(model.parameters(), torch.optim.LBFGS)),
                      ("adafactor", lambda: ShardedOptimizer(model.parameters(), torch.optim.Adafactor)),
                      ("probe", lambda: ShardedOptimizer(model.parameters(), _PerTensorNormalised, lr=0.1)),
                      ("both", lambda: zero(model, torch.optim.AdamW, 3, compute_dtype=torch.bfloat16,
                                            mp_policy=MixedPrecision()))):
        try:
            call()
            errors[key] = None
        except (ValueError, TypeError) as e:
            errors[key] = f"{type(e).__name__}: {e}"
    with pytest.warns(DeprecationWarning, match="mp_policy"):
        zero(GPT(GPTConfig.preset("tiny")), torch.optim.AdamW, 3, compute_dtype=torch.bfloat16, lr=1e-3)
    ShardedOptimizer(GPT(GPTConfig.preset("tiny")).parameters(), torch.optim.RMSprop, lr=1e-3)  # element-wise
    return errors


class _PerTensorNormalised(torch.optim.Optimizer):
    """A per-tensor normalised step (LAMB-like): not element-wise, and not known by name."""

    def __init__(self, params, lr=0.1):
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad / (p.grad.norm() + 1e-12), alpha=-group["lr"])


def test_bad_input_names_the_value_and_the_fix():
    errors = workbench.launch(_bad_input, world_size=1)[0]
    assert errors["dtype"].startswith("ValueError") and "param_dtype=torch.int8" in errors["dtype"]
    assert errors["policy"].startswith("TypeError") and "MixedPrecision" in errors["policy"]
    assert errors["lbfgs"].startswith("ValueError") and "LBFGS" in errors["lbfgs"] and "line search" in errors["lbfgs"]
    assert errors["adafactor"].startswith("ValueError") and "factored" in errors["adafactor"]
    assert errors["probe"].startswith("ValueError") and "_PerTensorNormalised" in errors["probe"] \
        and "not element-wise" in errors["probe"]
    assert errors["both"].startswith("ValueError") and "not both" in errors["both"]


def _against_fully_shard_bf16():
    """Ours in bfloat16 against PyTorch's own mixed precision, FSDP2 with MixedPrecisionPolicy."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny"))
    theirs = copy.deepcopy(base)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
    for block in theirs.blocks:
        fully_shard(block, mp_policy=policy)
    fully_shard(theirs, mp_policy=policy)
    their_opt = torch.optim.AdamW(theirs.parameters(), **ADAMW)
    out = {}
    for stage in (0, 3):
        ours, our_opt = zero(copy.deepcopy(base), torch.optim.AdamW, stage,
                             mp_policy=MixedPrecision(param_dtype=torch.bfloat16), **ADAMW)
        pairs = ((ours, our_opt),) if stage else ((ours, our_opt), (theirs, their_opt))
        for x, y in _batches(5):
            for model, opt in pairs:
                model(_local(x), _local(y))[1].backward()
                opt.step()
                opt.zero_grad()
        if stage == 0:
            mine = {k: v.detach() for k, v in ours.module.state_dict().items()}
        else:
            mine = ours.full_state_dict()
        their_full = {k: v.full_tensor() for k, v in theirs.state_dict().items()}
        out[stage] = max((mine[k] - their_full[k]).abs().max().item() for k in their_full)
    return out


def test_bf16_ddp_and_fsdp_match_torch_fully_shard_with_mixed_precision():
    for out in workbench.launch(_against_fully_shard_bf16, world_size=2, timeout=180):
        assert out[3] <= 1e-6, out   # same casts, same order: FSDP2's own bf16 path
        assert out[0] <= 1e-6, out   # DDP pre-divides by N=2: exact in bfloat16, so the same sums


def test_compare_runs_in_bf16_with_recomputation():
    from workbench.apps import compare
    from workbench.apps.train import TrainConfig

    config = TrainConfig(model="tiny", steps=3, batch_size=4, precision="bf16", recompute="selective",
                         memory_step=None)
    rows = compare.run(config, ["torch-fsdp", "ddp", "zero2"], world_size=2, log=lambda *a: None)
    losses = [r["losses"] for r in rows]
    assert losses[1] == losses[0] and losses[2] == losses[0], losses   # ours == FSDP2, bit for bit
    with pytest.raises(ValueError, match="torch-ddp cannot train in mixed precision on cpu"):
        compare.run(config, ["torch-ddp"], world_size=2, log=lambda *a: None)
    with pytest.raises(ValueError, match="precision='fp16'"):
        TrainConfig(precision="fp16")


def _ddp_bf16_no_sync():
    """Two micro-batches per step, the first under no_sync: the bfloat16 gradients accumulate in
    the buckets (as autograd accumulates them in one process), one all-reduce per step."""
    torch.manual_seed(0)
    base = GPT(GPTConfig.preset("tiny", n_layer=2))
    model, opt = zero(copy.deepcopy(base), torch.optim.AdamW, 0, mp_policy=MixedPrecision(), **ADAMW)
    master = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(master.parameters(), **ADAMW)
    n, b = workbench.world_size(), GLOBAL_BATCH // workbench.world_size()
    calls = []
    for x, y in _batches(3):
        with comm.counters() as c:
            with model.no_sync():
                model(_local(x), _local(y))[1].backward()
            model(_local(y), _local(x))[1].backward()
        calls.append(c.stats[("all_reduce", "native")].calls)
        opt.step()
        opt.zero_grad()
        total = None
        for r in range(n):
            low = copy.deepcopy(master).to(torch.bfloat16)
            sl = slice(r * b, (r + 1) * b)
            low(x[sl], y[sl])[1].backward()
            low(y[sl], x[sl])[1].backward()
            grads = [p.grad * (1.0 / n) for p in low.parameters()]
            total = grads if total is None else [t + g for t, g in zip(total, grads)]
        for p, g in zip(master.parameters(), total):
            p.grad = g.float()
        ref_opt.step()
        ref_opt.zero_grad()
    err = max((p.detach() - q.detach()).abs().max().item()
              for p, q in zip(model.module.parameters(), master.parameters()))
    return {"err": err, "calls": calls, "buckets": len(model.buckets)}


def test_ddp_bf16_accumulates_under_no_sync_like_one_process():
    for out in workbench.launch(_ddp_bf16_no_sync, world_size=2, timeout=120):
        assert out["err"] <= 1e-6, out
        assert out["calls"][-1] == out["buckets"], out   # one all-reduce per bucket per step
