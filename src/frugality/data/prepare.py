"""`frugality data prepare`: text files -> a Megatron indexed dataset, on every core.

Inputs are `.txt` (one document per file), `.jsonl` (one document per line, in field
`text` or another), either gzip- or zstd-compressed, and `.parquet` (a document per row);
local paths or fsspec URLs (`s3://...`). Each document becomes one sequence followed by
one end-of-document token. `--dedup exact` drops documents seen before (`data.dedup`).

The inputs are cut into pieces (`data.pieces`: whole files, or line-aligned byte ranges of
a plain `.jsonl`). Worker processes, each with its own tokenizer (separate instances
scale where one `encode_batch` over many threads does not: tokenizers #1900), tokenize a
piece each into a part (`PREFIX.parts/NNNNN.bin/.idx`); the parts are merged in input
order, so the dataset is the same bytes whatever the workers (and megatron-core's builder
given the same tokens). A part is recorded in `PREFIX.parts/parts.jsonl` once written
whole, beside what the parts depend on (`PREFIX.parts/job.json`: the inputs' sizes and
times, the tokenizer, the pieces): a run killed mid-way and rerun with the same inputs and
tokenizer redoes only the missing parts. The parts are removed once merged.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import itertools
import json
import multiprocessing
import os
import shutil
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tqdm import tqdm

from frugality.data import dedup as dedup_
from frugality.data.indexed import IndexedDatasetWriter, paths, token_dtype
from frugality.data.pieces import JSONL, PARQUET, TEXT, Piece, plan_pieces, read_documents
from frugality.data.ray_cluster import joined, ray_module
from frugality.data.sources import absolute, expand, found, is_url
from frugality.data.tokenizer import LoadedTokenizer
from frugality.errors import UserError
from frugality.paths import write_atomically

_BATCH_CHARS = 4_000_000  # documents encoded together: the library's batches, bounded memory
PIECE_BYTES = 64 << 20  # a plain .jsonl is cut into pieces of about this much
JOB = "job.json"  # what the parts depend on, written once
PARTS_LOG = "parts.jsonl"  # a line per part written whole, appended
_STOP_AFTER = "FRUGALITY_PREPARE_STOP_AFTER"  # tests: the run dies after recording N parts


class PartsKept(UserError):
    """The run cannot go on, but its inputs are not at fault: the parts written are kept
    for a rerun (a worker lost more often than Ray retries)."""


@dataclass(frozen=True)
class PrepareStats:
    documents: int
    tokens: int
    bin_path: Path
    idx_path: Path
    text_bytes: int = 0  # UTF-8 bytes of the documents (this run's parts)
    seconds: float = 0.0
    workers: int = 1
    reused_parts: int = 0  # written by an earlier, interrupted run
    run_documents: int = 0  # this run's (not the reused parts')
    run_tokens: int = 0
    duplicates: int = 0  # documents dropped by --dedup exact

    def rates(self) -> str:
        """This run's work over its time."""
        s = max(self.seconds, 1e-9)
        return (
            f"{self.text_bytes / s / 1e6:,.2f} MB/s, {self.run_documents / s:,.0f} documents/s, "
            f"{self.run_tokens / s:,.0f} tokens/s"
        )


def prepare(
    inputs: Sequence[str | Path],
    tokenizer: LoadedTokenizer,
    out_prefix: str | Path,
    field: str = "text",
    overwrite: bool = False,
    progress: bool = True,
    workers: int = 1,
    piece_bytes: int = PIECE_BYTES,
    engine: str = "local",
    address: str | None = None,
    dedup: str | None = None,
) -> PrepareStats:
    """Tokenize `inputs` into `out_prefix`.bin/.idx with `workers` processes (1: this
    process, the library's threads; more are spawned, so a script calling this with
    workers > 1 needs the `if __name__ == "__main__":` guard). `engine="ray"`: the pieces
    are Ray tasks on the cluster at `address` (None: a local Ray instance), each reading
    its input and writing its part where every node sees them (shared storage).
    `dedup="exact"`: a document whose normalised text came earlier is dropped."""
    if engine not in ("local", "ray"):
        raise UserError(f"--engine {engine}: choose local or ray")
    if dedup not in (None, "exact"):
        raise UserError(f"--dedup {dedup}: the one kind is exact")
    if is_url(str(out_prefix)):
        raise UserError(f"--out {out_prefix}: a local or shared-storage path (URLs are for inputs)")
    if engine == "ray":
        ray_module()  # installed? (one line before anything is written)
    files = _expand(inputs)
    seen = _check_inputs(files)  # each input looked up once (a URL's is a request)
    _check_outputs(out_prefix, overwrite)
    pieces = plan_pieces(files, piece_bytes, {f: s.size for f, s in seen.items()})
    dtype = token_dtype(tokenizer.vocab_size)
    job = _job(files, seen, tokenizer, field, dtype, pieces, dedup)
    folder = Path(str(out_prefix) + ".parts")
    with _only_writer(folder):
        _check_outputs(out_prefix, overwrite)  # again: a run that just finished may have written it
        hashing = dedup is not None
        if engine == "ray":
            run = lambda todo, w: _run_ray(todo, tokenizer, field, dtype, folder, address, hashing)  # noqa: E731
        else:
            run = lambda todo, w: _run(todo, tokenizer, field, dtype, folder, w, hashing)  # noqa: E731
        return _prepare(tokenizer, out_prefix, overwrite, progress, workers, pieces, dtype, job, folder, run)


