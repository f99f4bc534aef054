"""An encoder's attention through the C kernel (kernels/encoder_attention_cpu.c): SDPA's
results up to float32 rounding order, in fp32 and bf16, for head sizes on and off a
vector's lanes (16 with AVX-512, 8 with AVX2: both builds where the CPU has AVX-512), texts
of 1 to 100 tokens, keys masked anywhere; SDPA where it does not apply; and the encoders
that use it give the vectors they give without it."""

import pytest
import torch
import torch.nn.functional as F
from kernel_calls import count_calls

from frugality import kernels
from frugality.hardware import cpu_flags
from frugality.kernels.dispatch import skip_reason
from frugality.kernels.encoder_attention import KernelAttention, attend, attend_unpadded, use_kernel_attention
from frugality.kernels.packed_linear import PackedAttention, pack_linear_weights
from frugality.models.bert import Bert, BertConfig, Unpadded

kernel = pytest.mark.skipif(kernels.encoder_attention_forward() is None, reason=skip_reason("encoder-attention"))


@pytest.fixture
def unpadded_calls(monkeypatch):
    """The unpadded entry's return codes, a call each (kernel_calls: its fallback, the rows
    padded back, gives the same results)."""
    return count_calls(monkeypatch, "encoder_attention_unpadded")


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


def _right(lengths, seq=None):
    """Right-padded mask rows of texts of `lengths` real tokens, padded to `seq`."""
    seq = seq or max(lengths)
    return [[1] * n + [0] * (seq - n) for n in lengths]


def _unpadded_inputs(mask_rows, heads, dim, dtype):
    """An unpadded batch of the texts whose (padded) key masks are `mask_rows`: its Unpadded
    (with the padding rows it keeps for a multiple of 32 rows), the padded q, k, v views and
    mask, and the unpadded rows' views of one (rows, 3 * width) projection."""
    width = heads * dim
    mask = torch.tensor(mask_rows, dtype=torch.long)
    tokens = Unpadded(mask)
    torch.manual_seed(3)
    padded = (torch.randn(*mask.shape, 3 * width) * 2).to(dtype)
    rows = tokens.unpad(padded.flatten(0, 1))
    q, k, v = padded.split(width, dim=2)
    qr, kr, vr = rows.split(width, dim=1)
    return tokens, (q, k, v), mask.bool()[:, None, None, :], (qr, kr, vr)


_HOLES = [[0, 0, 1, 1, 1, 1], [1, 0, 1, 0, 1, 1], [0, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 1]] * 3


def test_unpadded_says_where_each_texts_rows_start_and_which_are_real():
    """`starts` and `keep` for right padding, left padding, holes and a text of no token;
    the rows kept for the multiple of 32 are their texts' padding positions (keep 0)."""
    tokens = Unpadded(torch.tensor([[0, 0, 1, 1], [1, 0, 1, 0], [0, 0, 0, 0]]))
    assert tokens.index.tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]  # (4 real, 8 padding kept)
    assert tokens.starts.tolist() == [0, 4, 8, 12]
    assert tokens.keep.tolist() == [0, 0, 1, 1, 1, 0, 1, 0, 0, 0, 0, 0]
    many = Unpadded(torch.tensor(_right([30, 1, 7], 40)))  # 38 real, 26 kept: the first padding positions
    assert many.starts.tolist() == [0, 40, 57, 64]
    assert many.keep.tolist() == [1] * 30 + [0] * 10 + [1] + [0] * 16 + [1] * 7


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("heads", "dim"), [(12, 32), (4, 8), (2, 16), (3, 80), (2, 12), (2, 4)])
@pytest.mark.parametrize(
    "mask_rows",
    [_right([17]), _right([5, 29, 1, 12, 0, 29, 3]), _right([2] * 40), _right([40, 1]), _right([3, 9], 50), _HOLES],
    ids=["one-text", "mixed", "forty-short", "long-and-short", "padded-past-the-longest", "left-padding-and-holes"],
    # (padding rows kept for the multiple of 32 in mixed, long-and-short, padded-past-the-longest
    # and the holes; a text of no token in mixed and the holes, one of only padding rows there)
)
def test_an_unpadded_batch_gives_the_padded_batchs_rows(unpadded_calls, dtype, heads, dim, mask_rows):
    """The rows as they are: the bits of the batch padded back, attended and unpadded (the
    same arithmetic a text and head at a time), and a padding row kept for the multiple of
    32 (its key masked) gets its row as in the padded batch."""
    tokens, (q, k, v), mask, (qr, kr, vr) = _unpadded_inputs(mask_rows, heads, dim, dtype)
    got = attend_unpadded(qr, kr, vr, mask, tokens, heads)
    assert unpadded_calls == [0] and got is not None
    assert got.shape == qr.shape and got.dtype == dtype and got.is_contiguous()
    assert torch.equal(got, tokens.unpad(attend(q, k, v, mask, heads).flatten(0, 1)))
    reference = tokens.unpad(_sdpa(q, k, v, mask, heads, torch.float64).flatten(0, 1)).nan_to_num()
    assert (got.double() - reference).abs().max() <= (1e-4 if dtype == torch.float32 else 0.05)


