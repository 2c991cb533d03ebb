"""Context parallelism: attention over a sequence split across ranks (ring attention, Ulysses).

A long sequence does not fit one rank: its activations grow with S and its attention scores
with S^2. Context parallelism splits the *sequence* over the P ranks of a group. Everything in a
transformer layer works token by token except attention, where every query needs every (earlier)
key. Two ways to give it them:

* **Ring attention** (Liu et al. 2023; the ring of picotron and ring-flash-attention): each rank
  keeps its queries and passes its K and V block round the ring. In P steps every K/V block
  visits every rank; each step computes attention of the local queries against the visiting
  block, and the partial results are merged with their log-sum-exp (the online softmax of
  flash attention)::

      step 0:  rank 0 [Q0 | K0 V0]   rank 1 [Q1 | K1 V1]   rank 2 [Q2 | K2 V2]   rank 3 [Q3 | K3 V3]
      step 1:  rank 0 [Q0 | K3 V3]   rank 1 [Q1 | K0 V0]   rank 2 [Q2 | K1 V1]   rank 3 [Q3 | K2 V2]
      ...      each rank sends the block it holds to rank + 1 and receives from rank - 1

  The next block is posted (``comm.irecv``/``comm.isend``) *before* the current one is computed,
  so the transfer hides under the compute when a block's attention takes longer than its message
  (:func:`ring_timeline` records each step's post, compute and wait, for a figure).
  Backward runs a second ring (hand-written, not autograd through the forward's messages): the
  K/V blocks travel again, and with each block travels the running sum of its dK and dV; each
  rank adds its share and passes it on, and after P steps the sums are back with their owners.

* **DeepSpeed-Ulysses** (Jacobs et al. 2023): an all-to-all turns "all heads, S/P positions"
  into "H/P heads, all S positions" (``comm.all_to_all_single``); each rank runs ordinary
  full-sequence attention on its heads, and an all-to-all turns the output back. Needs
  ``H % P == 0``. Its backward is the same all-to-alls in reverse.

Layouts: which positions a rank holds
-------------------------------------
``"contiguous"``: rank r holds positions ``[r S/P, (r+1) S/P)``. Under a causal mask rank r's
queries see only blocks 0..r: the last rank has about P blocks of work, the first half of one.
``"zigzag"``: the sequence is cut into 2P chunks and rank r holds chunks ``r`` and ``2P-1-r`` (an
early and a late one), so every rank's queries see the same number of keys::

    S = 16, P = 2:  contiguous  rank 0: 0-7           rank 1: 8-15
                    zigzag      rank 0: 0-3, 12-15    rank 1: 4-7, 8-11

Causal work per rank, in unmasked query-key pairs (units of one ``(S/P)^2`` block, a diagonal
block counted as half):

* contiguous: rank r ``r + 1/2``; max/min = ``(P - 1/2) / (1/2) = 2P - 1``;
* zigzag: every rank ``P/2`` (its early chunk sees r chunks and half of itself, its late one
  ``2P-1-r`` chunks and half of itself: 2P pairs of ``(S/2P)^2`` chunks); max/min = 1.

The ring skips a block whose every pair is masked (no compute; the block is still passed on),
and trims the rest to the queries that see any of its keys and the keys any of them sees (a
flash kernel skips fully masked tiles the same way): under "contiguous" rank r computes r+1
blocks (its own under the causal mask) and the others wait for the last rank; under "zigzag"
every rank computes its own block under the mask and P-1 halves of blocks with no mask (the late
chunk's queries against a later rank's block, or all its queries against an earlier rank's early
chunk), the same work on every rank (PyTorch's load-balanced ring does the same).

:func:`sequence_positions` gives the global positions a rank holds, for position embeddings.

Formulas (B batch, H heads, S sequence, D head size, beta bytes per element, per rank and layer)
------------------------------------------------------------------------------------------------
* ring forward sends ``2 (P-1) B (S/P) H D beta`` (its K and V block, P-1 times: one message per
  step holding both); backward sends the K/V ring again, ``2 (P-1) B (S/P) H D beta``, plus the
  dK/dV ring, ``2 P B (S/P) H D beta`` (P hops: the last one brings each sum home).
* Ulysses forward sends ``4 B H (S/P) D beta (P-1)/P`` (three all-to-alls in: q, k, v; one out),
  backward the same. In blocks of ``B (S/P) H D beta``: the ring's forward sends ``2 (P-1)``,
  Ulysses' ``4 (P-1)/P``, ``P/2`` times fewer (the same at P = 2, 4x fewer at P = 8).
* Attention scores in memory per rank: ring ``B H (S/P)^2`` per step (one block at a time, plus
  two K/V blocks: the one computed and the one arriving), Ulysses ``B (H/P) S^2`` (the full
  sequence on H/P heads): P times more. (A flash kernel materialises neither; the ring here,
  written out in PyTorch, does hold its block's scores.)
* Time, alpha-beta: the ring is P-1 steps of ``alpha + 2 B (S/P) H D beta``, each hidden under a
  block of attention when that takes longer; Ulysses is 4 all-to-alls
  (``(P-1) alpha + (P-1)/P n beta`` each, n = ``B H (S/P) D beta``), not overlapped.

Precision: scores, the running output and the log-sum-exp are float32 whatever the input dtype
(float64 for float64 inputs);
merging uses ``torch.logaddexp`` (never ``log(1 + exp(x))``, which overflows for large x).
"""
from __future__ import annotations

