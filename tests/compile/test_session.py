"""Compilation in a run: an altered cache entry refused, the recompilation guard and the
eager fallback. Real torch.compile (Inductor, C++ on the CPU) on the micro recipe, from
the graphs `frugality compile` put in a cache once per run (`micro_compiled`); the
warm start that compiles nothing is tests/cli/test_compile_cli.py's."""

from __future__ import annotations

import shutil

import pytest
import torch

from frugality.compile.base import (
    CompileError,
    CompileFallbackWarning,
    RecompileError,
    RecompileWarning,
)
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.runtime.layout import plan_layout
from frugality.runtime.state import build_state
from frugality.training.ahead import compile_ahead
from frugality.training.loop import train_step
from frugality.training.trainer import train


@pytest.fixture
def compiled_cache(micro_compiled, tmp_path):
    """A copy of the micro recipe's compiled graphs (`frugality compile`, once per run),
    that a test may alter."""
    shutil.copytree(micro_compiled[0], tmp_path / "compiled")
    return tmp_path / "compiled"


@pytest.fixture(scope="module")
def shared_cache(micro_compiled, tmp_path_factory):
    """A copy for this module's tests that only add to it: the first to compile a new shape
    publishes it, and the next fetches it instead of compiling it again."""
    folder = tmp_path_factory.mktemp("shared") / "compiled"
    shutil.copytree(micro_compiled[0], folder)
    return folder


def _recipe(micro_recipe_file, cache, *extra):
    # On the CPU wherever the tests run: they exercise Inductor's C++ path and its cache.
    return load_recipe(
        str(micro_recipe_file), ["compile.level=O1", "train.device=cpu", f'compile.cache="{cache}"', *extra]
    )


@pytest.mark.slow
def test_an_altered_signed_entry_is_refused_and_the_run_completes(
    micro_recipe_file, compiled_cache, tmp_path, monkeypatch, broken_compiler
):
    """Someone with write access but not the key swaps a generated file and fixes the
    archive's hash: the entry is refused, nothing from it runs, the run goes on without it
    (here eagerly: this machine's compiler is made to fail, which spares the test a cold
    compile; a run with a working one compiles its own graphs)."""
    import json

    from test_cache import _repack

    from frugality.compile.cache import CompileCacheWarning

    monkeypatch.setenv("FRUGALITY_CACHE_KEY", "fleet-key-of-32-random-characters")  # the fixture's
    entry = next(p for p in compiled_cache.iterdir() if (p / "manifest.json").is_file())
    manifest = json.loads((entry / "manifest.json").read_text())
    assert "signature" in manifest

    def plant(files):
        name = next(n for n in files if n.endswith(".py"))
        files[name] = b"import os\nos.system('touch " + str(tmp_path / "pwned").encode() + b"')\n" + files[name]

    _repack(entry, manifest, plant)
    recipe = _recipe(micro_recipe_file, compiled_cache)
    with pytest.warns(CompileCacheWarning, match="altered after it was signed"):
        result = train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    stats = result.summary["compile"]
    assert not stats["fetched"] and stats["cache_hits"] == 0 and stats["fallbacks"]
    assert result.final_step == recipe.train.steps
    assert not (tmp_path / "pwned").exists()


def _session(recipe, device=torch.device("cpu")):
    """What train() builds, and its two phases as calls through the session."""
    state = build_state(plan_layout(recipe, device))
    session = state.compiled
    session.start(state.model)
    reset = lambda: state.optimizer.zero_grad(set_to_none=True)

    def step(number, batch):
        return session.run("train", number, lambda: train_step(state, [batch]), reset)

    @torch.no_grad()
    def evaluate(number, batch):
        def loss():
            state.wrapped.eval()
            return state.wrapped(batch, evaluate=True).loss.item()

        return session.run("eval", number, loss, reset)

    return session, step, evaluate


def _batch(recipe, rows):
    return torch.randint(0, 1000, (rows, recipe.data.seq_len + 1))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["error", "warn"])
