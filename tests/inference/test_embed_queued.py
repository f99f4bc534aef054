"""A GPU's way of embedding (`batches.in_bulk`): every batch's vectors left on the device and
copied back once, against each batch copied back as it ends. A BERT of random weights with
the bundled tokenizer, built here (the GPU check's image has no model to read)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def encoder_folder(tmp_path_factory):
    from frugality.data.tokenizer import shipped_tokenizer_dir

    folder = tmp_path_factory.mktemp("bert")
    config = transformers.BertConfig(
        vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64
    )
    torch.manual_seed(0)
    transformers.BertModel(config).save_pretrained(folder)
    tokenizer = transformers.BertTokenizerFast(
        tokenizer_file=str(shipped_tokenizer_dir("bert-uncased") / "tokenizer.json")
    )
    tokenizer.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_batches_queued_on_the_device_and_copied_back_at_once_get_the_same_vectors(monkeypatch, encoder_folder, device):
    from frugality.inference import batches
    from frugality.inference.encoder import load_encoder

    assert not batches.in_bulk(torch.device("cpu")) and not batches.in_bulk(torch.device("meta"))
    encoder, _ = load_encoder(encoder_folder, torch.device(device), "fp32")
    texts = [" ".join(["word"] * (1 + i % 9)) + f" number {i}" for i in range(23)]  # mixed lengths
    monkeypatch.setattr(batches, "in_bulk", lambda device: False)
    each = batches.embed_texts(encoder, texts, 64, 8)  # several batches
    monkeypatch.setattr(batches, "in_bulk", lambda device: True)
    monkeypatch.setattr(encoder, "embed_tokens", lambda *a: pytest.fail("a batch copied back alone"))
    queued = batches.embed_texts(encoder, texts, 64, 8)
    assert queued.shape == (23, 32) and np.array_equal(queued, each)
