"""Every registered task keeps the declared contract (`frugality.tasks.base.Task`): its
training module turns a batch into a scalar loss through one forward, and evaluation into
an `Evaluated`; the loop and the builder ask nothing else of a task."""

from __future__ import annotations

import inspect
import subprocess
from pathlib import Path

import pytest
import torch

from frugality.config.recipe import Recipe
from frugality.models import build_model
from frugality.tasks import TASKS, Evaluated, Task, task_for

SRC = Path(__file__).resolve().parents[2] / "src" / "frugality"
SMALL = {
    "gpt-neox": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 128, "max_seq_len": 32},
    "llama": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "kv_heads": 2, "vocab_size": 128, "max_seq_len": 32},
    "bert": {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 64,
        "vocab_size": 128,
        "max_seq_len": 32,
        "mlm_head": True,
    },
}


def test_every_task_is_a_declared_task_with_nothing_left_abstract():
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name
        assert not inspect.isabstract(type(task)), f"{name} leaves {type(task).__abstractmethods__} open"
        assert task.families and isinstance(task.unused, tuple)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_the_training_module_gives_a_loss_and_an_evaluation_through_one_forward(name):
    task = TASKS[name]
    family = task.families[0]
    recipe = Recipe.model_validate(
        {
            "name": "contract",
            "model": {"family": family, **SMALL[family]},
            "data": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 4},
            "train": {"task": name},
        }
    )
    fitted = task_for(recipe, mask_id=3)
    torch.manual_seed(0)
    model = build_model(recipe.model)
    module = fitted.training_module(model)
    assert module.model is model and {n for n, _ in model.named_parameters()} <= {
        n.removeprefix("model.") for n, _ in module.named_parameters()
    }  # the task adds no weights of its own
    batch = fitted.example_batch(recipe, torch.device("cpu"))
    batch = (
        type(batch)(**{**vars(batch), "ids": torch.randint(4, 128, batch.ids.shape)})
        if hasattr(batch, "ids")
        else torch.randint(4, 128, batch.shape)
    )
    calls = []
    module.register_forward_hook(lambda *a: calls.append(1))
    loss = module(batch)
    assert loss.dim() == 0 and torch.isfinite(loss) and len(calls) == 1
    loss.backward()
    assert any(p.grad is not None for p in model.parameters())
    with torch.no_grad():
        evaluated = module.eval()(batch, evaluate=True)
    assert isinstance(evaluated, Evaluated) and evaluated.loss.dim() == 0 and evaluated.weight > 0
    assert isinstance(fitted.metrics([evaluated.outputs], 1, lambda rows: rows), dict)
    assert fitted.tokens(batch) > 0 and isinstance(fitted.shape_key(batch), str)


def test_the_loop_and_the_builder_do_not_probe_tasks():
    found = subprocess.run(
        ["grep", "-rn", "hasattr(task\\|hasattr(state.task", str(SRC / "runtime"), str(SRC / "training")],
        capture_output=True,
        text=True,
    ).stdout
    assert found == "", found


def test_the_documented_example_task_keeps_the_contract():
    """docs/architecture.md's whole example of a task, run as written."""
    import re

    text = (SRC.parents[1] / "docs" / "architecture.md").read_text()
    [example] = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    namespace: dict = {}
    exec(compile(example, "architecture.md", "exec"), namespace)
    task = namespace["SuffixLM"]()
    assert isinstance(task, Task) and not inspect.isabstract(type(task))
    recipe = Recipe.model_validate(
        {
            "name": "example",
            "model": {"family": "gpt-neox", **SMALL["gpt-neox"]},
            "data": {"seq_len": 16, "global_batch_size": 2, "micro_batch_size": 2},
        }
    )
    module = task.training_module(build_model(recipe.model))
    batch = torch.randint(0, 128, (2, 17))
    loss = module(batch)
    loss.backward()
    assert loss.dim() == 0 and torch.isfinite(loss) and module(batch, evaluate=True).weight == 2
