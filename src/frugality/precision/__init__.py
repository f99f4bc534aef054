"""Precision policies: how weights, gradients and optimizer state are stored, and in which
dtype the matrix products run.

| policy     | weights + grads | Adam moments | compute            | bytes / parameter |
|------------|-----------------|--------------|--------------------|-------------------|
| `fp32`     | fp32            | fp32         | fp32               | 16                |
| `amp-bf16` | fp32            | fp32         | bf16 autocast      | 16                |
| `amp-fp16` | fp32            | fp32         | fp16 autocast, dynamic loss scaling | 16   |
| `bf16-sr`  | bf16            | bf16         | bf16               | 8                 |
| `bf16`     | bf16            | bf16         | bf16               | 8                 |
| `fp8`      | fp32            | fp32         | fp8 linears (torchao), bf16 elsewhere | 16 |

`bf16-sr` and `bf16` differ only in how the optimizer writes its float32 result back:
stochastic rounding (unbiased, so updates far below a bf16 step still accumulate) or
round-to-nearest (kept to show what stochastic rounding buys).

`auto` (the default) is the fastest policy the hardware runs natively: bf16-sr where bf16
products are native (AMX, AVX512-BF16, CUDA compute capability 8.0+), amp-fp16 on CUDA GPUs
with fp16 tensor cores but no bf16 (compute capability 7.x: V100, T4, the cheapest cloud
GPUs), fp32 elsewhere; see `frugality.hardware`. `amp-fp16` is Lightning's `16-mixed` and
Hugging Face's `fp16=True`; its loss scaling is `frugality.precision.loss_scale`.

On hardware without native bf16 products, `bf16-sr` and `bf16` keep their bf16 storage
(and its memory saving) but compute each product in fp32 from the bf16 operands, and
`amp-bf16` runs its products in fp32: torch's emulated bf16 products there are hundreds of
times slower than fp32 ones.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, TypeVar

import torch
from torch import nn

from frugality.backends import backend
from frugality.config.recipe import PRECISIONS as RECIPE_PRECISIONS
from frugality.errors import UserError
from frugality.hardware import probe

if TYPE_CHECKING:
    from frugality.precision.bf16_adamw import Rounding

M = TypeVar("M", bound=nn.Module)

AUTO = "auto"  # resolved by `resolve_policy` from what the hardware runs natively
PRECISIONS = tuple(name for name in RECIPE_PRECISIONS if name != AUTO)  # the policies themselves


@dataclass(frozen=True)
class PrecisionPolicy:
    name: str
    storage_dtype: torch.dtype  # weights, gradients and optimizer moments
    compute_dtype: torch.dtype  # what the matrix products run in (the MFU peak's dtype)
    autocast: bool  # autocast to compute_dtype over higher-precision storage
    rounding: Rounding | None  # for bf16 storage: "stochastic" or "nearest"
    # bf16 storage on hardware without native bf16 products: each product upcasts its bf16
    # operands and runs in float32 (compute_dtype is then float32)
    fp32_products: bool = False
    loss_scaling: bool = False  # fp16: the loss scaled up before backward (frugality.precision.loss_scale)

    @property
    def graph_dtype(self) -> torch.dtype:
        """bf16 where any tensor of the compiled blocks is (storage or products), else fp32."""
        return torch.bfloat16 if torch.bfloat16 in (self.storage_dtype, self.compute_dtype) else self.compute_dtype

    @property
    def key(self) -> str:
        """The policy as it runs, for cache keys and file names (no spaces)."""
        return self.label.replace(" (", "+").replace(")", "").replace(" ", "-")

    @property
    def label(self) -> str:
        """The name, and the compute mode where it differs from the policy's usual one."""
        return (
            f"{self.name} (fp32 products)"
            if self.fp32_products or (self.name == "amp-bf16" and not self.autocast)
            else self.name
        )

    @property
    def state_bytes_per_param(self) -> int:
        """Weights + gradients + two Adam moments, in bytes per parameter."""
        return 4 * torch.empty((), dtype=self.storage_dtype).element_size()

    def check_device(self, device: torch.device) -> None:
        if self.name == "fp8":
            _check_fp8(device)
        kind = backend(device)
        if self.name == "amp-fp16" and not (kind.on_host or kind.compute_capability() is not None):
            raise UserError(
                f"precision amp-fp16 is for CUDA GPUs without bf16 (T4, V100), not {device.type} devices: "
                "use auto or amp-bf16"
            )

    def prepare_model(self, model: M) -> M:
        """Cast (bf16 storage) or convert (fp8 linears) a model built in float32."""
        if self.storage_dtype != torch.float32:
            model = model.to(self.storage_dtype)
        if self.name == "fp8":
            model = _to_float8(model)
        return model

    def autocast_context(self, device: torch.device):
        if self.autocast:
            return torch.autocast(device.type, dtype=self.compute_dtype)
        return contextlib.nullcontext()


_POLICIES = {
    "fp32": PrecisionPolicy("fp32", torch.float32, torch.float32, False, None),
    "amp-bf16": PrecisionPolicy("amp-bf16", torch.float32, torch.bfloat16, True, None),
    "amp-fp16": PrecisionPolicy("amp-fp16", torch.float32, torch.float16, True, None, loss_scaling=True),
    "bf16-sr": PrecisionPolicy("bf16-sr", torch.bfloat16, torch.bfloat16, False, "stochastic"),
    "bf16": PrecisionPolicy("bf16", torch.bfloat16, torch.bfloat16, False, "nearest"),
    "fp8": PrecisionPolicy("fp8", torch.float32, torch.bfloat16, True, None),
}


