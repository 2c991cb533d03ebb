"""A cluster as the advisor sees it: how many devices, how much memory, how fast, linked how.

(skeleton: fields fixed here; presets with sources and validation to be written)
"""
from __future__ import annotations

from dataclasses import dataclass

from workbench.comm.topology import Link

__all__ = ["Cluster"]


@dataclass(frozen=True)
class Cluster:
    """``nodes`` x ``devices_per_node`` devices of ``memory_bytes`` each, computing at ``flops``
    (FLOP/s achieved on a large matmul in the compute precision), linked by ``intra`` inside a node and
    ``inter`` between nodes (per device, one direction)."""

    nodes: int
    devices_per_node: int
    memory_bytes: float
    flops: float
    intra: Link
    inter: Link
    name: str = "custom"
    source: str = ""             # where the figures come from (datasheets, a calibration run)

    @property
    def devices(self) -> int:
        return self.nodes * self.devices_per_node
