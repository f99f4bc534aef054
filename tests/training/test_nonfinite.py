"""Bad steps are never applied: a NaN in one gradient skips that step's update (and names the
parameter), a rollback restores the last checkpoint with the rest of the epoch reshuffled, a
loss spike counts as a bad step, a diverging run stops with one line and exit status 3."""

from __future__ import annotations

import json
import re

import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.errors import FrugalityWarning
from frugality.tasks.causal_lm import CausalLMModule
from frugality.training import loop, trainer


def test_a_nan_in_one_gradient_skips_that_step_and_names_the_parameter(micro_recipe_file, tmp_path, monkeypatch):
    target = "layers.1.mlp.down.weight"
    real_loss, real_step = CausalLMModule.forward, loop.train_step
    seen = {}

    def loss(self, batch, evaluate=False):  # at step 3, the target's gradient comes back NaN
        out = real_loss(self, batch, evaluate)
        if seen.get("step") == 3 and not evaluate:
            p = dict(self.model.named_parameters())[target]
            hook = p.register_hook(lambda g: (hook.remove(), torch.full_like(g, float("nan")))[1])
        return out

    def step(state, batches, **kw):
        seen["step"] = state.step + 1
        before = {n: p.detach().clone() for n, p in state.model.named_parameters()}
        out = real_step(state, batches, **kw)
        unchanged = all(torch.equal(before[n], p) for n, p in state.model.named_parameters())
        seen[state.step + 1] = unchanged
        return out

    monkeypatch.setattr(CausalLMModule, "forward", loss)
    monkeypatch.setattr(loop, "train_step", step)
    recipe = load_recipe(str(micro_recipe_file))
    with pytest.warns(
        FrugalityWarning, match=f"step 3: the gradient of {target} is not finite; its update was skipped"
    ):
        result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert result.final_step == 8
    assert seen[3] is True and not any(seen[s] for s in (1, 2, 4, 5, 6, 7, 8))  # only step 3 left weights alone
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in records if "skipped" in r}
    assert skipped == {3: f"the gradient of {target} is not finite"}


def test_a_diverging_run_stops_in_one_line_with_exit_status_3(micro_recipe_file, tmp_path, capsys):
    args = [
        "train",
        str(micro_recipe_file),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        "optim.lr=1e6",
        "--set",
        "train.on_nonfinite=stop",
    ]
    assert main(args) == 3
    [line] = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]
    # where lr=1e6 first overflows (the step, the loss or which gradient) depends on the CPU's
    # arithmetic: step 2 and embed.weight on AMD Zen 3 and Zen 4, another on an Intel Xeon with AMX
    assert re.fullmatch(r"error: step \d+: the (loss|gradient) .*is not finite; stopping before applying it.*", line), (
        line
    )


def _bad_step(monkeypatch, at: int, times: int, spoil):
    """`spoil(model, loss)` applied to the loss of step `at`, the first `times` times that step
    runs (a rollback runs it again); returns the first micro-batch of every step run, in order."""
    real_loss, real_step = CausalLMModule.forward, loop.train_step
    runs = {"now": 0, "spoiled": 0, "batches": []}

    def loss(self, batch, evaluate=False):
        out = real_loss(self, batch, evaluate)
        if runs["now"] == at and runs["spoiled"] < times and not evaluate:
            runs["spoiled"] += 1
            return spoil(self.model, out)
        return out

    def step(state, batches, **kw):
        runs["now"] = state.step + 1
        runs["batches"].append((runs["now"], batches[0].clone()))
        return real_step(state, batches, **kw)

    monkeypatch.setattr(CausalLMModule, "forward", loss)
    monkeypatch.setattr(loop, "train_step", step)
    return runs


def _nan_gradient(model, loss):
    p = dict(model.named_parameters())["layers.1.mlp.down.weight"]
    hook = p.register_hook(lambda g: (hook.remove(), torch.full_like(g, float("nan")))[1])
    return loss


def test_rollback_restores_the_last_checkpoint_and_reshuffles_the_rest_of_the_epoch(
    micro_recipe_file, tmp_path, monkeypatch
):
    from frugality.checkpoint import CheckpointManager

    runs = _bad_step(monkeypatch, at=6, times=1, spoil=_nan_gradient)
    recipe = load_recipe(str(micro_recipe_file), ["train.on_nonfinite=rollback"])  # checkpoints at 4, 8
    with pytest.warns(
        FrugalityWarning,
        match="step 6: the gradient of layers.1.mlp.down.weight is not finite; "
        "rolled back to step_00000004, the rest of the epoch reshuffled",
    ):
        result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert result.final_step == 8
    assert [n for n, _ in runs["batches"]] == [1, 2, 3, 4, 5, 6, 5, 6, 7, 8]
    first_5, again_5 = runs["batches"][4][1], runs["batches"][6][1]
    assert not torch.equal(first_5, again_5)  # other batches after the rollback
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    [bad] = [r for r in records if "skipped" in r]
    assert bad["step"] == 6 and bad["rolled_back_to"] == 4
    # The reshuffle is in the next checkpoint: a resumed run draws the same batches.
    model_state = CheckpointManager(tmp_path / "run" / "checkpoints")
    from frugality.models import build_model
    from frugality.runtime.optim import build_optimizer

    model = build_model(recipe.model)
    extra = model_state.load(model_state.latest(), model, build_optimizer(model, recipe.optim))
    assert extra["data"]["reshuffles"] == [[4 * recipe.data.global_batch_size, 1]]


def test_a_step_that_stays_bad_after_the_rollbacks_stops_the_run(micro_recipe_file, tmp_path, monkeypatch):
    from frugality.errors import RunDiverged

    runs = _bad_step(monkeypatch, at=6, times=99, spoil=_nan_gradient)
    recipe = load_recipe(str(micro_recipe_file), ["train.on_nonfinite=rollback", "train.max_rollbacks=2"])
    with (
        pytest.warns(FrugalityWarning, match="rolled back"),
        pytest.raises(RunDiverged, match="step 6: .* not finite; stopping after 2 rollback"),
    ):
        trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert [n for n, _ in runs["batches"]] == [1, 2, 3, 4, 5, 6, 5, 6, 5, 6]  # each rollback counted
    fives = [b for n, b in runs["batches"] if n == 5]
    assert not torch.equal(fives[1], fives[2])  # the second reshuffle draws another order


def test_a_loss_spike_is_skipped_like_a_non_finite_step(micro_recipe_file, tmp_path, monkeypatch):
    _bad_step(monkeypatch, at=6, times=1, spoil=lambda model, loss: loss * 100)
    recipe = load_recipe(str(micro_recipe_file), ["train.loss_spike=3", "train.loss_spike_window=4"])
    with pytest.warns(
        FrugalityWarning,
        match=r"step 6: the loss .* is \d+\.\dx the median .* of the last 4 steps "
        r"\(train.loss_spike = 3.0\); its update was skipped",
    ):
        result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert result.final_step == 8
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "skipped" in r] == [6]
