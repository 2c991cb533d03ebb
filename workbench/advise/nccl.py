"""A collective's time as NCCL runs it on a GPU cluster: algorithm, protocol, link class, message size.

On a GPU cluster every collective of the advisor (:mod:`workbench.advise.timing`) is priced here
when the :class:`~workbench.advise.cluster.Cluster` carries an :class:`NcclModel` (the GPU
presets do; a CPU cluster priced with gloo does not, and keeps :mod:`workbench.comm.cost`).

Bus bandwidth (nccl-tests' ``doc/PERFORMANCE.md``)
--------------------------------------------------
nccl-tests reports, for a collective of ``S`` bytes among ``n`` ranks that took ``t`` seconds,
the *algorithm bandwidth* ``S / t`` and the *bus bandwidth* ``busbw = S / t x factor``, the
factor being the share of ``S`` each rank's link carries in a bandwidth-optimal algorithm::

    all_reduce                          2 (n - 1) / n     (a reduce-scatter, then an all-gather)
    reduce_scatter, all_gather          (n - 1) / n       (S: the whole gathered buffer)
    all_to_all                          (n - 1) / n       (S: one rank's whole input)
    broadcast, reduce, send/recv        1

so the bus bandwidth of a large message is the link's achieved bandwidth whatever ``n``, and one
figure per link class prices every collective: ``t = latency + factor x S / busbw``.
(:func:`bus_factor`; ``S`` is the size :func:`workbench.comm.cost.predict` takes.)

Algorithms and protocols (NCCL's own tuning model, ``src/graph/tuning.cc``)
---------------------------------------------------------------------------
NCCL prices each (algorithm, protocol) as ``latency + S / algorithm bandwidth`` and runs the
fastest; this module does the same with the algorithms that matter for training:

* **ring** (every collective): ``2 (n - 1)`` steps for an all-reduce, ``n - 1`` for a
  reduce-scatter or an all-gather, each step paying a link latency: 3.4 us on NVLink, 14 us on
  the network (Simple protocol; the ring's base 8.4 us). A ring across nodes crosses the network
  twice per node and turn; every other step stays on NVLink. Its bandwidth is the slowest link
  of the ring (below).
* **tree** (all-reduce): a chain inside each node, a double binary tree between nodes: latency
  ``2 ((k - 1) x intra + log2(nodes) x inter)`` hops, 28 us per hop (Simple), so at many nodes
  it beats the ring's ``2 (n - 1)`` steps for small and medium messages; it moves each byte
  twice at 92% of the ring's bandwidth (``busBw * .92`` and the ``.5`` algorithm ratio), so for
  large messages the ring wins.
* **NVLS** (NVLink SHARP; all-reduce inside an NVSwitch node of H100s): the switch reduces, a
  latency of 23 us, and a bus bandwidth of its own (480 GB/s on 8 H100, above the ring's 370).
  Across nodes NCCL runs NVLS-Tree; not modelled (the ring/tree is priced instead: conservative).
* protocols: **Simple** (full bandwidth, the latencies above), **LL128** (a flag in each
  128-byte line: 92% of the bandwidth; base 14 us, 1.9 us per NVLink step and 4 us per network
  step in a ring, 1.25 and 8.5 per tree hop) and **LL** (low latency: a flag per 8 bytes; base
  6.6 us, 0.6 us per NVLink step, 2.7 us per network step, a quarter of the bandwidth -- a third
  for a single-node all-gather or reduce-scatter -- and at most 87.7 GB/s on one node, 22.5 on
  two, 19.0 beyond). Between a few KB and a few MB across many nodes LL128 wins: its network
  steps cost 4 us, not 14. NCCL enables LL128 on NVLink nodes of Volta, Ampere and Hopper (with
  GPUDirect RDMA between nodes), so on every preset here.

The bus bandwidth therefore grows with the message: ``busbw(S) = peak x S / (S + S_half)`` with
``S_half = latency x peak / factor`` (:meth:`NcclModel.busbw`) -- the saturation curve
nccl-tests prints, from a few GB/s at 64 KiB to the peak past a few hundred MB.

Link classes and the nodes a group spans
----------------------------------------
A group of ``n`` ranks with ``k`` on each of ``n / k`` nodes (the advisor's Megatron mesh gives
every group the same count on each node it touches; :meth:`Topology.of_group`):

* one node (``k == n``): NVLink through NVSwitch, ``nvlink_busbw`` (the ring's; NVLS for an
  all-reduce where the node has it);
* several nodes: NCCL runs one ring per channel, each entering and leaving every node through a
  different NIC, so a node's ``k`` ranks together move ``k x`` their per-GPU network share:
  ``busbw = min(nvlink_busbw, k x network_Bps)`` -- a tensor-parallel-sized group of 8 per node
  runs near NVLink speed across nodes on DGX H100 (8 NICs), a data-parallel group of one rank per
  node (``t = 8``) at one NIC's speed;
* all-to-all sends ``(k - 1) / n`` of its buffer over NVLink and ``(n - k) / n`` over the rank's
  own NIC at once: the slower of the two;
* send/recv (pipeline messages): one GPU to one GPU, ``p2p_Bps`` inside a node, the GPU's
  network share between nodes.

Figures (cited where they are set, :data:`PRESETS`) are nccl-tests results and NVIDIA engineers'
statements of them; NCCL's latency constants are its tuning model's. Nothing here is measured on
this machine.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["NcclModel", "PRESETS", "bus_factor", "COLLECTIVES"]

# names workbench.advise and workbench.comm.cost use -> the collective priced
COLLECTIVES = {"all_reduce": "all_reduce", "reduce_scatter": "reduce_scatter", "all_gather": "all_gather",
               "broadcast": "broadcast", "reduce": "reduce", "all_to_all": "all_to_all",
               "all_to_all_single": "all_to_all", "send_recv": "send_recv", "send": "send_recv",
               "recv": "send_recv"}

# NCCL's tuning model (NVIDIA/nccl src/graph/tuning.cc, baseLat and hwLat, NCCL 2.18-2.21), microseconds
_BASE_US = {("ring", "simple"): 8.4, ("ring", "ll128"): 14.0, ("ring", "ll"): 6.6,
            ("tree", "simple"): 0.0, ("tree", "ll128"): 14.0, ("tree", "ll"): 6.8}
_STEP_US = {("ring", "simple"): (3.4, 14.0), ("ring", "ll128"): (1.9, 4.0), ("ring", "ll"): (0.6, 2.7),
            ("tree", "simple"): (28.0, 28.0), ("tree", "ll128"): (1.25, 8.5), ("tree", "ll"): (0.6, 5.0)}
_PROTOCOLS = ("simple", "ll128", "ll")      # (NVLink, network) latency per ring step / tree hop above
_LL128_SHARE = 0.92      # LL128's bandwidth against Simple's: 120 data bytes per 128-byte line (tuning.cc: 0.92)
_NVLS_US = 23.0          # hwLat[NVLINK][NVLS][Simple]: NVLS's whole latency inside a node
_TREE_SHARE = 0.92       # a tree's bandwidth against the ring's (tuning.cc: busBw * .92)
_LL_MAX_BPS = (87.7e9, 22.5e9, 19.0e9)   # llMaxBws (Ampere/Hopper): 1 node, 2 nodes, more


def bus_factor(collective: str, n: int) -> float:
    """nccl-tests' bus-bandwidth factor (``doc/PERFORMANCE.md``): the share of the message each
    rank's link carries, so ``busbw = S / t x bus_factor``: ``2 (n - 1) / n`` for an all-reduce,
    ``(n - 1) / n`` for a reduce-scatter, an all-gather or an all-to-all, 1 for a broadcast, a
    reduce or a send/recv."""
    kind = _kind(collective)
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"bus_factor(n={n!r}): the number of ranks must be a whole number >= 1")
    if kind == "all_reduce":
        return 2 * (n - 1) / n
    if kind in ("reduce_scatter", "all_gather", "all_to_all"):
        return (n - 1) / n
    return 1.0


def _kind(collective: str) -> str:
    if collective not in COLLECTIVES:
        raise ValueError(f"collective={collective!r} is not priced by the NCCL model; use one of "
                         f"{sorted(COLLECTIVES)}")
    return COLLECTIVES[collective]


@dataclass(frozen=True)
class NcclModel:
    """The bus bandwidths NCCL achieves on one kind of GPU node and its network (bytes/s, one
    direction, large messages, as nccl-tests reports them); see the module docstring.

    ``nvlink_busbw``: a ring inside a node (any collective); ``nvls_busbw``: an all-reduce inside a
    node with NVLink SHARP (0: the node has none); ``p2p_Bps``: one GPU sending to another inside
    a node; ``network_Bps``: each GPU's achieved share of its node's NICs (one NIC per GPU on a
    DGX: one NIC's rate)."""

    name: str
    nvlink_busbw: float
    network_Bps: float
    p2p_Bps: float
    nvls_busbw: float = 0.0
    source: str = ""

    def __post_init__(self) -> None:
        for field, positive in (("nvlink_busbw", True), ("network_Bps", True), ("p2p_Bps", True),
                                ("nvls_busbw", False)):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                raise ValueError(f"NcclModel({field}={value!r}): must be a finite number of bytes/s "
                                 f"{'> 0' if positive else '>= 0 (0: none)'}, e.g. 370e9")

    # -- the model ---------------------------------------------------------------------------
    def link_busbw(self, n: int, per_node: int) -> float:
        """The ring's bus bandwidth for ``n`` ranks, ``per_node`` on each node: NVLink inside one
        node; across nodes the node's ranks share their NICs, ``per_node x network_Bps``, never
        above NVLink."""
        if per_node >= n:
            return self.nvlink_busbw
        return min(self.nvlink_busbw, per_node * self.network_Bps)

    def algorithms(self, collective: str, nbytes: float, n: int, per_node: int | None = None) -> dict[str, float]:
        """Seconds of each (algorithm/protocol) NCCL could run for ``collective`` of ``nbytes``
        among ``n`` ranks, ``per_node`` on each node they span (default: all on one node)."""
        kind = _kind(collective)
        per_node = self._check(nbytes, n, per_node)
        if n == 1:
            return {"local": 0.0}
        nodes = n // per_node
        intra = per_node >= n
        factor = bus_factor(kind, n)
        bw = self.link_busbw(n, per_node)
        ll_cap = _LL_MAX_BPS[min(nodes, 3) - 1]
        out: dict[str, float] = {}
        if kind == "send_recv":
            rate = self.p2p_Bps if intra else self.network_Bps
            for proto in ("simple", "ll"):
                step = _STEP_US[("ring", proto)][0 if intra else 1]
                share = 1.0 if proto == "simple" else 1 / 3
                out[f"p2p/{proto}"] = (_BASE_US[("ring", proto)] + step) * 1e-6 \
                    + nbytes / (min(rate * share, ll_cap) if proto == "ll" else rate)
            return out
        if kind == "all_to_all":
            inside = (per_node - 1) / n * nbytes / self.nvlink_busbw
            outside = (n - per_node) / n * nbytes / self.network_Bps
            step = _STEP_US[("ring", "simple")][0 if intra else 1]
            out["p2p/simple"] = (_BASE_US[("ring", "simple")] + step) * 1e-6 + max(inside, outside)
            return out
        # the ring: its steps, those crossing the network, and its bandwidth per protocol
        steps = {"all_reduce": 2 * (n - 1), "reduce_scatter": n - 1, "all_gather": n - 1}.get(kind, n - 1)
        crossing = 0 if intra else min(steps, {"all_reduce": 2 * nodes}.get(kind, nodes - 1))
        for proto in _PROTOCOLS:
            on_link, on_net = _STEP_US[("ring", proto)]
            latency = _BASE_US[("ring", proto)] + (steps - crossing) * on_link + crossing * on_net
            rate = bw if proto == "simple" else _LL128_SHARE * bw
            if proto == "ll":
                third = intra and kind in ("reduce_scatter", "all_gather", "broadcast")
                rate = min(ll_cap, bw / (3 if third else 4))
            out[f"ring/{proto}"] = latency * 1e-6 + factor * nbytes / rate
        if kind == "all_reduce":
            hops = (per_node - 1, int(math.log2(nodes)) if nodes > 1 else 0)
            for proto in _PROTOCOLS:
                on_link, on_net = _STEP_US[("tree", proto)]
                latency = _BASE_US[("tree", proto)] + 2 * (hops[0] * on_link + hops[1] * on_net)
                rate = {"simple": _TREE_SHARE * bw, "ll": min(ll_cap, _TREE_SHARE * bw / 3.8),
                        "ll128": _TREE_SHARE * bw * (7 / 9 if intra else 120 / 128)}[proto]
                out[f"tree/{proto}"] = latency * 1e-6 + 2 * nbytes / rate
            if intra and self.nvls_busbw > 0:
                out["nvls/simple"] = _NVLS_US * 1e-6 + factor * nbytes / self.nvls_busbw
        return out

    def time(self, collective: str, nbytes: float, n: int, per_node: int | None = None) -> float:
        """Seconds ``collective`` of ``nbytes`` (nccl-tests' size) takes among ``n`` ranks,
        ``per_node`` on each node: the fastest algorithm and protocol, as NCCL's tuner picks."""
        return min(self.algorithms(collective, nbytes, n, per_node).values())

    def busbw(self, collective: str, nbytes: float, n: int, per_node: int | None = None) -> float:
        """The bus bandwidth nccl-tests would report (bytes/s): ``nbytes / time x bus_factor``."""
        t = self.time(collective, nbytes, n, per_node)
        return nbytes / t * bus_factor(_kind(collective), n) if t > 0 else 0.0

    def _check(self, nbytes: float, n: int, per_node: int | None) -> int:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"NcclModel: n={n!r} ranks must be a whole number >= 1")
        if isinstance(nbytes, bool) or not isinstance(nbytes, (int, float)) or not nbytes >= 0:
            raise ValueError(f"NcclModel: nbytes={nbytes!r} must be a number of bytes >= 0")
        per_node = n if per_node is None else min(per_node, n)
        if isinstance(per_node, bool) or not isinstance(per_node, int) or per_node < 1 or n % per_node:
            raise ValueError(f"NcclModel: per_node={per_node!r} must divide the {n} ranks (the same count on "
                             "every node the group spans)")
        return per_node

    def describe(self) -> str:
        nvls = f", NVLS {self.nvls_busbw / 1e9:.0f}" if self.nvls_busbw else ""
        return (f"{self.name}: NVLink busbw {self.nvlink_busbw / 1e9:.0f} GB/s{nvls}, send/recv "
                f"{self.p2p_Bps / 1e9:.0f} GB/s, network {self.network_Bps / 1e9:.3g} GB/s per GPU")


