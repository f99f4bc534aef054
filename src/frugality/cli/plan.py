"""`frugality plan`: memory per rank before renting a cluster."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command()
@click.argument("recipe", required=False)
@click.option("--nproc", "nprocs", default="1,8", show_default=True, help="Comma-separated process counts.")
@click.option(
    "--strategy", "strategies", default="ddp,fsdp", show_default=True, help="Comma-separated data-parallel strategies."
)
@click.option(
    "--memory",
    "memory_gib",
    type=click.FloatRange(min=0, min_open=True),
    help="Device memory per rank in GiB [default: this machine's GPU, or its RAM shared by the ranks].",
)
@click.option("--tensor", type=click.IntRange(min=1), help="Tensor-parallel degree [default: the recipe's].")
@click.option("--pipeline", type=click.IntRange(min=1), help="Pipeline stages [default: the recipe's].")
@click.option(
    "--checkpointing",
    "modes",
    help="Comma-separated activation checkpointing modes (none, selective, full) [default: the recipe's; "
    "auto: all three].",
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option("--json", "json_path", type=click.Path(), help="Also write the plans as JSON (a new file).")
def plan(recipe, nprocs, strategies, memory_gib, tensor, pipeline, modes, overrides, json_path) -> None:
    """Memory per rank for RECIPE at each process count and strategy: weights, gradients,
    optimizer state, what is gathered in flight and one micro-batch's activations, and
    whether it fits the device (see frugality.runtime.plan for what is counted). With
    --tensor and --pipeline: the heaviest rank of that layout, data parallel over the
    ranks left over, activations for the micro-batches its schedule keeps in flight. A row
    per activation checkpointing mode (`auto`, the default: none, selective and full)."""
    from frugality.cli.options import comma_ints, comma_names
    from frugality.config.recipe import DATA_PARALLEL, load_recipe
    from frugality.errors import UserError
    from frugality.runtime.activation_checkpointing import MODES
    from frugality.runtime.plan import HEADROOM, markdown_rows, plan_memory, plan_model_parallel

    resolved = load_recipe(recipe, list(overrides))
    tensor = tensor or resolved.parallel.tensor  # (a layout variant, NAME:tp8-pp4, sets them)
    pipeline = pipeline or resolved.parallel.pipeline
    counts = comma_ints(nprocs, "--nproc")
    names = comma_names(strategies, DATA_PARALLEL, "--strategy")
    asked = resolved.train.activation_checkpointing
    checkpointing = comma_names(
        modes or ("none,selective,full" if asked == "auto" else asked), MODES, "--checkpointing"
    )
    if json_path and Path(json_path).exists():
        raise UserError(f"--json {json_path}: exists; choose another path or remove it")
    plans, notes, refused = [], dict[str, None](), []  # (notes in order, once each)
    for n in counts:
        if n % (tensor * pipeline):
            raise UserError(f"--tensor {tensor} x --pipeline {pipeline}: must divide --nproc ({n})")
        data_ranks = n // (tensor * pipeline)
        for strategy in names if data_ranks > 1 else names[:1]:  # one data-parallel rank: no strategy applies
            memory = int(memory_gib * 2**30) if memory_gib else _device_memory(n)
            # the run the ranks would make of it (`runtime.layout`'s rules, its micro-batch fitted
            # to them), or the line they would refuse it with
            try:
                ranks, note = _as_the_ranks_run(resolved, n, strategy, tensor, pipeline)
            except UserError as e:  # that layout's line; the others are planned
                refused.append(str(e))
                continue
            notes.update({note: None} if note else {})
            for mode in checkpointing:
                if tensor > 1 or pipeline > 1:
                    plans.append(plan_model_parallel(ranks, n, strategy, tensor, pipeline, memory, checkpointing=mode))
                else:
                    plans.append(plan_memory(ranks, n, strategy, memory, checkpointing=mode))
    if not plans:  # every layout asked for refused: the first one's line
        raise UserError(refused[0])
    click.echo(markdown_rows(plans))
    for line in notes:
        click.echo(line)
    for line in refused:
        click.echo(f"not planned: {line}")
    if resolved.train.precision == "auto":
        click.echo(
            "train.precision auto: planned as bf16-sr, what it picks where bf16 products are native "
            "(--set train.precision=... for another)"
        )
    click.echo(
        f"fits: the total within {HEADROOM:.0%} of each rank's device memory; activations are eager "
        "PyTorch's (selective: one block in train.selective_every recomputed); hsdp shards over "
        "parallel.shard_size ranks (all when unset)"
    )
    if json_path:
        from frugality.paths import write_atomically

        write_atomically(json_path, json.dumps([p.as_dict() for p in plans], indent=1) + "\n")


def _as_the_ranks_run(recipe, nproc: int, strategy: str, tensor: int, pipeline: int):
    """`recipe` as `nproc` ranks of `strategy`, `tensor` and `pipeline` would run it: the
    layout's rules (`runtime.layout.check_layout`; a device of the recipe's kind is enough),
    each refusal one line naming the layout; the micro-batch fitted to the data-parallel
    ranks (and a pipeline's schedule) as the run fits it. Under tensor or pipeline parallel
    the blocks run eagerly: a compiled recipe is planned at compile.level O0 (the layout
    variants set it), said in the returned note."""
    import torch

    from frugality.bench.scale import layout_name
    from frugality.distributed import World
    from frugality.errors import UserError
    from frugality.runtime.device import names_xla
    from frugality.runtime.layout import check_layout

    parallel = recipe.parallel.model_copy(update={"data": strategy, "tensor": tensor, "pipeline": pipeline})
    asked = recipe.model_copy(update={"parallel": parallel})
    note = None
    if (tensor > 1 or pipeline > 1) and recipe.compile.level != "O0":
        asked = asked.model_copy(update={"compile": recipe.compile.model_copy(update={"level": "O0"})})
        note = (
            f"compile.level {recipe.compile.level}: planned at O0, as tensor and pipeline parallel run "
            "(--set compile.level=O0 in the run)"
        )
    # the rules of the recipe's kind of device, none needed at hand (a plan for GPUs from a laptop)
    name = recipe.train.device
    kind = "xla" if names_xla(name) else "cuda" if name.split(":")[0] == "cuda" else "cpu"
    try:
        return check_layout(asked, torch.device(kind), World(0, nproc)).recipe, note
    except UserError as e:
        layout = layout_name(tensor, pipeline, nproc // (tensor * pipeline), strategy) or "one process"
        raise UserError(f"--nproc {nproc} ({layout}): {e}") from None


def _device_memory(nproc: int) -> int:
    """This machine's memory per rank: its GPU's, or the RAM (within any cgroup limit)
    divided among the ranks, as `hardware.device_memory` reads them."""
    import torch

    from frugality.hardware import device_memory

    if torch.cuda.is_available():
        return device_memory(torch.device("cuda", 0))[1]
    return device_memory(torch.device("cpu"))[1] // nproc
