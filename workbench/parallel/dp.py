"""DataParallel: one process, one thread per replica. ``nn.DataParallel``'s design, written out.

Every forward pass does four things (``DataParallel.forward``)::

    input batch [B, ...] on the output device
      1. scatter       chunk dim 0 into len(device_ids) pieces, copy piece i to device i
      2. replicate     copy every parameter and buffer to every device (autograd-aware)
      3. parallel_apply run replica i on piece i, one Python thread each
      4. gather        copy every output back to the output device, concatenate along dim 0

and backward runs the same graph in reverse: gather's backward splits the output gradient,
each replica's backward runs (the autograd engine gives each device its own thread), and
replicate's backward *sums* the replicas' parameter gradients onto the original parameters.
So after ``loss.backward()`` the wrapped module's ``.grad`` equals that of the plain module on
the whole batch (for a loss that is a sum, or a mean over equal chunks).

Why it does not scale (the lesson of notebook 02):

* **The GIL.** The replicas are threads of one Python process. Tensor kernels release the GIL,
  but every Python line of every module's ``forward`` takes it, so the Python part of a step
  runs one replica at a time. Small layers (Python-bound) get no speed-up at all.
* **Work on the output device.** Every step re-broadcasts all ``P`` parameter bytes to the other
  ``n - 1`` devices (``(n-1) P`` bytes moved, from one device), gathers every output onto one
  device and sums every gradient back there. The output device holds the full batch's outputs
  and their gradients, so its memory is higher than the others' (for a language model the
  logits, ``B x T x V`` floats, usually dominate).
* **Replication every step.** The replicas are rebuilt each forward; in-place changes a replica
  makes to a buffer (BatchNorm running statistics) survive only on the first device, whose
  replica shares storage with the original module.

DistributedDataParallel (``workbench.parallel.ddp``) fixes all three: one process per replica,
parameters broadcast once, and only gradients cross between replicas (as an all-reduce).

On a CPU-only machine ``device_ids`` may name the CPU several times, e.g.
``DataParallel(model, device_ids=["cpu", "cpu"])``: the two replicas then run in two threads on
the same memory, which is exactly what lets the lesson measure the GIL.
"""
from __future__ import annotations

import os
import threading
import time
from typing import Any, Sequence

import torch
from torch import nn

__all__ = ["DataParallel", "scatter", "replicate", "parallel_apply", "gather"]


# ------------------------------------------------------------------------------------- devices

def _to_device(d: Any, argument: str) -> torch.device:
    if isinstance(d, torch.device):
        return d
    if isinstance(d, bool):
        raise TypeError(f"{argument}={d!r} is not a device: use an int (a CUDA device), 'cpu', 'cuda:1' "
                        "or a torch.device")
    if isinstance(d, int):
        return torch.device("cuda", d)
    if isinstance(d, str):
        try:
            return torch.device(d)
        except RuntimeError:
            pass
    raise TypeError(f"{argument}={d!r} is not a device: use an int (a CUDA device), 'cpu', 'cuda:1' "
                    "or a torch.device")


def _parse_devices(device_ids) -> list[torch.device]:
    if device_ids is None:
        if torch.cuda.is_available():
            return [torch.device("cuda", i) for i in range(torch.cuda.device_count())]
        return [torch.device("cpu")]
    if isinstance(device_ids, (str, int, torch.device)) or not isinstance(device_ids, Sequence):
        raise TypeError(f"device_ids={device_ids!r} must be a list of devices, e.g. [0, 1] or ['cpu', 'cpu']")
    if len(device_ids) == 0:
        raise ValueError("device_ids=[] names no device: pass at least one, e.g. ['cpu'] or [0]")
    devices = [_to_device(d, f"device_ids[{i}]") for i, d in enumerate(device_ids)]
    for d in devices:
        if d.type == "cuda":
            if d.index is None:
                raise ValueError(f"device_ids contains {str(d)!r} without an index: write 'cuda:0'")
            if not torch.cuda.is_available() or d.index >= torch.cuda.device_count():
                have = torch.cuda.device_count() if torch.cuda.is_available() else 0
                raise ValueError(f"device_ids names {d} but this machine has {have} CUDA device(s): "
                                 "on a CPU-only machine use device_ids=['cpu', 'cpu', ...]")
    return devices


