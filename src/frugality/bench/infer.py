"""`frugality bench infer`: frugality's embedding path against sentence-transformers'
`encode` on the same model, texts, batch size, device and precision, in one process,
alternating rounds so that both share the machine's drift: texts/s (tokenization included)
and the cosine between the two outputs. A peer that is not installed is a row saying how to
install it; frugality's row is measured all the same. Every row names the device it ran on
and its precision: the Ray and ONNX rows run on the CPU whatever the device.

With a Ray cluster (`ray_address`; "local": a local instance), a row for the same texts as
an `embed --engine ray` job: one actor a CPU of the cluster, timed from the job's start to
its manifest (actors started and the model loaded in each, shards written), the cluster
joined before the rounds (its start-up is not timed)."""

from __future__ import annotations

import contextlib
import json
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from frugality.backends import backend
from frugality.bench.results import synchronize
from frugality.errors import UserError
from frugality.hardware import device_name
from frugality.inference.batches import embed_texts
from frugality.inference.encoder import load_encoder
from frugality.runtime.device import resolve_device


def _missing(peer: str, error: ImportError) -> str:
    """The note of a peer's row when it (or a module it needs) is not installed, or is
    installed but cannot be imported (a broken install, versions that do not match)."""
    if isinstance(error, ModuleNotFoundError):
        return f"{peer} is not installed (no module {error.name!r}): pip install {peer}"
    return f"{peer} is installed but cannot be imported ({str(error).splitlines()[0]})"


def bench_device(name: torch.device | str = "auto") -> torch.device:
    """The device `--device` names, checked as every command checks it; a CUDA device with
    its index (the GPU a row names)."""
    device = resolve_device(str(name), key="--device", what="frugality bench infer", xla_ok=True)
    if backend(device).device_per_rank and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def ran_on(device: torch.device) -> dict:
    """A row's device: torch's name for it and the hardware's."""
    return {"device": str(device), "device_name": device_name(device)}


def _timed(device: torch.device, fn, *args):
    """fn(*args)'s result and seconds, `device` idle at both ends (its queued work counted)."""
    synchronize(device)
    t0 = time.perf_counter()
    out = fn(*args)
    synchronize(device)
    return out, time.perf_counter() - t0


ST_ONNX_ROW = "sentence-transformers onnx int8"


