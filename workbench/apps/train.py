"""The one training loop every strategy runs: :func:`train` (inside a rank), :func:`summarize`.

Fairness is the point of sharing the loop. For every strategy:

* the model is built from the same seed (``torch.manual_seed(seed)`` then ``GPT(config)``), so
  every rank and every strategy starts from identical weights;
* step ``i`` trains on the same *global* batch (``workbench.models.data.get_batch(step=i)``); the
  strategy says what reaches each rank (``Strategy.batch``: a data-parallel rank r keeps rows
  ``[r B/N, (r+1) B/N)``, a tensor-parallel rank the whole batch);
* the loss reported for a step is the global batch's mean loss (``Strategy.global_loss``: for
  data parallelism the ranks' mean losses all-reduced and divided by N, which equals the single
  process's mean over the whole batch because every shard holds the same number of tokens);
* throughput is timed per step with the warm-up steps and the memory-measuring step left out;
  a step's time is the slowest rank's (the ranks wait for each other in the collectives), and
  its tokens are the global batch's, however the strategy spread them over ranks;
* memory is measured on one steady-state step (by default the second: Adam's moments exist by
  then) with :class:`workbench.measure.metrics.MemoryMeter`, which slows the step it watches.

The step is the strategy's (``Strategy.step``, by default the same three lines for every
data-parallel strategy, whatever ``Strategy.wrap`` did)::

    _, loss = model(x, y); loss.backward(); optimizer.step()

then the loop zeroes the gradients.

Memory levers, the same for every strategy: ``precision="bf16"`` passes
``MixedPrecision(param_dtype=torch.bfloat16)`` to the strategy's ``wrap`` (float32 master
weights and optimizer state, 16-bit compute and communication); ``recompute="selective"`` or
``"full"`` applies :func:`workbench.parallel.recompute` to the model before it is wrapped.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import asdict, dataclass

import torch

from workbench import runtime
from workbench.apps import strategies
from workbench.models.data import encoded_corpus, get_batch
from workbench.measure.metrics import MemoryMeter, Throughput, model_state_bytes
from workbench.models import GPT, GPTConfig
from workbench.parallel import MixedPrecision, recompute

__all__ = ["TrainConfig", "train", "summarize", "make_optimizer", "preload", "PRECISIONS"]

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


@dataclass
class TrainConfig:
    """What to train and how long. ``batch_size`` is the *global* batch (all ranks together)."""

    model: str = "tiny"  # a GPTConfig preset
    steps: int = 30
    batch_size: int = 16
    block_size: int | None = None  # None: the preset's context length
    lr: float = 1e-3
    seed: int = 0
    warmup: int = 2  # first steps left out of the throughput (allocator and cache warm-up)
    memory_step: int | None = 1  # the step measured by MemoryMeter (None: no memory measurement)
    precision: str = "fp32"  # "fp32", or "bf16": MixedPrecision(param_dtype=torch.bfloat16)
    recompute: str = "none"  # activation recomputation: "none", "selective" or "full"

    def __post_init__(self) -> None:
        if self.model not in GPTConfig.PRESETS:
            raise ValueError(f"TrainConfig.model={self.model!r} is not a preset: use one of {sorted(GPTConfig.PRESETS)}")
        for name in ("steps", "batch_size"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"TrainConfig.{name}={value!r} must be a whole number >= 1")
        if self.block_size is not None and (not isinstance(self.block_size, int) or self.block_size < 1):
            raise ValueError(f"TrainConfig.block_size={self.block_size!r} must be a whole number >= 1 or None")
        if self.block_size is not None and self.block_size > GPTConfig.PRESETS[self.model]["block_size"]:
            limit = GPTConfig.PRESETS[self.model]["block_size"]
            raise ValueError(f"TrainConfig.block_size={self.block_size} is longer than the {self.model!r} model's "
                             f"context ({limit} tokens): use block_size <= {limit} or a larger preset")
        if not self.lr > 0:
            raise ValueError(f"TrainConfig.lr={self.lr!r} must be > 0")
        if self.precision not in PRECISIONS:
            raise ValueError(f"TrainConfig.precision={self.precision!r}: use one of {', '.join(PRECISIONS)} "
                             "(float16 needs a loss scaler, which the shared loop does not run)")
        if self.recompute not in ("none", "selective", "full"):
            raise ValueError(f"TrainConfig.recompute={self.recompute!r}: use 'none', 'selective' (the attention "
                             "core) or 'full' (every block)")
        if self.memory_step is not None and not 0 <= self.memory_step < self.steps:
            self.memory_step = min(1, self.steps - 1)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig.preset(self.model)

    @property
    def sequence_length(self) -> int:
        return self.block_size or GPTConfig.PRESETS[self.model]["block_size"]

    def check_world_size(self, world_size: int) -> None:
        """ValueError unless the global batch splits evenly over ``world_size`` ranks."""
        if self.batch_size % world_size:
            lower = self.batch_size // world_size * world_size
            raise ValueError(f"batch_size={self.batch_size} does not split evenly over world_size={world_size} "
                             f"ranks: use a multiple of {world_size} (e.g. {max(lower, world_size)} or "
                             f"{lower + world_size})")


def make_optimizer(params, lr: float = 1e-3) -> torch.optim.Optimizer:
    """The optimizer every strategy gets: AdamW without weight decay (decay would not change
    what is being compared), single-tensor update so every strategy runs the same arithmetic."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.0, foreach=False)


