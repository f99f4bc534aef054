"""Text generation with the decoders (GPT-NeoX, Llama): the engine behind `frugality generate`.

Shapes stay static, so that a compiled model compiles once and never again:
- one key/value cache (`frugality.models.kv_cache`) of `batch` rows for the whole job, long
  enough for the longest prompt and the new tokens (rounded up to a multiple of 64);
- every batch has `batch` rows: a short last batch is filled with one-token rows whose
  output is dropped;
- prompts are left-padded to a bucket width (16, 32, 64, ... tokens), so the prefill
  compiles once per bucket;
- each decoding step feeds one token per row with its position as a tensor, never a
  Python number: the same graph at every step. Rows that have finished keep decoding
  (their tokens are dropped) rather than shrink the batch.

Positions follow transformers' generate under left padding: each row counts from its first
real token, and padding is hidden from every query, so greedy output equals
`model.generate(..., do_sample=False)` token for token (tests/inference/test_generate.py).

Sampling runs eagerly on the last logits: greedy at temperature 0, else temperature, top-k
and top-p (the smallest set of tokens whose probability reaches p), drawn from a
torch.Generator seeded by `seed`, so a run repeats exactly.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from tokenizers import Tokenizer

from frugality import xla
from frugality.backends import backend
from frugality.data.tokenizer import load_tokenizer
from frugality.errors import UserError
from frugality.inference.encoder import load_model, resolve_precision
from frugality.kernels.packed_linear import pack_linear_weights
from frugality.models import Decoder as DecoderModel
from frugality.models.families import DECODERS
from frugality.models.kv_cache import KVCache
from frugality.precision import bf16_is_native
from frugality.precision.int8 import quantize_int8

# End-of-text tokens looked for in a tokenizer when the model's config names none.
EOS_CANDIDATES = ("<|endoftext|>", "</s>", "<eos>", "<|end_of_text|>", "<|eot_id|>", "<|im_end|>")
MIN_BUCKET = 16
CACHE_GRAIN = 64


@dataclass(frozen=True)
class Sampling:
    max_new_tokens: int = 64
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: every token
    top_p: float = 1.0  # 1: every token
    seed: int = 0
    stop_ids: tuple[int, ...] = ()  # a row ends at any of these (kept in its tokens, not in its text)
    stop_strings: tuple[str, ...] = ()  # ... or once its text holds any of these (cut before it)

    def __post_init__(self) -> None:
        if self.max_new_tokens < 1:
            raise UserError(f"--max-new-tokens {self.max_new_tokens}: must be at least 1")
        if self.temperature < 0:
            raise UserError(f"--temperature {self.temperature}: must not be negative")
        if self.top_k < 0:
            raise UserError(f"--top-k {self.top_k}: must not be negative (0: off)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"--top-p {self.top_p}: must be in (0, 1]")
        if any(not s for s in self.stop_strings):
            raise UserError("--stop: a stop string must not be empty")


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)  # the new tokens, a stop token that ended the row included
    text: str = ""  # their text, without a stop token or stop string
    finish: str = "length"  # "stop" (a stop token or string) or "length" (max_new_tokens)


class Decoder:
    """A decoder ready to generate: the model in eval mode, its tokenizer, its end tokens."""

    def __init__(
        self,
        model: DecoderModel,
        tokenizer: Tokenizer,
        eos_ids: tuple[int, ...],
        device: torch.device,
        dtype: torch.dtype,
        source: Path,
    ) -> None:
        self.model, self.tokenizer, self.eos_ids = model.eval(), tokenizer, eos_ids
        self.device, self.dtype, self.source = device, dtype, source
        self.max_seq_len = model.config.max_seq_len
        tokenizer.no_padding()
        tokenizer.no_truncation()

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Token ids with the tokenizer's own special tokens (a Llama tokenizer's <s>)."""
        return [e.ids for e in self.tokenizer.encode_batch(texts)]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