def _same_device(a: torch.device, b: torch.device) -> bool:
    return a.type == b.type and (a.index or 0) == (b.index or 0)


# ------------------------------------------------------------------------------------- scatter

def scatter(inputs: Any, devices: Sequence[torch.device], dim: int = 0) -> list:
    """Split every tensor in ``inputs`` (nested tuples, lists, dicts) into ``len(devices)``
    chunks along ``dim`` and copy chunk i to device i. Non-tensors are repeated.

    ``Tensor.chunk`` may return fewer chunks than asked (a batch of 3 over 4 devices gives 3):
    the result then has fewer entries, and that many replicas run. Both ``chunk`` and ``to``
    are differentiable, so gradients flow back to the full input.
    """
    def split(obj):
        if isinstance(obj, torch.Tensor):
            return [c.to(d) for c, d in zip(obj.chunk(len(devices), dim), devices)]
        if isinstance(obj, (tuple, list)) and len(obj) > 0:
            rows = zip(*[split(o) for o in obj])  # zip stops at the shortest: fewer chunks, fewer replicas
            if hasattr(obj, "_fields"):  # a namedtuple
                return [type(obj)(*row) for row in rows]
            return [type(obj)(row) for row in rows]
        if isinstance(obj, dict) and len(obj) > 0:
            parts = {k: split(v) for k, v in obj.items()}
            n = min(len(p) for p in parts.values())
            return [type(obj)((k, p[i]) for k, p in parts.items()) for i in range(n)]
        return [obj for _ in devices]

    return split(inputs)


# ----------------------------------------------------------------------------------- replicate

def _broadcast_copies(devices, tensors) -> list[torch.Tensor]:
    """Device-major copies of ``tensors``; the first device, if it is theirs, gets views (free)."""
    out = []
    for i, d in enumerate(devices):
        for t in tensors:
            out.append(t.view_as(t) if i == 0 and _same_device(t.device, d) else t.to(d, copy=True))
    return out


class Broadcast(torch.autograd.Function):
    """Copy tensors to several devices; backward sums the copies' gradients (reduce-add).

    ``forward(devices, *tensors)`` returns ``len(devices) * len(tensors)`` outputs, device-major.
    On the tensors' own device the "copy" is a view (no memory), as in PyTorch, where
    ``broadcast_coalesced`` hands the source device the original tensors. Cost per call:
    ``(n-1) P`` bytes copied out of the source; backward adds ``n`` gradients per parameter.
    """

    @staticmethod
    def forward(ctx, devices, *tensors):
        ctx.source_devices = [t.device for t in tensors]
        return tuple(_broadcast_copies(devices, tensors))

    @staticmethod
    def backward(ctx, *grads):
        n_tensors = len(ctx.source_devices)
        summed = []
        for j, device in enumerate(ctx.source_devices):
            total = None
            for g in grads[j::n_tensors]:
                if g is None:
                    continue
                g = g.to(device)
                total = g.clone() if total is None else total.add_(g)
            summed.append(total)
        return (None, *summed)


def _shallow_copy(module: nn.Module) -> nn.Module:
    """A new module object sharing everything with ``module`` except its parameter, buffer and
    submodule tables (which ``replicate`` fills with the copies)."""
    replica = module.__new__(type(module))
    replica.__dict__ = module.__dict__.copy()
    replica._parameters = dict(module._parameters)
    replica._buffers = dict(module._buffers)
    replica._modules = dict(module._modules)
    replica._is_replica = True
    return replica


