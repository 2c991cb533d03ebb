"""Start N ranks from a notebook cell, a script, or under ``torchrun``: :func:`launch`.

How a launch works
------------------
::

    parent (notebook kernel)                         rank r (a child process)
    ------------------------                         -------------------------
    a FileStore in a fresh temp dir ---- path ---->  one intra-op thread, own process group
    one pipe per rank for output    <--- stdout ---  fd 1 and 2 redirected into the pipe
    one queue for all ranks         <--- records --  workbench.report(step=..., loss=...)
                                    <--- result ---  fn's return value (or its traceback)
    SIGUSR1 on timeout              ---- signal -->  faulthandler writes every thread's stack

* The rendezvous is a ``FileStore`` in a temporary directory made for this launch: ranks meet
  there to exchange the addresses gloo (or NCCL) connects through, on ports the operating system
  picks. No server runs in the parent, so nothing half-alive is copied into a forked child, and
  two launches (in a row, or from two notebooks) never collide. (A ``TCPStore`` served from the
  parent would be a server thread copied half-alive into every forked child; launches through one
  now and then hung in gloo's connection phase.)
* Children are forked by default, so a function defined in a notebook cell just works (spawn
  would have to pickle it by name, and a notebook's ``__main__`` cannot be imported). The first
  thing a child does is set one intra-op thread: a forked child of a parent that already ran
  OpenMP work would otherwise hang in its first parallel region.
* Whatever a rank prints, from Python or from C, goes into its pipe and is shown by the parent,
  prefixed ``[rank k]``, grouped in rank order at the end (or live with ``stream=True``). This
  is what makes rank output visible under nbval, where ipykernel does not capture children.
* If a rank raises, the parent stops every rank (SIGKILL to each rank's process group, so no
  grandchild survives) and raises :class:`RankFailed` with that rank's own traceback.
* After ``timeout`` seconds the parent asks each unfinished rank for its Python stacks
  (``faulthandler`` on SIGUSR1 works even inside a blocked C call such as a gloo ``recv``),
  kills every rank and raises :class:`LaunchTimeout`.
* Under ``torchrun`` (``RANK`` and ``WORLD_SIZE`` set) there is nothing to start: ``fn`` runs in
  this process inside torchrun's group, so a script exported from a notebook runs unchanged on
  one machine or several.
* ``topology=`` (or ``WORKBENCH_TOPOLOGY``, also read under torchrun) makes the ranks an emulated
  cluster (:mod:`workbench.comm.topology`): checked in the parent before any rank starts, then
  set up in every rank once its process group exists (:func:`workbench.comm.emulate`, which
  measures this machine's floor and refuses links faster than it).

Layer: starting ranks sits above :mod:`workbench.comm`, whose emulated network it sets up in every
rank, and below the models, strategies and apps, none of which starts ranks (a rank's own context,
:mod:`workbench.runtime`, is below comm). pyproject.toml's import contracts hold it there.
"""
from __future__ import annotations

import atexit
import ctypes
import faulthandler
import io
import logging
import multiprocessing as mp
import os
import pickle
import select
import signal
import sys
import tempfile
import threading
import time
import traceback
import warnings
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

from workbench import runtime
from workbench.runtime import gloo_threads
from workbench.comm import emulation
from workbench.comm.topology import Topology

log = logging.getLogger("workbench.launch")



class RankFailed(RuntimeError):
    """A rank raised (or died). ``.rank`` is its number, ``.remote_traceback`` its own traceback."""

    def __init__(self, rank: int, exc_type: str, message: str, remote_traceback: str = "",
                 exitcode: int | None = None):
        self.rank = rank
        self.exc_type = exc_type
        self.exc_message = message
        self.remote_traceback = remote_traceback
        self.exitcode = exitcode
        text = f"rank {rank} failed with {exc_type}: {message}"
        if remote_traceback:
            text += f"\n\n--- traceback from rank {rank} ---\n{remote_traceback.rstrip()}"
        super().__init__(text)

    def __reduce__(self):
        return (type(self), (self.rank, self.exc_type, self.exc_message, self.remote_traceback, self.exitcode))


