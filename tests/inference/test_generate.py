"""`frugality generate`: greedy output equals transformers' generate token for token on
GPT-NeoX (partial rotary) and Llama (grouped-query attention) weights saved by
`save_pretrained`, for one prompt and for a left-padded batch; sampling repeats with its
seed; stop tokens and strings end rows; a compiled decoding step never recompiles after
warm-up; the command end to end, and its refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from torch import nn

from frugality.cli.main import main
from frugality.errors import UserError
from frugality.hardware import cpu_flags
from frugality.inference.generate import Engine, Sampling, cache_length, load_decoder, pick
from frugality.kernels.packed_linear import packing_runs
from frugality.precision import bf16_is_native

transformers = pytest.importorskip("transformers")
EOS = 0  # the tiny decoders' end token (tests/conftest.py)


def _tokenizer(folder: Path):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


@pytest.fixture(scope="module")
def neox_folder(tiny_decoder) -> Path:
    return tiny_decoder("neox")


@pytest.fixture(scope="module")
def llama_folder(tiny_decoder) -> Path:
    return tiny_decoder("llama")


PROMPTS = [
    [5, 17, 33, 2, 9, 100, 7],
    [250],
    [12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29],
    [3, 3, 3, 4],
]


def _theirs(folder: Path, prompts: list[list[int]], new: int) -> list[list[int]]:
    """transformers' greedy continuation of each prompt, batched with left padding."""
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # every row runs to `new` tokens
    width = max(map(len, prompts))
    ids = torch.tensor([[EOS] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        out = model.generate(
            ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=EOS
        )
    return out[:, width:].tolist()


def _ours(folder: Path, prompts: list[list[int]], new: int, batch: int | None = None, **sampling) -> list[list[int]]:
    decoder, _ = load_decoder(folder, torch.device("cpu"), "fp32")
    engine = Engine(decoder, batch or len(prompts), cache_length(max(map(len, prompts)), new, decoder.max_seq_len))
    return [c.tokens for c in engine.generate(prompts, Sampling(max_new_tokens=new, **sampling))]


@pytest.mark.parametrize("family", ["neox", "llama"])
def test_greedy_equals_transformers_token_for_token(family, request):
    folder = request.getfixturevalue(f"{family}_folder")
    assert _ours(folder, PROMPTS[:1], 24) == _theirs(folder, PROMPTS[:1], 24)  # one prompt
    theirs = _theirs(folder, PROMPTS, 24)
    assert _ours(folder, PROMPTS, 24) == theirs  # a left-padded batch of different lengths
    assert _ours(folder, PROMPTS, 24, batch=6) == theirs  # filler rows change nothing


def test_sampling_repeats_with_its_seed_and_top_k_1_is_greedy(neox_folder):
    hot = dict(temperature=1.5, top_k=50, top_p=0.9)
    first = _ours(neox_folder, PROMPTS, 16, seed=3, **hot)
    assert _ours(neox_folder, PROMPTS, 16, seed=3, **hot) == first
    assert _ours(neox_folder, PROMPTS, 16, seed=4, **hot) != first
    assert _ours(neox_folder, PROMPTS, 16, temperature=0.7, top_k=1, seed=5) == _ours(neox_folder, PROMPTS, 16)


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    generator = torch.Generator().manual_seed(0)
    drawn = {pick(logits, Sampling(temperature=1.0, top_p=0.75), generator).item() for _ in range(200)}
    assert drawn == {0, 1}
    drawn = {pick(logits, Sampling(temperature=1.0, top_k=3), generator).item() for _ in range(200)}
    assert drawn == {0, 1, 2}


def test_stop_tokens_and_strings_end_rows(neox_folder):
    decoder, _ = load_decoder(neox_folder, torch.device("cpu"), "fp32")
    engine = Engine(decoder, 4, 64)
    free = engine.generate(PROMPTS, Sampling(max_new_tokens=12))
    stop = free[0].tokens[3]  # row 0's fourth token: that row stops there (others may too, earlier)
    stopped = engine.generate(PROMPTS, Sampling(max_new_tokens=12, stop_ids=(stop,)))
    assert stopped[0].tokens == free[0].tokens[:4] and stopped[0].finish == "stop"
    assert stopped[0].text == decoder.decode(free[0].tokens[:3])
    for got, full in zip(stopped, free, strict=True):
        assert got.tokens == full.tokens[: len(got.tokens)]
        assert got.finish == "stop" or got.tokens == full.tokens
    word = decoder.decode(free[1].tokens[2:3])
    cut = engine.generate(PROMPTS, Sampling(max_new_tokens=12, stop_strings=(word,)))
    assert cut[1].finish == "stop" and word not in cut[1].text and len(cut[1].tokens) <= 3


def test_streaming_pieces_add_up_to_the_text(llama_folder):
    decoder, _ = load_decoder(llama_folder, torch.device("cpu"), "fp32")
    pieces: list[str] = []
    [done] = Engine(decoder, 1, 64).generate(
        PROMPTS[:1], Sampling(max_new_tokens=10), on_text=lambda row, piece: pieces.append(piece)
    )
    assert len(pieces) > 1 and "".join(pieces) == done.text


def test_compiled_decoding_never_recompiles_after_warm_up(llama_folder):
    import torch._dynamo

    compiles = []

    def backend(gm, example_inputs):
        compiles.append(gm)
        return gm.forward

    torch._dynamo.reset()
    decoder, _ = load_decoder(llama_folder, torch.device("cpu"), "fp32")
    engine = Engine(decoder, 4, 64, compile=backend)
    sampling = Sampling(max_new_tokens=8)
    warm = engine.generate(PROMPTS, sampling)  # warm-up: the 32-token prefill bucket and the decoding step
    assert len(compiles) >= 2
    compiled = len(compiles)
    with torch._dynamo.config.patch(error_on_recompile=True):
        again = engine.generate(PROMPTS, sampling)
        other = engine.generate([[7, 8, 9] * 6, [1, 2]], Sampling(max_new_tokens=8, temperature=1.0, top_k=5))
    assert len(compiles) == compiled and again == warm and len(other) == 2
    assert [c.tokens for c in warm] == _ours(llama_folder, PROMPTS, 8)  # compiled as eager
    torch._dynamo.reset()


def _write_prompts(path: Path, prompts: list[str]) -> Path:
    path.write_text("".join(json.dumps({"text": p, "n": i}) + "\n" for i, p in enumerate(prompts)))
    return path


def test_the_command_from_a_prompt_file_to_jsonl(neox_folder, tmp_path, capsys):
    prompts = ["w5 w17 w33", "w250", "w12 w13 w14 w15 w16 w17 w18", "w3 w3", "w9"]
    source = _write_prompts(tmp_path / "prompts.jsonl", prompts)
    out = tmp_path / "out.jsonl"
    assert (
        main(
            [
                "generate",
                str(neox_folder),
                "--input",
                str(source),
                "--text-field",
                "text",
                "--id-field",
                "n",
                "--out",
                str(out),
                "--max-new-tokens",
                "6",
                "--batch",
                "2",
                "--precision",
                "fp32",
            ]
        )
        == 0
    )
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["0", "1", "2", "3", "4"] and [r["prompt"] for r in rows] == prompts
    ids = [[int(w[1:]) for w in p.split()] for p in prompts]
    theirs = _theirs(neox_folder, ids, 6)
    for row, expected in zip(rows, theirs, strict=True):
        stop = EOS in expected  # the tokenizer's end token stops a row by default
        tokens = expected[: expected.index(EOS) + 1] if stop else expected
        assert row["completion"] == _tokenizer(neox_folder).decode(tokens[:-1] if stop else tokens)
        assert row["prompt_tokens"] == len(row["prompt"].split()) and row["completion_tokens"] == len(tokens)
        assert row["finish"] == ("stop" if stop else "length")
    assert "5 prompts" in capsys.readouterr().err
    # an existing --out is refused, and left as it was
    before = out.read_text()
    assert main(["generate", str(neox_folder), "--input", str(source), "--out", str(out)]) == 2
    assert "already exists" in capsys.readouterr().err and out.read_text() == before


def test_an_out_that_is_the_input_is_refused_before_anything_is_written(neox_folder, tmp_path, capsys, monkeypatch):
    source = _write_prompts(tmp_path / "prompts.jsonl", ["w5 w17", "w250"])
    before = source.read_text()
    (tmp_path / "link.jsonl").symlink_to(source)
    (tmp_path / "sub").mkdir()
    monkeypatch.chdir(tmp_path)
    for spelling in (str(source), "./prompts.jsonl", "sub/../prompts.jsonl", str(tmp_path / "link.jsonl")):
        assert (
            main(
                [
                    "generate",
                    str(neox_folder),
                    "--input",
                    "prompts.jsonl",
                    "--text-field",
                    "text",
                    "--out",
                    spelling,
                    "--overwrite",
                    "--max-new-tokens",
                    "2",
                ]
            )
            == 2
        )
        err = capsys.readouterr().err.strip()
        assert (
            err == f"error: --out {spelling}: is the --input file prompts.jsonl; write the completions to another file"
        ), err
        assert source.read_text() == before and (tmp_path / "link.jsonl").is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link.jsonl", "prompts.jsonl", "sub"]  # no partial file


def test_one_prompt_streams_to_the_terminal(llama_folder, capsys):
    assert (
        main(["generate", str(llama_folder), "--prompt", "w5 w17 w33", "--max-new-tokens", "5", "--stop-token", "none"])
        == 0
    )
    [expected] = _theirs(llama_folder, [[5, 17, 33]], 5)  # (this tokenizer adds no <s>)
    assert capsys.readouterr().out == _tokenizer(llama_folder).decode(expected) + "\n"


def test_an_imported_folder_generates_as_the_hugging_face_one(llama_folder, tmp_path, capsys):
    assert main(["import", "hf", str(llama_folder), "--out", str(tmp_path / "imported")]) == 0
    outputs = []
    for model in (llama_folder, tmp_path / "imported"):
        capsys.readouterr()
        assert main(["generate", str(model), "--prompt", "w9 w8 w7", "--max-new-tokens", "6"]) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] and outputs[0].strip()


def test_refusals_are_one_error_line(neox_folder, tmp_path, capsys):
    def error(*args) -> str:
        assert main(["generate", *args]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and "\n" not in err, err
        return err

    assert "no such folder" in error(str(tmp_path / "missing"), "--prompt", "hi")
    bert = transformers.BertConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=256,
        max_position_embeddings=64,
    )
    transformers.BertModel(bert).save_pretrained(tmp_path / "bert")
    shutil.copy(neox_folder / "tokenizer.json", tmp_path / "bert")
    capsys.readouterr()  # transformers' progress bar
    assert "takes a decoder" in error(str(tmp_path / "bert"), "--prompt", "hi")
    assert "--prompt or --input" in error(str(neox_folder))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "w1"}\n{"text": "w2"}\n')
    assert f"{bad} line 2" in error(str(neox_folder), "--input", str(bad), "--out", str(tmp_path / "o.jsonl"))
    assert not (tmp_path / "o.jsonl").exists()
    assert "--max-new-tokens" in error(str(neox_folder), "--prompt", "w1", "--max-new-tokens", "500")
    assert error(str(neox_folder), "--prompt", "") == "error: --prompt is empty: give the text to complete"
    (tmp_path / "empty.jsonl").write_text('{"prompt": "w1"}\n{"prompt": ""}\n')
    said = error(str(neox_folder), "--input", str(tmp_path / "empty.jsonl"))
    assert said == f"error: prompt {tmp_path / 'empty.jsonl'}:2: no tokens (an empty prompt)"
    with pytest.raises(UserError, match="top-p"):
        Sampling(top_p=0.0)


