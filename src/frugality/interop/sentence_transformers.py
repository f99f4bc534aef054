"""sentence-transformers' module files, in and out, for BERT-family embedding models.

A sentence-transformers folder is a transformers folder plus `modules.json`, which lists
the modules an embedding goes through: the Transformer (the folder itself), Pooling
(`1_Pooling/config.json`: mean or CLS), any number of Dense layers (`N_Dense/config.json`
and weights `linear.weight`, `linear.bias`) and Normalize. frugality's `BertConfig` holds
the same: `pooling`, `head` (+ `head_activation`), `normalize`.

Module types are written under the names sentence-transformers has always read
(`sentence_transformers.models.*`), so that releases from 2.x to today load the folder.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import torch

from frugality.errors import UserError
from frugality.models.bert import BertConfig

# Activations by their sentence-transformers (torch class) names.
ACTIVATION_CLASSES = {
    "tanh": "torch.nn.modules.activation.Tanh",
    "relu": "torch.nn.modules.activation.ReLU",
    "gelu": "torch.nn.modules.activation.GELU",
}
IDENTITY = "torch.nn.modules.linear.Identity"
_BY_CLASS = {cls.rsplit(".", 1)[-1]: name for name, cls in ACTIVATION_CLASSES.items()}


def read_json(path: Path):
    """A module file's JSON; None where the file is absent; one error line where it is not JSON."""
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise UserError(f"{path}: not valid JSON ({e.msg})") from None


def read_modules(folder: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(BertConfig fields, head tensors) from a sentence-transformers folder's modules;
    ({}, {}) for a plain transformers folder. A module frugality cannot run is refused in
    one line rather than silently skipped (its embeddings would differ)."""
    modules = read_json(folder / "modules.json")
    if not isinstance(modules, list):
        return {}, {}
    fields: dict = {"normalize": False}
    widths, activations, state = [], [], {}
    for module in modules:
        kind = str(module.get("type", "")).rsplit(".", 1)[-1]
        path = folder / str(module.get("path", ""))
        if kind == "Transformer":
            continue
        if kind == "Pooling":
            fields["pooling"] = pooling_mode(path / "config.json")
        elif kind == "Dense":
            config = read_json(path / "config.json") or {}
            index = len(widths)
            weight, bias = _dense_weights(path)
            widths.append(int(config["out_features"]))
            activations.append(str(config.get("activation_function", ACTIVATION_CLASSES["tanh"])).rsplit(".", 1)[-1])
            state[f"head.{index}.weight"] = weight
            if bias is not None:
                state[f"head.{index}.bias"] = bias
            elif config.get("bias", True) is False:
                raise UserError(f"{path}: a Dense layer without bias is not supported")
        elif kind == "Normalize":
            fields["normalize"] = True
        else:
            raise UserError(
                f"{folder / 'modules.json'}: module {module.get('type')!r} is not supported "
                "(Transformer, Pooling, Dense, Normalize are)"
            )
    if widths:
        inner = set(activations[:-1])
        if activations[-1] != "Identity" or len(inner) > 1 or not inner <= set(_BY_CLASS):
            raise UserError(
                f"{folder / 'modules.json'}: Dense layers with activations {activations}: frugality's "
                "head takes one of Tanh, ReLU, GELU between layers and none after the last"
            )
        fields["head"] = tuple(widths)
        if inner:
            fields["head_activation"] = _BY_CLASS[inner.pop()]
    return fields, state


def pooling_mode(path: Path) -> str:
    """ "mean" or "cls" from a Pooling module's config.json (either generation of keys;
    mean without one). Any other pooling, or several at once (sentence-transformers then
    concatenates them), is refused: frugality would compute something else."""
    config = read_json(path) or {}
    if "pooling_mode" in config:
        modes = {str(config["pooling_mode"])}
    else:
        modes = {
            key.removeprefix("pooling_mode_")
            for key, on in config.items()
            if key.startswith("pooling_mode_") and on is True
        }
    modes = {"mean" if m in ("mean_tokens", "mean") else "cls" if m in ("cls_token", "cls") else m for m in modes}
    if not modes:
        return "mean"
    if len(modes) > 1 or modes - {"mean", "cls"}:
        raise UserError(f"{path}: pooling {sorted(modes)}: frugality pools by the mean or the CLS token, one of them")
    return modes.pop()


def _dense_weights(path: Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    if (path / "model.safetensors").is_file():
        from safetensors.torch import load_file

        tensors = load_file(path / "model.safetensors")
    elif (path / "pytorch_model.bin").is_file():  # older sentence-transformers releases
        tensors = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise UserError(f"{path}: a Dense module without model.safetensors or pytorch_model.bin")
    if "linear.weight" not in tensors:
        raise UserError(f"{path}: no linear.weight in the Dense module's weights")
    return tensors["linear.weight"], tensors.get("linear.bias")


def module_files(config: BertConfig, state: dict[str, torch.Tensor], max_length: int) -> dict[str, bytes]:
    """The files that make a transformers folder of `config` a sentence-transformers model
    computing what frugality's `Bert.embed` computes."""
    from safetensors.torch import save

    modules = [("", "Transformer"), ("1_Pooling", "Pooling")]
    files = {
        "sentence_bert_config.json": _dump({"max_seq_length": max_length, "do_lower_case": False}),
        "1_Pooling/config.json": _dump(
            {
                "word_embedding_dimension": config.hidden_size,
                "pooling_mode_cls_token": config.pooling == "cls",
                "pooling_mode_mean_tokens": config.pooling == "mean",
                "pooling_mode_max_tokens": False,
                "pooling_mode_mean_sqrt_len_tokens": False,
            }
        ),
    }
    widths = [config.hidden_size, *config.head]
    for i, (a, b) in enumerate(zip(widths, widths[1:], strict=False)):
        folder = f"{len(modules)}_Dense"
        last = i == len(config.head) - 1
        files[f"{folder}/config.json"] = _dump(
            {
                "in_features": a,
                "out_features": b,
                "bias": True,
                "activation_function": IDENTITY if last else ACTIVATION_CLASSES[config.head_activation],
            }
        )
        tensors = {"linear.weight": state[f"head.{i}.weight"], "linear.bias": state[f"head.{i}.bias"]}
        files[f"{folder}/model.safetensors"] = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
        modules.append((folder, "Dense"))
    if config.normalize:
        modules.append((f"{len(modules)}_Normalize", "Normalize"))
    files["modules.json"] = _dump(
        [
            {"idx": i, "name": str(i), "path": path, "type": f"sentence_transformers.models.{kind}"}
            for i, (path, kind) in enumerate(modules)
        ]
    )
    return files


def _dump(value) -> bytes:
    out = io.StringIO()
    json.dump(value, out, indent=2)
    return (out.getvalue() + "\n").encode()
