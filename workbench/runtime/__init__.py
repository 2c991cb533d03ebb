"""What a rank knows about itself: its number, the world size, its device, and how to report.

Every piece of the workbench asks these questions through this module, so the same code runs in a
rank started by :func:`workbench.launch` (fork or spawn from a notebook or script), in a process
started by ``torchrun``, or in a plain single process (rank 0 of a world of 1).

``report(**fields)`` is the one way a rank talks to the notebook while it runs: each call sends a
record (a dict with ``rank`` and ``time`` added) to the parent, which draws a progress bar and
keeps the records on the launch's result for plotting.

Importing this module also imports ``torch.distributed.nn.functional``, before any process group
exists. That torch module evaluates ``group=group.WORLD`` in its functions' default arguments when
it is imported, so imported after ``init_process_group`` it keeps the default group alive for good:
``destroy_process_group`` then cannot free it, and gloo's threads run into interpreter
finalization, where a thread letting go of a tensor aborts the process at exit (SIGABRT,
"terminate called without an active exception"), now and then, after a clean run. The first
``torch.optim`` optimizer of a process imports it (through ``torch._dynamo``), so every training
script would otherwise hit this.

:func:`destroy_process_group` is how a rank leaves its group. torch's DTensor caches what it
computed for a ``DeviceMesh`` (the mesh's topology, redistribution plans and planners, sharding
propagation keyed by specs that name the mesh) for the life of the process, and those entries hold
the mesh and, through it, its groups: a rank that ran torch's tensor parallelism or FSDP (the
lessons' reference runs) took gloo's threads into finalization the same way. It empties those
caches first.
"""
from __future__ import annotations

import gc
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.distributed as dist

if dist.is_available():
    import torch.distributed.nn.functional  # noqa: F401 -- before any group exists: see the docstring

BACKENDS = ("gloo", "nccl")


@dataclass
class _RankContext:
    """State of the current rank, set by the launcher in each rank process."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    backend: str | None = None
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    sink: Callable[[dict], None] | None = None  # where report() records go
    records: list = field(default_factory=list)  # used when there is no parent to send to


_context: _RankContext | None = None


def _set_context(ctx: _RankContext | None) -> None:
    global _context
    _context = ctx


def rank() -> int:
    """This process's rank in the default group (0 outside any launch)."""
    if _context is not None:
        return _context.rank
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def world_size() -> int:
    """Number of ranks in the default group (1 outside any launch)."""
    if _context is not None:
        return _context.world_size
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return int(os.environ.get("WORLD_SIZE", 1))


def local_rank() -> int:
    """This rank's number on its own machine (it picks the GPU under NCCL)."""
    if _context is not None:
        return _context.local_rank
    return int(os.environ.get("LOCAL_RANK", 0))


def device() -> torch.device:
    """The device this rank computes on: ``cuda:<local rank>`` under NCCL, else the CPU."""
    if _context is not None:
        return _context.device
    return torch.device("cpu")


def backend() -> str | None:
    """The process group's backend (``"gloo"`` or ``"nccl"``), or None outside a launch."""
    if _context is not None:
        return _context.backend
    if dist.is_available() and dist.is_initialized():
        return dist.get_backend()
    return None


def report(**fields: Any) -> None:
    """Send a progress record to the notebook, e.g. ``report(step=i, total=100, loss=l)``.

    ``step`` and ``total`` drive the progress bar; every other field is kept on the launch's
    result (``result.records``) for plotting. Tensors are turned into Python numbers.
    """
    record = {"rank": rank(), "time": time.time()}
    for key, value in fields.items():
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = value.item()
        record[key] = value
    ctx = _context
    if ctx is not None and ctx.sink is not None:
        ctx.sink(record)
    elif ctx is not None:
        ctx.records.append(record)


def gpu_count() -> int:
    """CUDA devices on this machine, counted without initialising CUDA in this process.

    ``torch.cuda.is_available()`` asks the CUDA runtime, which poisons ``fork``: a rank forked
    afterwards fails with "Cannot re-initialize CUDA in forked subprocess". ``device_count()``
    asks NVML first, which leaves the process fork-safe, so the launcher's parent uses only it.
    """
    return torch.cuda.device_count() if torch.backends.cuda.is_built() else 0


def default_backend(world_size: int) -> str:
    """NCCL when this machine has a GPU for every rank, gloo on the CPU otherwise."""
    if gpu_count() >= world_size and dist.is_nccl_available():
        return "nccl"
    return "gloo"


def check_backend(backend: str | None, world_size: int, *, local_world_size: int | None = None) -> str:
    """Validate ``backend=`` and return the backend to use."""
    if backend is None:
        return default_backend(local_world_size or world_size)
    if not isinstance(backend, str) or backend.lower() not in BACKENDS:
        raise ValueError(f"backend={backend!r} is not known: use 'gloo' (CPU) or 'nccl' (one GPU per rank), "
                         "or leave it None to choose by the hardware")
    backend = backend.lower()
    if backend == "nccl":
        need = local_world_size or world_size
        have = gpu_count()
        if have < need or not dist.is_nccl_available():
            raise ValueError(f"backend='nccl' needs one GPU per rank: {need} ranks on this machine but "
                             f"{have} CUDA device(s) found. Use backend='gloo' to run on the CPU.")
    return backend


