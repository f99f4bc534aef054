"""Causal language modelling: each position predicts the next token. A batch is (B, T + 1)
token ids: inputs are all but the last token, targets all but the first. The loss is the
mean cross-entropy of the model's output layer (for training, `frugality.kernels.specialize`
swaps in the fused output-layer loss, which never builds float32 logits)."""

from __future__ import annotations

from typing import cast

import torch
from torch import nn

from frugality.errors import UserError
from frugality.models import Decoder
from frugality.models.families import DECODERS
from frugality.tasks.base import Evaluated, PackedBlocks, Task


class CausalLMModule(nn.Module):
    """The decoder and its next-token loss: what DDP and FSDP2 wrap."""

    def __init__(self, model: Decoder) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: torch.Tensor, evaluate: bool = False):
        hidden = self.model.hidden_states(batch[:, :-1])
        loss = self.model.output.loss(hidden, batch[:, 1:])
        return Evaluated(loss, batch.shape[0]) if evaluate else loss  # rows: each has the same tokens


class CausalLM(Task):
    name = "causal_lm"
    families = DECODERS
    trains = "decoders"
    runs_on_xla = True
    runs_model_parallel = True

    blocks = PackedBlocks()

    def check(self, model_config) -> None:
        try:
            super().check(model_config)
        except UserError as e:
            raise UserError(
                f"{e}; {model_config.family} models can be imported, exported and used for embeddings"
            ) from None

    def training_module(self, model: nn.Module) -> nn.Module:
        return CausalLMModule(cast(Decoder, model))  # of `families`, as check() admitted

    def tokens(self, batch: torch.Tensor) -> int:
        return self.blocks.tokens(batch)

    def example_batch(self, recipe, device) -> torch.Tensor:
        return self.blocks.example_batch(recipe, device)
