"""A key/value cache for decoding: every layer's keys and values, allocated once at
(batch, kv_heads, length + 1, head_size) and written in place, so that a decoding step
sees the same shapes at every step and a compiled one never recompiles
(`frugality.inference.generate`).

Rows are indexed by position, not by column: the token at position p of a row (its own
position, counted from its first real token, as transformers' generate counts under left
padding) is written to slot p of that row, and padding (position -1) to the extra last
slot, which no query sees. A query at position p sees slots 0..p, so one comparison is
both the causal mask and the padding mask, and slots past p (left over from a longer row
of an earlier batch) are never read.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from frugality.models.layers import RotaryEmbedding


class KVCache:
    """Keys and values of `num_layers` layers for `batch` rows of up to `length` positions."""

    def __init__(
        self,
        num_layers: int,
        batch: int,
        kv_heads: int,
        length: int,
        head_size: int,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ) -> None:
        shape = (batch, kv_heads, length + 1, head_size)  # + 1: the slot padding is written to
        self.batch, self.length = batch, length
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model, batch: int, length: int) -> KVCache:
        """A cache fitting `model` (GPT-NeoX or Llama), in its parameters' dtype and device."""
        cfg, weight = model.config, model.embed.weight
        if length > cfg.max_seq_len:
            raise ValueError(f"cache of {length} positions exceeds max_seq_len {cfg.max_seq_len}")
        kv_heads = getattr(cfg, "kv_heads", cfg.num_heads)
        return cls(cfg.num_layers, batch, kv_heads, length, cfg.head_size, dtype=weight.dtype, device=weight.device)

    def layer(self, index: int, positions: torch.Tensor) -> LayerCache:
        """Layer `index`'s cache for one forward pass over tokens at `positions` (batch, seq)."""
        return LayerCache(self.keys[index], self.values[index], positions)


@dataclass
class LayerCache:
    keys: torch.Tensor  # (batch, kv_heads, length + 1, head_size)
    values: torch.Tensor
    positions: torch.Tensor  # (batch, seq); -1 marks padding

    def attend(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary: RotaryEmbedding | None = None
    ) -> torch.Tensor:
        """Rotate q and k by their positions, write k and v into their slots, and attend
        each query to the slots at or before its position. Padding queries see slot 0 (so
        no softmax row is empty); their outputs are never used."""
        length = self.keys.shape[2] - 1
        at = self.positions.clamp(min=0)
        if rotary is not None:
            q, k = rotary(q, at), rotary(k, at)
        slots = self.positions.masked_fill(self.positions < 0, length)[:, None, :, None].expand_as(k)
        self.keys.scatter_(2, slots, k)
        self.values.scatter_(2, slots, v)
        visible = torch.arange(length + 1, device=q.device) <= at[:, None, :, None]  # (batch, 1, seq, length + 1)
        return F.scaled_dot_product_attention(
            q, self.keys, self.values, attn_mask=visible, enable_gqa=self.keys.shape[1] != q.shape[1]
        )
