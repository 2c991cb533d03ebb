"""workbench.measure.show: measured sentences and tables for the lessons."""
from __future__ import annotations

import pytest

from workbench.measure import show


def test_format_table_aligns_and_formats():
    rows = [{"model": "tiny", "samples/s": 1234.5, "x": 0.5}, {"model": "a longer name", "samples/s": 7.0, "x": 2.0}]
    text = show.format_table(rows, formats={"samples/s": ",.0f", "x": lambda v: f"{v:.1f}x"})
    lines = text.splitlines()
    assert lines[0].split() == ["model", "samples/s", "x"]
    assert lines[1].split() == ["tiny", "1,234", "0.5x"] and lines[2].endswith("2.0x")
    assert len({len(line) for line in lines}) == 1  # right-aligned columns: every line as wide
    md = show.format_table(rows, ["x", "model"], {"x": ".2f"}, markdown_table=True).splitlines()
    assert md[0] == "| x | model |" and md[1] == "| ---: | --- |" and md[2] == "| 0.50 | tiny |"


def test_format_table_bad_input():
    with pytest.raises(ValueError, match="rows=\\[\\]"):
        show.format_table([])
    with pytest.raises(ValueError, match="missing"):
        show.format_table([{"a": 1}, {"b": 2}], ["a"])


def test_outside_a_notebook_it_prints_plain_text(capsys):
    show.markdown("the fit: **alpha = 3 us**")
    show.table([{"a": 1}])
    out = capsys.readouterr().out
    assert "the fit: alpha = 3 us" in out and "**" not in out and out.splitlines()[-1].strip() == "1"


def test_size_in_binary_units():
    sizes = (64, 1536, 4 << 20, 940000, 3 << 30)
    assert [show.size(n) for n in sizes] == ["64 B", "1.5 KiB", "4 MiB", "918 KiB", "3 GiB"]
