"""The GPU check (`scripts/gpu-check.sh`, which sets up the environment and calls this):
everything a GPU machine should confirm, in one go, within a time budget, every table
under one folder.

GPU machines are lent rarely and briefly, so each section runs on its own: one that fails
or runs out of time is a row in the summary saying so, and the rest go on. The most
important sections come first. `--dry-run` runs the same sections with the same commands
on the CPU, with small shapes, short runs, and the CUDA-only parts left out (saying so):
CI runs it, so the script works the first time a GPU is at hand.

Sections:

- `environment`: GPU, driver, torch, and what `auto` picks.
- `cuda-tests`: the tests marked `cuda`. The dry run collects them.
- `train-*`: `bench train` on Pythia-1B, Llama 1B, Pythia-410M and Pythia-160M.
  - frugality in bf16-sr against transformers-compiled, liger-kernel and torchtitan
    (each in amp-bf16, their usual way);
  - then frugality alone in amp-bf16 and fp8;
  - MFU against the measured dense peak of the dtype the products run in.
- `embed`: `bench infer` of an all-MiniLM-L6-v2-shaped encoder against
  sentence-transformers, in bf16.
- `generate`: `bench infer --generate` of a Pythia-160M-shaped decoder against
  transformers' generate.
- `serve`: `bench serve` of the encoder, closed and open loop.
- `energy`: a `tiny` run, and its J/token with the energy's source (NVML on a GPU).

The encoder and the decoder have random weights in their real shapes: throughput does not
depend on the values, and nothing can be downloaded on the GPU machines. Agreement with
the peers is still checked, since both sides load the same weights.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PEERS = "transformers-compiled:amp-bf16,liger-kernel:amp-bf16,torchtitan:amp-bf16"
TRAIN_RECIPES = ("pythia-1b", "llama-1b", "pythia-410m", "pythia-160m")
# The dry run's shapes: each recipe's family at a few layers and a small width.
SMALL = {
    "gpt-neox": ["model.num_layers=1", "model.hidden_size=64", "model.num_heads=4"],
    "llama": [
        "model.num_layers=1",
        "model.hidden_size=64",
        "model.num_heads=4",
        "model.num_kv_heads=2",
        "model.intermediate_size=128",
    ],
}
RESERVE_S = 20  # kept back at the end for the summary


@dataclass
class Section:
    name: str
    limit_s: float  # its own time limit (the budget left may cut it shorter)
    commands: list[list[str]]
    note: str = ""  # what the dry run left out, or what to read the tables with
    tables: list[str] = field(default_factory=list)  # files it writes under the output folder


@dataclass
class Outcome:
    status: str  # ok, failed (exit N), timed out, not run (no time left)
    seconds: float


def frugality(*args: str) -> list[str]:
    return [sys.executable, "-m", "frugality", *args]


def sections(out: Path, dry: bool, models: dict[str, Path]) -> list[Section]:
    """What runs, in order of importance."""
    found = []
    marked = (p for p in (ROOT / "tests").rglob("test_*.py") if "mark.cuda" in p.read_text())
    tests = sorted(str(p.relative_to(ROOT)) for p in marked)
    pytest = [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider", *tests]
    found.append(
        Section(
            "cuda-tests",
            150,
            [pytest + (["--collect-only"] if dry else ["--junitxml", str(out / "cuda-tests.xml")])],
            "collected only (no GPU)" if dry else "",
        )
    )
    for recipe in TRAIN_RECIPES:
        family = "llama" if recipe.startswith("llama") else "gpt-neox"
        shape = ["--batch", "1", "--seq", "32", "--steps", "1", "--warmup", "1"] if dry else ["--steps", "10"]
        # the dry run: frugality eager (its compiled blocks are tested in the suite); the
        # compiled peer still compiles
        sets = [a for s in ([*SMALL[family], "compile.level=O0"] if dry else []) for a in ("--set", s)]
        common = ["bench", "train", recipe, *shape, *sets, "--no-memory"]
        peers = frugality(
            *common,
            "--precision",
            "bf16-sr",
            "--baseline",
            PEERS,
            "--markdown",
            str(out / f"train-{recipe}.md"),
            "--json",
            str(out / f"train-{recipe}.json"),
        )
        alone = frugality(
            *common,
            "--only",
            "frugality",
            "--precision",
            "amp-bf16" if dry else "amp-bf16,fp8",
            "--markdown",
            str(out / f"train-{recipe}-precisions.md"),
            "--json",
            str(out / f"train-{recipe}-precisions.json"),
        )
        found.append(
            Section(
                f"train-{recipe}",
                150,
                [peers, alone],
                "fp8 left out (CUDA 8.9+ only); liger-kernel and torchtitan rows say they need CUDA" if dry else "",
                [f"train-{recipe}.md", f"train-{recipe}-precisions.md"],
            )
        )
    embed_args = ["--texts", "64", "--batch", "16", "--rounds", "1", "--precision", "fp32"] if dry else []
    found.append(
        Section(
            "embed",
            60,
            [
                frugality(
                    "bench",
                    "infer",
                    str(models["encoder"]),
                    *(embed_args or ["--texts", "20000", "--batch", "256", "--precision", "bf16"]),
                    "--markdown",
                    str(out / "embed.md"),
                    "--json",
                    str(out / "embed.json"),
                )
            ],
            "fp32 (bf16 is slow on CPUs without native bf16)" if dry else "",
            ["embed.md"],
        )
    )
    generate_args = ["--batch", "1", "--prompt-tokens", "16", "--new-tokens", "4", "--rounds", "1"]
    found.append(
        Section(
            "generate",
            60,
            [
                frugality(
                    "bench",
                    "infer",
                    "--generate",
                    str(models["decoder"]),
                    *(generate_args if dry else ["--batch", "1,8,32", "--compile"]),
                    "--markdown",
                    str(out / "generate.md"),
                    "--json",
                    str(out / "generate.json"),
                )
            ],
            "",
            ["generate.md"],
        )
    )
    load = ["--concurrency", "2", "--duration", "1"] if dry else ["--concurrency", "1,8,64", "--rate", "200,800"]
    found.append(
        Section(
            "serve",
            60,
            [
                frugality(
                    "bench",
                    "serve",
                    str(models["encoder"]),
                    *load,
                    *([] if dry else ["--duration", "5", "--slo-ms", "100"]),
                    "--markdown",
                    str(out / "serve.md"),
                    "--json",
                    str(out / "serve.json"),
                )
            ],
            "",
            ["serve.md"],
        )
    )
    steps = "5" if dry else "300"
    found.append(
        Section(
            "energy",
            60,
            [
                frugality(
                    "train",
                    "tiny",
                    "--set",
                    f"train.steps={steps}",
                    "--set",
                    "optim.warmup_steps=2",
                    "--set",
                    "train.eval_interval=1000",
                    "--run-dir",
                    str(out / "runs" / "tiny"),
                    "--fresh",
                    "--no-progress",
                ),
                [sys.executable, __file__, "energy-table", str(out / "runs" / "tiny"), str(out / "energy.md")],
            ],
            "estimated energy (no NVML on a CPU)" if dry else "",
            ["energy.md"],
        )
    )
    # the peers' sections first (the README's rows), then the rest, then the smaller recipes
    order = ["cuda-tests", "train-pythia-1b", "train-llama-1b", "embed", "generate", "serve", "energy"]
    ranked = sorted(found, key=lambda s: order.index(s.name) if s.name in order else len(order))
    return ranked


def build_models(folder: Path, dry: bool) -> dict[str, Path]:
    """An all-MiniLM-L6-v2-shaped sentence-transformers encoder and a Pythia-160M-shaped
    decoder with random weights, tokenizers from frugality's bundled assets."""
    import torch
    import transformers
    from sentence_transformers import SentenceTransformer, models

    from frugality.data.tokenizer import shipped_tokenizer_dir

    torch.manual_seed(0)
    encoder = folder / "minilm-shaped"
    if not (encoder / "modules.json").exists():
        width, layers = (64, 2) if dry else (384, 6)
        config = transformers.BertConfig(
            vocab_size=30522,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=4 if dry else 12,
            intermediate_size=4 * width,
            max_position_embeddings=512,
        )
        bert = folder / "bert"
        transformers.BertModel(config).save_pretrained(bert)
        vocab = shipped_tokenizer_dir("bert-uncased") / "tokenizer.json"
        tokenizer = transformers.BertTokenizerFast(tokenizer_file=str(vocab))
        tokenizer.save_pretrained(bert)
        body = models.Transformer(str(bert), max_seq_length=256)
        SentenceTransformer(modules=[body, models.Pooling(width, "mean"), models.Normalize()], device="cpu").save(
            str(encoder)
        )
    decoder = folder / "pythia-160m-shaped"
    if not (decoder / "config.json").exists():
        width, layers, heads = (64, 2, 4) if dry else (768, 12, 12)
        config = transformers.GPTNeoXConfig(
            vocab_size=50304,
            hidden_size=width,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            intermediate_size=4 * width,
            rotary_pct=0.25,
            max_position_embeddings=2048,
            bos_token_id=0,
            eos_token_id=0,
            use_parallel_residual=True,
        )
        transformers.GPTNeoXForCausalLM(config).save_pretrained(decoder)
        tokenizer = transformers.PreTrainedTokenizerFast(
            tokenizer_file=str(shipped_tokenizer_dir("pythia") / "tokenizer.json"),
            eos_token="<|endoftext|>",
            bos_token="<|endoftext|>",
        )
        tokenizer.save_pretrained(decoder)
    return {"encoder": encoder, "decoder": decoder}


