"""A text encoder ready to embed: a BERT-family model, its tokenizer and its pooling, from
a Hugging Face folder (e.g. sentence-transformers/all-MiniLM-L6-v2), a folder written by
`frugality import hf`, or a run directory.

Pooling follows sentence-transformers' own files where the folder has them (`modules.json`,
`1_Pooling/config.json`, `sentence_bert_config.json`): mean or CLS pooling, L2
normalisation when a Normalize module is listed, and the maximum length texts are cut to.
Without them: mean pooling, no normalisation, the model's maximum length."""

from __future__ import annotations

import os
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, replace
from itertools import chain
from pathlib import Path
from typing import cast

import numpy as np
import torch
from tokenizers import Tokenizer

from frugality import kernels
from frugality.backends import backend
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError
from frugality.hardware import cpu_flags
from frugality.inference import onnx_int8
from frugality.interop.hf import import_hf
from frugality.interop.sentence_transformers import pooling_mode, read_json
from frugality.interop.weights import WeightsSource, file_beside, load_weights, recipe_beside, resolve_source
from frugality.kernels.encoder_attention import use_kernel_attention
from frugality.kernels.layer_norm import use_kernel_layer_norm
from frugality.kernels.packed_linear import pack_linear_weights, stack_attention_projections
from frugality.models import Model
from frugality.models.bert import Bert, pool
from frugality.models.families import family
from frugality.models.materialize import build_empty
from frugality.precision import bf16_is_native
from frugality.precision.int8 import cast_around_int8, int8_products, quantize_int8

INT8_ENGINES = ("torch", "onnxruntime")


@dataclass(frozen=True)
class Pooling:
    mode: str = "mean"  # "mean" or "cls"
    normalize: bool = False
    max_length: int | None = None  # None: the model's max_seq_len


def read_pooling(folder: Path) -> Pooling:
    """The pooling sentence-transformers' files in `folder` describe (defaults without them)."""
    pooling = Pooling()
    modules = read_json(folder / "modules.json")
    if isinstance(modules, list):
        types = [str(m.get("type", "")) for m in modules if isinstance(m, dict)]
        pooling = replace(pooling, normalize=any(t.endswith("Normalize") for t in types))
    pooling = replace(pooling, mode=pooling_mode(folder / "1_Pooling" / "config.json"))
    bert = read_json(folder / "sentence_bert_config.json") or {}
    if isinstance(bert.get("max_seq_length"), int):
        pooling = replace(pooling, max_length=bert["max_seq_length"])
    return pooling


UNPAD_BELOW = 0.8  # a batch whose real tokens fill less of it than this skips its padding


