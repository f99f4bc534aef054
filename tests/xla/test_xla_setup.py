"""A PJRT_DEVICE naming a device that is not here is one line, exit 2; `ls` lists the
client's devices; `doctor` checks one."""

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


def test_ls_lists_the_pjrt_clients_devices(capsys):
    import json

    from frugality.cli.main import main

    assert main(["ls", "--json"]) == 0
    devices = json.loads(capsys.readouterr().out)
    [xla_device] = [d for d in devices if d["kind"] == "xla"]  # PJRT_DEVICE=CPU: one device
    assert xla_device["client"] == "CPU" and xla_device["torch_xla"] == "2.9.0"
    assert main(["ls"]) == 0
    assert "xla0   XLA CPU client, torch-xla 2.9.0" in capsys.readouterr().out


def test_doctor_checks_the_xla_devices_products_and_stochastic_rounding(tmp_path, capsys):
    from frugality.cli.main import main

    code = main(["doctor", "--quick", "--set", "train.device=xla", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0 and "doctor: all" in out, out
    for row in ("float32 product", "bfloat16 product", "stochastic rounding bias"):
        assert row in out
    assert "<= 1e-05 (fp32_product_rel_error)" in out  # XLA's CPU client is held to the CPU's threshold
    assert main(["doctor", "--set", "train.device=xla", "--nproc", "2"]) == 2
    assert "--nproc: doctor on an xla device checks that one device" in capsys.readouterr().err
