"""`frugality plan`: the counted bytes are those a real one-process training state holds, the
activation estimate is what autograd really saves on this CPU, and sharding divides what it
should."""

from __future__ import annotations

import json

import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.metrics.memory import training_state_bytes
from frugality.models import build_model
from frugality.runtime.optim import build_optimizer
from frugality.runtime.plan import plan_memory
from frugality.tasks import get_task


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_one_process_plan_counts_the_real_training_state(micro_recipe_file, precision):
    from frugality.precision import get_policy

    recipe = load_recipe(str(micro_recipe_file), [f"train.precision={precision}"])
    plan = plan_memory(recipe, 1, "ddp")
    policy = get_policy(precision)
    model = policy.prepare_model(build_model(recipe.model))
    optimizer = build_optimizer(model, recipe.optim, policy)
    get_task("causal_lm").training_module(model)(torch.randint(0, 1000, (2, recipe.data.seq_len + 1))).backward()
    optimizer.step()  # the moments exist from the first step on
    assert plan.parameters == sum(p.numel() for p in model.parameters())
    # the real state also holds the step counters (a few bytes)
    assert plan.weights + plan.gradients + plan.optimizer == pytest.approx(
        training_state_bytes(model, optimizer), abs=1024
    )
    assert plan.in_flight == 0 and plan.strategy == "none"


def test_activation_estimate_is_what_autograd_saves_on_this_cpu(micro_recipe_file):
    recipe = load_recipe(str(micro_recipe_file), ["data.micro_batch_size=4"])
    planned = plan_memory(recipe, 1, "ddp").activations
    model = build_model(recipe.model)
    saved = {}

    def keep(t):
        base = t._base if t._base is not None else t
        saved[base.untyped_storage().data_ptr()] = base.untyped_storage().nbytes()
        return t

    batch = torch.randint(0, 1000, (4, recipe.data.seq_len + 1))
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        get_task("causal_lm").training_module(model)(batch)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    real = sum(n for ptr, n in saved.items() if ptr not in params)
    assert planned == pytest.approx(real, rel=0.1)


def test_sharding_divides_the_state_and_adds_what_is_gathered(micro_recipe_file):
    recipe = load_recipe(str(micro_recipe_file), ["model.num_layers=4"])
    one, ddp = plan_memory(recipe, 1, "ddp"), plan_memory(recipe, 4, "ddp")
    fsdp = plan_memory(recipe, 4, "fsdp")
    hsdp = plan_memory(
        recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"shard_size": 2})}), 4, "hsdp"
    )
    kept = plan_memory(
        recipe.model_copy(update={"parallel": recipe.parallel.model_copy(update={"reshard_after_forward": False})}),
        4,
        "fsdp",
    )
    assert ddp.weights == one.weights and ddp.in_flight == one.gradients  # DDP's buckets
    assert fsdp.shard_over == 4 and fsdp.optimizer == pytest.approx(one.optimizer / 4, abs=64)
    assert hsdp.shard_over == 2 and hsdp.weights == pytest.approx(one.weights / 2, abs=16)
    # gathered: the root and two blocks (parameters and their unsharded gradients); all blocks if kept
    assert 0 < fsdp.in_flight < kept.in_flight <= 2 * one.weights
    assert fsdp.activations == one.activations  # per micro-batch, whatever the strategy


