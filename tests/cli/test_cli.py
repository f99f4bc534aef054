"""The command line as a user meets it: help, one-line errors, exit codes, nothing written."""

import subprocess
import sys
from pathlib import Path

import pytest

from frugality.cli.main import main

COMMANDS = [
    ["train"],
    ["data"],
    ["data", "prepare"],
    ["data", "inspect"],
    ["recipes"],
    ["bench"],
    ["bench", "train"],
    ["bench", "compile"],
    ["compile"],
    ["import"],
    ["import", "hf"],
    ["export"],
    ["export", "hf"],
]


def test_help_lists_every_command(capsys):
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for name in ("train", "compile", "data", "recipes", "bench", "import", "export"):
        assert name in out


@pytest.mark.parametrize("command", COMMANDS)
def test_each_command_has_help(command, capsys):
    assert main([*command, "--help"]) == 0
    assert "Usage: frugality " + " ".join(command) in capsys.readouterr().out


def test_console_script_runs():
    script = Path(sys.executable).with_name("frugality")  # the installed console script
    out = subprocess.run([str(script), "--version"], capture_output=True, text=True, check=True).stdout
    assert "frugality" in out


def _one_error_line(capsys) -> str:
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert err[0].startswith("error: ")
    return err[0]


def test_bad_recipe_exits_2_with_one_line_and_writes_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    bad = tmp_path / "bad.toml"
    bad.write_text("[model]\nhidden_size = 100\nnum_layers = 2\nnum_heads = 3\n")
    assert main(["train", str(bad)]) == 2
    line = _one_error_line(capsys)
    assert str(bad) in line and "divisible by num_heads" in line
    assert main(["train", "tiny", "--set", "train.steps=-1"]) == 2
    assert "--set train.steps=-1: train.steps" in _one_error_line(capsys)
    assert main(["train", "no-such-recipe"]) == 2
    _one_error_line(capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.toml"]


def test_train_and_data_commands_end_to_end(micro_recipe_file, tmp_path, capsys):
    text = tmp_path / "story.txt"
    text.write_text("Once upon a time there was a small model that learned to read. " * 400)
    assert main(["data", "prepare", str(text), "--tokenizer", "gpt2", "--out", str(tmp_path / "story")]) == 0
    assert "1 documents" in capsys.readouterr().out
    assert main(["data", "inspect", str(tmp_path / "story"), "--tokenizer", "gpt2"]) == 0
    assert "Once upon a time" in capsys.readouterr().out
    # Preparing again onto the same prefix is refused, and the files stay.
    before = (tmp_path / "story.bin").read_bytes()
    assert main(["data", "prepare", str(text), "--out", str(tmp_path / "story")]) == 2
    assert "already exists" in _one_error_line(capsys)
    assert (tmp_path / "story.bin").read_bytes() == before

    args = [
        "train",
        str(micro_recipe_file),
        "--run-dir",
        str(tmp_path / "run"),
        "--no-progress",
        "--set",
        f"data.dataset={tmp_path / 'story'}",
        "--set",
        "data.tokenizer=gpt2",
        "--set",
        "data.val_fraction=0.1",
        "--set",
        "train.steps=3",
    ]
    assert main(args) == 0
    assert "step 3/3" in capsys.readouterr().out
    assert (tmp_path / "run" / "checkpoints" / "step_00000003").is_dir()
    # The same command again resumes the finished run and has nothing left to do.
    assert main(args) == 0
    assert "step 3/3" in capsys.readouterr().out


def test_recipes_lists_and_shows(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out.splitlines()
    listed, machine = out[: out.index("")], out[out.index("") + 1 :]
    recipes = [line for line in listed if not line.startswith("  ")]  # (indented: a recipe's layout variants)
    assert recipes[0].startswith("tiny") and recipes[-1].startswith("gpt-neox-20b")
    assert listed[-2].startswith("  gpt-neox-20b:tp8-pp4  TP 8 within a node x PP 4 across nodes")
    # then what this machine is and what `auto` picks on it
    assert machine[0].startswith("this machine: ") and "bf16 products" in machine[0]
    assert machine[1].startswith("products (measured once per machine): fp32 ") and "GFLOP/s" in machine[1]
    assert machine[2].startswith("precision auto -> ")
    assert main(["recipes", "pythia-70m"]) == 0
    assert "hidden_size = 512" in capsys.readouterr().out


def test_a_shown_recipe_reads_as_written_and_as_it_loads(tmp_path, capsys):
    """`recipes NAME` for every shipped recipe: no float spelt as its binary rounding
    (min_lr = 2.9999999999999997e-05), no key only another task reads (a decoder's
    data.fields), and what it shows loads back as the same recipe."""
    import re

    from frugality.config.recipe import load_recipe, shipped_recipes

    for name in shipped_recipes():
        assert main(["recipes", name]) == 0
        shown = capsys.readouterr().out
        assert not re.search(r"\d\.\d{9,}", shown), (name, re.search(r".*\d\.\d{9,}.*", shown)[0])
        task = load_recipe(name).train.task
        for key, only in (("fields", "contrastive"), ("buckets", "contrastive"), ("mask_prob", "masked_lm")):
            assert (f"\n{key} = " in shown) == (task == only), (name, key)
        (tmp_path / f"{name}.toml").write_text(shown)
        assert load_recipe(str(tmp_path / f"{name}.toml")) == load_recipe(name)


def test_a_filesystem_fault_outside_checkpoints_is_one_line_naming_the_path(
    micro_recipe_file, tmp_path, capsys, monkeypatch
):
    """A disk that fills while metrics are written: the path, the cause and the free space in
    one line, exit status 2 (root ignores permissions, so the fault is raised where the file
    is written, as the kernel would). A read-only file system: the path and the cause."""
    import errno
    import os

    from frugality.cli.main import filesystem_fault
    from frugality.training.callbacks import run_log

    metrics = tmp_path / "run" / "metrics.jsonl"

    def failing(self, state, result):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(metrics))

    monkeypatch.setattr(run_log.RunLog, "on_step_end", failing)
    assert main(["train", str(micro_recipe_file), "--run-dir", str(tmp_path / "run"), "--no-progress"]) == 2
    line = _one_error_line(capsys)
    assert line.startswith(f"error: cannot write {metrics}: No space left on device (")
    assert f"GiB free on the device holding {tmp_path / 'run'})" in line
    read_only = OSError(errno.EROFS, os.strerror(errno.EROFS), str(metrics))
    assert filesystem_fault(read_only) == f"cannot write {metrics}: Read-only file system"
    denied = OSError(errno.EACCES, os.strerror(errno.EACCES), "/root/x")
    assert filesystem_fault(denied) == "cannot access /root/x: Permission denied"
