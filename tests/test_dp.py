"""DataParallel (threads in one process): gradients equal the plain module's on the whole batch.

No process group is needed: on a CPU-only machine ``device_ids=["cpu"] * n`` gives n replicas
that really run in n threads, so the scatter / replicate / parallel_apply / gather path and its
backward (replicate's reduce-add onto the original parameters) are all exercised.
"""
import copy

import pytest
import torch
from torch import nn

from workbench.models import GPT, MLP, GPTConfig
from workbench.parallel import DataParallel
from workbench.parallel.dp import gather, replicate, scatter


def _assert_same_grads(a, b, atol=1e-6):
    for (name, pa), pb in zip(a.named_parameters(), b.parameters()):
        if pa.grad is None or pb.grad is None:
            assert pa.grad is None and pb.grad is None, name
            continue
        torch.testing.assert_close(pa.grad, pb.grad, atol=atol, rtol=1e-5, msg=f"gradient of {name}")


@pytest.mark.parametrize("replicas,batch", [(2, 8), (3, 10), (4, 3)])
def test_mlp_gradients_equal_whole_batch(replicas, batch):
    torch.manual_seed(0)
    model = MLP(width=16, depth=3)
    reference = copy.deepcopy(model)
    x = torch.randn(batch, 16, requires_grad=True)
    x_ref = x.detach().clone().requires_grad_()
    dp = DataParallel(model, device_ids=["cpu"] * replicas)
    out = dp(x)
    assert out.shape == (batch, 16)
    out.pow(2).sum().backward()
    reference(x_ref).pow(2).sum().backward()
    _assert_same_grads(model, reference)
    torch.testing.assert_close(x.grad, x_ref.grad)  # gradient flows back through scatter too
    # the wrapper exposes exactly the module's parameters: replicas are not registered
    assert [id(p) for p in dp.parameters()] == [id(p) for p in model.parameters()]


def test_gpt_tied_weights_kwargs_and_tuple_outputs():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    reference = copy.deepcopy(model)
    idx = torch.randint(0, model.config.vocab_size, (4, 16))
    dp = DataParallel(model, device_ids=["cpu", "cpu"])
    logits, losses = dp(idx, targets=idx)  # targets is scattered from kwargs
    assert logits.shape == (4, 16, model.config.vocab_size)
    assert losses.shape == (2,)  # one mean loss per replica, stacked
    losses.mean().backward()  # equal chunks: mean of the means = mean over the batch
    _, loss = reference(idx, idx)
    loss.backward()
    torch.testing.assert_close(losses.mean(), loss)
    _assert_same_grads(model, reference)
    assert model.lm_head.weight is model.wte.weight  # still tied after replication


def test_replicas_share_ties_and_frozen_parameters_get_no_gradient():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 6), nn.ReLU(), nn.Linear(6, 6))
    model[2].weight = model[0].weight  # tied
    model[0].bias.requires_grad_(False)  # frozen
    reference = copy.deepcopy(model)
    replicas = replicate(model, [torch.device("cpu")] * 3)
    for r in replicas:
        assert r[2].weight is r[0].weight
        assert not isinstance(r[0].weight, nn.Parameter)  # a computed copy, not a leaf
    x = torch.randn(9, 6)
    DataParallel(model, device_ids=["cpu"] * 3)(x).sum().backward()
    reference(x).sum().backward()
    assert model[0].bias.grad is None
    _assert_same_grads(model, reference)


def test_batchnorm_running_stats_update_through_first_replica():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    reference = copy.deepcopy(model)
    x = torch.randn(8, 4)
    DataParallel(model, device_ids=["cpu", "cpu"])(x)
    reference(x[:4])  # only replica 0 shares storage with the module, as in PyTorch
    torch.testing.assert_close(model[1].running_mean, reference[1].running_mean)
    assert int(model[1].num_batches_tracked) == 1


def test_no_grad_and_single_device_paths():
    torch.manual_seed(0)
    model = MLP(width=8, depth=2)
    x = torch.randn(6, 8)
    with torch.no_grad():
        out = DataParallel(model, device_ids=["cpu"] * 2)(x)
    assert not out.requires_grad
    torch.testing.assert_close(out, model(x).detach())
    torch.testing.assert_close(DataParallel(model, device_ids=["cpu"])(x), model(x))


def test_scatter_gather_roundtrip_and_fewer_chunks():
    x = torch.arange(10.0).reshape(5, 2)
    parts = scatter((x, {"y": x * 2}, 7), [torch.device("cpu")] * 3)
    assert len(parts) == 3 and parts[0][2] == 7
    torch.testing.assert_close(gather([p[0] for p in parts], torch.device("cpu")), x)
    assert len(scatter(x[:2], [torch.device("cpu")] * 4)) == 2  # batch 2 over 4 devices: 2 replicas


def test_errors_name_the_argument():
    model = MLP(width=4, depth=1)
    with pytest.raises(ValueError, match="device_ids"):
        DataParallel(model, device_ids=[])
    with pytest.raises(TypeError, match="device_ids"):
        DataParallel(model, device_ids="cpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA device"):
            DataParallel(model, device_ids=[0])
    with pytest.raises(TypeError, match="module"):
        DataParallel("not a module")

    class Fails(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(2, 2)

        def forward(self, x):
            if x.shape[0] < 3:
                raise ValueError("too small")
            return self.lin(x)

    with pytest.raises(RuntimeError, match=r"replica 1 on cpu raised ValueError: too small"):
        DataParallel(Fails(), device_ids=["cpu"] * 2)(torch.randn(5, 2))


def _replica_threads_alive() -> list[str]:
    import glob

    names = []
    for path in glob.glob("/proc/self/task/*/comm"):
        try:
            names.append(open(path).read().strip())
        except OSError:  # the thread ended while we looked
            pass
    return [n for n in names if n.startswith("dp-replica")]


@pytest.mark.skipif(not __import__("os").path.isdir("/proc/self/task"), reason="needs Linux's /proc")
def test_replica_threads_have_ended_when_a_step_returns():
    """A process forked right after a DataParallel step (workbench.launch) must not copy a lock held
    by a replica thread that is still tearing down: the step returns only once the OS has ended
    its threads, not merely once Python's join() returned (issue 36: 1 launch in 8 hung)."""
    torch.manual_seed(0)
    model, x = MLP(width=32, depth=4), torch.randn(16, 32)
    dp = DataParallel(model, device_ids=["cpu", "cpu"])
    for _ in range(30):
        dp(x).square().mean().backward()
        assert _replica_threads_alive() == []