def load_decoder(
    path: str | Path, device: torch.device, precision: str = "auto", pack: bool = True
) -> tuple[Decoder, str]:
    """The decoder at `path` (a Hugging Face folder, an imported folder or a run) on
    `device`, and the precision line (what was chosen, why). `pack`: in bf16 on a CPU with
    native bf16, the linear layers' weights laid out once for oneDNN
    (`frugality.kernels.packed_linear`); pass False for a model torch.compile will take
    (Inductor cannot lower the packed op outside its own freezing pass)."""
    dtype, why = resolve_precision(precision, device, encoder=False)
    loaded = load_model(path, _check_decoder)
    tokenizer = _open_tokenizer(loaded.tokenizer, Path(path))
    eos = _eos_ids(Path(path), tokenizer)
    model = cast(DecoderModel, loaded.model).to(device=device, dtype=dtype)  # as _check_decoder admitted
    if precision == "int8":
        quantize_int8(model)
    elif pack and dtype == torch.bfloat16 and backend(device).on_host and bf16_is_native(device)[0]:
        packed = pack_linear_weights(model)  # (the output layer too, unless tied to the embedding)
        why += "; linear layers' weights packed for oneDNN" if packed else ""
    return Decoder(model, tokenizer, eos, device, dtype, loaded.weights), why


def _check_decoder(config, folder: Path) -> None:
    if config.family not in DECODERS:
        raise UserError(f"model {folder}: a {config.family} model; `generate` takes a decoder ({', '.join(DECODERS)})")


def _open_tokenizer(spec: str, folder: Path) -> Tokenizer:
    path = Path(spec)
    if path.name == "tokenizer.json" and not path.is_file():
        raise UserError(f"model {folder}: no tokenizer.json beside the weights")
    if not path.is_file():
        return load_tokenizer(spec).tokenizer  # a shipped name, or a folder
    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the library raises bare Exceptions on malformed files
        raise UserError(f"tokenizer {path}: cannot be read: {e}") from None


def _eos_ids(folder: Path, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The model's end tokens: generation_config.json's or config.json's eos_token_id (a
    Hugging Face folder), else the tokenizer's end-of-text tokens."""
    for name in ("generation_config.json", "config.json"):
        try:
            eos = json.loads((folder / name).read_text()).get("eos_token_id")
        except (OSError, json.JSONDecodeError, AttributeError):
            continue
        if isinstance(eos, int):
            return (eos,)
        if isinstance(eos, list) and eos and all(isinstance(i, int) for i in eos):
            return tuple(eos)
    return tuple(i for t in EOS_CANDIDATES if (i := tokenizer.token_to_id(t)) is not None)


def bucket(tokens: int, cap: int) -> int:
    """The width prompts of up to `tokens` tokens are padded to: 16, 32, 64, ... at most `cap`."""
    width = MIN_BUCKET
    while width < tokens:
        width *= 2
    return min(width, cap)


