"""XLA's prefetching device loader around the resumable stream: the same steps, on the
device; the position a checkpoint saves is that of the last step handed out, not of the
steps read ahead; a rewind or a reshuffle serves what the plain stream serves."""

from __future__ import annotations

import pytest
import torch

from frugality.config.recipe import load_recipe
from frugality.data.device_loader import DevicePrefetchStream
from frugality.runtime.data import open_training_data


def _streams(recipe_file):
    recipe = load_recipe(str(recipe_file), ["data.global_batch_size=4", "data.micro_batch_size=2"])
    plain = open_training_data(recipe, progress=False).stream
    ahead = DevicePrefetchStream(open_training_data(recipe, progress=False).stream, prefetch=2)
    return plain, ahead


def _same(plain_step, device_step):
    assert len(plain_step) == len(device_step) == 2
    for a, b in zip(plain_step, device_step, strict=True):
        assert b.device.type == "xla"
        assert torch.equal(a, b.cpu())


def test_steps_come_on_the_device_and_the_saved_position_is_the_last_handed_out(micro_recipe_file):
    plain, ahead = _streams(micro_recipe_file)
    try:
        for _ in range(3):
            _same(plain.next_step(), ahead.next_step())
        # the reader is ahead of training; what a checkpoint saves is not
        assert ahead.stream.consumed_samples > plain.consumed_samples
        assert ahead.state_dict() == plain.state_dict() and ahead.epoch == plain.epoch
        saved = ahead.state_dict()
        for _ in range(2):
            _same(plain.next_step(), ahead.next_step())
        ahead.load_state_dict(saved)  # a rollback's restore: back to step 3's position
        plain.load_state_dict(saved)
        for _ in range(2):
            _same(plain.next_step(), ahead.next_step())
        ahead.reshuffle(1)  # the divergence guard's new order from the handed-out position
        plain.reshuffle(1)
        assert ahead.reshuffles == plain.reshuffles
        for _ in range(2):
            _same(plain.next_step(), ahead.next_step())
        assert ahead.state_dict() == plain.state_dict()
    finally:
        ahead.close()
    assert ahead.stream.state_dict() == plain.state_dict()  # closing sets the stream back


def test_an_error_reading_the_data_is_raised_in_training_not_lost_as_an_end(micro_recipe_file, monkeypatch):
    """The reader thread fails at its fifth step's gather; training gets the four steps
    read before it, then the error (not an end of the data)."""
    _, ahead = _streams(micro_recipe_file)
    gather, calls = ahead.stream.samples.gather, []

    def failing(ids):
        calls.append(ids)
        if len(calls) > 8:  # two micro-batches a step: the fifth step
            raise OSError("the dataset's .bin went away")
        return gather(ids)

    monkeypatch.setattr(ahead.stream.samples, "gather", failing)
    delivered = 0
    try:
        with pytest.raises(OSError, match="went away"):
            for _ in range(20):  # more than the loader can hold ahead
                ahead.next_step()
                delivered += 1
    finally:
        ahead.close()
    assert delivered == 4
