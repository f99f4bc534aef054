"""Kernels dispatched by run-time detection: each needs its instruction sets, each can be
switched off by name, and a model trained with every kernel off (their torch fallbacks)
matches the same model with whichever kernels this machine runs."""

import copy

import pytest
import torch

from frugality import hardware, kernels
from frugality.config.recipe import OptimConfig
from frugality.errors import UserError
from frugality.kernels import attention, dispatch, gelu, linear
from frugality.kernels.specialize import specialize
from frugality.models import GPTNeoX, GPTNeoXConfig
from frugality.precision import resolve_policy
from frugality.runtime.optim import build_optimizer

ACCESSORS = {  # kernel name -> a call that returns its C function, or None
    "amx-linear": kernels.weight_grad_bf16,
    "amx-attention": kernels.attention_forward_bf16,
    "gelu": kernels.gelu_bf16,
    "cross-entropy": lambda: kernels.cross_entropy("f32"),
    "adamw": kernels.adamw_bf16_step,
    "transpose": kernels.transpose_2byte,
    "encoder-attention": kernels.encoder_attention_forward,
    "layer-norm": kernels.add_layer_norm,
    "int8-linear": kernels.int8_quantize_rows,
}


def _forget_kernel_trials(monkeypatch):
    """The kernels' one-time trials are cached per process; start them afresh."""
    monkeypatch.setattr(linear, "_KERNEL_TRIED", {})
    monkeypatch.setattr(attention, "_KERNEL_TRIED", {})
    monkeypatch.setattr(gelu, "_KERNEL_TRIED", {})


def test_every_kernel_is_known_to_dispatch():
    assert set(ACCESSORS) == set(dispatch.KERNELS)


@pytest.mark.c_kernel
@pytest.mark.parametrize("name", sorted(dispatch.KERNELS))
def test_each_kernel_can_be_switched_off_by_name(monkeypatch, name):
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", f"{name}, ")
    assert dispatch.allowed(name) == (False, f"{name} switched off by the environment")
    assert ACCESSORS[name]() is None
    others = [n for n in dispatch.KERNELS if n != name and not dispatch.KERNELS[n][1]]
    assert all(dispatch.allowed(n)[0] for n in others)  # the portable ones stay on


def test_all_off_and_unknown_names(monkeypatch):
    monkeypatch.setenv("FRUGALITY_NO_C_KERNEL", "1")
    assert all(ACCESSORS[n]() is None for n in dispatch.KERNELS)
    monkeypatch.delenv("FRUGALITY_NO_C_KERNEL")
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "all")
    assert dispatch.disabled() == set(dispatch.KERNELS)
    monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", "gelu,amx_linear")
    with pytest.raises(UserError, match="unknown kernel.*amx_linear"):
        dispatch.allowed("gelu")


@pytest.mark.c_kernel
def test_a_kernel_whose_instruction_sets_are_missing_is_not_offered(monkeypatch):
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"avx2", "fma"})
    hw = hardware._probe_cpu.__wrapped__(2, "", "")
    monkeypatch.setattr(dispatch, "probe", lambda device="cpu": hw)
    for name in ("amx-linear", "amx-attention", "gelu"):
        ok, why = dispatch.allowed(name)
        assert not ok and "which this CPU lacks" in why and ACCESSORS[name]() is None
    assert dispatch.allowed("cross-entropy") == (True, "")
    assert dispatch.allowed("encoder-attention") == (True, "")
    monkeypatch.setattr(hardware, "cpu_flags", lambda: {"sse4_2"})
    hw = hardware._probe_cpu.__wrapped__(2, "", "")
    ok, why = dispatch.allowed("encoder-attention")
    assert not ok and "avx2" in why and ACCESSORS["encoder-attention"]() is None


@pytest.mark.parametrize("precision", ["fp32", "bf16-sr"])
def test_training_with_every_kernel_off_matches_the_kernels_here(monkeypatch, precision):
    """Two steps of a small model, specialized with this machine's kernels and with none."""
    cpu = torch.device("cpu")
    policy = resolve_policy(precision, cpu)[0]
    torch.manual_seed(0)
    base = policy.prepare_model(
        GPTNeoX(GPTNeoXConfig(hidden_size=64, num_layers=2, num_heads=2, vocab_size=512, max_seq_len=64))
    )
    tokens = torch.randint(0, 512, (2, 65), generator=torch.Generator().manual_seed(3))
    results = {}
    for setting in ("", "all"):
        monkeypatch.setenv("FRUGALITY_DISABLE_KERNELS", setting)
        _forget_kernel_trials(monkeypatch)
        model = copy.deepcopy(base)
        specialize(model, cpu, policy)
        optimizer = build_optimizer(model, OptimConfig(lr=1e-2), policy, seed=1)
        losses, grads = [], {}
        for step in range(2):
            loss = model(tokens[:, :-1], targets=tokens[:, 1:])
            loss.backward()
            if step == 0:  # Adam's first step is +-lr wherever a gradient is nonzero: compare these
                grads = {n: p.grad.float() for n, p in model.named_parameters()}
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
        results[setting] = losses, grads
    (fast_losses, fast), (plain_losses, plain) = results[""], results["all"]
    tolerance = 1e-5 if precision == "fp32" else 2e-2
    assert fast_losses == pytest.approx(plain_losses, rel=tolerance)
    for key in plain:
        error = (fast[key] - plain[key]).norm() / plain[key].norm().clamp(min=1e-12)
        assert error < tolerance * 3, key
