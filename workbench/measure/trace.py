"""Timelines as Chrome trace files: open what a run did in Perfetto or ``chrome://tracing``.

``workbench.measure.plots.timeline`` draws a timeline as a static figure; a trace file lets a reader zoom
into one bucket's all-reduce or one micro-batch's backward, measure a gap with the mouse and read
every event's fields. This module writes the package's timelines in the Chrome trace event
format, the JSON that ``torch.profiler``'s ``export_chrome_trace`` writes::

    from workbench.measure import trace
    trace.export("runs/ddp.json", ddp.timeline_events())               # one source
    trace.export("runs/ddp.json", {"ours": ours, "torch": theirs})     # several, one origin each

Open the file at https://ui.perfetto.dev ("Open trace file", or drag it onto the page; the file
stays in the browser) or in Chrome's ``chrome://tracing`` ("Load").

The format (the "JSON Object Format" of the Trace Event Format document)
-----------------------------------------------------------------------
A JSON object whose ``"traceEvents"`` list holds:

* one **complete event** per timed interval: ``{"ph": "X", "name", "ts", "dur", "pid", "tid",
  "args"}``, ``ts`` (start) and ``dur`` (duration) in microseconds, ``ts`` counted from the
  trace's origin (by default the earliest time in it);
* one **instant event** per point in time (a ``workbench.report`` record): ``{"ph": "i", "s": "t",
  ...}``;
* **metadata events** (``"ph": "M"``) that name the rows: ``pid`` is the rank, named ``"rank N"``
  by a ``process_name`` event; ``tid`` is a row of that rank, one per kind of work (computation on
  one row, communication on its own row), named by ``thread_name`` events and ordered by
  ``thread_sort_index`` in the order of their first events.

The complete events of one row must nest or follow each other; two collectives in flight at
once (torch's buckets, timed from issue to completion) overlap partly and would be drawn wrongly,
so an event that overlaps an earlier one on its row moves to an extra row, ``"all-reduce (2)"``,
as in a Gantt chart (:func:`without_overlap` does the same for ``plots.timeline``).

What it reads (:func:`normalise`): every timeline the package records, as it records it.

* ``{"rank", "lane", "name", "start", "end", ...}`` (``"duration"`` may stand for ``"end"`` in
  any form): ``DistributedDataParallel.timeline_events()``,
  ZeRO's and FSDP's ``events``, :class:`TorchDDPTimeline`, what ``plots.timeline`` draws. The row
  is the lane; ``issued`` (when a collective was queued) becomes ``args["queued_us"]``.
* ``{"rank", "stage", "kind", "microbatch", "start", "end"}``: a pipeline's ``schedule.timeline``
  (or ``planned_timeline()``). F/B/W go on ``"compute"`` (named ``F3``), send/recv on
  ``"communication"`` (named ``send 3``).
* ``(step, what, start, end)`` tuples: ``context.ring_timeline()``, one list per rank gathered
  (list index = rank). ``compute`` goes on ``"compute"``, ``post`` and ``wait`` on
  ``"communication"``.
* ``{"rank", "time", ...fields}``: a launch's ``records`` (``records_of(rank)``): instants named
  ``report`` on a ``"report"`` row, the fields as ``args``.

An object is read for what it holds: ``.timeline_events()`` (a DDP), ``.timeline`` (a pipeline
schedule), ``.records`` (a launch's result). A list whose items are lists is per rank (index =
rank). Times are seconds on one clock: the timelines' ``time.perf_counter()``, shared by the
processes of one machine, so ranks line up; a ``report`` record's ``time`` is ``time.time()``,
another clock, so export records apart from the timelines (or pass them under their own label).

Cost: linear in the number of events (about 150 bytes of JSON each); nothing is kept.
"""
from __future__ import annotations

import json
import math
import os
import tempfile
import time
from pathlib import Path
from typing import Any, Iterable, Mapping

import torch
import torch.distributed as dist

__all__ = ["export", "chrome_trace", "normalise", "without_overlap", "TorchDDPTimeline", "COMPUTE", "COMMUNICATION"]

COMPUTE = "compute"
COMMUNICATION = "communication"
_PIPELINE_COMPUTE = ("F", "B", "W")
_RING_COMPUTE = ("compute",)


# ------------------------------------------------------------------------------- normalising

