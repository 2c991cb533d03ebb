"""Who holds what before and after each collective: small labelled inputs, run on real ranks.

Each rank starts with a small tensor whose values say where they came from. In the reducing
collectives rank r holds powers of ten, ``10^r``, so a sum such as ``1111`` shows that ranks 0-3
all contributed (``1001``: ranks 0 and 3); in all-to-all rank r's element j is ``10 (r+1) + (j+1)``
(tens: where it came from, units: where it goes); in the others the values number the elements. Every
algorithm of every collective runs on the same inputs, and its output is compared with what
``torch.distributed`` itself returns for them (:func:`before_and_after`, inside a launch).
:func:`workbench.measure.plots.holdings` draws the result: one row per rank, one cell per element.

This is the check lesson 01 pictures; the parity tests (``tests/test_comm.py``) check the same
algorithms on random data, every dtype and uneven sizes.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from workbench import comm

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "reduce", "gather", "scatter",
               "all_to_all_single")
ROOT = 0  # src/dst of the rooted collectives


def inputs(collective: str, rank: int, world_size: int) -> list[float] | None:
    """What ``rank`` holds before ``collective`` (None: a rank that contributes nothing)."""
    r, p = rank, world_size
    if collective in ("all_reduce", "reduce"):
        return [10.0 ** r] * p
    if collective == "reduce_scatter":
        return [(i + 1) * 10.0 ** r for i in range(p)]
    if collective == "broadcast":
        return [float(i + 1) for i in range(p)] if r == ROOT else [0.0] * p
    if collective == "scatter":
        return [float(i + 1) for i in range(p)] if r == ROOT else None
    if collective in ("all_gather", "gather"):
        return [float(r + 1)]  # one element each
    if collective == "all_to_all_single":
        return [10.0 * (r + 1) + j + 1 for j in range(p)]  # element j goes to rank j
    raise ValueError(f"collective={collective!r} is not known: use one of {', '.join(COLLECTIVES)}")


def run(collective: str, algorithm: str | None, rank: int, world_size: int) -> list[float] | None:
    """Run ``collective`` on :func:`inputs` with ``algorithm`` of ``workbench.comm`` (None:
    ``torch.distributed`` itself) inside a rank; what this rank holds afterwards (None where it
    holds no result: a reduce's or gather's non-root)."""
    r, p = rank, world_size
    x = inputs(collective, r, p)
    if algorithm is None:
        call, kw = (lambda name: getattr(dist, name)), {}
    else:
        call, kw = (lambda name: getattr(comm, name)), {"algorithm": algorithm}
    if collective in ("all_reduce", "broadcast", "reduce"):
        t = torch.tensor(x)
        if collective == "all_reduce":
            call("all_reduce")(t, **kw)
        elif collective == "broadcast":
            call("broadcast")(t, ROOT, **kw)
        else:
            call("reduce")(t, ROOT, **kw)
            return t.tolist() if r == ROOT else None  # other ranks' buffers are scratch space
        return t.tolist()
    if collective == "all_gather":
        outs = [torch.zeros(1) for _ in range(p)]
        call("all_gather")(outs, torch.tensor(x), **kw)
        return torch.cat(outs).tolist()
    if collective == "reduce_scatter":
        out = torch.zeros(1)
        call("reduce_scatter")(out, list(torch.tensor(x).chunk(p)), **kw)
        return out.tolist()
    if collective == "gather":
        outs = [torch.zeros(1) for _ in range(p)] if r == ROOT else None
        call("gather")(torch.tensor(x), outs, dst=ROOT, **kw)
        return torch.cat(outs).tolist() if r == ROOT else None
    if collective == "all_to_all_single":
        out = torch.zeros(p)
        call("all_to_all_single")(out, torch.tensor(x), **kw)
        return out.tolist()
    out = torch.zeros(1)  # scatter
    call("scatter")(out, list(torch.tensor(x).chunk(p)) if r == ROOT else None, src=ROOT, **kw)
    return out.tolist()


def before_and_after(collectives=COLLECTIVES) -> dict:
    """Call on every rank: for each collective, every rank's holdings before and after
    (``torch.distributed``'s result) and, per algorithm, whether it returned the same on every
    rank. The same dict on every rank (under torchrun each process can read the whole picture)."""
    r, p = dist.get_rank(), dist.get_world_size()
    mine = {}
    for c in collectives:
        reference = run(c, None, r, p)
        mine[c] = {"before": inputs(c, r, p), "after": reference,
                   "parity": {a: run(c, a, r, p) == reference for a in comm.ALGORITHMS[c]}}
    everyone = [None] * p
    dist.all_gather_object(everyone, mine)
    return {c: {"before": [e[c]["before"] for e in everyone], "after": [e[c]["after"] for e in everyone],
                "parity": {a: all(e[c]["parity"][a] for e in everyone) for a in comm.ALGORITHMS[c]}}
            for c in collectives}
