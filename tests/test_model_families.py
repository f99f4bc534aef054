"""One spec per model family: what each says agrees with the code built for it, and code
outside `models/` and `interop/` asks the spec rather than checking family names."""

import ast
from pathlib import Path

import pytest

import frugality
from frugality.config.recipe import load_recipe
from frugality.distributed.tensor_parallel import PLANS
from frugality.errors import UserError
from frugality.interop.hf import ADAPTERS
from frugality.models import DECODERS, ENCODERS, SPECS, Decoder, family
from frugality.tasks import TASKS

SRC = Path(frugality.__file__).parent
# where a family's name is the point: the families themselves, their Hugging Face adapters,
# and the peers raced on their own architectures (torchtitan and liger-kernel: Llama only)
NAMED_HERE = ("models/", "interop/hf_", "bench/peers.py", "bench/cuda_peers.py", "bench/reference.py")


def test_each_spec_agrees_with_what_is_built_for_its_family():
    assert set(PLANS) == {name for name, f in SPECS.items() if f.tensor_parallel}
    assert set(DECODERS) | set(ENCODERS) == set(SPECS) and not set(DECODERS) & set(ENCODERS)
    assert all(issubclass(SPECS[name].model, Decoder.__args__) for name in DECODERS)  # (the causal LMs)
    assert not any(issubclass(SPECS[name].model, Decoder.__args__) for name in ENCODERS)
    assert {f.hf_model_type: name for name, f in SPECS.items()} == {a.MODEL_TYPE: a.FAMILY for a in ADAPTERS.values()}
    widths = {"pythia-70m": 2048, "llama-135m": 1536, "bert-mlm": 512}  # the MLPs: 4 x 512; as written (Llama, BERT)
    for name, width in widths.items():
        config = load_recipe(name).model
        assert isinstance(config, family(config).config) and family(config).width_of_mlp(config) == width
    assert family(load_recipe("llama-135m").model).heads_to_split(load_recipe("llama-135m").model) == {
        "heads": 9,
        "key-value heads": 3,
    }
    assert {task.name: task.families for task in TASKS.values()} == {
        "causal_lm": DECODERS,
        "masked_lm": ENCODERS,
        "contrastive": ENCODERS,
    }
    with pytest.raises(ValueError, match="unknown model family 't5'"):
        family("t5")


def test_a_family_without_a_plan_or_stages_is_refused_by_its_spec():
    from frugality.distributed.pipeline import check_pipeline
    from frugality.distributed.tensor_parallel import check_tensor_parallel

    bert = load_recipe("bert-mlm")
    with pytest.raises(UserError, match=r"'bert' has no tensor-parallel plan \(gpt-neox and llama do\)"):
        check_tensor_parallel(bert.model, 2, False, 2, seq_len=128)
    parallel = bert.parallel.model_copy(update={"pipeline": 2})
    with pytest.raises(UserError, match=r"'bert' is not cut into stages yet \(gpt-neox and llama are\)"):
        check_pipeline(bert.model, parallel, 2, 4)


def _name_comparisons(path: Path) -> list[int]:
    """Lines comparing something with a family's name (==, !=, in; either side; a tuple,
    list or set of names), or indexing by one (`PLANS["llama"]`)."""
    names, lines = set(SPECS), []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            values = [v for s in sides for v in (s.elts if isinstance(s, (ast.Tuple, ast.List, ast.Set)) else [s])]
        elif isinstance(node, ast.Subscript):
            values = [node.slice]
        else:
            continue
        if any(isinstance(v, ast.Constant) and v.value in names for v in values):
            lines.append(node.lineno)
    return lines


def test_the_walk_finds_each_way_of_naming_a_family(tmp_path):
    code = tmp_path / "c.py"
    code.write_text('a = f == "bert"\nb = "llama" != f\nc = f in ["gpt-neox"]\nd = PLANS["llama"]\ne = f == "t5"\n')
    assert _name_comparisons(code) == [1, 2, 3, 4]


def test_code_outside_the_families_asks_their_spec_rather_than_their_names():
    found = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if not rel.startswith(NAMED_HERE):
            found += [(rel, line) for line in _name_comparisons(path)]
    assert not found, "ask frugality.models.family(config) instead:\n" + "\n".join(map(str, found))
