"""The default recipe does what the README promises: the model learns real English.

This runs the shipped `tiny` recipe unchanged (about two minutes on a 2-core CPU) and
checks quality, not time: the final validation loss is at least 30% below step 0's.
"""

from frugality.config.recipe import load_recipe
from frugality.training import trainer


def test_tiny_recipe_learns(tmp_path):
    result = trainer.train(load_recipe("tiny"), run_dir=tmp_path / "tiny", progress=False, tensorboard=False)
    first, last = result.evals[0], result.evals[100]
    assert first > 10.5  # an untrained model is near ln(50304) = 10.83
    assert last <= 0.7 * first, (first, last)