def normalise(events: Any, *, what: str = "events") -> list[dict]:
    """Every source's events as ``{"rank", "row", "name", "start", "end", "args"}`` (seconds;
    ``end`` is None for an instant). ``what`` names the argument in error messages."""
    if hasattr(events, "timeline_events") and callable(events.timeline_events):
        events = events.timeline_events()
    elif isinstance(getattr(events, "timeline", None), list):
        events = events.timeline
    elif isinstance(getattr(events, "records", None), list):
        events = events.records
    if isinstance(events, (str, bytes, Mapping)) or not isinstance(events, Iterable):
        raise TypeError(f"trace: {what}={_short(events)} is not a timeline: pass a list of events (e.g. "
                        "ddp.timeline_events(), schedule.timeline, a launch's records), a list of such lists "
                        "(one per rank), or an object holding one")
    out: list[dict] = []
    for i, item in enumerate(list(events)):
        if isinstance(item, (list, tuple)) and not _is_ring_event(item):  # one rank's events
            for j, e in enumerate(item):
                out.append(_event(e, f"{what}[{i}][{j}]", rank=i))
        else:
            out.append(_event(item, f"{what}[{i}]", rank=None))
    return out


def _is_ring_event(item) -> bool:
    return isinstance(item, tuple) and len(item) == 4 and isinstance(item[1], str)


def _event(e: Any, where: str, rank: int | None) -> dict:
    """One source event -> the common form (see the table in the module docstring)."""
    if _is_ring_event(e):  # context.ring_timeline: (step, what, start, end), rank from the list
        if rank is None:
            raise ValueError(f"trace: {where}={e!r} is a ring_timeline event, which carries no rank: pass "
                             "the ranks' lists gathered (everyone(events)), so that list index = rank")
        step, kind, start, end = e
        row = COMPUTE if kind in _RING_COMPUTE else COMMUNICATION
        return _checked({"rank": rank, "row": row, "name": kind, "start": start, "end": end,
                         "args": {"step": step}}, where)
    if not isinstance(e, Mapping):
        raise TypeError(f"trace: {where}={_short(e)} is not an event: expected a dict such as "
                        "{'rank', 'lane', 'name', 'start', 'end'} or a (step, what, start, end) tuple")
    e = dict(e)
    if "rank" not in e:
        if rank is None:
            raise ValueError(f"trace: {where}={_short(e)} has no 'rank': add it, or pass one list per rank")
        e["rank"] = rank
    end = e.get("end")
    if end is None and "start" in e and "duration" in e:
        try:
            end = float(e["start"]) + float(e["duration"])
        except (TypeError, ValueError):
            raise ValueError(f"trace: {where} has a start or duration that is not a number: {_short(e)}") from None
    if "lane" in e:  # plots.timeline's form: DDP, ZeRO, FSDP, TorchDDPTimeline
        _need(e, ("name", "start"), where, end)
        args = {k: v for k, v in e.items() if k not in ("rank", "lane", "name", "start", "end", "duration",
                                                         "issued")}
        out = _checked({"rank": e["rank"], "row": str(e["lane"]), "name": str(e["name"]), "start": e["start"],
                        "end": end, "args": args}, where)
        if isinstance(e.get("issued"), (int, float)):  # when the collective was queued, before it ran
            args["queued_us"] = (out["start"] - e["issued"]) * 1e6
        return out
    if "kind" in e and "stage" in e:  # a pipeline schedule's timeline (measured or planned)
        _need(e, ("microbatch", "start"), where, end)
        kind, mb = e["kind"], e["microbatch"]
        compute = kind in _PIPELINE_COMPUTE
        return _checked({"rank": e["rank"], "row": COMPUTE if compute else COMMUNICATION,
                         "name": f"{kind}{mb}" if compute else f"{kind} {mb}", "start": e["start"], "end": end,
                         "args": {"stage": e["stage"], "microbatch": mb}}, where)
    if "time" in e and "start" not in e:  # a workbench.report record: a point in time
        args = {k: v for k, v in e.items() if k not in ("rank", "time")}
        return _checked({"rank": e["rank"], "row": "report", "name": "report", "start": e["time"], "end": None,
                         "args": args}, where)
    raise ValueError(f"trace: {where}={_short(e)} is none of the timelines trace reads: it needs 'start' and "
                     "'end' (or 'duration') with 'lane' and 'name' (plots.timeline, DDP), or with 'stage', "
                     "'kind' and 'microbatch' (a pipeline schedule), or 'time' (a report record)")


def _need(e: dict, keys, where: str, end) -> None:
    missing = [k for k in keys if k not in e] + ([] if end is not None else ["end (or duration)"])
    if missing:
        raise ValueError(f"trace: {where}={_short(e)} lacks {missing}")