def bench_embed(
    model: str,
    texts: list[str],
    batch: int,
    precision: str,
    rounds: int,
    log=print,
    ray_address: str | None = None,
    st_onnx_int8: bool = False,
    device: torch.device | str = "auto",
) -> list[dict]:
    """The rows of the embedding race on `device` (frugality's and sentence-transformers';
    the Ray job and the ONNX peer run on the CPU); `st_onnx_int8` adds sentence-transformers'
    own ONNX int8 backend (`st_onnx_int8_model`) as a peer."""
    device = bench_device(device)
    cpu = torch.device("cpu")
    ours, why = load_encoder(model, device, precision)
    # the Ray job in the same precision as ours, not `auto` resolved again for its CPU
    ours_precision = "int8" if ours.int8 else {torch.float32: "fp32", torch.bfloat16: "bf16"}[ours.dtype]
    try:
        import sentence_transformers
    except ImportError as e:
        missing = _missing("sentence-transformers", e)
        log(f"sentence-transformers skipped: {missing}")
    else:
        missing = None
        theirs = sentence_transformers.SentenceTransformer(model, device=str(device))
        if ours.dtype != torch.float32:
            theirs = theirs.to(ours.dtype)
    normalize = ours.pooling.normalize
    tokens = batch * 32  # the token budget: `batch` texts of up to 32 tokens, fewer longer ones

    def frugality_run():
        return embed_texts(ours, texts, tokens, batch)

    def st_run():
        return theirs.encode(texts, batch_size=batch, normalize_embeddings=normalize, convert_to_numpy=True)

    impls = {"frugality": frugality_run} | ({} if missing else {"sentence-transformers": st_run})
    with (
        _ray_job(model, texts, batch, ours_precision, ray_address) as ray_run,
        st_onnx_int8_model(model, log) if st_onnx_int8 else contextlib.nullcontext((None, "")) as (
            onnx_peer,
            onnx_note,
        ),
    ):
        if onnx_peer is not None:
            impls[ST_ONNX_ROW] = lambda: onnx_peer.encode(
                texts, batch_size=batch, normalize_embeddings=normalize, convert_to_numpy=True
            )
        if ray_run:
            impls[RAY_ROW] = ray_run
        for name, fn in impls.items():  # warm-up: allocator, thread pools
            if name != RAY_ROW:  # (each Ray round is a new job: its actors' start is what it measures)
                fn()
        seconds = {name: [] for name in impls}
        outputs = {}
        for r in range(rounds):
            for name, fn in impls.items():
                outputs[name], took = _timed(device, fn)
                seconds[name].append(took)
                log(f"round {r + 1}: {name} {len(texts) / seconds[name][-1]:,.0f} texts/s")
    cosines = {}
    if not missing:
        unit = (lambda v: v) if normalize else (lambda v: v / np.linalg.norm(v, axis=1, keepdims=True))  # noqa: E731
        b = unit(np.asarray(outputs["sentence-transformers"], dtype=np.float32))
        for name in impls.keys() - {"sentence-transformers"}:
            cosines[name] = (unit(np.asarray(outputs[name], dtype=np.float32)) * b).sum(1)
    best = {name: min(ts) for name, ts in seconds.items()}
    rows = []
    extra = [*([RAY_ROW] if RAY_ROW in impls else []), *([ST_ONNX_ROW] if st_onnx_int8 else [])]
    for name in ("sentence-transformers", "frugality", *extra):
        run = name in best
        skipped = onnx_note if name == ST_ONNX_ROW else missing
        rows.append(
            {
                "implementation": name,
                **ran_on(cpu if name in (RAY_ROW, ST_ONNX_ROW) else device),
                "precision": "int8"
                if (ours.int8 and name != "sentence-transformers") or name == ST_ONNX_ROW
                else str(ours.dtype).removeprefix("torch."),
                "batch": batch,
                "texts": len(texts),
                "texts_per_s": round(len(texts) / best[name], 1) if run else None,
                "rounds_texts_per_s": [round(len(texts) / t, 1) for t in seconds[name]] if run else None,
                "vs_sentence_transformers": round(best["sentence-transformers"] / best[name], 3)
                if run and not missing
                else None,
                "min_cosine": round(float(cosines[name].min()), 6) if name in cosines else None,
                "mean_cosine": round(float(cosines[name].mean()), 6) if name in cosines else None,
                "threads": torch.get_num_threads() if name != RAY_ROW else 1,  # embed_ray: a thread a CPU actor
                "precision_choice": onnx_note if name == ST_ONNX_ROW else why,
                "skipped": None if run else skipped,
            }
        )
    return rows


@contextlib.contextmanager
def st_onnx_int8_model(model: str, log=print):
    """sentence-transformers' ONNX int8 backend as its docs set it up: the model loaded with
    `backend="onnx"` (exported by optimum), then `export_dynamic_quantized_onnx_model` with
    the configuration for this CPU's instructions, loaded again from the quantized file (a
    copy of the model folder in a temporary one). Yields (model, how) or (None, why not):
    optimum-onnx pins transformers below 4.58, which sentence-transformers 6 cannot use, so
    it installs in a venv of its own (benchmarks/embed_throughput.py says how)."""
    import platform

    from frugality.hardware import cpu_flags

    try:
        import optimum.onnxruntime  # noqa: F401
        import sentence_transformers
    except ImportError as e:
        yield None, _missing("optimum-onnx", e) + " (it needs transformers < 4.58: a venv of its own)"
        return
    flags = cpu_flags()
    if platform.machine() in ("aarch64", "arm64"):
        config = "arm64"
    else:
        config = "avx512_vnni" if "avx512_vnni" in flags else "avx512" if "avx512f" in flags else "avx2"
    with tempfile.TemporaryDirectory(prefix="frugality-bench-st-onnx-") as tmp:
        try:  # an export that fails is a row saying so; the race goes on
            peer, how = _st_onnx_int8(sentence_transformers, model, Path(tmp) / "model", config)
        except Exception as e:  # noqa: BLE001
            peer, how = (
                None,
                f"its ONNX int8 export failed ({type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''})",
            )
        log(f"{ST_ONNX_ROW}: {how}")
        yield peer, how


