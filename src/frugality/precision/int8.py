"""int8 inference on CPUs: a model's linear layers swapped, from outside the model, for
layers whose weights are quantized once per output channel and whose activations are
quantized per token (row) at run time; the products run int8 x int8 -> int32 in oneDNN
through `torch._int_mm`, and are scaled back to float32. Attention, norms, embeddings and
pooling stay in float32.

Why these choices (benchmarks/int8_linear.py, 2026-11-25, AMD EPYC Zen 4):
- per-token activation scales keep all-MiniLM-L6-v2's embeddings at cosine 0.997 to fp32;
  one scale for the whole batch (FBGEMM's dynamic quantization, 7-bit) fell to 0.949;
- PyTorch sends `torch._int_mm` to oneDNN only where the CPU has AVX512-VNNI (AMX CPUs have
  it too). Elsewhere a reference loop runs it 35-40x slower than fp32, and under an
  `ONEDNN_MAX_CPU_ISA` cap below VNNI oneDNN returns wrong products: int8 is refused there
  (`int8_products`), never run slowly or wrongly;
- the quantize and scale-back passes around each product are fused by torch.compile
  (Inductor) into one pass each, with dynamic shapes: a few graphs serve every row count
  (Dynamo compiles again for a new kind of input: a row count of 1, inference tensors
  against normal ones; past its limit of 8, new kinds run eagerly, never wrongly). Where
  Inductor cannot build (no C++ compiler, no Python headers) the passes run eagerly, with
  a warning: 1.7x fp32 end to end in an ad-hoc probe, against 2.2x compiled
  (benchmarks/int8_onnxruntime.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from frugality.backends import backend
from frugality.errors import UserError
from frugality.hardware import cpu_flags, onednn_capped_below


def int8_products() -> tuple[bool, str]:
    """Whether this CPU runs int8 products fast and right through `torch._int_mm`, and why.
    PyTorch sends `_int_mm` to oneDNN by the CPU's own flags (not ATEN_CPU_CAPABILITY), and
    oneDNN honours ONEDNN_MAX_CPU_ISA: both are what count here."""
    flags = cpu_flags()
    capped = onednn_capped_below("AVX512_CORE_VNNI")
    if "avx512_vnni" in flags and not capped and torch.backends.mkldnn.is_available():
        how = "int8 products in oneDNN (AVX512-VNNI" + (", AMX)" if "amx_int8" in flags else ")")
        return True, how if compiler_works() else how + ", quantize passes eager: no C++ compiler for Inductor"
    return False, (
        "this CPU has no AVX512-VNNI or AMX (or ONEDNN_MAX_CPU_ISA caps oneDNN below them): PyTorch's int8 "
        "product would run 35-40x slower than fp32 here; use --precision fp32"
    )


def compiler_works() -> bool:
    """Whether Inductor finds a working C++ compiler (it builds the fused passes)."""
    if "works" not in _COMPILER:
        try:
            from torch._inductor.cpp_builder import get_cpp_compiler

            get_cpp_compiler()
            _COMPILER["works"] = True
        except Exception:  # InvalidCxxCompiler, or an Inductor without that helper
            _COMPILER["works"] = False
    return _COMPILER["works"]


_COMPILER: dict[str, bool] = {}


def _quantized_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor):
    """x (rows, in) float32 times int8 `weight` (in, out) with per-column `weight_scale`,
    plus `bias` (zeros for a layer without one: one kind of call, one graph)."""
    scale = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127  # per token
    rows = (x / scale).round().clamp(-127, 127).to(torch.int8)
    # torch re-exports its ops without an __all__ that names this one
    return torch._int_mm(rows, weight).float() * scale * weight_scale + bias  # pyright: ignore[reportPrivateImportUsage]


_compiled = None  # the fused product, compiled once per process; or the eager one


def _compiled_or_eager(*args: torch.Tensor) -> torch.Tensor:
    """The fused product; without a compiler, or where Inductor fails to build it (a
    compiler without Python's headers, an unwritable cache: then with a warning), the
    eager passes from then on."""
    global _compiled
    if _compiled is None:
        _compiled = torch.compile(_quantized_linear, dynamic=True) if compiler_works() else _quantized_linear
    if _compiled is _quantized_linear:
        return _quantized_linear(*args)
    try:
        return _compiled(*args)
    except Exception as e:  # BackendCompilerFailed, InductorError: the build, not the arithmetic
        if "Backend" not in type(e).__name__ and "Inductor" not in type(e).__name__:
            raise
        warnings.warn(
            f"int8: Inductor could not build the fused quantize passes ({type(e).__name__}); running them eagerly",
            stacklevel=2,
        )
        _compiled = _quantized_linear
        _COMPILER["works"] = False
        return _quantized_linear(*args)


class Int8Linear(nn.Module):
    """An nn.Linear's weights as int8 (one scale per output channel) and its bias in float32."""

    qweight: torch.Tensor  # buffers, registered in __init__
    weight_scale: torch.Tensor
    bias: torch.Tensor

    def __init__(self, linear: nn.Linear, compiled: bool = True) -> None:
        super().__init__()
        weight = linear.weight.detach().float()
        scale = weight.abs().amax(1).clamp(min=1e-8) / 127
        quantized = (weight / scale[:, None]).round().clamp(-127, 127).to(torch.int8)
        # not `weight`: code that casts to a layer's `weight.dtype` must not find int8 there
        self.register_buffer("qweight", quantized.t().contiguous())  # (in, out), as _int_mm takes it
        self.register_buffer("weight_scale", scale)
        bias = torch.zeros(linear.out_features) if linear.bias is None else linear.bias.detach().float()
        self.register_buffer("bias", bias)
        self.in_features, self.out_features, self.compiled = linear.in_features, linear.out_features, compiled

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features).float()
        product = _compiled_or_eager if self.compiled else _quantized_linear
        return product(rows, self.qweight, self.weight_scale, self.bias).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 per channel"


def quantize_int8(model: nn.Module, skip: tuple[str, ...] = (), compiled: bool = True) -> int:
    """Swap `model`'s nn.Linear layers (but those whose name is in `skip`) for Int8Linear in
    place; the count swapped. Subclasses of nn.Linear stay as they are: a decoder's output
    layer (`OutputLayer`, which fuses the loss) keeps its float32 product."""
    if not backend(next(model.parameters()).device).on_host:
        raise UserError("--precision int8: CPUs only (int8 products through oneDNN)")
    swapped = 0
    for parent_name, parent in list(model.named_modules()):
        for name, child in list(parent.named_children()):
            full = f"{parent_name}.{name}" if parent_name else name
            if type(child) is nn.Linear and full not in skip:
                setattr(parent, name, Int8Linear(child, compiled))
                swapped += 1
    return swapped
