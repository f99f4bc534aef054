"""Every module of the package imports (a lint fix that drops a re-export, a cycle, a
renamed name would otherwise show only where a test happens to import it)."""

import importlib
import pkgutil

import frugality


def test_every_module_imports():
    failed = {}
    for info in pkgutil.walk_packages(frugality.__path__, "frugality."):
        if info.name == "frugality.__main__":
            continue  # runs the command line
        try:
            importlib.import_module(info.name)
        except Exception as e:  # noqa: BLE001 - every failure is named
            failed[info.name] = f"{type(e).__name__}: {e}"
    assert not failed, failed
