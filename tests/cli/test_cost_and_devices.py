"""`frugality cost`, `ls` and `top` as a user runs them: JSON keys, one-line errors, this
machine's devices, and a running job found by its lock."""

from __future__ import annotations

import json
import os
import socket

import pytest

from frugality.cli.main import main
from frugality.hardware import probe


def _json(capsys, argv):
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_cost_train_and_serve_print_the_documented_keys(capsys):
    f = _json(
        capsys, ["cost", "train", "--seq-per-s", "12", "--seq-len", "2048", "--instance", "trn1.32xlarge", "--json"]
    )
    assert f["tokens_per_dollar"] == 4115051 and f["usd_per_million_tokens"] == 0.243
    assert f["instance"] == "trn1.32xlarge" and f["price"].startswith("catalogue: trn1.32xlarge")
    f = _json(
        capsys,
        [
            "cost",
            "serve",
            "--rate",
            "1e6/h",
            "--per-instance-throughput",
            "120",
            "--price-per-hour",
            "0.7582",
            "--watts",
            "100",
            "--json",
        ],
    )
    assert (f["instances"], f["usd_per_million_inferences"], f["kwh_per_million_inferences"]) == (3, 2.2746, 0.3)
    f = _json(
        capsys,
        ["cost", "serve", "--rate", "1000000", "--per-instance-throughput", "300", "--instance", "g6.xlarge", "--json"],
    )  # energy from the catalogue's board power, labelled
    assert f["kwh_per_million_inferences"] == 0.072 and f["energy"].startswith("estimated: 1 x 72 W")


def test_cost_train_with_a_recipe_gives_mfu_against_the_catalogues_bf16_peak(capsys):
    import torch

    from frugality.config.recipe import load_recipe
    from frugality.metrics.flops import non_embedding_params
    from frugality.models import build_model

    argv = ["cost", "train", "--seq-per-s", "12", "--seq-len", "2048", "--recipe", "pythia-410m", "--json"]
    f = _json(capsys, [*argv, "--instance", "trn1.32xlarge"])
    cfg = load_recipe("pythia-410m").model
    with torch.device("meta"):
        n = non_embedding_params(build_model(cfg))
    flops = (6 * n + 12 * cfg.num_layers * cfg.hidden_size * 2048) * 12 * 2048  # 6N + 12LHT per token
    assert f["model_tflops_per_s"] == pytest.approx(flops / 1e12, abs=1e-3)
    assert f["mfu"] == pytest.approx(flops / (16 * 190e12), abs=1e-4)  # 16 Trainium chips, 190 bf16 TFLOP/s each
    trn2 = _json(capsys, [*argv, "--instance", "trn2.48xlarge"])
    assert trn2["mfu"] == pytest.approx(f["mfu"] * 190 / 667, abs=1e-4)
    assert main(argv[:-1] + ["--instance", "c7a.xlarge"]) == 2
    assert "c7a.xlarge has no accelerators" in capsys.readouterr().err


