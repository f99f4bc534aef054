"""Packed fixed-length samples from an indexed dataset, and the stream of training batches.

The token stream (documents back to back, each ending in EOD) is cut into disjoint
blocks of `seq_len + 1` tokens: inputs are the first `seq_len`, targets the last. Every
batch has the same shape, so compiled graphs never see a new one. A seeded permutation
holds out `val_fraction` of the blocks for validation.

The stream's whole state is one integer, the number of samples consumed so far, counted
over all data-parallel ranks together. Each step takes the next `global_batch_size`
positions of a per-epoch seeded shuffle, and rank r of W takes its own slice, so a
checkpoint resumes with the next unseen batch at any world size.

A rollback after a divergence (`train.on_nonfinite`) reshuffles what the current epoch has
not yet served: the positions of each reshuffle are part of the state, so a resumed run
draws the same batches.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

import numpy as np
import torch

from frugality.data.indexed import IndexedDataset
from frugality.errors import UserError

if TYPE_CHECKING:
    from frugality.data.pairs import PairSamples, TextBatch


class PackedSamples:
    def __init__(self, dataset: IndexedDataset, seq_len: int, val_fraction: float, seed: int) -> None:
        self.dataset = dataset
        self.seq_len = seq_len
        self.seed = seed
        self.block = seq_len + 1
        total = dataset.num_tokens // self.block
        if total < 2:
            raise UserError(
                f"dataset {dataset.prefix}: {dataset.num_tokens} tokens make fewer than two "
                f"samples of {self.block} tokens"
            )
        order = np.random.default_rng([seed, 0xDA7A]).permutation(total)
        n_val = max(1, round(val_fraction * total))
        self.val_ids = np.sort(order[:n_val])
        self.train_ids = np.sort(order[n_val:])

    def gather(self, ids: np.ndarray) -> torch.Tensor:
        """Samples by block id -> int64 tensor (len(ids), seq_len + 1)."""
        tokens = self.dataset.tokens
        rows = [tokens[i * self.block : (i + 1) * self.block] for i in ids.tolist()]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


class TrainStream:
    """Yields each optimizer step's micro-batches for one data-parallel rank."""

    def __init__(
        self,
        samples: PackedSamples | PairSamples,
        global_batch_size: int,
        micro_batch_size: int,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        if global_batch_size % (micro_batch_size * world_size):
            raise UserError(
                f"data.global_batch_size ({global_batch_size}) must be a multiple of "
                f"micro_batch_size x data-parallel ranks ({micro_batch_size} x {world_size})"
            )
        self.samples = samples
        self.global_batch_size = global_batch_size
        self.micro_batch_size = micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.grad_accum = global_batch_size // (micro_batch_size * world_size)
        self.consumed_samples = 0
        self.reshuffles: list[tuple[int, int]] = []  # (position, seed) from which an epoch's remainder was reshuffled
        self._epoch, self._order = -1, np.empty(0, dtype=np.int64)

    @property
    def epoch(self) -> float:
        return self.consumed_samples / len(self.samples.train_ids)

    def next_step(self) -> list:
        """grad_accum micro-batches of shape (micro_batch_size, seq_len + 1) (or, for samples
        that gather several at once, of one shape they choose: pairs padded to one bucket)."""
        start, b, w = self.consumed_samples, self.micro_batch_size, self.world_size
        ids = [self._ids(start + (m * w + self.rank) * b, b) for m in range(self.grad_accum)]
        self.consumed_samples += self.global_batch_size
        if hasattr(self.samples, "gather_step"):
            return cast("PairSamples", self.samples).gather_step(ids)
        return [self.samples.gather(i) for i in ids]

    def _ids(self, position: int, count: int) -> np.ndarray:
        n = len(self.samples.train_ids)
        ids = np.empty(count, dtype=np.int64)
        for j, pos in enumerate(range(position, position + count)):
            epoch, offset = divmod(pos, n)
            ids[j] = self._epoch_order(epoch)[offset]
        return ids

    def _epoch_order(self, epoch: int) -> np.ndarray:
        if epoch != self._epoch:
            rng = np.random.default_rng([self.samples.seed, 0x5EED, epoch])
            order = rng.permutation(self.samples.train_ids)
            n = len(order)
            for position, number in self.reshuffles:
                if position // n == epoch:  # the samples not yet served, in a new order
                    start = position % n
                    salted = np.random.default_rng([self.samples.seed, 0x5EED, epoch, 0x0DD, number])
                    order[start:] = salted.permutation(order[start:])
            self._epoch, self._order = epoch, order
        return self._order

    def reshuffle(self, number: int) -> None:
        """Serve the rest of the current epoch in a new order (its samples, each once), from
        the current position on; what was served before is unchanged. `number` (the run's
        rollbacks so far) seeds the order, so each reshuffle draws a different one."""
        self.reshuffles.append((self.consumed_samples, number))
        self._epoch = -1  # recomputed with the new order

    def state_dict(self) -> dict:
        state: dict[str, object] = {"consumed_samples": self.consumed_samples}
        if self.reshuffles:
            state["reshuffles"] = [list(r) for r in self.reshuffles]
        return state

    def load_state_dict(self, state: dict) -> None:
        self.consumed_samples = int(state["consumed_samples"])
        self.reshuffles = [(int(p), int(n)) for p, n in state.get("reshuffles", [])]
        self._epoch = -1


def validation_batches(
    samples: PackedSamples | PairSamples,
    count: int,
    micro_batch_size: int,
    rank: int = 0,
    world_size: int = 1,
) -> tuple[list[torch.Tensor | TextBatch], int]:
    """The same validation samples at every evaluation, whatever the micro-batch and the
    world size: the first `count` of the split, or the whole split where it is smaller. They
    go in micro-batches dealt round-robin to the ranks; the last is short where the samples
    run out (its own compiled shape, met at the first evaluation). Returns this rank's
    batches and how many of them count: every rank must run the same number of forwards
    (FSDP2 gathers parameters in each), so a rank with fewer adds forwards of another batch
    whose loss is not counted."""
    n = min(len(samples.val_ids), count)
    b = micro_batch_size
    batches = -(-n // b)
    mine = [samples.gather(samples.val_ids[k * b : min((k + 1) * b, n)]) for k in range(rank, batches, world_size)]
    forwards = -(-batches // world_size)
    padding = [mine[0] if mine else samples.gather(samples.val_ids[: min(b, n)])] * (forwards - len(mine))
    return mine + padding, len(mine)
