"""Training tasks: what a batch is and which loss the model is trained on. A recipe names
its task (`train.task`); the training loop calls the task and knows nothing of it.

To add one: a module with a class like `CausalLM` (its `name`, the model families it
trains, `check`, `loss`), registered in TASKS.
"""

from __future__ import annotations

from frugality.errors import UserError
from frugality.tasks.causal_lm import CausalLM

TASKS = {task.name: task for task in (CausalLM(),)}


def get_task(name: str):
    try:
        return TASKS[name]
    except KeyError:
        raise UserError(f"train.task {name!r}: choose one of {', '.join(TASKS)}") from None


__all__ = ["TASKS", "CausalLM", "get_task"]
