"""ZeRO-1 and ZeRO-2: shard the optimizer state (and the gradients) over the data-parallel ranks.

Data parallelism keeps a full copy of the model state on every rank: with float32 Adam, ``4 psi``
bytes of parameters, ``4 psi`` of gradients and ``8 psi`` of Adam's two moments, ``16 psi`` in
all for ``psi`` parameters. But after the gradient all-reduce every rank performs the *same*
optimizer update. ZeRO (Rajbhandari et al. 2020) splits that work: rank ``r`` updates only
``1/N`` of the parameters, so it needs optimizer state (ZeRO-1) and reduced gradients (ZeRO-2)
only for that ``1/N``.

Flat shards
-----------
The parameters are grouped into buckets (the DDP buckets of :mod:`workbench.parallel.buckets`:
reverse parameter order, a small first bucket). Each bucket becomes one flat float buffer, padded
with zeros to a multiple of ``N``; the parameters are re-pointed at views of it
(``param.data = buffer[offset:offset + numel].view(shape)``), so the model runs unchanged. Rank
``r`` owns chunk ``r`` of every bucket::

    bucket 0:  [ lm_head.weight | ln_f.bias | ln_f.weight | ... | pad ]
               [   rank 0's chunk    |    rank 1's chunk    | ...     ]

and the inner optimizer (``optimizer_cls``, for example ``torch.optim.AdamW``) is built on those
chunks, one flat ``nn.Parameter`` per bucket that *aliases* the buffer: stepping it updates this
rank's slice of the real parameters in place. The update must be element-wise (SGD, Adam,
AdamW, ...), as in ZeRO and DeepSpeed: a chunk may start in the middle of a tensor.

One step
--------
::

    ZeRO-1 (step):      reduce-scatter each bucket's gradients -> this rank's chunk (averaged)
                        inner optimizer steps the chunk
                        all-gather each bucket's chunks back into the buffer (the parameters)
    ZeRO-2 (backward):  as each bucket's gradients are ready, copy them into a flat buffer, free
                        ``param.grad``, start an asynchronous reduce-scatter (overlapped with the
                        rest of backward); at the end of backward keep only the chunk
           (step):      inner optimizer steps the chunk; all-gather as in ZeRO-1

Communication per rank and step: reduce-scatter ``(N-1)/N psi`` + all-gather ``(N-1)/N psi`` =
``2 (N-1)/N psi`` elements, exactly DDP's ring all-reduce (which *is* a reduce-scatter followed
by an all-gather): the sharding is free in bandwidth.

Memory per rank (float32 Adam, ``K = 8`` bytes of state per parameter)::

    DDP      4 psi + 4 psi     + 8 psi       = 16 psi
    ZeRO-1   4 psi + 4 psi     + 8 psi / N   =  8 psi +  8 psi / N
    ZeRO-2   4 psi + 4 psi / N + 8 psi / N   =  4 psi + 12 psi / N

plus at most ``N - 1`` padding elements per bucket.

Mixed precision (``mp_policy=MixedPrecision(param_dtype=torch.bfloat16)``): the flat buffers,
hence the model's parameters and the gradients autograd produces, are 16-bit; each rank keeps a
float32 *master* copy of its chunk only, and the inner optimizer steps the masters::

    step:  reduce-scatter the 16-bit gradients (in reduce_dtype) -> chunk gradient
           cast it to float32 as the master's .grad (only for the duration of step)
           inner optimizer steps the float32 master chunk
           all-gather the master chunks cast to param_dtype into the 16-bit buffers

    ZeRO-1   2 psi + 2 psi     + (4 + 8) psi / N   =  4 psi + 12 psi / N
    ZeRO-2   2 psi + 2 psi / N + (4 + 8) psi / N   =  2 psi + 14 psi / N

(the paper's mixed-precision formulas; with ``reduce_dtype=torch.float32`` ZeRO-2's gradient
chunk is ``4 psi / N``). Wire bytes are half float32's.

Only element-wise optimizers can step a chunk that starts in the middle of a tensor: the
constructor refuses others (LBFGS's line search, Adafactor's row/column statistics, LAMB's
per-tensor trust ratio), after a probe that steps a small matrix whole and in two flat halves. ZeRO-3 shards the parameters as well:
:mod:`workbench.parallel.fsdp`. :func:`zero` builds any stage from one call.
"""
from __future__ import annotations

