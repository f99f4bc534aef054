"""int8 encoders on CPUs without AVX512-VNNI: the encoder's body (token ids and mask in,
hidden states out) exported to ONNX once, quantized by ONNX Runtime's dynamic int8 (weights
int8 per output channel, activations uint8 per tensor at run time: one scale for a whole
batch, so a text's vector moves a little with the batch it runs in), and run by ONNX
Runtime, whose MLAS library has u8s8 kernels for AVX2 (`vpmaddubsw`). Attention goes out as
ONNX Runtime's fused `MultiHeadAttention` (softmax(q k^T / sqrt(d)) v over the unmasked keys
in one kernel, fp32), not as the dozen transposes, masks and products the exporter makes of
`scaled_dot_product_attention`; ONNX Runtime's own fuser does not recognise those. Pooling,
the head and normalisation stay frugality's, in fp32.

Why a second runtime: PyTorch's `torch._int_mm` is fast only with AVX512-VNNI or AMX (a
reference loop elsewhere, 35-40x slower than fp32; `frugality.precision.int8`). On a 2-core
AVX2-only EPYC (Zen 3) this engine embeds all-MiniLM-L6-v2 at 2.41x sentence-transformers'
fp32 and, in a second run, 1.94x its own ONNX int8 backend; mean cosine to fp32 0.992
(docs/benchmarks.md).

The quantized model is cached under the frugality cache (`int8-onnx/`), keyed by the
weights' bytes and the versions of torch and ONNX Runtime, so the export (a few seconds)
runs once per model. Needs the `int8` extra (`onnxruntime`, `onnx`).
"""

from __future__ import annotations

import hashlib
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch
from torch import nn

from frugality.errors import UserError
from frugality.models.bert import Attention, Bert
from frugality.paths import cache_dir, move_into_place


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