def replicate(module: nn.Module, devices: Sequence[torch.device]) -> list[nn.Module]:
    """One copy of ``module`` per device, whose parameters are outputs of :class:`Broadcast`.

    The replicas' parameters are not leaves: they are differentiable copies of the original
    parameters, so backward through any replica accumulates into the original ``.grad``.
    Buffers are copied without autograd. Tied parameters (one tensor reachable under two names)
    stay tied in every replica, because tensors are copied once each and looked up by identity.
    """
    modules = list(module.modules())
    params = list(module.parameters())  # unique tensors, tied weights once
    buffers = list(module.buffers())
    n = len(devices)

    grad_params = [p for p in params if p.requires_grad]
    param_copies: dict[int, list[torch.Tensor]] = {}
    if grad_params:
        flat = Broadcast.apply(list(devices), *grad_params) if torch.is_grad_enabled() else \
            _broadcast_copies(devices, [p.detach() for p in grad_params])
        for j, p in enumerate(grad_params):
            param_copies[id(p)] = [flat[i * len(grad_params) + j] for i in range(n)]
    for p in params:
        if not p.requires_grad:
            param_copies[id(p)] = [p if _same_device(p.device, d) and i == 0 else p.detach().to(d, copy=True)
                                   for i, d in enumerate(devices)]
    buffer_copies = {id(b): [b if i == 0 and _same_device(b.device, d) else b.detach().to(d, copy=True)
                             for i, d in enumerate(devices)] for b in buffers}

    replicas_of = {id(m): [_shallow_copy(m) for _ in range(n)] for m in modules}
    for m in modules:
        for i in range(n):
            r = replicas_of[id(m)][i]
            for key, p in m._parameters.items():
                # a plain attribute, not an nn.Parameter: a replica's parameter is a computed tensor
                r._parameters[key] = None if p is None else param_copies[id(p)][i]
            for key, b in m._buffers.items():
                r._buffers[key] = None if b is None else buffer_copies[id(b)][i]
            for key, child in m._modules.items():
                r._modules[key] = None if child is None else replicas_of[id(child)][i]
    return [replicas_of[id(module)][i] for i in range(n)]


# ------------------------------------------------------------------------------ parallel_apply

def _wait_until_gone(threads: Sequence[threading.Thread], timeout: float = 1.0) -> None:
    """Return once the operating system has ended each joined thread (``/proc/self/task/<tid>`` is
    gone), or after ``timeout``.

    ``Thread.join`` returns when the thread's Python work is done, before the thread itself has
    ended: its C++ thread-local state (torch's per-thread caches) is destroyed after that, and
    can hold a process-wide lock for a moment. A process forked in that moment -- a
    ``workbench.launch`` right after a DataParallel step -- copies the lock held, and its rank
    hangs in its first matrix multiply. Where there is no ``/proc`` this returns at once.
    """
    deadline = time.monotonic() + timeout
    for t in threads:
        while t.native_id is not None and os.path.exists(f"/proc/self/task/{t.native_id}"):
            if time.monotonic() > deadline:
                return
            time.sleep(1e-4)