import math
import time
from numbers import Real
from typing import Iterable
import warnings

import torch
import torch.distributed as dist
from torch import nn

from workbench import comm
from workbench.parallel.buckets import ZERO_BUCKET_CAP_MB, assign_buckets
from workbench.parallel.ddp import DistributedDataParallel
from workbench.parallel.fsdp import FullyShardedDataParallel
from workbench.parallel.mixed_precision import MixedPrecision, cast_floats, resolve_policy

__all__ = ["ShardedOptimizer", "zero"]

MB = 1024 * 1024


class _FlatBucket:
    """Some parameters of one param group, living in one flat padded buffer; this rank's chunk."""

    def __init__(self, params: list[nn.Parameter], rank: int, world: int, dtype: torch.dtype | None = None):
        self.params = params
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.numel = sum(self.numels)
        self.shard_numel = math.ceil(self.numel / world)
        self.padded_numel = self.shard_numel * world
        self.world = world
        p0 = params[0]
        lo = rank * self.shard_numel
        self.master: nn.Parameter | None = None   # mixed precision: the float32 copy of this chunk
        if dtype is not None and dtype != p0.dtype:
            with torch.no_grad():
                flat = torch.zeros(self.padded_numel, dtype=p0.dtype, device=p0.device)
                torch.cat([p.detach().reshape(-1) for p in params], out=flat[:self.numel])
                self.master = nn.Parameter(flat[lo:lo + self.shard_numel].clone())
        self.buffer = torch.zeros(self.padded_numel, dtype=dtype or p0.dtype, device=p0.device)
        with torch.no_grad():
            for p, o, n in zip(params, self.offsets, self.numels):
                view = self.buffer[o:o + n].view_as(p)
                view.copy_(p.detach())
                p.data = view                    # the parameter now lives in the flat buffer
        self.shard = nn.Parameter(self.buffer[lo:lo + self.shard_numel])   # an alias, not a copy
        # what the inner optimizer steps: the float32 master (mixed precision) or the alias
        self.opt_param = self.master if self.master is not None else self.shard
        self.grad_shard: torch.Tensor | None = None   # mixed precision: the reduced chunk, reduce dtype
        # ZeRO-2 state of the current backward pass.
        self.grad_buffer: torch.Tensor | None = None
        self.ready = 0
        self.launched = False

    def chunks(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return list(flat.chunk(self.world))

    def flat_grad(self) -> torch.Tensor:
        """The parameters' gradients, back to back and padded (zeros for a missing gradient)."""
        flat = torch.zeros(self.padded_numel, dtype=self.buffer.dtype, device=self.buffer.device)
        for p, o, n in zip(self.params, self.offsets, self.numels):
            if p.grad is not None:
                flat[o:o + n].copy_(p.grad.reshape(-1))
        return flat


class ShardedOptimizer(torch.optim.Optimizer):
    """ZeRO-1 (and, with ``shard_gradients=True``, ZeRO-2) around any element-wise optimizer.

    ``ShardedOptimizer(model.parameters(), torch.optim.AdamW, lr=1e-3)`` on every rank of an
    identically initialised model: each rank keeps ``optimizer_cls`` state only for its chunk of
    the flat parameter buckets (see the module docstring), steps it with the averaged gradient,
    and all-gathers the updated chunks, so after ``step()`` every rank holds the same full
    parameters, equal to what one process would compute on the global batch.

    Arguments not forwarded to ``optimizer_cls``: ``process_group`` (the ranks to shard over,
    default all), ``shard_gradients`` (ZeRO-2: reduce-scatter gradients during backward and keep
    only this rank's chunk), ``bucket_cap_mb`` (bucket size, as in DDP; 5 rather than DDP's 25
    because with ZeRO-2 a bucket's full-size gradient buffer is the memory added while it waits
    for its last gradient, and with ZeRO-1 the temporary flat gradient of a step).

    ``param_groups`` are the inner optimizer's groups: one flat chunk per bucket as ``params``,
    and your hyper-parameters (changing ``lr`` there works, as for any optimizer). ``state`` is
    the local chunks' state. ``state_dict()`` is the *consolidated* state, in the format a plain
    ``optimizer_cls`` on the original parameters would produce: call
    :meth:`consolidate_state_dict` on every rank first (PyTorch's ``ZeroRedundancyOptimizer``
    contract). ``load_state_dict`` takes such a full state dict on every rank and keeps its chunk.

    ``mp_policy``: a :class:`~workbench.parallel.MixedPrecision`. The parameters handed in
    become ``param_dtype`` (views of 16-bit flat buffers; frozen ones are cast too), this rank
    keeps float32 masters of its chunks, which ``param_groups`` then hold, and gradients are
    reduced in ``reduce_dtype`` (see the module docstring). Floating inputs of your model's
    forward must be ``param_dtype`` too: :func:`zero` registers the casts for you.
    """

    def __init__(self, params: Iterable, optimizer_cls: type, *, process_group=None,
                 shard_gradients: bool = False, bucket_cap_mb: float = ZERO_BUCKET_CAP_MB, mp_policy=None, **kwargs):
        if isinstance(optimizer_cls, torch.optim.Optimizer) or not callable(optimizer_cls):
            raise TypeError(f"ShardedOptimizer(optimizer_cls={optimizer_cls!r}): pass an optimizer class such as "
                            "torch.optim.AdamW (not an instance), with its arguments as keywords (lr=1e-3), or a "
                            "function params -> optimizer")
        if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, Real) or not bucket_cap_mb >= 0:
            raise ValueError(f"ShardedOptimizer(bucket_cap_mb={bucket_cap_mb!r}): must be a number of MiB >= 0 "
                             "(25 is DDP's default)")
        if not isinstance(shard_gradients, bool):
            raise TypeError(f"ShardedOptimizer(shard_gradients={shard_gradients!r}): pass True (ZeRO-2) or False (ZeRO-1)")
        mp_policy = resolve_policy(mp_policy, "ShardedOptimizer")
        _check_element_wise(optimizer_cls, kwargs)
        if not dist.is_initialized():
            raise RuntimeError("ShardedOptimizer needs an initialised process group: run it inside "
                               "workbench.launch(fn, world_size=N) or under torchrun")
        self._building = True
        super().__init__(params, defaults=dict(kwargs))
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.shard_gradients = shard_gradients
        self.optimizer_cls = optimizer_cls
        self.mp_policy = mp_policy
        self._reduced = False   # gradients already reduced into the chunks for the coming step
        self.events: list[dict] | None = None  # set to [] to record a timeline of this rank

        # The original groups, as a plain optimizer would hold them (kept for state_dict()).
        self._original_groups = self.param_groups
        self.buckets: list[_FlatBucket] = []
        inner_groups = []
        cap = int(bucket_cap_mb * MB)
        for group in self._original_groups:
            params = [p for p in group["params"] if p.requires_grad]
            dtype = mp_policy.param_dtype if mp_policy is not None else None
            group_buckets = [_FlatBucket([params[i] for i in sorted(idx)], self.rank, self.world_size, dtype)
                             for idx in assign_buckets(params, cap)] if params else []
            if dtype is not None:
                for p in group["params"]:
                    if not p.requires_grad:   # frozen: computed with in param_dtype too
                        p.data = p.data.to(dtype)
            self.buckets.extend(group_buckets)
            hyper = {k: v for k, v in group.items() if k != "params"}
            inner_groups.append({"params": [b.opt_param for b in group_buckets], **hyper})
            group["_buckets"] = group_buckets
        self.optim = optimizer_cls(inner_groups, **kwargs)
        if not isinstance(self.optim, torch.optim.Optimizer):
            raise TypeError(f"ShardedOptimizer: optimizer_cls={optimizer_cls!r} returned {type(self.optim).__name__}, "
                            "not a torch.optim.Optimizer")
        # What users and metrics see: the chunks this rank steps, and their state.
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self.defaults = self.optim.defaults
        self._bucket_of: dict[nn.Parameter, tuple[_FlatBucket, int]] = {}
        for b in self.buckets:
            for slot, p in enumerate(b.params):
                self._bucket_of[p] = (b, slot)
        self._pending: list[tuple[_FlatBucket, torch.Tensor, object, float]] = []
        self._next_launch = 0
        self._callback_queued = False
        self._consolidated: dict | None = None
        if shard_gradients:
            for p in self._bucket_of:
                p.register_post_accumulate_grad_hook(self._on_grad_ready)
        self._building = False

    def add_param_group(self, param_group: dict) -> None:
        if not getattr(self, "_building", False):
            raise RuntimeError("ShardedOptimizer.add_param_group: the flat buckets are fixed at construction; "
                               "pass every param group to ShardedOptimizer(...) at once")
        super().add_param_group(param_group)

    # --------------------------------------------------------------- ZeRO-2: during backward
    def _on_grad_ready(self, param: nn.Parameter) -> None:
        """A gradient is complete: move it into its bucket's flat buffer and free ``param.grad``;
        launch the reduce-scatter of every bucket, in order, whose gradients are all there."""
        bucket, slot = self._bucket_of[param]
        if bucket.grad_buffer is None:
            bucket.grad_buffer = torch.zeros(bucket.padded_numel, dtype=bucket.buffer.dtype,
                                             device=bucket.buffer.device)
        o, n = bucket.offsets[slot], bucket.numels[slot]
        bucket.grad_buffer[o:o + n].add_(param.grad.reshape(-1))
        param.grad = None
        bucket.ready += 1
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)
        # Buckets go out in index order on every rank, so the collectives match across ranks.
        while self._next_launch < len(self.buckets) and \
                self.buckets[self._next_launch].ready == len(self.buckets[self._next_launch].params):
            self._launch_reduce_scatter(self.buckets[self._next_launch])
            self._next_launch += 1

    def _launch_reduce_scatter(self, bucket: _FlatBucket) -> None:
        flat = bucket.grad_buffer if bucket.grad_buffer is not None else bucket.flat_grad()
        if self.mp_policy is not None and self.mp_policy.reduce_dtype is not None:
            flat = flat.to(self.mp_policy.reduce_dtype)
        out = torch.empty(bucket.shard_numel, dtype=flat.dtype, device=flat.device)
        work = comm.reduce_scatter(out, bucket.chunks(flat), group=self.process_group, async_op=True)
        self._pending.append((bucket, out, work, time.perf_counter()))
        bucket.launched = True

    def finish_gradient_synchronization(self) -> None:
        """ZeRO-2: launch any bucket still waiting (a parameter unused in this backward counts as
        a zero gradient), wait for every reduce-scatter, and add each averaged chunk to the chunk's
        ``.grad``. Runs by itself at the end of backward; calling it again is a no-op."""
        if self.shard_gradients and any(b.ready for b in self.buckets):
            for bucket in self.buckets[self._next_launch:]:
                self._launch_reduce_scatter(bucket)
        self._wait_reductions()
        for bucket in self.buckets:
            bucket.grad_buffer, bucket.ready, bucket.launched = None, 0, False
        self._next_launch = 0
        self._callback_queued = False

    def _wait_reductions(self, keep: int = 0) -> None:
        """Wait for all reduce-scatters in flight but the last ``keep``; average into chunk grads."""
        pending, self._pending = self._pending[:len(self._pending) - keep], self._pending[len(self._pending) - keep:]
        for bucket, out, work, start in pending:
            work.wait()
            self._event("reduce-scatter", self.buckets.index(bucket), start, work)
            out.div_(self.world_size)
            if bucket.master is not None:   # mixed precision: keep the chunk until step() casts it
                bucket.grad_shard = out if bucket.grad_shard is None else bucket.grad_shard.add_(out)
            elif bucket.shard.grad is None:
                bucket.shard.grad = out
            else:
                bucket.shard.grad.add_(out)

    # --------------------------------------------------------------- the step
    @torch.no_grad()
    def step(self, closure=None):
        """Reduce-scatter the gradients (ZeRO-1; ZeRO-2 did it in backward), step this rank's
        chunks, all-gather the updated chunks into every rank's parameters."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if not self._reduced:
            self.reduce_gradients()
        self._reduced = False
        self.optim.step()
        for bucket in self.buckets:
            if bucket.master is not None:   # the float32 chunk gradient lives only for the step
                bucket.master.grad = None
                if not self.shard_gradients:   # ZeRO-2 keeps its gradient chunk until zero_grad, as in float32
                    bucket.grad_shard = None
            elif not self.shard_gradients:   # ZeRO-1 keeps full local gradients, not the reduced chunk
                bucket.shard.grad = None
        handles = []
        for i, bucket in enumerate(self.buckets):
            work = comm.all_gather(bucket.chunks(bucket.buffer), bucket.opt_param.detach().to(bucket.buffer.dtype),
                                   group=self.process_group, async_op=True)
            handles.append((i, work, time.perf_counter()))
        for i, work, start in handles:
            work.wait()
            self._event("all-gather", i, start, work)
        self._consolidated = None
        return loss

    @torch.no_grad()
    def reduce_gradients(self) -> None:
        """The first half of :meth:`step`: reduce-scatter the gradients (ZeRO-1; ZeRO-2 did it in
        backward) into this rank's chunks, and with mixed precision cast each chunk to float32
        as its master's ``.grad``. A loss scaler calls it to unscale and check the chunks before
        the update; ``step()`` then does not reduce again."""
        if self._reduced:
            return
        if self.shard_gradients:
            self.finish_gradient_synchronization()
        else:
            # One bucket's flat gradient is built while the previous one is reduced: at most two
            # temporary flat buffers are alive, never a second copy of every gradient.
            for bucket in self.buckets:
                self._launch_reduce_scatter(bucket)
                if len(self._pending) > 1:
                    self._wait_reductions(keep=1)
            self._wait_reductions()
        for bucket in self.buckets:
            if bucket.master is not None and bucket.grad_shard is not None:
                bucket.master.grad = bucket.grad_shard.to(bucket.master.dtype)
        self._reduced = True

    def discard_gradients(self) -> None:
        """Drop the reduced chunk gradients without stepping (a loss scaler's skipped step)."""
        for bucket in self.buckets:
            bucket.opt_param.grad = None
            if not self.shard_gradients:
                bucket.grad_shard = None
        self._reduced = False

    def _extra_model_state(self) -> dict[str, list[torch.Tensor]]:
        """For ``model_state_bytes``: the flat parameter buffers and the reduced gradient chunks
        waiting for ``step()`` (mixed precision keeps them outside any ``.grad``)."""
        return {"params": [b.buffer for b in self.buckets],
                "grads": [b.grad_shard for b in self.buckets if b.grad_shard is not None]}

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the full gradients (ZeRO-1) and the gradient chunks (both stages)."""
        for group in self._original_groups:
            for p in group["params"]:
                if p.grad is not None:
                    if set_to_none:
                        p.grad = None
                    else:
                        p.grad.zero_()
        self.optim.zero_grad(set_to_none=set_to_none)
        for bucket in self.buckets:
            bucket.grad_shard = None
        self._reduced = False

    # --------------------------------------------------------------- state dict
    @torch.no_grad()
    def consolidate_state_dict(self, to: int | None = 0) -> None:
        """Gather the full optimizer state (every rank must call this; it is a collective).

        ``to``: the rank that keeps it for :meth:`state_dict` (``None``: every rank)."""
        state: dict[int, dict] = {}
        index = 0
        groups = []
        for group in self._original_groups:
            buckets = group["_buckets"]
            per_param = {}
            for bucket in buckets:
                shard_state = self.optim.state.get(bucket.opt_param, {})
                full_state: dict[str, list] = {}
                for key in sorted(shard_state):
                    value = shard_state[key]
                    if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == bucket.shard_numel:
                        full = torch.empty(bucket.padded_numel, dtype=value.dtype, device=value.device)
                        comm.all_gather(list(full.chunk(self.world_size)), value.contiguous(), group=self.process_group)
                        full_state[key] = [full[o:o + n].view_as(p).clone()
                                           for p, o, n in zip(bucket.params, bucket.offsets, bucket.numels)]
                    else:   # a per-tensor value such as Adam's step count: the same on every rank
                        full_state[key] = [value.clone() if isinstance(value, torch.Tensor) else value
                                           for _ in bucket.params]
                for slot, p in enumerate(bucket.params):
                    per_param[p] = {key: values[slot] for key, values in full_state.items()}
            ids = []
            for p in group["params"]:
                if per_param.get(p):
                    state[index] = per_param[p]
                ids.append(index)
                index += 1
            groups.append({**{k: v for k, v in self.optim.param_groups[len(groups)].items() if k != "params"},
                           "params": ids})
        keep = to is None or to == self.rank
        self._consolidated = {"state": state, "param_groups": groups} if keep else None

    def state_dict(self) -> dict:
        """The full state from the last :meth:`consolidate_state_dict`, in the format of a plain
        ``optimizer_cls`` over the original parameters (so it loads into one, and back here)."""
        if self._consolidated is None:
            raise RuntimeError(f"ShardedOptimizer.state_dict() on rank {self.rank}: the state is sharded over "
                               f"{self.world_size} ranks; call optimizer.consolidate_state_dict(to={self.rank}) on "
                               "every rank first (after the last step), then state_dict() on that rank")
        return self._consolidated

    @torch.no_grad()
    def load_state_dict(self, state_dict: dict) -> None:
        """Load a full state dict (from :meth:`state_dict`, or from a plain ``optimizer_cls`` over
        the same parameters) on every rank: each rank keeps its chunk. No communication."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if groups is None or len(groups) != len(self._original_groups) or any(
                len(g["params"]) != len(o["params"]) for g, o in zip(groups, self._original_groups)):
            raise ValueError("ShardedOptimizer.load_state_dict: the state dict's param groups do not match this "
                             f"optimizer's ({[len(g['params']) for g in self._original_groups]} parameters per "
                             "group): load a state dict saved from an optimizer over the same parameters")
        full_state = state_dict["state"]
        inner_state, inner_groups, j = {}, [], 0
        for group, saved in zip(self._original_groups, groups):
            index_of = {p: i for p, i in zip(group["params"], saved["params"])}
            ids = []
            for bucket in group["_buckets"]:
                entries = [full_state.get(index_of[p], full_state.get(str(index_of[p]))) for p in bucket.params]
                if all(e is not None for e in entries):
                    chunk_state = {}
                    for key, first in entries[0].items():
                        if isinstance(first, torch.Tensor) and first.shape == bucket.params[0].shape \
                                and first.dim() > 0:
                            flat = torch.zeros(bucket.padded_numel, dtype=first.dtype)
                            for e, o, n in zip(entries, bucket.offsets, bucket.numels):
                                flat[o:o + n].copy_(e[key].reshape(-1))
                            lo = self.rank * bucket.shard_numel
                            chunk_state[key] = flat[lo:lo + bucket.shard_numel].clone()
                        else:
                            chunk_state[key] = first.clone() if isinstance(first, torch.Tensor) else first
                    inner_state[j] = chunk_state
                ids.append(j)
                j += 1
            inner_groups.append({**{k: v for k, v in saved.items() if k != "params"}, "params": ids})
        self.optim.load_state_dict({"state": inner_state, "param_groups": inner_groups})
        self.param_groups = self.optim.param_groups
        self.state = self.optim.state
        self._consolidated = None

    def _event(self, name: str, bucket: int, start: float, work=None) -> None:
        """Record ``{"rank", "lane", "name", "bucket", "start", "end"}`` when ``self.events`` is a
        list: a collective from when the communication thread began it to when it finished
        (``work.started``/``work.ended``; ``"issued"`` holds ``start``, when it was issued)."""
        if self.events is not None:
            event = {"rank": self.rank, "lane": "comm", "name": name, "bucket": bucket,
                     "start": start, "end": time.perf_counter()}
            if getattr(work, "started", None) is not None and getattr(work, "ended", None) is not None:
                event.update(start=work.started, end=work.ended, issued=getattr(work, "issued", None) or start)
            self.events.append(event)

    def __repr__(self) -> str:
        stage = 2 if self.shard_gradients else 1
        name = getattr(self.optimizer_cls, "__name__", type(self.optim).__name__)
        return (f"ShardedOptimizer(ZeRO-{stage}, {name}, world_size={self.world_size}, "
                f"buckets={len(self.buckets)}, local elements={sum(b.shard_numel for b in self.buckets)})")


