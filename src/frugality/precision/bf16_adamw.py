"""AdamW for weights, gradients and optimizer states stored in bfloat16 (the `bf16-sr` and
`bf16` precision policies).

Each parameter group's parameters and both moments live in three flat bf16 buffers; every
parameter and its state entries are views into them. Gradients are ordinary tensors that
backward allocates and `zero_grad` frees (as with torch's optimizers): backward then hands
each new gradient to `.grad` without copying it, where gradients kept in a flat buffer
would cost a zeroing pass and an addition per parameter on every step (about 50 ms of a
1.4 s Pythia-70m step on a 2-core CPU). One step is an elementwise pass per group: read
weights, gradients and moments, compute AdamW in float32, write weights and moments back
to bf16 — with stochastic rounding (`bf16-sr`) or round-to-nearest (`bf16`). The pass
runs, in order of preference: on CPUs, a small C kernel (frugality/kernels/
adamw_bf16_cpu.c, built on first use) called per parameter on its gradient; elsewhere,
`torch.compile` of `_update` (one fused loop over the group, the gradients gathered into
one buffer first, the rounding noise generated in registers); and eager torch ops in chunks
if neither is available or `fused=False`. All compute the same formula with the same
noise (element i of the group's flat buffer draws the same noise on every path); the C
kernel and eager ops give identical bits. Parameters without a gradient are skipped, as
torch's AdamW skips them.

Memory: 2 + 2 + 2 + 2 = 8 bytes per parameter, against 16 for fp32 master weights,
gradients and moments (the `fp32` and `amp-bf16` policies).
"""

from __future__ import annotations

import math
import warnings
from typing import Callable, Literal

import numpy as np
import torch

from frugality import kernels
from frugality.precision.stochastic_rounding import mix_key, noise16x3, round_to_bf16

Rounding = Literal["stochastic", "nearest"]
_EAGER_CHUNK = 1 << 20  # bounds the eager path's temporaries to a few MB
_FLOAT_SCALARS = ("lr", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps", "decay",
                  "bc1", "bc2_sqrt", "grad_scale")


def _update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, start: torch.Tensor,
    lr: torch.Tensor, beta1: torch.Tensor, one_minus_beta1: torch.Tensor, beta2: torch.Tensor,
    one_minus_beta2: torch.Tensor, eps: torch.Tensor, decay: torch.Tensor, bc1: torch.Tensor,
    bc2_sqrt: torch.Tensor, grad_scale: torch.Tensor, key: torch.Tensor, stochastic: bool,
) -> None:
    """One AdamW step on flat bf16 buffers, in place. Scalars are 0-dim float32 tensors
    computed once by the caller (so a changing learning rate never recompiles), and the
    operations and their order are exactly those of adamw_bf16_cpu.c."""
    g32 = g.float() * grad_scale
    m32 = m.float() * beta1 + g32 * one_minus_beta1
    v32 = v.float() * beta2 + (g32 * g32) * one_minus_beta2
    update = (m32 / bc1) / (v32.sqrt() / bc2_sqrt + eps)
    p32 = p.float() * decay - lr * update
    if stochastic:
        index = start + torch.arange(p.numel(), device=p.device, dtype=torch.int64)
        noise = noise16x3(index, key)
    else:
        noise = (None, None, None)
    p.copy_(round_to_bf16(p32, noise[0]))
    m.copy_(round_to_bf16(m32, noise[1]))
    v.copy_(round_to_bf16(v32, noise[2]))


