"""The fused output-projection cross-entropy equals the textbook one, loss and gradients."""

import pytest
import torch
import torch.nn.functional as F

from frugality.kernels.output_loss import linear_cross_entropy


@pytest.mark.parametrize("tokens", [1, 64, 200])
def test_matches_cross_entropy_of_logits(tokens):
    torch.manual_seed(0)
    h = torch.randn(tokens, 48, dtype=torch.float64, requires_grad=True)
    w = torch.randn(1000, 48, dtype=torch.float64, requires_grad=True)
    y = torch.randint(0, 1000, (tokens,))
    ref = F.cross_entropy(h @ w.t(), y)
    ref_grads = torch.autograd.grad(ref * 3.0, (h, w))
    loss = linear_cross_entropy(h, w, y)
    grads = torch.autograd.grad(loss * 3.0, (h, w))
    torch.testing.assert_close(loss.double(), ref, rtol=1e-6, atol=1e-6)  # loss is float32
    for a, b in zip(grads, ref_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float32 softmax


def test_no_grad_and_bf16():
    torch.manual_seed(0)
    h = torch.randn(130, 32)
    w = torch.randn(500, 32) * 0.1
    y = torch.randint(0, 500, (130,))
    with torch.no_grad():
        loss = linear_cross_entropy(h.bfloat16(), w.bfloat16(), y)
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(F.cross_entropy(h @ w.t(), y).item(), rel=2e-2)


def test_without_grad_mode_no_gradient_is_computed():
    """needs_input_grad is True under torch.no_grad() too: evaluation must not pay for the
    gradient pass and its two matrix products. The reused logits buffer shows which ran."""
    from frugality.kernels import output_loss as loss_module

    torch.manual_seed(0)
    h = torch.randn(40, 32, requires_grad=True)
    w = torch.randn(300, 32, requires_grad=True)
    y = torch.randint(0, 300, (40,))
    with torch.no_grad():
        linear_cross_entropy(h, w, y)
    (buffer,) = loss_module._WORKSPACE.values()
    torch.testing.assert_close(buffer, h.detach() @ w.detach().t())  # still the logits
    loss = linear_cross_entropy(h, w, y)
    (buffer,) = loss_module._WORKSPACE.values()
    assert loss.requires_grad
    torch.testing.assert_close(buffer.sum(dim=1), torch.zeros(40), atol=1e-5, rtol=0)  # softmax - onehot


def test_under_autocast_the_products_run_in_bf16_and_grads_keep_their_dtype():
    torch.manual_seed(0)
    h = torch.randn(70, 32, requires_grad=True)
    w = (torch.randn(500, 32) * 0.1).requires_grad_()
    y = torch.randint(0, 500, (70,))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = linear_cross_entropy(h, w, y)
    loss.backward()
    assert h.grad.dtype == torch.float32 and w.grad.dtype == torch.float32
    ref = F.cross_entropy(h.bfloat16().float() @ w.bfloat16().float().t(), y)
    assert loss.item() == pytest.approx(ref.item(), rel=1e-2)
