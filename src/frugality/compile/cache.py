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
its size and SHA-256 and lists the SHA-256 of every file in it, is written last (one object
PUT on S3, a rename on a file system), so a reader never sees a half-uploaded entry. A
manifest of another fingerprint (a foreign or stale entry), an unreadable manifest, an
archive whose size or hash differs (corrupt) or that holds a file the manifest does not
list with its hash is ignored with a warning: the run compiles from scratch, never crashes
or loads bad code.

Trust: what an entry holds is executed (Inductor's generated Python, built shared objects),
so whoever can write to the cache URL can run code on every machine that reads it. With a
fleet key in the environment (`compile.cache_key_env`, default FRUGALITY_CACHE_KEY) every
published manifest carries an HMAC-SHA256 of its content, and an entry that is unsigned,
signed with another key or altered after signing is refused and compiled locally: then only
holders of the key can publish code the fleet runs. Without a key, a remote URL is named
once as a code-execution channel. docs/security.md has the trust model.
"""

from __future__ import annotations

import hashlib
import hmac
import io
import json
import os
import platform
import re
import tarfile
import tempfile
import uuid
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch

from frugality import __version__
from frugality.backends import backend
from frugality.errors import FrugalityWarning
from frugality.paths import cache_dir

ENTRY_FORMAT = 1
MANIFEST = "manifest.json"
ENV_VAR = "FRUGALITY_COMPILE_CACHE"
KEY_ENV_VAR = "FRUGALITY_CACHE_KEY"
ARCHIVE_NAME = re.compile(r"^inductor-[0-9a-f]{16}\.tar\.gz$")  # what publish names; nothing else is read or removed
_warned_unsigned: set[str] = set()  # remote URLs already named as unsigned in this process


class CompileCacheWarning(FrugalityWarning):
    """An entry at the cache URL was skipped (foreign, stale or corrupt) or could not be written."""


def cache_url(configured: str | None) -> str:
    """`compile.cache`, else $FRUGALITY_COMPILE_CACHE, else a folder in the user cache."""
    return configured or os.environ.get(ENV_VAR) or str(cache_dir() / "compile")


def device_fingerprint(device: torch.device) -> dict:
    """What compiled code depends on besides the graph: the device kind and its generation."""
    if backend(device).compute_capability() is not None:  # a CUDA GPU
        index = device.index if device.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "type": "cuda",
            "name": props.name,
            "capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
        }
    info: dict[str, object] = {"type": device.type, "machine": platform.machine()}
    if backend(device).on_host:
        # The instruction sets Inductor's C++ may be built for (AMX, AVX-512, ...), and the
        # thread count, which Inductor writes into its OpenMP pragmas. Probing the ISA the way
        # Inductor does builds test programs (seconds each); the CPU's flags say the same.
        if hasattr(torch.cpu, "get_capabilities"):
            info["isa"] = sorted(k for k, v in torch.cpu.get_capabilities().items() if v is True)
        else:  # torch before 2.10 (the XLA environment's 2.9): the usable flags, as frugality reads them
            from frugality.hardware import probe

            info["isa"] = sorted(probe(device).features)
        info["threads"] = torch.get_num_threads()
    return info


def fingerprint(
    *,
    model: dict,
    micro_batch_size: int,
    seq_len: int,
    precision: str,
    level: str,
    device: torch.device,
    options: dict,
    checkpointing: str = "none",
) -> dict:
    """Everything that makes compiled code valid; two runs with equal fingerprints compile the
    same graphs. Steps, learning rates, datasets and paths are left out: they change no graph.
    (Activation checkpointing is named only where it recomputes: the entries without it keep
    their names.)"""
    recomputed = {"activation_checkpointing": checkpointing} if checkpointing != "none" else {}
    return recomputed | {
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

    def __init__(self, url: str, fp: dict, key: bytes | None = None) -> None:
        """`key`: the fleet key that signs published entries and that fetched ones must be
        signed with (None: entries are checked for integrity, not for who wrote them)."""
        from fsspec.core import url_to_fs  # imported when compiling only

        self.url = url
        self._key = key or None
        self.fingerprint = json.loads(json.dumps(fp))  # as it reads back from a manifest
        self.name = entry_name(fp)
        self.fs, root = url_to_fs(url)
        self.root = root.rstrip("/")
        self.entry = f"{self.root}/{self.name}"
        protocols = (self.fs.protocol,) if isinstance(self.fs.protocol, str) else self.fs.protocol
        self.remote = not {"file", "local"} & set(protocols)

    @property
    def signed(self) -> bool:
        return self._key is not None

    def __repr__(self) -> str:
        return f"{self.url.rstrip('/')}/{self.name}"

    def fetch(self, into: Path) -> FetchResult:
        """Unpack the entry into `into`; a missing entry is a miss, a bad one a warning."""
        if self.remote and not self.signed and self.url not in _warned_unsigned:
            _warned_unsigned.add(self.url)
            warnings.warn(
                f"compile cache {self.url}: whoever can write there can run code on this "
                f"machine; set {KEY_ENV_VAR} to sign and verify entries (docs/security.md)",
                CompileCacheWarning,
                stacklevel=2,
            )
        try:
            manifest = self._read_manifest()
            if manifest is None:
                return FetchResult(False)
            if manifest.get("fingerprint") != self.fingerprint:
                self._warn("was written for another configuration (foreign or stale entry)")
                return FetchResult(False)
            if self._key is not None and (problem := self._signature_problem(manifest, self._key)):  # signed
                self._warn(problem)
                return FetchResult(False)
            data = self.fs.cat_file(f"{self.entry}/{manifest['archive']}")
            if len(data) != manifest["size"] or hashlib.sha256(data).hexdigest() != manifest["sha256"]:
                self._warn(
                    f"archive {manifest['archive']} does not match its manifest (corrupt, partly written or altered)"
                )
                return FetchResult(False)
            members = _read_archive(data)
            if "files" in manifest and (problem := _files_problem(members, manifest["files"])):
                self._warn(problem)
                return FetchResult(False)
            files = _unpack(data, into)
            return FetchResult(True, files)
        except Exception as e:  # noqa: BLE001 - a cache must never stop a run
            self._warn(f"could not be read ({type(e).__name__}: {e})")
            return FetchResult(False)

    def publish(self, directory: Path) -> str | None:
        """Archive `directory` and make it the entry, signed when a key is set; returns the
        archive name, None on failure."""
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
                "files": {name: hashlib.sha256(content).hexdigest() for name, content in _read_archive(data).items()},
                "frugality": __version__,
            }
            if self._key is not None:  # signed
                manifest["signature"] = {
                    "alg": "hmac-sha256",
                    "key_id": key_id(self._key),
                    "value": _mac(self._key, manifest),
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

    def _signature_problem(self, manifest: dict, key: bytes) -> str | None:
        signature = manifest.get("signature")
        if not isinstance(signature, dict) or "value" not in signature:
            return f"is unsigned, and {KEY_ENV_VAR} asks for signed entries"
        if signature.get("key_id") != key_id(key):
            return "is signed with another key"
        if not hmac.compare_digest(str(signature["value"]), _mac(key, manifest)):
            return "was altered after it was signed"
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
            if not isinstance(manifest["archive"], str) or not ARCHIVE_NAME.match(manifest["archive"]):
                raise ValueError(f"archive name {manifest['archive']!r}")
            return manifest
        except ValueError as e:
            if not quiet:
                self._warn(f"has an unreadable manifest ({e})")
            return None

    def _warn(self, what: str) -> None:
        warnings.warn(f"compile cache entry {self!r} {what}; ignoring it", CompileCacheWarning, stacklevel=3)


def key_id(key: bytes) -> str:
    """A short name for a key, to tell keys apart in a message (not the key, not its MAC)."""
    return hashlib.sha256(b"frugality compile cache key id\0" + key).hexdigest()[:12]


def _mac(key: bytes, manifest: dict) -> str:
    """HMAC-SHA256 of the manifest's content, its signature left out, in one canonical form."""
    content = {k: v for k, v in manifest.items() if k != "signature"}
    canonical = json.dumps(content, sort_keys=True, separators=(",", ":")).encode()
    return hmac.new(key, canonical, hashlib.sha256).hexdigest()


def _read_archive(data: bytes) -> dict[str, bytes]:
    """Every regular file of an archive by name; links, devices and the like are refused."""
    files = {}
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        for member in tar.getmembers():
            if member.isdir():
                continue
            if not member.isfile():
                raise ValueError(f"{member.name} is not a regular file")
            extracted = tar.extractfile(member)
            assert extracted is not None  # a regular file's
            files[member.name] = extracted.read()
    return files


def _files_problem(members: dict[str, bytes], listed: dict[str, str]) -> str | None:
    """What differs between an archive's files and the manifest's list of their hashes."""
    for name, content in members.items():
        if name not in listed:
            return f"holds {name}, a file its manifest does not list"
        if hashlib.sha256(content).hexdigest() != listed[name]:
            return f"holds {name}, which does not match its manifest's SHA-256"
    missing = sorted(set(listed) - set(members))
    return f"lacks {missing[0]}, listed in its manifest" if missing else None


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
