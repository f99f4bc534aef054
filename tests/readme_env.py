"""The environment a README reader has: what `./scripts/setup.sh` installs (frugality and
what its base requirements pull in), plus what the README told them to install before the
command at hand, and nothing else. The test environment holds much more (the test extra,
the peers, all-MiniLM-L6-v2's weights); its other packages are hidden from the commands
the README test runs by a `sitecustomize` on their PYTHONPATH, whose import hook says
"No module named ..." as a missing package does. A README command that needs an extra the
README never installed fails there as it would for the reader."""

from __future__ import annotations

import importlib.metadata as metadata
import json
import re
import shlex
from pathlib import Path

from packaging.requirements import Requirement

_HOOK = '''
import json, os, sys
from importlib.machinery import FileFinder

_HIDDEN = frozenset(json.load(open(os.environ["FRUGALITY_README_HIDDEN"])))


class _Filtered:
    """A site-packages folder without the packages the README reader has not installed:
    they are not found there (None, as for any absent module), so an import of one fails
    as it would for the reader, and a probe for one (importlib.util.find_spec) says absent."""

    def __init__(self, finder):
        self._finder = finder

    def find_spec(self, name, target=None):
        return None if name.partition(".")[0] in _HIDDEN else self._finder.find_spec(name, target)

    def __getattr__(self, name):
        return getattr(self._finder, name)


_WRAPPED = 0
for _entry in sys.path:
    if _entry.rstrip("/").endswith(("site-packages", "dist-packages")):
        _finder = sys.path_importer_cache.get(_entry)
        if _finder is None:
            for _hook in sys.path_hooks:
                try:
                    _finder = _hook(_entry)
                    break
                except ImportError:
                    continue
        if _finder is not None:
            sys.path_importer_cache[_entry] = _Filtered(_finder)
            _WRAPPED += 1
if not _WRAPPED:  # (nothing hidden: the README test would pass where a reader fails)
    raise SystemExit(f"sitecustomize: no site-packages folder on sys.path to hide packages in: {sys.path}")
'''


def _key(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def closure(name: str, extras: tuple[str, ...] = ()) -> set[str]:
    """The distributions `pip install name[extras]` brings (as installed here)."""
    found: set[str] = set()
    todo = [(name, tuple(extras))]
    seen = set()
    while todo:
        dist, wanted = todo.pop()
        if (_key(dist), wanted) in seen:
            continue
        seen.add((_key(dist), wanted))
        try:
            requirements = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:  # (an optional one not installed here)
            continue
        found.add(_key(dist))
        for line in requirements:
            req = Requirement(line)
            if req.marker is None or any(req.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                todo.append((req.name, tuple(sorted(req.extras))))
    return found


class ReaderEnvironment:
    """What a reader following the README has installed, as the commands go by."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.installed = closure("frugality") | {"pip", "setuptools", "wheel"}
        self.hook = folder / "sitecustomize"
        self.hook.mkdir(parents=True, exist_ok=True)
        (self.hook / "sitecustomize.py").write_text(_HOOK)
        self.written = 0
        self._write()

    def follow(self, command: str) -> bool:
        """Take in what `command` installs (`pip install ...`, `setup.sh --FLAG`); whether it
        was an installation (the packages are here already: it is not run)."""
        words = shlex.split(command)
        if words and words[0].endswith("setup.sh"):
            flag = words[1].removeprefix("--") if len(words) > 1 else None
            self.installed |= closure("frugality", (flag,)) if flag else set()
            if flag in ("peers", "test"):  # (setup.sh installs litgpt beside the extra, without its pins)
                self.installed |= {"litgpt"}
            self._write()
            return flag is not None
        if words[1:3] == ["-m", "pip"]:  # python -m pip install ...
            words = ["pip", *words[3:]]
        if len(words) < 3 or not words[0].endswith("pip") or words[1] != "install":
            return False
        no_deps = "--no-deps" in words
        for word in words[2:]:
            if word.startswith("-") and word != "-e":
                continue
            if word == "-e":
                continue
            extras = re.search(r"\[(.*)\]", word)
            name = "frugality" if word.startswith(".") else re.split(r"[\[=<>!~ ]", word)[0]
            wanted = tuple(e.strip() for e in extras.group(1).split(",")) if extras else ()
            self.installed |= {_key(name)} if no_deps else closure(name, wanted)
        self._write()
        return True

    def _write(self) -> None:
        hidden = set()
        for module, dists in metadata.packages_distributions().items():
            if not any(_key(d) in self.installed for d in dists):
                hidden.add(module)
        # a file of its own each time: the hook reads it at start-up, and a process that
        # started with one state (tests/forked_cli.py's servers) keeps it
        self.written += 1
        self.hidden_file = self.folder / f"hidden-{self.written}.json"
        self.hidden_file.write_text(json.dumps(sorted(hidden)))

    def env(self, base: dict) -> dict:
        path = base.get("PYTHONPATH")
        return base | {
            "PYTHONPATH": str(self.hook) + (f":{path}" if path else ""),
            "FRUGALITY_README_HIDDEN": str(self.hidden_file),
        }
