"""Gaps closed in DDP and FSDP, on gloo with 2 ranks, against PyTorch and a single process.

* DDP rebuilds its buckets after the first step in the order gradients became ready: the same
  buckets (parameter indices and bytes) as PyTorch's Reducer reports, and the same weights.
* ``find_unused_parameters=True`` on a model whose branch is unused on one step (on every rank)
  and used on another: the same gradients, ``None`` where PyTorch leaves ``None``, both with
  ``zero_grad(set_to_none=True)`` and ``False``; no rebuild (PyTorch does none either).
* FSDP with frozen parameters (a whole unit, and part of two others): parity with one process
  that freezes the same ones, frozen values unchanged, no gradient and no optimizer state.
"""
from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import workbench
from workbench.models import GPT, GPTConfig
from workbench.parallel import DistributedDataParallel, FullyShardedDataParallel, MixedPrecision

from sharded_common import ADAMW
from sharded_common import batches as _batches, local as _local, max_diff as _max_diff


class DefinedBackwards(nn.Module):
    """Layers defined in the reverse of the order forward calls them, then a head."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(64, 64) for _ in range(4))
        self.head = nn.Linear(64, 2)

    def forward(self, x):
        for layer in reversed(self.layers):
            x = torch.tanh(layer(x))
        return self.head(x)


def _rebuild_like_torch():
    rank = dist.get_rank()
    torch.manual_seed(0)
    base = DefinedBackwards()
    cap = 64 * 65 * 4 * 1.5 / 2 ** 20   # about one and a half layers per bucket
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=cap)
    theirs = TorchDDP(copy.deepcopy(base), bucket_cap_mb=cap)
    before = [[ours._slot[id(p)][2] for p in b.params] for b in ours.buckets]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ours, theirs)]
    for step in range(3):
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))[rank * 4:rank * 4 + 4]
        for m, opt in zip((ours, theirs), opts):
            m(x).pow(2).mean().backward()
            opt.step()
            opt.zero_grad()
    logged = theirs._get_ddp_logging_data()
    return {"before": before, "ours_indices": ", ".join(" ".join(map(str, b)) for b in
                                                        ours.rebuilt_per_bucket_param_indices),
            "torch_indices": logged.get("rebuilt_per_bucket_param_indices"),
            "ours_sizes": ", ".join(map(str, ours.rebuilt_bucket_sizes)),
            "torch_sizes": logged.get("rebuilt_bucket_sizes"),
            "weights": max((a - b).abs().max().item() for a, b in zip(ours.parameters(), theirs.parameters()))}


def test_ddp_rebuilds_buckets_in_gradient_ready_order_like_torch():
    for out in workbench.launch(_rebuild_like_torch, world_size=2):
        assert out["ours_indices"] == out["torch_indices"], out
        assert out["ours_sizes"] == out["torch_sizes"], out
        assert out["before"][0][0] == 9 and out["before"] != out["ours_indices"]   # reverse order first
        assert out["weights"] <= 1e-6


class SometimesBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(5, 5)
        self.branch = nn.Linear(5, 5)
        self.b = nn.Linear(5, 2)

    def forward(self, x, use_branch):
        h = torch.relu(self.a(x))
        if use_branch:
            h = h + self.branch(h)
        return self.b(h)


def _unused_on_one_step():
    rank, world = dist.get_rank(), dist.get_world_size()
    out = {}
    for set_to_none in (True, False):
        torch.manual_seed(0)
        base = SometimesBranch()
        ours = DistributedDataParallel(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0001)
        theirs = TorchDDP(copy.deepcopy(base), find_unused_parameters=True, bucket_cap_mb=0.0001)
        opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1) for m in (ours, theirs)]
        for step, use in enumerate((True, False, True, False)):
            x = torch.randn(2 * world, 5, generator=torch.Generator().manual_seed(step))[rank * 2:rank * 2 + 2]
            for m in (ours, theirs):
                m(x, use).pow(2).mean().backward()
            for (name, p), q in zip(ours.module.named_parameters(), theirs.module.parameters()):
                same = (p.grad is None) == (q.grad is None) and (p.grad is None or torch.equal(p.grad, q.grad))
                out[(set_to_none, step, name)] = (same, p.grad is None)
            for opt in opts:
                opt.step()
                opt.zero_grad(set_to_none=set_to_none)
        out[(set_to_none, "weights")] = max((a - b).abs().max().item()
                                            for a, b in zip(ours.parameters(), theirs.parameters()))
        out[(set_to_none, "rebuilt")] = ours.rebuilt_per_bucket_param_indices is not None
        out[(set_to_none, "torch rebuilt")] = theirs._get_ddp_logging_data().get("has_rebuilt_buckets", 0) == 1
    return out


def test_find_unused_parameters_matches_torch_on_a_branch_unused_on_one_step():
    for out in workbench.launch(_unused_on_one_step, world_size=2):
        for set_to_none in (True, False):
            for step in range(4):
                for name in ("a.weight", "branch.weight", "branch.bias", "b.bias"):
                    same, is_none = out[(set_to_none, step, name)]
                    assert same, (set_to_none, step, name)
            # the branch has no gradient on the steps it was unused (after set_to_none)
            assert out[(True, 1, "branch.weight")][1] and not out[(True, 2, "branch.weight")][1]
            assert not out[(False, 1, "branch.weight")][1]   # zeros kept, as PyTorch
            assert out[(set_to_none, "weights")] <= 1e-6
            assert out[(set_to_none, "rebuilt")] == out[(set_to_none, "torch rebuilt")] == False  # noqa: E712


def _freeze(model: GPT) -> GPT:
    model.wpe.weight.requires_grad_(False)            # part of the root unit
    for p in model.blocks[0].ln_1.parameters():       # part of block 0
        p.requires_grad_(False)
    for p in model.blocks[1].parameters():            # all of block 1
        p.requires_grad_(False)
    return model


def _fsdp_frozen(policy):
    torch.manual_seed(0)
    base = _freeze(GPT(GPTConfig.preset("tiny")))
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW(ref.parameters(), **ADAMW)
    model = FullyShardedDataParallel(copy.deepcopy(base), mp_policy=policy)
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    n = workbench.world_size()
    for x, y in _batches(4):
        model(_local(x), _local(y))[1].backward()
        opt.step()
        opt.zero_grad()
        if policy is None:
            ref(x, y)[1].backward()
        else:   # the same casts: per-rank slices on a bfloat16 copy, summed in bfloat16
            b = x.shape[0] // n
            total = None
            for r in range(n):
                low = copy.deepcopy(ref).to(policy.param_dtype)
                low(x[r * b:(r + 1) * b], y[r * b:(r + 1) * b])[1].backward()
                grads = [p.grad for p in low.parameters() if p.requires_grad]
                total = grads if total is None else [t + g for t, g in zip(total, grads)]
            for p, g in zip([p for p in ref.parameters() if p.requires_grad], total):
                p.grad = g.float() / n
        ref_opt.step()
        ref_opt.zero_grad()
    full = model.full_state_dict()
    frozen_names = [k for k, p in base.named_parameters() if not p.requires_grad]
    return {"err": _max_diff(full, {k: v.detach() for k, v in ref.state_dict().items()}),
            "frozen_unchanged": all(torch.equal(full[k], base.state_dict()[k]) for k in frozen_names),
            "frozen_shards_without_grad": all(p.grad is None for p in model.parameters() if not p.requires_grad),
            "state_entries": len(opt.state), "trainable_shards": sum(p.requires_grad for p in model.parameters()),
            "frozen_shards": sum(not p.requires_grad for p in model.parameters()),
            "gathered_after_step": [u.name for u in model.units + model._companions if u.full is not None]}


def test_fsdp_frozen_parameters_match_a_single_process_freezing_the_same():
    for policy in (None, MixedPrecision(param_dtype=torch.bfloat16)):
        for out in workbench.launch(_fsdp_frozen, args=(policy,), world_size=2):
            assert out["err"] <= 1e-6, (policy, out)
            assert out["frozen_unchanged"] and out["frozen_shards_without_grad"]
            # root and block 0 have a frozen companion, block 1 is frozen whole
            assert out["frozen_shards"] == 3 and out["state_entries"] == out["trainable_shards"] == 4
            assert out["gathered_after_step"] == []
