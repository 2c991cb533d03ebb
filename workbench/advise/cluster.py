"""A cluster as the advisor sees it: how many devices, how much memory, how fast, linked how.

Five figures decide every prediction: the devices (``nodes x devices_per_node``), the memory each
has, the FLOP/s each *achieves* on a large matrix multiply (not the datasheet's peak), and two
link classes in the alpha-beta model (:class:`workbench.comm.topology.Link`: a message of ``m``
bytes takes ``latency_s + m / bandwidth_Bps``), one inside a node and one between nodes, per
device and per direction -- the same :class:`Link` the emulated topology slows this machine's
messages down with, so a preset and an emulation describe a cluster the same way.

A GPU cluster also carries its ``device`` (:class:`workbench.advise.device.Device`): with it the
step's compute is priced operator by operator (matrix multiplies at an efficiency that depends on
their shape, memory-bound operators at the achieved bandwidth, flash attention, eager PyTorch's
launch cost per kernel and per micro-batch), not as FLOPs at one rate; ``flops`` is then only what
:meth:`describe` prints (the device's large-multiply rate). Without a device (a CPU cluster, one
built by hand) compute is the FLOPs at ``flops``.

Presets (:meth:`Cluster.preset`; ``nodes=`` sets how many). Links are those of
:data:`workbench.comm.topology.PRESETS` where the cluster is there; the network bandwidth is the
node's NICs divided by its devices (one rail each). Each GPU preset carries its device profile
(:data:`workbench.advise.device.PROFILES`, sources beside every figure: datasheet peaks, public
GEMM, bandwidth and FlashAttention measurements, eager PyTorch's overheads); the *achieved* column
below is the profile's large-multiply rate (H100: 75% of the dense peak, A100: 88%).
``fp32_flops`` is the rate without tensor cores (PyTorch's default for float32 matmuls: TF32 off).
To replace the published figures by your own GPU's, run ``workbench advise --calibrate --device
cuda --profile FILE`` on one of its nodes and load the profile with ``--profile FILE`` (or
:meth:`Cluster.from_profile`); ``workbench advise --calibrate`` without ``--device`` measures this
CPU machine, ranks sharing its cores (:mod:`workbench.advise.shared_cores`).

================  =====================  ========================  ===========================  =================
preset            devices, memory        inside a node             between nodes (per device)   achieved bf16/fp32
================  =====================  ========================  ===========================  =================
``dgx-h100``      8 x H100 SXM 80 GB     NVLink 4, 450 GB/s, 2 us  8 x 400 Gb/s IB: 50 GB/s,    742 / 50 TFLOP/s
                  [1]                    [1]                       5 us [2]                     (of 989 / 67) [1]
``dgx-h200``      8 x H200 SXM 141 GB    as ``dgx-h100`` [7]       as ``dgx-h100`` [7]          742 / 50 TFLOP/s
                  [7]                                                                           (of 989 / 67) [7]
``p4d-a100``      8 x A100 40 GB [3]     NVLink 3, 300 GB/s, 2 us  400 Gb/s EFA per node:       275 / 17 TFLOP/s
                                         [3]                       6.25 GB/s, 15 us [4]         (of 312 / 19.5) [3]
``a2-ultra-100g`` 8 x A100 80 GB [3][5]  NVLink 3, 300 GB/s, 2 us  100 Gb/s per node (cloud     275 / 17 TFLOP/s
                                                                   Ethernet): 1.56 GB/s, 30 us
                                                                   [5]
``dgx-a100``      8 x A100 SXM 80 GB     NVLink 3 + NVSwitch,      8 x 200 Gb/s HDR IB:         275 / 17 TFLOP/s
                  [3][6]                 300 GB/s, 2 us [3][6]     25 GB/s, 5 us [6]            (of 312 / 19.5) [3]
================  =====================  ========================  ===========================  =================

Memory is what a process can use (``workbench.advise.device``: 81,559 MiB of an H100 "80 GB" as
nvidia-smi lists it, 85.06e9 bytes of an A100 80 GB and 150.1e9 of an H200 "141 GB" as CUDA
reports them, 0.99 of the A100 40 GB's 40 GiB), not the name's 80e9 bytes.

[1] NVIDIA H100 Tensor Core GPU datasheet (SXM: 80 GB, NVLink 900 GB/s both ways, BF16 989 TFLOP/s
dense, FP32 67 TFLOP/s). [2] NVIDIA DGX H100 user guide (8 x ConnectX-7, 400 Gb/s each).
[3] NVIDIA A100 Tensor Core GPU datasheet (NVLink 600 GB/s both ways, BF16 312 TFLOP/s dense, FP32
19.5). [4] AWS, "Amazon EC2 P4d instances" (8 x A100 40 GB, 400 Gbps EFA). [5] Google Cloud,
"GPU machine types": a2-ultragpu-8g, 8 x A100 80 GB, 100 Gbps network bandwidth. [6] NVIDIA DGX A100
user guide and system architecture white paper (8 x A100 SXM4 80 GB on 6 NVSwitches, 600 GB/s of
NVLink per GPU both ways; 8 x ConnectX-6 200 Gb/s HDR InfiniBand for the compute fabric, one per GPU).
[7] NVIDIA H200 Tensor Core GPU datasheet (SXM: 141 GB HBM3e, 4.8 TB/s, the H100's peaks) and DGX H200
datasheet (8 x H200 on 4 NVSwitches, 900 GB/s of NVLink per GPU both ways; 8 x ConnectX-7 400 Gb/s for
the compute fabric): the DGX H100's links, a GPU with more and faster memory.
Latencies are typical one-way small-message figures (orders of magnitude, as in
:mod:`workbench.comm.topology`).

``communicator_bytes``: device memory each NCCL communicator takes (its buffers live outside
PyTorch's allocator). NVIDIA/nccl#964 measured 544 MB for a 2-rank and 688 MB for a larger group
on A100s with NVLink (nccl#864 reports about 1.6 GB with more channels); the GPU presets take
688 MiB. On gloo (this machine) communicators hold no device memory: 0.

``runtime_memory``: what a GPU training process holds beyond the formulas and the framework's
conventions (:class:`workbench.advise.runtime_memory.RuntimeMemory`: the CUDA context, the caching
allocator's reserve, float32 gradients and loss, the attention kernel); the GPU presets take
Megatron-LM's (``MEGATRON``); ``None`` (a CPU cluster) keeps the formulas exactly.

``framework``: the training framework (:class:`workbench.advise.framework.Framework`: attention
kernel, fused or eager elementwise kernels, tensor-parallel overlap, what selective recomputation
keeps, the optimizer's passes, gradient buckets); it sets the attention kernel of the device and of
the runtime memory, so both read the same. ``dgx-h100`` and ``dgx-h200`` run ``eager-fused`` (eager PyTorch
launching Megatron-style fused kernels, every operator dispatched from Python: see
:mod:`workbench.advise.framework`), the A100 presets ``megatron-2022`` (Megatron-LM as in the
published A100 runs at scale); ``None`` (a CPU cluster): none of its terms.

``nccl``: the GPU presets' collectives as NCCL runs them (:class:`workbench.advise.nccl.NcclModel`:
ring, tree and NVLink SHARP, bus bandwidths from published nccl-tests results, the nodes a group
spans); without it (a CPU cluster, or one built by hand) a collective is priced on ``intra`` and
``inter`` by :func:`workbench.comm.cost.predict`. A cluster's links and its NCCL model change
together: ``with_(inter=...)`` (``workbench advise --inter``) scales the model's network bandwidth
by the new link's bandwidth over the old (what NCCL achieves stays the same share of a link's line
rate), ``with_(intra=...)`` its NVLink figures alike, unless ``nccl=`` is given too. NCCL's
latencies are its own (per algorithm and protocol) and do not follow the links' latencies.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, fields, replace

from workbench.advise.nccl import PRESETS as NCCL_PRESETS
from workbench.advise.nccl import NcclModel
from workbench.comm.topology import PRESETS as TOPOLOGY_PRESETS
from workbench.comm.topology import Link

from .device import PROFILES as DEVICES
from .device import Device
from .framework import EAGER_FUSED, FRAMEWORKS, MEGATRON_2022, Framework
from .runtime_memory import MEGATRON, RuntimeMemory

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
    device: Device | None = None  # a GPU's compute model (workbench.advise.device); None: FLOPs at ``flops``
    runtime_memory: RuntimeMemory | None = None   # GPU runtime's memory terms (None: the formulas only)
    nccl: NcclModel | None = None   # a GPU cluster's collectives as NCCL runs them (workbench.advise.nccl)
    framework: Framework | None = None   # the training framework's kernels and policies (workbench.advise.framework)

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
        if self.runtime_memory is not None and not isinstance(self.runtime_memory, RuntimeMemory):
            raise ValueError(f"Cluster(runtime_memory={self.runtime_memory!r}): pass a "
                             "workbench.advise.runtime_memory.RuntimeMemory(), or None (the formulas only)")
        if self.nccl is not None and not isinstance(self.nccl, NcclModel):
            raise ValueError(f"Cluster(nccl={self.nccl!r}): pass a workbench.advise.nccl.NcclModel, e.g. "
                             "workbench.advise.nccl.PRESETS['dgx-h100'], or None (collectives priced by link latency "
                             "and bandwidth)")
        if self.device is not None and not isinstance(self.device, Device):
            raise ValueError(f"Cluster(device={self.device!r}): pass a workbench.advise.device.Device, e.g. "
                             "workbench.advise.device.PROFILES['h100-sxm-80gb'], or None (compute as FLOPs at flops)")
        if self.framework is not None:
            if not isinstance(self.framework, Framework):
                raise ValueError(f"Cluster(framework={self.framework!r}): pass a workbench.advise.framework.Framework, "
                                 f"e.g. FRAMEWORKS['eager-fused'] (one of {sorted(FRAMEWORKS)}), or None")
            # one attention kernel and one selective policy for the compute and the memory model
            fw = self.framework
            if self.device is not None and self.device.attention != fw.attention:
                object.__setattr__(self, "device", self.device.with_(attention=fw.attention))
            rt = self.runtime_memory
            # eager PyTorch's unfused layer keeps more (runtime_memory.eager_layer_extra_bytes); compiled, the
            # partitioner decides; an unfused framework's tensor parallelism is DTensor's (torchtitan's)
            eager = not fw.fused and not fw.compiled
            conventions = dict(attention=fw.attention, loss_float32_copies=fw.loss_float32_copies,
                               selective=fw.selective, compiled=fw.compiled,
                               float32_norms=eager and not fw.fused_norm, repeat_kv=eager,
                               dtensor_tp=not fw.fused)
            if rt is not None and any(getattr(rt, k) != v for k, v in conventions.items()):
                object.__setattr__(self, "runtime_memory", replace(rt, **conventions))
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
        if self.nccl is not None and "nccl" not in changes:
            changes["nccl"] = self._nccl_following(changes.get("intra"), changes.get("inter"))
        return replace(self, **changes)

    def _nccl_following(self, intra, inter) -> NcclModel:
        """The NCCL model with its bandwidths scaled as the links change (module docstring); a link
        that is not a :class:`Link` is left for validation to refuse."""
        scaled = {}
        if isinstance(inter, Link) and inter.bandwidth_Bps != self.inter.bandwidth_Bps:
            scaled["network_Bps"] = self.nccl.network_Bps * inter.bandwidth_Bps / self.inter.bandwidth_Bps
        if isinstance(intra, Link) and intra.bandwidth_Bps != self.intra.bandwidth_Bps:
            f = intra.bandwidth_Bps / self.intra.bandwidth_Bps
            scaled.update(nvlink_busbw=self.nccl.nvlink_busbw * f, p2p_Bps=self.nccl.p2p_Bps * f,
                          nvls_busbw=self.nccl.nvls_busbw * f)
        return replace(self.nccl, **scaled) if scaled else self.nccl

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
        what = f"{self.device.name} " if self.device is not None else ""
        return (f"{self.name}: {self.nodes} node(s) x {self.devices_per_node} {what}devices, "
                f"{self.memory_bytes / GiB:.1f} GiB and {self.flops / 1e12:.3g} TFLOP/s each; "
                f"inside a node {link_text(self.intra)}, between nodes {link_text(self.inter)} "
                f"({self.link_ratio:.3g}x slower)")

    def to_profile(self, measured: dict | None = None, base: str | None = None) -> dict:
        """The cluster as a profile (a JSON-able dict :meth:`from_profile` loads): its figures, its
        device's, the preset it builds on (``base``: the network and runtime figures a one-node
        calibration cannot measure come from it) and the ``measured`` raw timings."""
        doc = {"format": PROFILE_FORMAT, "base": base, "name": self.name, "source": self.source,
               "nodes": self.nodes, "devices_per_node": self.devices_per_node, "memory_bytes": self.memory_bytes,
               "flops": self.flops, "fp32_flops": self.fp32_flops, "communicator_bytes": self.communicator_bytes,
               "intra": [self.intra.latency_s, self.intra.bandwidth_Bps],
               "inter": [self.inter.latency_s, self.inter.bandwidth_Bps],
               "device": json.loads(self.device.to_json()) if self.device is not None else None,
               "measured": measured or {}}
        return doc

    @classmethod
    def from_profile(cls, path, nodes: int | None = None) -> "Cluster":
        """The cluster a profile describes (a file written by ``workbench advise --calibrate --device
        cuda --profile FILE``, or :meth:`to_profile`'s dict): the ``base`` preset (its links and runtime
        figures) with the profile's device, memory, FLOP/s and links; ``nodes`` of them (default the
        profile's)."""
        if isinstance(path, dict):
            doc = path
        else:
            try:
                with open(path) as f:
                    doc = json.load(f)
            except (OSError, json.JSONDecodeError) as e:
                raise ValueError(f"Cluster.from_profile({path!r}): cannot read a profile ({e}); write one with "
                                 "workbench advise --calibrate --device cuda --profile FILE") from None
        if not isinstance(doc, dict) or doc.get("format") != PROFILE_FORMAT:
            raise ValueError(f"Cluster.from_profile({path!r}): not a {PROFILE_FORMAT} profile (format "
                             f"{doc.get('format') if isinstance(doc, dict) else type(doc).__name__!r})")
        base = doc.get("base")
        if base is not None and base not in PRESETS:
            raise ValueError(f"Cluster.from_profile: base={base!r} is not a preset; use one of {sorted(PRESETS)} "
                             "or null")
        start = PRESETS[base] if base is not None else None
        changes = {"name": doc["name"], "source": doc.get("source", ""), "nodes": int(nodes or doc["nodes"]),
                   "devices_per_node": int(doc["devices_per_node"]), "memory_bytes": float(doc["memory_bytes"]),
                   "flops": float(doc["flops"]), "fp32_flops": float(doc.get("fp32_flops", 0.0)),
                   "communicator_bytes": float(doc.get("communicator_bytes", 0.0)),
                   "intra": Link(*doc["intra"]), "inter": Link(*doc["inter"]),
                   "device": Device.from_json(doc["device"]) if doc.get("device") else None}
        if start is not None:   # a measured intra is a bus bandwidth already: the preset's NCCL model as it is
            return start.with_(nccl=start.nccl, **changes)
        return cls(**changes)


