"""Choose a strategy for a model and a cluster: predict memory and step time, rank, explain, validate.

``advise(model, cluster, global_batch) -> list[Plan]`` enumerates every configuration of the
space (data x tensor x pipeline over the devices, ZeRO stage, schedule and micro-batches,
sequence parallelism, precision, recomputation), predicts for each the memory per device by
category and the step time split into compute, exposed communication per dimension and pipeline
bubble, drops the infeasible ones with their reason, and ranks the rest by predicted step time.
The formulas are the ones the strategies are checked against (:mod:`workbench.parallel.zero_memory`,
:mod:`workbench.parallel.tensor`, :mod:`workbench.parallel.recompute`, the pipeline schedules'
counts, :mod:`workbench.comm.cost`).

Files, one idea each:

==================  ==================================================================================
``cluster``         :class:`Cluster` (nodes, devices per node, memory, FLOP/s, intra/inter links) and
                    its presets, with sources
``shape``           :class:`ModelShape`: a transformer's sizes (ours, a preset, or a Llama-shaped one)
``plan``            :class:`Config` (one point of the space, checked), :class:`Plan` (its prediction) and
                    :meth:`Plan.explain` (why a ranked plan wins)
``space``           the configurations to try, and why some are infeasible
``memory``          predicted bytes per device by category
``device``          a GPU's compute, operator by operator (shape-dependent matmuls, memory-bound
                    operators, attention kernels, launch costs), and the published device profiles
``framework``       the training framework a GPU is priced for (eager PyTorch, Megatron-Core, Megatron-LM
                    2022): its kernels, recomputation policy, overlaps and reductions
``runtime_memory``  what a GPU process holds beyond the formulas (CUDA context, allocator, float32 loss)
``nccl``            collectives as NCCL runs them on each link class
``published``       public GPU measurements predicted beside their published figures
``timing``          predicted step time: compute, exposed communication per dimension, bubble
``shared_cores``    the contention of ranks sharing CPU cores (a calibrated CPU cluster only)
``choose``          :func:`advise`: predict every configuration, rank
``sensitivity``     does the choice hold if the network delivers less? (the ``If:`` line of explain())
``calibrate``       measure this machine (matmul rate, link costs) into a :class:`Cluster`
``calibrate_cuda``  measure a GPU into a device profile (``--calibrate --device cuda``)
``validate``        run a sample of configurations here and put measured beside predicted
``figure``          every plan's predicted time against its memory; the best plans' breakdowns
``cli``             ``workbench advise``: table, JSON, figure
==================  ==================================================================================
"""
from workbench.advise.cluster import Cluster
from workbench.advise.framework import FRAMEWORKS, Framework
from workbench.advise.plan import MEMORY_CATEGORIES, TIME_PARTS, Config, Plan
from workbench.advise.shape import ModelShape
from workbench.advise.memory_model import memory_per_device
from workbench.advise.space import configurations, infeasible_reason
from workbench.advise.choose import advise, predict

__all__ = ["advise", "predict", "Cluster", "Config", "Plan", "ModelShape", "MEMORY_CATEGORIES", "TIME_PARTS",
           "memory_per_device", "configurations", "infeasible_reason", "Framework", "FRAMEWORKS"]