def _checked(e: dict, where: str) -> dict:
    try:
        e["rank"] = int(e["rank"])
        e["start"] = float(e["start"])
        e["end"] = None if e["end"] is None else float(e["end"])
    except (TypeError, ValueError):
        raise ValueError(f"trace: {where} has a rank or time that is not a number: {_short(e)}") from None
    if e["end"] is not None and not e["end"] >= e["start"]:
        raise ValueError(f"trace: {where} ends before it starts (start {e['start']!r}, end {e['end']!r})")
    if e["rank"] < 0:
        raise ValueError(f"trace: {where} has rank {e['rank']}: ranks count from 0")
    return e


def _short(x: Any, limit: int = 160) -> str:
    text = repr(x)
    return text if len(text) <= limit else text[:limit] + "...}"


# ----------------------------------------------------------------------------- the trace itself

def chrome_trace(events: Any, *, origin: float | None = None) -> dict:
    """The Chrome trace of ``events`` (what :func:`export` writes), as a dict.

    ``events``: one source (see the module docstring), or a dict ``{label: source}`` of several
    runs to view together: each label's rows are named ``"label: row"`` under the same ranks, and
    each label's times count from its own earliest time (runs made one after the other start
    together), unless ``origin`` (seconds on their clock) is given.
    """
    if isinstance(events, Mapping) and events and not ({"rank", "start", "time"} & set(events)):
        sources = [(str(label), normalise(src, what=f"events[{label!r}]")) for label, src in events.items()]
    else:
        sources = [(None, normalise(events))]
    rows: dict[str, int] = {}  # row name -> tid, in order of first use
    trace: list[dict] = []
    used: set[tuple[int, int]] = set()  # (pid, tid) that hold events
    for label, evs in sources:
        if not evs:
            continue
        t0 = origin if origin is not None else min(e["start"] for e in evs)
        named = [{**e, "row": f"{label}: {e['row']}" if label else e["row"]} for e in evs]
        row_of = _rows_without_overlap(named, "row")
        for i in sorted(range(len(named)), key=lambda i: named[i]["start"]):  # rows in order of first use
            e, row = named[i], row_of[i]
            tid = rows.setdefault(row, len(rows) + 1)
            used.add((e["rank"], tid))
            event = {"name": e["name"], "ph": "X", "ts": (e["start"] - t0) * 1e6, "pid": e["rank"], "tid": tid,
                     "args": _jsonable(e["args"])}
            if e["end"] is None:
                event.update(ph="i", s="t")
            else:
                event["dur"] = (e["end"] - e["start"]) * 1e6
            trace.append(event)
    meta = []
    for rank in sorted({pid for pid, _ in used}):
        meta.append({"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}})
        meta.append({"name": "process_sort_index", "ph": "M", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
        for row, tid in rows.items():
            if (rank, tid) not in used:
                continue
            meta.append({"name": "thread_name", "ph": "M", "pid": rank, "tid": tid, "args": {"name": row}})
            meta.append({"name": "thread_sort_index", "ph": "M", "pid": rank, "tid": tid, "args": {"sort_index": tid}})
    return {"traceEvents": meta + trace, "displayTimeUnit": "ms",
            "otherData": {"producer": "workbench.measure.trace", "time_unit": "us"}}


def without_overlap(events: Iterable[Mapping]) -> list[dict]:
    """``plots.timeline`` events (``{"rank", "lane", "start", "end", ...}``) with a lane whose bars
    overlap split into as few lanes as keep them apart: ``"all-reduce"``, ``"all-reduce (2)"``, ...
    (e.g. torch's buckets, several in flight at once). Same events, same order."""
    events = [dict(e) for e in events]
    for e, lane in zip(events, _rows_without_overlap(events, "lane")):
        e["lane"] = lane
    return events


def _rows_without_overlap(events: list[dict], key: str) -> list[str]:
    """Each event's row: ``e[key]``, or, for an interval that overlaps an earlier one on that row
    of its rank, the first extra row ``"<row> (k)"`` free at its start -- greedy interval
    partitioning in order of start, which uses as few rows as the most intervals in flight at
    once; O(n log n + n k) for k rows. Instants (``end`` None) stay on their row."""
    rows = [str(e[key]) for e in events]
    free_at: dict[tuple, list[float]] = {}  # (rank, row) -> when each of its rows is free again
    for i in sorted(range(len(events)), key=lambda i: events[i]["start"]):
        e = events[i]
        if e["end"] is None:
            continue
        ends = free_at.setdefault((e["rank"], rows[i]), [])
        k = next((k for k, end in enumerate(ends) if end <= e["start"]), len(ends))
        if k == len(ends):
            ends.append(e["end"])
        ends[k] = e["end"]
        if k:
            rows[i] = f"{rows[i]} ({k + 1})"
    return rows


def _jsonable(x: Any) -> Any:
    if isinstance(x, dict):
        return {str(k): _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, torch.Tensor) and x.numel() == 1:
        return x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    return str(x)


def export(path: str | os.PathLike, events: Any, *, origin: float | None = None) -> Path:
    """Write ``events`` (one source, or ``{label: source}``; see :func:`chrome_trace`) to ``path``
    as a Chrome trace (JSON) and return the path. Open it at https://ui.perfetto.dev or in
    ``chrome://tracing``. The folder is created; the file is replaced in one step (written beside
    it, then renamed), so ranks that export the same trace at once leave one whole file."""
    if not isinstance(path, (str, os.PathLike)) or not str(path):
        raise TypeError(f"trace.export: path={path!r} must be a file name, e.g. 'runs/timeline.json'")
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"trace.export: path={str(path)!r} is a folder: name the file, "
                         f"e.g. {str(path / 'trace.json')!r}")
    data = chrome_trace(events, origin=origin)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, separators=(",", ":"))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)   # mkstemp's file is private (0600); a trace is an ordinary file
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


# --------------------------------------------------------------- a timeline for torch's own DDP

class TorchDDPTimeline:
    """Record a timeline of ``torch.nn.parallel.DistributedDataParallel``, which keeps none, in
    the form of ``workbench.parallel.DistributedDataParallel.timeline_events``, so both can be
    drawn (``plots.timeline``) and exported side by side::

        ddp = torch.nn.parallel.DistributedDataParallel(model)
        recorder = TorchDDPTimeline(ddp)      # before the first backward
        ...train...
        recorder.timeline_events(steps=1)

    How: a post-accumulate-grad hook on every trainable parameter stamps when the first gradient
    of a backward is ready and queues an autograd-engine callback that stamps the end of
    backward's computation (it runs before torch's own callback, which waits for the
    all-reduces); a communication hook (``register_comm_hook``) runs torch's default
    ``allreduce_hook`` and stamps each bucket's issue and, from its future's callback, completion.
    torch does not say when gloo's thread began a bucket, so a bar runs from issue to completion
    (queueing included, and buckets in flight together overlap); ours runs from the start of the
    transfer. The Python hook costs a few microseconds per bucket: time torch's DDP without it.
    """

    def __init__(self, ddp: torch.nn.parallel.DistributedDataParallel):
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"TorchDDPTimeline: ddp={type(ddp).__name__} is not a "
                            "torch.nn.parallel.DistributedDataParallel (ours records its own: ddp.timeline_events())")
        from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

        self._allreduce = default_hooks.allreduce_hook
        self.rank = dist.get_rank(ddp.process_group)
        self.events: list[dict] = []  # one record per backward: its times and its buckets'
        self._current: dict | None = None
        ddp.register_comm_hook(ddp.process_group, self._hook)
        for p in ddp.module.parameters():
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(self._gradient_ready)

    def _gradient_ready(self, param) -> None:
        if self._current is None or self._current["backward_end"] is not None:  # a new backward
            self._current = {"step": len(self.events), "backward_start": time.perf_counter(),
                             "backward_end": None, "buckets": []}
            self.events.append(self._current)
            torch.autograd.Variable._execution_engine.queue_callback(self._backward_done)

    def _backward_done(self) -> None:
        self._current["backward_end"] = time.perf_counter()

    def _hook(self, group, bucket):
        record = {"bucket": bucket.index(), "start": time.perf_counter(), "end": None}
        if self._current is not None:
            self._current["buckets"].append(record)

        def done(fut):
            record["end"] = time.perf_counter()
            return fut.value()

        return self._allreduce(group, bucket).then(done)

    def timeline_events(self, steps: int | None = None, origin: float = 0.0) -> list[dict]:
        """The recorded steps as ``plots.timeline`` events (lanes ``"backward"`` and
        ``"all-reduce"``, one box ``b0``, ``b1``, ... per bucket from issue to completion), in
        seconds from ``origin``; ``steps``: how many of the last steps (default all)."""
        recorded = self.events[-steps:] if steps else self.events
        out = []
        for step in recorded:
            if step["backward_end"] is not None:
                out.append({"rank": self.rank, "lane": "backward", "name": "backward", "step": step["step"],
                            "start": step["backward_start"] - origin, "end": step["backward_end"] - origin})
            for bk in step["buckets"]:
                if bk["end"] is not None:
                    out.append({"rank": self.rank, "lane": "all-reduce", "name": f"b{bk['bucket']}",
                                "step": step["step"], "start": bk["start"] - origin, "end": bk["end"] - origin})
        return out
