"""workbench.ranks.launch: return values, output, progress records, failures, hangs, bad input."""
from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import LaunchTimeout, RankFailed

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _sum_of_ranks(scale):
    t = torch.tensor([float(workbench.rank() + 1)])
    dist.all_reduce(t)
    print(f"rank {workbench.rank()} sees {t.item():g}")
    workbench.report(step=0, total=1, loss=t.item() * scale)
    return {"rank": workbench.rank(), "world": workbench.world_size(), "sum": t.item() * scale,
            "device": str(workbench.device()), "threads": torch.get_num_threads(),
            "backend": workbench.backend()}


@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_return_values_in_rank_order(world_size, capsys):
    # gloo named: on a machine with a GPU per rank the default is NCCL, which cannot reduce CPU tensors
    result = workbench.launch(_sum_of_ranks, world_size=world_size, args=(2.0,), backend="gloo")
    expected_sum = 2.0 * world_size * (world_size + 1) / 2
    assert [r["rank"] for r in result] == list(range(world_size))
    assert all(r["world"] == world_size and r["sum"] == expected_sum for r in result)
    assert all(r["device"] == "cpu" and r["backend"] == "gloo" and r["threads"] == 1 for r in result)
    # printed output is grouped by rank, each line prefixed
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if line.startswith("[rank")]
    assert lines == [f"[rank {r}] rank {r} sees {expected_sum / 2:g}" for r in range(world_size)]
    assert result.output[0] == f"rank 0 sees {expected_sum / 2:g}"
    # one progress record per rank, with rank and time added
    assert sorted(rec["rank"] for rec in result.records) == list(range(world_size))
    assert all(rec["loss"] == expected_sum and "time" in rec for rec in result.records)


def test_two_launches_in_a_row_use_fresh_ports():
    first = workbench.launch(_sum_of_ranks, 2, args=(1.0,))
    second = workbench.launch(_sum_of_ranks, 2, kwargs={"scale": 3.0})
    assert [r["sum"] for r in first] == [3.0, 3.0]
    assert [r["sum"] for r in second] == [9.0, 9.0]


def _print_from_c_and_python():
    sys.stdout.write("from python\n")
    os.write(1, b"from the file descriptor\n")
    print("to stderr", file=sys.stderr)
    return workbench.rank()


def test_output_at_file_descriptor_level_is_captured(capsys):
    result = workbench.launch(_print_from_c_and_python, 2)
    assert result == [0, 1]
    out = capsys.readouterr().out
    for r in range(2):
        for text in ("from python", "from the file descriptor", "to stderr"):
            assert f"[rank {r}] {text}" in out


def test_stream_prints_live(capsys):
    workbench.launch(_print_from_c_and_python, 2, stream=True)
    out = capsys.readouterr().out
    assert out.count("[rank 0] from python") == 1 and out.count("[rank 1] from python") == 1


def _fail_on_rank_one():
    if workbench.rank() == 1:
        raise KeyError("no such shard")
    dist.barrier()  # rank 0 would wait forever for rank 1


def test_rank_failure_names_rank_and_carries_traceback():
    start = time.monotonic()
    with pytest.raises(RankFailed) as info:
        workbench.launch(_fail_on_rank_one, 2, timeout=120)
    assert time.monotonic() - start < 15, "the other rank must be stopped within seconds"
    err = info.value
    assert isinstance(err, RuntimeError)
    assert err.rank == 1 and err.exc_type == "KeyError"
    assert "rank 1 failed with KeyError" in str(err) and "no such shard" in str(err)
    assert "_fail_on_rank_one" in err.remote_traceback and "raise KeyError" in err.remote_traceback
    assert err.remote_traceback.rstrip() in str(err)


def _die_hard():
    if workbench.rank() == 0:
        os._exit(3)
    dist.barrier()


def test_rank_that_dies_without_exception_is_reported():
    with pytest.raises(RankFailed) as info:
        workbench.launch(_die_hard, 2, timeout=120)
    assert info.value.rank == 0 and info.value.exitcode == 3
    assert "exited with code 3" in str(info.value)


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")  # a zombie has exited
    except FileNotFoundError:
        return False


def _hang_with_a_grandchild(pid_dir):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    with open(os.path.join(pid_dir, f"rank{workbench.rank()}"), "w") as f:
        f.write(f"{os.getpid()} {child.pid}")
    if workbench.rank() == 1:
        time.sleep(600)  # stuck in Python
    dist.barrier()  # rank 0: stuck in gloo, waiting for rank 1


