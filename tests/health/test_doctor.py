"""`frugality doctor`: each check passes on this machine and fails, naming itself, when what
it checks is broken."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import forked_cli
import pytest
import torch

from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.health import FAIL, PASS, thresholds
from frugality.health import device as device_checks
from frugality.health.machine import machine_checks

CPU = torch.device("cpu")


def test_device_checks_pass_here_and_a_biased_rounding_fails(monkeypatch):
    limits = thresholds("cpu")
    assert [c.status for c in device_checks.product_checks(CPU, limits)] == [PASS, PASS]
    assert device_checks.stochastic_rounding_check(CPU, limits).status == PASS
    # noise that never carries: rounding toward zero, 0.3 bf16 steps below the value on average
    monkeypatch.setattr(device_checks, "noise16x3", lambda index, key: (torch.zeros_like(index),) * 3)
    check = device_checks.stochastic_rounding_check(CPU, limits)
    assert check.status == FAIL and check.data["value"] == pytest.approx(0.3, abs=0.01)


def test_machine_checks_fail_on_a_full_disk_an_unwritable_cache_and_a_missing_dataset(micro_recipe_file, tmp_path):
    recipe = load_recipe(str(micro_recipe_file), [])
    assert all(c.status != FAIL for c in machine_checks(CPU, recipe, tmp_path / "runs", thresholds("cpu"), 4))
    blocked = tmp_path / "file"
    blocked.write_text("a file where the cache folder should be")
    broken = load_recipe(
        str(micro_recipe_file), [f'compile.cache="{blocked}/cache"', f'data.dataset="{tmp_path}/missing"']
    )
    limits = thresholds("cpu", ["min_free_disk_gib=1e9"])  # more than any disk holds
    failing = {c.name: c for c in machine_checks(CPU, broken, tmp_path / "runs", limits, 4) if c.status == FAIL}
    assert set(failing) == {f"free disk at {tmp_path / 'runs'}", "compile cache", "dataset"}
    assert "missing" in failing["dataset"].detail
    assert not list(tmp_path.glob(".frugality-doctor-*"))  # the write probe is removed


def test_thresholds_are_overridable_by_name_only():
    assert thresholds("cuda", ["min_bus_bandwidth_gb_s=40"])["min_bus_bandwidth_gb_s"] == 40
    with pytest.raises(UserError, match="NAME one of"):
        thresholds("cpu", ["min_bandwidth=3"])
    with pytest.raises(UserError, match="not a number"):
        thresholds("cpu", ["min_free_disk_gib=lots"])


def _doctor(tmp_path, *args, **env):
    import forked_cli

    return forked_cli.run("doctor", "--quick", "--run-dir", tmp_path / "runs", *args, timeout=300, env=os.environ | env)


@pytest.mark.distributed
def test_collectives_among_two_processes_pass_and_an_injected_wrong_value_fails(tmp_path):
    done = _doctor(tmp_path, "--nproc", "2", "--max-size", "1", "--json", str(tmp_path / "doctor.json"))
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [r for r in json.loads((tmp_path / "doctor.json").read_text()) if r["group"] == "collectives"]
    measured = [r for r in rows if "op" in r["data"]]
    assert len(measured) == 4 * 6 and all(r["status"] == PASS for r in rows)  # 4 ops x 1 KiB..1 MiB
    for r in measured:  # nccl-tests' definitions
        d = r["data"]
        assert d["algbw_gb_s"] == pytest.approx(d["bytes"] / (d["time_us"] * 1e-6) / 1e9)
        factor = {"all_reduce": 1.0, "all_gather": 0.5, "reduce_scatter": 0.5, "broadcast": 1.0}[d["op"]]
        assert d["busbw_gb_s"] == pytest.approx(d["algbw_gb_s"] * factor)
    broken = _doctor(tmp_path, "--nproc", "2", "--max-size", "1", FRUGALITY_INJECT_FAULT="all_reduce_value")
    assert broken.returncode == 1
    assert "all_reduce 1 KiB (256 wrong values across the ranks)" in broken.stderr
    assert "| all_gather 1 KiB | pass |" in broken.stdout  # only the corrupted collective fails


def test_doctor_refuses_bad_input_in_one_line(tmp_path, capsys):
    existing = tmp_path / "out.json"
    existing.write_text("keep")
    assert main(["doctor", "--quick", "--json", str(existing)]) == 2
    assert main(["doctor", "--quick", "--threshold", "speed=1"]) == 2
    assert existing.read_text() == "keep"
    assert capsys.readouterr().err.count("error:") == 2


def test_a_read_only_run_directory_is_a_failed_check(tmp_path):
    """A run directory on a read-only file system (a read-only mount: root writes through
    permission bits) is the disk-write check failing, in the table, with doctor's status 1."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fulldisk

    runs = tmp_path / "runs"
    done = fulldisk.run_on_small_disk(
        runs,
        1 << 20,
        ["doctor", "--quick", "--run-dir", str(runs), "--threshold", "min_free_disk_gib=0.0005"],
        cwd=tmp_path,
        read_only=True,
    )
    out, left = fulldisk.left(done)
    assert done.returncode == 1, done.stderr[-3000:]
    assert f"| machine | disk write at {runs} | fail | not writable | [Errno 30] Read-only file system" in out
    assert f"| machine | free disk at {runs} | pass |" in out  # the other checks ran and are reported
    assert "doctor: 1 check(s) failed: disk write at" in done.stderr and "Traceback" not in done.stderr
    assert left == []


