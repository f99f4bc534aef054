"""`frugality ARGS` run as a user runs it (its own process, its own stdout, stderr and exit
status, a working folder and an environment), without paying again for Python, torch and
frugality's imports: a server process imports them once, then forks a child per command,
as multiprocessing's forkserver does. The child points its standard streams at files, moves
to the folder, takes the environment, and calls the console script's `frugality.cli.main`.

A real `python -m frugality` is used instead where forking could differ from a fresh start:
an environment that changes what torch or its libraries read when they load (OpenMP's,
OpenBLAS's and oneDNN's variables, `LD_*`, `PYTHON*`, `TORCH*`, the temporary folder...),
`fresh=True` (a test of start-up itself), or a server that could not start. The server
imports but never computes: no OpenMP pool exists when it forks (numpy's OpenBLAS starts
its threads at import, and re-creates them in a forked child, as it is built to). What the
imports printed to stderr (a warning a user would see) is put before each command's own."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

# Variables read when torch and its libraries load (or by the interpreter): a command whose
# environment changes one of them runs in a fresh process.
IMPORT_TIME = (
    *("OMP_", "KMP_", "MKL_", "OPENBLAS_", "GOTO", "ONEDNN_", "DNNL_", "ATEN_", "TORCH", "PYTORCH", "CUDA"),
    *("LD_", "PYTHON"),
)
IMPORT_TIME_NAMES = (
    "FRUGALITY_NO_C_KERNEL",
    "PJRT_DEVICE",
    "XLA_FLAGS",
    "NVIDIA_VISIBLE_DEVICES",
    "TMPDIR",
    "TMP",
    "TEMP",
)

# The modules a command imports (its own and torch's heavy ones), loaded once by the server.
PRELOAD = (
    "torch",
    "frugality.cli.main",
    "frugality.cli.train",
    "frugality.training.trainer",
    "frugality.inference.embed",
    "frugality.inference.encoder",
    "frugality.inference.generate",
    "frugality.interop.export",
    "frugality.data.prepare",
)

_SERVER = r"""
import atexit, importlib, json, os, random, select, signal, socket, sys, threading, traceback
from frugality.cli import main  # the console script's (before frugality.cli.main, the module, shadows it)
for name in sys.argv[2].split(","):
    importlib.import_module(name)

listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)


def answer(conn, message):
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the client gave up (a time-out): it stops the command itself
        pass


while True:
    # the test process holds our stdin: its end (however it ends) ends this server
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if sys.stdin in ready:
        break
    conn, _ = listener.accept()
    with conn:
        request = json.loads(conn.makefile("rb").readline())
        pid = os.fork()
        if pid == 0:  # the command
            status = 1
            try:
                listener.close()
                os.setsid()  # its own process group: a time-out stops it and what it started
                for fd, path, mode in ((0, request["stdin"], os.O_RDONLY), (1, request["stdout"], os.O_WRONLY),
                                       (2, request["stderr"], os.O_WRONLY | os.O_APPEND)):
                    opened = os.open(path, mode)
                    os.dup2(opened, fd)
                    os.close(opened)
                os.chdir(request["cwd"])
                os.environ.clear()
                os.environ.update(request["env"])
                sys.argv = ["frugality", *request["args"]]
                random.seed()  # (not the server's sequence in every command)
                signal.signal(signal.SIGINT, signal.default_int_handler)
                status = main(request["args"])
            except SystemExit as e:  # as the interpreter ends on it
                if isinstance(e.code, str):
                    print(e.code, file=sys.stderr)
                status = e.code if isinstance(e.code, int) else int(e.code is not None)
            except BaseException:
                traceback.print_exc()
            finally:
                try:  # what a process's end does: its threads joined, then the exit functions
                    threading._shutdown()
                    atexit._run_exitfuncs()
                    sys.stdout.flush()
                    sys.stderr.flush()
                finally:
                    os._exit(status if isinstance(status, int) else 1)
        answer(conn, {"pid": pid})
        _, waited = os.waitpid(pid, 0)
        answer(conn, {"status": os.waitstatus_to_exitcode(waited)})