def test_a_changed_batch_shape_after_warm_up_is_reported_with_its_reason(micro_recipe_file, shared_cache, mode):
    recipe = _recipe(micro_recipe_file, shared_cache, f"compile.on_recompile={mode}")
    session, step, evaluate = _session(recipe)
    try:
        evaluate(0, _batch(recipe, 2))
        step(1, _batch(recipe, 2))
        step(2, _batch(recipe, 2))  # the warmed-up shape: no compilation
        assert session.stats.cache_misses == 0 and session.stats.cache_hits == 3  # from the cache
        assert session.stats.recompiles == 0
        # another implementation's compilation (a peer in bench train) is not this session's
        with session.outside():
            torch.compile(lambda x: x * 2 + 1, backend="eager")(torch.ones(3))
        step(3, _batch(recipe, 2))
        assert session.stats.recompiles == 0 and session.stats.graphs == 3
        if mode == "error":
            with pytest.raises(RecompileError, match=r"at step 4: .*size mismatch at index 0\. expected 2, actual 3"):
                step(4, _batch(recipe, 3))
        else:
            with pytest.warns(RecompileWarning, match=r"at step 4: .*size mismatch at index 0\. expected 2, actual 3"):
                step(4, _batch(recipe, 3))
        assert session.stats.graphs > 3  # the new shape's graph (compiled, or cached by the other mode)
        assert session.stats.recompiles == 1
        assert "expected 2, actual 3" in session.stats.recompile_reasons[0]
    finally:
        session.close()
        session.cleanup()


@pytest.fixture
def broken_compiler():
    """A machine without a working C++ compiler: Inductor's build step fails for real."""
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.cxx": (None, "/nonexistent/bin/g++")}):
        yield


def test_a_graph_that_fails_to_compile_runs_eagerly_with_a_warning(micro_recipe_file, tmp_path, broken_compiler):
    recipe = _recipe(micro_recipe_file, tmp_path / "empty-cache")
    session, step, _ = _session(recipe)
    try:
        with pytest.warns(
            CompileFallbackWarning,
            match=r"GPTNeoX block .*\(train\) failed to compile: "
            r".*No working C\+\+ compiler.*; running it eagerly",
        ):
            first = step(1, _batch(recipe, 2))[0]
        assert session.stats.fallbacks == ["GPTNeoX block (frugality.models.gpt_neox.Block) (train)"]
        losses = [first] + [step(i, _batch(recipe, 2))[0] for i in (2, 3)]
        assert all(torch.isfinite(torch.tensor(losses)))
        assert session.stats.recompiles == 0 and not session.stats.published
    finally:
        session.close()
        session.cleanup()


def test_compile_failure_is_fatal_without_fallback(micro_recipe_file, tmp_path, broken_compiler):
    recipe = _recipe(micro_recipe_file, tmp_path / "empty-cache", "compile.fallback=false")
    with pytest.raises(CompileError) as caught:
        train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    message = str(caught.value)
    assert message.startswith("compile: the GPTNeoX block") and "compile.fallback = false" in message
    assert "\n" not in message
    assert isinstance(caught.value, UserError)


def test_compile_refuses_eager_recipes(micro_recipe_file):
    with pytest.raises(UserError, match="nothing to compile"):
        compile_ahead(load_recipe(str(micro_recipe_file)), progress=False)


def test_another_backend_compiles_the_blocks_without_the_shared_cache(micro_recipe_file, tmp_path):
    """compile.backend names any registered torch.compile backend (here aot_eager: dynamo and
    AOTAutograd, no code generation); the shared cache, which holds Inductor's graphs, is
    left out, and the guard still reads dynamo's compilations."""
    recipe = _recipe(micro_recipe_file, tmp_path / "cache", "compile.backend=aot_eager", "train.steps=3")
    eager = load_recipe(str(micro_recipe_file), ["train.device=cpu", "train.steps=3"])
    result = train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    plain = train(eager, run_dir=tmp_path / "eager", progress=False, tensorboard=False)
    stats = result.summary["compile"]
    assert stats["level"] == "O1 (aot_eager)" and stats["cache"].startswith("none: the shared cache holds Inductor")
    assert stats["graphs"] >= 2 and stats["recompiles"] == 0 and not stats["published"]
    assert not (tmp_path / "cache").exists()
    assert result.summary["final_train_loss"] == pytest.approx(plain.summary["final_train_loss"], rel=1e-5)
    with pytest.raises(UserError, match=r"compile.backend 'neuron': not a torch.compile backend here \(these are: "):
        train(_recipe(micro_recipe_file, tmp_path / "cache", "compile.backend=neuron"), run_dir=tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