def _st_onnx_int8(sentence_transformers, model: str, folder: Path, config: str):
    import shutil

    shutil.copytree(model, folder)
    exported = sentence_transformers.SentenceTransformer(str(folder), device="cpu", backend="onnx")
    sentence_transformers.export_dynamic_quantized_onnx_model(exported, config, str(folder))
    del exported  # its fp32 session is not raced
    # model_qint8_<config>.onnx, or quint8 where the configuration's weights are uint8 (avx2's)
    found = sorted(folder.glob(f"onnx/model_q*int8_{config}.onnx"))
    if not found:
        raise FileNotFoundError(f"no onnx/model_q*int8_{config}.onnx after the export")
    name = found[0].relative_to(folder).as_posix()
    peer = sentence_transformers.SentenceTransformer(
        str(folder), device="cpu", backend="onnx", model_kwargs={"file_name": name}
    )
    return peer, f"sentence-transformers {sentence_transformers.__version__}, backend onnx, {name} (optimum)"


RAY_ROW = "frugality embed --engine ray"


@contextlib.contextmanager
def _ray_job(model: str, texts: list[str], batch: int, precision: str, address: str | None):
    """A function running the texts as one `embed --engine ray` job into a fresh folder and
    returning its vectors in input order, with the cluster joined (None: no Ray row)."""
    if address is None:
        yield None
        return
    from frugality.data.ray_cluster import joined
    from frugality.inference.embed import EmbedSettings, read_embeddings, run_job
    from frugality.inference.inputs import open_inputs

    with (
        tempfile.TemporaryDirectory(prefix="frugality-bench-ray-") as tmp,
        joined(None if address == "local" else address) as ray,
    ):
        source = Path(tmp) / "texts.jsonl"
        source.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts))
        actors = max(1, int(ray.cluster_resources().get("CPU", 1)))
        shard = -(-len(texts) // (4 * actors))  # four shards an actor: work to share out
        runs = iter(range(1_000_000))

        def ray_run():
            out = Path(tmp) / f"out-{next(runs)}"
            settings = EmbedSettings(model, str(out), shard, batch * 32, batch, precision, "cpu")
            run_job(settings, open_inputs([str(source)]), progress=False, engine="ray")
            return read_embeddings(out)[1]

        yield ray_run


def _device_cell(row: dict) -> str:
    """`cuda:0 (NVIDIA H200)`, `cpu (AMD EPYC 9R14)`; "—" where a row names none."""
    if not row.get("device"):
        return "—"
    return f"{row['device']} ({row['device_name']})" if row.get("device_name") else row["device"]


def markdown_table(rows: list[dict]) -> str:
    lines = [
        "| implementation | device | precision | batch | texts | texts/s | vs sentence-transformers "
        "| min cosine | mean cosine |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"| {r['implementation']} | {_device_cell(r)} | {r['precision']} | {r['batch']} | {r['texts']:,} | "
                f"not run: {r['skipped']} | | | |"
            )
            continue
        cosine = "—" if r["min_cosine"] is None else f"{r['min_cosine']:.6f}"
        mean = "—" if r.get("mean_cosine") is None else f"{r['mean_cosine']:.6f}"
        versus = "—" if r["vs_sentence_transformers"] is None else f"{r['vs_sentence_transformers']:.2f}×"
        lines.append(
            f"| {r['implementation']} | {_device_cell(r)} | {r['precision']} | {r['batch']} | {r['texts']:,} | "
            f"{r['texts_per_s']:,.0f} | {versus} | {cosine} | {mean} |"
        )
    return "\n".join(lines)


def rows_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2)


