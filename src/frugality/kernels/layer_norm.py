"""A residual add and LayerNorm at inference on CPUs through a C kernel
(kernels/layer_norm_cpu.c): `add_layer_norm`, and BERT's blocks and embeddings that call it
(`KernelBlock`, `KernelEmbeddings`, swapped in by `use_kernel_layer_norm`).

PyTorch's CPU LayerNorm pays its fixed costs per row, and the residual add before it is a
pass of its own: on an encoder's narrow rows that is most of their time (a one-layer
width-32 BERT on 20,000 WordNet glosses: 46 ms in LayerNorm and 9 ms in the adds of 280,
one thread, bf16, Zen 4). The kernel adds, normalises and writes a row in one pass.
The results are torch's up to float32 rounding (in bf16 the sum is rounded to bf16 before it
is normalised, as `norm(x + r)` rounds it; a row of equal values gives the bias, as torch's
Welford moments give it). Elsewhere (other devices and dtypes,
non-contiguous rows, gradients, compiled or traced graphs, CPUs without AVX2, no C compiler,
FRUGALITY_DISABLE_KERNELS=layer-norm) it is `norm(x + r)`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.jit._trace import is_tracing  # (torch.jit re-exports it, but not to type checkers)

from frugality import kernels
from frugality.models.bert import Block, Embeddings, Unpadded

# Below this many elements torch's two calls cost less than the kernel's one, or as much: its
# Python checks and ctypes call (about 10 us) outweigh its gain (by hand, bf16, 2 threads,
# Zen 4, torch against the kernel: 30 x 32 8.6-11.3 us against 16.3; 48 x 384 16.1-30.9
# against 23.6-38.3; 96 x 384 22.2-25.9 against 23.8-25.7; 1,000 x 32 37.3-45.5 against
# 35.1; 192 x 384 39.0-39.7 against 31.5-33.3). Narrow rows gain sooner than wide ones (1,000
# x 32 led, 96 x 384 did not): one threshold for both, where the kernel led at every width.
MIN_ELEMENTS = 32_768


def add_layer_norm(x: torch.Tensor, r: torch.Tensor | None, norm: nn.LayerNorm) -> torch.Tensor:
    """`norm(x + r)` (`norm(x)` where r is None; r of x's shape, or one row of x's width
    added to every row), through the kernel where it applies (MIN_ELEMENTS or more)."""
    weight, bias = norm.weight, norm.bias  # (each a module attribute lookup: once)
    if (
        weight is not None
        and bias is not None
        and _kernel_applies(x, r, norm, weight, bias)
        and (kernel := kernels.add_layer_norm()) is not None
    ):
        out = torch.empty_like(x)
        width = x.shape[-1]
        code = kernel(
            x.data_ptr(), 0 if r is None else r.data_ptr(), width if r is not None and r.dim() > 1 else 0,
            weight.data_ptr(), bias.data_ptr(), out.data_ptr(), x.numel() // width, width, norm.eps,
            int(x.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if code == 0:
            return out
    return norm(x if r is None else x + r)


def _kernel_applies(
    x: torch.Tensor, r: torch.Tensor | None, norm: nn.LayerNorm, weight: torch.Tensor, bias: torch.Tensor
) -> bool:
    return (
        x.numel() >= MIN_ELEMENTS  # (first: a small call's way to torch stays cheap)
        and x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and (
            r is None
            or (
                r.device == x.device and r.dtype == x.dtype and r.shape in (x.shape, x.shape[-1:]) and r.is_contiguous()
            )
        )
        and norm.normalized_shape == (x.shape[-1],)
        and weight.device == bias.device == x.device
        and weight.dtype == bias.dtype == x.dtype
        and weight.is_contiguous()
        and bias.is_contiguous()
        and not (
            torch.is_grad_enabled()
            and (x.requires_grad or weight.requires_grad or bias.requires_grad or (r is not None and r.requires_grad))
        )
        and not torch.compiler.is_compiling()
        and not is_tracing()
    )


class KernelBlock(Block):
    """BERT's post-LN block (the same parameters) with each residual add and its LayerNorm
    through `add_layer_norm`."""

    def forward(self, h: torch.Tensor, mask: torch.Tensor | None, tokens: Unpadded | None = None) -> torch.Tensor:
        h = add_layer_norm(self.attn(h, mask, tokens), h, self.attn_norm)
        return add_layer_norm(self.down(self.act(self.up(h))), h, self.mlp_norm)


class KernelEmbeddings(Embeddings):
    """BERT's embeddings (the same parameters) with the last add and the LayerNorm through
    `add_layer_norm`: the same sum, (word + position) + token type; without token types, type
    0's row is added to every token (not looked up for each: the same values)."""

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor | None) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        types = self.token_type(token_type_ids) if token_type_ids is not None else self.token_type.weight[0]
        return add_layer_norm(self.word(input_ids) + self.position(positions), types, self.norm)


def use_kernel_layer_norm(model: nn.Module) -> int:
    """BERT's plain blocks and embeddings in `model` swapped, in place, for `KernelBlock` and
    `KernelEmbeddings` where the kernel may run here (frugality.kernels.dispatch) and builds;
    returns how many."""
    if kernels.add_layer_norm() is None:
        return 0
    swapped = 0
    for module in model.modules():
        if type(module) is Block:
            module.__class__ = KernelBlock
            swapped += 1
        elif type(module) is Embeddings:
            module.__class__ = KernelEmbeddings
            swapped += 1
    return swapped