def _prepare(tokenizer, out_prefix, overwrite, progress, workers, pieces, dtype, job, folder, run):
    start = time.perf_counter()
    done = _open_parts(folder, job, overwrite)
    reused = len(done)
    todo = [p for p in pieces if str(p.index) not in done]
    workers = max(1, min(workers, len(todo) or 1))
    bar = tqdm(total=sum(p.size for p in pieces), unit="B", unit_scale=True, desc="tokenizing", disable=not progress)
    bar.update(sum(p.size for p in pieces if str(p.index) in done))
    written = {"documents": 0, "tokens": 0, "text_bytes": 0}  # this run's parts (the rates' figures)
    try:
        results = run(todo, workers)
        for index, part in results:
            done[str(index)] = part
            _record(folder, index, part)
            for key in written:
                written[key] += part[key]
            bar.update(part["bytes"])
            bar.set_postfix(docs=written["documents"], tokens=written["tokens"])
            if os.environ.get(_STOP_AFTER) and len(done) - reused >= int(os.environ[_STOP_AFTER]):
                os._exit(9)  # (tests: a run killed between two parts)
        documents, tokens, duplicates = _merge(folder, pieces, done, out_prefix, dtype, job["dedup"])
    except PartsKept:
        raise
    except UserError:
        if not reused:  # a bad input: nothing of this run is kept
            shutil.rmtree(folder, ignore_errors=True)
        raise
    except BrokenProcessPool:
        raise UserError(
            f"data prepare: a worker process died (out of memory? killed?); the parts written are kept in "
            f"{folder}: rerun the same command to go on, with fewer --workers if memory ran out"
        ) from None
    finally:
        bar.close()
    shutil.rmtree(folder, ignore_errors=True)
    bin_path, idx_path = paths(out_prefix)
    return PrepareStats(
        documents,
        tokens,
        bin_path,
        idx_path,
        written["text_bytes"],
        time.perf_counter() - start,
        workers,
        reused,
        written["documents"],
        written["tokens"],
        duplicates,
    )


@contextlib.contextmanager
def _only_writer(folder: Path):
    """One preparation of an output at a time: a second, while the first runs, is refused
    in one line (an exclusive lock on PREFIX.parts.lock, released when the process ends)."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    lock_path = folder.with_name(folder.name + ".lock")
    while True:
        lock = open(lock_path, "a")  # noqa: SIM115 - the lock, held while the output is written
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise UserError(f"{lock_path}: another data prepare is writing this output; wait for it") from None
        try:  # locked: still the file at the path (not one a finishing run just removed)?
            if os.stat(lock_path).st_ino == os.fstat(lock.fileno()).st_ino:
                break
        except FileNotFoundError:
            pass
        lock.close()
    try:
        yield
    finally:
        lock_path.unlink(missing_ok=True)
        lock.close()


def _run(todo: list[Piece], tokenizer: LoadedTokenizer, field: str, dtype, folder: Path, workers: int, hashing: bool):
    """(piece index, part record) as each piece's part is written whole."""
    if workers == 1:
        state = {"tokenizer": tokenizer.tokenizer, "eod": tokenizer.eod_id, "dtype": dtype, "hashing": hashing}
        for piece in todo:
            yield piece.index, _tokenize(state, piece, field, folder)
        return
    context = multiprocessing.get_context("spawn")  # no fork of a process whose library threads ran
    saved = folder / "tokenizer.json"  # read by each worker (not sent down the start-up pipe: 1.5 MB)
    tokenizer.tokenizer.save(str(saved))
    setup = (str(saved), tokenizer.eod_id, dtype.str, os.getpid(), hashing)
    pool = ProcessPoolExecutor(workers, mp_context=context, initializer=_start_worker, initargs=setup)
    try:
        # the largest pieces first, so that the last ones to finish are small
        order = iter(sorted(todo, key=lambda p: -p.size))
        running = {
            pool.submit(_worker_tokenize, p.as_dict(), field, str(folder)): p
            for p in itertools.islice(order, 2 * workers)
        }
        while running:
            finished, _ = wait(running, return_when=FIRST_COMPLETED)
            for future in finished:
                piece = running.pop(future)
                record = future.result()  # a worker's UserError is raised here, as it was
                for p in itertools.islice(order, 1):
                    running[pool.submit(_worker_tokenize, p.as_dict(), field, str(folder))] = p
                yield piece.index, record
        pool.shutdown()
    except BaseException:
        # the pieces still running are abandoned (a part is renamed into place only whole)
        for process in list(getattr(pool, "_processes", {}).values()):
            process.kill()
        pool.shutdown(wait=False, cancel_futures=True)
        raise


