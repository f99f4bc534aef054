"""`frugality embed --engine ray` on a Ray cluster of two nodes on this machine: the same
ids in the same order and the same vectors as the job on one machine, with an actor killed
mid-shard (its shard goes back to the queue; nothing is lost)."""

from __future__ import annotations

import numpy as np
import pytest
from test_embed import MODEL, texts_file  # noqa: F401 - the module's inputs fixture

from frugality.cli.main import main
from frugality.inference.embed import read_embeddings


@pytest.mark.slow
def test_two_nodes_embed_as_one_machine_and_a_lost_actor_loses_nothing(ray_cluster, tmp_path, texts_file):  # noqa: F811
    common = [MODEL, str(texts_file), "--text-field", "body", "--id-field", "key", "--precision", "fp32"]
    common += ["--shard-size", "40", "--no-progress"]
    assert main(["embed", *common, "--out", str(tmp_path / "one"), "--nproc", "1"]) == 0
    assert (
        main(["embed", *common, "--out", str(tmp_path / "ray"), "--engine", "ray", "--address", ray_cluster.address])
        == 0
    )
    assert (tmp_path / "ray" / ".died-in-1").exists()  # shard 1's actor died once; the shard was redone
    ids, vectors = read_embeddings(tmp_path / "ray")
    one_ids, one_vectors = read_embeddings(tmp_path / "one")
    assert ids == one_ids == [f"g{i}" for i in range(120)]
    cosine = (vectors * one_vectors).sum(1) / np.linalg.norm(vectors, axis=1) / np.linalg.norm(one_vectors, axis=1)
    assert cosine.min() >= 0.9999


def test_address_without_the_ray_engine_is_a_usage_error(tmp_path, texts_file, capsys):  # noqa: F811
    assert main(["embed", MODEL, str(texts_file), "--out", str(tmp_path / "x"), "--address", "auto"]) == 2
    assert "--address goes with --engine ray" in capsys.readouterr().err


@pytest.mark.slow
def test_bench_infer_adds_the_ray_jobs_row(ray_cluster, tmp_path, capsys):
    import json

    import pytest

    from frugality.hardware import cpu_name

    pytest.importorskip("sentence_transformers")
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"sentence number {i} about a {'long ' * (i % 7)}topic\n" for i in range(48)))
    command = ["bench", "infer", MODEL, "--input", str(texts), "--texts", "48", "--batch", "16", "--rounds", "1"]
    command += ["--device", "cpu"]
    assert main([*command, "--ray", "--address", ray_cluster.address, "--json", str(tmp_path / "rows.json")]) == 0
    rows = {r["implementation"]: r for r in json.loads((tmp_path / "rows.json").read_text())}
    assert list(rows) == ["sentence-transformers", "frugality", "frugality embed --engine ray"]
    ray_row = rows["frugality embed --engine ray"]
    assert ray_row["texts"] == 48 and ray_row["texts_per_s"] > 0 and ray_row["min_cosine"] >= 0.9999
    assert all(r["device"] == "cpu" for r in rows.values())
    assert f"| frugality embed --engine ray | cpu ({cpu_name()}) | float32 | 16 | 48 |" in capsys.readouterr().out
