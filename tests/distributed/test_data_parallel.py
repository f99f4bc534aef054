"""Data parallelism on torchrun with 2 (HSDP: 4) CPU processes over gloo: the same losses as
one process taking every rank's samples, and checkpoints that resume at another world size
and under another strategy."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import forked_cli
import pytest
from torchrun import KILLED, losses, train

_train, _losses = train, losses


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    """The one-process runs to compare with, each trained once: (precision, micro-batch) -> run dir."""
    runs = {}

    def run(recipe_file, precision="fp32", micro=2):
        if (precision, micro) not in runs:
            runs[precision, micro] = tmp_path_factory.mktemp("one-process")
            _train(recipe_file, runs[precision, micro], 1, f"train.precision={precision}", *_shares(micro))
        return runs[precision, micro]

    return run


def _shares(micro: int) -> list[str]:
    # amp-fp16 at a loss scale that overflows in neither run: where it overflows depends on
    # how many micro-batches a backward's loss is divided by (2 in one process, 1 a rank here)
    return [f"data.micro_batch_size={micro}", "train.loss_scale=1024"]


@pytest.mark.parametrize(
    "strategy, nproc, precision, micro, tolerance",
    [
        # DDP in fp32 at 2 ranks: test_frugality_train_nproc_starts_the_processes_itself
        ("fsdp", 2, "fp32", 1, 1e-5),  # 2 micro-batches a rank: the first accumulates without syncing
        ("hsdp", 4, "fp32", 1, 1e-5),  # 2 replicas of 2-rank shard groups
        ("ddp", 2, "bf16-sr", 2, 1e-3),  # gradients reduced in bf16
        ("fsdp", 2, "bf16-sr", 2, 1e-3),
        ("ddp", 2, "amp-fp16", 2, 1e-3),  # scaled losses accumulated without syncing, unscaled after
    ],
)
def test_ranks_train_as_one_process_with_all_their_shares(
    micro_recipe_file, tmp_path, one_process, strategy, nproc, precision, micro, tolerance
):
    """Each rank's micro-batches of each step = the same micro-batches accumulated in one process."""
    one = one_process(micro_recipe_file, precision, micro)
    # fsdp with bf16-sr writes its step-4 checkpoint asynchronously (sharded state, its own
    # gloo group), and resumes from it below
    asynchronous = f"train.async_checkpoint={str(strategy == 'fsdp' and precision == 'bf16-sr').lower()}"
    # FSDP2's ranks recompute their blocks (the one-process run does not): the same losses
    recompute = {"fp32": "full", "bf16-sr": "selective"}.get(precision, "auto") if strategy == "fsdp" else "auto"
    done = _train(
        micro_recipe_file,
        tmp_path / "many",
        nproc,
        f"parallel.data={strategy}",
        f"train.precision={precision}",
        *_shares(micro),
        "parallel.shard_size=2",
        asynchronous,
        f"train.activation_checkpointing={recompute}",
    )
    assert f"{strategy} over {nproc} processes" in done.stdout
    assert recompute == "auto" or f"activation checkpointing: {recompute}, " in done.stdout
    many = _losses(tmp_path / "many")
    assert sorted(many) == list(range(1, 9))
    for step, loss in _losses(one).items():
        assert many[step] == pytest.approx(loss, rel=tolerance), step
    assert _losses(tmp_path / "many", "eval") == pytest.approx(_losses(one, "eval"), rel=tolerance)
    summary = json.loads((tmp_path / "many" / "summary.json").read_text())
    assert summary["final_step"] == 8 and summary["tokens_seen"] == 8 * 4 * 32
    if precision == "amp-fp16":
        assert summary["loss_scale"] == {"final": 1024.0, "overflow_steps": 0}
    if strategy == "fsdp" and precision == "fp32":
        _export_and_init_from_a_sharded_run(micro_recipe_file, tmp_path, one, tmp_path / "many")
    if strategy == "fsdp" and precision == "bf16-sr":
        # resumed at the same world size from its step-4 checkpoint: the same bits as straight through
        shutil.rmtree(tmp_path / "many" / "checkpoints" / "step_00000008")
        _train(
            micro_recipe_file,
            tmp_path / "many",
            nproc,
            f"parallel.data={strategy}",
            f"train.precision={precision}",
            f"data.micro_batch_size={micro}",
            f"train.activation_checkpointing={recompute}",
        )
        resumed = _losses(tmp_path / "many")
        assert all(resumed[step] == many[step] for step in range(5, 9)), (resumed, many)


