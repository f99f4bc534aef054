"""Training tasks: what a batch is and which loss the model is trained on. A recipe names
its task (`train.task`); the training loop calls the task and knows nothing of it.

To add one: a module with a class like `CausalLM` (its `name`, the model families it
trains, `check`, `loss`, `tokens` — the tokens a batch's forward processes — and
`shape_key`, which tells batches of different compiled shapes apart), registered in TASKS.
"""

from __future__ import annotations

from frugality.errors import UserError
from frugality.tasks.causal_lm import CausalLM
from frugality.tasks.contrastive import Contrastive
from frugality.tasks.masked_lm import MaskedLM

TASKS = {task.name: task for task in (CausalLM(), MaskedLM(), Contrastive())}


def get_task(name: str):
    try:
        return TASKS[name]
    except KeyError:
        raise UserError(f"train.task {name!r}: choose one of {', '.join(TASKS)}") from None


__all__ = ["TASKS", "CausalLM", "Contrastive", "MaskedLM", "get_task"]