import contextlib
import time
from numbers import Real

import torch
import torch.distributed as dist
import torch.nn.functional as F

from workbench import comm

__all__ = ["shard_sequence", "unshard_sequence", "sequence_positions", "ring_attention", "ulysses_attention",
           "ring_timeline", "LAYOUTS"]

LAYOUTS = ("contiguous", "zigzag")

# tags of the ring's messages (K/V blocks, dK/dV sums), apart from other point-to-point traffic
TAG_KV, TAG_DKV = 38, 39
# the mask of a block whose every (query, key) pair is masked: not computed at all
SKIP = "skip"


# ------------------------------------------------------------------------------------- layouts

def _group(group) -> tuple[int, int]:
    """(this rank's number in ``group``, the group's size)."""
    return dist.get_rank(group), dist.get_world_size(group)


def _check_layout(layout) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r} is not known: use one of {LAYOUTS}")


def _chunk_size(seq_len: int, p: int, layout: str, name: str = "seq_len") -> int:
    """The length of one chunk: S/P (contiguous) or S/(2P) (zigzag), checked."""
    _check_layout(layout)
    chunks = p if layout == "contiguous" else 2 * p
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 0 or seq_len % chunks:
        raise ValueError(f"{name}={seq_len!r} does not split into {chunks} equal chunks for layout={layout!r} over "
                         f"{p} ranks: use a sequence length that is a multiple of {chunks}")
    return seq_len // chunks


def _chunks_of(rank: int, p: int, layout: str) -> list[int]:
    """The chunks rank ``rank`` holds, in the order it holds them."""
    return [rank] if layout == "contiguous" else [rank, 2 * p - 1 - rank]


def _positions(seq_len: int, p: int, rank: int, layout: str) -> torch.Tensor:
    c = _chunk_size(seq_len, p, layout)
    return torch.cat([torch.arange(i * c, (i + 1) * c) for i in _chunks_of(rank, p, layout)])


def sequence_positions(seq_len: int, group=None, layout: str = "zigzag") -> torch.Tensor:
    """The global positions (a LongTensor of ``seq_len / P``) this rank holds, in its order."""
    r, p = _group(group)
    return _positions(seq_len, p, r, layout)


def _check_dim(x: torch.Tensor, dim: int) -> int:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if isinstance(dim, bool) or not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        raise ValueError(f"dim={dim!r} is not a dimension of x (shape {tuple(x.shape)}): use the sequence "
                         "dimension, e.g. 2 for (B, H, S, D) or 1 for (B, S, hidden)")
    return dim % x.dim()


