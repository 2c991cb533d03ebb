"""workbench.comm.send/recv/isend/irecv: torch's signatures, delivery (contiguous or not,
sub-groups with group_dst/group_src, any source, tags, empty), counters, bad input."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import workbench
from workbench import comm


def _p2p_rank() -> list[str]:
    r, w = dist.get_rank(), dist.get_world_size()
    bad = []
    nxt, prv = (r + 1) % w, (r - 1) % w
    payload = lambda k: torch.arange(12, dtype=torch.float32).view(3, 4) + 100 * k  # noqa: E731
    with comm.counters() as c:
        # ring shift with isend/irecv (receives posted first), two tags matched by tag
        a, b = torch.zeros(3, 4), torch.zeros(4, 3).t()  # b is non-contiguous
        hs = [comm.irecv(a, src=prv, tag=1), comm.irecv(b, src=prv, tag=2),
              comm.isend(payload(r) + 0.5, dst=nxt, tag=2), comm.isend(payload(r), dst=nxt, tag=1)]
        for h in hs:
            h.wait()
        if not torch.equal(a, payload(prv)) or not torch.equal(b, payload(prv) + 0.5):
            bad.append(f"rank {r}: ring shift with tags / non-contiguous receive got {a} {b}")
        # blocking, ordered: even ranks send first
        t = torch.zeros(5)
        if r % 2 == 0:
            comm.send(torch.full((5,), float(r)), dst=nxt)
            src = comm.recv(t, src=prv)
        else:
            src = comm.recv(t, src=prv)
            comm.send(torch.full((5,), float(r)), dst=nxt)
        if src != prv or not torch.equal(t, torch.full((5,), float(prv))):
            bad.append(f"rank {r}: blocking send/recv got {t} from {src}")
        # any source: rank 0 collects one message from every other rank
        if r == 0:
            got = {}
            for _ in range(w - 1):
                t = torch.zeros(2)
                s = comm.recv(t)
                got[s] = t[0].item()
            if got != {k: float(k) for k in range(1, w)}:
                bad.append(f"rank 0: any-source receives got {got}")
        else:
            comm.send(torch.full((2,), float(r)), dst=0)
        comm.send(torch.zeros(0), dst=nxt) if r % 2 == 0 else comm.recv(torch.zeros(0), src=prv)
        comm.recv(torch.zeros(0), src=prv) if r % 2 == 0 else comm.send(torch.zeros(0), dst=nxt)
    sent = 12 * 4 * 2 + 5 * 4 + (2 * 4 if r else 0)
    recv = 12 * 4 * 2 + 5 * 4 + (2 * 4 * (w - 1) if r == 0 else 0)
    if c.total_bytes_sent != sent or c.total_bytes_received != recv:
        bad.append(f"rank {r}: counted {c.total_bytes_sent}/{c.total_bytes_received} B, want {sent}/{recv}")
    if c.stats[("isend", "native")].calls != 2 or c.stats[("irecv", "native")].calls != 2:
        bad.append(f"rank {r}: calls {c.as_dict()}")
    # a sub-group of the odd ranks, numbered inside the group
    odd = [k for k in range(w) if k % 2]
    g = dist.new_group(odd)
    if r in odd and len(odd) >= 2:
        me = odd.index(r)
        t = torch.zeros(3)
        if me == 0:
            comm.send(torch.ones(3) * r, group=g, group_dst=1)
        elif me == 1:
            if comm.recv(t, group=g, group_src=0) != odd[0] or not torch.equal(t, torch.ones(3) * odd[0]):
                bad.append(f"rank {r}: group_src receive got {t}")
    # bad input, before anything is sent
    for call, words in [(lambda: comm.send(torch.ones(1), dst=r), "itself"),
                        (lambda: comm.send(torch.ones(1), dst=w), f"dst={w}"),
                        (lambda: comm.isend(torch.ones(1), group_dst=w), f"group_dst={w}"),
                        (lambda: comm.irecv(torch.ones(1), src=0, group_src=0), "not both"),
                        (lambda: comm.send(torch.ones(1)), "dst is required"),
                        (lambda: comm.send(torch.ones(1), dst=nxt, tag=-1), "tag=-1")]:
        try:
            call()
            bad.append(f"rank {r}: no error for {words}")
        except ValueError as e:
            if words not in str(e):
                bad.append(f"rank {r}: error {e} does not mention {words}")
    dist.barrier()
    return bad


@pytest.mark.parametrize("world_size", [2, 4])
def test_p2p(world_size):
    out = workbench.launch(_p2p_rank, world_size=world_size, timeout=60)
    assert [b for rank in out for b in rank] == []
