"""`frugality import hf` and `frugality export hf`: Hugging Face checkpoints in and out."""

from __future__ import annotations

from pathlib import Path

import click


@click.group("import")
def import_() -> None:
    """Bring a model in from another framework."""


@import_.command("hf")
@click.argument("source", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Folder to write (must not exist).")
def import_hf_command(source, out) -> None:
    """Import a Hugging Face checkpoint folder (config.json + safetensors or
    pytorch_model.bin) as a frugality checkpoint folder with its recipe.toml, ready for
    `frugality train RECIPE --init-from OUT` or `frugality export hf OUT`."""
    from frugality.config.recipe import Recipe
    from frugality.interop.hf import SENTENCE_TRANSFORMERS_FILES, import_hf
    from frugality.interop.weights import save_weights
    from frugality.paths import check_output_folder

    check_output_folder(out, "--out")
    config, state = import_hf(source)
    out = Path(out)
    files = {}
    tokenizer = Path(source) / "tokenizer.json"
    data: dict[str, object] = {"seq_len": min(2048, config.max_seq_len)}
    if tokenizer.is_file():
        files["tokenizer.json"] = tokenizer.read_bytes()
        data["tokenizer"] = str((out / "tokenizer.json").resolve())
    for name in SENTENCE_TRANSFORMERS_FILES:  # how an embedding model pools, for `frugality embed`
        if (Path(source) / name).is_file():
            files[name] = (Path(source) / name).read_bytes()
    recipe = Recipe.model_validate(
        {
            "name": _recipe_name(out),
            "description": f"imported from {source}",
            "model": config.model_dump(),
            "data": data,
        }
    )
    files["recipe.toml"] = recipe.to_toml().encode()
    save_weights(out, state, files)
    n = sum(t.numel() for t in state.values())
    click.echo(f"imported {source} -> {out}: {config.family}, {n:,} parameters")


def _recipe_name(out: Path) -> str:
    """The recipe's name from the folder's (a recipe name is letters, digits, '.', '_' and
    '-'): accents dropped, any other run of characters a '-' ("my model" -> "my-model")."""
    import re
    import unicodedata

    plain = "".join(c for c in unicodedata.normalize("NFKD", out.resolve().name) if not unicodedata.combining(c))
    return re.sub(r"[^A-Za-z0-9._-]+", "-", plain).strip("-") or "imported"


@click.group("export")
def export() -> None:
    """Take a model out to another framework."""


@export.command("hf")
@click.argument("checkpoint", type=click.Path())
@click.option("--out", required=True, type=click.Path(), help="Folder to write (must not exist).")
def export_hf_command(checkpoint, out) -> None:
    """Export CHECKPOINT (a run directory, one of its checkpoints, or an imported folder)
    as config.json + model.safetensors (+ tokenizer.json) for transformers."""
    from frugality.interop.export import export_checkpoint
    from frugality.paths import check_output_folder

    check_output_folder(out, "--out")
    path = export_checkpoint(checkpoint, out)
    click.echo(f"exported {checkpoint} -> {path}")
