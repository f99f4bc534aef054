"""`frugality launch slurm`: the sbatch script, and its training command run here with 2
processes (torchrun's c10d rendezvous on this machine, as on a one-node allocation)."""

import json
import os
import socket
import subprocess

import pytest

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.distributed.slurm import SlurmJob, render, torchrun_command


def _job(recipe_file, run_dir, **kw):
    recipe = load_recipe(str(recipe_file))
    args = dict(
        recipe=str(recipe_file),
        overrides=("train.steps=4",),
        name=recipe.name,
        run_dir=str(run_dir),
        nodes=1,
        gpus_per_node=0,
        procs_per_node=2,
        compile_first=False,
    )
    return SlurmJob(**(args | kw))


def test_the_script_says_what_the_cluster_needs(micro_recipe_file, tmp_path, capsys):
    out = tmp_path / "job.sbatch"
    args = [
        "launch",
        "slurm",
        str(micro_recipe_file),
        "--nodes",
        "4",
        "--gpus-per-node",
        "8",
        "--partition",
        "gpu",
        "--time",
        "12:00:00",
        "--set",
        "compile.level=O1",
        "--set",
        "data.global_batch_size=32",  # (a sample for each of the 32 ranks: checked before the script is written)
        "--run-dir",
        str(tmp_path / "run"),
        "--out",
        str(out),
    ]
    assert main(args) == 0
    script = out.read_text()
    for line in (
        "#SBATCH --nodes=4",
        "#SBATCH --ntasks-per-node=1",
        "#SBATCH --gpus-per-node=8",
        "#SBATCH --partition=gpu",
        "#SBATCH --time=12:00:00",
        "#SBATCH --requeue",
    ):
        assert line in script.splitlines()
    assert "frugality compile" in script  # compile.level O1: the cache is warmed first
    assert "--nnodes=$SLURM_NNODES --nproc_per_node=8 --rdzv-backend=c10d --rdzv-endpoint=$head_node:" in script
    assert script.index("frugality compile") < script.index("frugality train")
    assert main(args) == 2  # an existing script is never overwritten
    assert "exists" in capsys.readouterr().err
    assert out.read_text() == script


def test_eager_recipes_skip_the_compile_step_and_bad_ranks_are_refused(micro_recipe_file, tmp_path, capsys):
    assert "frugality compile" not in render(_job(micro_recipe_file, tmp_path / "run"))
    assert (
        main(
            [
                "launch",
                "slurm",
                str(micro_recipe_file),
                "--gpus-per-node",
                "8",
                "--procs-per-node",
                "2",
                "--out",
                str(tmp_path / "x.sbatch"),
            ]
        )
        == 2
    )
    assert "one rank per GPU" in capsys.readouterr().err
    assert not (tmp_path / "x.sbatch").exists()


@pytest.mark.distributed
def test_its_training_command_runs_here_with_two_processes(micro_recipe_file, tmp_path):
    with socket.socket() as s:  # a free port for the rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    job = _job(micro_recipe_file, tmp_path / "run")
    command = torchrun_command(job, "1", "127.0.0.1", "test", port)
    done = subprocess.run(
        ["bash", "-c", command], capture_output=True, text=True, timeout=600, env=os.environ | {"OMP_NUM_THREADS": "1"}
    )
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_step"] == 4


@pytest.mark.parametrize(
    "args, said",
    [
        # tiny's global batch of 8 over 3 CPU ranks
        (["--nodes", "3"], "data.global_batch_size (8) cannot be shared evenly by 3 data-parallel ranks"),
        # 16 GPUs, none here: the rules of the kind are enough
        (
            ["--nodes", "2", "--gpus-per-node", "8", "--set", "parallel.tensor=3"],
            "must divide the number of processes (16)",
        ),
        (
            ["--gpus-per-node", "2", "--set", "parallel.pipeline=2", "--set", "compile.level=O1"],
            "compile.level O1 does not run with pipeline parallel",
        ),
        (
            ["--gpus-per-node", "2", "--set", "train.precision=amp-fp16", "--set", "parallel.data=fsdp"],
            "(loss scaling) does not run with parallel.data fsdp",
        ),
        (["--set", "train.task=masked_lm"], "model.family 'gpt-neox': task masked_lm trains"),
    ],
)
def test_a_job_its_ranks_would_refuse_is_refused_before_it_is_written(tmp_path, capsys, args, said):
    out = tmp_path / "job.sbatch"
    assert main(["launch", "slurm", "tiny", *args, "--run-dir", str(tmp_path / "run"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert said in err and len(err.strip().splitlines()) == 1 and not out.exists()
    assert main(["launch", "slurm", "tiny", "--nodes", "2", "--run-dir", str(tmp_path / "run"), "--out", str(out)]) == 0
    assert out.exists()  # (8 over 2 ranks: written)


def test_a_job_for_gpu_nodes_is_checked_from_a_machine_without_them(tmp_path, monkeypatch):
    """The rules need a device of the kind, not the device: nothing asks CUDA (as on a
    login node), and the 20B model's TP 8 x PP 4 over 4 nodes of 8 GPUs passes."""
    import torch

    def no_cuda(*args, **kwargs):
        raise AssertionError("CUDA was asked")

    for name in ("device_count", "current_device", "get_device_capability", "get_device_properties", "mem_get_info"):
        monkeypatch.setattr(torch.cuda, name, no_cuda)
    out = tmp_path / "job.sbatch"
    args = ["--nodes", "4", "--gpus-per-node", "8", "--run-dir", str(tmp_path / "run"), "--out", str(out)]
    assert main(["launch", "slurm", "gpt-neox-20b:tp8-pp4", *args]) == 0 and out.exists()


def test_shipped_scale_recipes_compile_first_for_the_jobs_ranks(tmp_path):
    """The README's promise, "compile, then torchrun", holds for the published recipes."""
    out = tmp_path / "job.sbatch"
    assert (
        main(
            [
                "launch",
                "slurm",
                "pythia-410m",
                "--nodes",
                "4",
                "--gpus-per-node",
                "8",
                "--run-dir",
                str(tmp_path / "run"),
                "--out",
                str(out),
            ]
        )
        == 0
    )
    script = out.read_text()
    assert "-m frugality compile pythia-410m --ranks 32 --no-progress" in script
    assert script.index("frugality compile") < script.index("frugality train")


@pytest.mark.slow
def test_a_full_disk_leaves_no_script_and_the_rerun_writes_it(micro_recipe_file, tmp_path):
    """A real full disk (a 4 KiB tmpfs, tests/fulldisk.py) for a 6 KB script: one line, no
    empty or partial script left that a rerun would find "exists"."""
    import fulldisk

    disk = tmp_path / "disk"
    long = "description=" + "a long description " * 300  # (it travels in the script's command)
    args = ["launch", "slurm", micro_recipe_file, "--set", long, "--run-dir", tmp_path / "run"]
    done = fulldisk.run_on_small_disk(disk, 4096, [*map(str, args), "--out", str(disk / "job.sbatch")], cwd=tmp_path)
    _, left = fulldisk.left(done)
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert lines[0].startswith(f"error: cannot write {disk / 'job.sbatch'}: No space left on device"), lines
    assert left == [], left
    assert main([*map(str, args), "--out", str(tmp_path / "job.sbatch")]) == 0
    assert (tmp_path / "job.sbatch").stat().st_size > 4096
