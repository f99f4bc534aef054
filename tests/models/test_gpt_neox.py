"""The GPT-NeoX model computes what transformers' GPTNeoXForCausalLM computes."""

import pytest
import torch

from frugality.interop.hf_gpt_neox import config_to_hf, from_hf, to_hf
from frugality.models import GPTNeoX, GPTNeoXConfig

transformers = pytest.importorskip("transformers")


def _hf_model(cfg: GPTNeoXConfig, attn: str = "eager"):
    config = transformers.GPTNeoXConfig(**{k: v for k, v in config_to_hf(cfg).items() if k != "architectures"})
    config._attn_implementation = attn
    return transformers.GPTNeoXForCausalLM(config).eval()


@pytest.mark.parametrize(
    "arch",
    [
        dict(hidden_size=64, num_layers=2, num_heads=4),  # Pythia shape: rotary on 25%
        dict(hidden_size=96, num_layers=3, num_heads=3, rotary_pct=1.0, parallel_residual=False),
        dict(hidden_size=128, num_layers=2, num_heads=2, intermediate_size=200, rotary_base=500.0),
    ],
)
def test_logits_match_transformers_both_ways(arch):
    cfg = GPTNeoXConfig(vocab_size=503, max_seq_len=96, **arch)
    torch.manual_seed(0)
    ours = GPTNeoX(cfg).eval()
    tokens = torch.randint(0, cfg.vocab_size, (2, 96))

    # ours -> transformers
    theirs = _hf_model(cfg)
    theirs.load_state_dict(to_hf(ours.state_dict(), output_name="lm_head.weight"), strict=True)
    with torch.no_grad():
        diff = (ours(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4

    # transformers (its own random init) -> ours
    torch.manual_seed(1)
    theirs = _hf_model(cfg)
    fresh = GPTNeoX(cfg).eval()
    fresh.load_state_dict(from_hf(theirs.state_dict()), strict=True)
    with torch.no_grad():
        diff = (fresh(tokens) - theirs(tokens).logits).abs().max().item()
    assert diff <= 1e-4


def test_loads_a_save_pretrained_checkpoint_from_disk(tmp_path):
    """The on-disk names (embed_out.weight, safetensors) map too, not just live modules'."""
    from safetensors.torch import load_file

    cfg = GPTNeoXConfig(hidden_size=64, num_layers=2, num_heads=4, vocab_size=300, max_seq_len=32)
    torch.manual_seed(2)
    theirs = _hf_model(cfg, attn="sdpa")
    theirs.save_pretrained(tmp_path)
    on_disk = load_file(tmp_path / "model.safetensors")
    assert "embed_out.weight" in on_disk or "lm_head.weight" in on_disk
    ours = GPTNeoX(cfg).eval()
    ours.load_state_dict(from_hf(on_disk), strict=True)
    tokens = torch.randint(0, 300, (3, 32))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4


def test_config_rejects_impossible_shapes():
    with pytest.raises(ValueError, match="divisible by num_heads"):
        GPTNeoXConfig(hidden_size=100, num_layers=1, num_heads=3)
    with pytest.raises(ValueError, match="odd number of rotary channels"):
        GPTNeoXConfig(hidden_size=40, num_layers=1, num_heads=4, rotary_pct=0.5)  # 10 * 0.5 = 5


def test_initialisation_follows_gpt_neox():
    cfg = GPTNeoXConfig(hidden_size=256, num_layers=4, num_heads=4, vocab_size=1000)
    torch.manual_seed(0)
    model = GPTNeoX(cfg)
    small, wang = (2 / (5 * 256)) ** 0.5, 2 / (4 * 256**0.5)
    assert model.layers[0].attn.qkv.weight.std().item() == pytest.approx(small, rel=0.05)
    assert model.layers[0].mlp.down.weight.std().item() == pytest.approx(wang, rel=0.05)
    assert torch.count_nonzero(model.layers[0].attn.qkv.bias) == 0
    assert torch.all(model.final_norm.weight == 1)


def test_too_long_input_is_refused():
    cfg = GPTNeoXConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=10, max_seq_len=8)
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        GPTNeoX(cfg)(torch.zeros(1, 9, dtype=torch.long))
