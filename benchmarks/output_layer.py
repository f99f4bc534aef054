"""The output layer and the gradient norm, each path against the one it replaced, on
this machine's device: Pythia-70m's shapes (hidden 512, vocabulary 50304), bf16.

1. The cross-entropy's row pass over (tokens x vocabulary) logits: the C kernel (CPUs) or
   the compiled graph (GPUs) against torch ops in chunks of rows (64 rows, the path GPUs
   took before the compiled graph).
2. The fused output layer in evaluation (under torch.no_grad()): forward only, against
   the same layer also computing its gradient, which evaluation did before.
3. BF16AdamW's gradient norm over 70M bf16 gradients: its kernel (CPUs) or float32 torch
   norm, against torch's bf16 `vector_norm`; with each one's relative error.

Medians of --repeats, the paths alternating. Writes benchmarks/results/output_layer-
<machine>-<date>.md.

    .venv/bin/python benchmarks/output_layer.py [--tokens 2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch

from frugality import kernels
from frugality.bench.results import machine_line, race, write_results
from frugality.kernels import output_loss as loss
from frugality.runtime.host_memory import keep_freed_memory

VOCAB, HIDDEN, PARAMS = 50304, 512, 70_426_624


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        keep_freed_memory()  # as in training
    torch.manual_seed(0)
    bf16 = torch.bfloat16
    logits = torch.randn(args.tokens, VOCAB, device=device).to(bf16)
    targets = torch.randint(0, VOCAB, (args.tokens,), device=device)
    scale = 1.0 / args.tokens
    rows = []

    work = logits.clone()
    fast_name = "C kernel" if device.type == "cpu" else "compiled graph"
    fast = loss.rows_in_c if device.type == "cpu" else loss.rows_compiled

    def chunked(work: torch.Tensor = work):
        saved, loss.CHUNK_BYTES_OFF_CPU = loss.CHUNK_BYTES_OFF_CPU, 0  # 64-row chunks everywhere
        try:
            loss.rows_in_torch(work, targets, scale, True)
        finally:
            loss.CHUNK_BYTES_OFF_CPU = saved

    t = race(device, args.repeats, fast=lambda work=work: fast(work, targets, scale, True), chunked=chunked)
    rows.append(
        (
            f"cross-entropy rows, {args.tokens} x {VOCAB}",
            fast_name,
            t["fast"],
            "torch ops, 64-row chunks",
            t["chunked"],
            "",
        )
    )

    hidden = torch.randn(args.tokens, HIDDEN, device=device, dtype=bf16, requires_grad=True)
    weight = (torch.randn(VOCAB, HIDDEN, device=device) * 0.02).to(bf16).requires_grad_()
    with torch.no_grad():
        t = race(
            device,
            args.repeats,
            new=lambda: loss.LinearCrossEntropy.apply(hidden, weight, targets, False, None),
            old=lambda: loss.LinearCrossEntropy.apply(hidden, weight, targets, True, None),
        )
    rows.append(
        (
            f"output layer in evaluation, {args.tokens} tokens",
            "forward only",
            t["new"],
            "with the gradient's two products",
            t["old"],
            "",
        )
    )
    hidden = weight = logits = work = None  # freed before what follows

    grads = (torch.randn(PARAMS, device=device) * 1e-3).to(bf16)
    reference = grads.double().square().sum().sqrt().item()
    kernel = kernels.bf16_sum_squares() if device.type == "cpu" else None
    if kernel is not None:
        new_name, new = "C kernel", lambda: math.sqrt(kernel(grads.data_ptr(), grads.numel(), torch.get_num_threads()))
    else:
        new_name, new = "float32 torch norm", lambda: torch.linalg.vector_norm(grads, dtype=torch.float32).item()
    old = lambda: torch.linalg.vector_norm(grads).float().item()
    t = race(device, args.repeats, new=new, old=old)
    error = lambda fn: f"{abs(fn() - reference) / reference:.1e} / {abs(old() - reference) / reference:.1e}"
    rows.append(
        (f"gradient norm, {PARAMS / 1e6:.0f}M bf16", new_name, t["new"], "torch bf16 vector_norm", t["old"], error(new))
    )

    table = (
        "| what | path | ms | replaced path | ms | speed-up | relative error (path / replaced) |\n"
        "|---|---|---|---|---|---|---|\n"
    )
    for what, new_name, new_s, old_name, old_s, err in rows:
        table += (
            f"| {what} | {new_name} | {new_s * 1e3:.1f} | {old_name} | {old_s * 1e3:.1f} | "
            f"{old_s / new_s:.2f}× | {err} |\n"
        )
    header = (
        f"# Output layer and gradient norm, Pythia-70m shapes, bf16\n\n{machine_line()}\n"
        f"Medians of {args.repeats} calls per path, alternating, after one warm-up call each.\n\n"
    )
    records = [
        dict(what=w, path=n, seconds=a, replaced_path=o, replaced_seconds=b, relative_errors=e or None)
        for w, n, a, o, b, e in rows
    ]
    write_results(
        Path(__file__).parent / "results", "output_layer", "pythia-70m", header, table, json.dumps(records, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
