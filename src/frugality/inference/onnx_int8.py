"""int8 encoders on CPUs without AVX512-VNNI: the encoder's body (token ids and mask in,
hidden states out) exported to ONNX once, quantized by ONNX Runtime's dynamic int8 (weights
int8 per output channel, activations uint8 per tensor at run time), and run by ONNX
Runtime, whose MLAS library has u8s8 kernels for AVX2 (`vpmaddubsw`). Pooling, the head and
normalisation stay frugality's, in fp32.

Why a second runtime: PyTorch's `torch._int_mm` is fast only with AVX512-VNNI or AMX (a
reference loop elsewhere, 35-40x slower than fp32; `frugality.precision.int8`). On the Zen 4
EPYC (which has VNNI) ONNX Runtime's int8 ran all-MiniLM-L6-v2 at 1.89x torch fp32, cosine
min 0.981 / mean 0.993, and under QEMU presenting an AVX2-only EPYC (Rome) its AVX2 kernels
gave the same quality (min 0.979, mean 0.992): saturation of u8s8 on AVX2 did not show. Its
speed on a real AVX2-only CPU is still to be measured (docs/benchmarks.md).

The quantized model is cached under the frugality cache (`int8-onnx/`), keyed by the
weights' bytes and the versions of torch and ONNX Runtime, so the export (a few seconds)
runs once per model. Needs the `int8` extra (`onnxruntime`, `onnx`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import warnings
from pathlib import Path

import torch
from torch import nn

from frugality.errors import UserError
from frugality.paths import cache_dir


def available() -> tuple[bool, str]:
    """Whether ONNX Runtime (with onnx, for the quantizer) is installed, and why not."""
    try:
        import onnx  # noqa: F401
        import onnxruntime  # noqa: F401
    except ImportError as e:
        return False, f"{e.name} is not installed (pip install 'frugality[int8]')"
    return True, ""


class _Body(nn.Module):
    """What is exported: the encoder's forward, ids and mask to hidden states."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        return self.model(ids, mask)


class OnnxInt8Body:
    """A callable (ids, mask) -> hidden states (float32) running the quantized model."""

    def __init__(self, path: Path) -> None:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
        self.path = path
        self.session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

    def __call__(self, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        feed = {"ids": ids.cpu().numpy(), "mask": mask.cpu().numpy()}
        return torch.from_numpy(self.session.run(["hidden"], feed)[0])


def quantized_body(model: nn.Module) -> OnnxInt8Body:
    """`model`'s forward as ONNX Runtime int8, exported and quantized on first use."""
    ok, why = available()
    if not ok:
        raise UserError(f"--precision int8 on this CPU runs in ONNX Runtime: {why}")
    import onnxruntime

    key = hashlib.sha256(f"torch {torch.__version__} onnxruntime {onnxruntime.__version__}".encode())
    for name, tensor in sorted(model.state_dict().items()):
        key.update(name.encode())
        key.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    folder = cache_dir() / "int8-onnx"
    path = folder / f"{key.hexdigest()[:32]}.onnx"
    if not path.is_file():
        folder.mkdir(parents=True, exist_ok=True)
        _export_quantized(model, path)
    return OnnxInt8Body(path)


def _export_quantized(model: nn.Module, path: Path) -> None:
    """Export (TorchScript exporter: dynamic batch and length, no onnxscript needed), quantize,
    and move into place; concurrent processes each write their own file, then rename."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    ids = torch.randint(1000, 2000, (2, 8))
    dims = {0: "batch", 1: "length"}
    with tempfile.TemporaryDirectory(dir=path.parent) as tmp:
        fp32, int8 = Path(tmp) / "model.onnx", Path(tmp) / "model.int8.onnx"
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on the model's shape checks
            torch.onnx.export(
                _Body(model).eval(),
                (ids, torch.ones_like(ids)),
                str(fp32),
                input_names=["ids", "mask"],
                output_names=["hidden"],
                dynamic_axes={"ids": dims, "mask": dims, "hidden": dims},
                dynamo=False,
                opset_version=17,
            )
        quantize_dynamic(str(fp32), str(int8), per_channel=True, weight_type=QuantType.QInt8)
        os.replace(int8, path)
