"""Does the choice hold if the network delivers less than its figure?

Of everything the advisor is told about a GPU cluster, the bandwidth its network between nodes
achieves is the least certain. A preset takes what NCCL reaches on a well-tuned fabric (0.96 of an
InfiniBand NIC's line rate, as nccl-tests show: :mod:`workbench.advise.nccl`); a cloud's network, a
fabric shared with other jobs, RoCE without lossless tuning or a NIC behind the wrong PCIe switch
delivers less, and nothing in a datasheet says how much. A plan that is fastest by a few percent on
the figure may not be fastest on the cluster as it runs, and a plan whose step hides its gradient
traffic behind backward at full bandwidth may expose it at half.

:func:`network_sensitivity` prices the chosen plan and its nearest rivals again on the same
cluster with the link between nodes scaled by ``factor`` (``Cluster.with_(inter=...)``, which
scales the NCCL model's network bandwidth with it) and reports how much the plan slows down and
which of them is then the fastest. Memory does not depend on the network, so a plan that did not
fit still does not; only time is priced again.

:func:`~workbench.advise.choose.advise` asks it of the plan it ranks first (at half the bandwidth)
and keeps the answer in ``Plan.what_ifs``, the ``If:`` line of ``explain()``.

Cost: ``rivals + 1`` step times (:func:`~workbench.advise.timing.step_time`), no search: a few
milliseconds each. The rivals are the ``rivals`` fastest feasible plans of the ranking: a slower
network reorders plans whose times are close; one far behind would have to make up more than its
deficit, which only a plan that sends much less across nodes can, and the next fastest usually
include such a plan (another split of the same devices).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .cluster import Cluster
from .plan import Config, Plan
from .plan import _seconds as seconds_text
from .timing import step_time

__all__ = ["Sensitivity", "network_sensitivity"]


@dataclass(frozen=True)
class Sensitivity:
    """The chosen plan's step time with the network at ``factor`` of its bandwidth, and the fastest
    of the plans considered then."""

    factor: float                # the network's bandwidth as a share of the cluster's figure
    network_Bps: float           # the link between nodes then, per device and direction
    config: Config               # the plan asked about
    seconds: float               # its step time at full bandwidth
    slowed_seconds: float        # its step time then
    best: Config                 # the fastest of the plans considered then
    best_seconds: float
    considered: int              # plans priced again, the asked one included

    @property
    def slowdown(self) -> float:
        """The step time then over the step time at full bandwidth."""
        return self.slowed_seconds / self.seconds

    def describe(self) -> str:
        """One sentence: the plan's step time then, and whether it is still the fastest."""
        head = (f"with the network between nodes at {self.factor:.0%} of its bandwidth "
                f"({self.network_Bps / 1e9:.3g} GB/s per device), {self.config.label()} takes "
                f"{seconds_text(self.slowed_seconds)} (+{_percent(self.slowdown - 1)})")
        if self.best == self.config:
            return f"{head} and is still the fastest of the {self.considered} fastest plans"
        gain = 1 - self.best_seconds / self.slowed_seconds
        return (f"{head}; {self.best.label()} would then be the fastest of the {self.considered} fastest "
                f"plans, {gain:.1%} faster ({seconds_text(self.best_seconds)})")


def network_sensitivity(plan: Plan, factor: float = 0.5, rivals: int = 20) -> Sensitivity | None:
    """``plan`` (one of :func:`~workbench.advise.choose.advise`'s ranking, or a
    :func:`~workbench.advise.choose.predict` result) priced again with the network between nodes
    at ``factor`` of its bandwidth, beside the ``rivals`` fastest feasible plans of its ranking.
    None where the question does not arise: a plan that does not fit, a cluster of one node (no
    network), or one without a GPU device model (an emulated link on this machine is what it was
    set to)."""
    if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor <= 1:
        raise ValueError(f"network_sensitivity(factor={factor!r}): the share of the network's bandwidth "
                         "delivered, in (0, 1], e.g. 0.5")
    if isinstance(rivals, bool) or not isinstance(rivals, int) or rivals < 0:
        raise ValueError(f"network_sensitivity(rivals={rivals!r}): how many of the fastest plans to price again, "
                         "a whole number >= 0")
    context = getattr(plan, "_context", None)
    if context is None:
        raise ValueError("network_sensitivity(plan): pass a Plan from advise() or predict(), which know their "
                         "model, cluster and batch")
    shape, cluster, global_batch = context
    if not plan.feasible or cluster.nodes < 2 or cluster.device is None:
        return None
    slow = _slowed(cluster, factor)
    ranked = getattr(plan, "_ranked", None) or [plan]
    configs = [plan.config] + [p.config for p in ranked if p.feasible and p.config != plan.config][:rivals]
    times = {c: step_time(shape, slow, c, global_batch)["total"] for c in configs}
    best = min(configs, key=lambda c: times[c])
    return Sensitivity(factor=float(factor), network_Bps=slow.inter.bandwidth_Bps, config=plan.config,
                       seconds=plan.time["total"], slowed_seconds=times[plan.config], best=best,
                       best_seconds=times[best], considered=len(configs))


def _slowed(cluster: Cluster, factor: float) -> Cluster:
    """The cluster with its link between nodes at ``factor`` of its bandwidth (the NCCL model follows)."""
    return cluster.with_(inter=replace(cluster.inter, bandwidth_Bps=cluster.inter.bandwidth_Bps * factor))


def _percent(x: float) -> str:
    """A share as a percentage, one decimal below 10% (a 0.3% slowdown is not "0%")."""
    return f"{x:.1%}" if abs(x) < 0.1 else f"{x:.0%}"
