"""A real full disk for the CLI tests: the command runs in a mount namespace of its own, in
which `folder` is a tmpfs of `size` bytes (the rest of the file system is as it was, and
nothing is mounted outside the command's namespace). Needs `unshare` and a kernel that
lets this user make a mount namespace (root, or unprivileged user namespaces)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# mount, run the command, then list what it left on the small disk (which goes with the namespace)
_WRAPPER = (
    'mount -t tmpfs -o size="$1" tmpfs "$2" || exit 99; d="$2"; cd "$3"; shift 3; "$@"; s=$?; '
    'echo "--- left on the small disk:"; find "$d" -mindepth 1 | sort; exit $s'
)
LISTING = "--- left on the small disk:"


def _unshare_argv() -> list[str]:
    return ["unshare", "--mount", "--propagation", "private", *([] if os.geteuid() == 0 else ["--map-root-user"])]


def available() -> str | None:
    """None when a full disk can be made here; else why not."""
    if shutil.which("unshare") is None:
        return "unshare is not installed"
    probe = subprocess.run(
        [*_unshare_argv(), "sh", "-c", "mount -t tmpfs -o size=4k tmpfs /mnt || exit 1"], capture_output=True, text=True
    )
    return None if probe.returncode == 0 else f"cannot mount a tmpfs in a mount namespace: {probe.stderr.strip()}"


def run_on_small_disk(
    folder: Path,
    size: int,
    args: list[str],
    cwd: Path | None = None,
    env: dict | None = None,
    timeout: float = 600,
    read_only: bool = False,
) -> subprocess.CompletedProcess:
    """`frugality ARGS` with `folder` a `size`-byte tmpfs (empty at the start: whatever the
    test put there is hidden under the mount), mounted read-only with `read_only` (which
    holds for root too, unlike permission bits). Skips the test where no namespace can be
    made. stdout ends with the LISTING line and the paths left under `folder` (see `left`)."""
    why = available()
    if why:
        pytest.skip(why)
    folder.mkdir(parents=True, exist_ok=True)
    options = f"{size},ro" if read_only else str(size)  # the wrapper mounts with -o size=OPTIONS
    argv = [
        *_unshare_argv(),
        "sh",
        "-c",
        _WRAPPER,
        "sh",
        options,
        str(folder),
        str(cwd or folder),
        sys.executable,
        "-m",
        "frugality",
        *args,
    ]
    return subprocess.run(argv, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})})


def left(result: subprocess.CompletedProcess) -> tuple[str, list[str]]:
    """The command's own stdout, and the paths it left on the small disk."""
    out, _, listing = result.stdout.partition(LISTING)
    return out, listing.split()
