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

import torch
from torch import nn

from frugality.errors import UserError
from frugality.tasks.causal_lm import CausalLM

EVAL_SEED = 0xB3E7


class MaskedLM(CausalLM):
    """Packed token blocks as CausalLM's (its `tokens`, `shape_key`, `example_batch`)."""

    name = "masked_lm"
    families = ("bert",)

    unused = ("pooler.", "head.", "logit_scale")  # the embedding model's parts

    def __init__(self, mask_id: int | None = None, mask_prob: float = 0.15, special_ids: tuple[int, ...] = ()) -> None:
        self.mask_id, self.mask_prob, self.special_ids = mask_id, mask_prob, tuple(special_ids)

    def configure(self, mask_id: int, mask_prob: float, special_ids: tuple[int, ...] = ()) -> "MaskedLM":
        """This task for a tokenizer's [MASK] id, a masking share, and the special tokens
        ([SEP] between documents) that are never chosen."""
        return MaskedLM(mask_id, mask_prob, special_ids)

    def check(self, model) -> None:
        if model.family not in self.families:
            raise UserError(f"model.family {model.family!r}: task {self.name} trains encoders "
                            f"({', '.join(self.families)})")
        if not model.mlm_head:
            raise UserError("train.task masked_lm needs model.mlm_head = true (the masked-LM head)")

    def loss(self, model: nn.Module, batch: torch.Tensor) -> torch.Tensor:
        tokens = batch[:, :-1]
        if not model.training and tokens.device.type != "meta":
            return self.eval_loss(model, batch)[0]
        generator = None  # on the meta device (`frugality plan`), which has none
        if tokens.device.type != "meta":
            # torch seeds from 32 bits: one 32-bit draw, moved per rank by an odd constant
            seed = (int(torch.randint(2**32, (1,)).item()) + _rank() * 0x9E3779B1) % 2**32
            generator = torch.Generator(device=tokens.device).manual_seed(seed)
        inputs, targets = self.mask(tokens, model_vocab(model), generator)
        return model(inputs, mlm_targets=targets)

    def eval_loss(self, model: nn.Module, batch: torch.Tensor) -> tuple[torch.Tensor, int]:
        """The loss at evaluation masks, and how many positions it averages over. Each row's
        positions come from a fixed seed and the row's own tokens, so that a sample is masked
        alike in any batch, at any micro-batch size and rank."""
        tokens = batch[:, :-1]
        vocab, rows = model_vocab(model), []
        for row in tokens:
            seed = (EVAL_SEED + zlib.crc32(row.cpu().numpy().tobytes())) % 2**32
            rows.append(self.mask(row[None], vocab, torch.Generator(device=row.device).manual_seed(seed)))
        inputs, targets = torch.cat([r[0] for r in rows]), torch.cat([r[1] for r in rows])
        return model(inputs, mlm_targets=targets), int((targets != -100).sum())

    def mask(self, tokens: torch.Tensor, vocab_size: int, generator=None) -> tuple[torch.Tensor, torch.Tensor]:
        if self.mask_id is None:
            raise RuntimeError("MaskedLM needs configure(mask_id, ...) before use")
        draw = torch.rand(tokens.shape, generator=generator, device=tokens.device)
        chosen = draw < self.mask_prob
        if self.special_ids:
            chosen &= ~torch.isin(tokens, torch.tensor(self.special_ids, device=tokens.device))
        targets = torch.where(chosen, tokens, torch.full_like(tokens, -100))
        kind = torch.rand(tokens.shape, generator=generator, device=tokens.device)
        random_ids = torch.randint(vocab_size, tokens.shape, generator=generator, device=tokens.device)
        inputs = torch.where(chosen & (kind < 0.8), torch.full_like(tokens, self.mask_id), tokens)
        inputs = torch.where(chosen & (kind >= 0.8) & (kind < 0.9), random_ids, inputs)
        return inputs, targets


def _rank() -> int:
    """This process's data-parallel rank (every rank is one: frugality's parallelism is data
    parallelism), 0 outside a process group."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def model_vocab(model: nn.Module) -> int:
    module = getattr(model, "module", model)  # inside a DDP wrapper
    return module.config.vocab_size
