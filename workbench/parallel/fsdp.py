"""ZeRO-3, FSDP-style: every rank keeps 1/N of the parameters, gathering each unit just in time.

ZeRO-1 and ZeRO-2 (:mod:`workbench.parallel.zero`) shard the optimizer state and the gradients
but still keep every parameter on every rank (``4 psi`` bytes in float32). ZeRO-3
(Rajbhandari et al. 2020), which PyTorch calls *Fully Sharded Data Parallel*, shards the
parameters too, so the whole model state costs ``16 psi / N`` bytes per rank with Adam.

Units and flat shards
---------------------
The model is cut into **units**: each block of ``module.blocks`` (or ``module.layers``) is one
unit, and everything else (embeddings, final norm, head) is the *root* unit. A unit's
parameters are flattened into one vector of ``n`` elements, padded with zeros to
``N * ceil(n / N)`` so it splits evenly, and rank ``r`` keeps only chunk ``r``::

    unit "blocks.0":  [ c_attn.weight | c_attn.bias | ... | mlp.c_proj.bias | pad ]
                      [ rank 0's shard  |  rank 1's shard  | ... | rank N-1's     ]

The shards are the wrapper's only parameters: ``model.parameters()`` yields one float32 tensor
per unit, and an ordinary ``torch.optim`` optimizer built on them keeps state for the local
shards only. The original ``nn.Parameter`` objects are removed from the wrapped module.

One training step
-----------------
::

    forward   root:   all-gather -> ... (root stays gathered while the blocks run)
              unit k: wait for its all-gather, start unit k+1's (prefetch), run, free
              root:   run the head, free
    backward  root:   all-gather again (the head needs its weight), prefetch the last block
              unit k: all-gather (already prefetched), start unit k-1's, backward through the
                      unit, free, reduce-scatter its gradient (asynchronous)
    end       wait for the reduce-scatters, each rank adds its gradient shard (float32)

How the gathered weights reach backward without being kept: the wrapper runs the forward under
:func:`torch.autograd.graph.saved_tensors_hooks`. When autograd wants to save a tensor that
lives in a gathered unit (``F.linear`` saves its weight for the input gradient), the *pack* hook
stores only where it lives (unit, offset, shape, strides); the *unpack* hook, called when
backward needs it, all-gathers the unit again and returns the same view of the new buffer. So a
unit's full parameters exist only while its forward or its backward runs.

A unit's gradient: the gathered flat tensor comes out of :class:`_GatherParams`, an autograd
function whose backward receives the gradient of the *whole* flat tensor once backward is done
with the unit. It starts a reduce-scatter of it (asynchronous, so the next unit's backward
overlaps it) and frees the unit; ``finish_gradient_synchronization()``, queued to run when the
autograd engine finishes, waits for them and averages the shards into ``shard.grad``.

Cost per step, per rank (``psi`` parameters, ring algorithms, ``beta`` seconds per byte)::

    all-gather forward      (N-1)/N psi elements
    all-gather backward     (N-1)/N psi
    reduce-scatter grads    (N-1)/N psi      total 3 (N-1)/N psi: 1.5x DDP's all-reduce

Memory per rank (float32 Adam): ``16 psi / N`` of model state (parameters, gradients and Adam's
two moments, each sharded), plus the gathered units: at most the root and two blocks (the one
running and the one prefetched) at any moment.

``mp_policy=MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=None, output_dtype=None)``
(FSDP2's names): the shards stay float32 master weights and the optimizer steps them in float32,
but each unit is cast to ``param_dtype`` before its all-gather, so the gather and the forward
and backward compute run in 16 bits (half the bytes on the wire); the gradient reduce-scatter
runs in ``reduce_dtype`` (default ``param_dtype``) and the reduced shard is cast back to float32
(``16 psi / N`` in all, as in float32). Floating-point inputs are cast on the way in, outputs to
``output_dtype`` if given. The old ``compute_dtype=d`` still works (deprecated) and means
``MixedPrecision(param_dtype=d)``.

Gradient hooks a parameter carries (``Tensor.register_hook``, registered before wrapping) are
kept: the original parameters leave the module, so each hook runs instead on that parameter's
slice of the unit's gradient, as a view of the parameter's shape, before the reduce-scatter. That
is how tensor parallelism's sequence-parallel norms (a Hugging Face ``RMSNorm`` is not replaced,
its weight's gradient is summed over the tensor-parallel ranks by a hook) compose with ZeRO-3.

Frozen parameters (``requires_grad=False``) are sharded too, in a flat shard of their own per
unit that is gathered and freed with the unit's trainable one: they get no gradient, no
reduce-scatter and (their shard has no ``.grad``) no optimizer state.

Hybrid sharding (HSDP; ZeRO++'s hierarchical partitioning): ``process_group`` is the ranks of
one node and ``replicate_group`` the ranks with the same local index on every node
(``workbench.comm.node_groups()`` makes both). Parameters are sharded inside the node only, so
the all-gathers of forward and backward stay on the fast links; each node holds a full replica
of the sharded state, and after the reduce-scatter each rank all-reduces its gradient shard with
its replicas across nodes. Per step and rank, for S ranks per node and R nodes: ``3 (S-1)/S psi``
inside the node and ``2 (R-1)/R psi/S`` across nodes, where FSDP over all ``N = S R`` ranks moves
``3 (N-1)/N psi``, much of it across nodes. Memory per rank: ``16 psi / S`` of model state
instead of ``16 psi / N``.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
import warnings

import torch
import torch.distributed as dist
from torch import nn

from workbench import comm
from workbench.parallel.mixed_precision import MixedPrecision, cast_floats, resolve_policy

__all__ = ["FullyShardedDataParallel", "find_units"]


def find_units(module: nn.Module) -> list[tuple[str, nn.Module]]:
    """The sub-modules that become units of their own: each child of ``module.blocks`` (or of
    ``module.layers``; a list, a sequence, or a pipeline stage's dict of its blocks by their index
    in the model) that has parameters, with its name. Everything else is the root unit."""
    for attr in ("blocks", "layers"):
        container = getattr(module, attr, None)
        if isinstance(container, (nn.ModuleList, nn.Sequential, nn.ModuleDict)):
            return [(f"{attr}.{name}", child) for name, child in container.named_children()
                    if any(True for _ in child.parameters())]
    return []


@dataclass
class _Saved:
    """What the pack hook keeps instead of a tensor that lives in a gathered unit."""

    unit: "_Unit"
    offset: int
    size: torch.Size
    stride: tuple


class _Unit:
    """One unit: its parameters as one flat, padded vector, of which this rank keeps a shard.

    ``uses[i]`` lists every ``(submodule, attribute, name)`` through which parameter ``i`` was
    reachable (a tied weight has several); gathering sets each of them to a view of the
    gathered buffer, freeing sets them back to ``None``.
    """

    def __init__(self, name: str, params: list[nn.Parameter], uses: list[list[tuple[nn.Module, str, str]]],
                 rank: int, world: int, group, compute_dtype: torch.dtype | None,
                 reduce_dtype: torch.dtype | None = None):
        self.name = name
        self.shapes = [p.shape for p in params]
        self.numels = [p.numel() for p in params]
        self.offsets = [0]
        for n in self.numels[:-1]:
            self.offsets.append(self.offsets[-1] + n)
        self.uses = uses
        self.numel = sum(self.numels)
        self.world = world
        self.group = group
        self.shard_numel = math.ceil(self.numel / world)
        self.padded_numel = self.shard_numel * world
        self.dtype = compute_dtype or params[0].dtype
        self.reduce_dtype = reduce_dtype or self.dtype
        self.frozen = not params[0].requires_grad
        # (index, hooks) of the parameters that carry gradient hooks: they run on the unit's gradient
        self.grad_hooks = [(i, list(p._backward_hooks.values())) for i, p in enumerate(params) if p._backward_hooks]
        self.companion: "_Unit | None" = None   # the unit's frozen parameters, gathered with it
        self.main: "_Unit | None" = None        # set on a companion: the unit it belongs to
        with torch.no_grad():
            flat = torch.zeros(self.padded_numel, dtype=params[0].dtype, device=params[0].device)
            torch.cat([p.detach().reshape(-1) for p in params], out=flat[:self.numel])
            lo = rank * self.shard_numel
            self.shard = nn.Parameter(flat[lo:lo + self.shard_numel].clone(), requires_grad=not self.frozen)
        self.full: torch.Tensor | None = None      # the gathered flat buffer while unsharded
        self._gathering: tuple | None = None        # (buffer, work handle, start time) in flight

    # -- gathering ------------------------------------------------------------------------
    def start_all_gather(self) -> None:
        """Issue this unit's all-gather asynchronously (no-op if gathered or in flight)."""
        if self.full is not None or self._gathering is not None:
            return
        buffer = torch.empty(self.padded_numel, dtype=self.dtype, device=self.shard.device)
        local = self.shard.detach().to(self.dtype)
        work = comm.all_gather(list(buffer.chunk(self.world)), local, group=self.group, async_op=True)
        self._gathering = (buffer, work, time.perf_counter())

    def wait_all_gather(self, owner: "FullyShardedDataParallel") -> torch.Tensor:
        """The gathered flat buffer, issuing and/or waiting for the all-gather as needed."""
        if self.full is None:
            self.start_all_gather()
            buffer, work, start = self._gathering
            work.wait()
            owner._event("comm", "all-gather", self, start, work)
            self._gathering = None
            self.full = buffer
        return self.full

    def set_views(self, flat: torch.Tensor) -> None:
        """Point every use of every parameter at its slice of ``flat`` (``None``: detach them)."""
        for i, uses in enumerate(self.uses):
            view = None if flat is None else flat[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])
            for module, attr, _ in uses:
                setattr(module, attr, view)

    def unflatten(self, flat: torch.Tensor) -> list[torch.Tensor]:
        return [flat[o:o + n].view(s) for o, n, s in zip(self.offsets, self.numels, self.shapes)]

    def run_grad_hooks(self, grad_full: torch.Tensor) -> torch.Tensor:
        """The unit's gradient after its parameters' own gradient hooks, each on its parameter's
        slice (a copy where a hook returns a new gradient; ``grad_full`` itself when none has hooks)."""
        if not self.grad_hooks:
            return grad_full
        grad = grad_full.clone()
        for i, hooks in self.grad_hooks:
            view = grad[self.offsets[i]:self.offsets[i] + self.numels[i]].view(self.shapes[i])
            for hook in hooks:
                out = hook(view)
                if out is not None:
                    view.copy_(out)
        return grad


