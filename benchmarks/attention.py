"""Causal attention on this CPU, bf16, Pythia-70m's layer shapes (8 heads of 64, rotary on
16 channels): frugality's AMX kernel against the paths it replaced.

For each shape (batch x seq), medians of --repeats calls, the paths alternating:
1. forward (under torch.no_grad()): the kernel against torch's rotary ops + SDPA (the CPU
   flash kernel);
2. forward + backward: the kernel against torch's rotary + SDPA eagerly (frugality's `O0`
   before the kernel, and transformers'), and against the compiled rotary + blocked
   backward (`CausalAttention`, frugality's `O1` before the kernel).
Each path's relative error against float64 (the output, and the largest of the three
input gradients' errors). Writes benchmarks/results/attention-pythia-70m-<machine>-<date>.

    .venv/bin/python benchmarks/attention.py [--repeats 9]
"""

from __future__ import annotations

import argparse
import json
import sys
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from frugality.bench.results import machine_line, race, write_results
from frugality.kernels import attention as cpu_attention
from frugality.kernels.attention import BlockedBackwardAttention, causal_attention
from frugality.models.layers import RotaryEmbedding
from frugality.runtime.host_memory import keep_freed_memory

HEADS, HEAD_SIZE, ROTARY = 8, 64, 16


def _torch_path(rotary):
    def attention(q, k, v):
        return F.scaled_dot_product_attention(rotary(q), rotary(k), v, is_causal=True)

    return attention


def _blocked_path(rotary):
    return torch.compile(lambda q, k, v: BlockedBackwardAttention.apply(rotary(q), rotary(k), v), fullgraph=True)


def _errors(fn, q, k, v, grad, rotary) -> str:
    """Relative errors of the output and the worst input gradient against float64."""
    inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    out = fn(*inputs)
    grads = torch.autograd.grad(out, inputs, grad)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(rotary(q64), rotary(k64), v64, is_causal=True)
    ref_grads = torch.autograd.grad(ref, (q64, k64, v64), grad.double())
    rel = lambda a, b: ((a.double() - b).norm() / b.norm()).item()
    return f"{rel(out, ref):.1e}, {max(rel(g, r) for g, r in zip(grads, ref_grads, strict=True)):.1e}"


def _training(fn, leaves: list[torch.Tensor], grad: torch.Tensor):
    """A forward and backward of `fn` over `leaves`, their gradients dropped after."""

    def step():
        fn(*leaves).backward(grad)
        for t in leaves:
            t.grad = None

    return step


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    device = torch.device("cpu")
    keep_freed_memory()  # as in training
    rows = []
    for batch, seq in ((4, 512), (1, 2048)):
        torch.manual_seed(0)
        q, k, v, grad = (torch.randn(batch, HEADS, seq, HEAD_SIZE, dtype=torch.bfloat16) for _ in range(4))
        if not cpu_attention.amx_attention_applies(q, k, v):
            print("this CPU cannot run the AMX kernel (no AMX, or no C compiler)", file=sys.stderr)
            return 1
        rotary = RotaryEmbedding(ROTARY, seq, head_size=HEAD_SIZE)
        kernel = lambda q, k, v, rotary=rotary: causal_attention(q, k, v, rotary)
        paths = {
            "AMX kernel": kernel,
            "torch rotary + SDPA": _torch_path(rotary),
            "compiled rotary + blocked backward": _blocked_path(rotary),
        }
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        with torch.no_grad():
            t = race(
                device, args.repeats, new=partial(kernel, q, k, v), old=partial(paths["torch rotary + SDPA"], q, k, v)
            )
        what = f"{batch} x {seq} tokens"
        errors = {name: _errors(fn, q, k, v, grad, rotary) for name, fn in paths.items()}
        rows.append(
            (
                what,
                "forward",
                "AMX kernel",
                t["new"],
                "torch rotary + SDPA",
                t["old"],
                f"{errors['AMX kernel'].split(',')[0]} / {errors['torch rotary + SDPA'].split(',')[0]}",
            )
        )
        t = race(device, args.repeats, **{name: _training(fn, leaves, grad) for name, fn in paths.items()})
        for old in ("torch rotary + SDPA", "compiled rotary + blocked backward"):
            rows.append(
                (
                    what,
                    "forward + backward",
                    "AMX kernel",
                    t["AMX kernel"],
                    old,
                    t[old],
                    f"{errors['AMX kernel']} / {errors[old]}",
                )
            )

    table = (
        "| shape | pass | path | ms | replaced path | ms | speed-up | relative error vs float64 "
        "(path / replaced) |\n|---|---|---|---|---|---|---|---|\n"
    )
    for what, kind, new, new_s, old, old_s, err in rows:
        table += (
            f"| {what} | {kind} | {new} | {new_s * 1e3:.1f} | {old} | {old_s * 1e3:.1f} | "
            f"{old_s / new_s:.2f}× | {err} |\n"
        )
    header = (
        f"# Causal attention, Pythia-70m layer shapes ({HEADS} heads of {HEAD_SIZE}, rotary on "
        f"{ROTARY} channels), bf16\n\n{machine_line()}\n"
        f"Medians of {args.repeats} calls per path, alternating, after one warm-up call each. "
        "Errors: the output's, then (forward + backward) the worst of the three input "
        "gradients'.\n\n"
    )
    records = [
        dict(shape=w, kind=k, path=n, seconds=a, replaced_path=o, replaced_seconds=b, relative_errors=e)
        for w, k, n, a, o, b, e in rows
    ]
    write_results(
        Path(__file__).parent / "results", "attention", "pythia-70m", header, table, json.dumps(records, indent=1)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
