"""amp-fp16's dynamic loss scaling on the CPU (torch's GradScaler runs there; fp16 products
are emulated, slow but exact to fp16's rules): overflows skip the step without being bad
steps, the scale backs off and grows, a resumed run continues bit for bit, and what it
does not run with is refused in one line."""

import json

import pytest
import torch

from frugality.checkpoint import CheckpointManager
from frugality.config.recipe import load_recipe
from frugality.distributed import World
from frugality.errors import UserError
from frugality.models import build_model
from frugality.precision import get_policy
from frugality.precision.loss_scale import LossScaler
from frugality.runtime.layout import check_loss_scaling, plan_layout
from frugality.runtime.optim import build_optimizer
from frugality.runtime.state import build_state
from frugality.training import loop, trainer

# one micro-batch of 2 a step: fp16 products are emulated on CPUs (about 1 GFLOP/s), and the
# output layer's dominate
FP16 = ["train.precision=amp-fp16", "train.fused_optimizer=false", "data.global_batch_size=2"]


def _records(run_dir, kind="train") -> list[dict]:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return [r for r in map(json.loads, lines) if r["kind"] == kind]


def _train(recipe_file, run_dir, *overrides, **kwargs):
    recipe = load_recipe(str(recipe_file), [*FP16, *overrides])
    return trainer.train(recipe, run_dir=run_dir, progress=False, tensorboard=False, **kwargs)


def test_an_overflow_skips_the_step_without_a_bad_step_and_halves_the_scale(micro_recipe_file, tmp_path):
    # 2**20: the scaled gradients overflow fp16 (max 65504) until the scale has halved enough
    # (measured: 2**16 fits, 2**17 overflows). on_nonfinite = "stop": a bad step would end the run.
    result = _train(micro_recipe_file, tmp_path / "run", "train.loss_scale=1048576", "train.on_nonfinite=stop")
    records = _records(tmp_path / "run")
    logged = _records(tmp_path / "run", "overflow")  # a record of its own for every overflow
    overflows = [r for r in records if "overflow" in r]
    assert overflows and overflows == records[: len(overflows)]  # the first steps, then none
    assert len(overflows) < len(records)
    assert all("skipped" not in r for r in records)  # not bad steps
    scales = [r["loss_scale"] for r in records]
    assert scales[: len(overflows) + 1] == [2.0**20 / 2**i for i in range(len(overflows) + 1)]
    assert result.summary["loss_scale"] == {"final": 2.0**20 / 2 ** len(overflows), "overflow_steps": len(overflows)}
    assert [r["step"] for r in logged] == [r["step"] for r in overflows]
    assert [r["loss_scale"] for r in logged] == scales[: len(overflows)]
    assert records[-1]["loss"] < records[0]["loss"]  # the applied steps trained


def test_a_skipped_step_leaves_the_weights_and_the_optimizer_as_they_were(micro_recipe_file):
    recipe = load_recipe(str(micro_recipe_file), [*FP16, "train.loss_scale=1099511627776"])
    state = build_state(plan_layout(recipe, torch.device("cpu")))
    before = {k: v.clone() for k, v in state.model.state_dict().items()}
    batch = torch.randint(0, 50304, (2, 33))
    loss, norm, rejected = loop.train_step(state, [batch])
    assert rejected is None and state.loss_scaler.overflowed and not torch.isfinite(torch.tensor(norm))
    assert all(torch.equal(before[k], v) for k, v in state.model.state_dict().items())
    assert not state.optimizer.state  # no moments were made
    assert all(p.grad is None for p in state.model.parameters())
    assert state.loss_scaler.scale == 2.0**39


@pytest.mark.slow
def test_the_scale_doubles_after_a_window_without_an_overflow_and_training_matches_fp32(micro_recipe_file, tmp_path):
    _train(micro_recipe_file, tmp_path / "fp16", "train.loss_scale=16", "train.loss_scale_window=2")
    assert [r["loss_scale"] for r in _records(tmp_path / "fp16")] == [16, 16, 32, 32, 64, 64, 128, 128]
    recipe = load_recipe(str(micro_recipe_file), ["train.precision=fp32", *FP16[1:]])
    trainer.train(recipe, run_dir=tmp_path / "fp32", progress=False, tensorboard=False)
    fp16, fp32 = (_records(tmp_path / d, "eval")[-1]["loss"] for d in ("fp16", "fp32"))
    assert fp16 == pytest.approx(fp32, rel=1e-3)  # fp16 products, fp32 master weights


def _final(recipe, run_dir):
    policy = get_policy("amp-fp16")
    model = policy.prepare_model(build_model(recipe.model))
    optimizer = build_optimizer(model, recipe.optim, policy, seed=recipe.seed, fused=False)
    manager = CheckpointManager(run_dir / "checkpoints")
    manager.load(manager.latest(), model, optimizer)
    return model.state_dict(), optimizer.state_dict()


