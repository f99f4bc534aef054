"""A PJRT_DEVICE naming a device that is not here is one line, exit 2."""

import os
import subprocess
import sys

import pytest


@pytest.mark.parametrize("device, says", [("TPU", "libtpu not found"), ("BOGUS", "No PjRtPlugin registered")])
def test_a_pjrt_device_that_is_not_here_is_one_line(micro_recipe_file, tmp_path, device, says):
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "frugality",
            "train",
            str(micro_recipe_file),
            "--run-dir",
            str(tmp_path / "run"),
            "--set",
            "train.device=xla",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "PJRT_DEVICE": device},
    )
    [line] = done.stderr.strip().splitlines()
    assert (
        done.returncode == 2
        and line.startswith(f"error: PJRT_DEVICE='{device}': torch_xla cannot open")
        and says in line
    )
    assert not (tmp_path / "run").exists()
