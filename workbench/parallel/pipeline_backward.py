"""Splitting one backward into B (input gradient) and W (weight gradient), for zero-bubble schedules.

A stage's backward computes two things: dL/dx, which the previous stage is waiting for, and
dL/dW for its own parameters, which nobody waits for. Zero-bubble schedules (Qi et al. 2023)
run the first right away (B) and the second later (W), to fill idle time.

How, with autograd. Call the graph's nodes that lead (through ``next_functions``) to the input
x the *input path*. Every parameter's gradient leaves the input path at some node -- a Linear's
``AddmmBackward`` computes both dL/d(its input) and dL/dW from the same dL/d(its output); a
LayerNorm's node likewise. Those nodes are the *intermediates*.

* **B** runs ``autograd.grad(out, x, grad_out, retain_graph=True)``: autograd executes only the
  input path, and each node computes only the outputs that lead to x (no weight matmuls). A
  pre-hook on every intermediate keeps the gradient that flowed into it.
* **W** runs ``autograd.backward`` from those intermediates, fed the kept gradients, with
  ``inputs=`` the parameters each one branches to (one call per group of intermediates sharing
  parameters; all of them at once would also follow the input path on to the next Linear's
  weights and count those twice): autograd executes each intermediate again for its weight
  outputs only, and the short branches from there to the parameters' ``.grad``.

Which gradients wait for W. Only the weight gradients of *matrices* (Linear and embedding
weights: the weight-gradient GEMMs that zero-bubble schedules move) are deferred. Parameters
with fewer than 2 dimensions -- LayerNorm scales and shifts, biases -- get their gradient in B:
it costs next to nothing, and deferring it would keep the normalisation's input and output
gradient alive until W for no gain (Megatron's zero-bubble code does the same; torch's
``stage_backward_weight`` defers every parameter).

Memory (Qi et al. 2023, section 3). A micro-batch's forward keeps its activations, ``M_B``
bytes, until B. After B, W needs only the inputs of the deferred matrix products (the saved
``mat1`` of each Linear) and the gradients of their outputs, ``M_W`` bytes -- for a transformer
block 7 + 9 = 16 floats per token and channel against ~18 + attention for ``M_B``, so a
deferred W holds less than a pending backward (the paper's 32bsh against 34bsh + 5as^2b, in
fp16 bytes). Autograd's ``retain_graph=True`` would keep *every* saved tensor until W, so a
forward whose backward will be split runs under :class:`SavedActivations`: it boxes each tensor
autograd saves, and after B :func:`backward_input` empties the boxes that the nodes W will run
do not read. So between B and W a micro-batch holds ``M_W``, as the paper counts.

Cost: B + W = one backward (plus a Python walk over the graph per micro-batch, ~100 nodes per
GPT block). With no input requiring a gradient (a first stage fed token ids) B has nothing to
do and W is the whole backward (holding ``M_B`` until it runs). Same idea as
``torch.distributed.pipelining._backward``.
"""
from __future__ import annotations

import weakref

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["SavedActivations", "backward_input", "backward_weight"]


class _Box:
    """What autograd holds for one saved tensor while a :class:`SavedActivations` is active."""

    __slots__ = ("tensor", "read", "__weakref__")

    def __init__(self, tensor: torch.Tensor):
        self.tensor, self.read = tensor, False


