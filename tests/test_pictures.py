"""workbench.comm.pictures (who holds what before and after each collective) and plots.holdings."""
from __future__ import annotations

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

import workbench  # noqa: E402
from workbench import comm  # noqa: E402
from workbench.measure import plots
from workbench.comm import pictures  # noqa: E402


def test_before_and_after_on_three_ranks():
    res = workbench.launch(pictures.before_and_after, 3, timeout=120)
    assert res[0] == res[1] == res[2]  # every rank returns the whole picture
    pic = res[0]
    assert list(pic) == list(pictures.COLLECTIVES)
    for c, p in pic.items():
        assert set(p["parity"]) == set(comm.ALGORITHMS[c]) and all(p["parity"].values()), (c, p["parity"])
    # powers of ten tell who contributed: 111 is ranks 0, 1 and 2
    assert pic["all_reduce"]["before"] == [[1.0] * 3, [10.0] * 3, [100.0] * 3]
    assert pic["all_reduce"]["after"] == [[111.0] * 3] * 3
    assert pic["reduce_scatter"]["after"] == [[111.0], [222.0], [333.0]]
    assert pic["reduce"]["after"] == [[111.0] * 3, None, None]  # non-roots hold no result
    assert pic["all_gather"]["after"] == [[1.0, 2.0, 3.0]] * 3
    assert pic["scatter"]["before"] == [[1.0, 2.0, 3.0], None, None]
    assert pic["scatter"]["after"] == [[1.0], [2.0], [3.0]]
    assert pic["gather"]["after"] == [[1.0, 2.0, 3.0], None, None]
    assert pic["broadcast"]["after"] == [[1.0, 2.0, 3.0]] * 3
    # all-to-all transposes: tens say where an element came from, units where it goes
    assert pic["all_to_all_single"]["before"] == [[11.0, 12.0, 13.0], [21.0, 22.0, 23.0], [31.0, 32.0, 33.0]]
    assert pic["all_to_all_single"]["after"] == [[11.0, 21.0, 31.0], [12.0, 22.0, 32.0], [13.0, 23.0, 33.0]]


def test_inputs_bad_collective():
    with pytest.raises(ValueError, match="collective='all_to_all'"):
        pictures.inputs("all_to_all", 0, 2)


def test_holdings_draws_a_cell_per_element_and_outlines_the_highlight():
    fig, ax = plt.subplots()
    plots.holdings(ax, [[1.0, 2.0], None, [3.0]], "t", highlight={0: 1})
    assert len(ax.patches) == 3 * 2  # 3 ranks x the widest row
    assert [t.get_text() for t in ax.texts] == ["1", "2", "3"]
    assert sum(p.get_edgecolor()[:3] == matplotlib.colors.to_rgb("crimson") for p in ax.patches) == 1
    assert ax.get_title() == "t"
    plt.close(fig)
