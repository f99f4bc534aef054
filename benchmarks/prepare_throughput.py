"""`data prepare` throughput: text MB/s and tokens/s of `frugality data prepare` at 1, 2, ...
workers on the bundled corpus (six books, 2.6 MB of text in .txt.gz), against the
tokenizer's own limit: Hugging Face tokenizers' `encode_batch` over the same texts, already
in memory, with the library's threads (as many as the cores) and with one thread. Written
to benchmarks/results/prepare_throughput-gutenberg-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/prepare_throughput.py [--workers 1,2] [--rounds 3] [--copies 4]
        [--documents books|jsonl]

`--copies N` prepares N copies of the corpus (each book N times, as separate files), so
that the workers have more pieces than the six books to share out. Each figure is the best
of `--rounds` (the machine's speed drifts with its neighbours). `prepare` runs as a user
runs it: a subprocess `frugality data prepare ... --workers W`, reading, tokenizing,
writing the parts and merging them.

`--documents jsonl` gives the corpus the Pile's shape instead: each book cut at paragraph
breaks into documents of about 4 KB, all in one `.jsonl` (prepared with `--piece-mb 2`,
so that the workers have pieces to share at this small size), and adds Megatron-LM's
`preprocess_data.py` method on the same file (`benchmarks/megatron_preprocess_method.py`:
a process pool fed 32 lines a task, one text a tokenizer call, megatron-core's builder),
whose output must be the same bytes as frugality's.
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


def _prepare_seconds(files: list[Path], workers: int, rounds: int, folder: Path, extra=(), megatron=False):
    """Best seconds of `data prepare` (or the Megatron method) and the tokens it wrote; the
    last round's output is kept at folder/out-{workers}[-megatron]."""
    best, tokens = float("inf"), 0
    out = folder / f"out-{workers}{'-megatron' * megatron}"
    for _ in range(rounds):
        for suffix in (".bin", ".idx"):
            Path(str(out) + suffix).unlink(missing_ok=True)
        if megatron:
            command = [sys.executable, str(Path(__file__).with_name("megatron_preprocess_method.py"))]
            command += [str(files[0]), str(out), str(workers)]
        else:
            command = [sys.executable, "-m", "frugality", "data", "prepare", *map(str, files), "--out", str(out)]
            command += ["--workers", str(workers), *extra]
        start = time.perf_counter()
        done = subprocess.run(command, capture_output=True, text=True)
        seconds = time.perf_counter() - start
        if done.returncode:
            raise RuntimeError(done.stderr[-2000:])
        best = min(best, seconds)
        if megatron:
            tokens = json.loads(done.stdout.strip().splitlines()[-1])["tokens"]
        else:
            tokens = int(done.stdout.split(" documents, ")[1].split(" tokens")[0].replace(",", ""))
    return best, tokens


def _read_gz(path: Path) -> str:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return f.read()


def _documents(books: list[Path], copies: int, path: Path) -> list[str]:
    """The books cut at paragraph breaks into documents of about 4 KB, `copies` times, as
    one .jsonl at `path`."""
    documents = []
    for book in books:
        document = ""
        for paragraph in _read_gz(book).split("\n\n"):
            document += paragraph + "\n\n"
            if len(document) >= 4000:
                documents.append(document)
                document = ""
        if document.strip():
            documents.append(document)
    documents *= copies
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": d}) + "\n" for d in documents)
    return documents


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--copies", type=int, default=4)
    parser.add_argument("--documents", choices=["books", "jsonl"], default="books")
    args = parser.parse_args()
    cores = len(os.sched_getaffinity(0))
    same = None
    with tempfile.TemporaryDirectory(prefix="frugality-prepare-") as tmp:
        folder = Path(tmp)
        files = []
        if args.documents == "jsonl":
            files = [folder / "documents.jsonl"]
            texts = _documents(corpus_files(), args.copies, files[0])
        else:
            for c in range(args.copies):
                for f in corpus_files():
                    files.append(folder / f"{c}-{f.name}")
                    shutil.copyfile(f, files[-1])
            texts = [_read_gz(f) for f in files]
        megabytes = sum(len(t.encode()) for t in texts) / 1e6
        tokens = sum(len(ids) for ids in load_tokenizer("pythia").encode_batch(texts))
        rows = []
        for threads in sorted({1, cores}):
            seconds = _encode_batch_seconds(texts, threads, args.rounds)
            rows.append((f"encode_batch, in memory, {threads} thread{'s' * (threads > 1)}", seconds, tokens))
            print(f"{rows[-1][0]}: {megabytes / seconds:.2f} MB/s", file=sys.stderr)
        extra = ["--piece-mb", "2"] if args.documents == "jsonl" else []
        for workers in (int(w) for w in args.workers.split(",")):
            seconds, written = _prepare_seconds(files, workers, args.rounds, folder, extra)
            what = "library threads" if workers == 1 else "a thread each"
            rows.append((f"frugality data prepare --workers {workers} ({what})", seconds, written))
            print(f"{rows[-1][0]}: {megabytes / seconds:.2f} MB/s", file=sys.stderr)
            if args.documents == "jsonl":
                seconds, written = _prepare_seconds(files, workers, args.rounds, folder, megatron=True)
                rows.append((f"Megatron preprocess_data.py method, --workers {workers}", seconds, written))
                print(f"{rows[-1][0]}: {megabytes / seconds:.2f} MB/s", file=sys.stderr)
                ours, theirs = folder / f"out-{workers}", folder / f"out-{workers}-megatron"
                same = same is not False and all(
                    Path(f"{ours}{ext}").read_bytes() == Path(f"{theirs}{ext}").read_bytes() for ext in (".bin", ".idx")
                )
    limit = megabytes / rows[len({1, cores}) - 1][1]  # encode_batch at all the cores
    lines = [
        "| path | seconds | text MB/s | tokens/s | of encode_batch's MB/s (all cores) |",
        "|---|---|---|---|---|",
    ]
    for name, seconds, count in rows:
        rate = megabytes / seconds
        lines.append(f"| {name} | {seconds:.2f} | {rate:.2f} | {count / seconds:,.0f} | {rate / limit:.2f} |")
    shape = f"{len(files)} .txt.gz files" if args.documents == "books" else f"one .jsonl of {len(texts):,} documents"
    header = (
        f"# data prepare throughput, the bundled corpus x {args.copies} ({megabytes:.1f} MB of text, "
        f"{tokens:,} tokens, {shape})\n\n{machine_line()}\nBest of {args.rounds} rounds each; "
        "prepare timed as a subprocess (start-up, reading, tokenizing, writing and merging parts)."
        + ("" if same is None else f" The Megatron method wrote frugality's bytes: {'yes' if same else 'NO'}.")
        + "\n\n"
    )
    results = Path(__file__).parent / "results"
    json_rows = json.dumps(
        [{"path": n, "seconds": s, "tokens": c, "mb_per_s": megabytes / s} for n, s, c in rows], indent=1
    )
    name = "gutenberg" if args.documents == "books" else "gutenberg-jsonl"
    write_results(results, "prepare_throughput", name, header, "\n".join(lines), json_rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