class _GatherParams(torch.autograd.Function):
    """Identity on the unit's gathered buffer in forward; in backward, hands the gradient of the
    whole unit to :meth:`FullyShardedDataParallel._reduce_scatter` (which starts the
    reduce-scatter) and returns no gradient: the shard's ``.grad`` is filled when the
    reduce-scatter is waited on, at the end of backward."""

    @staticmethod
    def forward(ctx, shard, full, unit, owner):
        ctx.unit, ctx.owner = unit, owner
        return full.view_as(full)

    @staticmethod
    def backward(ctx, grad_full):
        ctx.owner._reduce_scatter(ctx.unit, grad_full)
        return None, None, None, None


class FullyShardedDataParallel(nn.Module):
    """ZeRO-3: parameters, gradients and (through the optimizer) optimizer state sharded per unit.

    ``module``: the model, identically initialised on every rank. Each child of
    ``module.blocks`` (or ``module.layers``) is a unit, the rest is the root unit (see the
    module docstring). A tensor shared by two units (for example a weight tied between a block
    and the head) cannot live in two flat shards and is refused with a ValueError; a weight
    tied inside one unit (GPT's embedding and head, both in the root) is fine.

    ``mp_policy``: a :class:`~workbench.parallel.MixedPrecision` (``param_dtype`` for the
    all-gathers and compute, ``reduce_dtype`` for the gradient reduce-scatters). Master
    weights, gradients seen by the optimizer and its state stay float32. ``compute_dtype``
    (deprecated) is ``mp_policy=MixedPrecision(param_dtype=compute_dtype)``.

    ``process_group``: the ranks to shard over (default: all).

    ``replicate_group``: hybrid sharding (see the module docstring): shard over
    ``process_group`` (a node), keep a replica on each rank of ``replicate_group`` (one per node),
    all-reduce the gradient shards across it. The two groups must meet in this rank only. Feed
    every rank of both groups its own slice of the global batch.

    Use ``model.parameters()`` for the optimizer (the local float32 shards). Gradients are
    complete when ``backward`` returns; :meth:`finish_gradient_synchronization` does the same
    by hand and is safe to call again. :meth:`full_state_dict` gathers the full parameters.
    """

    def __init__(self, module: nn.Module, *, mp_policy: MixedPrecision | None = None,
                 compute_dtype: torch.dtype | None = None, process_group=None, replicate_group=None):
        super().__init__()
        if not isinstance(module, nn.Module):
            raise TypeError(f"FullyShardedDataParallel(module={module!r}): pass an nn.Module")
        if compute_dtype is not None and (not isinstance(compute_dtype, torch.dtype)
                                          or not compute_dtype.is_floating_point):
            raise ValueError(f"FullyShardedDataParallel: compute_dtype={compute_dtype!r} is not a floating-point "
                             "dtype; pass torch.bfloat16, torch.float16 or torch.float32, or None to compute in "
                             "the parameters' own dtype")
        mp_policy = resolve_policy(mp_policy, "FullyShardedDataParallel")
        if compute_dtype is not None:
            if mp_policy is not None:
                raise ValueError("FullyShardedDataParallel: pass mp_policy=MixedPrecision(...) or the deprecated "
                                 "compute_dtype, not both")
            warnings.warn("FullyShardedDataParallel(compute_dtype=...) is deprecated: pass "
                          "mp_policy=MixedPrecision(param_dtype=...)", DeprecationWarning, stacklevel=2)
            mp_policy = MixedPrecision(param_dtype=compute_dtype)
        if not any(True for _ in module.parameters()):
            raise ValueError(f"FullyShardedDataParallel: {type(module).__name__} has no parameters to shard")
        if not dist.is_initialized():
            raise RuntimeError("FullyShardedDataParallel needs an initialised process group: run it inside "
                               "workbench.launch(fn, world_size=N) or under torchrun")
        self.process_group = process_group
        self.rank = dist.get_rank(process_group)
        self.world_size = dist.get_world_size(process_group)
        self.mp_policy = mp_policy
        self.compute_dtype = compute_dtype = mp_policy.param_dtype if mp_policy is not None else None
        reduce_dtype = mp_policy.reduce_dtype if mp_policy is not None else None
        self.replicate_group = replicate_group
        self.replicate_size = _check_replicate_group(process_group, replicate_group)
        self.module = module
        self._param_names = [name for name, _ in module.named_parameters(remove_duplicate=False)]

        block_units = find_units(module)
        unit_params, uses = _assign_parameters(module, block_units)
        for mod_name, sub in module.named_modules(remove_duplicate=False):
            for attr in list(sub._parameters):
                if sub._parameters[attr] is not None:
                    del sub._parameters[attr]
                    setattr(sub, attr, None)

        self.units: list[_Unit] = []
        self._companions: list[_Unit] = []
        for unit_name in [""] + [name for name, _ in block_units]:
            params = unit_params[unit_name]
            # trainable parameters first; frozen ones in a companion flat shard (or the unit itself)
            parts = [[p for p in params if p.requires_grad], [p for p in params if not p.requires_grad]]
            made = [_Unit((unit_name or "root") + (" (frozen)" if k and parts[0] else ""), ps,
                          [uses[id(p)] for p in ps], self.rank, self.world_size, process_group, compute_dtype,
                          reduce_dtype) for k, ps in enumerate(parts) if ps]
            if made:
                self.units.append(made[0])
            if len(made) == 2:
                made[0].companion, made[1].main = made[1], made[0]
                self._companions.append(made[1])
        self.flat_shards = nn.ParameterList([u.shard for u in self.units + self._companions])
        self._root = self.units[0] if self.units and self.units[0].name == "root" else None
        self._blocks = [u for u in self.units if u is not self._root]
        # Backward meets the root first (the head), then the blocks last to first.
        self._backward_order = ([self._root] if self._root else []) + self._blocks[::-1]
        self._by_storage: dict[int, _Unit] = {}
        self._pending: list[tuple[_Unit, torch.Tensor, object, float]] = []
        self._callback_queued = False
        self._in_backward: set[int] = set()
        self.events: list[dict] | None = None  # set to [] to record a timeline of this rank
        for (_, sub), unit in zip(block_units, self._blocks):
            sub.register_forward_pre_hook(self._make_pre_forward(unit))
            sub.register_forward_hook(self._make_post_forward(unit))

    # ------------------------------------------------------------------- forward
    def forward(self, *args, **kwargs):
        self.finish_gradient_synchronization()
        if self.compute_dtype is not None:
            args, kwargs = cast_floats((args, kwargs), self.compute_dtype)
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            if self._root is not None:
                self._gather_for_forward(self._root)
            try:
                if self._blocks:
                    self._blocks[0].start_all_gather()   # prefetch the first block
                return cast_floats(self.module(*args, **kwargs),
                                   self.mp_policy.output_dtype if self.mp_policy is not None else None)
            finally:
                if self._root is not None:
                    self._free(self._root)

    def _make_pre_forward(self, unit: _Unit):
        def hook(module, args):
            if torch._C._current_graph_task_id() != -1:   # recomputed in backward (checkpointing)
                self._gather_for_recompute(unit)
            else:
                self._gather_for_forward(unit)
            return None
        hook.rerun_on_recompute = True   # workbench.parallel.recompute runs it again before recomputing
        return hook

    def _make_post_forward(self, unit: _Unit):
        def hook(module, args, output):
            self._free(unit)
            return None
        hook.rerun_on_recompute = True
        return hook

    def _gather_for_recompute(self, unit: _Unit) -> None:
        """Activation recomputation re-runs a unit's forward inside backward: gather it as
        backward would (prefetching in backward order) and point the parameters at it through a
        fresh :class:`_GatherParams`, so the recomputed operators see the same autograd
        structure as the first forward. That node's backward never runs: gradients flow
        through the first forward's graph."""
        full = self._gather_for_backward(unit)
        self._by_storage[full.untyped_storage().data_ptr()] = unit
        unit.set_views(_GatherParams.apply(unit.shard, full, unit, self) if not unit.frozen else full)
        if unit.companion is not None:
            unit.companion.set_views(self._gather_for_backward(unit.companion))

    def _gather_for_forward(self, unit: _Unit) -> None:
        full = unit.wait_all_gather(self)
        index = self._blocks.index(unit) if unit is not self._root else -1
        if 0 <= index < len(self._blocks) - 1:
            self._blocks[index + 1].start_all_gather()
        flat = _GatherParams.apply(unit.shard, full, unit, self) \
            if torch.is_grad_enabled() and not unit.frozen else full
        self._by_storage[full.untyped_storage().data_ptr()] = unit
        unit.set_views(flat)
        unit.forward_start = time.perf_counter()
        if unit.companion is not None:   # the unit's frozen parameters: gathered, no gradient
            frozen = unit.companion.wait_all_gather(self)
            self._by_storage[frozen.untyped_storage().data_ptr()] = unit.companion
            unit.companion.set_views(frozen)

    def _free(self, unit: _Unit) -> None:
        if unit.companion is not None:
            self._free(unit.companion)
        if unit.full is not None:
            self._by_storage.pop(unit.full.untyped_storage().data_ptr(), None)
            if getattr(unit, "forward_start", None) is not None:
                self._event("compute", "forward", unit, unit.forward_start)
                unit.forward_start = None
        unit.set_views(None)
        unit.full = None

    # ------------------------------------------------------------------- backward
    def _pack(self, tensor: torch.Tensor):
        if tensor.layout != torch.strided or tensor.device.type == "meta":
            return tensor
        unit = self._by_storage.get(tensor.untyped_storage().data_ptr())
        if unit is None:
            return tensor
        return _Saved(unit, tensor.storage_offset(), tensor.size(), tensor.stride())

    def _unpack(self, saved):
        if not isinstance(saved, _Saved):
            return saved
        full = self._gather_for_backward(saved.unit)
        return full.as_strided(saved.size, saved.stride, saved.offset)

    def _gather_for_backward(self, unit: _Unit) -> torch.Tensor:
        if unit.main is not None:   # frozen companion: gathered on demand, freed with its unit
            self._in_backward.add(id(unit))
            return unit.wait_all_gather(self)
        first = id(unit) not in self._in_backward
        full = unit.wait_all_gather(self)
        if first:
            self._in_backward.add(id(unit))
            unit.backward_start = time.perf_counter()
            order = self._backward_order
            i = order.index(unit)
            if i + 1 < len(order):
                order[i + 1].start_all_gather()   # prefetch the unit backward reaches next
        return full

    def _reduce_scatter(self, unit: _Unit, grad_full: torch.Tensor) -> None:
        """Backward is done with ``unit``: free its parameters, start reducing its gradient."""
        if getattr(unit, "backward_start", None) is not None:
            self._event("compute", "backward", unit, unit.backward_start)
            unit.backward_start = None
        unit.full = None
        self._in_backward.discard(id(unit))
        if unit.companion is not None and unit.companion.full is not None:
            self._by_storage.pop(unit.companion.full.untyped_storage().data_ptr(), None)
            unit.companion.full = None
            self._in_backward.discard(id(unit.companion))
        grad = unit.run_grad_hooks(grad_full).to(unit.reduce_dtype).contiguous()
        out = torch.empty(unit.shard_numel, dtype=unit.reduce_dtype, device=grad.device)
        work = comm.reduce_scatter(out, list(grad.chunk(self.world_size)), group=self.process_group, async_op=True)
        self._pending.append((unit, out, work, time.perf_counter()))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.finish_gradient_synchronization)

    def finish_gradient_synchronization(self) -> None:
        """Wait for the gradient reduce-scatters and add each averaged shard to ``shard.grad``.

        Runs by itself when backward ends; calling it again (or with nothing pending) is a no-op.
        Also frees any unit backward left gathered (a unit whose parameters got no gradient).
        """
        pending, self._pending = self._pending, []
        self._callback_queued = False
        for unit, out, work, start in pending:
            work.wait()
            self._event("comm", "reduce-scatter", unit, start, work)
            if self.replicate_group is not None:  # HSDP: add up the replicas' shards across nodes
                comm.all_reduce(out, group=self.replicate_group)
            grad = out.to(unit.shard.dtype).div_(self.world_size * self.replicate_size)
            if unit.shard.grad is None:
                unit.shard.grad = grad
            else:
                unit.shard.grad.add_(grad)
        for unit in self.units + self._companions:
            if unit._gathering is not None:   # prefetched for a unit backward never reached
                unit._gathering[1].wait()
                unit._gathering = None
            if id(unit) in self._in_backward:
                self._free(unit)
        self._in_backward.clear()

    # ------------------------------------------------------------------- state
    @torch.no_grad()
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Every parameter, unsharded (float32 master values), on every rank, keyed by the names
        the module gave them before wrapping (a tied weight under each of its names), plus the
        module's buffers. ``reference.load_state_dict(model.full_state_dict())`` works."""
        self.finish_gradient_synchronization()
        out: dict[str, torch.Tensor] = {}
        for unit in self.units + self._companions:
            full = torch.empty(unit.padded_numel, dtype=unit.shard.dtype, device=unit.shard.device)
            comm.all_gather(list(full.chunk(self.world_size)), unit.shard.detach(), group=self.process_group)
            for tensor, uses in zip(unit.unflatten(full), unit.uses):
                for _, _, name in uses:
                    out[name] = tensor.clone()
        for name, buf in self.module.named_buffers():
            out[name] = buf.detach().clone()
        order = {name: i for i, name in enumerate(self._param_names)}
        return dict(sorted(out.items(), key=lambda kv: order.get(kv[0], len(order))))

    def _event(self, lane: str, name: str, unit: _Unit, start: float, work=None) -> None:
        """Record ``{"rank", "lane", "name", "unit", "start", "end"}`` when ``self.events`` is a list.
        A collective's bar runs from when the communication thread began it to when it finished
        (``work.started``/``work.ended``), and ``"issued"`` holds ``start``, when it was issued;
        the root's forward and backward are not drawn, since they enclose the blocks'."""
        if self.events is not None and not (lane == "compute" and unit is self._root):
            end = time.perf_counter()
            event = {"rank": self.rank, "lane": lane, "name": name, "unit": unit.name, "start": start, "end": end}
            if getattr(work, "started", None) is not None and getattr(work, "ended", None) is not None:
                # issued: the handle's own stamp, taken before the task was queued (a stamp the caller
                # takes after the call returns can fall after the thread already began it)
                event.update(start=work.started, end=work.ended, issued=getattr(work, "issued", None) or start)
            self.events.append(event)

    def extra_repr(self) -> str:
        return (f"world_size={self.world_size}, units={[u.name for u in self.units]}, "
                f"mp_policy={self.mp_policy}, replicas={self.replicate_size}")


