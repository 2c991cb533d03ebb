"""A cluster as the advisor sees it: how many devices, how much memory, how fast, linked how.

Five figures decide every prediction: the devices (``nodes x devices_per_node``), the memory each
has, the FLOP/s each *achieves* on a large matrix multiply (not the datasheet's peak), and two
link classes in the alpha-beta model (:class:`workbench.comm.topology.Link`: a message of ``m``
bytes takes ``latency_s + m / bandwidth_Bps``), one inside a node and one between nodes, per
device and per direction -- the same :class:`Link` the emulated topology slows this machine's
messages down with, so a preset and an emulation describe a cluster the same way.

Presets (:meth:`Cluster.preset`; ``nodes=`` sets how many). Links are those of
:data:`workbench.comm.topology.PRESETS` where the cluster is there; the network bandwidth is the
node's NICs divided by its devices (one rail each). *Achieved* FLOP/s are an assumption, not a
datasheet figure: 70% of the dense peak, which large cuBLAS matrix multiplies reach; calibrate on
the real cluster (``workbench advise --calibrate`` there) to replace it. ``fp32_flops`` is the rate
without tensor cores (PyTorch's default for float32 matmuls: TF32 off).

================  =====================  ========================  ===========================  =================
preset            devices, memory        inside a node             between nodes (per device)   achieved bf16/fp32
================  =====================  ========================  ===========================  =================
``dgx-h100``      8 x H100 SXM 80 GB     NVLink 4, 450 GB/s, 2 us  8 x 400 Gb/s IB: 50 GB/s,    692 / 47 TFLOP/s
                  [1]                    [1]                       5 us [2]                     (of 989 / 67) [1]
``p4d-a100``      8 x A100 40 GB [3]     NVLink 3, 300 GB/s, 2 us  400 Gb/s EFA per node:       218 / 14 TFLOP/s
                                         [3]                       6.25 GB/s, 15 us [4]         (of 312 / 19.5) [3]
``a2-ultra-100g`` 8 x A100 80 GB [3][5]  NVLink 3, 300 GB/s, 2 us  100 Gb/s per node (cloud     218 / 14 TFLOP/s
                                                                   Ethernet): 1.56 GB/s, 30 us
                                                                   [5]
``dgx-a100``      8 x A100 SXM 80 GB     NVLink 3 + NVSwitch,      8 x 200 Gb/s HDR IB:         218 / 14 TFLOP/s
                  [3][6]                 300 GB/s, 2 us [3][6]     25 GB/s, 5 us [6]            (of 312 / 19.5) [3]
================  =====================  ========================  ===========================  =================

[1] NVIDIA H100 Tensor Core GPU datasheet (SXM: 80 GB, NVLink 900 GB/s both ways, BF16 989 TFLOP/s
dense, FP32 67 TFLOP/s). [2] NVIDIA DGX H100 user guide (8 x ConnectX-7, 400 Gb/s each).
[3] NVIDIA A100 Tensor Core GPU datasheet (NVLink 600 GB/s both ways, BF16 312 TFLOP/s dense, FP32
19.5). [4] AWS, "Amazon EC2 P4d instances" (8 x A100 40 GB, 400 Gbps EFA). [5] Google Cloud,
"GPU machine types": a2-ultragpu-8g, 8 x A100 80 GB, 100 Gbps network bandwidth. [6] NVIDIA DGX A100
user guide and system architecture white paper (8 x A100 SXM4 80 GB on 6 NVSwitches, 600 GB/s of
NVLink per GPU both ways; 8 x ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric, one per GPU).
Latencies are typical one-way small-message figures (orders of magnitude, as in
:mod:`workbench.comm.topology`).

``communicator_bytes``: device memory each NCCL communicator takes (its buffers live outside
PyTorch's allocator). NVIDIA/nccl#964 measured 544 MB for a 2-rank and 688 MB for a larger group
on A100s with NVLink (nccl#864 reports about 1.6 GB with more channels); the GPU presets take
688 MiB. On gloo (this machine) communicators hold no device memory: 0.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from workbench.comm.topology import PRESETS as TOPOLOGY_PRESETS
from workbench.comm.topology import Link

__all__ = ["Cluster", "PRESETS", "GiB", "link_text"]

GiB = float(2 ** 30)


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of ``memory_bytes`` each, computing at ``flops``
    (FLOP/s achieved on a large matmul in the compute precision), linked by ``intra`` inside a node and
    ``inter`` between nodes (per device, one direction).

    ``fp32_flops``: the rate of float32 matmuls when it differs from the 16-bit one (0: the same,
    as on a CPU); ``communicator_bytes``: device memory per NCCL communicator (0 on gloo).
    """

    nodes: int
    devices_per_node: int
    memory_bytes: float
    flops: float
    intra: Link
    inter: Link
    name: str = "custom"
    source: str = ""             # where the figures come from (datasheets, a calibration run)
    fp32_flops: float = 0.0
    communicator_bytes: float = 0.0

    def __post_init__(self) -> None:
        for name in ("nodes", "devices_per_node"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"Cluster({name}={value!r}): must be a whole number >= 1")
        for name, positive in (("memory_bytes", True), ("flops", True), ("fp32_flops", False),
                               ("communicator_bytes", False)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) \
                    or value < 0 or (positive and value == 0):
                unit = "bytes" if "bytes" in name else "FLOP/s"
                raise ValueError(f"Cluster({name}={value!r}): must be a finite number of {unit} "
                                 f"{'> 0' if positive else '>= 0 (0: not given)'}, e.g. 80e9 bytes or 600e12 FLOP/s")
        for name in ("intra", "inter"):
            if not isinstance(getattr(self, name), Link):
                raise ValueError(f"Cluster({name}={getattr(self, name)!r}): pass a "
                                 "workbench.comm.Link(latency_s, bandwidth_Bps)")

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node

    def flops_for(self, precision: str) -> float:
        """Achieved FLOP/s in ``precision``: ``fp32_flops`` (when given) for ``"fp32"``, else ``flops``."""
        return self.fp32_flops if (precision == "fp32" and self.fp32_flops) else self.flops

    @property
    def link_ratio(self) -> float:
        """How many times slower the network is than the links inside a node (bandwidth)."""
        return self.intra.bandwidth_Bps / self.inter.bandwidth_Bps

    def with_(self, **changes) -> "Cluster":
        """A copy with some fields changed (validated again), e.g. ``cluster.with_(nodes=4)``."""
        known = {f.name for f in fields(self)}
        bad = sorted(set(changes) - known)
        if bad:
            raise ValueError(f"Cluster.with_: unknown field(s) {bad}; fields are {sorted(known)}")
        return replace(self, **changes)

    @classmethod
    def preset(cls, name: str, nodes: int | None = None, **changes) -> "Cluster":
        """A named cluster (see the module docstring for the figures and sources), ``nodes`` of them
        (default 1); keyword arguments change other fields (``devices_per_node=4``, ...)."""
        if isinstance(name, Cluster):
            return name.with_(**({"nodes": nodes} if nodes is not None else {}), **changes)
        if name not in PRESETS:
            raise ValueError(f"Cluster.preset({name!r}): unknown; use one of {sorted(PRESETS)}, or build "
                             "Cluster(nodes=, devices_per_node=, memory_bytes=, flops=, intra=Link(...), inter=Link(...))")
        return PRESETS[name].with_(**({"nodes": nodes} if nodes is not None else {}), **changes)

    def describe(self) -> str:
        """One line: the devices, their memory and speed, the two links."""
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} devices, "
                f"{self.memory_bytes / GiB:.1f} GiB and {self.flops / 1e12:.3g} TFLOP/s each; "
                f"inside a node {link_text(self.intra)}, between nodes {link_text(self.inter)} "
                f"({self.link_ratio:.3g}x slower)")


