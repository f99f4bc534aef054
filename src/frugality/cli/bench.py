"""`frugality bench ...`: measured comparisons, printed as Markdown tables."""

from __future__ import annotations

from pathlib import Path

import click
from click.core import ParameterSource


@click.group()
def bench() -> None:
    """Benchmarks against reference implementations."""


def _resolve(recipe, overrides, precisions, batch, seq):
    """The recipe, the precision names, and the batch shape (the recipe's by default)."""
    from frugality.config.recipe import load_recipe
    from frugality.errors import UserError
    from frugality.precision import get_policy

    resolved = load_recipe(recipe, list(overrides))
    names = [p.strip() for p in precisions.split(",") if p.strip()]
    if "auto" in names:  # what a run picks on this machine (bf16-sr where bf16 products are native, else fp32)
        from frugality.precision import resolve_policy
        from frugality.runtime.device import resolve_device

        chosen = resolve_policy("auto", resolve_device(resolved.train.device, what="frugality bench"))[0].name
        names = list(dict.fromkeys(chosen if name == "auto" else name for name in names))
    for name in names:
        get_policy(name)
    batch = batch or resolved.data.micro_batch_size
    seq = seq or resolved.data.seq_len
    if seq > resolved.model.max_seq_len:
        raise UserError(f"--seq {seq} exceeds model.max_seq_len ({resolved.model.max_seq_len})")
    if batch < 1:
        raise UserError("--batch must be positive")
    return resolved, names, batch, seq


def _write(table: str, rows_json: str, markdown_path, json_path) -> None:
    click.echo(table)
    from frugality.paths import write_atomically

    if markdown_path:
        write_atomically(markdown_path, table + "\n")
    if json_path:
        write_atomically(json_path, rows_json + "\n")


@bench.command("train")
@click.argument("recipe", required=False)
@click.option(
    "--precision",
    "precisions",
    default="fp32,amp-bf16,bf16-sr,bf16",
    show_default=True,
    help="Comma-separated precision policies; auto: the one a run picks on this machine.",
)
@click.option("--batch", type=int, help="Sequences per step [default: the recipe's micro_batch_size].")
@click.option("--seq", type=int, help="Tokens per sequence [default: the recipe's seq_len].")
@click.option("--steps", default=5, show_default=True, help="Timed steps per implementation.")
@click.option("--warmup", default=2, show_default=True, help="Untimed steps first (allocator, compilation).")
@click.option("--only", help="Run one implementation: frugality or a peer.")
@click.option(
    "--baseline",
    metavar="PEER[:PRECISION],...",
    help="Peers to race, comma-separated: transformers, transformers-compiled, litgpt, liger-kernel and "
    "torchtitan (these two: Llama recipes on CUDA, at amp-bf16); each optionally at a precision "
    "(transformers-compiled:amp-bf16); a bare precision is transformers at it [default: "
    "transformers at the pass's precision].",
)
@click.option("--no-memory", is_flag=True, help="Skip the peak-memory subprocesses.")
@click.option(
    "--nproc",
    type=int,
    default=1,
    show_default=True,
    help="Processes on this machine to run the recipe's layout over (parallel.*, as train --nproc; "
    "frugality alone: its peers race in one process).",
)
@click.option(
    "--device",
    type=click.Choice(["xla"]),
    help="xla: XLA beside the CPU backend, eager and compiled, each a fresh training run (.venv-xla; docs/xla.md).",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--json", "json_path", type=click.Path(), help="Also write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(), help="Also write the table to a file.")