def shard_sequence(x: torch.Tensor, group=None, dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """This rank's shard of the full sequence ``x`` (no message: every rank holds ``x``)."""
    dim = _check_dim(x, dim)
    r, p = _group(group)
    c = _chunk_size(x.shape[dim], p, layout, name=f"x.shape[{dim}]")
    return torch.cat([x.narrow(dim, i * c, c) for i in _chunks_of(r, p, layout)], dim)


def unshard_sequence(x: torch.Tensor, group=None, dim: int = 2, layout: str = "zigzag") -> torch.Tensor:
    """The full sequence from every rank's shard ``x`` (an all-gather; for checks and plots, not
    differentiable)."""
    dim = _check_dim(x, dim)
    p = dist.get_world_size(group)
    seq_len = x.shape[dim] * p
    c = _chunk_size(seq_len, p, layout, name=f"x.shape[{dim}] * {p} ranks")
    shards = [torch.empty_like(x, memory_format=torch.contiguous_format) for _ in range(p)]
    comm.all_gather(shards, x.contiguous(), group=group)
    shape = list(x.shape)
    shape[dim] = seq_len
    full = x.new_empty(shape)
    for j, shard in enumerate(shards):
        for a, i in enumerate(_chunks_of(j, p, layout)):
            full.narrow(dim, i * c, c).copy_(shard.narrow(dim, a * c, c))
    return full


# ------------------------------------------------------------------------------- the checks

def _check_attention(name: str, q, k, v, group, is_causal, scale, layout) -> tuple[int, int]:
    """Every argument, before any message; returns (rank, P) in ``group``."""
    for arg, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {arg} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name}: {arg} has shape {tuple(t.shape)}: pass this rank's shard as "
                             "(batch, heads, sequence / P, head size)")
    for arg, t in (("k", k), ("v", v)):
        if t.shape != q.shape:
            raise ValueError(f"{name}: {arg} has shape {tuple(t.shape)} but q has {tuple(q.shape)}: q, k and v "
                             "must have the same shape (batch, heads, sequence / P, head size)")
        if t.dtype != q.dtype:
            raise ValueError(f"{name}: {arg} has dtype {t.dtype} but q has {q.dtype}: use one dtype")
    if not q.dtype.is_floating_point:
        raise ValueError(f"{name}: q has dtype {q.dtype}: attention needs floating point")
    if not isinstance(is_causal, bool):
        raise ValueError(f"{name}: is_causal={is_causal!r} must be True or False")
    if scale is not None and (isinstance(scale, bool) or not isinstance(scale, Real) or not scale > 0):
        raise ValueError(f"{name}: scale={scale!r} must be a number > 0, or None for 1/sqrt(head size)")
    r, p = _group(group)
    _chunk_size(q.shape[2] * p, p, layout, name=f"sequence length (q.shape[2]={q.shape[2]} x {p} ranks)")
    return r, p


# --------------------------------------------------------------------------- one block of the ring

def _block_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool):
    """The causal mask of one (queries, key block) pair from global positions: ``None`` (every
    pair visible), ``SKIP`` (none visible), or a boolean (S/P, S/P) tensor (True = visible)."""
    if not is_causal:
        return None
    visible = k_pos[None, :] <= q_pos[:, None]
    if visible.all():
        return None
    if not visible.any():
        return SKIP
    return visible


def _trim(q_pos: torch.Tensor, k_pos: torch.Tensor, is_causal: bool):
    """The part of a (queries, key block) pair worth computing: ``SKIP`` (no pair visible), or
    ``(rows, cols, mask)``: the queries that see any of these keys (a suffix of this rank's
    queries: positions only grow along a shard), the keys any of them sees (a prefix), and the
    mask of that sub-block (``None``: every pair visible). Under zigzag an off-diagonal block
    trims to half a block with no mask: the late chunk's queries against the whole block, or every
    query against the early chunk's keys."""
    if not is_causal:
        return slice(None), slice(None), None
    rows = int((q_pos < k_pos.min()).sum())        # queries before the block's first key see none of it
    cols = int((k_pos <= q_pos.max()).sum())       # keys after the last query are seen by none
    if rows == len(q_pos) or cols == 0:
        return SKIP
    rows, cols = slice(rows, None), slice(None, cols)
    return rows, cols, _block_mask(q_pos[rows], k_pos[cols], is_causal)


def _scores(q32, k32, mask, scale) -> torch.Tensor:
    """Scaled scores of one block, masked pairs at -inf. The mask is worked out on the host from
    positions (:func:`_trim`: deciding what to skip must not wait for the GPU) and moved to the
    scores' device here."""
    s = (q32 @ k32.transpose(-2, -1)) * scale  # (B, H, S/P, S/P), float32
    return s if mask is None else s.masked_fill(~mask.to(s.device, non_blocking=True), float("-inf"))


