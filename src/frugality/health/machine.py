"""What the machine is, and whether a run can write and read what it needs: memory, the run
directory's free space and write speed, the compile cache, the dataset."""

from __future__ import annotations

import contextlib
import os
import shutil
import time
import uuid
from pathlib import Path

import torch

from frugality.compile.cache import cache_url
from frugality.config.recipe import Recipe
from frugality.data.bundled import BUNDLED_PREFIX
from frugality.data.indexed import IndexedDataset
from frugality.hardware import device_memory, probe
from frugality.health import FAIL, INFO, PASS, Check, at_least
from frugality.tasks import get_task

GIB = 2**30


def machine_checks(
    device: torch.device, recipe: Recipe, run_root: Path, limits: dict[str, float], write_mib: int = 64
) -> list[Check]:
    hw = probe(device)
    checks = [Check("machine", "device", INFO, hw.name, hw.describe(), {"features": list(hw.features)})]
    checks.append(_memory(device))
    checks += _disk(run_root, limits, write_mib)
    checks.append(_compile_cache(recipe))
    checks.append(_dataset(recipe))
    return checks


def _memory(device: torch.device) -> Check:
    free, total = device_memory(device)
    return Check(
        "machine",
        "memory",
        INFO,
        f"{free / GIB:.1f} of {total / GIB:.1f} GiB free",
        device.type,
        {"free_bytes": free, "total_bytes": total},
    )


def _disk(run_root: Path, limits: dict[str, float], write_mib: int) -> list[Check]:
    """Free space where runs go, and the speed of writing `write_mib` MiB there, fsynced (what
    a checkpoint costs); the probe file is removed."""
    existing = _existing(run_root)
    checks = [free_disk_check(run_root, limits)]
    probe_file = existing / f".frugality-doctor-{uuid.uuid4().hex}"
    block = os.urandom(1 << 20)
    try:
        t0 = time.perf_counter()
        with open(probe_file, "wb") as f:
            for _ in range(write_mib):
                f.write(block)
            f.flush()
            os.fsync(f.fileno())
        rate = write_mib * 2**20 / 1e6 / (time.perf_counter() - t0)
        checks.append(
            at_least(
                "machine",
                f"disk write at {existing}",
                rate,
                limits["min_disk_write_mb_s"],
                f"{rate:,.0f} MB/s",
                "min_disk_write_mb_s",
            )
        )
    except OSError as e:
        checks.append(Check("machine", f"disk write at {existing}", FAIL, "not writable", str(e)))
    finally:
        with contextlib.suppress(OSError):  # a read-only file system refuses even to remove a file that is not there
            probe_file.unlink(missing_ok=True)
    return checks


def _existing(path: Path) -> Path:
    """`path`, or the nearest folder above it that exists (where it will be created)."""
    return next((p for p in (path, *path.resolve().parents) if p.exists()), Path("/"))


def free_disk_check(run_root: Path, limits: dict[str, float]) -> Check:
    free = shutil.disk_usage(_existing(run_root)).free / GIB
    return at_least(
        "machine",
        f"free disk at {run_root}",
        free,
        limits["min_free_disk_gib"],
        f"{free:,.1f} GiB",
        "min_free_disk_gib",
    )


def _compile_cache(recipe: Recipe) -> Check:
    """The compile cache URL takes a small file and gives it back (then it is removed)."""
    from fsspec.core import url_to_fs

    url = cache_url(recipe.compile.cache)
    try:
        fs, root = url_to_fs(url)
        path = f"{root.rstrip('/')}/.frugality-doctor-{uuid.uuid4().hex}"
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(path, b"ok")
        ok = fs.cat_file(path) == b"ok"
        fs.rm_file(path)
    except Exception as e:  # noqa: BLE001 - any backend's failure is this check's result
        return Check("machine", "compile cache", FAIL, url, f"{type(e).__name__}: {e}")
    return Check("machine", "compile cache", PASS if ok else FAIL, url, "read and write" if ok else "read back differs")


def _dataset(recipe: Recipe) -> Check:
    name = recipe.data.dataset
    if name.startswith(BUNDLED_PREFIX):
        return Check("machine", "dataset", INFO, name, "bundled with frugality")
    if get_task(recipe.train.task).samples == "pairs":  # a JSONL of pairs, read whole when training starts
        if not os.access(name, os.R_OK) or not Path(name).is_file():
            return Check("machine", "dataset", FAIL, name, "no readable file of pairs")
        return Check("machine", "dataset", PASS, name, f"{Path(name).stat().st_size:,} bytes of pairs readable")
    try:
        dataset = IndexedDataset(name)
    except Exception as e:  # noqa: BLE001 - a missing or malformed dataset is this check's result
        return Check("machine", "dataset", FAIL, name, str(e))
    return Check("machine", "dataset", PASS, name, f"{dataset.num_tokens:,} tokens readable")
