"""Reading checkpoints from strangers without running their code.

A DCP checkpoint has two pickle channels: `.metadata`, which torch reads with a plain
`pickle.load`, and non-tensor values (our `extra` training state), which DCP's default
planner reads with `torch.load(weights_only=False)`. Either runs whatever a crafted file
asks for the moment it is read. Every load in frugality (resume, `--init-from`, `export hf`)
goes through `SafeReader` and `SafePlanner` instead:

- `.metadata` is unpickled with an allow-list of DCP's own metadata classes, `torch.Size`,
  dtypes, layouts and paths (the classes a DCP save writes, checked with torch 2.13), and
  object states are set on instances of DCP's classes only (never on a class or function);
- non-tensor values are read with `torch.load(weights_only=True)`: plain data only;
- tensors DCP already reads with `weights_only=True`.

Anything else is refused with one line naming the file and the class it asked for. torch
offers no safe metadata reader (its reader is `pickle.load`), hence this one; the approach
is the one Python's own documentation gives ("Restricting Globals").

Checkpoints written before frugality stored its training state as JSON held a pickle of
plain data (dicts, NumPy and torch RNG states); `legacy_state` reads those with the same
kind of allow-list, so old runs still resume.
"""

from __future__ import annotations

import io
import pathlib
import pickle
import re
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Any, ClassVar

import torch
import torch._utils
from torch.distributed.checkpoint import metadata as dcp_metadata
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemReader, _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from frugality.errors import UserError

SECURITY_DOC = "docs/security.md"


class UnsafeCheckpointError(UserError):
    """A checkpoint file asked to build something other than plain data."""


class _Refused(pickle.UnpicklingError):
    """A global outside the allow-list: the pickle asked for `module.name`."""


def _metadata_class(module: str, name: str) -> Any | None:
    """The classes DCP's metadata module defines (dataclasses and one enum); nothing else there."""
    if module != dcp_metadata.__name__:
        return None
    found = getattr(dcp_metadata, name, None)
    if (
        isinstance(found, type)
        and found.__module__ == module
        and (hasattr(found, "__dataclass_fields__") or issubclass(found, Enum))
    ):
        return found
    return None


def _layout(name: str) -> torch.layout:
    found = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(found, torch.layout):
        raise pickle.UnpicklingError(f"unknown layout {name!r}")
    return found


_ALLOWED: dict[tuple[str, str], Any] = {
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): _layout,  # torch's own is a lookup by name too
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _StorageInfo,
    ("pathlib", "PosixPath"): pathlib.PurePosixPath,  # a path, never touched: pure paths
    ("pathlib", "WindowsPath"): pathlib.PureWindowsPath,
    ("pathlib", "PurePosixPath"): pathlib.PurePosixPath,
    ("pathlib", "PureWindowsPath"): pathlib.PureWindowsPath,
    ("collections", "OrderedDict"): dict,
}


class _RestrictedUnpickler(pickle._Unpickler):
    """Python's own unpickler (its pure-Python twin, whose opcodes can be overridden) with two
    restrictions: `find_class` answers from an allow-list, and BUILD — which sets an object's
    state, and on a class or function would rewrite it for the whole process — applies only
    to instances that `_build` accepts."""

    # opcode -> method (typeshed types them as pickle.Unpickler's, which has no such table)
    dispatch: ClassVar[dict[int, Callable[[Any], None]]] = dict(pickle._Unpickler.dispatch)
    stack: list[Any]  # the pure-Python unpickler's, which typeshed leaves out

    def _load_build(self) -> None:
        inst = self.stack[-2]
        verdict = False if isinstance(inst, type) else self._may_build(inst, self.stack[-1])
        if not verdict:
            kind = inst if isinstance(inst, type) else type(inst)
            raise _Refused(f"a state for {kind.__module__}.{kind.__qualname__}")
        if verdict == "as built":
            self.stack.pop()  # the state it already has
            return
        # typeshed's _Unpickler omits the opcode methods
        pickle._Unpickler.load_build(self)  # pyright: ignore[reportAttributeAccessIssue]

    dispatch[pickle.BUILD[0]] = _load_build

    def _may_build(self, inst: Any, state: Any) -> bool | str:
        return False


class _MetadataUnpickler(_RestrictedUnpickler):
    def _may_build(self, inst: Any, state: Any) -> bool | str:  # DCP's dataclasses only
        return type(inst) is _StorageInfo or _metadata_class(type(inst).__module__, type(inst).__name__) is type(inst)

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _ALLOWED:
            return _ALLOWED[module, name]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        found = _metadata_class(module, name)
        if found is not None:
            return found
        raise _Refused(f"{module}.{name}")


