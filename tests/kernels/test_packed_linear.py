"""bf16 linear layers with their weights packed once for oneDNN (`PackedLinear`): nn.Linear's
products for any row count and layout (bit for bit where measured so, as close to float64
everywhere), swapped in only where they apply, an output layer's loss kept."""

import pytest
import torch
from torch import nn

from frugality.hardware import cpu_flags
from frugality.kernels.packed_linear import PackedLinear, PackedOutputLayer, pack_linear_weights, packing_runs
from frugality.models.layers import OutputLayer

packs = pytest.mark.skipif(not packing_runs(), reason="no oneDNN bf16 products in this PyTorch on this CPU")
# the same bits measured on AVX512-BF16 (Zen 4); with AMX, plain and packed products are
# different oneDNN kernels, held to float64 as closely as the plain one instead
EXACT = "amx_tile" not in cpu_flags()


def same_product(packed: torch.Tensor, plain: torch.Tensor, exact_value: torch.Tensor) -> None:
    if EXACT:
        assert torch.equal(packed, plain)
    error = lambda t: (t.double() - exact_value).abs().max().item()  # noqa: E731
    assert error(packed) <= 1.25 * error(plain) + 1e-6


@packs
@pytest.mark.parametrize("bias", [True, False])
def test_a_packed_layer_gives_nn_linears_products_for_any_rows_and_layout(bias):
    torch.manual_seed(0)
    linear = nn.Linear(96, 160, bias=bias).to(torch.bfloat16)
    packed = PackedLinear(linear)
    assert (packed.bias is None) == (not bias) and "in_features=96, out_features=160" in repr(packed)
    with torch.inference_mode():
        for shape in [(1, 96), (7, 96), (33, 96), (300, 96), (4, 21, 96)]:  # a server's, a job's, (batch, tokens, d)
            x = torch.randn(shape).to(torch.bfloat16)
            out = packed(x)
            assert out.shape == (*shape[:-1], 160) and out.dtype == torch.bfloat16
            exact = x.double() @ linear.weight.double().t() + (linear.bias.double() if bias else 0)
            same_product(out, linear(x), exact)


@packs
def test_a_packed_output_layer_gives_the_same_logits_and_loss():
    torch.manual_seed(0)
    output = OutputLayer(64, 300).to(torch.bfloat16)
    packed = PackedOutputLayer(output)
    hidden = torch.randn(2, 5, 64).to(torch.bfloat16)
    targets = torch.randint(0, 300, (2, 5))
    with torch.inference_mode():
        same_product(packed.logits_or_loss(hidden, None), output(hidden), hidden.double() @ output.weight.double().t())
        loss, reference = packed.logits_or_loss(hidden, targets), output.loss(hidden, targets)
        assert loss.shape == () and (torch.equal(loss, reference) if EXACT else torch.allclose(loss, reference, 1e-2))


@packs
def test_only_unshared_bf16_cpu_layers_outside_skip_are_swapped():
    torch.manual_seed(0)
    model = nn.Module()
    model.embed = nn.Embedding(50, 32)
    model.body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 32))
    model.pooler = nn.Linear(32, 32)  # skipped by name
    model.tied = OutputLayer(32, 50)
    model.output = OutputLayer(32, 50)
    model.to(torch.bfloat16)
    model.tied.weight = model.embed.weight  # shared with the embedding: left alone
    model.wide = nn.Linear(32, 8)  # float32: left alone
    x = torch.randn(5, 32).to(torch.bfloat16)
    with torch.inference_mode():
        before = model.body(x)
    assert pack_linear_weights(model, skip=("pooler",)) == 3
    assert [type(m).__name__ for m in model.body] == ["PackedLinear", "GELU", "PackedLinear"]
    assert type(model.output) is PackedOutputLayer
    assert type(model.pooler) is type(model.wide) is nn.Linear and type(model.tied) is OutputLayer
    assert model.tied.weight is model.embed.weight
    with torch.inference_mode():
        after = model.body(x)
    assert torch.equal(after, before) if EXACT else torch.allclose(after, before, rtol=2e-2, atol=2e-2)


@packs
def test_a_stacked_attention_gives_the_plain_attentions_output_padded_or_not():
    """BERT's attention with q, k and v as one packed product (`PackedAttention`): the plain
    layer's output on a padded batch and on its real tokens alone (`Unpadded`), and
    `pack_linear_weights` swaps it whole (its four layers counted) or, asked, packs them apart."""
    from frugality.kernels.encoder_attention import use_kernel_attention
    from frugality.kernels.packed_linear import PackedAttention
    from frugality.models.bert import Attention, BertConfig, Unpadded

    torch.manual_seed(0)
    cfg = BertConfig(hidden_size=64, num_layers=1, num_heads=4, intermediate_size=128, vocab_size=100)
    plain = Attention(cfg).to(torch.bfloat16)
    stacked = PackedAttention(plain)
    use_kernel_attention(plain)  # the stacked layer's attention arithmetic (the kernel's, where it runs)
    x = torch.randn(4, 40, 64).to(torch.bfloat16)
    keep = (torch.arange(40) < torch.tensor([[9], [5], [2], [1]])).long()  # 17 real of 160 positions
    mask = keep.bool()[:, None, None, :]
    tokens = Unpadded(keep)
    assert len(tokens.index) == Unpadded.MULTIPLE < keep.numel()  # (rows dropped: the unpadded path's own)
    with torch.inference_mode():
        rows = tokens.unpad(x.flatten(0, 1))
        for ours, theirs in (
            (stacked(x, mask), plain(x, mask)),
            (stacked(rows, mask, tokens), plain(rows, mask, tokens)),
        ):
            assert ours.shape == theirs.shape and ours.dtype == torch.bfloat16
            assert torch.equal(ours, theirs) if EXACT else torch.allclose(ours, theirs, rtol=2e-2, atol=2e-2)
        assert stacked(rows, mask, tokens).shape == rows.shape
    model = nn.Module()
    model.attn, model.other = Attention(cfg).to(torch.bfloat16), Attention(cfg).to(torch.bfloat16)
    assert pack_linear_weights(model, skip=("other.out",)) == 4 + 3  # `other` is left whole: its layers apart
    assert type(model.attn) is PackedAttention and type(model.other) is Attention
    assert type(model.other.query) is PackedLinear and type(model.other.out) is nn.Linear
    apart = nn.Module()
    apart.attn = Attention(cfg).to(torch.bfloat16)
    assert pack_linear_weights(apart, stack_attention=False) == 4 and type(apart.attn) is Attention


@pytest.mark.skipif(packing_runs(), reason="oneDNN's bf16 products run here")
def test_without_onednn_bf16_nothing_is_swapped():
    model = nn.Sequential(nn.Linear(8, 8)).to(torch.bfloat16)
    assert pack_linear_weights(model) == 0 and type(model[0]) is nn.Linear
