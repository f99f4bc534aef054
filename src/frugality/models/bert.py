"""BERT encoder (Devlin et al., 2019), the family of sentence-embedding models such as
all-MiniLM-L6-v2: learned absolute positions and token types, post-LayerNorm blocks
(eps 1e-12), exact GELU, bidirectional attention over non-padding tokens, an optional
tanh pooler and an optional masked-LM head tied to the word embeddings. Computes what
`transformers.BertModel` / `BertForMaskedLM` compute (tests/models/test_bert.py).

As an embedding model it pools the hidden states (mean of the non-padding tokens, or the
first token), passes them through an optional MLP projection head and optionally
L2-normalises them: what sentence-transformers' Pooling, Dense and Normalize modules do.
Embedding a padded batch can skip the padding (`unpad=True`): the hidden states are kept as
one row per real token between the layers, so the linear layers (most of the work) only
see real tokens; attention alone pads them back, per text, behind its mask. The result is
the padded computation's, token for token.
A learnable temperature (CLIP's logit scale) lives here too, so that it is checkpointed
and optimised with the weights; the losses that use it are the tasks' (`frugality.tasks`).
"""

from __future__ import annotations

import math
from functools import cached_property
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
    # As an embedding model (contrastive training, `frugality embed`, sentence-transformers export):
    pooling: Literal["mean", "cls"] = "mean"
    head: tuple[PositiveInt, ...] = Field(
        default=(),
        description="widths of the MLP projection head's layers after pooling (empty: none); the last layer is linear",
    )
    head_activation: Literal["tanh", "relu", "gelu"] = Field(default="gelu", description="between head layers")
    normalize: bool = Field(default=False, description="L2-normalise the embeddings")
    temperature: float = Field(
        default=0.05,
        gt=0.0,
        description="contrastive loss: similarities are divided by it (the initial value when learnt)",
    )
    learn_temperature: bool = False

    @model_validator(mode="after")
    def _check_shapes(self) -> BertConfig:
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

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, tokens: Unpadded | None = None) -> torch.Tensor:
        if tokens is not None:  # x: (real tokens, d); attention runs on them padded back
            shape = (tokens.rows, tokens.length, self.heads, self.head_size)
            q, k, v = (tokens.pad(proj(x)).view(shape).transpose(1, 2) for proj in (self.query, self.key, self.value))
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
            return self.out(tokens.unpad(y.transpose(1, 2).flatten(0, 1).flatten(1)))
        b, t, d = x.shape
        q, k, v = (
            proj(x).view(b, t, self.heads, self.head_size).transpose(1, 2)
            for proj in (self.query, self.key, self.value)
        )
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # bidirectional
        return self.out(y.transpose(1, 2).reshape(b, t, d))


class Unpadded:
    """Where a padded (rows, length) batch's real tokens are: `unpad` keeps their rows of a
    (rows * length, ...) tensor, in order; `pad` puts them back, zeros between.

    The kept rows are rounded up to a multiple of `MULTIPLE` with padding positions, which
    attention masks and pooling ignores: products whose kernels need a multiple of 16 or 32
    rows (fp8's scaled products, the AMX linear kernels) keep them."""

    MULTIPLE = 32

    def __init__(self, attention_mask: torch.Tensor) -> None:
        self.rows, self.length = attention_mask.shape
        self.real = real = attention_mask.flatten().bool()
        self.index = real.nonzero().squeeze(1)
        extra = -len(self.index) % self.MULTIPLE
        if extra:
            self.index = torch.cat([self.index, (~real).nonzero().squeeze(1)[:extra]]).sort().values

    @cached_property
    def starts(self) -> torch.Tensor:
        """Where each text's kept rows begin, and the last's end: (rows + 1,) int64 (a text's
        kept rows are consecutive: `index` is sorted)."""
        counts = torch.bincount(self.index // self.length, minlength=self.rows)
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)])

    @cached_property
    def keep(self) -> torch.Tensor:
        """Whether each kept row is a real token (1) or one of the padding rows kept for
        `MULTIPLE` (0): (kept rows,) uint8."""
        return self.real.index_select(0, self.index).to(torch.uint8)

    def unpad(self, padded: torch.Tensor) -> torch.Tensor:
        return padded.index_select(0, self.index)

    def pad(self, rows: torch.Tensor) -> torch.Tensor:
        return rows.new_zeros((self.rows * self.length, *rows.shape[1:])).index_copy(0, self.index, rows)

    def padded(self, rows: torch.Tensor) -> torch.Tensor:
        """The kept rows back in the (rows, length, ...) layout, zeros elsewhere."""
        return self.pad(rows).view(self.rows, self.length, *rows.shape[1:])


class Block(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attn = Attention(cfg)
        self.attn_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.up = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = nn.GELU()
        self.down = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.mlp_norm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None, tokens: Unpadded | None = None) -> torch.Tensor:
        h = self.attn_norm(h + self.attn(h, mask, tokens))  # post-LN
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


ACTIVATIONS = {"tanh": torch.tanh, "relu": F.relu, "gelu": F.gelu}


