"""An emulated cluster: which ranks share a node, and how fast the links between them are.

"Some GPU-to-GPU links are not like others": inside a node GPUs talk over NVLink (hundreds of
GB/s), between nodes over the network (tens of GB/s per GPU). Which strategy and which collective
algorithm is fastest depends on that difference, so the workbench lets a single machine play a
cluster::

    from workbench.comm import Link, Topology

    topo = Topology(2, intra=Link(latency_s=500e-6, bandwidth_Bps=200e6),
                       inter=Link(latency_s=500e-6, bandwidth_Bps=20e6))
    workbench.launch(train, world_size=4, topology=topo)     # 2 emulated nodes x 2 ranks

    WORKBENCH_TOPOLOGY="ranks_per_node=2,intra=500us@200MB/s,inter=500us@20MB/s" torchrun ...
    WORKBENCH_TOPOLOGY="nvlink-3.2tbps,ranks_per_node=2" torchrun ...          # a preset

Layout: rank ``r`` lives on node ``r // ranks_per_node`` and has local index
``r % ranks_per_node`` there (torchrun's numbering, and Megatron's: neighbours share a node).

Links: a message of ``m`` bytes between two ranks of the same node takes
``intra.latency_s + m / intra.bandwidth_Bps``, between nodes the same with ``inter``. A link left
``None`` is not emulated: its messages go at this machine's own speed. How messages are held
back, and what that costs, is in :mod:`workbench.comm.emulation`.

Presets (:meth:`Topology.preset`): the clusters people rent, 8 GPUs per node on NVLink, with
their links slowed down by one factor (``slowdown``, default :data:`SLOWDOWN` = 1000) so that
they fit under this machine's own speed while every ratio between links, and every crossover
size between algorithms (``latency x bandwidth``), stays what it is on the real cluster. Times
measured under a preset are the real cluster's times multiplied by ``slowdown``.

===================  ======================================  =======================================
preset               inside a node (per GPU, one direction)  between nodes (per GPU)
===================  ======================================  =======================================
``nvlink-400gbps``   A100 NVLink 3: 600 GB/s both ways,       400 Gb/s per node (4 x 100 Gb/s EFA),
(AWS p4d.24xlarge)   300 GB/s each way [1]                    50 GB/s / 8 GPUs = 6.25 GB/s [2]
``nvlink-3.2tbps``   H100 NVLink 4: 900 GB/s both ways,       3.2 Tb/s per node (8 x 400 Gb/s, one
(DGX H100, AWS p5)   450 GB/s each way [3]                    NIC per GPU) = 50 GB/s per GPU [4][5]
===================  ======================================  =======================================

[1] NVIDIA A100 Tensor Core GPU datasheet (NVLink: 600 GB/s). [2] AWS, "Amazon EC2 P4d instances"
(8 x A100, 400 Gbps EFA). [3] NVIDIA H100 Tensor Core GPU datasheet (NVLink: 900 GB/s).
[4] NVIDIA DGX H100 user guide (8 x ConnectX-7, 400 Gb/s each, for the compute fabric).
[5] AWS, "Amazon EC2 P5 instances" (8 x H100, 3200 Gbps EFA).

Latencies are not datasheet figures: the presets use typical one-way small-message latencies,
2 us over NVLink and 5 us (InfiniBand, 3.2 Tb/s preset) or 15 us (EFA, 400 Gb/s preset) between
nodes; treat them as orders of magnitude. The network bandwidth is per GPU (the node's NICs shared
by its 8 GPUs, one rail each), because the emulation holds back each rank's own messages: it
does not model several ranks of one node contending for one NIC, nor a switch.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace

__all__ = ["Link", "Topology", "Hierarchy", "PRESETS", "SLOWDOWN", "ENV", "LINK_CLASSES",
           "hierarchy"]

ENV = "WORKBENCH_TOPOLOGY"
LINK_CLASSES = ("intra", "inter")
# Loopback TCP between two processes moves a few GB/s at best, with tens of microseconds per
# message: NVLink is two to three orders of magnitude faster. A slowdown of 1000 puts NVLink's
# 450 GB/s at 450 MB/s, under that floor (emulate() measures it and refuses a faster link), and
# keeps every ratio.
SLOWDOWN = 1000.0


@dataclass(frozen=True)
class Link:
    """A link class: a message of ``m`` bytes takes ``latency_s + m / bandwidth_Bps`` seconds.

    ``bandwidth_Bps`` is in bytes per second, one direction (a link carries as much each way).
    """

    latency_s: float
    bandwidth_Bps: float

    def __post_init__(self):
        for name in ("latency_s", "bandwidth_Bps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) \
                    or math.isinf(value) or value < 0:
                raise ValueError(f"Link({name}={value!r}): must be a finite number >= 0 "
                                 f"({'seconds per message' if name == 'latency_s' else 'bytes per second'})")
        for name in ("latency_s", "bandwidth_Bps"):  # 12 digits: str() and parse() give back an equal Link
            object.__setattr__(self, name, float(f"{getattr(self, name):.12g}"))
        if self.bandwidth_Bps == 0:
            raise ValueError("Link(bandwidth_Bps=0): a link must move bytes; give bytes per second, "
                             "e.g. 20e6 for 20 MB/s")

    @property
    def beta(self) -> float:
        """Seconds per byte (the alpha-beta model's beta; latency_s is its alpha)."""
        return 1.0 / self.bandwidth_Bps

    def time(self, nbytes: float) -> float:
        """Seconds one message of ``nbytes`` takes on this link."""
        return self.latency_s + nbytes / self.bandwidth_Bps

    def slowed(self, factor: float) -> "Link":
        """This link ``factor`` times slower: latency times ``factor``, bandwidth divided by it."""
        return Link(self.latency_s * factor, self.bandwidth_Bps / factor)

    def __str__(self) -> str:
        return f"{_format_seconds(self.latency_s)}@{_format_rate(self.bandwidth_Bps)}"


@dataclass(frozen=True)
class Topology:
    """Ranks grouped into nodes of ``ranks_per_node``; ``intra``/``inter``: the emulated links
    inside and between nodes (``None``: not emulated, this machine's own speed).

    ``Topology(2)`` is a layout only (hierarchical algorithms and per-link counters work, nothing
    is slowed down). See the module docstring for the spec string, the presets and the sources.
    """

    ranks_per_node: int
    intra: Link | None = None
    inter: Link | None = None

    def __post_init__(self):
        rpn = self.ranks_per_node
        if isinstance(rpn, bool) or not isinstance(rpn, int) or rpn < 1:
            raise ValueError(f"Topology(ranks_per_node={rpn!r}): must be a whole number >= 1 "
                             "(the ranks each emulated node holds)")
        for name in ("intra", "inter"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, Link):
                raise TypeError(f"Topology({name}={value!r}): pass a Link(latency_s, bandwidth_Bps) or None")

    # -- layout -----------------------------------------------------------------------------
    def node_of(self, rank: int) -> int:
        return rank // self.ranks_per_node

    def local_index(self, rank: int) -> int:
        return rank % self.ranks_per_node

    def link_class(self, a: int, b: int) -> str:
        """``"intra"`` if global ranks ``a`` and ``b`` share a node, else ``"inter"``."""
        return "intra" if self.node_of(a) == self.node_of(b) else "inter"

    def link(self, link_class: str) -> Link | None:
        return self.intra if link_class == "intra" else self.inter

    @property
    def emulated(self) -> bool:
        """True if any link is slowed down."""
        return self.intra is not None or self.inter is not None

    def nodes(self, world_size: int) -> int:
        return -(-world_size // self.ranks_per_node)

    def of_group(self, ranks: list[int], *, uneven: str = "raise") -> "Topology":
        """The topology as a group of global ``ranks`` sees it, renumbered ``0..len-1`` (what
        :func:`workbench.comm.cost.predict` takes): nodes of ``k`` group ranks, ``k`` the group's
        ranks on each node it touches -- all of them on one node, 1 when each sits on its own.
        A group with different counts on different nodes has no such ``k``: ``uneven="raise"``
        refuses it, ``uneven="slowest"`` prices it as one rank per node (the slow link throughout)."""
        if uneven not in ("raise", "slowest"):
            raise ValueError(f"Topology.of_group(uneven={uneven!r}): use 'raise' or 'slowest'")
        per_node: dict[int, int] = {}
        for r in ranks:
            per_node[self.node_of(r)] = per_node.get(self.node_of(r), 0) + 1
        counts = set(per_node.values())
        if len(counts) != 1 and uneven == "raise":
            raise ValueError(f"Topology.of_group: ranks {list(ranks)} span their nodes unevenly "
                             f"({sorted(per_node.values())} ranks per node); pass ranks with as many on every node "
                             "they touch, or uneven='slowest'")
        return Topology(counts.pop() if len(counts) == 1 else 1, intra=self.intra, inter=self.inter)

    def check_world(self, world_size: int) -> None:
        """Refuse a world that does not fill whole nodes (every node must hold ranks_per_node)."""
        if world_size % self.ranks_per_node:
            raise ValueError(f"topology with ranks_per_node={self.ranks_per_node} does not fit world_size="
                             f"{world_size}: every emulated node must be full. Use a world size that is a "
                             f"multiple of {self.ranks_per_node}, or Topology(..., ranks_per_node=k) / "
                             f"Topology.preset(name, ranks_per_node=k) with k dividing {world_size}")

    # -- presets and spec strings ---------------------------------------------------------------
    @classmethod
    def preset(cls, name: str, *, slowdown: float = SLOWDOWN, ranks_per_node: int | None = None) -> "Topology":
        """A rented cluster's links (see the module docstring), ``slowdown`` times slower.

        ``ranks_per_node``: fewer ranks per node than the real 8, to fit this machine (the links
        stay the real ones, slowed down).
        """
        if name not in PRESETS:
            raise ValueError(f"Topology.preset({name!r}): not a preset; use one of {', '.join(PRESETS)}")
        if isinstance(slowdown, bool) or not isinstance(slowdown, (int, float)) or not slowdown >= 1:
            raise ValueError(f"Topology.preset(slowdown={slowdown!r}): must be a number >= 1 (emulation can only "
                             "slow links down)")
        real = PRESETS[name]
        return cls(ranks_per_node or real.ranks_per_node, intra=real.intra.slowed(slowdown),
                   inter=real.inter.slowed(slowdown))

    @classmethod
    def parse(cls, text: str) -> "Topology":
        """A topology from its spec string (``str(topology)`` gives one back)::

            ranks_per_node=2,intra=500us@200MB/s,inter=1ms@20MB/s    (intra=none: not emulated)
            nvlink-3.2tbps                                           a preset
            nvlink-3.2tbps,ranks_per_node=2,slowdown=1000            a preset, changed

        Latencies take s, ms, us or ns; bandwidths B/s or b/s (bits) with k, M, G or T (powers
        of 1000), or a plain number of bytes per second.
        """
        if isinstance(text, Topology):
            return text
        if not isinstance(text, str) or not text.strip():
            raise ValueError(f"topology spec {text!r} is empty: write e.g. "
                             "'ranks_per_node=2,inter=1ms@20MB/s' or a preset name "
                             f"({', '.join(PRESETS)})")
        items = [item.strip() for item in text.split(",") if item.strip()]
        preset = None
        if "=" not in items[0]:
            preset = items.pop(0)
        fields: dict[str, str] = {}
        for item in items:
            key, sep, value = item.partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ranks_per_node", "intra", "inter", "slowdown"):
                raise ValueError(f"topology spec {text!r}: cannot read {item!r}; use ranks_per_node=N, "
                                 "intra=LATENCY@BANDWIDTH, inter=LATENCY@BANDWIDTH (or none), slowdown=F "
                                 "(with a preset), e.g. 'ranks_per_node=2,inter=1ms@20MB/s'")
            fields[key] = value.strip()
        try:
            rpn = int(fields["ranks_per_node"]) if "ranks_per_node" in fields else None
        except ValueError:
            raise ValueError(f"topology spec {text!r}: ranks_per_node={fields['ranks_per_node']!r} is not a "
                             "whole number") from None
        if preset is not None:
            slowdown = _number(fields.pop("slowdown", str(SLOWDOWN)), text, "slowdown")
            topo = cls.preset(preset, slowdown=slowdown, ranks_per_node=rpn)
            links = {k: _parse_link(v, text) for k, v in fields.items() if k in ("intra", "inter")}
            return replace(topo, **links)
        if "slowdown" in fields:
            raise ValueError(f"topology spec {text!r}: slowdown= applies to a preset only "
                             f"({', '.join(PRESETS)}); give the links' own speeds instead")
        if rpn is None:
            raise ValueError(f"topology spec {text!r} has no ranks_per_node=N (or preset name)")
        return cls(rpn, intra=_parse_link(fields.get("intra", "none"), text),
                   inter=_parse_link(fields.get("inter", "none"), text))

    @classmethod
    def from_env(cls) -> "Topology | None":
        """The topology named by ``WORKBENCH_TOPOLOGY``, or None if it is unset or empty."""
        value = os.environ.get(ENV, "").strip()
        if not value:
            return None
        try:
            return cls.parse(value)
        except (ValueError, TypeError) as e:
            raise ValueError(f"{ENV}={value!r} is not understood: {e}") from None

    def __str__(self) -> str:
        return (f"ranks_per_node={self.ranks_per_node},intra={self.intra or 'none'},"
                f"inter={self.inter or 'none'}")


# The real clusters (see the module docstring for the sources); Topology.preset slows them down.
PRESETS: dict[str, Topology] = {
    "nvlink-400gbps": Topology(8, intra=Link(2e-6, 300e9), inter=Link(15e-6, 400e9 / 8 / 8)),
    "nvlink-3.2tbps": Topology(8, intra=Link(2e-6, 450e9), inter=Link(5e-6, 3200e9 / 8 / 8)),
}


# ----------------------------------------------------------------------------- hierarchy of a group

@dataclass(frozen=True)
class Hierarchy:
    """A process group seen as nodes: ``nodes[k]`` lists the group ranks on the k-th node the
    group touches (ascending); this rank is ``nodes[node][local]``. Every node holds the same
    number of the group's ranks.

    ``row``: the ranks of this rank's node (a node-local ring); ``column``: the ranks with this
    rank's local index on every node (the ring that crosses nodes).
    """

    nodes: tuple[tuple[int, ...], ...]
    node: int
    local: int

    @property
    def per_node(self) -> int:
        return len(self.nodes[0])

    @property
    def row(self) -> tuple[int, ...]:
        return self.nodes[self.node]

    @property
    def column(self) -> tuple[int, ...]:
        return tuple(n[self.local] for n in self.nodes)


def hierarchy(collective: str, topology: "Topology | None", global_ranks: list[int], rank: int) -> Hierarchy:
    """The :class:`Hierarchy` of a group (``global_ranks[i]`` = global rank of group rank i) for
    this rank (its group rank). Raises a ValueError naming the fix if there is no topology or the
    group does not hold the same number of ranks on every node."""
    if topology is None:
        raise ValueError(f"{collective}: algorithm='hierarchical' needs a topology (which ranks share a node): "
                         "launch with workbench.launch(fn, world_size, topology=Topology(ranks_per_node, ...)), "
                         f"set {ENV} under torchrun, or call workbench.comm.emulate(topology) on every rank")
    by_node: dict[int, list[int]] = {}
    for group_rank, g in enumerate(global_ranks):
        by_node.setdefault(topology.node_of(g), []).append(group_rank)
    nodes = tuple(tuple(by_node[k]) for k in sorted(by_node))
    sizes = {len(n) for n in nodes}
    if len(sizes) != 1:
        layout = {k: [global_ranks[i] for i in by_node[k]] for k in sorted(by_node)}
        raise ValueError(f"{collective}: algorithm='hierarchical' needs the same number of the group's ranks on "
                         f"every node; the group's global ranks by node are {layout} (ranks_per_node="
                         f"{topology.ranks_per_node}). Use a group with as many ranks on each node, or "
                         "another algorithm")
    for k, members in enumerate(nodes):
        if rank in members:
            return Hierarchy(nodes, k, members.index(rank))
    raise AssertionError("rank not in its own group")  # resolve_group guarantees membership


# ------------------------------------------------------------------------------- units, for specs

_TIME = {"s": 1.0, "ms": 1e-3, "us": 1e-6, "µs": 1e-6, "ns": 1e-9}
_PREFIX = {"": 1.0, "k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}


def _number(value: str, text: str, name: str) -> float:
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"topology spec {text!r}: {name}={value!r} is not a number") from None


def _parse_link(value: str, text: str) -> Link | None:
    if value.strip().lower() in ("none", ""):
        return None
    lat, sep, bw = value.partition("@")
    if not sep:
        raise ValueError(f"topology spec {text!r}: link {value!r} needs LATENCY@BANDWIDTH, e.g. 1ms@20MB/s")
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(s|ms|us|µs|ns)?\s*", lat)
    if not m:
        raise ValueError(f"topology spec {text!r}: latency {lat!r} is not a time; write e.g. 500us, 1ms, 0.002s")
    latency = _number(m.group(1), text, "latency") * _TIME[m.group(2) or "s"]
    m = re.fullmatch(r"\s*([0-9.eE+-]+)\s*(?:([kKMGT]?)([Bb])/s)?\s*", bw)
    if not m:
        raise ValueError(f"topology spec {text!r}: bandwidth {bw!r} is not a rate; write e.g. 20MB/s, 400Gb/s "
                         "(bits) or 2e7 (bytes per second)")
    rate = _number(m.group(1), text, "bandwidth") * _PREFIX[m.group(2) or ""]
    if m.group(3) == "b":
        rate /= 8
    return Link(latency, rate)


def _format_seconds(s: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("us", 1e-6)):
        if s >= scale:
            return f"{s / scale:.12g}{unit}"
    return f"{s / 1e-9:.12g}ns"


def _format_rate(bps: float) -> str:
    for unit, scale in (("TB/s", 1e12), ("GB/s", 1e9), ("MB/s", 1e6), ("kB/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.12g}{unit}"
    return f"{bps:.12g}B/s"
