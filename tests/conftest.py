"""Shared fixtures: a per-session cache (bundled corpus tokenized once) and a micro recipe
small enough that a training step takes milliseconds on a CPU."""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import subprocess
from pathlib import Path

import pytest
import torch


def pytest_configure(config):
    if getattr(config.option, "numprocesses", None) and not hasattr(config, "workerinput"):
        import tempfile  # an xdist controller: its workers, started after this, inherit the folder

        os.environ[FOLDER_VARIABLE] = tempfile.mkdtemp(prefix="xla-tests-")


TIERS = ("slow", "distributed", "readme", "cuda", "xla")  # pyproject's markers; `fast` is none of them


def _mark_tiers(items) -> None:
    """Marks a test's folder or name implies (tests/distributed: distributed; the README and
    XLA tests), then `fast` on every test with none of TIERS."""
    for item in items:
        path = Path(str(item.fspath)).relative_to(ROOT)  # (a clone under a folder named xla marks nothing)
        if "distributed" in path.parts:
            item.add_marker(pytest.mark.distributed)
        if item.name == README_TEST:
            item.add_marker(pytest.mark.readme)
        if item.name == XLA_BRIDGE or "xla" in path.parts:
            item.add_marker(pytest.mark.xla)
        if not any(item.get_closest_marker(tier) for tier in TIERS):
            item.add_marker(pytest.mark.fast)


def pytest_collection_modifyitems(config, items):
    _mark_tiers(items)
    # In one process the XLA bridge comes last: the XLA run, in the background, has had the
    # idle moments of every test before it. Under xdist the run goes at the suite's priority
    # and the bridge first: its worker waits for the run, as for a long test, while the
    # others go on. And the longest test early, so that no worker ends long after the rest.
    # The Ray cluster's tests together at the end: its idle processes (a GCS, two raylets, their
    # agents) take ~4% of a core for as long as the session holds it.
    bridge = -2 if hasattr(config, "workerinput") else 1

    def order(item) -> float:
        first_or_last = {README_TEST: -1, XLA_BRIDGE: bridge}.get(item.name)
        if first_or_last is not None:
            return first_or_last
        return 0.5 if "ray_cluster" in getattr(item, "fixturenames", ()) else 0

    items.sort(key=order)  # (stable)
    if os.environ.get("FRUGALITY_NO_C_KERNEL"):  # the kernels off by request: nothing to test of them
        off = pytest.mark.skip(reason="FRUGALITY_NO_C_KERNEL=1: the C kernels are off")
        for item in items:
            if item.get_closest_marker("c_kernel") is not None:
                item.add_marker(off)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if item.get_closest_marker("cuda") is not None:
            item.add_marker(skip)


ROOT = Path(__file__).resolve().parents[1]
XLA_PYTHON = ROOT / ".venv-xla" / "bin" / "python"
XLA_BRIDGE = "test_the_xla_tests_pass_in_their_environment"
README_TEST = "test_every_readme_command_runs_as_written_in_order"
FOLDER_VARIABLE = "FRUGALITY_XLA_TESTS_FOLDER"  # set by an xdist controller for its workers
_xla_tests: dict = {}


