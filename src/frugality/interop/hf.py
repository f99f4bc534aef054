"""Hugging Face checkpoint folders in and out: `config.json` + safetensors (sharded or
not) or a legacy `pytorch_model.bin`.

Mapped: GPT-NeoX/Pythia (`gpt_neox`) and Llama (`llama`); other `model_type`s are refused
with one line.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping, Set
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from frugality.errors import UserError
from frugality.interop import hf_bert, hf_gpt_neox, hf_llama
from frugality.interop.sentence_transformers import read_modules
from frugality.models.families import family
from frugality.paths import publish_folder

# sentence-transformers' files that say how an encoder pools; carried along by import.
SENTENCE_TRANSFORMERS_FILES = ("modules.json", "sentence_bert_config.json", "1_Pooling/config.json")

# One adapter module per model family, each with the same five names: FAMILY, MODEL_TYPE,
# config_from_hf(hf config, checkpoint tensor names), config_to_hf(config),
# from_hf(state, config) and to_hf(state, config).
ADAPTERS = {adapter.MODEL_TYPE: adapter for adapter in (hf_gpt_neox, hf_llama, hf_bert)}
BY_FAMILY = {adapter.FAMILY: adapter for adapter in ADAPTERS.values()}


def config_from_hf(config: dict[str, Any], where: Path, state_keys: Set[str] = frozenset()):
    """frugality's model config from a transformers `config.json` (4.x or 5.x keys); for
    BERT, which heads exist is read from the checkpoint's tensor names."""
    adapter = ADAPTERS.get(config.get("model_type"))
    if adapter is None:
        raise UserError(
            f"{where}: model_type {config.get('model_type')!r} is not supported yet (supported: {', '.join(ADAPTERS)})"
        )
    try:
        return adapter.config_from_hf(config, state_keys)
    except KeyError as e:
        raise UserError(f"{where}: config.json lacks {e.args[0]!r}") from None
    except ValueError as e:
        raise UserError(f"{where}: config.json describes a model frugality cannot build: {e}") from None


def read_hf_weights(folder: Path) -> dict[str, torch.Tensor]:
    """All tensors of a checkpoint folder, in their stored dtype, on the CPU."""
    from safetensors.torch import load_file

    if (folder / "model.safetensors").is_file():
        return _readable(load_file, folder / "model.safetensors")
    for index_name, loader in (
        ("model.safetensors.index.json", load_file),
        ("pytorch_model.bin.index.json", _load_bin),
    ):
        index = folder / index_name
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            state: dict[str, torch.Tensor] = {}
            for shard in shards:
                state.update(_readable(loader, folder / shard))
            return state
    if (folder / "pytorch_model.bin").is_file():
        return _readable(_load_bin, folder / "pytorch_model.bin")
    raise UserError(f"{folder}: no model.safetensors, sharded index or pytorch_model.bin")


def _readable(loader, path: Path) -> dict[str, torch.Tensor]:
    """The file's tensors, or one line naming a file that is missing, cut short or not a
    checkpoint at all."""
    try:
        return loader(path)
    except Exception as e:  # noqa: BLE001 - safetensors' and torch.load's errors have no common type
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise UserError(f"{path}: not a readable checkpoint file ({type(e).__name__}: {reason[:200]})") from None


def _load_bin(path: Path) -> dict[str, torch.Tensor]:
    # weights_only: a checkpoint from the internet must not run code when loaded.
    return torch.load(path, map_location="cpu", weights_only=True)


def _to_hf(config, state):
    adapter = BY_FAMILY[config.family]
    return adapter.to_hf(state, config), adapter.config_to_hf(config)


def _from_hf(config, state):
    return BY_FAMILY[config.family].from_hf(state, config)


