"""Pipeline parallelism: cut the model into stages, one (or a few) per rank, and stream
micro-batches through them. Mirrors ``torch.distributed.pipelining``::

    stages = partition(GPT(cfg), num_stages=2)              # stage k: blocks of stage k only
    stage = PipelineStage(stages[rank], rank, 2)
    schedule = Schedule1F1B(stage, n_microbatches=4, loss_fn=loss)
    losses = []
    schedule.step(x) if rank == 0 else schedule.step(target=y, losses=losses)
    optimizer.step()                                        # each rank updates its own stage

The idea. Stage k holds layers [a_k, a_{k+1}); the global batch is split along dim 0 into m
micro-batches; the first stage runs the forward of micro-batch i and sends its output (an
activation of ``b/m x T x C`` floats for our GPT) to stage k+1, which runs its forward, and so
on; the last stage computes the loss, and gradients flow back the same way. While stage 1 works
on micro-batch 0, stage 0 can already start micro-batch 1: that overlap is the whole point.
Who does what when is the *schedule* (:mod:`workbench.parallel.pipeline_schedules`): a list of
actions per rank, built before the run (``schedule.actions``) and run here by ONE interpreter,
whatever the schedule. After ``step()``, ``schedule.timeline`` holds the measured start and end
of every action of every rank (gathered to every rank), which the same plot draws. The ranks
start a step together (a 4-byte all-reduce lines them up), so times on different ranks, each
counted from its own start of the step, can be compared.

Cost. Per step each boundary carries 2 m messages (m activations forward, m gradients back),
``2 x b x T x C x 4`` bytes in all for a float32 GPT, whatever m is. Idle time ("bubble")
(p-1)/(m+p-1) of the step for GPipe and 1F1B, less for interleaved and zero-bubble schedules.
Memory: stage k holds ~1/p of the parameters, gradients and optimizer state, plus the
activations of every micro-batch between its forward and its backward: m for GPipe, p - k for
1F1B (so stage 0 holds the most); with a split backward a micro-batch holds, from B to W, only
what W reads (``pipeline_backward``). Nothing else is kept: a sent gradient is let go as soon
as the peer is known to have it, and ``step(..., return_outputs=False)`` (as in torch) keeps no
outputs for returning (with ``True``, the default, the last stage keeps all m, e.g. a GPT's
logits, to concatenate them).

Gradients. The last stage's loss per micro-batch is the mean over the micro-batch; backward
runs on ``loss / m``, so after ``step()`` every ``.grad`` equals single-process backward of the
mean loss over the whole batch (torch's ``scale_grads=True``). Tied embeddings: with
``tie_weights=True`` the first stage uses ``wte.weight`` to embed and the last stage uses the
same matrix as its head. After partitioning, each holds its own copy (same values); each gets
only its own use's gradient, so after backward the two gradients are summed between the two
ranks (Megatron's "embedding group"), and both copies take the same optimizer step and stay
equal -- exactly the tied single-process model. Any module can declare such sharing through a
``shared_parameters`` attribute (see :func:`partition`).

Messages go through :func:`workbench.comm.isend` / :func:`workbench.comm.irecv` only, so
``comm.counters()`` sees every byte. Every message has its own tag (stage, micro-batch, and
direction), so a receive matches its send whatever order the two ranks post them in, and sends
never block: the only waits are for data a rank really needs, and a schedule that respects the
data dependencies cannot deadlock (``pipeline_schedules.simulate`` proves each plan). On NCCL,
which ignores tags, messages between two ranks must be posted in the same order on both ends.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from workbench import comm
from workbench.comm.group import resolve_group
from workbench.parallel import pipeline_backward as split_backward
from workbench.parallel import pipeline_schedules as plans
from workbench.parallel import pipeline_split
from workbench.parallel.pipeline_schedules import Action
from workbench.parallel.pipeline_split import GPTStage

__all__ = ["partition", "PipelineStage", "ScheduleGPipe", "Schedule1F1B", "ScheduleInterleaved1F1B",
           "ScheduleZeroBubble", "ScheduleZBV", "ScheduleDualPipeV", "SCHEDULES", "GPTStage", "Action"]

_DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32]
_META_LEN = 12         # shape message: ndim, dtype code, up to 10 sizes
_META_TAG = 1 << 22    # tags of the one-off shape messages and the tied-gradient sums
_TIE_TAG = 1 << 23


# ----------------------------------------------------------------------------- partition a model

def partition(model: nn.Module, num_stages: int, split=None, *, layers_per_stage: Sequence[int] | None = None
              ) -> list[nn.Module]:
    """Cut a model into ``num_stages`` stages (blocks balanced, or as ``split`` says).

    ``split``: None (the built-in split of our GPT, Hugging Face GPT-2 or Llama, blocks
    balanced), a list of module names before which a stage begins (``["model.layers.2"]``), or
    a callable ``split(model, num_stages)`` returning the stages. ``layers_per_stage``: blocks
    per stage instead of names. See :mod:`workbench.parallel.pipeline_split` for what each
    stage holds and rebuilds (positions, rotary tables, masks).

    The stages share their modules with ``model``: build the same model on every rank (same
    seed), partition it, and keep the stage(s) this rank runs. With tied embeddings the first
    and last stages both hold the embedding (see the module docstring for how its gradient is
    summed).
    """
    return pipeline_split.build(model, num_stages, split, layers_per_stage)


# ----------------------------------------------------------------------------- a stage

class PipelineStage:
    """One stage of a pipeline on this rank: ``submodule`` runs stage ``stage_index`` of
    ``num_stages``. Any module works whose forward takes the previous stage's output tensor (the
    micro-batch's inputs, for the first stage) and returns one tensor."""

    def __init__(self, submodule: nn.Module, stage_index: int, num_stages: int,
                 device: torch.device | str | None = None, group=None):
        if not isinstance(submodule, nn.Module):
            raise TypeError(f"PipelineStage: submodule must be an nn.Module, got {type(submodule).__name__}")
        if isinstance(num_stages, bool) or not isinstance(num_stages, int) or num_stages < 1:
            raise ValueError(f"PipelineStage: num_stages={num_stages!r} must be a whole number >= 1")
        if isinstance(stage_index, bool) or not isinstance(stage_index, int) or not 0 <= stage_index < num_stages:
            raise ValueError(f"PipelineStage: stage_index={stage_index!r} is out of range: stages are "
                             f"numbered 0..{num_stages - 1}")
        view = resolve_group(group)
        if view is None:
            raise ValueError("PipelineStage: this rank is not in group: build stages only on the "
                             "group's ranks")
        self.submodule = submodule
        self.stage_index = stage_index
        self.num_stages = num_stages
        self.device = torch.device(device) if device is not None else \
            next((p.device for p in submodule.parameters()), torch.device("cpu"))
        self.group = group
        self.group_rank = view.rank
        self.group_size = view.size

    @property
    def is_first(self) -> bool:
        return self.stage_index == 0

    @property
    def is_last(self) -> bool:
        return self.stage_index == self.num_stages - 1

    def __repr__(self) -> str:
        return f"PipelineStage(stage {self.stage_index} of {self.num_stages}, group rank {self.group_rank})"


