"""Checkpoints from strangers run no code: a crafted `.metadata` or training state is refused
by resume, --init-from and export, before anything it asks for runs; old checkpoints resume."""

import hashlib
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import torch.distributed.checkpoint as dcp

from frugality.checkpoint import CheckpointManager, LegacyCheckpointWarning, single_process_ok
from frugality.checkpoint.safe import read_metadata
from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.training import trainer


def _final_weights(recipe, run_dir):
    from frugality.models import build_model
    from frugality.runtime.optim import build_optimizer

    model = build_model(recipe.model)
    optimizer = build_optimizer(model, recipe.optim)
    manager = CheckpointManager(run_dir / "checkpoints")
    extra = manager.load(manager.latest(), model, optimizer)
    return model.state_dict(), extra


def _train_losses(run_dir):
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


class Payload:
    """What an attacker pickles: unpickling it runs a shell command that creates `marker`."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


@pytest.fixture(scope="module")
def trained(tmp_path_factory, micro_recipe_text):
    """A micro run stopped after step 4 (one checkpoint), shared read-only by the tests."""
    root = tmp_path_factory.mktemp("safe")
    (root / "micro.toml").write_text(micro_recipe_text)
    recipe = load_recipe(str(root / "micro.toml"))
    trainer.train(recipe, run_dir=root / "run", until_step=4, progress=False, tensorboard=False)
    return root


def _copy(trained, tmp_path):
    shutil.copytree(trained / "run", tmp_path / "run")
    return tmp_path / "run", tmp_path / "run" / "checkpoints" / "step_00000004"


def _replace(checkpoint, name, data: bytes):
    """Write a file of the checkpoint and update the manifest to match, as an attacker who
    controls the folder would (the manifest guards against accidents, not against them)."""
    (checkpoint / name).write_bytes(data)
    manifest = json.loads((checkpoint / "manifest.json").read_text())
    manifest["files"][name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (checkpoint / "manifest.json").write_text(json.dumps(manifest))


def _error_line(capsys):
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_a_metadata_payload_is_refused_by_resume_init_from_and_export(trained, tmp_path, capsys):
    run, checkpoint = _copy(trained, tmp_path)
    marker = tmp_path / "pwned"
    with open(checkpoint / ".metadata", "rb") as f:
        metadata = pickle.load(f)  # the real metadata, trusted here: we wrote it
    metadata.planner_data = Payload(marker)  # hidden in a field DCP keeps for planners
    _replace(checkpoint, ".metadata", pickle.dumps(metadata))
    recipe = str(trained / "micro.toml")

    for argv in (
        ["train", recipe, "--run-dir", str(run), "--no-progress"],
        ["train", recipe, "--run-dir", str(tmp_path / "new"), "--init-from", str(checkpoint), "--no-progress"],
        [
            "train",
            recipe,
            "--run-dir",
            str(tmp_path / "new2"),
            "--init-from",
            str(checkpoint),
            "--resume-optimizer",
            "--no-progress",
        ],
        ["export", "hf", str(checkpoint), "--out", str(tmp_path / "hf")],
    ):
        assert main(argv) == 2, argv
        line = _error_line(capsys)
        assert "step_00000004: .metadata asks to build posix.system" in line, line
        assert "refused without running it" in line
        assert not marker.exists(), argv
    assert not (tmp_path / "hf").exists()


def test_a_training_state_payload_is_refused_on_resume(trained, tmp_path, capsys):
    """The training state slot holding a pickled object (DCP would unpickle it with
    weights_only=False), or, in the old format, pickled bytes holding one."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from frugality.models import build_model
    from frugality.runtime.optim import build_optimizer

    recipe = load_recipe(str(trained / "micro.toml"))
    marker = tmp_path / "pwned"
    for slot in (Payload(marker), pickle.dumps({"rng": Payload(marker)})):
        run, checkpoint = _copy(trained, tmp_path)
        model, optimizer = build_model(recipe.model), None
        optimizer = build_optimizer(model, recipe.optim)
        extra = CheckpointManager(checkpoint.parent).load(checkpoint, model, optimizer)
        assert isinstance(extra["rng"]["torch"], str)  # written as JSON: no pickle in it
        model_state, optim_state = get_state_dict(model, optimizer)
        shutil.rmtree(checkpoint)
        with single_process_ok():
            dcp.save(
                {"model": model_state, "optim": optim_state, "extra": slot}, checkpoint_id=checkpoint, no_dist=True
            )
        assert main(["train", str(trained / "micro.toml"), "--run-dir", str(run), "--no-progress"]) == 2
        line = _error_line(capsys)
        assert "step_00000004:" in line and "posix.system" in line and "refused" in line, line
        assert not marker.exists()
        shutil.rmtree(run)


