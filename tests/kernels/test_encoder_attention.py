"""An encoder's attention through the C kernel (kernels/encoder_attention_cpu.c): SDPA's
results up to float32 rounding order, in fp32 and bf16, for head sizes on and off a
vector's lanes (16 with AVX-512, 8 with AVX2: both builds where the CPU has AVX-512), texts
of 1 to 100 tokens, keys masked anywhere; SDPA where it does not apply; and the encoders
that use it give the vectors they give without it."""

import pytest
import torch
import torch.nn.functional as F

from frugality import kernels
from frugality.hardware import cpu_flags
from frugality.kernels.dispatch import skip_reason
from frugality.kernels.encoder_attention import KernelAttention, attend, use_kernel_attention
from frugality.kernels.packed_linear import PackedAttention, pack_linear_weights
from frugality.models.bert import Bert, BertConfig

kernel = pytest.mark.skipif(kernels.encoder_attention_forward() is None, reason=skip_reason("encoder-attention"))


def _inputs(batch, seq, heads, dim, dtype, seed=0):
    """q, k, v as views of one packed (batch, seq, 3 * heads * dim) projection, and a key
    mask with padding at the ends of half the texts and a hole in one."""
    torch.manual_seed(seed)
    width = heads * dim
    qkv = (torch.randn(batch, seq, 3 * width) * 2).to(dtype)
    keep = torch.ones(batch, seq, dtype=torch.bool)
    keep[: batch // 2, max(1, seq // 2) :] = False
    if batch > 2 and seq > 4:
        keep[-1, 2:4] = False
    q, k, v = qkv.split(width, dim=2)
    return q, k, v, keep[:, None, None, :]


def _sdpa(q, k, v, mask, heads, dtype=None):
    b, t, width = q.shape
    q, k, v = (x.to(dtype or x.dtype).view(b, t, heads, -1).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, width)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("batch", "seq", "heads", "dim"),
    [
        (1, 1, 2, 32), (3, 17, 12, 32), (8, 29, 4, 8), (2, 33, 3, 80), (5, 100, 2, 64), (4, 7, 1, 256),
        (3, 9, 2, 12), (2, 18, 3, 24), (2, 40, 2, 40), (1, 5, 1, 3), (3, 21, 2, 16), (2, 40, 3, 4), (2, 1, 2, 8),
    ],  # (head sizes ending a vector short, or a second vector short, of 8 and 16 lanes; up to 16
    # the queries run across the lanes: texts of one, two and three vectors of them)
)  # fmt: skip
def test_the_kernel_gives_sdpas_results(dtype, batch, seq, heads, dim):
    q, k, v, mask = _inputs(batch, seq, heads, dim, dtype)
    got = attend(q, k, v, mask, heads)
    reference = _sdpa(q, k, v, mask, heads, torch.float64)
    assert got.dtype == dtype and got.shape == q.shape and got.is_contiguous()
    if dtype == torch.float32:
        torch.testing.assert_close(got, reference.float(), rtol=1e-5, atol=1e-5)
    else:  # as close to float64 as torch's own bf16 attention, within one bf16 rounding
        ours = (got.double() - reference).abs().max().item()
        theirs = (_sdpa(q, k, v, mask, heads).double() - reference).abs().max().item()
        assert ours <= max(theirs, reference.abs().max().item() * 2**-8)


@kernel
@pytest.mark.parametrize("heads", [4, 2])  # (heads of 16: queries across the lanes; of 32: in tiles)
def test_separate_projections_no_mask_and_a_text_with_no_key(heads):
    """Three tensors of one layout (BERT's plain attention), no mask; a text whose keys are
    all masked gets zeros (SDPA: NaN), the others their rows."""
    torch.manual_seed(1)
    q, k, v = (torch.randn(3, 9, 64) for _ in range(3))
    torch.testing.assert_close(attend(q, k, v, None, heads), _sdpa(q, k, v, None, heads), rtol=1e-5, atol=1e-5)
    keep = torch.ones(3, 9, dtype=torch.bool)
    keep[1] = False
    got = attend(q, k, v, keep[:, None, None, :], heads)
    assert torch.equal(got[1], torch.zeros(9, 64))
    reference = _sdpa(q, k, v, keep[:, None, None, :], heads)[[0, 2]]
    torch.testing.assert_close(got[[0, 2]], reference, rtol=1e-5, atol=1e-5)


