"""Device-specific code, kept out of the model files: C kernels for CPUs and the modules
that use them, applied to a plain model by `frugality.kernels.specialize`.

This file holds the ctypes side: each accessor returns a C function, or None where the
kernel may not run here (`frugality.kernels.dispatch`: missing instruction sets, switched
off by the environment) or no C compiler is available; the caller then takes its torch
path. Nothing is built until first use.
"""

from __future__ import annotations

import ctypes

import torch

from frugality.kernels.build import library
from frugality.kernels.dispatch import allowed

_p, _i64, _f32, _int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int


def _function(kernel: str, library_name: str, symbol: str, restype, argtypes, extra_flags: tuple[str, ...] = ()):
    if not allowed(kernel)[0]:
        return None
    lib = library(library_name, extra_flags)
    if lib is None:
        return None
    fn = getattr(lib, symbol)
    fn.restype, fn.argtypes = restype, argtypes
    return fn


def adamw_bf16_step():
    """adamw_bf16_step(p, g, m, v, n, start, lr, beta1, 1 - beta1, beta2, 1 - beta2, eps,
    decay, bc1, sqrt(bc2), grad_scale, key, stochastic, threads): see adamw_bf16_cpu.c."""
    return _function(
        "adamw",
        "adamw_bf16_cpu",
        "adamw_bf16_step",
        None,
        [_p] * 4 + [_i64] * 2 + [_f32] * 10 + [ctypes.c_uint32, _int, _int],
        # no fused multiply-adds: the kernel must give the torch formula's bits
        extra_flags=("-ffp-contract=off",),
    )


def bf16_sum_squares():
    """bf16_sum_squares(x, n, threads) -> double: see adamw_bf16_cpu.c."""
    return _function(
        "adamw",
        "adamw_bf16_cpu",
        "bf16_sum_squares",
        ctypes.c_double,
        [_p, _i64, _int],
        extra_flags=("-ffp-contract=off",),
    )  # the same library as adamw_bf16_step


def cross_entropy(dtype_name: str):
    """cross_entropy_{bf16,f32}(logits, rows, cols, ld, targets, scale, want_grad, losses,
    threads) -> bad targets (or -1: out of memory): see cross_entropy_cpu.c."""
    return _function(
        "cross-entropy",
        "cross_entropy_cpu",
        f"cross_entropy_{dtype_name}",
        _i64,
        [_p, _i64, _i64, _i64, _p, _f32, _int, _p, _int],
    )


def transpose_2byte():
    """transpose_2byte(src, rows, cols, ld_src, dst, ld_dst, threads): see transpose_cpu.c."""
    return _function("transpose", "transpose_cpu", "transpose_2byte", None, [_p, _i64, _i64, _i64, _p, _i64, _int])


def transposed(x: torch.Tensor) -> torch.Tensor:
    """`x.t().contiguous()` for a 2-D tensor, through the C kernel where it applies (CPU,
    2-byte dtypes, rows contiguous)."""
    if (
        x.device.type == "cpu"
        and x.dim() == 2
        and x.element_size() == 2
        and x.stride(1) == 1
        and (kernel := transpose_2byte()) is not None
    ):
        out = torch.empty(x.shape[1], x.shape[0], dtype=x.dtype)
        kernel(
            x.data_ptr(), x.shape[0], x.shape[1], x.stride(0), out.data_ptr(), out.stride(0), torch.get_num_threads()
        )
        return out
    return x.t().contiguous()


def attention_forward_bf16():
    """attention_forward_bf16(q, k, v, out, lse, batch, heads, seq, dim, strides, cos, sin,
    rotary_dim, scale, threads) -> 0, -1 (no AMX) or -2 (out of memory): see attention_cpu.c."""
    return _function(
        "amx-attention",
        "attention_cpu",
        "attention_forward_bf16",
        _i64,
        [_p] * 5 + [_i64] * 4 + [_p] * 3 + [_i64, _f32, _int],
    )


def attention_backward_bf16():
    """attention_backward_bf16(q, k, v, out, lse, dout, dq, dk, dv, batch, heads, seq, dim,
    strides, cos, sin, rotary_dim, scale, threads) -> as attention_forward_bf16: see
    attention_cpu.c."""
    return _function(
        "amx-attention",
        "attention_cpu",
        "attention_backward_bf16",
        _i64,
        [_p] * 9 + [_i64] * 4 + [_p] * 3 + [_i64, _f32, _int],
    )


