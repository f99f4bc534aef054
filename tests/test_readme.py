"""Every command the README shows runs as written, in the README's order, as a reader who
set up with `./scripts/setup.sh` meets it: in a fresh folder laid out as a clone (`src`,
`scripts` and `.venv` linked in; outputs such as `runs/` land in the folder), through
bash (globs expand as for a reader), with only the packages that set-up and the README's
own install commands give (tests/readme_env.py hides the rest of the test environment).
Each command must keep its promise: the file, figure or line it says it gives.

What differs from a reader's session, and only that:
- a `frugality` command's process is forked from one that imported torch and frugality with
  the reader's environment (tests/forked_cli.py), after bash expanded its words; the
  console script by its path (`.venv/bin/frugality train`), `serve` and what the commands
  start themselves (`--nproc`'s ranks) are fresh processes;
- each `train` trains two steps (`--set train.steps=2`: the warm-up is cut to them, as for a
  reader), and so evaluates at its end, over at most 64 held-out samples;
- caches (frugality's, Inductor's) start empty in a folder of the test's, as on a new machine;
- `pip install` and `./scripts/setup.sh --FLAG` are not run (their packages are in .venv)
  but followed: what they install is no longer hidden. The test command's block
  (`./scripts/setup.sh --test`, `./scripts/test.sh`) is a developer's: what it installs
  stays hidden;
- `serve` is started on a free port, asked for its health and a vector, and stopped;
- `compare` may say FAIL (exit 1): a verdict, not an error.
A command that would need a GPU or SLURM (`--submit`) would run with that part rendered
instead; the README shows none today, and the test fails if one appears unhandled.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from readme_env import ReaderEnvironment

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
TEST_BLOCK = ("./scripts/setup.sh --test", "./scripts/test.sh")  # a developer's, not a reader's


def readme_commands(text: str) -> list[str]:
    """The bash blocks' commands (a line each, `&&` chains split) and the commands table's
    examples, in the order they appear in the README."""
    found = []  # (offset, command)
    for block in re.finditer(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.group(1).splitlines():
            line = line.split("  #", 1)[0].strip()  # a comment after the command
            if line and not line.startswith("#"):
                found += [(block.start(), part.strip()) for part in line.split("&&")]
    start = text.index("## Commands")
    table = text[start : text.index("\n## ", start + 1)]
    for row in re.finditer(r"^\|.*\|$", table, flags=re.M):
        cells = [c.strip() for c in row.group(0).strip("|").split("|")]
        if len(cells) == 3 and cells[1].startswith("`frugality"):
            found.append((start + row.start(), cells[1].strip("`")))
    return [command for _, command in sorted(found, key=lambda f: f[0])]


def as_tested(command: str) -> str:
    """The command as this test runs it."""
    words = shlex.split(command)
    if words[0].endswith("frugality") and words[1:2] == ["train"]:
        return f"{command} --set train.steps=2 --set train.eval_samples=64"
    assert "--submit" not in words and "cuda" not in command, f"{command}: needs a GPU or SLURM; render it"
    return command


def _prints(pattern: str, stream: str = "stdout"):
    def check(done, root: Path) -> None:
        text = getattr(done, stream)
        assert re.search(pattern, text, flags=re.M), f"no {pattern!r} in\n{text[-2000:]}"

    return check


def _writes(*paths: str):
    def check(done, root: Path) -> None:
        for path in paths:
            assert list(root.glob(path)) and all(p.stat().st_size > 0 for p in root.glob(path)), path

    return check


def _trained(run: str, learns: bool = True):
    """Two steps trained, logged and summarised; from scratch (`learns`), the validation loss
    lower after them (a pretrained model's may not move in two steps)."""

    def check(done, root: Path) -> None:
        summary = json.loads((root / run / "summary.json").read_text())
        assert summary["final_step"] == 2, summary
        assert not learns or summary["final_val_loss"] < summary["first_val_loss"], summary
        assert f"{run}: step 2/2" in done.stdout, done.stdout

    return check


def _embedded(out: str):
    def check(done, root: Path) -> None:
        manifest = json.loads((root / out / "manifest.json").read_text())
        assert manifest["count"] > 100 and f"{manifest['count']:,} texts" in done.stdout, done.stdout

    return check


def _all(*checks):
    return lambda done, root: [check(done, root) for check in checks]


# What each command promises, by its first words (the longest match counts): checked after it ran.
PROMISES = {
    ".venv/bin/frugality train": _trained("runs/tiny"),
    "frugality train tiny --set train.precision=fp32": _trained("runs/tiny-fp32"),
    "frugality train tiny --nproc 2": _trained("runs/tiny-2ranks"),
    "frugality train minilm-pairs": _all(_trained("runs/minilm-pairs", learns=False), _prints(r"recall@1 \d")),
    "frugality import hf": _all(_writes("models/minilm/recipe.toml"), _prints("^imported ")),
    "frugality data prepare": _all(_writes("data/books.bin", "data/books.idx"), _prints(r"^wrote data/books\.bin")),
    "frugality embed models/minilm": _embedded("emb"),
    "frugality embed runs/minilm-pairs": _embedded("emb-tuned"),
    # (the completion streams to stdout: after two steps of training, often blank lines)
    "frugality generate": _all(_prints(r"\n"), _prints(r"^1 prompt, \d+ tokens in .* tokens/s", "stderr")),
    "frugality serve": lambda done, root: None,  # (asked while it runs: see _serve)
    "frugality doctor": _prints(r"^doctor: all \d+ checks passed"),
    "frugality plan": _prints(r"GiB"),
    "frugality launch slurm": _writes("runs/pythia-410m.sbatch"),
    "frugality recipes": _prints(r"^hidden_size = 1024$"),
    "frugality export hf": _writes("exported/config.json", "exported/model.safetensors"),
    "frugality compile": _writes("compile-cache/*/manifest.json"),
    "frugality bench train": _prints(r"^\| frugality \| (bf16-sr|fp32) "),
    "frugality compare": _prints(r"\b(PASS|FAIL)\b"),
    "frugality cost train": _prints(r"^[\d,]+ tokens per dollar"),
    "frugality top": _prints(r"\S"),
}


def _keeps_its_promise(command: str, done, root: Path) -> None:
    matches = [prefix for prefix in PROMISES if command.startswith(prefix)]
    assert matches, f"{command}: add what it promises to PROMISES"
    PROMISES[max(matches, key=len)](done, root)


def _serve(command: str, root: Path, env: dict) -> subprocess.CompletedProcess:
    """The server as a reader starts it, on a free port: ready, healthy, answering a vector;
    then SIGTERM. Killed however the checks end."""
    import httpx

    log = root / "serve.log"
    with open(log, "w") as err:
        server = subprocess.Popen(
            ["bash", "-c", f"exec {command} --port 0 --runs serve-runs"],
            cwd=root,
            env=env,
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
        )
    try:
        deadline = time.monotonic() + 300
        while "ready, POST" not in log.read_text():
            assert server.poll() is None, f"{command}: ended\n{log.read_text()}"
            assert time.monotonic() < deadline, f"{command}: not ready\n{log.read_text()}"
            time.sleep(0.1)
        url = re.search(r"(http://[\d.]+:\d+)", log.read_text()).group(1)
        assert httpx.get(f"{url}/health").status_code == 200
        reply = httpx.post(f"{url}/v1/embeddings", json={"model": "minilm", "input": "a reader's text"}, timeout=60)
        assert reply.status_code == 200 and len(reply.json()["data"][0]["embedding"]) == 384, reply.text
        server.send_signal(signal.SIGTERM)
        out, _ = server.communicate(timeout=120)
    finally:
        if server.poll() is None:
            server.kill()
            server.wait()
    return subprocess.CompletedProcess(command, server.returncode, out, log.read_text())


def _run(command: str, root: Path, env: dict) -> subprocess.CompletedProcess:
    """`command` through bash; a `frugality` command's words as bash expands them (globs,
    quotes), its process forked from one that imported torch and frugality in the reader's
    environment (tests/forked_cli.py: a server per state of the reader's packages)."""
    words = shlex.split(command)
    # through bash itself: anything but `frugality ...`, the console script by its path (the
    # README's first command: set-up's entry point), and a command bash would redirect or chain
    if words[0] != "frugality" or re.search(r"[|;&<>]", command):
        return subprocess.run(["bash", "-c", command], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    expanded = subprocess.run(
        ["bash", "-c", f"printf '%s\\0' {command}"], cwd=root, env=env, capture_output=True, text=True, check=True
    )
    import forked_cli

    return forked_cli.run(*expanded.stdout.split("\0")[1:-1], cwd=root, env=env, timeout=900)


def test_the_readme_lists_what_this_test_runs():
    commands = readme_commands(README.read_text())
    assert commands[0] == "./scripts/setup.sh" and commands[1] == ".venv/bin/frugality train"
    assert [c for c in commands if c in TEST_BLOCK] == list(TEST_BLOCK)
    assert sum(c.startswith("frugality ") for c in commands) >= 19  # the table and the embedding blocks
    assert all(not c.startswith("tensorboard") for c in commands)  # prose, not a block


@pytest.mark.timeout(1800)  # (the slowest CPU kind, with empty caches)
def test_every_readme_command_runs_as_written_in_order(tmp_path):
    root = tmp_path / "clone"
    root.mkdir()
    for name in ("src", "scripts", ".venv"):
        target = ROOT / name if name != ".venv" else Path(sys.prefix)
        (root / name).symlink_to(target, target_is_directory=True)
    reader = ReaderEnvironment(tmp_path / "reader")
    base = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    caches = tmp_path / "home-cache"  # a new machine's: nothing measured, tokenized or compiled yet
    base |= {"XDG_CACHE_HOME": str(caches), "FRUGALITY_CACHE": str(caches / "frugality")}
    base |= {"TORCHINDUCTOR_CACHE_DIR": str(caches / "inductor")}
    for command in readme_commands(README.read_text()):
        if command in TEST_BLOCK:
            continue
        if reader.follow(command) or command == "./scripts/setup.sh":
            continue  # (installed: the packages are in .venv; the hook stops hiding them)
        tested = as_tested(command)
        env = reader.env(base)
        if shlex.split(command)[1:2] == ["serve"]:
            done = _serve(tested, root, env)
        else:
            done = _run(tested, root, env)
        allowed = (0, 1) if shlex.split(command)[1:2] == ["compare"] else (0,)
        assert done.returncode in allowed and "Traceback" not in done.stderr, (
            f"{tested}\nexit {done.returncode}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
        )
        _keeps_its_promise(command, done, root)


def test_a_command_whose_extra_the_reader_has_not_installed_says_how_in_one_line(tmp_path):
    """With `./scripts/setup.sh` alone (the README reader's environment, above): `serve`
    names its extra (it was a traceback of `No module named 'fastapi'`), as `embed
    --format parquet` names pyarrow."""
    reader = ReaderEnvironment(tmp_path / "reader")
    env = reader.env({**os.environ})
    (tmp_path / "t.txt").write_text("a text\n")
    cases = [
        (
            ["serve", tmp_path],
            "error: frugality serve needs its extra (fastapi, uvicorn, prometheus_client, orjson missing)",
        ),
        (["embed", tmp_path, tmp_path / "t.txt", "--out", tmp_path / "o", "--format", "parquet"], "needs pyarrow"),
    ]
    for args, said in cases:
        done = subprocess.run(
            [sys.executable, "-m", "frugality", *map(str, args)], capture_output=True, text=True, env=env
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2 and len(lines) == 1 and said in lines[0], done.stderr
