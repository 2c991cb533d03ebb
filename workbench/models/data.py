"""Data: the tiny Shakespeare corpus, a character tokenizer, deterministic batches, sharding.

Every strategy must see exactly the same numbers for its loss to be comparable, so batches are
a pure function of ``(split, batch_size, block_size, step, seed)``: the same call gives the same
tensors in any process, on any rank, in any order. A distributed run draws the *global* batch
on every rank and keeps its own slice (:func:`shard_batch`)::

    x, y = get_batch("train", batch_size=8, block_size=64, step=i, seed=0)   # (8, 64) each
    x_r, y_r = shard_batch((x, y), rank, world_size)                           # rank r: rows [4r, 4r+4)

Rank r's rows are the contiguous slice ``[r B/N, (r+1) B/N)`` of the global batch, so the
union over ranks is the global batch in order and the mean of the ranks' mean losses equals the
single-process loss (each shard has the same number of tokens). Drawing the whole batch on each
rank costs ``B x T`` index reads, nothing next to a training step, and needs no sampler state.

The corpus (``data/tinyshakespeare.txt`` in the repository, 1,115,394 bytes) is checked against
its SHA-256 on first load; ``WORKBENCH_DATA`` points elsewhere (a directory holding the file, or
the file itself). Nothing is downloaded. The first 90% of the characters are ``"train"``, the
rest ``"val"``.
"""
from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path
from typing import Sequence

import torch

__all__ = ["CORPUS_FILE", "CORPUS_SHA256", "CORPUS_BYTES", "corpus_path", "load_corpus", "CharTokenizer",
           "encoded_corpus", "get_batch", "shard_batch", "synthetic_batch"]

CORPUS_FILE = "tinyshakespeare.txt"
CORPUS_BYTES = 1_115_394
CORPUS_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
TRAIN_FRACTION = 0.9
SPLITS = ("train", "val")


def corpus_path() -> Path:
    """Where the corpus is read from: ``$WORKBENCH_DATA`` if set, else ``<repository>/data/``."""
    env = os.environ.get("WORKBENCH_DATA")
    if env:
        path = Path(env).expanduser()
        return path / CORPUS_FILE if path.is_dir() else path
    return Path(__file__).resolve().parents[2] / "data" / CORPUS_FILE


@functools.lru_cache(maxsize=4)
def _read_checked(path: str) -> str:
    p = Path(path)
    fix = (f"restore it with `git checkout -- data/{CORPUS_FILE}` in the repository, or set WORKBENCH_DATA "
           f"to a directory holding an intact {CORPUS_FILE} ({CORPUS_BYTES:,} bytes, sha256 {CORPUS_SHA256})")
    if not p.is_file():
        raise FileNotFoundError(f"tiny Shakespeare corpus not found at {p}: {fix}")
    raw = p.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != CORPUS_SHA256:
        raise ValueError(f"corpus file {p} is corrupt: {len(raw):,} bytes with sha256 {digest}, expected "
                         f"{CORPUS_BYTES:,} bytes with sha256 {CORPUS_SHA256}: {fix}")
    return raw.decode("utf-8")


def load_corpus(path: str | os.PathLike | None = None) -> str:
    """The tiny Shakespeare text, verified against its SHA-256 (raises on a missing/corrupt file)."""
    return _read_checked(str(Path(path) if path is not None else corpus_path()))