# Figures, each beside its source. Bus bandwidths are nccl-tests' (large messages, bytes/s).
PRESETS: dict[str, NcclModel] = {
    # H100 SXM, NVLink 4 through NVSwitch (450 GB/s line rate each way):
    # - ring / non-all-reduce busbw 370 GB/s: "With the protocol overhead (~20%) NCCL can get an effective
    #   NVLink bandwidth of 370GB/s, which you can observe as BusBw when running non-allreduce operations, or
    #   when running with NCCL_ALGO=RING" (S. Jeaugey, NVIDIA, github.com/NVIDIA/nccl-tests/issues/212);
    # - NVLS all-reduce busbw 480 GB/s on 8 GPUs ("you should reach a peak busBw of ~480GB/s (algbw ~275GB/s)",
    #   same thread; 476 GB/s "in the expected range for H100", github.com/NVIDIA/nccl-tests/issues/290);
    # - NDR 400 Gb/s: "you should see 46-48GB/s per NIC" (nccl-tests#290, NVIDIA); DGX H100: 8 ConnectX-7,
    #   one per GPU (DGX H100 user guide): 47 GB/s per GPU.
    "dgx-h100": NcclModel("dgx-h100", nvlink_busbw=370e9, network_Bps=47e9, p2p_Bps=370e9, nvls_busbw=480e9,
                          source="nccl-tests#212 and #290 (NVIDIA): NVLink ring 370, NVLS 480, NDR 46-48 GB/s per NIC"),
    # DGX H200: the DGX H100's NVLink 4 and NVSwitch and its 8 ConnectX-7 NDR 400 Gb/s NICs for the compute fabric,
    # one per GPU (NVIDIA DGX H200 datasheet): the same collectives, the same figures.
    "dgx-h200": NcclModel("dgx-h200", nvlink_busbw=370e9, network_Bps=47e9, p2p_Bps=370e9, nvls_busbw=480e9,
                          source="as dgx-h100 (the DGX H200 has the DGX H100's NVLink, NVSwitch and NICs): "
                                 "nccl-tests#212 and #290 (NVIDIA)"),
    # A100 SXM, NVLink 3 through NVSwitch (300 GB/s line rate each way):
    # - ring busbw 235 GB/s: NCCL's own tuning model caps sm80 bus bandwidth there
    #   (src/graph/tuning.cc, NCCL 2.8: "if (compCap80) busBw = std::min(busBw, 235.0f)");
    # - send/recv 195 GB/s between two A100s (sendrecv_perf, 1 GiB: github.com/li-plus/playground cuda/nccl.md);
    # - HDR 200 Gb/s: 96 GB/s all-reduce busbw from 4 HDR NICs per 8 A100 across 3 nodes, 24 GB/s per NIC
    #   (github.com/NVIDIA/nccl-tests/issues/119); DGX A100: 8 HDR NICs, one per GPU (DGX A100 user guide).
    "dgx-a100": NcclModel("dgx-a100", nvlink_busbw=235e9, network_Bps=24e9, p2p_Bps=195e9,
                          source="NCCL tuning.cc (sm80 235 GB/s); li-plus/playground sendrecv 195 GB/s; "
                                 "nccl-tests#119 (HDR 24 GB/s per NIC)"),
    # p4d.24xlarge: the same A100 node (40 GB), 4 x 100 Gb/s EFA for 8 GPUs (AWS): 6.25 GB/s line rate per
    # GPU, at the 96% of line rate HDR reaches above (nccl-tests#119): an assumption for EFA, not a measurement.
    "p4d-a100": NcclModel("p4d-a100", nvlink_busbw=235e9, network_Bps=0.96 * 400e9 / 8 / 8, p2p_Bps=195e9,
                          source="A100 figures as dgx-a100; 400 Gb/s EFA per node (AWS) at 96% of line rate "
                                 "(assumed as HDR's, nccl-tests#119)"),
    # a2-ultragpu-8g: the same A100 node (80 GB), 100 Gb/s per node (Google Cloud) at the same 96%.
    "a2-ultra-100g": NcclModel("a2-ultra-100g", nvlink_busbw=235e9, network_Bps=0.96 * 100e9 / 8 / 8,
                               p2p_Bps=195e9,
                               source="A100 figures as dgx-a100; 100 Gb/s per node (Google Cloud) at 96% of line "
                                      "rate (assumed)"),
}
