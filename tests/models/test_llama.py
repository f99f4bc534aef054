"""The Llama model computes what transformers' LlamaForCausalLM computes."""

import re

import pytest
import torch

from frugality.models.llama import Llama, LlamaConfig

transformers = pytest.importorskip("transformers")

_NAMES = [
    ("attn_norm", "input_layernorm"),
    ("mlp_norm", "post_attention_layernorm"),
    ("attn.q", "self_attn.q_proj"),
    ("attn.k", "self_attn.k_proj"),
    ("attn.v", "self_attn.v_proj"),
    ("attn.o", "self_attn.o_proj"),
    ("mlp.gate", "mlp.gate_proj"),
    ("mlp.up", "mlp.up_proj"),
    ("mlp.down", "mlp.down_proj"),
]


def _to_hf(name: str) -> str:
    top = {
        "embed.weight": "model.embed_tokens.weight",
        "final_norm.weight": "model.norm.weight",
        "output.weight": "lm_head.weight",
    }
    if name in top:
        return top[name]
    i, rest = re.match(r"layers\.(\d+)\.(.+)\.weight", name).groups()
    return f"model.layers.{i}.{dict(_NAMES)[rest]}.weight"


@pytest.mark.parametrize("kv_heads,tie", [(4, False), (2, True), (1, False)])
def test_logits_match_transformers(kv_heads, tie):
    cfg = LlamaConfig(
        hidden_size=64,
        num_layers=2,
        num_heads=4,
        num_kv_heads=kv_heads,
        intermediate_size=96,
        vocab_size=300,
        max_seq_len=64,
        rope_theta=50000.0,
        rms_norm_eps=1e-5,
        tie_embeddings=tie,
    )
    torch.manual_seed(0)
    ours = Llama(cfg).eval()
    hf_cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        intermediate_size=96,
        vocab_size=300,
        max_position_embeddings=64,
        rms_norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
        tie_word_embeddings=tie,
    )
    hf_cfg._attn_implementation = "eager"
    theirs = transformers.LlamaForCausalLM(hf_cfg).eval()
    state = {_to_hf(k): v for k, v in ours.state_dict().items()}
    missing, unexpected = theirs.load_state_dict(state, strict=False)
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tie else set())
    if tie:
        assert theirs.lm_head.weight.data_ptr() == theirs.model.embed_tokens.weight.data_ptr()
    tokens = torch.randint(0, 300, (2, 64))
    with torch.no_grad():
        assert (ours(tokens) - theirs(tokens).logits).abs().max().item() <= 1e-4


def test_llama_config_rejects_bad_grouping():
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        LlamaConfig(hidden_size=64, num_layers=1, num_heads=4, num_kv_heads=3, intermediate_size=8)
