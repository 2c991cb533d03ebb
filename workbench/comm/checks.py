"""Argument checks shared by the collectives.

Every check runs on the calling rank before anything is sent, and raises a ``ValueError``
(``TypeError`` for a wrong kind of object) that names the argument, its value and the fix. A rank
that raises before sending leaves its peers blocked in a receive; under ``workbench.launch`` the
launcher then stops every rank and reports :class:`workbench.RankFailed` for the rank that raised.
"""
from __future__ import annotations

import warnings

import torch
import torch.distributed as dist

from workbench.comm import emulation, ops, topology
from workbench.comm.group import GroupView, resolve_group


def check_algorithm(collective: str, algorithm, known) -> str:
    if not isinstance(algorithm, str) or algorithm not in known:
        raise ValueError(f"{collective}: algorithm={algorithm!r} is not known: use one of "
                         f"{tuple(known)} (see workbench.comm.ALGORITHMS[{collective!r}])")
    return algorithm


def check_tensor(tensor, name: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")


def check_list(tensors, name: str, size: int, like: torch.Tensor, like_name: str) -> None:
    """``tensors`` is a list of ``size`` tensors, each of ``like``'s shape and dtype."""
    if not isinstance(tensors, (list, tuple)):
        raise TypeError(f"{name} must be a list of {size} tensors (one per rank of the group), "
                        f"got {type(tensors).__name__}")
    if len(tensors) != size:
        raise ValueError(f"{name} has {len(tensors)} tensors but the group has {size} ranks: "
                         f"pass exactly one tensor per rank")
    for i, t in enumerate(tensors):
        check_tensor(t, f"{name}[{i}]")
        if t.dtype != like.dtype:
            raise ValueError(f"{name}[{i}] has dtype {t.dtype} but {like_name} has {like.dtype}: "
                             "every tensor of a collective must have the same dtype")
        if t.shape != like.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(t.shape)} but {like_name} has "
                             f"{tuple(like.shape)}: every tensor must have {like_name}'s shape")


def check_op(collective: str, op, dtype: torch.dtype, algorithm: str) -> None:
    if algorithm != "native" and op not in ops.SUPPORTED_OPS:
        raise ValueError(f"{collective}: op={ops.op_name(op)} is not supported by algorithm={algorithm!r}: use "
                         f"one of ReduceOp.{', ReduceOp.'.join(ops.SUPPORTED_OPS.values())}, "
                         "or algorithm='native'")
    if op == dist.ReduceOp.AVG and not (dtype.is_floating_point or dtype.is_complex):
        raise ValueError(f"{collective}: op=ReduceOp.AVG needs a floating-point tensor, got dtype "
                         f"{dtype} (the mean of integers is not an integer): use ReduceOp.SUM and "
                         "divide, or convert to float")
    if algorithm != "native" and dtype not in ops.REDUCE_DTYPES:
        raise ValueError(f"{collective}: dtype {dtype} cannot be reduced by algorithm={algorithm!r}: "
                         f"use one of {[str(d) for d in ops.REDUCE_DTYPES]}, or algorithm='native'")


def check_root(view: GroupView, rank, group_rank, name: str, default_to_zero: bool) -> int:
    """Return the root's rank in the group from ``src``/``dst`` (global rank, as in torch) or
    ``group_src``/``group_dst`` (rank in the group)."""
    group_name = f"group_{name}"
    if rank is not None and group_rank is not None:
        raise ValueError(f"pass {name}= (a global rank) or {group_name}= (a rank in the group), "
                         f"not both: got {name}={rank!r}, {group_name}={group_rank!r}")
    if rank is None and group_rank is None:
        if not default_to_zero:
            raise ValueError(f"{name} is required: pass {name}= (a global rank) or {group_name}= "
                             "(a rank in the group)")
        rank = 0
    if group_rank is not None:
        if isinstance(group_rank, bool) or not isinstance(group_rank, int) or not 0 <= group_rank < view.size:
            raise ValueError(f"{group_name}={group_rank!r} is out of range: the group has {view.size} "
                             f"ranks, numbered 0..{view.size - 1}")
        return group_rank
    world = dist.get_world_size()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world:
        raise ValueError(f"{name}={rank!r} is out of range: {name} is a global rank, 0..{world - 1} "
                         f"(use {group_name}= for a rank numbered inside the group)")
    try:
        return view.group_rank(rank)
    except (ValueError, RuntimeError):
        raise ValueError(f"{name}={rank} is not a member of the group: {name} is a global rank; "
                         f"the group has global ranks {[view.global_rank(i) for i in range(view.size)]} "
                         f"(or pass {group_name}= in group numbering)") from None


def enter(collective: str, algorithm, known, tensor, tensor_name: str, group) -> GroupView | None:
    """The checks every collective starts with: a known ``algorithm``, a tensor, and the group.

    Returns this rank's view of ``group``, or None (with torch's warning) if this rank is not in
    it: such a rank does nothing and the collective returns None, as in torch.distributed.
    """
    check_algorithm(collective, algorithm, known)
    check_tensor(tensor, tensor_name)
    view = resolve_group(group)
    if view is None:
        warnings.warn(f"Running {collective} on global rank {dist.get_rank()} which does not belong "
                      "to the given group.", stacklevel=3)
    return view


def run_as(collective: str, algorithm: str, view: GroupView) -> str:
    """The algorithm to run: ``algorithm``, except ``"native"`` on a group that crosses a link an
    emulated topology slows down, which runs the hand-written algorithm gloo uses instead (torch's
    messages cannot be held back: see emulation.py)."""
    if algorithm != "native" or emulation.current() is None:
        return algorithm
    return emulation.native_stand_in(collective, emulation.global_ranks(view.pg)) or algorithm


def hierarchy(collective: str, view: GroupView):
    """The node layout of ``view``'s group for ``algorithm="hierarchical"`` (a clear ValueError
    without a topology, or when the group's nodes hold different numbers of its ranks)."""
    return topology.hierarchy(collective, emulation.current(), emulation.global_ranks(view.pg), view.rank)