class XlaTests:
    """tests/xla in .venv-xla (tests/test_xla_environment.py checks the result), run once a
    session and started with it: in one process at a low priority, taking the cores the main
    suite leaves idle between its processes instead of minutes of their own at the end; under
    xdist, where few are idle, at the suite's priority. The run writes
    its output and then its exit status into `folder`, so that under pytest-xdist the
    controller, which outlives every worker, owns it, and the bridge test reads it from
    whichever worker it runs in."""

    def __init__(self, folder: Path, process: subprocess.Popen | None = None):
        self.folder, self.process = folder, process
        self.log, self.status = folder / "log", folder / "status"

    @classmethod
    def start(cls, folder: Path, background: bool = True) -> XlaTests:
        folder.mkdir(parents=True, exist_ok=True)
        script = '"$@" > "$0/log" 2>&1; echo $? > "$0/status.partial" && mv "$0/status.partial" "$0/status"'
        command = [str(XLA_PYTHON), "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/xla"]
        process = subprocess.Popen(
            ["bash", "-c", script, str(folder), *command],
            cwd=ROOT,
            env={**os.environ, "PJRT_DEVICE": "CPU"},
            stdin=subprocess.DEVNULL,
            preexec_fn=_background if background else None,
            start_new_session=True,  # its own process group: stopped with the processes it starts
        )
        (folder / "group").write_text(str(process.pid))
        return cls(folder, process)

    def wait(self, timeout: float) -> int | str:
        """The run's exit status, or why there is none."""
        if self.process is not None:
            try:
                self.process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.stop()
                return f"killed after {timeout:.0f} s"
        else:  # the controller's run: its status file is all this worker can wait on
            import time

            deadline = time.monotonic() + timeout
            while not self.status.exists() and time.monotonic() < deadline and self._alive():
                time.sleep(0.5)
        if not self.status.exists():
            ended = not self._alive()
            self.stop()
            return "it ended without an exit status" if ended else f"no exit status after {timeout:.0f} s"
        return int(self.status.read_text())

    def _alive(self) -> bool:
        """Whether the run has not ended (its status is written before it ends); a run that
        ended unreaped by the controller is a zombie."""
        try:
            pid = int((self.folder / "group").read_text())
            os.kill(pid, 0)
            return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
        except (OSError, ValueError, IndexError):
            return False

    def stop(self) -> None:
        """Stop the run and the processes it started (a suite that ends before the bridge
        test, or a bridge test that times out)."""
        import signal

        if self.process is not None and self.process.poll() is not None:
            return
        with contextlib.suppress(OSError, ValueError):  # ended already, or never started
            os.killpg(int((self.folder / "group").read_text()), signal.SIGKILL)
        if self.process is not None:
            self.process.wait()


def start_xla_tests() -> XlaTests | None:
    """This session's run of tests/xla, started here if no one has: by this process, or,
    in an xdist worker, the controller's (FOLDER_VARIABLE)."""
    if "run" not in _xla_tests and XLA_PYTHON.exists():
        shared = os.environ.get(FOLDER_VARIABLE) if os.environ.get("PYTEST_XDIST_WORKER") else None
        if shared and (Path(shared) / "group").exists():
            _xla_tests["run"] = XlaTests(Path(shared))
        else:
            import tempfile

            _xla_tests["run"] = XlaTests.start(Path(tempfile.mkdtemp(prefix="xla-tests-")))
    return _xla_tests.get("run")


def stop_xla_tests() -> None:
    if "run" in _xla_tests and _xla_tests["run"].process is not None:  # (a worker's view is not its own)
        _xla_tests["run"].stop()
        import shutil

        shutil.rmtree(_xla_tests["run"].folder, ignore_errors=True)


def _background() -> None:
    """The lowest priority: the XLA tests run on what the main suite leaves idle. With
    Linux's autogroup scheduling (a group per session: the XLA tests' new session is one),
    groups share the CPU by the group's nice value, not their processes': both are set."""
    os.nice(19)
    with contextlib.suppress(OSError):  # no autogroup (another OS, a kernel without it): the nice value decides
        Path("/proc/self/autogroup").write_text("19")


def _wanted(config) -> bool:
    return not config.option.collectonly and importlib.util.find_spec("torch_xla") is None


def pytest_collection_finish(session):
    """Without xdist: started once the bridge test is known to be among those that run. An
    xdist worker leaves it to the controller (pytest_xdist_node_collection_finished)."""
    controller = _wanted(session.config) and not hasattr(session.config, "workerinput")
    if controller and any(item.name == XLA_BRIDGE for item in session.items):
        start_xla_tests()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node, ids):
    """The xdist controller, once a worker has collected: started once, into the folder
    its workers know from their environment."""
    wanted = "run" not in _xla_tests and _wanted(node.config) and any(i.endswith(XLA_BRIDGE) for i in ids)
    # (not with `-d --tx` alone: no -n)
    if wanted and XLA_PYTHON.exists() and FOLDER_VARIABLE in os.environ:
        _xla_tests["run"] = XlaTests.start(Path(os.environ[FOLDER_VARIABLE]), background=False)