def parallel_apply(replicas: Sequence[nn.Module], inputs: Sequence[tuple], kwargs: Sequence[dict],
                   devices: Sequence[torch.device]) -> list:
    """Run ``replicas[i](*inputs[i], **kwargs[i])`` in one thread each; return the outputs in order.

    Grad mode and autocast are thread-local in PyTorch, so each thread re-enters the caller's.
    An exception in any replica is re-raised here, naming the replica and its device.
    """
    grad_enabled = torch.is_grad_enabled()
    results: list[Any] = [None] * len(replicas)
    errors: list[BaseException | None] = [None] * len(replicas)

    def worker(i: int) -> None:
        try:
            with torch.set_grad_enabled(grad_enabled):
                if devices[i].type == "cuda":
                    with torch.cuda.device(devices[i]):
                        results[i] = replicas[i](*inputs[i], **kwargs[i])
                else:
                    results[i] = replicas[i](*inputs[i], **kwargs[i])
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread below
            errors[i] = e

    if len(replicas) == 1:
        worker(0)
    else:
        threads = [threading.Thread(target=worker, args=(i,), name=f"dp-replica-{i}") for i in range(len(replicas))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        _wait_until_gone(threads)
    for i, e in enumerate(errors):
        if e is not None:
            raise RuntimeError(f"DataParallel replica {i} on {devices[i]} raised {type(e).__name__}: {e}") from e
    return results


# -------------------------------------------------------------------------------------- gather

def gather(outputs: Sequence[Any], device: torch.device, dim: int = 0) -> Any:
    """Copy each replica's outputs to ``device`` and concatenate them along ``dim``.

    Scalars (0-dim tensors, such as a replica's mean loss) cannot be concatenated: they are
    stacked into a vector of one value per replica, as PyTorch does (take ``.mean()`` of it).
    """
    first = outputs[0]
    if isinstance(first, torch.Tensor):
        if first.dim() == 0:
            return torch.stack([o.to(device) for o in outputs])
        return torch.cat([o.to(device) for o in outputs], dim=dim)
    if first is None:
        return None
    if isinstance(first, dict):
        return type(first)((k, gather([o[k] for o in outputs], device, dim)) for k in first)
    if isinstance(first, (tuple, list)):
        parts = [gather([o[i] for o in outputs], device, dim) for i in range(len(first))]
        if hasattr(first, "_fields"):
            return type(first)(*parts)
        return type(first)(parts)
    raise TypeError(f"DataParallel cannot gather outputs of type {type(first).__name__}: return tensors, "
                    "or tuples/lists/dicts of tensors, from the module's forward")


# -------------------------------------------------------------------------------- the wrapper

class DataParallel(nn.Module):
    """Split each batch over ``device_ids``, run one replica per device in threads, gather.

    ``DataParallel(module, device_ids=None, output_device=None)`` with PyTorch's meaning:
    ``device_ids`` defaults to every CUDA device (or the CPU alone), ``output_device`` to
    ``device_ids[0]``; ``module`` must live on ``device_ids[0]``. On a CPU-only machine name the
    CPU several times to get several replicas in threads: ``device_ids=["cpu"] * 2``.

    ``.module`` is the wrapped model; its parameters receive the gradients.
    """

    def __init__(self, module: nn.Module, device_ids=None, output_device=None, dim: int = 0):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"module={module!r} must be an nn.Module")
        self.module = module
        self.device_ids = _parse_devices(device_ids)
        self.output_device = self.device_ids[0] if output_device is None else _to_device(output_device, "output_device")
        self.dim = dim
        src = self.device_ids[0]
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            if not _same_device(t.device, src):
                raise ValueError(f"DataParallel needs the module on device_ids[0]={src}, but {name!r} is on "
                                 f"{t.device}: call module.to({str(src)!r}) first")

    def forward(self, *inputs, **kwargs):
        if len(self.device_ids) == 1:
            return self.module(*inputs, **kwargs)
        scattered = scatter(inputs, self.device_ids, self.dim) if inputs else []
        scattered_kwargs = scatter(kwargs, self.device_ids, self.dim) if kwargs else []
        n = max(len(scattered), len(scattered_kwargs))
        if not inputs:
            scattered = [() for _ in range(n)]
        if not kwargs:
            scattered_kwargs = [{} for _ in range(n)]
        n = min(len(scattered), len(scattered_kwargs))
        devices = self.device_ids[:n]
        if n == 1:
            return self.module(*scattered[0], **scattered_kwargs[0])
        replicas = replicate(self.module, devices)
        outputs = parallel_apply(replicas, scattered[:n], scattered_kwargs[:n], devices)
        return gather(outputs, self.output_device, self.dim)
