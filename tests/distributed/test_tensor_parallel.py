"""Tensor and sequence parallel on torchrun (gloo on CPU): the same losses as one process
(GPT-NeoX, and Llama with grouped-query heads and tied embeddings), composed with FSDP2,
under bf16-sr; a run that moves between layouts; export and --init-from at a layout; each
bad combination one line."""

from __future__ import annotations

import json

import forked_cli
import pytest
from torchrun import STEPS, assert_close, losses, train

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.distributed.tensor_parallel import check_tensor_parallel
from frugality.errors import UserError


@pytest.mark.parametrize(
    "name, nproc, layout, precision, rel",
    [
        # (with activation checkpointing in two of them: the one-process runs recompute nothing)
        (
            "micro-llama",
            2,
            ["parallel.tensor=2", "parallel.sequence=true", "train.activation_checkpointing=full"],
            "fp32",
            1e-5,
        ),
        ("micro", 2, ["parallel.tensor=2", "parallel.sequence=true"], "bf16-sr", 1e-3),
        (
            "micro",
            4,
            ["parallel.tensor=2", "parallel.data=fsdp", "train.activation_checkpointing=selective"],
            "fp32",
            1e-5,
        ),
    ],
    ids=["llama-tp2-sp", "neox-tp2-sp-bf16sr", "neox-tp2-fsdp2"],
)
def test_tensor_parallel_trains_as_one_process(
    layout_recipes, one_process_run, tmp_path, name, nproc, layout, precision, rel
):
    straight = one_process_run(name, precision)
    done = train(
        layout_recipes / f"{name}.toml", tmp_path / "run", nproc, STEPS, f"train.precision={precision}", *layout
    )
    assert "tensor parallel over 2 ranks" in done.stdout and "kernels: none under tensor parallel" in done.stdout
    for mode in ("full", "selective"):
        assert (f"train.activation_checkpointing={mode}" in layout) == (
            f"activation checkpointing: {mode}, " in done.stdout
        )
    assert_close(losses(tmp_path / "run"), losses(straight), rel)
    assert_close(losses(tmp_path / "run", "eval"), losses(straight, "eval"), rel)
    # the time a step's rank spent blocked in the tensor-parallel collectives (profiled steps)
    figures = json.loads((tmp_path / "run" / "summary.json").read_text())["parallel"]
    assert figures["tensor"] == 2 and figures["tensor_collectives_s"] > 0


def test_a_run_moves_between_layouts_and_exports_and_starts_from_hugging_face(
    layout_recipes, one_process_run, tmp_path
):
    """TP 2, then one process, then pipeline parallel 2, then TP 2 x PP 2, each resuming the
    last's checkpoint (DCP reshards; a stage holds the whole model's names for its blocks; DDP
    saves what one process does: test_data_parallel): the straight run's losses, every sample
    consumed once. Its
    Hugging Face export (from TP 2 x PP 2's shards) holds the straight run's weights, and a
    TP 2 x PP 2 run started from that export evaluates them as the straight run did."""
    straight = one_process_run("micro")
    moved = tmp_path / "moved"
    recipe = layout_recipes / "micro.toml"
    for layout, nproc, until in [
        ("parallel.tensor=2", 2, 4),
        ("parallel.tensor=1", 1, 7),
        ("parallel.pipeline=2", 2, 9),
        ("parallel.pipeline=2 parallel.tensor=2", 4, 10),
    ]:
        sets = layout.split()
        train(recipe, moved, nproc, "train.steps=10", *sets, extra=["--until-step", str(until)])
    assert_close(losses(moved), losses(straight), 1e-4)
    summary = json.loads((moved / "summary.json").read_text())
    assert summary["tokens_seen"] == 10 * 4 * 32  # 10 steps of the global batch, each sample once
    for run in (moved, straight):
        assert main(["export", "hf", str(run), "--out", str(tmp_path / f"hf-{run.name}")]) == 0
    from safetensors.torch import load_file

    ours, theirs = (load_file(tmp_path / f"hf-{run.name}" / "model.safetensors") for run in (moved, straight))
    assert ours.keys() == theirs.keys()
    difference = sum((ours[n] - theirs[n]).square().sum() for n in ours) ** 0.5
    assert difference / sum(theirs[n].square().sum() for n in ours) ** 0.5 < 1e-4
    started = tmp_path / "started"  # at TP 2 x PP 2: each stage takes its part of the export's weights
    train(
        recipe,
        started,
        4,
        "train.steps=2",
        "parallel.tensor=2",
        "parallel.pipeline=2",
        extra=["--init-from", str(tmp_path / "hf-moved")],
    )
    assert losses(started, "eval")[0] == pytest.approx(losses(straight, "eval")[10], rel=1e-4)