def test_where_the_unpadded_kernel_does_not_apply_the_rows_are_padded_back(monkeypatch, unpadded_calls):
    """attend_unpadded answers None (its callers pad the rows back) for rows that are not
    the batch's, a mask it cannot read as the batch's keys, gradients, another dtype or the
    kernel switched off; starts that do not rise from 0 to the rows' count are refused by
    the kernel itself."""
    tokens, _, mask, (q, k, v) = _unpadded_inputs(_right([3, 9, 4]), 2, 16, torch.float32)
    assert attend_unpadded(q[:-1], k[:-1], v[:-1], mask, tokens, 2) is None
    assert attend_unpadded(q.half(), k.half(), v.half(), mask, tokens, 2) is None
    for other in (None, mask.float(), mask[:2], mask[..., :-1]):
        assert attend_unpadded(q, k, v, other, tokens, 2) is None
    with torch.enable_grad():
        assert attend_unpadded(q.requires_grad_(), k, v, mask, tokens, 2) is None
    q = q.detach()
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "encoder-attention")
    assert attend_unpadded(q, k, v, mask, tokens, 2) is None
    monkeypatch.delenv("FRUGALITY_DISABLE_KERNELS")
    assert unpadded_calls == []
    raw = kernels.encoder_attention_unpadded()
    if raw is None:
        pytest.skip(skip_reason("encoder-attention"))
    rows = q.shape[0]
    assert tokens.starts.tolist() == [0, 9, 18, rows]  # (every position kept: 16 real, 27 under 32)
    out = torch.full(q.shape, 7.0)
    for starts in (
        [1, 3, 12, rows],
        [0, 9, 3, rows],
        [0, 3, 12, rows + 1],
        [0, 3, 12, rows - 1],
        [0, 3, rows + 5, rows],
    ):
        bad = torch.tensor(starts, dtype=torch.int64)
        code = raw(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), tokens.keep.data_ptr(), out.data_ptr(), bad.data_ptr(),
            3, rows, 2, 16, q.stride(0), 0.25, 0, 1,
        )  # fmt: skip
        assert code == -4, starts
    assert torch.equal(out, torch.full(q.shape, 7.0))  # (nothing written)


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
def test_an_encoder_gives_its_vectors_with_the_kernel_or_without(monkeypatch, unpadded_calls, dtype):
    """A small BERT, its attention swapped for the kernel's (plain and, in bf16 where
    packing runs, packed): padded and unpadded batches (the latter's rows attended as they
    are) give the plain model's vectors."""
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
    uses_kernel = kernels.encoder_attention_forward() is not None
    assert unpadded_calls == ([0] * config.num_layers if uses_kernel else [])


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
    unpadded = kernels._function(
        "encoder-attention",
        "encoder_attention_cpu",
        "encoder_attention_unpadded",
        ctypes.c_int64,
        [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 5 + [ctypes.c_float, ctypes.c_int, ctypes.c_int],
        extra_flags=("-mno-avx512f",),
    )
    assert unpadded is not None
    for heads, dim in ((12, 32), (4, 8)):
        tokens, _, mask, (q, k, v) = _unpadded_inputs(_HOLES, heads, dim, dtype)
        out = torch.empty(q.shape, dtype=dtype)
        code = unpadded(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), tokens.keep.data_ptr(), out.data_ptr(),
            tokens.starts.data_ptr(), tokens.rows, q.shape[0], heads, dim, q.stride(0), dim**-0.5,
            int(dtype == torch.bfloat16), 2,
        )  # fmt: skip
        assert code == 0
        torch.testing.assert_close(
            out, attend_unpadded(q, k, v, mask, tokens, heads), rtol=1e-5, atol=1e-5 if dtype == torch.float32 else 1e-2
        )
