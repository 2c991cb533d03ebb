"""DistributedDataParallel: one process per replica, gradients averaged by bucketed all-reduces.

The algorithm (Li et al., "PyTorch Distributed", VLDB 2020), as this file runs it::

    construction   broadcast every parameter and buffer from rank 0 (all replicas start equal)
                   group the trainable parameters into buckets (workbench.parallel.buckets):
                   reverse parameter order, ~bucket_cap_mb each, a 1 MB first bucket;
                   each bucket is one flat buffer and param.grad is a view into it
                   register a post-accumulate-grad hook on every trainable parameter
    forward        broadcast the buffers from rank 0 (BatchNorm statistics), run the module
    backward       autograd accumulates a gradient into param.grad (= the bucket view), then
                   calls our hook: when the bucket's last gradient has arrived, the bucket is
                   ready; ready buckets are launched *in bucket order* (every rank must issue
                   the same collectives in the same order): buffer /= world, async all-reduce
    end of backward  an autograd-engine callback waits for every all-reduce: param.grad now
                   holds the average over ranks, and optimizer.step() may run

Because the all-reduce of the first buckets runs while autograd still computes the gradients of
earlier layers, part of the communication is hidden behind backward (``overlap=True``). With
``overlap=False`` every bucket is launched after backward, the simple and slow baseline.

Cost per step (``psi`` parameters, 4-byte gradients, ``k`` buckets, ``p`` ranks, ring
all-reduce): ``2(p-1) k alpha + 2 (p-1)/p 4 psi beta``, minus whatever overlaps with backward.
Memory: the gradient buffers are the ``4 psi`` bytes of gradients themselves (``param.grad`` is
a view), so DDP adds no gradient memory over single-process training.

Everything crosses between ranks through ``workbench.comm`` (the ``algorithm`` argument picks
the all-reduce), so ``algorithm="ring"`` trains with the hand-written ring.

Features and their PyTorch names
--------------------------------
``no_sync()``             skip the all-reduce; gradients accumulate locally (in the buckets)
                          until a backward outside the context, which averages the sum.
``find_unused_parameters``  parameters that got no gradient are filled with zeros at the end of
                          backward, so their bucket can still be reduced; a parameter unused on
                          *every* rank keeps ``.grad = None`` (one extra small all-reduce tells
                          which), as PyTorch does. Without the flag an unused parameter is an
                          error that names it.
``finish_gradient_synchronization()``  waits for the all-reduces; runs by itself at the end of
                          backward, and is safe to call again.
``events``                per step and bucket (``time.perf_counter`` seconds), for the timeline
                          plot: ``ready`` (its last gradient arrived), ``start`` (its all-reduce
                          was issued), ``run_start``/``run_end`` (when the communication thread
                          ran it: ``workbench.comm.work``), ``end`` (completion first seen,
                          polled at every gradient hook, then waited for in order).

``mp_policy``              :class:`~workbench.parallel.MixedPrecision`: forward and backward run on
                          16-bit copies of the float32 parameters (cast at each forward, freed
                          at the end of backward, as PyTorch DDP's ``mixed_precision``), the
                          buckets hold 16-bit gradients and are reduced in ``reduce_dtype``
                          (half the bytes of float32), and the float32 parameters receive the
                          averaged gradient in float32: the optimizer steps float32 masters.
                          Held between steps: 4 + 4 + 8 = 16 psi bytes with Adam (the 16-bit
                          buckets are freed once their gradients reach the masters).

Bucket rebuild: as PyTorch's Reducer, the first synchronising backward records the order in
which gradients became ready, and the next forward re-assigns the buckets in that order (rank
0's order, broadcast), so that the bucket launched first is the one ready first even when the
module defines its layers in another order than it calls them. Like PyTorch, this happens once,
and not with ``find_unused_parameters=True`` (the order may change from step to step).
``rebuilt_bucket_sizes`` and ``rebuilt_per_bucket_param_indices`` report it in the terms of
PyTorch's ``_get_ddp_logging_data()``.

Differences from PyTorch's C++ ``Reducer``: a bucket holding a locally unused parameter waits
for the end of backward (PyTorch finds unused parameters by walking the graph after forward).
"""
from __future__ import annotations

