"""Causal attention for training on CPUs inside compiled regions: the flash forward, and a
backward pass written as batched matrix products over blocks of query rows.

PyTorch's CPU flash-attention backward issues many small matrix products per head and
runs about 5x slower than its forward (measured on a 2-core Xeon with AMX, bf16, 32 heads
of 512 x 64: forward 10 ms, backward 55 ms). The same gradients from a few large batched
products, with the elementwise work between them fused by Inductor, take about 30 ms.
Eagerly, without that fusion, the elementwise passes cost more than they save, so
`causal_attention` only routes here while torch.compile is tracing.

The backward recomputes the attention probabilities from the forward's log-sum-exp, block
by block of `_BLOCK` query rows against only the keys at or before them (causal: about
half the work of the full square). Scores and probabilities are float32, as in the flash
kernel; the products that take them (P^T dO, dS K, dS^T Q) take them rounded to the
input dtype. dK and dV accumulate across blocks in float32.
"""

from __future__ import annotations

import torch

_BLOCK = 256  # query rows per block: fewer, larger products; 32 heads x 256 x 2048 f32 = 64 MB


class CausalAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):  # the float32 products must stay float32
            return _backward(q, k, v, out, lse, grad_out)


def _backward(q, k, v, out, lse, grad_out):
    batch, heads, seq, head_size = q.shape
    scale = head_size**-0.5
    dtype = q.dtype
    q, k, v, out, grad_out = (t.reshape(batch * heads, seq, head_size) for t in (q, k, v, out, grad_out))
    lse = lse.reshape(batch * heads, seq, 1)
    # softmax backward's row term: sum_j P_ij dP_ij = sum_d dO_id O_id
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    dq = torch.empty_like(q)
    dk = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for start in range(0, seq, _BLOCK):
        end = min(start + _BLOCK, seq)
        q_b, k_b, v_b, do_b = q[:, start:end], k[:, :end], v[:, :end], grad_out[:, start:end]
        scores = torch.bmm(q_b.float(), k_b.float().transpose(1, 2))
        rows = torch.arange(start, end, device=q.device)[:, None]
        cols = torch.arange(end, device=q.device)[None, :]
        p = torch.exp(scores * scale - lse[:, start:end]).masked_fill(cols > rows, 0.0)
        dv[:, :end] += torch.bmm(p.to(dtype).transpose(1, 2), do_b).float()
        dp = torch.bmm(do_b, v_b.transpose(1, 2)).float()
        ds = (p * (dp - delta[:, start:end]) * scale).to(dtype)
        dq[:, start:end] = torch.bmm(ds, k_b)
        dk[:, :end] += torch.bmm(ds.transpose(1, 2), q_b).float()
    shape = (batch, heads, seq, head_size)
    return dq.view(shape), dk.to(dtype).view(shape), dv.to(dtype).view(shape)
