"""Linear layers whose products run through C kernels for bf16 on CPUs with AMX
(`AMXLinear`, swapped in for nn.Linear by `frugality.kernels.specialize`).

A linear layer's weight gradient, dW = dY^T X, reduces over the tokens, and both operands
are laid out token-major, the layout oneDNN's AMX products handle worst. `weight_grad`
(kernels/weight_grad_cpu.c) lays the operands out in AMX's blocked tile order first. The
forward product x W^T goes through `product` (kernels/matmul_cpu.c), which rounds each
finished block to bf16 while the tile unit computes the next. Input gradients dY W stay
oneDNN's, except past K = 4096 (an output layer's, K = its vocabulary), where the kernel's
chunked variant takes them. Measured against oneDNN at Pythia-70m's shapes and 2048 tokens
(benchmarks/linear_products.py, two runs one night on a shared 2-core Xeon): weight
gradients 1.11-1.37x on the block shapes, 1.04-1.05x on the output layer's (against
oneDNN plus the transposes that product needed); forward products 1.0-1.4x on the block
shapes, 1.18-1.68x on the output layer's; the block shapes' input gradients 0.85-1.06x
(so oneDNN's), the output layer's 0.97-1.26x. Elsewhere (other dtypes and devices, shapes
that are not multiples of 32, CPUs without AMX) it is torch's product, so the kernels only
ever change speed, and the accumulation order within float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugality import kernels


def weight_grad_applies(grad_out: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether `weight_grad` takes these (tokens, outputs) and (tokens, inputs) tensors."""
    return (
        grad_out.device.type == "cpu"
        and grad_out.dtype == x.dtype == torch.bfloat16
        and grad_out.dim() == x.dim() == 2
        and grad_out.shape[0] == x.shape[0]
        and grad_out.shape[0] > 0
        and grad_out.shape[0] % 32 == 0
        and grad_out.shape[1] % 32 == 0
        and x.shape[1] % 32 == 0
        and amx_kernel_runs()
    )


@torch.compiler.assume_constant_result  # asked once; compiled graphs keep the answer
def amx_kernel_runs() -> bool:
    """The kernel may run here (frugality.kernels.dispatch), builds, and the OS grants AMX:
    tried once on a tiny input."""
    if "runs" not in _KERNEL_TRIED:
        x = torch.zeros(32, 32, dtype=torch.bfloat16)
        kernel = kernels.weight_grad_bf16()
        _KERNEL_TRIED["runs"] = (
            kernel is not None
            and _call(kernel, x, x, torch.empty(32, 32, dtype=torch.bfloat16), torch.empty(32, dtype=torch.bfloat16))
            == 0
        )
    return _KERNEL_TRIED["runs"]


_KERNEL_TRIED: dict[str, bool] = {}


def _call(kernel, grad_out: torch.Tensor, x: torch.Tensor, out: torch.Tensor, bias_out: torch.Tensor) -> int:
    return kernel(
        grad_out.data_ptr(),
        grad_out.stride(0),
        x.data_ptr(),
        x.stride(0),
        out.data_ptr(),
        bias_out.data_ptr(),
        grad_out.shape[0],
        grad_out.shape[1],
        x.shape[1],
        torch.get_num_threads(),
    )


