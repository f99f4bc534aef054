"""BERT encoder (Devlin et al., 2019), the family of sentence-embedding models such as
all-MiniLM-L6-v2: learned absolute positions and token types, post-LayerNorm blocks
(eps 1e-12), exact GELU, bidirectional attention over non-padding tokens, an optional
tanh pooler and an optional masked-LM head tied to the word embeddings. Computes what
`transformers.BertModel` / `BertForMaskedLM` compute (tests/models/test_bert.py).
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator
from torch import nn

from frugality.models.layers import check_length


class BertConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    family: Literal["bert"] = "bert"
    hidden_size: PositiveInt
    num_layers: PositiveInt
    num_heads: PositiveInt
    intermediate_size: PositiveInt
    vocab_size: PositiveInt = 30522
    max_seq_len: PositiveInt = 512
    type_vocab_size: PositiveInt = 2
    layer_norm_eps: float = Field(default=1e-12, gt=0.0)
    pooler: bool = True
    mlm_head: bool = False
    init_std: float = Field(default=0.02, gt=0.0)

    @model_validator(mode="after")
    def _check_shapes(self) -> "BertConfig":
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_heads ({self.num_heads})")
        return self


class Embeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.word = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.position = nn.Embedding(cfg.max_seq_len, cfg.hidden_size)
        self.token_type = nn.Embedding(cfg.type_vocab_size, cfg.hidden_size)
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        types = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        return self.norm(self.word(input_ids) + self.position(positions) + self.token_type(types))


class Attention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.heads, self.head_size = cfg.num_heads, cfg.hidden_size // cfg.num_heads
        self.query = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.key = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.value = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.out = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, self.head_size).transpose(1, 2)
                   for proj in (self.query, self.key, self.value))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # bidirectional
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = nn.GELU()
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        h = self.attn_norm(h + self.attn(h, mask))  # post-LN
        return self.mlp_norm(h + self.down(self.act(self.up(h))))


class MaskedLMHead(nn.Module):
    def __init__(self, cfg: BertConfig, word_embeddings: nn.Embedding) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.act = nn.GELU()
        self.norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.decoder = nn.Linear(cfg.hidden_size, cfg.vocab_size)
        self.decoder.weight = word_embeddings.weight  # tied, as in BERT

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.decoder(self.norm(self.act(self.dense(h))))


class Bert(nn.Module):
    """input_ids (B, T) [+ attention_mask, token_type_ids] -> hidden states (B, T, d); with
    the masked-LM head, `mlm_logits(hidden)` gives (B, T, vocab)."""

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if cfg.pooler else None
        self.mlm = MaskedLMHead(cfg, self.embeddings.word) if cfg.mlm_head else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, self.config.init_std)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        check_length(input_ids, self.config.max_seq_len)
        # Padding keys are masked out for every query: a (B, 1, 1, T) boolean mask.
        mask = attention_mask.bool()[:, None, None, :] if attention_mask is not None else None
        h = self.embeddings(input_ids, token_type_ids)
        for layer in self.layers:
            h = layer(h, mask)
        return h

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler: tanh(dense(hidden state of the first token))."""
        if self.pooler is None:
            raise ValueError("this BERT has no pooler")
        return torch.tanh(self.pooler(hidden[:, 0]))

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mlm is None:
            raise ValueError("this BERT has no masked-LM head")
        return self.mlm(hidden)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them: the mean of the
    non-padding tokens' hidden states, then (optionally) L2-normalised."""
    weights = attention_mask.unsqueeze(-1).to(hidden.dtype)
    pooled = (hidden * weights).sum(1) / weights.sum(1).clamp(min=1e-9)
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