@click.option("--rows-to", "rows_to", type=click.Path(), hidden=True)  # (--nproc's ranks: rank 0 hands its rows back)
def bench_train(
    recipe,
    precisions,
    batch,
    seq,
    steps,
    warmup,
    only,
    baseline,
    no_memory,
    nproc,
    device,
    overrides,
    json_path,
    markdown_path,
    rows_to,
) -> None:
    """Training throughput of frugality against its peers (transformers' GPTNeoXForCausalLM +
    AdamW eager or compiled, litgpt, ...) on RECIPE's architecture, alternating steps in one
    process; medians of --steps. A peer that cannot run here is a row saying why. With
    --nproc N: frugality alone at the recipe's layout over N ranks (data, tensor and pipeline
    parallel, as train --nproc N runs it; --batch is each data-parallel rank's, by default its
    share of the global batch). With --device xla: frugality on XLA, on the CPU eager and on
    the CPU compiled (O1)."""
    from frugality import distributed
    from frugality.bench.peers import PEERS, parse_baselines
    from frugality.bench.train import bench_train as run
    from frugality.bench.train import markdown_table, rows_json
    from frugality.errors import UserError

    distributed.follow_launcher()  # a rank of --nproc N: end with the launcher
    rank = distributed.world_from_env()
    if nproc < 1:
        raise UserError(f"--nproc {nproc}: a positive number of processes")
    ranks = nproc if nproc > 1 else rank.world_size  # (torchrun's ranks, started by this command or not)
    if ranks > 1 and (device or only not in (None, "frugality") or baseline):
        given = "--device xla" if device else "--baseline" if baseline else f"--only {only}"
        raise UserError(
            f"--nproc {ranks} with {given}: over ranks frugality alone runs (its peers race in one process, "
            "XLA trains in one process); drop one of them"
        )
    if device == "xla":
        if only or baseline or no_memory:
            raise UserError(
                "--device xla: frugality on XLA and on the CPU backend; --only, --baseline and "
                "--no-memory are for the race against peers"
            )
        _bench_xla(recipe, precisions, batch, seq, steps, warmup, overrides, json_path, markdown_path)
        return
    batch_given = batch
    resolved, names, batch, seq = _resolve(recipe, overrides, precisions, batch, seq)
    if ranks > 1 and not batch_given:  # a data-parallel rank's share of a step, as `train` takes it
        batch = resolved.data.global_batch_size // max(
            1, ranks // (resolved.parallel.tensor * resolved.parallel.pipeline)
        )
    if steps < 1 or warmup < 0:
        raise UserError("--steps must be positive, --warmup not negative")
    if resolved.train.task != "causal_lm":
        raise UserError(
            f"bench train times causal language models; recipe {resolved.name} trains "
            f"{resolved.train.task} (time it with frugality train: summary.json has tokens/s)"
        )
    p = resolved.parallel
    aside = [f"parallel.tensor {p.tensor}"] * (p.tensor > 1) + [f"parallel.pipeline {p.pipeline}"] * (p.pipeline > 1)
    if aside and ranks == 1:  # (said, not silently dropped: the rows are one process's)
        click.echo(
            f"bench train races one process: {' and '.join(aside)} set aside (--nproc N times frugality "
            "at the layout over N ranks)",
            err=True,
        )
    if rank.distributed and len(names) > 1:  # (the launcher of --nproc N starts one launch a precision)
        raise UserError(
            f"--precision {','.join(names)} over ranks: one precision a launch (a process's peak memory is "
            "its precision's); bench train --nproc N launches one for each"
        )
    if ranks > 1:
        only = "frugality"
    peers = parse_baselines(baseline)
    impls = ("frugality", *dict.fromkeys(name for name, _ in peers))
    if only:
        if only != "frugality" and only not in PEERS:
            raise UserError(f"--only {only!r}: choose frugality or a peer ({', '.join(PEERS)})")
        impls = (only,)
    compiled = [
        i
        for i in impls
        if i in ("transformers-compiled", "litgpt", "torchtitan", "liger-kernel")  # (liger: Triton's JIT)
        or (i == "frugality" and resolved.compile.level != "O0")
    ]
    if warmup < 1 and compiled:
        raise UserError(
            f"--warmup 0: {', '.join(compiled)} compile in their first step; "
            "it must be a warm-up step (--warmup 1 or more)"
        )
    if nproc > 1 and not rank.distributed:  # the same command in N ranks, checked first as train checks
        rows = _launch_bench_ranks(resolved, names, batch, seq, nproc)
    else:
        try:
            rows = run(
                resolved,
                names,
                batch,
                seq,
                steps=steps,
                warmup=warmup,
                impls=impls,
                peer_precisions={name: p for name, p in peers if p},
                memory=not no_memory,
                log=lambda line: click.echo(line, err=True) if rank.is_main else None,
            )
        finally:
            distributed.shutdown()
        if rows_to:  # a rank of --nproc N: its launcher prints the table of every precision's launch
            if rank.is_main:
                from frugality.paths import write_atomically

                write_atomically(rows_to, rows_json(rows) + "\n")
            return
    if rank.is_main:
        _write(markdown_table(rows), rows_json(rows), markdown_path, json_path)