def _attend_block(q32, k32, v32, mask, scale) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention of the local queries over one K/V block: (output, log-sum-exp per query).

    A query whose every key in this block is masked gets output 0 and log-sum-exp -inf, which the
    merge then ignores.
    """
    s = _scores(q32, k32, mask, scale)
    m = s.amax(-1, keepdim=True)
    m = m.masked_fill(m == float("-inf"), 0.0)  # a fully masked row: exp(-inf - 0) = 0, not nan
    e = torch.exp(s - m)
    total = e.sum(-1, keepdim=True)
    out = (e @ v32) / total.clamp_min(torch.finfo(torch.float32).tiny)
    lse = (m + torch.log(total)).squeeze(-1)  # -inf where the row saw nothing
    return out, lse


def _merge(out, lse, block_out, block_lse) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine two partial softmaxes over disjoint key sets (the online softmax)::

        lse = log(exp(lse) + exp(block_lse))
        out = exp(old lse - lse) out + exp(block_lse - lse) block_out
    """
    new = torch.logaddexp(lse, block_lse)
    out = torch.exp(lse - new).unsqueeze(-1) * out + torch.exp(block_lse - new).unsqueeze(-1) * block_out
    return out, new


def _block_grads(q32, k32, v32, out32, dout32, lse, delta, mask, scale):
    """Gradients of one block from the *final* output and log-sum-exp (flash attention's backward)::

        P = exp(S - lse)    dV = P^T dO    dP = dO V^T    dS = P (dP - rowsum(dO O))
        dQ = scale dS K     dK = scale dS^T Q
    """
    probs = torch.exp(_scores(q32, k32, mask, scale) - lse.unsqueeze(-1))  # masked pairs: exp(-inf) = 0
    dv = probs.transpose(-2, -1) @ dout32
    ds = probs * (dout32 @ v32.transpose(-2, -1) - delta.unsqueeze(-1))
    return (ds @ k32) * scale, (ds.transpose(-2, -1) @ q32) * scale, dv


# ------------------------------------------------------------------------------------- the ring

class _Ring:
    """Who is where: this rank, its neighbours, and the part of the block it holds at each step
    that it computes."""

    def __init__(self, group, s_local: int, is_causal: bool, layout: str) -> None:
        self.group, self.is_causal, self.layout = group, is_causal, layout
        self.rank, self.p = _group(group)
        self.right, self.left = (self.rank + 1) % self.p, (self.rank - 1) % self.p
        self.seq_len = s_local * self.p
        self.q_pos = _positions(self.seq_len, self.p, self.rank, layout)  # global positions of my queries

    def block(self, step: int):
        """At step s this rank holds the K/V block of rank ``(rank - s) mod P``: ``SKIP`` or the
        ``(rows, cols, mask)`` of it to compute (:func:`_trim`)."""
        owner = (self.rank - step) % self.p
        return _trim(self.q_pos, _positions(self.seq_len, self.p, owner, self.layout), self.is_causal)

    def pass_on(self, block: torch.Tensor, tag: int):
        """Post the receive of the left neighbour's block and the send of ``block`` to the right;
        returns (the buffer the next block lands in, the two handles)."""
        nxt = torch.empty_like(block)
        handles = (comm.irecv(nxt, group=self.group, group_src=self.left, tag=tag),
                   comm.isend(block, group=self.group, group_dst=self.right, tag=tag))
        return nxt, handles


def _wait(handles) -> None:
    for h in handles:
        h.wait()


# ------------------------------------------------------------------------ a timeline of the ring

_TIMELINES: list[list] = []  # the open recorders (ring_timeline), each a list of events


@contextlib.contextmanager
def ring_timeline():
    """Record what this rank's ring forward does while the block is open: yields a list that
    fills with ``(step, what, start, end)`` events (``time.perf_counter`` seconds), ``what`` one
    of ``"post"`` (posting the next block's receive and send), ``"compute"`` (this step's block
    of attention; absent for a skipped block) and ``"wait"`` (waiting for the next block to
    arrive, after the compute: short when the message travelled under it)."""
    events: list = []
    _TIMELINES.append(events)
    try:
        yield events
    finally:
        _TIMELINES.remove(events)


def _note(step: int, what: str, start: float) -> None:
    end = time.perf_counter()
    for events in _TIMELINES:
        events.append((step, what, start, end))