def test_hang_raises_launch_timeout_with_stacks_and_leaves_no_process(tmp_path):
    timeout = 4.0
    start = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        workbench.launch(_hang_with_a_grandchild, 2, args=(str(tmp_path),), timeout=timeout)
    assert time.monotonic() - start < timeout + 15
    err = info.value
    assert err.ranks == [0, 1]
    assert "barrier" in err.stacks[0] and "_hang_with_a_grandchild" in err.stacks[0]
    assert "_hang_with_a_grandchild" in err.stacks[1]
    assert "rank(s) 0, 1 had not finished" in str(err)
    pids = [int(p) for r in range(2) for p in (tmp_path / f"rank{r}").read_text().split()]
    deadline = time.monotonic() + 5
    while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [p for p in pids if _pid_alive(p)], "ranks and their children must not survive"


def test_bad_input_is_refused_before_any_process_starts():
    with pytest.raises(ValueError, match="world_size=0"):
        workbench.launch(_sum_of_ranks, 0)
    with pytest.raises(ValueError, match="world_size"):
        workbench.launch(_sum_of_ranks, 2.5)
    with pytest.raises(TypeError, match="fn=42 is not callable"):
        workbench.launch(42)
    with pytest.raises(ValueError, match="backend='mpx'"):
        workbench.launch(_sum_of_ranks, 2, backend="mpx")
    if torch.cuda.device_count() < 2:
        with pytest.raises(ValueError, match="backend='nccl' needs one GPU per rank"):
            workbench.launch(_sum_of_ranks, 2, backend="nccl")
    with pytest.raises(ValueError, match="timeout"):
        workbench.launch(_sum_of_ranks, 2, timeout=0)
    with pytest.raises(ValueError, match="start_method='thread'"):
        workbench.launch(_sum_of_ranks, 2, start_method="thread")
    with pytest.raises(TypeError, match=r"args\[0\]=.*cannot be pickled.*spawn"):
        workbench.launch(_sum_of_ranks, 2, args=(lambda: 1,), start_method="spawn")
    with pytest.raises(TypeError, match="args=.* must be a tuple"):
        workbench.launch(_sum_of_ranks, 2, args=5)


def _return_unpicklable():
    return lambda: 1


def test_unpicklable_return_value_is_a_clear_failure():
    with pytest.raises(RankFailed, match="return value function cannot be pickled"):
        workbench.launch(_return_unpicklable, 2)


def _run_script(code: str, timeout: float = 120, env_extra=None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "OMP_NUM_THREADS")}
    env.update(env_extra or {})
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=REPO)


def test_function_defined_in_main_and_spawn_of_an_importable_function():
    proc = _run_script("""
        import workbench, torch.distributed as dist
        def in_main(x):
            return x * (workbench.rank() + 1)
        print(workbench.launch(in_main, 2, args=(5,)))
        print(workbench.launch(dist.get_world_size, 2, start_method="spawn"))
        try:
            workbench.launch(in_main, 2, args=(5,), start_method="spawn")
        except TypeError as e:
            print("refused:", e)
    """)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == "[5, 10]" and lines[1] == "[2, 2]"
    assert lines[2].startswith("refused: fn='in_main' is defined in an interactive session")


