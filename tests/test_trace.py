"""workbench.measure.trace: the package's timelines as Chrome trace files (Perfetto, chrome://tracing).

One launch of 2 ranks records a real pipeline step (1F1B, a 2-layer GPT of width 32, 4
micro-batches), two steps of our DDP and of torch's DDP (recorded by ``TorchDDPTimeline``) on the
same tiny MLP and data; the tests export them, read the JSON back and compare it event by event
with the timelines it came from.
"""
from __future__ import annotations

import copy
import json
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import workbench
from workbench.measure import trace
from workbench.models import MLP
from workbench.models.gpt import GPT, GPTConfig
from workbench.parallel import DistributedDataParallel
from workbench.parallel import pipeline as pp


def _record() -> dict:
    rank = dist.get_rank()
    torch.manual_seed(0)
    cfg = GPTConfig(n_layer=2, n_head=2, n_embd=32, block_size=16, vocab_size=65)
    stage = pp.PipelineStage(pp.partition(GPT(cfg), 2)[rank], rank, 2)
    schedule = pp.Schedule1F1B(stage, 4, loss_fn=lambda logits, y: F.cross_entropy(logits.flatten(0, 1), y.flatten()))
    g = torch.Generator().manual_seed(1)
    x, y = torch.randint(0, 65, (8, 16), generator=g), torch.randint(0, 65, (8, 16), generator=g)
    schedule.step(x) if rank == 0 else schedule.step(target=y)

    base = MLP(width=64, depth=4)
    ours = DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.01)
    theirs = torch.nn.parallel.DistributedDataParallel(copy.deepcopy(base), bucket_cap_mb=0.01)
    recorder = trace.TorchDDPTimeline(theirs)
    data = torch.randn(2, 16, 64, generator=torch.Generator().manual_seed(2 + rank))
    losses = {"ours": [], "torch": []}
    for name, model in (("ours", ours), ("torch", theirs)):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for x in data:
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses[name].append(loss.item())
    return workbench.everyone({"pipeline": schedule.timeline, "ddp": ours.timeline_events(),
                               "torch": recorder.timeline_events(), "losses": losses,
                               "torch_buckets": len(recorder.events[-1]["buckets"])})


@pytest.fixture(scope="module")
def recorded() -> list[dict]:
    # torch's DDP imports torch._dynamo on first use (seconds): once here, and both forked ranks
    # (and later launches of this worker) inherit it
    import torch._dynamo  # noqa: F401

    return workbench.launch(_record, world_size=2, timeout=120)[0]


def _complete(data: dict) -> list[dict]:
    return [e for e in data["traceEvents"] if e["ph"] == "X"]


def _names(data: dict, kind: str) -> dict[tuple, str]:
    return {(e["pid"], e.get("tid", 0)): e["args"]["name"] for e in data["traceEvents"]
            if e["ph"] == "M" and e["name"] == kind}


def test_a_pipeline_timeline_exports_event_for_event(recorded, tmp_path):
    timeline = recorded[0]["pipeline"]  # gathered: every rank's actions
    path = trace.export(tmp_path / "runs" / "pipeline.json", timeline, origin=0.0)
    data = json.loads(path.read_text())
    events = _complete(data)
    assert Counter(e["pid"] for e in events) == Counter(t["rank"] for t in timeline)
    for rank in (0, 1):
        mine = sorted((t for t in timeline if t["rank"] == rank), key=lambda t: t["start"])
        got = sorted((e for e in events if e["pid"] == rank), key=lambda e: e["ts"])
        expected = [f"{t['kind']}{t['microbatch']}" if t["kind"] in "FBW" else f"{t['kind']} {t['microbatch']}"
                    for t in mine]
        assert [e["name"] for e in got] == expected
        for e, t in zip(got, mine):
            assert e["ts"] == pytest.approx(t["start"] * 1e6, abs=1e-6)
            assert e["dur"] == pytest.approx((t["end"] - t["start"]) * 1e6, abs=1e-6)
            assert e["args"] == {"stage": t["stage"], "microbatch": t["microbatch"]}
    threads = _names(data, "thread_name")
    compute = {e["tid"] for e in events if e["name"][0] in "FBW"}
    comm = {e["tid"] for e in events if e["name"].split()[0] in ("send", "recv")}
    assert len(compute) == 1 and len(comm) == 1 and compute != comm, (compute, comm)
    assert {threads[(r, t)] for r in (0, 1) for t in compute | comm} == {"compute", "communication"}
    assert _names(data, "process_name") == {(0, 0): "rank 0", (1, 0): "rank 1"}
    assert data["displayTimeUnit"] == "ms"


def test_a_ddp_timeline_exports_with_communication_on_its_own_row(recorded, tmp_path):
    per_rank = [r["ddp"] for r in recorded]  # one list per rank, as everyone() returns them
    flat = [e for evs in per_rank for e in evs]
    data = trace.chrome_trace(per_rank)
    events = _complete(data)
    origin = min(e["start"] for e in flat)
    assert Counter(e["pid"] for e in events) == Counter(e["rank"] for e in flat)
    by_key = {(e["rank"], e["step"], e["name"]): e for e in flat}
    assert len(by_key) == len(flat) == len(events)
    threads = _names(data, "thread_name")
    for e in events:
        src = by_key[(e["pid"], e["args"]["step"], e["name"])]
        assert e["ts"] == pytest.approx((src["start"] - origin) * 1e6, abs=1e-6)
        assert e["dur"] == pytest.approx((src["end"] - src["start"]) * 1e6, abs=1e-6)
        assert threads[(e["pid"], e["tid"])] == src["lane"]  # one bucket at a time: no extra rows
        if src.get("issued") is not None:
            assert e["args"]["queued_us"] == pytest.approx((src["start"] - src["issued"]) * 1e6)
    backward = {e["tid"] for e in events if e["name"] == "backward"}
    allreduce = {e["tid"] for e in events if e["name"].startswith("b")} - backward
    assert len(backward) == 1 and len(allreduce) == 1 and backward.isdisjoint(allreduce)


