"""Context parallelism (workbench.parallel.context) and comm.all_to_all_single.

Against single-process ``F.scaled_dot_product_attention`` on the unsharded tensors: ring and
Ulysses attention, both layouts, causal and not, P = 2 and 4, float32: the output and the
gradients of q, k and v within 1e-5; the bytes each rank sends, counted by ``comm.counters()``,
equal to the module docstring's formulas exactly. ``all_to_all_single`` (native and pairwise,
even and uneven splits, P = 2 and 3) against torch's own. Bad input is a ValueError naming the
argument, raised before any message.

Each world size runs every case inside ONE launch (ranks loop over the cases and return what
they measured); the tests then assert on those results.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import workbench
from workbench import comm
from workbench.parallel import context as cp

B, H, D = 1, 4, 8
S = 16  # zigzag over P = 4 needs S % 8 == 0
TOL = 1e-5
METHODS = {"ring": cp.ring_attention, "ulysses": cp.ulysses_attention}


def _full(seed: int, heads: int = H):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, heads, S, D, generator=g) for _ in range(4)]  # q, k, v and the loss weights


def _attention_cases(group=None) -> dict:
    """Every (method, layout, causal) on this rank: max |difference| from SDPA, bytes sent.
    On a sub-group (``group``) a few cases: the ring and the all-to-all in group numbering."""
    p = dist.get_world_size(group)
    out: dict = {"diff": {}, "bytes": {}, "calls": {}}
    cases = [(m, lay, c, None, "native") for m in METHODS for lay in cp.LAYOUTS for c in (True, False)]
    cases += [("ring", "zigzag", True, 0.3, "native"), ("ulysses", "contiguous", True, 0.3, "pairwise")]
    if group is not None:
        cases = [(m, "zigzag", True, None, "native") for m in METHODS]
    for n, (method, layout, causal, scale, algorithm) in enumerate(cases):
        q, k, v, w = _full(seed=n)
        ref = [t.clone().requires_grad_() for t in (q, k, v)]
        o_ref = F.scaled_dot_product_attention(*ref, is_causal=causal, scale=scale)
        (o_ref * w).sum().backward()

        def shard(t):
            return cp.shard_sequence(t, group=group, layout=layout)

        mine = [shard(t).requires_grad_() for t in (q, k, v)]
        kw = {"algorithm": algorithm} if method == "ulysses" else {}
        with comm.counters() as fwd:
            o = METHODS[method](*mine, group=group, is_causal=causal, scale=scale, layout=layout, **kw)
        with comm.counters() as bwd:
            (o * shard(w)).sum().backward()
        key = f"{method}/{layout}/{'causal' if causal else 'full'}" + (f"/scale={scale}/{algorithm}" if scale else "")
        pairs = [(o, o_ref)] + [(m.grad, r.grad) for m, r in zip(mine, ref)]
        out["diff"][key] = [(a.detach() - shard(b.detach())).abs().max().item() for a, b in pairs]
        out["bytes"][key] = (fwd.total_bytes_sent, bwd.total_bytes_sent)
        out["calls"][key] = ({f"{c}/{a}": s.calls for (c, a), s in fwd.stats.items()},
                             {f"{c}/{a}": s.calls for (c, a), s in bwd.stats.items()})
        if n == 0:  # the shards put back together are the full output
            full = cp.unshard_sequence(o.detach(), group=group, layout=layout)
            out["unshard"] = (full - o_ref.detach()).abs().max().item()
    out["positions"] = {lay: cp.sequence_positions(S, group=group, layout=lay).tolist() for lay in cp.LAYOUTS}
    out["p"] = p
    return out


def _bruck_bytes(rows, r: int, row_bytes: int, headers: bool) -> tuple[int, int]:
    """Bytes rank r sends and receives in Bruck's all-to-all, ``rows[i][j]`` the rows i sends j: in
    the round of distance d = 2^k, slot i (bit k set) of rank s holds the block from
    ``s - (i mod d)`` for ``s - (i mod d) + i``; a header of one int64 per moving slot goes first
    when the sizes are uneven. Rank r receives in that round what rank r - d sends."""
    p = len(rows)

    def sent(s: int, d: int) -> int:
        srcs = [((s - i % d) % p, i) for i in range(p) if i & d]
        return sum(rows[src][(src + i) % p] * row_bytes + (8 if headers else 0) for src, i in srcs)

    ds = [1 << k for k in range((p - 1).bit_length())]
    return sum(sent(r, d) for d in ds), sum(sent((r - d) % p, d) for d in ds)


def _all_to_all_cases() -> dict:
    """all_to_all_single, ours against torch's, even and uneven splits; bytes and calls counted."""
    r, p = dist.get_rank(), dist.get_world_size()
    res: dict = {"bad": [], "counted": {}}
    uneven = [[(i + 2 * j) % 3 for j in range(p)] for i in range(p)]  # rows rank i sends rank j (some 0)
    for splits in ("even", "uneven"):
        for dtype in (torch.float32, torch.int64):
            rows = [[2] * p for _ in range(p)] if splits == "even" else uneven
            send, recv = rows[r], [rows[i][r] for i in range(p)]
            x = (torch.arange(sum(send) * 3).view(-1, 3) + 1000 * r).to(dtype)
            want = torch.empty(sum(recv), 3, dtype=dtype)
            sizes = (None, None) if splits == "even" else (recv, send)
            dist.all_to_all_single(want, x, *sizes)
            for alg in comm.ALGORITHMS["all_to_all_single"]:
                for async_op in (False, True):
                    got = torch.full((sum(recv), 3), -1, dtype=dtype)
                    with comm.counters() as c:
                        h = comm.all_to_all_single(got, x, *sizes, algorithm=alg, async_op=async_op)
                        if async_op:
                            h.wait()
                    if (h is None) == async_op:
                        res["bad"].append(f"{alg} async_op={async_op} returned {h!r}")
                    if not torch.equal(got, want):
                        res["bad"].append(f"{alg} {splits} {dtype} async={async_op}: got {got.tolist()} "
                                          f"want {want.tolist()}")
                    stat = c.stats[("all_to_all_single", alg)]
                    row = 3 * x.element_size()
                    expect = (1, (sum(send) - send[r]) * row, (sum(recv) - recv[r]) * row)
                    if alg == "bruck":  # forwarded blocks and (uneven) size headers travel too
                        expect = (1,) + _bruck_bytes(rows, r, row, headers=splits == "uneven")
                    if (stat.calls, stat.bytes_sent, stat.bytes_received) != expect:
                        res["bad"].append(f"{alg} {splits} counted {(stat.calls, stat.bytes_sent, stat.bytes_received)}"
                                          f" want {expect}")
    # a non-contiguous output (a transposed view) is written in place
    x = torch.arange(4 * p, dtype=torch.float32).view(2 * p, 2) + 100 * r
    want = torch.empty(2 * p, 2)
    dist.all_to_all_single(want, x)
    for alg in comm.ALGORITHMS["all_to_all_single"]:
        got = torch.empty(2, 2 * p).t()
        comm.all_to_all_single(got, x, algorithm=alg)
        if not torch.equal(got, want):
            res["bad"].append(f"{alg} non-contiguous output: got {got.tolist()} want {want.tolist()}")
    return res


