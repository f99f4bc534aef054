"""Llama decoder (Touvron et al., 2023): pre-norm RMSNorm, SwiGLU MLP, rotary embeddings
on every channel (base `rope_theta`), grouped-query attention, no biases, optionally tied
input and output embeddings. Computes what `transformers.LlamaForCausalLM` computes with
the same weights (tests/models/test_llama.py); its layout is transformers', so the
weight mapping (frugality.interop.hf_llama) is a renaming.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from torch import nn

from frugality.models.kv_cache import KVCache, LayerCache
from frugality.models.layers import CausalAttention, OutputLayer, RotaryEmbedding, check_length


class LlamaConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Literal["llama"] = "llama"
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    num_kv_heads: PositiveInt | None = Field(
        default=None, description="grouped-query attention; = num_heads when left out"
    )
    intermediate_size: PositiveInt
    vocab_size: PositiveInt = 32000
    max_seq_len: PositiveInt = 2048
    rope_theta: float = Field(default=10000.0, gt=0.0)
    rms_norm_eps: float = Field(default=1e-6, gt=0.0)
    tie_embeddings: bool = False
    init_std: float = Field(default=0.02, gt=0.0)

    @model_validator(mode="after")
    def _check_shapes(self) -> LlamaConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.num_heads % self.kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.kv_heads})")
        if self.head_size % 2:
            raise ValueError(f"head size ({self.head_size}) must be even for rotary embeddings")
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_heads

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads


class RMSNorm(nn.Module):
    """x / rms(x) * weight, computed in float32 and cast back (as transformers does)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_size = cfg.num_heads, cfg.kv_heads, cfg.head_size
        self.q = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_size, bias=False)
        self.k = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_size, bias=False)
        self.v = nn.Linear(cfg.hidden_size, cfg.kv_heads * cfg.head_size, bias=False)
        self.o = nn.Linear(cfg.num_heads * cfg.head_size, cfg.hidden_size, bias=False)
        self.rotary = RotaryEmbedding(cfg.head_size, cfg.max_seq_len, cfg.rope_theta)
        self.attend = CausalAttention()

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        b, t, _ = x.shape
        # heads from the projections' widths: a tensor-parallel rank holds a share of them
        q = self.q(x).view(b, t, -1, self.head_size).transpose(1, 2)
        k = self.k(x).view(b, t, -1, self.head_size).transpose(1, 2)
        v = self.v(x).view(b, t, -1, self.head_size).transpose(1, 2)
        y = self.attend(q, k, v, self.rotary) if cache is None else cache.attend(q, k, v, self.rotary)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))  # SwiGLU (Shazeer, 2020)


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        h = h + self.attn(self.attn_norm(h), cache)
        return h + self.mlp(self.mlp_norm(h))


class Llama(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.output = OutputLayer(cfg.hidden_size, cfg.vocab_size)
        if cfg.tie_embeddings:
            self.output.weight = self.embed.weight
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """N(0, init_std) for every matrix, as transformers initialises Llama; the two
        residual-stream projections scaled by 1/sqrt(2 * layers) (GPT-2's rule) to keep
        the stream's variance flat with depth."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """One parameter's share of `reset_parameters`, by its name (`frugality.models.
        materialize` draws a model's values one parameter at a time through it)."""
        residual = self.config.init_std / math.sqrt(2 * self.config.num_layers)
        if "norm" in name:
            p.fill_(1.0)
        elif name.endswith(("attn.o.weight", "mlp.down.weight")):
            p.normal_(0.0, residual)
        else:
            p.normal_(0.0, self.config.init_std)

    def hidden_states(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The final norm's output (B, T, d): what the output layer turns into logits or,
        given targets, into the loss (a task's training module calls the two apart)."""
        check_length(input_ids, self.config.max_seq_len)
        h = self.embed(input_ids)
        for layer in self.layers:
            h = layer(h)
        return self.final_norm(h)

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor | None = None,
        cache: KVCache | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """As GPTNeoX.forward: logits, the loss given `targets`, or a decoding step with a `cache`."""
        if cache is None:
            return self.output.logits_or_loss(self.hidden_states(input_ids), targets)
        check_length(input_ids, self.config.max_seq_len)
        assert positions is not None, "decoding with a cache needs the tokens' positions"
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache.layer(i, positions))
        return self.output(self.final_norm(h[:, -1:]))
