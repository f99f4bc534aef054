"""`frugality recipes`: the recipes that ship with frugality."""

from __future__ import annotations

import click


@click.command()
@click.argument("name", required=False)
def recipes(name) -> None:
    """List shipped recipes (and their layout variants, NAME:VARIANT), or print the resolved
    TOML of recipe NAME (a name, NAME:VARIANT or a file)."""
    from frugality.config.recipe import load_recipe, recipe_variants, shipped_recipes

    if name:
        click.echo(load_recipe(name).to_toml(shown=True), nl=False)
        return
    for recipe_name in sorted(shipped_recipes(), key=_size_order):
        r = load_recipe(recipe_name)
        m = r.model
        click.echo(
            f"{recipe_name:14} {m.family:9} layers {m.num_layers:3}  hidden {m.hidden_size:5}  "
            f"heads {m.num_heads:3}  seq {r.data.seq_len:5}  {r.description}"
        )
        for variant, description in recipe_variants(recipe_name).items():
            click.echo(f"  {recipe_name}:{variant}  {description}")
    _machine()


def _machine() -> None:
    """What this machine is, and what `train.precision = "auto"` picks on it."""
    import torch

    from frugality.hardware import probe, report
    from frugality.precision import resolve_policy

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    click.echo(f"\nthis machine: {probe(device).describe()}")
    speeds = report(device)  # the product probe, cached per machine
    click.echo(
        f"products (measured once per machine): fp32 {speeds['fp32_gflops']:,.1f} GFLOP/s, "
        f"bf16 {speeds['bf16_gflops']:,.1f} GFLOP/s"
    )
    click.echo(resolve_policy("auto", device)[1])


def _size_order(name: str) -> tuple:
    """tiny first, then the recipes without a size in their name (the encoders) by name, then
    by model size as written in the name (14m < 1b < 20b)."""
    units = {"m": 1e6, "b": 1e9}
    tail = name.rsplit("-", 1)[-1]
    try:
        return (2, float(tail[:-1]) * units[tail[-1]], name)
    except (ValueError, KeyError):
        return (0 if name == "tiny" else 1, 0.0, name)
