"""Causal attention for CPUs (`CPUCausalAttention`, swapped in for the models' plain
`CausalAttention` by `frugality.kernels.specialize`): a C kernel for bf16 where the CPU
has AMX, and a faster backward pass for compiled training elsewhere.

PyTorch's CPU flash attention issues many small matrix products per head; its backward
runs about 5x slower than its forward (2-core Xeon with AMX, bf16, Pythia-70m's rotary
attention at 4 x 512 tokens, 8 heads of 64: forward 12 ms, forward + backward 78 ms;
benchmarks/attention.py).

1. `amx_attention` (kernels/attention_cpu.c), bf16 on CPUs with AMX, eager or compiled,
   training or inference: each product one run of AMX tiles over operands laid out once per
   head, the rotary embedding and the softmax and its gradient in float32 between them.
   Same example: forward 7.7 ms, forward + backward 26 ms, closer to float64 than torch's.
2. Elsewhere, while torch.compile traces training, `BlockedBackwardAttention`: the flash forward and
   a backward written as batched matrix products over blocks of query rows, the elementwise
   work between them fused by Inductor (forward + backward 51 ms in the example). Eagerly,
   without that fusion, the elementwise passes cost more than they save, so
   `CPUCausalAttention` only routes here while tracing.
3. bf16 tensors on a CPU without native bf16 products (`fp32_products`): q, k and v are
   upcast and attention runs in float32, its result rounded back to bf16 once; torch's
   bf16 attention there runs its products in emulated bf16, hundreds of times slower.

The blocked backward recomputes the attention probabilities from the forward's
log-sum-exp, block by block of `_BLOCK` query rows against only the keys at or before them
(causal: about half the work of the full square). Scores and probabilities are float32, as
in the flash kernel; the products that take them (P^T dO, dS K, dS^T Q) take them rounded
to the input dtype. dK and dV accumulate across blocks in float32.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from frugality import kernels
from frugality.models.layers import CausalAttention, RotaryEmbedding

_BLOCK = 256  # query rows per block: fewer, larger products; 32 heads x 256 x 2048 f32 = 64 MB


class BlockedBackwardAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        with torch.autocast("cpu", enabled=False):  # the float32 products must stay float32
            return _backward(q, k, v, out, lse, grad_out)


def _backward(q, k, v, out, lse, grad_out):
    batch, heads, seq, head_size = q.shape
    scale = head_size**-0.5
    dtype = q.dtype
    q, k, v, out, grad_out = (t.reshape(batch * heads, seq, head_size) for t in (q, k, v, out, grad_out))
    lse = lse.reshape(batch * heads, seq, 1)
    # softmax backward's row term: sum_j P_ij dP_ij = sum_d dO_id O_id
    delta = (grad_out.float() * out.float()).sum(-1, keepdim=True)
    dq = torch.empty_like(q)
    dk = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    for start in range(0, seq, _BLOCK):
        end = min(start + _BLOCK, seq)
        q_b, k_b, v_b, do_b = q[:, start:end], k[:, :end], v[:, :end], grad_out[:, start:end]
        scores = torch.bmm(q_b.float(), k_b.float().transpose(1, 2))
        rows = torch.arange(start, end, device=q.device)[:, None]
        cols = torch.arange(end, device=q.device)[None, :]
        p = torch.exp(scores * scale - lse[:, start:end]).masked_fill(cols > rows, 0.0)
        dv[:, :end] += torch.bmm(p.to(dtype).transpose(1, 2), do_b).float()
        dp = torch.bmm(do_b, v_b.transpose(1, 2)).float()
        ds = (p * (dp - delta[:, start:end]) * scale).to(dtype)
        dq[:, start:end] = torch.bmm(ds, k_b)
        dk[:, :end] += torch.bmm(ds.transpose(1, 2), q_b).float()
    shape = (batch, heads, seq, head_size)
    return dq.view(shape), dk.to(dtype).view(shape), dv.to(dtype).view(shape)


def amx_attention_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether `amx_attention` takes these (batch, heads, seq, head_size) tensors (k and v
    repeated to q's heads where fewer): bf16 on a CPU whose kernel runs, seq and head_size
    multiples of 32."""
    return (
        q.device.type == "cpu"
        and q.dtype == k.dtype == v.dtype == torch.bfloat16
        and k.shape == v.shape
        and k.shape[-2:] == q.shape[-2:]
        and q.shape[-2] % 32 == 0
        and q.shape[-1] % 32 == 0
        and amx_kernel_runs()
    )


