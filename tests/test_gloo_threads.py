"""gloo's network thread is demoted to SCHED_IDLE in every rank (see workbench/runtime/gloo_threads.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.runtime import gloo_threads

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


def _loop_class() -> set[int]:
    return set(_policies()[gloo_threads.LOOP_THREAD])


def _classes_while_waiting_for_an_emulated_message():
    import threading
    import time

    seen = {}
    with gloo_threads.promoted():  # nests: the threads stay promoted until the outer block ends
        with gloo_threads.promoted():
            seen["nested"] = _loop_class()
        seen["outer"] = _loop_class()
    seen["after"] = _loop_class()
    t = torch.zeros(1 << 16)
    if dist.get_rank() == 0:
        time.sleep(0.5)  # rank 1 waits for this message's bytes meanwhile
        comm.send(t, dst=1)
    else:
        sampler = threading.Timer(0.25, lambda: seen.__setitem__("waiting", _loop_class()))
        sampler.start()
        comm.recv(t, src=0)
        sampler.join()
    seen["done"] = _loop_class()
    return seen


def test_network_thread_is_promoted_only_while_a_rank_waits_for_an_emulated_message():
    """On an emulated link gloo's network thread must move the bytes while the rank computes (as a
    NIC would), so it runs in the normal class while a thread waits for a held-back message."""
    slow = comm.Topology(1, inter=comm.Link(latency_s=1e-3, bandwidth_Bps=50e6))
    seen = workbench.launch(_classes_while_waiting_for_an_emulated_message, 2, topology=slow)
    for rank in seen:
        assert rank["nested"] == rank["outer"] == {os.SCHED_OTHER}, rank
        assert rank["after"] == rank["done"] == {os.SCHED_IDLE}, rank
    assert seen[1]["waiting"] == {os.SCHED_OTHER}, seen[1]