def bench_generate(
    model: str,
    batches: list[int],
    prompt_tokens: int,
    new_tokens: int,
    rounds: int,
    compile: bool | str = False,
    log=print,
    precision: str = "fp32",
    device: torch.device | str = "auto",
) -> list[dict]:
    """`frugality generate`'s engine against transformers' `generate` on the same weights and
    `device` (both in `precision`, fp32 or bf16; frugality's int8 against transformers' fp32;
    greedy, no stop token, `new_tokens` each, prompts of `prompt_tokens` tokens cut from the
    bundled corpus: all of one length, so transformers pads none; frugality pads them to its
    prompt bucket, 16, 32, 64, ...), alternating rounds, the best of each. Both are timed
    alike: a run of one new token is the prefill; a run of `new_tokens` less that one is the
    decoding of the other `new_tokens - 1`. Also whether the two outputs agree token for token.

    `compile` (True: Inductor; or a backend's name, "eager" in tests): frugality's engine
    compiled (its decoding step replayed as a CUDA graph on a GPU), and transformers with
    its static cache, which transformers itself compiles on a GPU (`reduce-overhead`, as its
    docs advise). Each side's warm-up (the compiles) is timed apart from the rounds."""
    from frugality.inference.generate import Engine, Sampling, cache_length, load_decoder

    device = bench_device(device)
    backend_name = ("inductor" if compile is True else compile) or None
    decoder, _ = load_decoder(model, device, precision, pack=not backend_name)
    theirs_precision = "bf16" if precision == "bf16" else "fp32"  # (int8: against fp32)
    theirs_dtype = torch.bfloat16 if theirs_precision == "bf16" else torch.float32
    theirs_name = "transformers"
    try:
        import transformers
    except ImportError as e:
        missing = _missing("transformers", e)
        log(f"transformers skipped: {missing}")
    else:
        missing = None
        theirs = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=theirs_dtype).eval()
        # a Module's `to`, in place; pyright reads it through generate's protocol (as below)
        theirs.to(device)  # pyright: ignore[reportArgumentType]
        theirs.generation_config.eos_token_id = None  # every row runs to max_new_tokens, as ours do
        if backend_name:
            theirs.generation_config.cache_implementation = "static"
            # (transformers compiles a static cache's forward on the devices it lists, GPUs among them)
            compiled = _transformers_compiles(theirs)
            theirs_name = f"transformers (static cache{', compiled' if compiled else ''})"
    if prompt_tokens + new_tokens - 1 > decoder.max_seq_len:
        raise UserError(
            f"--prompt-tokens {prompt_tokens} + --new-tokens {new_tokens} pass the model's "
            f"{decoder.max_seq_len} positions"
        )
    prompts, width = _corpus_prompts(decoder, max(batches), prompt_tokens), prompt_tokens
    length = cache_length(width, new_tokens, decoder.max_seq_len)
    engines = {b: Engine(decoder, b, length, backend_name) for b in batches}
    if backend_name and not missing:  # one cache length for every call (else a compile per length)
        theirs.generation_config.max_cache_len = length

    def ours(batch: int, new: int) -> list[list[int]]:
        done = engines[batch].generate(prompts[:batch], Sampling(max_new_tokens=new))
        return [c.tokens for c in done]

    def hf(batch: int, new: int) -> list[list[int]]:
        ids = torch.tensor(prompts[:batch], device=device)
        with torch.no_grad():
            # transformers types generate's self as a protocol its own models fail to match
            out = theirs.generate(  # pyright: ignore[reportAttributeAccessIssue]
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False, pad_token_id=0
            )
        return out[:, width:].tolist()

    impls = ({} if missing else {"transformers": hf}) | {"frugality": ours}
    warmup: dict[str, float] = {}
    best: dict[tuple[str, int, int], float] = {}
    outputs: dict[tuple[str, int], list[list[int]]] = {}
    # a batch size at a time (transformers' static cache is made for one batch size), its
    # warm-up first: each side's allocator, threads and compiles, at the timed runs'
    # own shapes (a CUDA graph is recorded at a step's second call)
    for batch in batches:
        for name, fn in impls.items():
            warmup[name] = warmup.get(name, 0.0) + sum(_timed(device, fn, batch, n)[1] for n in (1, new_tokens))
        for r in range(rounds):
            for name, fn in impls.items():
                for new in (1, new_tokens):
                    out, seconds = _timed(device, fn, batch, new)
                    best[name, batch, new] = min(best.get((name, batch, new), seconds), seconds)
                    if new == new_tokens:
                        outputs[name, batch] = out
            log(
                f"round {r + 1}, batch {batch}: "
                + ", ".join(
                    f"{name} {_rates(best, name, batch, width, new_tokens)[1]:,.0f} decode tokens/s"
                    for name in impls
                    if (name, batch, new_tokens) in best
                )
            )
    log("warm-up (compiles included): " + ", ".join(f"{name} {s:.1f} s" for name, s in warmup.items()))
    rows = []
    for batch in batches:
        for name in ("transformers", "frugality"):
            label = theirs_name if name == "transformers" else name + (" (compiled)" if backend_name else "")
            row = {
                "implementation": label,
                **ran_on(device),
                "batch": batch,
                "prompt_tokens": width,
                "new_tokens": new_tokens,
                "prefill_tokens_per_s": None,
                "decode_tokens_per_s": None,
                "prefill_vs_transformers": None,
                "decode_vs_transformers": None,
                "same_tokens": None,
                "precision": precision if name == "frugality" else theirs_precision,
                "warmup_s": round(warmup[name], 2) if name in warmup else None,
                "threads": torch.get_num_threads(),
                "skipped": None if name in impls else missing,
            }
            if name in impls:
                prefill, decode = _rates(best, name, batch, width, new_tokens)
                row |= {"prefill_tokens_per_s": round(prefill, 1), "decode_tokens_per_s": round(decode, 1)}
            if name in impls and not missing:
                reference = _rates(best, "transformers", batch, width, new_tokens)
                row |= {
                    "prefill_vs_transformers": round(prefill / reference[0], 3),
                    "decode_vs_transformers": round(decode / reference[1], 3),
                    "same_tokens": None
                    if name == "transformers"
                    else outputs[name, batch] == outputs["transformers", batch],
                }
            rows.append(row)
    return rows