@torch.compiler.assume_constant_result  # asked once; compiled graphs keep the answer
def amx_kernel_runs() -> bool:
    """The kernel may run here (frugality.kernels.dispatch), builds, and the OS grants AMX:
    tried once on a tiny input."""
    if "runs" not in _KERNEL_TRIED:
        q = torch.zeros(1, 1, 32, 32, dtype=torch.bfloat16)
        kernel = kernels.attention_forward_bf16()
        none = torch.empty(0)
        _KERNEL_TRIED["runs"] = (
            kernel is not None
            and _call(
                kernel,
                q,
                q,
                q,
                torch.empty_like(q),
                torch.empty(1, 1, 32),
                tensors=(q, q, q, q),
                cos=none,
                sin=none,
                rotary_dim=0,
            )
            == 0
        )
    return _KERNEL_TRIED["runs"]


_KERNEL_TRIED: dict[str, bool] = {}


def _rows(t: torch.Tensor) -> torch.Tensor:
    """t with contiguous rows (the kernel takes any other strides)."""
    return t if t.stride(-1) == 1 else t.contiguous()


def _seq_major(q: torch.Tensor) -> torch.Tensor:
    """An empty (batch, seq, heads, dim) tensor for attention's output or an input gradient:
    seen through .transpose(1, 2) it is a (batch, heads, seq, dim) result whose heads merge
    back into (batch, seq, hidden) as a view, not a copy. (The custom ops return it
    contiguous and the transposing view happens outside them, where compilers expect it.)"""
    batch, heads, seq, dim = q.shape
    return torch.empty(batch, seq, heads, dim, dtype=q.dtype, device=q.device)


def _call(
    kernel,
    *pointers_from: torch.Tensor,
    tensors: tuple[torch.Tensor, ...],
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
) -> int:
    """kernel(pointers..., batch, heads, seq, dim, strides of `tensors`, cos, sin, rotary_dim,
    scale, threads)."""
    batch, heads, seq, dim = tensors[0].shape
    if rotary_dim and not all(
        t.dtype == torch.float32 and t.is_contiguous() and t.shape == (seq, dim) for t in (cos, sin)
    ):  # the kernel reads seq rows of dim floats
        raise ValueError(
            f"attention: rotary tables must be contiguous float32 ({seq}, {dim}), "
            f"got {tuple(cos.shape)} {cos.dtype} and {tuple(sin.shape)} {sin.dtype}"
        )
    strides = torch.tensor([t.stride()[:3] for t in tensors], dtype=torch.int64)
    return kernel(
        *(t.data_ptr() for t in pointers_from),
        batch,
        heads,
        seq,
        dim,
        strides.data_ptr(),
        cos.data_ptr(),
        sin.data_ptr(),
        rotary_dim,
        dim**-0.5,
        torch.get_num_threads(),
    )


def _check(code: int) -> None:
    if code == -2:
        raise MemoryError("attention: could not allocate the kernel's per-thread buffers")
    if code != 0:
        raise RuntimeError(f"attention kernel failed (code {code})")


# The ops take the rotary tables as RotaryEmbedding keeps them (float32 (seq, dim), cos 1
# and sin 0 past `rotary_dim`, the first half's sign folded into sin) and rotate q and k
# themselves; rotary_dim 0 (with any tables) for none.


