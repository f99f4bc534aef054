"""A Ctrl-C that comes while a module is being imported is taken once the import is over.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside an import
that leaves modules half-initialised in `sys.modules` (torch's C extension, numpy's
`linalg`), and code that imports them under `try: ... except ImportError` (or catches and
goes on) may then run the whole command: a run trained to its end after a Ctrl-C, exit 0,
or an abort from C++ ("what(): KeyboardInterrupt"), seen about once in ten tries in the
first second of `frugality train`. So the interrupt is held while an import runs and raised
once it is over: a watching thread looks at the main thread's stack every 50 ms and sends
the signal again, once, when no import is on it. A second Ctrl-C while one is held is
raised at once (an import that hangs can still be interrupted)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
_LOOK_EVERY_S = 0.05


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


class InterruptsAfterImports:
    """Within the block, SIGINT raises KeyboardInterrupt as Python's own handler does, except
    during an import (above). Only Python's default handler is replaced (a command's own, a
    SIG_IGN, stay as they are), only in the main thread, and only where a thread can signal
    another (not Windows); the default comes back at the block's end, and an interrupt still
    held then is raised there. The handler touches no lock: flags, and a byte down a pipe."""

    def __init__(self) -> None:
        self.installed = False
        self.pending = False  # a Ctrl-C held until the import is over
        self.resent = False  # the signal now coming is the watcher's
        self.closed = False

    def __enter__(self) -> InterruptsAfterImports:
        main = threading.main_thread()
        if (
            threading.current_thread() is main
            and main.ident is not None
            and hasattr(signal, "pthread_kill")
            and signal.getsignal(signal.SIGINT) is signal.default_int_handler
        ):
            self.main: int = main.ident
            self.wake_r, self.wake_w = os.pipe()
            self.watcher = threading.Thread(target=self._watch, name="interrupt-after-import", daemon=True)
            self.watcher.start()
            signal.signal(signal.SIGINT, self._handle)
            self.installed = True
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if not self.installed:
            return
        self.installed = False
        if signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.closed = True
        os.write(self.wake_w, b"x")
        self.watcher.join(timeout=1)
        os.close(self.wake_r)
        os.close(self.wake_w)
        if self.pending and exc_type is None:  # held, and the block ended before it was sent
            self.pending = False
            raise KeyboardInterrupt

    def _handle(self, signum, frame) -> None:
        if self.resent:  # the watcher's: the import it waited for is over
            self.resent = False
            if _importing(frame):  # (another one began meanwhile)
                os.write(self.wake_w, b"x")
                return
        elif not self.pending and _importing(frame):
            self.pending = True
            os.write(self.wake_w, b"x")
            return
        self.pending = False  # (or a second Ctrl-C while one is held: at once)
        raise KeyboardInterrupt

    def _watch(self) -> None:
        while True:
            os.read(self.wake_r, 1)
            while self.pending and not self.closed:
                frame = sys._current_frames().get(self.main)
                if frame is None or not _importing(frame):
                    # once: to this handler, or to the one the command installed meanwhile
                    # (which takes it as its own: nothing is held any more)
                    if signal.getsignal(signal.SIGINT) != self._handle:
                        self.pending = False
                    else:
                        self.resent = True
                    signal.pthread_kill(self.main, signal.SIGINT)
                    break
                time.sleep(_LOOK_EVERY_S)
            if self.closed:
                return