NOISE_RUNS = """
import os
import torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from frugality.precision.bf16_adamw import _shard_runs

dist.init_process_group("gloo")
mesh = init_device_mesh("cpu", (1, 2, 2), mesh_dim_names=("replicate", "shard", "tensor"))
torch.manual_seed(0)
m = torch.nn.Sequential(torch.nn.Linear(8, 12), torch.nn.Linear(12, 8), torch.nn.Embedding(16, 8))
parallelize_module(m, mesh["tensor"], {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": RowwiseParallel()})
fully_shard(m, mesh=mesh["replicate", "shard"])
for name, p in m.named_parameters():
    full, local = p.full_tensor().reshape(-1), p.to_local().reshape(-1)
    runs = _shard_runs(p)
    assert sum(n for _, _, n in runs) == local.numel(), name
    for start, at, n in runs:
        assert torch.equal(full[start : start + n], local[at : at + n]), (name, p.placements)
print("ok", dist.get_rank(), flush=True)
dist.destroy_process_group()
os._exit(0)  # gloo's threads can abort the interpreter's teardown: see distributed.exit_process
"""


def test_bf16_sr_rounds_each_shard_with_the_noise_of_its_place_in_the_whole(tmp_path):
    """Under TP 2 x FSDP2 2 (strided shards, row-wise shards of dim 1): each run of a rank's
    shard names the elements of the unsharded parameter it holds, so the rounding noise,
    hashed from that index, is the one-process run's."""
    script = tmp_path / "runs.py"
    script.write_text(NOISE_RUNS)
    done = forked_cli.ranks(4, script=script, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("ok") == 4  # every rank (their lines may interleave)


def _config(**changes):
    recipe = load_recipe("pythia-70m")
    return recipe.model.model_copy(update=changes)


@pytest.mark.parametrize(
    "config, tensor, sequence, world, message",
    [
        ({}, 3, False, 8, "parallel.tensor 3: must divide the number of processes (8)"),
        ({}, 16, False, 16, "the model's 8 heads do not divide among 16 ranks"),
        ({"vocab_size": 50277}, 2, False, 4, "model.vocab_size (50277) is not a multiple of it"),
        ({}, 1, True, 4, "parallel.sequence: needs parallel.tensor > 1"),
    ],
)
def test_bad_combinations_are_one_line(config, tensor, sequence, world, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_tensor_parallel(_config(**config), tensor, sequence, world, seq_len=2048)


def test_grouped_query_heads_and_other_families_are_checked():
    llama = load_recipe("llama-135m").model  # 9 heads sharing 3 key-value heads
    with pytest.raises(UserError, match="the model's 9 heads do not divide among 2 ranks"):
        check_tensor_parallel(llama, 2, False, 2, seq_len=2048)
    with pytest.raises(UserError, match="the model's 3 key-value heads do not divide among 9 ranks"):
        check_tensor_parallel(llama.model_copy(update={"num_heads": 18, "hidden_size": 576 * 2}), 9, False, 9, 2048)
    with pytest.raises(UserError, match="model family 'bert' has no tensor-parallel plan"):
        check_tensor_parallel(load_recipe("bert-mlm").model, 2, False, 2, seq_len=128)


@pytest.mark.parametrize(
    "sets, message",
    [
        (
            ["parallel.tensor=2"],
            "parallel.tensor 2: must divide the number of processes (1); tensor parallel runs on torchrun",
        ),
        (["parallel.tensor=2", "compile.level=O1"], "compile.level O1 does not run with tensor parallel yet"),
        (["parallel.pipeline=2"], "parallel.pipeline 2 x parallel.tensor 1: must divide the number of processes (1)"),
        (["parallel.pipeline=2", "compile.level=O1"], "compile.level O1 does not run with pipeline parallel yet"),
        (["parallel.pipeline_microbatches=2"], "parallel.pipeline_microbatches: needs parallel.pipeline > 1"),
    ],
)
def test_model_parallel_layouts_it_cannot_run_are_refused_before_anything_is_written(
    micro_recipe_file, tmp_path, capsys, sets, message
):
    run = tmp_path / "run"
    status = main(["train", str(micro_recipe_file), "--run-dir", str(run), *(a for s in sets for a in ("--set", s))])
    assert status == 2 and not run.exists()
    assert message in capsys.readouterr().err


def test_resume_optimizer_under_pipeline_parallel_is_refused_with_the_way_round(micro_recipe_file, tmp_path, capsys):
    run = tmp_path / "run"
    args = ["train", str(micro_recipe_file), "--run-dir", str(run), "--set", "parallel.pipeline=2"]
    assert main([*args, "--init-from", str(tmp_path / "ckpt"), "--resume-optimizer"]) == 2 and not run.exists()
    assert (
        "--resume-optimizer with parallel.pipeline: not built yet; start the run in another layout"
        in capsys.readouterr().err
    )
