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

Sharded parameters (DTensors: FSDP2's, tensor parallel's) are not moved into flat buffers:
their owner keeps their storage. Each rank updates its local shard in place, its moments
are DTensors of the same placement (so DCP saves and reshards them), and element i of a
shard draws the noise of its index in the unsharded group, the index it has in one process:
the rounding does not depend on the layout. A shard of dim 1 (tensor parallel's row-wise
layers) is rows lying apart in the unsharded parameter: one pass still, its indices
computed from (row length, row stride). Gradients are first placed as their parameters (a
replicated norm under sequence parallel gets partial sums from each rank), and clipping
sums each gradient's squares over the mesh dimensions it is split along.

Memory: 2 + 2 + 2 + 2 = 8 bytes per parameter, against 16 for fp32 master weights,
gradients and moments (the `fp32` and `amp-bf16` policies).
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from frugality import kernels
from frugality.backends import backend
from frugality.precision.stochastic_rounding import mix_key, noise16x3, round_to_bf16

Rounding = Literal["stochastic", "nearest"]
_EAGER_CHUNK = 1 << 20  # bounds the eager path's temporaries to a few MB
_FLOAT_SCALARS = (
    "lr",
    "beta1",
    "one_minus_beta1",
    "beta2",
    "one_minus_beta2",
    "eps",
    "decay",
    "bc1",
    "bc2_sqrt",
    "grad_scale",
)