def link_text(link: Link) -> str:
    """A link in three significant digits: ``2 us, 450 GB/s``."""
    lat = link.latency_s
    lat_text = f"{lat * 1e6:.3g} us" if lat < 1e-3 else f"{lat * 1e3:.3g} ms"
    bw = link.bandwidth_Bps
    bw_text = f"{bw / 1e9:.3g} GB/s" if bw >= 1e9 else f"{bw / 1e6:.3g} MB/s"
    return f"{lat_text}, {bw_text}"


_ACHIEVED = 0.7      # fraction of the dense peak a large matmul reaches (assumption; calibrate to replace)
_NCCL_COMM = 688 * 2 ** 20
_H100 = "NVIDIA H100 datasheet; DGX H100 user guide; achieved = 70% of dense peak (assumption)"
_A100 = "NVIDIA A100 datasheet; {}; achieved = 70% of dense peak (assumption)"

PRESETS: dict[str, Cluster] = {
    "dgx-h100": Cluster(1, 8, 80e9, _ACHIEVED * 989e12, TOPOLOGY_PRESETS["nvlink-3.2tbps"].intra,
                        TOPOLOGY_PRESETS["nvlink-3.2tbps"].inter, name="dgx-h100", source=_H100,
                        fp32_flops=_ACHIEVED * 67e12, communicator_bytes=_NCCL_COMM),
    "p4d-a100": Cluster(1, 8, 40e9, _ACHIEVED * 312e12, TOPOLOGY_PRESETS["nvlink-400gbps"].intra,
                        TOPOLOGY_PRESETS["nvlink-400gbps"].inter, name="p4d-a100",
                        source=_A100.format("AWS EC2 P4d (400 Gbps EFA)"), fp32_flops=_ACHIEVED * 19.5e12,
                        communicator_bytes=_NCCL_COMM),
    "a2-ultra-100g": Cluster(1, 8, 80e9, _ACHIEVED * 312e12, TOPOLOGY_PRESETS["nvlink-400gbps"].intra,
                             Link(30e-6, 100e9 / 8 / 8), name="a2-ultra-100g",
                             source=_A100.format("Google Cloud a2-ultragpu-8g (100 Gbps network)"),
                             fp32_flops=_ACHIEVED * 19.5e12, communicator_bytes=_NCCL_COMM),
    "dgx-a100": Cluster(1, 8, 80e9, _ACHIEVED * 312e12, TOPOLOGY_PRESETS["nvlink-400gbps"].intra,
                        Link(5e-6, 200e9 / 8), name="dgx-a100",
                        source=_A100.format("DGX A100 user guide (8 x 200 Gb/s HDR InfiniBand)"),
                        fp32_flops=_ACHIEVED * 19.5e12, communicator_bytes=_NCCL_COMM),
}
