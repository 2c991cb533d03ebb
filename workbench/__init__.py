"""workbench: learn and measure distributed training, one readable file per idea.

Start here::

    import workbench

    def hello():
        return f"rank {workbench.rank()} of {workbench.world_size()} on {workbench.device()}"

    workbench.launch(hello, world_size=2)   # ['rank 0 of 2 on cpu', 'rank 1 of 2 on cpu']
"""
from workbench.ranks.launch import LaunchResult, LaunchTimeout, RankFailed, launch
from workbench.ranks.live import LiveRanks
from workbench.runtime import backend, device, everyone, local_rank, rank, report, smoke_test, world_size

__all__ = ["launch", "LaunchResult", "RankFailed", "LaunchTimeout", "LiveRanks",
           "rank", "world_size", "local_rank", "device", "backend", "report", "everyone", "smoke_test"]
__version__ = "0.1.0"


def load_ipython_extension(ipython):
    """``%load_ext workbench``: the ``%ranks``/``%%ranks`` magics (see workbench.ranks.magic)."""
    from workbench.ranks.magic import load_ipython_extension as load  # IPython only when a kernel asks

    load(ipython)


def unload_ipython_extension(ipython):
    from workbench.ranks.magic import unload_ipython_extension as unload

    unload(ipython)
