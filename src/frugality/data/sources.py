"""Where `data prepare` reads its inputs: local paths, or fsspec URLs (`s3://bucket/key`,
`gs://`, `https://`, ...), each named as the command line gave it. A URL's filesystem is
fsspec's (s3fs for S3: `pip install 'frugality[s3]'`), configured as fsspec configures it
(credentials from the environment, an endpoint from `FSSPEC_S3_ENDPOINT_URL`)."""

from __future__ import annotations

import glob
from dataclasses import dataclass
from pathlib import Path

from frugality.errors import UserError


def is_url(name: str) -> bool:
    return "://" in name


@dataclass(frozen=True)
class Found:
    """What an input is: its kind, its size, and what says it changed since."""

    kind: str  # "file", "directory" or "missing"
    size: int = 0
    version: str = ""  # local: the modification time (ns); a URL: its ETag, or its time


def found(name: str) -> Found:
    if not is_url(name):
        path = Path(name)
        if path.is_dir():
            return Found("directory")
        if not path.is_file():
            return Found("missing")
        st = path.stat()
        return Found("file", st.st_size, str(st.st_mtime_ns))
    fs, path = _fs(name)
    try:
        info = fs.info(path)
    except FileNotFoundError:
        return Found("missing")
    except Exception as e:  # credentials, a refused connection: the library's own words
        raise UserError(f"input {name}: cannot be read ({type(e).__name__}: {e})") from None
    if info.get("type") == "directory":
        return Found("directory")
    version = info.get("ETag") or info.get("etag") or info.get("LastModified") or info.get("mtime") or ""
    return Found("file", int(info.get("size") or 0), str(version))


def open_input(name: str, block_size: int = 16 << 20, cache: str = "readahead"):
    """`name`'s bytes as a seekable binary file; a URL's read in ranges of `block_size` as it
    is sought (not the filesystem's default, 50 MiB for S3, which a small piece or a search
    for a line's end would fetch whole)."""
    if not is_url(name):
        return open(name, "rb")
    fs, path = _fs(name)
    try:
        return fs.open(path, "rb", block_size=block_size, cache_type=cache)
    except FileNotFoundError:
        raise UserError(f"input {name}: no such file") from None


def expand(given: str) -> list[str]:
    """`given`, or, when it names no input as it is and holds a glob (quoted on the command
    line, or given by a program), its matches sorted; a glob matching nothing is one line."""
    if not glob.has_magic(given) or found(given).kind != "missing":
        return [given]
    if is_url(given):
        fs, path = _fs(given)
        matches = sorted(fs.unstrip_protocol(p) for p in fs.glob(path) if fs.isfile(p))
    else:
        matches = sorted(glob.glob(given, recursive=True))
    if not matches:
        raise UserError(f"input {given}: matches no file")
    return matches


def base_name(name: str) -> str:
    return name.rstrip("/").rsplit("/", 1)[-1] if is_url(name) else Path(name).name


def absolute(name: str) -> str:
    """As every node of a cluster names it (a Ray worker's working directory is its own)."""
    return name if is_url(name) else str(Path(name).resolve())


def _fs(name: str):
    from fsspec.core import url_to_fs

    try:
        return url_to_fs(name)
    except ImportError as e:  # fsspec: "Install s3fs to access S3"
        protocol = name.split("://", 1)[0]
        extra = " (pip install 'frugality[s3]')" if protocol in ("s3", "s3a") else ""
        raise UserError(f"input {name}: reading {protocol}:// needs a package not installed{extra}: {e}") from None
    except ValueError as e:  # an unknown protocol
        raise UserError(f"input {name}: {e}") from None
