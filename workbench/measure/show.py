"""Measured sentences and tables for the lessons: rendered as Markdown in a notebook, plain text elsewhere.

A lesson never types a measured number into its prose (it would go stale the next time the
lesson runs); it writes the sentence in code, ``show.markdown(f"... {ratio:.2f}x ...")``, so the
number is whatever this run measured. :func:`table` does the same for the wide tables the
lessons print (one row per design, model or size), so their columns are laid out in one place.

In a notebook (an IPython kernel) both render as Markdown; under ``torchrun`` or ``python`` they
print plain text, aligned, so the paired scripts stay readable.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence


def _in_notebook() -> bool:
    try:
        from IPython import get_ipython
    except ImportError:  # pragma: no cover - IPython ships with the test extras
        return False
    shell = get_ipython()
    return shell is not None and shell.__class__.__name__ != "TerminalInteractiveShell"


def markdown(text: str) -> None:
    """Show ``text`` (Markdown) as a rendered cell output in a notebook, as plain text elsewhere."""
    if _in_notebook():
        from IPython.display import Markdown, display

        display(Markdown(text))
    else:
        print(text.replace("**", ""))


def format_table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
                 formats: Mapping[str, str | Callable[[Any], str]] | None = None, *,
                 markdown_table: bool = False) -> str:
    """``rows`` (dicts) as a table, one line per row, the columns in ``columns`` order.

    ``formats`` maps a column to a format spec (``".2f"``) or a function returning the cell's
    text; other cells use ``str``. Plain text right-aligns every column; ``markdown_table=True``
    gives a Markdown pipe table (numbers right-aligned).
    """
    if not rows:
        raise ValueError("rows=[] is empty: pass at least one row to format a table")
    columns = list(columns or rows[0].keys())
    missing = [c for c in columns if any(c not in r for r in rows)]
    if missing:
        raise ValueError(f"columns={missing} are missing from some rows: every row needs every column")
    formats = dict(formats or {})

    def cell(column, value):
        f = formats.get(column)
        if f is None:
            return str(value)
        return f(value) if callable(f) else format(value, f)

    body = [[cell(c, r[c]) for c in columns] for r in rows]
    if markdown_table:
        numeric = [all(isinstance(r[c], (int, float)) for r in rows) for c in columns]
        lines = ["| " + " | ".join(columns) + " |",
                 "| " + " | ".join("---:" if n else "---" for n in numeric) + " |"]
        lines += ["| " + " | ".join(line) + " |" for line in body]
        return "\n".join(lines)
    widths = [max(len(c), *(len(line[i]) for line in body)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(line, widths)) for line in body]
    return "\n".join(lines)


def table(rows: Sequence[Mapping[str, Any]], columns: Sequence[str] | None = None,
          formats: Mapping[str, str | Callable[[Any], str]] | None = None) -> None:
    """Show ``rows`` as a table (see :func:`format_table`): Markdown in a notebook, text elsewhere."""
    if _in_notebook():
        markdown(format_table(rows, columns, formats, markdown_table=True))
    else:
        print(format_table(rows, columns, formats))


def size(nbytes: float) -> str:
    """Bytes in binary units for prose: ``4194304 -> "4 MiB"``, ``940000 -> "918 KiB"``, ``64 -> "64 B"``."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.3g} {unit}"
    return f"{nbytes:.0f} B"