"""


class ForkedCLI:
    def __init__(self) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="forked-cli-"))
        self.address = str(self.folder / "socket")
        self.env = dict(os.environ)  # what the server loaded with
        self.imports_said = self.folder / "imports.stderr"
        with open(self.imports_said, "w") as said:
            self.server = subprocess.Popen(
                [sys.executable, "-c", _SERVER, self.address, ",".join(PRELOAD)],
                stdout=subprocess.PIPE,
                stderr=said,
                stdin=subprocess.PIPE,  # closed when this process ends, however: the server then ends
                text=True,
                start_new_session=True,
            )
        if self.server.stdout.readline().strip() != "ready":  # (a socket path too long, ...): fresh processes
            self.server.wait()
        self.said_at_import = self.imports_said.read_text()  # (what the server prints later is its own)
        self.running: int | None = None  # the command's process group while one runs

    def forkable(self, env: dict) -> bool:
        """Whether `env` leaves what torch read at import as the server read it."""
        names = set(env) | set(self.env)
        return not any(
            env.get(n) != self.env.get(n) for n in names if n.startswith(IMPORT_TIME) or n in IMPORT_TIME_NAMES
        )

    def __call__(
        self,
        *args,
        cwd=None,
        env: dict | None = None,
        timeout: float = 300,
        input: str | None = None,
        fresh: bool = False,
    ) -> subprocess.CompletedProcess:
        """`frugality ARGS` (each str()'d) in `cwd` with `env` (default: this process's), as
        `subprocess.run(..., capture_output=True, text=True)` returns it."""
        args = [str(a) for a in args]
        env = dict(os.environ if env is None else env)
        if fresh or not self.forkable(env) or self.server.poll() is not None:
            return subprocess.run(
                [sys.executable, "-m", "frugality", *args],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
            )
        with tempfile.TemporaryDirectory(dir=self.folder) as scratch:
            files = {name: Path(scratch) / name for name in ("stdin", "stdout", "stderr")}
            files["stdin"].write_text(input or "")
            files["stdout"].touch()
            files["stderr"].write_text(self.said_at_import)  # (what a fresh start prints first)
            request = {
                "args": args,
                "cwd": str(Path(cwd or os.getcwd()).absolute()),
                "env": env,
                **{name: str(path) for name, path in files.items()},
            }
            deadline = time.monotonic() + timeout
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
                conn.settimeout(timeout)
                conn.connect(self.address)
                conn.sendall((json.dumps(request) + "\n").encode())
                replies = _Replies(conn, deadline)
                try:
                    self.running = replies.next()["pid"]
                    status = replies.next()["status"]
                except BaseException as e:  # a time-out (ours or pytest's), an interrupt: the command stops too
                    if self.running is not None:
                        _stop_group(self.running)
                    if isinstance(e, TimeoutError):
                        raise subprocess.TimeoutExpired(["frugality", *args], timeout) from None
                    raise
                finally:
                    self.running = None
            read = lambda name: files[name].read_text(errors="replace")
            return subprocess.CompletedProcess(["frugality", *args], status, read("stdout"), read("stderr"))

    def close(self) -> None:
        if self.running is not None:
            _stop_group(self.running)
        if self.server.poll() is None:
            try:
                self.server.stdin.close()  # (the server ends at its stdin's end)
                self.server.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                _stop_group(self.server.pid)
                self.server.wait()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


class _Replies:
    """The server's JSON lines on `conn`, each awaited until `deadline` (TimeoutError past it)."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn, self.deadline, self.buffer = conn, deadline, b""

    def next(self) -> dict:
        while b"\n" not in self.buffer:
            left = self.deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            self.conn.settimeout(left)
            try:
                chunk = self.conn.recv(4096)
            except socket.timeout:
                raise TimeoutError from None
            if not chunk:
                raise ConnectionError("the forked CLI's server ended")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


def _stop_group(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_shared: list[ForkedCLI] = []


def run(*args, **kw) -> subprocess.CompletedProcess:
    """`frugality ARGS` on this test process's one server (started at its first use, closed
    when the process ends): what the `frugality_cli` fixture and the test modules' own
    helpers call."""
    if not _shared:
        import atexit

        _shared.append(ForkedCLI())
        atexit.register(_shared[0].close)
    return _shared[0](*args, **kw)
