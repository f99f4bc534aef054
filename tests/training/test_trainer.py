"""End-to-end training on the bundled corpus with a micro model."""

import json
import os
import signal

import pytest
import torch

from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.models import build_model
from frugality.runtime.layout import plan_layout
from frugality.runtime.optim import build_optimizer
from frugality.runtime.state import build_state
from frugality.training import loop, trainer


def _final_state(recipe, run_dir):
    model = build_model(recipe.model)
    optimizer = build_optimizer(model, recipe.optim)
    manager = CheckpointManager(run_dir / "checkpoints")
    extra = manager.load(manager.latest(), model, optimizer)
    return model.state_dict(), optimizer.state_dict(), extra


def _train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _assert_identical(a, b):
    model_a, optim_a, extra_a = a
    model_b, optim_b, extra_b = b
    assert model_a.keys() == model_b.keys()
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    for i, state in optim_a["state"].items():
        for k, v in state.items():
            assert torch.equal(v, optim_b["state"][i][k]), (i, k)
    assert extra_a["data"] == extra_b["data"]
    assert extra_a["rng"] == extra_b["rng"]


def test_loss_falls_and_the_run_directory_has_everything(micro_recipe_file, tmp_path):
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=12", "train.eval_interval=6", "cost.target_loss=9.5"])
    result = trainer.train(recipe, run_dir=tmp_path / "run", progress=False)
    run = tmp_path / "run"
    assert result.evals[12] < result.evals[0] - 1.0  # from ~ln(50304) = 10.8

    assert load_recipe(str(run / "recipe.toml")).model == recipe.model
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    train_records = [r for r in records if r["kind"] == "train"]
    assert [r["step"] for r in train_records] == list(range(1, 13))
    for key in ("loss", "grad_norm", "lr", "tokens_per_s", "mfu", "tokens"):
        assert all(isinstance(r[key], float | int) for r in train_records), key
    assert [r["step"] for r in records if r["kind"] == "eval"] == [0, 6, 12]

    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_step"] == 12 and summary["tokens_seen"] == 12 * 4 * 32
    assert summary["first_val_loss"] == result.evals[0] and summary["final_val_loss"] == result.evals[12]
    assert [p.name for p in CheckpointManager(run / "checkpoints").complete()] == [
        "step_00000008",
        "step_00000012",
    ]  # keep_checkpoints = 2

    # What the run cost: every figure there, each labelled with how it is known
    cost = summary["cost"]
    for key in (
        "wall_time_s",
        "tokens_per_s",
        "usd",
        "tokens_per_dollar",
        "usd_per_million_tokens",
        "kwh",
        "joules_per_token",
        "kg_co2e",
    ):
        assert isinstance(cost[key], float | int) and cost[key] > 0, key
    assert cost["tokens"] == 12 * 4 * 32 and cost["tokens_per_dollar"] == pytest.approx(
        cost["tokens"] / cost["usd"], rel=2e-3
    )
    labels = cost["labels"]
    assert labels["price"].startswith(("estimated", "catalogue", "declared"))
    assert labels["energy"].startswith(("measured", "estimated"))  # RAPL where readable, else the vCPU model
    assert {"pue", "carbon"} <= set(labels)
    target = cost["target"]  # between the evaluations at 6 and 12 (or at 6): interpolated in both
    assert target["reached"] and 0 < target["step"] <= 12 and 0 < target["elapsed_s"] <= cost["wall_time_s"]
    evals = [r for r in records if r["kind"] == "eval"]
    assert all(r["energy_j"] >= 0 and r["elapsed_s"] > 0 for r in evals)
    assert [r["elapsed_s"] for r in evals] == sorted(r["elapsed_s"] for r in evals)

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(run))
    events.Reload()
    tags = events.Tags()["scalars"]
    assert {
        "train/loss",
        "train/grad_norm",
        "train/lr",
        "train/tokens_per_s",
        "train/mfu",
        "eval/loss",
        "eval/perplexity",
    } <= set(tags)
    assert len(events.Scalars("train/loss")) == 12