def pytest_sessionfinish(session):
    stop_xla_tests()
    if getattr(session.config.option, "numprocesses", None) and not hasattr(session.config, "workerinput"):
        import shutil  # the xdist controller's folder, whether or not a run went into it

        if folder := os.environ.pop(FOLDER_VARIABLE, None):
            shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
def xla_tests():
    return start_xla_tests()


@pytest.fixture(scope="session", autouse=True)
def _isolated_cache(tmp_path_factory):
    """Keep tests off ~/.cache; the bundled corpus is tokenized once per session."""
    previous = os.environ.get("FRUGALITY_CACHE")
    os.environ["FRUGALITY_CACHE"] = str(tmp_path_factory.mktemp("frugality-cache"))
    torch.set_num_threads(max(1, min(2, len(os.sched_getaffinity(0)))))  # (the XLA tests: one core)
    yield
    if previous is None:
        os.environ.pop("FRUGALITY_CACHE", None)
    else:
        os.environ["FRUGALITY_CACHE"] = previous


def once_per_run(request, tmp_path_factory, name: str, build):
    """`build(folder)`'s JSON-able result, built once for the whole run: under pytest-xdist
    the first worker to ask builds it in a folder the workers share while the others wait on
    a file lock, then read it (pytest-xdist's own recipe for costly session fixtures: its
    `--dist loadgroup` does not group tests under pytest 9, whose node ids it cannot tag).
    A build that failed fails the others' tests too, with its error; the remains of a worker
    that died building are removed before the next builds. What is built is read only: a
    test that changes it copies it first."""
    if not hasattr(request.config, "workerinput"):  # (not an xdist worker)
        return build(tmp_path_factory.mktemp(name))
    import shutil
    import traceback

    from filelock import FileLock

    shared = tmp_path_factory.getbasetemp().parent / name  # (the workers' basetemps' parent)
    failed, result = shared.parent / f"{name}.failed", shared / "result.json"
    with FileLock(f"{shared}.lock"):
        if failed.is_file():
            pytest.fail(f"{name}: another worker's build failed:\n{failed.read_text()}")
        if not result.is_file():
            shutil.rmtree(shared, ignore_errors=True)  # (a worker that died building)
            shared.mkdir()
            try:
                built = build(shared)
            except BaseException:
                failed.write_text(traceback.format_exc())
                raise
            result.write_text(json.dumps(built))
        return json.loads(result.read_text())


MICRO_RECIPE = """
name = "micro"
seed = 7

[model]
family = "gpt-neox"
hidden_size = 32
num_layers = 2
num_heads = 4
vocab_size = 50304
max_seq_len = 64

[data]
dataset = "bundled:gutenberg"
tokenizer = "pythia"
seq_len = 32
global_batch_size = 4
micro_batch_size = 2
val_fraction = 0.01

[optim]
lr = 1e-2
min_lr = 1e-3
warmup_steps = 2

[train]
precision = "fp32"  # the same on every machine; `auto` has tests of its own
steps = 8
eval_interval = 4
eval_samples = 4
save_interval = 4

[metrics]
peak_tflops = 1.0
"""


@pytest.fixture(scope="session")
def micro_recipe_text() -> str:
    """The micro recipe's text, for fixtures wider than one test."""
    return MICRO_RECIPE


@pytest.fixture
def micro_recipe_file(tmp_path) -> Path:
    path = tmp_path / "micro.toml"
    path.write_text(MICRO_RECIPE)
    return path


