"""A residual add and LayerNorm through the C kernel (kernels/layer_norm_cpu.c): torch's
`norm(x + r)` up to float32 summation order, in fp32 and bf16, for widths on and off a
vector's lanes, row counts on and off its blocks of 8 rows, r a tensor, one row or absent,
one thread and two (both builds where the CPU has AVX-512); torch's expression where it
does not apply; and BERT's blocks and embeddings that use it give the vectors they give
without it."""

import ctypes
import itertools

import pytest
import torch
import torch.nn.functional as F
from kernel_calls import count_calls
from torch import nn

from frugality import kernels
from frugality.hardware import cpu_flags
from frugality.kernels import layer_norm
from frugality.kernels.dispatch import skip_reason
from frugality.kernels.layer_norm import KernelBlock, KernelEmbeddings, add_layer_norm, use_kernel_layer_norm
from frugality.models.bert import Bert, BertConfig

kernel = pytest.mark.skipif(kernels.add_layer_norm() is None, reason=skip_reason("layer-norm"))


@pytest.fixture(autouse=True)
def every_size(monkeypatch):
    """The kernel for every size (small ones otherwise take torch's cheaper call)."""
    monkeypatch.setattr(layer_norm, "MIN_ELEMENTS", 1)


@pytest.fixture
def calls(monkeypatch):
    """The kernel's return codes, a call each (kernel_calls: its fallback gives torch's results too)."""
    return count_calls(monkeypatch, "add_layer_norm")


def _norm(width, dtype, seed=0, eps=1e-12):
    torch.manual_seed(seed)
    norm = nn.LayerNorm(width, eps=eps).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
        norm.bias.normal_()
    return norm


def _close(got, norm, x, r):
    """got is torch's `norm(x + r)`: in fp32 to float32 rounding; in bf16 no further from
    float64 (on the same bf16 sum) than torch's own, within one bf16 rounding."""
    s = x if r is None else x + r  # (in bf16: rounded, as the kernel rounds it)
    theirs = norm(s)
    assert got.dtype == x.dtype and got.shape == x.shape
    if x.dtype == torch.float32:
        torch.testing.assert_close(got, theirs, rtol=1e-5, atol=1e-5)
        return
    exact = F.layer_norm(s.double(), norm.normalized_shape, norm.weight.double(), norm.bias.double(), norm.eps)
    ours, torchs = (got.double() - exact).abs().max().item(), (theirs.double() - exact).abs().max().item()
    assert ours <= max(torchs, exact.abs().max().item() * 2**-8)
    assert (got != theirs).float().mean().item() < 0.01  # the same bits nearly everywhere


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [5, 32, 37, 384])
@pytest.mark.parametrize("rows", [1, 9, 1_203])  # (under a block of 8, one over, and two threads' worth)
@pytest.mark.parametrize("residual", ["tensor", "row", None])
def test_the_kernel_gives_torchs_results(calls, dtype, width, rows, residual):
    norm = _norm(width, dtype)
    x = (torch.randn(rows, width) * 3 + 1).to(dtype)
    r = {"tensor": torch.randn(rows, width), "row": torch.randn(width), None: None}[residual]
    r = r.to(dtype) if r is not None else None
    with torch.inference_mode():
        _close(add_layer_norm(x, r, norm), norm, x, r)
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            _close(add_layer_norm(x, r, norm), norm, x, r)
        finally:
            torch.set_num_threads(threads)
    assert calls == [0, 0]  # (the kernel's results, not its fallback's)


@kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("eps", [1e-5, 0.1])
def test_eps_and_rows_of_equal_values(calls, dtype, eps):
    """eps counts as torch counts it, and a row of equal values (a zero variance) gives the
    bias exactly, as torch's Welford moments give it (the mean's rounding left in the
    variance gave weight + bias once)."""
    norm = _norm(37, dtype, eps=eps)
    x = (torch.randn(40, 37) * 0.05).to(dtype)  # (small values: eps matters)
    x[::3] = (torch.randn(14, 1) * 3).to(dtype)  # every third row all one value
    with torch.inference_mode():
        got = add_layer_norm(x, None, norm)
        _close(got, norm, x, None)
        assert torch.equal(got[::3], norm.bias.expand(14, 37))
    assert calls == [0]


