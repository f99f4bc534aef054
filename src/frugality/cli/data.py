"""`frugality data ...`: turn text into Megatron indexed datasets and look inside them."""

from __future__ import annotations

import click


@click.group()
def data() -> None:
    """Prepare and inspect tokenized datasets (Megatron .bin/.idx)."""


@data.command()
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--tokenizer",
    "tokenizer_name",
    default="pythia",
    show_default=True,
    help="'pythia', 'gpt2', or a tokenizer.json / tokenizer folder.",
)
@click.option(
    "--out", "out_prefix", required=True, type=click.Path(), help="Output prefix: writes PREFIX.bin and PREFIX.idx."
)
@click.option("--field", default="text", show_default=True, help="JSON field holding the text (.jsonl).")
@click.option("--overwrite", is_flag=True, help="Replace an existing PREFIX.bin/.idx.")
def prepare(inputs, tokenizer_name, out_prefix, field, overwrite) -> None:
    """Tokenize INPUTS (.txt: a document per file; .jsonl: a document per line; either
    may be .gz) into a Megatron indexed dataset, one end-of-document token after each."""
    from frugality.data.prepare import prepare as run_prepare
    from frugality.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name)
    stats = run_prepare(inputs, tokenizer, out_prefix, field=field, overwrite=overwrite)
    click.echo(f"wrote {stats.bin_path} and {stats.idx_path}: {stats.documents:,} documents, {stats.tokens:,} tokens")


@data.command()
@click.argument("prefix", type=click.Path())
@click.option("--tokenizer", "tokenizer_name", help="Decode the start of the first document with this tokenizer.")
def inspect(prefix, tokenizer_name) -> None:
    """Show what a dataset PREFIX (.bin + .idx; either file's name does too) holds."""
    from frugality.data.indexed import IndexedDataset

    prefix = prefix.removesuffix(".bin") if prefix.endswith(".bin") else prefix.removesuffix(".idx")
    ds = IndexedDataset(prefix)
    click.echo(
        f"{prefix}: {ds.num_documents:,} documents, {ds.num_sequences:,} sequences, "
        f"{ds.num_tokens:,} tokens of {ds.dtype}"
    )
    if tokenizer_name and ds.num_sequences:
        from frugality.data.tokenizer import load_tokenizer

        text = load_tokenizer(tokenizer_name).decode(ds[0][:64].tolist())
        click.echo(f"first document begins: {text!r}")
