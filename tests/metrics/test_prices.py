"""The price catalogue: the bundled rows, a user's catalogue merged over them, bad rows
named by file and line, and how a run's price is found (declared, catalogue, estimate)."""

from __future__ import annotations

import pytest

from frugality.errors import UserError
from frugality.metrics.prices import COLUMNS, load_catalogue, resolve_price


def test_every_bundled_row_has_a_price_a_source_and_a_date():
    rows = load_catalogue()
    assert {
        "trn1.32xlarge",
        "inf2.xlarge",
        "p4d.24xlarge",
        "p5.48xlarge",
        "g5.xlarge",
        "g6.xlarge",
        "a3-highgpu-8g",
        "Standard_ND96isr_H100_v5",
    } <= set(rows)
    assert {r.provider for r in rows.values()} == {"aws", "gcp", "azure"}
    for row in rows.values():
        assert row.usd_per_hour > 0 and row.source.startswith("https://") and row.date, row.instance
        assert (row.accelerator_count == 0) == (row.accelerator == ""), row.instance
    assert rows["trn1.32xlarge"].usd_per_hour == 21.50 and rows["trn1.32xlarge"].accelerator_count == 16


def test_a_users_catalogue_overrides_and_adds_rows(tmp_path):
    mine = tmp_path / "mine.csv"
    mine.write_text(
        ",".join(COLUMNS) + "\n"
        "aws,trn1.32xlarge,Trainium,16,32,128,512,12.00,us-east-1,,190,my contract,2026-11\n"
        "onprem,lab-a100,A100-SXM4-80GB,8,80,128,1024,9.5,lab,400,312,amortised over 3 years,2026-11\n"
    )
    rows = load_catalogue(mine)
    assert rows["trn1.32xlarge"].usd_per_hour == 12.0 and rows["trn1.32xlarge"].source == "my contract"
    assert rows["lab-a100"].accelerator_tdp_w == 400.0 and "p5.48xlarge" in rows
    assert rows["lab-a100"].accelerator_bf16_tflops == 312.0
    # a catalogue written before the bf16 peak column still reads, without peaks
    older = tmp_path / "older.csv"
    older.write_text(
        ",".join(c for c in COLUMNS if c != "accelerator_bf16_tflops") + "\n"
        "onprem,lab-h100,H100,8,80,128,1024,20,lab,700,amortised,2026-11\n"
    )
    assert load_catalogue(older)["lab-h100"].accelerator_bf16_tflops is None


@pytest.mark.parametrize(
    "row, message",
    [
        ("aws,x,,0,,2,4,cheap,r,,,s,d", "line 2: usd_per_hour 'cheap' is not a number"),
        ("aws,x,,0,,2,4,-1,r,,,s,d", "line 2: usd_per_hour -1 is negative"),
        ("aws,x,,0,,2,4,1.0,r,,,,d", "line 2: source is empty"),
        ("aws,x,,1,,2,4,1.0,r,,fast,s,d", "line 2: accelerator_bf16_tflops 'fast' is not a number"),
    ],
)
def test_a_bad_row_is_named_by_file_and_line(tmp_path, row, message):
    bad = tmp_path / "bad.csv"
    bad.write_text(",".join(COLUMNS) + "\n" + row + "\n")
    with pytest.raises(UserError, match=f"^{bad}: ?{message}$".replace(": ?line", " line")):
        load_catalogue(bad)


def test_a_missing_catalogue_is_one_line(tmp_path):
    with pytest.raises(UserError, match=r"cost.catalogue .*nope.csv: No such file"):
        load_catalogue(tmp_path / "nope.csv")


def test_a_runs_price_declared_from_the_catalogue_or_estimated():
    rows = load_catalogue()
    declared = resolve_price(rows, 3.0, None, "cpu", "AMD EPYC", 2)
    assert declared.usd_per_hour == 3.0 and declared.label.startswith("declared")
    listed = resolve_price(rows, None, "p4d.24xlarge", "cuda", "NVIDIA A100-SXM4-40GB", 96, 8)
    assert listed.usd_per_hour == rows["p4d.24xlarge"].usd_per_hour and listed.label.startswith("catalogue: p4d")
    assert listed.provider == "aws" and listed.accelerator_w == 8 * 400
    # an H100 at hand, nothing declared: its share of the cheapest H100 instance per GPU
    gpu = resolve_price(rows, None, None, "cuda", "NVIDIA H100 80GB HBM3", 16, 1)
    assert gpu.usd_per_hour == pytest.approx(55.04 / 8) and gpu.label.startswith("estimated: 1 of p5.48xlarge")
    cpu = resolve_price(rows, None, None, "cpu", "AMD EPYC 9R14", 2)
    assert cpu.usd_per_hour == pytest.approx(rows["c7a.large"].usd_per_hour) and "c7a.large" in cpu.label
    assert resolve_price(rows, None, None, "cuda", "Some Future GPU", 8) is None
    assert resolve_price(rows, None, None, "cuda", "NVIDIA L40S", 8) is None  # not an L4
    two = resolve_price(rows, None, "p4d.24xlarge", "cuda", "NVIDIA A100-SXM4-40GB", 192, 16, hosts=2)
    assert two.usd_per_hour == pytest.approx(2 * rows["p4d.24xlarge"].usd_per_hour) and "x 2 machines" in two.label
    with pytest.raises(UserError, match="cost.instance 'p9.huge' is not in the price catalogue"):
        resolve_price(rows, None, "p9.huge", "cpu", "x", 2)
