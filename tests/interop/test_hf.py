"""Hugging Face checkpoints in and out, and training from another model's weights."""

import json

import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.interop.hf_gpt_neox import config_to_hf
from frugality.models import GPTNeoX, GPTNeoXConfig
from frugality.training import trainer

transformers = pytest.importorskip("transformers")

CFG = GPTNeoXConfig(hidden_size=32, num_layers=2, num_heads=4, vocab_size=50304, max_seq_len=64)


def _hf_model(cfg=CFG, seed=0):
    torch.manual_seed(seed)
    config = transformers.GPTNeoXConfig(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    return transformers.GPTNeoXForCausalLM(config).eval()


def _logits(model, tokens):
    with torch.no_grad():
        out = model(tokens)
        return (out.logits if hasattr(out, "logits") else out).float()


@pytest.mark.parametrize("layout", ["safetensors", "sharded", "bin"])
def test_import_then_export_round_trips_through_transformers(tmp_path, layout, capsys):
    theirs = _hf_model()
    kwargs = {"sharded": dict(max_shard_size="1MB"), "bin": dict(safe_serialization=False)}.get(layout, {})
    theirs.save_pretrained(tmp_path / "hf", **kwargs)
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", "hf", str(tmp_path / "imported"), "--out", str(tmp_path / "exported")]) == 0
    back, info = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "exported", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.randint(0, 50304, (2, 48))
    assert (_logits(back.eval(), tokens) - _logits(theirs, tokens)).abs().max().item() <= 1e-4
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path / "exported")
    assert tokenizer("Hello world").input_ids == [12092, 1533]


@pytest.mark.parametrize("name, recipe_name", [("my model", "my-model"), ("modèle ünï", "modele-uni")])
def test_an_out_folder_with_a_space_or_accents_imports_and_exports(tmp_path, name, recipe_name, capsys):
    """A folder name that is not a valid recipe name gives the recipe a name made from it."""
    import shutil

    from frugality.data.tokenizer import shipped_tokenizer_dir

    _hf_model().save_pretrained(tmp_path / "hf")
    shutil.copy(shipped_tokenizer_dir("pythia") / "tokenizer.json", tmp_path / "hf" / "tokenizer.json")
    out = tmp_path / "models" / name
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(out)]) == 0, capsys.readouterr().err
    recipe = load_recipe(str(out / "recipe.toml"))
    assert recipe.name == recipe_name and recipe.data.tokenizer == str((out / "tokenizer.json").resolve())
    assert main(["export", "hf", str(out), "--out", str(tmp_path / f"{name} hf")]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / f"{name} hf").eval()
    tokens = torch.randint(0, 50304, (1, 16))
    assert (_logits(back, tokens) - _logits(_hf_model(), tokens)).abs().max().item() <= 1e-4


