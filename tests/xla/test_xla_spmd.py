"""Data parallel over two XLA devices in one process (`parallel.spmd`, XLA's CPU client with
CPU_NUM_DEVICES=2): the losses of one device, and checkpoints that move between SPMD and
the CPU backend. SPMD is chosen before XLA opens its client, so each SPMD run is a process
of its own."""

from __future__ import annotations

import json
import os
import subprocess

import forked_cli
import pytest

from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.training import trainer


def _losses(run) -> dict[tuple[str, int], float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return {(r["kind"], r["step"]): r["loss"] for r in records if r["kind"] in ("train", "eval")}


def _on_cpu(recipe_file, run, until_step=None):
    recipe = load_recipe(str(recipe_file), ["train.device=cpu", "train.eval_samples=3"])
    return trainer.train(recipe, run_dir=run, progress=False, tensorboard=False, until_step=until_step)


def _two_devices(*args, script=None) -> subprocess.CompletedProcess:
    """`frugality ARGS` (or `python SCRIPT ARGS`) in a process of its own, forked from one that
    imported torch, torch_xla and frugality (tests/forked_cli.py), with XLA's CPU client made
    of two devices: the client opens in the command, after the fork."""
    env = {**os.environ, "PJRT_DEVICE": "CPU", "CPU_NUM_DEVICES": "2"}
    done = forked_cli.run(*args, env=env, timeout=600, script=script)
    assert done.returncode == 0, done.stderr[-3000:]
    return done


def _spmd(recipe_file, run, strategy, *extra) -> str:
    sets = ["train.device=xla", "parallel.spmd=true", f"parallel.data={strategy}", "train.eval_samples=3"]
    command = ["train", str(recipe_file), "--run-dir", str(run), "--no-progress"]
    return _two_devices(*command, *(a for s in sets for a in ("--set", s)), *extra).stdout


def test_fsdp_over_two_devices_resumes_a_cpu_checkpoint_and_trains_as_one(micro_recipe_file, tmp_path):
    """The sharded direction of a load: DCP into parameters split over the devices, and the
    optimizer's moments made for them; evaluation batches of 3 rows split over 2 devices."""
    straight = _on_cpu(micro_recipe_file, tmp_path / "straight")
    _on_cpu(micro_recipe_file, tmp_path / "moved", until_step=4)
    header = _spmd(micro_recipe_file, tmp_path / "moved", "fsdp")
    assert "SPMD over 2 XLA devices (fsdp): parameters split (28 of 28)" in header
    assert "micro-batches of 4 rows" in header  # 2 per device, as the recipe says
    assert _losses(tmp_path / "moved") == pytest.approx(_losses(tmp_path / "straight"), rel=1e-4)
    summary = json.loads((tmp_path / "moved" / "summary.json").read_text())
    assert summary["compile"]["recompiles"] == 0 and summary["final_step"] == straight.final_step
    run_recipe = (tmp_path / "moved" / "recipe.toml").read_text()
    assert "micro_batch_size = 2" in run_recipe  # the run keeps the per-device micro-batch


def test_ddp_over_two_devices_trains_as_one_and_its_checkpoint_resumes_on_the_cpu_backend(micro_recipe_file, tmp_path):
    _on_cpu(micro_recipe_file, tmp_path / "straight")
    header = _spmd(micro_recipe_file, tmp_path / "moved", "ddp", "--until-step", "4")
    assert "SPMD over 2 XLA devices (ddp): each micro-batch split by rows" in header
    moved = _on_cpu(micro_recipe_file, tmp_path / "moved")
    assert moved.start_step == 4 and moved.final_step == 8
    assert _losses(tmp_path / "moved") == pytest.approx(_losses(tmp_path / "straight"), rel=1e-4)


SHARDINGS = """
import json, sys, torch
from frugality import xla
xla.use_spmd()
import torch_xla
from frugality.config.recipe import load_recipe
from frugality.runtime.layout import plan_layout
from frugality.runtime.state import build_state
from frugality.training.loop import train_step

spec = torch_xla._XLAC._get_xla_sharding_spec
out = {}
for strategy in ("ddp", "fsdp"):
    recipe = load_recipe(sys.argv[1], ["train.device=xla", "parallel.spmd=true", f"parallel.data={strategy}"])
    state = build_state(plan_layout(recipe, xla.device()))
    seen = []  # a hook after SPMD's own: the batch as the module gets it
    state.wrapped.register_forward_pre_hook(lambda module, args: seen.append(spec(args[0])))
    train_step(state, [torch.randint(0, 1000, (4, recipe.data.seq_len + 1))])
    weight = state.model.embed.weight
    out[strategy] = [seen[0], spec(weight), spec(state.optimizer.state[weight]["exp_avg"])]
print(json.dumps(out))
"""


def test_the_batch_the_parameters_and_the_moments_carry_the_shardings_asked_for(micro_recipe_file):
    script = micro_recipe_file.parent / "shardings.py"
    script.write_text(SHARDINGS)
    done = _two_devices(micro_recipe_file, script=script)
    split, whole = "{devices=[2,1]0,1}", "{replicated}"
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "ddp": [split, whole, whole],  # rows split; parameters and moments whole on each device
        "fsdp": [split, split, split],  # the moments follow their parameters
    }


def test_spmd_asked_for_where_it_cannot_be_is_one_line(micro_recipe_file, tmp_path):
    from frugality import xla

    xla.device()  # this process's client is open, without SPMD
    for sets, message in [
        (["train.device=cpu"], "parallel.spmd: for an xla device"),
        (["train.device=xla", "parallel.data=hsdp"], 'parallel.data "hsdp" is not built on XLA'),
        (["train.device=xla"], "opened its XLA device without SPMD; start a new process"),
    ]:
        recipe = load_recipe(str(micro_recipe_file), [*sets, "parallel.spmd=true"])
        with pytest.raises(UserError, match=message):
            trainer.train(recipe, run_dir=tmp_path / "run", progress=False)
        assert not (tmp_path / "run").exists()


def test_compile_runs_an_spmd_recipes_trial_over_its_devices(micro_recipe_file):
    command = ["compile", str(micro_recipe_file), "--device", "xla"]
    done = _two_devices(*command, "--set", "parallel.spmd=true", "--set", "parallel.data=fsdp", "--no-progress")
    assert "SPMD over 2 XLA devices (fsdp)" in done.stdout
    assert (
        "compiled micro on XLA (CPU): " in done.stdout
        and "the step after the two of warm-up compiled nothing" in done.stdout
    )
