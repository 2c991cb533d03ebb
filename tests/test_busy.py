"""workbench.runtime.busy: how much of the cores' time other work takes (the test for asserting a timing)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from workbench.runtime.busy import busy_fraction, were_free


@pytest.mark.skipif(not os.path.exists("/proc/stat"), reason="reads Linux's /proc/stat")
def test_a_busy_process_shows_as_its_share_of_the_cores():
    spin = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 5\nwhile time.time() < end: pass"])
    try:
        busy = busy_fraction(0.4)
    finally:
        spin.kill()
        spin.wait()
    cores = os.cpu_count() or 1
    assert 0.8 / cores <= busy <= 1.0, busy   # one core of `cores` spinning (a little more: the machine's own)
    assert were_free([busy]) is (busy <= 0.25)
    if cores <= 3:   # one spinner takes more than a quarter of the cores' time: not free
        assert not were_free([0.0, busy])


def test_windows_that_cannot_be_read_count_as_free():
    assert were_free([None, None]) and were_free([None, 0.1]) and not were_free([None, 0.6])


def test_bad_window_is_refused():
    with pytest.raises(ValueError, match="seconds=0"):
        busy_fraction(0)