class SavedActivations:
    """``with saved:`` around a forward: every tensor autograd saves for backward goes into a
    box (which autograd holds in its place), so that :func:`backward_input` can let go of those
    W will not read.

    Boxing changes nothing else: unpacking returns the very tensor that was saved, and a box
    lives exactly as long as autograd's saved copy would (this object keeps only weak references
    to the boxes). A box emptied after B and read again (it cannot be, by construction) raises
    instead of computing garbage.
    """

    __slots__ = ("boxes", "_marking", "_hooks")

    def __init__(self):
        self.boxes: list[weakref.ref] = []
        self._marking = False
        self._hooks = None

    def _pack(self, t: torch.Tensor) -> _Box:
        box = _Box(t)
        self.boxes.append(weakref.ref(box))
        return box

    def _unpack(self, box: _Box) -> torch.Tensor:
        if box.tensor is None:
            raise RuntimeError("pipeline_backward: a saved activation released after B was read "
                               "again: W ran a node that B's analysis did not foresee")
        if self._marking:
            box.read = True
        return box.tensor

    def __enter__(self) -> "SavedActivations":
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._hooks.__exit__(*exc)
        self._hooks = None  # no reference cycle: the graph's nodes hold this object, not back

    def keep_only_read_by(self, nodes) -> None:
        """Release every saved tensor that none of ``nodes`` reads. Reading a node's saved
        attribute (``_saved_mat1``, a custom Function's ``saved_tensors``) unpacks it through
        :meth:`_unpack`, which marks its box."""
        self._marking = True
        try:
            for n in nodes:
                for name in _saved_names(type(n)):
                    try:
                        getattr(n, name)
                    except RuntimeError:  # already freed, or not readable outside backward
                        pass
        finally:
            self._marking = False
        alive = []
        for ref in self.boxes:
            box = ref()
            if box is None:
                continue
            if box.read:
                alive.append(ref)
            else:
                box.tensor = None
        self.boxes = alive


_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def _saved_names(node_type: type) -> tuple[str, ...]:
    """The attributes through which a node of this type exposes what it saved (per type, once)."""
    names = _SAVED_NAMES.get(node_type)
    if names is None:
        names = _SAVED_NAMES[node_type] = tuple(
            a for a in dir(node_type) if a.startswith("_saved_") or a == "saved_tensors")
    return names


def _node(t: torch.Tensor):
    return get_gradient_edge(t).node


def _reaching(graph_children: dict, targets: set) -> set:
    """The nodes from which some node of ``targets`` is reachable along ``next_functions``."""
    parents: dict = {}
    for n, kids in graph_children.items():
        for k in kids:
            parents.setdefault(k, []).append(n)
    seen, stack = set(targets), list(targets)
    while stack:
        n = stack.pop()
        for q in parents.get(n, ()):
            if q not in seen:
                seen.add(q)
                stack.append(q)
    return seen


def _accumulate(param: torch.Tensor, grad: torch.Tensor | None) -> None:
    """Add ``grad`` into a parameter's ``.grad`` as backward would: through autograd's own
    accumulation for a leaf, so that the hooks strategies put on it run (DDP adopting the gradient
    into its bucket, ZeRO-2 moving it into its flat buffer)."""
    if grad is None:
        return
    if param.is_leaf and param.requires_grad:
        torch.autograd.backward(param, grad)
        return
    if param.grad is None:
        param.grad = grad.detach().clone()
    else:
        param.grad += grad


def backward_input(out: torch.Tensor, grad_out: torch.Tensor | None, inputs: list[torch.Tensor],
                   params: list[torch.Tensor], saved: SavedActivations | None = None):
    """B: dL/d(inputs) (a tuple), and the state W needs (pass it to :func:`backward_weight`).

    Gradients of parameters with fewer than 2 dimensions are accumulated into their ``.grad``
    here. With ``saved`` (the :class:`SavedActivations` the forward ran under), every saved
    activation the W nodes do not read is released before returning.
    """
    if not inputs:  # nothing to send back: W does the whole backward from the output
        return (), {"edges": None, "grads": grad_out, "out": out}
    deferred = [p for p in params if p.dim() >= 2]
    now = [p for p in params if p.dim() < 2]
    children = _graph_below(out.grad_fn)
    by_node = {_node(p): p for p in deferred}
    owned, branch_nodes = _intermediates(children, {_node(x) for x in inputs}, set(by_node))
    grads, kept = _input_gradients(out, grad_out, inputs, now, owned)
    work = _weight_calls(owned, kept, by_node)
    if saved is not None:
        saved.keep_only_read_by(set(owned) | branch_nodes)
    return grads, {"edges": work, "grads": None, "out": None}


