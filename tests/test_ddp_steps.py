"""The four steps from all-reduce-after-backward to overlapped buckets leave the same averaged
gradients as the full DistributedDataParallel, step after step, on gloo with 2 ranks."""
import copy

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench.models import MLP
from workbench.parallel import DistributedDataParallel
from workbench.parallel.ddp_steps import STEPS, Buckets, OverlappedBuckets


def _parity(algorithm: str) -> dict:
    rank = dist.get_rank()
    torch.manual_seed(rank)  # different weights per rank: the wrappers must broadcast rank 0's
    base = MLP(width=64, depth=4)
    reference = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.01, algorithm=algorithm)
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    steps = {cls.__name__: cls(copy.deepcopy(base), algorithm=algorithm, **(
        {"bucket_cap_mb": 0.01} if issubclass(cls, Buckets) else {})) for cls in STEPS}
    opts = {name: torch.optim.SGD(m.parameters(), lr=0.1) for name, m in steps.items()}
    errors = {name: 0.0 for name in steps}
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own data
    for _ in range(3):
        x = torch.randn(8, 64, generator=g)
        reference(x).square().mean().backward()
        for name, model in steps.items():
            model(x).square().mean().backward()
            model.finish_gradient_synchronization()
            for p, q in zip(model.parameters(), reference.parameters()):
                errors[name] = max(errors[name], (p.grad - q.grad).abs().max().item())
            opts[name].step()
            opts[name].zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    buckets = {name: len(m.buckets) for name, m in steps.items() if hasattr(m, "buckets")}
    return {"errors": errors, "buckets": buckets, "ddp_buckets": len(reference.buckets)}


@pytest.mark.parametrize("algorithm", ["native", "ring"])
def test_every_step_matches_distributed_data_parallel(algorithm):
    for out in workbench.launch(_parity, args=(algorithm,), world_size=2, timeout=120):
        assert set(out["errors"]) == {cls.__name__ for cls in STEPS}
        for name, err in out["errors"].items():
            assert err <= 1e-6, (name, err)
        assert out["buckets"]["Buckets"] == out["buckets"]["OverlappedBuckets"] == out["ddp_buckets"] > 2


def _unused() -> str:
    model = OverlappedBuckets(MLP(width=8, depth=2), bucket_cap_mb=0)
    model.module.layers[0](torch.randn(2, 8)).sum().backward()  # the last layer gets no gradient
    try:
        model.finish_gradient_synchronization()
    except RuntimeError as e:
        return str(e)
    return ""


def test_a_parameter_without_gradient_is_named():
    for message in workbench.launch(_unused, world_size=2, timeout=60):
        assert "never got all its gradients" in message and "layers." in message
