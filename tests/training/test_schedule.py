import math

import pytest

from frugality.training.schedule import learning_rate


def test_warmup_then_cosine_to_the_floor():
    lr = lambda s: learning_rate(s, total_steps=110, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert lr(0) == pytest.approx(0.1) and lr(9) == pytest.approx(1.0)
    assert lr(10) == pytest.approx(1.0)
    assert lr(60) == pytest.approx(0.1 + 0.45 * (1 + math.cos(math.pi * 0.5)))
    assert lr(110) == pytest.approx(0.1) and lr(500) == pytest.approx(0.1)
    assert all(lr(s) >= lr(s + 1) for s in range(10, 120))


def test_no_warmup():
    assert learning_rate(0, 100, 1.0, 0.0, 0) == pytest.approx(1.0)


def test_a_warmup_longer_than_the_run_is_cut_to_it():
    lr = lambda s: learning_rate(s, total_steps=6, lr=1.0, min_lr=0.1, warmup_steps=10)
    assert [lr(s) for s in range(6)] == pytest.approx([learning_rate(s, 6, 1.0, 0.1, 6) for s in range(6)])
    assert lr(5) == pytest.approx(1.0)  # the run reaches its peak rate at its last step
