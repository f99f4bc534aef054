"""The cross-entropy row kernels (C on CPUs, a compiled graph on GPUs) against torch's own
cross-entropy: loss, gradient, bad input."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from frugality import kernels
from frugality.kernels.output_loss import rows_compiled, rows_fused, rows_in_c, rows_in_torch


def _reference(logits: torch.Tensor, targets: torch.Tensor):
    x = logits.double().requires_grad_()
    losses = F.cross_entropy(x, targets, reduction="none")
    (grad,) = torch.autograd.grad(losses.mean(), x)
    return losses, grad


@pytest.mark.c_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_torch_cross_entropy(dtype):
    assert kernels.cross_entropy("bf16") is not None, "the C kernel should build where a C compiler exists"
    torch.manual_seed(0)
    logits = (torch.randn(37, 1001) * 4).to(dtype)  # odd sizes: vector loops' remainders
    targets = torch.randint(0, 1001, (37,))
    ref_losses, ref_grad = _reference(logits, targets)
    work = logits.clone()
    losses = rows_in_c(work, targets, 1.0 / 37, want_grad=True)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-6, atol=1e-6)
    tolerance = dict(rtol=1e-5, atol=1e-8) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(work.double(), ref_grad, **tolerance)  # rounded once to dtype


def test_without_grad_the_logits_are_left_alone():
    logits = torch.randn(5, 300)
    work = logits.clone()
    rows_in_c(work, torch.tensor([0, 1, 2, 3, 299]), 0.2, want_grad=False)
    assert torch.equal(work, logits)


@pytest.mark.c_kernel
def test_strided_rows_and_agreement_with_the_torch_ops_path():
    torch.manual_seed(1)
    big = torch.randn(6, 700, dtype=torch.bfloat16)
    tail = big[:, 500:].clone()
    targets = torch.randint(0, 500, (6,))
    expected = big[:, :500].clone()
    expected_losses = rows_in_torch(expected, targets, 0.5, True)
    losses = rows_in_c(big[:, :500], targets, 0.5, True)  # rows 700 elements apart
    torch.testing.assert_close(losses, expected_losses, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(big[:, :500].float(), expected.float(), rtol=8e-3, atol=1e-6)
    assert torch.equal(big[:, 500:], tail)  # columns past the view untouched


@pytest.mark.c_kernel
def test_a_nan_row_gives_a_nan_loss_and_leaves_other_rows_finite():
    logits = torch.randn(3, 64)
    logits[1, 5] = float("nan")
    losses = rows_in_c(logits, torch.tensor([0, 0, 0]), 1 / 3, True)
    assert torch.isnan(losses[1]) and torch.isfinite(losses[[0, 2]]).all()
    assert torch.isnan(logits[1]).all() and torch.isfinite(logits[[0, 2]]).all()


DEVICES = [pytest.param("cpu", marks=pytest.mark.c_kernel), pytest.param("cuda", marks=pytest.mark.cuda)]


def _served(device: str):
    """The path that serves each device's rows: the C kernel on CPUs, the compiled function on GPUs."""
    return rows_in_c if device == "cpu" else rows_compiled


@pytest.mark.parametrize("device", DEVICES)
def test_a_target_outside_the_vocabulary_is_an_error(device):
    # (on a GPU said before the index stops the device with an assert)
    with pytest.raises(IndexError, match=r"1 target\(s\) outside the vocabulary \[0, 64\)"):
        _served(device)(torch.randn(3, 64, device=device), torch.tensor([0, 64, 1], device=device), 1 / 3, True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_graph_gpus_compile_matches_torch_cross_entropy(dtype):
    """`rows_fused` run eagerly: the math that GPUs compile (the compiled form is checked
    on a GPU below; on CPUs the C kernel serves instead)."""
    torch.manual_seed(0)
    logits = (torch.randn(37, 1001) * 4).to(dtype)
    targets = torch.randint(0, 1001, (37,))
    ref_losses, ref_grad = _reference(logits, targets)
    work = logits.clone()
    losses = rows_fused(work, targets, torch.tensor(1.0 / 37), want_grad=True)
    torch.testing.assert_close(losses.double(), ref_losses, rtol=1e-6, atol=1e-6)
    tolerance = dict(rtol=1e-5, atol=1e-8) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-6)
    torch.testing.assert_close(work.double(), ref_grad, **tolerance)
    assert rows_compiled(logits.clone(), targets, 1.0 / 37, True) is None  # not on CPUs


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rows_each_device_serves_match_torch_cross_entropy(dtype, device):
    """A GPU's compiled rows at a real vocabulary; the CPU's kernel (CI's twin) at a small one."""
    torch.manual_seed(0)
    tokens, vocab = (300, 50304) if device == "cuda" else (37, 1001)
    logits = (torch.randn(tokens, vocab) * 4).to(dtype)
    targets = torch.randint(0, vocab, (tokens,))
    ref_losses, ref_grad = _reference(logits, targets)
    work = logits.to(device, copy=True)  # (the rows write their gradient over it)
    losses = _served(device)(work, targets.to(device), 1.0 / tokens, want_grad=True)
    assert losses is not None, f"{_served(device).__name__} should serve on {device}"
    torch.testing.assert_close(losses.cpu().double(), ref_losses, rtol=1e-5, atol=1e-5)
    tolerance = dict(rtol=1e-4, atol=1e-9) if dtype == torch.float32 else dict(rtol=8e-3, atol=1e-7)
    torch.testing.assert_close(work.cpu().double(), ref_grad, **tolerance)
    # the chunked torch-ops fallback agrees with it
    chunked = logits.to(device, copy=True)
    torch.testing.assert_close(
        rows_in_torch(chunked, targets.to(device), 1.0 / tokens, True), losses, rtol=1e-5, atol=1e-5
    )
    torch.testing.assert_close(chunked.float(), work.float(), rtol=8e-3, atol=1e-7)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_every_shape_is_served_by_the_devices_own_rows(device):
    """One process may train several models (a benchmark, a test session): on a GPU, dynamo
    allows 8 compilations per function by default and the graph is compiled per shape, so
    more than 8 shapes must still be served compiled (the limit is raised around its call),
    with the torch ops' losses. On the CPU (CI's twin) the same shapes go to the CPU's own
    rows, the compiled function left out."""
    import frugality.kernels.output_loss as output_loss

    for tokens, vocab in [
        (3, 64),
        (5, 100),
        (17, 1000),
        (40, 333),
        (64, 50304),
        (7, 8),
        (9, 65),
        (11, 512),
        (13, 2048),
    ]:
        logits = torch.randn(tokens, vocab, device=device, dtype=torch.bfloat16)
        targets = torch.randint(0, vocab, (tokens,), device=device)
        reference = rows_in_torch(logits.clone(), targets, 1.0 / tokens, False)
        with warnings.catch_warnings():
            warnings.filterwarnings("error", message="compiled cross-entropy failed")  # the fallback's
            losses = output_loss.rows(logits, targets, 1.0 / tokens, True)
        if device == "cuda":
            assert output_loss._COMPILED["fn"] is not None  # compiled, every shape
        else:
            assert rows_compiled(logits.clone(), targets, 1.0 / tokens, True) is None
        torch.testing.assert_close(losses.float(), reference.float(), rtol=1e-2, atol=1e-2)
