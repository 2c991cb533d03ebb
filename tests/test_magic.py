"""The %ranks / %%ranks magics, driven through a real Jupyter kernel (the project's kernel spec).

One kernel runs the tour of everything a learner does (cells that persist, subsets, pull/push,
figures, a failing rank, a hang, a rank that dies); a second one is killed with SIGKILL to check
that no rank outlives it. Rank processes are checked by pid.
"""
from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

jupyter_client = pytest.importorskip("jupyter_client")
from jupyter_client.manager import KernelManager  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


class Kernel:
    """A workbench kernel and a helper that runs code in it and gathers what it shows."""

    def __init__(self):
        os.environ["JUPYTER_PATH"] = f"{REPO}" + (f":{os.environ['JUPYTER_PATH']}" if os.environ.get("JUPYTER_PATH") else "")
        self.km = KernelManager(kernel_name="workbench")
        self.km.start_kernel(cwd=str(REPO))
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)

    def run(self, code: str, timeout: float = 60) -> dict:
        """Execute ``code``; return its stdout text, images, error (ename, evalue, traceback)."""
        shown = {"stdout": "", "stderr": "", "images": 0, "plain": [], "error": None}

        def hook(msg):
            kind, content = msg["msg_type"], msg["content"]
            if kind == "stream":
                shown[content["name"]] += content["text"]
            elif kind in ("display_data", "execute_result"):
                shown["images"] += "image/png" in content["data"]
                shown["plain"].append(content["data"].get("text/plain", ""))
            elif kind == "error":
                shown["error"] = (content["ename"], content["evalue"], "\n".join(content["traceback"]))

        reply = self.kc.execute_interactive(code, output_hook=hook, timeout=timeout)
        shown["status"] = reply["content"]["status"]   # "aborted": the kernel dropped it unrun
        return shown

    def ok(self, code: str, timeout: float = 60) -> dict:
        shown = self.run(code, timeout)
        assert shown["error"] is None and shown["status"] == "ok", (shown["status"], shown["error"])
        return shown

    def wait_idle(self, msg_id: str, timeout: float = 30) -> None:
        """Read the kernel's broadcasts until it is idle after request ``msg_id``. After a request that
        failed, the kernel aborts the requests that reach it before then (ipykernel's stop_on_error):
        the next one must be sent after it."""
        deadline = time.monotonic() + timeout
        while True:
            msg = self.kc.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
            if (msg["parent_header"].get("msg_id") == msg_id and msg["msg_type"] == "status"
                    and msg["content"]["execution_state"] == "idle"):
                return

    def pids(self) -> list[int]:
        shown = self.ok("print(get_ipython()._workbench_ranks.group.pids)")
        return eval(shown["stdout"].strip())

    def shutdown(self):
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)