def test_stop_and_resume_is_bit_identical(micro_recipe_file, tmp_path, micro_reference_run):
    recipe = load_recipe(str(micro_recipe_file))  # 8 steps, checkpoints every 4
    straight = micro_reference_run

    first = trainer.train(recipe, run_dir=tmp_path / "split", until_step=3, progress=False, tensorboard=False)
    assert first.final_step == 3
    with open(tmp_path / "split" / "metrics.jsonl", "a") as log:
        log.write('{"kind": "train", "step": 4, "lo')  # a line cut by a crash or a full disk: dropped
    second = trainer.train(recipe, run_dir=tmp_path / "split", progress=False, tensorboard=False)
    assert second.start_step == 3 and second.final_step == 8
    # the run's cost counts both sessions: the first one's time is carried over from the log
    records = [json.loads(line) for line in (tmp_path / "split" / "metrics.jsonl").read_text().splitlines()]
    step3 = next(r for r in records if r["kind"] == "train" and r["step"] == 3)
    assert second.summary["cost"]["wall_time_s"] > step3["elapsed_s"] > 0
    assert second.summary["wall_time_s"] > first.summary["wall_time_s"] > 0  # the summary too covers both
    assert second.summary["cost"]["device_energy_j"] > step3["energy_j"] > 0  # the first session's last record
    assert step3["kwh"] > 0 and step3["tokens_per_dollar"] > 0  # the cost figures reach TensorBoard too

    _assert_identical(_final_state(recipe, straight), _final_state(recipe, tmp_path / "split"))
    assert _train_losses(straight) == _train_losses(tmp_path / "split")


def test_a_corrupt_newest_checkpoint_resumes_from_the_one_before_to_the_same_bits(
    micro_recipe_file, tmp_path, micro_reference_run
):
    import shutil

    from frugality.checkpoint import CorruptCheckpointWarning

    recipe = load_recipe(str(micro_recipe_file))  # 8 steps, checkpoints at 4 and 8
    straight = micro_reference_run
    shutil.copytree(straight, tmp_path / "cut")
    shard = next((tmp_path / "cut" / "checkpoints" / "step_00000008").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])  # a crash mid-write of the disk
    with pytest.warns(CorruptCheckpointWarning, match="step_00000008 is unusable"):
        again = trainer.train(recipe, run_dir=tmp_path / "cut", progress=False, tensorboard=False)
    assert again.start_step == 4 and again.final_step == 8
    _assert_identical(_final_state(recipe, straight), _final_state(recipe, tmp_path / "cut"))
    assert _train_losses(straight) == _train_losses(tmp_path / "cut")


def test_sigterm_checkpoints_and_the_rerun_resumes_exactly(
    micro_recipe_file, tmp_path, monkeypatch, micro_reference_run
):
    recipe = load_recipe(str(micro_recipe_file))

    real_step = loop.train_step
    calls = []

    def step_then_get_killed(*args, **kwargs):
        calls.append(1)
        out = real_step(*args, **kwargs)
        if len(calls) == 5:
            os.kill(os.getpid(), signal.SIGTERM)  # what SLURM sends on preemption
        return out

    monkeypatch.setattr(loop, "train_step", step_then_get_killed)
    killed = trainer.train(recipe, run_dir=tmp_path / "killed", progress=False, tensorboard=False)
    assert killed.interrupted and killed.final_step == 5
    monkeypatch.setattr(loop, "train_step", real_step)
    resumed = trainer.train(recipe, run_dir=tmp_path / "killed", progress=False, tensorboard=False)
    assert resumed.start_step == 5 and resumed.final_step == 8
    _assert_identical(_final_state(recipe, micro_reference_run), _final_state(recipe, tmp_path / "killed"))
    # The steps after the checkpoint are logged once, not twice.
    assert sorted(_train_losses(tmp_path / "killed")) == list(range(1, 9))