def _check_replicate_group(process_group, replicate_group) -> int:
    """The number of replicas (1 without ``replicate_group``); refuses groups HSDP cannot use."""
    if replicate_group is None:
        return 1
    if process_group is None:
        raise ValueError("FullyShardedDataParallel(replicate_group=...) needs process_group= too: hybrid sharding "
                         "shards inside process_group (a node) and replicates across replicate_group; make both "
                         "with workbench.comm.node_groups()")
    if not isinstance(replicate_group, dist.ProcessGroup) or dist.get_rank(replicate_group) < 0:
        raise ValueError(f"FullyShardedDataParallel: replicate_group={replicate_group!r} is not a process group "
                         "this rank belongs to; pass the group of this rank's replicas (one rank per node)")
    shard_ranks = set(dist.get_process_group_ranks(process_group))
    replica_ranks = set(dist.get_process_group_ranks(replicate_group))
    if shard_ranks & replica_ranks != {dist.get_rank()}:
        raise ValueError(f"FullyShardedDataParallel: process_group {sorted(shard_ranks)} and replicate_group "
                         f"{sorted(replica_ranks)} must have only this rank ({dist.get_rank()}) in common: one "
                         "shards, the other replicates (workbench.comm.node_groups() makes such a pair)")
    return dist.get_world_size(replicate_group)


