"""Masked language modelling (BERT's pre-training objective, Devlin et al., 2019): a share
of the tokens (`data.mask_prob`, 15%) is chosen for prediction; of those, 80% are replaced
by [MASK], 10% by a random token and 10% left as they are. The loss is the cross-entropy
at the chosen positions only.

Batches are packed token blocks as for causal LM ((B, T + 1); the last token is unused).
Training masks come from a generator seeded per batch by one draw of torch's global
generator plus the process's rank: the global generator advances alike on every rank and
checkpoints carry it, so a resumed run masks alike, while each data-parallel rank masks
its own positions (from the global generator alone, every rank would mask the same
positions of its batch). Evaluation masks each row from a fixed seed and the row's tokens,
so every evaluation scores the same masked positions of each sample, however the samples
are batched."""

from __future__ import annotations

import zlib
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from frugality.errors import UserError
from frugality.models.bert import Bert
from frugality.models.families import ENCODERS
from frugality.tasks.base import Evaluated, PackedBlocks, RunSetup, Task, rank

EVAL_SEED = 0xB3E7


class MaskedLMModule(nn.Module):
    """The encoder with its masked-LM head and loss: what DDP and FSDP2 wrap."""

    def __init__(self, model: Bert, setup: RunSetup) -> None:
        super().__init__()
        self.model, self.setup = model, setup

    def forward(self, batch: torch.Tensor, evaluate: bool = False):
        tokens = batch[:, :-1]
        if evaluate:
            inputs, targets = self._evaluation_masks(tokens)
            return Evaluated(self._loss(inputs, targets), int((targets != -100).sum()))
        generator = None  # on the meta device (`frugality plan`), which has none
        if tokens.device.type != "meta":
            # torch seeds from 32 bits: one 32-bit draw, moved per rank by an odd constant
            seed = (int(torch.randint(2**32, (1,)).item()) + rank() * 0x9E3779B1) % 2**32
            generator = torch.Generator(device=tokens.device).manual_seed(seed)
        return self._loss(*mask(tokens, self.setup, self.model.config.vocab_size, generator))

    def _loss(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.model.mlm_logits(self.model(inputs)).float()
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)

    def _evaluation_masks(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each row's masks from a fixed seed and the row's own tokens: a sample is masked
        alike in any batch, at any micro-batch size and rank."""
        rows = []
        for row in tokens:
            seed = (EVAL_SEED + zlib.crc32(row.cpu().numpy().tobytes())) % 2**32
            generator = torch.Generator(device=row.device).manual_seed(seed)
            rows.append(mask(row[None], self.setup, self.model.config.vocab_size, generator))
        return torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])


def mask(tokens: torch.Tensor, setup: RunSetup, vocab_size: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(inputs, targets): BERT's 80/10/10 replacement at `setup.mask_prob` of the positions
    (never the special tokens); targets are -100 where nothing is predicted."""
    if setup.mask_id is None:
        raise RuntimeError("MaskedLM needs configured(mask_id=...) before use")
    draw = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    chosen = draw < setup.mask_prob
    if setup.special_ids:
        chosen &= ~torch.isin(tokens, torch.tensor(setup.special_ids, device=tokens.device))
    targets = torch.where(chosen, tokens, torch.full_like(tokens, -100))
    kind = torch.rand(tokens.shape, generator=generator, device=tokens.device)
    random_ids = torch.randint(vocab_size, tokens.shape, generator=generator, device=tokens.device)
    inputs = torch.where(chosen & (kind < 0.8), torch.full_like(tokens, setup.mask_id), tokens)
    inputs = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, inputs)
    return inputs, targets


class MaskedLM(Task):
    name = "masked_lm"
    families = ENCODERS
    trains = "encoders"
    needs_mask_token = True
    unused = ("pooler.", "head.", "logit_scale")  # the embedding model's parts

    blocks = PackedBlocks()

    def check(self, model_config) -> None:
        super().check(model_config)
        if not model_config.mlm_head:
            raise UserError("train.task masked_lm needs model.mlm_head = true (the masked-LM head)")

    def training_module(self, model: nn.Module) -> nn.Module:
        return MaskedLMModule(cast(Bert, model), self.setup)  # of `families`, as check() admitted

    def tokens(self, batch: torch.Tensor) -> int:
        return self.blocks.tokens(batch)

    def example_batch(self, recipe, device) -> torch.Tensor:
        return self.blocks.example_batch(recipe, device)
