"""Live ranks: a process group that stays up between notebook cells (the engine of ``%%ranks``).

:func:`workbench.launch` starts a fresh group for one function and tears it down. A
:class:`LiveRanks` group starts N ranks once and then runs one piece of source after another on
them, the way a notebook runs cells, so names a cell defines on a rank are there for the next
cell (the idea of ipyparallel's ``%%px``). The ranks are started and watched with the launcher's
own machinery (``launch._start_rank``, ``launch._rank_setup``): forked children, a ``FileStore``
rendezvous, one intra-op thread, output captured at the file-descriptor level and shown
``[rank k]``-prefixed in rank order, stacks on SIGUSR1, :class:`RankFailed` and
:class:`LaunchTimeout` for failures and hangs, death with the parent.

::

    parent (notebook kernel)                        rank r (a child process, alive between cells)
    ------------------------                        ---------------------------------------------
    request pipe  ---- ("exec", source) ------->   main thread: exec(source, namespace)
                  <--- value repr, PNG figures --   (figures from the Agg backend, then closed)
    control pipe  ---- "interrupt" ----------->    control thread: break the group's connections,
                                                    raise KeyboardInterrupt in the main thread
    output pipe   <--- fd 1 and 2 --------------    what the cell printed
    stack pipe    <--- faulthandler on SIGUSR1 --   where it is stuck (on timeout)

Interrupting a rank
-------------------
A rank blocked in a collective (its peer raised, or never called it) sits in C++ and cannot
see a Python signal until the call returns. Aborting a gloo group from another thread does not
wake it either; closing the group's TCP connections does: the blocked call fails with
"Connection closed" and the KeyboardInterrupt sent with it ends the cell. The rank's Python state
(every name it defined) is untouched, but its process group is now broken, and collectives on
the ranks that did *not* block are out of step with the ones that did, so after any interrupted
cell every rank leaves the old group and joins a new one through a fresh ``FileStore``
(milliseconds). Groups a cell made with ``dist.new_group`` do not survive this. (Under NCCL the
group's own ``abort`` is used.)

A rank that dies (a segfault, ``os._exit``, the OOM killer) takes its state with it: the whole
group is restarted, with a message saying so, and :class:`RankFailed` names the rank that died.
So is a rank that does not come back within a few seconds of being interrupted.

Costs: an empty cell is one request/reply round trip over pipes per rank; joining a fresh group
after an interrupt is one ``FileStore`` rendezvous; restarting the ranks is a new launch (one
machine's figures: ``docs/benchmarks/2026-11-27-figures-from-the-code-2vcpu.md``). Each figure is rendered to PNG in the rank and each pulled or
pushed value is pickled once (tensors travel as CPU tensors).
"""
from __future__ import annotations

import ast
import builtins
import io
import linecache
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import shutil
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from workbench import runtime
from workbench.ranks.launch import (LaunchTimeout, RankFailed, _collect_stacks, _exception_name, _kill,
                              _rank_setup, _root_cause, _start_rank, _validate, init_group)

__all__ = ["LiveRanks", "CellResult"]

GRACE = 5.0  # seconds an interrupted rank has to come back before the group is restarted
_INTERRUPTED = "KeyboardInterrupt"
_WHAT = {"exec": "%%ranks cell", "pull": "%ranks pull", "push": "%ranks push", "regroup": "joining a fresh group"}


@dataclass
class CellResult:
    """What one rank produced for one cell: printed lines, the last expression's repr, figures."""

    rank: int
    output: list[str] = field(default_factory=list)
    value: str | None = None
    figures: list[bytes] = field(default_factory=list)  # PNG images


def print_results(results: Sequence[CellResult], show_figure: Callable[[bytes], None] | None = None) -> None:
    """Each rank in order: its printed lines and last value, ``[rank k]``-prefixed, then its figures."""
    for res in results:
        for line in res.output:
            print(f"[rank {res.rank}] {line}")
        if res.value is not None:
            for i, line in enumerate(res.value.splitlines() or [""]):
                print(f"[rank {res.rank}] {'Out: ' if i == 0 else '     '}{line}")
        sys.stdout.flush()
        if show_figure is not None:
            for png in res.figures:
                show_figure(png)


# ------------------------------------------------------------------------------------ the rank

class _State:
    running = False  # a cell is executing: SIGINT raises KeyboardInterrupt only then
    interrupted = False


