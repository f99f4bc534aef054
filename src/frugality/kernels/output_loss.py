"""Cross-entropy fused with the output projection: `FusedOutputLayer`, swapped in for the
models' plain `OutputLayer` for training by `frugality.kernels.specialize`.

A language model's last step, logits = h @ W^T over a 50k vocabulary, produces the
largest tensor of the step (tokens x vocab), and the textbook path then makes three more
of that size: the float32 copy, log-softmax, and its gradient. Here the forward pass
computes the loss and the gradient with respect to the logits together, row by row in
float32, overwriting the logits buffer with its own gradient, and finishes both weight and
input gradients with two matrix products; the backward pass only scales them (when the
loss was scaled at all). On CPUs the rows go through a C kernel (kernels/
cross_entropy_cpu.c: one read and one write of the logits, about twice as fast as torch
ops here); on GPUs through one compiled (Triton) function over all rows, which reads the
logits twice and writes their gradient in place; failing both, through torch ops in
chunks of rows. Memory: one tokens x vocab buffer in the compute dtype instead of four,
half of them float32.

The gradient is (softmax(logits) - onehot(target)) / tokens, the exact derivative of the
mean cross-entropy; the loss is computed in float32 whatever the compute dtype.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

import torch

from frugality import kernels
from frugality.kernels.linear import amx_product_applies, amx_product_into, product, weight_grad, weight_grad_applies
from frugality.models.layers import OutputLayer

_ROWS_PER_CHUNK = 64  # 64 x 50k float32 = 12.9 MB: within a server CPU's L3
CHUNK_BYTES_OFF_CPU = 256 << 20  # GPUs: few, large chunks (each chunk is ~10 kernel launches)


_WORKSPACE: dict[tuple, torch.Tensor] = {}


def _workspace(shape: tuple[int, int], dtype: torch.dtype, device: torch.device, keep: bool = True) -> torch.Tensor:
    """The tokens x vocab buffer, kept between steps (`keep`): allocating hundreds of MB afresh
    each step costs page faults (about 50 ms per 200 MB on a CPU). It never outlives its use
    within one forward, so reusing it across steps and micro-batches is safe. Not kept, it is
    given back when the forward ends: under activation checkpointing, where memory is what
    was asked for, it would otherwise sit beside the gradients and the optimizer's moments
    at the step's peak (Pythia-70m at 4 x 512 in fp32: 393 MiB, more than the activations
    full recomputation keeps)."""
    key = (shape, dtype, device)
    if not keep:
        _WORKSPACE.clear()
        return torch.empty(shape, dtype=dtype, device=device)
    if key not in _WORKSPACE:
        _WORKSPACE.clear()  # one live buffer: a new shape (e.g. evaluation) replaces it
        _WORKSPACE[key] = torch.empty(shape, dtype=dtype, device=device)
    return _WORKSPACE[key]


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        grad_mode: bool,
        compute_dtype: torch.dtype | None,
        keep_workspace: bool = True,
    ) -> torch.Tensor:
        device_type = hidden.device.type
        dtype = compute_dtype or (
            torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
        )
        ctx.dtypes = hidden.dtype, weight.dtype
        # needs_input_grad says True under torch.no_grad() too; without the caller's grad
        # mode, evaluation would pay for the gradient's two products (2/3 of the layer).
        want_grad = grad_mode and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        with torch.autocast(device_type, enabled=False):  # casts are explicit below
            return LinearCrossEntropy._forward(
                ctx, hidden.to(dtype), weight.to(dtype), targets, want_grad, keep_workspace
            )

    @staticmethod
    def _forward(
        ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, want_grad: bool, keep: bool
    ) -> torch.Tensor:
        logits = _workspace((hidden.shape[0], weight.shape[0]), hidden.dtype, hidden.device, keep)
        amx_layout = _transpose_first(hidden)
        if amx_product_applies(hidden, weight, None, transposed=True):  # AMX: the weight as it is
            amx_product_into(hidden, weight, None, True, logits)
        else:
            torch.mm(hidden, kernels.transposed(weight) if amx_layout else weight.t(), out=logits)
        n = logits.shape[0]
        # Over the rows, in place: the loss per row, and (softmax - onehot) / n if wanted.
        # the row pass's own profiler range, apart from this Function's products (`bench profile`)
        with torch.profiler.record_function("frugality::cross_entropy_rows"):
            row_losses = rows(logits, targets, 1.0 / n, want_grad)
        if want_grad:
            grad_logits = logits  # now holds d(mean loss)/d(logits)
            if weight_grad_applies(grad_logits, hidden):  # AMX: straight into the weight's layout
                grad_weight = weight_grad(grad_logits, hidden)[0]
            elif amx_layout:  # (hidden^T @ grad_logits)^T: the same product, laid out for AMX
                grad_weight = kernels.transposed(kernels.transposed(hidden) @ grad_logits)
            else:
                grad_weight = grad_logits.t() @ hidden
            grad_hidden = (
                product(grad_logits, weight, None, False)
                if amx_product_applies(grad_logits, weight, None, transposed=False)
                else grad_logits @ weight
            )
            ctx.save_for_backward(grad_hidden, grad_weight)
        return row_losses.sum() / n

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        if grad_output.device.type == "cpu" and grad_output.item() == 1.0:
            # the usual case: scaling two 25M-element tensors by one would cost ~30 ms
            return grad_hidden.to(hidden_dtype), grad_weight.to(weight_dtype), None, None, None, None
        scale = grad_output.to(grad_hidden.dtype)
        return (grad_hidden * scale).to(hidden_dtype), (grad_weight * scale).to(weight_dtype), None, None, None, None


def _transpose_first(hidden: torch.Tensor) -> bool:
    """Whether to hand oneDNN the (d, vocab) layout: for 2-byte dtypes on CPUs its AMX
    products took 150-170 ms instead of 270 (forward) and 200-250 instead of 280-350
    (weight gradient) on a 2-core Xeon at 2048 tokens x 512 x 50k, for 20 ms of
    transposing each."""
    return hidden.device.type == "cpu" and hidden.element_size() == 2


def rows(logits: torch.Tensor, targets: torch.Tensor, scale: float, want_grad: bool) -> torch.Tensor:
    """The rows' losses (float32), and with `want_grad` their gradient times `scale` written
    over `logits`: through the CPU kernel, else the compiled function (GPUs), else torch ops."""
    losses = rows_in_c(logits, targets, scale, want_grad)
    if losses is None:
        losses = rows_compiled(logits, targets, scale, want_grad)
    return losses if losses is not None else rows_in_torch(logits, targets, scale, want_grad)


def rows_in_c(logits: torch.Tensor, targets: torch.Tensor, scale: float, want_grad: bool):
    """The CPU kernel (cross_entropy_cpu.c): one read and one write of the logits. None
    where it does not apply (other devices and dtypes, no C compiler)."""
    names = {torch.bfloat16: "bf16", torch.float32: "f32"}
    if logits.device.type != "cpu" or logits.dtype not in names or logits.stride(1) != 1:
        return None
    kernel = kernels.cross_entropy(names[logits.dtype])
    if kernel is None:
        return None
    targets = targets.to(torch.int64).contiguous()
    losses = torch.empty(logits.shape[0], dtype=torch.float32)
    bad = kernel(
        logits.data_ptr(),
        logits.shape[0],
        logits.shape[1],
        logits.stride(0),
        targets.data_ptr(),
        scale,
        int(want_grad),
        losses.data_ptr(),
        torch.get_num_threads(),
    )
    if bad < 0:
        raise MemoryError("cross-entropy: could not allocate a row buffer")
    if bad:
        raise IndexError(f"cross-entropy: {bad} target(s) outside the vocabulary [0, {logits.shape[1]})")
    return losses


def rows_fused(logits: torch.Tensor, targets: torch.Tensor, scale: torch.Tensor, want_grad: bool) -> torch.Tensor:
    """The rows' losses, and their gradient written over `logits`, as one graph for
    torch.compile: a reduction (max, then the sum of exponentials) and one elementwise
    pass, both reading the logits in their own dtype and computing in float32."""
    x = logits.float()
    shift = x.amax(dim=-1, keepdim=True)
    log_sum_exp = (x - shift).exp().sum(dim=-1, keepdim=True).log() + shift
    losses = (log_sum_exp - x.gather(1, targets[:, None])).squeeze(1)
    if want_grad:
        onehot = torch.arange(x.shape[1], device=x.device) == targets[:, None]
        logits.copy_(((x - log_sum_exp).exp() - onehot.to(x.dtype)) * scale)
    return losses


_COMPILED: dict[str, Callable | None] = {}


def rows_compiled(logits: torch.Tensor, targets: torch.Tensor, scale: float, want_grad: bool):
    """`rows_fused` compiled, off CPUs (where the C kernel serves); None if it does not
    apply or failed to compile once in this process (the caller then uses torch ops)."""
    if logits.device.type == "cpu":
        return None
    # An index past the vocabulary would stop the GPU with a device-side assert (in this
    # path and in the torch-ops fallback); say so instead, as the CPU kernel does (one
    # small reduction and a sync per step).
    bad = int(((targets < 0) | (targets >= logits.shape[1])).sum())
    if bad:
        raise IndexError(f"cross-entropy: {bad} target(s) outside the vocabulary [0, {logits.shape[1]})")
    if "fn" not in _COMPILED:
        _COMPILED["fn"] = torch.compile(rows_fused, dynamic=False, fullgraph=True)
    if _COMPILED["fn"] is None:
        return None
    scale_tensor = torch.tensor(scale, dtype=torch.float32, device=logits.device)  # no recompile per n
    try:
        # Static shapes (symbolic ones made the step 3-4 ms slower on an H100): a graph per
        # token count, vocabulary, dtype and gradient mode. A process that trains several
        # models (a benchmark, a test session) needs more than dynamo's default of 8.
        with torch._dynamo.config.patch(recompile_limit=64):
            return _COMPILED["fn"](logits, targets.to(torch.int64), scale_tensor, want_grad)
    except Exception as e:  # e.g. no Triton for this GPU; nothing was written before the failure
        warnings.warn(
            f"compiled cross-entropy failed ({type(e).__name__}: {e}); using torch ops for the rest of this run",
            stacklevel=1,
        )
        _COMPILED["fn"] = None
        return None


def rows_in_torch(logits: torch.Tensor, targets: torch.Tensor, scale: float, want_grad: bool):
    """The same with torch ops, in chunks of rows in float32: on CPUs small enough to stay
    in cache, elsewhere large enough that kernel launches don't dominate."""
    n = logits.shape[0]
    rows_per_chunk = (
        _ROWS_PER_CHUNK
        if logits.device.type == "cpu"
        else max(_ROWS_PER_CHUNK, CHUNK_BYTES_OFF_CPU // (4 * logits.shape[1]))
    )
    losses = torch.empty(n, dtype=torch.float32, device=logits.device)
    buffer = torch.empty(min(n, rows_per_chunk), logits.shape[1], dtype=torch.float32, device=logits.device)
    for start in range(0, n, rows_per_chunk):
        rows = logits[start : start + rows_per_chunk]
        x = buffer[: rows.shape[0]]
        x.copy_(rows)  # float32 working copy, reused so no chunk allocates
        target = targets[start : start + rows_per_chunk, None]
        shift = x.amax(dim=-1, keepdim=True)
        target_logit = x.gather(1, target)
        x.sub_(shift).exp_()
        sum_exp = x.sum(dim=-1, keepdim=True)
        # loss per row = logsumexp - target logit = log(sum_exp) + shift - target logit
        losses[start : start + rows.shape[0]] = (sum_exp.log() + shift - target_logit).squeeze(1)
        if want_grad:
            x.mul_(scale / sum_exp)
            x.scatter_add_(1, target, torch.full(target.shape, -scale, device=x.device))
            rows.copy_(x)
    return losses


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    compute_dtype: torch.dtype | None = None,
    keep_workspace: bool = True,
) -> torch.Tensor:
    """Mean cross-entropy of `hidden @ weight.T` against `targets`, without materialising
    float32 logits. hidden: (tokens, d); weight: (vocab, d); targets: (tokens,) int64. The
    products run in `compute_dtype` if given, else autocast's dtype or hidden's;
    `keep_workspace`: the tokens x vocab buffer kept for the next call (`_workspace`)."""
    return LinearCrossEntropy.apply(hidden, weight, targets, torch.is_grad_enabled(), compute_dtype, keep_workspace)


class FusedOutputLayer(OutputLayer):
    """OutputLayer whose `loss` is `linear_cross_entropy` (same parameters and results up
    to rounding order, a quarter of the memory)."""

    compute_dtype: torch.dtype | None = None  # float32 for bf16 weights without native bf16 products
    # the logits buffer kept between steps; given back after each forward under activation
    # checkpointing (frugality.runtime.activation_checkpointing sets it)
    keep_workspace: bool = True

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        flat = hidden.flatten(0, 1)
        return linear_cross_entropy(flat, self.weight, targets.flatten(), self.compute_dtype, self.keep_workspace)