def get_policy(name: str) -> PrecisionPolicy:
    try:
        return _POLICIES[name]
    except KeyError:
        raise UserError(f"precision {name!r}: choose one of {', '.join(PRECISIONS)}") from None


# What `auto` trains in, by whether bf16 products are native: the one answer for training,
# the memory plan (which plans for hardware with native bf16) and, through `bf16_is_native`,
# inference. CUDA GPUs with fp16 tensor cores but no bf16 ones: FP16_AUTO.
AUTO_POLICY = {True: "bf16-sr", False: "fp32"}
FP16_AUTO = "amp-fp16"
FP16_TENSOR_CORES = (7, 0)  # Volta; Pascal's fp16 is slow on all but the P100


def bf16_is_native(device: torch.device) -> tuple[bool, str]:
    """The decision behind every `auto`: whether bf16 products run at hardware speed on
    `device` (AMX, AVX512-BF16, CUDA 8.0+), and why."""
    hw = probe(device)
    return hw.native_bf16, hw.why


def resolve_policy(name: str, device: torch.device) -> tuple[PrecisionPolicy, str]:
    """The policy `train.precision` names, fitted to `device`, and one line saying what was
    chosen and why (for the run header)."""
    native, why = bf16_is_native(device)
    if name == AUTO:
        name = AUTO_POLICY[native]
        note = f"precision auto -> {name}: bf16 products {'native' if native else 'not native'} ({why})"
        if not native and _fp16_tensor_cores(device):
            name = FP16_AUTO
            note = f"precision auto -> {name}: no bf16 tensor cores ({why}), fp16 ones with dynamic loss scaling"
        return get_policy(name), note
    policy = get_policy(name)
    policy.check_device(device)
    if name == "amp-fp16" and not _fp16_tensor_cores(device):
        where = "on this CPU" if backend(device).on_host else "on this GPU (no fp16 tensor cores)"
        return policy, (
            f"precision amp-fp16: fp16 products are emulated {where}, many times slower than fp32 "
            "(amp-fp16 is for CUDA GPUs of compute capability 7.x: T4, V100)"
        )
    if native or policy.compute_dtype != torch.bfloat16 or name == "fp8":
        return policy, f"precision {name}"
    if policy.autocast:  # amp-bf16: autocast to bf16 here would emulate every product
        return (
            replace(policy, compute_dtype=torch.float32, autocast=False),
            f"precision amp-bf16: products run in fp32, not bf16 autocast ({why}; bf16 would be "
            "hundreds of times slower); use fp32 or auto here",
        )
    return (
        replace(policy, compute_dtype=torch.float32, fp32_products=True),
        f"precision {name}: bf16 weights, gradients and optimizer state, products computed in fp32 "
        f"from the bf16 operands ({why})",
    )


def _fp16_tensor_cores(device: torch.device) -> bool:
    capability = backend(device).compute_capability()
    return capability is not None and capability >= FP16_TENSOR_CORES


def apply_tf32(device: torch.device, enabled: bool) -> str | None:
    """Set whether fp32 matrix products on `device` run in TF32 (`train.tf32`), where the
    GPU has TF32 (compute capability 8.0+); the header's line saying which, or None where
    TF32 does not exist. TF32 keeps fp32's range with a 10-bit mantissa; PyTorch leaves it
    off by default for matmuls; JAX and TensorFlow turn it on."""
    capability = backend(device).compute_capability()
    if capability is None or capability < (8, 0):
        return None
    # the API every torch >= 1.12 has, and that Inductor's autotuning reads (setting the newer
    # `matmul.fp32_precision` alone makes `get_float32_matmul_precision` raise); cuDNN's
    # convolutions keep PyTorch's default (TF32), and frugality's models have none
    torch.set_float32_matmul_precision("high" if enabled else "highest")
    if enabled:
        return "tf32: fp32 matrix products in TF32 (train.tf32 = false keeps full fp32, for parity runs)"
    return "tf32: off (train.tf32 = false): fp32 matrix products in full fp32"


def _check_fp8(device: torch.device) -> None:
    if backend(device).compute_capability() is None:
        raise UserError(
            f"precision fp8 needs a CUDA GPU of compute capability 8.9 or later (Ada, Hopper, "
            f"Blackwell); this run is on {device.type}. Use bf16-sr or amp-bf16 here."
        )
    capability = torch.cuda.get_device_capability(device)
    if capability < (8, 9):
        raise UserError(
            f"precision fp8 needs compute capability 8.9 or later; "
            f"{torch.cuda.get_device_name(device)} has {capability[0]}.{capability[1]}"
        )
    try:
        import torchao.float8  # noqa: F401
    except ImportError:
        raise UserError("precision fp8 uses torchao's float8 training: pip install torchao") from None


def float8_eligible(module: nn.Module, fqn: str) -> bool:
    """Whether fp8 converts this module (`fqn`: its name in the model) to a float8 linear:
    float8 matmuls need both dimensions divisible by 16; the output layer stays bf16 (its
    gradient is the most precision-sensitive, as in torchao's own recipes)."""
    return (
        isinstance(module, nn.Linear)
        and fqn != "output"
        and module.in_features % 16 == 0
        and module.out_features % 16 == 0
    )


def _to_float8(model: M) -> M:
    from torchao.float8 import convert_to_float8_training

    return convert_to_float8_training(model, module_filter_fn=float8_eligible)