@pytest.mark.slow
def test_preflight_runs_before_step_one_and_refuses_a_broken_device(micro_recipe_file, tmp_path, monkeypatch):
    from frugality.training import trainer

    recipe = load_recipe(str(micro_recipe_file), ["train.preflight=true", "train.steps=2"])
    # an all-reduce that corrupts its result, in 2 processes over gloo: every rank stops, nothing written
    script = tmp_path / "corrupt.py"
    script.write_text(CORRUPT_ALL_REDUCE)
    done = forked_cli.ranks(
        2, micro_recipe_file, tmp_path / "two", script=script, env=os.environ | {"OMP_NUM_THREADS": "1"}, timeout=300
    )
    assert done.returncode != 0
    # the wrong values are counted over the ranks: each rank names the failed collective
    assert "preflight failed on rank 0: all_reduce 1 KiB" in done.stderr
    assert "preflight failed on rank 1: all_reduce 1 KiB" in done.stderr
    assert "256 wrong values across the ranks" in done.stderr
    assert not (tmp_path / "two").exists()
    # one process: float32 products wrong by 1% fail the check before the run directory exists
    real_mm = torch.Tensor.__matmul__
    monkeypatch.setattr(
        torch.Tensor, "__matmul__", lambda a, b: real_mm(a, b) * (1.01 if a.dtype == torch.float32 else 1)
    )
    with pytest.raises(UserError, match="preflight failed: float32 product: rel. error 1.0e-02"):
        trainer.train(recipe, run_dir=tmp_path / "one", progress=False, tensorboard=False)
    assert not (tmp_path / "one").exists()
    monkeypatch.undo()
    result = trainer.train(recipe, run_dir=tmp_path / "one", progress=False, tensorboard=False)
    assert result.final_step == 2


CORRUPT_ALL_REDUCE = """
import sys
import torch.distributed as dist
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.training import trainer

real = dist.all_reduce
def corrupt(tensor, *args, **kwargs):  # rank 1's results come back off by one
    work = real(tensor, *args, **kwargs)
    if dist.get_rank() == 1 and tensor.numel() == 256:
        tensor += 1
    return work
dist.all_reduce = corrupt
try:
    trainer.train(load_recipe(sys.argv[1], ["train.preflight=true"]), run_dir=sys.argv[2], progress=False,
                  tensorboard=False)
except UserError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)
"""


@pytest.mark.slow
def test_doctor_refuses_more_processes_than_train_would_run(frugality_cli, tmp_path):
    """`doctor --nproc N` beyond this machine's cores is refused as `train --nproc N` is (it
    passed before: the collectives ran, contending for the cores)."""
    cores = len(os.sched_getaffinity(0))
    for command in (["doctor", "--quick"], ["train"]):
        args = [*command, "--nproc", cores + 2, "--run-dir", tmp_path / "runs", "--set", "train.device=cpu"]
        done = frugality_cli(*args, cwd=tmp_path)
        [line] = [line for line in done.stderr.splitlines() if line.strip()]
        assert done.returncode == 2 and line == (
            f"error: --nproc {cores + 2}: this machine has {cores} CPU cores, and each CPU rank needs one; "
            "more ranks than cores only contend for them (use torchrun across machines for more)"
        )
    assert not (tmp_path / "runs").exists()
