"""Entry point: `frugality <command>`; bad input becomes one `error:` line and exit 2."""

from __future__ import annotations

import errno
import shutil
import sys
import warnings
from pathlib import Path

import click

from frugality import __version__
from frugality.errors import DIVERGED_EXIT, FrugalityWarning, RunDiverged, UserError

USER_ERROR_EXIT = 2


# command -> "module:object": a command's module (and what it imports: torch, for most) is
# loaded only when that command runs, so that `frugality data prepare` or `cost` start fast
COMMANDS = {
    "train": "train:train",
    "compile": "compile:compile_",
    "data": "data:data",
    "recipes": "recipes:recipes",
    "bench": "bench:bench",
    "import": "interop:import_",
    "export": "interop:export",
    "launch": "launch:launch",
    "plan": "plan:plan",
    "doctor": "doctor:doctor",
    "ckpt": "ckpt:ckpt",
    "report": "report:report",
    "compare": "report:compare",
    "cost": "cost:cost",
    "embed": "embed:embed",
    "generate": "generate:generate",
    "serve": "serve:serve",
    "ls": "devices:ls",
    "top": "devices:top",
}


class _Commands(click.Group):
    def list_commands(self, ctx) -> list[str]:
        return sorted(COMMANDS)  # (as click lists a group's commands; --help loads them all)

    def get_command(self, ctx, name: str):
        if name not in COMMANDS:
            return None
        import importlib

        module, _, attribute = COMMANDS[name].partition(":")
        return getattr(importlib.import_module(f"frugality.cli.{module}"), attribute)


@click.group(cls=_Commands, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="frugality")
def cli() -> None:
    """Train and run transformer models at the lowest cost, time and energy on
    whatever accelerator is at hand."""


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """frugality's own warnings as one `warning: ...` line; others as Python prints them."""
    if issubclass(category, FrugalityWarning):
        from tqdm import tqdm

        tqdm.write(f"warning: {message}", file=sys.stderr)
    else:
        _default_show_warning(message, category, filename, lineno, file, line)


_default_show_warning = warnings.showwarning


# A full disk, a read-only or over-quota filesystem, a permission: the user's to fix, not a bug.
FILESYSTEM_FAULTS = {errno.ENOSPC, errno.EROFS, errno.EACCES, errno.EDQUOT, errno.EPERM}


def filesystem_fault(error: OSError) -> str:
    """One line: the path, the cause, and (when space is the cause) the free space there."""
    path = Path(error.filename) if error.filename else None
    writing = error.errno in (errno.ENOSPC, errno.EDQUOT, errno.EROFS)
    line = f"cannot {'write' if writing else 'access'} {path or 'a file'}: {error.strerror or error}"
    if path is not None and error.errno in (errno.ENOSPC, errno.EDQUOT):
        try:  # the nearest folder that exists; a folder we may not search ends the search
            folder = next((p for p in (path, *path.parents) if p.is_dir()), None)
            if folder is not None:
                line += f" ({shutil.disk_usage(folder).free / 2**30:.1f} GiB free on the device holding {folder})"
        except OSError:
            pass
    return line


def main(argv: list[str] | None = None) -> int:
    warnings.showwarning = _show_warning
    try:
        # without standalone mode click returns (not raises) a command's Exit status
        argv = sys.argv[1:] if argv is None else list(argv)
        # the command as given: `train --nproc` and `--retries` run it again in other processes
        status = cli.main(args=argv, prog_name="frugality", standalone_mode=False, obj={"argv": argv})
    except UserError as e:
        for line in str(e).splitlines():  # several problems (a recipe's): a line each
            click.echo(f"error: {line}", err=True)
        return USER_ERROR_EXIT
    except RunDiverged as e:
        click.echo(f"error: {e}", err=True)
        return DIVERGED_EXIT
    except OSError as e:
        if e.errno not in FILESYSTEM_FAULTS:
            raise
        click.echo(f"error: {filesystem_fault(e)}", err=True)
        return USER_ERROR_EXIT
    except (click.exceptions.Abort, KeyboardInterrupt):
        click.echo("interrupted", err=True)
        return 130
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.exceptions.Exit as e:
        return e.exit_code
    return status if isinstance(status, int) else 0


if __name__ == "__main__":
    sys.exit(main())