@pytest.mark.skipif(
    not (bf16_is_native(torch.device("cpu"))[0] and packing_runs()), reason="no native bf16 products in oneDNN here"
)
@pytest.mark.parametrize("family", ["neox", "llama"])
def test_a_bf16_decoder_packs_its_layers_and_completes_alike(family, request):
    """Where bf16 is native, a bf16 decoder's linear layers run with their weights packed for
    oneDNN, the output layer too unless it is tied to the embedding (which keeps its tensor):
    the logits of the same decoder with plain layers (bit for bit where measured so), the
    same greedy tokens; `pack=False` (a decoder torch.compile will take) packs nothing."""
    from frugality.kernels.packed_linear import PackedLinear, PackedOutputLayer
    from frugality.models.layers import OutputLayer

    exact = "amx_tile" not in cpu_flags()  # (as tests/kernels/test_packed_linear.py: AMX not compared)
    folder = request.getfixturevalue(f"{family}_folder")
    ids = torch.tensor([PROMPTS[0], PROMPTS[2][: len(PROMPTS[0])]])
    logits, tokens = {}, {}
    for pack in (True, False):
        decoder, why = load_decoder(folder, torch.device("cpu"), "bf16", pack=pack)
        assert ("weights packed for oneDNN" in why) == pack
        model = decoder.model
        linear = [m for m in model.modules() if isinstance(m, nn.Linear)]
        packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
        tied = model.output.weight is model.embed.weight if isinstance(model.output, nn.Linear) else False
        if pack:
            assert packed and linear == ([model.output] if tied else [])
            assert type(model.output) is (OutputLayer if tied else PackedOutputLayer)
        else:
            assert not packed and type(model.output) is OutputLayer
        with torch.inference_mode():
            logits[pack] = model(ids)
        engine = Engine(decoder, len(PROMPTS), cache_length(max(map(len, PROMPTS)), 6, decoder.max_seq_len))
        tokens[pack] = [c.tokens for c in engine.generate(PROMPTS, Sampling(max_new_tokens=6))]
    assert logits[True].shape == (2, len(PROMPTS[0]), model.config.vocab_size)
    if exact:
        assert torch.equal(logits[True], logits[False]) and tokens[True] == tokens[False]
    else:
        assert torch.allclose(logits[True].float(), logits[False].float(), rtol=2e-2, atol=2e-2)


