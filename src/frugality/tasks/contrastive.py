"""Contrastive training of a text encoder: a batch is a `frugality.data.pairs.TextBatch` of
queries, positives and (optionally) hard negatives; the loss is symmetric InfoNCE with
in-batch negatives (`info_nce`), at the model's temperature, fixed or learnt. Evaluation
adds retrieval metrics over the held-out pairs: each query ranks every held-out positive
by cosine similarity."""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from frugality.data.pairs import TextBatch
from frugality.models.bert import Bert, pool
from frugality.models.families import ENCODERS
from frugality.tasks.base import Evaluated, RunSetup, Task

RECALL_AT = (1, 10)


class ContrastiveModule(nn.Module):
    """The encoder, its pooling, head and temperature, and InfoNCE over a batch's pairs
    (with every rank's documents as candidates when `setup.gather` is given): what DDP and
    FSDP2 wrap, so that the temperature is used inside their forward."""

    def __init__(self, model: Bert, setup: RunSetup) -> None:
        super().__init__()
        self.model, self.setup = model, setup

    def forward(self, batch: TextBatch, evaluate: bool = False):
        hidden = self.model(batch.ids, batch.mask, unpad=self.setup.unpad)
        embeddings = self.model.project(pool(hidden, batch.mask, self.model.config.pooling), normalize=True)
        # evaluation keeps each rank's own negatives: ranks may hold different numbers of batches
        gather = None if evaluate else self.setup.gather
        loss = info_nce(embeddings, batch.groups, self.model.similarity_scale(), gather)
        if not evaluate:
            return loss
        n = batch.pairs
        return Evaluated(loss, n, (embeddings[:n].float(), embeddings[n : 2 * n].float()))


def info_nce(embeddings: torch.Tensor, groups: int, scale: torch.Tensor | float, gather=None) -> torch.Tensor:
    """Symmetric InfoNCE with in-batch negatives (van den Oord et al., 2018; CLIP's form):
    rows are n queries, n positives, then (with 3 groups) n hard negatives, L2-normalised.
    Each query must pick its positive among every positive and negative of the batch, and
    each positive its query among the queries; the loss is the mean of both directions.

    `gather(rows) -> (every part's rows stacked, this part's index)`, given by the caller
    (data parallelism: `frugality.distributed.gather_with_grad`), widens the candidates to
    every part's documents and queries; this part's loss is over its own queries and
    positives, so the mean over the parts is InfoNCE over the union of their batches."""
    n = embeddings.shape[0] // groups
    queries, documents = embeddings[:n].float(), embeddings[n:].float()
    candidates, others, first = documents, queries, 0  # single device: the batch itself
    if gather is not None:
        candidates, part = gather(documents)
        others, _ = gather(queries)
        first = part * n  # this part's first query among all queries
        # documents are stacked part by part, (groups - 1) * n each: positives first
    labels = torch.arange(n, device=embeddings.device)
    forward = F.cross_entropy(scale * queries @ candidates.T, labels + (first * (groups - 1) if gather else 0))
    backward = F.cross_entropy(scale * documents[:n] @ others.T, labels + first)
    return (forward + backward) / 2


class Contrastive(Task):
    name = "contrastive"
    families = ENCODERS
    trains = "encoders"
    unused = ("pooler.", "mlm.")  # BERT's pooler and masked-LM head (the tied decoder weight is the embedding's)
    gathers_negatives = True
    samples = "pairs"
    min_micro_batch = 2  # each pair's negatives are the others
    perplexity = False

    def training_module(self, model: nn.Module) -> nn.Module:
        return ContrastiveModule(cast(Bert, model), self.setup)  # of `families`, as check() admitted

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

    def metrics(self, outputs: list, counted: int, all_ranks) -> dict[str, float]:
        """recall@k and MRR of every rank's counted held-out queries among every rank's
        held-out positives."""
        mine = outputs[:counted] or [(q[:0], p[:0]) for q, p in outputs[:1]]  # a rank may count none
        queries = torch.cat([q for q, _ in mine]).cpu()
        positives = torch.cat([p for _, p in mine]).cpu()
        return self.retrieval_metrics(all_ranks(queries), all_ranks(positives))

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

    def batch_shape(self, recipe) -> str:
        d = recipe.data
        buckets = "/".join(str(b) for b in sorted({*d.buckets, d.seq_len}))
        return f"{d.global_batch_size} pairs ({len(d.fields)} texts each, padded to {buckets} tokens)"

    def notes(self, recipe) -> list[str]:
        if self.setup.unpad:
            return ["padding skipped in every layer but attention (eager: the real tokens' count varies)"]
        return [
            f"padding kept in every layer: compiled blocks ({recipe.compile.level}) take static shapes; "
            "compile.level = O0 skips it, often faster for short texts"
        ]
