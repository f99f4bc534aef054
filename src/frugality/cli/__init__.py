"""The `frugality` command line. Heavy modules (torch) load inside each command, so
`frugality --help` answers at once."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    """The console script: the commands (`frugality.cli.main`), with a Ctrl-C that comes
    while they are still being imported ending as one mid-command does (exit 130, no
    traceback), once the import is over (`interrupts`)."""
    from frugality.cli.interrupts import InterruptsAfterImports

    try:
        with InterruptsAfterImports():
            from frugality.cli.main import main as run

            status = run(argv)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        status = 130
    except BaseException as e:  # a rank that ends by sys.exit or an error: it still leaves by exit_process
        if not _joined():
            raise
        if isinstance(e, SystemExit):
            status = e.code if isinstance(e.code, int) else int(e.code is not None)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        else:
            import traceback

            traceback.print_exc()
            status = 1
    if _joined():  # a rank under torchrun: see exit_process
        sys.modules["frugality.distributed"].exit_process(status)
    return status


def _joined() -> bool:
    """Whether this process joined a process group (frugality.distributed not even imported: no)."""
    distributed = sys.modules.get("frugality.distributed")
    return distributed is not None and distributed.joined()
