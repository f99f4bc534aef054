"""Causal language modelling: each position predicts the next token. A batch is (B, T + 1)
token ids: inputs are all but the last token, targets all but the first. The loss is the
mean cross-entropy, through the model's output layer (for training,
`frugality.kernels.specialize` swaps in the fused output-layer loss)."""

from __future__ import annotations

import torch
from torch import nn

from frugality.errors import UserError


class CausalLM:
    name = "causal_lm"
    families = ("gpt-neox", "llama")  # the decoders

    unused = ()  # prefixes of parameters the loss never reaches

    def check(self, model) -> None:
        family = model.family
        if family not in self.families:
            raise UserError(f"model.family {family!r}: task {self.name} trains decoders "
                            f"({', '.join(self.families)}); {family} models can be imported, exported "
                            "and used for embeddings")

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        return model(batch[:, :-1], targets=batch[:, 1:])

    def eval_loss(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The batch's mean loss and what it averages over, in units alike for every batch
        (rows: each has the same tokens), so that batches of any size weigh alike per token."""
        return self.loss(model, batch), batch.shape[0]

    def tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def shape_key(self, batch) -> str:
        return ""  # one shape per run

    def example_batch(self, recipe, device) -> torch.Tensor:
        return torch.zeros((recipe.data.micro_batch_size, recipe.data.seq_len + 1), dtype=torch.long, device=device)
