"""`frugality compare` on constructed runs: PASS within the tolerance (exit 0), FAIL
outside it (exit 1), the largest deviation of each curve and its step, and `report`'s
files for the same runs."""

from __future__ import annotations

import json

import pytest

from frugality.cli.main import main
from frugality.errors import UserError
from frugality.metrics.compare import parity, parse_tolerance


def _run(
    path,
    val_losses: dict[int, float],
    train_loss=lambda s: 10 - s * 0.1,
    grad_norm=lambda s: 1.0,
    summary: dict | None = None,
):
    path.mkdir(parents=True)
    records = [
        {
            "kind": "eval",
            "step": s,
            "loss": v,
            "elapsed_s": s * 2.0,
            "energy_j": s * 10.0,
            "usd": s * 1e-3,
            "tokens": s * 128,
        }
        for s, v in val_losses.items()
    ]
    records += [
        {
            "kind": "train",
            "step": s,
            "loss": train_loss(s),
            "grad_norm": grad_norm(s),
            "tokens": s * 128,
            "tokens_per_s": 1000.0,
            "mfu": 0.4,
            "elapsed_s": s * 2.0,
            "usd": s * 1e-3,
        }
        for s in range(1, 21)
    ]
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if summary is not None:
        (path / "summary.json").write_text(json.dumps(summary))
    return path


def test_a_final_loss_within_the_tolerance_passes(tmp_path, capsys):
    a = _run(
        tmp_path / "a", {0: 11.0, 10: 6.0, 20: 4.0}, summary={"final_step": 20, "cost": {"usd": 0.02, "kwh": 1e-4}}
    )
    b = _run(
        tmp_path / "b",
        {0: 11.0, 10: 6.1, 20: 4.003},  # +0.075%
        train_loss=lambda s: 10 - s * 0.1 + (0.5 if s == 7 else 0.0),
        grad_norm=lambda s: 1.2 if s == 13 else 1.0,
        summary={"final_step": 20, "cost": {"usd": 0.01, "kwh": 5e-5}},
    )
    assert main(["compare", str(a), str(b), "--plots", str(tmp_path / "plots")]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("PASS: final validation loss at step 20: 4.000000 (A) vs 4.003000 (B), +0.0750%")
    assert out[1] == "training loss over 20 shared steps: largest deviation 5.3763% at step 7"  # 0.5 / 9.3
    assert out[2] == "gradient norm: largest deviation 20.0000% at step 13"
    assert "usd: 0.02 (A) vs 0.01 (B)" in out
    assert (tmp_path / "plots" / "compare.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_final_loss_outside_the_tolerance_fails_with_exit_1(tmp_path, capsys):
    a = _run(tmp_path / "a", {0: 11.0, 20: 4.0})
    b = _run(tmp_path / "b", {0: 11.0, 20: 4.01})  # +0.25%
    assert main(["compare", str(a), str(b), "--json"]) == 1
    result = json.loads(capsys.readouterr().out)
    assert result["verdict"] == "FAIL" and result["final_val_rel_diff"] == pytest.approx(0.0025)
    assert main(["compare", str(a), str(b), "--tolerance", "0.3%"]) == 0  # a looser bar passes it


def test_runs_that_cannot_be_judged_are_one_line(tmp_path, capsys):
    a = _run(tmp_path / "a", {0: 11.0, 20: 4.0})
    short = _run(tmp_path / "short", {0: 11.0, 10: 6.0})
    with pytest.raises(UserError, match="last evaluations differ"):
        parity(a, short)
    assert main(["compare", str(a), str(tmp_path / "missing")]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    assert parse_tolerance("0.1%") == pytest.approx(0.001) and parse_tolerance("0.002") == 0.002
    for bad in ("abc", "150%", "-1"):
        with pytest.raises(UserError, match="--tolerance"):
            parse_tolerance(bad)


def test_report_writes_markdown_and_plots(tmp_path, capsys):
    summary = {
        "final_step": 20,
        "final_val_loss": 4.0,
        "cost": {
            "tokens": 2560,
            "usd": 0.02,
            "kwh": 1e-4,
            "labels": {"price": "declared in cost.price_per_hour ($1/h)", "energy": "estimated (x)"},
            "target": {"loss": 5.0, "reached": True, "step": 15.0, "elapsed_s": 30.0, "kwh": 4e-5, "usd": 0.015},
        },
    }
    a = _run(tmp_path / "a", {0: 11.0, 10: 6.0, 20: 4.0}, summary=summary)
    b = _run(tmp_path / "b", {0: 11.0, 10: 6.5, 20: 4.5})  # a run without a summary still plots
    assert main(["report", str(a), str(b), "--out", str(tmp_path / "out")]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "out" / n) for n in ("report.md", "loss.png", "throughput.png")]
    text = (tmp_path / "out" / "report.md").read_text()
    assert "| final validation loss | 4.0000 | n/a |" in text and "| dollars | $0.0200 | n/a |" in text
    assert "a, price: declared in cost.price_per_hour ($1/h)" in text
    assert "a, target loss 5: reached at step 15 after 30.0 s" in text and "b: no cost figures" in text
    for png in ("loss.png", "throughput.png"):
        assert (tmp_path / "out" / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["report", str(tmp_path / "nothing")]) == 2
