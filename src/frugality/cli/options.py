"""Options and option values that several commands share."""

from __future__ import annotations

import click

from frugality.errors import UserError

# `embed`, `generate` and `serve`: how the model's products run
inference_precision = click.option(
    "--precision",
    type=click.Choice(["auto", "fp32", "bf16", "int8"]),
    default="auto",
    show_default=True,
    help="auto: bf16 where this machine's bf16 products are native, else fp32 (never int8: it changes results).",
)


def comma_ints(value: str, option: str) -> list[int]:
    """`1,2,8` -> [1, 2, 8] (sorted, each once, all positive)."""
    try:
        numbers = sorted({int(n) for n in value.split(",") if n.strip()})
    except ValueError:
        raise UserError(f"{option} {value}: comma-separated positive integers, e.g. 1,2") from None
    if not numbers or numbers[0] < 1:
        raise UserError(f"{option} {value}: comma-separated positive integers, e.g. 1,2")
    return numbers


def comma_names(value: str, allowed: tuple[str, ...], option: str) -> list[str]:
    """`ddp,fsdp` -> ["ddp", "fsdp"], each one of `allowed`."""
    names = [s.strip() for s in value.split(",") if s.strip()]
    for name in names or [value]:
        if name not in allowed:
            raise UserError(f"{option} {name}: choose from {', '.join(allowed)}")
    return names


def comma_floats(value: str | None, option: str) -> list[float]:
    """`5,10,20` -> [5.0, 10.0, 20.0], in the order given, all positive; none for None."""
    if not value:
        return []
    try:
        numbers = [float(n) for n in value.split(",") if n.strip()]
    except ValueError:
        numbers = []
    if not numbers or min(numbers) <= 0:
        raise UserError(f"{option} {value}: comma-separated positive numbers, e.g. 5,10")
    return numbers