def amx_product_applies(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> bool:
    """Whether `product` takes a (rows, K) and the weight (N, K) if `transposed`, else (K, N)."""
    return (
        a.device.type == weight.device.type == "cpu"
        and a.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and a.dim() == weight.dim() == 2
        and a.shape[0] > 0
        and a.shape[0] % 32 == 0
        and a.shape[1] % 32 == 0
        and weight.shape[0] % 32 == 0
        and weight.shape[1] % 32 == 0
        and a.shape[1] == weight.shape[1 if transposed else 0]
        and (a.shape[1] <= _PRODUCT_MAX_K or (not transposed and bias is None))
        and amx_kernel_runs()
    )


# matmul_cpu.c's KMAX: its packed panels of the weight must stay in L2; past it, input
# gradients (an output layer's: K = its vocabulary) take the kernel's chunked variant
_PRODUCT_MAX_K = 4096


def amx_product_into(
    a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool, out: torch.Tensor
) -> torch.Tensor:
    """out = a @ weight^T + bias if `transposed` (the forward product, weight (N, K)), else
    a @ weight (the input gradient, weight (K, N)); see `amx_product_applies`. `out`: (rows, N),
    contiguous rows."""
    a, weight = _rows(a), _rows(weight)
    if transposed and weight.stride(0) % 2:  # the kernel reads its rows as 4-byte pairs
        weight = weight.contiguous()
    bias = None if bias is None else bias.contiguous()
    n = weight.shape[0] if transposed else weight.shape[1]
    if a.shape[1] > _PRODUCT_MAX_K:
        kernel = kernels.matmul_long_bf16()
        assert kernel is not None  # amx_product_applies checked first: the AMX kernels build here
        code = kernel(
            a.data_ptr(),
            a.stride(0),
            weight.data_ptr(),
            weight.stride(0),
            out.data_ptr(),
            out.stride(0),
            a.shape[0],
            n,
            a.shape[1],
            torch.get_num_threads(),
        )
    else:
        kernel = kernels.matmul_bf16()
        assert kernel is not None  # (as above)
        code = kernel(
            a.data_ptr(),
            a.stride(0),
            weight.data_ptr(),
            weight.stride(0),
            int(transposed),
            None if bias is None else bias.data_ptr(),
            out.data_ptr(),
            out.stride(0),
            a.shape[0],
            n,
            a.shape[1],
            torch.get_num_threads(),
        )
    if code == -2:
        raise MemoryError("linear product: could not allocate the kernel's buffers")
    if code != 0:
        raise RuntimeError(f"linear product kernel failed (code {code})")
    return out


@torch.library.custom_op("frugality::linear_product", mutates_args=())
def product(a: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, transposed: bool) -> torch.Tensor:
    """`amx_product_into` a new (rows, N) tensor."""
    n = weight.shape[0] if transposed else weight.shape[1]
    return amx_product_into(a, weight, bias, transposed, torch.empty(a.shape[0], n, dtype=a.dtype))


@product.register_fake
def _(a, weight, bias, transposed):
    return a.new_empty(a.shape[0], weight.shape[0] if transposed else weight.shape[1])


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op("frugality::weight_grad", mutates_args=())
def weight_grad(grad_out: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(grad_out^T @ x, (outputs, inputs) contiguous; grad_out summed over the tokens): the
    weight and bias gradients of a linear layer from its output gradient (tokens, outputs)
    and input (tokens, inputs); see `weight_grad_applies`. The sum comes with the kernel's
    one read of grad_out, instead of a pass of its own down the columns."""
    grad_out, x = _rows(grad_out), _rows(x)
    out = torch.empty(grad_out.shape[1], x.shape[1], dtype=x.dtype)
    bias_out = torch.empty(grad_out.shape[1], dtype=x.dtype)
    code = _call(kernels.weight_grad_bf16(), grad_out, x, out, bias_out)
    if code == -2:
        raise MemoryError("weight gradient: could not allocate the kernel's buffers")
    if code != 0:
        raise RuntimeError(f"weight gradient kernel failed (code {code})")
    return out, bias_out


@weight_grad.register_fake
def _(grad_out, x):
    return x.new_empty(grad_out.shape[1], x.shape[1]), x.new_empty(grad_out.shape[1])


class _Linear(torch.autograd.Function):
    """F.linear, with the weight and bias gradients through `weight_grad`, the forward
    product through `product` where it applies, and the input gradient too where K is wide."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        rows = x.reshape(-1, x.shape[-1])
        if amx_product_applies(rows, weight, bias, transposed=True):
            return product(rows, weight, bias, True).view(*x.shape[:-1], weight.shape[0])
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        x, weight = ctx.saved_tensors
        g = grad_out.reshape(-1, grad_out.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:  # oneDNN's, unless K is wide (benchmarks/linear_products.py)
            wide = g.shape[-1] > _PRODUCT_MAX_K and amx_product_applies(g, weight, None, transposed=False)
            grad_x = (product(g, weight, None, False) if wide else g @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w, grad_b = weight_grad(g, x.reshape(-1, x.shape[-1]))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = grad_b if ctx.needs_input_grad[1] else g.sum(0)
        else:
            grad_b = None
        return grad_x, grad_w, grad_b


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear; for bf16 on CPUs with AMX through the kernels: `_Linear` (all three
    products) when the weight's gradient will be wanted, `product` when no gradient is
    (evaluation, inference)."""
    if (
        x.device.type == "cpu"
        and x.dim() >= 2
        and not torch.is_autocast_enabled("cpu")
        and x.dtype == weight.dtype == torch.bfloat16
        and (bias is None or bias.dtype == torch.bfloat16)
        and x.shape[:-1].numel() % 32 == 0
        and x.numel() > 0
        and weight.shape[0] % 32 == 0
        and weight.shape[1] % 32 == 0
        and amx_kernel_runs()
    ):
        if torch.is_grad_enabled() and weight.requires_grad:
            return _Linear.apply(x, weight, bias)
        wanted = torch.is_grad_enabled() and (x.requires_grad or (bias is not None and bias.requires_grad))
        rows = x.reshape(-1, x.shape[-1])
        if not wanted and amx_product_applies(rows, weight, bias, transposed=True):
            return product(rows, weight, bias, True).view(*x.shape[:-1], weight.shape[0])
    return F.linear(x, weight, bias)


class AMXLinear(nn.Linear):
    """nn.Linear (same parameters, same state dict) through `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