# Optimizers whose update of one element reads other elements of the same tensor, with the reason.
_NOT_ELEMENT_WISE = {
    "LBFGS": "it takes a line search and curvature pairs over the whole gradient vector (and needs a closure)",
    "Adafactor": "its factored second moment keeps row and column statistics of each matrix; a flat chunk "
                 "has no rows or columns",
    "SparseAdam": "it updates sparse gradients of embedding rows, not flat dense chunks",
    "Muon": "it orthogonalises each weight matrix as a whole",
    "Lamb": "its trust ratio is the norm of a whole tensor",
    "LAMB": "its trust ratio is the norm of a whole tensor",
    "Shampoo": "its preconditioners are built from whole matrices",
}


def _check_element_wise(optimizer_cls, kwargs: dict) -> None:
    """Refuse an optimizer whose update is not element-wise, naming it and the reason.

    Known ones are refused by name; any other class is probed: two steps on a 4 x 6 matrix,
    and the same two steps on its 24 elements cut into two flat chunks of 12, must agree, as
    ZeRO's flat chunks (which may start mid-tensor) need. A probe that cannot run (the optimizer
    wants arguments we do not have) is skipped."""
    name = getattr(optimizer_cls, "__name__", type(optimizer_cls).__name__)
    why = _NOT_ELEMENT_WISE.get(name)
    if why is None:
        try:
            with torch.random.fork_rng():
                torch.manual_seed(0)
                whole = nn.Parameter(torch.randn(4, 6))
                halves = [nn.Parameter(t.clone()) for t in whole.detach().reshape(-1).chunk(2)]
                grads = [torch.randn(4, 6) for _ in range(2)]
            opt_whole = optimizer_cls([whole], **kwargs)
            opt_halves = optimizer_cls(halves, **kwargs)
            for g in grads:
                whole.grad = g.clone()
                for h, gh in zip(halves, g.reshape(-1).chunk(2)):
                    h.grad = gh.clone()
                opt_whole.step()
                opt_halves.step()
            diff = (whole.detach().reshape(-1) - torch.cat([h.detach() for h in halves])).abs().max().item()
        except Exception:   # a probe we cannot run says nothing
            return
        if diff <= 1e-6 * max(1.0, whole.detach().abs().max().item()):
            return
        why = (f"one step on a 4 x 6 matrix differs from the same step on its elements in two flat chunks "
               f"(by up to {diff:.2g}): its update of an element depends on other elements of the tensor")
    raise ValueError(f"ShardedOptimizer(optimizer_cls={name}): {name} is not element-wise: {why}. ZeRO-1/2 step "
                     "flat chunks of the parameters that may start in the middle of a tensor, so use an "
                     "element-wise optimizer (SGD, Adam, AdamW, RMSprop, ...), or shard with "
                     "FullyShardedDataParallel and a per-tensor optimizer on the full parameters")


