"""`frugality serve MODEL`: an OpenAI-compatible endpoint for an encoder or a decoder."""

from __future__ import annotations

import click

from frugality.cli.options import inference_precision

SERVE_NEEDS = ("fastapi", "uvicorn", "prometheus_client", "orjson")  # the [serve] extra's modules it cannot run without


@click.command()
@click.argument("model", type=click.Path())
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on (loopback by default).")
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535), help="0: any free port.")
@click.option("--name", help="The model's name in the API [default: the folder's name].")
@click.option("--device", default="auto", show_default=True)
@inference_precision
@click.option(
    "--max-wait-ms",
    type=click.FloatRange(min=0),
    help="How long an idle model waits after a request for others to batch with it (those that "
    "arrive while a batch runs join the next one anyway) [default: 0 for embeddings, 5 for completions].",
)
@click.option(
    "--max-queue",
    default=256,
    show_default=True,
    type=click.IntRange(min=1),
    help="Requests (embeddings) or prompts (completions) waiting; past it, 503 with Retry-After.",
)
@click.option(
    "--batch-tokens",
    type=click.IntRange(min=1),
    help="Embeddings: tokens a model call (the texts a call stay the model's default) [default: embed's].",
)
@click.option(
    "--rows", default=8, show_default=True, type=click.IntRange(min=1), help="Completions: prompts decoding at once."
)
@click.option(
    "--context", type=click.IntRange(min=2), help="Completions: positions a row holds [default: the model's]."
)
@click.option(
    "--compile",
    "compile_",
    is_flag=True,
    help="Completions: the decoding step and the prefill compiled by Inductor, as `generate --compile` (the "
    "step replayed as a CUDA graph on a GPU): the step and the shortest prompts' bucket before the server is "
    "ready, each longer bucket at its first prompt.",
)
@click.option("--max-body-kb", default=1024, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--max-inputs", default=256, show_default=True, type=click.IntRange(min=1), help="Texts in one embeddings request."
)
@click.option(
    "--max-length",
    "--max-input-tokens",
    "max_input_tokens",
    type=click.IntRange(min=2),
    help="Embeddings: cut texts to this many tokens, as `embed --max-length` does [default: the model's length].",
)
@click.option(
    "--max-tokens",
    default=512,
    show_default=True,
    type=click.IntRange(min=1),
    help="The largest max_tokens a completions request may ask.",
)
@click.option(
    "--max-prompts",
    default=16,
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompts in one completions request.",
)
@click.option("--api-key-env", help="Require `Authorization: Bearer $NAME` (the key read from this variable).")
@click.option(
    "--runs",
    "runs_dir",
    default="runs",
    show_default=True,
    type=click.Path(),
    help="Where `frugality top` finds this server: RUNS/serve-NAME-PORT holds its lock and log.",
)
@click.option(
    "--workers",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Embeddings: processes answering HTTP, all feeding the one model process's batches (one "
    "process's Python caps the requests a second it can answer; a GPU's model outruns it).",
)
@click.option(
    "--streams",
    default=1,
    show_default=True,
    type=click.IntRange(min=1),
    help="Embeddings on a CPU: model calls running at once, each on its share of the cores (more "
    "requests answered a second near saturation; a lone request slower, on fewer cores; N times "
    "the activations' memory).",
)
@click.option(
    "--drain-s",
    default=30.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="On SIGTERM: how long requests in flight may take to finish.",
)
def serve(
    model,
    host,
    port,
    name,
    device,
    precision,
    max_wait_ms,
    max_queue,
    batch_tokens,
    rows,
    context,
    compile_,
    max_body_kb,
    max_inputs,
    max_input_tokens,
    max_tokens,
    max_prompts,
    api_key_env,
    runs_dir,
    workers,
    streams,
    drain_s,
) -> None:
    """Serve MODEL (an encoder: POST /v1/embeddings; a decoder: POST /v1/completions) as
    the OpenAI API does, with GET /v1/models, /health and /metrics. Needs the [serve] extra."""
    import importlib.util

    from frugality.errors import UserError

    missing = [m for m in SERVE_NEEDS if importlib.util.find_spec(m) is None]
    if missing:  # (before the server's modules, which import them)
        raise UserError(f"frugality serve needs its extra ({', '.join(missing)} missing): pip install -e '.[serve]'")
    from frugality.serve.protocol import Limits
    from frugality.serve.server import ServeSettings
    from frugality.serve.server import serve as run

    limits = Limits(max_body_kb * 1024, max_inputs, max_input_tokens, max_tokens, max_prompts)
    settings = ServeSettings(
        model,
        host,
        port,
        name,
        device,
        precision,
        max_wait_ms,
        max_queue,
        batch_tokens,
        rows,
        context,
        drain_s,
        api_key_env,
        limits,
        runs_dir,
        compile_,
        workers,
        streams,
    )
    run(settings)
