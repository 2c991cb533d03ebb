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