def _bad_input_cases() -> dict:
    """Each bad call raises a ValueError naming the argument; nothing is sent by any of them."""
    q = torch.randn(B, H, S // 2, D)
    odd = torch.randn(B, H, 3, D)
    three_heads = torch.randn(B, 3, S // 2, D)
    x = torch.arange(8.0)
    calls = {
        "sequence length": lambda: cp.ring_attention(odd, odd, odd),  # 3 x 2 = 6, not a multiple of 4
        "heads": lambda: cp.ulysses_attention(three_heads, three_heads, three_heads),
        "layout='spiral'": lambda: cp.ring_attention(q, q, q, layout="spiral"),
        "k has shape": lambda: cp.ring_attention(q, q[..., :4], q),
        "v has shape": lambda: cp.ulysses_attention(q, q, q[:, :2]),
        "is_causal='yes'": lambda: cp.ring_attention(q, q, q, is_causal="yes"),
        "scale=-1": lambda: cp.ulysses_attention(q, q, q, scale=-1),
        "algorithm='bogus'": lambda: cp.ulysses_attention(q, q, q, algorithm="bogus"),
        "x.shape[2]=10": lambda: cp.shard_sequence(torch.zeros(1, 1, 10, 2)),
        "seq_len=10": lambda: cp.sequence_positions(10, layout="zigzag"),
        "dim=5": lambda: cp.shard_sequence(q, dim=5),
        "input_split_sizes": lambda: comm.all_to_all_single(torch.empty(8), x, input_split_sizes=[1, 2]),
        "output_split_sizes": lambda: comm.all_to_all_single(torch.empty(8), x, [4, 4, 0]),
        "input has 7 rows": lambda: comm.all_to_all_single(torch.empty(8), torch.arange(7.0)),
        "dtype": lambda: comm.all_to_all_single(torch.empty(8, dtype=torch.int64), x),
        "algorithm='tree'": lambda: comm.all_to_all_single(torch.empty(8), x, algorithm="tree"),
    }
    res: dict = {}
    with comm.counters() as c:
        for name, call in calls.items():
            try:
                call()
                res[name] = "no error"
            except ValueError as e:
                res[name] = "ok" if name in str(e) else f"message does not name it: {e}"
            except Exception as e:  # noqa: BLE001 -- reported to the test
                res[name] = f"{type(e).__name__}: {e}"
    res["messages"] = c.total_calls
    t = torch.ones(1)
    comm.all_reduce(t)  # nothing left in flight: the group still works
    res["after"] = t.item()
    return res


# the mesh with context parallelism: GPT tiny (float64), 3 AdamW steps against one process, every step's
# loss and the full state within 1e-5 (tests/test_mesh.py's check); (dp, tp, pp, parallelize's kwargs)
MESH_CASES = {
    2: [(1, 1, 1, dict(cp=2, cp_method="ring", cp_layout="zigzag")),
        (1, 1, 1, dict(cp=2, cp_method="ulysses", cp_layout="contiguous"))],
    4: [(2, 1, 1, dict(cp=2, cp_method="ring", cp_layout="contiguous", zero_stage=1, against_torch=True)),
        (2, 1, 1, dict(cp=2, cp_method="ulysses", cp_layout="zigzag", zero_stage=3)),
        (2, 1, 1, dict(cp=2, cp_method="ring", zero_stage=0)),
        (1, 2, 1, dict(cp=2, cp_method="ring", sequence_parallel=True)),   # cp x tp
        (1, 1, 2, dict(cp=2, cp_method="ring", schedule="gpipe"))],        # cp x pp
}


def _mesh_cases(p: int) -> list[str]:
    from test_mesh import _parity_rank

    return _parity_rank(MESH_CASES[p])


def _mesh_bad_input() -> dict:
    """parallelize and step refuse bad context-parallel input with a ValueError naming it, before
    any message."""
    from workbench.models.gpt import GPT, GPTConfig
    from workbench.parallel.mesh import Mesh, parallelize

    def gpt(**kw):
        return GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=2, n_embd=16, **kw))

    mesh = Mesh(cp=2)
    trained = parallelize(gpt(), mesh)  # DDP over dp x cp broadcasts the parameters: before counting
    calls = {
        "cp_method='bogus'": lambda: parallelize(gpt(), mesh, cp_method="bogus"),
        "cp_layout='spiral'": lambda: parallelize(gpt(), mesh, cp_layout="spiral"),
        "n_head=1, tp=1, cp=2": lambda: parallelize(GPT(GPTConfig(vocab_size=65, block_size=8, n_layer=1, n_head=1,
                                                                  n_embd=16)), mesh, cp_method="ulysses"),
        "dropout=0.1": lambda: parallelize(gpt(dropout=0.1), mesh),
        "sequence length 6": lambda: trained.step(torch.zeros(2, 6, dtype=torch.long),
                                                  torch.zeros(2, 6, dtype=torch.long)),
    }
    res: dict = {}
    with comm.counters() as c:
        for name, call in calls.items():
            try:
                call()
                res[name] = "no error"
            except ValueError as e:
                res[name] = "ok" if name in str(e) else f"message does not name it: {e}"
    res["messages"] = c.total_calls
    return res


