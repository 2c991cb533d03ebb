"""The corpus, the tokenizer, deterministic batches, and sharding a global batch over ranks."""
import hashlib
from pathlib import Path

import pytest
import torch

from workbench.models import data


def test_corpus_is_verified_and_tokenized():
    text = data.load_corpus()
    raw = data.corpus_path().read_bytes()
    assert len(raw) == data.CORPUS_BYTES == 1_115_394
    assert hashlib.sha256(raw).hexdigest() == data.CORPUS_SHA256
    tok = data.CharTokenizer(text)
    assert tok.vocab_size == 65
    assert tok.decode(tok.encode("First Citizen:")) == "First Citizen:"
    train, val = data.encoded_corpus("train"), data.encoded_corpus("val")
    assert len(train) + len(val) == len(text) and len(train) == int(0.9 * len(text))
    assert tok.decode(train[:14]) == text[:14]
    with pytest.raises(ValueError, match="not in the vocabulary"):
        tok.encode("€")


def test_missing_or_corrupt_corpus_names_path_and_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("WORKBENCH_DATA", str(tmp_path))
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "tinyshakespeare.txt")) as e:
        data.load_corpus()
    assert "WORKBENCH_DATA" in str(e.value) and "git checkout" in str(e.value)
    bad = tmp_path / "tinyshakespeare.txt"
    bad.write_text("To be, or not to be")
    with pytest.raises(ValueError, match=r"corrupt.*sha256.*expected 1,115,394 bytes") as e:
        data.load_corpus()
    assert str(bad) in str(e.value)
    monkeypatch.setenv("WORKBENCH_DATA", str(Path(__file__).resolve().parents[1] / "data"))
    assert len(data.load_corpus()) == data.CORPUS_BYTES  # a directory holding the file works too


def test_batches_are_deterministic_next_character_windows():
    x, y = data.get_batch("train", batch_size=6, block_size=32, step=3, seed=0)
    x2, y2 = data.get_batch("train", batch_size=6, block_size=32, step=3, seed=0)
    assert x.shape == y.shape == (6, 32) and x.dtype == torch.long
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are inputs shifted by one
    assert not torch.equal(x, data.get_batch("train", 6, 32, step=4, seed=0)[0])
    assert not torch.equal(x, data.get_batch("train", 6, 32, step=3, seed=1)[0])
    corpus = data.encoded_corpus("train")
    for row_x, row_y in zip(x, y):  # every row is a real window of the corpus
        start = (corpus.unfold(0, 32, 1) == row_x).all(1).nonzero()[0, 0]
        assert torch.equal(corpus[start + 1:start + 33], row_y)
    assert data.get_batch("val", 2, 8, step=0)[0].max() < 65
    with pytest.raises(ValueError, match="split='test'"):
        data.get_batch("test", 2, 8)
    with pytest.raises(ValueError, match="batch_size=0"):
        data.get_batch("train", 0, 8)


@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_shards_partition_the_global_batch(world_size):
    x, y = data.get_batch("train", batch_size=12, block_size=8, step=0)
    shards = [data.shard_batch((x, y), r, world_size) for r in range(world_size)]
    assert all(s[0].shape == (12 // world_size, 8) for s in shards)
    assert torch.equal(torch.cat([s[0] for s in shards]), x)  # in rank order, nothing lost or repeated
    assert torch.equal(torch.cat([s[1] for s in shards]), y)
    assert isinstance(shards[0], tuple)


def test_shard_errors():
    x = torch.zeros(10, 4)
    with pytest.raises(ValueError, match=r"batch size 10 does not split evenly over world_size=4.*multiple of 4 \(e.g. 8 or 12\)"):
        data.shard_batch(x, 0, 4)
    with pytest.raises(ValueError, match=r"rank=2 must be in \[0, world_size=2\)"):
        data.shard_batch(x, 2, 2)
    with pytest.raises(TypeError):
        data.shard_batch([1, 2], 0, 1)


def test_synthetic_batches():
    x, y = data.synthetic_batch(4, block_size=16, vocab_size=10, step=2)
    assert x.shape == y.shape == (4, 16) and x.max() < 10 and x.dtype == torch.long
    assert torch.equal(x, data.synthetic_batch(4, block_size=16, vocab_size=10, step=2)[0])
    f, g = data.synthetic_batch(4, features=8, out_features=3)
    assert f.shape == (4, 8) and g.shape == (4, 3) and f.dtype == torch.float32
    assert not torch.equal(f, data.synthetic_batch(4, features=8, step=1)[0])
    with pytest.raises(ValueError, match="exactly one of block_size"):
        data.synthetic_batch(4)
