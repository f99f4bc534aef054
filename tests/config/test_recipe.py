"""Recipes: the shipped ones are valid and published; bad input is one clear line."""

import pytest

from frugality.config.recipe import load_recipe, shipped_recipes
from frugality.errors import UserError

PYTHIA = {  # name: (layers, hidden, heads, lr) from EleutherAI/pythia models/*.yml
    "pythia-14m": (6, 128, 4, 1e-3),
    "pythia-70m": (6, 512, 8, 1e-3),
    "pythia-160m": (12, 768, 12, 6e-4),
    "pythia-410m": (24, 1024, 16, 3e-4),
    "pythia-1b": (16, 2048, 8, 3e-4),
    "pythia-1.4b": (24, 2048, 16, 2e-4),
    "pythia-2.8b": (32, 2560, 32, 1.6e-4),
    "pythia-6.9b": (32, 4096, 32, 1.2e-4),
    "pythia-12b": (36, 5120, 40, 1.2e-4),
}


def test_every_shipped_recipe_validates():
    names = set(shipped_recipes())
    assert {"tiny", "gpt-neox-20b", *PYTHIA} <= names
    for name in names:
        assert load_recipe(name).name == name


@pytest.mark.parametrize("name", sorted(PYTHIA))
def test_pythia_recipes_have_the_published_architecture(name):
    r = load_recipe(name)
    layers, hidden, heads, lr = PYTHIA[name]
    m = r.model
    assert (m.num_layers, m.hidden_size, m.num_heads, r.optim.lr) == (layers, hidden, heads, lr)
    assert (m.rotary_pct, m.parallel_residual, m.vocab_size, m.max_seq_len) == (0.25, True, 50304, 2048)
    assert r.data.seq_len == 2048 and r.data.global_batch_size == 1024
    assert r.optim.min_lr == pytest.approx(lr / 10) and r.train.steps == 143000


def test_gpt_neox_20b():
    m = load_recipe("gpt-neox-20b").model
    assert (m.num_layers, m.hidden_size, m.num_heads, m.rotary_pct) == (44, 6144, 64, 0.25)