class _MultiHeadAttention(torch.autograd.Function):
    """Attention after the q, k, v products (without their biases, which it adds), exported
    as ONNX Runtime's `com.microsoft::MultiHeadAttention`; `forward` (what tracing runs) is
    the same computation in torch. `keep` is BERT's (batch, 1, 1, keys) mask, True at a real token."""

    @staticmethod
    def forward(ctx, q, k, v, bias, keep, heads: int):  # noqa: ARG004 - autograd's signature
        b, t, d = q.shape
        # (fixed slices: slices computed in a loop trip the exporter's peephole pass)
        q, k, v = q + bias[:d], k + bias[d : 2 * d], v + bias[2 * d :]
        q, k, v = (x.view(b, t, heads, d // heads).transpose(1, 2) for x in (q, k, v))
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
        return y.transpose(1, 2).reshape(b, t, d)

    @staticmethod
    def symbolic(g, q, k, v, bias, keep, heads: int):
        keep = g.op("Flatten", g.op("Cast", keep, to_i=6), axis_i=1)  # (batch, keys) int32, as the kernel takes it
        # a masked key's score gets -1e30, not the default -10000, which scores spread past 1e4 would outweigh
        return g.op(
            "com.microsoft::MultiHeadAttention", q, k, v, bias, keep, num_heads_i=heads, mask_filter_value_f=-1e30
        ).setType(q.type())


class _FusedAttention(nn.Module):
    """A BERT attention block as exported: the q, k, v products (plain MatMuls, quantized
    like the others), then the fused kernel, then the output product. Swapped into the
    model for the export only: the model is the engine's own at that point (`load_encoder`)."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.attn = attn

    def forward(self, x: torch.Tensor, mask: torch.Tensor, tokens=None) -> torch.Tensor:
        assert tokens is None, "the export runs the padded layout (_Body never unpads)"
        a = self.attn
        q, k, v = (torch.nn.functional.linear(x, p.weight) for p in (a.query, a.key, a.value))
        bias = torch.cat([a.query.bias, a.key.bias, a.value.bias])
        return a.out(_MultiHeadAttention.apply(q, k, v, bias, mask, a.heads))


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


# Bumped whenever the export or the quantization changes: the cached files of earlier ones
# are not used (they keep their old names; `int8-onnx/` in the cache is safe to delete).
FORMAT = 4  # 2: MatMuls alone quantized (the embedding tables stay fp32); 3: fused attention; 4: its mask -1e30


def quantized_body(model: Bert) -> OnnxInt8Body:
    """`model`'s forward as ONNX Runtime int8, exported and quantized on first use, then
    read from the cache. A cached file that does not load (cut short by a crash) is made
    again, once."""
    ok, why = available()
    if not ok:
        raise UserError(f"--precision int8 on this CPU runs in ONNX Runtime: {why}")
    import onnxruntime

    from frugality import __version__

    config = model.config.model_dump_json() if hasattr(model.config, "model_dump_json") else repr(model.config)
    key = hashlib.sha256(
        f"format {FORMAT} frugality {__version__} torch {torch.__version__} "
        f"onnxruntime {onnxruntime.__version__} {config}".encode()
    )
    for name, tensor in sorted(model.state_dict().items()):
        key.update(name.encode())
        key.update(str(tensor.dtype).encode())
        key.update(tensor.detach().contiguous().cpu().numpy().tobytes())
    folder = cache_dir() / "int8-onnx"
    path = folder / f"{key.hexdigest()[:32]}.onnx"
    for attempt in (1, 2):
        if not path.is_file():
            folder.mkdir(parents=True, exist_ok=True)
            _export_quantized(model, path)
        try:
            return OnnxInt8Body(path)
        except Exception as e:  # noqa: BLE001 - a damaged file: made again once, else one line
            path.unlink(missing_ok=True)
            if attempt == 2:
                raise UserError(
                    f"--precision int8: ONNX Runtime cannot load the int8 model it made ({path}: "
                    f"{type(e).__name__}); use --precision fp32, or FRUGALITY_INT8_ENGINE=torch on a CPU with VNNI"
                ) from None
    raise AssertionError("unreachable")


def export_fp32(model: Bert, path: Path) -> None:
    """The encoder's body as an fp32 ONNX graph, inputs `ids` and `mask`, output `hidden`,
    batch and length dynamic (TorchScript exporter: no onnxscript needed)."""
    config = model.config
    ids = torch.randint(0, config.vocab_size, (2, min(8, config.max_seq_len)))  # values and size do not matter
    dims = {0: "batch", 1: "length"}
    # each attention block swapped for its fused export for the time of the export, then put back
    blocks = [
        (m, name, child) for m in model.modules() for name, child in m.named_children() if type(child) is Attention
    ]
    try:
        for parent, name, child in blocks:
            setattr(parent, name, _FusedAttention(child))
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the tracer's notes on the model's shape checks
            torch.onnx.export(
                _Body(model).eval(),
                (ids, torch.ones_like(ids)),
                str(path),
                input_names=["ids", "mask"],
                output_names=["hidden"],
                dynamic_axes={"ids": dims, "mask": dims, "hidden": dims},
                dynamo=False,
                opset_version=17,
                custom_opsets={"com.microsoft": 1},
            )
    finally:
        for parent, name, child in blocks:
            setattr(parent, name, child)


def _export_quantized(model: Bert, path: Path) -> None:
    """Export (TorchScript exporter: dynamic batch and length, no onnxscript needed), quantize
    its MatMuls, and move the file into place, synced; concurrent processes each write their
    own, then rename. Folders left by an export that was killed are removed first."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    for stale in path.parent.glob(".partial-*"):
        if time.time() - stale.stat().st_mtime > 3600:  # an hour: no export takes that long
            shutil.rmtree(stale, ignore_errors=True)
    root = logging.getLogger()
    quiet = logging.NullHandler()  # the quantizer logs through the root logger, which would set up logging
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".partial-") as tmp:
        fp32, int8 = Path(tmp) / "model.onnx", Path(tmp) / "model.int8.onnx"
        try:
            export_fp32(model, fp32)
            root.addHandler(quiet)
            # MatMuls alone: quantized too, the embedding tables would get one scale a table
            # (min cosine to fp32 0.974, against 0.980 with them in fp32, at the same speed)
            quantize_dynamic(
                str(fp32), str(int8), per_channel=True, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul"]
            )
        except Exception as e:  # noqa: BLE001 - an exporter or quantizer that fails: one line
            raise UserError(
                f"--precision int8: exporting the encoder to ONNX Runtime failed ({type(e).__name__}: "
                f"{str(e).splitlines()[0][:160] if str(e) else ''}); use --precision fp32"
            ) from None
        finally:
            root.removeHandler(quiet)
        move_into_place(int8, path)
