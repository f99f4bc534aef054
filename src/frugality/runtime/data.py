"""A recipe's training data, opened and checked before anything is written: the tokenizer,
the dataset (the bundled corpus tokenized on first use), packed samples — or, for
contrastive training, tokenized text pairs — the resumable training stream and the
held-out validation batches."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from frugality.config.recipe import Recipe
from frugality.data.bundled import BUNDLED_PREFIX, bundled_dataset, bundled_pairs
from frugality.data.indexed import IndexedDataset
from frugality.data.loader import PackedSamples, TrainStream, validation_batches
from frugality.data.pairs import PairSamples
from frugality.data.tokenizer import LoadedTokenizer, load_tokenizer
from frugality.errors import UserError
from frugality.tasks import get_task

if TYPE_CHECKING:
    from frugality.data.device_loader import DevicePrefetchStream


@dataclass
class TrainingData:
    samples: PackedSamples | PairSamples
    stream: TrainStream | DevicePrefetchStream  # the training batches, in a resumable order (on XLA, prefetched)
    val_batches: list  # this rank's forwards at each evaluation (tensors, or TextBatches of pairs)
    val_counted: int  # how many of them count (the rest keep the ranks in step)
    description: str  # for the run header: samples and tokens
    mask_id: int | None = None  # the tokenizer's [MASK], for masked-LM training
    special_ids: tuple[int, ...] = ()  # [CLS], [SEP], [PAD]...: never masked


def open_training_data(recipe: Recipe, progress: bool = True, rank: int = 0, world_size: int = 1) -> TrainingData:
    """The data, and this rank's share of each step's global batch and of the validation
    batches; the stream's position is global, so it resumes at any world size."""
    tokenizer = load_tokenizer(recipe.data.tokenizer)
    if tokenizer.vocab_size > recipe.model.vocab_size:
        raise UserError(
            f"tokenizer {recipe.data.tokenizer!r} has {tokenizer.vocab_size} tokens, more than "
            f"model.vocab_size ({recipe.model.vocab_size})"
        )
    task = get_task(recipe.train.task)
    if recipe.data.micro_batch_size < task.min_micro_batch:
        raise UserError(
            f"data.micro_batch_size = {recipe.data.micro_batch_size}: train.task {task.name} needs at least "
            f"{task.min_micro_batch} samples per micro-batch"
        )
    if task.samples == "pairs":
        samples = _open_pairs(recipe, tokenizer)
    else:
        dataset = _open_dataset(recipe, tokenizer, progress)
        samples = PackedSamples(dataset, recipe.data.seq_len, recipe.data.val_fraction, recipe.seed)
        # A dataset tokenized for another vocabulary shows in its first tokens; scanning them
        # all would take minutes on a large corpus.
        if int(dataset.tokens[: 1 << 24].max(initial=0)) >= recipe.model.vocab_size:
            raise UserError(
                f"dataset {dataset.prefix}: holds token ids >= model.vocab_size "
                f"({recipe.model.vocab_size}); was it tokenized with another tokenizer?"
            )
    stream = TrainStream(samples, recipe.data.global_batch_size, recipe.data.micro_batch_size, rank, world_size)
    val_batches, val_counted = validation_batches(
        samples, recipe.train.eval_samples, recipe.data.micro_batch_size, rank, world_size
    )
    if isinstance(samples, PairSamples):
        description = samples.description
    else:
        description = f"{len(samples.train_ids):,} training samples ({samples.dataset.num_tokens:,} tokens)"
    mask_id = tokenizer.tokenizer.token_to_id("[MASK]")
    if task.needs_mask_token and mask_id is None:
        raise UserError(
            f"train.task {task.name}: tokenizer {recipe.data.tokenizer!r} has no [MASK] token "
            '(use data.tokenizer = "bert-uncased" or a BERT tokenizer)'
        )
    specials = tuple(i for t in ("[CLS]", "[SEP]", "[PAD]") if (i := tokenizer.tokenizer.token_to_id(t)) is not None)
    return TrainingData(samples, stream, val_batches, val_counted, description, mask_id, specials)


def _open_pairs(recipe: Recipe, tokenizer: LoadedTokenizer) -> PairSamples:
    name = recipe.data.dataset
    if name.startswith(BUNDLED_PREFIX):
        try:
            name = bundled_pairs(name.removeprefix(BUNDLED_PREFIX))
        except ValueError as e:
            raise UserError(f"data.dataset: {e}") from None
    buckets = tuple(sorted({*recipe.data.buckets, recipe.data.seq_len}))
    return PairSamples(name, tokenizer.tokenizer, recipe.data.fields, buckets, recipe.data.val_fraction, recipe.seed)


def _open_dataset(recipe: Recipe, tokenizer: LoadedTokenizer, progress: bool) -> IndexedDataset:
    name = recipe.data.dataset
    if name.startswith(BUNDLED_PREFIX):
        try:
            prefix = bundled_dataset(name.removeprefix(BUNDLED_PREFIX), tokenizer, progress)
        except ValueError as e:
            raise UserError(f"data.dataset: {e}") from None
        return IndexedDataset(prefix)
    return IndexedDataset(name)
