"""int8 inference on CPUs: a model's linear layers swapped, from outside the model, for
layers whose weights are quantized once per output channel and whose activations are
quantized per token (row) at run time; the products run int8 x int8 -> int32 in oneDNN
through `torch._int_mm`, and are scaled back to the activations' dtype. Attention, norms,
embeddings and pooling stay in float32 (an encoder's in bf16 where bf16 products are native:
`cast_around_int8`, called by inference.encoder).

Why these choices (benchmarks/int8_linear.py, 2026-11-25, AMD EPYC Zen 4):
- per-token activation scales keep all-MiniLM-L6-v2's embeddings at cosine 0.997 to fp32;
  one scale for the whole batch (FBGEMM's dynamic quantization, 7-bit) fell to 0.949;
- PyTorch sends `torch._int_mm` to oneDNN only where the CPU has AVX512-VNNI (AMX CPUs have
  it too). Elsewhere a reference loop runs it 35-40x slower than fp32, and under an
  `ONEDNN_MAX_CPU_ISA` cap below VNNI oneDNN returns wrong products: int8 is refused there
  (`int8_products`), never run slowly or wrongly;
- the quantize and scale-back passes around each product run in a C kernel of frugality's
  (kernels/int8_linear_cpu.c: one pass each, the eager expressions' bits) since 2026-11-29.
  Before, torch.compile (Inductor) fused them, behind Dynamo's checks at every call: a MiniLM
  call 1.30x faster for a lone text, 1.19x at 8 texts, 1.09-1.11x at 32-64 with the kernel
  (2-core Zen 4; benchmarks/embed_batch_sizes.py --against int8-inductor). Where the kernel does not
  run (FRUGALITY_DISABLE_KERNELS=int8-linear) Inductor still fuses them; where Inductor
  cannot build (no C++ compiler, no Python headers) they run eagerly, with a warning: 1.7x
  fp32 end to end in an ad-hoc probe, against 2.2x compiled (benchmarks/int8_onnxruntime.py).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from frugality import kernels
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
        if fused_passes() or compiler_works():
            return True, how
        return True, how + ", quantize passes eager: frugality's int8-linear kernel off or not built, no C++ compiler"
    return False, (
        "this CPU has no AVX512-VNNI or AMX (or ONEDNN_MAX_CPU_ISA caps oneDNN below them): PyTorch's int8 "
        "product would run 35-40x slower than fp32 here; use --precision fp32"
    )


def fused_passes() -> bool:
    """Whether the quantize and scale-back passes run in frugality's C kernel here (else
    Inductor's, else eager)."""
    return kernels.int8_quantize_rows() is not None and kernels.int8_dequantize_rows() is not None


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


def _kernel_linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor, bias: torch.Tensor):
    """`_quantized_linear` with its passes in the C kernel, in x's dtype (float32 or bf16:
    the float32 result rounded once), or None where the kernel does not apply."""
    if not (
        backend(x.device).on_host
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.dim() == 2
        and weight_scale.dtype == bias.dtype == torch.float32
        and weight_scale.is_contiguous()
        and bias.is_contiguous()
        and not (torch.is_grad_enabled() and x.requires_grad)
        and not torch.compiler.is_compiling()
    ):
        return None
    quantize, scale_back = kernels.int8_quantize_rows(), kernels.int8_dequantize_rows()
    if quantize is None or scale_back is None:
        return None
    x = x.contiguous()  # (a strided view, e.g. a CLS row, copied: the kernel reads rows whole)
    if weight_scale.shape != (weight.shape[1],) or bias.shape != (weight.shape[1],) or weight.shape[0] != x.shape[1]:
        return None
    (rows, width), bf16, threads = x.shape, int(x.dtype == torch.bfloat16), torch.get_num_threads()
    quantized, scales = torch.empty(rows, width, dtype=torch.int8), torch.empty(rows, dtype=torch.float32)
    quantize(x.data_ptr(), rows, width, bf16, quantized.data_ptr(), scales.data_ptr(), threads)
    products = torch._int_mm(quantized, weight).contiguous()  # pyright: ignore[reportPrivateImportUsage]
    out = torch.empty(rows, weight.shape[1], dtype=x.dtype)
    scale_back(
        products.data_ptr(), rows, weight.shape[1], scales.data_ptr(), weight_scale.data_ptr(), bias.data_ptr(),
        out.data_ptr(), bf16, threads,
    )  # fmt: skip
    return out


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
    """An nn.Linear's weights as int8 (one scale per output channel) and its bias in float32;
    `compiled` False runs the passes eagerly (the reference the fused ones are tested against)."""

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
        rows = x.reshape(-1, self.in_features)
        out = _kernel_linear(rows, self.qweight, self.weight_scale, self.bias) if self.compiled else None
        if out is None:
            product = _compiled_or_eager if self.compiled else _quantized_linear
            out = product(rows.float(), self.qweight, self.weight_scale, self.bias).to(x.dtype)
        return out.reshape(*x.shape[:-1], self.out_features)

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


def cast_around_int8(model: nn.Module, dtype: torch.dtype) -> None:
    """`model`'s float parameters and buffers cast to `dtype` in place, but `Int8Linear`'s
    (its scales and bias stay float32: the passes take them so); its layers then take and
    give `dtype` activations."""
    for module in model.modules():
        if isinstance(module, Int8Linear):
            continue
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if tensor.is_floating_point():
                tensor.data = tensor.data.to(dtype)
