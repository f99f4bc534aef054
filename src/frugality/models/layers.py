"""Layers shared by the model families: rotary position embeddings and causal attention.

Model code here is single-device. Parallelism (DDP, FSDP, tensor parallel) wraps the
modules from outside, so nothing in this package knows about process groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugality.models.cpu_attention import CausalAttention, amx_attention, amx_attention_applies


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings (RoFormer; GPT-NeoX and Llama layout) on the first `dim`
    of each head's `head_size` channels (all of them by default).

    Channel i < dim/2 pairs with i + dim/2: out_i = x_i cos - x_(i+dim/2) sin, and
    out_(i+dim/2) = x_(i+dim/2) cos + x_i sin. This is computed over the whole head as
    `x * cos + (x @ swap) * sin`, with cos = 1 and sin = 0 past `dim`, the signs folded into
    the sin table, and `swap` the permutation matrix that exchanges the two halves. The usual
    slice-negate-concatenate form gives the same values (a product with a permutation
    matrix is exact), but compiled on CPUs its backward ran as masked vector loads at the
    half and `dim` boundaries: 10 ms more per Pythia-70m layer at 4 x 512 tokens (2-core
    Xeon, forward + backward of a compiled block, median of 30 paired runs).

    The tables are computed once in float32 for `max_seq_len` positions and kept as
    non-persistent buffers, so they never appear in checkpoints.
    """

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0, head_size: int | None = None) -> None:
        super().__init__()
        head_size = dim if head_size is None else head_size
        if dim % 2 or dim > head_size:
            raise ValueError(f"rotary dimension must be even and at most the head size ({head_size}), got {dim}")
        self.dim = dim
        half = dim // 2
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float32), inv_freq)  # (T, dim/2)
        cos = torch.ones(max_seq_len, head_size)
        sin = torch.zeros(max_seq_len, head_size)
        cos[:, :half] = cos[:, half:dim] = angles.cos()
        sin[:, :half], sin[:, half:dim] = -angles.sin(), angles.sin()
        source = torch.arange(head_size)  # (x @ swap)[..., i] = x[..., source[i]]
        source[:half] += half
        source[half:dim] -= half
        swap = torch.zeros(head_size, head_size)
        swap[source, torch.arange(head_size)] = 1.0
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("swap", swap, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (batch, heads, seq, head_size); channels past `dim` pass through."""
        seq_len = x.shape[-2]
        cos = self.cos[:seq_len].to(x.dtype)
        sin = self.sin[:seq_len].to(x.dtype)
        return x * cos + self.swap_halves(x, by_product=x.device.type == "cpu") * sin

    def swap_halves(self, x: torch.Tensor, by_product: bool) -> torch.Tensor:
        """x with channels i and i + dim/2 exchanged (i < dim/2); the others as they are. As
        a product with `swap` where that is faster (CPUs), else by slicing: on GPUs a float32
        product may run in TF32, which would round x."""
        if by_product:
            return x @ self.swap.to(x.dtype)
        half = self.dim // 2
        return torch.cat((x[..., half : self.dim], x[..., :half], x[..., self.dim :]), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     rotary: RotaryEmbedding | None = None) -> torch.Tensor:
    """Causal self-attention over (batch, heads, seq, head_size) tensors, q and k rotated by
    `rotary` first if given; k and v may have fewer heads than q (grouped-query attention),
    each serving a contiguous group of q's.

    SDPA picks the fused kernel the device has (flash / memory-efficient on CUDA, the
    flash-style C++ kernel on CPU); the scale is the default head_size ** -0.5. On CPUs two
    paths are faster (see frugality.models.cpu_attention): bf16 with AMX takes the C kernel
    `amx_attention`, which applies the rotation itself (in float32, rounding once); other
    training inside a compiled region takes `CausalAttention`.
    """
    grouped = k.shape[1] != q.shape[1]
    if q.device.type == "cpu" and amx_attention_applies(q, k, v):
        return amx_attention(q, *_repeat_kv(q, k, v), rotary)
    if rotary is not None:
        q, k = rotary(q), rotary(k)
    training = torch.is_grad_enabled() and q.requires_grad
    if q.device.type == "cpu" and torch.compiler.is_compiling() and training:
        return CausalAttention.apply(q, *_repeat_kv(q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with as many heads as q (each serving a contiguous group of q's heads)."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def check_length(input_ids: torch.Tensor, max_seq_len: int) -> None:
    if input_ids.shape[1] > max_seq_len:
        raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds max_seq_len {max_seq_len}")