def _socket_inodes() -> set[int]:
    """The sockets this process has open now (a forked rank inherits the notebook kernel's)."""
    inodes = set()
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def _break_connections(inherited: set[int]) -> None:
    """Make every collective this rank is blocked in fail (see "Interrupting a rank").

    Sockets inherited from the parent (the kernel's own connections to the notebook) are never
    touched: shutting one down here would cut the notebook off from its kernel. Other TCP
    connections the rank's cells opened themselves are shut down with gloo's.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return
    if runtime.backend() == "nccl":
        for group in list(dist.distributed_c10d._world.pg_map):
            try:
                group.abort()
            except Exception:  # noqa: BLE001 - best effort: the rank is restarted if this fails
                pass
        return
    # gloo: shut down connected TCP sockets (gloo's pairs); listening sockets are left alone
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
            if not target.startswith("socket:[") or int(target[8:-1]) in inherited:
                continue
            sock = socket.socket(fileno=os.dup(int(name)))
        except (OSError, ValueError):
            continue
        try:
            if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                    and not sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN)):
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        finally:
            sock.close()


def _listen(control, state: _State, main_thread: int, inherited: set[int]) -> None:
    """The rank's control thread: on "interrupt", break the group and interrupt the main thread."""
    while True:
        try:
            control.recv_bytes()
        except (EOFError, OSError):
            return
        if state.running:
            state.interrupted = True
            _break_connections(inherited)
            signal.pthread_kill(main_thread, signal.SIGINT)


def _on_sigint(state: _State):
    def handler(signum, frame):
        if state.running:
            raise KeyboardInterrupt
    return handler


def _prepare_plotting_and_display() -> None:
    """Figures render off-screen (Agg); IPython's display machinery of the parent is forgotten."""
    os.environ["MPLBACKEND"] = "Agg"
    if "matplotlib.pyplot" in sys.modules:
        plt = sys.modules["matplotlib.pyplot"]
        plt.close("all")  # figures the notebook had open when this rank was forked are not this rank's
        plt.switch_backend("Agg")
    elif "matplotlib" in sys.modules:
        sys.modules["matplotlib"].use("Agg")
    if "IPython" in sys.modules:  # a forked kernel's shell would write to the parent's sockets
        from IPython.core.interactiveshell import InteractiveShell

        InteractiveShell.clear_instance()


def _take_figures() -> list[bytes]:
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    images = []
    for number in plt.get_fignums():
        buffer = io.BytesIO()
        plt.figure(number).savefig(buffer, format="png", bbox_inches="tight")
        images.append(buffer.getvalue())
    plt.close("all")
    return images


def _exec_cell(source: str, filename: str, namespace: dict) -> Any:
    """Run ``source`` like a notebook cell: return the value of a last bare expression."""
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    tree = ast.parse(source, filename)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr) and not source.rstrip().endswith(";"):
        last = ast.Expression(tree.body.pop().value)
    exec(compile(tree, filename, "exec"), namespace)
    if last is not None:
        return eval(compile(last, filename, "eval"), namespace)
    return None


def _to_cpu(value):
    if isinstance(value, torch.Tensor):
        return value.detach().cpu()
    if isinstance(value, (list, tuple)) and not hasattr(value, "_fields"):
        return type(value)(_to_cpu(v) for v in value)
    if isinstance(value, dict):
        return {k: _to_cpu(v) for k, v in value.items()}
    return value


