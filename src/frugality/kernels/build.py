"""Builds and loads the C files of this package: each compiled once per machine with the
system C compiler (about a second) into frugality's cache, called through ctypes.

No torch headers are involved, so a build is quick and does not depend on the torch
version. If no compiler is there or a build fails, `library()` returns None (with one
warning) and callers fall back to torch ops (same results, slower).
`FRUGALITY_NO_C_KERNEL=1` turns them all off.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from functools import cache
from importlib import resources
from pathlib import Path

from frugality.paths import cache_dir, move_into_place

_FLAGS = ["-O3", "-march=native", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]
if platform.machine().lower() in ("x86_64", "amd64"):
    # gcc otherwise keeps to 256-bit vectors on AVX-512 CPUs; 512 measured 1.3x faster here
    _FLAGS.append("-mprefer-vector-width=512")


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


@cache
def library(name: str, extra_flags: tuple[str, ...] = ()) -> ctypes.CDLL | None:
    """`name`.c of this package, compiled (with `extra_flags` after the common ones) and
    loaded; None where it cannot be built."""
    if os.environ.get("FRUGALITY_NO_C_KERNEL"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    here = resources.files("frugality") / "kernels"
    source = (here / f"{name}.c").read_bytes()
    # the shared headers are part of what is built: a change to one rebuilds every kernel
    headers = b"".join(h.read_bytes() for h in sorted(here.iterdir(), key=lambda h: h.name) if h.name.endswith(".h"))
    flags = [*_FLAGS, *extra_flags]
    key = hashlib.sha256(
        source + headers + " ".join(flags).encode() + compiler.encode() + _cpu_signature().encode()
    ).hexdigest()[:16]
    path = cache_dir() / "kernels" / f"{name}-{key}.so"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        src = path.with_suffix(f".{os.getpid()}.c")
        tmp = path.with_suffix(f".{os.getpid()}.so")
        src.write_bytes(source)
        try:
            done = subprocess.run(
                [compiler, *flags, f"-I{here}", str(src), "-o", str(tmp), "-lm"],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except (OSError, subprocess.TimeoutExpired) as e:
            warnings.warn(f"could not build the C kernel {name} ({e}); using torch ops", stacklevel=1)
            return None
        finally:
            src.unlink(missing_ok=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            warnings.warn(
                f"could not build the C kernel {name}; using torch ops:\n" + done.stderr[-2000:], stacklevel=1
            )
            return None
        try:
            move_into_place(tmp, path)  # atomic: concurrent builders never load a partial file
        except OSError as e:  # (a full disk at the sync): as a failed build
            warnings.warn(f"could not keep the C kernel {name} ({e}); using torch ops", stacklevel=1)
            return None
    return ctypes.CDLL(str(path))