def _launch_bench_ranks(recipe, precisions: list[str], batch: int, seq: int, nproc: int) -> list:
    """`bench train` again in `nproc` ranks as torchrun starts them, a launch per precision
    (a process's peak is its one precision's), after the layout each runs is checked over
    them (one line, before any rank starts); every launch's rows, or exit with the status of
    the first that failed."""
    import json
    import sys
    import tempfile
    from pathlib import Path

    from frugality import distributed
    from frugality.bench.train import BenchRow, for_shape
    from frugality.distributed import World
    from frugality.runtime.device import resolve_device
    from frugality.runtime.layout import check_ranks

    resolve_device(recipe.train.device, what="frugality bench")  # as the ranks will (XLA refused)
    for precision in precisions:
        check_ranks(for_shape(recipe, precision, batch, seq, World(0, nproc)), nproc)
    argv = click.get_current_context().find_root().obj["argv"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="frugality-bench-") as scratch:
        for precision in precisions:
            back = Path(scratch) / f"{precision}.json"
            again = [*argv, "--nproc", "1", "--precision", precision, "--batch", str(batch), "--rows-to", str(back)]
            status = distributed.launch_local(nproc, again, recipe.parallel.timeout_s)
            if status != 0:
                sys.exit(status)
            rows += [BenchRow(**row) for row in json.loads(back.read_text())]
    return rows


def _bench_xla(recipe, precisions, batch, seq, steps, warmup, overrides, json_path, markdown_path) -> None:
    import json

    from frugality.bench.xla import bench_xla, markdown_table
    from frugality.errors import UserError

    if click.get_current_context().get_parameter_source("precisions") is ParameterSource.DEFAULT:
        precisions = "fp32"  # not every policy by default: auto's on XLA's CPU client
    _, names, batch, seq = _resolve(recipe, overrides, precisions, batch, seq)
    shape = [f"data.micro_batch_size={batch}", f"data.global_batch_size={batch}", f"data.seq_len={seq}"]
    if steps < 1:
        raise UserError("--steps must be positive")
    if warmup < 2:
        raise UserError(f"--warmup {warmup}: XLA compiles over its first two steps; 2 or more")
    log = lambda line: click.echo(line, err=True)
    # the loss read every --warmup steps: XLA runs that many steps between two reads, timed together
    rows = [
        row
        for name in names
        for row in bench_xla(recipe or "tiny", [*overrides, *shape], steps, warmup, name, log, warmup=warmup)
    ]
    _write(markdown_table(rows), json.dumps(rows), markdown_path, json_path)


@bench.command("compile")
@click.argument("recipe", required=False)
@click.option("--level", "levels", default="O0,O1,O2", show_default=True, help="Comma-separated compile levels.")
@click.option(
    "--precision",
    "precisions",
    default="fp32,amp-bf16,bf16-sr,bf16",
    show_default=True,
    help="Comma-separated precision policies; auto: the one a run picks on this machine.",
)
@click.option("--batch", type=int, help="Sequences per step [default: the recipe's micro_batch_size].")
@click.option("--seq", type=int, help="Tokens per sequence [default: the recipe's seq_len].")
@click.option("--steps", default=5, show_default=True, help="Timed steps of the warm process.")
@click.option(
    "--cache", help="Cache URL to go through (s3://..., a directory) [default: a fresh temporary directory per level]."
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--json", "json_path", type=click.Path(), help="Also write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(), help="Also write the table to a file.")
def bench_compile(recipe, levels, precisions, batch, seq, steps, cache, overrides, json_path, markdown_path) -> None:
    """Cold compile time, warm-start time to the first step and tokens/s per compile level,
    each measured in fresh processes (a cold one with an empty cache, then a warm one that
    fetches what the cold one published)."""
    from frugality.bench.compile import bench_compile as run
    from frugality.bench.compile import markdown_table, rows_json
    from frugality.compile.levels import LEVELS
    from frugality.errors import UserError

    resolved, names, batch, seq = _resolve(recipe, overrides, precisions, batch, seq)
    level_names = [lv.strip() for lv in levels.split(",") if lv.strip()]
    for name in level_names:
        if name not in LEVELS:
            raise UserError(f"--level {name}: choose from {', '.join(LEVELS)}")
    if steps < 1:
        raise UserError("--steps must be positive")
    rows = run(
        resolved, names, level_names, batch, seq, steps=steps, cache=cache, log=lambda line: click.echo(line, err=True)
    )
    _write(markdown_table(rows), rows_json(rows), markdown_path, json_path)


