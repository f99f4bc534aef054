"""Training tasks: what a batch is and which loss the model is trained on. A recipe names
its task (`train.task`); the training loop calls the task's training module and its
declared methods (`frugality.tasks.base.Task`), and knows nothing else of it.

To add one: a module with a `Task` subclass and its training module (see
docs/architecture.md), registered in TASKS and in the recipe's `train.task` values.
"""

from __future__ import annotations

from frugality.errors import UserError
from frugality.tasks.base import Evaluated, RunSetup, Task
from frugality.tasks.causal_lm import CausalLM
from frugality.tasks.contrastive import Contrastive
from frugality.tasks.masked_lm import MaskedLM

TASKS = {task.name: task for task in (CausalLM(), MaskedLM(), Contrastive())}


def get_task(name: str) -> Task:
    try:
        return TASKS[name]
    except KeyError:
        raise UserError(f"train.task {name!r}: choose one of {', '.join(TASKS)}") from None


def task_for(
    recipe, mask_id: int | None = None, special_ids: tuple[int, ...] = (), gather=None, unpad: bool = False
) -> Task:
    """The recipe's task, checked against its model and fitted to the run: the tokenizer's
    [MASK] id and the special tokens never masked (masked LM), the gather of every rank's
    negatives (`parallel.gather_negatives`), the padding skipped (eager contrastive runs)."""
    task = get_task(recipe.train.task)
    task.check(recipe.model)
    if recipe.parallel.gather_negatives and not task.gathers_negatives:
        raise UserError(
            f"parallel.gather_negatives = true: only contrastive training has negatives to gather "
            f"(train.task is {recipe.train.task!r})"
        )
    return task.configured(
        mask_id=0 if mask_id is None else mask_id,
        special_ids=tuple(special_ids),
        mask_prob=recipe.data.mask_prob,
        gather=gather,
        unpad=unpad,
    )


def freeze_unused(task, model) -> list[str]:
    """Parameters the task's loss never reaches stop requiring gradients, so that DDP does
    not wait for theirs (a BERT's pooler under contrastive training); their names."""
    frozen = []
    for name, p in model.named_parameters():
        if name.startswith(task.unused) or name in task.unused:
            p.requires_grad_(False)
            frozen.append(name)
    return frozen


__all__ = [
    "TASKS",
    "CausalLM",
    "Contrastive",
    "Evaluated",
    "MaskedLM",
    "RunSetup",
    "Task",
    "freeze_unused",
    "get_task",
    "task_for",
]