def _transformers_compiles(model) -> bool:
    """Whether transformers' generate compiles this model's forward with a static cache: on
    the devices its own rule lists (`_valid_auto_compile_criteria`; CUDA among them)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=8)
    try:
        # (the cache's key: "cache" in transformers 5.24, "past_key_values" in others)
        kwargs = {"cache": cache, "past_key_values": cache}
        return bool(model._valid_auto_compile_criteria(kwargs, model.generation_config))
    except (AttributeError, TypeError):  # another transformers: its rule unknown here
        return False


def _rates(best: dict, name: str, batch: int, width: int, new_tokens: int) -> tuple[float, float]:
    """(prefill, decode) tokens/s from the best runs of one and of `new_tokens` new tokens."""
    one, full = best[name, batch, 1], best.get((name, batch, new_tokens), float("nan"))
    return batch * width / one, batch * (new_tokens - 1) / max(full - one, 1e-9)


def generate_markdown_table(rows: list[dict]) -> str:
    lines = [
        "| implementation | device | precision | batch | prompt tokens | new tokens | prefill tokens/s "
        "| decode tokens/s | ms a decoding step | decode vs transformers | same tokens | warm-up s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r.get("skipped"):
            lines.append(
                f"| {r['implementation']} | {_device_cell(r)} | {r['precision']} | {r['batch']} | "
                f"{r['prompt_tokens']} | {r['new_tokens']} | not run: {r['skipped']} | | | | | |"
            )
            continue
        same = "—" if r["same_tokens"] is None else ("yes" if r["same_tokens"] else "no")
        versus = "—" if r["decode_vs_transformers"] is None else f"{r['decode_vs_transformers']:.2f}×"
        step_ms = 1000 * r["batch"] / r["decode_tokens_per_s"]  # (every row advances a token a step)
        warmup = "—" if r.get("warmup_s") is None else f"{r['warmup_s']:.1f}"
        lines.append(
            f"| {r['implementation']} | {_device_cell(r)} | {r['precision']} | {r['batch']} | {r['prompt_tokens']} | "
            f"{r['new_tokens']} | {r['prefill_tokens_per_s']:,.0f} | {r['decode_tokens_per_s']:,.0f} | "
            f"{step_ms:.2f} | {versus} | {same} | {warmup} |"
        )
    return "\n".join(lines)


def _corpus_prompts(decoder, count: int, tokens: int) -> list[list[int]]:
    """`count` prompts of exactly `tokens` tokens: consecutive pieces of the bundled
    corpus, in the model's tokenizer (ids the model has)."""
    import gzip

    from frugality.data.bundled import corpus_files

    with gzip.open(corpus_files()[0], "rt") as f:
        text = f.read(8 * count * tokens + 10_000)
    ids = [
        i for i in decoder.tokenizer.encode(text, add_special_tokens=False).ids if i < decoder.model.config.vocab_size
    ]
    if len(ids) < count * tokens:
        raise UserError(
            f"the bundled corpus gave {len(ids)} tokens, short of {count} prompts x {tokens} tokens; "
            "lower --prompt-tokens or --batch"
        )
    return [ids[k * tokens : (k + 1) * tokens] for k in range(count)]
