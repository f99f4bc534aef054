"""Model weights from anywhere a user may point: a run directory (its latest checkpoint),
one checkpoint folder, a folder written by `frugality import hf`, or a Hugging Face
checkpoint folder. Shapes are checked before anything is loaded, so a mismatch is one
clear error naming the first tensor that differs."""

from __future__ import annotations

import shutil
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType

import torch
from torch import nn
from torch.distributed.checkpoint import state_dict_saver  # (dcp.save, which dcp re-exports without an __all__)
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from frugality.checkpoint import CheckpointManager, safe_load, single_process_ok
from frugality.checkpoint.safe import read_metadata
from frugality.config.recipe import Recipe
from frugality.errors import UserError
from frugality.interop.hf import import_hf
from frugality.paths import publish_folder


@dataclass(frozen=True)
class WeightsSource:
    path: Path
    kind: str  # "dcp" (frugality checkpoint) or "hf"
    has_optimizer: bool = False


def resolve_source(path: str | Path, what: str = "--init-from") -> WeightsSource:
    """The weights at `path`; `what` names it in errors (the flag or argument it came from)."""
    p = Path(path)
    if not p.exists():
        raise UserError(f"{what} {p}: no such file or folder")
    if (p / "config.json").is_file():
        return WeightsSource(p, "hf")
    if (p / ".metadata").is_file():
        return WeightsSource(p, "dcp", "optim" in _top_level_keys(p))
    latest = CheckpointManager(p / "checkpoints").latest()
    if latest is not None:
        return WeightsSource(latest, "dcp", "optim" in _top_level_keys(latest))
    raise UserError(
        f"{what} {p}: not a run directory with a checkpoint, a checkpoint "
        "folder, or a Hugging Face checkpoint folder (config.json)"
    )


def _metadata(path: Path):
    return read_metadata(path).state_dict_metadata  # without running code from the file


def _top_level_keys(path: Path) -> set[str]:
    return {key.split(".", 1)[0] for key in _metadata(path)}


def _check_shapes(
    theirs: dict[str, tuple], ours: dict[str, torch.Tensor], where: Path, optional: tuple[str, ...] = ()
) -> None:
    """Every tensor of `ours` (name -> a tensor, or its whole model's shape) in `theirs`
    at its shape, and nothing of theirs without a place."""
    for name, tensor in ours.items():
        shape = tuple(tensor.shape) if hasattr(tensor, "shape") else tuple(tensor)
        if name not in theirs and name.startswith(optional):
            continue  # a part the source never had (an embedding head): it starts as initialised
        if name not in theirs:
            raise UserError(f"--init-from {where}: has no tensor {name!r} that the recipe's model needs")
        if tuple(theirs[name]) != shape:
            raise UserError(
                f"--init-from {where}: tensor {name!r} has shape {list(theirs[name])} there but "
                f"{list(shape)} in the recipe's model (check model.* and vocab_size)"
            )
    extra = sorted(set(theirs) - set(ours))
    if extra:
        raise UserError(f"--init-from {where}: tensor {extra[0]!r} has no place in the recipe's model")


def _read_hf(source: WeightsSource) -> dict[str, torch.Tensor]:
    return import_hf(source.path)[1]


def _optional(model: nn.Module) -> tuple[str, ...]:
    """Parameters a source may lack and the model then keeps as initialised: those a model
    adds on top of a pretrained one (BERT's embedding head and learnt temperature)."""
    return tuple(getattr(model, "optional_in_checkpoints", ()))


def _their_shapes(source: WeightsSource) -> dict[str, tuple]:
    meta = _metadata(source.path)
    return {
        k.removeprefix("model."): m.size
        for k, m in meta.items()
        if k.startswith("model.") and isinstance(m, TensorStorageMetadata)  # (not a non-tensor value's)
    }


def check_compatible(source: WeightsSource, model: nn.Module) -> None:
    ours = model.state_dict()
    if source.kind == "hf":
        _check_shapes({k: v.shape for k, v in _read_hf(source).items()}, ours, source.path, _optional(model))
        return
    _check_shapes(_their_shapes(source), ours, source.path, _optional(model))


@torch.no_grad()
def load_weights(source: WeightsSource, model: nn.Module) -> list[str]:
    """Copy the source's weights into `model` in place (cast to its dtype and device),
    after checking every shape; returns the names the source lacked, left as initialised
    (only parts a model may add to a pretrained one, `optional_in_checkpoints`)."""
    ours = model.state_dict()  # tensors share storage with the parameters
    # a pipeline stage holds part of the model: every rank checks the whole model's shapes
    # (one verdict everywhere), and copies its own part
    whole = getattr(model, "whole_model_shapes", None) or ours
    if source.kind == "hf":
        state = _read_hf(source)  # read once: checked, then copied
        _check_shapes({k: v.shape for k, v in state.items()}, whole, source.path, _optional(model))
        for name, tensor in ours.items():
            if name in state:
                tensor.copy_(placed_like(state[name], tensor))
        return [name for name in ours if name not in state]
    theirs = _their_shapes(source)
    _check_shapes(theirs, whole, source.path, _optional(model))
    safe_load({"model": {k: v for k, v in ours.items() if k in theirs}}, source.path, no_dist=True)
    return [name for name in ours if name not in theirs]


