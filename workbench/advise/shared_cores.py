"""Ranks that share CPU cores: the contention terms of a calibrated CPU cluster, an opt-in layer.

On a GPU cluster every rank has its own device and its own host threads; on a laptop (this
project's 2-core development machine) four ranks share two cores, and a step pays for it in ways
no GPU user meets. :mod:`workbench.advise.timing` prices a step with the terms below only where
the cluster says its ranks share cores: a :class:`~workbench.advise.calibrate.CalibratedCluster`
measured by :func:`workbench.advise.calibrate.calibrate` (its ``cores``, ``sync_by_size``,
``message_cpu``, ...). A :class:`~workbench.advise.cluster.Cluster` with a
:class:`~workbench.advise.device.Device` (every GPU preset) never reaches them, and neither does
a plain datasheet cluster: :func:`of` returns None for both, and the timing model then uses the
neutral values (no slow-down, no price, full overlap).

The terms, each measured by a probe of :mod:`workbench.advise.calibrate`:

* **time sharing** (``cores``): while every rank computes, each runs ``world / cores`` times
  slower than alone (:func:`oversubscription`); a pipeline in its ramp-up and drain has fewer ranks
  computing, so its step is the schedule replayed with the cores shared among the ranks
  computing at each moment (:func:`workbench.advise.timing.simulate`'s ``cores``).
* **drift before a collective** (``sync_by_size``): a collective after compute waits for the
  ranks the scheduler took off their cores to run again, a price that grows with the compute
  before it up to a time slice (:func:`sync_price`), paid in part when fewer ranks compute
  (:func:`crowding`).
* **the scheduler's time slice** (``time_slice_s``): a pipeline message that lands while every
  core computes waits half a slice on average for its rank and gloo's reading thread to run
  (:func:`late_message`).
* **CPU of messages and of the schedule's loop** (``message_cpu``, ``pipeline_action_s``): a
  message's ends and the schedule's bookkeeping cost their rank CPU that competes with compute
  (:func:`message_cpu`).
* **CPU of ZeRO-3's collectives** (``collective_cpu``): a lower bound on their time when every
  rank's threads share the cores (:func:`zero3_cpu`).
* **no overlap** (``overlap``, ``prefetch_overlap``): gloo's threads need the cores compute has,
  so gradient buckets do not hide behind backward as NCCL's do on a GPU's own streams.
"""
from __future__ import annotations

import math

__all__ = ["of", "oversubscription", "crowding", "sync_price", "message_cpu", "zero3_cpu", "late_message", "overlap"]


def of(cluster):
    """The cluster itself where its ranks share cores and it carries the contention figures (a
    calibrated CPU cluster), else None (a GPU cluster, a datasheet cluster: no contention)."""
    if getattr(cluster, "device", None) is not None or not hasattr(cluster, "cores"):
        return None
    return cluster


def oversubscription(cluster, world: int) -> float:
    """How many times slower each rank computes while all ``world`` ranks compute: ``world / cores``
    where they outnumber the cores, else 1."""
    cores = getattr(cluster, "cores", None)
    return max(1.0, world / cores) if cores else 1.0


def crowding(cluster, active: int, world: int) -> float:
    """How crowded the cores are with ``active`` ranks computing, as a share of how crowded they are
    with all ``world`` ranks computing (0: every active rank has a core; 1: as crowded as the
    calibration's every rank busy), linear in the ranks per core. The drift price of a collective
    (:func:`sync_price`) was measured with every rank busy; with no more ranks than cores computing,
    nobody is descheduled."""
    cores = getattr(cluster, "cores", None)
    if not cores or world <= cores:
        return 1.0
    return min(1.0, max(0.0, (active / cores - 1) / (world / cores - 1)))


def sync_price(cluster, group_size: int, chunk: float = math.inf) -> float:
    """Seconds a collective (or message) among ``group_size`` ranks costs beyond its bytes when it
    follows ``chunk`` seconds of compute: a calibrated cluster's ``sync_by_size`` (per group size,
    points ``(compute, price)``), interpolated in both; its ``sync_s`` (or 0) without them."""
    by = getattr(cluster, "sync_by_size", None)
    if not by:
        return float(getattr(cluster, "sync_s", 0.0))

    def at(points):
        pts = sorted(points)
        if chunk <= pts[0][0]:
            return pts[0][1]
        for (c0, s0), (c1, s1) in zip(pts, pts[1:]):
            if chunk <= c1:
                return s0 + (s1 - s0) * (chunk - c0) / (c1 - c0) if c1 > c0 else s1
        return pts[-1][1]

    sizes = sorted(by)
    if group_size <= sizes[0]:
        return float(at(by[sizes[0]]))
    for lo, hi in zip(sizes, sizes[1:]):
        if group_size <= hi:
            return float(at(by[lo]) + (at(by[hi]) - at(by[lo])) * (group_size - lo) / (hi - lo))
    return float(at(by[sizes[-1]]))


def message_cpu(cluster, nbytes: float) -> float:
    """CPU seconds one end of a ``nbytes`` pipeline message costs its rank after compute (a
    calibrated cluster's ``message_cpu`` points: a straight line through them, never below the
    smallest; 0 for a cluster without them, whose devices compute while their NICs move the bytes)."""
    points = getattr(cluster, "message_cpu", None)
    if not points:
        return 0.0
    if len(points) == 1:
        return max(0.0, float(points[0][1]))
    (x0, y0), (x1, y1) = points[0], points[-1]
    slope = max(0.0, (y1 - y0) / (x1 - x0)) if x1 > x0 else 0.0
    return max(0.0, float(y0) + slope * max(0.0, nbytes - x0))


def zero3_cpu(cluster, shape, config) -> float:
    """CPU seconds one rank's ZeRO-3 collectives cost per micro-batch on a calibrated cluster
    whose ranks share cores (its ``collective_cpu``; 0 elsewhere): FSDP's units are the stage's
    layers and the root, each gathered in forward and again in backward and reduce-scattered
    once, ``2 (L/p + 1)`` gathers and ``L/p + 1`` reduce-scatters."""
    cpu = getattr(cluster, "collective_cpu", None)
    if not cpu or not getattr(cluster, "cores", None):
        return 0.0
    layers, pp = shape.layers, config.pp
    units = layers // pp + (1 if layers % pp else 0) + 1     # the largest stage's layers, and the root
    return units * (2 * float(cpu["all_gather"]) + float(cpu["reduce_scatter"]))


def late_message(cluster) -> float:
    """Seconds more a pipeline message waits when it lands while every core computes: half the
    scheduler's time slice on this machine's own links (with an emulated link the ranks sleep
    through its held-back messages and their network threads run meanwhile: 0 there)."""
    if getattr(cluster, "links", None) is not None:
        return 0.0
    return float(getattr(cluster, "time_slice_s", 0.0) or 0.0) / 2


def overlap(cluster) -> tuple[float, float]:
    """``(overlap, prefetch)``: the share of compute that hides data-parallel traffic (gradient
    buckets), and of a ZeRO-3 gather beside compute (None: ``overlap``)."""
    share = float(getattr(cluster, "overlap", 1.0))
    hides = getattr(cluster, "prefetch_overlap", None)
    return share, (share if hides is None else float(hides))
