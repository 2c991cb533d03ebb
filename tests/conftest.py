"""Test session set-up: what every launched rank would otherwise import again.

The ranks a test launches are forked from this process (a pytest worker). The first optimizer a
rank builds imports ``torch._dynamo`` (about a second of CPU per rank), and the first DDP or FSDP
PyTorch's parallel modules; :func:`workbench.apps.train.preload` does it once here, so every rank
forked afterwards inherits it, as the lessons do in their first cell. It runs in a process that
runs tests (a pytest-xdist worker, or pytest without workers), not in the xdist controller, which
only hands tests out.
"""
import pytest

from workbench.apps.train import preload


@pytest.fixture(scope="session", autouse=True)
def _preloaded():
    preload()


# Files whose tests take longest, started first: with ``-n 2 --dist loadfile`` pytest-xdist hands
# out whole files in collection order, so a long file collected last (the lessons, after every unit
# test) runs alone at the end while the other worker idles. Longest first evens the two workers
# out; within a file the order is kept (a notebook's cells run in order in one kernel).
LONGEST_FIRST = ("tests/test_notebooks.py", "notebooks/05_pipeline_parallel.ipynb",
                 "notebooks/08_choosing_a_strategy.ipynb", "notebooks/07_3d_parallelism_and_topology.ipynb",
                 "notebooks/04b_memory_levers.ipynb", "notebooks/06_tensor_parallel.ipynb")


def pytest_collection_modifyitems(session, config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item):
        path = item.nodeid.split("::")[0]
        return rank.get(path, len(rank))

    items.sort(key=key)   # stable: each file's own order is kept