class BF16AdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay, bias-corrected) over bf16 storage.

    `seed` drives the stochastic rounding: step s of group k rounds with noise from
    hash(seed, k, s, element index), so the state to checkpoint is just the step count —
    it lives in the optimizer state as usual — and a resumed run rounds exactly as an
    uninterrupted one would.
    """

    def __init__(
        self,
        params,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        rounding: Rounding = "stochastic",
        seed: int = 0,
        fused: bool = True,
    ) -> None:
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        rounding=rounding, seed=seed)
        super().__init__(params, defaults)
        self._compiled: Callable | None = None
        self._fused = fused
        self._grad_scale = 1.0  # set by clip_grad_norm_, applied and reset by the next step
        self._flat: list[dict[str, torch.Tensor]] = []
        for group in self.param_groups:
            self._flat.append(self._flatten(group))

    def _flatten(self, group: dict) -> dict[str, torch.Tensor]:
        params = group["params"]
        if not params:
            return {}
        device = params[0].device
        if any(p.dtype != torch.bfloat16 or p.device != device for p in params):
            raise ValueError("BF16AdamW needs bfloat16 parameters on one device per group")
        numel = sum(p.numel() for p in params)
        flat = {name: torch.zeros(numel, dtype=torch.bfloat16, device=device)
                for name in ("param", "exp_avg", "exp_avg_sq")}
        step = torch.zeros((), dtype=torch.float32)  # one counter per group, shared by its params
        offset = 0
        for p in params:
            n = p.numel()
            view = flat["param"][offset : offset + n].view_as(p)
            view.copy_(p.detach())
            p.data = view  # the parameter now lives in the flat buffer
            self.state[p] = {
                "step": step,
                "exp_avg": flat["exp_avg"][offset : offset + n].view_as(p),
                "exp_avg_sq": flat["exp_avg_sq"][offset : offset + n].view_as(p),
            }
            offset += n
        return flat

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for k, (group, flat) in enumerate(zip(self.param_groups, self._flat)):
            if not flat:
                continue
            counter = self.state[group["params"][0]]["step"]  # shared by the group
            step = int(counter.item()) + 1
            counter.fill_(step)
            self._run(group, flat, self._scalars(group, k, step, self._grad_scale),
                      group["rounding"] == "stochastic")
        self._grad_scale = 1.0
        return loss

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        """The global gradient norm (as torch.nn.utils.clip_grad_norm_ returns it), and
        clipping to `max_norm` folded into the next step: each gradient is scaled in float32
        as the update reads it, instead of in a separate bf16 pass over all of them."""
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            self._grad_scale = 1.0
            return torch.zeros((), dtype=torch.float32)
        # On CPUs a C kernel (whatever `fused` says: every update path then clips by the
        # same scale): one read of each gradient, where torch's bf16 norm ran at ~4 GB/s.
        kernel = kernels.bf16_sum_squares() if grads[0].device.type == "cpu" else None
        if kernel is not None:
            threads = torch.get_num_threads()
            squares = sum(kernel(g.data_ptr(), g.numel(), threads) for g in map(_bf16_contiguous, grads))
            total = torch.tensor(math.sqrt(squares), dtype=torch.float32)
        else:
            total = torch.linalg.vector_norm(
                torch.stack([torch.linalg.vector_norm(g, dtype=torch.float32) for g in grads]))
        value = float(total)
        # torch's formula, clamped to 1; a non-finite norm poisons the step, as it does there
        self._grad_scale = min(max_norm / (value + 1e-6), 1.0) if math.isfinite(value) else math.nan
        return total

    @staticmethod
    def _scalars(group: dict, index: int, step: int, grad_scale: float = 1.0) -> dict[str, float]:
        """Every scalar of the update, rounded to float32 once, so that all paths (C,
        compiled, eager) compute with identical values."""
        f32 = np.float32
        beta1, beta2 = group["betas"]
        lr, wd = f32(group["lr"]), f32(group["weight_decay"])
        return dict(
            lr=lr, beta1=f32(beta1), one_minus_beta1=f32(1) - f32(beta1), beta2=f32(beta2),
            one_minus_beta2=f32(1) - f32(beta2), eps=f32(group["eps"]), decay=f32(1) - lr * wd,
            bc1=f32(1 - beta1**step), bc2_sqrt=f32((1 - beta2**step) ** 0.5), grad_scale=f32(grad_scale),
            key=mix_key(group["seed"], index, step),
        )

    def _run(self, group: dict, flat: dict, scalars: dict, stochastic: bool) -> None:
        device = flat["param"].device
        floats = [float(scalars[k]) for k in _FLOAT_SCALARS]
        if self._fused and device.type == "cpu" and (kernel := kernels.adamw_bf16_step()) is not None:
            threads = torch.get_num_threads()
            for start, n, grad in _segments(group["params"]):
                grad = _bf16_contiguous(grad)
                p, m, v = (flat[name][start:].data_ptr() for name in ("param", "exp_avg", "exp_avg_sq"))
                kernel(p, grad.data_ptr(), m, v, n, start, *floats, scalars["key"], int(stochastic), threads)
            return
        tensors = {k: torch.tensor(scalars[k], dtype=torch.float32, device=device) for k in _FLOAT_SCALARS}
        tensors["key"] = torch.tensor(scalars["key"], dtype=torch.int64, device=device)
        if self._fused and self._compiled is None:
            self._compiled = torch.compile(_update, dynamic=True, fullgraph=True)
        # Runs of consecutive parameters that have gradients (usually the whole group), each
        # gradient run gathered into one buffer for one pass.
        for start, n, grads in _runs(group["params"]):
            grad = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
            buffers = [flat["param"][start : start + n], grad.to(torch.bfloat16),
                       flat["exp_avg"][start : start + n], flat["exp_avg_sq"][start : start + n]]
            if self._fused:
                try:
                    self._compiled(*buffers, torch.tensor(start, dtype=torch.int64, device=device),
                                   **tensors, stochastic=stochastic)
                    continue
                except Exception as e:  # e.g. an Inductor C++ build failure on this machine
                    warnings.warn(f"compiled BF16AdamW step failed ({type(e).__name__}: {e}); "
                                  "using eager torch ops for the rest of this run")
                    self._fused = False
            for chunk in range(0, n, _EAGER_CHUNK):
                _update(*(b[chunk : chunk + _EAGER_CHUNK] for b in buffers),
                        torch.tensor(start + chunk, dtype=torch.int64, device=device), **tensors,
                        stochastic=stochastic)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load, then move the loaded moments back into the flat buffers (the base class
        replaces state tensors with fresh copies, which would break the views)."""
        super().load_state_dict(state_dict)
        for group, flat in zip(self.param_groups, self._flat):
            if not group["params"]:
                continue
            step = self.state[group["params"][0]]["step"].to(torch.float32).cpu()
            offset = 0
            for p in group["params"]:
                n = p.numel()
                state = self.state[p]
                for name in ("exp_avg", "exp_avg_sq"):
                    view = flat[name][offset : offset + n].view_as(p)
                    view.copy_(state[name])
                    state[name] = view
                state["step"] = step
                offset += n


def _bf16_contiguous(grad: torch.Tensor) -> torch.Tensor:
    """A gradient as the kernels read it: dense bf16 (backward gives the parameter's dtype;
    a gradient someone assigned by hand may differ)."""
    return grad.to(torch.bfloat16).contiguous()


def _segments(params: list[torch.Tensor]):
    """(offset in the group's flat buffers, numel, grad) of each parameter with a gradient."""
    offset = 0
    for p in params:
        if p.grad is not None:
            yield offset, p.numel(), p.grad
        offset += p.numel()


def _runs(params: list[torch.Tensor]):
    """(offset, numel, grads) of each run of consecutive parameters with gradients."""
    run: list = []
    for offset, n, grad in _segments(params):
        if run and run[0] + run[1] == offset:
            run[1] += n
            run[2].append(grad)
        else:
            if run:
                yield tuple(run)
            run = [offset, n, [grad]]
    if run:
        yield tuple(run)