def _legacy_rng(state):
    """The objects frugality pickled before its training state was JSON."""
    python, numpy = state["python"], state["numpy"]
    return {
        "python": (python[0], tuple(python[1]), python[2]),
        "numpy": (numpy[0], np.asarray(numpy[1], dtype=np.uint32), *numpy[2:]),
        "torch": torch.frombuffer(bytearray(__import__("base64").b64decode(state["torch"])), dtype=torch.uint8),
    }


def test_a_checkpoint_from_before_json_state_resumes_bit_identically(trained, tmp_path, micro_reference_run):
    """Rewrite step 4 the way frugality wrote checkpoints before (training state pickled, no
    manifest), resume to step 8, and compare with an uninterrupted run."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from frugality.models import build_model
    from frugality.runtime.optim import build_optimizer

    recipe = load_recipe(str(trained / "micro.toml"))
    run, checkpoint = _copy(trained, tmp_path)
    model = build_model(recipe.model)
    optimizer = build_optimizer(model, recipe.optim)
    extra = CheckpointManager(checkpoint.parent).load(checkpoint, model, optimizer)
    extra["rng"] = _legacy_rng(extra["rng"])
    model_state, optim_state = get_state_dict(model, optimizer)
    shutil.rmtree(checkpoint)
    with single_process_ok():
        dcp.save(
            {"model": model_state, "optim": optim_state, "extra": pickle.dumps(extra)},
            checkpoint_id=checkpoint,
            no_dist=True,
        )

    with pytest.warns(LegacyCheckpointWarning, match="older frugality"):
        resumed = trainer.train(recipe, run_dir=run, progress=False, tensorboard=False)
    assert resumed.start_step == 4 and resumed.final_step == 8
    (weights_a, extra_a), (weights_b, extra_b) = (
        _final_weights(recipe, micro_reference_run),
        _final_weights(recipe, run),
    )
    for name, tensor in weights_a.items():
        assert torch.equal(tensor, weights_b[name]), name
    assert extra_a == extra_b  # data position and every RNG state
    assert _train_losses(micro_reference_run) == _train_losses(run)


def test_read_metadata_refuses_what_is_not_dcp_metadata(tmp_path):
    (tmp_path / ".metadata").write_bytes(pickle.dumps({"not": "metadata"}))
    with pytest.raises(Exception, match="holds a dict, not DCP metadata"):
        read_metadata(tmp_path)
    (tmp_path / ".metadata").write_bytes(b"\x80\x04garbage")
    with pytest.raises(Exception, match=".metadata is unreadable"):
        read_metadata(tmp_path)


def test_object_states_are_set_on_allowed_instances_only(tmp_path):
    """BUILD on an allowed class would rewrite it for the whole process; a NumPy dtype with
    object fields would make an array read raw bytes as pointers. Both refused."""
    import pathlib

    from frugality.checkpoint.safe import UnsafeCheckpointError, legacy_state

    # pathlib.PurePosixPath's __truediv__ replaced, as a crafted .metadata would
    (tmp_path / ".metadata").write_bytes(b"cpathlib\nPurePosixPath\n(dS'__truediv__'\nNsb.")
    with pytest.raises(UnsafeCheckpointError, match="a state for pathlib.PurePosixPath"):
        read_metadata(tmp_path)
    assert pathlib.PurePosixPath("/tmp") / "x" == pathlib.PurePosixPath("/tmp/x")

    class ObjectDtype:
        def __reduce__(self):
            return np.dtype, ("O8", False, True)

    with pytest.raises(UnsafeCheckpointError, match=r"numpy.dtype\('O8'\)"):
        legacy_state(pickle.dumps({"rng": ObjectDtype()}), tmp_path)

    class RestatedDtype:  # a plain dtype whose pickled state claims object fields
        def __reduce__(self):
            return np.dtype, ("u4", False, True), (3, "|", None, ("a",), {"a": (np.dtype("u4"), 0)}, 4, 1, 0x3F)

    with pytest.raises(UnsafeCheckpointError, match="a state for numpy"):
        legacy_state(pickle.dumps({"rng": RestatedDtype()}), tmp_path)
    assert legacy_state(pickle.dumps({"numpy": np.random.get_state()}), tmp_path)["numpy"][0] == "MT19937"
