"""`data prepare` throughput: text MB/s and tokens/s of `frugality data prepare` at 1, 2, ...
workers on the bundled corpus (six books, 2.6 MB of text in .txt.gz), against the
tokenizer's own limit: Hugging Face tokenizers' `encode_batch` over the same texts, already
in memory, with the library's threads (as many as the cores) and with one thread. Written
to benchmarks/results/prepare_throughput-gutenberg-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/prepare_throughput.py [--workers 1,2] [--rounds 3] [--copies 4]

`--copies N` prepares N copies of the corpus (each book N times, as separate files), so
that the workers have more pieces than the six books to share out. Each figure is the best
of `--rounds` (the machine's speed drifts with its neighbours). `prepare` runs as a user
runs it: a subprocess `frugality data prepare ... --workers W`, reading, tokenizing,
writing the parts and merging them.
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frugality.bench.results import machine_line, write_results
from frugality.data.bundled import corpus_files
from frugality.data.tokenizer import load_tokenizer


def _encode_batch_seconds(texts: list[str], threads: int, rounds: int) -> float:
    """Best seconds of `encode_batch` over `texts` in a fresh process with `threads`."""
    script = (
        "import sys, time, json; from frugality.data.tokenizer import load_tokenizer\n"
        "texts = json.load(open(sys.argv[1])); tok = load_tokenizer('pythia').tokenizer\n"
        "best = float('inf')\n"
        f"for _ in range({rounds}):\n"
        "    t = time.perf_counter(); tok.encode_batch(texts, add_special_tokens=False)\n"
        "    best = min(best, time.perf_counter() - t)\n"
        "print(best)\n"
    )
    with tempfile.NamedTemporaryFile("w", suffix=".json") as f:
        json.dump(texts, f)
        f.flush()
        env = os.environ | {"RAYON_NUM_THREADS": str(threads)}
        if threads == 1:
            env["TOKENIZERS_PARALLELISM"] = "false"
        done = subprocess.run([sys.executable, "-c", script, f.name], capture_output=True, text=True, env=env)
    if done.returncode:
        raise RuntimeError(done.stderr[-2000:])
    return float(done.stdout.strip())


def _prepare_seconds(files: list[Path], workers: int, rounds: int, folder: Path) -> tuple[float, int]:
    best, tokens = float("inf"), 0
    for r in range(rounds):
        out = folder / f"out-{workers}-{r}"
        command = [sys.executable, "-m", "frugality", "data", "prepare", *map(str, files), "--out", str(out)]
        start = time.perf_counter()
        done = subprocess.run([*command, "--workers", str(workers)], capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        best = min(best, seconds)
        tokens = int(done.stdout.split(" documents, ")[1].split(" tokens")[0].replace(",", ""))
        for suffix in (".bin", ".idx"):
            Path(str(out) + suffix).unlink()
    return best, tokens


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copies", type=int, default=4)
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    with tempfile.TemporaryDirectory(prefix="frugality-prepare-") as tmp:
        folder = Path(tmp)
        files = []
        for c in range(args.copies):
            for f in corpus_files():
                files.append(folder / f"{c}-{f.name}")
                shutil.copyfile(f, files[-1])
        texts = [gzip.open(f, "rt", encoding="utf-8").read() for f in files]
        megabytes = sum(len(t.encode()) for t in texts) / 1e6
        tokens = sum(len(ids) for ids in load_tokenizer("pythia").encode_batch(texts))
        rows = []
        for threads in sorted({1, cores}):
            seconds = _encode_batch_seconds(texts, threads, args.rounds)
            rows.append((f"encode_batch, in memory, {threads} thread{'s' * (threads > 1)}", seconds, tokens))
            print(f"{rows[-1][0]}: {megabytes / seconds:.2f} MB/s", file=sys.stderr)
        for workers in (int(w) for w in args.workers.split(",")):
            seconds, written = _prepare_seconds(files, workers, args.rounds, folder)
            what = "library threads" if workers == 1 else "a thread each"
            rows.append((f"frugality data prepare --workers {workers} ({what})", seconds, written))
            print(f"{rows[-1][0]}: {megabytes / seconds:.2f} MB/s", file=sys.stderr)
    limit = megabytes / rows[len({1, cores}) - 1][1]  # encode_batch at all the cores
    lines = [
        "| path | seconds | text MB/s | tokens/s | of encode_batch's MB/s (all cores) |",
        "|---|---|---|---|---|",
    ]
    for name, seconds, count in rows:
        rate = megabytes / seconds
        lines.append(f"| {name} | {seconds:.2f} | {rate:.2f} | {count / seconds:,.0f} | {rate / limit:.2f} |")
    header = (
        f"# data prepare throughput, the bundled corpus x {args.copies} ({megabytes:.1f} MB of text, "
        f"{tokens:,} tokens, {len(files)} files)\n\n{machine_line()}\nBest of {args.rounds} rounds each; "
        "prepare timed as a subprocess (start-up, reading .gz, tokenizing, writing and merging parts).\n\n"
    )
    results = Path(__file__).parent / "results"
    json_rows = json.dumps(
        [{"path": n, "seconds": s, "tokens": c, "mb_per_s": megabytes / s} for n, s, c in rows], indent=1
    )
    write_results(results, "prepare_throughput", "gutenberg", header, "\n".join(lines), json_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