class LaunchTimeout(RuntimeError):
    """Ranks did not finish in time. ``.stacks`` maps each unfinished rank to where it was stuck."""

    def __init__(self, timeout: float, stacks: dict[int, str], what: str = "launch",
                 outcome: str = "All ranks were stopped."):
        self.timeout = timeout
        self.ranks = sorted(stacks)
        self.stacks = stacks
        names = ", ".join(str(r) for r in self.ranks)
        text = (f"{what} timed out after {timeout:g} s: rank(s) {names} had not finished "
                f"(raise timeout= if the work is just slow). {outcome}")
        for r in self.ranks:
            text += f"\n\n--- rank {r} was here (most recent call first) ---\n{stacks[r].rstrip() or '(no stack received)'}"
        super().__init__(text)


class LaunchResult(list):
    """The ranks' return values (index = rank), plus what the launch observed.

    ``records``: every ``workbench.report(...)`` record, in arrival order (dicts with ``rank``
    and ``time``); ``output``: each rank's printed text; ``elapsed``: wall time in seconds;
    ``restarts``: how many times the ranks were started again because gloo failed to connect them
    while the process group was made (0 or 1; each is logged to the ``workbench.launch`` logger).
    """

    def __init__(self, values=(), *, records=None, output=None, elapsed=0.0, restarts=0):
        super().__init__(values)
        self.records: list[dict] = list(records or [])
        self.output: dict[int, str] = dict(output or {})
        self.elapsed = elapsed
        self.restarts = restarts

    def records_of(self, rank: int = 0) -> list[dict]:
        """The records one rank sent."""
        return [r for r in self.records if r["rank"] == rank]


# --------------------------------------------------------------------------------------- checks

def _validate(fn, world_size, args, kwargs, timeout, start_method) -> str:
    if not callable(fn):
        raise TypeError(f"fn={fn!r} is not callable: pass the function each rank should run, "
                        "e.g. launch(train, world_size=2)")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a whole number >= 1 (2 on a 2-core machine)")
    if not isinstance(args, (tuple, list)):
        raise TypeError(f"args={args!r} must be a tuple of positional arguments, e.g. args=(x,)")
    if kwargs is not None and not isinstance(kwargs, dict):
        raise TypeError(f"kwargs={kwargs!r} must be a dict of keyword arguments")
    if not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"timeout={timeout!r} must be a positive number of seconds")
    methods = mp.get_all_start_methods()
    requested = start_method
    if start_method is None:
        start_method = "fork" if "fork" in methods else "spawn"
    if start_method not in ("fork", "spawn", "forkserver") or start_method not in methods:
        raise ValueError(f"start_method={start_method!r} is not available here: use one of {methods} "
                         "(fork works for functions defined in a notebook)")
    if start_method == "fork" and not _under_torchrun() and runtime._context is None:
        start_method = _instead_of_a_poisoned_fork(fn, args, kwargs or {}, requested)
    if start_method != "fork":
        _check_picklable(fn, args, kwargs or {}, start_method)
    gloo_threads.enabled()  # a bad WORKBENCH_GLOO_LOOP is refused here, before any rank starts
    return start_method


def _fork_is_unsafe() -> str | None:
    """Why a forked rank could not use CUDA or autograd here, or None if forking is safe.

    Two states of the parent process are inherited by a forked child and make it fail later,
    deep inside the user's function:

    * CUDA initialised in the parent, or only its runtime asked a question
      (``torch.cuda.is_available()`` does): the child cannot use CUDA at all. The second is
      invisible in the parent; the forked probe below reads it in the child.
    * On a machine with CUDA devices (a CUDA build of torch), the first ``backward`` starts
      autograd's per-device worker threads, and from then on every forked child refuses to run
      a backward pass ("Unable to handle autograd's threading in combination with fork-based
      multiprocessing"), even on the CPU. A notebook that trained anything before launching
      is in this state. It cannot be read from Python, so a forked probe tries a one-element
      backward (a few milliseconds; only where CUDA devices exist: CPU builds never start the
      threads).
    """
    if torch.cuda.is_initialized():
        return "CUDA was already initialised in this process, and a forked child cannot use it"
    if runtime.gpu_count() == 0:
        return None
    pid = os.fork()
    if pid == 0:  # the probe: exit 0 if CUDA and autograd can work in a forked child
        code = 1
        try:
            # any call into the CUDA runtime (torch.cuda.is_available(), say) leaves the child "in a
            # bad fork" although torch.cuda.is_initialized() is still False in the parent
            if getattr(torch.cuda, "_is_in_bad_fork", lambda: False)():
                os._exit(2)
            x = torch.ones(1, requires_grad=True)
            (x * 2).sum().backward()
            code = 0
        except BaseException:  # noqa: BLE001 - any failure means the child cannot train
            pass
        os._exit(code)
    deadline = time.monotonic() + 30
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = 1
            break
        time.sleep(0.005)
    code = os.waitstatus_to_exitcode(status)
    if code == 0:
        return None
    if code == 2:
        return ("this process already called the CUDA runtime (torch.cuda.is_available(), say), and a child "
                "forked after that cannot initialise CUDA")
    return ("this process already ran a backward pass on a machine with CUDA devices, and PyTorch's "
            "autograd refuses to run in a child forked after that "
            "(https://github.com/pytorch/pytorch/wiki/Autograd-and-Fork)")