class Encoder:
    """Texts in, one embedding (float32) per text out."""

    def __init__(
        self,
        model: Bert,
        tokenizer: Tokenizer,
        pooling: Pooling,
        device: torch.device,
        dtype: torch.dtype,
        source: Path,
        int8: str | None = None,
    ) -> None:
        self.model, self.tokenizer, self.pooling = model.eval(), tokenizer, pooling
        self.device, self.dtype, self.source = device, dtype, source  # source: the folder the weights came from
        # int8: the engine ("torch": linear layers quantized, frugality.precision.int8;
        # "onnxruntime": the body in ONNX Runtime, frugality.inference.onnx_int8); dtype is then float32
        self.int8 = int8
        self.max_length = min(pooling.max_length or model.config.max_seq_len, model.config.max_seq_len)
        tokenizer.enable_truncation(self.max_length)
        tokenizer.no_padding()
        self.dim = (model.config.head or (model.config.hidden_size,))[-1]
        self.width = model.config.hidden_size  # (the hidden states': what sets a batch's activations)
        # skipping padding: measured on the CPU only (not on XLA, which compiles a graph per
        # shape), and in the model's own forward (ONNX Runtime's body runs the padded layout)
        self.unpads = backend(device).on_host and int8 != "onnxruntime"

    def identity(self) -> dict:
        """What a resumed job checks is the same model: the folder of the weights and each
        of its files' size and modification time."""
        files = {
            p.name: [p.stat().st_size, p.stat().st_mtime_ns]
            for p in sorted(self.source.iterdir())
            if p.is_file()
            and (
                p.suffix in (".safetensors", ".bin", ".distcp")
                or p.name in ("config.json", ".metadata", "tokenizer.json")
            )
        }
        return {"weights": str(self.source.resolve()), "files": files}

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the model's special tokens ([CLS] ... [SEP]), cut to max_length."""
        return self.encode(texts)[0]

    def encode(self, texts: list[str]) -> tuple[list[list[int]], int]:
        """`tokenize`, and how many of the texts were cut to max_length (`embed` and `serve`
        cut longer texts, as sentence-transformers does, and report how many)."""
        rows, cut = self.encode_each(texts)
        return rows, sum(cut)

    def encode_each(self, texts: list[str]) -> tuple[list[list[int]], list[bool]]:
        """`encode`, with whether each text was cut."""
        # (HF tokenizers let go of the GIL meanwhile; the fast batch skips the character
        # offsets, which embeddings never use)
        encode = getattr(self.tokenizer, "encode_batch_fast", self.tokenizer.encode_batch)
        encodings = encode(texts)
        return [e.ids for e in encodings], [bool(e.overflowing) for e in encodings]

    def embed_tokens(self, rows: list[list[int]], pad_to: int, fill: int | None = None) -> np.ndarray:
        """Embeddings of token rows padded to `pad_to`: (len(rows), dim) float32. `fill`
        pads the batch to that many rows (one-token rows, dropped), for a fixed shape."""
        # XLA's linear layers set version counters, which inference tensors refuse
        with backend(self.device).inference(), self._torch_threads():
            # (the filler rows dropped on the host: on XLA a slice on the device is one more graph)
            return self._embed(rows, pad_to, fill).float().cpu().numpy()[: len(rows)]

    def embed_tokens_on_device(self, rows: list[list[int]], pad_to: int) -> torch.Tensor:
        """`embed_tokens` left on the device, float32, not waited for (a GPU's batches queue
        up; `batches.embed_rows` copies a chunk's back at once)."""
        with backend(self.device).inference():
            return self._embed(rows, pad_to, None).float()

    @contextmanager
    def _torch_threads(self):
        """Under ONNX Runtime's engine, torch's part (the batch's tensors, pooling) runs on one
        thread: its OpenMP threads, spinning after each small parallel op, took cores from ONNX
        Runtime's own (torch's part of a batch 0.4-0.9 s on 3,000 glosses at 2 threads, 0.1-0.3 s
        at one; 2-core EPYC, AVX2). The thread count is put back after each batch (torch keeps
        it per process; the batches of one encoder run on one thread: serve's model thread)."""
        threads = torch.get_num_threads()
        if self.int8 != "onnxruntime" or threads == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(threads)

    def _embed(self, rows: list[list[int]], pad_to: int, fill: int | None) -> torch.Tensor:
        count = len(rows)
        rows = rows + [rows[0][:1]] * max(0, (fill or count) - count)
        # the batch laid out in numpy at once (a tensor a row cost ~20 us a text: 0.4 s of a
        # 20,000-text job with a one-layer model)
        lengths = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
        filled = np.arange(pad_to) < lengths[:, None]
        ids_np = np.zeros((len(rows), pad_to), dtype=np.int64)
        ids_np[filled] = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(lengths.sum()))
        ids, mask = torch.from_numpy(ids_np), torch.from_numpy(filled.astype(np.int64))
        if backend(self.device).asynchronous:  # page-locked: copied while the host goes on to the next batch
            ids, mask = ids.pin_memory(), mask.pin_memory()
        ids, mask = ids.to(self.device, non_blocking=True), mask.to(self.device, non_blocking=True)
        # A batch of mixed lengths (a server's can be: requests come as they come) runs its
        # products on the real tokens only; sorted batches (embed's) have little padding to skip
        unpad = self.unpads and lengths.sum() < UNPAD_BELOW * filled.size
        hidden = self.model(ids, mask, unpad=True) if unpad else self.model(ids, mask)
        pooled = pool(hidden, mask, self.pooling.mode)
        return self.model.project(pooled, self.pooling.normalize)  # through any head; `fill`'s rows too


