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

import contextlib
import json
import os
import select
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
    *("PT_XLA", "TPU_", "NEURON"),  # (torch_xla's, read when it is imported)
)
IMPORT_TIME_NAMES = (
    "FRUGALITY_NO_C_KERNEL",
    "PJRT_DEVICE",
    "XLA_FLAGS",
    "NVIDIA_VISIBLE_DEVICES",
    "TMPDIR",
    "TMP",
    "TEMP",
    "FRUGALITY_README_HIDDEN",  # (what the README test's sitecustomize hides, read at start-up)
    # torch_xla's, read when it is imported (the XLA environment's server imports it)
    "XLA_REGISTER_INSTALLED_PLUGINS",
    "XLA_USE_EAGER_DEBUG_MODE",
    "PJRT_SELECT_DEFAULT_DEVICE",
)


def import_time(env: dict) -> dict:
    """The part of `env` that torch, its libraries or the interpreter read when they load
    (torchrun's TORCHELASTIC_* variables are read later, by the rank)."""
    return {
        name: value
        for name, value in env.items()
        if (name.startswith(IMPORT_TIME) and not name.startswith("TORCHELASTIC_")) or name in IMPORT_TIME_NAMES
    }


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
set_by_imports = {}  # what the imports put in the environment, for each command to find there
if os.environ.get("PJRT_DEVICE"):  # started for XLA (.venv-xla): torch_xla too, ~3 s a process
    before = dict(os.environ)
    try:
        os.environ.setdefault("XLA_NO_SPECIAL_SCALARS", "1")  # (as frugality.xla.load sets it first)
        import torch_xla, torch_xla.debug.metrics, torch_xla.runtime  # (no client opened: no threads)
        set_by_imports = {n: v for n, v in os.environ.items() if before.get(n) != v}
    except ImportError:  # (not installed here: the environment as it was)
        os.environ.clear()
        os.environ.update(before)

listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(sys.argv[1])
listener.listen(1)
print("ready", flush=True)


def answer(conn, message):
    try:
        conn.sendall((json.dumps(message) + "\n").encode())
    except OSError:  # the client gave up (a time-out): it stops the command itself
        pass


def waited(conn, pid):
    with conn:
        _, status = os.waitpid(pid, 0)
        answer(conn, {"status": os.waitstatus_to_exitcode(status)})


while True:
    # the test process holds our stdin: its end (however it ends) ends this server
    ready, _, _ = select.select([listener, sys.stdin], [], [])
    if sys.stdin in ready:
        break
    conn, _ = listener.accept()
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
            for name, value in set_by_imports.items():  # (its C++ side reads them when the client opens)
                if name == "XLA_FLAGS":
                    torch_xla._setup_xla_flags()  # its flags added to the command's own
                else:
                    os.environ.setdefault(name, value)
            random.seed()  # (not the server's sequence in every command)
            signal.signal(signal.SIGINT, signal.default_int_handler)
            if request.get("script"):  # python SCRIPT ARGS
                import runpy
                sys.argv = [request["script"], *request["args"]]
                runpy.run_path(request["script"], run_name="__main__")
                status = 0
            else:
                sys.argv = ["frugality", *request["args"]]
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
    # several commands at once (the ranks of a run): a thread waits for each
    threading.Thread(target=waited, args=(conn, pid), daemon=True).start()