def _instead_of_a_poisoned_fork(fn, args, kwargs, requested: str | None) -> str:
    """``"fork"`` if forking is safe; else ``"spawn"`` when ``fn`` can be sent to a spawned child
    (with a warning saying why), else a clear error: the rank would fail anyway."""
    reason = _fork_is_unsafe()
    if reason is None:
        return "fork"
    fix = ("Restart the kernel and call launch() before any CUDA work or backward pass in it, or "
           "define the function in a .py module and pass start_method='spawn'.")
    if requested == "fork":
        raise RuntimeError(f"start_method='fork' cannot work: {reason}. {fix}")
    try:
        _check_picklable(fn, args, kwargs, "spawn")
    except TypeError as e:
        raise RuntimeError(f"A forked rank cannot work: {reason}; and a spawned one cannot import "
                           f"what it should run ({e}). {fix}") from None
    warnings.warn(f"starting the ranks with start_method='spawn' instead of 'fork': {reason}", stacklevel=4)
    return "spawn"


def _check_picklable(fn, args, kwargs, start_method) -> None:
    main = sys.modules.get("__main__")
    if getattr(fn, "__module__", None) == "__main__" and not getattr(main, "__file__", None):
        raise TypeError(f"fn={getattr(fn, '__qualname__', fn)!r} is defined in an interactive session, which a "
                        f"'{start_method}' child cannot import: use start_method='fork' (the default on Linux) "
                        "or move the function into a .py module")
    items = [("fn", fn)] + [(f"args[{i}]", a) for i, a in enumerate(args)] + \
            [(f"kwargs[{k!r}]", v) for k, v in kwargs.items()]
    for name, value in items:
        try:
            pickle.dumps(value)
        except Exception as e:  # noqa: BLE001 - any pickling failure is the user's to fix
            raise TypeError(f"{name}={value!r} cannot be pickled for start_method='{start_method}' ({e}): "
                            "define it at module top level, or use start_method='fork'") from None


def _under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ------------------------------------------------------------------------------------ the child

def _exception_name(e: BaseException) -> str:
    name = type(e).__qualname__
    if type(e).__module__ not in ("builtins", "__main__"):
        name = f"{type(e).__module__}.{name}"
    return name


def _die_with_parent(parent_pid: int | None = None) -> None:
    """Ask Linux to SIGKILL this rank if the parent dies (no orphans after a kernel crash).

    ``PR_SET_PDEATHSIG`` is set only after the fork, so with ``parent_pid`` a parent that died in
    between is caught by comparing ``getppid``, and a watchdog thread checks it twice a second
    from then on (for long-lived ranks, and for platforms without the prctl).
    """
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except OSError:
            pass
    if parent_pid is not None:
        if os.getppid() != parent_pid:
            os._exit(1)
        threading.Thread(target=_watch_parent, args=(parent_pid,), name="workbench-watch-parent",
                         daemon=True).start()


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(1)