def resolve_precision(name: str, device: torch.device, encoder: bool = True) -> tuple[torch.dtype, str]:
    """'auto' is bf16 where bf16 products are native (AMX, AVX512-BF16, CUDA 8.0+), else
    fp32 (never int8, which changes results: only when asked for); the dtype the model's
    float tensors take and why. int8 is refused in one line where no engine runs it fast
    (`int8_engine`)."""
    if name == "fp32":
        return torch.float32, "fp32 (asked for)"
    if name == "bf16":
        return torch.bfloat16, "bf16 (asked for)"
    if name == "int8":
        engine, why = int8_engine(device, encoder)
        if engine == "onnxruntime":
            return torch.float32, f"int8 (asked for): the encoder's body in {why}; pooling in fp32"
        # an encoder's other layers in bf16 where its products are native: the passes around
        # the int8 products read and write half the bytes (a MiniLM call 1.00-1.05x at 1-32
        # random texts, 1.09x at 64, 2-core Zen 4: benchmarks/embed_batch_sizes.py --against
        # int8-fp32-rest; cosine to fp32 the same; decoders keep fp32: not measured)
        # (FRUGALITY_INT8_REST=bf16|fp32 names it: a Ray job's actors run the driver's)
        asked_rest = os.environ.get("FRUGALITY_INT8_REST", "").strip().lower()
        if asked_rest not in ("", "bf16", "fp32"):
            raise UserError(f"FRUGALITY_INT8_REST={asked_rest!r}: choose bf16 or fp32 (or leave it unset)")
        bf16_rest = asked_rest == "bf16" or (not asked_rest and bf16_is_native(device)[0])
        rest = torch.bfloat16 if encoder and bf16_rest else torch.float32
        if rest == torch.bfloat16:
            return rest, f"int8 (asked for): linear layers in {why}; attention and norms in bf16, pooling in fp32"
        return rest, f"int8 (asked for): linear layers in {why}; attention, norms and pooling in fp32"
    if name != "auto":
        raise UserError(f"--precision {name!r}: choose auto, fp32, bf16 or int8")
    native, why = bf16_is_native(device)
    return (torch.bfloat16, f"bf16: {why}") if native else (torch.float32, f"fp32: {why}")


def int8_engine(device: torch.device, encoder: bool = True) -> tuple[str, str]:
    """Which engine runs int8 here, and how: PyTorch's `_int_mm` where the CPU has
    AVX512-VNNI or AMX; for encoders on other x86 CPUs with AVX2, ONNX Runtime
    (`frugality.inference.onnx_int8`). FRUGALITY_INT8_ENGINE (torch or onnxruntime) names one.
    Anything else is refused in one line."""
    if not backend(device).on_host:
        raise UserError(f"--precision int8: CPUs only, not {device.type}; add --device cpu")
    asked = os.environ.get("FRUGALITY_INT8_ENGINE", "").strip().lower()
    if asked and asked not in INT8_ENGINES:
        raise UserError(f"FRUGALITY_INT8_ENGINE={asked!r}: choose {' or '.join(INT8_ENGINES)} (or leave it unset)")
    fast, why = int8_products()
    if asked != "onnxruntime" and (fast or asked == "torch"):
        if not fast:
            raise UserError(f"--precision int8 (FRUGALITY_INT8_ENGINE=torch): {why}")
        return "torch", why
    if not encoder and fast:  # only the variable stands in the way
        raise UserError(
            "FRUGALITY_INT8_ENGINE=onnxruntime: ONNX Runtime's int8 serves encoders only; unset it (this CPU runs "
            "PyTorch's int8 for decoders)"
        )
    if not encoder:
        raise UserError(
            f"--precision int8: {why.removesuffix('; use --precision fp32')}; ONNX Runtime's int8 serves encoders "
            "only; use --precision fp32"
        )
    if not asked and "avx2" not in cpu_flags():
        raise UserError(f"--precision int8: {why}")
    ok, missing = onnx_int8.available()
    if not ok:
        raise UserError(f"--precision int8: this CPU's int8 engine is ONNX Runtime, and {missing}")
    import onnxruntime

    because = "FRUGALITY_INT8_ENGINE=onnxruntime" if asked else "no AVX512-VNNI or AMX for PyTorch's int8 here"
    return "onnxruntime", f"ONNX Runtime {onnxruntime.__version__}'s int8 kernels ({because})"


@dataclass(frozen=True)
class LoadedModel:
    """A model read from a folder, on the CPU, with where its tokenizer and weights are."""

    model: Model
    tokenizer: str  # a tokenizer.json beside the weights, else the recipe's data.tokenizer (a name or path)
    weights: Path  # the folder the weights came from: a run's latest checkpoint when MODEL is a run


