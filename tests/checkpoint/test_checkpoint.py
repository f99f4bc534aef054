"""DCP checkpoints: clean keys, crash-safe folders, pruning, device-agnostic loading."""

import pytest
import torch

from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import OptimConfig
from frugality.models import GPTNeoX, GPTNeoXConfig
from frugality.runtime.optim import build_optimizer

CFG = GPTNeoXConfig(hidden_size=32, num_layers=1, num_heads=2, vocab_size=64, max_seq_len=16)


def _trained():
    torch.manual_seed(0)
    model = GPTNeoX(CFG)
    optimizer = build_optimizer(model, OptimConfig())
    model(torch.randint(0, 64, (2, 16))).sum().backward()
    optimizer.step()
    return model, optimizer


def test_compiled_model_saves_plain_keys(tmp_path):
    from torch.distributed.checkpoint.state_dict import get_state_dict

    model, optimizer = _trained()
    compiled = torch.compile(model)  # never called: wrapping alone adds _orig_mod. to state_dict()
    assert any(k.startswith("_orig_mod.") for k in compiled.state_dict())
    model_state, optim_state = get_state_dict(compiled, optimizer)
    assert set(model_state) == set(model.state_dict())
    assert set(optim_state["state"]) == set(model.state_dict())  # keyed by name, not position

    manager = CheckpointManager(tmp_path)
    path = manager.save(1, compiled, optimizer, {"note": "x"})
    fresh = GPTNeoX(CFG)
    fresh_optimizer = build_optimizer(fresh, OptimConfig())
    assert manager.load(path, fresh, fresh_optimizer) == {"note": "x"}
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)


def test_partial_checkpoints_are_ignored_and_old_ones_pruned(tmp_path):
    model, optimizer = _trained()
    manager = CheckpointManager(tmp_path, keep=2)
    for step in (10, 20, 30):
        manager.save(step, model, optimizer, {})
    assert [p.name for p in manager.complete()] == ["step_00000020", "step_00000030"]
    # A save that died half-way: a .partial folder, and a step folder without .metadata.
    (tmp_path / ".step_00000040.partial").mkdir()
    (tmp_path / "step_00000050").mkdir()
    assert manager.latest().name == "step_00000030"


def test_loads_onto_the_live_models_device(tmp_path):
    """Tensors land where the model is, whatever device saved them (here: a meta-free CPU
    model loading a CPU checkpoint; on CUDA machines the same path maps cuda -> cpu)."""
    model, optimizer = _trained()
    path = CheckpointManager(tmp_path).save(1, model, optimizer, {})
    target = GPTNeoX(CFG).to(torch.float32)
    target_optimizer = build_optimizer(target, OptimConfig())
    CheckpointManager(tmp_path).load(path, target, target_optimizer)
    assert all(p.device.type == "cpu" for p in target.parameters())
    state = target_optimizer.state_dict()["state"]
    assert all(s["exp_avg"].device.type == "cpu" for s in state.values())


def test_an_asynchronous_save_holds_the_state_of_its_step_and_completes_at_poll(tmp_path):
    """The state is copied before training goes on: parameters changed after `save` returns
    are not in the checkpoint; it is complete (manifest, renamed) once polled or waited."""
    from frugality.checkpoint import verify

    model, optimizer = _trained()
    expected = {k: v.clone() for k, v in model.state_dict().items()}
    manager = CheckpointManager(tmp_path)
    final = manager.save(1, model, optimizer, {"step": 1}, asynchronous=True)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # the next steps, while the write goes on
    manager.wait()
    assert final.is_dir() and verify(final) is None and manager.latest() == final
    fresh = GPTNeoX(CFG)
    assert manager.load(final, fresh, build_optimizer(fresh, OptimConfig())) == {"step": 1}
    for k, v in expected.items():
        assert torch.equal(fresh.state_dict()[k], v), k
    manager.save(2, model, optimizer, {"step": 2}, asynchronous=True)
    manager._pending[3].result()  # the background write has ended
    manager.poll()  # completes it without blocking
    assert manager.latest().name == "step_00000002" and manager._pending is None


@pytest.mark.parametrize("kind", ["foreach", "fused"])
def test_a_checkpoint_taken_before_any_update_resumes_to_the_bits_of_a_run_that_took_none(tmp_path, kind):
    """DCP gives an optimizer without state a zero-lr step to make it; that step must not count."""

    def pair():
        torch.manual_seed(0)
        model = torch.nn.Linear(8, 4)
        flags = {"foreach": True} if kind == "foreach" else {"fused": True}
        return model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.1, **flags)

    def update(model, optimizer):
        model(torch.ones(2, 8)).square().sum().backward()
        optimizer.step()
        optimizer.zero_grad()

    never, saved, loaded = pair(), pair(), pair()
    manager = CheckpointManager(tmp_path)
    manager.save(0, *saved, {})  # before any update (every step skipped so far)
    manager.load(manager.latest(), *loaded)
    for model, optimizer in (never, saved, loaded):
        update(model, optimizer)
        update(model, optimizer)
    for other in (saved, loaded):
        assert torch.equal(other[0].weight, never[0].weight) and torch.equal(other[0].bias, never[0].bias)
