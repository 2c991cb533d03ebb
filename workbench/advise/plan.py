"""One point of the search space (:class:`Config`) and what is predicted for it (:class:`Plan`).

A configuration places ``dp x tp x pp`` ranks (Megatron's order: tensor-parallel ranks adjacent,
then data, then pipeline) and chooses the levers that trade memory for time: the ZeRO stage over
the data-parallel ranks, the pipeline schedule and its micro-batch count, sequence parallelism,
the precision and the recomputation policy.

A plan holds the prediction, each figure split the way a reader asks about it:

- ``memory``: bytes per device by category -- ``parameters``, ``gradients``, ``optimizer``
  (float32 masters and Adam moments), ``activations`` (the peak of the schedule's in-flight
  micro-batches), ``buffers`` (communication buckets, gathered ZeRO-3 units, NCCL communicators);
  ``total`` is their sum. The worst device (a pipeline's first stage) is the one reported.
- ``time``: seconds per step -- ``compute`` (forward + backward [+ recomputation] at the device's
  achieved FLOP/s), ``tp``, ``dp``, ``pp`` (the communication of each dimension left exposed, not
  hidden behind compute), ``bubble`` (pipeline idle time); ``total`` is their sum.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field

__all__ = ["Config", "Plan", "MEMORY_CATEGORIES", "TIME_PARTS"]

MEMORY_CATEGORIES = ("parameters", "gradients", "optimizer", "activations", "buffers")
TIME_PARTS = ("compute", "tp", "dp", "pp", "bubble")


@dataclass(frozen=True)
class Config:
    """One configuration. ``dp * tp * pp`` is the number of devices it uses."""

    dp: int = 1
    tp: int = 1
    pp: int = 1
    zero: int = 0                    # ZeRO stage over dp: 0 (DDP), 1, 2, 3 (FSDP)
    schedule: str = "1f1b"           # pipeline schedule when pp > 1: "gpipe", "1f1b", "interleaved", "zb-h1", "zbv"
    microbatches: int = 1            # per data-parallel rank: the pipeline's m; with pp == 1, gradient-accumulation steps
    sequence_parallel: bool = False  # needs tp > 1
    precision: str = "fp32"          # "fp32", "bf16" (bf16 compute, fp32 masters), "fp16"
    recompute: str = "none"          # "none", "selective", "full"

    @property
    def devices(self) -> int:
        return self.dp * self.tp * self.pp

    def label(self) -> str:
        """Short name, e.g. ``dp2-tp2-pp2 zero1 1f1b m4 sp bf16 selective``."""
        parts = [f"dp{self.dp}-tp{self.tp}-pp{self.pp}"]
        if self.dp > 1:
            parts.append(f"zero{self.zero}")
        if self.pp > 1:
            parts.append(f"{self.schedule} m{self.microbatches}")
        elif self.microbatches > 1:
            parts.append(f"accum m{self.microbatches}")
        if self.sequence_parallel:
            parts.append("sp")
        parts.append(self.precision)
        if self.recompute != "none":
            parts.append(self.recompute)
        return " ".join(parts)


@dataclass
class Plan:
    """A configuration and its prediction; ``feasible`` False with ``reason`` when it cannot run."""

    config: Config
    memory: dict[str, float] = field(default_factory=dict)   # MEMORY_CATEGORIES + "total", bytes per device
    time: dict[str, float] = field(default_factory=dict)     # TIME_PARTS + "total", seconds per step
    feasible: bool = True
    reason: str = ""                 # why not, when infeasible ("needs 93.1 GiB per device, has 80")
    notes: list[str] = field(default_factory=list)  # the facts explain() draws on

    def explain(self) -> str:
        """Why this plan, in plain words: the deciding facts (see :func:`workbench.advise.choose.explain`)."""
        from workbench.advise.choose import explain

        return explain(self)

    def as_dict(self) -> dict:
        d = asdict(self)
        d["config"]["label"] = self.config.label()
        return d
