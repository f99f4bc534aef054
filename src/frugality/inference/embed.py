"""`frugality embed`: an offline embedding job over many texts, resumable and sharded.

The texts (in input order) are cut into shards of `shard_size`; each shard is written as
`shard-NNNNN.npy` (float32, one row per text) and `shard-NNNNN.ids.json` (their ids, in
the same order), or as one `shard-NNNNN.parquet` (id, embedding), each file under a
temporary name and renamed into place, then `shard-NNNNN.done.json` (each file's SHA-256,
and how many of its texts were cut to the model's length) last: a shard is complete when
that file exists and its files match it. A rerun after a
crash or Ctrl-C checks that the job is the same (`job.json`: model, inputs with their
sizes and times, settings) and redoes only the shards that are not complete (damaged ones
included), so no text is lost and none is written twice. When every shard is there,
`manifest.json` lists them with their hashes, which `read_embeddings` checks.

A shard's files and work are `frugality.inference.shards`'s (the Ray engine,
`inference.embed_ray`, runs the same); texts into vectors, `inference.batches`'s.
Inside a shard, texts are tokenized and embedded in chunks of 16,384 (on an accelerator the
next chunk tokenized in a thread while the model embeds this one); inside a chunk they are sorted by
token length and batched by a token budget (many short texts or few long ones per batch),
each batch padded to its longest text only; results go back to input order.

`nproc` processes share the pending shards, each with its share of the CPU threads (an
encoder's products are small, and one thread per process avoids threads waiting on each
other where cores are independent; on the 2-vCPU EPYC VM two processes ran no faster than
one with two threads) or its own GPU. `auto` starts one process per usable CPU (at most
8, and at most one per 20,000 texts: a process takes seconds to start), or one per GPU.
A new job cuts its texts into at least as many shards as it has processes.
"""

from __future__ import annotations

import fcntl
import json
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from frugality.backends import backend
from frugality.errors import UserError
from frugality.inference.inputs import Inputs
from frugality.inference.shards import (
    clean_partials,
    done_name,
    embed_shard,
    file_sha256,
    is_complete,
    read_done,
    shard_names,
    shard_texts,
)
from frugality.paths import write_atomically

JOB_FILE, MANIFEST_FILE = "job.json", "manifest.json"
TEXTS_PER_PROCESS = 20_000  # a process takes seconds to start and load the model: not worth it for fewer
MAX_CPU_PROCESSES = 8


class JobIncomplete(Exception):
    """A worker process died: what was written stays, and a rerun finishes the job."""


@dataclass(frozen=True)
class EmbedSettings:
    model: str
    out: str
    shard_size: int = 50_000
    batch_tokens: int | None = None  # None: the device's default (inference.batches.batch_defaults)
    max_batch: int | None = None
    precision: str = "auto"
    device: str = "auto"
    normalize: bool | None = None
    max_length: int | None = None
    format: str = "npy"  # or "parquet"


