"""`frugality cost train|serve|compare|instances`: the calculator behind tokens per dollar
and fleet sizing, usable without a run (formulas: `frugality.metrics.cost`)."""

from __future__ import annotations

import json
from pathlib import Path

import click

_PRICE = [
    click.option("--price-per-hour", type=float, help="USD per hour of one instance."),
    click.option("--instance", help="A price catalogue row, e.g. trn1.32xlarge (`frugality cost instances`)."),
    click.option("--catalogue", type=click.Path(), help="A CSV of instances merged over the bundled catalogue."),
    click.option("--json", "as_json", is_flag=True, help="Print the figures as one JSON object."),
]


def _price_options(fn):
    for option in reversed(_PRICE):
        fn = option(fn)
    return fn


def _price(price_per_hour, instance, catalogue):
    """(USD per hour, the catalogue row or None, where the price comes from)."""
    from frugality.errors import UserError
    from frugality.metrics.prices import load_catalogue

    if price_per_hour is None and instance is None:
        raise UserError("give --price-per-hour or --instance (`frugality cost instances` lists the catalogue)")
    row = None
    if instance is not None:
        rows = load_catalogue(catalogue)
        if instance not in rows:
            raise UserError(f"--instance {instance!r} is not in the price catalogue (`frugality cost instances`)")
        row = rows[instance]
    if price_per_hour is not None:
        return price_per_hour, row, "declared (--price-per-hour)"
    assert row is not None  # no price: an instance, checked above
    return row.usd_per_hour, row, f"catalogue: {row.instance} on demand in {row.region}, {row.date.split(' (')[0]}"


def _price_name(price_per_hour) -> str:
    """What a bad price is called in the error: the option when the user gave one."""
    return "the price per hour" if price_per_hour is None else "--price-per-hour"


