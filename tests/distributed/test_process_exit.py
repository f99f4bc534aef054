"""A rank that joined a process group ends with its command's status once the command
returned, its exit handlers run and its output flushed, without the interpreter teardown in
which gloo's lingering threads can abort it (distributed.exit_process)."""

from __future__ import annotations

import subprocess
import sys

RANK = """
import atexit, sys
from frugality import distributed
atexit.register(lambda: print("exit handlers ran"))
print("unflushed output", end="")
distributed._JOINED.append(True)  # as init does when torchrun's world has several ranks
distributed.exit_process(3)
print("not reached")
"""


def test_a_rank_exits_with_its_status_after_its_exit_handlers_and_output():
    done = subprocess.run([sys.executable, "-c", RANK], capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stderr[-2000:]
    assert done.stdout == "unflushed outputexit handlers ran\n"


def test_one_process_that_joined_no_group_returns_as_before():
    done = subprocess.run(
        [sys.executable, "-c", "from frugality import distributed; distributed.exit_process(3); print('returned')"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert (done.returncode, done.stdout) == (0, "returned\n"), done.stderr[-2000:]


WRAPPED = """
import atexit, sys
from frugality.cli import main  # the console script's function (before the submodule of that name)
import frugality.cli.main
from frugality import distributed

def command(argv=None):
    print("ran", flush=True)
    if sys.argv[1] == "exit":
        sys.exit(7)  # as a rank other than 0 ends `train`
    raise RuntimeError("a collective timed out")

frugality.cli.main.main = command
atexit.register(lambda: print("exit handlers ran"))
distributed._JOINED.append(True)
main()
"""


def test_a_rank_ending_by_sys_exit_or_an_error_leaves_through_exit_process():
    done = subprocess.run([sys.executable, "-c", WRAPPED, "exit"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (7, "ran\nexit handlers ran\n"), done.stderr[-2000:]
    done = subprocess.run([sys.executable, "-c", WRAPPED, "error"], capture_output=True, text=True, timeout=120)
    assert (done.returncode, done.stdout) == (1, "ran\nexit handlers ran\n")
    assert done.stderr.rstrip().endswith("RuntimeError: a collective timed out")  # the traceback, printed