def _bench_smallest() -> dict:
    """``workbench bench context``'s measurement at the smallest size (S = 8, P = 2)."""
    from workbench.apps.bench import context as bench

    return bench.measure([8], batch=1, heads=2, head_dim=4, candidates=list(bench.CANDIDATES), trials=1, steps=1,
                         warmup=0)


def _timeline() -> list:
    """The ring's forward recorded by ``ring_timeline`` (zigzag, P = 2)."""
    q = cp.shard_sequence(_full(seed=0)[0])
    with cp.ring_timeline() as events:
        cp.ring_attention(q, q, q)
    return events


def _rank_p2() -> dict:
    return {"attention": _attention_cases(), "a2a": _all_to_all_cases(), "bad": _bad_input_cases(),
            "mesh": _mesh_cases(2), "mesh_bad": _mesh_bad_input(), "bench": _bench_smallest(),
            "timeline": _timeline()}


def _rank_p3() -> dict:
    return {"a2a": _all_to_all_cases()}


def _rank_p4() -> dict:
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank makes every group
    return {"attention": _attention_cases(), "subgroup": _attention_cases(pairs[dist.get_rank() // 2]),
            "mesh": _mesh_cases(4), "a2a": _all_to_all_cases()}


@functools.lru_cache(maxsize=None)
def _launch(p: int) -> list[dict]:
    from workbench.apps.train import preload

    preload()  # imports the mesh's strategies once, in the parent: the forked ranks inherit them
    fn = {2: _rank_p2, 3: _rank_p3, 4: _rank_p4}[p]
    return workbench.launch(fn, world_size=p, timeout=120)


def _block_bytes(p: int) -> int:
    return B * (S // p) * H * D * 4  # one rank's K (or V, or q, ...) block of float32


@pytest.mark.parametrize("p", [2, 4])
def test_attention_matches_sdpa(p):
    for rank, res in enumerate(_launch(p)):
        diff = res["attention"]["diff"]
        assert len(diff) == 10
        worst = {k: max(v) for k, v in diff.items()}
        assert max(worst.values()) <= TOL, (rank, worst)
        assert res["attention"]["unshard"] <= TOL


@pytest.mark.parametrize("p", [2, 4])
def test_bytes_and_calls_match_the_formulas(p):
    block = _block_bytes(p)
    ring_fwd, ring_bwd = 2 * (p - 1) * block, 2 * (p - 1) * block + 2 * p * block
    ulysses = 4 * block * (p - 1) // p
    assert 4 * block * (p - 1) % p == 0
    for res in _launch(p):
        for key, (fwd, bwd) in res["attention"]["bytes"].items():
            want = (ring_fwd, ring_bwd) if key.startswith("ring") else (ulysses, ulysses)
            assert (fwd, bwd) == want, key
        for key, (fwd, bwd) in res["attention"]["calls"].items():
            if key.startswith("ring"):  # one K/V message per step, and P dK/dV hops
                assert fwd == {"isend/native": p - 1, "irecv/native": p - 1}, key
                assert bwd == {"isend/native": 2 * p - 1, "irecv/native": 2 * p - 1}, key
            else:  # three all-to-alls in (q, k, v), one out; the same backward
                alg = "pairwise" if key.endswith("pairwise") else "native"
                assert fwd == bwd == {f"all_to_all_single/{alg}": 4}, key


def test_layouts_positions():
    for p in (2, 4):
        res = _launch(p)
        for lay in cp.LAYOUTS:
            held = [r["attention"]["positions"][lay] for r in res]
            assert sorted(sum(held, [])) == list(range(S)), lay
        c = S // (2 * p)
        for r, out in enumerate(res):
            assert out["attention"]["positions"]["contiguous"] == list(range(r * S // p, (r + 1) * S // p))
            assert out["attention"]["positions"]["zigzag"] == (list(range(r * c, (r + 1) * c))
                                                                + list(range((2 * p - 1 - r) * c, (2 * p - r) * c)))


@pytest.mark.parametrize("p", [2, 3, 4])
def test_all_to_all_single_matches_torch(p):
    for rank, res in enumerate(_launch(p)):
        assert not res["a2a"]["bad"], (rank, res["a2a"]["bad"])


def test_bad_input_raises_before_any_message():
    for res in _launch(2):
        bad = res["bad"]
        assert bad.pop("messages") == 0
        assert bad.pop("after") == 2.0
        assert all(v == "ok" for v in bad.values()), {k: v for k, v in bad.items() if v != "ok"}


@pytest.mark.parametrize("p", [2, 4, 8])
def test_causal_work_per_rank_matches_the_docstring(p):
    """Unmasked pairs and blocks computed per rank, from the ring's own masks (no launch needed)."""
    seq = 16 * p
    for layout in cp.LAYOUTS:
        pairs, computed = [], []
        for r in range(p):
            q_pos = cp._positions(seq, p, r, layout)
            k_pos = [cp._positions(seq, p, j, layout) for j in range(p)]
            computed.append(sum(cp._block_mask(q_pos, kp, True) is not cp.SKIP for kp in k_pos))
            pairs.append(sum(int((kp[None, :] <= q_pos[:, None]).sum()) for kp in k_pos))
        if layout == "contiguous":  # rank r: r whole blocks and a triangle; r + 1 blocks computed
            c = seq // p
            assert pairs == [r * c * c + c * (c + 1) // 2 for r in range(p)]
            assert computed == [r + 1 for r in range(p)]
            # max/min = 1 + 2(P-1) c/(c+1): the docstring's 2P-1 once a chunk is long
            assert max(pairs) / min(pairs) == pytest.approx(1 + 2 * (p - 1) * c / (c + 1))
        else:  # zigzag: 2P-1 whole chunk pairs and two triangles on every rank; every block computed
            c = seq // (2 * p)
            assert pairs == [(2 * p - 1) * c * c + c * (c + 1)] * p
            assert computed == [p] * p
            for r in range(p):  # trimmed: its own block under the mask, then P-1 unmasked halves
                q_pos = cp._positions(seq, p, r, layout)
                parts = [cp._trim(q_pos, cp._positions(seq, p, (r - s) % p, layout), True) for s in range(p)]
                assert parts[0][2] is not None and all(m is None for _, _, m in parts[1:])
                sizes = [len(q_pos[rows]) * len(q_pos[cols]) for rows, cols, _ in parts]
                assert sizes == [(2 * c) ** 2] + [2 * c * c] * (p - 1), (r, sizes)


def test_on_a_sub_group():
    """P = 4 split into two groups of 2 (ranks 0-1 and 2-3): each runs its own ring and all-to-all."""
    block = _block_bytes(2)
    for res in _launch(4):
        sub = res["subgroup"]
        assert sub["p"] == 2 and len(sub["diff"]) == 2
        assert max(max(v) for v in sub["diff"].values()) <= TOL and sub["unshard"] <= TOL
        assert sub["bytes"]["ring/zigzag/causal"] == (2 * block, 2 * block + 4 * block)
        assert sub["bytes"]["ulysses/zigzag/causal"] == (2 * block, 2 * block)


@pytest.mark.parametrize("p", [2, 4])
def test_mesh_matches_one_process(p):
    """parallelize(..., Mesh(cp=2)) and Mesh(dp=2, cp=2), ring and Ulysses, both layouts, with DDP,
    ZeRO-1, ZeRO-3, tensor and sequence parallelism, a pipeline: 3 steps equal one process."""
    bad = [f"rank {r}: {line}" for r, res in enumerate(_launch(p)) for line in res["mesh"]]
    assert not bad, "\n".join(bad[:20])


def test_mesh_bad_input_raises_before_any_message():
    for res in _launch(2):
        bad = res["mesh_bad"]
        assert bad.pop("messages") == 0
        assert all(v == "ok" for v in bad.values()), {k: v for k, v in bad.items() if v != "ok"}


def test_bench_context_cli(tmp_path, capsys, monkeypatch):
    """``workbench bench context`` end to end at the smallest size (its measurement ran in the P = 2
    launch above): every candidate runs, matches one process, and its bytes equal the formulas
    (timings are the command's, not asserted)."""
    import argparse
    import json

    from workbench.apps import cli
    from workbench.apps.bench import context as bench

    measured = _launch(2)[0]["bench"]
    launched = []

    def launch(fn, world_size, args, timeout):  # the measurement ran already, in the P = 2 launch
        launched.append((fn, world_size, args))
        return [dict(measured)]

    monkeypatch.setattr(workbench, "launch", launch)
    assert "context" in cli._benchmarks()
    assert cli.main(["bench", "context", "--seq-lens", "8", "--heads", "2", "--head-dim", "4", "--trials", "1",
                     "--steps", "1", "--warmup", "0", "--no-plot", "--out", str(tmp_path)]) == 0
    assert launched[0][1] == 2 and launched[0][2][0]["seq_lens"] == [8]
    printed = capsys.readouterr().out
    assert "bytes sent equal the formulas: yes, every row" in printed and "x ideal" in printed
    rows = json.loads((tmp_path / "context.json").read_text())["results"]["rows"]
    ran = {r["candidate"] for r in rows}
    assert {"sdpa", "ring", "ring-contiguous", "ulysses"} <= ran
    assert "torch-ring" in ran or "torch-ring skipped" in printed
    assert all(r["max_diff"] <= TOL for r in rows)
    block = 1 * 4 * 2 * 4 * 4  # B (S/P) H D float32 at S = 8, P = 2
    ring = next(r for r in rows if r["candidate"] == "ring")
    assert (ring["sent_fwd"], ring["sent_bwd"]) == (2 * block, 2 * block + 4 * block)
    assert all(r["bytes_match"] for r in rows if "sent_fwd" in r)

    def configure(*argv):
        parser = argparse.ArgumentParser()
        bench.add_arguments(parser)
        return bench.configure(parser.parse_args(list(argv)))

    for argv, words in [(("--seq-lens", "6"), "multiples of 4"), (("--heads", "3"), "--heads=3"),
                        (("--candidates", "flash"), "'flash'"), (("--world-size", "1"), "at least 2 ranks")]:
        with pytest.raises(ValueError, match=words):
            configure(*argv)


def test_ring_timeline_records_post_compute_wait_in_order():
    """Each step posts the next block before computing the current one, then waits for it."""
    for res in _launch(2):
        events = res["timeline"]
        assert [(step, what) for step, what, _, _ in events] == [(0, "post"), (0, "compute"), (0, "wait"),
                                                                 (1, "compute")]
        assert all(start <= end for _, _, start, end in events)
        assert all(a[3] <= b[2] for a, b in zip(events, events[1:]))  # one after another, in that order