def test_where_the_kernel_does_not_apply_it_is_sdpa(monkeypatch):
    """Gradients, another dtype, mismatched layouts, the kernel switched off: SDPA's bits."""
    q, k, v, mask = _inputs(2, 5, 2, 16, torch.float32)
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "encoder-attention")
    assert torch.equal(attend(q, k, v, mask, 2), _sdpa(q, k, v, mask, 2))
    monkeypatch.delenv("FRUGALITY_DISABLE_KERNELS")
    qkv = torch.cat([q, k, v], dim=2).requires_grad_()  # (one layout, as the kernel takes it)
    out = attend(*qkv.split(q.shape[2], dim=2), mask, 2)
    assert out.grad_fn is not None and torch.equal(out.detach(), _sdpa(q, k, v, mask, 2))
    out.sum().backward()
    assert qkv.grad is not None
    half = [x.half() for x in (q, k, v)]
    assert torch.equal(attend(*half, mask, 2), _sdpa(*half, mask, 2))
    assert torch.equal(attend(q.contiguous(), k, v, mask, 2), _sdpa(q.contiguous(), k, v, mask, 2))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_encoder_gives_its_vectors_with_the_kernel_or_without(monkeypatch, dtype):
    """A small BERT, its attention swapped for the kernel's (plain and, in bf16 where
    packing runs, packed): padded and unpadded batches give the plain model's vectors."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_seq_len=64
    )
    plain = Bert(config).to(dtype).eval()
    ids = torch.randint(0, 300, (5, 23))
    mask = torch.ones(5, 23, dtype=torch.long)
    mask[1:, 11:] = 0
    mask[3, 3:] = 0
    swapped = Bert(config).to(dtype).eval()
    swapped.load_state_dict(plain.state_dict())
    if dtype == torch.bfloat16:
        pack_linear_weights(swapped, skip=("pooler", "mlm"))
    swapped_count = use_kernel_attention(swapped)
    kinds = {type(m) for m in swapped.modules()}
    if kernels.encoder_attention_forward() is None:
        assert swapped_count == 0
    else:
        assert KernelAttention in kinds or PackedAttention in kinds
    with torch.inference_mode():
        for unpad in (False, True):
            ours = swapped.embed(ids, mask, unpad=unpad).float()
            theirs = plain.embed(ids, mask, unpad=unpad).float()
            cosine = F.cosine_similarity(ours, theirs, dim=-1)
            assert cosine.min() >= (0.99999 if dtype == torch.float32 else 0.999), (unpad, cosine)


@kernel
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the 8-lane build is the default where there is no AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_sdpas_results_too(dtype):
    """The kernel as an AVX2-only CPU builds it (8 lanes), run on this AVX-512 one."""
    import ctypes

    narrow = kernels._function(
        "encoder-attention",
        "encoder_attention_cpu",
        "encoder_attention_forward",
        ctypes.c_int64,
        [ctypes.c_void_p] * 5 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int, ctypes.c_int],
        extra_flags=("-mno-avx512f",),
    )
    assert narrow is not None
    for batch, seq, heads, dim in ((3, 17, 12, 32), (2, 11, 3, 12), (2, 21, 2, 20), (8, 29, 4, 8), (2, 19, 2, 16)):
        q, k, v, mask = _inputs(batch, seq, heads, dim, dtype)
        out = torch.empty(q.shape, dtype=dtype)
        keep = mask.reshape(batch, seq).to(torch.uint8)
        code = narrow(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), keep.data_ptr(), out.data_ptr(),
            batch, seq, heads, dim, q.stride(0), q.stride(1), dim**-0.5, int(dtype == torch.bfloat16), 2,
        )  # fmt: skip
        assert code == 0
        torch.testing.assert_close(
            out, attend(q, k, v, mask, heads), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2
        )
