"""Contrastive training of a text encoder: a batch is a `frugality.data.pairs.TextBatch` of
queries, positives and (optionally) hard negatives; the loss is symmetric InfoNCE with
in-batch negatives (`frugality.models.bert.info_nce`), at the model's temperature, fixed or
learnt. Evaluation adds retrieval metrics over the held-out pairs: each query ranks every
held-out positive by cosine similarity."""

from __future__ import annotations

import torch
from torch import nn

from frugality.data.pairs import TextBatch
from frugality.errors import UserError

RECALL_AT = (1, 10)


class Contrastive:
    name = "contrastive"
    families = ("bert",)  # encoders

    unused = ("pooler.", "mlm.")  # BERT's pooler and masked-LM head (the tied decoder weight is the embedding's)

    def __init__(self, gather=None, unpad: bool = False) -> None:
        self.gather = gather  # `frugality.distributed.gather_with_grad` with parallel.gather_negatives
        self.unpad = unpad  # skip the padding in every layer but attention (eager runs: shapes vary)

    _KEEP = object()

    def configured(self, *, gather=_KEEP, unpad=_KEEP) -> "Contrastive":
        """This task with every rank's documents as candidates in training (`gather`;
        evaluation keeps each rank's own: ranks may hold different numbers of evaluation
        batches), and with the padding skipped (`unpad`); what is not named stays."""
        return Contrastive(self.gather if gather is self._KEEP else gather,
                           self.unpad if unpad is self._KEEP else unpad)

    def check(self, model) -> None:
        if model.family not in self.families:
            raise UserError(f"model.family {model.family!r}: task {self.name} trains encoders "
                            f"({', '.join(self.families)})")

    def loss(self, model: nn.Module, batch) -> torch.Tensor:
        gather = self.gather if model.training else None
        return model(batch.ids, batch.mask, contrastive_groups=batch.groups, gather=gather, unpad=self.unpad)

    def tokens(self, batch) -> int:
        """The step's real tokens, the texts' own: the same count whether the layers skip
        the padding (eager) or not (compiled levels), so that tokens/s, MFU and a resumed
        run's `tokens_seen` mean the same at every level (useful work, not padding)."""
        return int(batch.mask.sum())

    def shape_key(self, batch) -> str:
        """Each length bucket is a graph of its own: its first use is its warm-up."""
        return f"@{batch.ids.shape[1]}"

    def example_batch(self, recipe, device) -> TextBatch:
        rows = len(recipe.data.fields) * recipe.data.micro_batch_size
        ids = torch.zeros((rows, recipe.data.seq_len), dtype=torch.long, device=device)
        return TextBatch(ids, torch.ones_like(ids), len(recipe.data.fields))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, batch) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        """One forward: the batch's loss (this rank's negatives) and the L2-normalised
        float32 embeddings of its queries and positives, for the retrieval metrics."""
        loss, embeddings = model(batch.ids, batch.mask, contrastive_groups=batch.groups, unpad=self.unpad,
                                 with_embeddings=True)
        n = batch.pairs
        return loss, (embeddings[:n].float(), embeddings[n:2 * n].float())

    def retrieval_metrics(self, queries: torch.Tensor, positives: torch.Tensor) -> dict[str, float]:
        """recall@k (the right positive among the k most similar) and the mean reciprocal
        rank, query i's right positive being positive i, among all of them."""
        if not len(queries):
            return {}
        scores = queries @ positives.T
        right = scores.diagonal().unsqueeze(1)
        rank = (scores > right).sum(1) + 1  # ties counted in the query's favour
        metrics = {f"recall@{k}": (rank <= k).float().mean().item() for k in RECALL_AT}
        metrics["mrr"] = (1.0 / rank.float()).mean().item()
        metrics["candidates"] = positives.shape[0]
        return metrics
