"""A Ctrl-C that comes while a module is being imported is taken once the import is over.

Python raises KeyboardInterrupt wherever the main thread happens to be. Inside an import
that leaves modules half-initialised in `sys.modules` (torch's C extension, numpy's
`linalg`), and code that imports them under `try: ... except ImportError` (or catches and
goes on) may then run the whole command: a run trained to its end after a Ctrl-C, exit 0,
or an abort from C++ ("what(): KeyboardInterrupt"), seen about once in ten tries in the
first second of `frugality train`. So the interrupt is held while an import runs and raised
at the first moment after it, within about 50 ms of the import's end."""

from __future__ import annotations

import signal
import threading
import time

_IMPORT_MACHINERY = ("<frozen importlib._bootstrap>", "<frozen importlib._bootstrap_external>")
_RETRY_S = 0.05


def _importing(frame) -> bool:
    while frame is not None:
        if frame.f_code.co_filename in _IMPORT_MACHINERY:
            return True
        frame = frame.f_back
    return False


class InterruptsAfterImports:
    """Within the block, SIGINT raises KeyboardInterrupt as Python's own handler does, except
    during an import: then a thread signals the main thread again every 50 ms until the
    import is over. Only Python's default handler is replaced (a command's own, a SIG_IGN,
    stay as they are), and only in the main thread; the default comes back at the block's end."""

    def __init__(self) -> None:
        self.pending = threading.Event()
        self.installed = False

    def __enter__(self) -> InterruptsAfterImports:
        on_main_thread = threading.current_thread() is threading.main_thread()
        if on_main_thread and signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            signal.signal(signal.SIGINT, self._handle)
            self.installed = True
        return self

    def __exit__(self, *exc) -> None:
        self.pending.clear()
        if self.installed and signal.getsignal(signal.SIGINT) == self._handle:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        self.installed = False

    def _handle(self, signum, frame) -> None:
        if _importing(frame):
            if not self.pending.is_set():
                self.pending.set()
                threading.Thread(target=self._ask_again, name="interrupt-after-import", daemon=True).start()
            return
        self.pending.clear()
        raise KeyboardInterrupt

    def _ask_again(self) -> None:
        while self.pending.is_set():
            time.sleep(_RETRY_S)
            if self.pending.is_set():
                # a real signal to the main thread (interrupt_main would wait out a blocking call)
                main = threading.main_thread().ident
                assert main is not None  # (it is running)
                signal.pthread_kill(main, signal.SIGINT)
