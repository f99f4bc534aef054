"""Cross-entropy fused with the output projection.

A language model's last step, logits = h @ W^T over a 50k vocabulary, produces the
largest tensor of the step (tokens x vocab), and the textbook path then makes three more
of that size: the float32 copy, log-softmax, and its gradient. Here the forward pass
computes the loss and the gradient with respect to the logits together, a few rows at a
time in float32 (chunks small enough to stay in cache), overwriting the logits buffer with
its own gradient, and finishes both weight and input gradients with two matrix products.
The backward pass only scales them. Memory: one tokens x vocab buffer in the compute dtype
instead of four, half of them float32.

The gradient is (softmax(logits) - onehot(target)) / tokens, the exact derivative of the
mean cross-entropy; the loss is computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import torch

_ROWS_PER_CHUNK = 64  # 64 x 50k float32 = 12.9 MB: within a server CPU's L3


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _workspace(shape: tuple[int, int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The tokens x vocab buffer, kept between steps: allocating hundreds of MB afresh each
    step costs page faults (about 50 ms per 200 MB on a CPU). It never outlives its use
    within one forward, so reusing it across steps and micro-batches is safe."""
    key = (shape, dtype, device)
    if key not in _WORKSPACE:
        _WORKSPACE.clear()  # one live buffer: a new shape (e.g. evaluation) replaces it
        _WORKSPACE[key] = torch.empty(shape, dtype=dtype, device=device)
    return _WORKSPACE[key]


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        device_type = hidden.device.type
        dtype = (torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type)
                 else hidden.dtype)
        ctx.dtypes = hidden.dtype, weight.dtype
        with torch.autocast(device_type, enabled=False):  # casts are explicit below
            return _LinearCrossEntropy._forward(ctx, hidden.to(dtype), weight.to(dtype), targets)

    @staticmethod
    def _forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = _workspace((hidden.shape[0], weight.shape[0]), hidden.dtype, hidden.device)
        torch.mm(hidden, weight.t(), out=logits)
        n = logits.shape[0]
        total = torch.zeros((), dtype=torch.float32, device=logits.device)
        want_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        buffer = torch.empty(min(n, _ROWS_PER_CHUNK), logits.shape[1], dtype=torch.float32,
                             device=logits.device)
        for start in range(0, n, _ROWS_PER_CHUNK):
            rows = logits[start : start + _ROWS_PER_CHUNK]
            x = buffer[: rows.shape[0]]
            x.copy_(rows)  # float32 working copy, reused so no chunk allocates
            target = targets[start : start + _ROWS_PER_CHUNK, None]
            shift = x.amax(dim=-1, keepdim=True)
            target_logit = x.gather(1, target)
            x.sub_(shift).exp_()
            sum_exp = x.sum(dim=-1, keepdim=True)
            # loss per row = logsumexp - target logit = log(sum_exp) + shift - target logit
            total += (sum_exp.log() + shift - target_logit).sum()
            if want_grad:
                x.div_(sum_exp * n)  # softmax / n
                x.scatter_add_(1, target, torch.full(target.shape, -1.0 / n, device=x.device))
                rows.copy_(x)
        if want_grad:
            grad_logits = logits  # now holds d(mean loss)/d(logits)
            ctx.save_for_backward(grad_logits @ weight, grad_logits.t() @ hidden)
        return total / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = grad_output.to(grad_hidden.dtype)
        return (grad_hidden * scale).to(hidden_dtype), (grad_weight * scale).to(weight_dtype), None


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, without materialising
    float32 logits. hidden: (tokens, d); weight: (vocab, d); targets: (tokens,) int64."""
    return _LinearCrossEntropy.apply(hidden, weight, targets)


def logits_or_loss(hidden: torch.Tensor, output: torch.nn.Linear, targets: torch.Tensor | None) -> torch.Tensor:
    """A decoder's last step: logits (B, T, vocab), or with next-token `targets` (B, T) the
    mean cross-entropy through `linear_cross_entropy`."""
    if targets is None:
        return output(hidden)
    return linear_cross_entropy(hidden.flatten(0, 1), output.weight, targets.flatten())
