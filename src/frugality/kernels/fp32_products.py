"""bf16 storage, fp32 products: linear layers for hardware without native bf16 products
(CPUs without AMX or AVX512-BF16, CUDA GPUs before compute capability 8.0).

There torch's bf16 matrix products run in emulated bf16 (a 2048^3 product at 0.3 GFLOP/s
against 173 in fp32 on a 2-core AVX2 AMD EPYC), so a bf16 policy would train hundreds of
times slower than fp32. `Fp32ProductLinear` keeps the weights, gradients and activations
in bf16 (the policy's memory saving stays) and runs each of the three products in float32
from the upcast bf16 operands, rounding each result to bf16 once: the same values torch's
bf16 products give up to float32 accumulation order (they too accumulate in float32).
Only bf16 tensors are saved for backward.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _Fp32ProductLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = F.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return out.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1]).float()
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight.float()).to(x.dtype).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = (g.t() @ x.reshape(-1, x.shape[-1]).float()).to(weight.dtype)
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0).to(weight.dtype)
        return grad_x, grad_w, grad_b


class Fp32ProductLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) whose bf16 products run in float32."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != torch.bfloat16 and self.weight.dtype != torch.bfloat16:
            return F.linear(x, self.weight, self.bias)
        return _Fp32ProductLinear.apply(x, self.weight, self.bias)
