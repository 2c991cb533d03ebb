"""What a run measures: throughput, model-state bytes, live memory by category, record tables.

* :class:`Throughput` -- samples/s and tokens/s over training steps, warm-up steps excluded.
* :func:`model_state_bytes` -- the bytes of parameters, gradients and optimizer state this rank
  holds right now, each storage counted once. It is the left side of the ZeRO formulas: with
  float32 Adam and psi parameters, DDP holds 4 psi + 4 psi + 8 psi = 16 psi bytes per rank,
  ZeRO-1 8 psi + 8 psi / N, ZeRO-2 4 psi + 12 psi / N, ZeRO-3 16 psi / N.
* :class:`MemoryMeter`, :func:`tag`, :func:`category` -- peak bytes of live tensors during a
  block, by category (see :mod:`workbench.measure.memory_meter` for how the CPU is measured).
* :func:`records_table` -- the records ranks send with ``workbench.report`` as rows for plots.
"""
from __future__ import annotations

import time
from typing import Iterable

import torch
import torch.nn as nn

from workbench.measure.memory_meter import CATEGORIES, MemoryMeter, Metered, category, format_bytes, storage_bytes, storages_of, tag

__all__ = ["Throughput", "model_state_bytes", "MemoryMeter", "Metered", "tag", "category", "CATEGORIES",
           "storages_of", "storage_bytes", "format_bytes", "records_table"]


def _storage_key(s: torch.UntypedStorage) -> tuple:
    return (s.device.type, s.device.index, s.data_ptr(), s.nbytes())


def model_state_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes of model state this rank holds: ``{"params", "grads", "optimizer", "total"}``.

    Each storage is counted once and in full, so tied weights (one tensor used twice), views,
    and parameters carved out of one flat buffer are not double counted, and the padding of a
    flat buffer is counted (it is held). A DTensor (FSDP2's sharded parameters) counts only
    its local shard. Buffers (e.g. running statistics) count as parameters. ``optimizer``:
    every tensor in its ``state`` (Adam: ``exp_avg``, ``exp_avg_sq`` and a 4-byte ``step``
    per parameter tensor), and the optimizer's own parameters (float32 master weights such as
    ZeRO's mixed-precision chunks; the same storages as the model's when there are none).
    Strategies hold more than ``.parameters()`` and ``.grad`` show: a module or optimizer with
    an ``_extra_model_state()`` method (DDP's gradient buckets, which outlive ``zero_grad``, and
    its 16-bit parameter copies; ZeRO's flat buffers and reduced gradient chunks) adds those
    tensors too. A storage used by two categories is counted in the first of params, grads,
    optimizer. A storage freed in place (``resize_(0)``, as mixed-precision copies are between
    steps) counts 0. ``total`` is the sum.

    With mixed precision and Adam (``psi`` parameters, ``N`` ranks) the ZeRO paper's
    ``2 + 2 + 12`` bytes give DDP ``16 psi``, ZeRO-1 ``4 psi + 12 psi / N``, ZeRO-2
    ``2 psi + 14 psi / N``, ZeRO-3 ``16 psi / N`` (see :mod:`workbench.parallel.mixed_precision`).
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model_state_bytes(model={type(model).__name__}): pass an nn.Module")
    if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"model_state_bytes(optimizer={type(optimizer).__name__}): pass a torch.optim.Optimizer or None")
    seen: set = set()

    def count(tensors: Iterable[torch.Tensor]) -> int:
        n = 0
        for t in tensors:
            for s in storages_of(t):
                key = _storage_key(s)
                if key not in seen:
                    seen.add(key)
                    n += s.nbytes()
        return n

    holders = [m for m in model.modules() if hasattr(m, "_extra_model_state")]
    if optimizer is not None and hasattr(optimizer, "_extra_model_state"):
        holders.append(optimizer)
    extra = {"params": [], "grads": []}
    for h in holders:   # what a strategy holds outside .parameters()/.grad (buckets, 16-bit copies)
        for key, tensors in h._extra_model_state().items():
            extra[key].extend(tensors)
    params = list(model.parameters())
    opt_params = [p for g in optimizer.param_groups for p in g["params"]] if optimizer is not None else []
    out = {"params": count(params + list(model.buffers()) + opt_params + extra["params"]),
           "grads": count([p.grad for p in params + opt_params if p.grad is not None] + extra["grads"]),
           "optimizer": 0}
    if optimizer is not None:
        out["optimizer"] = count(v for state in optimizer.state.values() for v in state.values()
                                 if isinstance(v, torch.Tensor))
    out["total"] = out["params"] + out["grads"] + out["optimizer"]
    return out


class Throughput:
    """Samples/s and tokens/s over training steps, the first ``warmup`` steps excluded.

    ::

        meter = Throughput(warmup=2)
        for step in range(steps):
            meter.start()
            train_step()
            meter.stop(samples=batch_size, tokens=batch_size * block_size)
        meter.tokens_per_s

    Rates are total work over total time of the counted steps (not a mean of per-step rates,
    which over-weights fast steps). Time with ``time.perf_counter``; on a GPU, pass
    ``sync=torch.cuda.synchronize`` so a step's kernels are finished when its clock stops.
    """

    def __init__(self, warmup: int = 1, sync=None):
        if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
            raise ValueError(f"Throughput(warmup={warmup!r}): must be a whole number of steps >= 0")
        self.warmup = warmup
        self.sync = sync
        self.step_times: list[float] = []  # every step, warm-up included
        self.counted: list[bool] = []
        self._samples = self._tokens = 0
        self._t0: float | None = None

    def start(self) -> None:
        if self.sync is not None:
            self.sync()
        self._t0 = time.perf_counter()

    def stop(self, samples: int, tokens: int = 0, count: bool = True) -> float:
        """End the step started by :meth:`start`; ``count=False`` leaves it out of the rates."""
        if self._t0 is None:
            raise RuntimeError("Throughput.stop() called without start()")
        if self.sync is not None:
            self.sync()
        dt = time.perf_counter() - self._t0
        self._t0 = None
        counted = count and len(self.step_times) >= self.warmup
        self.step_times.append(dt)
        self.counted.append(counted)
        if counted:
            self._samples += samples
            self._tokens += tokens
        return dt

    @property
    def seconds(self) -> float:
        """Time of the counted steps."""
        return sum(t for t, c in zip(self.step_times, self.counted) if c)

    @property
    def steps(self) -> int:
        return sum(self.counted)

    @property
    def samples_per_s(self) -> float:
        return self._samples / self.seconds if self.seconds > 0 else float("nan")

    @property
    def tokens_per_s(self) -> float:
        return self._tokens / self.seconds if self.seconds > 0 else float("nan")

    def summary(self) -> dict[str, float]:
        return {"steps": self.steps, "seconds": self.seconds, "samples_per_s": self.samples_per_s,
                "tokens_per_s": self.tokens_per_s}


def records_table(records: Iterable[dict], *fields: str) -> list[dict]:
    """Rows from ``workbench.report`` records: those having every one of ``fields``, in order,
    keeping ``rank``, ``time`` and the fields. ``records_table(result.records, "step", "loss")``
    gives the rows a loss curve is drawn from.
    """
    rows = []
    for r in records:
        if all(f in r for f in fields):
            rows.append({k: r[k] for k in ("rank", "time", *fields) if k in r} if fields else dict(r))
    return rows
