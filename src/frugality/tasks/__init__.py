"""Training tasks: what a batch is and which loss the model is trained on. A recipe names
its task (`train.task`); the training loop calls the task and knows nothing of it.

To add one: a module with a class like `CausalLM` (its `name`, the model families it
trains, `check` of the model config, `loss`, `tokens` — the tokens a batch's forward
processes — `shape_key`, which tells batches of different compiled shapes apart,
`example_batch` for the memory plan, and `unused`, the parameters its loss never touches),
registered in TASKS.
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


def task_for(recipe, mask_id: int | None = None, special_ids: tuple[int, ...] = ()):
    """The recipe's task, checked against its model and set up for its data (masked LM:
    the tokenizer's [MASK] id and the special tokens it never masks)."""
    task = get_task(recipe.train.task)
    task.check(recipe.model)
    if hasattr(task, "configure"):
        task = task.configure(0 if mask_id is None else mask_id, recipe.data.mask_prob, special_ids)
    return task


def freeze_unused(task, model) -> list[str]:
    """Parameters the task's loss never reaches stop requiring gradients, so that DDP does
    not wait for theirs (a BERT's pooler under contrastive training); their names."""
    frozen = []
    for name, p in model.named_parameters():
        if name.startswith(task.unused) or name in task.unused:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


__all__ = ["TASKS", "CausalLM", "Contrastive", "MaskedLM", "freeze_unused", "get_task", "task_for"]
