"""`data prepare --engine ray` on a Ray cluster of two nodes on this machine
(`ray.cluster_utils.Cluster`, one CPU each): the same bytes as one process, and a worker
that dies mid-piece loses nothing (Ray runs its task again). Without Ray installed, the
engine is one line saying how to install it."""

from __future__ import annotations

import sys

import pytest
from test_prepare_workers import _inputs  # noqa: E402 - the same inputs as the local engine's tests

from frugality.data.prepare import prepare
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError


@pytest.mark.slow
def test_two_nodes_prepare_one_process_bytes_and_a_lost_worker_loses_nothing(ray_cluster, tmp_path):
    import ray

    tok = load_tokenizer("pythia")
    files, texts = _inputs(tmp_path)
    one = prepare(files, tok, tmp_path / "one", progress=False, workers=1, piece_bytes=1000)
    ray_run = prepare(
        files, tok, tmp_path / "ray", progress=False, piece_bytes=1000, engine="ray", address=ray_cluster.address
    )
    assert ray_run.documents == one.documents == len(texts)
    for ext in ("bin", "idx"):
        assert (tmp_path / f"ray.{ext}").read_bytes() == (tmp_path / f"one.{ext}").read_bytes()
    assert (tmp_path / "ray.parts.died-in-2").exists()  # piece 2's worker died once; Ray ran it again
    assert len(ray_cluster.list_all_nodes()) == 2 and not ray.is_initialized()  # joined for the job, left after


def test_a_bad_line_on_a_ray_worker_is_the_same_one_line(ray_cluster, tmp_path):
    (tmp_path / "docs.jsonl").write_text('{"text": "ok"}\n{"text": broken\n')
    with pytest.raises(UserError, match=r"^input \S*docs.jsonl:2: not valid JSON"):
        prepare(
            [tmp_path / "docs.jsonl"],
            load_tokenizer("pythia"),
            tmp_path / "out",
            progress=False,
            engine="ray",
            address=ray_cluster.address,
        )


def test_without_ray_the_engine_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "ray", None)  # as if not installed
    (tmp_path / "a.txt").write_text("text")
    with pytest.raises(UserError, match=r"--engine ray: Ray is not installed here; pip install 'frugality\[ray\]'"):
        prepare([tmp_path / "a.txt"], load_tokenizer("pythia"), tmp_path / "out", progress=False, engine="ray")
    assert not (tmp_path / "out.parts").exists()