def preload() -> None:
    """Do once in the parent what every forked rank would otherwise do again: import what the
    optimizer and PyTorch's DDP/FSDP pull in on first use (``torch._dynamo`` alone takes about a
    second) and tokenize the corpus. Ranks forked afterwards inherit it all."""
    import torch.distributed.fsdp  # noqa: F401
    import torch.nn.parallel  # noqa: F401

    make_optimizer([torch.zeros(1, requires_grad=True)])
    encoded_corpus("train")


def train(strategy: str | strategies.Strategy, config: TrainConfig | None = None) -> dict:
    """Train with ``strategy`` in this rank (call it through ``workbench.launch``); return its record.

    The record (picklable): ``strategy``, ``rank``, ``world_size``, ``losses`` (global mean per
    step), ``step_times`` and ``counted`` (per step, whether it counts for throughput),
    ``tokens_per_step`` and ``samples_per_step`` (the global batch's), ``peak_bytes`` and
    ``peak_by_category`` (MemoryMeter on ``memory_step``), ``model_state`` (model_state_bytes
    after the memory step's optimizer update, before its gradients are freed) and ``parameters``.
    Each step is also sent to the parent with ``workbench.report(step, total, loss, strategy)``.
    """
    config = config or TrainConfig()
    if isinstance(strategy, str):
        strategy = strategies.get(strategy)
    rank, world = runtime.rank(), runtime.world_size()
    if not strategy.distributed and world != 1:
        raise ValueError(f"strategy {strategy.name!r} trains in one process but this launch has world_size={world}: "
                         "launch it with world_size=1")
    config.check_world_size(world)
    device = runtime.device()

    torch.manual_seed(config.seed)
    model = GPT(config.gpt_config()).to(device)
    n_params = model.num_parameters()
    if config.recompute != "none":
        recompute(model, config.recompute)
    extra = {}
    if PRECISIONS[config.precision] is not None:
        why = strategies.mixed_precision_refusal(strategy, device.type, config.gpt_config().tie_weights)
        if why:
            raise ValueError(f"strategy {strategy.name!r} cannot train with precision={config.precision!r} on "
                             f"{device.type}: {why}; leave it out, or use fp32")
        extra["mp_policy"] = MixedPrecision(param_dtype=PRECISIONS[config.precision])
    model, optimizer = strategy.wrap(model, functools.partial(make_optimizer, lr=config.lr), **extra)

    sync = torch.cuda.synchronize if device.type == "cuda" else None
    clock = Throughput(warmup=config.warmup, sync=sync)
    losses: list[float] = []
    peak_bytes, peak_by_category, state = 0, {}, {}
    T = config.sequence_length
    for step in range(config.steps):
        x, y = get_batch("train", config.batch_size, T, step=step, seed=config.seed, device=device)
        global_samples, global_tokens = x.shape[0], x.numel()
        if strategy.distributed:
            x, y = strategy.batch(x, y, rank, world)
        metered = step == config.memory_step
        clock.start()
        with (MemoryMeter(x, y, device=device) if metered else contextlib.nullcontext()) as meter:
            loss = strategy.step(model, optimizer, x, y)
            if metered:
                state = model_state_bytes(model, optimizer)
            optimizer.zero_grad(set_to_none=True)
        clock.stop(samples=global_samples, tokens=global_tokens, count=not metered)
        if metered:
            peak_bytes, peak_by_category = meter.peak_bytes, meter.peak_by_category
        losses.append(strategy.global_loss(None if loss is None else loss.detach(), world))
        runtime.report(step=step, total=config.steps, loss=losses[-1], strategy=strategy.name)
    return {
        "strategy": strategy.name, "rank": rank, "world_size": world, "distributed": strategy.distributed,
        "losses": losses, "step_times": clock.step_times, "counted": clock.counted,
        "tokens_per_step": global_tokens, "samples_per_step": global_samples,
        "peak_bytes": peak_bytes, "peak_by_category": peak_by_category, "model_state": state,
        "parameters": n_params, "config": asdict(config),
    }


def summarize(ranks: list[dict], reference: list[float] | None = None) -> dict:
    """One row of the comparison from every rank's :func:`train` record.

    tokens/s is global: the global batch's tokens per step over the slowest rank's step time,
    summed over the counted steps. ``loss_diff`` is the largest |loss - reference| over the steps.
    """
    first = ranks[0]
    counted = [all(r["counted"][i] for r in ranks) for i in range(len(first["step_times"]))]
    seconds = sum(max(r["step_times"][i] for r in ranks) for i, c in enumerate(counted) if c)
    steps = sum(counted)
    tokens = steps * first["tokens_per_step"]
    samples = steps * first["samples_per_step"]
    row = {
        "strategy": first["strategy"], "world_size": first["world_size"],
        "tokens_per_s": tokens / seconds if seconds > 0 else float("nan"),
        "samples_per_s": samples / seconds if seconds > 0 else float("nan"),
        "step_seconds": seconds / steps if steps else float("nan"),
        "peak_bytes": [r["peak_bytes"] for r in ranks],
        "peak_by_category": [r["peak_by_category"] for r in ranks],
        "model_state": [r["model_state"] for r in ranks],
        "losses": first["losses"], "final_loss": first["losses"][-1], "parameters": first["parameters"],
        "loss_diff": None,
    }
    if reference is not None:
        n = min(len(reference), len(first["losses"]))
        row["loss_diff"] = max(abs(a - b) for a, b in zip(first["losses"][:n], reference[:n]))
    return row
