"""A run's layout is worked out by rules alone (`plan_layout`), for any world, without
starting a process: what it resolves to, and each layout it refuses in one line."""

import re

import pytest
import torch

from frugality.config.recipe import load_recipe
from frugality.distributed import World
from frugality.errors import UserError
from frugality.runtime.layout import plan_layout

CPU = torch.device("cpu")


def _layout(name, sets=(), world_size=1, device=CPU, **kwargs):
    return plan_layout(load_recipe(name, list(sets)), device, World(0, world_size), fit=False, **kwargs)


def test_a_single_process_layout_keeps_the_recipe_as_written():
    layout = _layout("tiny", ["train.precision=fp32"])
    assert layout.recipe == layout.loads == load_recipe("tiny", ["train.precision=fp32"])
    assert (layout.world.world_size, layout.world.data_size, layout.world.tensor, layout.world.pipeline) == (1, 1, 1, 1)
    assert not layout.model_parallel and layout.accumulation == 1
    assert layout.policy.name == "fp32" and layout.precision_note == "precision fp32"
    assert layout.task.name == "causal_lm" and layout.notes == ()


def test_tensor_and_pipeline_degrees_share_the_ranks_and_the_batch_is_fitted_to_the_rest():
    # 8 ranks: TP 2 x PP 2 leaves 2 data-parallel ranks; 1,024 samples a step, 512 each, in
    # micro-batches of 32: 16 micro-batches a rank, enough for 2 stages
    layout = _layout(
        "pythia-70m", ["parallel.tensor=2", "parallel.pipeline=2", "parallel.data=ddp", "compile.level=O0"], 8
    )
    w = layout.world
    assert (w.tensor, w.pipeline, w.data_size, w.data_rank) == (2, 2, 2, 0)
    assert layout.model_parallel and layout.accumulation == 16 and layout.recipe.data.micro_batch_size == 32
    # the last data-parallel group's ranks read the second share
    assert plan_layout(layout.recipe, CPU, World(7, 8), fit=False).world.data_rank == 1


def test_a_global_batch_the_micro_batch_does_not_divide_is_fitted_and_said():
    layout = _layout("tiny", [], 2)
    assert layout.recipe.data.micro_batch_size == 4 and layout.accumulation == 1
    assert layout.notes == (
        "data.micro_batch_size 8 -> 4: the global batch of 8 over 2 ranks is 4 each, 1 micro-batch(es) of 4",
    )


def test_spmd_loads_every_devices_rows_and_the_run_keeps_the_recipe_as_written():
    recipe = load_recipe("tiny", ["parallel.spmd=true"])
    layout = plan_layout(recipe, CPU, World(devices=4), fit=False)
    assert layout.recipe.data.micro_batch_size == 2 and layout.loads.data.micro_batch_size == 8  # 8 a step, 2 a device
    assert "per XLA device x 4 devices (SPMD): micro-batches of 8 rows" in layout.notes[0]


def test_a_warm_up_longer_than_the_run_is_cut_and_said():
    layout = _layout("tiny", ["train.steps=4"])
    assert layout.notes == ("optim.warmup_steps 10 -> 4: the warm-up is cut to train.steps",)


def test_fitting_to_memory_chooses_the_checkpointing_mode_and_a_dry_run_does_not(monkeypatch):
    from frugality.runtime import plan as planning

    assert _layout("tiny", ["train.activation_checkpointing=full"]).checkpointing == (
        "full",
        "not fitted to the memory (a dry run)",
    )
    recipe = load_recipe("tiny", ["train.precision=fp32"])  # (auto is the default mode)
    monkeypatch.setattr(planning, "device_memory", lambda device: (2**40, 2**40))
    mode, why = plan_layout(recipe, CPU).checkpointing
    assert mode == "none" and why.startswith("auto: none ") and "GiB free" in why
    monkeypatch.setattr(planning, "device_memory", lambda device: (2**20, 2**40))  # 1 MiB free: nothing fits
    with pytest.raises(UserError, match="needs about .* more than the 0.0 GiB free"):
        plan_layout(recipe, CPU)
    assert _layout("tiny", ["train.precision=fp32"]).checkpointing[0] == "auto"  # (a dry run weighs nothing)


@pytest.mark.parametrize(
    "name, sets, world_size, device, message",
    [
        ("tiny", ["parallel.tensor=2"], 1, CPU, "parallel.tensor 2: must divide the number of processes (1)"),
        (
            "tiny",
            ["parallel.tensor=2", "compile.level=O1"],
            2,
            CPU,
            "compile.level O1 does not run with tensor parallel",
        ),
        ("tiny", ["parallel.tensor=2", "train.precision=fp8"], 2, CPU, "fp8 does not run with tensor parallel yet"),
        ("tiny", ["parallel.tensor=2"], 2, torch.device("xla"), "on xla devices, tensor parallel is not built"),
        ("minilm-pairs", ["parallel.tensor=2"], 2, CPU, "train.task contrastive does not run tensor parallel yet"),
        ("tiny", ["parallel.tensor=3"], 3, CPU, "do not divide among 3 ranks"),
        (
            "tiny",
            ["parallel.pipeline=3"],
            4,
            CPU,
            "parallel.pipeline 3 x parallel.tensor 1: must divide the number of processes (4)",
        ),
        (
            "tiny",
            ["parallel.pipeline=2", "compile.level=O1"],
            2,
            CPU,
            "compile.level O1 does not run with pipeline parallel",
        ),
        ("tiny", ["parallel.pipeline=2"], 2, torch.device("xla"), "on xla devices, pipeline parallel is not built"),
        ("minilm-pairs", ["parallel.pipeline=2"], 2, CPU, "train.task contrastive is not pipelined yet"),
        (
            "tiny",
            ["parallel.pipeline_microbatches=2"],
            1,
            CPU,
            "parallel.pipeline_microbatches: needs parallel.pipeline > 1",
        ),
        (
            "tiny",
            ["parallel.pipeline=2", "parallel.pipeline_microbatches=3"],
            2,
            CPU,
            "parallel.pipeline_microbatches 3: must divide the 8 samples each data-parallel rank takes a step",
        ),
        (
            "tiny",
            ["parallel.pipeline=2", "data.global_batch_size=2", "data.micro_batch_size=2"],
            4,
            CPU,
            "which no micro-batch makes into at least 2 micro-batches (one a stage)",
        ),
        ("tiny", [], 3, CPU, "data.global_batch_size (8) cannot be shared evenly by 3 data-parallel ranks"),
        (
            "minilm-pairs",
            ["data.global_batch_size=6", "data.micro_batch_size=6"],
            6,
            CPU,
            "needs micro-batches of at least",
        ),
        (
            "tiny",
            ["train.precision=amp-fp16", "parallel.data=fsdp"],
            2,
            CPU,
            "amp-fp16 (loss scaling) does not run with parallel.data fsdp",
        ),
        (
            "tiny",
            ["train.precision=amp-fp16", "parallel.pipeline=2"],
            2,
            CPU,
            "amp-fp16 (loss scaling) does not run with pipeline parallel",
        ),
    ],
)
def test_each_layout_that_does_not_run_is_refused_in_one_line(name, sets, world_size, device, message):
    with pytest.raises(UserError, match=re.escape(message)) as refused:
        _layout(name, sets, world_size, device)
    assert "\n" not in str(refused.value)


def test_resuming_the_optimizer_under_pipeline_parallel_is_refused():
    with pytest.raises(UserError, match=re.escape("--resume-optimizer with parallel.pipeline: not built yet")):
        _layout("tiny", ["parallel.pipeline=2"], 2, resume_optimizer=True)
