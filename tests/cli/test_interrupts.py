"""A Ctrl-C during an import is raised once the import is over: no half-imported module
left behind for later code to trip on (the race behind a run that trained to its end after
a Ctrl-C at start-up)."""

from __future__ import annotations

import signal
import sys
import time

import pytest

from frugality.cli.interrupts import InterruptsAfterImports

MODULE = """
import signal, time
signal.raise_signal(signal.SIGINT)  # a Ctrl-C in the middle of this import
time.sleep(0.1)  # (the import goes on: a retry or two come while it runs)
COMPLETE = True
"""


@pytest.fixture(autouse=True)
def python_default_handler():
    """Python's own SIGINT handler, as at a terminal (a suite started in the background by a
    script has SIGINT ignored, and the block then rightly leaves it so)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def test_an_interrupt_during_an_import_comes_after_it(tmp_path, monkeypatch):
    (tmp_path / "interrupted_module.py").write_text(MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    reached = []
    with pytest.raises(KeyboardInterrupt), InterruptsAfterImports():
        import interrupted_module  # noqa: F401

        reached.append("after the import")
        time.sleep(5)  # the interrupt comes here, within a retry
    assert sys.modules["interrupted_module"].COMPLETE and reached == ["after the import"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # as it was
    del sys.modules["interrupted_module"]


def test_a_second_interrupt_during_an_import_is_at_once(tmp_path, monkeypatch):
    (tmp_path / "twice_interrupted.py").write_text(
        "import signal\nsignal.raise_signal(signal.SIGINT)\nsignal.raise_signal(signal.SIGINT)\nREACHED = True\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt), InterruptsAfterImports():
        import twice_interrupted  # noqa: F401
    assert not hasattr(sys.modules.get("twice_interrupted"), "REACHED")  # (an import that hangs ends too)
    sys.modules.pop("twice_interrupted", None)


def test_one_held_when_the_block_ends_is_raised_there(tmp_path, monkeypatch):
    (tmp_path / "short_module.py").write_text("import signal\nsignal.raise_signal(signal.SIGINT)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(KeyboardInterrupt), InterruptsAfterImports():
        import short_module  # noqa: F401
        # (the block ends before the watcher looks again)
    sys.modules.pop("short_module", None)


def test_a_handler_installed_after_the_import_gets_the_held_interrupt_once(tmp_path, monkeypatch):
    (tmp_path / "held_module.py").write_text("import signal\nsignal.raise_signal(signal.SIGINT)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    got = []
    with InterruptsAfterImports():
        import held_module  # noqa: F401

        previous = signal.signal(signal.SIGINT, lambda *_: got.append(time.monotonic()))  # as a training run's
        try:
            time.sleep(0.5)  # ten looks of the watcher: one signal, not one each
        finally:
            signal.signal(signal.SIGINT, previous)
    assert len(got) == 1
    sys.modules.pop("held_module", None)


def test_outside_an_import_it_is_at_once_and_a_commands_own_handler_is_left_alone():
    with pytest.raises(KeyboardInterrupt), InterruptsAfterImports():
        signal.raise_signal(signal.SIGINT)
    own = lambda *_: None
    previous = signal.signal(signal.SIGINT, own)
    try:
        with InterruptsAfterImports():
            assert signal.getsignal(signal.SIGINT) is own
    finally:
        signal.signal(signal.SIGINT, previous)
