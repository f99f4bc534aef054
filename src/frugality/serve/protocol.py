"""Requests as the OpenAI API shapes them, checked against the server's limits; a problem
is an `APIError`: the status and the error object OpenAI returns (message, type, param,
code), naming the field."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import numpy as np


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.kind = status, message, param, kind
        self.headers: dict[str, str] = {}

    def body(self) -> dict:
        message = self.message.encode("utf-8", "backslashreplace").decode()  # (a request's lone surrogate echoed)
        return {"error": {"message": message, "type": self.kind, "param": self.param, "code": None}}


def overloaded(retry_after_s: int = 1) -> APIError:
    error = APIError(503, "the server's queue is full; retry later", None, "server_overloaded")
    error.headers = {"Retry-After": str(retry_after_s)}
    return error


@dataclass(frozen=True)
class Limits:
    max_body_bytes: int = 1 << 20  # a request's body
    max_inputs: int = 256  # texts in one embeddings request
    max_input_tokens: int | None = None  # embeddings: texts are cut to it (None: the model's own length)
    max_tokens: int = 512  # a completion's new tokens
    max_prompts: int = 16  # prompts in one completions request


@dataclass
class Embedded:
    """An embeddings request's answer: its vectors (float32, one row a text), tokens, texts
    cut (here, not beside the service: a front end of `serve --workers` reads it without torch)."""

    vectors: np.ndarray
    tokens: int
    cut: int


@dataclass(frozen=True)
class EmbeddingsRequest:
    model: str
    texts: list[str]
    encoding_format: str  # "float" or "base64"


@dataclass(frozen=True)
class CompletionsRequest:
    model: str
    prompts: list[str]
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None
    stop: tuple[str, ...]
    stream: bool
    echo: bool


def parse_json(body: bytes, limits: Limits) -> dict:
    if len(body) > limits.max_body_bytes:
        raise APIError(
            413, f"the request body is {len(body):,} bytes, more than the limit of {limits.max_body_bytes:,}"
        )
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"the request body is not valid JSON ({e})") from None
    except RecursionError:
        raise APIError(400, "the request body is nested too deeply") from None
    if not isinstance(data, dict):
        raise APIError(400, "the request body must be a JSON object")
    return data


def embeddings_request(data: dict, limits: Limits, served: str) -> EmbeddingsRequest:
    model = _model(data, served)
    texts = _texts(data, "input", "texts", limits.max_inputs)
    fmt = data.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise APIError(400, "'encoding_format' must be 'float' or 'base64'", "encoding_format")
    if data.get("dimensions") is not None:
        raise APIError(400, "'dimensions' is not supported: the model's vectors have one size", "dimensions")
    return EmbeddingsRequest(model, texts, fmt)


def completions_request(data: dict, limits: Limits, served: str) -> CompletionsRequest:
    model = _model(data, served)
    prompts = _texts(data, "prompt", "prompts", limits.max_prompts)
    max_tokens = _number(data, "max_tokens", int, min(16, limits.max_tokens))
    if max_tokens < 1:
        raise APIError(400, f"'max_tokens' is {max_tokens}; it must be at least 1", "max_tokens")
    if max_tokens > limits.max_tokens:
        raise APIError(400, f"'max_tokens' is {max_tokens}, more than the limit of {limits.max_tokens}", "max_tokens")
    temperature = _number(data, "temperature", float, 1.0)
    if not 0 <= temperature <= 2:
        raise APIError(400, f"'temperature' is {temperature}; it must be between 0 and 2", "temperature")
    top_p = _number(data, "top_p", float, 1.0)
    if not 0 < top_p <= 1:
        raise APIError(400, f"'top_p' is {top_p}; it must be in (0, 1]", "top_p")
    seed = data.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise APIError(400, "'seed' must be an integer", "seed")
    stop = data.get("stop")
    stops = () if stop is None else (stop,) if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
        raise APIError(400, "'stop' must be a non-empty string or a list of up to 4 of them", "stop")
    for key in ("n", "best_of"):
        if data.get(key) not in (None, 1):
            raise APIError(400, f"'{key}' other than 1 is not supported", key)
    if data.get("logprobs") is not None:
        raise APIError(400, "'logprobs' is not supported", "logprobs")
    stream = data.get("stream", False)
    if not isinstance(stream, bool):
        raise APIError(400, "'stream' must be true or false", "stream")
    echo = data.get("echo", False)
    if not isinstance(echo, bool):
        raise APIError(400, "'echo' must be true or false", "echo")
    return CompletionsRequest(model, prompts, max_tokens, temperature, top_p, seed, tuple(stops), stream, echo)


def _model(data: dict, served: str) -> str:
    model = data.get("model")
    if not isinstance(model, str) or not model:
        raise APIError(400, "'model' is required: a string", "model")
    if model != served:
        raise APIError(
            404, f"the model '{model}' does not exist here; this server serves '{served}'", "model", "model_not_found"
        )
    return model


def _number(data: dict, key: str, kind: type, default):
    value = data.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
        raise APIError(400, f"'{key}' must be {'an integer' if kind is int else 'a number'}", key)
    try:
        return kind(value)
    except OverflowError:
        raise APIError(400, f"'{key}' is out of range", key) from None


def _texts(data: dict, key: str, what: str, limit: int) -> list[str]:
    """`data[key]`: a text or a list of texts (not token arrays, which OpenAI also takes),
    each non-empty and whole, at most `limit` of them."""
    given = data.get(key)
    if given is None:
        raise APIError(400, f"'{key}' is required", key)
    texts = [given] if isinstance(given, str) else given
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise APIError(400, f"'{key}' must be a string or a list of strings", key)
    if not texts:
        raise APIError(400, f"'{key}' is empty", key)
    if len(texts) > limit:
        raise APIError(400, f"'{key}' holds {len(texts)} {what}, more than the limit of {limit}", key)
    for i, text in enumerate(texts):
        if not text:
            raise APIError(400, f"'{key}[{i}]' is an empty string", key)
        _text(text, f"{key}[{i}]", key)
    return texts


def _text(text: str, where: str, param: str) -> None:
    """Text the tokenizer can take: no lone surrogate (JSON's "\\ud800", half a character)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"'{where}' holds a lone surrogate, not text", param) from None