def test_parent_that_used_openmp_does_not_hang_its_forked_children():
    proc = _run_script("""
        import torch, workbench
        torch.set_num_threads(2)
        a = torch.randn(2000, 2000)
        (a @ a).sum()            # the parent's OpenMP pool is now running
        def child_matmul():
            b = torch.randn(500, 500)
            return float((b @ b).abs().sum() > 0), torch.get_num_threads()
        print(workbench.launch(child_matmul, 2, timeout=60))
    """, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "[(1.0, 1), (1.0, 1)]"


def _nested():
    inner = workbench.launch(workbench.rank, 2)
    return inner


def test_launch_inside_a_rank_runs_in_process():
    assert workbench.launch(_nested, 2) == [[0], [1]]


def test_after_cuda_was_initialised_a_module_function_is_spawned_and_a_notebook_one_refused(monkeypatch):
    """A forked child cannot use CUDA initialised in its parent: launch spawns what it can send
    (with a warning saying why), and refuses what it cannot, naming the cause and the fix."""
    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    with pytest.warns(UserWarning, match="'spawn' instead of 'fork': CUDA was already initialised"):
        assert [r["sum"] for r in workbench.launch(_sum_of_ranks, 2, args=(1.0,))] == [3.0, 3.0]
    with pytest.raises(RuntimeError, match="start_method='fork' cannot work: CUDA was already initialised"):
        workbench.launch(_sum_of_ranks, 2, args=(1.0,), start_method="fork")
    with pytest.raises(RuntimeError, match="CUDA was already initialised.*cannot import.*Restart the kernel"):
        workbench.launch(lambda: 1, 2)


@pytest.mark.skipif(torch.cuda.device_count() > 0, reason="its backward would stop forking for every later test "
                    "on a GPU machine; test_cuda.py checks the probe there, in a fresh interpreter")
def test_the_autograd_fork_probe_passes_where_forked_children_can_train(monkeypatch):
    """On a GPU machine launch forks a probe that runs a backward pass (see _fork_is_unsafe); here
    the probe is forced to run, and a CPU build's forked child trains, so forking stays."""
    from workbench import runtime
    from workbench.ranks.launch import _fork_is_unsafe

    monkeypatch.setattr(runtime, "gpu_count", lambda: 1)
    x = torch.ones(2, requires_grad=True)
    (x * 3).sum().backward()
    assert _fork_is_unsafe() is None
    monkeypatch.setattr(torch.Tensor, "backward", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    assert "backward" in _fork_is_unsafe()


def test_device_argument_is_checked_before_any_rank_starts():
    with pytest.raises(ValueError, match="device='tpu' is not known"):
        workbench.launch(_sum_of_ranks, 2, args=(1.0,), device="tpu")
    if torch.cuda.device_count() == 0:
        with pytest.raises(ValueError, match="device='cuda' but this machine has no CUDA device"):
            workbench.launch(_sum_of_ranks, 2, args=(1.0,), device="cuda")
    assert [r["device"] for r in workbench.launch(_sum_of_ranks, 2, args=(1.0,), device="cpu")] == ["cpu", "cpu"]


def test_launches_from_two_processes_at_once_do_not_collide():
    """Two notebooks launching at the same moment: each launch gets its own free port."""
    code = """
        import workbench, torch, torch.distributed as dist
        def work(k):
            t = torch.full((1000,), float(workbench.rank() + k))
            dist.all_reduce(t)
            return t[0].item()
        print([workbench.launch(work, 2, args=(k,))[0] for k in range(5)])
    """
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    procs = [subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env, cwd=REPO) for _ in range(2)]
    for proc in procs:
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, err
        assert out.strip() == "[1.0, 3.0, 5.0, 7.0, 9.0]"


def _fail_alone_on_rank_one():
    if workbench.rank() == 1:
        raise ValueError("only rank 1 fails")
    return "rank 0 is done"


def test_the_failing_rank_is_named_even_when_its_exit_is_seen_before_its_message():
    """Rank 0 returns, rank 1 raises and exits: the parent may see the exit code first."""
    for _ in range(10):
        with pytest.raises(RankFailed) as info:
            workbench.launch(_fail_alone_on_rank_one, 2, timeout=60)
        assert (info.value.rank, info.value.exc_type) == (1, "ValueError")


def _tiny_all_reduce():
    t = torch.ones(4)
    dist.all_reduce(t)
    return t[0].item()


def test_many_launches_in_a_row_never_hang_at_rendezvous():
    """With a TCPStore served from the parent, about one launch in a few hundred hung in gloo's
    connection phase; the FileStore rendezvous must not. 12 world-3 launches (36 rendezvous), each
    with its own short timeout so a hang shows up as LaunchTimeout with the ranks' stacks."""
    start = time.monotonic()
    for _ in range(12):
        assert workbench.launch(_tiny_all_reduce, 3, timeout=30) == [3.0, 3.0, 3.0]
    assert time.monotonic() - start < 30


def test_destroy_process_group_frees_gloo_after_an_optimizer_was_built(tmp_path):
    """torch's first optimizer imports torch.distributed.nn.functional (through torch._dynamo), whose
    default arguments capture the default group when a group exists: destroy_process_group could
    then not free it, and gloo's threads ran into interpreter finalization, where they abort the
    process now and then. Importing workbench first imports that module while there is no group."""
    script = textwrap.dedent(f"""
        import glob, sys
        import torch, torch.distributed as dist
        import workbench
        assert "torch._dynamo" not in sys.modules  # the import it triggers must happen after the group
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
        model = torch.nn.Linear(4, 4)
        torch.optim.SGD(model.parameters(), lr=0.1)
        assert "torch._dynamo" in sys.modules
        dist.destroy_process_group()
        names = [open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")]
        print("gloo threads left:", sum(n.startswith(("gloo", "pt_gloo")) for n in names))
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "gloo threads left: 0" in proc.stdout, proc.stdout


def test_leaving_the_group_frees_gloo_after_torch_s_tensor_parallelism_ran(tmp_path):
    """torch's DTensor caches keyed by a DeviceMesh (its topology, redistribution plans and planners)
    hold the mesh, and through it the group, for the life of the process: after torch's own tensor
    parallelism ran (the lessons' reference runs), torch's destroy_process_group left gloo's threads
    alive into interpreter finalization. workbench's empties those caches first."""
    script = textwrap.dedent(f"""
        import glob, sys
        import torch, torch.distributed as dist
        from workbench import runtime
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
        dist.init_process_group("gloo", store=dist.FileStore({str(tmp_path / "store")!r}, 1), rank=0, world_size=1)
        assert runtime.forget_torch_meshes() is False  # DTensor imported, no mesh yet: no collection to pay
        mesh = init_device_mesh("cpu", (1,))
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 8))
        parallelize_module(model, mesh, {{"0": ColwiseParallel(), "2": RowwiseParallel()}})
        model(torch.randn(2, 8)).sum().backward()
        d = distribute_tensor(torch.randn(4, 4), mesh, [Shard(0)])
        (d @ d).redistribute(mesh, [Replicate()])
        del model, d, mesh
        (runtime if sys.argv[1] == "workbench" else dist).destroy_process_group()
        names = [open(p).read().strip() for p in glob.glob("/proc/self/task/*/comm")]
        print("gloo threads left:", sum(n.startswith(("gloo", "pt_gloo")) for n in names))
    """)
    left = {}
    for how in ("torch", "workbench"):
        proc = subprocess.run([sys.executable, "-c", script, how], capture_output=True, text=True, timeout=120,
                              env={**os.environ, "OMP_NUM_THREADS": "1"})
        assert proc.returncode == 0, proc.stderr[-3000:]
        left[how] = proc.stdout.strip().splitlines()[-1]
    assert left["workbench"] == "gloo threads left: 0", left
    assert left["torch"] != "gloo threads left: 0", f"torch no longer keeps its meshes: {left}"


def test_ranks_that_fail_to_connect_while_joining_the_group_are_started_again_once(tmp_path, monkeypatch, capsys,
                                                                                    caplog):
    """gloo's connectFullMesh failing while the process group is made (no user code has run) makes the
    launch start its ranks again from a fresh rendezvous, once: logged and counted in ``restarts``,
    with nothing on stdout or stderr (a notebook's stored output stays as it was); a second such
    failure, or any other failure, is reported as it is."""
    launch_module = sys.modules["workbench.ranks.launch"]  # the module (workbench.launch is the function)
    real = launch_module.init_group
    flag = tmp_path / "attempts"

    def init_group(rank, world_size, store_path, backend, pg_timeout):  # the forked ranks inherit this patch
        with open(flag, "a") as f:
            f.write(f"{rank}\n")
        if rank == 0 and flag.read_text().count("0\n") <= fails:
            print("gloo's own error line")   # what gloo logs: not shown for an attempt that is retried
            raise RuntimeError("Gloo connectFullMesh failed with [pair.cc:553] Connection closed by peer")
        real(rank, world_size, store_path, backend, pg_timeout)

    monkeypatch.setattr(launch_module, "init_group", init_group)
    fails = 1
    caplog.set_level(logging.INFO, logger="workbench.launch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        result = workbench.launch(dist.get_world_size, 2, timeout=30)
    assert result == [2, 2] and result.restarts == 1
    assert flag.read_text().count("0\n") == 2
    assert [r.getMessage() for r in caplog.records if r.name == "workbench.launch"] == [
        "rank 0 could not connect to its peers while joining the process group (Gloo connectFullMesh failed "
        "with [pair.cc:553] Connection closed by peer): starting the ranks again"]
    seen = capsys.readouterr()
    assert "gloo's own error line" not in seen.out and seen.err == ""
    assert workbench.launch(dist.get_world_size, 2, timeout=30).restarts == 0  # fails only counts rank 0's tries
    flag.unlink()
    fails = 2  # twice in a row: reported, with the rank, gloo's message and the restart
    with pytest.raises(RankFailed, match="rank 0 failed with RuntimeError: Gloo connectFullMesh failed with "
                                         r"\[pair.cc:553\] Connection closed by peer \(the ranks were started again"):
        workbench.launch(dist.get_world_size, 2, timeout=30)
    assert flag.read_text().count("0\n") == 2
