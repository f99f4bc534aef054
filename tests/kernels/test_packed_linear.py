"""bf16 linear layers with their weights packed once for oneDNN (`PackedLinear`): the same
bits as nn.Linear for any row count and layout, swapped in only where they apply."""

import pytest
import torch
from torch import nn

from frugality.kernels.packed_linear import PackedLinear, pack_linear_weights, packing_runs

packs = pytest.mark.skipif(not packing_runs(), reason="no oneDNN bf16 products in this PyTorch on this CPU")


@packs
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_gives_nn_linears_bits_for_any_rows_and_layout(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert (packed.bias is None) == (not bias) and "in_features=96, out_features=160" in repr(packed)
    with torch.inference_mode():
        for shape in [(1, 96), (7, 96), (33, 96), (300, 96), (4, 21, 96)]:  # a server's, a job's, (batch, tokens, d)
            x = torch.randn(shape).to(torch.bfloat16)
            out = packed(x)
            assert out.shape == (*shape[:-1], 160) and out.dtype == torch.bfloat16
            assert torch.equal(out, linear(x)), shape


@packs
def test_only_unshared_bf16_cpu_layers_outside_skip_are_swapped():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(50, 32)
    model.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model.pooler = nn.Linear(32, 32)  # skipped by name
    model.tied = nn.Linear(32, 50, bias=False)
    model.to(torch.bfloat16)
    model.tied.weight = model.embed.weight  # shared with the embedding: left alone
    model.wide = nn.Linear(32, 8)  # float32: left alone
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = model.body(x)
    assert pack_linear_weights(model, skip=("pooler",)) == 2
    assert [type(m).__name__ for m in model.body] == ["PackedLinear", "GELU", "PackedLinear"]
    assert type(model.pooler) is type(model.tied) is type(model.wide) is nn.Linear
    assert model.tied.weight is model.embed.weight
    with torch.inference_mode():
        assert torch.equal(model.body(x), before)


@pytest.mark.skipif(packing_runs(), reason="oneDNN's bf16 products run here")
def test_without_onednn_bf16_nothing_is_swapped():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linear_weights(model) == 0 and type(model[0]) is nn.Linear
