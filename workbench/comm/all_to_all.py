"""All-to-all: every rank sends a different block to every rank (a transpose across ranks).

::

    before (rank i holds row i)      after (rank j holds column j)
    rank 0: a0 a1 a2 a3              rank 0: a0 b0 c0 d0
    rank 1: b0 b1 b2 b3              rank 1: a1 b1 c1 d1
    rank 2: c0 c1 c2 c3              rank 2: a2 b2 c2 d2
    rank 3: d0 d1 d2 d3              rank 3: a3 b3 c3 d3

``all_to_all_single(output, input, output_split_sizes, input_split_sizes)`` works on one tensor
per side, split along dimension 0, as ``torch.distributed.all_to_all_single``: rank i's
``input[rows of block j]`` lands in rank j's ``output[rows of block i]``. Without split sizes
dimension 0 is cut into p equal blocks; with them the blocks may be uneven (and empty), and
they must agree across ranks: rank i's ``input_split_sizes[j]`` is rank j's
``output_split_sizes[i]`` (the rows i sends j). Each rank knows only its own sizes, so that
cannot be checked without a message: sizes that disagree are the caller's error, as in torch.

Where it is used: DeepSpeed-Ulysses context parallelism (sequence shards <-> head shards, see
:mod:`workbench.parallel.context`) and expert parallelism (tokens to their experts and back).

Algorithms (n = bytes of one rank's whole input, p ranks):

* ``pairwise``: p-1 rounds; in round k rank r sends its block for rank ``(r+k) % p`` and
  receives the block from rank ``(r-k) % p``, both at once; its own block is a local copy::

      p = 4, round 1:  0 -> 1 -> 2 -> 3 -> 0      (each arrow one block)
             round 2:  0 -> 2, 1 -> 3, 2 -> 0, 3 -> 1
             round 3:  0 -> 3 -> 2 -> 1 -> 0

  Every rank sends one message and receives one per round, so no link is ever asked to carry two
  at once. ``(p-1) alpha + ((p-1)/p) n beta`` (even splits): every byte but this rank's own block
  leaves once, the bandwidth lower bound; unlike all-gather there is no way to fewer rounds
  without sending some bytes more than once (Bruck's all-to-all does that trade).
* ``native``: ``torch.distributed.all_to_all_single`` (gloo's alltoallv on CPU).

Counted (see :mod:`workbench.comm.counters`) as ``("all_to_all_single", algorithm)``, bytes sent
= every input block but this rank's own, bytes received = every output block but its own.
Memory: nothing beyond the caller's two tensors (a non-contiguous one is copied).
"""
from __future__ import annotations

import math

import torch
import torch.distributed as dist

from workbench.comm import checks
from workbench.comm.dispatch import flat_buffer, run_algorithm, run_native
from workbench.comm.group import Comm


def pairwise(c: Comm, out_blocks: list[torch.Tensor], in_blocks: list[torch.Tensor]) -> None:
    """Pairwise exchange: round k, send to ``r + k``, receive from ``r - k`` (see the module
    docstring). ``(p-1) alpha + ((p-1)/p) n beta``. Receives go straight into the output."""
    p, r = c.size, c.rank
    out_blocks[r].copy_(in_blocks[r])  # this rank's own block never leaves
    for k in range(1, p):
        to, frm = (r + k) % p, (r - k) % p
        c.sendrecv(in_blocks[to], to, out_blocks[frm], frm)


ALGORITHMS = {"native": None, "pairwise": pairwise}


def _splits(sizes, name: str, rows: int, p: int, tensor_name: str) -> list[int]:
    """The rows of each of the p blocks (checked): given, or dimension 0 cut into p equal blocks."""
    if sizes is None:
        if rows % p:
            raise ValueError(f"all_to_all_single: {tensor_name} has {rows} rows (dimension 0), which do not "
                             f"split into {p} equal blocks (one per rank): pass {name}= or make dimension 0 "
                             f"a multiple of {p}")
        return [rows // p] * p
    sizes = list(sizes)
    if len(sizes) != p or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes):
        raise ValueError(f"all_to_all_single: {name}={sizes!r} must be {p} whole numbers >= 0, the rows of "
                         "dimension 0 for each rank of the group")
    if sum(sizes) != rows:
        raise ValueError(f"all_to_all_single: {name}={sizes!r} adds up to {sum(sizes)} rows but {tensor_name} "
                         f"has {rows} (dimension 0): the sizes must add up to {tensor_name}.shape[0]")
    return sizes


def all_to_all_single(output: torch.Tensor, input: torch.Tensor, output_split_sizes=None,
                      input_split_sizes=None, group=None, async_op: bool = False, algorithm: str = "native"):
    """Like ``torch.distributed.all_to_all_single``: block j of ``input`` (rows along dimension 0)
    goes to rank j, and block i of ``output`` receives rank i's block for this rank."""
    view = checks.enter("all_to_all_single", algorithm, ALGORITHMS, output, "output", group)
    if view is None:
        return None
    algorithm = checks.run_as("all_to_all_single", algorithm, view)  # pairwise under an emulated topology
    checks.check_tensor(input, "input")
    if input.dtype != output.dtype:
        raise ValueError(f"all_to_all_single: input has dtype {input.dtype} but output has {output.dtype}: "
                         "both must have the same dtype")
    if input.dim() == 0 or output.dim() == 0 or input.shape[1:] != output.shape[1:]:
        raise ValueError(f"all_to_all_single: input has shape {tuple(input.shape)} and output "
                         f"{tuple(output.shape)}: both need a dimension 0 to split and the same shape "
                         "after it (each row travels whole)")
    p, r = view.size, view.rank
    in_rows = _splits(input_split_sizes, "input_split_sizes", input.shape[0], p, "input")
    out_rows = _splits(output_split_sizes, "output_split_sizes", output.shape[0], p, "output")
    per_row = math.prod(input.shape[1:])  # elements of one row (the same on both sides)
    row_bytes = per_row * input.element_size()
    sent = (sum(in_rows) - in_rows[r]) * row_bytes
    received = (sum(out_rows) - out_rows[r]) * row_bytes
    if algorithm == "native":
        def start(a: bool) -> None:
            out, write_back = flat_buffer(output)
            dist.all_to_all_single(out.view(output.shape), input.contiguous(), list(out_rows), list(in_rows),
                                   group=view.pg, async_op=a)
            write_back()

        return run_native("all_to_all_single", start, sent=sent, received=received, async_op=async_op)
    algo = ALGORITHMS[algorithm]

    def body(c: Comm) -> None:
        out, write_back = flat_buffer(output)
        inp = input.contiguous().view(-1)
        in_blocks = list(inp.split([n * per_row for n in in_rows]))  # block j: the rows for rank j
        out_blocks = list(out.split([n * per_row for n in out_rows]))  # block i: the rows from rank i
        algo(c, out_blocks, in_blocks)
        write_back()

    return run_algorithm("all_to_all_single", algorithm, view, body, async_op)
