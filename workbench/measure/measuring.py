"""What every measurement shares: sizes, interleaved trials, medians, the slowest rank, tables, output.

Used by every ``workbench bench NAME`` and by the advisor's validation against runs
(``workbench advise --validate``), so it sits in the measure layer, below both.

The measuring discipline (docs/design.md, "Measure, don't assume")
---------------------------------------------------------------
* **Interleaved trials.** Speed is a ratio against PyTorch measured in the same run. Candidates
  (ours and PyTorch's) take turns inside every trial, and the order rotates from trial to trial,
  so a slow patch of the machine (another process waking up, a frequency change) hits every
  candidate alike instead of spoiling one of them::

      trial 0:  native  ring    rabenseifner
      trial 1:  ring    rabenseifner  native
      trial 2:  rabenseifner  native  ring     ...

* **Median over trials.** One trial is one number per candidate; the report keeps all of them
  and quotes the median, which one unlucky trial cannot move.
* **Time of a collective = the slowest rank.** Each rank times the same loop; the parent reports
  the maximum over ranks (as nccl-tests does), because the step is over only when every rank is.

The helpers below are generic (no collective, model or strategy in them) so that every
benchmark, and the advisor's validation, prints and stores results the same way.
"""
from __future__ import annotations

import json
import math
import os
import platform
import re
import statistics
import time
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.distributed as dist

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
          "MIB": 1 << 20, "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


# ----------------------------------------------------------------------------------------- sizes

