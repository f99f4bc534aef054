"""The kernel swap against the plain model: same parameters and state dict, same loss and
gradients (up to rounding order) in every precision policy, on whatever CPU this is; and
model files that hold no device-specific code."""

import copy
import dataclasses
from pathlib import Path

import pytest
import torch
from torch import nn

import frugality.models
from frugality.kernels.specialize import specialize
from frugality.models import GPTNeoX, GPTNeoXConfig, Llama, LlamaConfig
from frugality.models.layers import CausalAttention, OutputLayer
from frugality.precision import get_policy, resolve_policy

CPU = torch.device("cpu")
NEOX = GPTNeoXConfig(hidden_size=64, num_layers=2, num_heads=2, vocab_size=512, max_seq_len=64)
LLAMA = LlamaConfig(
    hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=96, vocab_size=512, max_seq_len=64
)


def _policies():
    """Each policy as this machine resolves it, plus the bf16 ones forced to fp32 products
    (what a CPU without native bf16 runs) so that mode is tested on every machine."""
    out = []
    for name in ("fp32", "amp-bf16", "bf16-sr", "bf16"):
        out.append(pytest.param(resolve_policy(name, CPU)[0], id=name))
    for name in ("bf16-sr", "bf16"):
        forced = dataclasses.replace(get_policy(name), compute_dtype=torch.float32, fp32_products=True)
        out.append(pytest.param(forced, id=f"{name}-fp32-products"))
    return out


def _loss_and_grads(model, policy, tokens):
    model.zero_grad(set_to_none=True)
    with policy.autocast_context(CPU):
        loss = model(tokens[:, :-1], targets=tokens[:, 1:])
    loss.backward()
    return loss.detach().float(), {n: p.grad.float() for n, p in model.named_parameters()}


@pytest.mark.parametrize("policy", _policies())
@pytest.mark.parametrize("family", ["gpt-neox", "llama"])
def test_specialized_model_matches_the_plain_one(policy, family):
    torch.manual_seed(0)
    cls, cfg = (GPTNeoX, NEOX) if family == "gpt-neox" else (Llama, LLAMA)
    plain = policy.prepare_model(cls(cfg))
    fast = copy.deepcopy(plain)
    choices = specialize(fast, CPU, policy)
    assert choices and "fused output-layer loss" in choices
    assert fast.state_dict().keys() == plain.state_dict().keys()
    assert type(fast.output) is not OutputLayer and isinstance(fast.output, OutputLayer)
    if policy.fp32_products:
        assert any(c.startswith("linear layers: fp32 products") for c in choices)
        assert any(c.startswith("attention: fp32") for c in choices)
    tokens = torch.randint(0, cfg.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    loss_plain, grads_plain = _loss_and_grads(plain, policy, tokens)
    loss_fast, grads_fast = _loss_and_grads(fast, policy, tokens)
    bf16 = policy.storage_dtype == torch.bfloat16 or policy.autocast
    tolerance = 2e-2 if bf16 else 1e-5
    torch.testing.assert_close(loss_fast, loss_plain, rtol=tolerance / 4, atol=0)
    for name, grad in grads_plain.items():
        error = (grads_fast[name] - grad).norm() / grad.norm().clamp(min=1e-12)
        assert error < tolerance * 3, (name, error.item())


def test_fp32_products_save_only_bf16_for_backward_and_match_float64():
    from frugality.kernels.fp32_products import Fp32ProductLinear

    torch.manual_seed(0)
    layer = nn.Linear(48, 40).bfloat16()
    layer.__class__ = Fp32ProductLinear
    x = torch.randn(3, 8, 48).bfloat16().requires_grad_()
    grad = torch.randn(3, 8, 40).bfloat16()
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t.dtype) or t, lambda t: t):
        out = layer(x)
    assert out.dtype == torch.bfloat16 and set(saved) == {torch.bfloat16}
    out.backward(grad)
    x64, w64 = x.detach().double(), layer.weight.detach().double()
    exact = {
        "out": x64 @ w64.t() + layer.bias.double(),
        "x": grad.double() @ w64,
        "w": grad.double().flatten(0, 1).t() @ x64.flatten(0, 1),
        "b": grad.double().sum((0, 1)),
    }
    for got, key in ((out, "out"), (x.grad, "x"), (layer.weight.grad, "w"), (layer.bias.grad, "b")):
        assert got.dtype == torch.bfloat16
        assert ((got.double() - exact[key]).norm() / exact[key].norm()) < 2**-8, key


def test_without_training_the_output_layer_stays_plain_and_other_devices_get_only_the_loss():
    policy = get_policy("fp32")
    model = GPTNeoX(NEOX)
    specialize(model, CPU, policy, training=False)
    assert type(model.output) is OutputLayer
    meta = GPTNeoX(NEOX).to("meta")
    choices = specialize(meta, torch.device("meta"), policy)
    assert choices == ["fused output-layer loss"]
    assert all(
        type(m) in (nn.Linear, CausalAttention)
        for m in meta.modules()
        if isinstance(m, (nn.Linear, CausalAttention)) and not isinstance(m, OutputLayer)
    )


def test_model_files_hold_no_device_specific_code():
    models = Path(frugality.models.__file__).parent
    for source in models.glob("*.py"):
        text = source.read_text()
        assert "frugality.kernels" not in text.replace("`frugality.kernels", ""), source.name
        assert "frugality import kernels" not in text and ".device.type ==" not in text, source.name
