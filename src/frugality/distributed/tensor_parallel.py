"""Tensor and sequence parallel from outside the plain models, on DTensor (Megatron-LM's
layout, as torchtitan applies it with `parallelize_module`): a plan per model family names
how each layer's weights are split over the ranks of the mesh's "tensor" dimension.

- Attention: the query-key-value projections split by output rows, whole heads to each
  rank (GPT-NeoX's fused weight is laid out [heads, (q, k, v), head_size], so consecutive
  rows are consecutive heads; Llama's grouped-query k and v by key-value heads), the output
  projection by input columns: one all-reduce after it.
- MLP: the first projection(s) by columns, the second by rows: one all-reduce.
- Embedding and output layer split along the vocabulary; the loss is computed on the
  sharded logits (`loss_parallel`), so no rank ever holds a full-vocabulary row.
- Sequence parallel (`parallel.sequence`): between those layers the residual stream and
  the norms are split along the sequence (the all-reduces become a reduce-scatter and an
  all-gather), so activations there take 1/tensor of the memory.
- Everything else (the norms without sequence parallel) is replicated on the tensor ranks,
  as a DTensor too, so that clipping and checkpoints see one kind of parameter.

The models compute their head counts from the projections' widths, so the same code runs
on a rank's share of the heads.
"""

from __future__ import annotations

import contextlib
from typing import cast

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    RowwiseParallel,
    SequenceParallel,
    loss_parallel,
    parallelize_module,
)

from frugality.errors import UserError
from frugality.models import Decoder, ModelConfig
from frugality.models.families import family, names


def check_tensor_parallel(
    model_config: ModelConfig, tensor: int, sequence: bool, world_size: int, seq_len: int
) -> None:
    """Bad combinations, one line each, before anything starts."""
    if tensor == 1:
        if sequence:
            raise UserError("parallel.sequence: needs parallel.tensor > 1 (it splits what tensor parallel replicates)")
        return
    if world_size % tensor:
        raise UserError(
            f"parallel.tensor {tensor}: must divide the number of processes ({world_size}); tensor parallel "
            "runs on torchrun (frugality train --nproc N, a multiple of it)"
        )
    spec = family(model_config)
    if not spec.tensor_parallel:
        raise UserError(
            f"parallel.tensor {tensor}: model family {spec.name!r} has no tensor-parallel plan "
            f"({names(lambda f: f.tensor_parallel)} do)"
        )
    for what, count in spec.heads_to_split(model_config).items():
        if count % tensor:
            raise UserError(f"parallel.tensor {tensor}: the model's {count} {what} do not divide among {tensor} ranks")
    ffn = spec.width_of_mlp(model_config)
    if ffn % tensor:
        raise UserError(f"parallel.tensor {tensor}: the MLP's width ({ffn}) does not divide among {tensor} ranks")
    if model_config.vocab_size % tensor:
        raise UserError(
            f"parallel.tensor {tensor}: model.vocab_size ({model_config.vocab_size}) is not a multiple of it; "
            f"pad the vocabulary (GPT-NeoX pads to a multiple of 128 x tensor)"
        )
    if sequence and seq_len % tensor:
        raise UserError(f"parallel.sequence: data.seq_len ({seq_len}) does not divide among {tensor} ranks")


def _gpt_neox_block(sequence: bool) -> dict:
    return {
        "attn.qkv": ColwiseParallel(),
        "attn.out": RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate()),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate()),
    }


def _llama_block(sequence: bool) -> dict:
    return {
        "attn.q": ColwiseParallel(),
        "attn.k": ColwiseParallel(),
        "attn.v": ColwiseParallel(),
        "attn.o": RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate()),
        "mlp.gate": ColwiseParallel(),
        "mlp.up": ColwiseParallel(),
        "mlp.down": RowwiseParallel(output_layouts=Shard(1) if sequence else Replicate()),
    }


PLANS = {"gpt-neox": _gpt_neox_block, "llama": _llama_block}


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sequence: bool) -> str:
    """Split `model`'s layers over `mesh` (one dimension: the tensor-parallel ranks), in
    place; a line for the run header. The weights each rank starts from are the slices of
    the same full weights (every rank built the model from the recipe's seed)."""
    model = cast(Decoder, model)  # a family of PLANS (`check_tensor_parallel`)
    plan_of = PLANS[model.config.family]
    seq = Shard(1) if sequence else Replicate()  # the residual stream between the split layers
    top = {
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=seq),
        # the logits stay split by vocabulary: the loss runs on the shards (loss_parallel)
        "output": ColwiseParallel(input_layouts=seq, output_layouts=Shard(-1), use_local_output=False),
    }
    if sequence:
        top["final_norm"] = SequenceParallel()
    parallelize_module(model, mesh, top)
    for block in model.layers:
        plan = plan_of(sequence)
        if sequence:
            plan["attn_norm"] = SequenceParallel()
            plan["mlp_norm"] = SequenceParallel()
            plan["attn"] = PrepareModuleInput(input_layouts=(Shard(1), None), desired_input_layouts=(Replicate(), None))
            plan["mlp"] = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
        parallelize_module(block, mesh, plan)
        if not sequence:
            for name in ("attn_norm", "mlp_norm"):
                _replicate(getattr(block, name), mesh)
    if not sequence:
        _replicate(model.final_norm, mesh)
    if getattr(model.config, "tie_embeddings", False):  # both split by vocabulary alike: one parameter again
        model.output.weight = model.embed.weight
    size = mesh.size()
    what = "attention heads, MLP columns and the vocabulary"
    line = f"tensor parallel over {size} ranks ({what} split; the loss on vocabulary shards)"
    return line + (", sequence parallel between them" if sequence else "")


def _replicate(module: nn.Module, mesh: DeviceMesh) -> None:
    """`module`'s parameters as DTensors replicated on the tensor ranks, its input and
    output plain tensors as before (every rank computes the same)."""

    def to_dtensor(module, inputs, mesh):
        return tuple(DTensor.from_local(x, mesh, [Replicate()], run_check=False) for x in inputs)

    def to_local(module, output, mesh):
        return output.to_local()

    # torch types input_fn as returning None; a pre-hook's return value replaces the inputs, as here
    distribute_module(module, mesh, input_fn=to_dtensor, output_fn=to_local)  # pyright: ignore[reportArgumentType]


@contextlib.contextmanager
def loss_context(enabled: bool):
    """Around forward and backward: cross-entropy over logits split by vocabulary (each rank
    its shard's log-sum-exp, all-reduced) where tensor parallel is on."""
    if not enabled:
        yield
        return
    with loss_parallel():
        yield
