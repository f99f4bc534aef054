"""`frugality embed`."""

from __future__ import annotations

import signal
import sys

import click

from frugality.cli.options import inference_precision


@click.command()
@click.argument("model", type=click.Path())
@click.argument("inputs", nargs=-1, required=True, type=click.Path())
@click.option(
    "--out",
    required=True,
    type=click.Path(),
    help="Folder for the shards and manifest.json; rerunning with the same --out resumes.",
)
@click.option("--text-field", default="text", show_default=True, help="The text's field in .jsonl/.parquet.")
@click.option("--id-field", help="The id's field in .jsonl/.parquet [default: FILE:LINE].")
@inference_precision
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, xla (.venv-xla), ...")
@click.option(
    "--nproc",
    default="auto",
    show_default=True,
    help="Processes sharing the work, each with its share of the CPU threads or its own GPU; auto: one "
    "per CPU (up to 8, one per 20,000 texts), or one per GPU.",
)
@click.option(
    "--batch-tokens",
    type=click.IntRange(min=8),
    help="Padded tokens per batch: many short texts or a few long ones [default: 2048 on a CPU, up to 8x "
    "that for models narrower than 384; 65536 on a GPU]; the texts a batch stay the model's default.",
)
@click.option(
    "--shard-size",
    type=click.IntRange(min=1),
    default=50_000,
    show_default=True,
    help="Texts per output shard (the unit a rerun redoes).",
)
@click.option(
    "--normalize/--no-normalize",
    default=None,
    help="L2-normalise the embeddings [default: as the model's sentence-transformers config says].",
)
@click.option("--max-length", type=click.IntRange(min=2), help="Cut texts to this many tokens [default: the model's].")
@click.option(
    "--format",
    "fmt",
    type=click.Choice(["npy", "parquet"]),
    default="npy",
    show_default=True,
    help="npy: shard-N.npy + shard-N.ids.json; parquet: shard-N.parquet (id, embedding).",
)
@click.option(
    "--engine",
    type=click.Choice(["local", "ray"]),
    default="local",
    show_default=True,
    help="local: this machine's processes; ray: actors on a Ray cluster (the model and --out on shared storage).",
)
@click.option("--address", help="--engine ray: the cluster to join (HOST:PORT, auto, ray://...) [default: local].")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def embed(
    model,
    inputs,
    out,
    text_field,
    id_field,
    precision,
    device,
    nproc,
    batch_tokens,
    shard_size,
    normalize,
    max_length,
    fmt,
    engine,
    address,
    no_progress,
) -> None:
    """Embed every text of INPUTS (.txt, .jsonl, .parquet) with MODEL (a Hugging Face or
    sentence-transformers folder, a folder from `frugality import hf`, or a run) into
    shards under --out. Ctrl-C or a crash loses only the shard in progress: the same
    command again finishes the job."""
    from pathlib import Path

    from frugality.errors import UserError
    from frugality.inference.inputs import open_inputs
    from frugality.paths import check_output_folder

    # what a user gets wrong most is said before torch and the model load (seconds)
    check_output_folder(out, "--out")
    if nproc != "auto" and not (nproc.isdigit() and int(nproc) >= 1):
        raise UserError(f"--nproc {nproc!r}: a number of processes (1 or more) or auto")
    if address is not None and engine != "ray":
        raise click.UsageError("--address goes with --engine ray")
    if not Path(model).exists():
        raise UserError(f"model {model}: no such folder")
    texts = open_inputs(list(inputs), text_field, id_field)
    texts.check_not_empty()
    from frugality.inference.embed import EmbedSettings, JobIncomplete, run_job

    if fmt == "parquet":
        _need_pyarrow()
    settings = EmbedSettings(
        model=model,
        out=out,
        shard_size=shard_size,
        batch_tokens=batch_tokens,
        precision=precision,
        device=device,
        normalize=normalize,
        max_length=max_length,
        format=fmt,
    )
    previous = signal.signal(signal.SIGTERM, _interrupt)  # a scheduler's stop ends the job as Ctrl-C does
    try:
        result = run_job(settings, texts, nproc, not no_progress, engine, address)
    except KeyboardInterrupt as stop:
        how = "stopped by SIGTERM" if stop.args == ("SIGTERM",) else "stopped"
        click.echo(f"{how}; the shards written stay in {out}: rerun the same command to finish", err=True)
        sys.exit(130)
    except JobIncomplete as e:
        click.echo(f"error: {e}", err=True)
        sys.exit(1)
    finally:
        signal.signal(signal.SIGTERM, previous)
    resumed = f" (resumed: {result['resumed_from']:,} were done)" if result["resumed_from"] else ""
    speed = f", {result['texts_per_s']:,.0f} texts/s" if result["texts_per_s"] else ""
    many = result["processes"] > 1
    workers = ("Ray actors" if many else "Ray actor") if engine == "ray" else ("processes" if many else "process")
    cut = result["truncated"]
    cut = f" ({cut:,} cut to {result['max_length']} tokens, the model's length or --max-length)" if cut else ""
    click.echo(
        f"{out}: {result['count']:,} texts{cut} in {result['shards']} shards{resumed}; embedded "
        f"{result['embedded']:,} in {result['seconds']:.1f} s{speed} ({result['processes']} {workers}); "
        f"{result['precision']}"
    )


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def _need_pyarrow() -> None:
    from frugality.errors import UserError

    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise UserError("--format parquet needs pyarrow (pip install 'frugality[parquet]')") from None
