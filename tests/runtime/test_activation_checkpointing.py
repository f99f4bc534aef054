"""Activation checkpointing: the same training bit for bit with and without it (eager, and
compiled through dynamo and AOTAutograd), what autograd keeps falls as the plan says, the
plain model's names and eval path untouched, and `auto` choosing by the memory plan."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch._dynamo

from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.models import build_model
from frugality.runtime.activation_checkpointing import (
    apply_activation_checkpointing,
    checkpointed_blocks,
    checkpointing_of,
)
from frugality.runtime.layout import plan_layout
from frugality.runtime.state import build_state
from frugality.tasks import get_task


def _batches(recipe, n=3):
    g = torch.Generator().manual_seed(0)
    return [
        torch.randint(0, 1000, (recipe.data.micro_batch_size, recipe.data.seq_len + 1), generator=g) for _ in range(n)
    ]


def _train(recipe, mode, compile_backend=None):
    """Three steps of `recipe` under `mode`: the losses and the parameters after them."""
    state = build_state(replace(plan_layout(recipe, torch.device("cpu"), fit=False), checkpointing=(mode, "asked for")))
    assert state.checkpointing == mode and checkpointing_of(state.model) == mode  # (applied, not only named)
    recomputed = []  # the blocks whose forward ran again in backward (a layer of each, heard)
    for i, block in enumerate(state.model.layers):
        next(block.children()).register_forward_hook(lambda *_, i=i: recomputed.append(i))
    if compile_backend:
        for block in state.model.layers:
            block.compile(backend=compile_backend)
    from frugality.kernels import output_loss

    fused = [m for m in state.model.modules() if isinstance(m, output_loss.FusedOutputLayer)]
    losses = []
    for batch in _batches(recipe):
        with state.autocast:
            loss = state.wrapped(batch)
        # the logits buffer: kept for the next step without recomputation, given back under it
        assert fused and bool(output_loss._WORKSPACE) == (mode == "none"), mode
        recomputed.clear()
        loss.backward()
        if not compile_backend:
            assert recomputed == checkpointed_blocks(len(state.model.layers), mode, 2)[::-1], (mode, recomputed)
        state.optimizer.step()
        state.optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {n: p.detach().clone() for n, p in state.model.named_parameters()}


@pytest.mark.parametrize(
    "family, precision",
    [("gpt-neox", "fp32"), ("gpt-neox", "bf16-sr"), ("llama", "fp32")],
)
def test_every_mode_trains_the_same_bits_as_none(micro_recipe_file, family, precision):
    sets = [f"train.precision={precision}", f"model.family={family}", "model.num_layers=3"]
    if family == "llama":
        sets += ["model.intermediate_size=64"]
    recipe = load_recipe(str(micro_recipe_file), sets)
    losses, params = _train(recipe, "none")
    for mode in ("full", "selective"):
        got_losses, got_params = _train(recipe, mode)
        assert got_losses == losses, mode
        assert got_params.keys() == params.keys()  # the plain model's names
        assert all(torch.equal(got_params[n], params[n]) for n in params), mode


def test_compiled_blocks_recompute_and_train_as_eager(micro_recipe_file):
    """dynamo traces the checkpoint as a region AOTAutograd's partitioner recomputes in the
    backward graph; the eager backend keeps the test in seconds (Inductor at O1 was checked
    by hand, docs/training.md). Inductor's options for it: no C++ wrapper, which cannot emit
    the replayed attention's RNG state in torch 2.13."""
    from frugality.compile.levels import inductor_options

    cpu = torch.device("cpu")
    assert "cpp_wrapper" not in inductor_options(cpu, torch.float32, recomputes=True)
    if torch.get_num_threads() <= 4:
        assert inductor_options(cpu, torch.float32)["cpp_wrapper"] is True
    recipe = load_recipe(str(micro_recipe_file), ["train.precision=fp32"])
    torch._dynamo.reset()
    eager_losses, _ = _train(recipe, "none")
    losses, _ = _train(recipe, "full", compile_backend="aot_eager")
    assert losses == pytest.approx(eager_losses, rel=1e-6)
    torch._dynamo.reset()


