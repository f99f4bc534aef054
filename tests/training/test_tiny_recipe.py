"""The shipped `tiny` recipe, unchanged but for the precision (about a minute or two each
on a 2-core CPU). Checks quality, never time:

- the model learns: the final validation loss is at least 30% below step 0's;
- bf16-sr (bf16 weights, gradients and moments, stochastic rounding) ends within 1% of
  fp32;
- plain bf16 (round-to-nearest) ends measurably worse than bf16-sr on the same steps:
  the reason stochastic rounding exists.
"""

import pytest

from frugality.config.recipe import load_recipe
from frugality.training import trainer


@pytest.fixture(scope="module")
def final_val_loss(tmp_path_factory):
    results = {}
    for precision in ("fp32", "bf16-sr", "bf16"):
        recipe = load_recipe("tiny", [f"train.precision={precision}"])
        run = tmp_path_factory.mktemp(f"tiny-{precision}")
        result = trainer.train(recipe, run_dir=run, progress=False, tensorboard=False)
        results[precision] = (result.evals[0], result.evals[recipe.train.steps])
    return results


def test_tiny_recipe_learns(final_val_loss):
    first, last = final_val_loss["fp32"]
    assert first > 10.5  # an untrained model is near ln(50304) = 10.83
    assert last <= 0.7 * first, (first, last)


def test_bf16_sr_matches_fp32_within_one_percent(final_val_loss):
    fp32, sr = final_val_loss["fp32"][1], final_val_loss["bf16-sr"][1]
    assert abs(sr - fp32) / fp32 <= 0.01, (fp32, sr)


def test_round_to_nearest_bf16_is_measurably_worse(final_val_loss):
    sr, nearest = final_val_loss["bf16-sr"][1], final_val_loss["bf16"][1]
    assert nearest - sr > 0.01, (sr, nearest)
