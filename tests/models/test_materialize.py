"""A model's values drawn a layer at a time (what a tensor- or pipeline-parallel rank keeps
its part of) are build_model's, bit for bit, and leave the generator where it would."""

import pytest
import torch

from frugality.config.recipe import load_recipe
from frugality.models import build_model
from frugality.models.materialize import allocate, draw_parameters


@pytest.mark.parametrize(
    "name, sets",
    [("tiny", []), ("llama-135m", ["model.num_layers=2", "model.tie_embeddings=true", "model.num_kv_heads=3"])],
)
def test_drawn_values_are_build_models_and_the_generator_ends_alike(name, sets):
    cfg = load_recipe(name, sets).model
    torch.manual_seed(7)
    built = dict(build_model(cfg).named_parameters())
    after_build = torch.rand(4)
    torch.manual_seed(7)
    drawn = {}
    draw_parameters(cfg, "cpu", lambda n, v: drawn.__setitem__(n, v.clone()))
    assert drawn.keys() == built.keys()
    assert all(torch.equal(drawn[n], built[n]) for n in built)
    assert torch.equal(torch.rand(4), after_build)


def test_a_part_allocated_from_the_meta_model_keeps_its_ties_and_rotary_tables():
    cfg = load_recipe("llama-135m", ["model.num_layers=2", "model.tie_embeddings=true"]).model
    with torch.device("meta"):
        model = build_model(cfg)
    part = allocate(model, "cpu")
    assert part.output.weight is part.embed.weight and not part.embed.weight.is_meta
    reference = build_model(cfg)
    for (name, ours), theirs in zip(part.named_buffers(), reference.buffers(), strict=True):
        assert torch.equal(ours, theirs), name
