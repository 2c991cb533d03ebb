"""The ZeRO formulas (the ones lesson 04's checks and its memory explorer use), and their figure."""
import pytest

from workbench.measure import plots
from workbench.parallel.zero_memory import bytes_sent_per_rank, elements_moved, model_state_per_rank


def test_float32_adam_formulas_of_the_design_sheet():
    psi, n = 1000, 4
    totals = [model_state_per_rank(psi, n, s)["total"] for s in range(4)]
    assert totals == [16 * psi, 8 * psi + 8 * psi / n, 4 * psi + 12 * psi / n, 16 * psi / n]
    split = model_state_per_rank(psi, n, 2)
    assert (split["params"], split["grads"], split["optimizer"]) == (4 * psi, 4 * psi / n, 8 * psi / n)
    assert model_state_per_rank(psi, 1, 3)["total"] == 16 * psi  # one rank: nothing to shard


def test_mixed_precision_reproduces_the_papers_7_5b_example():
    # Rajbhandari et al. 2020, Figure 1: 7.5 B parameters, 64 GPUs, K = 12
    got = [model_state_per_rank(7.5e9, 64, s, precision="mixed")["total"] / 1e9 for s in range(4)]
    assert [round(g, 1) for g in got] == [120.0, 31.4, 16.6, 1.9]


def test_other_optimizers_and_communication():
    assert model_state_per_rank(100, 2, 0, optimizer="sgd")["total"] == 800
    assert model_state_per_rank(100, 2, 1, optimizer="sgd-momentum")["optimizer"] == 200
    assert [elements_moved(100, 4, s) for s in range(4)] == [150, 150, 150, 225]
    assert bytes_sent_per_rank(100, 4, 3) == 900


@pytest.mark.parametrize("kwargs, match", [
    (dict(psi=-1, world_size=2, stage=0), "psi=-1"), (dict(psi=10, world_size=0, stage=0), "world_size=0"),
    (dict(psi=10, world_size=2, stage=4), "stage=4"), (dict(psi=10, world_size=2, stage=1, optimizer="lion"), "lion"),
    (dict(psi=10, world_size=2, stage=1, precision="fp8"), "fp8")])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises(ValueError, match=match):
        model_state_per_rank(**kwargs)


def test_explorer_figure_draws_formula_and_measured_bars():
    import matplotlib.pyplot as plt

    psi = 2 ** 20
    measured = [{"stage": s, **model_state_per_rank(psi, 2, s)} for s in range(4)]
    fig = plots.zero_model_state(psi=psi, world_size=2, stage=3, measured=measured, measured_world_size=2)
    ax = fig.axes[0]
    heights = {}
    for p in ax.patches:
        if p.get_fill() and p.get_height() > 0:
            heights.setdefault(round(p.get_x() + p.get_width() / 2, 2), 0.0)
            heights[round(p.get_x() + p.get_width() / 2, 2)] += p.get_height()
    # formula bars (left) and measured bars (right) of each stage have the same height, in MiB
    assert sorted(round(h, 3) for h in heights.values()) == sorted(2 * [16.0, 12.0, 10.0, 8.0])
    assert ax.get_ylim()[0] == 0 and "MiB" in ax.get_ylabel()
    plt.close("all")