"""


class ForkedCLI:
    def __init__(self, env: dict | None = None) -> None:
        self.folder = Path(tempfile.mkdtemp(prefix="forked-cli-"))
        self.address = str(self.folder / "socket")
        self.env = dict(os.environ if env is None else env)  # what the server loads with
        self.imports_said = self.folder / "imports.stderr"
        with open(self.imports_said, "w") as said:
            self.server = subprocess.Popen(
                [sys.executable, "-c", _SERVER, self.address, ",".join(PRELOAD)],
                stdout=subprocess.PIPE,
                stderr=said,
                stdin=subprocess.PIPE,  # closed when this process ends, however: the server then ends
                text=True,
                env=self.env,
                start_new_session=True,
            )
        if self.server.stdout.readline().strip() != "ready":  # (a socket path too long, ...): fresh processes
            self.server.wait()
        self.said_at_import = self.imports_said.read_text()  # (what the server prints later is its own)
        self.running: set[int] = set()  # the process groups of the commands running

    def forkable(self, env: dict) -> bool:
        """Whether `env` leaves what torch read at import as the server read it."""
        return import_time(env) == import_time(self.env)

    def __call__(
        self,
        *args,
        cwd=None,
        env: dict | None = None,
        timeout: float = 300,
        input: str | None = None,
        fresh: bool = False,
        script=None,
    ) -> subprocess.CompletedProcess:
        """`frugality ARGS` (each str()'d), or `python SCRIPT ARGS`, in `cwd` with `env`
        (default: this process's), as `subprocess.run(..., capture_output=True, text=True)`
        returns it."""
        args = [str(a) for a in args]
        env = dict(os.environ if env is None else env)
        if fresh or not self.forkable(env) or self.server.poll() is not None:
            return subprocess.run(
                [sys.executable, *([str(script)] if script else ["-m", "frugality"]), *args],
                cwd=cwd,
                env=env,
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
            )
        command = self.start(args, cwd, env, input, time.monotonic() + timeout, script)
        with command:
            return command.wait(timeout)

    def start(self, args: list[str], cwd, env: dict, input: str | None, deadline: float, script=None) -> _Command:
        """A command forked and started: its pid known, its end not awaited."""
        command = _Command(self, args, input)
        request = {
            "args": args,
            "script": str(Path(script).absolute()) if script else None,
            "cwd": str(Path(cwd or os.getcwd()).absolute()),
            "env": env,
            **{name: str(path) for name, path in command.files.items()},
        }
        command.conn.settimeout(max(0.1, deadline - time.monotonic()))
        command.conn.connect(self.address)
        command.conn.sendall((json.dumps(request) + "\n").encode())
        command.replies = _Replies(command.conn, deadline)
        try:
            command.pid = command.replies.next()["pid"]
        except BaseException:
            command.close()
            raise
        self.running.add(command.pid)
        return command

    def close(self) -> None:
        for pid in list(self.running):
            _stop_group(pid)
        if self.server.poll() is None:
            try:
                self.server.stdin.close()  # (the server ends at its stdin's end)
                self.server.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                _stop_group(self.server.pid)
                self.server.wait()
        import shutil

        shutil.rmtree(self.folder, ignore_errors=True)


class _Command:
    """One forked command: its standard streams in files, its status read from the server."""

    def __init__(self, server: ForkedCLI, args: list[str], input: str | None) -> None:
        self.server, self.args = server, args
        self.scratch = tempfile.mkdtemp(dir=server.folder)
        self.files = {name: Path(self.scratch) / name for name in ("stdin", "stdout", "stderr")}
        self.files["stdin"].write_text(input or "")
        self.files["stdout"].touch()
        self.files["stderr"].write_text(server.said_at_import)  # (what a fresh start prints first)
        self.conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.pid: int | None = None
        self.replies: _Replies | None = None
        self.status: int | None = None

    def __enter__(self) -> _Command:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def poll(self, until: float) -> int | None:
        """Its exit status once it ended, waiting until `until` (monotonic) at most."""
        if self.status is None:
            self.replies.deadline = until
            try:
                self.status = self.replies.next()["status"]
            except TimeoutError:
                return None
            self.server.running.discard(self.pid)
        return self.status

    def wait(self, timeout: float) -> subprocess.CompletedProcess:
        """Its end (stopped past `timeout`, or on an interrupt), as subprocess.run returns it."""
        try:
            if self.poll(time.monotonic() + timeout) is None:
                raise subprocess.TimeoutExpired(["frugality", *self.args], timeout)
        except BaseException:  # a time-out (ours or pytest's), an interrupt: the command stops too
            self.stop()
            raise
        return self.result()

    def result(self) -> subprocess.CompletedProcess:
        read = lambda name: self.files[name].read_text(errors="replace")
        return subprocess.CompletedProcess(["frugality", *self.args], self.status, read("stdout"), read("stderr"))

    def stop(self, how: int = signal.SIGKILL) -> None:
        if self.pid is not None and self.status is None:
            _stop_group(self.pid, how)

    def close(self) -> None:
        self.stop()
        self.server.running.discard(self.pid)
        self.conn.close()
        import shutil

        shutil.rmtree(self.scratch, ignore_errors=True)


class _Replies:
    """The server's JSON lines on `conn`, each awaited until `deadline` (TimeoutError past it)."""

    def __init__(self, conn: socket.socket, deadline: float) -> None:
        self.conn, self.deadline, self.buffer = conn, deadline, b""

    def next(self) -> dict:
        while b"\n" not in self.buffer:
            # (past the deadline: one look without waiting, which a poll needs)
            self.conn.settimeout(max(0.0, self.deadline - time.monotonic()))
            try:
                chunk = self.conn.recv(4096)
            except (TimeoutError, BlockingIOError):
                raise TimeoutError from None
            if not chunk:
                raise ConnectionError("the forked CLI's server ended")
            self.buffer += chunk
        line, _, self.buffer = self.buffer.partition(b"\n")
        return json.loads(line)


def _stop_group(pid: int, how: int = signal.SIGKILL) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, how)


_servers: dict[frozenset, ForkedCLI] = {}  # (in the order of their last use)
_asked: dict[frozenset, int] = {}
MAX_SERVERS = 4  # (past them the one used least lately, if idle, is closed)


def _server(env: dict, fresh_processes: int = 1) -> ForkedCLI:
    """This test process's server for `env`'s import-time variables: started at the second
    command that asks for it (a one-off environment costs a fresh process either way, and
    would push out a server in use), or at the first whose fresh start would cost several
    processes (torchrun's agent and its ranks: `fresh_processes`); closed when the process
    ends or when MAX_SERVERS others were used after it. Else the first server, which starts
    a fresh process for `env`."""
    key = frozenset(import_time(env).items())
    _asked[key] = _asked.get(key, 0) + 1
    default = not _servers
    if key not in _servers and (default or _asked[key] >= 2 or fresh_processes >= 2):
        idle = [k for k, server in _servers.items() if not server.running]
        if len(_servers) >= MAX_SERVERS and idle:
            _servers.pop(idle[0]).close()
        loads_with = {n: v for n, v in os.environ.items() if n not in import_time(os.environ)} | import_time(env)
        _servers[key] = ForkedCLI(loads_with)
        if default:
            import atexit

            atexit.register(lambda: [server.close() for server in _servers.values()])
    if key not in _servers:
        return next(iter(_servers.values()))
    _servers[key] = _servers.pop(key)  # (the last used, last)
    return _servers[key]


def run(*args, env: dict | None = None, **kw) -> subprocess.CompletedProcess:
    """`frugality ARGS` forked from a server that imported with `env`'s import-time variables
    (default: this process's environment): what the `frugality_cli` fixture and the test
    modules' own helpers call."""
    return _server(os.environ if env is None else env)(*args, env=env, **kw)


_TORCHRUN = (
    "import sys; from torch.distributed.run import get_args_parser, run; n = int(sys.argv[1]); "
    "config = get_args_parser().parse_args(sys.argv[2 : 2 + n]); config.training_script_args = sys.argv[2 + n :]; "
    "run(config)"
)


def ranks(
    nproc: int, *args, cwd=None, env: dict | None = None, timeout: float = 600, script=None
) -> subprocess.CompletedProcess:
    """`torchrun --standalone --nproc_per_node=NPROC -m frugality ARGS` (or `SCRIPT ARGS`), its
    ranks forked from a server: each rank gets the variables torchrun's agent sets (ranks,
    world sizes, the address of the store this process hosts as the agent does,
    OMP_NUM_THREADS=1 unless set; not TORCHELASTIC_ERROR_FILE, and not
    TORCH_NCCL_ASYNC_ERROR_HANDLING, which gloo does not read) and the others are stopped
    when one fails (SIGTERM, then SIGKILL after 5 s, not torchrun's 30). Their outputs come one after the
    other in rank order (torchrun's ranks write to its streams as they go); the exit status
    is 0, or 1 as torchrun's after a failed rank, with a line per failed rank in stderr.
    What torchrun itself does (its agent, its messages, a rank killed by a signal) is tested
    through torchrun: `frugality train --nproc`, tests/distributed/test_process_exit.py."""
    args = [str(a) for a in args]
    env = {**(os.environ if env is None else env)}
    env.setdefault("OMP_NUM_THREADS", "1")  # (torchrun's default for several ranks a node)
    server = _server(env, fresh_processes=nproc + 1)  # (torchrun's agent and its ranks)
    if not server.forkable(env) or server.server.poll() is not None:
        # torchrun's own launcher, the command's arguments given to it apart, as
        # `distributed.launch_local` gives them: through torchrun's parser, one such as
        # `--nproc` would read as an abbreviation of its own options
        launcher = ["--standalone", f"--nproc_per_node={nproc}", *([str(script)] if script else ["-m", "frugality"])]
        return subprocess.run(
            [sys.executable, "-c", _TORCHRUN, str(len(launcher)), *launcher, *args],
            cwd=cwd,
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    import uuid

    import torch.distributed as dist

    # the store torchrun's agent hosts (standalone: TORCHELASTIC_USE_AGENT_STORE), on a port it
    # chose itself; the ranks' process group is its client, under the attempt's prefix
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = store.port
    launcher = {
        **{"GROUP_RANK": "0", "ROLE_NAME": "default", "GROUP_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1"},
        **{"LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "ROLE_WORLD_SIZE": str(nproc)},
        **{"MASTER_PORT": str(port), "TORCHELASTIC_RUN_ID": uuid.uuid4().hex},
        **{
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0",
            "TORCHELASTIC_USE_AGENT_STORE": "True",
        },
    }
    deadline = time.monotonic() + timeout
    commands: list[_Command] = []
    try:
        for rank in range(nproc):
            rank_env = env | launcher | {"RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)}
            commands.append(server.start(args, cwd, rank_env, None, deadline, script))
        while any(c.status is None for c in commands):
            if time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(["torchrun", *args], timeout)
            running = [c for c in commands if c.status is None]
            readable, _, _ = select.select([c.conn for c in running], [], [], 0.2)
            for c in running:
                c.poll(time.monotonic() + (0.2 if c.conn in readable else 0))
            if any(c.status not in (None, 0) for c in commands):
                # torchrun's agent sees it at its next look (--monitor-interval, 0.1 s), then
                # stops the others (they would wait in collectives): SIGTERM, and SIGKILL after
                # a grace (torchrun's --shutdown-timeout is 30 s; 5 s here)
                time.sleep(0.1)
                for c in commands:
                    c.stop(signal.SIGTERM)
                for c in commands:
                    if c.poll(time.monotonic() + 5) is None:
                        c.stop()
                        c.poll(time.monotonic() + 10)
                break
        results = [c.result() for c in commands]
    finally:
        for c in commands:
            c.close()
        del store
    failed = [(rank, r.returncode) for rank, r in enumerate(results) if r.returncode not in (None, 0)]
    said = "".join(f"rank {rank} of {nproc} failed with exit status {status}\n" for rank, status in failed)
    return subprocess.CompletedProcess(
        ["torchrun", *args],
        1 if failed or any(r.returncode is None for r in results) else 0,
        "".join(r.stdout for r in results),
        "".join(r.stderr for r in results) + said,
    )


class Popen:
    """`frugality ARGS` left running, forked (a fresh process where `env` needs one), as tests
    use subprocess.Popen: `pid`, `poll()`, `wait(timeout)`, `send_signal(sig)`, `returncode`;
    its output in the files `stdout_path` and `stderr_path`."""

    def __init__(self, *args, cwd=None, env: dict | None = None) -> None:
        args = [str(a) for a in args]
        env = dict(os.environ if env is None else env)
        server = _server(env)
        self.command: _Command | None = None
        self.process: subprocess.Popen | None = None
        if server.forkable(env) and server.server.poll() is None:
            self.command = server.start(args, cwd, env, None, time.monotonic() + 60)
            self.pid = self.command.pid
            self.stdout_path, self.stderr_path = self.command.files["stdout"], self.command.files["stderr"]
        else:
            self.folder = Path(tempfile.mkdtemp(prefix="frugality-popen-"))
            self.stdout_path, self.stderr_path = self.folder / "stdout", self.folder / "stderr"
            with open(self.stdout_path, "w") as out, open(self.stderr_path, "w") as err:
                self.process = subprocess.Popen(
                    [sys.executable, "-m", "frugality", *args], cwd=cwd, env=env, stdout=out, stderr=err
                )
            self.pid = self.process.pid

    @property
    def returncode(self) -> int | None:
        return self.process.returncode if self.process else self.command.status

    def poll(self) -> int | None:
        return self.process.poll() if self.process else self.command.poll(time.monotonic())

    def wait(self, timeout: float | None = None) -> int:
        if self.process:
            return self.process.wait(timeout)
        status = self.command.poll(time.monotonic() + (1e9 if timeout is None else timeout))
        if status is None:
            raise subprocess.TimeoutExpired(["frugality", *self.command.args], timeout)
        return status

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def close(self) -> None:
        """Its files removed, and the process killed if it still runs."""
        if self.poll() is None:
            self.kill()
            self.wait(60)
        if self.command:
            self.command.close()
        else:
            import shutil

            shutil.rmtree(self.folder, ignore_errors=True)