@pytest.fixture(scope="session")
def micro_reference_run(request, tmp_path_factory) -> Path:
    """The micro recipe trained straight through (8 steps, checkpoints at 4 and 8) in the
    test process, once per run (`once_per_run`): the run that resumed, retried and recovered runs must equal to
    the bit. Read only: a test that changes a run copies it first."""
    from frugality.config.recipe import load_recipe
    from frugality.training import trainer

    def build(folder: Path) -> str:
        (folder / "micro.toml").write_text(MICRO_RECIPE)
        trainer.train(
            load_recipe(str(folder / "micro.toml")), run_dir=folder / "run", progress=False, tensorboard=False
        )
        return str(folder / "run")

    return Path(once_per_run(request, tmp_path_factory, "micro-reference", build))


# An encoder trained contrastively on WordNet pairs, a step in milliseconds.
MICRO_PAIRS_RECIPE = """
name = "micro-pairs"
seed = 11

[model]
family = "bert"
hidden_size = 32
num_layers = 2
num_heads = 4
intermediate_size = 64
vocab_size = 30522
max_seq_len = 64
pooler = false
head = [24, 16]
normalize = true
learn_temperature = true

[data]
dataset = "{pairs}"
tokenizer = "bert-uncased"
seq_len = 32
buckets = [16, 24]
global_batch_size = 8
micro_batch_size = 4
val_fraction = 0.1

[optim]
lr = 1e-3
min_lr = 1e-4
warmup_steps = 1

[train]
task = "contrastive"
precision = "fp32"
steps = 4
eval_interval = 2
eval_samples = 16
save_interval = 2

[metrics]
peak_tflops = 1.0
"""


@pytest.fixture(scope="session")
def micro_pairs_file(tmp_path_factory) -> Path:
    """The first 400 pairs of the bundled WordNet file."""
    import gzip
    from itertools import islice

    from frugality.data.bundled import bundled_pairs

    path = tmp_path_factory.mktemp("pairs") / "pairs.jsonl"
    with gzip.open(bundled_pairs("wordnet"), "rt") as f:
        path.write_text("".join(islice(f, 400)))
    return path


@pytest.fixture(scope="session")
def micro_pairs_recipe_text(micro_pairs_file) -> str:
    return MICRO_PAIRS_RECIPE.replace("{pairs}", str(micro_pairs_file))


@pytest.fixture
def micro_pairs_recipe(tmp_path, micro_pairs_file) -> Path:
    path = tmp_path / "micro-pairs.toml"
    path.write_text(MICRO_PAIRS_RECIPE.replace("{pairs}", str(micro_pairs_file)))
    return path


CACHE_KEY = "fleet-key-of-32-random-characters"  # signs the compile cache entries of the tests


@pytest.fixture(scope="session")
def micro_compiled(request, tmp_path_factory, micro_recipe_text) -> tuple[Path, str]:
    """The micro recipe compiled ahead of time at O1 on the CPU by `frugality compile`, a
    process of its own as a user runs it (forked: tests/forked_cli.py), once per run (Inductor's
    cold compile is the suite's most expensive step): the cache folder, with signed entries, and what the
    command printed. Tests copy the folder before they change anything in it."""
    import forked_cli

    def build(folder: Path) -> tuple[str, str]:
        recipe = folder / "micro.toml"
        recipe.write_text(micro_recipe_text)
        done = forked_cli.run(
            *("compile", recipe, "--level", "O1", "--cache", folder / "cache", "--set", "train.device=cpu"),
            "--no-progress",
            env=os.environ | {"FRUGALITY_CACHE_KEY": CACHE_KEY},
            cwd=folder,
            timeout=900,
        )
        assert done.returncode == 0, done.stderr
        return str(folder / "cache"), done.stdout

    cache, printed = once_per_run(request, tmp_path_factory, "micro-compiled", build)
    return Path(cache), printed


