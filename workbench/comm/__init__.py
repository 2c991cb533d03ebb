"""Collectives written by hand from point-to-point messages: the only door strategies talk through.

Same names, signatures and in-place semantics as ``torch.distributed``, plus ``algorithm=``::

    from workbench import comm
    comm.all_reduce(t)                                   # torch.distributed.all_reduce ("native")
    comm.all_reduce(t, algorithm="ring")                 # ours, from isend/irecv
    h = comm.all_reduce(t, algorithm="ring", async_op=True); ...; h.wait()
    with comm.counters() as c:
        comm.all_gather(outs, t, algorithm="bruck")
    print(c.table())

=================  ========================================================================
collective         algorithms (default ``"native"`` everywhere)
=================  ========================================================================
broadcast          native, flat, binomial, scatter_allgather
reduce             native, flat, binomial
all_reduce         native, reduce_broadcast, ring, recursive_doubling, rabenseifner, hierarchical
scatter, gather    native, flat, binomial
all_gather         native, ring, recursive_doubling, bruck, hierarchical
reduce_scatter     native, ring, recursive_halving, hierarchical
all_to_all_single  native, pairwise, bruck
=================  ========================================================================

``hierarchical`` needs to know which ranks share a node (``comm.ALGORITHMS`` lists the algorithms
that run on any group, ``comm.TOPOLOGY_ALGORITHMS`` the ones that need a topology): a
:class:`Topology`, given to ``workbench.launch(..., topology=)``, by ``WORKBENCH_TOPOLOGY`` under
torchrun, or to :func:`emulate` on every rank. A topology can also slow the links down, so that
one machine behaves like a cluster whose links between nodes are slower than inside them
(:mod:`workbench.comm.topology`, :mod:`workbench.comm.emulation`); on groups that cross a slowed
link ``algorithm="native"`` then runs the hand-written algorithm gloo uses (torch's messages
cannot be held back), with a warning.

Point-to-point: ``send``, ``recv``, ``isend``, ``irecv`` (torch's signatures, ``p2p.py``), counted
as ``("send", "native")`` etc.

Every algorithm works for every group size (recursive doubling/halving fold non-powers of two
in and out), every tensor size (uneven, smaller than the group, empty), ``ReduceOp`` SUM,
PRODUCT, MIN, MAX and AVG (floating point only, as a SUM then a division), the dtypes gloo
reduces, non-contiguous tensors, and sub-groups from ``torch.distributed.new_group``. As in torch,
``src``/``dst`` are global ranks and ``group_src``/``group_dst`` ranks inside ``group``; a rank that
is not in ``group`` does nothing and returns None. Each algorithm's docstring gives its
alpha-beta cost and draws its messages.

``async_op=True`` returns a handle with ``wait()`` and ``is_completed()`` (see
:mod:`workbench.comm.work`); hand-written collectives then run, in issue order, on one background
communication thread per process.

Where things are: one module per collective (``broadcast.py``, ``reduce.py``, ``all_reduce.py``,
``scatter_gather.py``, ``all_gather.py``, ``reduce_scatter.py``, ``all_to_all.py``) holds its
algorithms and its public function; ``group.py`` the point-to-point layer (group numbering,
counted ``isend``/``irecv``, block and segment splits, power-of-two folding), ``ops.py`` the
reduction operators, ``checks.py`` the argument checks, ``work.py`` the async handles and the
communication thread, ``counters.py`` the counters, ``dispatch.py`` what runs one call,
``topology.py`` the emulated cluster's description (nodes, links, presets) and ``emulation.py``
how its messages are held back. As in ``torch.distributed``, ``workbench.comm.all_reduce`` is the
*function*; reach a module's algorithms with ``from workbench.comm.all_reduce import ring``
(``import workbench.comm.all_reduce as m`` would give the function).
"""
from __future__ import annotations

# The functions share their modules' names (comm.reduce is the function, as in torch.distributed);
# the modules stay reachable as workbench.comm.<name> in sys.modules and through `from ... import`.
from workbench.comm.all_gather import ALGORITHMS as _ALL_GATHER, all_gather
from workbench.comm.all_reduce import ALGORITHMS as _ALL_REDUCE, all_reduce
from workbench.comm.all_to_all import ALGORITHMS as _ALL_TO_ALL, all_to_all_single
from workbench.comm.broadcast import ALGORITHMS as _BROADCAST, broadcast
from workbench.comm.counters import Counters, LinkStat, Stat, counters
from workbench.comm.emulation import emulate, node_groups
from workbench.comm.topology import Link, Topology
from workbench.comm.ops import ReduceOp
from workbench.comm.p2p import irecv, isend, recv, send
from workbench.comm.group import wire_device
from workbench.comm.reduce import ALGORITHMS as _REDUCE, reduce
from workbench.comm.reduce_scatter import ALGORITHMS as _REDUCE_SCATTER, reduce_scatter
from workbench.comm.scatter_gather import GATHER_ALGORITHMS as _GATHER, SCATTER_ALGORITHMS as _SCATTER
from workbench.comm.scatter_gather import gather, scatter
from workbench.comm.work import Work

# algorithms that need a topology (which ranks share a node): refused without one
NEEDS_TOPOLOGY = frozenset({"hierarchical"})


def _any_group(algorithms) -> tuple[str, ...]:
    return tuple(a for a in algorithms if a not in NEEDS_TOPOLOGY)


# the algorithms that run on any group, as in the table above
ALGORITHMS: dict[str, tuple[str, ...]] = {
    "broadcast": _any_group(_BROADCAST),
    "reduce": _any_group(_REDUCE),
    "all_reduce": _any_group(_ALL_REDUCE),
    "scatter": _any_group(_SCATTER),
    "gather": _any_group(_GATHER),
    "all_gather": _any_group(_ALL_GATHER),
    "reduce_scatter": _any_group(_REDUCE_SCATTER),
    "all_to_all_single": _any_group(_ALL_TO_ALL),
}
# the algorithms that need a topology: {"all_reduce": ("hierarchical",), ...}
TOPOLOGY_ALGORITHMS: dict[str, tuple[str, ...]] = {
    name: tuple(a for a in algs if a in NEEDS_TOPOLOGY)
    for name, algs in (("all_reduce", _ALL_REDUCE), ("all_gather", _ALL_GATHER), ("reduce_scatter", _REDUCE_SCATTER))
}

__all__ = ["send", "recv", "isend", "irecv", "broadcast", "reduce", "all_reduce", "scatter", "gather", "all_gather",
           "reduce_scatter", "all_to_all_single", "ALGORITHMS", "TOPOLOGY_ALGORITHMS", "NEEDS_TOPOLOGY", "ReduceOp",
           "counters", "Counters", "Stat", "LinkStat", "Work", "Link", "Topology", "emulate", "node_groups"]
