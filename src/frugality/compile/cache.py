"""The shared compile cache: Inductor's cache directory, archived per fingerprint, at a URL.

A run works in a fresh local Inductor directory. At start it fetches the entry matching its
fingerprint from the cache URL (a directory, `file://`, `s3://`, any fsspec URL) and
unpacks it there; when the run compiled something new, it archives the directory and
publishes it back. Inductor's directory holds the generated code *and* the built shared
objects, which is what makes a warm start fast on a CPU: the portable
`torch.compiler.save_cache_artifacts()` leaves the C++ to be rebuilt (13 s of a 15-23 s
cold start measured here, shared/NOTES.md).

Layout at the URL, one folder per fingerprint:

    <url>/<family>-<level>-<precision>-<key>/manifest.json
    <url>/<family>-<level>-<precision>-<key>/inductor-<sha256 prefix>.tar.gz

The archive is uploaded first, under a name of its own; the manifest, which names it with
its size and SHA-256, is written last (one object PUT on S3, a rename on a file system), so a
reader never sees a half-uploaded entry. A manifest of another fingerprint (a foreign or
stale entry), an unreadable manifest, or an archive whose size or hash differs (corrupt)
is ignored with a warning: the run compiles from scratch, never crashes or loads bad code.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import platform
import tarfile
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from frugality import __version__
from frugality.paths import cache_dir
from frugality.errors import FrugalityWarning

ENTRY_FORMAT = 1
MANIFEST = "manifest.json"
ENV_VAR = "FRUGALITY_COMPILE_CACHE"


class CompileCacheWarning(FrugalityWarning):
    """An entry at the cache URL was skipped (foreign, stale or corrupt) or could not be written."""


def cache_url(configured: str | None) -> str:
    """`compile.cache`, else $FRUGALITY_COMPILE_CACHE, else a folder in the user cache."""
    return configured or os.environ.get(ENV_VAR) or str(cache_dir() / "compile")


def device_fingerprint(device: torch.device) -> dict:
    """What compiled code depends on besides the graph: the device kind and its generation."""
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {"type": "cuda", "name": props.name, "capability": f"{props.major}.{props.minor}",
                "cuda": torch.version.cuda}
    info = {"type": device.type, "machine": platform.machine()}
    if device.type == "cpu":
        # The instruction sets Inductor's C++ may be built for (AMX, AVX-512, ...), and the
        # thread count, which Inductor writes into its OpenMP pragmas. Probing the ISA the way
        # Inductor does builds test programs (seconds each); the CPU's flags say the same.
        info["isa"] = sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True)
        info["threads"] = torch.get_num_threads()
    return info


def fingerprint(*, model: dict, micro_batch_size: int, seq_len: int, precision: str, level: str,
                device: torch.device, options: dict) -> dict:
    """Everything that makes compiled code valid; two runs with equal fingerprints compile the
    same graphs. Steps, learning rates, datasets and paths are left out: they change no graph."""
    return {
        "format": ENTRY_FORMAT,
        "torch": torch.__version__,
        "python": ".".join(platform.python_version_tuple()[:2]),
        "device": device_fingerprint(device),
        "level": level,
        "precision": precision,
        "model": model,
        "batch_shape": [micro_batch_size, seq_len],
        "inductor_options": options,
    }


def entry_name(fp: dict) -> str:
    key = hashlib.sha256(json.dumps(fp, sort_keys=True).encode()).hexdigest()[:16]
    return f"{fp['model'].get('family', 'model')}-{fp['level']}-{fp['precision']}-{key}"


@dataclass
class FetchResult:
    found: bool
    files: int = 0  # files unpacked


class CompileCache:
    """One fingerprint's entry at one URL."""

    def __init__(self, url: str, fp: dict) -> None:
        from fsspec.core import url_to_fs  # imported when compiling only

        self.url = url
        self.fingerprint = json.loads(json.dumps(fp))  # as it reads back from a manifest
        self.name = entry_name(fp)
        self.fs, root = url_to_fs(url)
        self.root = root.rstrip("/")
        self.entry = f"{self.root}/{self.name}"

    def __repr__(self) -> str:
        return f"{self.url.rstrip('/')}/{self.name}"

    def fetch(self, into: Path) -> FetchResult:
        """Unpack the entry into `into`; a missing entry is a miss, a bad one a warning."""
        try:
            manifest = self._read_manifest()
            if manifest is None:
                return FetchResult(False)
            if manifest.get("fingerprint") != self.fingerprint:
                self._warn("was written for another configuration (foreign or stale entry)")
                return FetchResult(False)
            data = self.fs.cat_file(f"{self.entry}/{manifest['archive']}")
            if len(data) != manifest["size"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
                self._warn(f"archive {manifest['archive']} does not match its manifest (corrupt "
                           "or partly written)")
                return FetchResult(False)
            files = _unpack(data, into)
            return FetchResult(True, files)
        except Exception as e:  # noqa: BLE001 - a cache must never stop a run
            self._warn(f"could not be read ({type(e).__name__}: {e})")
            return FetchResult(False)

    def publish(self, directory: Path) -> str | None:
        """Archive `directory` and make it the entry; returns the archive name, None on failure."""
        try:
            data = _pack(directory)
            digest = hashlib.sha256(data).hexdigest()
            archive = f"inductor-{digest[:16]}.tar.gz"
            previous = self._read_manifest(quiet=True)
            self.fs.makedirs(self.entry, exist_ok=True)
            self.fs.pipe_file(f"{self.entry}/{archive}", data)
            manifest = {
                "fingerprint": self.fingerprint,
                "archive": archive,
                "size": len(data),
                "sha256": digest,
                "frugality": __version__,
            }
            staged = f"{self.entry}/.{MANIFEST}.{uuid.uuid4().hex}"
            self.fs.pipe_file(staged, json.dumps(manifest, indent=1).encode())
            self.fs.mv(staged, f"{self.entry}/{MANIFEST}")  # the entry switches here
            if previous and previous.get("archive") not in (None, archive):
                self.fs.rm_file(f"{self.entry}/{previous['archive']}")
            return archive
        except Exception as e:  # noqa: BLE001
            self._warn(f"could not be written ({type(e).__name__}: {e})")
            return None

    def _read_manifest(self, quiet: bool = False) -> dict | None:
        path = f"{self.entry}/{MANIFEST}"
        self.fs.invalidate_cache(self.entry)  # another process may have published since
        if not self.fs.exists(path):
            return None
        try:
            manifest = json.loads(self.fs.cat_file(path))
            if not isinstance(manifest, dict) or not {"archive", "size", "sha256"} <= manifest.keys():
                raise ValueError("fields missing")
            return manifest
        except ValueError as e:
            if not quiet:
                self._warn(f"has an unreadable manifest ({e})")
            return None

    def _warn(self, what: str) -> None:
        warnings.warn(f"compile cache entry {self!r} {what}; ignoring it", CompileCacheWarning,
                      stacklevel=3)


def _pack(directory: Path) -> bytes:
    """A gzip tar of the directory's files, without Inductor's lock files."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz", compresslevel=1) as tar:
        for path in sorted(directory.rglob("*")):
            relative = path.relative_to(directory)
            if path.is_file() and not path.is_symlink() and relative.parts[0] != "locks":
                tar.add(path, arcname=str(relative), recursive=False)
    return buffer.getvalue()


def _unpack(data: bytes, into: Path) -> int:
    into.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        members = tar.getmembers()
        tar.extractall(into, filter="data")  # no absolute paths, links out, or devices
    return sum(m.isfile() for m in members)


def fresh_inductor_dir() -> Path:
    """A new, empty local directory for Inductor's cache, for this run only."""
    return Path(tempfile.mkdtemp(prefix="frugality-inductor-"))