def _serve(rank, world_size, store_path, backend, requests, control, out_conn, dump_conn, pg_timeout,
           parent_pid):
    """A live rank: set up like a launched rank, then answer requests until told to stop."""
    state = _State()
    inherited = _socket_inodes()  # before this rank makes any connection of its own
    try:
        _rank_setup(rank, world_size, store_path, backend, out_conn, dump_conn, pg_timeout,
                    sink=None, parent_pid=parent_pid)
        _prepare_plotting_and_display()
        signal.signal(signal.SIGINT, _on_sigint(state))
        threading.Thread(target=_listen, args=(control, state, threading.get_ident(), inherited),
                         daemon=True).start()
        requests.send_bytes(pickle.dumps((0, "ok", os.getpid())))
    except BaseException as e:  # noqa: BLE001 - a rank that cannot start says why
        requests.send_bytes(pickle.dumps((0, "error", _describe(e))))
        return
    namespace: dict = {"__name__": "__main__", "__builtins__": builtins}
    while True:
        try:
            request_id, op, *args = pickle.loads(requests.recv_bytes())
        except (EOFError, OSError):
            break
        if op == "stop":
            break
        state.interrupted = False
        try:
            state.running = True
            try:
                if op == "exec":
                    value = _exec_cell(args[0], f"<ranks cell {args[1]}>", namespace)
                    answer = (None if value is None else repr(value), _take_figures())
                elif op == "pull":
                    if args[0] not in namespace:
                        raise NameError(f"name {args[0]!r} is not defined")
                    answer = _pickle_for_pull(args[0], namespace[args[0]])
                elif op == "push":
                    namespace[args[0]] = pickle.loads(args[1])
                    answer = None
                elif op == "regroup":
                    _regroup(rank, world_size, args[0], backend, pg_timeout)
                    answer = None
                else:
                    raise ValueError(f"unknown request {op!r}")
            finally:
                state.running = False
            reply = ("ok", answer)
        except BaseException as e:  # noqa: BLE001 - every failure goes back to the notebook
            if op == "exec":
                _take_figures()  # a failed cell's figures are dropped, not carried into the next
            reply = ("error", _describe(e, interrupted=state.interrupted))
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        try:
            requests.send_bytes(pickle.dumps((request_id, *reply)))
        except Exception as e:  # noqa: BLE001 - e.g. a value that cannot be pickled
            requests.send_bytes(pickle.dumps((request_id, "error", _describe(e))))
    try:
        runtime.destroy_process_group()
    except Exception:  # noqa: BLE001 - teardown is best effort
        pass


def _pickle_for_pull(name: str, value) -> bytes:
    try:
        return pickle.dumps(_to_cpu(value))
    except Exception as e:  # noqa: BLE001 - whatever pickle refuses, the learner can act on
        raise TypeError(f"{name}={type(value).__name__} cannot be pickled to send to the notebook ({e}): "
                        "pull tensors or plain Python objects, e.g. a dict of tensors") from None


def _regroup(rank, world_size, store_path, backend, pg_timeout) -> None:
    try:
        runtime.destroy_process_group()
    except Exception:  # noqa: BLE001 - the old group is broken on purpose
        pass
    init_group(rank, world_size, store_path, backend, pg_timeout)


def _describe(e: BaseException, interrupted: bool = False) -> tuple[str, str, str]:
    name = _INTERRUPTED if interrupted else _exception_name(e)
    tb = e.__traceback__
    while tb is not None and not tb.tb_frame.f_code.co_filename.startswith("<ranks cell"):
        tb = tb.tb_next  # start the traceback in the cell: the server's frames teach nothing
    text = "".join(traceback.format_exception(type(e), e, tb or e.__traceback__))
    return name, str(e), text


# ---------------------------------------------------------------------------------- the parent

def _failure(ranks: list[int], replies: dict, died: dict, stuck: list[int], missing_ok: bool) -> RankFailed | None:
    """The failure to raise once the ranks are quiet: a rank's own error (not an interrupt; with
    ``missing_ok`` the caller reads the errors itself), else a rank that died, else one that did not answer."""
    own = [RankFailed(r, *replies[r][1]) for r in ranks
           if r in replies and replies[r][0] == "error" and replies[r][1][0] != _INTERRUPTED]
    if own and not missing_ok:
        return _root_cause(own, died)
    if died:
        return _root_cause([], died)
    if stuck:
        return RankFailed(stuck[0], "Unresponsive", "the rank did not answer", "")
    return None