def _export_and_init_from_a_sharded_run(recipe_file, tmp_path, one, sharded):
    """`frugality export hf` consolidates the 2-rank FSDP2 checkpoint into the one-process
    run's weights; `--init-from` starts a new run from it."""
    from safetensors.torch import load_file

    for run in (one, sharded):
        done = forked_cli.run("export", "hf", run, "--out", tmp_path / f"{run.name}-hf", timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    expected = load_file(tmp_path / f"{one.name}-hf" / "model.safetensors")
    got = load_file(tmp_path / f"{sharded.name}-hf" / "model.safetensors")
    assert expected.keys() == got.keys() and len(got) > 10
    for name in expected:
        # A shard out of place would be off by about the weights themselves. Matrices agree to
        # 1e-4 of their norm; Adam turns gradients that are zero but for rounding (the key
        # bias: softmax ignores it) into lr-sized steps of either sign, so 1-D tensors get 5%.
        error = ((got[name] - expected[name]).norm() / expected[name].norm()).item()
        assert error < (1e-4 if got[name].ndim > 1 else 0.05), (name, error)
    _train(
        recipe_file,
        tmp_path / "from-sharded",
        1,
        "data.micro_batch_size=1",
        extra=["--init-from", str(sharded), "--until-step", "1"],
    )
    # its evaluation before step 1 is the sharded run's last one: the same weights, the same batches
    assert _losses(tmp_path / "from-sharded", "eval")[0] == pytest.approx(_losses(sharded, "eval")[8], rel=1e-6)


def test_frugality_train_nproc_starts_the_processes_itself(micro_recipe_file, tmp_path, one_process):
    """... and trains as one process would (the compiled variant, O1 inside the DDP wrapper, was
    checked by hand: about 90 s of compiling on one thread per rank, too slow for this suite)."""
    frugality = str(Path(sys.executable).with_name("frugality"))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            frugality,
            "train",
            str(micro_recipe_file),
            "--run-dir",
            str(tmp_path / "run"),
            "--no-progress",
            "--nproc",
            "2",
            "--until-step",
            "4",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ddp over 2 processes" in done.stdout and done.stdout.count("step 4/8") == 1  # rank 0 reports
    one = one_process(micro_recipe_file)
    losses, eager = _losses(tmp_path / "run"), _losses(one)
    assert sorted(losses) == [1, 2, 3, 4]
    for step in losses:
        assert losses[step] == pytest.approx(eager[step], rel=1e-5), step
    evals = _losses(tmp_path / "run", "eval")  # steps 0 and 4: every rank's share of the validation batches
    assert evals == pytest.approx({s: v for s, v in _losses(one, "eval").items() if s in evals}, rel=1e-5)
    # both ranks' energy, summed where they met (the evaluation at step 4 and the end)
    cost = json.loads((tmp_path / "run" / "summary.json").read_text())["cost"]
    assert cost["device_energy_j"] > 0 and "summed over 2 ranks" in cost["labels"]["energy"]


def test_a_rank_that_dies_ends_the_run_naming_it(micro_recipe_file, tmp_path):
    script = tmp_path / "killed.py"
    script.write_text(KILLED)
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(script),
            str(micro_recipe_file),
            str(tmp_path / "run"),
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode != 0
    assert "rank      : 1" in done.stderr and "exitcode  : 9" in done.stderr


def test_a_run_saved_in_one_process_resumes_on_two_ranks(micro_recipe_file, tmp_path, one_process):
    straight = one_process(micro_recipe_file)
    frugality = [
        sys.executable,
        "-m",
        "frugality",
        "train",
        str(micro_recipe_file),
        "--run-dir",
        str(tmp_path / "grown"),
        "--no-progress",
        "--until-step",
        "4",
    ]
    assert subprocess.run(frugality, capture_output=True, text=True, timeout=600).returncode == 0
    done = _train(micro_recipe_file, tmp_path / "grown", 2)
    assert "resuming" in done.stdout
    straight, grown = _losses(straight), _losses(tmp_path / "grown")
    assert sorted(grown) == list(range(1, 9))
    for step in range(5, 9):
        assert grown[step] == pytest.approx(straight[step], rel=1e-4), step


def test_an_encoder_trains_contrastively_on_two_ranks_as_in_one_process(micro_pairs_recipe, tmp_path):
    """DDP with a pooler the loss never reaches (frozen, so DDP waits for no gradient of it),
    micro-batches of a step padded to one bucket, and one evaluation batch: rank 1 counts none."""
    sets = [
        "model.pooler=true",
        "train.eval_samples=2",
        "data.micro_batch_size=2",
        "train.steps=3",
        "train.eval_interval=3",
    ]
    _train(micro_pairs_recipe, tmp_path / "one", 1, *sets)
    two = _train(micro_pairs_recipe, tmp_path / "two", 2, *sets)
    assert "not trained (task contrastive does not use them): pooler" in two.stdout
    # one process takes all four micro-batches of a step (two on each rank): the same losses
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    evals = [
        json.loads(line)
        for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()
        if json.loads(line)["kind"] == "eval"
    ]
    assert [e["candidates"] for e in evals] == [2, 2] and "recall@1" in evals[-1]
    # the real tokens, summed over the ranks: those of one process taking every micro-batch
    tokens = lambda run: json.loads((run / "summary.json").read_text())["tokens_seen"]
    assert 0 < tokens(tmp_path / "two") == tokens(tmp_path / "one")


def test_gathered_negatives_on_two_ranks_train_as_one_process_with_both_batches(micro_pairs_recipe, tmp_path):
    """parallel.gather_negatives: each rank's 2 queries meet both ranks' documents, so two
    ranks of 2 pairs train as one process of 4 pairs (losses of three steps: the updates'
    gradients, through the gather's backward, included). The rank-local loss differs."""
    sets = ["train.eval_samples=2", "data.global_batch_size=4", "train.steps=3", "train.eval_interval=3"]
    one = _train(micro_pairs_recipe, tmp_path / "one", 1, *sets, "data.micro_batch_size=4")
    two = _train(
        micro_pairs_recipe, tmp_path / "two", 2, *sets, "data.micro_batch_size=2", "parallel.gather_negatives=true"
    )
    # without the gather each micro-batch of 2 meets its own documents only: as one process of 2 x 2
    local = _train(micro_pairs_recipe, tmp_path / "local", 1, *sets, "data.micro_batch_size=2")
    assert "contrastive negatives gathered from all 2 ranks" in two.stdout
    assert "negatives gathered" not in local.stdout + one.stdout
    assert _losses(tmp_path / "two") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)
    assert _losses(tmp_path / "local")[1] != pytest.approx(_losses(tmp_path / "one")[1], rel=1e-3)
    # FSDP2, whose root is the task's training module (the learnt temperature and the head
    # are the root's): the same losses again
    sharded = _train(
        micro_pairs_recipe,
        tmp_path / "sharded",
        2,
        *sets,
        "data.micro_batch_size=2",
        "parallel.gather_negatives=true",
        "parallel.data=fsdp",
    )
    assert sharded.returncode == 0, sharded.stderr[-3000:]
    assert _losses(tmp_path / "sharded") == pytest.approx(_losses(tmp_path / "one"), rel=1e-4)


def test_masked_lm_trains_on_two_fsdp_ranks_and_resumes_on_one(tmp_path):
    """The masked-LM head (tied to the embeddings) at FSDP2's root, the training module:
    two ranks train, save, and one process resumes the checkpoint."""
    sets = [
        "model.hidden_size=32",
        "model.num_layers=2",
        "model.num_heads=4",
        "model.intermediate_size=64",
        "data.seq_len=32",
        "data.global_batch_size=4",
        "data.micro_batch_size=2",
        "train.steps=4",
        "train.eval_interval=2",
        "train.save_interval=2",
        "train.eval_samples=4",
        "optim.warmup_steps=1",
        "train.precision=fp32",
    ]
    two = _train("bert-mlm", tmp_path / "run", 2, *sets, "parallel.data=fsdp", extra=["--until-step", "2"])
    assert two.returncode == 0, two.stderr[-3000:]
    one = _train("bert-mlm", tmp_path / "run", 1, *sets)
    assert one.returncode == 0, one.stderr[-3000:]
    losses = _losses(tmp_path / "run")
    assert sorted(losses) == [1, 2, 3, 4] and all(math.isfinite(v) for v in losses.values())