def _update(
    p: torch.Tensor,
    g: torch.Tensor,
    m: torch.Tensor,
    v: torch.Tensor,
    start: torch.Tensor,
    lr: torch.Tensor,
    beta1: torch.Tensor,
    one_minus_beta1: torch.Tensor,
    beta2: torch.Tensor,
    one_minus_beta2: torch.Tensor,
    eps: torch.Tensor,
    decay: torch.Tensor,
    bc1: torch.Tensor,
    bc2_sqrt: torch.Tensor,
    grad_scale: torch.Tensor,
    key: torch.Tensor,
    stochastic: bool,
    rows: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """One AdamW step on flat bf16 buffers, in place. Scalars are 0-dim float32 tensors
    computed once by the caller (so a changing learning rate never recompiles), and the
    operations and their order are exactly those of adamw_bf16_cpu.c. Element j rounds with
    the noise of index `start + j` in its group, or, given `rows` (cols, stride: 0-dim
    int64), of `start + (j // cols) * stride + j % cols`."""
    g32 = g.float() * grad_scale
    m32 = m.float() * beta1 + g32 * one_minus_beta1
    v32 = v.float() * beta2 + (g32 * g32) * one_minus_beta2
    update = (m32 / bc1) / (v32.sqrt() / bc2_sqrt + eps)
    p32 = p.float() * decay - lr * update
    if stochastic:
        index = torch.arange(p.numel(), device=p.device, dtype=torch.int64)
        if rows is not None:  # rows of `cols` elements, `stride` apart in the group (a shard of dim 1)
            cols, stride = rows
            index = (index // cols) * stride + index % cols
        noise = noise16x3(start + index, key)
    else:
        noise = (None, None, None)
    p.copy_(round_to_bf16(p32, noise[0]))
    m.copy_(round_to_bf16(m32, noise[1]))
    v.copy_(round_to_bf16(v32, noise[2]))


def _compiled_rounding_is_right(device: torch.device) -> bool:
    """Whether `torch.compile` of `_update` rounds stochastically as the C kernel and eager ops
    do on `device`. Inductor's AVX2 code for it does not: about half of a step's elements
    differ (and a run's losses drift: 4.56 against 5.13 after 8 steps in
    tests/kernels/test_dispatch.py), found under ONEDNN_MAX_CPU_ISA=AVX2
    ATEN_CPU_CAPABILITY=avx2 on a Zen 4, while its AVX-512 code gives the same bits, and the
    noise hash, the rounding and the index arithmetic compiled alone are right under AVX2 too.
    A CPU whose Inductor vectors are narrower than AVX-512 takes eager ops (only where the C
    kernel is off or cannot build: CPUs run the kernel)."""
    if not backend(device).on_host:  # (Inductor's C++ for the host's vectors)
        return True
    from torch._inductor import cpu_vec_isa

    isa = cpu_vec_isa.pick_vec_isa()
    return bool(isa) and isa.bit_width() >= 512  # (no vectors at all, NEON: not measured, eager too)


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
        index_of=None,
    ) -> None:
        """`index_of`: a parameter's first element's index in its group of the whole model,
        where the optimizer holds a part of it (a pipeline stage's): the noise then is that
        of the whole model's update. Default: its place in this optimizer's group."""
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, rounding=rounding, seed=seed)
        super().__init__(params, defaults)
        self._index_of = index_of
        self._compiled: Callable | None = None
        self._fused = fused
        # set by clip_grad_norm_ (a tensor on XLA: no host read), applied and reset by the next step
        self._grad_scale: float | torch.Tensor = 1.0
        self._flat: list[dict[str, torch.Tensor]] = []  # per group; empty for sharded groups
        # each contiguous run of a rank's shard: (its first element's index in the group, in the shard, its length)
        self._shard_runs: dict[torch.Tensor, list[tuple[int, int, int]]] = {}
        for group in self.param_groups:
            sharded = [isinstance(p, DTensor) for p in group["params"]]
            if any(sharded) and not all(sharded):
                raise ValueError("BF16AdamW needs a group's parameters all sharded (DTensor) or none")
            # XLA: no flat buffers; each parameter its own tensors (reading a view of a buffer
            # to the host, as a checkpoint does, changes the next step's graph), and XLA fuses
            # the per-parameter updates of a step into one graph anyway
            apart = any(sharded) or any(backend(p.device).traced for p in group["params"])
            self._flat.append({} if apart else self._flatten(group))
            if apart:
                self._shard_state(group)

    def _flatten(self, group: dict) -> dict[str, torch.Tensor]:
        params = group["params"]
        if not params:
            return {}
        device = params[0].device
        if any(p.dtype != torch.bfloat16 or p.device != device for p in params):
            raise ValueError("BF16AdamW needs bfloat16 parameters on one device per group")
        numel = sum(p.numel() for p in params)
        flat = {
            name: torch.zeros(numel, dtype=torch.bfloat16, device=device) for name in ("param", "exp_avg", "exp_avg_sq")
        }
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

    def _shard_state(self, group: dict) -> None:
        """Moments of a group kept apart per parameter: DTensors placed like their sharded
        parameters, or plain tensors like theirs (XLA)."""
        step = torch.zeros((), dtype=torch.float32)
        offset = 0
        for p in group["params"]:
            if p.dtype != torch.bfloat16:
                raise ValueError("BF16AdamW needs bfloat16 parameters")
            if isinstance(p, DTensor):
                base = offset if self._index_of is None else self._index_of(p)
                self._shard_runs[p] = [(base + start, local, n) for start, local, n in _shard_runs(p)]
                moments = {
                    name: DTensor.from_local(
                        torch.zeros_like(p.to_local()),
                        p.device_mesh,
                        p.placements,
                        shape=p.shape,
                        stride=p.stride(),
                        run_check=False,
                    )
                    for name in ("exp_avg", "exp_avg_sq")
                }
            else:
                self._shard_runs[p] = [(offset if self._index_of is None else self._index_of(p), 0, p.numel())]
                moments = {name: torch.zeros_like(p) for name in ("exp_avg", "exp_avg_sq")}
            self.state[p] = {"step": step, **moments}
            offset += p.numel()

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._place_grads()
        for k, (group, flat) in enumerate(zip(self.param_groups, self._flat, strict=True)):
            if not group["params"]:
                continue
            counter = self.state[group["params"][0]]["step"]  # shared by the group
            step = int(counter.item()) + 1
            counter.fill_(step)
            scalars = self._scalars(group, k, step, self._grad_scale)
            stochastic = group["rounding"] == "stochastic"
            if flat:
                self._run(group, flat, scalars, stochastic)
            else:
                self._run_shards(group, scalars, stochastic)
        self._grad_scale = 1.0
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Drop the gradients, and a clip scale computed from them that no step applied."""
        super().zero_grad(set_to_none)
        self._grad_scale = 1.0

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, sum_squares=None) -> torch.Tensor:
        """The global gradient norm (as torch.nn.utils.clip_grad_norm_ returns it), and
        clipping to `max_norm` folded into the next step: each gradient is scaled in float32
        as the update reads it, instead of in a separate bf16 pass over all of them.
        `sum_squares`: adds the squared norms of the other pipeline stages' parameters."""
        self._place_grads()
        grads = [p.grad for group in self.param_groups for p in group["params"] if p.grad is not None]
        if not grads:
            self._grad_scale = 1.0
            return torch.zeros((), dtype=torch.float32)
        if isinstance(grads[0], DTensor):
            # each rank sums the squares of its shards, by the mesh dimensions they are split
            # along (FSDP2's all alike; tensor parallel's differ), then with the ranks of those
            by_split: dict[tuple, list] = {}
            for g in grads:
                by_split.setdefault(tuple(i for i, pl in enumerate(g.placements) if pl.is_shard()), []).append(g)
            squares = sum(_sum_over_shards(self._norm(gs).square(), gs[0]) for _, gs in sorted(by_split.items()))
            total = cast(torch.Tensor, squares).sqrt()  # a sum of one or more tensors
        else:
            total = self._norm(grads)
        if sum_squares is not None:
            total = sum_squares(total.square()).sqrt()
        if backend(total.device).traced:  # the scale stays on the device: no host read inside the step
            self._grad_scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)  # (a NaN norm stays NaN)
            return total
        value = float(total)
        # torch's formula, clamped to 1; a non-finite norm poisons the step, as it does there
        self._grad_scale = min(max_norm / (value + 1e-6), 1.0) if math.isfinite(value) else math.nan
        return total

    @staticmethod
    def _norm(grads: list[torch.Tensor]) -> torch.Tensor:
        """The float32 norm of this rank's part of `grads`. On CPUs a C kernel (whatever
        `fused` says: every update path then clips by the same scale): one read of each
        gradient, where torch's bf16 norm ran at ~4 GB/s."""
        kernel = kernels.bf16_sum_squares() if backend(grads[0].device).c_kernels else None
        if kernel is not None:
            threads = torch.get_num_threads()
            local = map(_bf16_contiguous, map(_local, grads))
            squares = sum(kernel(g.data_ptr(), g.numel(), threads) for g in local)
            return torch.tensor(math.sqrt(squares), dtype=torch.float32)
        return torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(_local(g), dtype=torch.float32) for g in grads])
        )

    def _place_grads(self) -> None:
        """Gradients placed as their parameters: a replicated parameter that saw a split
        input (sequence parallel's norms) gets a partial sum from each rank, reduced here."""
        for group in self.param_groups:
            for p in group["params"]:
                g = p.grad
                if isinstance(g, DTensor) and tuple(g.placements) != tuple(p.placements):
                    p.grad = g.redistribute(p.device_mesh, p.placements)

    @staticmethod
    def _scalars(group: dict, index: int, step: int, grad_scale: float | torch.Tensor = 1.0) -> dict[str, Any]:
        """Every scalar of the update, rounded to float32 once, so that all paths (C,
        compiled, eager) compute with identical values."""
        f32 = np.float32
        beta1, beta2 = group["betas"]
        lr, wd = f32(group["lr"]), f32(group["weight_decay"])
        return dict(
            lr=lr,
            beta1=f32(beta1),
            one_minus_beta1=f32(1) - f32(beta1),
            beta2=f32(beta2),
            one_minus_beta2=f32(1) - f32(beta2),
            eps=f32(group["eps"]),
            decay=f32(1) - lr * wd,
            bc1=f32(1 - beta1**step),
            bc2_sqrt=f32((1 - beta2**step) ** 0.5),
            grad_scale=grad_scale if isinstance(grad_scale, torch.Tensor) else f32(grad_scale),
            key=mix_key(group["seed"], index, step),
        )

    def _run(self, group: dict, flat: dict, scalars: dict, stochastic: bool) -> None:
        names = ("param", "exp_avg", "exp_avg_sq")
        if self._cpu_kernel(flat["param"].device) is not None or self._index_of is not None:
            # a call per parameter, no gathering (a stage's parameters lie apart in the whole model)
            for (start, n, grad), param in zip(_segments(group["params"]), _with_grads(group["params"]), strict=True):
                p, m, v = (flat[name][start : start + n] for name in names)
                index = start if self._index_of is None else self._index_of(param)
                self._update_buffers([p, _bf16_contiguous(grad).view(-1), m, v], index, scalars, stochastic)
            return
        # Runs of consecutive parameters that have gradients (usually the whole group), each
        # gradient run gathered into one buffer for one pass.
        for start, n, grads in _runs(group["params"]):
            grad = torch.cat([g.reshape(-1) for g in grads]) if len(grads) > 1 else grads[0].reshape(-1)
            p, m, v = (flat[name][start : start + n] for name in names)
            self._update_buffers([p, grad.to(torch.bfloat16), m, v], start, scalars, stochastic)

    def _cpu_kernel(self, device: torch.device):
        return kernels.adamw_bf16_step() if self._fused and backend(device).c_kernels else None

    def _update_buffers(
        self,
        buffers: list[torch.Tensor],
        start: int,
        scalars: dict,
        stochastic: bool,
        rows: tuple[int, int] | None = None,
    ) -> None:
        """One pass over 1-D contiguous (weight, gradient, first and second moment) buffers
        whose first element is element `start` of the group; `rows` (cols, stride): they
        hold rows of `cols` elements that lie `stride` apart in the group."""
        device, n = buffers[0].device, buffers[0].numel()
        if (kernel := self._cpu_kernel(device)) is not None:
            if "_floats" not in scalars:  # once per group and step: this runs per parameter
                scalars["_floats"] = [float(scalars[k]) for k in _FLOAT_SCALARS]
            cols, stride = rows if rows is not None and stochastic else (n, n)
            for r in range(n // cols):  # the C kernel numbers contiguous runs: a call per row
                p, g, m, v = (b[r * cols : (r + 1) * cols].data_ptr() for b in buffers)
                first = start + r * stride
                kernel(
                    p,
                    g,
                    m,
                    v,
                    cols,
                    first,
                    *scalars["_floats"],
                    scalars["key"],
                    int(stochastic),
                    torch.get_num_threads(),
                )
            return
        rows_on_device = None  # (cols, stride) as 0-dim int64 tensors, as _update takes them
        if rows is not None and stochastic:
            rows_on_device = (
                torch.tensor(rows[0], dtype=torch.int64, device=device),
                torch.tensor(rows[1], dtype=torch.int64, device=device),
            )
        if "_tensors" not in scalars:  # once per group and step: on a GPU each is a host-to-device copy
            scalars["_tensors"] = _scalar_tensors(scalars, device)
        tensors = scalars["_tensors"]
        if self._fused and (not stochastic or _compiled_rounding_is_right(device)):
            if self._compiled is None:
                self._compiled = torch.compile(_update, dynamic=True, fullgraph=True)
            try:
                self._compiled(
                    *buffers,
                    torch.tensor(start, dtype=torch.int64, device=device),
                    **tensors,
                    stochastic=stochastic,
                    rows=rows_on_device,
                )
                return
            except Exception as e:  # e.g. an Inductor C++ build failure on this machine
                warnings.warn(
                    f"compiled BF16AdamW step failed ({type(e).__name__}: {e}); "
                    "using eager torch ops for the rest of this run",
                    stacklevel=1,
                )
                self._fused = False
        size = n if backend(device).traced else _EAGER_CHUNK  # XLA traces one pass and fuses it: no chunks
        if rows_on_device is not None:  # chunks of whole rows
            cols, stride = (int(x) for x in rows_on_device)
            size = max(cols, size // cols * cols)
        for chunk in range(0, n, size):
            first = start + chunk if rows_on_device is None else start + chunk // cols * stride
            p, g, m, v = (b[chunk : chunk + size] for b in buffers)
            _update(
                p,
                g,
                m,
                v,
                torch.tensor(first, dtype=torch.int64, device=device),
                **tensors,
                stochastic=stochastic,
                rows=rows_on_device,
            )

    def _run_shards(self, group: dict, scalars: dict, stochastic: bool) -> None:
        """The update of a sharded group, each rank on its local shards in place (one pass per
        parameter, the noise indexed from the shard's place in the unsharded group)."""
        for p in group["params"]:
            if p.grad is None or _local(p).numel() == 0:  # FSDP2 may leave a rank no rows
                continue
            state = self.state[p]
            local = [
                _local(p),
                _bf16_contiguous(_local(p.grad)),
                _local(state["exp_avg"]),
                _local(state["exp_avg_sq"]),
            ]
            if not all(t.is_contiguous() for t in local):
                raise ValueError("BF16AdamW needs contiguous local shards")
            flat = [t.view(-1) for t in local]
            runs = self._shard_runs[p]
            rows = None
            if len(runs) > 1:  # a shard of dim 1: rows of equal length, equally far apart
                rows = (runs[0][2], runs[1][0] - runs[0][0])
            self._update_buffers(flat, runs[0][0], scalars, stochastic, rows)

    def load_state_dict(self, state_dict: dict) -> None:
        """Load, then move the loaded moments back into the flat buffers (the base class
        replaces state tensors with fresh copies, which would break the views)."""
        super().load_state_dict(state_dict)
        for group, flat in zip(self.param_groups, self._flat, strict=True):
            if not group["params"]:
                continue
            step = self.state[group["params"][0]]["step"].to(torch.float32).cpu()
            if not flat:  # sharded: the loaded moments are the state; the group shares one counter
                for p in group["params"]:
                    self.state[p]["step"] = step
                continue
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


def _scalar_tensors(scalars: dict, device: torch.device) -> dict[str, torch.Tensor]:
    """The update's scalars as 0-dim tensors on `device` (so a changing value never
    recompiles), copied there as one tensor: one transfer, and one graph input whatever the
    values (XLA shares the device data of equal scalars, which would change its graph's
    inputs the step two of them happened to be equal)."""
    names = [k for k in _FLOAT_SCALARS if not isinstance(scalars[k], torch.Tensor)]
    packed = torch.tensor([float(scalars[k]) for k in names], dtype=torch.float32).to(device)
    tensors = {k: packed[i] for i, k in enumerate(names)}
    tensors.update({k: v.to(device, torch.float32) for k, v in scalars.items() if isinstance(v, torch.Tensor)})
    tensors["key"] = torch.tensor(scalars["key"], dtype=torch.int64, device=device)
    return tensors


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a sharded (DTensor) tensor; a plain tensor itself."""
    return t.to_local() if isinstance(t, DTensor) else t


def _shard_runs(p: DTensor) -> list[tuple[int, int, int]]:
    """This rank's shard of `p` as contiguous runs of the flattened unsharded parameter:
    (the run's first flat index there, its first index in the local shard, its length).
    FSDP2 shards dim 0 (and tensor parallel's column-wise layers too): one run; tensor
    parallel's row-wise layers shard dim 1: a run per row."""
    shape, offset = compute_local_shape_and_global_offset(p.shape, p.device_mesh, p.placements)
    n = math.prod(shape)
    if n == 0:
        return []
    if len(shape) == 1 or tuple(shape[1:]) == tuple(p.shape[1:]):
        return [(offset[0] * math.prod(p.shape[1:]), 0, n)]
    if len(shape) == 2:
        rows, cols = shape
        return [((offset[0] + r) * p.shape[1] + offset[1], r * cols, cols) for r in range(rows)]
    raise ValueError(f"BF16AdamW shards 1-D and 2-D parameters only, not {tuple(p.shape)} as {p.placements}")


def _sum_over_shards(value: torch.Tensor, like: DTensor) -> torch.Tensor:
    """`value` (a sum over this rank's shards) summed over the ranks that hold the other
    shards: the mesh dimensions along which `like` is sharded (not those it is replicated on)."""
    value = value.to(like.to_local().device)
    for dim, placement in enumerate(like.placements):
        if placement.is_shard():
            dist.all_reduce(value, group=like.device_mesh.get_group(dim))
    return value.cpu()


def _with_grads(params: list[torch.Tensor]):
    """The parameters `_segments` yields, in its order."""
    return (p for p in params if p.grad is not None)


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
