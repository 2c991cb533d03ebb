"""nbval's failure report, with what the cell printed this time.

When a lesson's fresh output differs from the stored one only by an output stream, nbval says
which ("Unexpected output fields from running code: {'stderr'}") but not what was in it, so a rare
failure in CI leaves no trace of its cause. This hook adds the failing cell's fresh stdout and
stderr (the last 4,000 characters of each) to the report as a section of its own.
"""
from __future__ import annotations

import pytest

SHOWN = 4000


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    outputs = getattr(item, "test_outputs", None)  # nbval's IPyNbCell keeps the cell's fresh outputs
    if report.when != "call" or not report.failed or not outputs:
        return
    for stream in ("stdout", "stderr"):
        text = "".join(o.get("text", "") for o in outputs
                       if o.get("output_type") == "stream" and o.get("name") == stream)
        if text:
            report.sections.append((f"the cell's fresh {stream}", text[-SHOWN:]))
