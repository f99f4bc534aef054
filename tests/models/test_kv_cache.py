"""Decoding through the key/value cache computes what the full forward computes: a prompt
then one token at a time, rows left-padded to different lengths, rotary tables swapped for
the product form (kernels.specialize) included."""

import pytest
import torch

from frugality.kernels.attention import ProductRotaryEmbedding
from frugality.models import GPTNeoX, GPTNeoXConfig, Llama, LlamaConfig
from frugality.models.kv_cache import KVCache
from frugality.models.layers import RotaryEmbedding

MODELS = {
    "gpt-neox": lambda: GPTNeoX(
        GPTNeoXConfig(hidden_size=32, num_layers=2, num_heads=4, vocab_size=97, max_seq_len=64, rotary_pct=0.5)
    ),
    "llama": lambda: Llama(
        LlamaConfig(
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=48,
            vocab_size=97,
            max_seq_len=64,
        )
    ),
}


@pytest.mark.parametrize("family", MODELS)
@torch.no_grad()
def test_cached_decoding_equals_the_full_forward(family):
    torch.manual_seed(0)
    model = MODELS[family]().eval()
    rows = [torch.randint(0, 97, (n,)) for n in (12, 5, 9)]
    cache = KVCache.for_model(model, len(rows), 32)
    width, prompt = 12, 4  # a prefill of each row's first tokens, left-padded to `width`
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    positions = torch.full((len(rows), width), -1)
    for i, row in enumerate(rows):
        head = row[: len(row) - prompt]
        ids[i, width - len(head) :], positions[i, width - len(head) :] = head, torch.arange(len(head))
    last = model(ids, cache=cache, positions=positions)[:, 0]
    for i, row in enumerate(rows):
        full = model(row[None])[0]
        assert (last[i] - full[len(row) - prompt - 1]).abs().max() < 1e-5
    for step in range(prompt):  # then one token per row, each at its own position
        at = torch.tensor([[len(row) - prompt + step] for row in rows])
        step_ids = torch.stack([row[len(row) - prompt + step] for row in rows])[:, None]
        logits = model(step_ids, cache=cache, positions=at)[:, 0]
        for i, row in enumerate(rows):
            assert (logits[i] - model(row[None])[0, len(row) - prompt + step]).abs().max() < 1e-5


def test_rotary_at_positions_equals_rotary_of_a_prefix_for_both_forms():
    x = torch.randn(2, 3, 10, 16)
    for cls in (RotaryEmbedding, ProductRotaryEmbedding):
        rotary = RotaryEmbedding(8, 32, head_size=16)
        rotary.__class__ = cls
        if cls is ProductRotaryEmbedding:
            rotary.specialize()
        positions = torch.arange(10).expand(2, 10)
        assert torch.equal(rotary(x, positions), rotary(x))
        shifted = rotary(x[:, :, 4:], torch.arange(4, 10).expand(2, 6))
        assert torch.allclose(shifted, rotary(x)[:, :, 4:])


def test_the_cache_refuses_more_positions_than_the_model_has():
    model = MODELS["llama"]()
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        KVCache.for_model(model, 1, 65)
