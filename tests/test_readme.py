"""Every command the README shows runs as written on a fresh clone: its bash blocks, then its
commands table, in order, in a folder laid out as the repository's root (`src`, `scripts`
and `.venv` linked in; outputs such as `runs/` land in the folder), through bash, so that
globs expand as they do for a user.

What differs from a user's session, and only that:
- each `train` trains two steps (`--set train.steps=2 --set optim.warmup_steps=1`), and so
  evaluates at its end;
- `scripts/setup.sh` is what CI ran before this suite, and `pytest` is this suite: not rerun;
- `compare` may say FAIL (exit 1): a verdict, not an error.
A command that would need a GPU or SLURM (`--submit`) would run with that part rendered
instead; the README shows none today, and the test fails if one appears unhandled.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"


def readme_commands(text: str) -> list[str]:
    """The bash blocks' commands (a line each, `&&` chains split), then the commands table's
    examples, in the order they appear."""
    blocks, table = [], []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            line = line.split("  #", 1)[0].strip()  # a comment after the command
            if line and not line.startswith("#"):
                blocks += [part.strip() for part in line.split("&&")]
    commands = text[text.index("## Commands") :]
    commands = commands[: commands.index("\n## ", 1)]
    for row in commands.splitlines():
        cells = [c.strip() for c in row.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`frugality"):
            table.append(cells[1].strip("`"))
    return blocks + table


def as_tested(command: str) -> str | None:
    """The command as this test runs it; None for what CI has run already."""
    if command.startswith("./scripts/setup.sh") or " -m pytest" in command:
        return None
    words = shlex.split(command)
    if words[0].endswith("frugality") and words[1:2] == ["train"]:
        return f"{command} --set train.steps=2 --set optim.warmup_steps=1"
    assert "--submit" not in words and "cuda" not in command, f"{command}: needs a GPU or SLURM; render it"
    return command


def test_the_readme_lists_what_this_test_runs():
    commands = readme_commands(README.read_text())
    assert commands[0] == "./scripts/setup.sh" and ".venv/bin/frugality train" in commands
    assert sum(c.startswith("frugality ") for c in commands) >= 18  # the table and the embedding block
    assert all(not c.startswith("tensorboard") for c in commands)  # prose, not a block


def test_every_readme_command_runs_as_written(tmp_path):
    root = tmp_path / "clone"
    root.mkdir()
    for name in ("src", "scripts", ".venv"):
        target = ROOT / name if name != ".venv" else Path(sys.prefix)
        (root / name).symlink_to(target, target_is_directory=True)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for command in readme_commands(README.read_text()):
        tested = as_tested(command)
        if tested is None:
            continue
        done = subprocess.run(["bash", "-c", tested], cwd=root, env=env, capture_output=True, text=True, timeout=900)
        allowed = (0, 1) if shlex.split(command)[1:2] == ["compare"] else (0,)
        assert done.returncode in allowed and "Traceback" not in done.stderr, (
            f"{tested}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
