"""Packed samples: fixed shapes, seeded order, held-out validation, sharding, resumption."""

import numpy as np
import pytest
import torch

from frugality.data.indexed import IndexedDataset, IndexedDatasetWriter
from frugality.data.loader import PackedSamples, TrainStream, validation_batches
from frugality.errors import UserError


@pytest.fixture
def dataset(tmp_path):
    w = IndexedDatasetWriter(tmp_path / "d", np.uint16)
    rng = np.random.default_rng(0)
    for _ in range(40):
        w.add_document(rng.integers(1, 1000, size=rng.integers(5, 200)))
    w.finalize()
    return IndexedDataset(tmp_path / "d")


def test_samples_are_disjoint_blocks_of_the_stream(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=3)
    assert len(s.train_ids) + len(s.val_ids) == dataset.num_tokens // 16
    assert not set(s.train_ids) & set(s.val_ids)
    batch = s.gather(np.array([0, 2]))
    assert batch.shape == (2, 16) and batch.dtype == torch.int64
    np.testing.assert_array_equal(batch[1].numpy(), dataset.tokens[32:48])


def test_every_step_has_the_same_shape_and_an_epoch_sees_each_sample_once(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=3)
    stream = TrainStream(s, global_batch_size=6, micro_batch_size=3)
    n = len(s.train_ids)
    seen = []
    for _ in range(n // 6 + 3):  # runs past the end of the first epoch
        micro = stream.next_step()
        assert [m.shape for m in micro] == [(3, 16), (3, 16)]
        seen.extend(tuple(row.tolist()) for m in micro for row in m)
    first_epoch = seen[:n]
    assert len(set(first_epoch)) == n  # every sample once before any repeats


def test_order_is_seeded(dataset):
    def first_batch(seed):
        s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=seed)
        return TrainStream(s, 4, 4).next_step()[0]

    assert torch.equal(first_batch(1), first_batch(1))
    assert not torch.equal(first_batch(1), first_batch(2))


def test_ranks_split_each_global_batch_and_resume_continues(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=3)
    single = TrainStream(s, global_batch_size=8, micro_batch_size=4)
    ranks = [TrainStream(s, 8, micro_batch_size=2, rank=r, world_size=2) for r in range(2)]
    for _ in range(3):
        whole = torch.cat(single.next_step())
        shards = torch.cat([torch.cat(r.next_step()) for r in ranks])
        assert sorted(map(tuple, whole.tolist())) == sorted(map(tuple, shards.tolist()))

    # A stream restored from the state (at another world size) yields the next unseen batch.
    restored = TrainStream(s, 8, 2, rank=0, world_size=2)
    restored.load_state_dict(single.state_dict())
    other = TrainStream(s, 8, 2, rank=1, world_size=2)
    other.load_state_dict(single.state_dict())
    expected = torch.cat(single.next_step())
    got = torch.cat(restored.next_step() + other.next_step())
    assert sorted(map(tuple, expected.tolist())) == sorted(map(tuple, got.tolist()))


def test_ranks_share_the_validation_batches_of_one_process_in_equal_numbers(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.3, seed=3)
    one, _ = validation_batches(s, count=3, micro_batch_size=1)
    shares = [validation_batches(s, count=3, micro_batch_size=1, rank=r, world_size=4) for r in range(4)]
    assert [len(batches) for batches, _ in shares] == [1, 1, 1, 1]  # one forward each
    counted = [b for batches, n in shares for b in batches[:n]]
    assert sorted(map(tuple, torch.cat(counted).tolist())) == sorted(map(tuple, torch.cat(one).tolist()))


def _samples(batches) -> list[tuple]:
    return sorted(map(tuple, torch.cat(batches).tolist()))


@pytest.mark.parametrize("micro, world", [(1, 1), (2, 1), (3, 1), (2, 2), (1, 3), (4, 2)])
def test_the_validation_samples_do_not_depend_on_the_batching(dataset, micro, world):
    """The counted rows of every rank together are the same samples, each once, whatever the
    micro-batch and the ranks (a short last batch where needed)."""
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.3, seed=3)
    expected, _ = validation_batches(s, count=8, micro_batch_size=4)
    shares = [validation_batches(s, 8, micro, rank=r, world_size=world) for r in range(world)]
    assert len({len(batches) for batches, _ in shares}) == 1  # every rank runs as many forwards
    assert _samples([b for batches, n in shares for b in batches[:n]]) == _samples(expected)
    assert len(_samples(expected)) == 8


