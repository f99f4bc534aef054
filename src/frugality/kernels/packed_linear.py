"""bf16 linear layers for inference on CPUs, their weights laid out once in oneDNN's blocked
order (`PackedLinear`, swapped in for nn.Linear by `pack_linear_weights`); and an attention's
query, key and value stacked into one product, for packing or for int8
(`stack_attention_projections`).

A plain bf16 `F.linear` on a CPU hands oneDNN the weight in PyTorch's row-major layout at
every call, and oneDNN's bf16 kernels want their own blocked layout: at the row counts a
server batches (tens of tokens) that costs a large part of the product. Laid out once at
load (`torch.ops.mkldnn._reorder_linear_weight`, as Inductor's freezing pass does for CPU
models), the same product runs through `torch.ops.mkldnn._linear_pointwise`, with the same
bits on the Zen 4 measured (on AMX the two are different oneDNN kernels: not yet compared).

Measured (benchmarks/packed_linear.py, AMD EPYC Zen 4, 2 threads, all-MiniLM-L6-v2's shapes,
the 2026-11-27 table): 1.59-1.88x a layer at 11 rows, 1.16-1.40x
at 96, 1.06-1.16x at 1,000; the whole encoder's call 1.43x for one text, 1.05-1.28x for 4-8
(a server's batches), 1.09-1.11x for 16-64; `generate`'s eager engine on a decoder of
Pythia-70m's shape, its output layer packed too, 1.19x at batch 1 and 1.13x at 8, the same
completions. Runs of the same evening gave a call 1.28-1.37x for one text (the tables at
8f6bd87 and bf6d121). In fp32 PyTorch uses MKL, whose packed layout
(`torch.ops.mkl._mkl_linear`) gained under 10% at these shapes in a hand probe: not used.

A BERT attention's query, key and value products become one packed product of three times
the width (`PackedAttention`): one oneDNN call instead of three, the same bits on the Zen 4
(AMX not compared); against the
layers packed apart, an encoder call 1.07-1.36x for one text, 1.03-1.11x for 4, 0.99-1.07x
for 8-64 (all-MiniLM-L6-v2, the Zen 4 above, three runs of the benchmark in a noisy hour:
a server's lone requests gain, a job's batches about nothing).

Inference only (no gradient flows to a packed weight). `inference.encoder.load_encoder` and
`inference.generate.load_decoder` pack only where bf16 products are native
(`frugality.precision.bf16_is_native`, which counts an ONEDNN_MAX_CPU_ISA cap).
"""

from __future__ import annotations

import torch
from torch import nn

from frugality.kernels.encoder_attention import attend, attend_unpadded
from frugality.models.bert import Attention, Unpadded
from frugality.models.layers import OutputLayer


def packing_runs() -> bool:
    """Whether this PyTorch has oneDNN's packed bf16 linear ops and oneDNN says it runs bf16
    (natively, or emulated under some ONEDNN_MAX_CPU_ISA caps: the callers ask
    `bf16_is_native` too)."""
    mkldnn = torch.ops.mkldnn
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(mkldnn, "_reorder_linear_weight")
        and hasattr(mkldnn, "_linear_pointwise")
        and bool(mkldnn._is_mkldnn_bf16_supported())
    )


class PackedLinear(nn.Module):
    """`linear`'s product with its weight in oneDNN's blocked layout (bf16, CPU)."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # an opaque layout: only `_linear_pointwise` reads it (not saved: a buffer apart from the state dict)
            self.register_buffer("packed", torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach()), False)
            bias = linear.bias.detach().clone() if linear.bias is not None else None
            self.register_buffer("bias", bias, False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class PackedOutputLayer(PackedLinear):
    """A language model's `OutputLayer`, packed: the same logits, and the loss from them."""

    loss = OutputLayer.loss  # (both call the layer itself: its packed product here)
    logits_or_loss = OutputLayer.logits_or_loss