@pytest.fixture(scope="session")
def ray_cluster():
    """A Ray cluster of two nodes on this machine (one CPU each), for the ray engines' tests.
    Its workers die once where the tests ask: in `data prepare`'s piece 2, in `embed`'s
    shard 1 (the environment the nodes' workers inherit)."""
    ray = pytest.importorskip("ray")
    import os

    from ray.cluster_utils import Cluster

    dying = {"FRUGALITY_PREPARE_DIE_IN": "2", "FRUGALITY_EMBED_DIE_IN": "1"}
    os.environ.update(dying)
    try:
        nodes = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
        nodes.add_node(num_cpus=1)
    finally:
        for key in dying:
            del os.environ[key]
    yield nodes
    ray.shutdown()
    nodes.shutdown()


@pytest.fixture
def s3_bucket(monkeypatch):
    """`s3://BUCKET`: a bucket on a real S3 endpoint on loopback (moto's threaded server,
    through s3fs, as s3fs's own tests do), fsspec pointed at it as users point it: by the
    environment, which the processes a test starts inherit."""
    import socket

    moto_server = pytest.importorskip("moto.server")
    pytest.importorskip("s3fs")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for key, value in {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "FSSPEC_S3_ENDPOINT_URL": endpoint,
    }.items():
        monkeypatch.setenv(key, value)
    import uuid

    import fsspec
    import fsspec.config

    monkeypatch.setattr(fsspec.config, "conf", {})
    fsspec.config.set_conf_env(fsspec.config.conf)  # how users point fsspec at an endpoint
    fs = fsspec.filesystem("s3", skip_instance_cache=True)
    bucket = f"frugality-{uuid.uuid4().hex[:12]}"  # moto's state outlives one server
    fs.mkdir(bucket)
    yield f"s3://{bucket}"
    server.stop()


TINY_VOCAB, TINY_EOS = 256, 0  # the tiny decoders' word-level vocabulary: <|endoftext|>, w1 ... w255


@pytest.fixture(scope="session")
def tiny_decoder(tmp_path_factory):
    """`tiny_decoder("neox" | "llama")`: a decoder of two layers saved by transformers
    (GPT-NeoX with partial rotary; Llama with grouped-query attention) beside a word-level
    tokenizer, its weights spread so that greedy choices are decided by clear margins
    rather than by float rounding; built once a session."""
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer, models, pre_tokenizers

    common = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    common |= dict(vocab_size=TINY_VOCAB, max_position_embeddings=128, eos_token_id=TINY_EOS)
    kinds = {
        "neox": (
            transformers.GPTNeoXForCausalLM,
            transformers.GPTNeoXConfig(**common, rotary_pct=0.25, bos_token_id=0),
        ),
        "llama": (
            transformers.LlamaForCausalLM,
            transformers.LlamaConfig(**common, num_key_value_heads=2, bos_token_id=1, pad_token_id=TINY_EOS),
        ),
    }
    built: dict[str, Path] = {}

    def build(kind: str) -> Path:
        if kind not in built:
            model_class, config = kinds[kind]
            model = model_class(config).eval()
            torch.manual_seed(0)
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if p.dim() > 1:
                        p.normal_(0.0, 0.3 if "embed" in name else 0.15)
            folder = tmp_path_factory.mktemp(kind)
            model.save_pretrained(folder)
            vocab = {"<|endoftext|>": TINY_EOS, **{f"w{i}": i for i in range(1, TINY_VOCAB)}}
            tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
            tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
            tokenizer.add_special_tokens(["<|endoftext|>"])
            tokenizer.save(str(folder / "tokenizer.json"))
            built[kind] = folder
        return built[kind]

    return build


@pytest.fixture(scope="session")
def frugality_cli():
    """`frugality_cli(*args, cwd=, env=, timeout=, input=)`: the command line run as a user
    runs it, its process forked from one that has imported torch and frugality already
    (tests/forked_cli.py); a subprocess.CompletedProcess."""
    import forked_cli

    return forked_cli.run
