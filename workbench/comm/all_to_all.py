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
* ``bruck`` (Bruck, Ho, Kipnis, Upfal and Weathersby 1997): ``ceil(lg p)`` rounds for any p, for
  small messages. Rotate locally so that slot i holds the block for rank ``r + i``; in round k
  (d = 2^k) send every slot whose index has bit k set to rank ``r + d`` and receive the same slots
  from ``r - d``; a block for ``r + i`` thus hops the binary digits of i and lands in slot i of
  its destination, which holds the block *from* rank ``r - i`` there (the final inverse
  rotation)::

      p = 4, slots 0 1 2 3:  round 0 (d=1) sends slots 1, 3 to r+1
                             round 1 (d=2) sends slots 2, 3 to r+2   (slot 3 hops twice)

  ``ceil(lg p) alpha + (lg p / 2) n beta`` for a power of two (half the slots move each round),
  ``sum_i popcount(i) n/p`` bytes sent in general: fewer messages than pairwise, more bytes.
  Uneven splits: a rank forwards blocks between *other* ranks, whose sizes only their source and
  destination know, so each round first sends a header of the moving slots' row counts (one
  int64 each) and then their rows packed in one message: ``2 ceil(lg p)`` messages and
  ``8 sum_i popcount(i)`` header bytes per rank more. Whether the headers are sent follows from
  the arguments: split sizes given -> headers. Ranks must therefore agree on passing split
  sizes (all of them, or none: all-None means every block has the same size, known to everyone).
  Copies: the slots packed into each round's message, and the final rotation into the output.
* ``native``: ``torch.distributed.all_to_all_single`` (gloo's alltoallv on CPU).

Counted (see :mod:`workbench.comm.counters`) as ``("all_to_all_single", algorithm)``, bytes sent
= every input block but this rank's own, bytes received = every output block but its own (for
``bruck``: every byte of every message, forwarded blocks and headers included).
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


def bruck_rounds(p: int) -> list[tuple[int, list[int]]]:
    """Bruck's schedule: per round, the distance ``d = 2^k`` and the slots (indices with bit k set)
    that move, the same on every rank. ``p = 4``: ``[(1, [1, 3]), (2, [2, 3])]``."""
    rounds, d = [], 1
    while d < p:
        rounds.append((d, [i for i in range(p) if i & d]))
        d <<= 1
    return rounds


def bruck(c: Comm, out_blocks: list[torch.Tensor], in_blocks: list[torch.Tensor],
          per_row: int = 1, sized: bool = False) -> None:
    """Bruck's all-to-all (see the module docstring): ``ceil(lg p)`` rounds; in round k the slots
    with bit k set go to ``r + 2^k``, packed in one message. ``sized``: the blocks' sizes are not
    known to every rank (uneven splits), so a header of row counts goes first in each round."""
    p, r = c.size, c.rank
    slots = [in_blocks[(r + i) % p] for i in range(p)]  # local rotation: slot i is for rank r + i
    for d, moving in bruck_rounds(p):
        to, frm = (r + d) % p, (r - d) % p
        pack = torch.cat([slots[i] for i in moving])  # one message per round
        if sized:
            rows = torch.tensor([slots[i].numel() // per_row for i in moving], dtype=torch.int64,
                                device=pack.device)
            got_rows = torch.empty_like(rows)
            c.sendrecv(rows, to, got_rows, frm)
            sizes = [int(n) * per_row for n in got_rows.tolist()]
        else:  # every block has the same size, the one of this rank's own
            sizes = [slots[0].numel()] * len(moving)
        got = pack.new_empty(sum(sizes))
        c.sendrecv(pack, to, got, frm)
        for i, block in zip(moving, got.split(sizes)):
            slots[i] = block  # now the block from rank r - i (for the bits seen so far) for r + i
    for i in range(p):  # inverse rotation: slot i holds the block from rank r - i
        out_blocks[(r - i) % p].copy_(slots[i])


ALGORITHMS = {"native": None, "pairwise": pairwise, "bruck": bruck}


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
        if algorithm == "bruck":
            sized = input_split_sizes is not None or output_split_sizes is not None
            algo(c, out_blocks, in_blocks, per_row, sized)
        else:
            algo(c, out_blocks, in_blocks)
        write_back()

    return run_algorithm("all_to_all_single", algorithm, view, body, async_op)