@bench.command("scale")
@click.argument("recipe", required=False)
@click.option("--nproc", "nprocs", default="1,2", show_default=True, help="Comma-separated process counts.")
@click.option(
    "--strategy", "strategies", default="ddp,fsdp", show_default=True, help="Comma-separated data-parallel strategies."
)
@click.option("--steps", default=10, show_default=True, help="Training steps per configuration.")
@click.option("--tensor", "tensors", help="Comma-separated tensor-parallel degrees to run too.")
@click.option("--pipeline", "pipelines", help="Comma-separated pipeline-parallel degrees to run too.")
@click.option("--pipeline-microbatches", type=int, help="Micro-batches a pipeline step drives [default: the recipe's].")
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--json", "json_path", type=click.Path(), help="Also write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(), help="Also write the table to a file.")
def bench_scale(
    recipe, nprocs, strategies, steps, tensors, pipelines, pipeline_microbatches, overrides, json_path, markdown_path
) -> None:
    """Training tokens/s of RECIPE at each process count and strategy on this machine (real
    `frugality train --nproc N` runs; on CPUs the cores are split between the ranks); with
    --tensor/--pipeline, those layouts too, with the pipeline bubble and the time in
    tensor-parallel collectives."""
    from frugality.bench.scale import bench_scale as run
    from frugality.bench.scale import markdown_table, rows_json
    from frugality.cli.options import comma_ints, comma_names
    from frugality.config.recipe import DATA_PARALLEL, load_recipe
    from frugality.errors import UserError

    resolved = load_recipe(recipe, list(overrides))
    counts = comma_ints(nprocs, "--nproc")
    names = comma_names(strategies, DATA_PARALLEL, "--strategy")
    if steps < 2:
        raise UserError("--steps must be at least 2")
    degrees = {}
    for flag, value in (("--tensor", tensors), ("--pipeline", pipelines)):
        degrees[flag] = comma_ints(value, flag) if value else []
        if any(d < 2 for d in degrees[flag]):
            raise UserError(f"{flag} {value}: degrees are 2 or more (1 is the data-parallel rows)")
    if pipeline_microbatches is not None and (pipeline_microbatches < 1 or not degrees["--pipeline"]):
        raise UserError("--pipeline-microbatches: a positive count, with --pipeline")
    rows = run(
        recipe,
        resolved,
        list(overrides),
        counts,
        names,
        steps,
        log=lambda line: click.echo(line, err=True),
        tensors=degrees["--tensor"],
        pipelines=degrees["--pipeline"],
        pipeline_microbatches=pipeline_microbatches,
    )
    _write(markdown_table(rows), rows_json(rows), markdown_path, json_path)


@bench.command("profile")
@click.argument("recipe", required=False)
@click.option("--precision", default="fp32", show_default=True, help="frugality's precision policy.")
@click.option("--batch", type=int, help="Sequences per step [default: the recipe's micro_batch_size].")
@click.option("--seq", type=int, help="Tokens per sequence [default: the recipe's seq_len].")
@click.option("--steps", default=2, show_default=True, help="Profiled steps per implementation.")
@click.option("--warmup", default=2, show_default=True, help="Unprofiled steps first (allocator, compilation).")
@click.option(
    "--baseline", metavar="PEER[:PRECISION],...", help="Peers to profile too, as for bench train [default: none]."
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--json", "json_path", type=click.Path(), help="Also write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(), help="Also write the table to a file.")
def bench_profile(recipe, precision, batch, seq, steps, warmup, baseline, overrides, json_path, markdown_path) -> None:
    """Where a training step's time goes, by kind of work: the output layer's and the blocks'
    matrix products (and their rate), attention, loss, optimizer, compiled kernels,
    elementwise ops, time outside ops; for frugality and each --baseline peer, one at a time
    on the same shape (torch profiler)."""
    from frugality.bench.peers import parse_baselines
    from frugality.bench.profile import markdown_table, profile_steps, rows_json
    from frugality.bench.train import for_shape
    from frugality.errors import UserError

    if "," in precision or precision == "auto":
        raise UserError(f"--precision {precision!r}: one policy, named (fp32, amp-bf16, bf16-sr, bf16, ...)")
    resolved, (precision,), batch, seq = _resolve(recipe, overrides, precision, batch, seq)
    if steps < 1 or warmup < 1:
        raise UserError("--steps and --warmup must be positive (the first step compiles or allocates)")
    if resolved.train.task != "causal_lm":
        raise UserError(
            f"bench profile times causal language models; recipe {resolved.name} trains {resolved.train.task}"
        )
    peers = parse_baselines(baseline) if baseline else []
    runs = [("frugality", precision)] + [(name, p or precision) for name, p in peers]
    if any(p == "auto" for _, p in runs):
        raise UserError("--baseline ...:auto: name the peer's precision (fp32, amp-bf16, ...)")
    rows = [
        profile_steps(
            for_shape(resolved, p, batch, seq),
            impl,
            p,
            batch,
            seq,
            steps,
            warmup,
            log=lambda line: click.echo(line, err=True),
        )
        for impl, p in runs
    ]
    _write(markdown_table(rows), rows_json(rows), markdown_path, json_path)