def _redirect_output(fd: int) -> None:
    """Point fd 1 and 2 (and Python's sys.stdout/err) at the parent's pipe for this rank."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - the parent's stream objects may be half-usable after fork
            pass
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), line_buffering=True, write_through=True)
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), line_buffering=True, write_through=True)


def _resolve_topology(topology, world_size: int):
    """``topology=`` (a Topology, a spec string, or None: ``WORKBENCH_TOPOLOGY`` if set), checked
    against the world size here, in the parent, before any rank starts."""
    if topology is None:
        topology = Topology.from_env()
    elif isinstance(topology, str):
        topology = Topology.parse(topology)
    elif not isinstance(topology, Topology):
        raise TypeError(f"topology={topology!r}: pass a workbench.comm.Topology, a spec string such as "
                        "'ranks_per_node=2,inter=1ms@20MB/s', or None")
    if topology is not None:
        topology.check_world(world_size)
    return topology


def _emulate(topology) -> None:
    if topology is not None:
        emulation.emulate(topology)


def _rank_setup(rank, world_size, store_path, backend, out_conn, dump_conn, pg_timeout, sink,
                parent_pid=None, device: str | None = None) -> None:
    """Everything a rank does before running user code (shared by launch and the live ranks).

    One intra-op thread, die with the parent, own process group, output into the parent's pipe,
    stacks on SIGUSR1, the rank's context, the process group, gloo's network thread demoted.
    """
    runtime.limit_threads(1)  # before any tensor work (see module docstring)
    _die_with_parent(parent_pid)
    try:
        os.setpgid(0, 0)  # own process group: the parent can kill this rank and its children at once
    except OSError:
        pass
    _redirect_output(out_conn.fileno())
    dump_file = os.fdopen(os.dup(dump_conn.fileno()), "w")
    faulthandler.register(signal.SIGUSR1, file=dump_file, all_threads=True)

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    dev = runtime.rank_device(backend, device, rank)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    runtime._set_context(runtime._RankContext(
        rank=rank, world_size=world_size, local_rank=rank, backend=backend, device=dev, sink=sink))
    init_group(rank, world_size, store_path, backend, pg_timeout)


def init_group(rank, world_size, store_path, backend, pg_timeout) -> None:
    """Join the default process group through a ``FileStore`` at ``store_path``."""
    store = dist.FileStore(store_path, world_size)
    dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=pg_timeout))
    gloo_threads.demote_loop_threads()  # see gloo_threads.py: no time-slice stalls on a busy machine


def _rank_main(rank, world_size, store_path, backend, fn, args, kwargs, queue, out_conn, dump_conn, pg_timeout,
               topology=None, device=None):
    code = 0
    try:
        _rank_setup(rank, world_size, store_path, backend, out_conn, dump_conn, pg_timeout,
                    sink=lambda record: queue.put(("record", rank, record)), device=device)
        _emulate(topology)
        value = fn(*args, **kwargs)
        try:
            payload = pickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"rank {rank}'s return value {type(value).__name__} cannot be pickled back to the "
                            f"parent ({e}): return plain Python objects or CPU tensors") from None
        queue.put(("result", rank, payload))
        try:
            runtime.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown after the result is sent is best effort
            pass
    except BaseException as e:  # noqa: BLE001 - every failure is reported to the parent
        code = 1
        # the traceback starts in fn: the launcher's own frame teaches nothing
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next or e.__traceback__))
        queue.put(("error", rank, (_exception_name(e), str(e), tb)))
    finally:
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        queue.close()
        queue.join_thread()
    sys.exit(code)


# ----------------------------------------------------------------------------------- the parent

class _RankOutput:
    """Reads one rank's pipe without blocking and splits it into lines."""

    def __init__(self, rank: int, conn, stream: bool):
        self.rank, self.conn, self.stream = rank, conn, stream
        self.fd = conn.fileno()
        os.set_blocking(self.fd, False)
        self.buffer = b""
        self.lines: list[str] = []
        self.open = True

    def read(self) -> bool:
        """Read what is there; return True if anything arrived."""
        got = False
        while self.open:
            try:
                chunk = os.read(self.fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                self.open = False
                break
            got = True
            self.buffer += chunk
        *complete, self.buffer = self.buffer.split(b"\n")
        for raw in complete:
            self._add(raw)
        return got

    def finish(self) -> None:
        self.read()
        if self.buffer:
            self._add(self.buffer)
            self.buffer = b""

    def _add(self, raw: bytes) -> None:
        line = raw.decode("utf-8", "replace").rstrip("\r")
        self.lines.append(line)
        if self.stream:
            print(f"[rank {self.rank}] {line}", flush=True)


class _Progress:
    """A progress bar fed by ``report(step=..., total=...)`` records from rank 0."""

    def __init__(self):
        self.bar = None

    def update(self, record: dict) -> None:
        if record["rank"] != 0 or "step" not in record:
            return
        if self.bar is None:
            from tqdm.auto import tqdm  # optional: only when a progress bar is shown (it loads ipywidgets)

            self.bar = tqdm(total=record.get("total"), desc="rank 0", unit="step", leave=True)
        if record.get("total") is not None and self.bar.total != record["total"]:
            self.bar.total = record["total"]
        self.bar.n = int(record["step"]) + 1 if record.get("total") else int(record["step"])
        shown = {k: v for k, v in record.items()
                 if k not in ("rank", "time", "step", "total") and isinstance(v, (int, float))}
        self.bar.set_postfix({k: (f"{v:.4g}" if isinstance(v, float) else v) for k, v in shown.items()},
                             refresh=False)
        self.bar.refresh()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


_live: set = set()  # processes of launches in flight, killed if the interpreter exits


@atexit.register
def _kill_leftovers() -> None:
    for proc in list(_live):
        _kill(proc)


def _kill(proc) -> None:
    if proc.pid is None:
        return
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the rank and anything it started
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except (ProcessLookupError, OSError, AttributeError, ValueError):
        pass
    proc.join(5)
    _live.discard(proc)


def _start_rank(ctx, rank: int, target, make_args, stream: bool = False):
    """Start one rank process running ``target(*make_args(out_pipe, dump_pipe))``.

    The rank gets the write ends of two pipes (its output, its stacks on SIGUSR1); the parent keeps
    the read ends, wrapped in :class:`_RankOutput`. The rank is put in its own process group and
    registered so that it is killed if this interpreter exits. Returns (process, output, dump).
    """
    out_read, out_write = ctx.Pipe(duplex=False)
    dump_read, dump_write = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=target, name=f"workbench-rank-{rank}", args=make_args(out_write, dump_write))
    proc.start()
    _live.add(proc)
    try:
        os.setpgid(proc.pid, proc.pid)
    except OSError:
        pass
    out_write.close()
    dump_write.close()
    return proc, _RankOutput(rank, out_read, stream), _RankOutput(rank, dump_read, False)


