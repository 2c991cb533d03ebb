"""The ``%ranks`` / ``%%ranks`` IPython magics: live ranks driven cell by cell from a notebook.

::

    %load_ext workbench
    %ranks start 2                    # 2 ranks, each in an initialised process group
    %%ranks                           # this cell runs on every rank
    import torch, torch.distributed as dist, workbench
    x = torch.ones(3) * (workbench.rank() + 1)
    dist.all_reduce(x)
    x                                 # shown per rank: [rank 0] Out: tensor([3., 3., 3.])
    %ranks pull x                     # x = [x on rank 0, x on rank 1], CPU tensors, in the notebook
    %ranks stop

Commands (``%ranks help`` prints them):

=====================================================  ==============================================
``%ranks start N [--backend gloo] [--timeout 120]``    start N live ranks (stops a running group first)
``%%ranks [--ranks 0,2] [--timeout S]``                run the cell on every rank, or on a subset
``%ranks pull NAME [--ranks 0,2]``                     a list of NAME's value on each rank, into NAME
``%ranks push NAME [--ranks 0,2]``                     send the notebook's NAME to the ranks
``%ranks status``  /  ``%ranks stop``                  show the group  /  end it (always succeeds)
=====================================================  ==============================================

This file is only the notebook front end: parsing the magic's arguments and showing what the
ranks produced (text ``[rank k]``-prefixed in rank order, the last expression's value, and each
matplotlib figure a rank drew, rendered there with Agg and displayed here as a PNG). The ranks
themselves, their failures, hangs and restarts are :mod:`workbench.ranks.live`'s.
"""
from __future__ import annotations

import argparse
import shlex

from IPython.core.error import UsageError
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.display import Image, display

from workbench.ranks.live import CellResult, LiveRanks, print_results

__all__ = ["RanksMagics", "load_ipython_extension", "unload_ipython_extension"]

USAGE = """\
%ranks start N [--backend gloo|nccl] [--timeout SECONDS]   start N live ranks
%%ranks [--ranks 0,2] [--timeout SECONDS]                   run the cell on the ranks
%ranks pull NAME [--ranks 0,2]                              NAME = [value on each rank]
%ranks push NAME [--ranks 0,2]                              send the notebook's NAME to the ranks
%ranks status | stop | help"""


class RanksUsageError(UsageError, ValueError):
    """A ``%ranks`` line that cannot be understood (a ValueError, shown by IPython without a traceback)."""


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise RanksUsageError(f"%ranks: {message}\n\n{USAGE}")


def _rank_list(text: str) -> list[int]:
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--ranks {text!r} must be rank numbers separated by commas, e.g. 0,2")
    if not ranks:
        raise argparse.ArgumentTypeError(f"--ranks {text!r} names no rank: e.g. --ranks 0 or --ranks 0,2")
    return ranks


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = -1
    if value <= 0:
        raise argparse.ArgumentTypeError(f"--timeout {text!r} must be a positive number of seconds, e.g. 120")
    return value


def _count(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"N={text!r} must be a whole number of ranks >= 1, e.g. %ranks start 2")
    return int(text)


def _parsers():
    cell = _Parser(prog="%%ranks", add_help=False)
    cell.add_argument("--ranks", type=_rank_list, default=None)
    cell.add_argument("--timeout", type=_positive, default=None)
    line = _Parser(prog="%ranks", add_help=False)
    commands = line.add_subparsers(dest="command", parser_class=_Parser)
    start = commands.add_parser("start", add_help=False)
    start.add_argument("n", type=_count)
    start.add_argument("--backend", choices=("gloo", "nccl"), default=None)
    start.add_argument("--timeout", type=_positive, default=120.0)
    for name in ("pull", "push"):
        sub = commands.add_parser(name, add_help=False)
        sub.add_argument("name")
        sub.add_argument("--ranks", type=_rank_list, default=None)
    for name in ("stop", "status", "help"):
        commands.add_parser(name, add_help=False)
    return cell, line


def show_results(results: list[CellResult]) -> None:
    """Each rank in order: its printed lines, its last value, then its figures (as PNG images)."""
    print_results(results, show_figure=lambda png: display(Image(data=png, format="png")))


@magics_class
class RanksMagics(Magics):
    """``%ranks`` (commands) and ``%%ranks`` (run a cell on the ranks); one live group per kernel."""

    def __init__(self, shell=None):
        super().__init__(shell)
        self.group: LiveRanks | None = None
        self._cell_parser, self._line_parser = _parsers()

    def _running(self) -> LiveRanks:
        if self.group is None:
            raise RanksUsageError("%ranks: no ranks are running: start them first with %ranks start 2")
        return self.group

    @line_cell_magic
    def ranks(self, line: str, cell: str | None = None):
        """Run a cell on live ranks (``%%ranks``) or manage them (``%ranks start|stop|pull|push|status``)."""
        if cell is not None:
            args = self._cell_parser.parse_args(shlex.split(line))
            self._running().run(cell, args.ranks, timeout=args.timeout, show=show_results)
            return None
        args = self._line_parser.parse_args(shlex.split(line) or ["status"])
        if args.command == "start":
            if self.group is not None:  # (also a group with a dead rank: its live ones must go)
                print(f"workbench: stopping the {self.group.world_size} running rank(s) first")
                self.stop()
            self.group = LiveRanks(args.n, backend=args.backend, timeout=args.timeout)
            print(f"workbench: {args.n} rank(s) running ({self.group.backend}, timeout {args.timeout:g} s); "
                  f"run cells on them with %%ranks")
        elif args.command == "stop":
            had = self.group.world_size if self.group is not None else 0
            self.stop()
            print(f"workbench: stopped {had} rank(s)" if had else "workbench: no ranks were running")
        elif args.command == "pull":
            values = self._running().pull(args.name, args.ranks)
            self.shell.user_ns[args.name] = values
            return values
        elif args.command == "push":
            if args.name not in self.shell.user_ns:
                raise RanksUsageError(f"%ranks push {args.name}: the notebook has no variable {args.name!r}")
            self._running().push(args.name, self.shell.user_ns[args.name], args.ranks)
        elif args.command == "help":
            print(USAGE)
        else:
            print(repr(self.group) if self.group is not None else "workbench: no ranks (start: %ranks start 2)")
        return None

    def stop(self) -> None:
        if self.group is not None:
            self.group.stop()
            self.group = None


def load_ipython_extension(ipython) -> None:
    """``%load_ext workbench`` registers ``%ranks`` and ``%%ranks``."""
    magics = RanksMagics(ipython)
    ipython.register_magics(magics)
    ipython._workbench_ranks = magics


def unload_ipython_extension(ipython) -> None:
    magics = getattr(ipython, "_workbench_ranks", None)
    if magics is not None:
        magics.stop()
