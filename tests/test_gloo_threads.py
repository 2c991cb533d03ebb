"""gloo's network thread is demoted to SCHED_IDLE in every rank (see workbench/gloo_threads.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm, gloo_threads

pytestmark = pytest.mark.skipif(not hasattr(os, "SCHED_IDLE") or not os.path.isdir("/proc/self/task"),
                                reason="SCHED_IDLE and /proc are Linux features")


def _policies() -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    for tid in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{tid}/comm") as f:
            out.setdefault(f.read().strip(), []).append(os.sched_getscheduler(int(tid)))
    return out


def _rank_policies():
    before = _policies()
    sub = dist.new_group(list(range(dist.get_world_size())))  # a new gloo group starts its own thread
    t = torch.ones(4)
    comm.all_reduce(t, group=sub, algorithm="ring")  # comm meets the group: its thread is demoted too
    return before, _policies()


def test_launch_demotes_gloo_loop_threads_and_comm_demotes_new_groups():
    before, after = workbench.launch(_rank_policies, 2)[0]
    assert before[gloo_threads.LOOP_THREAD] == [os.SCHED_IDLE]
    assert after[gloo_threads.LOOP_THREAD] == [os.SCHED_IDLE, os.SCHED_IDLE]
    # nothing else is touched: the rank's main thread and torch's gloo workers keep the normal class
    assert set(after["python"]) == {os.SCHED_OTHER}
    assert set(after["pt_gloo_runloop"]) == {os.SCHED_OTHER}


def test_normal_leaves_gloo_alone_and_a_bad_value_is_refused_before_start(monkeypatch):
    monkeypatch.setenv(gloo_threads.ENV, "normal")
    before, _ = workbench.launch(_rank_policies, 2)[0]
    assert before[gloo_threads.LOOP_THREAD] == [os.SCHED_OTHER]
    monkeypatch.setenv(gloo_threads.ENV, "sometimes")
    with pytest.raises(ValueError, match="WORKBENCH_GLOO_LOOP='sometimes'.*'idle'.*'normal'"):
        workbench.launch(_rank_policies, 2)
