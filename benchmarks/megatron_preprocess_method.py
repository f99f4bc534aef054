"""Megatron-LM's `tools/preprocess_data.py` pipeline, re-created for the `data prepare`
benchmark: the script is not in the megatron-core wheel (it needs Megatron-LM's training
package), so its method is rebuilt here from the same parts.

- A `multiprocessing.Pool` of `--workers`, each loading the tokenizer once (its
  `initializer`).
- The input `.jsonl` read line by line by the main process and fed to the pool with
  `imap(encode, lines, 32)`: in order, 32 lines a task.
- Each worker parses a line, tokenizes its text with a Hugging Face fast tokenizer called
  on one text (Megatron's `HuggingFaceTokenizer.tokenize`: `tokenizer(text).input_ids`),
  and appends the end-of-document token (`--append-eod`).
- The main process adds each document to megatron-core's `IndexedDatasetBuilder`.

    .venv/bin/python benchmarks/megatron_preprocess_method.py INPUT.jsonl OUT_PREFIX WORKERS
"""

from __future__ import annotations

import json
import multiprocessing
import sys

_TOKENIZER = {}


def _load(tokenizer_file: str) -> None:
    from transformers import PreTrainedTokenizerFast

    _TOKENIZER["tok"] = PreTrainedTokenizerFast(tokenizer_file=tokenizer_file)


def _encode(line: str) -> tuple[list[int], int]:
    text = json.loads(line)["text"]
    return _TOKENIZER["tok"](text).input_ids, len(line)


def main(input_path: str, out_prefix: str, workers: int) -> int:
    import numpy as np
    from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder

    from frugality.data.tokenizer import load_tokenizer

    tokenizer = load_tokenizer("pythia")
    saved = f"{out_prefix}.tokenizer.json"
    tokenizer.tokenizer.save(saved)
    builder = IndexedDatasetBuilder(f"{out_prefix}.bin", dtype=np.uint16)
    documents = tokens = 0
    with multiprocessing.Pool(workers, initializer=_load, initargs=(saved,)) as pool, open(input_path) as lines:
        for ids, _ in pool.imap(_encode, lines, 32):
            ids.append(tokenizer.eod_id)
            # a list, as Megatron's own preprocess_data.py passes (its stub says Tensor)
            builder.add_document(ids, [len(ids)])  # pyright: ignore[reportArgumentType]
            documents += 1
            tokens += len(ids)
    builder.finalize(f"{out_prefix}.idx")
    print(json.dumps({"documents": documents, "tokens": tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