def test_where_the_kernel_does_not_apply_it_is_torchs(monkeypatch):
    """The kernel switched off, gradients, another dtype, rows apart, a norm without an affine
    part, fewer elements than MIN_ELEMENTS: torch's own bits; tensors on another device:
    torch's error."""
    norm = _norm(16, torch.float32)
    x, r = torch.randn(6, 16), torch.randn(6, 16)
    with torch.no_grad(), monkeypatch.context() as small:
        small.setattr(layer_norm, "MIN_ELEMENTS", 6 * 16 + 1)

        def never():
            raise AssertionError("the kernel was asked for under MIN_ELEMENTS")

        small.setattr(kernels, "add_layer_norm", never)
        assert torch.equal(add_layer_norm(x, r, norm), norm(x + r))
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "layer-norm")
    assert torch.equal(add_layer_norm(x, r, norm), norm(x + r))
    monkeypatch.delenv("FRUGALITY_DISABLE_KERNELS")
    out = add_layer_norm(x, r, norm)  # (the norm's parameters want gradients)
    assert out.grad_fn is not None and torch.equal(out, norm(x + r))
    out.sum().backward()
    assert norm.weight.grad is not None
    with torch.no_grad():
        half = _norm(16, torch.float16)
        assert torch.equal(add_layer_norm(x.half(), r.half(), half), half(x.half() + r.half()))
        wide = torch.randn(16, 6).t()  # (rows apart)
        assert torch.equal(add_layer_norm(wide, r, norm), norm(wide + r))
        bare = nn.LayerNorm(16, elementwise_affine=False)
        assert torch.equal(add_layer_norm(x, r, bare), bare(x + r))
        # a residual or a norm on another device: torch's error, not a pointer the kernel misreads
        with pytest.raises(RuntimeError, match="device"):
            add_layer_norm(x, r.to("meta"), norm)
        with pytest.raises(RuntimeError, match="device"):
            add_layer_norm(x, r, nn.LayerNorm(16, device="meta"))


@kernel
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the 8-lane build is the default where there is no AVX-512")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_avx2_build_gives_torchs_results_too(dtype):
    """The kernel as an AVX2-only CPU builds it (8 lanes), run on this AVX-512 one."""
    narrow = kernels._function(
        "layer-norm",
        "layer_norm_cpu",
        "add_layer_norm",
        ctypes.c_int64,
        [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
        + [ctypes.c_void_p] * 3
        + [ctypes.c_int64] * 2
        + [ctypes.c_float, ctypes.c_int, ctypes.c_int],
        extra_flags=("-mno-avx512f",),
    )
    assert narrow is not None
    for (rows, width), residual in itertools.product(((1, 5), (17, 32), (1_100, 37)), ("tensor", "row", None)):
        norm = _norm(width, dtype)
        x = torch.randn(rows, width).to(dtype)
        r = {"tensor": torch.randn(rows, width), "row": torch.randn(width), None: None}[residual]
        r = r.to(dtype) if r is not None else None
        out = torch.empty_like(x)
        with torch.no_grad():
            code = narrow(
                x.data_ptr(), 0 if r is None else r.data_ptr(), width if residual == "tensor" else 0,
                norm.weight.data_ptr(), norm.bias.data_ptr(), out.data_ptr(), rows, width, norm.eps,
                int(dtype == torch.bfloat16), 2,
            )  # fmt: skip
            assert code == 0
            _close(out, norm, x, r)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_encoder_gives_its_vectors_with_the_kernel_or_without(calls, dtype):
    """A small BERT, its blocks and embeddings swapped for the kernel's: padded and unpadded
    batches, with token types and without, give the plain model's vectors."""
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=300, hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, max_seq_len=64
    )
    plain = Bert(config).to(dtype).eval()
    swapped = Bert(config).to(dtype).eval()
    swapped.load_state_dict(plain.state_dict())
    count = use_kernel_layer_norm(swapped)
    kinds = {type(m) for m in swapped.modules()}
    if kernels.add_layer_norm() is None:
        assert count == 0
    else:
        assert count == 3 and KernelBlock in kinds and KernelEmbeddings in kinds
    ids = torch.randint(0, 300, (5, 23))
    mask = torch.ones(5, 23, dtype=torch.long)
    mask[1:, 11:] = 0
    types = torch.randint(0, 2, (5, 23))
    with torch.inference_mode():
        for unpad in (False, True):
            for token_types in (None, types):
                ours = swapped.embed(ids, mask, token_types, unpad=unpad).float()
                theirs = plain.embed(ids, mask, token_types, unpad=unpad).float()
                cosine = F.cosine_similarity(ours, theirs, dim=-1)
                assert cosine.min() >= (0.99999 if dtype == torch.float32 else 0.999), (unpad, cosine)
    # (2 layers' 2 norms and the embeddings' one, in 4 forwards, where the kernel runs)
    assert calls == ([0] * 20 if count else [])