@pytest.mark.slow
def test_stop_and_resume_is_bit_identical_with_the_scale_and_its_counters(micro_recipe_file, tmp_path):
    # window 3 and overflows at the start: the checkpoint at step 3 is taken before any update
    # (Adam's step counts must stay 0 in it), then a window and a back-off follow
    scaling = ["train.loss_scale=262144", "train.loss_scale_window=3"]
    straight = _train(micro_recipe_file, tmp_path / "straight", *scaling)
    _train(micro_recipe_file, tmp_path / "split", *scaling, until_step=3)
    split = _train(micro_recipe_file, tmp_path / "split", *scaling)
    assert straight.summary["loss_scale"] == split.summary["loss_scale"]
    assert straight.summary["loss_scale"]["overflow_steps"] >= 1
    recipe = load_recipe(str(micro_recipe_file), FP16)
    (model_a, optim_a), (model_b, optim_b) = (_final(recipe, tmp_path / d) for d in ("straight", "split"))
    for k in model_a:
        assert torch.equal(model_a[k], model_b[k]), k
    for i, state in optim_a["state"].items():
        for k, v in state.items():
            assert torch.equal(v, optim_b["state"][i][k]), (i, k)
    runs = [_records(tmp_path / d) for d in ("straight", "split")]
    assert [(r["loss"], r["loss_scale"]) for r in runs[0]] == [(r["loss"], r["loss_scale"]) for r in runs[1]]


def test_a_bad_step_leaves_the_scale_and_its_count_of_clean_steps_and_a_resume_keeps_the_recipes_window():
    weight = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([weight], lr=0.1)

    def step(scaler, grad, overflow, applied):
        weight.grad = scaler.scale_loss(torch.full((3,), grad))
        scaler.unscale(optimizer)
        scaler.update(overflow, applied)

    scaler = LossScaler(torch.device("cpu"), init_scale=16.0, window=2)
    step(scaler, 1.0, False, True)  # one clean step of the two a doubling takes
    for _ in range(3):  # bad steps (a non-finite loss): neither clean steps nor overflows
        step(scaler, float("nan"), False, False)
    assert scaler.scale == 16.0 and scaler.overflows == 0
    step(scaler, 1.0, False, True)  # the second clean step
    assert scaler.scale == 32.0
    step(scaler, float("inf"), True, False)  # an overflow
    assert scaler.scale == 16.0 and scaler.overflows == 1
    resumed = LossScaler(torch.device("cpu"), init_scale=16.0, window=5)
    resumed.load_state_dict(scaler.state_dict())  # saved with window 2
    assert resumed.scale == 16.0 and resumed.overflows == 1 and resumed.scaler.get_growth_interval() == 5


def test_an_overflow_is_the_scales_fault_only_above_a_scale_of_one():
    scaler = LossScaler(torch.device("cpu"), init_scale=8.0, window=10)
    assert scaler.is_overflow(2.0, float("inf"))
    assert scaler.is_overflow(2.0, float("nan"))
    assert not scaler.is_overflow(2.0, 1.5)
    assert not scaler.is_overflow(float("nan"), float("nan"))  # the forward overflowed: a bad step
    scaler.load_state_dict({**scaler.state_dict(), "scale": 1.0})
    assert not scaler.is_overflow(2.0, float("inf"))  # unscaled gradients overflow: a bad step


@pytest.mark.parametrize(
    "world,overrides,layout",
    [
        (World(0, 2), ["parallel.data=fsdp"], "parallel.data fsdp"),
        (World(0, 2), ["parallel.data=hsdp"], "parallel.data hsdp"),
        (World(0, 2, tensor=2), ["parallel.tensor=2"], "tensor parallel"),
        (World(0, 2), ["parallel.pipeline=2"], "pipeline parallel"),
    ],
)
def test_layouts_loss_scaling_does_not_run_with_are_refused_in_one_line(micro_recipe_file, world, overrides, layout):
    recipe = load_recipe(str(micro_recipe_file), [*FP16, *overrides])
    with pytest.raises(UserError, match=f"amp-fp16 \\(loss scaling\\) does not run with {layout} yet") as e:
        check_loss_scaling(recipe, world)
    assert "\n" not in str(e.value)
    check_loss_scaling(load_recipe(str(micro_recipe_file), FP16), World(0, 2))  # ddp runs


def test_amp_fp16_on_an_xla_device_is_refused():
    refusal = r"amp-fp16 is for CUDA GPUs without bf16 \(T4, V100\), not xla devices: use auto or amp-bf16"
    with pytest.raises(UserError, match=refusal):
        get_policy("amp-fp16").check_device(torch.device("xla"))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_amp_fp16_trains_like_amp_bf16(micro_recipe_file, tmp_path, device):
    """On a GPU: 16 steps, the fused update, TF32 on (train.tf32's default); the CPU case is CI's
    twin of the same contract in a few steps."""
    steps = 16 if device == "cuda" else 4
    fused = "true" if device == "cuda" else "false"
    same = [f"train.device={device}", f"train.steps={steps}", f"train.fused_optimizer={fused}"]
    fp16 = _train(micro_recipe_file, tmp_path / "fp16", *same)
    # the same global batch as fp16's (the two once trained on batches of 2 and 4)
    bf16 = load_recipe(str(micro_recipe_file), ["train.precision=amp-bf16", FP16[-1], *same])
    assert bf16.data.global_batch_size == load_recipe(str(micro_recipe_file), [*FP16, *same]).data.global_batch_size
    trainer.train(bf16, run_dir=tmp_path / "bf16", progress=False, tensorboard=False)
    losses = [_records(tmp_path / d, "eval")[-1]["loss"] for d in ("fp16", "bf16")]
    assert losses[0] == pytest.approx(losses[1], rel=0.01)
    # both learned (a run whose steps were all skipped would sit at its first loss, as close)
    assert all(
        loss < _records(tmp_path / d)[0]["loss"] - 0.05 for loss, d in zip(losses, ("fp16", "bf16"), strict=True)
    )
    assert fp16.summary["loss_scale"]["overflow_steps"] < steps  # most steps applied
    if device == "cuda" and torch.cuda.get_device_capability() >= (8, 0):
        assert torch.backends.cuda.matmul.fp32_precision == "tf32"  # train.tf32's default