def parse_bytes(text: str | int) -> int:
    """``"64M"`` -> 67108864. Suffixes K, M, G are powers of 1024, as in nccl-tests' ``-b/-e``."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        match = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", str(text))
        if not match or match.group(2).upper() not in _UNITS:
            raise ValueError(f"size {text!r} is not a byte count: write e.g. 8, 4K, 64M or 1G "
                             "(K, M, G are powers of 1024)")
        value = int(match.group(1)) * _UNITS[match.group(2).upper()]
    if value < 0:
        raise ValueError(f"size {text!r} must not be negative")
    return value


def format_bytes(n: float) -> str:
    """67108864 -> ``"64M"``, 1536 -> ``"1.5K"``: short, for table cells and plot ticks."""
    for unit, scale in (("G", 1 << 30), ("M", 1 << 20), ("K", 1 << 10)):
        if n >= scale:
            value = n / scale
            return f"{value:.0f}{unit}" if value == int(value) else f"{value:.3g}{unit}"
    return f"{int(n)}"


def choices(text: str, allowed: Sequence[str], option: str) -> list[str]:
    """A benchmark option's comma-separated list (``--candidates=ddp,zero1``), each name checked
    against ``allowed``: the names in the order given, or a ``ValueError`` naming the option, the
    unknown names and the choices."""
    items = [s.strip() for s in text.split(",") if s.strip()]
    bad = [s for s in items if s not in allowed]
    if bad or not items:
        raise ValueError(f"--{option}={text!r}: unknown {bad or 'empty list'}; choose from {', '.join(allowed)}")
    return items


def size_sweep(min_bytes: int, max_bytes: int, factor: int) -> list[int]:
    """Sizes ``min_bytes, min_bytes*factor, ...`` up to ``max_bytes`` (nccl-tests' ``-b -e -f``).

    ``max_bytes`` itself is always the last size, even where the factor steps over it
    (8 B by x4 reaches 32 MiB, then 64 MiB is added), so a sweep "from 8 B to 64 MiB" ends at 64 MiB.
    """
    if min_bytes < 1:
        raise ValueError(f"min_bytes={min_bytes} must be at least 1")
    if max_bytes < min_bytes:
        raise ValueError(f"max_bytes={max_bytes} is smaller than min_bytes={min_bytes}: swap them")
    if not isinstance(factor, int) or factor < 2:
        raise ValueError(f"factor={factor!r} must be a whole number >= 2 (4 gives 8, 32, 128, ... bytes)")
    sizes, n = [], min_bytes
    while n <= max_bytes:
        sizes.append(n)
        n *= factor
    if sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def scaled_iterations(nbytes: int, iterations: int, budget_bytes: int) -> int:
    """Iterations for one measurement: ``iterations``, fewer for big messages.

    A measurement moves at most about ``budget_bytes`` per rank (never fewer than 1 iteration),
    so a sweep up to 64 MiB stays short while small messages, whose time is all latency, get
    enough iterations to average the timer's noise away.
    """
    if nbytes <= 0:
        return iterations
    return max(1, min(iterations, budget_bytes // nbytes))


# ------------------------------------------------------------------------------- trials, medians

def rotated(candidates: Sequence[str], trial: int) -> list[str]:
    """The order in which ``candidates`` run in ``trial``: shifted by one place per trial."""
    k = len(candidates)
    if k == 0:
        return []
    s = trial % k
    return list(candidates[s:]) + list(candidates[:s])


def interleaved_trials(candidates: Sequence[str], trials: int,
                       measure: Callable[[str], float], *, after: Sequence[str] = ()) -> dict[str, list[float]]:
    """Call ``measure(name)`` for every candidate once per trial, in rotating order.

    ``after``: names measured once per trial after the rotating ones, in this order -- work whose
    aftermath slows what runs next (a calibration's seconds of probes), which then falls on a
    different candidate in each trial instead of on the same one in most of them.
    Returns ``{name: [one number per trial]}``. Inside a rank, every rank must pass the same
    ``candidates`` and ``trials`` (the order is deterministic, so collectives inside ``measure``
    match up across ranks).
    """
    if trials < 1:
        raise ValueError(f"trials={trials} must be at least 1 (5 or more for a stable median)")
    samples: dict[str, list[float]] = {name: [] for name in (*candidates, *after)}
    for t in range(trials):
        for name in (*rotated(candidates, t), *after):
            samples[name].append(float(measure(name)))
    return samples


def median(values: Iterable[float]) -> float:
    """The median (NaN for no values)."""
    values = [v for v in values if v is not None and not math.isnan(v)]
    return statistics.median(values) if values else math.nan


def max_over_ranks(value: float, group=None) -> float:
    """The largest ``value`` over the ranks of ``group`` (the value itself outside a process group).

    Used outside the timed region, so it may use ``torch.distributed`` directly.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return float(value)
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
    return float(t.item())


def sum_over_ranks(value: int | float, group=None) -> float:
    """The sum of ``value`` over the ranks of ``group`` (e.g. wrong elements in a check)."""
    if not (dist.is_available() and dist.is_initialized()):
        return value
    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.SUM, group=group)
    return t.item()


def timed(fn: Callable[[], Any], iterations: int, *, barrier: bool = True, group=None) -> float:
    """Seconds per call of ``fn`` on this rank: ``iterations`` back-to-back calls after a barrier.

    The barrier lines the ranks up so that no rank's time includes waiting for a late peer to
    arrive at the first call; the slowest rank's time is taken afterwards with :func:`max_over_ranks`.
    """
    if barrier and dist.is_available() and dist.is_initialized():
        dist.barrier(group=group)
    start = time.perf_counter()
    for _ in range(iterations):
        fn()
    return (time.perf_counter() - start) / iterations


# --------------------------------------------------------------------------------------- tables

def format_table(rows: Sequence[dict], columns: Sequence[tuple[str, str, str]], *, title: str = "") -> str:
    """A fixed-width text table in the nccl-tests look: ``#`` header lines, right-aligned numbers.

    ``columns`` is a list of ``(key, header, format)``: ``format`` is a ``str.format`` spec
    applied to ``row[key]`` (``"{:.2f}"``), or ``"s"`` for text. Missing or NaN cells print ``-``.
    """
    def cell(row, key, fmt):
        value = row.get(key)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            return "-"
        if fmt == "s":
            return str(value)
        return fmt.format(value)

    body = [[cell(row, key, fmt) for key, _, fmt in columns] for row in rows]
    headers = [header for _, header, _ in columns]
    widths = [max([len(h)] + [len(r[i]) for r in body]) for i, h in enumerate(headers)]
    lines = []
    if title:
        lines += [f"# {line}" for line in title.splitlines()]
    lines.append("# " + "  ".join(h.rjust(w) for h, w in zip(headers, widths)))
    for r in body:
        lines.append("  " + "  ".join(c.rjust(w) for c, w in zip(r, widths)))
    return "\n".join(lines)


# --------------------------------------------------------------------------------------- output

def default_out_dir(name: str, root: str | os.PathLike = "runs") -> Path:
    """``runs/<name>-<UTC timestamp>/`` (not created)."""
    return Path(root) / f"{name}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"


def machine_info() -> dict:
    """Where a measurement was taken: enough to tell two JSON files apart."""
    info = {"host": platform.node(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count(), "platform": platform.platform(),
            "time_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    try:
        info["load_average"] = os.getloadavg()
    except OSError:
        pass
    return info


def write_json(path: str | os.PathLike, data: Any) -> Path:
    """Write ``data`` as indented JSON (NaN written as null), creating the folder."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)

    def clean(x):
        if isinstance(x, float) and (math.isnan(x) or math.isinf(x)):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    path.write_text(json.dumps(clean(data), indent=1) + "\n")
    return path


def save_outputs(args, name: str, payload: dict, plot: Callable[[], Any] | None) -> None:
    """Write ``<out>/<name>.json`` (the command's options, the machine's description and
    ``payload``) and, if ``plot`` is given, the figure it returns as ``<out>/<name>.png``; say
    where. ``<out>`` is ``args.out``, or ``runs/<name>-<time>`` when that is None."""
    out_dir = default_out_dir(name) if args.out is None else args.out
    options = {k: v for k, v in vars(args).items() if not callable(v)}
    payload = {"args": options, **payload}
    path = write_json(f"{out_dir}/{name}.json", {"machine": machine_info(), **payload})
    print(f"wrote {path}")
    if plot is not None:
        plot().savefig(f"{out_dir}/{name}.png", dpi=120)
        print(f"wrote {out_dir}/{name}.png")