def link_text(link: Link) -> str:
    """A link in three significant digits: ``2 us, 450 GB/s``."""
    lat = link.latency_s
    lat_text = f"{lat * 1e6:.3g} us" if lat < 1e-3 else f"{lat * 1e3:.3g} ms"
    bw = link.bandwidth_Bps
    bw_text = f"{bw / 1e9:.3g} GB/s" if bw >= 1e9 else f"{bw / 1e6:.3g} MB/s"
    return f"{lat_text}, {bw_text}"


PROFILE_FORMAT = "workbench-advise-profile/1"
_NCCL_COMM = 688 * 2 ** 20
_H100_SXM, _A100_80, _A100_40 = DEVICES["h100-sxm-80gb"], DEVICES["a100-sxm-80gb"], DEVICES["a100-sxm-40gb"]
_H200_SXM = DEVICES["h200-sxm-141gb"]
_H100 = "NVIDIA H100 datasheet; DGX H100 user guide; compute: workbench.advise.device.PROFILES['h100-sxm-80gb']"
_H200 = ("NVIDIA H200 datasheet; DGX H200 datasheet (the DGX H100's NVLink, NVSwitch and 8 x 400 Gb/s NICs); "
         "compute: workbench.advise.device.PROFILES['h200-sxm-141gb']")
