"""GPT-NeoX decoder, the architecture of the Pythia suite and GPT-NeoX-20B (Black et al., 2022).

What sets it apart from GPT-2: rotary embeddings on a share of each head's channels
(`rotary_pct`, 0.25 in Pythia), a parallel residual `h + attn(ln1(h)) + mlp(ln2(h))`
(from GPT-J), untied input and output embeddings, biases everywhere, exact GELU.
It computes exactly what `transformers.GPTNeoXForCausalLM` computes; the mapping between
the two state dicts lives in `frugality.interop.hf_gpt_neox`.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from torch import nn

from frugality.models.kv_cache import KVCache, LayerCache
from frugality.models.layers import CausalAttention, OutputLayer, RotaryEmbedding, check_length


class GPTNeoXConfig(BaseModel):
    """Architecture of a GPT-NeoX model; the `[model]` table of a recipe."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Literal["gpt-neox"] = "gpt-neox"
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    intermediate_size: PositiveInt | None = Field(default=None, description="MLP width; 4 x hidden_size when left out")
    vocab_size: PositiveInt = 50304
    max_seq_len: PositiveInt = 2048
    rotary_pct: float = Field(default=0.25, ge=0.0, le=1.0)
    rotary_base: float = Field(default=10000.0, gt=0.0)
    parallel_residual: bool = True
    layer_norm_eps: float = Field(default=1e-5, gt=0.0)

    @model_validator(mode="after")
    def _check_shapes(self) -> GPTNeoXConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        if self.rotary_dim % 2:
            raise ValueError(
                f"rotary_pct ({self.rotary_pct}) x head size ({self.head_size}) gives an odd "
                f"number of rotary channels ({self.rotary_dim}); it must be even"
            )
        return self

    @property
    def head_size(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def rotary_dim(self) -> int:
        return int(self.head_size * self.rotary_pct)

    @property
    def ffn_size(self) -> int:
        return self.intermediate_size or 4 * self.hidden_size


class Attention(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig) -> None:
        super().__init__()
        self.num_heads = cfg.num_heads
        self.head_size = cfg.head_size
        # Fused projection; rows are laid out [heads, (q, k, v), head_size] as in GPT-NeoX,
        # so a tensor-parallel split of the rows keeps whole heads together.
        self.qkv = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.rotary = RotaryEmbedding(cfg.rotary_dim, cfg.max_seq_len, cfg.rotary_base, cfg.head_size)
        self.attend = CausalAttention()

    def forward(self, x: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        batch, seq, _ = x.shape
        # heads from the projection's width: a tensor-parallel rank holds a share of them
        qkv = self.qkv(x).view(batch, seq, -1, 3, self.head_size)
        q, k, v = (t.transpose(1, 2) for t in qkv.unbind(dim=3))  # (B, heads, T, head_size)
        rotary = self.rotary if self.rotary.dim else None
        y = self.attend(q, k, v, rotary) if cache is None else cache.attend(q, k, v, rotary)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))


class MLP(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig) -> None:
        super().__init__()
        self.up = nn.Linear(cfg.hidden_size, cfg.ffn_size)
        self.act = nn.GELU()  # exact (erf) GELU, as Pythia was trained
        self.down = nn.Linear(cfg.ffn_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


class Block(nn.Module):
    def __init__(self, cfg: GPTNeoXConfig) -> None:
        super().__init__()
        self.parallel_residual = cfg.parallel_residual
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.attn = Attention(cfg)
        self.mlp = MLP(cfg)

    def forward(self, h: torch.Tensor, cache: LayerCache | None = None) -> torch.Tensor:
        if self.parallel_residual:
            return h + self.attn(self.attn_norm(h), cache) + self.mlp(self.mlp_norm(h))
        h = h + self.attn(self.attn_norm(h), cache)
        return h + self.mlp(self.mlp_norm(h))


class GPTNeoX(nn.Module):
    """Decoder-only language model: token ids (B, T) -> logits (B, T, vocab)."""

    def __init__(self, cfg: GPTNeoXConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.final_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.output = OutputLayer(cfg.hidden_size, cfg.vocab_size)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """GPT-NeoX's initialisation as Pythia used it: "small_init" (std sqrt(2 / 5d),
        Nguyen & Salazar 2019) everywhere, "wang_init" (std 2 / (layers * sqrt(d))) for the
        two projections that write into the residual stream; zero biases, unit norms."""
        for name, p in self.named_parameters():
            self.init_parameter(name, p)

    @torch.no_grad()
    def init_parameter(self, name: str, p: torch.Tensor) -> None:
        """One parameter's share of `reset_parameters`, by its name (`frugality.models.
        materialize` draws a model's values one parameter at a time through it)."""
        d, layers = self.config.hidden_size, self.config.num_layers
        small, wang = math.sqrt(2.0 / (5.0 * d)), 2.0 / (layers * math.sqrt(d))
        if name.endswith("bias"):
            p.zero_()
        elif "norm" in name:
            p.fill_(1.0)
        elif name.endswith(("attn.out.weight", "mlp.down.weight")):
            p.normal_(0.0, wang)
        else:
            p.normal_(0.0, small)

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
        """Logits (B, T, vocab); or, given next-token `targets` (B, T), the mean cross-entropy.
        Decoding, with a `cache`: the tokens sit at `positions` (B, T) of their rows (-1:
        padding), their keys and values go into the cache, and only the last column's
        logits (B, 1, vocab) come back."""
        if cache is None:
            return self.output.logits_or_loss(self.hidden_states(input_ids), targets)
        check_length(input_ids, self.config.max_seq_len)
        assert positions is not None, "decoding with a cache needs the tokens' positions"
        h = self.embed(input_ids)
        for i, layer in enumerate(self.layers):
            h = layer(h, cache.layer(i, positions))
        return self.output(self.final_norm(h[:, -1:]))