def _assign_parameters(module: nn.Module, block_units: list[tuple[str, nn.Module]]):
    """Which unit owns each parameter (``""``: the root), and every ``(submodule, attribute,
    name)`` through which it is reached. Refuses what one flat shard per unit cannot hold."""
    dtype = next(module.parameters()).dtype
    owner: dict[int, str] = {}
    for unit_name, sub in block_units:
        for pname, p in sub.named_parameters():
            if id(p) in owner:
                raise ValueError(f"FullyShardedDataParallel: parameter '{unit_name}.{pname}' is also used by "
                                 f"unit '{owner[id(p)]}'; a tensor shared by two units cannot be split into two "
                                 "flat shards. Untie it (one copy per unit) or move both uses into one unit")
            owner[id(p)] = unit_name
    unit_params: dict[str, list[nn.Parameter]] = {name: [] for name, _ in block_units}
    unit_params[""] = []
    uses: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for mod_name, sub in module.named_modules(remove_duplicate=False):
        for attr, p in list(sub._parameters.items()):
            if p is None:
                continue
            full_name = f"{mod_name}.{attr}" if mod_name else attr
            unit_name = owner.get(id(p), "")
            inside = unit_name == "" or full_name.startswith(unit_name + ".")
            if not inside:
                raise ValueError(f"FullyShardedDataParallel: parameter '{full_name}' is the same tensor as one "
                                 f"of unit '{unit_name}'; a tensor shared by two units cannot be split into two "
                                 "flat shards. Untie it (one copy per unit) or move both uses into one unit")
            if p.dtype != dtype or not p.is_floating_point():
                raise ValueError(f"FullyShardedDataParallel: parameter '{full_name}' has dtype {p.dtype} but "
                                 "each unit is one flat tensor of one floating-point dtype: convert the module "
                                 "first, e.g. module.float()")
            if id(p) not in uses:
                uses[id(p)] = []
                unit_params[unit_name].append(p)
            uses[id(p)].append((sub, attr, full_name))
    return unit_params, uses

