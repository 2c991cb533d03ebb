"""model_state_bytes, MemoryMeter against hand-counted bytes, Throughput, records, plots."""
import matplotlib

matplotlib.use("Agg")

import pytest
import torch
import torch.nn as nn

from workbench.measure import metrics, plots
from workbench.measure.metrics import MemoryMeter, model_state_bytes
from workbench.models import GPT, GPTConfig

D, B = 256, 4  # two D x D Linear layers (no bias), a batch of B rows
P = 2 * D * D * 4  # bytes of all parameters (float32)
ACT = B * D * 4  # bytes of one (B, D) activation


def two_linears():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False))


def metered_step(model, optimizer, x):
    with MemoryMeter(device="cpu") as m:
        model(x).sum().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return m


def close(measured, expected, rel=0.01):
    return abs(measured - expected) <= rel * expected


# ----------------------------------------------------------------------------- model_state_bytes

def test_model_state_bytes_counts_tied_weights_once():
    model = GPT(GPTConfig.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    psi = model.num_parameters()
    assert model_state_bytes(model) == {"params": 4 * psi, "grads": 0, "optimizer": 0, "total": 4 * psi}
    x = torch.randint(0, 65, (2, 16))
    model(x, x)[1].backward()
    opt.step()
    n_tensors = len(list(model.parameters()))  # tied weight: one tensor
    state = model_state_bytes(model, opt)
    # Adam: exp_avg + exp_avg_sq (8 bytes per parameter) and a float32 step per tensor
    assert state == {"params": 4 * psi, "grads": 4 * psi, "optimizer": 8 * psi + 4 * n_tensors,
                     "total": 16 * psi + 4 * n_tensors}


def test_model_state_bytes_counts_a_flat_buffer_once_with_its_padding():
    model = two_linears()
    numel = sum(p.numel() for p in model.parameters())
    flat, flat_grad = torch.zeros(numel + 100), torch.zeros(numel + 100)  # padded, as ZeRO/FSDP do
    offset = 0
    for p in model.parameters():
        p.data = flat[offset:offset + p.numel()].view_as(p)  # parameters become views of one buffer
        p.grad = flat_grad[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    assert model.state_dict()["0.weight"].untyped_storage().data_ptr() == flat.data_ptr()
    assert model_state_bytes(model) == {"params": (numel + 100) * 4, "grads": (numel + 100) * 4, "optimizer": 0,
                                        "total": 2 * (numel + 100) * 4}
    with pytest.raises(TypeError, match="nn.Module"):
        model_state_bytes(torch.zeros(3))


# ----------------------------------------------------------------------------- MemoryMeter

def test_meter_sgd_matches_hand_count():
    model, x = two_linears(), torch.randn(B, D)
    m = metered_step(model, torch.optim.SGD(model.parameters(), lr=0.1), x)
    # peak at the last gradient: parameters + both gradients + the (B, D) hidden gradient still alive
    assert close(m.peak_bytes, P + P + ACT)
    assert m.peak_by_category["params"] == P and m.peak_by_category["grads"] == P
    assert m.peak_by_category["optimizer"] == 0 and close(m.peak_by_category["activations"], ACT, rel=0.02)
    assert sum(m.peak_by_category.values()) == m.peak_bytes
    assert m.current_bytes == P  # grads freed by zero_grad, activations by backward: only parameters left


def test_meter_sgd_momentum_matches_hand_count():
    model, x = two_linears(), torch.randn(B, D)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    first = metered_step(model, opt, x)  # momentum buffers are cloned from the gradients in step 1
    assert close(first.peak_bytes, 3 * P)
    assert first.peak_by_category["optimizer"] == P and first.peak_by_category["grads"] == P
    second = metered_step(model, opt, x)  # buffers exist before the block: found and counted from its start
    assert close(second.peak_bytes, 3 * P + ACT)
    assert second.peak_by_category == {"params": P, "grads": P, "optimizer": P,
                                       "activations": second.peak_bytes - 3 * P, "comm": 0}


@pytest.mark.parametrize("step", [1, 2])
def test_meter_adam_matches_hand_count(step):
    model, x = two_linears(), torch.randn(B, D)
    opt = torch.optim.Adam(model.parameters(), foreach=False)
    for _ in range(step - 1):
        metered_step(model, opt, x)
    m = metered_step(model, opt, x)
    # params P, grads P, moments 2P, two float32 step counters, and the single-tensor update's
    # temporaries while it divides for the second parameter: exp_avg_sq.sqrt() and its quotient by
    # bias_correction2_sqrt, plus the first parameter's `denom`, still bound to the loop variable:
    # three tensors of one parameter's size (P / 2)
    expected = P + P + 2 * P + 2 * 4 + 3 * (P // 2)
    assert close(m.peak_bytes, expected)
    assert m.peak_by_category["params"] == P and m.peak_by_category["grads"] == P
    assert m.peak_by_category["optimizer"] == 2 * P + 2 * 4
    assert model_state_bytes(model, opt)["optimizer"] == 2 * P + 2 * 4


def test_meter_tracks_frees_views_and_autograd_saved_tensors():
    n = 1 << 20
    with MemoryMeter(device="cpu") as m:
        for _ in range(10):
            t = torch.empty(n, dtype=torch.uint8)
            del t  # freed before the next one: the peak is one buffer, not ten
        base = torch.zeros(1000)
        view = base[10:]
        view.mul_(2)
        base.add_(1)  # in-place and views add nothing
    assert m.peak_bytes == n and m.allocated_bytes == 10 * n + 4000
    assert m.current_bytes == 4000
    w = torch.randn(n // 4, requires_grad=True)
    with MemoryMeter(device="cpu") as m:
        y = w.exp()  # exp saves its output for backward
        z = y.sum()
        del y
        assert m.current_bytes == n + 4  # y is still held by the graph: not freed; z is 4 bytes
        z.backward()
        assert w.grad.nbytes == n
        assert m.current_bytes == n + 4  # after backward the graph let y go; w.grad (n bytes) and z live
    assert m.peak_bytes == 2 * n + 4 + 4  # y, w.grad, z and the scalar gradient of the sum


def test_meter_comm_category_and_tag():
    with MemoryMeter(device="cpu") as m:
        with metrics.category("comm"):
            bucket = torch.empty(256)
        staging = metrics.tag(torch.empty(512), "comm")
        work = torch.empty(128)
    assert m.peak_by_category["comm"] == (256 + 512) * 4 and m.peak_by_category["activations"] == 128 * 4
    x = torch.empty(1000)
    with MemoryMeter(x, device="cpu") as m:  # a tensor from before the block, counted from its start
        torch.empty(10)
    assert m.peak_bytes == 4040
    with pytest.raises(ValueError, match="category 'weights' is not known"):
        metrics.tag(work, "weights")
    del bucket, staging


def test_meter_on_gpt_training_step():
    torch.manual_seed(0)
    model = GPT(GPTConfig.preset("tiny"))
    opt = torch.optim.AdamW(model.parameters(), foreach=False)
    x = torch.randint(0, 65, (4, 32))
    for _ in range(2):
        with MemoryMeter(device="cpu") as m:
            model(x, x)[1].backward()
            opt.step()
            opt.zero_grad()
    state = model_state_bytes(model, opt)
    assert m.peak_by_category["params"] == state["params"]
    assert m.peak_by_category["optimizer"] == state["optimizer"]
    assert 0 < m.peak_by_category["grads"] <= state["params"]
    assert m.peak_by_category["activations"] > 0
    assert "peak=" in repr(m)


# ----------------------------------------------------------------------------- Throughput, records

def test_throughput_leaves_out_warmup_and_uncounted_steps(monkeypatch):
    clock = iter([0.0, 5.0, 5.0, 6.0, 6.0, 6.5, 6.5, 9.5, 9.5, 10.0])  # step times 5, 1, 0.5, 3, 0.5
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    t = metrics.Throughput(warmup=1)
    for i, count in enumerate([True, True, True, False, True]):
        t.start()
        t.stop(samples=4, tokens=256, count=count)
    assert t.step_times == [5.0, 1.0, 0.5, 3.0, 0.5]
    assert t.counted == [False, True, True, False, True]
    assert t.steps == 3 and t.seconds == 2.0
    assert t.samples_per_s == 12 / 2.0 and t.tokens_per_s == 768 / 2.0
    with pytest.raises(ValueError, match="warmup=-1"):
        metrics.Throughput(warmup=-1)


def test_records_table():
    records = [{"rank": 0, "time": 1.0, "step": 0, "loss": 2.0}, {"rank": 0, "time": 1.1, "note": "x"},
               {"rank": 1, "time": 1.2, "step": 0, "loss": 2.0, "extra": 1}]
    assert metrics.records_table(records, "step", "loss") == [
        {"rank": 0, "time": 1.0, "step": 0, "loss": 2.0}, {"rank": 1, "time": 1.2, "step": 0, "loss": 2.0}]


# ----------------------------------------------------------------------------- plots

def test_plots_have_titles_units_and_legends():
    rows = [{"strategy": "single", "world_size": 1, "tokens_per_s": 1000.0,
             "peak_by_category": [{"params": 2 << 20, "activations": 5 << 20}]},
            {"strategy": "torch-ddp", "world_size": 2, "tokens_per_s": 1500.0,
             "peak_by_category": [{"params": 2 << 20, "comm": 1 << 20}] * 2}]
    fig = plots.throughput(rows)
    ax = fig.axes[0]
    assert "tokens/s" in ax.get_ylabel() and ax.get_title() and ax.get_legend() is not None
    assert [p.get_height() for p in ax.patches] == [1000.0, 1500.0]
    fig = plots.memory_breakdown(rows)
    ax = fig.axes[0]
    assert "MiB" in ax.get_ylabel() and ax.get_title()
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["params", "activations", "comm"]
    assert len(ax.patches) == 3 * 3  # three categories x three (strategy, rank) bars
    fig = plots.loss_curves({"single": [3.0, 2.5], "ddp": [{"rank": 0, "step": 0, "loss": 3.0},
                                                            {"rank": 0, "step": 1, "loss": 2.5}]})
    ax = fig.axes[0]
    assert [list(l.get_ydata()) for l in ax.get_lines()] == [[3.0, 2.5], [3.0, 2.5]]
    assert ax.get_xlabel() == "step" and ax.get_legend() is not None
    events = [{"rank": 0, "lane": "compute", "name": "forward", "start": 1.0, "end": 1.002},
              {"rank": 0, "lane": "comm", "name": "all_reduce", "start": 1.001, "end": 1.003},
              {"rank": 1, "lane": "compute", "name": "forward", "start": 1.0, "end": 1.004}]
    fig = plots.timeline(None, events)
    ax = fig.axes[0]
    assert ax.get_xlabel() == "time (ms)"
    top_down = sorted(ax.get_yticklabels(), key=lambda t: -t.get_position()[1])
    assert [t.get_text() for t in top_down] == ["rank 0 compute", "rank 0 comm", "rank 1 compute"]
    widths = sorted(round(p.get_width(), 6) for p in ax.patches)
    assert widths == [2.0, 2.0, 4.0]
    with pytest.raises(ValueError, match="lacks \\['end'\\]"):
        plots.timeline(None, [{"rank": 0, "lane": "x", "name": "y", "start": 0.0}])
    import matplotlib.pyplot as plt

    plt.close("all")


def test_storage_bytes_counts_each_storage_once_and_metered_files_activations_by_thread():
    import threading

    from workbench.measure.memory_meter import Metered, storage_bytes
    from workbench.models import GPT, GPTConfig

    model = GPT(GPTConfig.preset("tiny"))  # tied head: wte.weight and lm_head.weight share a storage
    flat = torch.zeros(10)
    assert storage_bytes([flat[:4], flat[4:], flat]) == 40  # views of one buffer: the buffer, once
    assert storage_bytes(model.parameters()) == 4 * model.num_parameters()
    log = {}
    metered = Metered(model, log)
    idx = torch.randint(0, 65, (2, 16))
    metered(idx, idx)
    worker = threading.Thread(target=lambda: metered(idx[:1], idx[:1]), name="replica-1")
    worker.start()
    worker.join()
    here = threading.current_thread().name
    assert set(log) == {here, "replica-1"}
    assert log[here] > log["replica-1"] > 0  # half the batch, fewer activations


def test_everyone_gathers_every_ranks_value_on_every_rank():
    import workbench

    assert workbench.everyone(3) == [3]  # no process group: this process alone
    results = workbench.launch(lambda: workbench.everyone({"rank": workbench.rank()}), world_size=2)
    assert results == [[{"rank": 0}, {"rank": 1}]] * 2