def test_what_autograd_keeps_falls_as_the_plan_counts(micro_recipe_file):
    """The tensors saved for backward outside the recomputed blocks, on this CPU: full keeps
    under half of none's; the plan's profile of the same micro-batch says the same."""
    from frugality.runtime.plan import activation_profile

    recipe = load_recipe(
        str(micro_recipe_file), ["model.num_layers=4", "data.micro_batch_size=4", "model.vocab_size=512"]
    )
    batch = torch.randint(0, 512, (4, recipe.data.seq_len + 1))

    def kept(mode: str) -> int:
        model = build_model(recipe.model)
        apply_activation_checkpointing(model, mode)
        saved = {}

        def keep(t):
            base = t._base if t._base is not None else t
            saved[base.untyped_storage().data_ptr()] = base.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
            loss = get_task("causal_lm").training_module(model)(batch)
        params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        loss.backward()  # (the recomputation runs; nothing is left behind)
        return sum(n for ptr, n in saved.items() if ptr not in params)

    none, selective, full = kept("none"), kept("selective"), kept("full")
    assert full < selective < none and full < 0.5 * none
    with torch.device("meta"):
        profile = activation_profile(build_model(recipe.model), recipe)
    assert profile.bytes("none", 2) == pytest.approx(none, rel=0.1)
    # (the plan adds what checkpoint's frames hold, the blocks' inputs, and one block recomputed)
    assert profile.bytes("full", 2) < 0.5 * profile.bytes("none", 2)
    assert profile.bytes("full", 2) < profile.bytes("selective", 2) < profile.bytes("none", 2)


def test_without_gradients_a_block_runs_as_it_is(micro_recipe_file):
    recipe = load_recipe(str(micro_recipe_file), [])
    model = build_model(recipe.model)
    x = torch.randint(0, 1000, (2, 16))
    with torch.no_grad():
        expected = model.hidden_states(x)
    assert apply_activation_checkpointing(model, "full") == 2
    assert apply_activation_checkpointing(model, "full") == 2  # twice: still one wrapper
    block = type(model.layers[0])
    assert block.__name__ == "CheckpointedBlock" and block.__bases__[0].__name__ == "Block"
    with torch.no_grad():
        assert torch.equal(model.hidden_states(x), expected)
    assert checkpointed_blocks(5, "selective", 2) == [0, 2, 4] and checkpointed_blocks(5, "none", 2) == []
    # under pipeline parallel, within each stage: 11 blocks a stage recompute 6 in each
    assert checkpointed_blocks(22, "selective", 2, stage=11) == [0, 2, 4, 6, 8, 10, 11, 13, 15, 17, 19, 21]


def _deep(micro_recipe_file, *more):
    """The micro recipe with eight blocks and a small vocabulary: activations dominate."""
    sets = ["model.num_layers=8", "model.vocab_size=512", "data.global_batch_size=8", "data.micro_batch_size=8"]
    sets += ["train.precision=fp32", *more]
    return load_recipe(str(micro_recipe_file), sets)


def _totals(recipe, micro=None):
    from frugality.precision import get_policy
    from frugality.runtime import plan as planning

    if micro:
        recipe = recipe.model_copy(update={"data": recipe.data.model_copy(update={"micro_batch_size": micro})})
    fp32 = get_policy("fp32")
    return [
        planning.plan_memory(recipe, 1, "ddp", policy=fp32, fused_output=True, checkpointing=m).total
        for m in ("none", "selective", "full")
    ]


def test_auto_takes_the_first_mode_that_fits_and_refuses_when_none_does(micro_recipe_file, monkeypatch):
    """auto: the first mode within 90% of the free memory, else the first within all of it;
    below full's plan: refused in one line, naming the micro-batch that would fit."""
    from frugality.precision import get_policy
    from frugality.runtime import plan as planning

    recipe = _deep(micro_recipe_file)
    fp32, cpu = get_policy("fp32"), torch.device("cpu")
    none, selective, full = _totals(recipe)
    assert none > selective / 0.9 and selective > full / 0.9  # (far enough apart for the cases below)

    def choice(free: float):
        monkeypatch.setattr(planning, "device_memory", lambda device: (int(free), none))
        return planning.fit_memory(recipe, fp32, 1, cpu)

    assert choice(none / 0.9 + 1)[0] == "none"
    mode, why = choice((selective / 0.9 + none) / 2)
    assert mode == "selective" and why.startswith("auto: none ") and "GiB per rank planned" in why
    assert choice((full / 0.9 + selective) / 2)[0] == "full"
    assert choice(none)[0] == "selective"  # none would fill it: the runtime's share is not counted
    assert choice(full)[0] == "full"  # nothing within 90%: the first within all of it
    between = (_totals(recipe, 4)[2] + full) // 2  # full at a micro-batch of 4 fits, at 8 it does not
    with pytest.raises(UserError, match=r"under activation checkpointing full \(auto: the most it recomputes\)"):
        choice(between)
    with pytest.raises(UserError, match=r"set data\.micro_batch_size 4 "):
        choice(between)
    asked = recipe.model_copy(update={"train": recipe.train.model_copy(update={"activation_checkpointing": "none"})})
    monkeypatch.setattr(planning, "device_memory", lambda device: (selective, none))
    with pytest.raises(UserError, match=r"under activation checkpointing none \(activations"):
        planning.fit_memory(asked, fp32, 1, cpu)
    unchecked = recipe.model_copy(update={"train": recipe.train.model_copy(update={"check_memory": False})})
    assert planning.fit_memory(unchecked, fp32, 1, cpu)[0] == "none"


