"""Rotary embeddings: the whole-head form equals the rotate-half formula of RoFormer / GPT-NeoX."""

import pytest
import torch

from frugality.kernels.attention import ProductRotaryEmbedding
from frugality.models.layers import RotaryEmbedding


def _rotate_half_reference(x, dim, base, positions):
    """The textbook form: rotate the first `dim` channels by slicing, pass the rest through."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    angles = torch.outer(positions.double(), inv_freq)
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((angles.sin(), angles.sin()), -1)
    rot, rest = x[..., :dim].double(), x[..., dim:].double()
    half = dim // 2
    rotated = torch.cat((-rot[..., half:], rot[..., :half]), -1)
    return torch.cat((rot * cos + rotated * sin, rest), -1)


@pytest.mark.parametrize("dim, head_size", [(16, 64), (64, 64), (6, 10)])
@pytest.mark.parametrize("product", [True, False])
def test_matches_the_rotate_half_formula(dim, head_size, product):
    torch.manual_seed(0)
    rotary = _rotary(product, dim, max_seq_len=40, base=500.0, head_size=head_size)
    x = torch.randn(2, 3, 32, head_size)
    expected = _rotate_half_reference(x, dim, 500.0, torch.arange(32))
    torch.testing.assert_close(rotary(x).double(), expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(rotary(x)[..., dim:], x[..., dim:])  # past `dim`, exactly unchanged


def _rotary(product: bool, *args, **kwargs) -> RotaryEmbedding:
    """The plain layer (slicing), or the CPU kernels' version (a product) swapped in."""
    rotary = RotaryEmbedding(*args, **kwargs)
    if product:
        rotary.__class__ = ProductRotaryEmbedding
        rotary.specialize()
    return rotary


def test_swapping_by_product_and_by_slicing_agree_exactly_in_bf16():
    x = torch.randn(4, 8, 64).to(torch.bfloat16)
    sliced, product = (_rotary(p, 16, max_seq_len=8, head_size=64) for p in (False, True))
    assert torch.equal(product.swap_halves(x), sliced.swap_halves(x))


def test_rejects_an_odd_or_oversized_rotary_dimension():
    with pytest.raises(ValueError, match="even"):
        RotaryEmbedding(5, 8, head_size=8)
    with pytest.raises(ValueError, match="at most the head size"):
        RotaryEmbedding(16, 8, head_size=8)


def test_a_model_built_empty_has_the_rotary_tables_of_one_built_for_real():
    from frugality.models import GPTNeoXConfig, build_model
    from frugality.models.materialize import build_empty

    cfg = GPTNeoXConfig(hidden_size=64, num_layers=2, num_heads=4, max_seq_len=32)
    real, empty = build_model(cfg), build_empty(cfg)
    for a, b in zip(real.layers, empty.layers, strict=True):
        assert torch.equal(a.attn.rotary.cos, b.attn.rotary.cos) and torch.equal(a.attn.rotary.sin, b.attn.rotary.sin)
    assert [n for n, _ in real.named_parameters()] == [n for n, _ in empty.named_parameters()]


def test_a_model_built_empty_keeps_its_tied_weights_tied():
    from frugality.models import BertConfig, LlamaConfig
    from frugality.models.materialize import build_empty

    llama = build_empty(
        LlamaConfig(
            hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128, vocab_size=100, tie_embeddings=True
        )
    )
    assert llama.output.weight is llama.embed.weight
    bert = build_empty(BertConfig(hidden_size=32, num_layers=1, num_heads=4, intermediate_size=64, mlm_head=True))
    assert bert.mlm.decoder.weight is bert.embeddings.word.weight