def test_resume_refuses_another_model_and_fresh_keeps_the_old_run(micro_recipe_file, tmp_path):
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=2"])
    trainer.train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    wider = load_recipe(str(micro_recipe_file), ["train.steps=2", "model.hidden_size=64"])
    before = sorted(p.name for p in (tmp_path / "run").rglob("*"))
    with pytest.raises(UserError, match=r"another model.hidden_size \(32 in its checkpoint step_00000002, 64 now\)"):
        trainer.train(wider, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    assert sorted(p.name for p in (tmp_path / "run").rglob("*")) == before

    trainer.train(wider, run_dir=tmp_path / "run", fresh=True, progress=False, tensorboard=False)
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run.prev-")]
    assert len(aside) == 1 and CheckpointManager(aside[0] / "checkpoints").latest() is not None
    assert load_recipe(str(tmp_path / "run" / "recipe.toml")).model.hidden_size == 64


def test_bad_inputs_fail_before_anything_is_written(micro_recipe_file, tmp_path):
    run = tmp_path / "run"
    cases = [
        (["data.dataset=" + str(tmp_path / "missing")], "does not exist"),
        (["data.tokenizer=gpt2", "model.vocab_size=50000"], "more than model.vocab_size"),
        (["train.device=cuda:7"] if not torch.cuda.is_available() else ["train.device=nonsense"], "device"),
    ]
    for overrides, message in cases:
        with pytest.raises(UserError, match=message):
            trainer.train(load_recipe(str(micro_recipe_file), overrides), run_dir=run, progress=False)
        assert not run.exists()
    with pytest.raises(UserError, match="until-step"):
        trainer.train(load_recipe(str(micro_recipe_file)), run_dir=run, until_step=99, progress=False)
    assert not run.exists()


def test_gradient_accumulation_matches_one_big_batch(micro_recipe_file):
    """Two micro-batches of 2 give the loss, gradient norm and update of one batch of 4."""
    recipe = load_recipe(str(micro_recipe_file), ["optim.grad_clip=0"])
    batch = torch.randint(0, 50000, (4, 33))
    results = []
    for micro in ([batch[:2], batch[2:]], [batch]):
        state = build_state(plan_layout(recipe, torch.device("cpu")))
        state.optimizer = torch.optim.SGD(state.model.parameters(), lr=1.0)  # the update is the gradient
        loss, norm, _ = loop.train_step(state, micro)
        results.append((loss, norm, state.model.state_dict()))
    (loss_a, norm_a, state_a), (loss_b, norm_b, state_b) = results
    assert loss_a == pytest.approx(loss_b, rel=1e-6) and norm_a == pytest.approx(norm_b, rel=1e-5)
    for k in state_a:
        torch.testing.assert_close(state_a[k], state_b[k], rtol=1e-5, atol=1e-6)


def test_amp_bf16_trains(micro_recipe_file, tmp_path):
    recipe = load_recipe(
        str(micro_recipe_file), ["train.precision=amp-bf16", "train.steps=12", "train.eval_interval=12"]
    )
    result = trainer.train(recipe, run_dir=tmp_path / "amp", progress=False, tensorboard=False)
    assert result.evals[12] < result.evals[0] - 1.0
    # Master weights stay fp32 under autocast.
    assert all(v.dtype == torch.float32 for v in _final_state(recipe, tmp_path / "amp")[0].values())


def test_resuming_under_another_precision_is_refused(micro_recipe_file, tmp_path):
    """`auto` may resolve otherwise on another machine: the checkpoint's policy must match."""
    run = tmp_path / "run"
    trainer.train(load_recipe(str(micro_recipe_file)), run_dir=run, until_step=2, progress=False, tensorboard=False)
    with pytest.raises(UserError, match="trained with float32 weights.*resolves train.precision = 'bf16-sr'"):
        trainer.train(
            load_recipe(str(micro_recipe_file), ["train.precision=bf16-sr"]),
            run_dir=run,
            progress=False,
            tensorboard=False,
        )
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000002"]


def test_validation_loss_does_not_depend_on_the_micro_batch(micro_recipe_file, tmp_path):
    """The same training at another micro-batch evaluates the same samples: validation
    losses agree to rounding, and `compare` says PASS (it said FAIL, -0.13%, before)."""
    from frugality.cli.main import main

    runs = {}
    for micro in (2, 1, 4):  # 5 samples: batches of 2, 2 and 1; five of 1; 4 and 1
        recipe = load_recipe(
            str(micro_recipe_file), [f"data.micro_batch_size={micro}", "train.steps=4", "train.eval_samples=5"]
        )
        runs[micro] = trainer.train(recipe, run_dir=tmp_path / f"m{micro}", progress=False, tensorboard=False)
    for micro in (1, 4):
        for step in (0, 4):
            assert runs[micro].evals[step] == pytest.approx(runs[2].evals[step], rel=1e-5), (micro, step)
    assert main(["compare", str(tmp_path / "m2"), str(tmp_path / "m1")]) == 0


def test_masked_lm_validation_does_not_depend_on_the_micro_batch(tmp_path):
    """Evaluation masks come from each sample's own tokens: at micro-batches 4, 3 and 1 the
    same positions are scored, each batch weighted by its masked positions."""
    from frugality.runtime.data import open_training_data
    from frugality.training.loop import validation_loss

    sets = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.intermediate_size=64",
        "data.seq_len=32",
        "data.global_batch_size=12",
        "train.eval_samples=7",
        "train.precision=fp32",
    ]
    losses = []
    for micro in (4, 3, 1):
        recipe = load_recipe("bert-mlm", [*sets, f"data.micro_batch_size={micro}"])
        state = build_state(plan_layout(recipe, torch.device("cpu")), open_training_data(recipe, progress=False))
        losses.append(validation_loss(state)[0])
    assert losses[1] == pytest.approx(losses[0], rel=1e-6) and losses[2] == pytest.approx(losses[0], rel=1e-6)
