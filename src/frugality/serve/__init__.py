"""`frugality serve`: a model behind an OpenAI-compatible HTTP API (FastAPI on uvicorn, the
`[serve]` extra), with dynamic batching, a bounded queue, Prometheus metrics and a drain on
SIGTERM.

- `protocol`: requests parsed and checked as the OpenAI API shapes them; errors as its
  error objects, naming the field.
- `embeddings`: continuous batching: a tokenizer thread and a model thread, each taking
  what is queued when it is free, up to a token budget.
- `completions`: one decoding loop on the static key/value cache, rows joining and leaving
  between steps (continuous batching).
- `metrics`: the Prometheus registry (`GET /metrics`).
- `app`: the routes; `server`: loading, uvicorn, the drain.
"""
