"""The contract every registered model family keeps: it builds, runs forward, has one Hugging
Face adapter (config and weights both ways, through files too), and trains a step, through
its task where one trains it."""

import pytest
import torch

from frugality.config.recipe import Recipe
from frugality.interop.hf import BY_FAMILY, export_hf, import_hf
from frugality.models import FAMILIES, build_model
from frugality.runtime.layout import plan_layout
from frugality.runtime.state import build_state
from frugality.tasks import TASKS
from frugality.training.loop import train_step

SMALL = {  # each family at a few thousand parameters
    "gpt-neox": dict(hidden_size=32, num_layers=2, num_heads=4, vocab_size=128, max_seq_len=32),
    "llama": dict(
        hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=48, vocab_size=128, max_seq_len=32
    ),
    "bert": dict(
        hidden_size=32, num_layers=2, num_heads=4, intermediate_size=48, vocab_size=128, max_seq_len=32, mlm_head=True
    ),
}


def test_every_family_is_covered_here_and_has_an_adapter():
    assert set(SMALL) == set(FAMILIES) == set(BY_FAMILY)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_builds_runs_and_round_trips_through_hugging_face(family, tmp_path):
    config_cls, _ = FAMILIES[family]
    config = config_cls(family=family, **SMALL[family])
    torch.manual_seed(0)
    model = build_model(config)
    tokens = torch.randint(0, 128, (2, 16))
    out = model(tokens)
    assert out.shape[:2] == (2, 16) and torch.isfinite(out).all()

    adapter = BY_FAMILY[family]
    state = model.state_dict()
    theirs = adapter.to_hf(state, config)
    back = adapter.from_hf(theirs, config)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    # configs compare as transformers sees them (defaults such as GPT-NeoX's 4 x hidden MLP filled in)
    same = lambda a, b: adapter.config_to_hf(a) == adapter.config_to_hf(b)
    assert same(adapter.config_from_hf(adapter.config_to_hf(config), set(theirs)), config)

    export_hf(config, state, tmp_path / "hf")
    imported_config, imported = import_hf(tmp_path / "hf")
    assert same(imported_config, config)
    assert all(torch.equal(imported[k], state[k]) for k in state)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_trains_one_step(family):
    tasks = [t for t in TASKS.values() if family in t.families]
    tokens = torch.randint(0, 128, (2, 17))
    if tasks:  # through the builder and the loop's step, as `frugality train` does
        recipe = Recipe.model_validate(
            {
                "name": "contract",
                "model": {"family": family, **SMALL[family]},
                "data": {"seq_len": 16, "global_batch_size": 2, "micro_batch_size": 2},
                "train": {"task": tasks[0].name, "precision": "fp32"},
            }
        )
        state = build_state(plan_layout(recipe, torch.device("cpu")))
        before = {k: v.clone() for k, v in state.model.state_dict().items()}
        loss, norm, _ = train_step(state, [tokens])
        after = state.model.state_dict()
    else:  # no task trains it yet (an encoder): one AdamW step on its hidden states
        config_cls, _ = FAMILIES[family]
        model = build_model(config_cls(family=family, **SMALL[family]))
        before = {k: v.clone() for k, v in model.state_dict().items()}
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        out = model(tokens).float().pow(2).mean()
        out.backward()
        optimizer.step()
        loss, after = out.item(), model.state_dict()
    assert loss == loss and loss > 0  # finite and positive
    assert any(not torch.equal(before[k], after[k]) for k in before)