def _alive(pid: int) -> bool:
    """True while ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _gone(pids, within: float = 10.0) -> bool:
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if not any(_alive(p) for p in pids):
            return True
        time.sleep(0.1)
    return False


@pytest.fixture(scope="module")
def kernel():
    k = Kernel()
    k.ok("%load_ext workbench")
    yield k
    k.shutdown()


def test_usage_errors_before_start(kernel):
    shown = kernel.run("%%ranks\nx = 1")
    assert shown["error"][0] == "RanksUsageError" and "%ranks start 2" in shown["error"][1]
    shown = kernel.run("%ranks start two")
    assert shown["error"] and "N='two'" in shown["error"][1]


def test_cells_persist_per_rank_with_subsets_pull_push_and_figures(kernel):
    shown = kernel.ok("%ranks start 2 --timeout 30")
    assert "2 rank(s) running (gloo" in shown["stdout"]
    pids = kernel.pids()
    assert len(pids) == 2 and all(_alive(p) for p in pids) and os.getpid() not in pids

    shown = kernel.ok(
        "%%ranks\n"
        "import torch, torch.distributed as dist, workbench\n"
        "x = torch.ones(3) * (workbench.rank() + 1)\n"
        "dist.all_reduce(x)\n"
        "class Scale:\n"
        "    def __init__(self, k): self.k = k\n"
        "    def __call__(self, t): return t * self.k\n"
        "def double(t):\n"
        "    return Scale(2)(t)\n"
        "print('threads', torch.get_num_threads(), 'world', dist.get_world_size())\n"
        "x")
    assert shown["stdout"].splitlines() == [
        "[rank 0] threads 1 world 2", "[rank 0] Out: tensor([3., 3., 3.])",
        "[rank 1] threads 1 world 2", "[rank 1] Out: tensor([3., 3., 3.])"]

    # the next cell sees the names, a function and a class defined in the last one; a subset runs alone
    shown = kernel.ok("%%ranks --ranks 1\ny = double(x) + workbench.rank()\ny")
    assert shown["stdout"].splitlines() == ["[rank 1] Out: tensor([7., 7., 7.])"]
    shown = kernel.ok("%%ranks\nprint('y' in dir())")
    assert shown["stdout"].splitlines() == ["[rank 0] False", "[rank 1] True"]

    # pull: a list of each rank's value, CPU tensors, in the notebook's namespace
    shown = kernel.ok("%ranks pull x\nprint(type(x).__name__, len(x), [t.tolist() for t in x], x[0].device)")
    assert "list 2 [[3.0, 3.0, 3.0], [3.0, 3.0, 3.0]] cpu" in shown["stdout"]
    shown = kernel.run("%ranks pull y")
    assert shown["error"][0] == "NameError" and "rank(s) 0" in shown["error"][1]

    # push: a notebook value reaches every rank
    kernel.ok("import torch\nw = torch.arange(4.)")
    kernel.ok("%ranks push w")
    shown = kernel.ok("%%ranks\nprint((w * (workbench.rank() + 1)).sum().item())")
    assert shown["stdout"].splitlines() == ["[rank 0] 6.0", "[rank 1] 12.0"]

    # a figure drawn inside each rank is shown in the notebook as a PNG
    shown = kernel.ok("%%ranks\nimport matplotlib.pyplot as plt\nplt.plot([0, workbench.rank()]);")
    assert shown["images"] == 2 and shown["stdout"] == ""
    assert kernel.pids() == pids  # nothing above restarted the ranks


def test_failing_rank_hang_and_death(kernel):
    kernel.ok("%ranks start 2 --timeout 30")
    kernel.ok("%%ranks\nimport torch, torch.distributed as dist, workbench\nkept = workbench.rank() * 10")
    pids = kernel.pids()

    # rank 1 raises while rank 0 waits in a barrier: RankFailed with rank 1's own traceback
    shown = kernel.run("%%ranks\nprint('before')\nif workbench.rank() == 1:\n"
                       "    raise KeyError('no such shard')\ndist.barrier()")
    ename, evalue, tb = shown["error"]
    assert ename == "RankFailed" and "rank 1 failed with KeyError" in evalue
    assert "<ranks cell" in evalue and "raise KeyError('no such shard')" in evalue
    assert "[rank 0] before" in shown["stdout"] and "[rank 1] before" in shown["stdout"]
    assert "interrupted rank(s) 0" in shown["stdout"]
    # ... and the group is usable, with the names kept, on the same processes
    shown = kernel.ok("%%ranks\nt = torch.ones(1) + kept\ndist.all_reduce(t)\nt.item()")
    assert shown["stdout"].splitlines() == ["[rank 0] Out: 12.0", "[rank 1] Out: 12.0"]
    assert kernel.pids() == pids

    # a hang: LaunchTimeout with where each rank was stuck, then usable again
    shown = kernel.run("%%ranks --timeout 2\nimport time\nif workbench.rank() == 0:\n"
                       "    time.sleep(60)\ndist.barrier()")
    ename, evalue, _ = shown["error"]
    assert ename == "LaunchTimeout" and "rank(s) 0, 1 had not finished" in evalue
    assert "--- rank 0 was here" in evalue and "line 4 in <module>" in evalue
    assert "in barrier" in evalue  # rank 1 was stuck in the collective
    shown = kernel.ok("%%ranks\nt = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert shown["stdout"].splitlines() == ["[rank 0] Out: 2.0", "[rank 1] Out: 2.0"]
    assert kernel.pids() == pids

    # a rank that dies: RankFailed naming it, and the group restarts with fresh processes
    shown = kernel.run("%%ranks\nimport os\nif workbench.rank() == 1:\n    os._exit(3)\ndist.barrier()")
    ename, evalue, _ = shown["error"]
    assert ename == "RankFailed" and "rank 1" in evalue and "exited with code 3" in evalue
    assert "rank 1 died: restarted 2 fresh rank(s)" in shown["stdout"]
    new_pids = kernel.pids()
    assert _gone(pids) and all(_alive(p) for p in new_pids)
    shown = kernel.ok("%%ranks\nimport torch, torch.distributed as dist\nprint('kept' in dir())\n"
                      "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()")
    assert shown["stdout"].splitlines() == ["[rank 0] False", "[rank 0] Out: 2.0",
                                            "[rank 1] False", "[rank 1] Out: 2.0"]


def test_a_rank_that_will_not_stop_is_restarted(kernel):
    kernel.ok("%ranks start 2 --timeout 30")
    pids = kernel.pids()
    # rank 1 swallows the interrupt: after the timeout and a grace period (shortened from its 5 s
    # for the test) the group is restarted
    kernel.ok("import workbench.ranks.live\nworkbench.ranks.live.GRACE = 1.0")
    shown = kernel.run("%%ranks --timeout 1\nimport time, workbench\nwhile workbench.rank() == 1:\n"
                       "    try:\n        time.sleep(0.1)\n    except KeyboardInterrupt:\n        pass")
    kernel.ok("workbench.ranks.live.GRACE = 5.0")
    assert shown["error"][0] == "LaunchTimeout" and "rank(s) 1 had not finished" in shown["error"][1]
    assert "rank(s) 1 did not stop within 1 s of an interrupt: restarted 2 fresh rank(s)" in shown["stdout"]
    assert _gone(pids)
    shown = kernel.ok("%%ranks\nimport workbench\nworkbench.rank()")
    assert shown["stdout"].splitlines() == ["[rank 0] Out: 0", "[rank 1] Out: 1"]


def test_bad_arguments_name_the_value_and_the_fix(kernel):
    kernel.ok("%ranks start 2 --timeout 30")
    shown = kernel.run("%%ranks --ranks 0,5\nx = 1")
    assert shown["error"][0] == "ValueError" and "[5] not in this group of 2" in shown["error"][1]
    shown = kernel.run("%%ranks --ranks zero\nx = 1")
    assert shown["error"][0] == "RanksUsageError" and "e.g. 0,2" in shown["error"][1]
    shown = kernel.run("%ranks push not_defined_here")
    assert shown["error"][0] == "RanksUsageError" and "no variable 'not_defined_here'" in shown["error"][1]
    shown = kernel.run("%%ranks\nx = (")
    assert shown["error"][0] == "SyntaxError"  # refused before any rank runs it


def test_kernel_interrupt_and_a_rank_killed_between_cells(kernel):
    kernel.ok("%ranks start 2 --timeout 30")
    kernel.ok("%%ranks\nimport torch, torch.distributed as dist, workbench\nkept = workbench.rank() + 1")
    pids = kernel.pids()
    # the learner presses "interrupt" while rank 0 sleeps and rank 1 waits in a barrier
    msg_id = kernel.kc.execute("%%ranks\nimport time\nif workbench.rank() == 0:\n    time.sleep(60)\ndist.barrier()")
    time.sleep(2.0)
    kernel.km.interrupt_kernel()
    reply = kernel.kc.get_shell_msg(timeout=30)
    assert reply["parent_header"]["msg_id"] == msg_id
    assert reply["content"]["status"] == "error" and reply["content"]["ename"] == "KeyboardInterrupt"
    kernel.wait_idle(msg_id)
    shown = kernel.ok("%%ranks\nt = torch.ones(1) * kept\ndist.all_reduce(t)\nt.item()")
    assert shown["stdout"].splitlines() == ["[rank 0] Out: 3.0", "[rank 1] Out: 3.0"]
    assert kernel.pids() == pids

    # a rank killed from outside between cells: the next cell restarts the group and says why
    os.kill(pids[1], signal.SIGKILL)
    assert _gone([pids[1]])
    shown = kernel.ok("%%ranks\nprint('fresh')")
    assert "rank 1 had died since the last cell (killed by signal SIGKILL)" in shown["stdout"]
    assert shown["stdout"].splitlines()[-2:] == ["[rank 0] fresh", "[rank 1] fresh"]
    assert _gone(pids) and not set(kernel.pids()) & set(pids)


def test_stop_restart_and_no_orphans(kernel):
    kernel.ok("%ranks start 2")
    first = kernel.pids()
    shown = kernel.ok("%ranks start 2")  # starting again stops the running group first, and says so
    assert "stopping the 2 running rank(s) first" in shown["stdout"]
    assert _gone(first)
    second = kernel.pids()
    kernel.ok("%ranks stop")
    assert _gone(second)
    kernel.ok("%ranks stop")  # always succeeds

    # a kernel restart leaves no rank behind
    kernel.ok("%ranks start 2")
    third = kernel.pids()
    kernel.km.restart_kernel(now=False)
    kernel.kc.wait_for_ready(timeout=60)
    assert _gone(third)
    kernel.ok("%load_ext workbench")


def test_ranks_die_with_a_killed_kernel():
    k = Kernel()
    try:
        k.ok("%load_ext workbench\n%ranks start 2")
        pids = k.pids()
        assert all(_alive(p) for p in pids)
        os.kill(k.km.provisioner.process.pid, signal.SIGKILL)
        assert _gone(pids), "rank processes outlived the SIGKILLed kernel"
    finally:
        k.shutdown()


def test_live_ranks_without_ipython():
    """The engine on its own (a script or a test): results come back as data, figures as PNG bytes."""
    import torch

    import workbench

    with workbench.LiveRanks(2, timeout=30) as group:
        results = group.run("import torch, workbench\nimport matplotlib.pyplot as plt\n"
                            "x = torch.full((2,), float(workbench.rank()))\nprint('hi')\n"
                            "plt.plot([0, 1])\nx.sum().item()", show=lambda results: None)
        assert [(r.rank, r.output, r.value) for r in results] == [(0, ["hi"], "0.0"), (1, ["hi"], "2.0")]
        assert all(len(r.figures) == 1 and r.figures[0].startswith(b"\x89PNG") for r in results)
        assert [t.tolist() for t in group.pull("x")] == [[0.0, 0.0], [1.0, 1.0]]
        group.push("y", {"k": torch.ones(1)}, ranks=[1])
        assert group.pull("y", ranks=[1])[0]["k"].tolist() == [1.0]
        group.run("import threading\nlock = threading.Lock()", show=lambda results: None)
        with pytest.raises(TypeError, match="rank 0: lock=lock cannot be pickled to send to the notebook"):
            group.pull("lock")
        with pytest.raises(ValueError, match=r"ranks=\[2\]: \[2\] not in this group of 2"):
            group.run("pass", ranks=[2])
        pids = group.pids
    assert _gone(pids) and not group.running