def _collect_stacks(procs, dumps, ranks, below: str = "in _rank_main") -> dict[int, str]:
    """SIGUSR1 each unfinished rank; faulthandler writes its stacks to the rank's dump pipe.

    Frames from the one containing ``below`` downwards (the launcher's own) are dropped.
    """
    for r in ranks:
        try:
            os.kill(procs[r].pid, signal.SIGUSR1)
        except ProcessLookupError:
            pass
    deadline, quiet_since = time.monotonic() + 3.0, time.monotonic()
    for r in ranks:
        dumps[r].lines.clear()  # a live rank may have been asked before
    while time.monotonic() < deadline:
        got = any(dumps[r].read() for r in ranks)
        now = time.monotonic()
        if got:
            quiet_since = now
        elif now - quiet_since > 0.5 and all(dumps[r].lines for r in ranks):
            break
        time.sleep(0.05)
    stacks = {}
    for r in ranks:
        dumps[r].finish()
        # faulthandler prints innermost first: keep frames down to fn, drop the launcher's below it
        lines, skipping = [], False
        for line in dumps[r].lines:
            if not line.startswith(" "):  # a "Thread 0x... (most recent call first):" header
                skipping = False
            elif below in line:
                skipping = True  # everything below is the launcher and the parent's frames
            if not skipping:
                lines.append(line)
        stacks[r] = "\n".join(lines)
    return stacks


def _print_output(outputs) -> None:
    for out in outputs:
        if not out.stream:
            for line in out.lines:
                print(f"[rank {out.rank}] {line}")
    sys.stdout.flush()