@bench.command("infer")
@click.argument("model", type=click.Path())
@click.option(
    "--generate",
    "generation",
    is_flag=True,
    help="Text generation instead of embeddings: `frugality "
    "generate` against transformers' generate on a decoder MODEL (GPT-NeoX, Llama).",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(),
    help="Texts (.txt, .jsonl, .parquet) [default: the "
    "WordNet glosses of ../shared/assets, else the bundled corpus's lines].",
)
@click.option("--text-field", default="text", show_default=True)
@click.option("--texts", "count", default=5000, show_default=True, help="How many texts (the first N).")
@click.option(
    "--batch",
    help="Texts per batch, for both [default: 64]; with --generate, comma-separated batch sizes [default: 1,8].",
)
@click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16", "int8"]),
    default="fp32",
    show_default=True,
    help="frugality's; int8 against the peer in fp32. --generate: fp32 or int8.",
)
@click.option(
    "--device",
    default="auto",
    show_default=True,
    help="auto, cpu, cuda, cuda:1, xla (.venv-xla), ...: frugality's and its peer's (the --ray row runs on CPUs).",
)
@click.option(
    "--prompt-tokens",
    default=128,
    show_default=True,
    help="With --generate: tokens per prompt (pieces of the bundled corpus).",
)
@click.option("--new-tokens", default=64, show_default=True, help="With --generate: greedy tokens per prompt.")
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="With --generate: frugality's prefill and decoding step compiled by Inductor (the "
    "step replayed as a CUDA graph on a GPU), and transformers with its static cache (which it "
    "compiles on a GPU); the warm-up, compiles included, is timed apart.",
)
@click.option("--rounds", default=3, show_default=True, help="Alternating timed rounds; the best of each counts.")
@click.option(
    "--ray",
    "ray_",
    is_flag=True,
    help="Embeddings: add a row for the texts as an `embed --engine ray` job (an actor a CPU).",
)
@click.option(
    "--address",
    help="--ray: the cluster to join (HOST:PORT, auto, ray://...) [default: a local one]; the job's folder is "
    "this machine's temporary folder, so a cluster of one machine.",
)
@click.option("--json", "json_path", type=click.Path(), help="Also write the rows as JSON.")
@click.option("--markdown", "markdown_path", type=click.Path(), help="Also write the table to a file.")
def bench_infer(
    model,
    generation,
    input_path,
    text_field,
    count,
    batch,
    precision,
    device,
    prompt_tokens,
    new_tokens,
    compile_,
    rounds,
    ray_,
    address,
    json_path,
    markdown_path,
) -> None:
    """Embedding throughput of frugality against sentence-transformers' encode on MODEL
    (e.g. all-MiniLM-L6-v2), the same texts, batch size, device and precision: texts/s and
    the cosine between the outputs. With --generate, generation throughput against
    transformers' generate on a decoder: prefill and decode tokens/s at each batch size,
    and whether the greedy outputs agree token for token. Each row names its device."""
    from itertools import islice

    from frugality.bench.infer import (
        bench_device,
        bench_embed,
        bench_generate,
        generate_markdown_table,
        markdown_table,
        rows_json,
    )
    from frugality.cli.options import comma_ints
    from frugality.errors import UserError
    from frugality.inference.inputs import open_inputs

    log = lambda line: click.echo(line, err=True)  # noqa: E731
    if rounds < 1:
        raise UserError("--rounds must be positive")
    if address is not None and not ray_:
        raise click.UsageError("--address goes with --ray")
    if ray_ and generation:
        raise click.UsageError("--ray goes with embeddings, not --generate")
    device = bench_device(device)  # a device that is not here: one line before the model loads
    if generation:
        if prompt_tokens < 1 or new_tokens < 2:
            raise UserError("--prompt-tokens must be positive and --new-tokens at least 2")
        if precision not in ("fp32", "bf16", "int8"):
            raise UserError(
                f"--precision {precision} with --generate: fp32 or bf16 (both sides), "
                "or int8 (frugality's) against fp32"
            )
        rows = bench_generate(
            model,
            comma_ints(batch or "1,8", "--batch"),
            prompt_tokens,
            new_tokens,
            rounds,
            compile_,
            log=log,
            precision=precision,
            device=device,
        )
        _write(generate_markdown_table(rows), rows_json(rows), markdown_path, json_path)
        return
    if not (batch or "64").isdigit() or int(batch or 64) < 1 or count < 1:
        raise UserError("--texts and --batch must be positive (one batch size without --generate)")
    if input_path is None:
        input_path = _default_texts()
    texts = [text for _, text in islice(open_inputs([input_path], text_field), count)]
    ray_address = (address or "local") if ray_ else None
    rows = bench_embed(
        model, texts, int(batch or 64), precision, rounds, log=log, ray_address=ray_address, device=device
    )
    _write(markdown_table(rows), rows_json(rows), markdown_path, json_path)


