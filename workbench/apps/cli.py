"""The ``workbench`` command.

``workbench compare``            the main job: every registered strategy on one model, one report
``workbench bench NAME [...]``   a benchmark; NAME is a module ``workbench.apps.bench.NAME`` exposing
                                 ``add_arguments(parser)`` and ``main(args) -> int``
``workbench advise [...]``       choose the strategy for a model and a cluster (``workbench.advise.cli``)

Each sub-command lives in its own module so that a reader finds the code of a job by its name.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import workbench.apps.bench as bench
from workbench.apps import compare
from workbench.advise import cli as advise_cli


def _benchmarks() -> list[str]:
    return sorted(m.name for m in pkgutil.iter_modules(bench.__path__) if not m.name.startswith("_"))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="workbench", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("compare", help="train with every strategy and write a report")
    compare.add_arguments(p)
    p.set_defaults(run=compare.main)

    b = sub.add_parser("bench", help="run a benchmark (nccl-tests style tables against PyTorch)")
    bsub = b.add_subparsers(dest="benchmark", required=True)
    for name in _benchmarks():
        module = importlib.import_module(f"workbench.apps.bench.{name}")
        bp = bsub.add_parser(name, help=(module.__doc__ or "").strip().split("\n")[0])
        module.add_arguments(bp)
        bp.set_defaults(run=module.main)

    a = sub.add_parser("advise", help="predict memory and step time of every strategy for a model and a cluster, "
                                      "rank them and explain the choice")
    advise_cli.add_arguments(a)
    a.set_defaults(run=advise_cli.main)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
