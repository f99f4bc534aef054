"""Model FLOPs per token, PaLM's way (Chowdhery et al., 2022, appendix B).

A training step costs 6N + 12·L·H·Q·T FLOPs per token: 6N for the forward and backward
matrix products through the N parameters that take part in them (every parameter except
the input embedding, which is a lookup; the output layer counts), plus 12·L·H·Q·T for the
attention scores and their weighted sum over a T-token context (L layers, H heads of size
Q, so H·Q is the hidden size). The count is of the model, not of the implementation:
recomputation and masked-out work do not add to it, so MFU compares implementations fairly.
"""

from __future__ import annotations

from torch import nn


def non_embedding_params(model: nn.Module) -> int:
    """Parameters that take part in matrix products: all but nn.Embedding tables, unless a
    table is also an output layer's weight (tied, as BERT's masked-LM decoder or a tied
    Llama's output): then it takes part in the output product."""
    products = {id(p) for m in model.modules() if isinstance(m, nn.Linear) for p in m.parameters()}
    lookup = {id(p) for m in model.modules() if isinstance(m, nn.Embedding) for p in m.parameters()} - products
    return sum(p.numel() for p in model.parameters() if id(p) not in lookup)


def training_flops_per_token(
    model: nn.Module, num_layers: int, hidden_size: int, seq_len: int, params: int | None = None
) -> float:
    """`params`: the count of `non_embedding_params` where `model` is a part of the model (a
    pipeline stage's: the count over every stage)."""
    params = non_embedding_params(model) if params is None else params
    return 6.0 * params + 12.0 * num_layers * hidden_size * seq_len
