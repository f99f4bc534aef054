"""The CPU training attention (flash forward, blocked backward) against float64 attention."""

import pytest
import torch
import torch.nn.functional as F
from torch._dynamo.backends.debugging import aot_eager

from frugality.models import cpu_attention
from frugality.models.cpu_attention import CausalAttention
from frugality.models.layers import causal_attention


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
    return [((a.double() - b).norm() / b.norm()).item() for a, b in zip(outputs, references)]


@pytest.mark.parametrize("dtype, tolerance", [(torch.float32, 1e-5), (torch.bfloat16, 1.5e-2)])
def test_gradients_match_float64_attention(monkeypatch, dtype, tolerance):
    monkeypatch.setattr(cpu_attention, "_BLOCK", 16)  # 40 rows: blocks of 16, 16 and 8
    q, k, v, grad = _inputs(dtype)
    out = CausalAttention.apply(q, k, v)
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
        torch.testing.assert_close(causal_attention(q, k, v),
                                   F.scaled_dot_product_attention(q, k, v, is_causal=True))
