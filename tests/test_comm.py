"""workbench.comm: every collective x algorithm x op x dtype against torch.distributed and a
single-process reference, at world sizes 2, 3 and 4, on sub-groups, uneven/tiny/empty sizes and
non-contiguous tensors; async handles; counters; bad input.

Each world size runs its whole matrix inside ONE launch: every rank loops over the cases,
collects mismatches as readable strings and returns them; the test asserts the list is empty.
"""
from __future__ import annotations

import threading
import time
import warnings

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm
from workbench.comm import work as comm_work

R = dist.ReduceOp
OPS = {"SUM": R.SUM, "PRODUCT": R.PRODUCT, "MIN": R.MIN, "MAX": R.MAX, "AVG": R.AVG}
DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16,
          torch.int64, torch.int32, torch.int8, torch.uint8)


# ------------------------------------------------------------------------------ inputs, reference

def _data(case: int, rank: int, shape, dtype, op_name: str = "SUM") -> torch.Tensor:
    """Rank ``rank``'s input for one case: small integers, so every sum/product/order is exact."""
    g = torch.Generator().manual_seed(1000 * case + rank)
    lo, hi = (1, 3) if op_name == "PRODUCT" else ((0, 9) if dtype == torch.uint8 else (-4, 5))
    return torch.randint(lo, hi, tuple(shape), generator=g).to(dtype)


def _reduce_ref(tensors: list[torch.Tensor], op_name: str) -> torch.Tensor:
    stack = torch.stack([t.double() for t in tensors])
    if op_name in ("SUM", "AVG"):
        out = stack.sum(0)
        if op_name == "AVG":
            out = out / len(tensors)
    elif op_name == "PRODUCT":
        out = stack.prod(0)
    elif op_name == "MIN":
        out = stack.min(0).values
    else:
        out = stack.max(0).values
    return out.to(tensors[0].dtype)


def _like(shape, dtype, contiguous: bool) -> torch.Tensor:
    """An uninitialised tensor of ``shape``; non-contiguous (a transposed view) when asked."""
    if contiguous or len(shape) < 2:
        return torch.full(tuple(shape), 7, dtype=dtype)
    return torch.full(tuple(shape[::-1]), 7, dtype=dtype).t()


