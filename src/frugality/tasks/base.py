"""The task contract: what the training loop, the state builder and the memory plan may ask
of a task, and nothing else (tests/tasks/test_contract.py checks every task of `TASKS`).

A task owns its objective. It builds the *training module*: an `nn.Module` that holds the
plain model and turns a batch into the task's loss (masking, temperature, the cross-rank
gather of negatives included). Parallel layouts wrap that module from outside (DDP,
FSDP2; later tensor and pipeline parallel), so every parameter the loss touches is used
inside one forward. The model itself stays a plain single-device model that returns
hidden states; its weights, their names and its checkpoints do not depend on the task.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, ClassVar

import torch
from torch import nn

from frugality.errors import UserError


@dataclass(frozen=True)
class RunSetup:
    """What a task is fitted to for one run (`Task.configured`); each task takes what it
    uses and ignores the rest."""

    mask_id: int | None = None  # the tokenizer's [MASK] (masked LM)
    special_ids: tuple[int, ...] = ()  # tokens never masked: [CLS], [SEP], [PAD]
    mask_prob: float = 0.15
    gather: Callable | None = None  # every rank's rows as candidates (`frugality.distributed.gather_with_grad`)
    unpad: bool = False  # skip the padding between layers (eager runs: shapes vary)


@dataclass
class Evaluated:
    """One validation batch through the training module (`forward(batch, evaluate=True)`)."""

    loss: torch.Tensor  # the batch's mean loss
    weight: float  # what that mean is over (rows, masked positions, pairs): batches weigh alike
    outputs: Any = None  # what `Task.metrics` needs of the batch (contrastive: its embeddings)


class Task(ABC):
    """A training objective. Subclasses set the class attributes and implement the abstract
    methods; the others have defaults that suit most tasks."""

    name: ClassVar[str]
    families: ClassVar[tuple[str, ...]]  # the model families it trains
    trains: ClassVar[str] = "models"  # what they are, for messages: "encoders", "decoders"
    unused: ClassVar[tuple[str, ...]] = ()  # parameter prefixes its loss never reaches: frozen before wrapping
    gathers_negatives: ClassVar[bool] = False  # parallel.gather_negatives applies to it
    samples: ClassVar[str] = "blocks"  # its data: "blocks" of a Megatron dataset, or "pairs" of texts (JSONL)
    min_micro_batch: ClassVar[int] = 1  # the smallest micro-batch its loss is defined on
    needs_mask_token: ClassVar[bool] = False  # the tokenizer must have [MASK]
    perplexity: ClassVar[bool] = True  # its evaluations log exp(loss)
    runs_on_xla: ClassVar[bool] = False  # static shapes, no host reads in its step (docs/xla.md)
    # its loss from the model's output layer alone: split by vocabulary (tensor parallel) or on the last stage
    runs_model_parallel: ClassVar[bool] = False

    def __init__(self, setup: RunSetup = RunSetup()) -> None:
        self.setup = setup

    def configured(self, **changes) -> Task:
        """This task for one run: `RunSetup` fields changed, the others kept."""
        return type(self)(replace(self.setup, **changes))

    def check(self, model_config) -> None:
        """Refuse a model this task cannot train, in one line."""
        if model_config.family not in self.families:
            raise UserError(
                f"model.family {model_config.family!r}: task {self.name} trains {self.trains} "
                f"({', '.join(self.families)})"
            )

    @abstractmethod
    def training_module(self, model: nn.Module) -> nn.Module:
        """The module DDP and FSDP2 wrap: `forward(batch)` is the batch's loss (a scalar
        tensor), `forward(batch, evaluate=True)` an `Evaluated`; it holds `model` as `.model`
        and no parameters of its own (the optimizer and checkpoints see the model's:
        `build_state` refuses a module with others)."""

    def metrics(
        self, outputs: list, counted: int, all_ranks: Callable[[torch.Tensor], torch.Tensor]
    ) -> dict[str, float]:
        """An evaluation's figures besides the loss, from this rank's batches' `outputs`
        (the first `counted` count; the others only keep the ranks in step), with
        `all_ranks(rows)` gathering a tensor from every rank; none by default."""
        return {}

    @abstractmethod
    def tokens(self, batch) -> int:
        """The tokens a forward of `batch` processes, as throughput counts them."""

    def shape_key(self, batch) -> str:
        """Tells batches of different compiled shapes apart ('' for one shape per run); each
        key's first step is its warm-up."""
        return ""

    @abstractmethod
    def example_batch(self, recipe, device: torch.device):
        """A batch of the recipe's micro-batch shape (for the memory plan, on the meta device)."""

    def notes(self, recipe) -> list[str]:
        """Lines for the run header about how this task runs."""
        return []

    def batch_shape(self, recipe) -> str:
        """A step's batch, for the run header."""
        return f"{recipe.data.global_batch_size} x {recipe.data.seq_len} tokens"


@dataclass
class PackedBlocks:
    """Batches of packed token blocks, (B, T + 1) ids, as causal and masked LM take them:
    their token count, one compiled shape, an example. Shared by composition."""

    def tokens(self, batch: torch.Tensor) -> int:
        return batch.shape[0] * (batch.shape[1] - 1)

    def example_batch(self, recipe, device: torch.device) -> torch.Tensor:
        return torch.zeros((recipe.data.micro_batch_size, recipe.data.seq_len + 1), dtype=torch.long, device=device)


def rank() -> int:
    """This process's rank in the default process group, 0 outside one."""
    dist = torch.distributed
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