def run_section(section: Section, out: Path, deadline: float) -> Outcome:
    t0 = time.monotonic()
    log = out / f"{section.name}.log"
    with log.open("w") as f:
        for command in section.commands:
            left = min(section.limit_s - (time.monotonic() - t0), deadline - time.monotonic() - RESERVE_S)
            if left < 5:
                return Outcome("timed out" if time.monotonic() - t0 > 1 else "not run (no time left)", 0.0)
            f.write(f"$ {shlex.join(command)}\n")
            f.flush()
            try:
                done = subprocess.run(command, stdout=f, stderr=subprocess.STDOUT, timeout=left, cwd=ROOT)
            except subprocess.TimeoutExpired:
                return Outcome(f"timed out after {left:.0f} s", time.monotonic() - t0)
            if done.returncode != 0:
                return Outcome(f"failed (exit {done.returncode}; see {log.name})", time.monotonic() - t0)
    return Outcome("ok", time.monotonic() - t0)


def environment(out: Path, dry: bool) -> str:
    """The machine, for the summary's first lines (also written to environment.log)."""
    import torch

    from frugality import __version__
    from frugality.hardware import probe
    from frugality.precision import resolve_policy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT)
    lines = [
        f"- machine: {probe(device).describe()}",
        f"- torch {torch.__version__}, CUDA {torch.version.cuda}, frugality {__version__} "
        f"(commit {commit.stdout.strip() or 'unknown'})",
        f"- auto: {resolve_policy('auto', device)[1]}",
    ]
    if device.type == "cuda":
        smi = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,power.limit,clocks.max.sm", "--format=csv,noheader"],
            capture_output=True,
            text=True,
        )
        lines.append(f"- nvidia-smi: {smi.stdout.strip() or smi.stderr.strip()}")
    elif not dry:
        lines.append("- **no CUDA GPU is visible: this is not a GPU check** (use --dry-run on a CPU)")
    (out / "environment.log").write_text("\n".join(lines) + "\n")
    return "\n".join(lines)


