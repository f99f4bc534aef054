"""What training and serving cost: the arithmetic of `frugality cost` and of every run's
summary. The calculator works in exact fractions from the decimal inputs and rounds once,
half up, at the end (`ROUNDING`), so a figure never depends on float accidents.

- tokens/s = sequences/s x sequence length
- tokens per dollar = tokens/s x 3600 / ($ per hour)
- $ per million tokens = ($ per hour) / (tokens/s x 3600) x 1e6
- instances for a rate R per hour = ceil(R / (per-instance throughput/s x 3600)), whole
  instances, and their utilisation = R / (instances x throughput/s x 3600)
- $ per million inferences = instances x ($ per hour) / (R / 1e6)
- kWh per million inferences = instances x watts / 1000 / (R / 1e6)
"""

from __future__ import annotations

import math
from fractions import Fraction

from frugality.errors import UserError

# Decimal places of each figure the calculator and the summaries report.
ROUNDING = {
    "tokens_per_s": 1,
    "tokens_per_dollar": 0,
    "usd_per_million_tokens": 4,
    "usd_per_hour": 4,
    "instances": 0,
    "utilisation": 4,
    "usd_per_million_inferences": 4,
    "kwh_per_million_inferences": 4,
    "inferences_per_hour": 0,
}


def exact(value) -> Fraction:
    """A number as the user wrote it (2.05 is 205/100, not the float nearest to it)."""
    try:
        return Fraction(str(value)) if isinstance(value, (float, str)) else Fraction(value)
    except (ValueError, OverflowError, TypeError):
        raise UserError(f"{value!r} is not a finite number") from None


def rounded(name: str, value: Fraction) -> float | int:
    r = _half_up(value, ROUNDING[name])
    return int(r) if ROUNDING[name] == 0 else r


def _positive(name: str, value) -> Fraction:
    try:
        v = exact(value)
    except UserError as e:  # nan, inf: the option named, as for any other bad value
        raise UserError(f"{name}: {e}") from None
    if v <= 0:
        raise UserError(f"{name} must be positive (got {value})")
    return v


def train_figures(seq_per_s, seq_len, usd_per_hour, price_name: str = "the price per hour") -> dict:
    """tokens/s, tokens per dollar and $ per million tokens of a training throughput."""
    tokens_per_s = _positive("--seq-per-s", seq_per_s) * _positive("--seq-len", seq_len)
    price = _positive(price_name, usd_per_hour)
    per_hour = tokens_per_s * 3600
    return {
        "tokens_per_s": rounded("tokens_per_s", tokens_per_s),
        "usd_per_hour": rounded("usd_per_hour", price),
        "tokens_per_dollar": rounded("tokens_per_dollar", per_hour / price),
        "usd_per_million_tokens": rounded("usd_per_million_tokens", price / per_hour * 1_000_000),
    }


def serve_figures(
    rate_per_hour, per_instance_per_s, usd_per_hour, watts=None, price_name: str = "the price per hour"
) -> dict:
    """The fleet that serves `rate_per_hour` inferences and what a million of them cost."""
    rate = _positive("--rate", rate_per_hour)
    capacity = _positive("--per-instance-throughput", per_instance_per_s) * 3600  # per instance per hour
    price = _positive(price_name, usd_per_hour)
    instances = math.ceil(rate / capacity)
    millions = rate / 1_000_000
    figures = {
        "inferences_per_hour": rounded("inferences_per_hour", rate),
        "instances": instances,
        "utilisation": rounded("utilisation", rate / (instances * capacity)),
        "usd_per_hour": rounded("usd_per_hour", instances * price),
        "usd_per_million_inferences": rounded("usd_per_million_inferences", instances * price / millions),
        "kwh_per_million_inferences": None,
    }
    if watts is not None:
        energy = instances * _positive("--watts", watts) / 1000 / millions
        figures["kwh_per_million_inferences"] = rounded("kwh_per_million_inferences", energy)
    return figures


def compare_figures(a: dict, b: dict) -> dict:
    """B against A for every figure both have: the ratio b/a, and the % B saves where lower
    is better (costs, energy, instances) or gains where higher is better."""
    higher_is_better = {"tokens_per_s", "tokens_per_dollar", "inferences_per_hour", "utilisation"}
    out = {}
    for key in a.keys() & b.keys():
        x, y = a[key], b[key]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not isinstance(y, (int, float)) or not x:
            continue
        ratio = exact(y) / exact(x)
        better = ratio - 1 if key in higher_is_better else 1 - ratio
        out[key] = {"a": x, "b": y, "ratio": _half_up(ratio, 4), "b_better_by": _half_up(better, 4)}
    return dict(sorted(out.items()))


def _half_up(value: Fraction, places: int) -> float:
    """Rounded to `places` decimals, halves away from zero, in exact integer arithmetic."""
    scaled = abs(value) * 10**places
    units = math.floor(scaled + Fraction(1, 2))
    return math.copysign(units / 10**places, value) if units else 0.0


def kwh(joules: float, pue: float) -> float:
    """Device joules as kWh at the wall (x PUE)."""
    return round(joules * pue / 3.6e6, 9)


def run_figures(tokens: int, seconds: float, joules: float, usd: float | None, pue: float, gco2_per_kwh: float) -> dict:
    """A run's totals: its tokens, time, device energy and dollars as tokens/s, tokens per
    dollar, kWh at the wall (device energy x PUE), J per token and kg CO2e."""
    energy = kwh(joules, pue)
    return {
        "tokens": tokens,
        "wall_time_s": round(seconds, 2),
        "tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else None,
        "usd": None if usd is None else round(usd, 9),
        "tokens_per_dollar": round(tokens / usd) if usd else None,
        "usd_per_million_tokens": round(usd / tokens * 1e6, 4) if usd is not None and tokens else None,
        "device_energy_j": round(joules, 1),
        "kwh": energy,
        "joules_per_token": round(joules * pue / tokens, 6) if tokens else None,
        "kg_co2e": round(energy * gco2_per_kwh / 1000, 9),
    }


def at_target(points: list[dict], target: float) -> dict | None:
    """Where the evaluation curve first reaches `target`: the step, seconds, joules and
    dollars, linearly interpolated between the evaluation before and the one that reached
    it. `points`: {"step", "loss", "elapsed_s", "energy_j", "usd"} in step order."""
    previous = None
    for point in points:
        if not isinstance(point["loss"], (int, float)) or point["loss"] != point["loss"]:
            continue  # a non-finite evaluation (logged as a string) reaches nothing
        if point["loss"] <= target:
            if previous is None or previous["loss"] == point["loss"]:
                return {k: point[k] for k in ("step", "elapsed_s", "energy_j", "usd")}
            f = (previous["loss"] - target) / (previous["loss"] - point["loss"])
            mix = lambda k, a=previous, b=point, f=f: a[k] + f * (b[k] - a[k])
            usd = None if point["usd"] is None or previous["usd"] is None else mix("usd")
            return {
                "step": round(mix("step"), 1),
                "elapsed_s": round(mix("elapsed_s"), 2),
                "energy_j": round(mix("energy_j"), 1),
                "usd": None if usd is None else round(usd, 9),
            }
        previous = point
    return None