class PackedAttention(Attention):
    """BERT's attention with its query, key and value products as one packed product (their
    weights stacked: the same dot products, one oneDNN call), its output product packed; or,
    `packed` False, both as plain linear layers for int8 to swap (`stack_attention_projections`)."""

    def __init__(self, attention: Attention, packed: bool = True) -> None:
        nn.Module.__init__(self)  # (the plain layer's own three projections are not made)
        self.heads, self.head_size = attention.heads, attention.head_size
        parts = (attention.query, attention.key, attention.value)
        stacked = nn.Linear(parts[0].in_features, 3 * parts[0].out_features, device="meta")  # (no values drawn)
        with torch.no_grad():  # the three weights one after another: q's features, then k's, then v's
            stacked.weight = nn.Parameter(torch.cat([p.weight.detach() for p in parts]), requires_grad=False)
            stacked.bias = nn.Parameter(torch.cat([p.bias.detach() for p in parts]), requires_grad=False)
        # (`packed` False: plain linear layers, for another swap to take: int8's)
        self.qkv = PackedLinear(stacked) if packed else stacked
        self.out = PackedLinear(attention.out) if packed else attention.out

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None, tokens: Unpadded | None = None) -> torch.Tensor:
        if tokens is not None:  # x: (real tokens, d)
            d, qkv = x.shape[-1], self.qkv(x)
            q, k, v = qkv.split(d, dim=1)
            if (y := attend_unpadded(q, k, v, mask, tokens, self.heads)) is not None:
                return self.out(y)
            b, t = tokens.rows, tokens.length  # else attention on them padded back
            qkv = tokens.pad(qkv)
        else:
            (b, t, d), qkv = x.shape, self.qkv(x)
        q, k, v = qkv.view(b, t, 3 * d).split(d, dim=2)  # (views: one layout, as `attend` takes them)
        y = attend(q, k, v, mask, self.heads)
        return self.out(tokens.unpad(y.flatten(0, 1)) if tokens is not None else y)


def stack_attention_projections(model: nn.Module) -> int:
    """Each plain BERT attention in `model` whose query, key and value are plain linear
    layers with biases, of their own, swapped in place for a `PackedAttention` of plain
    layers (`packed` False): one product of the three stacked where they were three calls.
    Returns how many. For int8 (`precision.int8.quantize_int8` then swaps the stacked layer):
    its per-channel weight scales and per-token activation scales are the three's, so the
    same bits in a third of the calls."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1
    swapped = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is not Attention:
                continue
            parts = (child.query, child.key, child.value)
            if all(
                type(p) is nn.Linear and p.bias is not None and owners[id(p.weight)] == owners[id(p.bias)] == 1
                for p in parts
            ):
                setattr(module, name, PackedAttention(child, packed=False))
                swapped += 1
    return swapped


def pack_linear_weights(model: nn.Module, skip: tuple[str, ...] = (), stack_attention: bool = True) -> int:
    """Swap `model`'s bf16 CPU linear layers for `PackedLinear` (an `OutputLayer` for
    `PackedOutputLayer`, a BERT attention's four for `PackedAttention`'s two), except those
    whose name starts with one of `skip` and those whose weight another module shares (a
    tied output layer keeps the embedding's tensor; an attention any of whose four layers is
    skipped or shared stays whole, its other layers packed apart). Returns how many linear layers were
    swapped (0 where packing does not run here). The packed weights are opaque oneDNN
    tensors: the model's state dict no longer holds them, and it cannot be copied, cast or
    compiled by Inductor; load another for that. `stack_attention` False packs an
    attention's four layers apart (what its benchmark compares)."""
    if not packing_runs():
        return 0
    owners: dict[int, int] = {}
    for module in model.modules():
        for p in module.parameters(recurse=False):
            owners[id(p)] = owners.get(id(p), 0) + 1

    def packs(full: str, child: nn.Module) -> bool:
        return (
            isinstance(child, nn.Linear)
            and type(child) in (nn.Linear, OutputLayer)  # (not int8's, AMX's or others' subclasses)
            and child.weight.device.type == "cpu"
            and child.weight.dtype == torch.bfloat16
            and owners.get(id(child.weight), 0) == 1
            and not any(full == s or full.startswith(s + ".") for s in skip)
        )

    swapped = 0
    passes = ((Attention,), (nn.Linear, OutputLayer)) if stack_attention else ((nn.Linear, OutputLayer),)
    for kinds in passes:  # attentions first: their layers go with them
        for name, module in list(model.named_modules()):
            for child_name, child in list(module.named_children()):
                full = f"{name}.{child_name}" if name else child_name
                if type(child) not in kinds:
                    continue
                if isinstance(child, Attention):
                    parts = {part: getattr(child, part) for part in ("query", "key", "value", "out")}
                    if all(packs(f"{full}.{part}", layer) for part, layer in parts.items()):
                        setattr(module, child_name, PackedAttention(child))
                        swapped += 4
                elif isinstance(child, nn.Linear) and packs(full, child):
                    kind = PackedOutputLayer if isinstance(child, OutputLayer) else PackedLinear
                    setattr(module, child_name, kind(child))
                    swapped += 1
    return swapped