class CharTokenizer:
    """Characters to integer ids and back; the vocabulary is the sorted set of characters seen.

    ``CharTokenizer(load_corpus())`` has ``vocab_size == 65`` (the model's default).
    """

    def __init__(self, text: str):
        if not isinstance(text, str) or not text:
            raise ValueError("CharTokenizer(text): text must be a non-empty string, e.g. load_corpus()")
        self.chars = sorted(set(text))
        self.stoi = {c: i for i, c in enumerate(self.chars)}
        self.itos = dict(enumerate(self.chars))

    @property
    def vocab_size(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> list[int]:
        try:
            return [self.stoi[c] for c in text]
        except KeyError as e:
            raise ValueError(f"CharTokenizer.encode: character {e.args[0]!r} is not in the vocabulary "
                             f"({self.vocab_size} characters)") from None

    def decode(self, ids: Sequence[int] | torch.Tensor) -> str:
        if isinstance(ids, torch.Tensor):
            ids = ids.tolist()
        return "".join(self.itos[int(i)] for i in ids)

    def __repr__(self) -> str:
        return f"CharTokenizer(vocab_size={self.vocab_size})"


@functools.lru_cache(maxsize=2)
def _encoded(path: str) -> tuple[CharTokenizer, torch.Tensor]:
    text = _read_checked(path)
    tok = CharTokenizer(text)
    return tok, torch.tensor(tok.encode(text), dtype=torch.long)


def encoded_corpus(split: str = "train") -> torch.Tensor:
    """The corpus as a 1-D int64 tensor of token ids, restricted to ``split`` ("train" or "val")."""
    if split not in SPLITS:
        raise ValueError(f"split={split!r} is not known: use 'train' or 'val'")
    _, ids = _encoded(str(corpus_path()))
    n = int(TRAIN_FRACTION * len(ids))
    return ids[:n] if split == "train" else ids[n:]


def _check_positive(name: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be a whole number >= 1")


def _generator(seed: int, step: int, salt: int) -> torch.Generator:
    # a fresh generator per (seed, step, split): any step can be drawn in any order, in any process
    g = torch.Generator()
    g.manual_seed((seed * 1_000_003 + step * 7_919 + salt) % (2**63))
    return g


def get_batch(split: str = "train", batch_size: int = 8, block_size: int = 64, step: int = 0, seed: int = 0,
              device: torch.device | str | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch for training step ``step``: ``(x, y)``, each ``(batch_size, block_size)`` int64.

    Row b is a random window of the corpus split; ``y`` is ``x`` shifted by one character (the
    next-character targets). Deterministic in all its arguments.
    """
    _check_positive("batch_size", batch_size)
    _check_positive("block_size", block_size)
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r} must be a whole number >= 0")
    data = encoded_corpus(split)
    if block_size >= len(data):
        raise ValueError(f"block_size={block_size} is longer than the {split!r} split ({len(data)} tokens): "
                         "use a shorter block_size")
    g = _generator(seed, step, SPLITS.index(split))
    starts = torch.randint(len(data) - block_size, (batch_size,), generator=g)
    offsets = torch.arange(block_size)
    x = data[starts[:, None] + offsets]
    y = data[starts[:, None] + offsets + 1]
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y


def shard_batch(batch, rank: int, world_size: int):
    """Rank ``rank``'s contiguous slice of dim 0 of ``batch`` (a tensor, or a tuple/list of tensors).

    With global batch B and N ranks, rank r gets rows ``[r B/N, (r+1) B/N)``. B must be a
    multiple of N, so every rank holds the same number of samples and the mean of the ranks'
    mean losses is the global mean loss.
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size={world_size!r} must be a whole number >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise ValueError(f"rank={rank!r} must be in [0, world_size={world_size})")
    if isinstance(batch, (tuple, list)):
        return type(batch)(shard_batch(t, rank, world_size) for t in batch)
    if not isinstance(batch, torch.Tensor):
        raise TypeError(f"shard_batch: expected a tensor or a tuple of tensors, got {type(batch).__name__}")
    if batch.dim() == 0:
        raise ValueError("shard_batch: a 0-d tensor has no batch dimension to split")
    size = batch.shape[0]
    if size % world_size:
        lower = size // world_size * world_size
        raise ValueError(f"batch size {size} does not split evenly over world_size={world_size} ranks: "
                         f"use a global batch size that is a multiple of {world_size} "
                         f"(e.g. {max(lower, world_size)} or {lower + world_size})")
    per_rank = size // world_size
    return batch[rank * per_rank:(rank + 1) * per_rank]


def synthetic_batch(batch_size: int, block_size: int | None = None, vocab_size: int = 65, *,
                    features: int | None = None, out_features: int | None = None, step: int = 0, seed: int = 0,
                    dtype: torch.dtype = torch.float32, device: torch.device | str | None = None):
    """Random data with no file behind it, deterministic in ``(step, seed)``, for benchmarks.

    * Tokens (the GPT): ``synthetic_batch(8, block_size=64)`` -> ``(x, y)`` int64 ``(8, 64)`` ids
      in ``[0, vocab_size)``.
    * Features (the MLP): ``synthetic_batch(8, features=1024)`` -> ``(x, y)`` float ``(8, 1024)``
      and ``(8, out_features or features)`` drawn from a standard normal.
    """
    _check_positive("batch_size", batch_size)
    if (block_size is None) == (features is None):
        raise ValueError("synthetic_batch: pass exactly one of block_size= (token batches for the GPT) or "
                         "features= (float batches for the MLP)")
    g = _generator(seed, step, 101)
    if features is not None:
        _check_positive("features", features)
        out = features if out_features is None else out_features
        _check_positive("out_features", out)
        x = torch.randn(batch_size, features, generator=g, dtype=dtype)
        y = torch.randn(batch_size, out, generator=g, dtype=dtype)
    else:
        _check_positive("block_size", block_size)
        _check_positive("vocab_size", vocab_size)
        x = torch.randint(vocab_size, (batch_size, block_size), generator=g)
        y = torch.randint(vocab_size, (batch_size, block_size), generator=g)
    if device is not None:
        x, y = x.to(device), y.to(device)
    return x, y
