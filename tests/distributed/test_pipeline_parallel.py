"""Pipeline parallel on torchrun (gloo on CPU): each schedule gives one process's losses,
alone and with data parallel; bf16-sr within 1e-4 (each stage rounds with the whole
model's noise indices); a dead stage ends every rank, named; each bad combination one
line. (Runs moving through pipeline layouts, with tensor parallel too:
test_tensor_parallel.py.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest
from torchrun import KILLED, STEPS, assert_close, losses, train

from frugality.config.recipe import load_recipe
from frugality.distributed.pipeline import check_pipeline, fit_microbatches
from frugality.errors import UserError


@pytest.mark.parametrize(
    "name, nproc, layout, precision, rel",
    [
        # (with activation checkpointing in two of them: the one-process runs recompute nothing)
        ("micro4", 2, ["parallel.pipeline_schedule=gpipe", "train.activation_checkpointing=selective"], "fp32", 1e-5),
        ("micro4", 2, ["parallel.pipeline_schedule=interleaved-1f1b"], "fp32", 1e-5),
        ("micro8", 4, ["parallel.data=fsdp"], "amp-bf16", 1e-3),
        # one micro-batch of 4: fitted to 2 of 2
        ("micro", 2, ["data.micro_batch_size=4", "train.activation_checkpointing=full"], "bf16-sr", 1e-4),
    ],
    ids=["gpipe", "interleaved-1f1b", "1f1b-fsdp2-amp-short-validation", "1f1b-bf16sr-fitted-micro-batch"],
)
def test_pipeline_trains_as_one_process(layout_recipes, one_process_run, tmp_path, name, nproc, layout, precision, rel):
    straight = one_process_run(name, precision)
    done = train(
        layout_recipes / f"{name}.toml",
        tmp_path / "run",
        nproc,
        STEPS,
        "parallel.pipeline=2",
        f"train.precision={precision}",
        *layout,
    )
    assert "pipeline parallel over 2 ranks" in done.stdout
    for mode in ("full", "selective"):
        assert (f"train.activation_checkpointing={mode}" in layout) == (
            f"activation checkpointing: {mode}, " in done.stdout
        )
    if "data.micro_batch_size=4" in layout:  # the global batch kept, in the micro-batches the stages need
        assert (
            "data.micro_batch_size 4 -> 2: a step of parallel.pipeline 2 needs at least 2 micro-batches" in done.stdout
        )
    assert_close(losses(tmp_path / "run"), losses(straight), rel)
    assert_close(losses(tmp_path / "run", "eval"), losses(straight, "eval"), rel)
    # the bubble measured (the stages' time not computing), beside the schedule's ideal
    figures = json.loads((tmp_path / "run" / "summary.json").read_text())["parallel"]
    v, m = (2 if "interleaved" in str(layout) else 1), figures["micro_batches"]
    assert figures["pipeline"] == 2 and figures["ideal_bubble"] == round(1 / (v * m + 1), 4)
    assert 0 < figures["bubble"] < 1


def test_a_stage_that_dies_ends_every_rank_naming_it(layout_recipes, tmp_path):
    """Rank 1, the last stage, dies before its third step; rank 0 waits for it inside the
    schedule's first send, and torchrun ends it: a non-zero exit naming rank 1."""
    recipe = tmp_path / "pipelined.toml"
    recipe.write_text((layout_recipes / "micro.toml").read_text() + "\n[parallel]\npipeline = 2\n")
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2"]
        + [str(script), str(recipe), str(tmp_path / "run")],
        capture_output=True,
        text=True,
        env=os.environ | {"OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    assert done.returncode != 0
    assert "rank      : 1" in done.stderr and "exitcode  : 9" in done.stderr


def _parallel(**keys):
    return load_recipe("pythia-70m").parallel.model_copy(update=keys)


@pytest.mark.parametrize(
    "parallel, world, micro_batches, message",
    [
        (
            _parallel(pipeline=3),
            4,
            8,
            "parallel.pipeline 3 x parallel.tensor 1: must divide the number of processes (4)",
        ),
        (_parallel(pipeline=4), 4, 8, "the model's 6 layers do not divide into 4 stages"),
        (_parallel(pipeline=2, pipeline_schedule="interleaved-1f1b"), 2, 8, "do not divide into 4 stages (2 a rank"),
        (_parallel(pipeline=2), 2, 1, "a step has 1 micro-batch(es) per data-parallel rank, fewer than the stages"),
    ],
)
def test_bad_combinations_are_one_line(parallel, world, micro_batches, message):
    with pytest.raises(UserError, match=message.replace("(", r"\(").replace(")", r"\)")):
        check_pipeline(load_recipe("pythia-70m").model, parallel, world, micro_batches)


@pytest.mark.parametrize(
    "schedule, global_batch, micro, data_ranks, fitted",
    [
        ("1f1b", 8, 8, 1, 4),  # 1 micro-batch of 8 -> 2 of 4
        ("1f1b", 8, 2, 1, 2),  # 4 of 2 already: kept
        ("interleaved-1f1b", 12, 4, 1, 3),  # 3 of 4 is not a multiple of 2 stages -> 4 of 3
        ("1f1b", 8, 4, 2, 2),  # 4 a data-parallel rank: 2 of 2
        ("1f1b", 2, 2, 2, "1 sample(s) each, which no micro-batch makes into at least 2 micro-batches"),
        ("interleaved-1f1b", 3, 3, 1, "3 sample(s) each, which no micro-batch makes into a multiple of 2"),
    ],
)
def test_the_micro_batch_is_fitted_to_the_stages_keeping_the_global_batch(
    schedule, global_batch, micro, data_ranks, fitted
):
    recipe = load_recipe(
        "pythia-70m",
        [
            "parallel.pipeline=2",
            f"parallel.pipeline_schedule={schedule}",
            f"data.global_batch_size={global_batch}",
            f"data.micro_batch_size={micro}",
        ],
    )
    if isinstance(fitted, str):  # none fits: what the global batch needs, in one line
        with pytest.raises(UserError, match=re.escape(fitted)):
            fit_microbatches(recipe, data_ranks)
        return
    after, note = fit_microbatches(recipe, data_ranks)
    assert after.data.micro_batch_size == fitted and after.data.global_batch_size == global_batch
    assert (note is None) == (fitted == micro)


def test_a_pipeline_no_micro_batch_can_feed_is_refused_once_before_any_rank_starts(
    frugality_cli, layout_recipes, tmp_path
):
    done = frugality_cli(
        "train", layout_recipes / "micro.toml", "--nproc", 2, "--run-dir", tmp_path / "run",
        "--set", "parallel.pipeline=2", "--set", "data.global_batch_size=1", "--set", "data.micro_batch_size=1",
    )  # fmt: skip
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: parallel.pipeline 2: the global batch of 1 over 1 data-parallel rank(s) is 1 sample(s) each, which "
        "no micro-batch makes into at least 2 micro-batches (one a stage); raise data.global_batch_size to at "
        "least 2 per data-parallel rank"
    ]
    assert not (tmp_path / "run").exists()


def test_tied_embeddings_and_encoders_are_not_pipelined():
    with pytest.raises(UserError, match="tied embeddings would live on the first and the last stage"):
        check_pipeline(load_recipe("llama-135m").model, _parallel(pipeline=2), 2, 8)
    with pytest.raises(UserError, match="model family 'bert' is not cut into stages yet"):
        check_pipeline(load_recipe("bert-mlm").model, _parallel(pipeline=2), 2, 8)