_WORKER: dict = {}


def _start_worker(tokenizer_path: str, eod: int, dtype: str, parent: int, hashing: bool) -> None:
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one thread a worker: the workers are the parallelism
    _die_with_parent()
    if os.getppid() != parent:  # the parent died before the line above took effect
        os._exit(1)
    from tokenizers import Tokenizer

    _WORKER.update(tokenizer=Tokenizer.from_file(tokenizer_path), eod=eod, dtype=np.dtype(dtype), hashing=hashing)


def _die_with_parent() -> None:
    """Linux: this worker is killed when the process that started it dies (a killed
    prepare leaves no worker tokenizing for no one)."""
    try:
        import ctypes
        import signal

        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def _run_ray(todo: list[Piece], tokenizer: LoadedTokenizer, field: str, dtype, folder: Path, address, hashing: bool):
    """(piece index, part record) as each piece's Ray task writes its part: one task a
    piece, a CPU each, largest first; a task whose worker dies is run again (Ray's
    retries), so a lost worker loses nothing."""
    with joined(address) as ray:
        yield from _ray_tasks(ray, todo, tokenizer, field, dtype, folder, hashing)


def _ray_tasks(ray, todo, tokenizer, field, dtype, folder, hashing):
    pending: dict = {}
    try:
        saved = folder / "tokenizer.json"  # every task reads it where it reads the parts folder
        tokenizer.tokenizer.save(str(saved))
        task = ray.remote(num_cpus=1, max_retries=3)(_ray_tokenize)
        here = {"folder": str(folder.resolve()), "tokenizer": str(saved.resolve())}  # (a worker's cwd is its own)
        pending = {
            task.remote(
                dict(p.as_dict(), file=absolute(p.file)),
                field,
                here["folder"],
                here["tokenizer"],
                tokenizer.eod_id,
                dtype.str,
                hashing,
            ): p
            for p in sorted(todo, key=lambda p: -p.size)
        }
        while pending:
            ready, _ = ray.wait(list(pending), num_returns=1)
            piece = pending.pop(ready[0])
            try:
                record = ray.get(ready[0])
            except ray.exceptions.RayTaskError as e:  # the task raised: a bad input is one line, as here
                cause = getattr(e, "cause", None)
                if isinstance(cause, UserError):
                    raise UserError(str(cause).replace(absolute(piece.file), piece.file)) from None
                raise
            except ray.exceptions.RayError as e:  # a worker lost more often than Ray retries
                raise PartsKept(
                    f"data prepare: piece {piece.index} ({piece.file}) failed on the Ray cluster "
                    f"({type(e).__name__}); the parts written are kept in {folder}: rerun to go on"
                ) from None
            yield piece.index, record
        pending = {}
    finally:
        for ref in pending:
            ray.cancel(ref, force=True)


_RAY_TOKENIZERS: dict = {}