@bench.command("serve")
@click.argument("target")
@click.option(
    "--rate", "rates", help="Open loop: Poisson arrival rates to try, requests/s, comma-separated (e.g. 5,10,20)."
)
@click.option("--concurrency", "concurrencies", help="Closed loop: numbers of clients to try, comma-separated.")
@click.option(
    "--duration",
    default=10.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="Seconds each level runs.",
)
@click.option(
    "--input",
    "input_path",
    type=click.Path(),
    help="Texts (.txt, .jsonl, .parquet) [default: the bundled corpus's lines].",
)
@click.option("--text-field", default="text", show_default=True)
@click.option(
    "--max-tokens", default=32, show_default=True, type=click.IntRange(min=1), help="Completions: tokens a request."
)
@click.option(
    "--slo-ms",
    default=1000.0,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    help="The p99 latency the saturation rate must meet.",
)
@click.option("--api-key-env", help="Send `Authorization: Bearer $NAME`.")
@click.option(
    "--peer",
    "peers",
    multiple=True,
    type=click.Choice(["infinity"]),
    help="With a MODEL: race this server too, on the same model, device and precision, level by level "
    "(infinity: infinity-emb, in .venv-infinity: ./scripts/setup.sh --peers).",
)
@click.option(
    "--ceiling-s",
    default=2.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="Seconds a level of the generator's own ceiling runs, against a no-op server (0: not measured).",
)
@click.option(
    "--serve-arg", "serve_args", multiple=True, help="With a MODEL: an option for `frugality serve` (repeatable)."
)
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--json",
    "json_path",
    type=click.Path(),
    help="Also write the levels and the saturation as JSON (`cost serve --from`).",
)
@click.option("--markdown", "markdown_path", type=click.Path(), help="Also write the table to a file.")
def bench_serve(
    target,
    rates,
    concurrencies,
    duration,
    input_path,
    text_field,
    max_tokens,
    slo_ms,
    api_key_env,
    peers,
    ceiling_s,
    serve_args,
    seed,
    json_path,
    markdown_path,
) -> None:
    """Load TARGET (a URL of an OpenAI-compatible server, or a MODEL folder that `frugality
    serve` serves for the run) at each --rate (open loop) and --concurrency (closed loop):
    throughput, p50/p95/p99 latency, errors, energy per 1,000 requests, and the saturation
    rate (the highest rate whose p99 meets --slo-ms). The generator's own ceiling is measured
    first against a no-op server, and a level it could not drive is marked."""
    import os
    import re
    import signal
    import threading
    from itertools import islice

    from frugality.bench.load import loop_name
    from frugality.bench.serve import Target, dumps, generator_ceiling, markdown_table, report, run_levels
    from frugality.cli.options import comma_floats, comma_ints
    from frugality.errors import UserError
    from frugality.inference.inputs import open_inputs

    log = lambda line: click.echo(line, err=True)  # noqa: E731
    loop_name()  # (a bad FRUGALITY_BENCH_LOOP refused before any server starts)
    rate_list = comma_floats(rates, "--rate")
    clients = comma_ints(concurrencies, "--concurrency") if concurrencies else []
    if not rate_list and not clients:
        rate_list = [1.0, 2.0, 4.0, 8.0]
    key = None
    if api_key_env:
        key = os.environ.get(api_key_env)
        if not key:
            raise UserError(f"--api-key-env {api_key_env}: that environment variable is empty or unset")
    source = input_path or _corpus_lines()
    texts = [text for _, text in islice(open_inputs([source], text_field), 10_000)]
    if input_path is None:
        texts = [t[:400] for t in texts if len(t.split()) >= 4]
    if not texts:
        raise UserError(f"{source}: no texts")
    if peers and re.match(r"https?://", target):
        raise UserError("--peer: give a MODEL folder, not a URL (each server is started on the same model)")
    main_thread = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, _exit_143) if main_thread else None  # SIGTERM runs the clean-ups too
    targets, missing = [], {}
    try:
        server = Target(target, key, list(serve_args), log)
        targets.append(server)
        for _peer in sorted(set(peers)):  # (infinity: the only choice)
            from frugality.bench.serve_peers import start_infinity

            device = _serve_device(serve_args)
            started = start_infinity(target, server.precision, device, log)
            if isinstance(started, str):
                missing["infinity-emb"] = started
                log(f"infinity-emb: {started}")
            else:
                targets.append(started)
        at = sorted(set(clients) | ({max([64, *clients])} if rate_list else set()))
        ceiling = generator_ceiling(server, texts, at, ceiling_s, log, tuple(targets)) if ceiling_s else None
        levels = run_levels(targets, texts, rate_list, clients, duration, max_tokens, seed, log, ceiling)
        result = report(targets, levels, slo_ms, missing)
    finally:
        for t in targets:  # each stopped whatever the others do
            try:
                t.stop()
            except Exception as e:
                log(f"{t.name}: not stopped cleanly ({e})")
        if main_thread:
            signal.signal(signal.SIGTERM, before)
    table = markdown_table(levels, missing)
    table += "\n"
    for figures in [result, *[p for p in result["peers"] if "missing" not in p]]:
        table += "\n" + _saturation_line(figures, slo_ms)
    _write(table, dumps(result), markdown_path, json_path)


