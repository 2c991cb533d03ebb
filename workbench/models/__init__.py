"""The models the strategies train: a small GPT (the default) and an MLP (for benchmarks)."""
from workbench.models.gpt import GPT, Block, CausalSelfAttention, FeedForward, GPTConfig
from workbench.models.mlp import MLP

__all__ = ["GPT", "GPTConfig", "Block", "CausalSelfAttention", "FeedForward", "MLP"]
