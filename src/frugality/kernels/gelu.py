"""Exact (erf) GELU through a C kernel for bf16 on CPUs with AVX-512 (kernels/gelu_cpu.c);
`KernelGELU` is swapped in for the models' nn.GELU by `frugality.kernels.specialize`.

Inside a compiled block, Inductor's generated GELU kernels were the largest elementwise
cost on a 2-core Xeon: 4.0 ms forward and 6.1 ms backward for a Pythia-70m MLP's 2048 x 2048
activations, against 3.0 and 3.3 ms for the kernel (one alternating run, 21 calls each).
The backward gains most: the derivative needs exp(-x^2 / 2), the exponential inside the
kernel's erf formula, so one exp serves both. Results are within float32 rounding of
torch's (bf16 bits equal for 99% of the forward's elements and all but a few backward)
and as close to float64. Elsewhere (other dtypes and devices, CPUs without AVX-512,
non-contiguous inputs, under autocast) it is `F.gelu`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugality import kernels


def gelu(x: torch.Tensor) -> torch.Tensor:
    """F.gelu (exact), through the kernel where it applies."""
    if (
        x.device.type == "cpu"
        and x.dtype == torch.bfloat16
        and x.is_contiguous()
        and x.numel() > 0
        and not torch.is_autocast_enabled("cpu")
        and kernel_runs()
    ):
        return gelu_op(x)
    return F.gelu(x)


@torch.compiler.assume_constant_result  # asked once; compiled graphs keep the answer
def kernel_runs() -> bool:
    """The kernel may run here (frugality.kernels.dispatch: AVX-512 with bf16) and builds:
    tried once on a tiny input."""
    if "runs" not in _KERNEL_TRIED:
        kernel = kernels.gelu_bf16()
        x, y = torch.zeros(16, dtype=torch.bfloat16), torch.empty(16, dtype=torch.bfloat16)
        _KERNEL_TRIED["runs"] = kernel is not None and kernel(x.data_ptr(), y.data_ptr(), 16, 1) == 0
    return _KERNEL_TRIED["runs"]


_KERNEL_TRIED: dict[str, bool] = {}


def _check(code: int) -> None:
    if code != 0:
        raise RuntimeError(f"GELU kernel failed (code {code})")


@torch.library.custom_op("frugality::gelu", mutates_args=())
def gelu_op(x: torch.Tensor) -> torch.Tensor:
    """Exact GELU of a contiguous bf16 CPU tensor."""
    out = torch.empty_like(x)
    kernel = kernels.gelu_bf16()
    assert kernel is not None  # kernel_runs() found it before KernelGELU was swapped in
    _check(kernel(x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads()))
    return out


@gelu_op.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("frugality::gelu_backward", mutates_args=())
def gelu_backward_op(grad: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """grad times GELU's derivative at x (contiguous bf16 CPU tensors of one shape)."""
    grad = grad.contiguous()
    out = torch.empty_like(x)
    kernel = kernels.gelu_backward_bf16()
    assert kernel is not None  # (as gelu_op's)
    _check(kernel(grad.data_ptr(), x.data_ptr(), out.data_ptr(), x.numel(), torch.get_num_threads()))
    return out


@gelu_backward_op.register_fake
def _(grad, x):
    return torch.empty_like(x)


def _save_input(ctx, inputs, output) -> None:
    ctx.save_for_backward(inputs[0])


def _gradient(ctx, grad: torch.Tensor):
    (x,) = ctx.saved_tensors
    return gelu_backward_op(grad.to(x.dtype), x)


gelu_op.register_autograd(_gradient, setup_context=_save_input)


class KernelGELU(nn.GELU):
    """nn.GELU (exact) through `gelu`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gelu(x)
