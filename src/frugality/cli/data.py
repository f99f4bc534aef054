"""`frugality data ...`: turn text into Megatron indexed datasets and look inside them."""

from __future__ import annotations

import os

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
@click.option("--overwrite", is_flag=True, help="Replace an existing PREFIX.bin/.idx (and another run's parts).")
@click.option(
    "--workers",
    type=click.IntRange(min=1),
    help="Processes tokenizing pieces of the input apart [default: the machine's cores].",
)
@click.option(
    "--piece-mb",
    type=click.FloatRange(min=0, min_open=True),
    default=64.0,
    show_default=True,
    help="A plain .jsonl is cut into pieces of about this many MiB, each a worker's.",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="local: this machine's processes; ray: Ray tasks on a cluster (shared storage for inputs and --out).",
)
@click.option(
    "--address",
    help="--engine ray: the cluster to join (ray://..., HOST:PORT, auto) [default: $RAY_ADDRESS, else a local one].",
)
@click.option(
    "--dedup",
    type=click.Choice(["exact"]),
    help="exact: drop a document whose text (spacing, case and Unicode form aside) came earlier.",
)
def prepare(inputs, tokenizer_name, out_prefix, field, overwrite, workers, piece_mb, engine, address, dedup) -> None:
    """Tokenize INPUTS (.txt: a document per file; .jsonl: a document per line; either
    may be .gz or .zst; .parquet: a document per row; paths, quoted globs or fsspec URLs
    such as s3://bucket/*.jsonl.zst) into a Megatron indexed dataset, one end-of-document
    token after each.
    The same bytes whatever --workers; a run killed mid-way, rerun as it was, redoes only
    the pieces it had not finished (PREFIX.parts/)."""
    from frugality.data.prepare import prepare as run_prepare
    from frugality.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_name)
    workers = workers or len(os.sched_getaffinity(0))
    if address is not None and engine != "ray":
        raise click.UsageError("--address goes with --engine ray")
    stats = run_prepare(
        inputs,
        tokenizer,
        out_prefix,
        field=field,
        overwrite=overwrite,
        workers=workers,
        piece_bytes=int(piece_mb * 2**20),
        engine=engine,
        address=address,
        dedup=dedup,
    )
    dropped = f" ({stats.duplicates:,} duplicates dropped)" if dedup else ""
    reused = f"; {stats.reused_parts} parts from the interrupted run" if stats.reused_parts else ""
    work = f"{stats.rates()}{reused}"
    if stats.reused_parts and not stats.run_documents:  # (no rate: nothing was tokenized now)
        work = f"every part from the interrupted run ({stats.reused_parts}), nothing tokenized again"
    click.echo(
        f"wrote {stats.bin_path} and {stats.idx_path}: {stats.documents:,} documents{dropped}, {stats.tokens:,} tokens "
        f"({'Ray tasks' if engine == 'ray' else f'{stats.workers} worker' + 's' * (stats.workers > 1)}: {work})"
    )


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
