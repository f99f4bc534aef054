"""`frugality compile` then `frugality train`, as separate processes the way a user runs
them: a run after the ahead-of-time compile compiles nothing."""

from __future__ import annotations

import json
import os

import pytest

from frugality.cli.main import main

KEY = "fleet-key-of-32-random-characters"  # the micro_compiled fixture's


def _run(*args, env):
    import forked_cli

    return forked_cli.run(*args, env=env)


@pytest.mark.slow
def test_compile_then_a_run_compiles_nothing(micro_compiled, micro_recipe_file, tmp_path):
    cache, printed = micro_compiled  # `frugality compile` run once for the session, with a fleet key
    # The block's forward and backward and the evaluation forward.
    assert "3 graphs (0 already cached, 3 compiled)" in printed and "recompiles 0" in printed
    assert not list(cache.parent.glob("runs/*"))  # throwaway state only
    manifests = [json.loads(p.read_text()) for p in cache.glob("*/manifest.json")]
    assert manifests and all("signature" in m for m in manifests)  # signed with the key

    env = os.environ | {"FRUGALITY_COMPILE_CACHE": str(cache), "FRUGALITY_CACHE_KEY": KEY}
    run_dir = tmp_path / "run"
    done = _run(
        "train",
        str(micro_recipe_file),
        "--set",
        "compile.level=O1",
        "--set",
        "train.device=cpu",
        "--run-dir",
        str(run_dir),
        "--no-progress",
        env=env,
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    compiled = summary["compile"]
    assert compiled["fetched"] and compiled["cache_hits"] == 3  # the signature checked when read
    assert compiled["cache_misses"] == 0 and compiled["recompiles"] == 0  # the guard saw nothing
    assert not compiled["published"]
    assert summary["final_step"] == 8
    assert summary["final_val_loss"] < summary["first_val_loss"]
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if r["kind"] == "compile"] == [0, 1, 8]
    assert KEY[:16] not in "".join(p.read_text(errors="replace") for p in run_dir.rglob("*.json*"))


def test_bad_compile_settings_are_one_line(micro_recipe_file, tmp_path, capsys):
    assert (
        main(
            [
                "train",
                str(micro_recipe_file),
                "--set",
                "compile.on_recompile=sometimes",
                "--run-dir",
                str(tmp_path / "run"),
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: --set compile.on_recompile=sometimes: compile.on_recompile: Input should be "
        "'warn' or 'error' (got 'sometimes')"
    ]
    assert not (tmp_path / "run").exists()
    assert main(["compile", str(micro_recipe_file)]) == 2
    assert "nothing to compile" in capsys.readouterr().err
