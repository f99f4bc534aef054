"""Layers shared by the model families: rotary position embeddings and causal attention.

Model code here is single-device. Parallelism (DDP, FSDP, tensor parallel) wraps the
modules from outside, so nothing in this package knows about process groups.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from frugality.models.cpu_attention import CausalAttention


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings (RoFormer; GPT-NeoX and Llama layout) on the first `dim`
    channels of each head.

    cos/sin tables are computed once in float32 for `max_seq_len` positions and kept as
    non-persistent buffers, so they never appear in checkpoints.
    """

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0) -> None:
        super().__init__()
        if dim % 2:
            raise ValueError(f"rotary dimension must be even, got {dim}")
        self.dim = dim
        inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
        positions = torch.arange(max_seq_len, dtype=torch.float32)
        freqs = torch.outer(positions, inv_freq)
        angles = torch.cat((freqs, freqs), dim=-1)  # (T, dim): channel i pairs with i + dim/2
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Rotate x of shape (batch, heads, seq, head_size); channels past `dim` pass through."""
        seq_len = x.shape[-2]
        cos = self.cos[:seq_len].to(x.dtype)
        sin = self.sin[:seq_len].to(x.dtype)
        if self.dim == x.shape[-1]:
            return x * cos + _rotate_half(x) * sin
        rot, rest = x[..., : self.dim], x[..., self.dim :]
        return torch.cat((rot * cos + _rotate_half(rot) * sin, rest), dim=-1)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Causal self-attention over (batch, heads, seq, head_size) tensors; k and v may have
    fewer heads than q (grouped-query attention), each serving a contiguous group of q's.

    SDPA picks the fused kernel the device has (flash / memory-efficient on CUDA, the
    flash-style C++ kernel on CPU); the scale is the default head_size ** -0.5. Training on
    a CPU inside a compiled region takes `CausalAttention` instead, whose backward pass is
    faster there (see frugality.models.cpu_attention).
    """
    grouped = k.shape[1] != q.shape[1]
    if (q.device.type == "cpu" and torch.compiler.is_compiling() and torch.is_grad_enabled()
            and q.requires_grad):
        if grouped:
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        return CausalAttention.apply(q, k, v)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=grouped)


def check_length(input_ids: torch.Tensor, max_seq_len: int) -> None:
    if input_ids.shape[1] > max_seq_len:
        raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds max_seq_len {max_seq_len}")
