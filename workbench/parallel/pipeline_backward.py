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

Cost: B + W = one backward (plus a Python walk over the graph per micro-batch, ~100 nodes per
GPT block). Memory: W needs the saved activations (kept until W, as the schedule counts) and the
gradients kept at the intermediates (about one activation gradient per Linear/LayerNorm) from B
until W. With no input requiring a gradient (a first stage fed token ids) B has nothing to do
and W is the whole backward. Same idea as ``torch.distributed.pipelining._backward``.
"""
from __future__ import annotations

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

__all__ = ["backward_input", "backward_weight"]


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


def backward_input(out: torch.Tensor, grad_out: torch.Tensor | None, inputs: list[torch.Tensor],
                   params: list[torch.Tensor]):
    """B: dL/d(inputs) (a tuple), and the state W needs (pass it to :func:`backward_weight`)."""
    root = out.grad_fn
    children: dict = {}
    stack = [root]
    while stack:  # the whole graph below `out`
        n = stack.pop()
        if n is None or n in children:
            continue
        children[n] = [k for k, _ in n.next_functions if k is not None]
        stack.extend(children[n])
    input_path = _reaching(children, {_node(x) for x in inputs})
    param_nodes = {_node(p) for p in params}
    towards_params = _reaching(children, param_nodes)
    if not input_path:  # nothing to send back: W does the whole backward from the output
        return (), {"edges": None, "grads": grad_out, "out": out}
    # intermediates: input-path nodes with a child off the input path that leads to a parameter;
    # each one's parameters are those reachable through such children
    owned: dict = {}
    for n in input_path & towards_params:
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
    kept: dict = {}
    handles = [n.register_prehook(lambda grads, n=n: kept.__setitem__(n, grads)) for n in owned]
    try:
        grads = torch.autograd.grad(out, inputs, grad_out, retain_graph=True)
    finally:
        for h in handles:
            h.remove()
    # one W call per group of intermediates sharing parameters, with inputs= only that group's
    # parameters: from one Linear's node, the input path also leads on to the layers below, whose
    # weights are another intermediate's business (they must not be counted twice)
    groups: list[tuple[set, set]] = []
    for n, ps in owned.items():
        merged = [g for g in groups if g[1] & ps]
        nodes, pset = {n}, set(ps)
        for g in merged:
            groups.remove(g)
            nodes |= g[0]
            pset |= g[1]
        groups.append((nodes, pset))
    by_node = {_node(p): p for p in params}
    work = []
    for nodes, pset in groups:
        edges, values = [], []
        for n in nodes:
            for i, g in enumerate(kept.get(n, ())):
                if g is not None:
                    edges.append(GradientEdge(n, i))
                    values.append(g)
        if edges:
            work.append((edges, values, [by_node[k] for k in pset]))
    return grads, {"edges": work, "grads": None, "out": out}


def backward_weight(state: dict, params: list[torch.Tensor]) -> None:
    """W: accumulate dL/dW into ``params``' ``.grad`` from what :func:`backward_input` kept."""
    if state["edges"] is None:  # B had nothing to do: the whole backward, for the weights
        torch.autograd.backward(state["out"], state["grads"], inputs=params)
    else:
        for edges, values, group_params in state["edges"]:
            torch.autograd.backward(edges, values, inputs=group_params)