def _put(dst: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    dst.copy_(src)
    return dst


def _same(got: torch.Tensor, want: torch.Tensor, op_name: str) -> bool:
    if got.shape != want.shape or got.dtype != want.dtype:
        return False
    if op_name == "AVG":
        tol = 1e-2 if want.dtype in (torch.float16, torch.bfloat16) else 1e-6
        return torch.allclose(got.double(), want.double(), rtol=tol, atol=tol)
    return torch.equal(got, want)


# ----------------------------------------------------------------------------------- the matrix

def _check_group(group, members: list[int], tag: str, full: bool) -> list[str]:
    """Run every collective x algorithm on ``group`` (global ranks ``members``); return mismatches.

    ``full``: every op x dtype x size; otherwise a smaller slice (used for sub-groups).
    """
    me = dist.get_rank()
    if me not in members:
        return []
    p, gr = len(members), members.index(me)
    bad: list[str] = []
    case = [0]

    def fail(what: str) -> None:
        bad.append(f"[{tag} p={p} global rank {me}] {what}")

    shapes = [(5,), (2, 3), (1,), (0,), (p - 1,), (4 * p + 1,)] if full else [(5,), (2, 3), (0,)]
    contig = [True, False]
    dtypes = DTYPES if full else (torch.float32, torch.int64)
    op_names = list(OPS) if full else ["SUM", "MAX", "AVG"]
    roots = sorted({0, p - 1})

    def cases_reduce():
        for dtype in dtypes:
            for op_name in op_names:
                if op_name == "AVG" and not dtype.is_floating_point:
                    continue
                for shape in (shapes if (dtype, op_name) in ((torch.float32, "SUM"), (torch.int64, "MAX"))
                              else [(5,)]):
                    for c in (contig if len(shape) == 2 else [True]):
                        case[0] += 1
                        yield case[0], dtype, op_name, shape, c

    def cases_move():
        for dtype in (dtypes if full else (torch.float32,)):
            for shape in (shapes if dtype in (torch.float32, torch.int64) else [(5,)]):
                for c in (contig if len(shape) == 2 else [True]):
                    case[0] += 1
                    yield case[0], dtype, shape, c

    kw = {} if group is None else {"group": group}
    for alg in comm.ALGORITHMS["all_reduce"]:
        for k, dtype, op_name, shape, c in cases_reduce():
            ins = [_data(k, r, shape, dtype, op_name) for r in members]
            t = _put(_like(shape, dtype, c), ins[gr])
            comm.all_reduce(t, op=OPS[op_name], algorithm=alg, **kw)
            want = _reduce_ref(ins, op_name)
            if not _same(t, want, op_name):
                fail(f"all_reduce {alg} {op_name} {dtype} {shape} contiguous={c}: got {t} want {want}")

    for alg in comm.ALGORITHMS["reduce"]:
        for k, dtype, op_name, shape, c in cases_reduce():
            for root in roots:
                ins = [_data(k, r, shape, dtype, op_name) for r in members]
                t = _put(_like(shape, dtype, c), ins[gr])
                comm.reduce(t, dst=members[root], op=OPS[op_name], algorithm=alg, **kw)
                want = _reduce_ref(ins, op_name) if gr == root else ins[gr]
                if gr == root or alg != "native":  # torch leaves non-root buffers unspecified
                    if not _same(t, want, op_name):
                        fail(f"reduce {alg} root={root} {op_name} {dtype} {shape} contiguous={c}: "
                             f"got {t} want {want}")

    for alg in comm.ALGORITHMS["reduce_scatter"]:
        for k, dtype, op_name, shape, c in cases_reduce():
            ins = [[_data(k, 100 * r + i, shape, dtype, op_name) for i in range(p)] for r in members]
            mine = [_put(_like(shape, dtype, c), x) for x in ins[gr]]
            kept = [x.clone() for x in mine]
            out = _like(shape, dtype, c)
            comm.reduce_scatter(out, mine, op=OPS[op_name], algorithm=alg, **kw)
            want = _reduce_ref([ins[r][gr] for r in range(p)], op_name)
            if not _same(out, want, op_name):
                fail(f"reduce_scatter {alg} {op_name} {dtype} {shape} contiguous={c}: got {out} want {want}")
            if not all(torch.equal(a, b) for a, b in zip(mine, kept)):
                fail(f"reduce_scatter {alg} {op_name} {dtype} {shape}: modified input_list")

    for alg in comm.ALGORITHMS["broadcast"]:
        for k, dtype, shape, c in cases_move():
            for root in roots:
                src = _data(k, members[root], shape, dtype)
                t = _put(_like(shape, dtype, c), _data(k, me, shape, dtype))
                if root == gr or k % 2:
                    comm.broadcast(t, src=members[root], algorithm=alg, **kw)
                else:  # the group-numbered spelling
                    comm.broadcast(t, group_src=root, algorithm=alg, **kw)
                if not torch.equal(t, src):
                    fail(f"broadcast {alg} root={root} {dtype} {shape} contiguous={c}: got {t} want {src}")

    for alg in comm.ALGORITHMS["all_gather"]:
        for k, dtype, shape, c in cases_move():
            ins = [_data(k, r, shape, dtype) for r in members]
            outs = [_like(shape, dtype, c) for _ in range(p)]
            comm.all_gather(outs, _put(_like(shape, dtype, c), ins[gr]), algorithm=alg, **kw)
            for i in range(p):
                if not torch.equal(outs[i], ins[i]):
                    fail(f"all_gather {alg} {dtype} {shape} contiguous={c}: slot {i} got {outs[i]} want {ins[i]}")

    for alg in comm.ALGORITHMS["scatter"]:
        for k, dtype, shape, c in cases_move():
            for root in roots:
                blocks = [_data(k, 100 * members[root] + i, shape, dtype) for i in range(p)]
                out = _like(shape, dtype, c)
                lst = [_put(_like(shape, dtype, c), b) for b in blocks] if gr == root else None
                comm.scatter(out, lst, src=members[root], algorithm=alg, **kw)
                if not torch.equal(out, blocks[gr]):
                    fail(f"scatter {alg} root={root} {dtype} {shape} contiguous={c}: got {out} want {blocks[gr]}")

    for alg in comm.ALGORITHMS["gather"]:
        for k, dtype, shape, c in cases_move():
            for root in roots:
                ins = [_data(k, r, shape, dtype) for r in members]
                lst = [_like(shape, dtype, c) for _ in range(p)] if gr == root else None
                comm.gather(_put(_like(shape, dtype, c), ins[gr]), lst, group_dst=root, algorithm=alg, **kw)
                if gr == root:
                    for i in range(p):
                        if not torch.equal(lst[i], ins[i]):
                            fail(f"gather {alg} root={root} {dtype} {shape} contiguous={c}: "
                                 f"slot {i} got {lst[i]} want {ins[i]}")

    for alg in comm.ALGORITHMS["all_to_all_single"]:
        for k, dtype, shape, c in cases_move():
            row = tuple(shape[1:])  # dimension 0 is split; each row travels whole
            even = k % 2 == 0  # even: no split sizes (torch cuts dimension 0 into p blocks)
            rows = [[1 if even else (i + 2 * j + k) % 3 for j in range(p)] for i in range(p)]  # rows i sends j
            ins = [_data(k, r, (sum(rows[i]),) + row, dtype) for i, r in enumerate(members)]
            out = _like((sum(rows[i][gr] for i in range(p)),) + row, dtype, c)
            splits = (None, None) if even else ([rows[i][gr] for i in range(p)], rows[gr])
            comm.all_to_all_single(out, _put(_like(ins[gr].shape, dtype, c), ins[gr]), *splits, algorithm=alg, **kw)
            want = torch.cat([ins[i].split(rows[i])[gr] for i in range(p)])
            theirs = torch.empty_like(want)  # torch's own, called directly
            dist.all_to_all_single(theirs, ins[gr], *splits, **kw)
            if not (torch.equal(out, want) and torch.equal(theirs, want)):
                fail(f"all_to_all_single {alg} {dtype} rows {rows} x {row} contiguous={c}: got {out} want {want} "
                     f"(torch.distributed: {theirs})")
    return bad


def _check_pipelined(members: list[int]) -> list[str]:
    """The ring algorithms with tiny segments, so that every block is cut into many uneven
    segments and the receive window (4 rows) wraps around many times."""
    from workbench.comm import group as comm_group

    me, p = dist.get_rank(), len(members)
    saved = comm_group.SEGMENT_BYTES, comm_group.PIPELINE_BYTES
    comm_group.SEGMENT_BYTES, comm_group.PIPELINE_BYTES = 64, 64
    bad = []
    try:
        for k, numel in enumerate([1000, 4097, 7, 3 * p * 37]):
            ins = [_data(5000 + k, r, (numel,), torch.float32) for r in members]
            t = ins[me].clone()
            h = comm.all_reduce(t, algorithm="ring", async_op=bool(k % 2))
            if h is not None:
                h.wait()
            if not torch.equal(t, _reduce_ref(ins, "SUM")):
                bad.append(f"pipelined ring all_reduce numel={numel} wrong on rank {me}")
            t = ins[me].clone()
            comm.broadcast(t, src=p - 1, algorithm="scatter_allgather")
            if not torch.equal(t, ins[p - 1]):
                bad.append(f"pipelined scatter_allgather broadcast numel={numel} wrong on rank {me}")
            chunks = [[_data(6000 + k, 100 * r + i, (numel,), torch.int64) for i in range(p)] for r in members]
            out = torch.empty(numel, dtype=torch.int64)
            comm.reduce_scatter(out, chunks[me], op=R.MAX, algorithm="ring")
            if not torch.equal(out, _reduce_ref([chunks[r][me] for r in range(p)], "MAX")):
                bad.append(f"pipelined ring reduce_scatter numel={numel} wrong on rank {me}")
            outs = [torch.empty(numel) for _ in range(p)]
            comm.all_gather(outs, ins[me], algorithm="ring")
            if not all(torch.equal(o, i) for o, i in zip(outs, ins)):
                bad.append(f"pipelined ring all_gather numel={numel} wrong on rank {me}")
    finally:
        comm_group.SEGMENT_BYTES, comm_group.PIPELINE_BYTES = saved
    return bad


def _matrix_rank() -> dict:
    world = dist.get_world_size()
    with comm.counters() as counted:  # proves every (collective, algorithm) really ran
        bad = _check_group(None, list(range(world)), "world", full=True)
        bad += _check_pipelined(list(range(world)))
    # A sub-group of the upper ranks: group numbering differs from global numbering.
    members = list(range(1, world)) if world > 2 else [1, 0]
    members = sorted(members)
    sub = dist.new_group(members)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        bad += _check_group(sub, members, "subgroup", full=False)
        if dist.get_rank() not in members:  # outside the group: nothing happens, None comes back
            t = torch.ones(3)
            for alg in comm.ALGORITHMS["all_reduce"]:
                if comm.all_reduce(t, group=sub, algorithm=alg) is not None or not torch.equal(t, torch.ones(3)):
                    bad.append(f"rank {dist.get_rank()} outside the group: all_reduce {alg} did something")
            if not any("does not belong" in str(w.message) for w in caught):
                bad.append("no warning for a rank outside the group")
    return {"bad": bad, "calls": {key: s.calls for key, s in counted.stats.items()}}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_parity_matrix(world_size):
    results = workbench.launch(_matrix_rank, world_size=world_size, timeout=240)
    bad = [line for out in results for line in out["bad"]]
    assert not bad, f"{len(bad)} mismatches, first 20:\n" + "\n".join(bad[:20])
    every = {(name, alg) for name, algs in comm.ALGORITHMS.items() for alg in algs}
    for out in results:
        assert set(out["calls"]) == every
        assert min(out["calls"].values()) >= 10 and sum(out["calls"].values()) > 1000


# ---------------------------------------------------------------------------------- async handles

def _async_rank() -> dict:
    me, p = dist.get_rank(), dist.get_world_size()
    out: dict = {"bad": []}
    big = [torch.full((1 << 16,), float(me + i)) for i in range(4)]
    small = torch.arange(10.0) * (me + 1)
    gathered = [torch.empty(3) for _ in range(p)]
    # Several hand-written collectives in flight at once, then a synchronous one, then a native one.
    handles = [comm.all_reduce(t, algorithm="ring", async_op=True) for t in big]
    handles.append(comm.all_gather(gathered, torch.full((3,), float(me)), algorithm="bruck", async_op=True))
    handles.append(comm.broadcast(small, src=p - 1, algorithm="binomial", async_op=True))
    sync = torch.ones(5) * me
    comm.all_reduce(sync, algorithm="recursive_doubling")  # must run after the queued ones
    native = torch.ones(4) * me
    hn = comm.all_reduce(native, async_op=True)
    out["handle_types"] = sorted({type(h).__name__ for h in handles + [hn]})
    out["all_have_api"] = all(hasattr(h, "wait") and hasattr(h, "is_completed") for h in handles + [hn])
    for h in handles + [hn]:
        if h.wait() is not True or not h.is_completed():
            out["bad"].append("wait() did not return True / is_completed() False after wait")
    # Each handle says when it ran on the thread: one at a time, in issue order.
    order = [h for h in handles] + [hn]
    out["ran_in_order"] = [i for i, h in enumerate(order)
                           if not (h.issued <= h.started <= h.ended) or (i and h.started < order[i - 1].ended)]
    total = sum(range(p))
    for i, t in enumerate(big):
        if not torch.equal(t, torch.full_like(t, float(total + p * i))):
            out["bad"].append(f"async ring all_reduce {i} wrong")
    if not all(torch.equal(g, torch.full((3,), float(r))) for r, g in enumerate(gathered)):
        out["bad"].append("async bruck all_gather wrong")
    if not torch.equal(small, torch.arange(10.0) * p):
        out["bad"].append("async binomial broadcast wrong")
    if not torch.equal(sync, torch.ones(5) * total) or not torch.equal(native, torch.ones(4) * total):
        out["bad"].append("sync/native after async wrong")

    # An error inside the communication thread comes back from wait(), on the caller's thread.
    from workbench.comm.all_reduce import ALGORITHMS as algos
    original = algos["ring"]

    def boom(c, buf, op):
        raise RuntimeError("boom from the communication thread")

    algos["ring"] = boom
    try:
        h = comm.all_reduce(torch.ones(3), algorithm="ring", async_op=True)
        try:
            h.wait()
            out["bad"].append("wait() did not re-raise the thread's error")
        except RuntimeError as e:
            out["error"] = str(e)
        out["error_is_completed"] = h.is_completed()
    finally:
        algos["ring"] = original
    # The thread survives an error: the next collective still works.
    t = torch.ones(3)
    comm.all_reduce(t, algorithm="ring", async_op=True).wait()
    if not torch.equal(t, torch.full((3,), float(p))):
        out["bad"].append("collective after a failed one is wrong")
    threads = [t for t in threading.enumerate() if t.name == "workbench-comm"]
    out["threads"] = [(t.daemon, t.is_alive()) for t in threads]
    return out


def test_async_handles_and_thread():
    # A communication thread in the parent first: forked ranks must make their own.
    comm_work.submit(lambda: None, async_op=True).wait()
    parent_thread = [t for t in threading.enumerate() if t.name == "workbench-comm"]
    assert len(parent_thread) == 1 and parent_thread[0].daemon
    for out in workbench.launch(_async_rank, world_size=3, timeout=120):
        assert out["bad"] == []
        assert out["handle_types"] == ["Work"] and out["all_have_api"]  # native ones run on the thread too
        assert out["ran_in_order"] == [], out["ran_in_order"]
        assert out["error"] == "boom from the communication thread" and out["error_is_completed"]
        assert out["threads"] == [(True, True)]  # one daemon thread per process


def test_work_records_queue_and_run_times():
    # A slow task, then a quick one issued while the first runs: the second waits in the queue
    # (issued before the first ends) and runs after it; its run time excludes the wait.
    first = comm_work.submit(lambda: time.sleep(0.2), async_op=True)
    second = comm_work.submit(lambda: None, async_op=True)
    second.wait()
    assert first.is_completed()
    assert first.issued <= first.started < first.ended <= second.started <= second.ended
    assert second.issued < first.ended  # it was queued while the first ran
    assert first.ended - first.started >= 0.19
    assert second.ended - second.started < 0.1 < second.ended - second.issued


def test_sync_call_without_thread_runs_inline():
    ran = []
    assert comm_work.submit(lambda: ran.append(threading.current_thread().name), async_op=False) is None
    assert ran == [threading.current_thread().name]


def test_scratch_buffer_is_reused_per_thread_and_dtype():
    from workbench.comm import group as comm_group

    a = comm_group.scratch(1000, torch.float32)
    b = comm_group.scratch(10, torch.float32)
    assert b.numel() == 10 and b.data_ptr() == a.data_ptr()  # no new allocation
    assert comm_group.scratch(10, torch.int64).dtype == torch.int64  # one buffer per dtype
    assert comm_group.scratch(5000, torch.float32).numel() == 5000  # grows on demand
    other = []
    t = threading.Thread(target=lambda: other.append(comm_group.scratch(10, torch.float32).data_ptr()))
    t.start()
    t.join()
    assert other[0] != comm_group.scratch(10, torch.float32).data_ptr()  # the comm thread has its own
    stage = comm_group.scratch(10, torch.float32, "stage")
    assert stage.data_ptr() != comm_group.scratch(10, torch.float32).data_ptr()  # slots never alias
    assert comm_group.scratch(10, torch.float32, "stage").data_ptr() == stage.data_ptr()


# ------------------------------------------------------------------------------------- counters

def _counters_rank() -> dict:
    p = dist.get_world_size()
    n = 4 * p * 1000  # elements, divisible by p
    t = torch.ones(n)
    with comm.counters() as outer:
        with comm.counters() as inner:
            comm.all_reduce(t, algorithm="ring")
        comm.all_reduce(t, algorithm="reduce_broadcast")
        comm.all_reduce(t)  # native: counted by the ring formula
        h = comm.all_reduce(t, algorithm="ring", async_op=True)
        h.wait()
    comm.all_reduce(t, algorithm="ring")  # after the counters closed: not counted
    return {"outer": outer.as_dict(), "inner": inner.as_dict(), "nbytes": 4 * n,
            "total_sent": outer.total_bytes_sent, "table": outer.table(),
            "ring_stat": outer.stats[("all_reduce", "ring")]}


@pytest.mark.parametrize("world_size", [2, 4])
def test_counters_match_ring_formula(world_size):
    p = world_size
    for rank, out in enumerate(workbench.launch(_counters_rank, world_size=p)):
        n = out["nbytes"]
        ring_bytes = 2 * (p - 1) * n // p  # 2 (p-1)/p of the buffer each way, per call
        ring, inner = out["outer"]["all_reduce/ring"], out["inner"]
        assert ring["calls"] == 2  # the sync and the async call
        assert ring["bytes_sent"] == ring["bytes_received"] == 2 * ring_bytes
        assert ring["seconds"] > 0
        assert out["ring_stat"].bytes_sent == 2 * ring_bytes
        assert inner == {"all_reduce/ring": {**inner["all_reduce/ring"], "calls": 1,
                                            "bytes_sent": ring_bytes, "bytes_received": ring_bytes}}
        assert out["outer"]["all_reduce/native"]["bytes_sent"] == ring_bytes
        # reduce_broadcast is one call of all_reduce: its inner reduce/broadcast are not counted apart
        assert set(out["outer"]) == {"all_reduce/ring", "all_reduce/native", "all_reduce/reduce_broadcast"}
        rb = out["outer"]["all_reduce/reduce_broadcast"]
        # binomial reduce then broadcast: a rank sends once per tree edge it owns
        assert rb["calls"] == 1 and rb["bytes_sent"] % n == 0 and rb["bytes_sent"] > 0
        assert out["total_sent"] == 3 * ring_bytes + rb["bytes_sent"]
        assert "all_reduce" in out["table"] and "ring" in out["table"]


# ------------------------------------------------------------------------------------- bad input

def _bad_input_rank() -> dict:
    """Every rank makes the same bad calls (so nobody waits on a message); each must raise a
    ValueError whose message names the argument, for native and a hand-written algorithm."""
    me, p = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    outs = [torch.empty(4) for _ in range(p)]
    other = dist.new_group([1])  # rank 1 only
    ints = torch.ones(3, dtype=torch.int64)
    # (text the message must contain, hand-written algorithm to try besides native, the call)
    cases = [
        ("tensor_list has 1 tensors", "ring", lambda a: comm.all_gather(outs[:-1], t, algorithm=a)),
        ("tensor_list[1] has shape (5,)", "ring",
         lambda a: comm.all_gather([outs[0], torch.empty(5)], t, algorithm=a)),
        ("tensor_list[1] has dtype torch.int64", "bruck",
         lambda a: comm.all_gather([outs[0], torch.empty(4, dtype=torch.int64)], t, algorithm=a)),
        ("input_list has 3 tensors", "ring", lambda a: comm.reduce_scatter(t, [t] * 3, algorithm=a)),
        ("input_list[0] has shape (5,)", "recursive_halving",
         lambda a: comm.reduce_scatter(t, [torch.ones(5)] * 2, algorithm=a)),
        ("src=5 is out of range", "binomial", lambda a: comm.broadcast(t, src=5, algorithm=a)),
        ("src=-1 is out of range", "flat", lambda a: comm.broadcast(t, src=-1, algorithm=a)),
        ("group_src=2 is out of range", "scatter_allgather", lambda a: comm.broadcast(t, group_src=2, algorithm=a)),
        ("src is required", "binomial", lambda a: comm.broadcast(t, algorithm=a)),
        ("not both", "binomial", lambda a: comm.reduce(t, dst=0, group_dst=0, algorithm=a)),
        ("dst=3 is out of range", "binomial", lambda a: comm.gather(t, None, dst=3, algorithm=a)),
        ("op=ReduceOp.AVG needs a floating-point", "ring", lambda a: comm.all_reduce(ints, op=R.AVG, algorithm=a)),
        ("op=ReduceOp.AVG needs a floating-point", "flat", lambda a: comm.reduce(ints, 0, op=R.AVG, algorithm=a)),
        ("scatter_list must be given", "binomial", lambda a: comm.scatter(t, None, src=me, algorithm=a)),
        ("scatter_list must be None", "flat", lambda a: comm.scatter(t, [t] * p, src=1 - me, algorithm=a)),
        ("gather_list must be None", "binomial", lambda a: comm.gather(t, [t] * p, dst=1 - me, algorithm=a)),
        ("gather_list has 1 tensors", "flat", lambda a: comm.gather(t, [t], dst=me, algorithm=a)),
        ("algorithm='bogus'", None, lambda a: comm.all_reduce(t, algorithm="bogus")),
        ("algorithm='rabenseifner' is not known", None, lambda a: comm.all_gather(outs, t, algorithm="rabenseifner")),
        ("op=", None, lambda a: comm.all_reduce(torch.ones(3, dtype=torch.int32), op=R.BAND, algorithm="ring")),
        ("dtype torch.bool cannot be reduced", None,
         lambda a: comm.all_reduce(torch.ones(3, dtype=torch.bool), algorithm="ring")),
    ]
    if me == 1:  # dst is a global rank: global rank 0 is not in {1}
        cases.append(("dst=0 is not a member", "binomial", lambda a: comm.reduce(t, dst=0, group=other, algorithm=a)))
    problems = []
    for text, handwritten, call in cases:
        for a in (["native", handwritten] if handwritten else ["-"]):
            try:
                call(a)
                problems.append(f"{text} ({a}): no error")
            except ValueError as e:
                if text not in str(e):
                    problems.append(f"{text} ({a}): message does not say it: {e}")
    try:
        comm.all_reduce([1, 2, 3], algorithm="ring")
        problems.append("a list instead of a tensor: no error")
    except TypeError as e:
        if "tensor must be a torch.Tensor" not in str(e):
            problems.append(f"TypeError message: {e}")
    # Nothing was half-sent: a real collective still works with every algorithm.
    for a in comm.ALGORITHMS["all_reduce"]:
        x = torch.ones(6)
        comm.all_reduce(x, algorithm=a)
        if not torch.equal(x, torch.full((6,), float(p))):
            problems.append(f"all_reduce {a} after the bad calls: {x}")
    return problems


def test_bad_input_raises_value_error_naming_the_argument():
    for problems in workbench.launch(_bad_input_rank, world_size=2, timeout=120):
        assert problems == []


def _one_rank_bad():
    me, p = dist.get_rank(), dist.get_world_size()
    t = torch.ones(4)
    outs = [torch.empty(4) for _ in range(p - (me == 1))]  # rank 1 passes one tensor too few
    h = comm.all_gather(outs, t, algorithm="ring", async_op=True)  # rank 0 waits for rank 1 forever
    h.wait()
    return "done"


def test_bad_input_on_one_rank_ends_launch_with_rank_failed():
    with pytest.raises(workbench.RankFailed) as info:
        workbench.launch(_one_rank_bad, world_size=2, timeout=60)
    assert info.value.rank == 1
    assert info.value.exc_type == "ValueError"
    assert "tensor_list has 1 tensors but the group has 2 ranks" in str(info.value)
