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