def load_model(path: str | Path, check: Callable[[object, Path], None]) -> LoadedModel:
    """The model at `path`: a Hugging Face folder, a folder from `frugality import hf`, or a
    run directory (its latest checkpoint); `check(config, folder)` refuses a family the
    caller cannot use before the model is built (a checkpoint's weights are not read by then;
    a Hugging Face folder's are, since BERT's heads are told by its tensor names)."""
    folder = Path(path)
    if not folder.exists():
        raise UserError(f"model {folder}: no such folder")
    if (folder / "config.json").is_file():  # a Hugging Face folder
        config, state = import_hf(folder)
        check(config, folder)
        model = build_empty(config)
        model.load_state_dict(state, strict=True)
        return LoadedModel(model, str(folder / "tokenizer.json"), folder)
    # a frugality checkpoint: an imported folder or a run directory
    source = resolve_source(folder, "model")
    recipe = recipe_beside(source)
    check(recipe.model, folder)
    model = build_empty(recipe.model)  # no initialisation: every weight is loaded
    missing = load_weights(source, model)
    if missing:  # uninitialised memory must never pass for weights
        raise UserError(f"model {folder}: the checkpoint {source.path} lacks {missing[0]!r}")
    own = source.path / "tokenizer.json"  # an imported folder's, wherever it was moved
    return LoadedModel(model, str(own) if own.is_file() else recipe.data.tokenizer, source.path)


def load_encoder(
    path: str | Path,
    device: torch.device,
    precision: str = "auto",
    normalize: bool | None = None,
    max_length: int | None = None,
) -> tuple[Encoder, str]:
    """The encoder at `path` on `device`, and the precision line (what was chosen, why)."""
    folder = Path(path)
    dtype, why = resolve_precision(precision, device)
    loaded = load_model(folder, _check_encoder)
    bert = cast(Bert, loaded.model)  # as _check_encoder admitted
    tokenizer = load_tokenizer(loaded.tokenizer).tokenizer
    weights = loaded.weights
    # sentence-transformers' files where the folder has them, else the model's own settings
    st_folder = next((f for f in (weights, folder) if (f / "modules.json").is_file()), None)
    if st_folder is not None:
        pooling = read_pooling(st_folder)
    else:  # a run's, with the length its starting model cut texts to where it carried one
        kind = "hf" if (weights / "config.json").is_file() else "dcp"
        beside = file_beside(WeightsSource(weights, kind), "sentence_bert_config.json")
        pooling = replace(
            read_pooling(beside.parent if beside else folder),
            mode=bert.config.pooling,
            normalize=bert.config.normalize,
        )
    if normalize is not None:
        pooling = replace(pooling, normalize=normalize)
    if max_length is not None:
        pooling = replace(pooling, max_length=max_length)
    engine = int8_engine(device)[0] if precision == "int8" else None
    # (int8 weights quantized from the float32 ones, whatever the other layers' dtype)
    model = bert.to(device=device, dtype=torch.float32 if engine == "torch" else dtype)
    if engine == "torch":  # (BERT's pooler and masked-LM head: unused by embeddings, left alone)
        stack_attention_projections(model)  # (q, k and v: one int8 product, the same bits)
        quantize_int8(model, skip=("pooler", "mlm.dense", "mlm.decoder"))
        cast_around_int8(model, dtype)
    elif engine == "onnxruntime":  # the body runs in ONNX Runtime; project() (the head) stays here
        # this instance's forward replaced (pyright allows no assignment over a method)
        model.forward = onnx_int8.quantized_body(model)  # pyright: ignore[reportAttributeAccessIssue]
    elif dtype == torch.bfloat16 and backend(device).on_host and bf16_is_native(device)[0]:
        # bf16 weights laid out once for oneDNN, not on every call (a call 1.1-1.4x at a server's batches)
        packed = pack_linear_weights(model, skip=("pooler", "mlm"))
        why += "; linear layers' weights packed for oneDNN" if packed else ""
    if engine != "onnxruntime" and backend(device).on_host:  # (packed attentions call the kernel themselves)
        use_kernel_attention(model)
        why += "; attention in a C kernel" if kernels.encoder_attention_forward() is not None else ""
        why += "; residual adds and norms in a C kernel" if use_kernel_layer_norm(model) else ""
    return Encoder(model, tokenizer, pooling, device, dtype, weights, int8=engine), why


def _check_encoder(config, folder: Path) -> None:
    if family(config).decoder:
        raise UserError(f"model {folder}: a {config.family} model; `embed` takes an encoder (BERT family)")