def resolve_processes(nproc: int | str, count: int, device) -> int:
    """`nproc` as a number of processes for `count` texts on `device` ('auto': see above)."""
    if backend(device).one_process:
        if nproc not in ("auto", 1, "1"):
            raise UserError(f"--nproc {nproc}: an xla device embeds in one process (its own device)")
        return 1
    if nproc != "auto":
        return int(nproc)
    if backend(device).device_per_rank:
        return max(1, backend(device).local_count() or 1)
    from frugality.metrics.energy import vcpus

    return max(1, min(vcpus(), MAX_CPU_PROCESSES, count // TEXTS_PER_PROCESS))


def prepare(
    settings: EmbedSettings, inputs: Inputs, encoder_line: dict, model: dict, processes=lambda count: 1
) -> dict:
    """Check or create the job in `out` (before any shard is written); the job record.
    What must match on a rerun is what decides the output: the model's weights (`model`,
    its files' sizes and times), the inputs (sizes and times), the fields, the format and
    shard size asked for, and the encoder as resolved (dtype, pooling, normalisation,
    length); not how the options were spelt, nor batch sizes or process counts. A new
    job's shard size is the one asked for, or smaller so that each of `processes(count)`
    processes gets a shard."""
    out = Path(settings.out)
    job = {
        "model": model,
        "inputs": inputs.identity(),
        "text_field": inputs.text_field,
        "id_field": inputs.id_field,
        "format": settings.format,
        "shard_size_asked": settings.shard_size,
        "encoder": {k: v for k, v in encoder_line.items() if k != "precision"},
    }
    existing = out / JOB_FILE
    if existing.is_file():
        try:
            before = json.loads(existing.read_text())
        except json.JSONDecodeError:
            raise UserError(f"{existing}: damaged; remove the folder or choose another --out") from None
        changed = _first_difference({k: v for k, v in before.items() if k in job}, job)
        if changed:
            raise UserError(
                f"{out} holds an embedding job with other settings ({changed} differs); rerun it "
                f"as it was, or choose another --out"
            )
        return before
    if out.exists() and any(out.iterdir()):
        raise UserError(f"--out {out} exists and is not an embedding job's folder; choose another")
    count = _count_unique(inputs)
    job["count"] = count
    job["precision"] = encoder_line.get("precision")
    job["hashed"] = True  # its shards carry their SHA-256 (jobs begun before: not)
    job["shard_size"] = min(settings.shard_size, -(-count // processes(count)))
    made = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    try:
        write_atomically(out / JOB_FILE, json.dumps(job, indent=2).encode())
    except BaseException:  # a full disk: no empty --out left behind
        if made:
            out.rmdir()
        raise
    return job


def _count_unique(inputs: Inputs) -> int:
    """The number of texts, after checking that no two share an id."""
    seen: set[str] = set()
    for text_id, _ in inputs:
        if text_id in seen:
            raise UserError(
                f"id {text_id!r} occurs twice in the inputs: ids must be unique (--id-field names "
                f"the field; without it, FILE:LINE is)"
            )
        seen.add(text_id)
    if not seen:
        inputs.check_not_empty()  # (its line names the files)
    return len(seen)


def _first_difference(a, b, where: str = "") -> str | None:
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            found = _first_difference(a.get(key), b.get(key), f"{where}.{key}" if where else key)
            if found:
                return found
        return None
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            found = _first_difference(x, y, f"{where}[{i}]")
            if found:
                return found
        return None
    return None if a == b else where


def pending_shards(
    out: Path, count: int, shard_size: int, fmt: str, hashed: bool = True, verify: bool = True
) -> list[int]:
    shards = -(-count // shard_size)
    return [
        k
        for k in range(shards)
        if not is_complete(out, k, fmt, min(shard_size, count - k * shard_size), hashed, verify)
    ]


def run_shards(
    encoder, inputs: Inputs, settings: EmbedSettings, size: int, shards: list[int], count: int, report=lambda n: None
) -> int:
    """Embed and write `shards` (numbers, of `size` texts), streaming through the inputs
    once (the first `count` texts: what the job counted); the number of shards written.
    `report(n)` hears of every n texts embedded."""
    written = 0
    for k, ids, texts in shard_texts(inputs, size, count, set(shards)):
        written += embed_shard(encoder, settings, k, ids, texts, report, written)
    return written


def write_manifest(out: Path, job: dict, dim: int) -> dict:
    count, size, fmt = job["count"], job["shard_size"], job["format"]
    shards = []
    for k in range(-(-count // size)):
        names = shard_names(k, fmt)
        entry = {"first": k * size, "count": min(size, count - k * size)}
        entry |= {"ids": names[0], "embeddings": names[1]} if fmt == "npy" else {"table": names[0]}
        if job.get("hashed"):
            done = read_done(out, k)
            if done is None:  # (every shard was found complete just before)
                raise JobIncomplete(f"shard {k} has no record {done_name(k)}; rerun the same command to finish")
            entry |= {"sha256": done["sha256"], "truncated": done.get("truncated", 0)}
        shards.append(entry)
    manifest = {
        "format": f"frugality-embeddings/1 ({fmt})",
        "model": job["model"]["weights"],
        "count": count,
        "dim": dim,
        "dtype": "float32",
        "encoder": job["encoder"] | {"precision": job.get("precision")},
        "inputs": job["inputs"],
        # texts longer than encoder.max_length, cut to it (as sentence-transformers cuts them)
        "truncated": sum(s.get("truncated", 0) for s in shards) if job.get("hashed") else None,
        "shards": shards,
        "written": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    write_atomically(out / MANIFEST_FILE, json.dumps(manifest, indent=2).encode())
    return manifest


def read_embeddings(out: str | Path) -> tuple[list[str], np.ndarray]:
    """All ids and embeddings of a finished job, in input order (for users and tests); a
    file that does not match its SHA-256 in the manifest is a UserError naming it."""
    out = Path(out)
    manifest = json.loads((out / MANIFEST_FILE).read_text())
    ids, parts = [], []
    for shard in manifest["shards"]:
        for name, digest in shard.get("sha256", {}).items():
            if file_sha256(out / name) != digest:
                raise UserError(
                    f"{out / name}: does not match its SHA-256 in {MANIFEST_FILE} (changed since it was written); "
                    "rerun the embed command to embed its shard again"
                )
        if "table" in shard:
            import pyarrow.parquet as pq

            table = pq.read_table(out / shard["table"])
            ids += [str(x) for x in table.column("id").to_pylist()]
            parts.append(np.asarray(table.column("embedding").combine_chunks().flatten()).reshape(-1, manifest["dim"]))
        else:
            ids += json.loads((out / shard["ids"]).read_text())
            parts.append(np.load(out / shard["embeddings"]))
    return ids, np.concatenate(parts) if parts else np.empty((0, manifest["dim"]), np.float32)


def _int8_label(encoder) -> str:
    """int8 as a job records it: PyTorch's (the first, kept as "int8"; "int8-bf16" where the
    layers around its products run in bf16) or ONNX Runtime's."""
    if encoder.int8 != "torch":
        return f"int8-{encoder.int8}"
    return "int8-bf16" if str(encoder.dtype) == "torch.bfloat16" else "int8"


def encoder_record(encoder, why: str) -> dict:
    """How the encoder was resolved: a resumed job must find all of it but the precision
    phrase (which names the machine) unchanged."""
    return {
        # int8 vectors differ, and differ between the engines
        "dtype": _int8_label(encoder) if encoder.int8 else str(encoder.dtype).removeprefix("torch."),
        "precision": why,
        "pooling": encoder.pooling.mode,
        "normalize": encoder.pooling.normalize,
        "max_length": encoder.max_length,
        "dim": encoder.dim,
    }


def run_job(
    settings: EmbedSettings,
    inputs: Inputs,
    nproc: int | str = "auto",
    progress: bool = True,
    engine: str = "local",
    address: str | None = None,
) -> dict:
    """The whole job: prepare, embed the pending shards (in `nproc` processes, or on a Ray
    cluster: `engine="ray"`, `frugality.inference.embed_ray`), and write the manifest;
    returns a summary. Raises KeyboardInterrupt on Ctrl-C (what is written stays; a rerun
    finishes)."""
    if engine == "ray":
        from frugality.data.ray_cluster import ray_module

        ray_module()  # installed? (one line before anything is written)
    from tqdm import tqdm

    from frugality.inference.encoder import load_encoder
    from frugality.runtime.device import resolve_device

    device = resolve_device(settings.device, key="--device", what="frugality embed", xla_ok=True)
    encoder, why = load_encoder(settings.model, device, settings.precision, settings.normalize, settings.max_length)
    job = prepare(
        settings,
        inputs,
        encoder_record(encoder, why),
        encoder.identity(),
        lambda n: resolve_processes(nproc, n, device),
    )
    out, count, size = Path(settings.out), job["count"], job["shard_size"]
    with _locked(out):
        clean_partials(out)
        hashed = job.get("hashed", False)
        pending = pending_shards(out, count, size, settings.format, hashed)
        processes = min(resolve_processes(nproc, count, device), len(pending))
        todo = sum(min(size, count - k * size) for k in pending)
        t0 = time.perf_counter()
        # int8 (PyTorch's) without frugality's kernel compiles its fused passes in the first
        # batches: tens of seconds on a machine whose Inductor cache is cold, said on the bar
        # until the first texts are done (a disabled bar has no description to clear: --no-progress)
        said = progress and encoder.int8 == "torch" and _int8_compiles()
        first = "int8: compiling its fused passes (Inductor; cached after)" if said else None
        with tqdm(
            total=count,
            initial=count - todo,
            unit="text",
            disable=not progress,
            dynamic_ncols=True,
            mininterval=1.0,
            desc=first,
        ) as bar:
            if first:
                bar.refresh()  # (shown now, not at the first update)
                bar.update = _then_clear(bar)
            if engine == "ray" and pending:  # actors on the cluster load the weights this process resolved
                from frugality.inference.embed_ray import run_on_ray

                # the precision this process chose (and recorded in the job), not each actor's own `auto`
                chosen = "int8" if encoder.int8 else "bf16" if str(encoder.dtype) == "torch.bfloat16" else "fp32"
                shared = replace(
                    settings, model=str(Path(encoder.source).resolve()), out=str(out.resolve()), precision=chosen
                )
                del encoder
                processes = run_on_ray(shared, inputs, size, pending, count, address, bar.update)
            elif processes <= 1:
                run_shards(encoder, inputs, settings, size, pending, count, report=bar.update)
            else:  # each worker loads the very weights this process resolved (a run's checkpoint then)
                workers = replace(settings, model=str(encoder.source))
                del encoder
                _run_workers(workers, inputs, size, pending, count, processes, device, bar)
        seconds = time.perf_counter() - t0
        missing = pending_shards(out, count, size, settings.format, hashed, verify=False)  # (hashed as written)
        if missing:
            raise JobIncomplete(f"shards {missing[:5]} were not written; rerun the same command to finish")
        manifest = write_manifest(out, job, job["encoder"]["dim"])
    return {
        "count": count,
        "embedded": todo,
        "seconds": seconds,
        "texts_per_s": todo / seconds if seconds else None,
        "shards": len(manifest["shards"]),
        "truncated": manifest["truncated"],
        "max_length": job["encoder"]["max_length"],
        "resumed_from": count - todo,
        "precision": why,
        "out": str(out),
        "processes": max(1, processes),
    }


def _then_clear(bar):
    """The bar's update, which clears its description at the first texts done."""
    update = bar.update

    def counted(n: float | None = 1) -> bool | None:  # (tqdm.update's signature)
        if bar.desc:
            bar.set_description_str("", refresh=False)
        return update(n)

    return counted


@contextmanager
def _locked(out: Path):
    """One job per --out at a time: a second one (or workers left by a killed parent)
    would write the same temporary files."""
    with open(out / ".lock", "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise UserError(f"{out} is in use by another embedding job; wait for it to end") from None
        yield


def _worker(
    rank: int,
    settings: EmbedSettings,
    inputs: Inputs,
    size: int,
    shards: list[int],
    count: int,
    device: str,
    threads: int,
    queue,
) -> None:
    """A worker process: its shards, progress and any error (one line) through `queue`.
    Ctrl-C is the parent's to handle: it ends the workers."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        import torch

        from frugality.inference.encoder import load_encoder

        torch.set_num_threads(threads)
        encoder, _ = load_encoder(
            settings.model, torch.device(device), settings.precision, settings.normalize, settings.max_length
        )
        run_shards(encoder, inputs, settings, size, shards, count, report=queue.put)
    except OSError as e:  # a full disk: raised again by the parent, where the CLI makes it one line
        queue.put(("error", rank, f"{type(e).__name__}: {e}", e.errno, e.strerror, e.filename))
    except Exception as e:  # noqa: BLE001 - reported by the parent as one line
        queue.put(("error", rank, f"{type(e).__name__}: {e}" if not isinstance(e, UserError) else str(e)))


def _run_workers(settings, inputs, size, pending, count, nproc, device, bar) -> None:
    """`nproc` processes, each with its share of the pending shards and of the CPU threads
    (or its own GPU); progress comes back through a queue."""
    import multiprocessing as mp
    import queue as queues

    import torch

    ctx = mp.get_context("spawn")  # a fresh interpreter: no forked torch thread pools
    q = ctx.Queue()
    threads = max(1, torch.get_num_threads() // nproc)
    gpus = (backend(device).local_count() or 0) if backend(device).device_per_rank else 0
    workers = []
    for rank in range(nproc):
        where = f"cuda:{rank % gpus}" if gpus else str(device)
        p = ctx.Process(
            target=_worker,
            args=(rank, settings, inputs, size, pending[rank::nproc], count, where, threads, q),
            daemon=True,
        )
        p.start()
        workers.append(p)
    # a worker's error: (kind, rank, message), or an OSError's with (errno, strerror, filename)
    error: tuple[str, int, str] | tuple[str, int, str, int | None, str | None, str | None] | None = None
    try:
        while any(p.is_alive() for p in workers) or not q.empty():
            try:
                message = q.get(timeout=0.5)
            except queues.Empty:
                continue
            if isinstance(message, tuple):  # a worker's error: stop the others
                error = error or message
                for p in workers:
                    p.terminate()
            else:
                bar.update(message)
    finally:
        for p in workers:
            if p.is_alive():
                p.terminate()
            p.join()
    if error is not None and len(error) > 3 and error[3] is not None:
        raise OSError(*error[3:])
    if error is not None:
        raise UserError(f"embedding process {error[1]}: {error[2]}")
    failed = [(rank, p.exitcode) for rank, p in enumerate(workers) if p.exitcode]
    if failed:
        rank, code = failed[0]
        how = f"signal {-code}" if code < 0 else f"exit status {code}"
        raise JobIncomplete(f"embedding process {rank} ended with {how}; rerun the same command to finish")


def _int8_compiles() -> bool:
    """Whether PyTorch's int8 will compile its passes with Inductor (frugality's kernel does
    not run here, and a compiler does)."""
    from frugality.precision import int8  # (torch: imported once a model is loaded)

    return not int8.fused_passes() and int8.compiler_works()
