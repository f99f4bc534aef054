"""Llama checkpoints in and out of transformers, and training a Llama-family recipe."""

import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.training import trainer

transformers = pytest.importorskip("transformers")


def _hf_llama(tie: bool, seed: int = 0):
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=96,
        vocab_size=50304,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
        tie_word_embeddings=tie,
    )
    return transformers.LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("tie", [False, True])
def test_llama_import_export_round_trip(tmp_path, tie):
    theirs = _hf_llama(tie)
    theirs.save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", "hf", str(tmp_path / "imported"), "--out", str(tmp_path / "exported")]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert back.config.tie_word_embeddings == tie and back.config.num_key_value_heads == 2
    tokens = torch.randint(0, 50304, (2, 40))
    with torch.no_grad():
        assert (back.eval()(tokens).logits - theirs(tokens).logits).abs().max().item() <= 1e-4


def test_a_llama_recipe_trains_resumes_and_exports(micro_recipe_file, tmp_path):
    overrides = [
        "model.family=llama",
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=64",
        "model.tie_embeddings=true",
        "train.steps=12",
        "train.eval_interval=12",
    ]
    text = micro_recipe_file.read_text().replace('family = "gpt-neox"\n', "")
    micro_recipe_file.write_text(text)
    recipe = load_recipe(str(micro_recipe_file), overrides)
    result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert result.evals[12] < result.evals[0] - 0.5
    assert main(["export", "hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(theirs).__name__ == "LlamaForCausalLM"
    from frugality.interop.weights import load_weights, resolve_source
    from frugality.models import build_model

    ours = build_model(recipe.model).eval()
    load_weights(resolve_source(tmp_path / "run"), ours)
    tokens = torch.randint(0, 50304, (2, 32))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4
    follow = trainer.train(
        recipe, run_dir=tmp_path / "follow", progress=False, tensorboard=False, init_from=tmp_path / "hf"
    )
    assert follow.evals[0] == pytest.approx(result.evals[12], abs=1e-4)