# ----------------------------------------------------------------------------- the interpreter

@dataclass
class _StepState:
    """What the interpreter holds during one step, keyed by ``(stage, micro-batch)``; dropped
    with the step, so nothing outlives it (a tensor leaves its dict as soon as it is spent)."""

    actions: list[Action]                                            # this rank's actions, in order
    inputs: dict[tuple, tuple] = field(default_factory=dict)         # the forward's inputs
    outputs: dict[tuple, torch.Tensor] = field(default_factory=dict)  # output (loss / m on the last stage)
    grad_out: dict[tuple, torch.Tensor] = field(default_factory=dict)  # dL/d(output)
    grad_in: dict[tuple, torch.Tensor] = field(default_factory=dict)   # dL/d(input), to send or pass on
    saved: dict[tuple, split_backward.SavedActivations] = field(default_factory=dict)  # split: its forward's
    results: list[torch.Tensor] = field(default_factory=list)        # the last stage's outputs, to return
    posted: dict[int, tuple] = field(default_factory=dict)           # action index -> (handle, buffer)
    sends: dict[int, tuple] = field(default_factory=dict)            # tag -> (handle, tensor), not known over
    records: list[tuple] = field(default_factory=list)               # the timeline: one per action


class _Schedule:
    """What every schedule shares: checks, the action lists, and the interpreter (``step``)."""

    name = ""          # key in pipeline_schedules.min_microbatches / bubble_formula
    multi = False      # several stages per rank?
    style = "loop"     # stage -> rank mapping

    def __init__(self, stages, n_microbatches: int, loss_fn: Callable | None = None):
        cls = type(self).__name__
        if self.multi:
            if isinstance(stages, PipelineStage) or not isinstance(stages, (list, tuple)):
                raise ValueError(f"{cls} runs several stages per rank: pass a list of PipelineStage "
                                 "(use ScheduleGPipe / Schedule1F1B / ScheduleZeroBubble for one stage)")
            stages = list(stages)
        else:
            if isinstance(stages, (list, tuple)):
                raise ValueError(f"{cls} runs one stage per rank: pass one PipelineStage, not a list "
                                 "(use ScheduleInterleaved1F1B or ScheduleZBV for several)")
            stages = [stages]
        if not stages or not all(isinstance(s, PipelineStage) for s in stages):
            raise TypeError(f"{cls}: stages must be PipelineStage objects, got {stages!r}")
        if isinstance(n_microbatches, bool) or not isinstance(n_microbatches, int) or n_microbatches < 1:
            raise ValueError(f"{cls}: n_microbatches={n_microbatches!r} must be a whole number >= 1")
        first = stages[0]
        p, rank, num_stages = first.group_size, first.group_rank, first.num_stages
        v = self._chunks(len(stages))
        if num_stages != v * p:
            raise ValueError(f"{cls}: the pipeline has num_stages={num_stages} but the group has {p} "
                             f"ranks and {cls} puts {v} stage(s) on each: num_stages must be {v * p}")
        owner = plans.stage_to_rank(num_stages, p, self.style)
        want = sorted(s for s in range(num_stages) if owner[s] == rank)
        got = sorted(s.stage_index for s in stages)
        if got != want:
            raise ValueError(f"{cls}: group rank {rank} holds stages {got} but {cls} places stages "
                             f"{want} on it ({self.style} placement): build those stages on this rank")
        need = plans.min_microbatches(self.name, p)
        if n_microbatches < need:
            raise ValueError(f"{cls} needs n_microbatches >= {need} (the number of stages) so that a "
                             f"steady state exists: got {n_microbatches} < {need}; use more "
                             "micro-batches or ScheduleGPipe")
        self._check_microbatches(n_microbatches, p)
        self._stages = {s.stage_index: s for s in stages}
        self._n = n_microbatches
        self._loss_fn = loss_fn
        self._p, self._rank, self._num_stages, self._owner = p, rank, num_stages, owner
        self._group = first.group
        self._compute = self._build(p, n_microbatches)
        self.actions: list[list[Action]] = plans.with_comms(self._compute, num_stages, self.style)
        self._split = {(a.stage, a.microbatch) for acts in self.actions for a in acts if a.kind == "W"}
        self._acked = self._acknowledgements()
        self._shapes: dict[int, tuple[torch.Size, torch.dtype]] | None = None
        self.timeline: list[dict] = []
        self.timeline_origin: float | None = None  # time.perf_counter() the timeline counts from

    # -- hooks for the subclasses
    def _chunks(self, n_local: int) -> int:
        return 1

    def _check_microbatches(self, m: int, p: int) -> None:
        return None

    def _build(self, p: int, m: int) -> list[list[Action]]:
        raise NotImplementedError

    # -- public
    @property
    def n_microbatches(self) -> int:
        return self._n

    def planned_timeline(self, f: float = 1.0, w: float = 1.0) -> list[dict]:
        """The plan replayed with fixed costs per action (see ``pipeline_schedules.simulate``)."""
        return plans.simulate(self.actions, self._num_stages, f=f / self._chunks(len(self._stages)),
                              w=w / self._chunks(len(self._stages)), style=self.style)

    def step(self, *args, target: torch.Tensor | None = None, losses: list | None = None,
             return_outputs: bool = True):
        """Run one training step (forward and backward of every micro-batch) on this rank's
        stages. The first stage passes the batch, the last ``target`` (and gets one loss per
        micro-batch appended to ``losses``). Returns the last stage's output (all micro-batches
        concatenated) on the rank holding it, else None.

        ``return_outputs=False`` (as in torch) returns None everywhere: the last stage then
        keeps no micro-batch's output beyond its loss's backward -- with a loss the outputs are
        not activations (the loss keeps what its backward needs), and keeping all m of them
        (the logits, for a GPT) only to return them costs m outputs of memory."""
        m = self._n
        first = self._stages.get(0)
        last = self._stages.get(self._num_stages - 1)
        arg_chunks = self._split_batch(args, "the batch (args)") if first is not None else None
        train = self._loss_fn is not None
        target_chunks = None
        if last is not None and train:
            if target is None:
                raise ValueError(f"{type(self).__name__}.step: this rank holds the last stage and the "
                                 "schedule has a loss_fn: pass target=")
            target_chunks = self._split_batch((target,), "target")
        if first is not None and not args:
            raise ValueError(f"{type(self).__name__}.step: this rank holds the first stage: pass the "
                             "batch, step(x)")
        if self._shapes is None:
            self._shapes = self._infer_shapes(arg_chunks)
        lists = self.actions if train else \
            [[a for a in acts if a.kind == "F" or
              (a.kind in ("send", "recv") and a.peer == a.stage + (1 if a.kind == "send" else -1))]
             for acts in self.actions]
        self._records_per_rank = [len(acts) for acts in lists]  # one timeline record per action
        return self._run(lists[self._rank], arg_chunks, target_chunks, losses, return_outputs or not train)

    # -- checks
    def _split_batch(self, tensors, what: str) -> list[tuple]:
        m = self._n
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.dim() == 0 or t.shape[0] % m:
                size = t.shape[0] if isinstance(t, torch.Tensor) and t.dim() else t
                raise ValueError(f"{type(self).__name__}.step: {what} has batch size {size!r}, which "
                                 f"does not split into n_microbatches={m} equal micro-batches: use a "
                                 f"batch size that is a multiple of {m}")
        return list(zip(*(t.chunk(m, dim=0) for t in tensors)))

    # -- shape inference (once, like torch: micro-batch shapes must stay the same across steps)
    def _infer_shapes(self, arg_chunks) -> dict[int, tuple[torch.Size, torch.dtype]]:
        """Each stage runs micro-batch 0 without gradients and tells the next stage the shape and
        dtype of its output, so receive buffers can be allocated. Stages go in order."""
        shapes: dict[int, tuple[torch.Size, torch.dtype]] = {}
        pending = []
        for s in sorted(self._stages):
            stage = self._stages[s]
            if s == 0:
                inputs = tuple(t.to(stage.device) for t in arg_chunks[0])
            else:
                if self._owner[s - 1] != self._rank:
                    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=comm.wire_device(self._group))
                    comm.recv(meta, group=self._group, group_src=self._owner[s - 1], tag=_META_TAG + s)
                    ndim, code = int(meta[0]), int(meta[1])
                    shapes[s] = (torch.Size(meta[2:2 + ndim].tolist()), _DTYPES[code])
                inputs = (torch.zeros(shapes[s][0], dtype=shapes[s][1], device=stage.device),)
            with torch.no_grad():
                out = stage.submodule(*inputs)
            if not isinstance(out, torch.Tensor):
                raise TypeError(f"stage {s}'s forward returned {type(out).__name__}: a pipeline stage "
                                "must return one tensor")
            if s + 1 < self._num_stages:
                shapes[s + 1] = (out.shape, out.dtype)
                if self._owner[s + 1] != self._rank:
                    if out.dim() > _META_LEN - 2 or out.dtype not in _DTYPES:
                        raise ValueError(f"stage {s} returns a {out.dim()}-d {out.dtype} tensor: stage "
                                         f"outputs may have at most {_META_LEN - 2} dims and dtype in {_DTYPES}")
                    meta = torch.zeros(_META_LEN, dtype=torch.int64, device=comm.wire_device(self._group))
                    meta[0], meta[1] = out.dim(), _DTYPES.index(out.dtype)
                    meta[2:2 + out.dim()] = torch.tensor(out.shape, device=meta.device)
                    pending.append((comm.isend(meta, group=self._group, group_dst=self._owner[s + 1],
                                               tag=_META_TAG + s + 1), meta))
        for work, _ in pending:
            work.wait()
        return shapes

    # -- the interpreter
    def _tag(self, stage: int, mb: int, grad: bool) -> int:
        """One tag per message of a step: (receiving stage's boundary, micro-batch, direction)."""
        return (mb * self._num_stages + stage) * 2 + int(grad)

    def _message(self, a: Action) -> int:
        """The tag of a send or recv action's message."""
        if a.kind == "recv":
            return self._tag(a.stage, a.microbatch, a.peer == a.stage + 1)
        return self._tag(a.peer, a.microbatch, a.peer == a.stage - 1)

    def _acknowledgements(self) -> dict[int, frozenset]:
        """For each message this rank receives (by tag): this rank's sends to the same peer that
        the peer has received before sending it, read off the peer's action list.

        Why: gloo marks a send done only when it is waited on, and waiting on a send blocks until
        the peer has posted its receive, so a send cannot be polled and must not be waited on
        early. But once the peer has sent a message it wrote after receiving ours, our send is
        over: waiting on it returns at once and frees the tensor it held (a gradient sent back
        would otherwise stay alive until the end of the step, m of them)."""
        me, out = self._rank, {}
        for q, acts in enumerate(self.actions):
            if q == me:
                continue
            got: set = set()
            for a in acts:
                if a.kind in ("send", "recv") and self._owner[a.peer] == me:
                    if a.kind == "recv":
                        got.add(self._message(a))
                    else:
                        out[self._message(a)] = frozenset(got)
        return out

    def _run(self, actions: list[Action], arg_chunks, target_chunks, losses, keep_outputs: bool):
        """Run this rank's action list for one step, in order, timing each action.

        Before each compute action (F, B, W) the receives up to the next one are posted, so their
        data arrives while it runs; after it, sends the peers have completed are let go of. At the
        end: the remaining sends waited for, the tied gradients summed, the timeline gathered."""
        st = _StepState(actions)
        compute_at = [j for j, a in enumerate(actions) if a.kind in ("F", "B", "W")]
        # line the ranks up (one 4-byte all-reduce), so that every rank's step starts together
        # and the timelines of different ranks share their origin
        comm.all_reduce(torch.zeros(1, device=comm.wire_device(self._group)), group=self._group)
        t0 = self.timeline_origin = time.perf_counter()
        self._step_params: dict[int, list] = {}
        nxt = 0
        for j, a in enumerate(actions):
            s, i = a.stage, a.microbatch
            if a.kind in ("F", "B", "W"):
                nxt += 1
                self._prefetch(st, j, compute_at[nxt] if nxt < len(compute_at) else len(actions))
            start = time.perf_counter()
            if a.kind == "recv":
                self._receive(st, j)
            elif a.kind == "send":
                self._send(st, a)
            elif a.kind == "F":
                self._forward(st, a, arg_chunks, target_chunks, losses, keep_outputs)
            elif a.kind == "B":
                self._backward(s, i, st.inputs, st.outputs, st.grad_out, st.grad_in, st.saved)
            elif a.kind == "W":
                self._weight_backward(s, i, st.inputs, st.outputs, st.grad_out)
            st.records.append((self._rank, s, a.kind, i, start - t0, time.perf_counter() - t0))
            if a.kind in ("F", "B", "W") and st.sends:  # let go of sent tensors as soon as they left
                for tag in [k for k, (w, _) in st.sends.items() if w.is_completed()]:  # NCCL knows
                    st.sends.pop(tag)[0].wait()
        for work, _ in st.sends.values():
            work.wait()
        if self._loss_fn is not None:
            self._sum_shared_gradients()
        self.timeline = self._gather_timeline(st.records)
        if self._num_stages - 1 in self._stages and keep_outputs:
            return torch.cat(st.results, dim=0)
        return None

    def _post(self, st: _StepState, j: int) -> None:
        """Post receive action ``j`` (once): a buffer of the message's shape, and its irecv."""
        a = st.actions[j]
        if j in st.posted:
            return
        grad = a.peer == a.stage + 1
        shape, dtype = self._shapes[a.stage + 1] if grad else self._shapes[a.stage]
        buf = torch.empty(shape, dtype=dtype, device=self._stages[a.stage].device)
        tag = self._tag(a.stage, a.microbatch, grad)
        st.posted[j] = (comm.irecv(buf, group=self._group, group_src=self._owner[a.peer], tag=tag), buf)

    def _prefetch(self, st: _StepState, j: int, upto: int) -> None:
        """Post the receives between compute action ``j`` and the next one (``upto``), so they
        arrive while ``j`` runs."""
        for k in range(j + 1, upto):
            if st.actions[k].kind == "recv":
                self._post(st, k)

    def _receive(self, st: _StepState, j: int) -> None:
        """recv: wait for the message (posted now if it was not yet); it is the stage's input
        (an activation from the previous stage) or dL/d(output) (a gradient from the next).
        Sends the peer provably got before sending this are over: waited for and let go."""
        a = st.actions[j]
        s, i = a.stage, a.microbatch
        self._post(st, j)
        work, buf = st.posted.pop(j)
        work.wait()
        for tag in self._acked.get(self._message(a), ()) & st.sends.keys():
            st.sends.pop(tag)[0].wait()  # the peer received it before sending this: over
        if a.peer == s - 1:
            st.inputs[(s, i)] = (buf.requires_grad_(buf.is_floating_point()),)
        else:
            st.grad_out[(s, i)] = buf

    def _send(self, st: _StepState, a: Action) -> None:
        """send: the output forward to the next stage, or dL/d(input) back to the previous one;
        never waited for here (the tensor is held in ``st.sends`` until the send is over)."""
        s, i = a.stage, a.microbatch
        if a.peer == s + 1:
            t = st.outputs[(s, i)].detach()
            tag = self._tag(s + 1, i, False)
        else:
            t = st.grad_in.pop((s, i))
            tag = self._tag(s - 1, i, True)
        st.sends[tag] = (comm.isend(t, group=self._group, group_dst=self._owner[a.peer], tag=tag), t)

    def _forward(self, st: _StepState, a: Action, arg_chunks, target_chunks, losses, keep_outputs: bool) -> None:
        """F: the stage's forward of one micro-batch; on the last stage, the loss (kept as
        ``loss / m`` for backward, so the gradients are those of the batch's mean). A micro-batch
        whose backward is split runs under :class:`SavedActivations`, so B can release what W won't read."""
        s, i = a.stage, a.microbatch
        stage = self._stages[s]
        if s == 0:
            x = tuple(t.to(stage.device) for t in arg_chunks[i])
        else:
            x = st.inputs.get((s, i))
            if x is None:  # the previous stage is on this rank (the tip of ZBV's V)
                x = (st.outputs[(s - 1, i)].detach().requires_grad_(),)
        st.inputs[(s, i)] = x
        if (s, i) in self._split:  # box what autograd saves: B releases what W won't read
            with split_backward.SavedActivations() as st.saved[(s, i)]:
                out = stage.submodule(*x)
        else:
            out = stage.submodule(*x)
        if s == self._num_stages - 1:
            if keep_outputs:
                st.results.append(out.detach())
            if self._loss_fn is not None:
                loss = self._loss_fn(out, target_chunks[i][0].to(out.device))
                if losses is not None:
                    losses.append(loss.detach())
                out = loss / self._n
        st.outputs[(s, i)] = out

    def _backward(self, s: int, i: int, inputs, outputs, grad_out, grad_in, saved) -> None:
        """B: the full backward, or (split) only dL/d(inputs), keeping for W only what it reads
        (the inputs of the deferred matrix products and the gradients of their outputs)."""
        out = outputs[(s, i)]
        g = grad_out.pop((s, i), None)
        if g is None and s < self._num_stages - 1:  # the next stage is on this rank
            g = grad_in.pop((s + 1, i))
        x = [t for t in inputs[(s, i)] if t.requires_grad]
        if (s, i) in self._split:
            grads, grad_out[(s, i)] = split_backward.backward_input(out, g, x, self._params(s),
                                                                    saved.pop((s, i), None))
            del outputs[(s, i)], inputs[(s, i)]
        else:
            torch.autograd.backward(out, g)
            grads = tuple(t.grad for t in x) if s > 0 else ()
            del outputs[(s, i)], inputs[(s, i)]
        if s > 0 and grads:
            grad_in[(s, i)] = grads[0]

    def _weight_backward(self, s: int, i: int, inputs, outputs, grad_out) -> None:
        """W: dL/dW of micro-batch i from what B kept (see pipeline_backward); then its
        activations are freed."""
        split_backward.backward_weight(grad_out.pop((s, i)), self._params(s))

    def _params(self, s: int) -> list[nn.Parameter]:
        params = self._step_params.get(s)
        if params is None:  # once per stage and step
            params = self._step_params[s] = [p for p in self._stages[s].submodule.parameters()
                                             if p.requires_grad]
        return params

    def _sum_shared_gradients(self) -> None:
        """Sum the gradients of parameters held by several stages on different ranks (the tied
        embedding on the first and last stage) so every copy has the full gradient."""
        seen = set()
        names = sorted({name for st in self._stages.values()
                        for name in getattr(st.submodule, "shared_parameters", {})})
        for k, name in enumerate(names):
            for st in self._stages.values():
                entry = getattr(st.submodule, "shared_parameters", {}).get(name)
                if entry is None or id(entry[0]) in seen:
                    continue
                param, holders = entry
                seen.add(id(param))
                ranks = sorted({self._owner[h] for h in holders})
                if len(ranks) < 2:
                    continue  # every holder is on this rank: the gradients already accumulated
                if param.grad is None:
                    param.grad = torch.zeros_like(param)
                mine = param.grad.detach().clone()
                parts, works = {}, []
                for q in ranks:
                    if q == self._rank:
                        parts[q] = mine
                        continue
                    parts[q] = torch.empty_like(mine)
                    works.append(comm.irecv(parts[q], group=self._group, group_src=q, tag=_TIE_TAG + k))
                    works.append(comm.isend(mine, group=self._group, group_dst=q, tag=_TIE_TAG + k))
                for w in works:
                    w.wait()
                total = parts[ranks[0]].clone()
                for q in ranks[1:]:
                    total += parts[q]
                param.grad.copy_(total)

    def _gather_timeline(self, records) -> list[dict]:
        """Every rank's records on every rank: one small all-gather (each rank's number of
        records is its number of actions, which every rank knows from the plan)."""
        kinds = ["F", "B", "W", "send", "recv"]
        counts = self._records_per_rank
        longest = max(counts)
        device = comm.wire_device(self._group)
        padded = torch.zeros(longest, 6, dtype=torch.float64, device=device)
        if records:
            padded[:len(records)] = torch.tensor(
                [[r, s, kinds.index(k), i, a, b] for r, s, k, i, a, b in records], dtype=torch.float64)
        everyone = [torch.zeros(longest, 6, dtype=torch.float64, device=device) for _ in range(self._p)]
        comm.all_gather(everyone, padded, group=self._group)
        out = []
        for c, rows in zip(counts, everyone):
            for r, s, k, i, a, b in rows[:c].tolist():
                out.append({"rank": int(r), "stage": int(s), "kind": kinds[int(k)],
                            "microbatch": int(i), "start": a, "end": b})
        return out


