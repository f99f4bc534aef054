"""int8 linear layers on this CPU, the candidates of issue 39 on all-MiniLM-L6-v2's shapes
(a batch of 64 texts of ~20 tokens: 1,280 rows; hidden 384, MLP 1,536): time against fp32
and the error against fp32, for

- `fp32`: `x @ w.T`, torch's (oneDNN) product, the baseline;
- `int_mm, eager`: activations quantized per token (absmax / 127) and weights per output
  channel, `torch._int_mm` (int8 x int8 -> int32), dequantized, each step a torch op;
- `int_mm, compiled`: the same function under `torch.compile` (Inductor fuses the
  quantize and dequantize passes around the product);
- `quantize_dynamic`: `torch.ao.quantization.quantize_dynamic` (FBGEMM: weights per
  channel, activations per tensor, u8 x s8);
- `ONNX Runtime` (where `onnxruntime` and `onnx` are installed): the layer as an ONNX
  MatMul, in fp32 and quantized by `onnxruntime.quantization.quantize_dynamic` (weights s8
  per channel, activations u8 per tensor: DynamicQuantizeLinear + MatMulInteger, MLAS).

Facts found with it (2026-11-25, 2-core AMD EPYC Zen 4, torch 2.13.0):
- `torch._int_mm` on CPU goes to oneDNN only where the CPU has AVX512-VNNI (pytorch#136942,
  after pytorch#136746: oneDNN overflowed without VNNI); elsewhere to a reference path.
  PyTorch asks cpuinfo, not oneDNN: under `ONEDNN_MAX_CPU_ISA=AVX2` on a VNNI machine it
  still calls oneDNN, which, capped at AVX2, returns wrong products (max error 1e5 on
  random int8). So the AVX2 emulation cannot measure `_int_mm`: its AVX2-only figures
  need an AVX2-only machine. The `error` column catches such a path.
- On this Zen 4 (VNNI), natively: compiled int_mm 3.0-3.5x fp32 per layer, relative
  error ~1%; eager int_mm no faster than fp32 (the quantize/dequantize passes).
- Without oneDNN (`torch.backends.mkldnn.flags(enabled=False)`, the path an AVX2-only CPU
  gets) `_int_mm` is 35-40x SLOWER than fp32: on AVX2-only CPUs it is no candidate.
- FBGEMM's dynamic quantization has AVX2 kernels of its own: 3.3-3.9x fp32 natively,
  1.1-1.7x with `FBGEMM_ENABLE_INSTRUCTIONS=AVX2` (plus the oneDNN/ATen limits); relative
  error ~2.4% here (activations per tensor, not per token).
- ONNX Runtime 1.32 int8: 3.5-3.9x torch's fp32 natively, error ~1.3% (u8 activations
  keep a bit more than s8); its fp32 is ~10% faster than torch's. MLAS picks its kernels by
  cpuid and takes no ISA limit: its AVX2 figure needs an AVX2-only machine too.
- End to end, all-MiniLM-L6-v2's 37 linear layers swapped, 3,000 WordNet glosses, batch
  64 (a probe, not yet a benchmark of its own; 2026-11-25, this Zen 4): fp32 428-436
  texts/s; FBGEMM dynamic int8 1,006-1,032 texts/s (2.3-2.4x) but cosine to fp32 min 0.881,
  mean 0.949 (activations per tensor, 7-bit by `reduce_range`): not the same model;
  per-token activations with `_int_mm`, eager, 739 texts/s (1.73x), cosine min 0.991, mean
  0.997. Per-token quantization is what keeps the model; the speed then needs the
  quantize/dequantize passes fused (compiled: 3x a layer) and an int8 product that is fast
  on AVX2 (not `_int_mm` there).
- ONNX Runtime end to end (the same probe): frugality's BERT exported by
  `torch.onnx.export` (TorchScript; weights moved from Constant nodes to initializers, or
  the quantizer leaves the MatMuls alone), `quantize_dynamic(per_channel=True)`: fp32 469
  texts/s (1.10x torch), int8 1,098 texts/s (2.59x torch fp32), cosine min 0.984, mean
  0.993: full 8-bit u8 activations per tensor keep the model where FBGEMM's 7-bit ones
  did not. The strongest candidate for AVX2-only CPUs (MLAS has u8s8 AVX2 kernels), to be
  measured there.

    .venv/bin/python benchmarks/int8_linear.py [--rows 1280]
    FBGEMM_ENABLE_INSTRUCTIONS=AVX2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 ...  # (see above: not _int_mm)
"""

