"""Where frugality caches what it can rebuild (tokenized corpora, measured device peaks,
compiled kernels), and how it writes: output paths checked before any work, files written
whole or not at all, and a failed write (a full disk) naming its file."""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import shutil
from pathlib import Path

from frugality.errors import UserError


def cache_dir() -> Path:
    """$FRUGALITY_CACHE, else $XDG_CACHE_HOME/frugality, else ~/.cache/frugality."""
    if root := os.environ.get("FRUGALITY_CACHE"):
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "frugality"


def check_output_folder(path: str | Path, what: str) -> None:
    """An output folder (`what` names it: '--out', 'run directory'): absent (made later) or
    a folder, and no folder above it a file; else a UserError before anything is written."""
    path = Path(path)
    for above in (path, *path.parents):
        if not above.exists():
            continue
        if above.is_dir():
            return
        if above == path:
            raise UserError(f"{what} {path}: a file, not a folder; give a folder's path")
        raise UserError(f"{what} {path}: {above} is a file, so no folder can be made under it")


def check_output_file(path: str | Path, what: str) -> None:
    """An output file: not a folder, and in a folder that exists."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path}: a folder; give a file's path, e.g. {path / 'out.jsonl'}")
    parent = path.absolute().parent
    if not parent.is_dir():
        what_it_is = "a file" if parent.exists() else "no such folder"
        raise UserError(f"{what} {path}: {parent} is {what_it_is}; the file needs a folder to be written in")


def write_atomically(path: str | Path, data, overwrite: bool = True, digest: bool = False) -> str | None:
    """`data` (bytes, str, or a function writing to a binary file) into `path` whole or not
    at all: written under a temporary name beside it, synced, then renamed into place (or,
    with `overwrite=False`, never over a file that appeared meanwhile). With `digest`, the
    file's SHA-256 (read back from the page cache). On any failure (a full disk) the
    temporary file is removed, and a filesystem error names `path` (a write's own error
    names no file)."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            if callable(data):
                data(f)
            else:
                f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        sha256 = None
        if digest:
            with open(tmp, "rb") as f:
                sha256 = hashlib.file_digest(f, "sha256").hexdigest()
        if overwrite:
            os.replace(tmp, path)
        else:
            _link_new(tmp, path)
        return sha256
    except OSError as e:
        if e.errno is not None and e.filename in (None, str(tmp)):  # (the temporary name means nothing to users)
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise
    finally:
        tmp.unlink(missing_ok=True)


def move_into_place(written: Path, path: Path) -> None:
    """A file another writer made whole under a temporary name beside `path` (a compiler's
    output, an exporter's) synced and renamed to `path`, the rename made durable; on a
    failure the temporary file is removed. `write_atomically` for what frugality writes itself."""
    try:
        with open(written, "rb") as f:
            os.fsync(f.fileno())
        os.replace(written, path)
        _fsync_dir_if_possible(path.parent)
    finally:
        Path(written).unlink(missing_ok=True)


def publish_folder(partial: Path, final: Path) -> None:
    """A folder written whole under a temporary name (`partial`) renamed to `final`, an
    empty `final` replaced; the rename made durable. The caller removes `partial` on a
    failure, as it wrote it."""
    if final.exists():
        final.rmdir()  # (only an empty one: anything else was refused before writing)
    partial.rename(final)
    _fsync_dir_if_possible(final.parent)


def _fsync_dir_if_possible(path: Path) -> None:
    """After the rename, which has happened: a failure to make it durable is not a failure
    to write (the file or folder is whole in place)."""
    with contextlib.suppress(OSError):
        fsync_dir(path)


def fsync_dir(path: Path) -> None:
    """Make a rename in `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _link_new(tmp: Path, path: Path) -> None:
    """`tmp` as `path`, which must not exist: a hard link (atomic), or where the file system
    has none, a copy into a file created exclusively."""
    try:
        os.link(tmp, path)
        return
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EXDEV, errno.EMLINK):
            raise
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(fd, "wb") as out, open(tmp, "rb") as src:
            shutil.copyfileobj(src, out)
            out.flush()
            os.fsync(out.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise


@contextlib.contextmanager
def naming(path: str | Path):
    """Inside, an OSError that names no file (a write's or a flush's: a full disk) names
    `path`, so that the command's one line says where it could not write."""
    try:
        yield
    except OSError as e:
        if e.filename is None and e.errno is not None:
            raise OSError(e.errno, e.strerror, str(path)) from None
        raise


class NamedFile:
    """An open file whose write, flush and close errors name `path` (see `naming`): for a
    file written a piece at a time (a dataset's tokens, a log)."""

    def __init__(self, f, path: str | Path) -> None:
        self.file, self.path = f, path

    def write(self, data):
        with naming(self.path):
            return self.file.write(data)

    def flush(self) -> None:
        with naming(self.path):
            self.file.flush()

    def close(self) -> None:
        with naming(self.path):
            self.file.close()

    def __getattr__(self, name: str):
        return getattr(self.file, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()
