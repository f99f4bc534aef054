"""Embedding models to and from sentence-transformers: a contrastively trained run with a
projection head, exported, loads in sentence-transformers and embeds as frugality does;
its Dense modules come back on import."""

import json

import numpy as np
import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.inference.batches import embed_texts
from frugality.inference.encoder import load_encoder
from frugality.interop.hf import import_hf
from frugality.training import trainer

TEXTS = [
    "a domesticated carnivorous mammal",
    "bank, depository financial institution",
    "the act of moving quickly",
    "a short text",
    "an open air market where stalls sell goods",
]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, micro_pairs_recipe_text):
    folder = tmp_path_factory.mktemp("st")
    recipe_file = folder / "micro-pairs.toml"
    recipe_file.write_text(
        micro_pairs_recipe_text.replace("head = [24, 16]", 'head = [24, 16]\nhead_activation = "tanh"')
    )
    trainer.train(load_recipe(str(recipe_file)), run_dir=folder / "run", progress=False)
    return folder / "run"


def test_an_exported_run_embeds_in_sentence_transformers_as_in_frugality(trained_run, tmp_path):
    from sentence_transformers import SentenceTransformer

    assert main(["export", "hf", str(trained_run), "--out", str(tmp_path / "st")]) == 0
    modules = json.loads((tmp_path / "st" / "modules.json").read_text())
    assert [m["type"].rsplit(".", 1)[-1] for m in modules] == ["Transformer", "Pooling", "Dense", "Dense", "Normalize"]
    theirs = SentenceTransformer(str(tmp_path / "st"), device="cpu").encode(TEXTS, convert_to_numpy=True)
    ours_encoder, _ = load_encoder(trained_run, torch.device("cpu"), "fp32")
    ours = embed_texts(ours_encoder, TEXTS, 256, 8)
    assert ours.shape == theirs.shape == (len(TEXTS), 16)
    assert np.allclose(np.linalg.norm(ours, axis=1), 1, atol=1e-5)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(theirs, axis=1)
    assert cosine.min() >= 0.9999, cosine
    # and back: the exported folder embeds alike through frugality, head and all
    again, _ = load_encoder(tmp_path / "st", torch.device("cpu"), "fp32")
    assert np.allclose(embed_texts(again, TEXTS, 256, 8), ours, atol=1e-5)
    config, state = import_hf(tmp_path / "st")
    assert config.head == (24, 16) and config.head_activation == "tanh" and config.normalize
    assert "head.1.bias" in state and "logit_scale" not in state


def test_a_dense_module_frugality_cannot_run_is_refused_on_import(trained_run, tmp_path, capsys):
    assert main(["export", "hf", str(trained_run), "--out", str(tmp_path / "st")]) == 0
    last = tmp_path / "st" / "3_Dense" / "config.json"
    config = json.loads(last.read_text())
    last.write_text(json.dumps(config | {"activation_function": "torch.nn.modules.activation.Tanh"}))
    assert main(["import", "hf", str(tmp_path / "st"), "--out", str(tmp_path / "imported")]) == 2
    assert "none after the last" in capsys.readouterr().err
    assert not (tmp_path / "imported").exists()


@pytest.mark.slow
def test_a_run_started_from_an_embedding_model_keeps_the_length_it_cuts_texts_to(
    frugality_cli, trained_run, tmp_path, micro_pairs_recipe_text
):
    """The model's sentence-transformers length (24 here; all-MiniLM-L6-v2's 256, under its
    512 positions) goes with a run trained from it: `embed` and `export hf` of the run use it."""
    assert main(["export", "hf", str(trained_run), "--out", str(tmp_path / "st")]) == 0
    (tmp_path / "st" / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 24}))
    recipe = tmp_path / "pairs.toml"
    recipe.write_text(micro_pairs_recipe_text.replace("head = [24, 16]", 'head = [24, 16]\nhead_activation = "tanh"'))
    run = tmp_path / "run"
    trained = frugality_cli(
        "train", recipe, "--init-from", tmp_path / "st", "--run-dir", run, "--no-progress", "--set", "train.steps=1"
    )
    assert trained.returncode == 0, trained.stderr
    (tmp_path / "texts.txt").write_text("".join(t + "\n" for t in TEXTS))
    for model, out in ((run, "emb"), (run / "checkpoints" / "step_00000001", "emb-of-its-checkpoint")):
        embedded = frugality_cli("embed", model, tmp_path / "texts.txt", "--out", tmp_path / out, "--no-progress")
        assert embedded.returncode == 0, embedded.stderr
        assert json.loads((tmp_path / out / "manifest.json").read_text())["encoder"]["max_length"] == 24
    assert frugality_cli("export", "hf", run, "--out", tmp_path / "again").returncode == 0
    assert json.loads((tmp_path / "again" / "sentence_bert_config.json").read_text())["max_seq_length"] == 24
