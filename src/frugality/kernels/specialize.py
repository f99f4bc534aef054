"""Fit a plain model to the device and precision it trains in, from outside the model.

The model files are plain single-device PyTorch (nn.Linear, nn.GELU, SDPA attention, an
output layer with a textbook loss). `specialize` swaps in, layer by layer, the faster
versions this machine can run, the way torchao swaps float8 linears in: each replacement
is a subclass of the plain layer with the same parameters and state dict, so checkpoints,
interop and the distributed wrappers see the same model. What is chosen depends on the
device, the precision policy and the instruction sets found at run time
(`frugality.kernels.dispatch`); every choice is reported for the run header.
"""

from __future__ import annotations

from typing import TypeVar, cast

import torch
from torch import nn

from frugality.kernels.attention import CPUCausalAttention, ProductRotaryEmbedding, amx_attention_applies
from frugality.kernels.fp32_products import Fp32ProductLinear
from frugality.kernels.gelu import KernelGELU
from frugality.kernels.gelu import kernel_runs as gelu_runs
from frugality.kernels.linear import AMXLinear
from frugality.kernels.linear import amx_kernel_runs as amx_linear_runs
from frugality.kernels.output_loss import FusedOutputLayer
from frugality.models.layers import CausalAttention, OutputLayer, RotaryEmbedding

M = TypeVar("M", bound=nn.Module)


def specialize(model: nn.Module, device: torch.device, policy, training: bool = True) -> list[str]:
    """Swap the faster layers in, in place; returns one phrase per kind of choice made.
    `policy`: a resolved frugality.precision.PrecisionPolicy."""
    cpu = device.type == "cpu"
    bf16 = policy.storage_dtype == torch.bfloat16
    counts: dict[str, int] = {}

    def swap(module: nn.Module, cls: type[M], label: str) -> M:
        module.__class__ = cls
        counts[label] = counts.get(label, 0) + 1
        return cast(M, module)  # the same module, now of `cls`

    for module in model.modules():
        kind = type(module)
        if kind is OutputLayer and training and device.type != "xla":  # XLA fuses the plain loss itself
            fused = swap(module, FusedOutputLayer, "fused output-layer loss")
            fused.compute_dtype = torch.float32 if policy.fp32_products else None
        elif kind is nn.Linear and policy.fp32_products:  # any device without native bf16 products
            swap(module, Fp32ProductLinear, "linear layers: fp32 products from bf16 operands")
        elif kind is CausalAttention and policy.fp32_products:
            attention = swap(module, CPUCausalAttention, "attention: fp32 from bf16 operands")
            attention.fp32_products = True
        elif not cpu:
            continue
        elif kind is nn.Linear:
            if bf16 and amx_linear_runs():
                swap(module, AMXLinear, "linear layers: AMX kernels")
        elif kind is nn.GELU and module.approximate == "none" and bf16 and gelu_runs():
            swap(module, KernelGELU, "GELU: AVX-512 kernel")
        elif kind is CausalAttention:
            probe = torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16)
            amx = bf16 and amx_attention_applies(probe, probe, probe)
            swap(
                module,
                CPUCausalAttention,
                "attention: AMX kernel" if amx else "attention: SDPA, blocked backward when compiled",
            )
        elif kind is RotaryEmbedding and not policy.fp32_products:
            swap(module, ProductRotaryEmbedding, "rotary: half swap as a product").specialize()
    return [f"{label} ({n})" if n > 1 else label for label, n in counts.items()]