def launch(fn: Callable[..., Any], world_size: int = 2, *, args: tuple = (), kwargs: dict | None = None,
           backend: str | None = None, timeout: float = 45.0, start_method: str | None = None,
           stream: bool = False, topology=None, device: str | None = None) -> LaunchResult:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks, each in an initialised process group.

    Returns the ranks' return values as a list (index = rank) with ``.records`` (from
    :func:`workbench.report`), ``.output`` and ``.elapsed``. Raises :class:`RankFailed` if a rank
    raises or dies, :class:`LaunchTimeout` if ranks are still running after ``timeout`` seconds.

    ``backend``: ``"gloo"`` (CPU, the default without enough GPUs) or ``"nccl"`` (one GPU per rank).
    ``start_method``: ``"fork"`` (default; works for notebook functions) or ``"spawn"`` (needs an
    importable, picklable ``fn``). ``stream=True`` prints rank output live instead of at the end.
    ``device``: where each rank computes (``runtime.device()``): None for the backend's own
    (a GPU per rank under NCCL, the CPU under gloo), or ``"cuda"`` under gloo to put the ranks on
    this machine's GPUs, round robin, so that many ranks share one GPU (NCCL refuses that) and
    messages carry CUDA tensors through gloo.
    ``topology``: an emulated cluster (a :class:`workbench.comm.Topology` or its spec string;
    default ``WORKBENCH_TOPOLOGY``): which ranks share a node, and how slow the links are.

    Under ``torchrun`` (``RANK``/``WORLD_SIZE`` set), and when called inside a rank, ``fn`` runs
    in this process in the existing group and a one-element list is returned.
    """
    kwargs = dict(kwargs or {})
    method = _validate(fn, world_size, args, kwargs, timeout, start_method)
    if runtime._context is not None or _under_torchrun():
        world = runtime._context.world_size if runtime._context is not None else int(os.environ["WORLD_SIZE"])
        return _launch_in_process(fn, world_size, args, kwargs, backend, timeout,
                                  _resolve_topology(topology, world), device)
    topology = _resolve_topology(topology, world_size)
    backend = runtime.check_backend(backend, world_size)
    runtime.check_device(device, backend)

    ctx = mp.get_context(method)
    restarted: list[str] = []
    for attempt in range(1 + RENDEZVOUS_RETRIES):
        try:
            result = _start_and_monitor(ctx, fn, world_size, args, kwargs, backend, timeout, stream, topology,
                                        device, retrying=attempt < RENDEZVOUS_RETRIES)
            result.restarts = attempt
            return result
        except RankFailed as failure:
            if not _failed_to_connect(failure):
                raise
            if attempt == RENDEZVOUS_RETRIES:
                raise RankFailed(failure.rank, failure.exc_type,
                                 f"{failure.exc_message} (the ranks were started again after the same failure: "
                                 f"{restarted[0]})", failure.remote_traceback, exitcode=failure.exitcode) from None
            restarted.append(failure.exc_message.splitlines()[0][:200])
            log.info("rank %d could not connect to its peers while joining the process group (%s): "
                     "starting the ranks again", failure.rank, restarted[0])
    raise AssertionError("unreachable")


# gloo connects every pair of ranks (connectFullMesh) when the process group is made; on a machine
# with far more busy processes than cores a connection is now and then closed during that handshake
# (gloo itself retries connections since pytorch/gloo#413). No user code has run yet, so the launch
# can start its ranks again from a fresh rendezvous, as torchrun restarts its workers
# (--max-restarts); once, so a failure that repeats is reported. The restart is logged (INFO, logger
# "workbench.launch") and counted in LaunchResult.restarts rather than warned about: nothing the
# user asked for failed, and a warning on a notebook's stderr would make its stored output differ.
RENDEZVOUS_RETRIES = 1


def _failed_to_connect(failure: RankFailed) -> bool:
    """Whether ``failure`` is gloo failing to connect the ranks while the process group was made."""
    return "connectFullMesh" in failure.exc_message and "init_group" in failure.remote_traceback


def _start_and_monitor(ctx, fn, world_size, args, kwargs, backend, timeout, stream, topology, device,
                       retrying: bool = False) -> LaunchResult:
    """Start ``world_size`` ranks running ``fn`` and wait for them (see :func:`launch`)."""
    rendezvous = tempfile.TemporaryDirectory(prefix="workbench-launch-")
    store_path = os.path.join(rendezvous.name, "store")
    queue = ctx.Queue()
    procs, outputs, dumps = [], [], []
    start = time.monotonic()
    try:
        for r in range(world_size):
            proc, output, dump = _start_rank(
                ctx, r, _rank_main, lambda out, dump, r=r: (
                    r, world_size, store_path, backend, fn, tuple(args), kwargs, queue, out, dump, timeout + 60, topology,
                    device),
                stream)
            procs.append(proc)
            outputs.append(output)
            dumps.append(dump)
        return _monitor(procs, outputs, dumps, queue, timeout, start, retrying)
    finally:
        for proc in procs:
            if proc.is_alive() or proc.exitcode is None:
                _kill(proc)
            else:
                proc.join(1)
                _live.discard(proc)
        for out in outputs + dumps:
            out.conn.close()
        queue.close()
        queue.cancel_join_thread()
        rendezvous.cleanup()


# A rank that dies breaks its peers' connections, and they fail too, a moment later, with errors
# like these. The parent reports the rank that failed first for a reason of its own.
_KNOCK_ON = ("Connection closed by peer", "Connection reset by peer", "Broken pipe", "gloo/transport",
             "NCCL communicator was aborted", "Socket Timeout")


def _root_cause(errors: list[RankFailed], died: dict[int, int]) -> RankFailed:
    """Pick the failure to report: an error of the rank's own, else a rank that died, else the first."""
    own = [e for e in errors if not any(marker in e.exc_message for marker in _KNOCK_ON)]
    if own:
        return own[0]
    if died:
        rank = min(died)
        code = died[rank]
        why = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return RankFailed(rank, "ProcessExited", f"rank process {why} without returning a result", "",
                          exitcode=code)
    return errors[0]