def _emit(figures: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        click.echo(json.dumps(figures, sort_keys=True))
    else:
        for line in lines:
            click.echo(line)


@click.group()
def cost() -> None:
    """What training and serving cost: tokens per dollar, fleets for an inference rate."""


@cost.command("train")
@click.option("--seq-per-s", required=True, type=float, help="Training throughput in sequences per second.")
@click.option("--seq-len", required=True, type=int, help="Tokens per sequence.")
@click.option(
    "--recipe",
    help="The model trained (a recipe name or file): adds MFU against the --instance's accelerators' bf16 peak.",
)
@_price_options
def train_(seq_per_s, seq_len, recipe, price_per_hour, instance, catalogue, as_json) -> None:
    """Tokens/s, tokens per dollar and $ per million tokens of a training throughput."""
    from frugality.metrics.cost import train_figures

    usd, row, source = _price(price_per_hour, instance, catalogue)
    f = train_figures(seq_per_s, seq_len, usd, _price_name(price_per_hour)) | {
        "instance": row.instance if row else None,
        "price": source,
    }
    lines = [
        f"{f['tokens_per_s']:,g} tokens/s at ${f['usd_per_hour']:g}/h ({source})",
        f"{f['tokens_per_dollar']:,} tokens per dollar, ${f['usd_per_million_tokens']:.4f} per million tokens",
    ]
    if recipe is not None:
        mfu = _catalogue_mfu(recipe, seq_len, f["tokens_per_s"], row)
        lines.append(mfu.pop("line"))
        f |= mfu
    _emit(f, as_json, lines)


def _catalogue_mfu(recipe_name: str, seq_len: int, tokens_per_s: float, row) -> dict:
    """The model FLOPs of a throughput (6N + 12·L·H·T per token), and its MFU against the
    instance's accelerators at their catalogue bf16 peak."""
    import torch

    from frugality.config.recipe import load_recipe
    from frugality.errors import UserError
    from frugality.metrics.flops import training_flops_per_token
    from frugality.models import build_model

    if row is None:
        raise UserError("--recipe: MFU needs an --instance of the catalogue with its accelerators' bf16 peak")
    if not row.accelerator_count:
        raise UserError(f"--recipe: {row.instance} has no accelerators; MFU is against an accelerator's bf16 peak")
    if not row.accelerator_bf16_tflops:
        raise UserError(f"--recipe: the catalogue has no bf16 peak for {row.instance}'s {row.accelerator}")
    recipe = load_recipe(recipe_name)
    with torch.device("meta"):  # counted, never allocated
        model = build_model(recipe.model)
    flops = training_flops_per_token(model, recipe.model.num_layers, recipe.model.hidden_size, seq_len) * tokens_per_s
    peak = row.accelerator_bf16_tflops * 1e12 * row.accelerator_count
    mfu = flops / peak
    return {
        "model_tflops_per_s": round(flops / 1e12, 3),
        "mfu": round(mfu, 4),
        "line": f"{recipe.name}: {flops / 1e12:,.1f} model TFLOP/s, MFU {mfu:.1%} of {row.accelerator_count} x "
        f"{row.accelerator_bf16_tflops:g} bf16 TFLOP/s ({row.accelerator}, dense, the vendor's figure)",
    }


@cost.command()
@click.option("--rate", required=True, help="Inferences per hour to serve, e.g. 1000000 or 1e6/h.")
@click.option("--per-instance-throughput", help="Inferences per second one instance serves.")
@click.option(
    "--from",
    "bench_json",
    type=click.Path(dir_okay=False),
    help="`frugality bench serve --json`: its saturation throughput and measured power, for one instance.",
)
@click.option(
    "--watts",
    type=float,
    help="What one instance draws [default: its accelerators' board power from the catalogue, labelled an estimate].",
)
@_price_options
def serve(rate, per_instance_throughput, bench_json, watts, price_per_hour, instance, catalogue, as_json) -> None:
    """The whole instances that serve RATE inferences per hour, their utilisation, and
    the dollars and energy per million inferences; with --from, one instance's throughput
    and power as `bench serve` measured them."""
    from frugality.errors import UserError
    from frugality.metrics.cost import serve_figures

    usd, row, source = _price(price_per_hour, instance, catalogue)
    energy = "declared (--watts)" if watts is not None else None
    throughput_source = "given"
    if bench_json is not None:
        if per_instance_throughput is not None:
            raise UserError("--from and --per-instance-throughput: give one")
        per_instance_throughput, measured_watts, kind, bound = _measured_serving(bench_json)
        throughput_source = f"measured by bench serve ({bench_json}{bound})"
        if watts is None and measured_watts is not None:
            watts, energy = measured_watts, f"{kind} by bench serve at saturation, {measured_watts:g} W"
    elif per_instance_throughput is None:
        raise UserError("give --per-instance-throughput, or --from a `bench serve --json` file")
    if watts is None and row is not None and row.accelerator_tdp_w and row.accelerator_count:
        watts = row.accelerator_tdp_w * row.accelerator_count
        energy = f"estimated: {row.accelerator_count} x {row.accelerator_tdp_w:g} W board power, accelerators only"
    f = serve_figures(
        _number(rate.removesuffix("/h"), "--rate"),
        _number(per_instance_throughput.removesuffix("/s"), "--per-instance-throughput"),
        usd,
        watts,
        _price_name(price_per_hour),
    )
    f |= {"instance": row.instance if row else None, "price": source, "energy": energy, "throughput": throughput_source}
    kwh = (
        f"{f['kwh_per_million_inferences']:.4f} kWh per million inferences ({energy})"
        if f["kwh_per_million_inferences"] is not None
        else "energy unknown (give --watts)"
    )
    _emit(
        f,
        as_json,
        [
            f"{f['instances']} instance{'s' if f['instances'] != 1 else ''} for {f['inferences_per_hour']:,} "
            f"inferences/h, {f['utilisation']:.1%} utilised, ${f['usd_per_hour']:g}/h ({source}); "
            f"throughput {throughput_source}",
            f"${f['usd_per_million_inferences']:.4f} per million inferences; {kwh}",
        ],
    )


def _measured_serving(path: str) -> tuple[str, float | None, str | None, str]:
    """One instance's saturation throughput (req/s), power (W) and its label from `bench
    serve --json`; a file that is not one, or has no saturation rate, is one line."""
    from frugality.errors import UserError

    try:
        data = json.loads(Path(path).read_text())
        best = data["saturation"]
        throughput = best["throughput_per_s"] if best else None
    except (OSError, ValueError, KeyError, TypeError):
        raise UserError(f"--from {path}: not the JSON of `frugality bench serve --json`") from None
    if not best:
        raise UserError(
            f"--from {path}: no rate the generator kept up with met its SLO ({data.get('slo_ms')} ms p99): "
            "rerun bench serve with lower --rate (or on a quieter machine)"
        )
    bound = "; a lower bound: every rate tried met the SLO" if data.get("saturation_is_lower_bound") else ""
    return str(throughput), best.get("watts"), best.get("energy"), bound


@cost.command("compare")
@click.argument("a", type=click.Path(exists=True, dir_okay=False))
@click.argument("b", type=click.Path(exists=True, dir_okay=False))
@click.option("--json", "as_json", is_flag=True, help="Print the ratios as one JSON object.")
def compare_(a, b, as_json) -> None:
    """B against A: two outputs of `frugality cost train|serve --json`, figure by figure."""
    from frugality.errors import UserError
    from frugality.metrics.cost import compare_figures

    figures = []
    for path in (a, b):
        try:
            figures.append(json.loads(Path(path).read_text()))
        except (json.JSONDecodeError, UnicodeDecodeError):
            figures.append(None)
        if not isinstance(figures[-1], dict):
            raise UserError(f"{path}: not the JSON of `frugality cost train|serve --json`")
    ratios = compare_figures(*figures)
    if not ratios:
        raise UserError(f"{a} and {b} share no figure to compare")
    lines = [
        f"{key}: {r['a']:,} -> {r['b']:,} (x{r['ratio']:g}; B {'better' if r['b_better_by'] >= 0 else 'worse'} "
        f"by {abs(r['b_better_by']):.1%})"
        for key, r in ratios.items()
    ]
    _emit(ratios, as_json, lines)


@cost.command()
@click.option("--catalogue", type=click.Path(), help="A CSV of instances merged over the bundled catalogue.")
def instances(catalogue) -> None:
    """The price catalogue: instance, accelerators, on-demand $/h, region, and its date."""
    from frugality.metrics.prices import load_catalogue

    for row in load_catalogue(catalogue).values():
        accel = f"{row.accelerator_count} x {row.accelerator}" if row.accelerator_count else f"{row.vcpus} vCPUs"
        peak = f"{row.accelerator_bf16_tflops:g} bf16 TFLOP/s each" if row.accelerator_bf16_tflops else ""
        click.echo(
            f"{row.provider:6} {row.instance:26} {accel:24} ${row.usd_per_hour:>10.4f}/h  {row.region:12} "
            f"{row.date.split(' (')[0]:10}  {peak}".rstrip()
        )


def _number(text: str, flag: str) -> str:
    from frugality.errors import UserError

    try:
        float(text)
    except ValueError:
        raise UserError(f"{flag} {text!r}: not a number") from None
    return text