def test_a_rank_with_no_validation_batch_of_its_own_runs_as_many_forwards_uncounted(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.3, seed=3)
    (first, counted0), (second, counted1) = [validation_batches(s, 4, 4, rank=r, world_size=2) for r in (0, 1)]
    assert (counted0, counted1) == (1, 0) and len(first) == len(second) == 1  # FSDP2 gathers in every forward


def test_validation_is_fixed_and_a_split_smaller_than_a_batch_is_one_short_batch(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=3)
    a, counted = validation_batches(s, 4, 1)
    b, _ = validation_batches(s, 4, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True)) and len(a) == counted == 4
    whole, counted = validation_batches(s, count=64, micro_batch_size=64)
    assert counted == 1 and whole[0].shape[0] == len(s.val_ids) < 64  # the whole split, one short batch
    with pytest.raises(UserError, match="multiple of"):
        TrainStream(s, global_batch_size=6, micro_batch_size=4)


@pytest.mark.parametrize("before, after", [(2, 1), (1, 2), (2, 3), (3, 2)])
def test_a_stream_resumed_at_another_world_size_takes_every_sample_once_per_epoch(dataset, before, after):
    """The position is global: ranks of any count, before and after a resume, together take
    the epoch's samples in one order, none skipped and none repeated."""
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=3)
    n = len(s.train_ids)
    taken: list[int] = []
    gather = s.gather
    s.gather = lambda ids: taken.extend(int(i) for i in ids) or gather(ids)
    global_batch = 12  # a multiple of the micro-batch (2) times 1, 2 and 3 ranks
    streams = [TrainStream(s, global_batch, 2, rank, before) for rank in range(before)]
    for _ in range(3):
        for stream in streams:
            stream.next_step()
    state = streams[0].state_dict()
    assert all(st.state_dict() == state for st in streams)  # one global position
    streams = [TrainStream(s, global_batch, 2, rank, after) for rank in range(after)]
    for stream in streams:
        stream.load_state_dict(state)
    while len(taken) < n - n % global_batch:
        for stream in streams:
            stream.next_step()
    epoch = taken[: n - n % global_batch]
    assert len(epoch) == len(set(epoch))  # nothing taken twice within the epoch
    assert set(epoch) <= set(s.train_ids.tolist())


def test_a_reshuffle_reorders_only_what_the_epoch_has_not_served_and_resumes_alike(dataset):
    s = PackedSamples(dataset, seq_len=15, val_fraction=0.1, seed=3)
    n = len(s.train_ids)
    rows = lambda stream, steps: [tuple(r.tolist()) for _ in range(steps) for m in stream.next_step() for r in m]
    plain = TrainStream(s, 4, 2)
    served = rows(plain, 3)  # 12 samples
    rest_plain = rows(plain, (n - 12) // 4)

    stream = TrainStream(s, 4, 2)
    assert rows(stream, 3) == served
    stream.reshuffle(1)  # what a first rollback to this position does
    state = stream.state_dict()
    assert state == {"consumed_samples": 12, "reshuffles": [[12, 1]]}
    rest = rows(stream, (n - 12) // 4)
    unserved = set(map(tuple, s.gather(s.train_ids).tolist())) - set(served)
    assert rest != rest_plain and len(set(rest)) == len(rest) and set(rest) <= unserved  # each once

    resumed = TrainStream(s, 4, 2)
    resumed.load_state_dict(state)
    assert rows(resumed, (n - 12) // 4) == rest  # a resumed run draws the same batches
    second = TrainStream(s, 4, 2)
    second.load_state_dict({"consumed_samples": 12, "reshuffles": [[12, 2]]})  # a second rollback here
    assert rows(second, (n - 12) // 4) != rest  # draws yet another order
    later = TrainStream(s, 4, 2)
    later.load_state_dict({"consumed_samples": 2 * n})  # other epochs keep their order
    resumed.load_state_dict({"consumed_samples": 2 * n, "reshuffles": [[12, 1]]})
    assert rows(later, 2) == rows(resumed, 2)