class LiveRanks:
    """N ranks that stay up between calls: ``run`` source on them, ``pull``/``push`` names, ``stop``.

    ``backend``: ``"gloo"`` or ``"nccl"`` (None: by the hardware). ``timeout``: seconds a request
    may run before :class:`LaunchTimeout` (with each rank's stack) and an interrupt.
    """

    def __init__(self, world_size: int = 2, *, backend: str | None = None, timeout: float = 120.0,
                 start_method: str | None = None):
        if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
            raise ValueError(f"world_size={world_size!r} must be a whole number >= 1 (2 on a 2-core machine)")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
            raise ValueError(f"timeout={timeout!r} must be a positive number of seconds, e.g. 120")
        self.world_size = world_size
        self.backend = runtime.check_backend(backend, world_size)
        self.timeout = float(timeout)
        self.start_method = _validate(_start, world_size, (), {}, timeout, start_method)
        self._procs: list = []
        self._cells = 0
        self._start()

    # ------------------------------------------------------------------ lifecycle
    @property
    def pids(self) -> list[int]:
        """The ranks' process ids, index = rank."""
        return [p.pid for p in self._procs]

    @property
    def running(self) -> bool:
        return bool(self._procs) and all(p.exitcode is None for p in self._procs)

    def _start(self) -> None:
        ctx = mp.get_context(self.start_method)
        self._dir = tempfile.mkdtemp(prefix="workbench-ranks-")
        self._stores = 0
        self._request_id = 0
        store = self._new_store()
        self._procs, self._outputs, self._dumps, self._requests, self._controls = [], [], [], [], []
        for r in range(self.world_size):
            mine, theirs = ctx.Pipe(duplex=True)
            control_read, control_write = ctx.Pipe(duplex=False)
            proc, output, dump = _start_rank(
                ctx, r, _serve, lambda out, dump, r=r: (
                    r, self.world_size, store, self.backend, theirs, control_read, out, dump,
                    self.timeout + 60, os.getpid()))
            theirs.close()
            control_read.close()
            self._procs.append(proc)
            self._outputs.append(output)
            self._dumps.append(dump)
            self._requests.append(mine)
            self._controls.append(control_write)
        try:
            self._wait(list(range(self.world_size)), self.timeout, "start")
        except BaseException:
            self.stop()
            raise

    def _new_store(self) -> str:
        self._stores += 1
        return os.path.join(self._dir, f"store-{self._stores}")

    def stop(self) -> None:
        """End every rank (politely, then by SIGKILL to its process group). Always succeeds."""
        for conn in getattr(self, "_requests", []):
            try:
                conn.send_bytes(pickle.dumps((0, "stop")))
            except (OSError, ValueError):
                pass
        deadline = time.monotonic() + 2.0
        for proc in self._procs:
            proc.join(max(0.0, deadline - time.monotonic()))
            _kill(proc)  # the rank's whole process group, even if it already exited
        for conn in getattr(self, "_requests", []) + getattr(self, "_controls", []):
            conn.close()
        for out in getattr(self, "_outputs", []) + getattr(self, "_dumps", []):
            out.conn.close()
        self._procs = []
        shutil.rmtree(getattr(self, "_dir", ""), ignore_errors=True)

    def restart(self, reason: str = "") -> None:
        """Stop the ranks and start fresh ones (their names are lost)."""
        self.stop()
        self._start()
        print(f"workbench: {reason + ': ' if reason else ''}restarted {self.world_size} fresh rank(s) "
              f"(names defined in earlier cells are gone)")
        sys.stdout.flush()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.stop()

    def __repr__(self):
        state = "running" if self.running else "stopped"
        return f"LiveRanks(world_size={self.world_size}, backend={self.backend!r}, {state}, pids={self.pids})"

    # ------------------------------------------------------------------ requests
    def _ensure_running(self) -> None:
        """Refuse if stopped; restart, saying why, if a rank died since the last request."""
        if not self._procs:
            raise RuntimeError("the ranks are not running: start them with LiveRanks(...) or %ranks start N")
        for proc in self._procs:
            if proc.exitcode is None and _is_zombie(proc.pid):
                proc.join(2)  # killed, its threads still exiting: wait, so it is seen as dead now
        died = self._died()
        if died and self._request_id:  # (during the start, _wait reports the death itself)
            rank = min(died)
            code = died[rank]
            why = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
            self.restart(f"rank {rank} had died since the last cell ({why})")

    def _check_ranks(self, ranks) -> list[int]:
        self._ensure_running()
        if ranks is None:
            return list(range(self.world_size))
        ranks = sorted(set(ranks))
        bad = [r for r in ranks if isinstance(r, bool) or not isinstance(r, int) or not 0 <= r < self.world_size]
        if bad or not ranks:
            raise ValueError(f"ranks={ranks!r}: {bad or 'empty'} not in this group of {self.world_size} "
                             f"(ranks 0..{self.world_size - 1})")
        return ranks

    def run(self, source: str, ranks: Sequence[int] | None = None, *, timeout: float | None = None,
            show: Callable[[list[CellResult]], None] = print_results) -> list[CellResult]:
        """Run ``source`` on ``ranks`` (default all) like a notebook cell; ``show`` their results.

        Raises :class:`RankFailed` (a rank raised or died) or :class:`LaunchTimeout`; the output
        printed up to then is shown first.
        """
        ranks = self._check_ranks(ranks)
        compile(source, "<ranks cell>", "exec")  # a SyntaxError is raised here, before any rank runs it
        results = {r: CellResult(r) for r in ranks}
        self._cells += 1  # names the cell in tracebacks: <ranks cell 3>, the same on every rank
        self._wait(ranks, timeout or self.timeout, ("exec", source, self._cells), results, show=show)
        return [results[r] for r in ranks]

    def pull(self, name: str, ranks: Sequence[int] | None = None) -> list:
        """The value of ``name`` on each rank (index = position in ``ranks``), tensors on the CPU."""
        _check_name(name)
        ranks = self._check_ranks(ranks)
        replies = self._wait(ranks, self.timeout, ("pull", name), missing_ok=True)
        missing = [r for r in ranks if replies[r][0] == "error"]
        if missing:
            kind, message, _ = replies[missing[0]][1]
            if kind == "NameError":
                raise NameError(f"{name!r} is not defined on rank(s) {', '.join(map(str, missing))}: "
                                f"define it in a %%ranks cell first")
            if kind == "TypeError":
                raise TypeError(f"rank {missing[0]}: {message}")
            raise RankFailed(missing[0], *replies[missing[0]][1])
        return [pickle.loads(replies[r][1]) for r in ranks]

    def push(self, name: str, value: Any, ranks: Sequence[int] | None = None) -> None:
        """Set ``name`` to (a copy of) ``value`` on each of ``ranks`` (default all)."""
        _check_name(name)
        ranks = self._check_ranks(ranks)
        try:
            payload = pickle.dumps(_to_cpu(value))
        except Exception as e:  # noqa: BLE001
            raise TypeError(f"{name}={type(value).__name__} cannot be pickled to send to the ranks ({e}): "
                            "push plain Python objects or tensors") from None
        self._wait(ranks, self.timeout, ("push", name, payload))

    # ------------------------------------------------------------------ the monitor
    def _wait(self, ranks: list[int], timeout: float, request, results: dict | None = None,
              missing_ok: bool = False, show: Callable | None = None) -> dict:
        """Send ``request`` to ``ranks`` and collect their replies, handling failure and hangs.

        The ranks' output goes into ``results`` and is shown (``show``) before any message about
        an interrupt or a restart, and before the failure is raised.
        """
        self._ensure_running()
        if request != "start":
            self._send(ranks, request)
        replies: dict[int, tuple] = {}
        cause = self._await_replies(ranks, timeout, request, replies, results, missing_ok)
        pending = [r for r in ranks if r not in replies]
        interrupted = bool(pending)
        if pending and not self._died():
            self._interrupt(ranks, pending, replies, results)
        self._pump(ranks, replies, results, 0.0)
        for out in self._outputs:
            out.finish()  # a last line printed without a newline belongs to this cell too
        died = self._died()
        stuck = [r for r in ranks if r not in replies]
        failure = cause if cause is not None else _failure(ranks, replies, died, stuck, missing_ok)
        if request == "start":
            if failure is not None:
                raise failure
            return replies
        self._collect(results, ranks)
        if show is not None and results is not None:
            show([results[r] for r in ranks])
        self._recover(died, stuck, interrupted, pending)
        if failure is not None:
            raise failure
        return replies

    def _send(self, ranks: list[int], request) -> None:
        """Send ``request`` to ``ranks`` under a new request id (a late reply to an abandoned request
        carries an older one, and is recognised and dropped)."""
        self._request_id += 1
        for r in ranks:
            self._requests[r].send_bytes(pickle.dumps((self._request_id, *request)))

    def _await_replies(self, ranks: list[int], timeout: float, request, replies: dict, results: dict | None,
                       missing_ok: bool) -> BaseException | None:
        """Fill ``replies`` until every rank answered, a rank died, or (unless ``missing_ok``) a rank's
        error has had 0.25 s for the others' own errors to arrive: then None. Or the cause of stopping
        early: a :class:`LaunchTimeout` with the pending ranks' stacks after ``timeout`` seconds, or the
        ``KeyboardInterrupt`` of a user who interrupted the wait."""
        deadline = time.monotonic() + timeout
        trouble_since = None
        try:
            while True:
                self._pump(ranks, replies, results, 0.05)
                pending = [r for r in ranks if r not in replies]
                died = self._died()
                errors = [r for r in ranks if r in replies and replies[r][0] == "error"]
                if not pending or died:
                    return None
                if errors and not missing_ok:
                    trouble_since = trouble_since or time.monotonic()
                    if time.monotonic() - trouble_since > 0.25:  # the others' own errors arrive first
                        return None
                if time.monotonic() > deadline:
                    return self._timed_out(pending, timeout, request)
        except KeyboardInterrupt as e:
            return e

    def _timed_out(self, pending: list[int], timeout: float, request) -> LaunchTimeout:
        """The :class:`LaunchTimeout` of ``request``: where each pending rank's cell is stuck (its main
        thread's stack), and what the ranks are about to be (interrupted)."""
        stacks = _collect_stacks(self._procs, self._dumps, pending, below="in _exec_cell")
        return LaunchTimeout(timeout, {r: _main_thread(s) for r, s in stacks.items()},
                             what=_WHAT.get(request[0], "ranks request") if request != "start"
                             else "starting the ranks", outcome="The ranks were interrupted.")

    def _interrupt(self, ranks: list[int], pending: list[int], replies: dict, results: dict | None) -> None:
        """Ask the ``pending`` ranks to interrupt their request (their control threads break the group's
        connections), and collect replies for up to :data:`GRACE` seconds, or until a rank dies."""
        for r in pending:
            try:
                self._controls[r].send_bytes(b"interrupt")
            except OSError:
                pass
        end = time.monotonic() + GRACE
        while [r for r in ranks if r not in replies] and not self._died() and time.monotonic() < end:
            self._pump(ranks, replies, results, 0.05)

    def _recover(self, died: dict, stuck: list[int], interrupted: bool, pending: list[int]) -> None:
        """Make the group usable for the next request: restart it if a rank died or did not come back
        from an interrupt; every rank joins a fresh process group after an interrupt that all survived."""
        if died or stuck:
            what = (f"rank {min(died)} died" if died else
                    f"rank(s) {', '.join(map(str, stuck))} did not stop within {GRACE:g} s of an interrupt")
            self.restart(what)
        elif interrupted:
            self._regroup()
            print(f"workbench: interrupted rank(s) {', '.join(map(str, pending))}; every rank joined a fresh "
                  "process group (names are kept; groups made with dist.new_group are not)")

    def _pump(self, ranks, replies, results, wait_s) -> None:
        waitables = [self._requests[r] for r in ranks if r not in replies]
        waitables += [o.conn for o in self._outputs if o.open] + [p.sentinel for p in self._procs]
        mp.connection.wait(waitables, timeout=wait_s)
        for out in self._outputs:
            out.read()
        for r in ranks:
            if r not in replies and self._requests[r].poll():
                try:
                    request_id, *reply = pickle.loads(self._requests[r].recv_bytes())
                except (EOFError, OSError):
                    continue
                if request_id != self._request_id:
                    continue
                replies[r] = tuple(reply)
                if results is not None and replies[r][0] == "ok":
                    results[r].value, results[r].figures = replies[r][1]
        if results is not None:
            self._collect(results, ranks)

    def _collect(self, results, ranks) -> None:
        for r in ranks:
            if results is not None and r in results:
                results[r].output.extend(self._outputs[r].lines)
            self._outputs[r].lines.clear()

    def _died(self) -> dict[int, int]:
        return {r: p.exitcode for r, p in enumerate(self._procs) if p.exitcode is not None}

    def _regroup(self) -> None:
        self._wait(list(range(self.world_size)), self.timeout, ("regroup", self._new_store()))


def _start():  # a stand-in callable for launch's argument checks
    pass


def _is_zombie(pid: int) -> bool:
    """True if ``pid`` has exited and waits to be reaped (Linux; False where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except (OSError, IndexError):
        return False


def _check_name(name) -> None:
    if not isinstance(name, str) or not name.isidentifier():
        raise ValueError(f"name={name!r} is not a Python variable name: pass e.g. 'x' (no quotes in %ranks pull x)")


def _main_thread(stack: str) -> str:
    """Keep the thread that runs the cell; drop the rank's control and parent-watching threads."""
    sections, current = [], []
    for line in stack.splitlines():
        if line and not line.startswith(" ") and current:
            sections.append(current)
            current = []
        current.append(line)
    if current:
        sections.append(current)
    keep = [s for s in sections if not any(" in _listen" in l or " in _watch_parent" in l for l in s)]
    return "\n".join(line for s in keep or sections for line in s)