def weight_grad_bf16():
    """weight_grad_bf16(g, ldg, x, ldx, dw, db or None, tokens, outputs, inputs, threads) -> 0,
    -1 (no AMX) or -2 (out of memory): see weight_grad_cpu.c."""
    return _function(
        "amx-linear", "weight_grad_cpu", "weight_grad_bf16", _i64, [_p, _i64, _p, _i64, _p, _p, _i64, _i64, _i64, _int]
    )


def matmul_bf16():
    """matmul_bf16(a, lda, w, ldw, w_rows_are_outputs, bias or None, out, ldo, M, N, K,
    threads) -> 0, -1 (no AMX), -2 (out of memory) or -3 (K too large): see matmul_cpu.c."""
    return _function(
        "amx-linear",
        "matmul_cpu",
        "matmul_bf16",
        _i64,
        [_p, _i64, _p, _i64, _int, _p, _p, _i64, _i64, _i64, _i64, _int],
    )


def matmul_long_bf16():
    """matmul_long_bf16(a, lda, w, ldw, out, ldo, M, N, K, threads) -> 0, -1 (no AMX) or -2
    (out of memory): the input-gradient product for K past matmul_bf16's: see matmul_cpu.c."""
    return _function(
        "amx-linear", "matmul_cpu", "matmul_long_bf16", _i64, [_p, _i64, _p, _i64, _p, _i64, _i64, _i64, _i64, _int]
    )


def gelu_bf16():
    """gelu_bf16(x, y, n, threads) -> 0, or -1 without AVX-512: see gelu_cpu.c."""
    return _function("gelu", "gelu_cpu", "gelu_bf16", _i64, [_p, _p, _i64, _int])


def gelu_backward_bf16():
    """gelu_backward_bf16(dy, x, dx, n, threads) -> 0, or -1 without AVX-512: see gelu_cpu.c."""
    return _function("gelu", "gelu_cpu", "gelu_backward_bf16", _i64, [_p, _p, _p, _i64, _int])


def encoder_attention_forward():
    """encoder_attention_forward(q, k, v, keep, out, batch, seq, heads, dim, batch_stride,
    token_stride, scale, bf16, threads) -> 0, -2 (out of memory) or -3 (dim over 256): see
    encoder_attention_cpu.c."""
    return _function(
        "encoder-attention",
        "encoder_attention_cpu",
        "encoder_attention_forward",
        _i64,
        [_p] * 5 + [_i64] * 6 + [_f32, _int, _int],
    )


def encoder_attention_unpadded():
    """encoder_attention_unpadded(q, k, v, keep, out, starts, batch, rows, heads, dim,
    token_stride, scale, bf16, threads) -> 0, -2 (out of memory), -3 (dim over 256) or -4
    (starts not rising from 0 to rows): see encoder_attention_cpu.c."""
    return _function(
        "encoder-attention",
        "encoder_attention_cpu",
        "encoder_attention_unpadded",
        _i64,
        [_p] * 6 + [_i64] * 5 + [_f32, _int, _int],
    )


def int8_quantize_rows():
    """quantize_rows(x, rows, cols, bf16, q, scales, threads) -> 0: see int8_linear_cpu.c."""
    return _function(
        "int8-linear",
        "int8_linear_cpu",
        "quantize_rows",
        _i64,
        [_p, _i64, _i64, _int, _p, _p, _int],
        extra_flags=("-ffp-contract=off",),  # (torch's expressions' bits: no fused multiply-adds)
    )


def int8_dequantize_rows():
    """dequantize_rows(acc, rows, cols, scales, col_scales, bias, out, bf16, threads) -> 0: see
    int8_linear_cpu.c."""
    return _function(
        "int8-linear",
        "int8_linear_cpu",
        "dequantize_rows",
        _i64,
        [_p, _i64, _i64, _p, _p, _p, _p, _int, _int],
        extra_flags=("-ffp-contract=off",),
    )


def add_layer_norm():
    """add_layer_norm(x, r or None, r_stride, weight, bias, out, rows, width, eps, bf16,
    threads) -> 0 or -2 (out of memory): see layer_norm_cpu.c."""
    return _function(
        "layer-norm",
        "layer_norm_cpu",
        "add_layer_norm",
        _i64,
        [_p, _p, _i64] + [_p] * 3 + [_i64] * 2 + [_f32, _int, _int],
    )
