"""Non-finite steps are never applied: a NaN in one gradient skips that step's update (and
names the parameter), a diverging run stops with one line and exit status 3."""

from __future__ import annotations

import json

import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.errors import FrugalityWarning
from frugality.tasks.causal_lm import CausalLM
from frugality.training import loop, trainer


def test_a_nan_in_one_gradient_skips_that_step_and_names_the_parameter(micro_recipe_file, tmp_path, monkeypatch):
    target = "layers.1.mlp.down.weight"
    real_loss, real_step = CausalLM.loss, loop.train_step
    seen = {}

    def loss(self, model, batch):  # at step 3, the target's gradient comes back NaN
        out = real_loss(self, model, batch)
        if seen.get("step") == 3:
            p = dict(model.named_parameters())[target]
            hook = p.register_hook(lambda g: (hook.remove(), torch.full_like(g, float("nan")))[1])
        return out

    def step(state, batches):
        seen["step"] = state.step + 1
        before = {n: p.detach().clone() for n, p in state.module.named_parameters()}
        out = real_step(state, batches)
        unchanged = all(torch.equal(before[n], p) for n, p in state.module.named_parameters())
        seen[state.step + 1] = unchanged
        return out

    monkeypatch.setattr(CausalLM, "loss", loss)
    monkeypatch.setattr(loop, "train_step", step)
    recipe = load_recipe(str(micro_recipe_file))
    with pytest.warns(FrugalityWarning, match=f"step 3: the gradient of {target} is not finite; its update was skipped"):
        result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert result.final_step == 8
    assert seen[3] is True and not any(seen[s] for s in (1, 2, 4, 5, 6, 7, 8))  # only step 3 left weights alone
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    skipped = {r["step"]: r["skipped"] for r in records if "skipped" in r}
    assert skipped == {3: f"the gradient of {target}"}


def test_a_diverging_run_stops_in_one_line_with_exit_status_3(micro_recipe_file, tmp_path, capsys):
    args = ["train", str(micro_recipe_file), "--run-dir", str(tmp_path / "run"), "--no-progress",
            "--set", "optim.lr=1e6", "--set", "train.on_nonfinite=stop"]
    assert main(args) == 3
    [line] = [l for l in capsys.readouterr().err.splitlines() if l.startswith("error")]
    assert line.startswith("error: step 2: the gradient of embed.weight is not finite; stopping before applying it")
