"""Run several lessons' scripts one after another in each torchrun process (the test suite's driver).

``torchrun --standalone --nproc-per-node 2 tests/lessons_under_torchrun.py notebooks/01_*.py ...``
runs each script with ``runpy`` as ``__main__``, exactly as ``torchrun ... script.py`` would, in
the same two processes: one interpreter start and one import of torch per rank for all the
lessons, instead of one per lesson. Each lesson's output is framed by ``=== lesson NAME start``
and ``=== lesson NAME end: ok`` (or ``failed`` with its traceback), so the test can tell which
lesson printed what and which failed; a lesson that fails stops the run (its rank's partner
would otherwise wait in a collective the failed rank never joins).
"""
from __future__ import annotations

import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import matplotlib.pyplot as plt


def main(scripts: list[str]) -> int:
    rank = os.environ.get("RANK", "?")
    for script in scripts:
        name = Path(script).stem
        print(f"=== lesson {name} start (rank {rank})", flush=True)
        start = time.perf_counter()
        try:
            runpy.run_path(script, run_name="__main__")
        except BaseException:  # noqa: BLE001 -- report any failure, SystemExit included, with its lesson
            print(f"=== lesson {name} end: failed (rank {rank})\n{traceback.format_exc()}", flush=True)
            return 1
        finally:
            plt.close("all")
        print(f"=== lesson {name} end: ok (rank {rank}, {time.perf_counter() - start:.1f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
