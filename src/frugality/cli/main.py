"""Entry point: `frugality <command>`; bad input becomes one `error:` line and exit 2."""

from __future__ import annotations

import errno
import shutil
import sys
import warnings
from pathlib import Path

import click

from frugality import __version__
from frugality.cli.bench import bench
from frugality.cli.ckpt import ckpt
from frugality.cli.compile import compile_
from frugality.cli.cost import cost
from frugality.cli.data import data
from frugality.cli.devices import ls, top
from frugality.cli.doctor import doctor
from frugality.cli.embed import embed
from frugality.cli.generate import generate
from frugality.cli.interop import export, import_
from frugality.cli.launch import launch
from frugality.cli.plan import plan
from frugality.cli.recipes import recipes
from frugality.cli.report import compare, report
from frugality.cli.train import train
from frugality.errors import DIVERGED_EXIT, FrugalityWarning, RunDiverged, UserError

USER_ERROR_EXIT = 2


@click.group(context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100})
@click.version_option(__version__, prog_name="frugality")
def cli() -> None:
    """Train and run transformer models at the lowest cost, time and energy on
    whatever accelerator is at hand."""


cli.add_command(train)
cli.add_command(compile_)
cli.add_command(data)
cli.add_command(recipes)
cli.add_command(bench)
cli.add_command(import_)
cli.add_command(export)
cli.add_command(launch)
cli.add_command(plan)
cli.add_command(doctor)
cli.add_command(ckpt)
cli.add_command(report)
cli.add_command(compare)
cli.add_command(cost)
cli.add_command(embed)
cli.add_command(generate)
cli.add_command(ls)
cli.add_command(top)


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