class Bert(nn.Module):
    """input_ids (B, T) [+ attention_mask, token_type_ids] -> hidden states (B, T, d); with
    the masked-LM head, `mlm_logits(hidden)` gives (B, T, vocab)."""

    # What fine-tuning may add to a pretrained encoder: absent from its weights, kept as
    # initialised by --init-from (frugality.interop.weights).
    optional_in_checkpoints = ("head.", "logit_scale")

    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = Embeddings(cfg)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.pooler = nn.Linear(cfg.hidden_size, cfg.hidden_size) if cfg.pooler else None
        self.mlm = MaskedLMHead(cfg, self.embeddings.word) if cfg.mlm_head else None
        widths = [cfg.hidden_size, *cfg.head]
        self.head = nn.ModuleList(nn.Linear(a, b) for a, b in zip(widths, widths[1:], strict=False))
        # log(1 / temperature), as CLIP keeps it: positive and well scaled for the optimizer
        self.logit_scale = nn.Parameter(torch.empty(1)) if cfg.learn_temperature else None
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """BERT's initialisation: N(0, 0.02) weights, zero biases, unit norms."""
        for name, p in self.named_parameters():
            if name == "logit_scale":
                p.fill_(math.log(1.0 / self.config.temperature))
            elif name.endswith("bias"):
                p.zero_()
            elif "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, self.config.init_std)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        unpad: bool = False,
    ) -> torch.Tensor:
        """Hidden states (B, T, d). `unpad` (with an attention mask) skips the padding in every
        layer (attention too where frugality's kernel runs) and puts the rows back in the
        padded layout at the end, zeros at the padding; the real tokens' states are the same."""
        check_length(input_ids, self.config.max_seq_len)
        # Padding keys are masked out for every query: a (B, 1, 1, T) boolean mask.
        mask = attention_mask.bool()[:, None, None, :] if attention_mask is not None else None
        h = self.embeddings(input_ids, token_type_ids)
        if unpad and attention_mask is not None:
            tokens = Unpadded(attention_mask)
            h = tokens.unpad(h.flatten(0, 1))
            for layer in self.layers:
                h = layer(h, mask, tokens)
            return tokens.padded(h)
        for layer in self.layers:
            h = layer(h, mask)
        return h

    def embed(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
        *,
        normalize: bool | None = None,
        unpad: bool = False,
    ) -> torch.Tensor:
        """Sentence embeddings: the hidden states pooled (`config.pooling`), through the
        projection head, L2-normalised where `normalize` (default `config.normalize`) says."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        hidden = self(input_ids, attention_mask, token_type_ids, unpad=unpad)
        return self.project(
            pool(hidden, attention_mask, self.config.pooling), self.config.normalize if normalize is None else normalize
        )

    def similarity_scale(self) -> torch.Tensor | float:
        """1 / temperature; learnt, it is kept at most 100 (CLIP's bound) so that the
        softmax cannot collapse onto one pair."""
        if self.logit_scale is None:
            return 1.0 / self.config.temperature
        return self.logit_scale.clamp(max=math.log(100.0)).exp()

    def project(self, pooled: torch.Tensor, normalize: bool) -> torch.Tensor:
        """The projection head (activation between layers, the last linear), then L2."""
        activation = ACTIVATIONS[self.config.head_activation]
        dtype = self.embeddings.word.weight.dtype  # the model's float dtype (a head layer's may be int8)
        for i, layer in enumerate(self.head):
            pooled = layer(pooled.to(dtype))
            if i < len(self.head) - 1:
                pooled = activation(pooled)
        return F.normalize(pooled, p=2, dim=-1) if normalize else pooled

    def pooled(self, hidden: torch.Tensor) -> torch.Tensor:
        """BERT's pooler: tanh(dense(hidden state of the first token))."""
        if self.pooler is None:
            raise ValueError("this BERT has no pooler")
        return torch.tanh(self.pooler(hidden[:, 0]))

    def mlm_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.mlm is None:
            raise ValueError("this BERT has no masked-LM head")
        return self.mlm(hidden)


def pool(hidden: torch.Tensor, attention_mask: torch.Tensor, mode: str = "mean") -> torch.Tensor:
    """One float32 vector per row: the mean of the non-padding tokens' hidden states (summed
    in float32: bf16 sums lose small terms), or the first token's ("cls")."""
    if mode == "cls":
        return hidden[:, 0].float()
    weights = attention_mask.unsqueeze(-1).float()
    return (hidden.float() * weights).sum(1) / weights.sum(1).clamp(min=1e-9)


def mean_pool(hidden: torch.Tensor, attention_mask: torch.Tensor, normalize: bool = True) -> torch.Tensor:
    """Sentence embeddings as sentence-transformers computes them: the mean of the
    non-padding tokens' hidden states, then (optionally) L2-normalised."""
    pooled = pool(hidden, attention_mask).to(hidden.dtype)
    return F.normalize(pooled, p=2, dim=-1) if normalize else pooled
