"""Generation throughput: `frugality generate`'s engine against transformers' `generate`
on two randomly initialised decoders of Pythia-70m's size (a GPT-NeoX with Pythia-70m's
shape, and a Llama of the same width and depth with grouped-query attention), saved by
`save_pretrained` with the Pythia tokenizer; the same prompts (pieces of the bundled
corpus), greedy, fp32, batch 1 and 8, in one process, alternating rounds (best of each).
Prefill and decode tokens/s, and whether the outputs agree token for token. Written to
benchmarks/results/generate_throughput-70m-<machine>-<date>.md and .json.

    .venv/bin/python benchmarks/generate_throughput.py [--prompt-tokens 128] [--new-tokens 64] [--rounds 3] [--compile]
        [--precision int8]   # frugality's linear layers in int8 (CPUs with AVX512-VNNI), transformers in fp32
        [--device auto]      # both rows' (int8: --device cpu)

Random weights time the same products as trained ones; what they cannot show is how early
real text stops (every row here runs to --new-tokens).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import torch
import transformers

from frugality.bench.infer import bench_generate, generate_markdown_table
from frugality.bench.results import machine_line, write_results
from frugality.data.tokenizer import shipped_tokenizer_dir

MODELS = {
    "GPT-NeoX (Pythia-70m shape)": (
        transformers.GPTNeoXForCausalLM,
        transformers.GPTNeoXConfig(
            hidden_size=512,
            num_hidden_layers=6,
            num_attention_heads=8,
            intermediate_size=2048,
            vocab_size=50304,
            max_position_embeddings=2048,
            # Pythia's rotary share (4.x's `rotary_pct=0.25`, the same config in 5.x)
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
    "Llama (512 wide, 6 layers, 8 heads, 4 kv heads)": (
        transformers.LlamaForCausalLM,
        transformers.LlamaConfig(
            hidden_size=512,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            intermediate_size=1408,
            vocab_size=50304,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=0,
        ),
    ),
}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompt-tokens", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--precision", choices=("fp32", "int8"), default="fp32", help="frugality's")
    parser.add_argument("--device", default="auto", help="both rows'")
    args = parser.parse_args()
    tables, rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for name, (cls, config) in MODELS.items():
            folder = Path(tmp) / cls.__name__
            torch.manual_seed(0)
            cls(config).save_pretrained(folder)
            shutil.copy(shipped_tokenizer_dir("pythia") / "tokenizer.json", folder / "tokenizer.json")
            print(f"{name}:", file=sys.stderr)
            model_rows = bench_generate(
                str(folder),
                [1, 8],
                args.prompt_tokens,
                args.new_tokens,
                args.rounds,
                args.compile,
                log=lambda s: print(s, file=sys.stderr),
                precision=args.precision,
                device=args.device,
            )
            rows += [{"model": name, **r} for r in model_rows]
            tables.append(f"**{name}**\n\n{generate_markdown_table(model_rows)}")
    header = (
        f"# Generation throughput, random decoders of Pythia-70m's size\n\n{machine_line()} Greedy, "
        f"{'fp32' if args.precision == 'fp32' else 'frugality in int8 (linear layers), transformers in fp32'}, "
        f"{args.prompt_tokens}-token prompts, {args.new_tokens} new tokens each (no stop token), best of "
        f"{args.rounds} alternating rounds. Prefill: a run of one new token; decode: the other "
        f"{args.new_tokens - 1} tokens (a full run less the prefill run). transformers: `generate` with its "
        f"default dynamic cache and SDPA; frugality: `Engine.generate` "
        f"({'compiled by Inductor' if args.compile else 'eager'}).\n\n"
    )
    write_results(
        Path(__file__).parent / "results",
        "generate_throughput",
        "70m" + ("" if args.precision == "fp32" else f"-{args.precision}") + ("-compiled" if args.compile else ""),
        header,
        "\n\n".join(tables),
        json.dumps(rows, indent=2),
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