def _ray_tokenize(piece: dict, field: str, folder: str, tokenizer_path: str, eod: int, dtype: str, hashing: bool):
    """A Ray task: one piece into its part, with the worker's tokenizer (loaded once)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # a CPU a task
    with open(tokenizer_path, "rb") as f:  # (a worker outlives a job: the same path may hold another tokenizer)
        key = (tokenizer_path, hashlib.sha256(f.read()).hexdigest())
    if key not in _RAY_TOKENIZERS:
        from tokenizers import Tokenizer

        _RAY_TOKENIZERS[key] = Tokenizer.from_file(tokenizer_path)
    state = {"tokenizer": _RAY_TOKENIZERS[key], "eod": eod, "dtype": np.dtype(dtype), "hashing": hashing}
    return _tokenize(state, Piece(**piece), field, Path(folder))


def _worker_tokenize(piece: dict, field: str, folder: str) -> dict:
    return _tokenize(_WORKER, Piece(**piece), field, Path(folder))


def _tokenize(state: dict, piece: Piece, field: str, folder: Path) -> dict:
    """Piece -> its part, written whole (temporary names, renamed into place); its record."""
    _die_once_in(piece, folder)
    tokenizer, eod = state["tokenizer"], np.asarray([state["eod"]])
    writer = IndexedDatasetWriter(folder / f"{piece.index:05d}", state["dtype"])
    documents = text_bytes = 0
    digests = bytearray() if state.get("hashing") else None
    try:
        batch: list[str] = []
        size = 0
        for text in itertools.chain(read_documents(piece, field), [None]):
            if text is not None:
                batch.append(text)
                size += len(text)
                text_bytes += len(text.encode("utf-8", "surrogateescape"))
                if digests is not None:
                    digests += dedup_.digest(text)
            if batch and (text is None or size >= _BATCH_CHARS):
                for encoding in tokenizer.encode_batch(batch, add_special_tokens=False):
                    writer.add_document(np.concatenate([np.asarray(encoding.ids, dtype=np.int64), eod]))
                documents += len(batch)
                batch, size = [], 0
        if digests is not None:  # before the part: a part in place has its digests
            dedup_.write_digests(folder / f"{piece.index:05d}{dedup_.SUFFIX}", digests)
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    digest = writer.sha256
    return {
        "documents": documents,
        "tokens": writer.num_tokens,
        "bytes": piece.size,
        "text_bytes": text_bytes,
        "bin_bytes": writer.bin_path.stat().st_size,
        "sha256": digest,
    }


def _die_once_in(piece: Piece, folder: Path) -> None:
    """Tests: the process tokenizing piece $FRUGALITY_PREPARE_DIE_IN dies there, once (a
    worker lost mid-job)."""
    if os.environ.get("FRUGALITY_PREPARE_DIE_IN") == str(piece.index):
        marker = folder.with_name(f"{folder.name}.died-in-{piece.index}")  # (outlives the parts)
        if not marker.exists():
            marker.touch()
            os._exit(1)


def _merge(folder: Path, pieces: list[Piece], done: dict, out_prefix, dtype, dedup) -> tuple[int, int, int]:
    """The parts, in input order, into the dataset (with `dedup`, each document whose
    digest came earlier left out); a part whose bytes are not those recorded is refused
    (its file was changed or damaged since). Returns documents, tokens, duplicates."""
    Path(out_prefix).parent.mkdir(parents=True, exist_ok=True)
    keeps = [None] * len(pieces)
    if dedup:
        keeps = dedup_.first_occurrences([folder / f"{p.index:05d}{dedup_.SUFFIX}" for p in pieces])
    writer = IndexedDatasetWriter(out_prefix, dtype)
    documents = duplicates = 0
    try:
        for piece, keep in zip(pieces, keeps, strict=True):
            record = done[str(piece.index)]
            digest = writer.append(folder / f"{piece.index:05d}", keep=keep)
            if digest != record["sha256"]:
                raise UserError(
                    f"{folder}/{piece.index:05d}.bin: not the part recorded in {PARTS_LOG} (changed since); "
                    f"remove {folder} and prepare again"
                )
            kept = record["documents"] if keep is None else int(keep.sum())
            documents += kept
            duplicates += record["documents"] - kept
        writer.finalize()
    except BaseException:
        writer.abort()
        raise
    return documents, writer.num_tokens, duplicates


def _job(files: list[str], seen: dict, tokenizer: LoadedTokenizer, field: str, dtype, pieces: list[Piece], dedup):
    """What the parts depend on: a rerun with anything else cannot use them."""
    return {
        "inputs": [{"path": f, "bytes": seen[f].size, "version": seen[f].version} for f in files],
        "tokenizer_sha256": hashlib.sha256(tokenizer.tokenizer.to_str().encode()).hexdigest(),
        "eod": tokenizer.eod_id,
        "dtype": np.dtype(dtype).name,
        "field": field,
        "pieces": [p.as_dict() for p in pieces],
        "dedup": dedup,
    }


def _open_parts(folder: Path, job: dict, overwrite: bool) -> dict:
    """The parts an earlier run of this same job recorded (their files present at the
    recorded size), or none; a folder of another job is refused, or removed with --overwrite."""
    if folder.exists():
        try:
            recorded = json.loads((folder / JOB).read_text())
        except (OSError, ValueError):
            recorded = None
        if not folder.is_dir() or recorded is None:
            raise UserError(f"{folder}: exists and is not the parts folder of a data prepare; move it away")
        if recorded != job:
            if not overwrite:
                raise UserError(
                    f"{folder}: the parts of another preparation ({_changed(recorded or {}, job)}); rerun that "
                    "one, or --overwrite to start over"
                )
            shutil.rmtree(folder)
        else:
            return {k: v for k, v in _recorded(folder).items() if _whole(folder, int(k), v, job["dedup"])}
    folder.mkdir(parents=True)
    write_atomically(folder / JOB, json.dumps(job, indent=1) + "\n")
    return {}


def _recorded(folder: Path) -> dict:
    """The parts.jsonl records by piece index (a line cut by a crash is not one)."""
    found = {}
    try:
        lines = (folder / PARTS_LOG).read_text().splitlines()
    except OSError:
        return found
    for line in lines:
        try:
            record = json.loads(line)
            found[str(record.pop("index"))] = record
        except (ValueError, KeyError, AttributeError):
            continue
    return found


def _whole(folder: Path, index: int, record: dict, dedup) -> bool:
    part = folder / f"{index:05d}.bin"
    if dedup:
        digests = folder / f"{index:05d}{dedup_.SUFFIX}"
        if not digests.is_file() or digests.stat().st_size != dedup_.DIGEST_BYTES * record.get("documents", -1):
            return False
    return part.is_file() and part.stat().st_size == record.get("bin_bytes") and (folder / f"{index:05d}.idx").is_file()


def _record(folder: Path, index: int, part: dict) -> None:
    with open(folder / PARTS_LOG, "a+b") as log:
        log.seek(0, os.SEEK_END)
        if log.tell():  # a line cut by a crash stays a line of its own (unreadable, skipped)
            log.seek(-1, os.SEEK_END)
            if log.read(1) != b"\n":
                log.write(b"\n")
        log.write((json.dumps({"index": index, **part}) + "\n").encode())
        log.flush()
        os.fsync(log.fileno())


def _changed(old: dict, new: dict) -> str:
    if not old:
        return "no readable job.json"
    names = {"inputs": "inputs", "tokenizer_sha256": "tokenizer", "eod": "tokenizer", "dtype": "tokenizer"}
    names |= {"field": "--field", "pieces": "inputs" if old.get("inputs") != new["inputs"] else "--piece-mb"}
    names |= {"dedup": "--dedup"}
    return "its " + ", ".join(sorted({names[k] for k in new if old.get(k) != new[k]})) + " differ"


def _expand(inputs: Sequence[str | Path]) -> list[str]:
    """The inputs (paths or URLs), a glob that names no file as it is (quoted on the command
    line, or given by a program) replaced by its matches, sorted."""
    return [name for given in map(str, inputs) for name in expand(given)]


def _check_inputs(files: list[str]) -> dict:
    """Each input's `Found`, once every input is a file of a kind prepare reads."""
    seen = {}
    if not files:
        raise UserError("data prepare: no input files given")
    for f in files:
        if not f.rstrip("/").endswith(TEXT + JSONL + PARQUET) and not is_url(f) and Path(f).is_dir():
            raise UserError(f"input {f}: a directory; give its files, e.g. {_glob(Path(f))}")
        if not f.endswith(TEXT + JSONL + PARQUET):
            raise UserError(f"input {f}: unsupported type (expected {', '.join(TEXT + JSONL + PARQUET)})")
        what = found(f)
        if what.kind == "directory":
            raise UserError(f"input {f}: a directory; give its files")
        if what.kind == "missing":
            raise UserError(f"input {f}: no such file")
        if what.size == 0:
            raise UserError(f"input {f}: empty (no text to tokenize)")
        seen[f] = what
    return seen


def _check_outputs(out_prefix: str | Path, overwrite: bool) -> None:
    for p in paths(out_prefix):
        if p.exists() and not overwrite:
            raise UserError(f"output {p} already exists (choose another --out, or --overwrite)")
        if p.parent.exists() and not p.parent.is_dir():
            raise UserError(f"output folder {p.parent} is a file")


def _glob(folder: Path) -> str:
    """A glob of the files of `folder` that data prepare reads (of its first such file's kind)."""
    suffixes = sorted(TEXT + JSONL, key=len, reverse=True)  # .txt.gz before .txt
    for entry in itertools.islice(folder.iterdir(), 1000):
        kind = next((s for s in suffixes if entry.name.endswith(s)), None)
        if kind:
            return str(folder / f"*{kind}")
    return str(folder / "*.txt")