def test_cuda_graph_trees_are_set_up_on_a_thread_of_its_own():
    """serve's decoding loop replays its CUDA graphs on a thread of its own: the graph trees'
    thread-local state is made there (torch before 2.13 asserted it was inherited)."""
    import threading

    import torch._inductor.cudagraph_trees  # noqa: F401 - (its own set-up made here, on the main thread)

    from frugality.inference.generate import replays_on_this_thread

    seen = []

    def loop():
        seen.append(torch._C._is_key_in_tls("tree_manager_containers"))
        replays_on_this_thread()
        replays_on_this_thread()  # (once is enough)
        seen.append(torch._C._is_key_in_tls("tree_manager_containers"))

    seen.append(torch._C._is_key_in_tls("tree_manager_containers"))  # (none yet on a new thread)
    thread = threading.Thread(target=loop)
    thread.start()
    thread.join()
    assert seen == [True, False, True]  # the main thread's, the new thread's before and after


def test_compile_is_refused_in_one_line_on_a_device_that_compiles_its_own_graphs():
    from frugality.errors import UserError
    from frugality.inference.generate import refuse_compile_where_traced

    refuse_compile_where_traced(torch.device("cpu"))  # (Inductor's, here)
    with pytest.raises(UserError) as refused:
        refuse_compile_where_traced(torch.device("xla"))
    assert str(refused.value) == "--compile: on an xla device XLA compiles the graphs itself; leave --compile out"
