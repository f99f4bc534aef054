"""Compile levels: what `compile.level` compiles, and how.

| level | what runs compiled                          | Inductor mode                 | compile time |
|-------|---------------------------------------------|-------------------------------|--------------|
| `O0`  | nothing (eager)                             | -                             | none         |
| `O1`  | each transformer block, forward + backward  | default                       | one block    |
| `O2`  | the same                                    | `max-autotune-no-cudagraphs`  | one block, plus autotuning |

Only the blocks are compiled ("regional compilation"): all layers share one block graph, so
the compile cost does not grow with depth, and the state-dict keys stay as they are (no
`_orig_mod.` prefix). The embedding lookup stays eager, as does the output layer with its
cross-entropy, which `frugality.kernels.output_loss` already fuses by hand. Shapes are static
(`dynamic=False`): the data path only ever produces (micro_batch_size, seq_len) batches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from frugality.backends import backend
from frugality.config.recipe import COMPILE_LEVELS as LEVELS  # noqa: F401 - the levels, named once there
from frugality.errors import UserError


@dataclass(frozen=True)
class CompileLevel:
    name: str
    mode: str | None  # torch.compile mode; None = eager
    description: str
    options: dict = field(default_factory=dict)


_LEVELS = {
    "O0": CompileLevel("O0", None, "eager: no compilation"),
    "O1": CompileLevel("O1", "default", "transformer blocks compiled with Inductor's defaults"),
    "O2": CompileLevel(
        "O2", "max-autotune-no-cudagraphs", "transformer blocks compiled with autotuned matrix-product templates"
    ),
}


def get_level(name: str) -> CompileLevel:
    return _LEVELS[name]


CPP_WRAPPER_MAX_THREADS = 4  # measured better at 2; where parallel per-kernel builds win is not measured


def inductor_options(device: torch.device, compute_dtype: torch.dtype, recomputes: bool = False) -> dict:
    """Inductor options by device and dtype (bf16 wherever the blocks hold bf16 tensors, also
    with fp32 products; part of the cache key through Inductor's own config hash).

    On CPU with bf16, torch 2.13's C++ code generator declares the same variable twice when
    one kernel stores two identical bf16 reductions (two bias gradients of a parallel-residual
    block are both the sum of the residual gradient): "conflicting declaration
    'auto at_BFloat16_tmp_acc0_vec'" (pytorch/pytorch#194706). Not fusing reductions
    horizontally keeps each one in its own kernel; it costs nothing measurable here.
    On CPU, no precompiled header: see `frugality.compile.session`. And on CPUs of up to
    CPP_WRAPPER_MAX_THREADS threads a C++ wrapper: each graph's kernels and the code calling
    them build as a few libraries, not one per kernel, each build parsing the same
    vectorisation headers (2 threads: the tiny recipe's cold compile 32.5 -> 20.4 s, 30 -> 12
    g++ runs; the same kernels, losses and step time). With many cores Inductor builds the
    per-kernel libraries in parallel, and a graph's one library would be the longest build:
    not measured there, so left as Inductor has it. (The thread count is in the compile
    cache's fingerprint already: machines that share an entry choose alike.) Not with
    activation checkpointing (`recomputes`): a recomputed block's attention is a seeded op to
    the partitioner (its dropout), wrapped to replay its RNG state, which torch 2.13's C++
    wrapper cannot emit ("AssertionError: RunAndSaveRngState"); the Python wrapper can.
    """
    options = {}
    if backend(device).on_host:  # Inductor's C++ for the host
        options["cpp_cache_precompile_headers"] = False  # see frugality.compile.session
        if torch.get_num_threads() <= CPP_WRAPPER_MAX_THREADS and not recomputes:
            options["cpp_wrapper"] = True
        if compute_dtype == torch.bfloat16:
            options["cpp.max_horizontal_fusion_size"] = 1
    return options


def compile_targets(model: nn.Module) -> list[nn.Module]:
    """The modules a level compiles: the model's transformer blocks."""
    layers = getattr(model, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not len(layers):
        raise TypeError(f"{type(model).__name__} has no `layers` list of blocks to compile")
    return list(layers)


def graph_name(model: nn.Module) -> str:
    block = compile_targets(model)[0]
    return f"{type(model).__name__} block ({type(block).__module__}.{type(block).__qualname__})"


def check_backend(name: str) -> None:
    """A torch.compile backend registered here, or one UserError line."""
    import torch._dynamo

    known = torch._dynamo.list_backends(exclude_tags=())
    if name not in known:
        raise UserError(
            f"compile.backend {name!r}: not a torch.compile backend here (these are: {', '.join(sorted(known))}); "
            "a vendor's backend comes with its own package (TorchNeuron's neuron: docs/xla.md)"
        )


def apply_level(model: nn.Module, level: CompileLevel, options: dict, backend: str = "inductor") -> None:
    """Compile the blocks in place with `nn.Module.compile` (lazily: on their first call);
    a backend other than Inductor takes neither Inductor's modes nor its options."""
    if level.mode is None:
        return
    if backend != "inductor":
        for block in compile_targets(model):
            block.compile(dynamic=False, backend=backend)
        return
    mode = None if level.mode == "default" else level.mode
    for block in compile_targets(model):
        if options and mode is not None:
            # torch.compile takes a mode or options, not both: spell the mode out.
            merged = torch._inductor.list_mode_options(mode) | options
            block.compile(dynamic=False, options=merged)
        else:
            block.compile(dynamic=False, mode=mode, options=options or None)


def revert_to_eager(model: nn.Module) -> None:
    """Undo `apply_level`: the blocks run their eager forward again."""
    for block in compile_targets(model):
        block._compiled_call_impl = None  # what nn.Module.compile sets; None = eager