def cache_length(longest_prompt: int, max_new_tokens: int, max_seq_len: int) -> int:
    """Positions a cache needs for prompts of up to `longest_prompt` tokens followed by
    `max_new_tokens` (the last one is never fed back), rounded up to a multiple of 64."""
    need = longest_prompt + max_new_tokens - 1
    return min(-(-need // CACHE_GRAIN) * CACHE_GRAIN, max_seq_len)


def pick(logits: torch.Tensor, sampling: Sampling, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token of each row from its logits (rows, vocab)."""
    if sampling.temperature == 0:
        return logits.argmax(-1)
    logits = logits.float() / sampling.temperature
    if sampling.top_k:
        kth = logits.topk(min(sampling.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sampling.top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        outside = probs.cumsum(-1) - probs >= sampling.top_p  # the mass before it already reaches p
        logits = logits.scatter(-1, order, ordered.masked_fill(outside, float("-inf")))
    return torch.multinomial(logits.softmax(-1), 1, generator=generator).squeeze(-1)


# Two functions, so that torch.compile keeps the prefill's graphs (one per bucket) apart
# from the decoding step's one graph.
def _prefill(model, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return model(ids, cache=cache, positions=positions)[:, -1]


def _decode(model, ids: torch.Tensor, positions: torch.Tensor, cache: KVCache) -> torch.Tensor:
    return model(ids, cache=cache, positions=positions)[:, -1]


def compiled_steps(decoder: Decoder, cache: KVCache, compile: str | None) -> tuple[Callable, Callable, bool]:
    """The prefill and the decoding step over `cache`, compiled by the torch.compile backend
    `compile` names (None: eager), and whether the step is replayed as a CUDA graph (then
    call `torch.compiler.cudagraph_mark_step_begin()` before each step). `Engine` and
    serve's continuous batching share them.

    On a GPU the compiled decoding step is replayed as a CUDA graph (~300 kernel launches a
    token for a 12-layer model become one), its cache at fixed addresses, as transformers'
    static cache marks its own (`mark_static_address`), so that no replay copies it; the
    prefill (one graph per bucket, run once a batch) is compiled only."""
    if not compile:
        return _prefill, _decode, False
    replays = compile == "inductor" and backend(decoder.device).replays_graphs
    if replays:
        # imported here, on the caller's thread: its thread-local set-up is made on the thread
        # that imports it first (other threads: `replays_on_this_thread`)
        from torch._inductor import cudagraph_trees  # noqa: F401

        for tensor in (*cache.keys, *cache.values):
            torch._dynamo.mark_static_address(tensor)
    prefill = torch.compile(_prefill, backend=compile, dynamic=False)
    decode = torch.compile(_decode, backend=compile, dynamic=False, mode="reduce-overhead" if replays else None)
    return prefill, decode, replays


def refuse_compile_where_traced(device: torch.device) -> None:
    """`--compile` (generate's, serve's) refused in one line on a device that compiles its own graphs."""
    if backend(device).traced:
        raise UserError(f"--compile: on an {device.type} device XLA compiles the graphs itself; leave --compile out")


def replays_on_this_thread() -> None:
    """Make Inductor's CUDA-graph trees usable on the calling thread (serve's decoding loop
    runs on one of its own): their manager lives in thread-local state set up on the thread
    that imported them, and before torch 2.13 another thread failed an assertion there
    (pytorch/pytorch#123177); 2.13 sets it up on each thread itself."""
    from collections import defaultdict
    from threading import Lock

    from torch._inductor import cudagraph_trees as trees

    if hasattr(trees.local, "tree_manager_containers") or torch._C._is_key_in_tls("tree_manager_containers"):
        return
    trees.local.tree_manager_containers = {}
    trees.local.tree_manager_locks = defaultdict(Lock)
    torch._C._stash_obj_in_tls("tree_manager_containers", trees.local.tree_manager_containers)
    torch._C._stash_obj_in_tls("tree_manager_locks", trees.local.tree_manager_locks)


@dataclass
class Timing:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prompt_tokens: int = 0  # real tokens, padding left out
    new_tokens: int = 0  # tokens the decoding steps produced for real rows, finished rows left out


class Engine:
    """Generates for up to `batch` prompts at a time with one cache of `length` positions;
    `compile`: a torch.compile backend ("inductor", or "eager"/"aot_eager" in tests)."""

    def __init__(self, decoder: Decoder, batch: int, length: int, compile: str | None = None) -> None:
        self.decoder, self.batch = decoder, batch
        self.cache = KVCache.for_model(decoder.model, batch, length)
        self.pad_id = decoder.eos_ids[0] if decoder.eos_ids else 0  # any id: padding is never seen
        self.prefill, self.decode, self.replays = compiled_steps(decoder, self.cache, compile)
        self.timing = Timing()

    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        sampling: Sampling,
        generator: torch.Generator | None = None,
        on_text: Callable[[int, str], None] | None = None,
    ) -> list[Completion]:
        """Completions of up to `batch` tokenized prompts. `on_text(row, piece)` gets each
        row's text as it becomes final (streaming); `generator` defaults to one seeded
        with `sampling.seed`."""
        count, device, length = len(prompts), self.decoder.device, self.cache.length
        if not 0 < count <= self.batch:
            raise ValueError(f"{count} prompts for a batch of {self.batch}")
        if any(not p for p in prompts):
            raise ValueError("an empty prompt")
        longest = max(len(p) for p in prompts)
        if longest + sampling.max_new_tokens - 1 > length:
            raise ValueError(
                f"a prompt of {longest} tokens and {sampling.max_new_tokens} new ones exceed the "
                f"cache's {length} positions"
            )
        if generator is None:
            generator = new_generator(device, sampling.seed)
        width = bucket(longest, self.decoder.max_seq_len)
        rows = prompts + [[self.pad_id]] * (self.batch - count)  # filler rows: one token, output dropped
        ids = torch.full((self.batch, width), self.pad_id, dtype=torch.long)
        positions = torch.full((self.batch, width), -1, dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            positions[i, width - len(row) :] = torch.arange(len(row))
        model = self.decoder.model
        t0 = time.perf_counter()
        following = torch.tensor([len(row) for row in rows], device=device)[:, None]  # the next token's position
        logits = self.prefill(model, ids.to(device), positions.to(device), self.cache)
        tokens, picked, following = self._pick(logits, following, sampling, generator)
        t1 = time.perf_counter()
        out = [Completion() for _ in range(count)]
        rows_text = RowText(self.decoder, sampling, on_text)
        done = [False] * count
        for step in range(sampling.max_new_tokens):
            for i, token in enumerate(picked.tolist()[:count]):
                if not done[i]:
                    done[i] = rows_text.add(i, out[i], token)
            if all(done) or step == sampling.max_new_tokens - 1:
                break
            if self.replays:  # a new step: the last replay's outputs are read (its logits picked)
                torch.compiler.cudagraph_mark_step_begin()
            logits = self.decode(model, tokens[:, None], following, self.cache)
            tokens, picked, following = self._pick(logits, following + 1, sampling, generator)
        t2 = time.perf_counter()
        for i, completion in enumerate(out):
            rows_text.finish(i, completion)
        self.timing = Timing(t1 - t0, t2 - t1, sum(map(len, prompts)), sum(len(c.tokens) for c in out) - count)
        return out

    def _pick(self, logits, following, sampling, generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The next tokens (on the device, and as the host reads them), and the positions
        they will take. On XLA the step's graph ends here (the cache written, the positions
        advanced: one graph per prefill bucket, and one that every decoding step shares)
        and tokens are picked on the host, whose generator draws what it draws on a CPU."""
        if not backend(self.decoder.device).traced:
            tokens = pick(logits, sampling, generator)
            return tokens, tokens, following
        xla.sync()
        picked = pick(logits.cpu(), sampling, generator)
        return picked.to(self.decoder.device), picked, following


def new_generator(device: torch.device, seed: int) -> torch.Generator:
    """The sampling generator: on the device, or the host's for XLA (which samples there)."""
    return torch.Generator(backend(device).generator_device()).manual_seed(seed)


class RowText:
    """Each row's text as its tokens come: the stop strings looked for, and for streaming
    the text that is final (no half of a UTF-8 character, no possible start of a stop
    string) handed on piece by piece."""

    def __init__(self, decoder: Decoder, sampling: Sampling, on_text: Callable[[int, str], None] | None) -> None:
        self.decoder, self.sampling, self.on_text = decoder, sampling, on_text
        self.shown: dict[int, int] = {}

    def add(self, row: int, completion: Completion, token: int) -> bool:
        """Append `token`; whether the row has ended."""
        completion.tokens.append(token)
        if token in self.sampling.stop_ids:
            completion.finish = "stop"
            return True
        if not (self.sampling.stop_strings or self.on_text):
            return False
        text = self.decoder.decode(completion.tokens)
        cut = min((i for s in self.sampling.stop_strings if (i := text.find(s)) >= 0), default=-1)
        if cut >= 0:
            completion.finish, completion.text = "stop", text[:cut]
            return True
        if self.on_text:
            final = len(text.rstrip("\ufffd"))
            for s in self.sampling.stop_strings:  # hold back what may be the start of a stop string
                final = min(
                    final, next((len(text) - k for k in range(len(s) - 1, 0, -1) if text.endswith(s[:k])), final)
                )
            self._show(row, text[:final])
        return False

    def finish(self, row: int, completion: Completion) -> None:
        if completion.finish == "length" or completion.tokens[-1] in self.sampling.stop_ids:
            ended = completion.tokens[-1] in self.sampling.stop_ids
            completion.text = self.decoder.decode(completion.tokens[:-1] if ended else completion.tokens)
        if self.on_text:
            self._show(row, completion.text)

    def _show(self, row: int, text: str) -> None:
        assert self.on_text is not None  # (called where it is set)
        shown = self.shown.get(row, 0)
        if len(text) > shown:
            self.on_text(row, text[shown:])
            self.shown[row] = len(text)


def fit_prompts(decoder: Decoder, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], int]:
    """Prompts cut from the left to leave room for `max_new_tokens` in the model's
    max_seq_len, and how many were cut."""
    room = decoder.max_seq_len - max_new_tokens + 1  # the last new token is never fed back
    if room < 1:
        raise UserError(
            f"--max-new-tokens {max_new_tokens}: the model takes at most {decoder.max_seq_len} "
            f"positions, prompt included"
        )
    cut = sum(len(p) > room for p in prompts)
    return [p[-room:] for p in prompts], cut


def generate_all(
    decoder: Decoder,
    items: list[tuple[str, str]],
    sampling: Sampling,
    batch: int,
    compile: str | None = None,
    on_row: Callable[[dict], None] | None = None,
    on_text: Callable[[int, str], None] | None = None,
) -> dict:
    """Complete every (id, prompt) of `items` in batches of `batch`, in order: `on_row`
    gets one record per prompt (id, prompt, completion, token counts, finish), `on_text`
    each batch's text as it comes (streaming one prompt). Returns the job's totals."""
    encoded = decoder.encode([text for _, text in items])
    empty = next((key for (key, _), ids in zip(items, encoded, strict=True) if not ids), None)
    if empty is not None:
        raise UserError(f"prompt {empty}: no tokens (an empty prompt)")
    encoded, cut = fit_prompts(decoder, encoded, sampling.max_new_tokens)
    length = cache_length(max(map(len, encoded)), sampling.max_new_tokens, decoder.max_seq_len)
    if compile:
        refuse_compile_where_traced(decoder.device)
    engine = Engine(decoder, min(batch, len(items)), length, compile)
    generator = new_generator(decoder.device, sampling.seed)
    totals = Timing()
    for start in range(0, len(items), engine.batch):
        prompts = encoded[start : start + engine.batch]
        completions = engine.generate(prompts, sampling, generator, on_text)
        for k, (prompt, completion) in enumerate(zip(prompts, completions, strict=True)):
            key, text = items[start + k]
            if on_row:
                on_row(
                    {
                        "id": key,
                        "prompt": text,
                        "completion": completion.text,
                        "prompt_tokens": len(prompt),
                        "completion_tokens": len(completion.tokens),
                        "finish": completion.finish,
                    }
                )
        t = engine.timing
        totals = Timing(
            totals.prefill_s + t.prefill_s,
            totals.decode_s + t.decode_s,
            totals.prompt_tokens + t.prompt_tokens,
            totals.new_tokens + t.new_tokens,
        )
    return {"prompts": len(items), "cut": cut, "timing": totals, "batch": engine.batch, "cache_length": length}