class ScheduleGPipe(_Schedule):
    """GPipe: all m forwards, then all m backwards. Any m >= 1; m micro-batches alive."""

    name = "gpipe"

    def _build(self, p, m):
        return plans.gpipe(p, m)


class Schedule1F1B(_Schedule):
    """1F1B: warm-up (p - s - 1 forwards on stage s), one forward one backward, cool-down.
    Needs m >= p; at most p - s micro-batches alive on stage s."""

    name = "1f1b"

    def _build(self, p, m):
        return plans.one_f_one_b(p, m)


class ScheduleZeroBubble(_Schedule):
    """ZB-H1 (Qi et al. 2023) on one stage per rank: backward split into B (input gradient) and
    W (weight gradient), W's deferred into the cool-down. Needs m >= p; 1F1B's memory."""

    name = "zb_h1"

    def _build(self, p, m):
        return plans.zero_bubble_h1(p, m)


class ScheduleInterleaved1F1B(_Schedule):
    """Interleaved 1F1B: v stages per rank (rank r holds r, r+p, ...). m must be a multiple of
    ``max(1, m // p)`` (torch's rule); bubble (p-1)/(v m + p-1) for m >= p."""

    name = "interleaved"
    multi = True

    def _chunks(self, n_local):
        if n_local < 2:
            raise ValueError(f"ScheduleInterleaved1F1B runs several stages per rank, got {n_local}: "
                             "pass stages r, r+p, ... of this rank (or use Schedule1F1B for one)")
        return n_local

    def _check_microbatches(self, m, p):
        rounds = max(1, m // p)
        if m % rounds:
            raise ValueError(f"ScheduleInterleaved1F1B: n_microbatches={m} must be a multiple of the "
                             f"number of rounds max(1, m // p) = {rounds}: use a multiple of {p}")

    def _build(self, p, m):
        return plans.interleaved(p, len(self._stages), m)


class _VShaped(_Schedule):
    """The V placement: two stages per rank, rank r holding stages r and 2p-1-r, so the first and
    the last stage share rank 0 and the turn of the V sits on rank p-1."""

    multi = True
    style = "v"

    def _chunks(self, n_local):
        if n_local != 2:
            raise ValueError(f"{type(self).__name__} needs exactly 2 stages per rank (r and 2p-1-r), got {n_local}")
        return 2


class ScheduleZBV(_VShaped):
    """ZBV: the V-shaped zero-bubble schedule, two stages per rank (rank r holds r and 2p-1-r),
    as torch's ``ScheduleZBVZeroBubble``. Any m >= 1."""

    name = "zbv"

    def _build(self, p, m):
        return plans.zbv(p, m)


class ScheduleDualPipeV(_VShaped):
    """DualPipeV (DeepSeek-V3's DualPipe, cut in half), as torch's ``ScheduleDualPipeV``: the V of
    :class:`ScheduleZBV` (rank r holds stages r and 2p-1-r), the steady state pairing one
    chunk's forward with the other's full backward, B/W splits in the ramps. Needs m >= 2p."""

    name = "dualpipev"

    def _build(self, p, m):
        return plans.dualpipev(p, m)


# every schedule by its name (the key of pipeline_schedules' formulas), as torch's get_schedule_class
SCHEDULES = {cls.name: cls for cls in (ScheduleGPipe, Schedule1F1B, ScheduleInterleaved1F1B, ScheduleZeroBubble,
                                       ScheduleZBV, ScheduleDualPipeV)}