def test_cost_compare_reads_two_json_lines(tmp_path, capsys):
    for name, rate, instance in (("a", "12", "trn1.32xlarge"), ("b", "20", "p4d.24xlarge")):
        assert main(["cost", "train", "--seq-per-s", rate, "--seq-len", "2048", "--instance", instance, "--json"]) == 0
        (tmp_path / f"{name}.json").write_text(capsys.readouterr().out)
    r = _json(capsys, ["cost", "compare", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--json"])
    assert r["tokens_per_s"]["ratio"] == pytest.approx(20 / 12, abs=1e-4)
    assert set(r) == {"tokens_per_s", "tokens_per_dollar", "usd_per_hour", "usd_per_million_tokens"}


@pytest.mark.parametrize(
    "argv, message",
    [
        (["cost", "train", "--seq-per-s", "1", "--seq-len", "8"], "give --price-per-hour or --instance"),
        (["cost", "train", "--seq-per-s", "1", "--seq-len", "8", "--instance", "p9"], "--instance 'p9' is not in"),
        (
            ["cost", "serve", "--rate", "lots", "--per-instance-throughput", "1", "--price-per-hour", "1"],
            "--rate 'lots': not a number",
        ),
        (
            ["cost", "train", "--seq-per-s", "0", "--seq-len", "8", "--price-per-hour", "1"],
            "--seq-per-s must be positive",
        ),
        # a number that is not finite, or not above zero: each option named
        (
            ["cost", "train", "--seq-per-s", "nan", "--seq-len", "8", "--price-per-hour", "1"],
            "--seq-per-s: nan is not a finite number",
        ),
        (
            ["cost", "train", "--seq-per-s", "1", "--seq-len", "-8", "--price-per-hour", "1"],
            "--seq-len must be positive",
        ),
        (
            ["cost", "train", "--seq-per-s", "1", "--seq-len", "8", "--price-per-hour", "inf"],
            "--price-per-hour: inf is not a finite number",
        ),
        (
            ["cost", "train", "--seq-per-s", "1", "--seq-len", "8", "--price-per-hour", "-2"],
            "--price-per-hour must be positive",
        ),
        (
            ["cost", "serve", "--rate", "nan/h", "--per-instance-throughput", "1", "--price-per-hour", "1"],
            "--rate: 'nan' is not a finite number",
        ),
        (
            ["cost", "serve", "--rate", "10", "--per-instance-throughput", "-inf", "--price-per-hour", "1"],
            "--per-instance-throughput: '-inf' is not a finite number",
        ),
        (
            [
                "cost",
                "serve",
                "--rate",
                "10",
                "--per-instance-throughput",
                "1",
                "--price-per-hour",
                "1",
                "--watts",
                "nan",
            ],
            "--watts: nan is not a finite number",
        ),
        (
            ["cost", "serve", "--rate", "10", "--per-instance-throughput", "1", "--price-per-hour", "0"],
            "--price-per-hour must be positive",
        ),
    ],
)
def test_bad_cost_input_is_one_line(capsys, argv, message):
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0]


def test_ls_lists_this_machines_cpu(capsys):
    devices = _json(capsys, ["ls", "--json"])
    cpu = devices[0]
    hw = probe("cpu")
    assert cpu["kind"] == "cpu" and cpu["name"] == hw.name and cpu["instruction_sets"] == list(hw.features)
    assert cpu["usable_cpus"] >= 1 and cpu["memory_gib"] > 0
    assert all(d["kind"] == "cuda" for d in devices[1:])


def test_top_once_finds_a_running_job_and_ignores_a_dead_one(tmp_path, capsys):
    runs = tmp_path / "runs"
    (runs / "live").mkdir(parents=True)
    (runs / "live" / "recipe.toml").write_text("[train]\nsteps = 100\n")
    (runs / "live" / "metrics.jsonl").write_text(
        json.dumps({"kind": "train", "step": 40, "tokens_per_s": 1500.0, "step_time_s": 0.5}) + "\n"
    )
    host = socket.gethostname()
    (runs / ".live.lock").write_text(json.dumps({"host": host, "pid": os.getpid(), "started": "2026-11-23T10:00:00"}))
    (runs / "dead").mkdir()
    (runs / ".dead.lock").write_text(json.dumps({"host": host, "pid": 2**22 + 12345, "started": "x"}))
    (runs / ".ended.lock").write_text("")  # released
    snapshot = _json(capsys, ["top", "--once", "--json", "--interval", "0.2", "--runs", str(runs)])
    cpu = snapshot["devices"][0]
    assert cpu["kind"] == "cpu" and 0.0 <= cpu["utilisation"] <= 1.0 and cpu["memory_used_gib"] > 0
    assert snapshot["runs"] == [
        {
            "run_dir": str(runs / "live"),
            "pid": os.getpid(),
            "started": "2026-11-23T10:00:00",
            "step": 40,
            "total_steps": 100,
            "tokens_per_s": 1500.0,
            "eta_s": 30.0,
        }
    ]
    assert main(["top", "--once", "--interval", "0.1", "--runs", str(runs)]) == 0
    assert f"{runs / 'live'} (PID {os.getpid()}): step 40/100, 1,500 tokens/s, ETA 0m30s" in capsys.readouterr().out
    assert main(["top", "--json"]) == 2  # a live view is not for scripts


@pytest.mark.slow
def test_top_refreshes_in_a_terminal_and_quits_on_q(tmp_path):
    import pty
    import subprocess
    import sys
    import time
    from pathlib import Path

    leader, follower = pty.openpty()
    top = subprocess.Popen(
        [str(Path(sys.executable).with_name("frugality")), "top", "--interval", "0.2", "--runs", str(tmp_path)],
        stdin=follower,
        stdout=follower,
        stderr=follower,
        close_fds=True,
    )
    os.close(follower)
    seen, deadline = b"", time.monotonic() + 60
    import select

    while b"(q quits)" not in seen and time.monotonic() < deadline:  # the first refresh drawn
        if select.select([leader], [], [], 1.0)[0]:
            seen += os.read(leader, 4096)
    os.write(leader, b"q")
    try:
        assert top.wait(timeout=30) == 0
    finally:
        top.kill()
        os.close(leader)
    assert b"no run training under the runs folder" in seen
