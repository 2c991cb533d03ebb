"""The GPT and the MLP: shapes, parameter counts against the formula, causality, errors."""
import pytest
import torch
import torch.nn.functional as F

from workbench.models import GPT, MLP, GPTConfig


def formula(c: GPTConfig) -> int:
    """12 C^2 + 13 C per block, V C token embedding (+ V C untied head), T C positions, 2 C ln_f."""
    C = c.n_embd
    n = c.n_layer * (12 * C * C + 13 * C) + c.vocab_size * C + c.block_size * C + 2 * C
    return n if c.tie_weights else n + c.vocab_size * C


@pytest.mark.parametrize("name,low,high", [("tiny", 0.15e6, 0.25e6), ("small", 2.5e6, 3.5e6), ("medium", 22e6, 28e6)])
def test_preset_sizes_match_formula(name, low, high):
    config = GPTConfig.preset(name)
    model = GPT(config)
    n = model.num_parameters()
    assert n == formula(config)
    assert low <= n <= high
    assert n == sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def test_structure_and_tied_head():
    model = GPT(GPTConfig.preset("tiny"))
    assert model.lm_head.weight is model.wte.weight
    assert len(model.blocks) == 4
    block = model.blocks[0]
    assert block.attn.c_attn.weight.shape == (3 * 64, 64) and block.attn.c_proj.weight.shape == (64, 64)
    assert block.mlp.c_fc.weight.shape == (4 * 64, 64) and block.mlp.c_proj.weight.shape == (64, 4 * 64)
    assert hasattr(block, "ln_1") and hasattr(block, "ln_2") and hasattr(model, "ln_f") and hasattr(model, "wpe")
    untied = GPT(GPTConfig.preset("tiny", tie_weights=False))
    assert untied.lm_head.weight is not untied.wte.weight
    assert untied.num_parameters() == model.num_parameters() + 65 * 64
    wte, wpe = 65 * 64, 64 * 64  # vocab x n_embd, block_size x n_embd
    assert untied.num_parameters(exclude_embeddings=True) == untied.num_parameters() - wte - wpe
    assert model.num_parameters(exclude_embeddings=True) == model.num_parameters() - wpe  # tied: wte is the head


def test_forward_shapes_loss_and_determinism():
    torch.manual_seed(0)
    a = GPT(GPTConfig.preset("tiny"))
    torch.manual_seed(0)
    b = GPT(GPTConfig.preset("tiny"))
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)  # seeded construction gives identical replicas
    idx = torch.randint(0, 65, (3, 20))
    tgt = torch.randint(0, 65, (3, 20))
    logits, loss = a(idx)
    assert logits.shape == (3, 20, 65) and loss is None
    logits, loss = a(idx, tgt)
    assert torch.allclose(loss, F.cross_entropy(logits.reshape(-1, 65), tgt.reshape(-1)))
    assert abs(loss.item() - torch.log(torch.tensor(65.0)).item()) < 0.1  # small init: near uniform
    assert torch.equal(a(idx, tgt)[1], b(idx, tgt)[1])


def test_attention_is_causal():
    torch.manual_seed(1)
    model = GPT(GPTConfig.preset("tiny"))
    idx = torch.randint(0, 65, (1, 16))
    changed = idx.clone()
    changed[0, 10:] = (changed[0, 10:] + 1) % 65
    la, _ = model(idx)
    lb, _ = model(changed)
    assert torch.allclose(la[0, :10], lb[0, :10], atol=1e-6)  # the past cannot see the future
    assert not torch.allclose(la[0, 10:], lb[0, 10:])


def test_errors_name_value_and_fix():
    model = GPT(GPTConfig.preset("tiny"))
    with pytest.raises(ValueError, match=r"sequence length 65 .* block_size=64"):
        model(torch.zeros(1, 65, dtype=torch.long))
    with pytest.raises(ValueError, match="not divisible by n_head=3"):
        GPTConfig(n_embd=64, n_head=3)
    with pytest.raises(ValueError, match="unknown preset.*medium"):
        GPTConfig.preset("huge")
    with pytest.raises(TypeError, match="unknown field"):
        GPTConfig.preset("tiny", layers=3)
    with pytest.raises(ValueError, match="n_layer=0"):
        GPTConfig(n_layer=0)


def test_mlp():
    mlp = MLP(width=32, depth=3, in_features=8, out_features=4)
    linears = [m for m in mlp.layers if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 3 and len(mlp.layers) == 5  # ReLU between, none after the last
    assert [l.weight.shape for l in linears] == [(32, 8), (32, 32), (4, 32)]
    assert mlp.num_parameters() == (8 * 32 + 32) + (32 * 32 + 32) + (32 * 4 + 4)
    assert mlp(torch.randn(5, 8)).shape == (5, 4)
    assert MLP(16, 2, bias=False).num_parameters() == 2 * 16 * 16
    with pytest.raises(ValueError, match="expects in_features=8"):
        mlp(torch.randn(5, 9))
    with pytest.raises(ValueError, match="depth=0"):
        MLP(8, 0)
