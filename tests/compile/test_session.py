"""Compilation in a run: ahead-of-time warm-up, a warm start that compiles nothing, the
recompilation guard and the eager fallback. Real torch.compile (Inductor, C++ on the CPU)
on the micro recipe; the cold compile is paid once per module."""

from __future__ import annotations

import pytest
import torch

from frugality.training.ahead import compile_ahead
from frugality.compile.session import (
    CompileError,
    CompileFallbackWarning,
    CompileSession,
    RecompileError,
    RecompileWarning,
)
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.runtime.state import build_state
from frugality.training.loop import train_step
from frugality.training.trainer import train


@pytest.fixture(scope="module")
def compiled_cache(tmp_path_factory):
    """The micro recipe compiled ahead of time into a fresh cache directory."""
    return tmp_path_factory.mktemp("compile-cache")


def _recipe(micro_recipe_file, cache, *extra):
    # On the CPU wherever the tests run: they exercise Inductor's C++ path and its cache.
    return load_recipe(str(micro_recipe_file), ["compile.level=O1", "train.device=cpu",
                                                f'compile.cache="{cache}"', *extra])


def test_compile_ahead_then_train_compiles_nothing(micro_recipe_file, compiled_cache, tmp_path, monkeypatch):
    monkeypatch.setenv("FRUGALITY_CACHE_KEY", "fleet-key-of-32-random-characters")  # entries signed, and checked when read
    recipe = _recipe(micro_recipe_file, compiled_cache)
    cold = compile_ahead(recipe, progress=False)
    # training forward, its backward, the evaluation forward
    assert cold["graphs"] == 3 and cold["cache_misses"] == 3 and cold["published"] and cold["signed"]
    assert cold["recompiles"] == 0 and not cold["fallbacks"]

    result = train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    warm = result.summary["compile"]
    assert warm["fetched"] and warm["cache_hits"] == 3
    assert warm["cache_misses"] == 0  # nothing generated or built: all of it came from the cache
    assert warm["recompiles"] == 0 and not warm["published"]
    assert result.final_step == recipe.train.steps
    assert result.summary["final_val_loss"] < result.summary["first_val_loss"]
    assert "fleet-key-of-32" not in "".join(p.read_text(errors="replace") for p in (tmp_path / "run").rglob("*.json*"))


def test_an_altered_signed_entry_is_compiled_locally_and_the_run_completes(
        micro_recipe_file, compiled_cache, tmp_path, monkeypatch):
    """Someone with write access but not the key swaps a generated file and fixes the
    archive's hash: the entry is refused, nothing from it runs, the run compiles its own."""
    import json
    import shutil

    from frugality.compile.cache import CompileCacheWarning
    from test_cache import _repack

    monkeypatch.setenv("FRUGALITY_CACHE_KEY", "fleet-key-of-32-random-characters")
    shutil.copytree(compiled_cache, tmp_path / "cache")
    entry = next(p for p in (tmp_path / "cache").iterdir() if (p / "manifest.json").is_file())
    manifest = json.loads((entry / "manifest.json").read_text())
    assert "signature" in manifest, "run after test_compile_ahead_then_train_compiles_nothing"

    def plant(files):
        name = next(n for n in files if n.endswith(".py"))
        files[name] = b"import os\nos.system('touch " + str(tmp_path / "pwned").encode() + b"')\n" + files[name]

    _repack(entry, manifest, plant)
    recipe = _recipe(micro_recipe_file, tmp_path / "cache")
    with pytest.warns(CompileCacheWarning, match="altered after it was signed"):
        result = train(recipe, run_dir=tmp_path / "run", progress=False, tensorboard=False)
    stats = result.summary["compile"]
    assert not stats["fetched"] and stats["cache_misses"] == 3 and stats["cache_hits"] == 0
    assert result.final_step == recipe.train.steps
    assert not (tmp_path / "pwned").exists()


def _session(recipe, device=torch.device("cpu")):
    """What train() builds, and its two phases as calls through the session."""
    state = build_state(recipe, device)
    session = state.compiled
    session.start(state.model)
    reset = lambda: state.optimizer.zero_grad(set_to_none=True)

    def step(number, batch):
        return session.run("train", number, lambda: train_step(state, [batch]), reset)

    @torch.no_grad()
    def evaluate(number, batch):
        def loss():
            state.model.eval()
            return state.task.loss(state.model, batch).item()
        return session.run("eval", number, loss, reset)

    return session, step, evaluate


def _batch(recipe, rows):
    return torch.randint(0, 1000, (rows, recipe.data.seq_len + 1))


@pytest.mark.parametrize("mode", ["error", "warn"])
def test_a_changed_batch_shape_after_warm_up_is_reported_with_its_reason(
        micro_recipe_file, compiled_cache, mode):
    recipe = _recipe(micro_recipe_file, compiled_cache, f"compile.on_recompile={mode}")
    session, step, evaluate = _session(recipe)
    try:
        evaluate(0, _batch(recipe, 2))
        step(1, _batch(recipe, 2))
        step(2, _batch(recipe, 2))  # the warmed-up shape: no compilation
        assert session.stats.cache_misses == 0 and session.stats.cache_hits == 3  # from the cache
        assert session.stats.recompiles == 0
        if mode == "error":
            with pytest.raises(RecompileError, match=r"at step 3: .*size mismatch at index 0\. expected 2, actual 3"):
                step(3, _batch(recipe, 3))
        else:
            with pytest.warns(RecompileWarning, match=r"at step 3: .*size mismatch at index 0\. expected 2, actual 3"):
                step(3, _batch(recipe, 3))
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


def test_a_graph_that_fails_to_compile_runs_eagerly_with_a_warning(micro_recipe_file, tmp_path,
                                                                     broken_compiler):
    recipe = _recipe(micro_recipe_file, tmp_path / "empty-cache")
    session, step, _ = _session(recipe)
    try:
        with pytest.warns(CompileFallbackWarning, match=r"GPTNeoX block .*\(train\) failed to compile: "
                                                         r".*No working C\+\+ compiler.*; running it eagerly"):
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