def test_a_run_says_which_mode_it_took_and_why(micro_recipe_file, tmp_path, monkeypatch, capsys):
    from frugality.runtime import plan as planning
    from frugality.training.trainer import train

    # (the micro recipe with its tokenizer's vocabulary: the modes' plans lie within 10%)
    recipe = load_recipe(str(micro_recipe_file), ["train.steps=2", "train.precision=fp32"])
    none, _, full = _totals(recipe)
    monkeypatch.setattr(planning, "device_memory", lambda device: (full, none))
    kept, given_back = [], []  # (a mode that asks for memory: glibc's defaults, the heap trimmed a step)
    monkeypatch.setattr("frugality.training.trainer.keep_freed_memory", lambda: kept.append(True))
    monkeypatch.setattr("frugality.training.loop.give_back_freed_memory", lambda: given_back.append(True))
    result = train(recipe, tmp_path / "run", progress=False, tensorboard=False)
    out = capsys.readouterr().out
    assert result.final_step == 2 and not kept and len(given_back) == 2
    assert "activation checkpointing: full, 2 of 2 blocks recomputed in backward (auto: none " in out, out
    assert result.summary["activation_checkpointing"] == "full"
    # where `none` fits, `auto` takes it: freed memory kept for speed, nothing trimmed
    monkeypatch.setattr(planning, "device_memory", lambda device: (none * 2, none * 2))
    result = train(recipe, tmp_path / "roomy", progress=False, tensorboard=False)
    assert result.summary["activation_checkpointing"] == "none" and kept == [True] and len(given_back) == 2


def test_compile_ahead_compiles_the_mode_the_run_over_its_ranks_takes(micro_recipe_file, monkeypatch):
    """`frugality compile --ranks 2` of an FSDP2 recipe: auto resolved with the plan of a rank
    of two (half the state), which fits without recomputation where one process would not."""
    from frugality.precision import get_policy
    from frugality.runtime import plan as planning
    from frugality.training.ahead import _run_checkpointing

    sets = ["parallel.data=fsdp", "train.precision=fp32", "model.num_layers=4", "model.vocab_size=512"]
    sets += ["model.hidden_size=256", "data.micro_batch_size=1"]  # (the state, which FSDP2 shards, dominates)
    recipe = load_recipe(str(micro_recipe_file), sets)
    fp32 = get_policy("fp32")
    one = planning.plan_memory(recipe, 1, "fsdp", policy=fp32, fused_output=True).total
    two = planning.plan_memory(recipe, 2, "fsdp", policy=fp32, fused_output=True).total
    assert two / 0.9 < one
    monkeypatch.setattr(planning, "device_memory", lambda device: (int(two / 0.9) + 1, one))
    assert _run_checkpointing(recipe, 2) == "none"
    with pytest.raises(UserError, match="needs about"):  # (one process would fit under no mode)
        _run_checkpointing(recipe, 1)
    # the trial, one process holding both ranks' state, cannot train the run's graphs: one line, nothing compiled
    from frugality.training.ahead import compile_ahead

    compiled = recipe.model_copy(update={"compile": recipe.compile.model_copy(update={"level": "O1"})})
    with pytest.raises(UserError, match=r"^frugality compile --ranks 2: its trial trains the run's graphs in 1 "):
        compile_ahead(compiled, progress=False, ranks=2)
    asked = load_recipe(str(micro_recipe_file), ["train.activation_checkpointing=full"])
    assert _run_checkpointing(asked, 2) == "full"