def _ring_forward(ring: _Ring, q32, k32, v32, scale):
    """Forward: P steps, a K/V block per step, partial softmaxes merged (returns out, lse)."""
    kv = torch.stack([k32, v32])  # the block that travels: K and V in one message
    out = lse = None
    for step in range(ring.p):
        last = step == ring.p - 1
        if not last:  # post the next block first: it travels while this one is computed
            start = time.perf_counter()
            next_kv, handles = ring.pass_on(kv, TAG_KV)
            _note(step, "post", start)
        part = ring.block(step)
        if part is not SKIP:
            start = time.perf_counter()
            rows, cols, mask = part
            block_out, block_lse = _attend_block(q32[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], mask, scale)
            if out is None:  # step 0, this rank's own block, whole: every query sees at least itself
                out, lse = block_out, block_lse
            else:  # only the rows that saw this block change
                out[:, :, rows], lse[:, :, rows] = _merge(out[:, :, rows], lse[:, :, rows], block_out, block_lse)
            _note(step, "compute", start)
        if not last:
            start = time.perf_counter()
            _wait(handles)
            _note(step, "wait", start)
            kv = next_kv
    return out, lse


def _ring_backward(ring: _Ring, q32, k32, v32, out32, dout32, lse, scale):
    """Backward: the K/V blocks go round again, and each block's dK/dV sum travels with it.

    At step s this rank holds the K/V of rank ``rank - s``, and receives from the left the dK/dV
    that ranks ``rank - s .. rank - 1`` computed for that block; it adds its own share and sends
    the sum on. The sum leaving at step P-1 is complete and lands with the block's owner.
    """
    delta = (dout32 * out32).sum(-1)  # rowsum(dO * O), the same for every block
    dq = torch.zeros_like(q32)
    kv = torch.stack([k32, v32])
    dkv_in = None  # the dK/dV sum arriving for the next step's block: (buffer, (its receive, our last send))
    for step in range(ring.p):
        last = step == ring.p - 1
        if not last:
            next_kv, kv_handles = ring.pass_on(kv, TAG_KV)
        part = ring.block(step)
        if part is not SKIP:  # this rank's share: its rows' dQ, the dK/dV of the keys they saw
            rows, cols, mask = part
            block_dq, dk, dv = _block_grads(q32[:, :, rows], kv[0][:, :, cols], kv[1][:, :, cols], out32[:, :, rows],
                                            dout32[:, :, rows], lse[:, :, rows], delta[:, :, rows], mask, scale)
            dq[:, :, rows] += block_dq
        if step == 0:  # this rank's own block starts its sum
            dkv = torch.zeros_like(kv)
        else:  # the sum so far arrived from the left (while this step computed)
            dkv, handles = dkv_in
            _wait(handles)
        if part is not SKIP:
            dkv[0][:, :, cols] += dk
            dkv[1][:, :, cols] += dv
        # pass the sum on (and post the receive of the next one): after P hops it is home
        dkv_in = ring.pass_on(dkv, TAG_DKV)
        if not last:
            _wait(kv_handles)
            kv = next_kv
    buf, handles = dkv_in
    _wait(handles)  # the complete dK/dV of this rank's own block
    return dq, buf[0], buf[1]


class _RingAttention(torch.autograd.Function):
    """Ring attention with its own backward ring (not autograd through the forward's messages)."""

    @staticmethod
    def forward(ctx, q, k, v, group, is_causal, scale, layout):
        ring = _Ring(group, q.shape[2], is_causal, layout)
        acc = torch.promote_types(q.dtype, torch.float32)  # float32, or float64 for a float64 model
        q32, k32, v32 = q.to(acc), k.to(acc), v.to(acc)
        out32, lse = _ring_forward(ring, q32, k32, v32, scale)
        ctx.save_for_backward(q32, k32, v32, out32, lse)
        ctx.ring, ctx.scale, ctx.dtype = ring, scale, q.dtype
        return out32.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q32, k32, v32, out32, lse = ctx.saved_tensors
        dq, dk, dv = _ring_backward(ctx.ring, q32, k32, v32, out32, dout.to(q32.dtype), lse, ctx.scale)
        return dq.to(ctx.dtype), dk.to(ctx.dtype), dv.to(ctx.dtype), None, None, None, None


