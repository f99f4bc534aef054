"""A residual add and LayerNorm at inference on CPUs through a C kernel
(kernels/layer_norm_cpu.c): `add_layer_norm`, and BERT's blocks and embeddings that call it
(`KernelBlock`, `KernelEmbeddings`, swapped in by `use_kernel_layer_norm`).

PyTorch's CPU LayerNorm pays its fixed costs per row, and the residual add before it is a
pass of its own: on an encoder's narrow rows that is most of their time (a one-layer
width-32 BERT on 20,000 WordNet glosses: 46 ms in LayerNorm and 9 ms in the adds of 280,
one thread, bf16, Zen 4). The kernel adds, normalises and writes a row in one pass.
The results are torch's up to float32 summation order (in bf16 the sum is rounded to bf16
before it is normalised, as `norm(x + r)` rounds it). Elsewhere (other devices and dtypes,
non-contiguous rows, gradients, compiled or traced graphs, CPUs without AVX2, no C compiler,
FRUGALITY_DISABLE_KERNELS=layer-norm) it is `norm(x + r)`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.jit._trace import is_tracing  # (torch.jit re-exports it, but not to type checkers)

from frugality import kernels
from frugality.models.bert import Block, Embeddings, Unpadded


def add_layer_norm(x: torch.Tensor, r: torch.Tensor | None, norm: nn.LayerNorm) -> torch.Tensor:
    """`norm(x + r)` (`norm(x)` where r is None; r of x's shape, or one row of x's width
    added to every row), through the kernel where it applies."""
    if _kernel_applies(x, r, norm) and (kernel := kernels.add_layer_norm()) is not None:
        out = torch.empty_like(x)
        assert norm.weight is not None and norm.bias is not None  # (as _kernel_applies found)
        width = x.shape[-1]
        code = kernel(
            x.data_ptr(), 0 if r is None else r.data_ptr(), width if r is not None and r.dim() > 1 else 0,
            norm.weight.data_ptr(), norm.bias.data_ptr(), out.data_ptr(), x.numel() // width, width, norm.eps,
            int(x.dtype == torch.bfloat16), torch.get_num_threads(),
        )  # fmt: skip
        if code == 0:
            return out
    return norm(x if r is None else x + r)


def _kernel_applies(x: torch.Tensor, r: torch.Tensor | None, norm: nn.LayerNorm) -> bool:
    weight, bias = norm.weight, norm.bias
    return (
        x.device.type == "cpu"
        and x.dtype in (torch.float32, torch.bfloat16)
        and x.is_contiguous()
        and x.numel() > 0
        and (r is None or (r.dtype == x.dtype and r.shape in (x.shape, x.shape[-1:]) and r.is_contiguous()))
        and weight is not None
        and bias is not None
        and norm.normalized_shape == (x.shape[-1],)
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
