"""Checkpoints that survive a crash anywhere: a manifest of sizes and SHA-256s written last;
a truncated or corrupt newest checkpoint is skipped for the previous one, with a warning;
what a crash leaves behind is cleaned up."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from frugality.checkpoint import MANIFEST, CheckpointManager, CorruptCheckpointWarning, verify
from frugality.config.recipe import OptimConfig
from frugality.models import GPTNeoX, GPTNeoXConfig
from frugality.runtime.optim import build_optimizer

CFG = GPTNeoXConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=64, max_seq_len=16)


@pytest.fixture
def two_checkpoints(tmp_path):
    torch.manual_seed(0)
    model = GPTNeoX(CFG)
    optimizer = build_optimizer(model, OptimConfig())
    manager = CheckpointManager(tmp_path, keep=3)
    for step in (1, 2):
        model(torch.randint(0, 64, (2, 16))).sum().backward()
        optimizer.step()
        manager.save(step, model, optimizer, {"step": step})
    return manager


def _distcp(path):
    return next(path.glob("__0_*.distcp"))


def test_the_manifest_lists_every_file_with_its_size_and_hash(two_checkpoints):
    newest = two_checkpoints.latest()
    files = json.loads((newest / MANIFEST).read_text())["files"]
    assert set(files) == {p.name for p in newest.iterdir()} - {MANIFEST}
    assert all(len(r["sha256"]) == 64 and r["size"] > 0 for r in files.values())
    assert verify(newest) is None


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda f: f.write_bytes(f.read_bytes()[: f.stat().st_size // 2]), "bytes, the manifest"),  # cut in half
        (lambda f: f.write_bytes(bytes([f.read_bytes()[0] ^ 1]) + f.read_bytes()[1:]), "does not match its SHA-256"),
        (lambda f: f.unlink(), "is missing"),
    ],
)
def test_a_damaged_newest_checkpoint_is_skipped_for_the_one_before(two_checkpoints, damage, reason):
    newest = two_checkpoints.latest()
    damage(_distcp(newest))
    assert reason in verify(newest)
    with pytest.warns(CorruptCheckpointWarning, match=f"{newest.name} is unusable"):
        assert two_checkpoints.latest().name == "step_00000001"


def test_a_checkpoint_without_manifest_is_checked_against_its_metadata(two_checkpoints):
    newest = two_checkpoints.latest()
    (newest / MANIFEST).unlink()  # as written before manifests existed, or the manifest deleted
    assert verify(newest) is None and two_checkpoints.latest() == newest
    shard = _distcp(newest)
    shard.write_bytes(shard.read_bytes()[:-100])  # and a shard cut short: .metadata says how long it was
    assert "no manifest" in verify(newest) and "points up to byte" in verify(newest)
    with pytest.warns(CorruptCheckpointWarning, match=f"{newest.name} is unusable"):
        assert two_checkpoints.latest().name == "step_00000001"
    shard.unlink()
    assert "is missing (no manifest" in verify(newest)


def test_a_checkpoint_whose_metadata_was_deleted_is_named_when_skipped(two_checkpoints):
    newest = two_checkpoints.latest()
    (newest / ".metadata").unlink()
    with pytest.warns(CorruptCheckpointWarning, match=f"{newest.name} is unusable .no .metadata: DCP's index"):
        assert two_checkpoints.latest().name == "step_00000001"
    (newest / MANIFEST).unlink()  # neither: a save cut short by an older version, skipped as before
    with pytest.warns(CorruptCheckpointWarning, match="an incomplete save"):
        assert two_checkpoints.latest().name == "step_00000001"


@pytest.mark.slow
def test_a_resume_past_a_damaged_checkpoint_without_manifest_says_so(
    micro_recipe_file, tmp_path, frugality_cli, micro_reference_run
):
    run = tmp_path / "run"
    shutil.copytree(micro_reference_run, run)  # the micro recipe's 8 steps, saved at 4 and 8 (read only: a copy)
    command = ["train", micro_recipe_file, "--run-dir", run, "--no-progress"]
    newest = run / "checkpoints" / "step_00000008"
    assert sorted(p.name for p in newest.parent.iterdir()) == ["step_00000004", newest.name]
    (newest / MANIFEST).unlink()
    _distcp(newest).write_bytes(_distcp(newest).read_bytes()[:1000])
    resumed = frugality_cli(*command, "--set", "train.steps=9")
    assert resumed.returncode == 0, resumed.stderr
    assert f"warning: checkpoint {newest} is unusable" in resumed.stderr
    assert "resuming" in resumed.stdout and "from step 4 (step_00000004)" in resumed.stdout


def test_what_a_crash_leaves_is_cleaned_at_the_next_save(two_checkpoints):
    folder = two_checkpoints.folder
    shutil.copytree(folder / "step_00000001", folder / ".step_00000003.partial")  # a save cut short
    stray = folder / "step_00000000"
    stray.mkdir()  # a step folder without .metadata, older than anything kept
    (stray / "__0_0.distcp").write_bytes(b"x" * 100)
    two_checkpoints.keep = 2
    model = GPTNeoX(CFG)
    two_checkpoints.save(3, model, build_optimizer(model, OptimConfig()), {})
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000002", "step_00000003"]


def test_ckpt_verify_names_the_unusable_checkpoint(two_checkpoints, capsys):
    from frugality.cli.main import main

    folder = two_checkpoints.folder
    assert main(["ckpt", "verify", str(folder)]) == 0
    assert capsys.readouterr().out.count("ok ") == 2
    _distcp(folder / "step_00000002").write_bytes(b"")
    assert main(["ckpt", "verify", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "unusable   " + str(folder / "step_00000002") in captured.out
    assert "a resume would start from step 1" in captured.err
    assert main(["ckpt", "verify", str(folder / "nothing")]) == 2
    (folder / "step_00000001" / MANIFEST).unlink()  # a manifest deleted, bytes flipped (the size kept)
    data = bytearray(_distcp(folder / "step_00000001").read_bytes())
    data[-4:] = bytes(255 - b for b in data[-4:])
    _distcp(folder / "step_00000001").write_bytes(bytes(data))
    assert main(["ckpt", "verify", str(folder / "step_00000001")]) == 1
    captured = capsys.readouterr()
    assert f"unverified {folder / 'step_00000001'}  no manifest.json" in captured.out and "ok " not in captured.out
    assert "1 of 1 checkpoint(s) could not be verified (no manifest.json)" in captured.err


def test_a_full_disk_during_a_save_is_one_line_and_leaves_the_previous_checkpoint(two_checkpoints, monkeypatch):
    import errno

    import torch.distributed.checkpoint.filesystem as dcp_files

    from frugality.errors import UserError

    real = dcp_files._write_item

    def full(*args, **kwargs):  # some bytes reach the disk, then it is full
        real(*args, **kwargs)
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(dcp_files, "_write_item", full)
    model = GPTNeoX(CFG)
    folder = two_checkpoints.folder
    with pytest.raises(
        UserError,
        match=r"cannot write checkpoint .*step_00000003: No space left on device "
        r"\(.* GiB free on the device holding .*\); the previous checkpoint "
        r"step_00000002 is intact",
    ):
        two_checkpoints.save(3, model, build_optimizer(model, OptimConfig()), {})
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000001", "step_00000002"]  # no partial left
    assert two_checkpoints.latest().name == "step_00000002"


def test_too_little_space_for_the_next_checkpoint_is_said_before_writing(two_checkpoints, monkeypatch):
    import shutil
    from collections import namedtuple

    from frugality.errors import UserError

    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10**9, 10**9 - 1000, 1000))
    model = GPTNeoX(CFG)
    folder = two_checkpoints.folder
    with pytest.raises(
        UserError,
        match=r"cannot write checkpoint .*step_00000003: 1,000 B free on the device holding "
        r".*, the checkpoint needs ~\d+\.\d KiB \(as step_00000002\); the previous "
        r"checkpoint step_00000002 is intact",
    ):
        two_checkpoints.save(3, model, build_optimizer(model, OptimConfig()), {})
    assert sorted(p.name for p in folder.iterdir()) == ["step_00000001", "step_00000002"]  # nothing written
