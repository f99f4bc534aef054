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
from frugality.tasks import TASKS, Evaluated, Task, freeze_unused, task_for

SRC = Path(__file__).resolve().parents[2] / "src" / "frugality"
SMALL = {  # each family at a few thousand parameters, with every part a task may train
    "gpt-neox": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 128, "max_seq_len": 32},
    "llama": {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "intermediate_size": 48,
        "vocab_size": 128,
        "max_seq_len": 32,
    },
    "bert": {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "intermediate_size": 48,
        "vocab_size": 128,
        "max_seq_len": 32,
        "mlm_head": True,
        "head": [16],
        "learn_temperature": True,
    },
}
PAIRS = [(name, family) for name, task in sorted(TASKS.items()) for family in task.families]


def test_every_task_is_a_declared_task():
    for name, task in TASKS.items():
        assert isinstance(task, Task) and task.name == name and task.families and isinstance(task.unused, tuple)
        assert task.samples in ("blocks", "pairs") and task.min_micro_batch >= 1
    # a subclass that leaves a declared method open cannot be made
    incomplete = type("Incomplete", (Task,), {"name": "x", "families": ("bert",)})
    with pytest.raises(TypeError, match="abstract"):
        incomplete()


def _batch(task, recipe):
    batch = task.example_batch(recipe, torch.device("cpu"))
    if isinstance(batch, torch.Tensor):
        return torch.randint(4, 128, batch.shape)
    lengths = torch.randint(2, batch.ids.shape[1] + 1, (batch.ids.shape[0], 1))
    mask = (torch.arange(batch.ids.shape[1]) < lengths).long()
    return type(batch)(torch.randint(4, 128, batch.ids.shape) * mask, mask, batch.groups)


@pytest.mark.parametrize("name, family", PAIRS)
def test_the_training_module_gives_a_loss_that_reaches_every_trained_parameter(name, family):
    """One forward gives a scalar loss whose backward reaches every parameter left
    trainable (DDP waits for each), none of the module's own; evaluation gives an
    `Evaluated`, and the task's metrics come from its outputs."""
    recipe = Recipe.model_validate(
        {
            "name": "contract",
            "model": {"family": family, **SMALL[family]},
            "data": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 4},
            "train": {"task": name},
        }
    )
    task = task_for(recipe, mask_id=3)
    torch.manual_seed(0)
    model = build_model(recipe.model)
    freeze_unused(task, model)
    module = task.training_module(model)
    assert module.model is model
    assert {id(p) for p in module.parameters()} == {id(p) for p in model.parameters()}  # none of its own
    batch = _batch(task, recipe)
    loss = module(batch)
    assert loss.dim() == 0 and torch.isfinite(loss)
    loss.backward()
    missed = [n for n, p in model.named_parameters() if p.requires_grad and p.grad is None]
    assert not missed, f"trainable but not reached by the loss: {missed}"
    with torch.no_grad():
        evaluated = module.eval()(batch, evaluate=True)
    assert isinstance(evaluated, Evaluated) and evaluated.loss.dim() == 0 and evaluated.weight > 0
    metrics = task.metrics([evaluated.outputs], 1, lambda rows: rows)
    assert set(metrics) == ({"recall@1", "recall@10", "mrr", "candidates"} if name == "contrastive" else set())
    assert task.tokens(batch) > 0 and isinstance(task.shape_key(batch), str) and task.batch_shape(recipe)


def test_the_loop_and_the_builder_do_not_probe_tasks():
    found = subprocess.run(
        [
            "grep",
            "-rn",
            "hasattr(task\\|hasattr(state.task\\|train.task [!=]=",
            str(SRC / "runtime"),
            str(SRC / "training"),
            str(SRC / "health"),
        ],
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
