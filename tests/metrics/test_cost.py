"""The calculator's arithmetic on hand-computed cases, its rounding, and the time, energy
and dollars to a target loss interpolated on the evaluation curve."""

from __future__ import annotations

import pytest

from frugality.errors import UserError
from frugality.metrics.cost import at_target, compare_figures, run_figures, serve_figures, train_figures


def test_training_throughput_as_tokens_per_dollar():
    # 12 sequences/s of 2048 tokens on a $21.50/h instance:
    # 24,576 tokens/s = 88,473,600 tokens/h; / 21.5 = 4,115,051.16 tokens/$; 21.5 / 88.4736 = $0.243008/M
    f = train_figures(12, 2048, 21.50)
    assert f == {
        "tokens_per_s": 24576.0,
        "usd_per_hour": 21.5,
        "tokens_per_dollar": 4115051,
        "usd_per_million_tokens": 0.2430,
    }


def test_rounding_is_half_up_on_the_exact_value():
    # 1 token/s at $0.72/h: 3600 / 0.72 = 5000 exactly; $0.72 / 3600 tokens x 1e6 = 200.0
    assert train_figures(1, 1, 0.72)["tokens_per_dollar"] == 5000
    # 0.5 x 2.5 = 1.25 tokens/s -> 1.3 (half up; Python's round(1.25, 1) gives 1.2)
    assert train_figures(0.5, 2.5, 1)["tokens_per_s"] == 1.3


def test_a_fleet_for_a_million_inferences_an_hour():
    # 120/s per instance = 432,000/h: ceil(1e6 / 432,000) = 3 instances, 1e6 / 1,296,000 = 77.16% used;
    # 3 x $0.7582 = $2.2746/h for one million = $2.2746 per million; 3 x 100 W for an hour = 0.3 kWh
    f = serve_figures(1_000_000, 120, 0.7582, watts=100)
    assert f == {
        "inferences_per_hour": 1000000,
        "instances": 3,
        "utilisation": 0.7716,
        "usd_per_hour": 2.2746,
        "usd_per_million_inferences": 2.2746,
        "kwh_per_million_inferences": 0.3,
    }
    exact = serve_figures(864_000, 120, 1.0)  # exactly two instances' worth: no third one
    assert exact["instances"] == 2 and exact["utilisation"] == 1.0 and exact["kwh_per_million_inferences"] is None
    with pytest.raises(UserError, match="--per-instance-throughput must be positive"):
        serve_figures(1e6, 0, 1.0)


def test_compare_gives_ratios_and_which_way_is_better():
    a, b = train_figures(12, 2048, 21.50), train_figures(20, 2048, 32.77)
    r = compare_figures(a, b)
    assert r["tokens_per_s"]["ratio"] == pytest.approx(20 / 12, abs=1e-4)
    assert r["tokens_per_dollar"]["b_better_by"] == pytest.approx(
        b["tokens_per_dollar"] / a["tokens_per_dollar"] - 1, abs=1e-4
    )
    assert r["usd_per_hour"]["b_better_by"] == pytest.approx(1 - 32.77 / 21.5, abs=1e-4)  # negative: B costs more
    fleets = compare_figures(serve_figures(1e6, 120, 1.0), serve_figures(1e6, 150, 1.0))  # 3 vs 2 instances
    assert fleets["utilisation"]["b_better_by"] > 0  # B's fleet idles less


def test_a_number_that_is_not_finite_is_one_line():
    for bad in ("inf", "nan"):
        with pytest.raises(UserError, match="is not a finite number"):
            train_figures(bad, 2048, 1.0)


def test_run_figures():
    # 1e6 tokens in 1800 s for $1; 7.2e6 J x PUE 1.25 = 2.5 kWh at 400 g/kWh = 1 kg
    f = run_figures(1_000_000, 1800.0, 7.2e6, 1.0, 1.25, 400.0)
    assert f["usd"] == 1.0 and f["tokens_per_dollar"] == 1_000_000 and f["usd_per_million_tokens"] == 1.0
    assert f["kwh"] == 2.5 and f["joules_per_token"] == 9.0 and f["kg_co2e"] == 1.0
    assert run_figures(10, 1.0, 1.0, None, 1.0, 0.0)["usd"] is None


def test_the_target_loss_is_interpolated_between_evaluations():
    points = [
        {"step": 0, "loss": 10.0, "elapsed_s": 0.0, "energy_j": 0.0, "usd": 0.0},
        {"step": 100, "loss": 6.0, "elapsed_s": 50.0, "energy_j": 1000.0, "usd": 0.5},
        {"step": 200, "loss": 4.0, "elapsed_s": 100.0, "energy_j": 2000.0, "usd": 1.0},
    ]
    # 5.0 lies halfway from 6.0 (step 100) to 4.0 (step 200)
    assert at_target(points, 5.0) == {"step": 150, "elapsed_s": 75.0, "energy_j": 1500.0, "usd": 0.75}
    assert at_target(points, 6.0)["step"] == 100  # reached exactly at an evaluation
    assert at_target(points, 3.0) is None
    points[0]["usd"] = None  # an earlier session without a price: no dollars, the rest interpolated
    assert at_target(points, 8.0) == {"step": 50, "elapsed_s": 25.0, "energy_j": 500.0, "usd": None}