def _graph_below(root) -> dict:
    """The whole autograd graph below ``root``: node -> its children (``next_functions``)."""
    children: dict = {}
    stack = [root]
    while stack:
        n = stack.pop()
        if n is None or n in children:
            continue
        children[n] = [k for k, _ in n.next_functions if k is not None]
        stack.extend(children[n])
    return children


def _intermediates(children: dict, input_nodes: set, param_nodes: set) -> tuple[dict, set]:
    """The intermediates: input-path nodes with a child off the input path that leads to a
    deferred parameter. Returns ``{intermediate: the parameter nodes its off-path children reach}``
    and the nodes on those branches (W runs them again, so their saved tensors stay after B).

    In the order autograd runs them (latest first), not a set's: the W calls must issue any
    collectives inside them (sequence parallelism's re-gather) in the same order on every rank."""
    input_path = _reaching(children, input_nodes)
    towards_params = _reaching(children, param_nodes)
    owned: dict = {}
    branch_nodes: set = set()
    for n in sorted(input_path & towards_params, key=lambda node: -node._sequence_nr()):
        found, stack = set(), [k for k in children[n] if k in towards_params and k not in input_path]
        seen = set(stack)
        while stack:
            k = stack.pop()
            if k in param_nodes:
                found.add(k)
            for c in children.get(k, ()):
                if c in towards_params and c not in input_path and c not in seen:
                    seen.add(c)
                    stack.append(c)
        if found:
            owned[n] = found
            branch_nodes |= seen
    return owned, branch_nodes


def _input_gradients(out: torch.Tensor, grad_out, inputs: list[torch.Tensor], now: list[torch.Tensor],
                     owned: dict) -> tuple[tuple, dict]:
    """B proper: one ``autograd.grad`` for dL/d(inputs) and the gradients of ``now`` (the small
    parameters, accumulated into their ``.grad`` here), the graph kept for W when it has
    intermediates. A pre-hook on each intermediate keeps the gradients that flowed into it.
    Returns ``(dL/d(inputs), {intermediate: its incoming gradients})``."""
    kept: dict = {}
    handles = [n.register_prehook(lambda grads, n=n: kept.__setitem__(n, grads)) for n in owned]
    try:
        wanted = list(inputs) + now
        grads = torch.autograd.grad(out, wanted, grad_out, retain_graph=bool(owned), allow_unused=True)
    finally:
        for h in handles:
            h.remove()
    for p, g in zip(now, grads[len(inputs):]):
        _accumulate(p, g)
    return grads[:len(inputs)], kept


def _weight_calls(owned: dict, kept: dict, by_node: dict) -> list[tuple[list, list, list]]:
    """W's work: one ``(edges, gradients, parameters)`` per group of intermediates sharing
    parameters, with only that group's parameters as ``inputs=``: from one Linear's node the input
    path also leads on to the layers below, whose weights are another intermediate's business (they
    must not be counted twice). Edges in autograd's order (latest first), as in B."""
    groups: list[tuple[set, set]] = []
    for n, ps in owned.items():
        merged = [g for g in groups if g[1] & ps]
        nodes, pset = {n}, set(ps)
        for g in merged:
            groups.remove(g)
            nodes |= g[0]
            pset |= g[1]
        groups.append((nodes, pset))
    work = []
    for nodes, pset in groups:
        edges, values = [], []
        for n in sorted(nodes, key=lambda node: -node._sequence_nr()):
            for i, g in enumerate(kept.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    values.append(g)
        if edges:
            work.append((edges, values, [by_node[k] for k in pset]))
    return work


def backward_weight(state: dict, params: list[torch.Tensor]) -> None:
    """W: accumulate dL/dW into ``params``' ``.grad`` from what :func:`backward_input` kept."""
    if state["edges"] is None:  # B had nothing to do: the whole backward, for the weights
        torch.autograd.backward(state["out"], state["grads"], inputs=params)
    else:
        for edges, values, group_params in state["edges"]:
            torch.autograd.backward(edges, values, inputs=group_params)
