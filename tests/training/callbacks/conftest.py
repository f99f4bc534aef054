"""A stand-in training state for callback tests: the fields callbacks read, no model run."""

from collections import deque
from types import SimpleNamespace

import pytest
import torch

from frugality.config.recipe import Recipe
from frugality.distributed import World
from frugality.tasks import TASKS
from frugality.training.loop import StepResult


@pytest.fixture
def state():
    recipe = Recipe.model_validate(
        {
            "name": "cb",
            "model": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "vocab_size": 512},
            "data": {"seq_len": 16, "global_batch_size": 4, "micro_batch_size": 2},
            "train": {"steps": 10, "eval_interval": 5, "save_interval": 4, "log_interval": 3},
            "metrics": {"peak_tflops": 1e-3},  # 1 GFLOP/s
        }
    )
    model = torch.nn.Linear(4, 4)
    stats = SimpleNamespace(as_dict=lambda: {"graphs": 2, "level": "O1"})
    return SimpleNamespace(
        recipe=recipe,
        task=TASKS["causal_lm"],
        model=model,
        optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
        device=torch.device("cpu"),
        step=0,
        stop_requested=False,
        policy=SimpleNamespace(compute_dtype=torch.float32, state_bytes_per_param=16, label="fp32", name="fp32"),
        compiled=SimpleNamespace(enabled=True, stats=stats, closed=0),
        world=World(),
        recent_losses=deque([2.5, 2.4], maxlen=50),
        tokens_seen=0,
        data=SimpleNamespace(stream=SimpleNamespace(epoch=0.5, state_dict=lambda: {"pos": 1}, reshuffles=[])),
    )


@pytest.fixture
def step():
    """step(state, loss=, seconds=, final=, rejected=): count a step and return its StepResult."""

    def make(state, loss=2.0, seconds=0.5, final=False, rejected=None):
        state.step += 1
        tokens = state.recipe.data.global_batch_size * state.recipe.data.seq_len  # as the loop counts them
        state.tokens_seen += tokens
        return StepResult(state.step, loss, 1.0, 1e-3, seconds, final, rejected, tokens=tokens)

    return make
