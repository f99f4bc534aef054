"""CPU attention against float64 attention and torch: the AMX kernel ops (where the CPU has
AMX) and the compiled blocked backward (everywhere)."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager

from frugality.kernels import attention as cpu_attention
from frugality.kernels.attention import BlockedBackwardAttention, causal_attention
from frugality.kernels.dispatch import skip_reason
from frugality.models.layers import RotaryEmbedding


def _inputs(dtype, heads=4, kv_heads=4, seq=40, head_size=16):
    torch.manual_seed(0)
    q = torch.randn(2, heads, seq, head_size, dtype=dtype, requires_grad=True)
    k = torch.randn(2, kv_heads, seq, head_size, dtype=dtype, requires_grad=True)
    v = torch.randn(2, kv_heads, seq, head_size, dtype=dtype, requires_grad=True)
    return q, k, v, torch.randn(2, heads, seq, head_size, dtype=dtype)


def _reference(q, k, v, grad):
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    out = F.scaled_dot_product_attention(q64, k64, v64, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])
    return out, torch.autograd.grad(out, (q64, k64, v64), grad.double())


def _relative_errors(outputs, references):
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(outputs, references, strict=True)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
def test_gradients_match_float64_attention(monkeypatch, dtype, tolerance):
    monkeypatch.setattr(cpu_attention, "_BLOCK", 16)  # 40 rows: blocks of 16, 16 and 8
    q, k, v, grad = _inputs(dtype)
    out = BlockedBackwardAttention.apply(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_out, ref_grads = _reference(q, k, v, grad)
    assert max(_relative_errors([out, *grads], [ref_out, *ref_grads])) < tolerance


def test_compiled_training_takes_it_with_grouped_heads_and_matches():
    q, k, v, grad = _inputs(torch.float32, heads=4, kv_heads=2)
    graphs = []

    def backend(gm, example_inputs):  # dynamo's graph, then AOT autograd as in training
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    out = torch.compile(causal_attention, backend=backend, fullgraph=True)(q, k, v)
    assert "autograd_function_apply" in graphs[0] and "scaled_dot_product_attention" not in graphs[0]
    grads = torch.autograd.grad(out, (q, k, v), grad)
    ref_out, ref_grads = _reference(q, k, v, grad)
    assert max(_relative_errors([out, *grads], [ref_out, *ref_grads])) < 1e-5


def test_eager_and_inference_keep_sdpa():
    q, k, v, _ = _inputs(torch.float32)
    with torch.no_grad():
        torch.testing.assert_close(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


amx = pytest.mark.skipif(not cpu_attention.amx_kernel_runs(), reason=skip_reason("amx-attention"))


@amx
@pytest.mark.parametrize(
    "heads, kv_heads, seq, head_size, rotary_dim", [(3, 3, 96, 32, 0), (4, 2, 64, 64, 16), (2, 2, 128, 128, 128)]
)
def test_amx_kernel_is_as_close_to_float64_as_torch(heads, kv_heads, seq, head_size, rotary_dim):
    """Forward, log-sum-exp and all three gradients, against float64; the bar is torch's own
    bf16 rotary + attention's error (96 rows: a last block of 32; 4 over 2 heads: grouped;
    rotary on a quarter of the channels as in Pythia, or on all as in Llama)."""
    q, k, v, grad = _inputs(torch.bfloat16, heads, kv_heads, seq, head_size)
    rotary = RotaryEmbedding(rotary_dim, seq, head_size=head_size) if rotary_dim else None
    assert cpu_attention.amx_attention_applies(q, k, v)
    out = causal_attention(q, k, v, rotary)
    grads = torch.autograd.grad(out, (q, k, v), grad)

    def rotated(*tensors):
        return tensors if rotary is None else (rotary(tensors[0]), rotary(tensors[1]), tensors[2])

    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_out = F.scaled_dot_product_attention(*rotated(q64, k64, v64), is_causal=True, enable_gqa=kv_heads != heads)
    ref_grads = torch.autograd.grad(ref_out, (q64, k64, v64), grad.double())
    q_, k_, v_ = (t.detach().clone().requires_grad_() for t in (q, k, v))
    torch_out = F.scaled_dot_product_attention(*rotated(q_, k_, v_), is_causal=True, enable_gqa=kv_heads != heads)
    torch_grads = torch.autograd.grad(torch_out, (q_, k_, v_), grad)
    ours = _relative_errors([out, *grads], [ref_out, *ref_grads])
    theirs = _relative_errors([torch_out, *torch_grads], [ref_out, *ref_grads])
    assert all(o < 1.25 * t + 1e-3 for o, t in zip(ours, theirs, strict=True)), (ours, theirs)

    if rotary is None:  # the log-sum-exp the backward pass starts from
        group = heads // kv_heads
        none = torch.empty(0)
        _, lse = cpu_attention._amx_forward(
            q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), none, none, 0
        )
        scores = (q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2)) * head_size**-0.5
        scores = scores.masked_fill(torch.ones(seq, seq, dtype=torch.bool).triu(1), float("-inf"))
        torch.testing.assert_close(lse.double(), scores.logsumexp(-1), atol=1e-3, rtol=0)


@amx
def test_amx_kernel_in_compiled_training_is_one_op_without_graph_breaks():
    q, k, v, grad = _inputs(torch.bfloat16, seq=64, head_size=32)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(gm.code)
        return aot_eager(gm, example_inputs)

    out = torch.compile(causal_attention, backend=backend, fullgraph=True)(q, k, v)
    assert "amx_attention" in graphs[0] and "scaled_dot_product_attention" not in graphs[0]
    grads = torch.autograd.grad(out, (q, k, v), grad)
    eager_grads = torch.autograd.grad(causal_attention(q, k, v), (q, k, v), grad)
    for a, b in zip(grads, eager_grads, strict=True):
        assert torch.equal(a, b)  # the same kernel, compiled or not


@amx
def test_amx_kernel_leaves_onednn_products_correct():
    """The kernel configures AMX tiles on torch's threads; oneDNN's bf16 products (AMX too)
    must be unaffected afterwards."""
    q, k, v, _ = _inputs(torch.bfloat16, seq=64, head_size=32)
    a, b = torch.randn(256, 512, dtype=torch.bfloat16), torch.randn(512, 384, dtype=torch.bfloat16)
    before = a @ b
    causal_attention(q, k, v).sum().backward()
    torch.testing.assert_close(a @ b, before, rtol=0, atol=0)
    torch.testing.assert_close((a @ b).float(), a.float() @ b.float(), rtol=2e-2, atol=2e-2)


def test_shapes_the_kernel_does_not_take_go_to_sdpa():
    q, k, v, _ = _inputs(torch.bfloat16, seq=40, head_size=16)  # neither a multiple of 32
    assert not cpu_attention.amx_attention_applies(q, k, v)
    with torch.no_grad():
        torch.testing.assert_close(causal_attention(q, k, v), F.scaled_dot_product_attention(q, k, v, is_causal=True))


@amx
def test_amx_kernel_reads_views_of_a_fused_projection_and_gives_the_same_bits():
    """q, k, v as the models slice them from one QKV projection (rows 3 x heads x dim apart):
    no copies, and the same results as from contiguous copies. The output comes laid out
    (batch, seq, heads, dim), so merging the heads is a view."""
    torch.manual_seed(0)
    batch, seq, heads, dim = 2, 64, 3, 32
    qkv = torch.randn(batch, seq, heads, 3, dim, dtype=torch.bfloat16, requires_grad=True)
    grad = torch.randn(batch, heads, seq, dim, dtype=torch.bfloat16)
    q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))
    out = causal_attention(q, k, v)
    assert out.transpose(1, 2).is_contiguous()
    (d_qkv,) = torch.autograd.grad(out, qkv, grad)
    copies = [t.detach().contiguous().requires_grad_() for t in (q, k, v)]
    out2 = causal_attention(*copies)
    grads2 = torch.autograd.grad(out2, copies, grad)
    assert torch.equal(out, out2)
    assert torch.equal(d_qkv, torch.stack([g.transpose(1, 2) for g in grads2], dim=3))


@amx
def test_amx_ops_pass_torch_opcheck():
    """Schema, fake (meta) kernels, autograd registration and AOT dispatch of both custom ops,
    as torch.compile relies on them."""
    q, k, v, grad = _inputs(torch.bfloat16, seq=64, head_size=32)
    rotary = RotaryEmbedding(16, 64, head_size=32)
    tables = (rotary.cos[:64], rotary.sin[:64], 16)
    torch.library.opcheck(cpu_attention._amx_forward, (q, k, v, *tables))
    out, lse = cpu_attention._amx_forward(q, k, v, *tables)
    args = (q, k, v, out.transpose(1, 2), lse, grad, *tables)
    # no double backward: the backward op's inputs carry no gradient
    torch.library.opcheck(cpu_attention._amx_backward, tuple(t.detach() if torch.is_tensor(t) else t for t in args))