_A100 = "NVIDIA A100 datasheet; {}; compute: workbench.advise.device.PROFILES['{}']"

PRESETS: dict[str, Cluster] = {
    "dgx-h100": Cluster(1, 8, _H100_SXM.memory_bytes, _H100_SXM.achieved("bf16"),
                        TOPOLOGY_PRESETS["nvlink-3.2tbps"].intra, TOPOLOGY_PRESETS["nvlink-3.2tbps"].inter,
                        name="dgx-h100", source=_H100, fp32_flops=_H100_SXM.achieved("fp32"), device=_H100_SXM,
                        communicator_bytes=_NCCL_COMM, nccl=NCCL_PRESETS["dgx-h100"], runtime_memory=MEGATRON,
                        framework=EAGER_FUSED),
    "dgx-h200": Cluster(1, 8, _H200_SXM.memory_bytes, _H200_SXM.achieved("bf16"),
                        TOPOLOGY_PRESETS["nvlink-3.2tbps"].intra, TOPOLOGY_PRESETS["nvlink-3.2tbps"].inter,
                        name="dgx-h200", source=_H200, fp32_flops=_H200_SXM.achieved("fp32"), device=_H200_SXM,
                        communicator_bytes=_NCCL_COMM, nccl=NCCL_PRESETS["dgx-h200"], runtime_memory=MEGATRON,
                        framework=EAGER_FUSED),
    "p4d-a100": Cluster(1, 8, _A100_40.memory_bytes, _A100_40.achieved("bf16"),
                        TOPOLOGY_PRESETS["nvlink-400gbps"].intra, TOPOLOGY_PRESETS["nvlink-400gbps"].inter,
                        name="p4d-a100", source=_A100.format("AWS EC2 P4d (400 Gbps EFA)", "a100-sxm-40gb"),
                        fp32_flops=_A100_40.achieved("fp32"), device=_A100_40,
                        communicator_bytes=_NCCL_COMM, nccl=NCCL_PRESETS["p4d-a100"], runtime_memory=MEGATRON,
                        framework=MEGATRON_2022),
    "a2-ultra-100g": Cluster(1, 8, _A100_80.memory_bytes, _A100_80.achieved("bf16"),
                             TOPOLOGY_PRESETS["nvlink-400gbps"].intra, Link(30e-6, 100e9 / 8 / 8), name="a2-ultra-100g",
                             source=_A100.format("Google Cloud a2-ultragpu-8g (100 Gbps network)", "a100-sxm-80gb"),
                             fp32_flops=_A100_80.achieved("fp32"), device=_A100_80, communicator_bytes=_NCCL_COMM,
                             nccl=NCCL_PRESETS["a2-ultra-100g"], runtime_memory=MEGATRON, framework=MEGATRON_2022),
    "dgx-a100": Cluster(1, 8, _A100_80.memory_bytes, _A100_80.achieved("bf16"),
                        TOPOLOGY_PRESETS["nvlink-400gbps"].intra, Link(5e-6, 200e9 / 8), name="dgx-a100",
                        source=_A100.format("DGX A100 user guide (8 x 200 Gb/s HDR InfiniBand)", "a100-sxm-80gb"),
                        fp32_flops=_A100_80.achieved("fp32"), device=_A100_80, communicator_bytes=_NCCL_COMM,
                        nccl=NCCL_PRESETS["dgx-a100"], runtime_memory=MEGATRON, framework=MEGATRON_2022),
}
