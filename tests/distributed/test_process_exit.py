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