def ring_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                   scale: float | None = None, layout: str = "zigzag") -> torch.Tensor:
    """Attention over a sequence split across ``group``, K/V blocks passed round a ring.

    ``q, k, v``: this rank's shards, ``(B, H, S/P, D)`` in ``layout``; returns this rank's output
    in the same layout, equal to ``F.scaled_dot_product_attention`` of the full sequence, sharded.
    Differentiable (the backward is a second ring; see the module docstring).
    """
    _check_attention("ring_attention", q, k, v, group, is_causal, scale, layout)
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    return _RingAttention.apply(q, k, v, group, is_causal, scale, layout)


# ------------------------------------------------------------------------------------- Ulysses

class _AllToAll(torch.autograd.Function):
    """``comm.all_to_all_single`` on ``(P, ...)`` blocks; its backward is the same all-to-all
    (block i came from rank i, so its gradient goes back to rank i)."""

    @staticmethod
    def forward(ctx, x, group, algorithm):
        ctx.group, ctx.algorithm = group, algorithm
        return _all_to_all(x, group, algorithm)

    @staticmethod
    def backward(ctx, grad):
        return _all_to_all(grad, ctx.group, ctx.algorithm), None, None


def _all_to_all(x, group, algorithm):
    x = x.contiguous()
    out = torch.empty_like(x)
    comm.all_to_all_single(out, x, group=group, algorithm=algorithm)
    return out


def _to_heads(x, group, order_inv, algorithm):
    """(B, H, S/P, D) sequence shard -> (B, H/P, S, D) head shard, positions in global order."""
    p = dist.get_world_size(group)
    b, h, s, d = x.shape
    blocks = x.reshape(b, p, h // p, s, d).transpose(0, 1)  # block j: the heads rank j will own
    got = _AllToAll.apply(blocks, group, algorithm)  # block i: rank i's positions of my heads
    seq = got.permute(1, 2, 0, 3, 4).reshape(b, h // p, p * s, d)  # rank 0's positions, rank 1's, ...
    return seq.index_select(2, order_inv)  # into global order


def _to_sequence(y, group, order, algorithm):
    """(B, H/P, S, D) head shard in global order -> (B, H, S/P, D) sequence shard (the inverse)."""
    p = dist.get_world_size(group)
    b, hp, seq_len, d = y.shape
    s = seq_len // p
    blocks = y.index_select(2, order).reshape(b, hp, p, s, d).permute(2, 0, 1, 3, 4)  # block j: rank j's positions
    got = _AllToAll.apply(blocks, group, algorithm)  # block i: my positions of rank i's heads
    return got.transpose(0, 1).reshape(b, p * hp, s, d)


def ulysses_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, *, is_causal: bool = True,
                      scale: float | None = None, layout: str = "zigzag", algorithm: str = "native") -> torch.Tensor:
    """DeepSpeed-Ulysses: all-to-all to head shards, full-sequence attention, all-to-all back.

    ``q, k, v``: this rank's shards ``(B, H, S/P, D)`` in ``layout`` (``H % P == 0``); returns this
    rank's output in the same layout. ``algorithm``: the all-to-all's (``comm.ALGORITHMS``).
    Differentiable through autograd (an all-to-all's backward is the reverse all-to-all).
    """
    _, p = _check_attention("ulysses_attention", q, k, v, group, is_causal, scale, layout)
    if q.shape[1] % p:
        raise ValueError(f"ulysses_attention: q has {q.shape[1]} heads (q.shape[1]), which do not split over "
                         f"{p} ranks: Ulysses needs heads % ranks == 0 (use ring_attention, or {p}x heads)")
    if algorithm not in comm.ALGORITHMS["all_to_all_single"]:
        raise ValueError(f"ulysses_attention: algorithm={algorithm!r} is not an all-to-all algorithm: use one of "
                         f"{comm.ALGORITHMS['all_to_all_single']}")
    seq_len = q.shape[2] * p
    # the global positions of the sequence as the all-to-all delivers it (rank 0's shard, rank 1's, ...)
    order = torch.cat([_positions(seq_len, p, j, layout) for j in range(p)]).to(q.device)
    order_inv = torch.argsort(order)
    qh, kh, vh = (_to_heads(t, group, order_inv, algorithm) for t in (q, k, v))
    out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=is_causal, scale=scale)
    return _to_sequence(out, group, order, algorithm)