def _saturation_line(figures: dict, slo_ms: float) -> str:
    best, name = figures["saturation"], figures["server"]
    if not best:
        return f"{name}: saturation: no open-loop rate met p99 <= {slo_ms:g} ms with no errors"
    line = (
        f"{name}: saturation: {best['rate_per_s']:g} req/s offered, {best['throughput_per_s']:g} req/s answered "
        f"with p99 {best['p99_ms']} ms <= {slo_ms:g} ms"
    )
    return (
        line
        + "; every rate tried met it: the capacity is higher (try higher --rate)" * figures["saturation_is_lower_bound"]
    )


def _exit_143(*_) -> None:
    raise SystemExit(143)  # (128 + SIGTERM, as the shell reports it; `finally` blocks run)


def _serve_device(serve_args) -> str:
    """The device `frugality serve` was given (--serve-arg=--device ...), as a peer names it."""
    import torch

    args = " ".join(serve_args).replace("=", " ").split()
    given = args[args.index("--device") + 1] if "--device" in args[:-1] else "auto"
    if given == "auto":
        given = "cuda" if torch.cuda.is_available() else "cpu"
    return given


def _corpus_lines() -> str:
    from frugality.data.bundled import corpus_files

    return str(corpus_files()[0])


def _default_texts() -> str:
    """The WordNet glosses beside a source checkout (../shared/assets), else the corpus."""
    import frugality
    from frugality.data.bundled import corpus_files

    glosses = Path(frugality.__file__).resolve().parents[3] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"
    return str(glosses if glosses.is_file() else corpus_files()[0])
