"""`frugality embed --engine ray`: the same job (`job.json`, shards, manifest, resume) with
its pending shards embedded by Ray actors on a cluster.

- One actor a device: a GPU each, or a CPU each. Each actor loads the model once.
- This process reads the inputs once, in order, and hands each pending shard's texts to
  an actor that is free, at most two shards an actor at a time. So no two actors write
  the same shard, and no actor reads the inputs: they need only the model and the output
  folder, on storage every node sees.
- An actor that dies is restarted by Ray, which then runs its shards again (at least once:
  a shard is written whole or not at all, so twice is the same bytes). A lost worker loses
  nothing. An actor that dies more than three times ends the job in one line.
"""

from __future__ import annotations

import os
import signal
from collections import deque
from pathlib import Path

from frugality.data.ray_cluster import joined
from frugality.errors import UserError
from frugality.inference.shards import embed_shard, shard_texts

_ATTEMPTS = 3
DIE_ENV = "FRUGALITY_EMBED_DIE_IN"  # tests: the actor embedding this shard dies there, once


def run_on_ray(settings, inputs, size: int, pending: list[int], count: int, address: str | None, report) -> int:
    """Embed the `pending` shards of the job on the Ray cluster at `address` (None: a local
    instance); `report(n)` hears of each shard's n texts. Returns the actors used."""
    with joined(address) as ray:
        return _run(ray, settings, inputs, size, pending, count, report)


def _run(ray, settings, inputs, size, pending, count, report) -> int:
    busy: dict = {}
    pool: list = []
    try:
        resources = ray.cluster_resources()
        gpus = int(resources.get("GPU", 0)) if settings.device in ("auto", "cuda") else 0
        if settings.device.startswith("cuda") and not gpus:  # not CPU actors in its place, silently
            raise UserError("--device cuda: the Ray cluster has no GPU (ray.cluster_resources() lists none)")
        actors = max(1, min(gpus or int(resources.get("CPU", 1)), len(pending)))
        options = {}
        if settings.precision == "int8":  # every actor runs this process's engine: their vectors differ
            import torch

            from frugality.inference.encoder import int8_engine, resolve_precision

            engine = int8_engine(torch.device("cpu"))[0]
            rest = "bf16" if resolve_precision("int8", torch.device("cpu"))[0] == torch.bfloat16 else "fp32"
            options["runtime_env"] = {"env_vars": {"FRUGALITY_INT8_ENGINE": engine, "FRUGALITY_INT8_REST": rest}}
        kind = ray.remote(
            num_gpus=1 if gpus else 0,
            num_cpus=0 if gpus else 1,
            max_restarts=_ATTEMPTS,
            max_task_retries=_ATTEMPTS,
            **options,
        )(_Embedder)
        pool = [kind.remote(settings, "cuda" if gpus else "cpu") for _ in range(actors)]
        load = {i: 0 for i in range(actors)}
        waiting: deque = deque()  # (shard, ids, texts) not yet handed out
        shards = shard_texts(inputs, size, count, set(pending))

        def hand_out() -> None:
            while True:
                free = [i for i in load if load[i] < 2]
                if not free:
                    return
                if not waiting:
                    nxt = next(shards, None)
                    if nxt is None:
                        return
                    waiting.append(nxt)
                k, ids, texts = waiting.popleft()
                i = min(free, key=lambda j: load[j])
                busy[pool[i].embed.remote(k, ids, texts)] = (i, k, ids, texts)
                load[i] += 1

        hand_out()
        while busy:
            ready, _ = ray.wait(list(busy), num_returns=1)
            i, k, ids, texts = busy.pop(ready[0])
            load[i] -= 1
            try:
                report(ray.get(ready[0]))
            except ray.exceptions.RayTaskError as e:  # the shard's own error: one line, as in one process
                cause = getattr(e, "cause", None)
                if isinstance(cause, (UserError, OSError)):
                    raise cause from None
                raise
            except ray.exceptions.RayActorError as e:  # restarted and retried by Ray, and still dying
                if getattr(e, "actor_init_failed", False):  # never started: Ray does not restart it
                    first = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
                    raise UserError(f"embed: a Ray actor could not load the model ({first})") from None
                raise UserError(
                    f"embed: shard {k}'s Ray worker died {_ATTEMPTS + 1} times; the shards written are kept in "
                    f"{settings.out}: rerun the same command to go on"
                ) from None
            hand_out()
        return actors
    finally:
        for actor in pool:  # (their shards in flight are abandoned: a shard is renamed into place whole)
            ray.kill(actor, no_restart=True)


class _Embedder:
    """A Ray actor: the model loaded once, then a shard at a time written to the job's folder."""

    def __init__(self, settings, device: str) -> None:
        import torch

        from frugality.inference.encoder import load_encoder

        torch.set_num_threads(1 if device == "cpu" else torch.get_num_threads())  # a CPU an actor
        self.settings = settings
        self.encoder, _ = load_encoder(
            settings.model, torch.device(device), settings.precision, settings.normalize, settings.max_length
        )

    def embed(self, k: int, ids: list[str], texts: list[str]) -> int:
        out = Path(self.settings.out)
        if os.environ.get(DIE_ENV) == str(k) and not (out / f".died-in-{k}").exists():
            (out / f".died-in-{k}").touch()
            os.kill(os.getpid(), signal.SIGKILL)  # (tests: a worker lost mid-shard)
        embed_shard(self.encoder, self.settings, k, ids, texts, lambda n: None, 0)
        return len(ids)