def test_a_trained_run_exports_with_equal_logits(micro_recipe_file, tmp_path):
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=2"])
    trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert main(["export", "hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()

    from frugality.interop.weights import load_weights, resolve_source

    ours = GPTNeoX(recipe.model).eval()
    load_weights(resolve_source(tmp_path / "run"), ours)
    tokens = torch.randint(0, 50304, (2, 32))
    assert (_logits(ours, tokens) - _logits(theirs, tokens)).abs().max().item() <= 1e-4


def test_bf16_weights_stay_bf16(tmp_path):
    _hf_model().to(torch.bfloat16).save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    assert main(["export", "hf", str(tmp_path / "imported"), "--out", str(tmp_path / "exported")]) == 0
    assert json.loads((tmp_path / "exported" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    from safetensors.torch import load_file

    assert all(t.dtype == torch.bfloat16 for t in load_file(tmp_path / "exported" / "model.safetensors").values())


def test_unsupported_and_broken_sources_are_one_line_errors(tmp_path, capsys):
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    assert main(["import", "hf", str(tmp_path / "t5"), "--out", str(tmp_path / "out")]) == 2
    assert "model_type 't5' is not supported yet" in capsys.readouterr().err
    (tmp_path / "llama").mkdir()
    (tmp_path / "llama" / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    assert main(["import", "hf", str(tmp_path / "llama"), "--out", str(tmp_path / "out")]) == 2
    assert "config.json lacks 'num_attention_heads'" in capsys.readouterr().err
    assert main(["import", "hf", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert "no config.json" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    # export names its own argument (not train's --init-from)
    assert main(["export", "hf", str(tmp_path / "nothing"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.strip() == f"error: checkpoint {tmp_path / 'nothing'}: no such file or folder"
    (tmp_path / "empty").mkdir()
    assert main(["export", "hf", str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err.startswith(f"error: checkpoint {tmp_path / 'empty'}: not a run directory")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_init_from_continues_where_the_source_left_off(micro_recipe_file, tmp_path):
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=12", "train.eval_interval=12"])
    source = trainer.train(recipe, run_dir=tmp_path / "source", progress=False, tensorboard=False)
    follow = trainer.train(
        recipe, run_dir=tmp_path / "follow", progress=False, tensorboard=False, init_from=tmp_path / "source"
    )
    # Step 0 of the new run evaluates the source's final weights on the same validation data.
    assert follow.evals[0] == pytest.approx(source.evals[12], abs=1e-5)
    assert follow.evals[0] < 10.0  # far from an untrained model's ~10.9

    again = trainer.train(
        recipe,
        run_dir=tmp_path / "again",
        progress=False,
        tensorboard=False,
        init_from=tmp_path / "source",
        resume_optimizer=True,
    )
    assert again.evals[0] == pytest.approx(source.evals[12], abs=1e-5)


def test_init_from_a_mismatching_model_names_the_tensor(micro_recipe_file, tmp_path):
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=2"])
    trainer.train(recipe, run_dir=tmp_path / "source", progress=False, tensorboard=False)
    wider = load_recipe(str(micro_recipe_file), ["train.steps=2", "model.hidden_size=64"])
    with pytest.raises(UserError, match=r"tensor 'embed.weight' has shape \[50304, 32\] there but \[50304, 64\]"):
        trainer.train(wider, run_dir=tmp_path / "new", progress=False, init_from=tmp_path / "source")
    assert not (tmp_path / "new").exists()
    with pytest.raises(UserError, match="no such file"):
        trainer.train(recipe, run_dir=tmp_path / "new", progress=False, init_from=tmp_path / "missing")
    assert not (tmp_path / "new").exists()


def test_init_from_a_hugging_face_folder_directly(micro_recipe_file, tmp_path):
    """A save_pretrained folder works as --init-from without importing it first."""
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=2"])
    theirs = _hf_model(recipe.model, seed=3)
    theirs.save_pretrained(tmp_path / "hf")
    result = trainer.train(
        recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False, init_from=tmp_path / "hf"
    )
    # The step-0 evaluation ran on transformers' weights: recompute it with transformers.
    from frugality.data.bundled import bundled_dataset
    from frugality.data.indexed import IndexedDataset
    from frugality.data.loader import PackedSamples, validation_batches
    from frugality.data.tokenizer import load_tokenizer

    samples = PackedSamples(
        IndexedDataset(bundled_dataset("gutenberg", load_tokenizer("pythia"), progress=False)),
        recipe.data.seq_len,
        recipe.data.val_fraction,
        recipe.seed,
    )
    losses = []
    for batch in validation_batches(samples, recipe.train.eval_samples, recipe.data.micro_batch_size)[0]:
        logits = _logits(theirs, batch[:, :-1])
        losses.append(torch.nn.functional.cross_entropy(logits.flatten(0, 1), batch[:, 1:].flatten()))
    assert result.evals[0] == pytest.approx(torch.stack(losses).mean().item(), abs=1e-4)


def test_a_config_that_disagrees_with_its_weights_or_a_cut_file_is_refused_at_import(tmp_path, capsys):
    _hf_model().save_pretrained(tmp_path / "hf")
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "wide").mkdir()
    (tmp_path / "wide" / "model.safetensors").write_bytes((tmp_path / "hf" / "model.safetensors").read_bytes())
    (tmp_path / "wide" / "config.json").write_text(json.dumps(config | {"hidden_size": 64}))
    assert main(["import", "hf", str(tmp_path / "wide"), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "config.json and the weights disagree" in err and "is [50304, 32] in the weights, [50304, 64]" in err
    weights = tmp_path / "hf" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "out")]) == 2
    [line] = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"error: {weights}: not a readable checkpoint file (")
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_a_full_disk_during_export_or_import_is_one_line_and_leaves_nothing(tmp_path):
    """A real full disk (a 1 MiB tmpfs, tests/fulldisk.py) for a model of 12 MiB: export runs
    out of space while writing model.safetensors; import finds it will not fit before it
    writes. Each is one line naming the path and the free space; no OUT.partial is left."""
    import re
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fulldisk

    _hf_model().save_pretrained(tmp_path / "hf")
    assert main(["import", "hf", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    disk = tmp_path / "disk"
    for args, message in (
        (
            ["export", "hf", str(tmp_path / "imported"), "--out", str(disk / "exported")],
            rf"error: cannot write {disk}/exported/model\.safetensors: No space left on device \(\d+\.\d GiB free on "
            rf"the device holding {disk}\)",
        ),
        (
            ["import", "hf", str(tmp_path / "hf"), "--out", str(disk / "imported")],
            rf"error: cannot write {disk}/imported: 1\.0 MiB free on the device holding {disk}, the weights need "
            rf"~12\.4 MiB",
        ),
    ):
        done = fulldisk.run_on_small_disk(disk, 1 << 20, args, cwd=tmp_path)
        _, left = fulldisk.left(done)
        assert done.returncode == 2, done.stderr[-3000:]
        [line] = [line for line in done.stderr.splitlines() if line.strip()]
        assert re.fullmatch(message, line), line
        assert left == []


def test_exported_files_share_one_mode(micro_recipe_file, tmp_path):
    trainer.train(
        load_recipe(str(micro_recipe_file), ["train.steps=2", "optim.warmup_steps=1"]),
        run_dir=tmp_path / "run",
        progress=False,
        tensorboard=False,
    )
    assert main(["export", "hf", str(tmp_path / "run"), "--out", str(tmp_path / "hf")]) == 0
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "hf").iterdir()}
    assert len(set(modes.values())) == 1 and modes["model.safetensors"] & 0o044, modes