from __future__ import annotations

import argparse
import time

import torch


def _best(fn, rounds: int = 30) -> float:
    for _ in range(3):
        fn()
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def qlinear(x: torch.Tensor, wq: torch.Tensor, sw: torch.Tensor) -> torch.Tensor:
    """Per-token int8 activations times per-channel int8 weights (wq: K x N), in fp32."""
    s = x.abs().amax(-1, keepdim=True).clamp(min=1e-8) / 127
    xq = (x / s).round().clamp(-127, 127).to(torch.int8)
    # torch's int8 product (cuBLASLt / oneDNN), private in its stub
    return torch._int_mm(xq, wq).float() * s * sw  # pyright: ignore[reportPrivateImportUsage]


def _onnx_runtime(x: torch.Tensor, w: torch.Tensor) -> dict:
    """The layer in ONNX Runtime, fp32 and dynamically quantized; none where not installed."""
    try:
        import onnx
        import onnxruntime as ort
        from onnx import TensorProto, helper, numpy_helper
        from onnxruntime.quantization import QuantType, quantize_dynamic
    except ImportError:
        return {}
    import tempfile
    from pathlib import Path

    k, n = w.shape[1], w.shape[0]
    folder = Path(tempfile.mkdtemp(prefix="int8-linear-"))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"])],
        "linear",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, k])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, n])],
        [numpy_helper.from_array(w.t().contiguous().numpy(), "w")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), folder / "fp32.onnx")
    quantize_dynamic(folder / "fp32.onnx", folder / "int8.onnx", weight_type=QuantType.QInt8, per_channel=True)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    sessions = {
        name: ort.InferenceSession(str(folder / f"{name}.onnx"), options, providers=["CPUExecutionProvider"])
        for name in ("fp32", "int8")
    }
    feed = {"x": x.numpy()}
    return {
        f"ONNX Runtime {name}": (lambda s=session: torch.from_numpy(s.run(None, feed)[0]))
        for name, session in sessions.items()
    }


def _without_onednn(fn, *args):
    with torch.backends.mkldnn.flags(enabled=False):
        return fn(*args)


def _paths(x, w, wq, sw, compiled, dynamic) -> dict:
    """One shape's products by path (ONNX Runtime's apart)."""
    return {
        "fp32": lambda: x @ w.t(),
        "int_mm, eager": lambda: qlinear(x, wq, sw),
        "int_mm, compiled": lambda: compiled(x, wq, sw),
        "quantize_dynamic (FBGEMM)": lambda: dynamic(x),
        "int_mm without oneDNN (an AVX2-only CPU's path)": lambda: _without_onednn(qlinear, x, wq, sw),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1280)
    args = parser.parse_args()
    torch.manual_seed(0)
    compiled = torch.compile(qlinear, dynamic=False)
    print("| K x N | path | ms | vs fp32 | relative error |")
    print("|---|---|---|---|---|")
    for k, n in ((384, 384), (384, 1536), (1536, 384)):
        x, w = torch.randn(args.rows, k), torch.randn(n, k) * 0.05
        sw = w.abs().amax(1) / 127
        wq = (w / sw[:, None]).round().to(torch.int8).t().contiguous()
        reference = x @ w.t()
        with torch.no_grad():
            linear = torch.nn.Linear(k, n, bias=False)
            linear.weight.copy_(w)
            dynamic = torch.ao.quantization.quantize_dynamic(
                torch.nn.Sequential(linear), {torch.nn.Linear}, torch.qint8
            )
        paths = _paths(x, w, wq, sw, compiled, dynamic) | _onnx_runtime(x, w)
        base = _best(paths["fp32"])
        for name, fn in paths.items():
            with torch.no_grad():
                seconds = _best(fn)
                error = float((fn() - reference).norm() / reference.norm())
            print(f"| {k} x {n} | {name} | {seconds * 1e3:.2f} | {base / seconds:.2f}x | {error:.4f} |")


if __name__ == "__main__":
    main()
