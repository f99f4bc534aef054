"""`frugality bench infer`: frugality's embedding path against sentence-transformers'
`encode` on the same model, texts, batch size and precision, in one process, alternating
rounds so that both share the machine's drift: texts/s (tokenization included) and the
cosine between the two outputs."""

from __future__ import annotations

import json
import time

import numpy as np
import torch

from frugality.inference.embed import embed_texts
from frugality.inference.encoder import load_encoder


def bench_embed(model: str, texts: list[str], batch: int, precision: str, rounds: int, log=print) -> list[dict]:
    import sentence_transformers

    device = torch.device("cpu")
    ours, why = load_encoder(model, device, precision)
    theirs = sentence_transformers.SentenceTransformer(model, device="cpu")
    if ours.dtype != torch.float32:
        theirs = theirs.to(ours.dtype)
    normalize = ours.pooling.normalize
    tokens = batch * 32  # the token budget: `batch` texts of up to 32 tokens, fewer longer ones

    def frugality_run():
        return embed_texts(ours, texts, tokens, batch)

    def st_run():
        return theirs.encode(texts, batch_size=batch, normalize_embeddings=normalize, convert_to_numpy=True)

    frugality_run(), st_run()  # warm-up: allocator, thread pools
    seconds = {"frugality": [], "sentence-transformers": []}
    outputs = {}
    for r in range(rounds):
        for name, fn in (("frugality", frugality_run), ("sentence-transformers", st_run)):
            t0 = time.perf_counter()
            outputs[name] = fn()
            seconds[name].append(time.perf_counter() - t0)
            log(f"round {r + 1}: {name} {len(texts) / seconds[name][-1]:,.0f} texts/s")
    a, b = outputs["frugality"], np.asarray(outputs["sentence-transformers"], dtype=np.float32)
    if not normalize:
        a = a / np.linalg.norm(a, axis=1, keepdims=True)
        b = b / np.linalg.norm(b, axis=1, keepdims=True)
    cosine = (a * b).sum(1)
    best = {name: min(ts) for name, ts in seconds.items()}
    rows = []
    for name in ("sentence-transformers", "frugality"):
        rows.append({"implementation": name, "precision": str(ours.dtype).removeprefix("torch."), "batch": batch,
                     "texts": len(texts), "texts_per_s": round(len(texts) / best[name], 1),
                     "vs_sentence_transformers": round(best["sentence-transformers"] / best[name], 3),
                     "min_cosine": None if name == "sentence-transformers" else round(float(cosine.min()), 6),
                     "threads": torch.get_num_threads(), "precision_choice": why})
    return rows


def markdown_table(rows: list[dict]) -> str:
    lines = ["| implementation | precision | batch | texts | texts/s | vs sentence-transformers | min cosine |",
             "|---|---|---|---|---|---|---|"]
    for r in rows:
        cosine = "—" if r["min_cosine"] is None else f"{r['min_cosine']:.6f}"
        lines.append(f"| {r['implementation']} | {r['precision']} | {r['batch']} | {r['texts']:,} | "
                     f"{r['texts_per_s']:,.0f} | {r['vs_sentence_transformers']:.2f}× | {cosine} |")
    return "\n".join(lines)


def rows_json(rows: list[dict]) -> str:
    return json.dumps(rows, indent=2)
