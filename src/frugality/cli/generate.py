"""`frugality generate`."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import click

from frugality.cli.options import inference_precision


@click.command()
@click.argument("model", type=click.Path())
@click.option("--prompt", help="One prompt: its completion streams to the terminal.")
@click.option(
    "--input",
    "input_path",
    type=click.Path(),
    help="Prompts (.jsonl, .txt, .parquet), completed in batches; one JSON line per prompt to --out (or stdout).",
)
@click.option("--text-field", default="prompt", show_default=True, help="The prompt's field in .jsonl/.parquet.")
@click.option("--id-field", help="The id's field in .jsonl/.parquet [default: FILE:LINE].")
@click.option(
    "--out",
    type=click.Path(),
    help="JSONL file for --input's completions (id, prompt, completion, prompt_tokens, completion_tokens, finish).",
)
@click.option("--overwrite", is_flag=True, help="Replace an existing --out file.")
@click.option("--max-new-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--temperature", type=click.FloatRange(min=0.0), default=0.0, show_default=True, help="0: greedy.")
@click.option("--top-k", type=click.IntRange(min=0), default=0, show_default=True, help="0: off.")
@click.option(
    "--top-p", type=click.FloatRange(min=0.0, max=1.0, min_open=True), default=1.0, show_default=True, help="1: off."
)
@click.option("--seed", type=int, default=0, show_default=True, help="Seeds the sampling.")
@click.option(
    "--stop-token",
    "stop_tokens",
    multiple=True,
    metavar="TOKEN",
    help="End a completion at this token (its text or id; repeatable; `none` for no stop token) "
    "[default: the model's end-of-text tokens].",
)
@click.option(
    "--stop",
    "stop_strings",
    multiple=True,
    metavar="TEXT",
    help="End a completion where its text holds TEXT (cut before it; repeatable).",
)
@click.option("--batch", type=click.IntRange(min=1), default=8, show_default=True, help="Prompts per batch.")
@inference_precision
@click.option("--device", default="auto", show_default=True, help="auto, cpu, cuda, cuda:1, xla (.venv-xla), ...")
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="torch.compile the prefill (once per prompt-length bucket) and the decoding step (once).",
)
def generate(
    model,
    prompt,
    input_path,
    text_field,
    id_field,
    out,
    overwrite,
    max_new_tokens,
    temperature,
    top_k,
    top_p,
    seed,
    stop_tokens,
    stop_strings,
    batch,
    precision,
    device,
    compile_,
) -> None:
    """Complete a --prompt, or every prompt of an --input file, with MODEL: a decoder
    (GPT-NeoX, Llama) as a Hugging Face folder, a folder from `frugality import hf`, or a
    run (its latest checkpoint). Greedy unless --temperature is above 0."""
    from frugality.errors import UserError
    from frugality.inference.generate import Sampling, generate_all, load_decoder
    from frugality.inference.inputs import open_inputs
    from frugality.runtime.device import resolve_device

    if (prompt is None) == (input_path is None):
        raise UserError("give either --prompt or --input (a file of prompts)")
    if prompt == "":
        raise UserError("--prompt is empty: give the text to complete")
    if out and prompt is not None:
        raise UserError("--out goes with --input; a --prompt's completion streams to the terminal")
    if out and input_path and Path(out).exists() and Path(input_path).exists() and os.path.samefile(out, input_path):
        # however spelt (./X, a symlink, a hard link): --overwrite would replace the prompts with their completions
        raise UserError(f"--out {out}: is the --input file {input_path}; write the completions to another file")
    if out:
        from frugality.paths import check_output_file

        check_output_file(out, "--out")  # before any prompt is generated
    if out and Path(out).exists() and not overwrite:
        raise UserError(f"--out {out}: already exists (--overwrite replaces it)")
    inputs = None if input_path is None else open_inputs([input_path], text_field, id_field)
    settings: dict[str, Any] = dict(
        max_new_tokens=max_new_tokens,
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        stop_strings=tuple(stop_strings),
    )
    Sampling(**settings)  # bad values are refused before the model loads
    decoder, why = load_decoder(
        model,
        resolve_device(device, key="--device", what="frugality generate", xla_ok=True),
        precision,
        pack=not compile_,  # (Inductor compiles plain layers)
    )
    sampling = Sampling(**settings, stop_ids=_stop_ids(decoder, stop_tokens))
    compile_backend = "inductor" if compile_ else None
    if prompt is not None:

        def stream(row: int, piece: str) -> None:
            click.echo(piece, nl=False)
            sys.stdout.flush()

        result = generate_all(decoder, [("prompt", prompt)], sampling, 1, compile_backend, on_text=stream)
        click.echo()
    else:
        assert inputs is not None  # --input, as checked above
        items = list(inputs)
        if not items:
            raise UserError(f"input {input_path}: no prompts")
        result = _to_jsonl(decoder, items, sampling, batch, compile_backend, out)
    timing = result["timing"]
    cut = f"; {result['cut']} prompts cut from the left to fit" if result["cut"] else ""
    click.echo(
        f"{result['prompts']} prompt{'s' if result['prompts'] > 1 else ''}, {timing.prompt_tokens:,} tokens in "
        f"(prefill {_rate(timing.prompt_tokens, timing.prefill_s)}), new tokens decoded at "
        f"{_rate(timing.new_tokens, timing.decode_s)} (batch {result['batch']}){cut}; {why}",
        err=True,
    )


def _to_jsonl(decoder, items, sampling, batch, compile_backend, out) -> dict:
    """Completions as JSON lines: to stdout, or to `out` through a temporary file renamed
    into place at the end (an interrupted job leaves no half file under that name)."""
    from frugality.inference.generate import generate_all
    from frugality.paths import NamedFile, naming

    if not out:
        return generate_all(
            decoder,
            items,
            sampling,
            batch,
            compile_backend,
            on_row=lambda row: click.echo(json.dumps(row, ensure_ascii=False)),
        )
    final = Path(out)
    partial = final.with_name(f".{final.name}.partial")
    try:
        with NamedFile(open(partial, "w", encoding="utf-8"), final) as f:
            result = generate_all(
                decoder,
                items,
                sampling,
                batch,
                compile_backend,
                on_row=lambda row: f.write(json.dumps(row, ensure_ascii=False) + "\n"),
            )
            f.flush()
            with naming(final):
                os.fsync(f.fileno())
        partial.replace(final)
    finally:
        partial.unlink(missing_ok=True)
    return result


def _stop_ids(decoder, tokens: tuple[str, ...]) -> tuple[int, ...]:
    """--stop-token values as ids: the model's end tokens when none is given."""
    from frugality.errors import UserError

    if not tokens:
        return decoder.eos_ids
    if tokens == ("none",):
        return ()
    ids = []
    vocab = decoder.model.config.vocab_size
    for token in tokens:
        tid = int(token) if token.isdigit() else decoder.tokenizer.token_to_id(token)
        if tid is None or not 0 <= tid < vocab:
            raise UserError(
                f"--stop-token {token!r}: not a token of this model's tokenizer (its text or an id below {vocab})"
            )
        ids.append(tid)
    return tuple(ids)


def _rate(tokens: int, seconds: float) -> str:
    return f"{tokens / seconds:,.0f} tokens/s" if seconds > 0 else "—"
