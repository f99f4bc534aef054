"""Builds and loads `adamw_bf16_cpu.c`: a small C file compiled once per machine with the
system C compiler (about a second) into frugality's cache, called through ctypes.

No torch headers are involved, so the build is quick and does not depend on the torch
version. If no compiler is there or the build fails, `load()` returns None and
BF16AdamW falls back to torch.compile or eager torch ops (same results, slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import warnings
from functools import lru_cache
from importlib import resources
from pathlib import Path

from frugality.cache import cache_dir

_FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fopenmp", "-shared", "-fPIC"]


def _cpu_signature() -> str:
    """What -march=native depends on: the CPU model and its feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [l for l in info.splitlines() if l.startswith(("model name", "flags"))][:2]
        return "\n".join(lines)
    except OSError:
        return platform.processor() + platform.machine()


@lru_cache(maxsize=1)
def load():
    """The compiled kernel as a ctypes function, or None where it cannot be built."""
    if os.environ.get("FRUGALITY_NO_C_KERNEL"):
        return None
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        return None
    source = (resources.files("frugality") / "precision" / "adamw_bf16_cpu.c").read_bytes()
    key = hashlib.sha256(source + " ".join(_FLAGS).encode() + compiler.encode()
                         + _cpu_signature().encode()).hexdigest()[:16]
    library = cache_dir() / "kernels" / f"adamw_bf16_cpu-{key}.so"
    if not library.exists():
        library.parent.mkdir(parents=True, exist_ok=True)
        src = library.with_suffix(f".{os.getpid()}.c")
        tmp = library.with_suffix(f".{os.getpid()}.so")
        src.write_bytes(source)
        try:
            done = subprocess.run([compiler, *_FLAGS, str(src), "-o", str(tmp), "-lm"],
                                  capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            warnings.warn(f"could not build the bf16 AdamW CPU kernel ({e}); using torch ops")
            return None
        finally:
            src.unlink(missing_ok=True)
        if done.returncode != 0:
            tmp.unlink(missing_ok=True)
            warnings.warn("could not build the bf16 AdamW CPU kernel; using torch ops:\n"
                          + done.stderr[-2000:])
            return None
        os.replace(tmp, library)  # atomic: concurrent builders never load a partial file
    fn = ctypes.CDLL(str(library)).adamw_bf16_step
    fn.restype = None
    fn.argtypes = ([ctypes.c_void_p] * 4 + [ctypes.c_int64] * 2 + [ctypes.c_float] * 9
                   + [ctypes.c_uint32, ctypes.c_int, ctypes.c_int])
    return fn