def placed_like(full: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`full`, split as `tensor` is where it is a DTensor (FSDP2, tensor parallel): this
    rank's share of it."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    if not isinstance(tensor, DTensor):
        return full
    full = full.to(tensor.device_mesh.device_type, tensor.dtype)
    return distribute_tensor(full, tensor.device_mesh, tensor.placements, src_data_rank=None)


def save_weights(
    path: str | Path, state: dict[str, torch.Tensor], files: Mapping[str, bytes] = MappingProxyType({})
) -> Path:
    """A model-only checkpoint folder (what `frugality import hf` writes) plus extra files,
    written under a temporary name and renamed into place when complete."""
    final = Path(path)
    if final.exists() and any(final.iterdir()):
        raise UserError(f"output {final} exists and is not empty")
    partial = final.with_name(f".{final.name}.partial")
    shutil.rmtree(partial, ignore_errors=True)
    need = sum(t.numel() * t.element_size() for t in state.values())
    problem = _no_room(final, need)
    if problem:  # said before writing: DCP's writer says a full disk as a zip error, not as an OSError
        raise UserError(problem)
    try:
        with single_process_ok():
            state_dict_saver.save({"model": state}, checkpoint_id=partial, no_dist=True)
        for name, data in files.items():
            (partial / name).parent.mkdir(parents=True, exist_ok=True)  # e.g. 1_Pooling/config.json
            (partial / name).write_bytes(data)
        publish_folder(partial, final)
    except BaseException as e:  # a full disk, Ctrl-C: no partial folder left behind
        shutil.rmtree(partial, ignore_errors=True)
        # DCP wraps a writer's OSError in its own exception; the CLI's one line names the folder asked for
        cause = (
            e
            if isinstance(e, OSError)
            else next((f[0] for f in getattr(e, "failures", {}).values() if isinstance(f[0], OSError)), None)
        )
        if cause is not None and cause.errno is not None:
            raise OSError(cause.errno, cause.strerror, str(final)) from None
        problem = _no_room(final, need) if isinstance(e, Exception) else None
        if problem:  # the disk filled while writing (something else wrote there too)
            raise UserError(problem) from None
        raise
    return final


def _no_room(final: Path, need: int) -> str | None:
    """What to say when the weights (`need` bytes) do not fit where `final` goes; else None."""
    folder = next(p for p in (final, *final.absolute().parents) if p.is_dir())
    free = shutil.disk_usage(folder).free
    if free >= need * 1.05:  # DCP's metadata and file-system slack
        return None
    return (
        f"cannot write {final}: {free / 2**20:,.1f} MiB free on the device holding {folder}, the weights "
        f"need ~{need / 2**20:,.1f} MiB"
    )


def recipe_beside(source: WeightsSource) -> Recipe:
    """The recipe.toml beside a checkpoint: in the folder itself (imported) or in the run
    directory two levels up (runs/<name>/checkpoints/step_N)."""
    found = file_beside(source, "recipe.toml")
    if found is None:
        raise UserError(f"{source.path}: no recipe.toml beside the checkpoint to describe the model")
    return Recipe.model_validate(tomllib.loads(found.read_text()))


def file_beside(source: WeightsSource, name: str) -> Path | None:
    """A file that describes the weights (recipe.toml, sentence-transformers'
    sentence_bert_config.json): in the source's folder, or, for a run's checkpoint, in its
    run directory."""
    folders = (source.path,) if source.kind == "hf" else (source.path, source.path.parent.parent)
    return next((f / name for f in folders if (f / name).is_file()), None)


# What a run started from an embedding model keeps of its sentence-transformers files: the
# length texts are cut to (`embed` and `export hf` of the run read it from the run directory).
CARRIED = ("sentence_bert_config.json",)


def carry_description(source: WeightsSource, run_dir: Path) -> None:
    """Copy CARRIED from beside `source` into a new run's directory."""
    for name in CARRIED:
        found = file_beside(source, name)
        if found is not None:
            shutil.copyfile(found, run_dir / name)


def stored_dtype(source: WeightsSource) -> torch.dtype | None:
    """The dtype the source's weights were saved in (None for Hugging Face folders)."""
    if source.kind != "dcp":
        return None
    for key, meta in _metadata(source.path).items():
        if key.startswith("model.") and isinstance(meta, TensorStorageMetadata):
            return meta.properties.dtype
    return None
