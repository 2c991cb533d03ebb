"""Parallel training strategies, one file each (see docs/design.md)."""
from workbench.parallel.context import (ring_attention, sequence_positions, shard_sequence, ulysses_attention,
                                        unshard_sequence)
from workbench.parallel.dp import DataParallel
from workbench.parallel.ddp import DistributedDataParallel
from workbench.parallel.expert import expert_parallel
from workbench.parallel.fsdp import FullyShardedDataParallel
from workbench.parallel.mixed_precision import DynamicLossScaler, MixedPrecision
from workbench.parallel.recompute import recompute
from workbench.parallel.zero import ShardedOptimizer, zero
from workbench.parallel.tensor import (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, full_state_dict,
                                       tensor_parallel, vocab_parallel_cross_entropy)
