"""The tree passes ruff's lint and format checks (pyproject's [tool.ruff]), so that the
README's test command covers them as .ci/run does."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("check", [["check"], ["format", "--check"]])
def test_ruff_passes(check):
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    assert ruff, "ruff is not installed (./scripts/setup.sh --test installs it)"
    done = subprocess.run([ruff, *check, "."], cwd=ROOT, capture_output=True, text=True)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-1000:]
