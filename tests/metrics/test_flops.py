import torch

from frugality.hardware import measure_product_rate
from frugality.metrics.flops import non_embedding_params, training_flops_per_token
from frugality.models import GPTNeoX, GPTNeoXConfig


def test_pythia_70m_counts():
    cfg = GPTNeoXConfig(hidden_size=512, num_layers=6, num_heads=8)
    with torch.device("meta"):
        model = GPTNeoX(cfg)
    d, f, v, layers = 512, 2048, 50304, 6
    per_layer = (3 * d * d + 3 * d) + (d * d + d) + (d * f + f) + (f * d + d) + 4 * d
    expected = layers * per_layer + 2 * d + d * v  # + final norm + output layer; no input embedding
    assert non_embedding_params(model) == expected
    assert sum(p.numel() for p in model.parameters()) == expected + v * d  # 70,426,624 in all
    assert expected + v * d == 70_426_624  # the published Pythia-70m size
    assert training_flops_per_token(model, layers, d, 2048) == 6 * expected + 12 * layers * d * 2048
    assert training_flops_per_token(model, layers, d, 2048) == 343_523_328  # as docs/training.md says


def test_a_tied_embedding_counts_once_as_the_output_product():
    from frugality.models import Bert, BertConfig, Llama, LlamaConfig

    with torch.device("meta"):
        tied = Llama(
            LlamaConfig(
                hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=1000, tie_embeddings=True
            )
        )
        untied = Llama(LlamaConfig(hidden_size=64, num_layers=2, num_heads=4, intermediate_size=128, vocab_size=1000))
        bert = Bert(
            BertConfig(
                hidden_size=64,
                num_layers=1,
                num_heads=4,
                intermediate_size=128,
                vocab_size=1000,
                mlm_head=True,
                pooler=False,
            )
        )
    assert non_embedding_params(tied) == non_embedding_params(untied)  # the output product is there either way
    tables = 512 * 64 + 2 * 64  # positions, token types: lookups only
    assert non_embedding_params(bert) == sum(p.numel() for p in bert.parameters()) - tables


def test_the_product_probe_is_2n3_over_the_median_call_and_measured_once_per_machine(monkeypatch, tmp_path):
    """Five timed calls after a warm-up; the median call's time (not the best one) divides
    2 n^3; the rate is cached per machine."""
    import frugality.hardware as hardware

    calls = iter([0.0, 1.0, 1.0, 1.5, 2.0, 2.0, 3.0, 3.25, 4.0, 6.0])  # call times 1, 0.5, 0, 0.25, 2
    monkeypatch.setattr(hardware, "_clock", lambda: next(calls))
    flops = measure_product_rate(torch.device("cpu"), torch.float32, size=16)
    assert flops == 2 * 16**3 / 0.5  # the median of 1, 0.5, 0, 0.25, 2
    monkeypatch.setenv("FRUGALITY_CACHE", str(tmp_path))
    measured = []
    monkeypatch.setattr(hardware, "measure_product_rate", lambda d, t, size=None: measured.append(t) or 1e9)
    assert hardware.product_rate(torch.device("cpu"), torch.float32) == 1e9
    assert hardware.product_rate(torch.device("cpu"), torch.float32) == 1e9 and measured == [torch.float32]
    assert [p.name for p in tmp_path.iterdir()] == ["products.json"]
