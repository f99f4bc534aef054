"""`frugality compile`."""

from __future__ import annotations

import click

from frugality.config.recipe import COMPILE_LEVELS as LEVELS  # (not compile.levels: it imports torch)


@click.command("compile")
@click.argument("recipe", required=False)
@click.option("--level", type=click.Choice(LEVELS[1:]), help="Compile level [default: the recipe's compile.level].")
@click.option(
    "--cache", help="Cache directory or URL [default: compile.cache, $FRUGALITY_COMPILE_CACHE, else the user cache]."
)
@click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE", help="Override a recipe field.")
@click.option(
    "--ranks",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="The data-parallel ranks the run will train on (their micro-batch is compiled).",
)
@click.option("--device", help="The device the run trains on [default: the recipe's train.device]; xla: docs/xla.md.")
@click.option("--no-progress", is_flag=True, help="No progress bar.")
def compile_(recipe, level, cache, overrides, ranks, device, no_progress) -> None:
    """Compile RECIPE's graphs ahead of time and publish them to the compile cache.

    Runs the training code path for a few steps on throwaway state (a temporary run
    directory), so `frugality train` with the same recipe and cache starts from compiled
    graphs and compiles nothing.
    """
    from frugality.config.recipe import load_recipe
    from frugality.training.ahead import compile_ahead

    extra = [f"compile.level={level}"] if level else []
    extra += [f'compile.cache="{cache}"'] if cache else []
    extra += [f'train.device="{device}"'] if device else []
    resolved = load_recipe(recipe, list(overrides) + extra)
    stats = compile_ahead(resolved, progress=not no_progress, ranks=ranks)
    if "xla_client" in stats:
        if stats["cache"].startswith("none: "):
            kept = f"executables not stored ({stats['cache'][6:]})"
        else:
            stored = "published to" if stats["published"] else "nothing new for"
            kept = (
                f"executables ({stats['cache_hits']} loaded from the cache, {stats['cache_misses']} compiled) "
                f"{stored} {stats['cache']}"
            )
        click.echo(
            f"compiled {resolved.name} on XLA ({stats['xla_client']}): {stats['graphs']} graphs in "
            f"{stats['compile_s']:.1f} s; "
            + (
                "the step after the two of warm-up compiled nothing"
                if stats["trial_steps"] > 2
                else f"train.steps ({stats['trial_steps']}) ends within the warm-up"
            )
            + f" -> {kept}"
        )
        return
    where = stats["cache"] if stats["published"] or stats["fetched"] else f"nothing published to {stats['cache']}"
    click.echo(
        f"compiled {resolved.name} at {stats['level']}: {stats['graphs']} graphs "
        f"({stats['cache_hits']} already cached, {stats['cache_misses']} compiled) in "
        f"{stats['compile_s']:.1f} s, recompiles {stats['recompiles']}"
        + (f", eager fallback: {'; '.join(stats['fallbacks'])}" if stats["fallbacks"] else "")
        + f" -> {where}"
    )
