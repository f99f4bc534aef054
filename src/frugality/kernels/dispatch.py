"""Which of frugality's C kernels may run here: each needs its instruction sets (found at
run time by `frugality.hardware`, within any ONEDNN_MAX_CPU_ISA / ATEN_CPU_CAPABILITY
limit) and can be switched off by name.

    FRUGALITY_DISABLE_KERNELS=amx-linear,gelu   # these take their torch fallback
    FRUGALITY_NO_C_KERNEL=1                     # every C kernel off

Each kernel's fallback gives the same results up to float32 accumulation order; the
tests run every fallback on every machine and compare it with the kernel where it runs.
"""

from __future__ import annotations

import os

from frugality.errors import UserError
from frugality.hardware import probe

# name -> (what it does, the CPU features it needs: all of them)
KERNELS: dict[str, tuple[str, tuple[str, ...]]] = {
    "amx-linear": (
        "linear layers' bf16 products (forward, weight and wide input gradients)",
        ("amx_tile", "amx_bf16", "avx512_bf16"),
    ),
    "amx-attention": ("causal attention in bf16, rotary included", ("amx_tile", "amx_bf16", "avx512_bf16")),
    "gelu": ("exact GELU and its gradient in bf16", ("avx512f", "avx512bw", "avx512_bf16")),
    "cross-entropy": ("the output layer's loss and logit gradient, row by row", ()),
    "adamw": ("BF16AdamW's update and gradient norm", ()),
    "transpose": ("2-byte transposes before the output layer's bf16 products", ()),
    "encoder-attention": ("an encoder's bidirectional attention at inference, fp32 or bf16", ("avx2",)),
    "layer-norm": ("an encoder's residual adds and LayerNorms at inference, fp32 or bf16", ("avx2",)),
    "int8-linear": ("the quantize and scale-back passes around --precision int8's products", ("avx2",)),
}


def disabled() -> set[str]:
    """The kernels switched off by FRUGALITY_DISABLE_KERNELS (or all, by FRUGALITY_NO_C_KERNEL)."""
    if os.environ.get("FRUGALITY_NO_C_KERNEL"):
        return set(KERNELS)
    names = {n.strip() for n in os.environ.get("FRUGALITY_DISABLE_KERNELS", "").split(",") if n.strip()}
    if "all" in names:
        return set(KERNELS)
    unknown = names - set(KERNELS)
    if unknown:
        raise UserError(
            f"FRUGALITY_DISABLE_KERNELS: unknown kernel(s) {', '.join(sorted(unknown))}; "
            f"known: {', '.join(KERNELS)}, all"
        )
    return names


def allowed(name: str) -> tuple[bool, str]:
    """Whether kernel `name` may run on this CPU, and if not, why (for skips and headers).
    Whether it then builds and runs is for its caller to try."""
    if name in disabled():
        return False, f"{name} switched off by the environment"
    missing = [f for f in KERNELS[name][1] if not probe("cpu").has(f)]
    if missing:
        return False, f"{name} needs {', '.join(missing)}, which this CPU lacks (or a limit hides)"
    return True, ""


def skip_reason(name: str) -> str:
    """Why kernel `name` does not run here: switched off, missing instruction sets, or (where
    it may run) no C compiler or no OS permission for AMX."""
    return allowed(name)[1] or f"{name} is allowed here but did not build or run (C compiler, OS permission)"