def _refusal(path: Path, what: str, error: Exception | str) -> UnsafeCheckpointError:
    return UnsafeCheckpointError(
        f"checkpoint {path}: {what} asks to build {error}, which a checkpoint may not hold; "
        f"refused without running it (see {SECURITY_DOC})"
    )


def _unpickle(unpickler: pickle._Unpickler, path: Path, what: str) -> Any:
    """Run a restricted unpickler: a refused global or state is an UnsafeCheckpointError,
    a damaged pickle one line saying so."""
    try:
        return unpickler.load()
    except _Refused as e:
        raise _refusal(path, what, e) from None
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        RuntimeError,
        MemoryError,
        RecursionError,
    ) as e:
        raise UserError(f"checkpoint {path}: {what} is unreadable ({type(e).__name__}: {e})") from None


def read_metadata(path: str | Path, name: str = ".metadata") -> Metadata:
    """DCP's `.metadata` of a checkpoint folder, read without running code from it."""
    with open(Path(path) / name, "rb") as f:
        metadata = _unpickle(_MetadataUnpickler(f), Path(path), name)
    if not isinstance(metadata, Metadata):
        raise UserError(f"checkpoint {path}: {name} holds a {type(metadata).__name__}, not DCP metadata")
    return metadata


class SafeReader(FileSystemReader):
    """DCP's file-system reader with `.metadata` read through the allow-list."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        file = Path(self._get_metadata_path(kwargs.get("rank")))  # per-rank files too, if asked
        metadata = read_metadata(file.parent, file.name)
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is None:
            storage_meta = metadata.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DCP's default load planner, with non-tensor values read as plain data only."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            raise _refusal(self.path, f"value {read_item.dest_index.fqn!r}", _refused_global(e)) from None
        plain = io.BytesIO()
        torch.save(loaded, plain)  # vetted plain data, for the parent's own reader
        plain.seek(0)
        super().load_bytes(read_item, plain)


def _refused_global(error: Exception) -> str:
    """The global torch's weights-only unpickler refused, from its long message."""
    found = re.search(r"GLOBAL (\S+)", str(error))
    return found.group(1) if found else str(error).splitlines()[0][:200]


def legacy_state(data: bytes, path: Path) -> dict:
    """The training state of a checkpoint written before it was JSON: a pickle of plain
    data and RNG states, read with an allow-list."""
    state = _unpickle(_LegacyUnpickler(io.BytesIO(data)), path, "the training state")
    if not isinstance(state, dict):
        raise UserError(f"checkpoint {path}: the training state is a {type(state).__name__}, not a table")
    return state


def _tensor_from_bytes(data: bytes) -> torch.Tensor:
    return torch.load(io.BytesIO(data), weights_only=True)


def _plain_dtype(name: Any, align: bool = False, copy: bool = False):
    """A NumPy dtype by name, numbers only: a dtype's pickled state can declare object fields
    that make arrays read raw bytes as pointers, so no other dtype is built."""
    import numpy as np

    dtype = np.dtype(name) if isinstance(name, str) else None
    if dtype is None or dtype.kind not in "biuf" or dtype.fields is not None:
        raise _Refused(f"numpy.dtype({name!r})")
    return dtype


class _LegacyUnpickler(_RestrictedUnpickler):
    def _may_build(self, inst: Any, state: Any) -> bool | str:
        import numpy as np

        if isinstance(inst, np.dtype):  # a plain dtype's own state, nothing else: then left as built
            return "as built" if state == inst.__reduce__()[2] else False
        return (
            type(inst) is np.ndarray
            and isinstance(state, tuple)
            and len(state) == 5
            and isinstance(state[2], np.dtype)
            and state[2].kind in "biuf"
            and state[2].fields is None
        )

    def find_class(self, module: str, name: str) -> Any:
        import numpy as np

        try:
            from numpy._core import multiarray
        except ImportError:  # NumPy 1
            from numpy.core import multiarray
        allowed = {
            ("collections", "OrderedDict"): dict,
            ("numpy", "dtype"): _plain_dtype,
            ("numpy", "ndarray"): np.ndarray,
            ("numpy._core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy.core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("torch._utils", "_rebuild_tensor_v2"): torch._utils._rebuild_tensor_v2,
            ("torch.storage", "_load_from_bytes"): _tensor_from_bytes,  # torch's is weights_only=False
        }
        if (module, name) in allowed:
            return allowed[module, name]
        raise _Refused(f"{module}.{name}")