def zero(module: nn.Module, optimizer_cls: type, stage: int, *, mp_policy: MixedPrecision | None = None,
         compute_dtype: torch.dtype | None = None, process_group=None,
         **optimizer_kwargs) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``(model, optimizer)`` for ZeRO stage 0 (plain DDP), 1, 2 or 3, so a sweep is one loop::

        for stage in range(4):
            model, optimizer = zero(GPT(config), torch.optim.AdamW, stage, lr=1e-3)

    stage 0: :class:`~workbench.parallel.ddp.DistributedDataParallel` and ``optimizer_cls``;
    1: the module and ``ShardedOptimizer``; 2: the same with ``shard_gradients=True``;
    3: :class:`~workbench.parallel.fsdp.FullyShardedDataParallel` and ``optimizer_cls`` on its
    shards. ``mp_policy``: a :class:`~workbench.parallel.MixedPrecision` for every stage (at
    stages 1-2 forward hooks on ``module`` cast floating inputs to ``param_dtype`` and outputs
    to ``output_dtype``). ``compute_dtype`` is deprecated: it means
    ``mp_policy=MixedPrecision(param_dtype=compute_dtype)``.
    """
    if isinstance(stage, bool) or not isinstance(stage, int) or stage not in (0, 1, 2, 3):
        raise ValueError(f"zero(stage={stage!r}): ZeRO stages are 0 (DDP), 1 (optimizer state sharded), "
                         "2 (+ gradients) and 3 (+ parameters); pass one of 0, 1, 2, 3")
    mp_policy = resolve_policy(mp_policy, "zero")
    if compute_dtype is not None:
        if not isinstance(compute_dtype, torch.dtype) or not compute_dtype.is_floating_point:
            raise ValueError(f"zero(compute_dtype={compute_dtype!r}): pass a floating-point dtype such as "
                             "torch.bfloat16, or None")
        if mp_policy is not None:
            raise ValueError("zero(): pass mp_policy=MixedPrecision(...) or the deprecated compute_dtype, not both")
        warnings.warn("zero(compute_dtype=...) is deprecated: pass mp_policy=MixedPrecision(param_dtype=...)",
                      DeprecationWarning, stacklevel=2)
        mp_policy = MixedPrecision(param_dtype=compute_dtype)
    if stage == 0:
        model = DistributedDataParallel(module, process_group=process_group, mp_policy=mp_policy)
        return model, optimizer_cls(model.parameters(), **optimizer_kwargs)
    if stage in (1, 2):
        optimizer = ShardedOptimizer(module.parameters(), optimizer_cls, process_group=process_group,
                                     shard_gradients=stage == 2, mp_policy=mp_policy, **optimizer_kwargs)
        if mp_policy is not None:
            module.register_forward_pre_hook(
                lambda mod, args, kwargs: cast_floats((args, kwargs), mp_policy.param_dtype), with_kwargs=True)
            if mp_policy.output_dtype is not None:
                module.register_forward_hook(lambda mod, args, out: cast_floats(out, mp_policy.output_dtype))
        return module, optimizer
    model = FullyShardedDataParallel(module, mp_policy=mp_policy, process_group=process_group)
    return model, optimizer_cls(model.parameters(), **optimizer_kwargs)