import contextlib
import time
import weakref
from collections import deque
from numbers import Real

import torch
import torch.distributed as dist
from torch import nn
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from workbench import comm
from workbench.parallel.buckets import DDP_BUCKET_CAP_MB, FIRST_BUCKET_BYTES, MB, Bucket, assign_buckets
from workbench.parallel.mixed_precision import cast_floats, resolve_policy

__all__ = ["DistributedDataParallel"]

_now = time.perf_counter


def _check_arguments(module, bucket_cap_mb, overlap, find_unused_parameters, broadcast_buffers,
                     algorithm: str) -> None:
    """DistributedDataParallel's arguments, checked before anything is sent; and the process
    group, which must exist (the broadcast of the parameters is the constructor's first message)."""
    if not isinstance(module, nn.Module):
        raise TypeError(f"module={module!r} must be an nn.Module")
    if isinstance(bucket_cap_mb, bool) or not isinstance(bucket_cap_mb, Real) or not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb={bucket_cap_mb!r} must be a number of MiB >= 0 "
                         "(25 is PyTorch's default; 0 means one all-reduce per parameter)")
    for name, flag in (("overlap", overlap), ("find_unused_parameters", find_unused_parameters),
                       ("broadcast_buffers", broadcast_buffers)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name}={flag!r} must be True or False")
    known = getattr(comm, "ALGORITHMS", None)
    names = known.get("all_reduce", known) if isinstance(known, dict) else known
    names = tuple(names or ()) + getattr(comm, "TOPOLOGY_ALGORITHMS", {}).get("all_reduce", ())  # hierarchical
    if names is not None and algorithm not in names:
        raise ValueError(f"algorithm={algorithm!r} is not an all-reduce algorithm of workbench.comm: "
                         f"use one of {sorted(names)}")
    if not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("DistributedDataParallel needs a process group: create it inside a rank, "
                           "e.g. workbench.launch(train, world_size=2), or run the script under torchrun")


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves every rank with the averaged gradient.

    Arguments mirror ``torch.nn.parallel.DistributedDataParallel``:

    * ``bucket_cap_mb``: bucket size in MiB (25 by default; the first bucket is at most 1 MiB;
      0 gives one bucket, hence one all-reduce, per parameter).
    * ``overlap``: launch each bucket's all-reduce from the backward hooks as soon as it is
      ready (True), or all of them after backward (False).
    * ``algorithm``: the ``workbench.comm`` all-reduce algorithm (``"native"`` = torch.distributed).
    * ``process_group``: the group to average over (None: the default group).
    * ``find_unused_parameters``: allow parameters that receive no gradient in a step.
    * ``broadcast_buffers``: broadcast buffers from rank 0 before forward (PyTorch's default).
    * ``mp_policy``: a :class:`~workbench.parallel.MixedPrecision` (FSDP2's argument name),
      or None for full precision. See the module docstring.

    Call it inside a rank (``workbench.launch``, ``torchrun``): the process group must exist.
    """

    def __init__(self, module: nn.Module, *, bucket_cap_mb: float = DDP_BUCKET_CAP_MB, overlap: bool = True,
                 algorithm: str = "native", process_group=None, find_unused_parameters: bool = False,
                 broadcast_buffers: bool = True, mp_policy=None):
        super().__init__()
        _check_arguments(module, bucket_cap_mb, overlap, find_unused_parameters, broadcast_buffers, algorithm)
        self.mp_policy = resolve_policy(mp_policy, "DistributedDataParallel")
        self.module = module
        self.process_group = process_group
        self.algorithm = algorithm
        self.overlap = overlap
        self.find_unused_parameters = find_unused_parameters
        self.broadcast_buffers = broadcast_buffers
        self.bucket_cap_mb = float(bucket_cap_mb)
        self.world_size = dist.get_world_size(process_group)
        self._src = 0 if process_group is None else dist.get_global_rank(process_group, 0)

        # module.named_parameters() yields a tied tensor once, under its first name
        named = [(n, p) for n, p in module.named_parameters()]
        self._module_buffers = [b for b in module.buffers()]
        self._sync_module_states([p.detach() for _, p in named] + self._module_buffers)

        trainable = [(n, p) for n, p in named if p.requires_grad]
        self._params = [p for _, p in trainable]
        self._mp_named: list[tuple[str, nn.Parameter]] = []   # mixed precision: (name, float32 master)
        self._masters: list[nn.Parameter] = []
        if self.mp_policy is not None:
            self._setup_mixed_precision(named)
        self._param_names = [n for n, _ in trainable]
        self.buckets: list[Bucket] = []
        self._slot: dict[int, tuple[int, int, int]] = {}  # id(param) -> (bucket, slot, param index)
        self._fill_buckets(assign_buckets(self._params, int(self.bucket_cap_mb * MB), FIRST_BUCKET_BYTES))
        self._init_step_state()
        self._register_gradient_hooks()

    # ------------------------------------------------------------------------ construction

    def _fill_buckets(self, assignment: list[list[int]]) -> None:
        """Build the buckets of ``assignment`` (per bucket, the indices of its parameters): one flat
        buffer each, every parameter's ``.grad`` a view into it. A gradient a parameter already
        has is kept, moved into its bucket."""
        self.buckets, self._slot = [], {}
        for b, indices in enumerate(assignment):
            bucket = Bucket(b, [self._params[i] for i in indices], [self._param_names[i] for i in indices])
            self.buckets.append(bucket)
            for s, i in enumerate(indices):
                self._slot[id(self._params[i])] = (b, s, i)
                if self._params[i].grad is not None:  # keep an existing gradient, now in the bucket
                    bucket.adopt_grad(s)

    def _init_step_state(self) -> None:
        """The state the backward hooks and ``forward`` keep from step to step (see the module
        docstring's algorithm): which gradients are ready, which buckets are launched, what is in
        flight, the first backward's gradient order (for the rebuild) and the timing events."""
        self._sync_enabled = True            # False inside no_sync()
        self._expect_sync = False            # set by forward: the next backward must all-reduce
        self._require_forward_buffer_sync = True  # PyTorch's require_forward_param_sync
        self._in_backward = False            # a synchronising backward is running / unfinished
        self._ready = [False] * len(self._params)
        # which parameters got a gradient since the last synchronisation (for find_unused_parameters)
        used_device = self._params[0].device if self._params else torch.device("cpu")
        self._locally_used = torch.zeros(len(self._params), dtype=torch.int32, device=used_device)
        self._next_bucket = 0
        self._inflight: list = []            # (handle, event record) of unfinished all-reduces
        self._step = 0
        self._ready_order: list[int] = []    # first synchronising backward: gradient-ready order
        self._rebuild_pending = not self.find_unused_parameters
        self.rebuilt_per_bucket_param_indices: list[list[int]] | None = None
        self._current: dict | None = None
        self.events: deque[dict] = deque(maxlen=64)  # the last steps' bucket timings

    def _register_gradient_hooks(self) -> None:
        """A post-accumulate-grad hook on every trainable parameter (or its 16-bit twin): it marks
        the gradient ready and launches the buckets that are complete (:meth:`_on_grad_ready`).
        The hook holds the wrapper weakly, so a dropped wrapper is not kept alive by its module."""
        me = weakref.ref(self)  # hooks must not keep a dropped wrapper alive

        def hook(param: torch.Tensor) -> None:
            ddp = me()
            if ddp is not None:
                ddp._on_grad_ready(param)

        self._hook_handles = [p.register_post_accumulate_grad_hook(hook) for p in self._params]

    def _setup_mixed_precision(self, named) -> None:
        """Give every trainable parameter a 16-bit *compute* twin: a leaf tensor of
        ``param_dtype`` (storage freed between steps) that forward runs on and autograd fills
        with a gradient. The buckets, hooks and unused-parameter logic work on the twins; the
        module's own parameters stay float32 and get the reduced gradient at the end."""
        dtype = self.mp_policy.param_dtype
        self._mp_named = named
        # every (submodule, attribute) a parameter sits at (a tied weight sits at two)
        self._mp_slots = [(sub, attr, p) for _, sub in self.module.named_modules(remove_duplicate=False)
                          for attr, p in sub._parameters.items() if p is not None]
        self._swapped = False
        self._masters = list(self._params)
        twins = []
        for p in self._masters:
            twin = nn.Parameter(torch.empty(p.shape, dtype=dtype or p.dtype, device=p.device))
            twin.untyped_storage().resize_(0)
            twins.append(twin)
        self._params = twins
        self._twin_of = {id(m): t for m, t in zip(self._masters, twins)}

    def _swap_in(self) -> None:
        """Cast the float32 parameters into their 16-bit twins and put the twins in the module.

        They stay there until backward ends (``finish_gradient_synchronization``), so that
        recomputation in backward (activation checkpointing) runs on the same weights; a
        forward without autograd swaps back at once. The next forward swaps back in any case."""
        self._swap_out()
        dtype = self.mp_policy.param_dtype
        cast: dict[int, nn.Parameter] = {}
        with torch.no_grad():
            for _, p in self._mp_named:
                twin = self._twin_of.get(id(p))
                if twin is None:  # frozen: a cast copy, no gradient
                    cast[id(p)] = nn.Parameter(p.detach().to(dtype or p.dtype), requires_grad=False)
                    continue
                storage = twin.untyped_storage()
                if storage.nbytes() == 0:
                    storage.resize_(twin.numel() * twin.element_size())
                twin.copy_(p.detach())
                cast[id(p)] = twin
        for sub, attr, p in self._mp_slots:
            sub._parameters[attr] = cast[id(p)]
        self._swapped = True

    def _swap_out(self) -> None:
        """Put the float32 parameters back in the module."""
        if self._swapped:
            for sub, attr, p in self._mp_slots:
                sub._parameters[attr] = p
            self._swapped = False

    def _free_twins(self) -> None:
        for twin in self._params:
            twin.untyped_storage().resize_(0)

    def _mixed_precision_gradients(self, reduced: dict) -> None:
        """Averaged 16-bit gradients -> float32 ``.grad`` of the masters; free the 16-bit copies."""
        self._swap_out()
        for i, (master, twin) in enumerate(zip(self._masters, self._params)):
            if twin.grad is None:
                continue
            g = reduced.get(i, twin.grad).to(master.dtype)
            if master.grad is None:
                master.grad = g if g.data_ptr() != twin.grad.data_ptr() else g.clone()
            else:
                master.grad.add_(g)
            twin.grad = None
        for bucket in self.buckets:
            bucket.buffer.untyped_storage().resize_(0)
        self._free_twins()

    def _extra_model_state(self) -> dict[str, list[torch.Tensor]]:
        """What this wrapper holds beyond the module's parameters, for ``model_state_bytes``:
        the gradient buckets (also after ``zero_grad``) and, with mixed precision, the 16-bit twins."""
        return {"params": list(self._params) if self.mp_policy is not None else [],
                "grads": [b.buffer for b in self.buckets]}

    def _sync_module_states(self, tensors: list[torch.Tensor]) -> None:
        """Broadcast ``tensors`` from rank 0, coalesced into one flat buffer per dtype/device."""
        if self.world_size == 1 or not tensors:
            return
        groups: dict[tuple, list[torch.Tensor]] = {}
        for t in tensors:
            groups.setdefault((t.dtype, t.device), []).append(t)
        with torch.no_grad():
            for group in groups.values():
                flat = _flatten_dense_tensors(group)
                comm.broadcast(flat, src=self._src, group=self.process_group)
                for t, synced in zip(group, _unflatten_dense_tensors(flat, group)):
                    t.copy_(synced)

    # ------------------------------------------------------------------------------ forward

    def _rebuild_buckets(self) -> None:
        """Re-assign the buckets in the order gradients became ready in the first backward
        (rank 0's order, broadcast), keeping any gradient already in them. Once, as PyTorch."""
        self._rebuild_pending = False
        order = torch.tensor(self._ready_order, dtype=torch.int64, device=comm.wire_device(self.process_group))
        if self.world_size > 1:
            comm.broadcast(order, src=self._src, group=self.process_group)
        order = order.tolist()
        assignment = assign_buckets(self._params, int(self.bucket_cap_mb * MB), FIRST_BUCKET_BYTES, order=order)
        self._fill_buckets(assignment)
        self.rebuilt_per_bucket_param_indices = assignment

    @property
    def rebuilt_bucket_sizes(self) -> list[int] | None:
        """Bytes per bucket after the rebuild (None before it), as PyTorch logs them."""
        return None if self.rebuilt_per_bucket_param_indices is None else [b.nbytes for b in self.buckets]

    def forward(self, *inputs, **kwargs):
        if self._rebuild_pending and len(self._ready_order) == len(self._params) and torch.is_grad_enabled():
            self._rebuild_buckets()
        if self.broadcast_buffers and self._require_forward_buffer_sync and self._module_buffers:
            self._sync_module_states([b for b in self.module.buffers()])
        syncing = torch.is_grad_enabled() and self._sync_enabled
        self._expect_sync = syncing
        self._require_forward_buffer_sync = syncing  # PyTorch skips the next buffer sync after no_sync
        if self.mp_policy is None:
            return self.module(*inputs, **kwargs)
        inputs, kwargs = cast_floats((inputs, kwargs), self.mp_policy.param_dtype)
        self._swap_in()
        try:
            output = self.module(*inputs, **kwargs)
        finally:
            if not torch.is_grad_enabled():
                self._swap_out()
        return cast_floats(output, self.mp_policy.output_dtype)

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally: backward inside this context all-reduces nothing.

        ``with ddp.no_sync(): ddp(x1).sum().backward()`` then ``ddp(x2).sum().backward()``
        outside it leaves the average over ranks of the summed micro-batch gradients, at the
        communication cost of one step instead of two.
        """
        old = self._sync_enabled
        self._sync_enabled = False
        try:
            yield
        finally:
            self._sync_enabled = old

    # ---------------------------------------------------------------------------- backward

    def _on_grad_ready(self, param: torch.Tensor) -> None:
        """Post-accumulate-grad hook: ``param.grad`` is final for this backward."""
        b, s, i = self._slot[id(param)]
        bucket = self.buckets[b]
        if bucket.buffer.untyped_storage().nbytes() == 0:  # mixed precision frees it between steps
            bucket.buffer.untyped_storage().resize_(bucket.nbytes)
            bucket.buffer.zero_()
        bucket.adopt_grad(s)  # the gradient now lives in the bucket, also under no_sync
        self._locally_used[i] = 1
        if not self._expect_sync:
            return
        if not self._in_backward:
            self._begin_backward()
        self._poll_completions()
        if self._ready[i]:
            raise RuntimeError(f"DistributedDataParallel: parameter {self._param_names[i]!r} received a second "
                               "gradient in one backward (backward through the same forward twice?). "
                               "Run forward again before each backward.")
        self._ready[i] = True
        if self._rebuild_pending and len(self._ready_order) < len(self._params):
            self._ready_order.append(i)
        bucket.pending -= 1
        if bucket.pending == 0:
            self._current["buckets"][b]["ready"] = _now()
            if self.overlap:
                self._launch_ready_buckets()

    def _begin_backward(self, from_engine: bool = True) -> None:
        self._in_backward = True
        self._ready = [False] * len(self._params)
        self._next_bucket = 0
        for bucket in self.buckets:
            bucket.reset()
        self._current = {"step": self._step, "backward_start": _now(), "backward_end": None,
                         "buckets": [{"bucket": bk.index, "bytes": bk.nbytes, "params": len(bk.params),
                                      "ready": None, "start": None, "end": None, "run_start": None,
                                      "run_end": None} for bk in self.buckets]}
        self.events.append(self._current)
        if from_engine:  # run finish_gradient_synchronization when autograd has finished this backward
            torch.autograd.Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        self._current["backward_end"] = _now()
        self.finish_gradient_synchronization()

    def _launch_ready_buckets(self) -> None:
        """Launch ready buckets in bucket order, so every rank issues the same sequence."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].pending == 0:
            bucket = self.buckets[self._next_bucket]
            record = self._current["buckets"][bucket.index]
            record["start"] = _now()
            buffer = bucket.buffer
            if self.mp_policy is not None and self.mp_policy.reduce_dtype not in (None, buffer.dtype):
                buffer = buffer.to(self.mp_policy.reduce_dtype)  # reduce 16-bit gradients in reduce_dtype
            bucket.reduce_buffer = buffer
            buffer.mul_(1.0 / self.world_size)  # average = sum of grad * (1/world), as PyTorch
            bucket.handle = comm.all_reduce(buffer, op=comm.ReduceOp.SUM, group=self.process_group,
                                            async_op=True, algorithm=self.algorithm)
            self._inflight.append((bucket.handle, record))
            self._next_bucket += 1

    def _poll_completions(self) -> None:
        """Stamp the end time of all-reduces that have finished (checked at every hook)."""
        if self._inflight:
            now = _now()
            still = []
            for handle, record in self._inflight:
                if handle.is_completed():
                    record["end"] = now
                else:
                    still.append((handle, record))
            self._inflight = still

    def synchronize_accumulated_gradients(self) -> None:
        """Average over the ranks, now, the gradients accumulated under :meth:`no_sync`.

        For loops that run several backwards per step in an order the forward cannot announce
        (a pipeline's micro-batches: the last forward is not followed by the last backward): run
        every forward and backward under ``no_sync()``, then call this once before
        ``optimizer.step()``. Same buckets, same order, same unused-parameter rules as the end of
        a synchronising backward. (``torch.distributed.pipelining`` reaches into DDP's reducer,
        ``prepare_for_backward``, for the same purpose.)
        """
        self.finish_gradient_synchronization()  # a backward still in flight, if any
        self._expect_sync = True
        self._begin_backward(from_engine=False)
        self._current["backward_end"] = _now()
        for i, used in enumerate(self._locally_used.tolist()):
            if used:  # got a gradient since the last synchronisation: its bucket slot holds it
                b, _, _ = self._slot[id(self._params[i])]
                self._ready[i] = True
                self.buckets[b].pending -= 1
                if self.buckets[b].pending == 0:
                    self._current["buckets"][b]["ready"] = _now()
        self.finish_gradient_synchronization()

    def finish_gradient_synchronization(self) -> None:
        """Wait until every gradient is averaged over the ranks. Idempotent.

        Runs by itself at the end of each backward (an autograd-engine callback), so the usual
        ``loss.backward(); optimizer.step()`` is correct without calling it.
        """
        if not self._in_backward:
            return
        self._in_backward = False
        self._expect_sync = False
        missing = [i for i, ready in enumerate(self._ready) if not ready]
        was_none = {i: self._params[i].grad is None for i in missing}
        for i in missing:  # unused in this backward: contribute zeros (or the accumulated gradient)
            b, s, _ = self._slot[id(self._params[i])]
            self.buckets[b].adopt_grad(s)
            self._ready[i] = True
            self.buckets[b].pending -= 1
            self._current["buckets"][b]["ready"] = self._current["buckets"][b]["ready"] or _now()
        self._poll_completions()
        self._launch_ready_buckets()  # the rest (all of them when overlap=False)
        used = None
        if self.find_unused_parameters:  # after the buckets, so every rank keeps the same order
            used = self._locally_used.clone()
            comm.all_reduce(used, op=comm.ReduceOp.SUM, group=self.process_group)
        for bucket in self.buckets:
            bucket.handle.wait()
            record = self._current["buckets"][bucket.index]
            record["end"] = record["end"] or _now()
            record["run_start"] = getattr(bucket.handle, "started", None)  # when the thread ran it
            record["run_end"] = getattr(bucket.handle, "ended", None)
            bucket.handle = None
        self._inflight = []
        self._locally_used.zero_()
        self._step += 1
        if missing and not self.find_unused_parameters:
            names = [self._param_names[i] for i in missing]
            more = f" (and {len(names) - 1} more: {', '.join(names[1:4])}{', ...' if len(names) > 4 else ''})" \
                if len(names) > 1 else ""
            raise RuntimeError(
                f"DistributedDataParallel: parameter {names[0]!r}{more} received no gradient in this backward "
                "pass. Every trainable parameter must take part in the loss: pass find_unused_parameters=True "
                "to DistributedDataParallel, or set requires_grad=False on the parameters you do not train.")
        if used is not None and missing:
            used = used.tolist()
            for i in missing:
                if used[i] == 0 and was_none[i]:
                    self._params[i].grad = None  # unused on every rank: no gradient, as without DDP
        if self.mp_policy is not None:
            reduced = {}
            for bucket in self.buckets:
                rb, offset = bucket.reduce_buffer, 0
                for p in bucket.params:
                    if rb is not None and rb is not bucket.buffer:
                        reduced[self._slot[id(p)][2]] = rb[offset:offset + p.numel()].view_as(p)
                    offset += p.numel()
                bucket.reduce_buffer = None
            self._mixed_precision_gradients(reduced)

    # ----------------------------------------------------------------------------- reports

    def timeline_events(self, steps: int | None = None, origin: float = 0.0) -> list[dict]:
        """The recorded steps as ``workbench.measure.plots.timeline`` events, in seconds from ``origin``.

        Lanes: ``"backward"`` (first gradient ready to end of backward) and ``"all-reduce"``
        (one box per bucket, ``b0``, ``b1``, ..., from when the communication thread began its
        all-reduce to when it finished; ``"issued"`` holds when it was queued, so
        ``issued..start`` is time spent waiting behind earlier buckets). ``steps``: how many of
        the last steps (default all recorded). Times are ``time.perf_counter()`` readings, one
        clock for every process of a machine, so events gathered from all ranks line up.
        """
        recorded = list(self.events)[-steps:] if steps else list(self.events)
        rank = dist.get_rank(self.process_group)
        out = []
        for step in recorded:
            if step["backward_end"] is not None:
                out.append({"rank": rank, "lane": "backward", "name": "backward", "step": step["step"],
                            "start": step["backward_start"] - origin, "end": step["backward_end"] - origin})
            for bk in step["buckets"]:
                start, end = _ran(bk)
                if start is not None and end is not None:
                    out.append({"rank": rank, "lane": "all-reduce", "name": f"b{bk['bucket']}", "step": step["step"],
                                "start": start - origin, "end": end - origin, "issued": bk["start"] - origin})
        return out

    def hidden_communication_fraction(self, steps: int | None = None) -> float:
        """Share of the all-reduces' running time that fell while backward was still computing (0 to 1)."""
        recorded = list(self.events)[-steps:] if steps else list(self.events)
        hidden = total = 0.0
        for step in recorded:
            end_bwd = step["backward_end"]
            for bk in step["buckets"]:
                start, end = _ran(bk)
                if start is None or end is None or end_bwd is None:
                    continue
                total += end - start
                hidden += max(0.0, min(end, end_bwd) - start)
        return hidden / total if total > 0 else 0.0

    def extra_repr(self) -> str:
        return (f"buckets={len(self.buckets)}, bucket_cap_mb={self.bucket_cap_mb:g}, overlap={self.overlap}, "
                f"algorithm={self.algorithm!r}, world_size={self.world_size}")


def _ran(bucket_record: dict) -> tuple:
    """When a bucket's all-reduce ran on the communication thread; issue-to-completion where the
    handle has no run times (a handle from outside ``workbench.comm``)."""
    if bucket_record.get("run_start") is not None and bucket_record.get("run_end") is not None:
        return bucket_record["run_start"], bucket_record["run_end"]
    return bucket_record["start"], bucket_record["end"]
