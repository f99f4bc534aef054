"""The model-parallel tests' recipes and their one-process runs, trained once a session."""

from __future__ import annotations

import pytest
from torchrun import STEPS, train

LLAMA = {  # grouped-query heads and tied embeddings
    'family = "gpt-neox"': 'family = "llama"\nnum_kv_heads = 2\nintermediate_size = 64\ntie_embeddings = true',
    'name = "micro"': 'name = "micro-llama"',
}


@pytest.fixture(scope="session")
def layout_recipes(tmp_path_factory, micro_recipe_text):
    """micro (GPT-NeoX, 2 layers), micro-llama, micro4 (4 layers: two stages a rank) and micro8
    (a batch of 8, a short validation batch)."""
    folder = tmp_path_factory.mktemp("recipes")
    llama = micro_recipe_text
    for old, new in LLAMA.items():
        llama = llama.replace(old, new)
    deeper = micro_recipe_text.replace("num_layers = 2", "num_layers = 4").replace('name = "micro"', 'name = "micro4"')
    (folder / "micro.toml").write_text(micro_recipe_text)
    (folder / "micro-llama.toml").write_text(llama)
    (folder / "micro4.toml").write_text(deeper)
    # 8 a step (2 micro-batches a rank at 2 data-parallel ranks), 3 validation samples: a short batch on one rank
    wider = micro_recipe_text.replace("global_batch_size = 4", "global_batch_size = 8")
    wider = wider.replace("eval_samples = 4", "eval_samples = 3").replace('name = "micro"', 'name = "micro8"')
    (folder / "micro8.toml").write_text(wider)
    return folder


@pytest.fixture(scope="session")
def one_process_run(tmp_path_factory, layout_recipes):
    """(recipe name, precision) -> the run directory of its one-process run, trained once."""
    runs = {}

    def run(name, precision="fp32"):
        if (name, precision) not in runs:
            runs[name, precision] = tmp_path_factory.mktemp("one-process")
            train(layout_recipes / f"{name}.toml", runs[name, precision], 1, STEPS, f"train.precision={precision}")
        return runs[name, precision]

    return run
