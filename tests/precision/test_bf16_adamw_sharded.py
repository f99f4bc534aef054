"""BF16AdamW on FSDP2's sharded parameters: 2 ranks over gloo update their shards to the
bits one process gives, rounding noise included (its stream does not depend on the world
size), with gradient clipping over the shards."""

from __future__ import annotations

import os

import forked_cli
import pytest
import torch

SCRIPT = """
import os
import sys
import torch
import torch.distributed as dist
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, {tests!r})
from precision.test_bf16_adamw_sharded import model_and_batch, train

sharded = len(sys.argv) > 2
if sharded:
    dist.init_process_group("gloo")
model, batch = model_and_batch()
if sharded:
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
state = train(model, batch)
if sharded:
    state = {{k: v.full_tensor() for k, v in state.items()}}
if not sharded or dist.get_rank() == 0:
    torch.save(state, sys.argv[1])
if sharded:
    dist.destroy_process_group()
    os._exit(0)  # gloo's threads can abort the interpreter's teardown: see distributed.exit_process
"""


def model_and_batch():
    torch.manual_seed(0)
    # 5 and 3 rows do not split evenly over 2 ranks: uneven shards (and an empty one) included
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3), torch.nn.Linear(3, 1)).bfloat16()
    return model, torch.randn(4, 6).bfloat16()


def train(model, batch) -> dict[str, torch.Tensor]:
    """Three steps on the same batch (every rank the same: the averaged gradient is exact),
    clipped to a norm below the gradients' so that clipping acts; weights and moments after."""
    from frugality.precision.bf16_adamw import BF16AdamW

    torch.set_num_threads(1)
    decay = [p for p in model.parameters() if p.ndim == 2]
    optimizer = BF16AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": [p for p in model.parameters() if p.ndim < 2]}],
        lr=1e-2,
        seed=7,
    )
    for _ in range(3):
        model(batch).float().square().mean().backward()
        optimizer.clip_grad_norm_(0.05)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    state = {}
    for name, p in model.named_parameters():
        state[name] = p.detach()
        for moment in ("exp_avg", "exp_avg_sq"):
            state[f"{name}.{moment}"] = optimizer.state[p][moment]
    return state


@pytest.mark.distributed
def test_two_ranks_update_their_shards_to_the_one_process_bits(tmp_path):
    script = tmp_path / "run.py"
    script.write_text(SCRIPT.format(tests=os.path.dirname(os.path.dirname(__file__))))
    env = os.environ | {"OMP_NUM_THREADS": "1"}
    one = forked_cli.run(tmp_path / "one.pt", script=script, env=env, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    two = forked_cli.ranks(2, tmp_path / "two.pt", "sharded", script=script, env=env, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    expected, got = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert expected.keys() == got.keys() and len(expected) == 18
    for name in expected:
        assert torch.equal(got[name], expected[name]), name
    # the steps did move the weights (so the comparison is not between two untouched models)
    torch.manual_seed(0)
    start = model_and_batch()[0].state_dict()
    assert not torch.equal(start["0.weight"], expected["0.weight"])