def energy_table(run_dir: Path, target: Path) -> None:
    """The `energy` section's table, from the tiny run's summary."""
    summary = json.loads((run_dir / "summary.json").read_text())
    cost = summary["cost"]
    target.write_text(
        "| run | device | tokens | tokens/s | J/token | energy |\n|---|---|---|---|---|---|\n"
        f"| tiny, {summary['final_step']} steps | {summary['device']} | {cost['tokens']:,} | "
        f"{cost['tokens_per_s']:,.0f} | {cost['joules_per_token']:.4g} | {cost['labels']['energy']} |\n"
    )
    print(target.read_text())


def main() -> int:
    if sys.argv[1:2] == ["energy-table"]:
        energy_table(Path(sys.argv[2]), Path(sys.argv[3]))
        return 0
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="the same sections on the CPU, small and short")
    parser.add_argument("--out", type=Path, help="the folder for every table and log")
    parser.add_argument("--budget-s", type=float, default=540, help="the whole check's time [default: 540]")
    parser.add_argument("--only", help="comma-separated section names (default: all)")
    args = parser.parse_args()
    started = time.monotonic()
    deadline = started + args.budget_s
    stamp = datetime.date.today().isoformat()
    out = args.out or ROOT / "benchmarks" / "results" / f"gpu-check-{'dry-run' if args.dry_run else 'gpu'}-{stamp}"
    out.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    machine = environment(out, args.dry_run)
    print(machine, flush=True)
    models = build_models(out / "models", args.dry_run)
    plan = sections(out, args.dry_run, models)
    if args.only:
        wanted = set(args.only.split(","))
        unknown = wanted - {s.name for s in plan}
        if unknown:
            print(f"gpu_check: --only {','.join(sorted(unknown))}: no such section", file=sys.stderr)
            return 2
        plan = [s for s in plan if s.name in wanted]
    outcomes = {}
    for section in plan:
        print(f"== {section.name}", flush=True)
        outcomes[section.name] = run_section(section, out, deadline)
        print(f"   {outcomes[section.name].status} ({outcomes[section.name].seconds:.0f} s)", flush=True)
    write_summary(out, args.dry_run, machine, plan, outcomes, time.monotonic() - started)
    failed = [name for name, o in outcomes.items() if o.status != "ok"]
    print(f"gpu_check: {len(plan) - len(failed)} of {len(plan)} sections ok; summary in {out / 'README.md'}")
    return 1 if failed else 0


def write_summary(out: Path, dry: bool, machine: str, plan, outcomes, seconds: float) -> None:
    title = "GPU check (dry run on a CPU)" if dry else "GPU check"
    lines = [f"# {title}, {datetime.date.today().isoformat()}", "", machine, ""]
    lines += ["| section | status | seconds | note |", "|---|---|---|---|"]
    for section in plan:
        o = outcomes[section.name]
        lines.append(f"| {section.name} | {o.status} | {o.seconds:.0f} | {section.note} |")
    lines += ["", f"Whole check: {seconds:.0f} s.", ""]
    for section in plan:
        for table in section.tables:
            path = out / table
            if path.exists():
                lines += [f"## {section.name}: {table}", "", path.read_text().strip(), ""]
    (out / "README.md").write_text("\n".join(lines))


if __name__ == "__main__":
    sys.exit(main())