def test_ours_and_torchs_ddp_in_one_trace_train_alike(recorded):
    """TorchDDPTimeline records torch's DDP in our form; both go into one trace under labels."""
    for r in recorded:
        assert r["losses"]["ours"] == pytest.approx(r["losses"]["torch"], rel=1e-5), r["losses"]
        assert r["torch_buckets"] >= 2
        assert {e["lane"] for e in r["torch"]} == {"backward", "all-reduce"}
    data = trace.chrome_trace({"ours": [r["ddp"] for r in recorded], "torch": [r["torch"] for r in recorded]})
    rows = set(_names(data, "thread_name").values())
    assert {"ours: backward", "ours: all-reduce", "torch: backward", "torch: all-reduce"} <= rows
    for label in ("ours", "torch"):  # each label counts from its own start
        tids = {t for (p, t), name in _names(data, "thread_name").items() if name.startswith(label)}
        assert min(e["ts"] for e in _complete(data) if e["tid"] in tids) == 0
    # torch's bars run from issue to completion and may overlap: never two overlapping on one row
    spans: dict[tuple, list] = {}
    for e in _complete(data):
        spans.setdefault((e["pid"], e["tid"]), []).append((e["ts"], e["ts"] + e["dur"]))
    for row in spans.values():
        row.sort()
        assert all(a[1] <= b[0] for a, b in zip(row, row[1:])), row


def test_ring_events_and_report_records_are_read_too():
    ring = [[(0, "post", 1.0, 1.001), (0, "compute", 1.001, 1.004), (0, "wait", 1.004, 1.0045)],
            [(0, "post", 1.0002, 1.001), (0, "compute", 1.001, 1.003)]]
    data = trace.chrome_trace(ring)
    threads = _names(data, "thread_name")
    rows = {(e["pid"], e["name"]): threads[(e["pid"], e["tid"])] for e in _complete(data)}
    assert rows == {(0, "post"): "communication", (0, "compute"): "compute", (0, "wait"): "communication",
                    (1, "post"): "communication", (1, "compute"): "compute"}
    records = [{"rank": 1, "time": 100.0, "step": 0, "loss": 2.5}, {"rank": 0, "time": 100.5, "step": 1}]
    instants = [e for e in trace.chrome_trace(records)["traceEvents"] if e["ph"] == "i"]
    assert [(e["pid"], e["ts"], e["args"]) for e in instants] == [(1, 0.0, {"step": 0, "loss": 2.5}),
                                                                   (0, 5e5, {"step": 1})]


def test_overlapping_bars_get_rows_of_their_own():
    bars = [{"rank": 0, "lane": "all-reduce", "name": n, "start": s, "end": e}
            for n, s, e in (("b0", 0, 5), ("b1", 1, 5), ("b2", 2, 7), ("b3", 5, 6), ("b4", 6, 8))]
    assert [e["lane"] for e in trace.without_overlap(bars)] == \
        ["all-reduce", "all-reduce (2)", "all-reduce (3)", "all-reduce", "all-reduce"]
    data = trace.chrome_trace(bars)
    assert sorted(_names(data, "thread_name").values()) == ["all-reduce", "all-reduce (2)", "all-reduce (3)"]


def test_bad_input_names_the_argument(tmp_path):
    with pytest.raises(TypeError, match=r"events=42 is not a timeline"):
        trace.export(tmp_path / "t.json", 42)
    with pytest.raises(ValueError, match=r"events\[1\]=.*lacks \['end \(or duration\)'\]"):
        trace.chrome_trace([{"rank": 0, "lane": "x", "name": "a", "start": 0, "end": 1},
                            {"rank": 0, "lane": "x", "name": "b", "start": 0}])
    with pytest.raises(ValueError, match=r"events\[0\] ends before it starts"):
        trace.chrome_trace([{"rank": 0, "lane": "x", "name": "a", "start": 2, "end": 1}])
    with pytest.raises(ValueError, match=r"events\[0\]=\(0, 'post'.*carries no rank"):
        trace.chrome_trace([(0, "post", 1.0, 2.0)])
    with pytest.raises(ValueError, match=r"events\['ours'\]\[0\]=.*is none of the timelines"):
        trace.chrome_trace({"ours": [{"rank": 0, "begin": 1}]})
    with pytest.raises(ValueError, match=r"path=.* is a folder"):
        trace.export(tmp_path, [])
    with pytest.raises(TypeError, match=r"TorchDDPTimeline: ddp=MLP is not"):
        trace.TorchDDPTimeline(MLP(width=8, depth=1))


def test_the_trace_file_is_an_ordinary_file(tmp_path):
    """Written through a temporary file and renamed, with the permissions of any file this user makes."""
    import os

    umask = os.umask(0)
    os.umask(umask)
    path = trace.export(tmp_path / "t.json", [{"rank": 0, "lane": "compute", "name": "F", "start": 0.0, "end": 1e-3}])
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask
