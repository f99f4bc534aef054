"""An encoder's bidirectional attention at inference on CPUs, through a C kernel
(kernels/encoder_attention_cpu.c): `attend` for the layers that call it (`PackedAttention`,
and `KernelAttention`, swapped in for BERT's plain attention by `use_kernel_attention`).

PyTorch's CPU attention pays a few microseconds per head whatever its size, which an
embedding job's and a server's short texts never amortise; the kernel scores a head's
queries in registers (heads of up to 16 dimensions: its queries across a vector's lanes).
Measured (benchmarks/encoder_attention.py, AMD EPYC Zen 4, 2 threads, bf16, against
F.scaled_dot_product_attention): 3.30x at 64 texts of 29 tokens in 12 heads of 32, 1.62x for
a lone text of 17, 7.73x at 4 heads of 8, 1.50x at 512 tokens.
The results are SDPA's up to float32 rounding order. Elsewhere (other devices and dtypes,
CPUs without AVX2, gradients, traced or compiled graphs, no C compiler,
FRUGALITY_DISABLE_KERNELS=encoder-attention) it is SDPA.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.jit._trace import is_tracing  # (torch.jit re-exports it, but not to type checkers)

from frugality import kernels
from frugality.models.bert import Attention, Unpadded


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, heads: int) -> torch.Tensor:
    """Attention of (b, t, heads * head_size) queries, keys and values (views of one layout:
    the same strides, features contiguous) under a (b, 1, 1, t) boolean key mask (or None):
    (b, t, heads * head_size)."""
    b, t, width = q.shape
    if _kernel_applies(q, k, v, mask, heads) and (kernel := kernels.encoder_attention_forward()) is not None:
        out = torch.empty(b, t, width, dtype=q.dtype)
        keep = torch.ones(b, t, dtype=torch.uint8) if mask is None else mask.reshape(b, t).to(torch.uint8).contiguous()
        code = kernel(
            q.data_ptr(), k.data_ptr(), v.data_ptr(), keep.data_ptr(), out.data_ptr(),
            b, t, heads, width // heads, q.stride(0), q.stride(1), (width // heads) ** -0.5,
            int(q.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if code == 0:
            return out
    q, k, v = (x.view(b, t, heads, width // heads).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, width)


def attend_unpadded(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, tokens: Unpadded, heads: int
) -> torch.Tensor | None:
    """Attention of an unpadded batch's (rows, heads * head_size) queries, keys and values
    (views of one layout, features contiguous; `tokens` says whose rows they are, made from
    the batch's boolean key `mask`, (texts, 1, 1, length)) through the kernel, on the rows as
    they are: (rows, heads * head_size), or None where the kernel does not run (the caller
    pads them back for `attend`)."""
    if q.dim() != 2 or not _tensors_apply(q, k, v, heads):
        return None
    if mask is None or mask.dtype != torch.bool or mask.shape != (tokens.rows, 1, 1, tokens.length):
        return None  # (the keys kept are the mask's: `tokens` must have been made from it)
    if (kernel := kernels.encoder_attention_unpadded()) is None:
        return None
    rows, width = q.shape
    starts, keep = tokens.starts, tokens.keep
    if keep.numel() != rows or starts.device.type != "cpu" or keep.device.type != "cpu":
        return None
    out = torch.empty(rows, width, dtype=q.dtype, device="cpu")
    code = kernel(
        q.data_ptr(), k.data_ptr(), v.data_ptr(), keep.data_ptr(), out.data_ptr(), starts.data_ptr(),
        tokens.rows, rows, heads, width // heads, q.stride(0), (width // heads) ** -0.5,
        int(q.dtype == torch.bfloat16), torch.get_num_threads(),
    )  # fmt: skip
    return out if code == 0 else None


def _kernel_applies(q, k, v, mask, heads: int) -> bool:
    return (
        q.dim() == 3
        and _tensors_apply(q, k, v, heads)
        and (mask is None or (mask.dtype == torch.bool and mask.shape == (q.shape[0], 1, 1, q.shape[1])))
    )


def _tensors_apply(q, k, v, heads: int) -> bool:
    return (
        q.device.type == "cpu"
        and q.dtype in (torch.float32, torch.bfloat16)
        and k.dtype == v.dtype == q.dtype
        and q.shape == k.shape == v.shape
        and q.stride() == k.stride() == v.stride()
        and q.stride(-1) == 1
        and q.shape[-1] % heads == 0
        and q.shape[-1] // heads <= 256
        and q.numel() > 0
        and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad))
        and not torch.compiler.is_compiling()
        and not is_tracing()
    )


class KernelAttention(Attention):
    """BERT's attention (the same parameters) with its product of queries and keys, softmax
    and weighted sum through `attend`."""

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, tokens: Unpadded | None = None) -> torch.Tensor:
        if tokens is not None:  # x: (real tokens, d)
            q, k, v = (proj(x) for proj in (self.query, self.key, self.value))
            if (y := attend_unpadded(q, k, v, mask, tokens, self.heads)) is not None:
                return self.out(y)
            shape = (tokens.rows, tokens.length, -1)  # else attention on them padded back
            q, k, v = (tokens.pad(t).view(shape) for t in (q, k, v))
            return self.out(tokens.unpad(attend(q, k, v, mask, self.heads).flatten(0, 1)))
        q, k, v = (proj(x) for proj in (self.query, self.key, self.value))
        return self.out(attend(q, k, v, mask, self.heads))


def use_kernel_attention(model: nn.Module) -> int:
    """BERT's plain attention layers in `model` swapped, in place, for `KernelAttention`
    where the kernel may run here (frugality.kernels.dispatch) and builds; returns how
    many."""
    if kernels.encoder_attention_forward() is None:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is Attention:
            module.__class__ = KernelAttention
            swapped += 1
    return swapped