@pytest.mark.parametrize(
    "name, tensor, pipeline, world",
    [("gpt-neox-20b:tp8-pp4", 8, 4, 32), ("gpt-neox-20b:tp2-pp4", 2, 4, 96), ("pythia-6.9b:tp8", 8, 1, 32)],
)
def test_layout_variants_apply_over_their_recipe_and_pass_the_layout_checks(name, tensor, pipeline, world):
    from frugality.distributed.pipeline import check_pipeline
    from frugality.distributed.tensor_parallel import check_tensor_parallel

    base, variant = name.split(":")
    r, plain = load_recipe(name), load_recipe(base)
    assert r.name == f"{base}-{variant}" and (r.parallel.tensor, r.parallel.pipeline) == (tensor, pipeline)
    assert r.parallel.sequence and r.compile.level == "O0"  # blocks run eagerly under TP and PP
    assert (r.model, r.data, r.optim) == (plain.model, plain.data, plain.optim)  # the write-up's batch and length
    check_tensor_parallel(r.model, tensor, True, world, r.data.seq_len)
    data_ranks = world // (tensor * pipeline)
    check_pipeline(r.model, r.parallel, world, r.data.global_batch_size // (data_ranks * r.data.micro_batch_size))
    assert load_recipe(name, ["parallel.tensor=4"]).parallel.tensor == 4  # overrides come after the variant


def test_an_unknown_variant_lists_the_recipes_variants(tmp_path):
    with pytest.raises(UserError, match=r"no variant 'tp4' \(its variants: tp2-pp4, tp8-pp4\)"):
        load_recipe("gpt-neox-20b:tp4")
    with pytest.raises(UserError, match=r"no variant 'x' \(its variants: none\)"):
        load_recipe("tiny:x")
    path = tmp_path / "mine.toml"
    path.write_text(
        "[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 2\n[variants.wide]\nmodel = { hidden_size = 65 }\n"
    )
    with pytest.raises(UserError, match=r"mine.toml:wide: model: hidden_size \(65\)"):
        load_recipe(f"{path}:wide")
    path.write_text("variants = 3\n")
    with pytest.raises(UserError, match=r"mine.toml: variants: a table of \[variants.NAME\] tables \(got 3\)"):
        load_recipe(str(path))
    with pytest.raises(UserError, match=r"recipe file nope:b/r.toml does not exist"):  # a colon in a path is no variant
        load_recipe("nope:b/r.toml")


def test_default_is_tiny_and_overrides_apply():
    r = load_recipe(None, ["optim.lr=3e-4", "train.device=cpu", "optim.betas=[0.8, 0.9]"])
    assert r.name == "tiny"
    assert r.optim.lr == 3e-4 and r.train.device == "cpu" and r.optim.betas == (0.8, 0.9)


def test_recipe_from_a_file(tmp_path):
    path = tmp_path / "mine.toml"
    path.write_text("[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 2\n")
    r = load_recipe(str(path))
    assert r.name == "mine" and r.model.ffn_size == 256


BAD = [
    ("[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 2\nhiden = 3\n", "model.hiden: unknown key"),
    (
        "[model]\nhidden_size = 100\nnum_layers = 2\nnum_heads = 3\n",
        "model: hidden_size (100) must be divisible by num_heads (3)",
    ),
    (
        "[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 2\n[train]\nsteps = -5\n",
        "train.steps: Input should be greater than 0 (got -5)",
    ),
    (
        "[model]\nhidden_size = 'big'\nnum_layers = 2\nnum_heads = 2\n",
        "model.hidden_size: Input should be a valid integer",
    ),
    ("[model]\nnum_layers = 2\nnum_heads = 2\n", "model.hidden_size: missing required key"),
    (
        "[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 2\n[data]\nseq_len = 4096\n",
        "data.seq_len (4096) exceeds model.max_seq_len (2048)",
    ),
    (
        "[model]\nhidden_size = 64\nnum_layers = 2\nnum_heads = 2\n[optim]\nlr = 1e-4\nmin_lr = 1e-3\n",
        "optim: min_lr (0.001) must not exceed lr (0.0001)",
    ),
    ("[model\nhidden_size = 64\n", "not valid TOML"),
]


@pytest.mark.parametrize("text,message", BAD)
def test_bad_recipes_name_the_file_and_key(tmp_path, text, message):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(UserError) as e:
        load_recipe(str(path))
    assert str(e.value).startswith(f"recipe {path}")
    assert message in str(e.value)
    assert "\n" not in str(e.value)


def test_bad_override_names_the_flag():
    with pytest.raises(UserError, match=r"^--set optim\.lrr=1: optim\.lrr: unknown key$"):
        load_recipe("tiny", ["optim.lrr=1"])
    with pytest.raises(UserError, match=r"^--set train\.steps=0: train\.steps: Input should be greater than 0"):
        load_recipe("tiny", ["train.steps=0"])
    with pytest.raises(UserError, match="expected KEY=VALUE"):
        load_recipe("tiny", ["optim.lr"])
    # an item of a list the flag set: the flag, not the recipe file
    with pytest.raises(
        UserError, match=r"^--set optim\.betas=\[0\.9\]: optim\.betas: too few values \(item 1 is missing\)$"
    ):
        load_recipe("tiny", ["optim.betas=[0.9]"])
    with pytest.raises(
        UserError, match=r"^--set optim\.betas=\[0\.9, 'x'\]: optim\.betas\.1: Input should be a valid number"
    ):
        load_recipe("tiny", ["optim.betas=[0.9, 'x']"])


def test_unknown_recipe_lists_shipped_ones(tmp_path):
    with pytest.raises(UserError, match="no recipe named 'pythia-7b'.*pythia-70m"):
        load_recipe("pythia-7b")
    with pytest.raises(UserError, match="does not exist"):
        load_recipe(str(tmp_path / "nope.toml"))


@pytest.mark.parametrize("name,params", [("llama-8b", 8_030_261_248), ("llama-1b", 1_235_814_400)])
def test_llama_recipes_have_the_published_sizes(name, params):
    """Parameter counts of Llama 3.1 8B and Llama 3.2 1B (tied), as their model cards give."""
    import torch

    from frugality.models import build_model

    with torch.device("meta"):
        model = build_model(load_recipe(name).model)
    assert sum(p.numel() for p in model.parameters()) == params


def test_unknown_model_family_names_the_flag():
    with pytest.raises(UserError, match=r"^--set model.family=t5: model.family: unknown model family 't5'"):
        load_recipe("tiny", ["model.family=t5"])


def test_each_settings_values_are_listed_once_and_implemented():
    """The recipe lists the allowed values; each implementing package covers exactly them."""
    from frugality.compile.levels import _LEVELS
    from frugality.config import recipe
    from frugality.precision import AUTO, PRECISIONS, get_policy
    from frugality.tasks import TASKS

    assert set(_LEVELS) == set(recipe.COMPILE_LEVELS)
    assert set(TASKS) == set(recipe.TASKS)
    assert (AUTO, *PRECISIONS) == recipe.PRECISIONS
    assert all(get_policy(name).name == name for name in PRECISIONS)


@pytest.mark.parametrize(
    "flag,message",
    [
        ("foo.bar=1", "foo: unknown key"),
        ("data.global_batch_size=5", "data: global_batch_size (5) must be a multiple of micro_batch_size"),
        ("optim.min_lr=1", "optim: min_lr (1.0) must not exceed lr"),
        ("data.seq_len=99999", "data.seq_len (99999) exceeds model.max_seq_len"),
        ("model.num_heads=7", "model: hidden_size (128) must be divisible by num_heads (7)"),
    ],
)
def test_a_check_across_fields_broken_by_a_flag_names_the_flag(flag, message):
    with pytest.raises(UserError) as e:
        load_recipe("tiny", [flag])
    assert str(e.value).startswith(f"--set {flag} (with recipe ") and message in str(e.value)


def test_every_problem_of_a_file_is_listed_a_line_each(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('[model]\nhidden_size = 100\nnum_heads = 3\n[optim]\nlr = -1\nmin_lr = "x"\n[bogus]\na = 1\n')
    with pytest.raises(UserError) as e:
        load_recipe(str(path))
    lines = str(e.value).splitlines()
    assert [line.split(": ")[1] for line in lines] == ["model.num_layers", "optim.lr", "optim.min_lr", "bogus"]
    assert all(line.startswith(f"recipe {path}: ") for line in lines)


def test_older_recipes_eval_batches_are_read_as_the_samples_they_meant(tmp_path):
    """`train.eval_batches` counted micro-batches: kept as eval_samples = batches x micro."""
    assert load_recipe("tiny").train.eval_samples == 32
    assert load_recipe("tiny", ["train.eval_batches=2", "data.micro_batch_size=4"]).train.eval_samples == 8
    old = tmp_path / "old.toml"
    old.write_text(
        "[model]\nhidden_size = 32\nnum_layers = 1\nnum_heads = 4\n[data]\nmicro_batch_size = 3\n"
        "global_batch_size = 6\n[train]\neval_batches = 5\n"
    )
    recipe = load_recipe(str(old))
    assert recipe.train.eval_samples == 15 and "eval_batches" not in recipe.to_toml()
    with pytest.raises(UserError, match="train.eval_batches"):
        load_recipe(str(old), ["train.eval_batches=0"])


def test_a_list_with_too_few_values_is_one_line_naming_the_flag_as_a_user_meets_it(frugality_cli, tmp_path):
    done = frugality_cli("train", "tiny", "--set", "optim.betas=[0.9]", "--run-dir", tmp_path / "run")
    assert done.returncode == 2 and done.stderr.splitlines() == [
        "error: --set optim.betas=[0.9]: optim.betas: too few values (item 1 is missing)"
    ]
    assert not (tmp_path / "run").exists()