def _drain_messages(queue, results: dict, records: list, errors: list, progress: _Progress) -> None:
    """Take every message the ranks have queued, waiting up to 20 ms for the first: records (fed to the
    progress bar), results (unpickled, by rank) and errors (as :class:`RankFailed`)."""
    try:
        kind, rank, payload = queue.get(timeout=0.02)
        while True:
            if kind == "record":
                records.append(payload)
                progress.update(payload)
            elif kind == "result":
                results[rank] = pickle.loads(payload)
            elif kind == "error":
                errors.append(RankFailed(rank, *payload))
            kind, rank, payload = queue.get_nowait()
    except Exception:  # noqa: BLE001 - queue.Empty: nothing more for now
        pass


def _read_outputs(outputs) -> None:
    """Read what the ranks printed, waiting up to 20 ms for any pipe to have something."""
    open_fds = [o.fd for o in outputs if o.open]
    ready, _, _ = select.select(open_fds, [], [], 0.02) if open_fds else ([], [], [])
    for out in outputs:
        if out.fd in ready:
            out.read()


def _judge_trouble(procs, results: dict, errors: list, first_trouble: float | None,
                   now: float) -> tuple[float | None, RankFailed | None]:
    """``(first_trouble, failure)``: when trouble (an error, a rank that died, one that exited 0 without
    its result) was first seen, and the failure to report once it is time, else None.

    Trouble is not judged at once: a rank that dies breaks its peers, whose errors and exits follow a
    moment later, and the message of a rank whose exit was seen first may still be in the queue's pipe. The
    root cause is picked once every rank has answered or exited and 0.25 s passed, or after 1 s
    regardless; with no error or death to report, a rank that exited 0 without its result is
    reported after 2 s."""
    reported = {e.rank for e in errors}
    died = {r: p.exitcode for r, p in enumerate(procs)
            if p.exitcode not in (None, 0) and r not in reported and r not in results}
    silent = [r for r, p in enumerate(procs) if p.exitcode == 0 and r not in results]
    if not (errors or died or silent):
        return first_trouble, None
    first_trouble = first_trouble or now
    settled = all(r in results or r in reported or procs[r].exitcode is not None for r in range(len(procs)))
    if (settled and now - first_trouble > 0.25) or now - first_trouble > 1.0:
        if errors or died:
            return first_trouble, _root_cause(errors, died)
        if now - first_trouble > 2.0:  # exited 0 but its result never came
            return first_trouble, RankFailed(silent[0], "ProcessExited",
                                             "rank process exited without returning a result", "", exitcode=0)
    return first_trouble, None


