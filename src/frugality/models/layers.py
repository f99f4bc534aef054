"""Layers shared by the model families: rotary position embeddings, causal attention and
the language-model output layer.

Model code here is single-device, plain PyTorch. Faster device-specific versions of these
layers (C kernels for CPUs, a fused output-layer loss) live in `frugality.kernels` and are
swapped in from outside by `frugality.kernels.specialize`, as parallelism (DDP, FSDP,
tensor parallel) wraps the modules from outside: nothing in this package knows about
either.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotate-half rotary embeddings (RoFormer; GPT-NeoX and Llama layout) on the first `dim`
    of each head's `head_size` channels (all of them by default).

    Channel i < dim/2 pairs with i + dim/2: out_i = x_i cos - x_(i+dim/2) sin, and
    out_(i+dim/2) = x_(i+dim/2) cos + x_i sin. This is computed over the whole head as
    `x * cos + swap_halves(x) * sin`, with cos = 1 and sin = 0 past `dim` and the signs
    folded into the sin table, so one expression serves full and partial rotation.

    The tables are computed once in float32 for `max_seq_len` positions and kept as
    non-persistent buffers, so they never appear in checkpoints.
    """

    cos: torch.Tensor  # (max_seq_len, head_size) buffers, registered in __init__
    sin: torch.Tensor

    def __init__(self, dim: int, max_seq_len: int, base: float = 10000.0, head_size: int | None = None) -> None:
        super().__init__()
        head_size = dim if head_size is None else head_size
        if dim % 2 or dim > head_size:
            raise ValueError(f"rotary dimension must be even and at most the head size ({head_size}), got {dim}")
        self.dim, self.base = dim, base
        self.register_buffer("cos", torch.empty(max_seq_len, head_size), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_size), persistent=False)
        self.reset_tables()

    @torch.no_grad()
    def reset_tables(self) -> None:
        """(Re)compute the tables in place, on whatever device they are: a model built on
        the meta device and moved with `to_empty` has them uninitialised
        (`frugality.models.materialize.build_empty`)."""
        if self.cos.is_meta:
            return
        max_seq_len, dim, half = self.cos.shape[0], self.dim, self.dim // 2
        positions = torch.arange(max_seq_len, dtype=torch.float32, device=self.cos.device)
        inv_freq = 1.0 / (self.base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=self.cos.device) / dim))
        angles = torch.outer(positions, inv_freq)  # (T, dim/2)
        self.cos.fill_(1.0)
        self.sin.zero_()
        self.cos[:, :half] = angles.cos()
        self.cos[:, half:dim] = angles.cos()
        self.sin[:, :half], self.sin[:, half:dim] = -angles.sin(), angles.sin()

    def forward(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Rotate x of shape (batch, heads, seq, head_size) by positions 0..seq-1, or by each
        row's own `positions` (batch, seq) when decoding; channels past `dim` pass through."""
        if positions is None:
            seq_len = x.shape[-2]
            cos = self.cos[:seq_len].to(x.dtype)
            sin = self.sin[:seq_len].to(x.dtype)
        else:
            cos = self.cos[positions].unsqueeze(1).to(x.dtype)  # (batch, 1, seq, head_size)
            sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        return x * cos + self.swap_halves(x) * sin

    def swap_halves(self, x: torch.Tensor) -> torch.Tensor:
        """x with channels i and i + dim/2 exchanged (i < dim/2); the others as they are."""
        half = self.dim // 2
        return torch.cat((x[..., half : self.dim], x[..., :half], x[..., self.dim :]), dim=-1)


class CausalAttention(nn.Module):
    """Causal self-attention over (batch, heads, seq, head_size) tensors, q and k rotated by
    `rotary` first if given; k and v may have fewer heads than q (grouped-query attention),
    each serving a contiguous group of q's. SDPA picks the fused kernel the device has; the
    scale is the default head_size ** -0.5. No parameters: a module so that a device's
    faster attention can be swapped in (`frugality.kernels.specialize`)."""

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: RotaryEmbedding | None = None
    ) -> torch.Tensor:
        if rotary is not None:
            q, k = rotary(q), rotary(k)
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class OutputLayer(nn.Linear):
    """A language model's output projection (hidden -> vocabulary logits, no bias), which
    also gives the next-token loss. Training swaps in a fused version of `loss` that never
    materialises float32 logits (`frugality.kernels.output_loss`); same parameters."""

    def __init__(self, hidden_size: int, vocab_size: int) -> None:
        super().__init__(hidden_size, vocab_size, bias=False)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of the logits of `hidden` (B, T, d) against `targets` (B, T)."""
        logits = self(hidden).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def logits_or_loss(self, hidden: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
        """A decoder's last step: logits (B, T, vocab), or the mean loss given `targets`."""
        return self(hidden) if targets is None else self.loss(hidden, targets)


def check_length(input_ids: torch.Tensor, max_seq_len: int) -> None:
    if input_ids.shape[1] > max_seq_len:
        raise ValueError(f"sequence of {input_ids.shape[1]} tokens exceeds max_seq_len {max_seq_len}")