def test_plan_command_prints_rows_and_refuses_bad_input(micro_recipe_file, tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert (
        main(
            [
                "plan",
                str(micro_recipe_file),
                "--nproc",
                "1,2",
                "--strategy",
                "ddp,fsdp",
                "--memory",
                "1",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    layouts = [("none", 1), ("ddp", 2), ("fsdp", 2)]
    # the recipe's activation checkpointing is auto: a row for each mode
    assert [(r["strategy"], r["nproc"], r["checkpointing"]) for r in rows] == [
        (*layout, mode) for layout in layouts for mode in ("none", "selective", "full")
    ]
    for none, selective, full in zip(rows[::3], rows[1::3], rows[2::3], strict=True):
        assert none["activations"] > selective["activations"] > full["activations"] > 0
        assert none["total"] - none["activations"] == full["total"] - full["activations"]  # the state alike
    assert all(r["fits"] for r in rows) and "| fsdp | 2 | 2 |" in capsys.readouterr().out
    assert main(["plan", str(micro_recipe_file), "--checkpointing", "full", "--nproc", "1"]) == 0
    assert "| full |" in capsys.readouterr().out
    assert main(["plan", str(micro_recipe_file), "--checkpointing", "some"]) == 2
    assert "--checkpointing some: choose from none, full, selective" in capsys.readouterr().err
    assert main(["plan", str(micro_recipe_file), "--json", str(out)]) == 2  # never overwritten
    assert main(["plan", str(micro_recipe_file), "--strategy", "zero"]) == 2
    assert "--strategy zero: choose from ddp, fsdp, hsdp" in capsys.readouterr().err


def test_plan_counts_the_micro_batch_the_ranks_take_and_refuses_what_they_would(micro_recipe_file, tmp_path, capsys):
    """Through the layout's rules: 4 ranks share the micro recipe's global batch of 4, a
    sample each (the recipe's micro-batch of 2 would not divide it), so a rank's activations
    are counted for 1; a layout the ranks refuse is that line, naming it, beside the others'
    rows (the error itself when no layout is left)."""
    out = tmp_path / "plan.json"
    args = ["plan", str(micro_recipe_file), "--nproc", "1,4", "--strategy", "ddp", "--checkpointing", "none"]
    assert main([*args, "--json", str(out)]) == 0
    one, four = json.loads(out.read_text())
    assert (one["micro_batch"], four["micro_batch"]) == (2, 1)
    assert four["activations"] == pytest.approx(one["activations"] / 2, rel=0.02)
    assert "(b=1, s=32)" in capsys.readouterr().out
    assert main(["plan", str(micro_recipe_file), "--nproc", "3", "--tensor", "3"]) == 2
    assert "error: --nproc 3 (tp3): parallel.tensor 3: the model's 4 heads" in capsys.readouterr().err
    assert main(["plan", str(micro_recipe_file), "--nproc", "1,8", "--strategy", "ddp,fsdp"]) == 0
    out = capsys.readouterr().out
    assert "| micro | " in out and "| none | 1 |" in out and "| ddp | 8 |" not in out
    assert "not planned: --nproc 8 (ddp8): data.global_batch_size (4) cannot be shared evenly by 8" in out
    assert "not planned: --nproc 8 (fsdp8): " in out
    # the rules of the recipe's kind of device, which need not be here
    assert main(["plan", str(micro_recipe_file), "--nproc", "2", "--tensor", "2", "--set", "train.device=cuda"]) == 0
    overrides = ["--set", "train.precision=amp-fp16"]
    assert main(["plan", str(micro_recipe_file), "--nproc", "2", "--pipeline", "2", *overrides]) == 2
    assert (
        "--nproc 2 (pp2): train.precision amp-fp16 (loss scaling) does not run with pipeline parallel yet"
        in capsys.readouterr().err
    )
    # a compiled recipe's layout is planned as it runs, eagerly, and the line says so
    assert main(["plan", str(micro_recipe_file), "--nproc", "2", "--tensor", "2", "--set", "compile.level=O1"]) == 0
    assert "compile.level O1: planned at O0, as tensor and pipeline parallel run" in capsys.readouterr().out


def test_the_model_parallel_plans_in_the_docs_are_the_commands_rows(capsys):
    """docs/distributed.md's tables under `--tensor T --pipeline P`: each is what its command
    prints now (the issue's GPT-NeoX-20B at TP 8 x PP 4 on 32 devices of 32 and 80 GB)."""
    import re
    import shlex
    from pathlib import Path

    from frugality.cli.main import main

    text = (Path(__file__).resolve().parents[2] / "docs" / "distributed.md").read_text()
    section = text[text.index("### Tensor and pipeline parallel: `--tensor T --pipeline P`") :]
    section = section[: section.index("\n## ")]
    blocks = re.findall(r"`(frugality plan [^`]+)`\n\n\|[^\n]+\n\|[^\n]+\n((?:\|[^\n]+\n)+)", section)
    assert len(blocks) == 6 and any("--tensor 8 --pipeline 4 --memory 32" in c for c, _ in blocks)
    for command, rows in blocks:
        assert main(shlex.split(command)[1:]) == 0
        printed = [
            line for line in capsys.readouterr().out.splitlines() if line.startswith("| ") and "recipe |" not in line
        ]
        assert printed == rows.strip().splitlines(), command
    assert "| yes (32.0) |" in section and "| no (32.0) |" in section  # a verdict either way


@pytest.mark.parametrize("tensor, pipeline", [(2, 1), (1, 2)])
def test_a_model_parallel_run_is_checked_against_its_heaviest_ranks_plan(
    micro_recipe_file, monkeypatch, tensor, pipeline
):
    """Free memory between the layout's plan and the one-process plan of the same ranks:
    the run passes (its rank holds a part); below the layout's plan: refused in one line."""
    from frugality.errors import UserError
    from frugality.precision import get_policy
    from frugality.runtime import plan as planning

    sets = [f"parallel.tensor={tensor}", f"parallel.pipeline={pipeline}", "model.vocab_size=4096"]
    sets.append(
        "train.activation_checkpointing=none"
    )  # (auto would recompute to fit: test_activation_checkpointing.py)
    recipe = load_recipe(str(micro_recipe_file), sets)
    fp32, cpu = get_policy("fp32"), torch.device("cpu")
    part = planning.plan_model_parallel(recipe, 2, "ddp", tensor, pipeline, policy=fp32).total
    whole = planning.plan_memory(recipe, 2, "ddp", policy=fp32, fused_output=True).total
    assert part < whole
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    monkeypatch.setattr(planning, "device_memory", lambda device: ((part + whole) // 2, whole))
    assert planning.fit_memory(recipe, fp32, 2, cpu, tensor, pipeline) == ("none", "asked for")  # the part fits
    monkeypatch.setattr(planning, "device_memory", lambda device: (part - 1, whole))
    with pytest.raises(
        UserError,
        match=r"needs about [\d.]+ GiB per rank under activation checkpointing none .* GiB free of this machine's "
        r"RAM per rank; set data.micro_batch_size 1 ",
    ):
        planning.fit_memory(recipe, fp32, 2, cpu, tensor, pipeline)