def _time_out(procs, outputs, dumps, results: dict, timeout: float) -> None:
    """The deadline passed: take the unfinished ranks' stacks, kill every rank, show their output and
    raise :class:`LaunchTimeout` with the stacks."""
    unfinished = [r for r in range(len(procs)) if r not in results]
    stacks = _collect_stacks(procs, dumps, unfinished)
    for proc in procs:
        _kill(proc)
    for out in outputs:
        out.finish()
    _print_output(outputs)
    raise LaunchTimeout(timeout, stacks)


def _monitor(procs, outputs, dumps, queue, timeout, start, retrying: bool = False) -> LaunchResult:
    """Collect the ranks' messages, output and exits until all returned, one failed or ``timeout``
    passed. ``retrying``: a failure to connect will be retried, so the ranks' output (gloo's own
    error lines) is not printed for it: the warning says what happened."""
    world_size = len(procs)
    results: dict[int, Any] = {}
    records: list[dict] = []
    progress = _Progress()
    errors: list[RankFailed] = []
    first_trouble: float | None = None  # when the first error or unexplained exit was seen
    failure: RankFailed | None = None
    deadline = start + timeout
    try:
        while True:
            _drain_messages(queue, results, records, errors, progress)  # 1. messages from the ranks
            _read_outputs(outputs)  # 2. what the ranks printed
            # 3. who has finished, who has died
            if len(results) == world_size:
                break
            now = time.monotonic()
            first_trouble, failure = _judge_trouble(procs, results, errors, first_trouble, now)
            if failure is not None:
                break
            if now > deadline:
                _time_out(procs, outputs, dumps, results, timeout)
    except KeyboardInterrupt:
        for proc in procs:
            _kill(proc)
        raise
    finally:
        progress.close()

    if failure is not None:
        procs[failure.rank].join(1)  # let it flush its last output
        for proc in procs:
            _kill(proc)
    else:
        for proc in procs:
            proc.join(10)
    for out in outputs:
        out.finish()
    if not (failure is not None and retrying and _failed_to_connect(failure)):
        _print_output(outputs)
    if failure is not None:
        raise failure
    return LaunchResult([results[r] for r in range(world_size)], records=records,
                        output={o.rank: "\n".join(o.lines) for o in outputs},
                        elapsed=time.monotonic() - start)


# ------------------------------------------------------------------------------ under torchrun

def _launch_in_process(fn, world_size, args, kwargs, backend, timeout, topology=None, device=None) -> LaunchResult:
    """Run ``fn`` in this process, as one rank of torchrun's group (or of an enclosing launch)."""
    start = time.monotonic()
    nested = runtime._context is not None
    if not nested:
        env_world = int(os.environ["WORLD_SIZE"])
        if env_world != world_size:
            warnings.warn(f"launch(world_size={world_size}) runs under torchrun with WORLD_SIZE={env_world}: "
                          f"torchrun's world size wins", stacklevel=3)
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", env_world))
        if not dist.is_initialized():
            backend = runtime.check_backend(backend, env_world, local_world_size=local_world)
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
            dist.init_process_group(backend, timeout=timedelta(seconds=timeout + 60))
            atexit.register(lambda: dist.is_initialized() and runtime.destroy_process_group())
        gloo_threads.demote_loop_threads()
        backend = dist.get_backend()
        local = int(os.environ.get("LOCAL_RANK", 0))
        runtime._set_context(runtime._RankContext(
            rank=dist.get_rank(), world_size=dist.get_world_size(), local_rank=local, backend=backend,
            device=runtime.rank_device(backend, device, local)))
    if topology is not None:
        if emulation.current() != topology:  # every rank sees the same topology: all call emulate
            emulation.emulate(topology)
    ctx = runtime._context
    first_record = len(ctx.records)
    try:
        value = fn(*args, **kwargs)
    except Exception as e:
        tb = "".join(traceback.format_exception(type(e), e, e.__traceback__.tb_next or e.__traceback__))
        raise RankFailed(ctx.rank, _exception_name(e), str(e), tb) from e
    return LaunchResult([value], records=ctx.records[first_record:], elapsed=time.monotonic() - start)