def check_device(device: str | None, backend: str) -> None:
    """Validate ``device=`` of a launch (see :func:`rank_device`) before any rank starts."""
    if device is None:
        return
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not known: use 'cuda' (ranks on this machine's GPUs), 'cpu', "
                         "or None for the backend's own (NCCL: one GPU per rank; gloo: the CPU)")
    if device == "cuda" and gpu_count() == 0:
        raise ValueError("device='cuda' but this machine has no CUDA device: leave device=None to compute "
                         "on the CPU")
    if device == "cpu" and backend == "nccl":
        raise ValueError("device='cpu' cannot go with backend='nccl' (NCCL moves only CUDA tensors): use "
                         "backend='gloo' for CPU ranks")


def rank_device(backend: str, device: str | None, local_rank: int) -> torch.device:
    """The device a rank computes on: its own GPU under NCCL; under gloo the CPU, or with
    ``device="cuda"`` GPU ``local_rank % gpu_count()`` (ranks share GPUs round robin)."""
    if backend == "nccl":
        return torch.device("cuda", local_rank)
    if device == "cuda":
        return torch.device("cuda", local_rank % gpu_count())
    return torch.device("cpu")


def forget_torch_meshes() -> bool:
    """Empty torch's DTensor caches that hold a ``DeviceMesh`` (and so its process groups) for good:
    ``MeshTopoInfo.build_from_mesh``, ``_gen_transform_infos`` (whose docstring names
    ``cache_clear``), the redistribution planners', and the sharding propagator's (its tensor
    metadata's and its op schemas', which name their mesh). Private to torch, so each is looked up and
    skipped where this torch lacks it; they only cost recomputation if DTensor is used again.
    Returns whether any of them held something (DTensor is imported by training code that never
    makes a mesh, through ``torch._dynamo``: then they are empty)."""
    if "torch.distributed.tensor" not in sys.modules:   # DTensor never imported: nothing cached
        return False
    caches = []
    utils = sys.modules.get("torch.distributed.tensor._collective_utils")
    if utils is not None:
        caches.append(getattr(getattr(utils, "MeshTopoInfo", None), "build_from_mesh", None))
    held = 0
    plans = sys.modules.get("torch.distributed.tensor._redistribute")
    if plans is not None:
        caches.append(getattr(plans, "_gen_transform_infos", None))
        held += len(getattr(plans, "_planner_cache", ()))
        if callable(getattr(plans, "clear_redistribute_planner_cache", None)):
            plans.clear_redistribute_planner_cache()   # its planners hold their mesh
    prop = sys.modules.get("torch.distributed.tensor._sharding_prop")
    if prop is not None:   # an lru_cache on a method: shared by every propagator, keyed by op schemas
        caches.append(getattr(getattr(prop, "ShardingPropagator", None), "_propagate_tensor_meta_cached", None))
    for cache in caches:
        if hasattr(cache, "cache_clear"):
            held += cache.cache_info().currsize if hasattr(cache, "cache_info") else 1
            cache.cache_clear()
    try:
        from torch.distributed.tensor.debug import _clear_sharding_prop_cache
        _clear_sharding_prop_cache()
    except Exception:  # noqa: BLE001 - absent or changed in this torch: the ones above are what hold meshes
        pass
    return held > 0


def destroy_process_group() -> None:
    """Leave the default group and free it: torch's caches of meshes emptied first
    (:func:`forget_torch_meshes`), then ``torch.distributed.destroy_process_group``; where those
    caches held something, a garbage collection too (the meshes sit in reference cycles, which would
    hold their groups until the next one; a full collection walks every object torch created, so it
    is not paid where no mesh was made)."""
    meshes = forget_torch_meshes()
    dist.destroy_process_group()
    if meshes:
        gc.collect()


def limit_threads(threads: int = 1) -> None:
    """One intra-op thread per rank: two ranks on two cores must not fight over them.

    Called first thing in every rank, before any tensor work, so that a forked child of a parent
    that already used OpenMP never enters an OpenMP parallel region (which can hang after fork).
    """
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    torch.set_num_threads(threads)


def everyone(value: Any) -> list:
    """Every rank's ``value``, in rank order, on every rank (``torch.distributed.all_gather_object``;
    ``[value]`` in a single process without a process group).

    The way a function run by :func:`workbench.launch` hands back what all ranks saw: rank 0's
    return value then holds every rank's, so ``launch(fn)[0]`` is the whole picture. Bookkeeping
    outside any timed region (it pickles), not a collective to measure.
    """
    if not dist.is_initialized():
        return [value]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, value)
    return out


SMOKE_TEST_ENV = "WORKBENCH_SMOKE_TEST"


def smoke_test() -> bool:
    """Whether this run is a smoke test (``WORKBENCH_SMOKE_TEST=1``), as the test suite runs every
    lesson's script under torchrun: the lesson then takes its smallest sizes (one trial, the fewest
    steps and sleeps) so that every code path runs in seconds, and its check cell asserts what
    does not depend on sizes (parity, byte and call counts, formulas) but no timing claim, which
    a single short trial cannot carry. The notebooks run at full size under nbval (the same
    convention as Ray's and Optuna's ``SMOKE_TEST`` examples)."""
    return os.environ.get(SMOKE_TEST_ENV, "") not in ("", "0")