def import_hf(folder: str | Path):
    """(model config, frugality state dict) from a Hugging Face checkpoint folder."""
    folder = Path(folder)
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise UserError(f"{folder}: no config.json (expected a Hugging Face checkpoint folder)")
    try:
        hf = json.loads(config_path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{config_path}: not valid JSON ({e.msg})") from None
    adapter = ADAPTERS.get(hf.get("model_type"))
    # an encoder's config is read with its tensors' names (which heads the folder holds)
    weights = read_hf_weights(folder) if adapter is not None and not family(adapter.FAMILY).decoder else None
    config = config_from_hf(hf, config_path, set(weights or ()))
    try:
        state = _from_hf(config, weights if weights is not None else read_hf_weights(folder))
    except KeyError as e:
        raise UserError(f"{folder}: {e.args[0]}") from None
    if not family(config).decoder:  # a sentence-transformers folder: its pooling, Dense head, Normalize
        fields, head = read_modules(folder)
        config = config.model_copy(update=fields)
        state.update(head)
    _check_against_config(state, config, config_path)
    return config, state


def _check_against_config(state: dict[str, torch.Tensor], config, config_path: Path) -> None:
    """Every tensor the model that config.json describes needs, at its shape: a config that
    disagrees with its weights is refused here, not at export or training."""
    from frugality.models import build_model

    with torch.device("meta"):
        expected = {k: v.shape for k, v in build_model(config).state_dict().items()}
    for name, shape in expected.items():
        if name not in state:
            raise UserError(f"{config_path}: the weights lack {name!r}, which this config needs")
        if state[name].shape != shape:
            raise UserError(
                f"{config_path} and the weights disagree: {name!r} is {list(state[name].shape)} in "
                f"the weights, {list(shape)} by the config"
            )
    extra = sorted(set(state) - set(expected))
    if extra:
        raise UserError(f"{config_path}: the weights hold {extra[0]!r}, which this config has no place for")


def export_hf(
    config, state: dict[str, torch.Tensor], out: str | Path, files: Mapping[str, bytes] = MappingProxyType({})
) -> Path:
    """Write `config.json` + `model.safetensors` (+ tokenizer files) that
    `transformers.AutoModelForCausalLM.from_pretrained(out)` loads; dtype preserved."""
    out = Path(out)
    if out.exists() and any(out.iterdir()):
        raise UserError(f"output folder {out} exists and is not empty")
    mapped, hf = _to_hf(config, state)
    tensors = {k: v.detach().to("cpu").contiguous() for k, v in mapped.items()}
    dtypes = {t.dtype for t in tensors.values()}
    hf["torch_dtype"] = str(next(iter(dtypes))).removeprefix("torch.") if len(dtypes) == 1 else "float32"
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        _save_safetensors(tensors, staging / "model.safetensors")
        (staging / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
        for name, data in files.items():  # e.g. tokenizer.json, 1_Pooling/config.json
            (staging / name).parent.mkdir(parents=True, exist_ok=True)
            (staging / name).write_bytes(data)
        _same_mode(staging)
        publish_folder(staging, out)
    except BaseException as e:  # a full disk, Ctrl-C: no OUT.partial left behind
        shutil.rmtree(staging, ignore_errors=True)
        if isinstance(e, OSError) and e.errno is not None:  # named by the path asked for (a write's error has none)
            raise OSError(e.errno, e.strerror, str(e.filename or staging).replace(str(staging), str(out), 1)) from None
        raise
    return out


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """safetensors' save_file, whose I/O errors (a full disk) come as its own error type: an
    OSError here, as from any other write, for the CLI's one line."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    try:
        save_file(tensors, path, metadata={"format": "pt"})
    except SafetensorError as e:
        code = re.search(r"\(os error (\d+)\)", str(e))
        if code is None:
            raise
        raise OSError(int(code[1]), os.strerror(int(code[1])), str(path)) from None


def _same_mode(folder: Path) -> None:
    """Every file as a plain write leaves it (0644 under the usual umask): safetensors writes
    its file through a private temporary file, mode 0600."""
    umask = os.umask(0)
    os.umask(umask)
    for f in folder.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~umask)