@torch.library.custom_op("frugality::amx_attention", mutates_args=())
def _amx_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotary_dim: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output laid out (batch, seq, heads, dim), log-sum-exp (batch, heads, seq))."""
    q, k, v = _rows(q), _rows(k), _rows(v)
    out, lse = _seq_major(q), torch.empty(q.shape[:-1], dtype=torch.float32)
    _check(
        _call(
            kernels.attention_forward_bf16(),
            q,
            k,
            v,
            out,
            lse,
            tensors=(q, k, v, out.transpose(1, 2)),
            cos=cos,
            sin=sin,
            rotary_dim=rotary_dim,
        )
    )
    return out, lse


@_amx_forward.register_fake
def _(q, k, v, cos, sin, rotary_dim):
    return _seq_major(q), q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("frugality::amx_attention_backward", mutates_args=())
def _amx_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    grad_out: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    rotary_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """dq, dk, dv (with respect to q and k before rotation), each laid out (batch, seq, heads,
    dim); q, k, v, out, grad_out (batch, heads, seq, dim)."""
    q, k, v, out, grad_out = _rows(q), _rows(k), _rows(v), _rows(out), _rows(grad_out)
    dq, dk, dv = _seq_major(q), _seq_major(q), _seq_major(q)
    _check(
        _call(
            kernels.attention_backward_bf16(),
            q,
            k,
            v,
            out,
            lse,
            grad_out,
            dq,
            dk,
            dv,
            tensors=(q, k, v, out, grad_out, dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)),
            cos=cos,
            sin=sin,
            rotary_dim=rotary_dim,
        )
    )
    return dq, dk, dv


@_amx_backward.register_fake
def _(q, k, v, out, lse, grad_out, cos, sin, rotary_dim):
    return _seq_major(q), _seq_major(q), _seq_major(q)


def _save_for_backward(ctx, inputs, output) -> None:
    q, k, v, cos, sin, ctx.rotary_dim = inputs
    ctx.save_for_backward(q, k, v, cos, sin, *output)


def _amx_gradients(ctx, grad_out, grad_lse):
    q, k, v, cos, sin, out, lse = ctx.saved_tensors
    # grad_out is the gradient of the op's (batch, seq, heads, dim) output
    grads = _amx_backward(q, k, v, out.transpose(1, 2), lse, grad_out.transpose(1, 2), cos, sin, ctx.rotary_dim)
    return *(g.transpose(1, 2) for g in grads), None, None, None


_amx_forward.register_autograd(_amx_gradients, setup_context=_save_for_backward)


def amx_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, rotary=None) -> torch.Tensor:
    """Causal attention through the C kernel (see `amx_attention_applies`), k and v with
    q's heads, q and k rotated first by `rotary` (a RotaryEmbedding) if given; scale
    head_size ** -0.5."""
    seq = q.shape[-2]
    if rotary is None or rotary.dim == 0:
        cos = sin = q.new_empty(0, dtype=torch.float32)
        return _amx_forward(q, k, v, cos, sin, 0)[0].transpose(1, 2)
    # float32 even where a policy cast the model's buffers; rows of (max_seq_len, dim): contiguous
    cos, sin = rotary.cos[:seq].float(), rotary.sin[:seq].float()
    return _amx_forward(q, k, v, cos, sin, rotary.dim)[0].transpose(1, 2)


def _repeat_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """k and v with as many heads as q (each serving a contiguous group of q's heads)."""
    group = q.shape[1] // k.shape[1]
    if group == 1:
        return k, v
    return k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)


def causal_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    rotary: RotaryEmbedding | None = None,
    fp32_products: bool = False,
) -> torch.Tensor:
    """The models' causal attention (see frugality.models.layers.CausalAttention) on a CPU:
    bf16 with AMX through `amx_attention`; training inside a compiled region through
    `BlockedBackwardAttention`; else SDPA. With `fp32_products`, bf16 inputs are computed
    in float32 (rotated in bf16 first, as the plain layer does)."""
    if fp32_products and q.dtype == torch.bfloat16:
        if rotary is not None:
            q, k = rotary(q), rotary(k)
        out = causal_attention(q.float(), k.float(), v.float())
        return out.to(torch.bfloat16)
    if q.device.type == "cpu" and amx_attention_applies(q, k, v):
        return amx_attention(q, *_repeat_kv(q, k, v), rotary)
    if rotary is not None:
        q, k = rotary(q), rotary(k)
    training = torch.is_grad_enabled() and q.requires_grad
    if q.device.type == "cpu" and torch.compiler.is_compiling() and training:
        return BlockedBackwardAttention.apply(q, *_repeat_kv(q, k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=k.shape[1] != q.shape[1])


class CPUCausalAttention(CausalAttention):
    """The plain layer's attention through `causal_attention`: same results up to float32
    rounding order, faster on CPUs; with `fp32_products` (any device without native bf16
    products), bf16 attention computed in float32."""

    fp32_products = False  # set by frugality.kernels.specialize

    def forward(self, q, k, v, rotary=None):
        return causal_attention(q, k, v, rotary, self.fp32_products)


class ProductRotaryEmbedding(RotaryEmbedding):
    """RotaryEmbedding whose half swap is a product with a permutation matrix (exact: each
    output is one input times 1). Compiled on CPUs the slicing form's backward ran as
    masked vector loads at the half and `dim` boundaries: 10 ms more per Pythia-70m layer at
    4 x 512 tokens (2-core Xeon, forward + backward of a compiled block, median of 30 paired
    runs). Only where the product's dtype is fast (float32, or bf16 with native products)."""

    swap: torch.Tensor  # a buffer, registered by specialize

    def specialize(self) -> None:
        head_size = self.cos.shape[1]
        half = self.dim // 2
        source = torch.arange(head_size)  # (x @ swap)[..., i] = x[..., source[i]]
        source[:half] += half
        source[half : self.dim] -= half
        swap = torch.zeros(head_size, head_size, device=self.cos.device)
        swap[source, torch.arange(head_size)] = 1.0
        self.register_buffer("swap", swap, persistent=False)

    def swap_halves(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.swap.to(x.dtype)
