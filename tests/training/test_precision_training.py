"""Training under the bf16 policies: exact resume, halved state, clear refusals."""

import json

import pytest
import torch

from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import load_recipe
from frugality.errors import UserError
from frugality.models import build_model
from frugality.precision import get_policy
from frugality.runtime.optim import build_optimizer
from frugality.training import trainer

EAGER = "train.fused_optimizer=false"  # the compiled update is tested in tests/precision


def _final_state(recipe, run_dir):
    policy = get_policy(recipe.train.precision)
    model = policy.prepare_model(build_model(recipe.model))
    optimizer = build_optimizer(model, recipe.optim, policy, seed=recipe.seed, fused=False)
    CheckpointManager(run_dir / "checkpoints").load(
        CheckpointManager(run_dir / "checkpoints").latest(), model, optimizer
    )
    return model.state_dict(), optimizer.state_dict()


def _train_losses(run_dir) -> list[float]:
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if r["kind"] == "train"]


@pytest.mark.parametrize(
    "precision,device",
    [
        ("bf16-sr", "cpu"),
        ("bf16", "cpu"),
        # On a GPU with the fused (compiled) update; the checkpoints load on the CPU below.
        pytest.param("bf16-sr", "cuda", marks=pytest.mark.cuda),
    ],
)
def test_stop_and_resume_is_bit_identical(micro_recipe_file, tmp_path, precision, device):
    overrides = [f"train.precision={precision}", f"train.device={device}"]
    recipe = load_recipe(str(micro_recipe_file), overrides + ([EAGER] if device == "cpu" else []))
    trainer.train(recipe, run_dir=tmp_path / "straight", progress=False, tensorboard=False)
    trainer.train(recipe, run_dir=tmp_path / "split", until_step=3, progress=False, tensorboard=False)
    trainer.train(recipe, run_dir=tmp_path / "split", progress=False, tensorboard=False)
    (model_a, optim_a), (model_b, optim_b) = (_final_state(recipe, tmp_path / d) for d in ("straight", "split"))
    for k in model_a:
        assert model_a[k].dtype == torch.bfloat16
        assert torch.equal(model_a[k], model_b[k]), k
    for i, state in optim_a["state"].items():
        for k, v in state.items():
            assert torch.equal(v, optim_b["state"][i][k]), (i, k)
    losses = [_train_losses(tmp_path / d) for d in ("straight", "split")]
    assert losses[0] == losses[1]


def test_bf16_sr_state_is_at_most_half_of_amp_bf16(micro_recipe_file, tmp_path):
    measured = {}
    for precision in ("amp-bf16", "bf16-sr"):
        recipe = load_recipe(str(micro_recipe_file), [f"train.precision={precision}", "train.steps=2", EAGER])
        result = trainer.train(recipe, run_dir=tmp_path / precision, progress=False, tensorboard=False)
        measured[precision] = result.summary["memory"]["bytes_per_param"]
        assert result.summary["memory"]["peak_memory_bytes"] > 0
    # 16 and 8 bytes per parameter, plus a few bytes of step counters.
    assert measured["amp-bf16"] == pytest.approx(16, abs=1e-3)
    assert measured["bf16-sr"] == pytest.approx(8, abs=1e-3)
    assert measured["bf16-sr"] <= 0.5 * measured["amp-bf16"]


def test_fp8_off_cuda_fails_before_anything_is_written(micro_recipe_file, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine may run fp8")
    recipe = load_recipe(str(micro_recipe_file), ["train.precision=fp8"])
    with pytest.raises(UserError, match="fp8 needs a CUDA GPU"):
        trainer.train(recipe, run_dir=tmp_path / "run", progress=False)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_fp8_converts_the_blocks_linears_and_trains_on_a_gpu_of_capability_8_9_or_later(
    micro_recipe_file, tmp_path, device
):
    """The CPU case (CI's twin) checks which layers fp8 takes; a GPU also converts and trains."""
    from frugality.precision import float8_eligible

    recipe = load_recipe(str(micro_recipe_file), ["train.precision=fp8", f"train.device={device}", "train.steps=16"])
    model = build_model(recipe.model)
    eligible = {name for name, m in model.named_modules() if float8_eligible(m, name)}
    linears = {name for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert "output" in linears and "output" not in eligible and len(eligible) == 4 * 2  # each block's four
    if device == "cpu":
        return
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 matrix products need compute capability 8.9 or later")
    from torchao.float8.float8_linear import Float8Linear

    converted = get_policy("fp8").prepare_model(model.cuda())
    kinds = {name: type(m) for name, m in converted.named_modules() if isinstance(m, torch.nn.Linear)}
    assert {name for name, kind in kinds.items() if kind is Float8Linear} == eligible  # the output layer stays

    trainer.train(recipe, run_dir=tmp_path / "fp8", progress=False, tensorboard=False)
    reference = load_recipe(str(micro_recipe_file), ["train.precision=amp-bf16", "train.device=cuda", "train.steps=16"])
    trainer.train(reference, run_dir=tmp_path / "amp", progress=False, tensorboard=False)
    fp8, amp = _train_losses(tmp_path / "fp8"), _train_losses(tmp_path / "amp")
    assert all(map(torch.isfinite, torch.tensor(fp8)))
    assert fp8[-1] < 0.8 * fp8[0]  # it learns
    # float8 linears with dynamic per-tensor scales: close to bf16 autocast on the same batches
    assert fp8[-1] == pytest.approx(amp[-1], rel=0.05)
