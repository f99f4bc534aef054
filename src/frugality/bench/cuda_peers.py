"""The peers of `bench train` that run on CUDA only (their kernels are Triton's), each set up
the way its own documentation sets it up, at amp-bf16 (their usual bf16 training):

- `liger-kernel`: transformers' LlamaForCausalLM with liger-kernel's RMSNorm, SwiGLU and
  fused linear cross-entropy (`apply_liger_kernel_to_llama(model=...)`), under bf16
  autocast, fused AdamW, not compiled (as `TrainingArguments(use_liger_kernel=True)` runs
  it). liger-kernel patches transformers' Llama module for the whole process (its RMSNorm
  and MLP classes, its RoPE function); the module is restored once this model is patched,
  so the transformers rows beside it stay transformers'. Its RoPE patch is left off: the
  model calls the module's function at run time, so it cannot be kept to this model.
  liger-kernel has no GPT-NeoX patch (its families: Llama, Mistral, Qwen, Gemma, ...).
- `torchtitan`: torchtitan's own Llama 3 model (`Llama3Model`, fused QKV, SDPA attention)
  and its training step: each transformer block compiled (`fullgraph=True`), as torchtitan's
  `apply_compile` does; bf16 parameters over fp32 master weights through FSDP2's
  mixed-precision policy on a one-GPU mesh (how torchtitan trains in bf16 on one GPU); its
  compiled cross-entropy loss in fp32; fused AdamW. Activation checkpointing is off (frugality
  does not checkpoint either), and the loss is the plain one, not chunked. torchtitan has no
  GPT-NeoX model.

The API facts these rest on (torchtitan 0.3.0, liger-kernel 0.8.5) are in docs/benchmarks.md.
"""

from __future__ import annotations

import dataclasses
import socket
from functools import partial

import torch
from torch import nn

from frugality.backends import backend
from frugality.config.recipe import Recipe


def liger(recipe: Recipe, device: torch.device, unavailable):
    """(step, model, optimizer): liger-kernel's layers in transformers' Llama."""
    if recipe.model.family != "llama":
        raise unavailable("liger-kernel has no GPT-NeoX patch (its families: Llama, Mistral, Qwen, Gemma, ...)")
    try:
        from liger_kernel.transformers import apply_liger_kernel_to_llama
    except ImportError as e:
        raise unavailable(f"liger-kernel is not installed ({e.name}; pip install liger-kernel)") from None
    from transformers.models.llama import modeling_llama

    from frugality.bench.reference import build_transformers, transformers_step

    model, optimizer, autocast = build_transformers(recipe, "amp-bf16", device, fused_adamw=True)
    names = ("LlamaRMSNorm", "LlamaMLP", "apply_rotary_pos_emb")
    kept = {n: getattr(modeling_llama, n) for n in names}
    try:  # this model's norms, MLPs and loss become liger's
        apply_liger_kernel_to_llama(rope=False, model=model)
    finally:  # ... and no other model's
        for n, value in kept.items():
            setattr(modeling_llama, n, value)
    clip = recipe.optim.grad_clip
    return (lambda b: transformers_step(model, optimizer, autocast, b, clip)), model, optimizer


def torchtitan(recipe: Recipe, device: torch.device, unavailable):
    """(step, model, optimizer): torchtitan's Llama 3 and its step on one GPU."""
    m = recipe.model
    if m.family != "llama":
        raise unavailable("torchtitan has no GPT-NeoX model (its dense decoder is Llama 3)")
    _torch_2_11_stand_in()
    try:
        from torchtitan.components.loss import cross_entropy_loss
        from torchtitan.distributed.fsdp import apply_fsdp_to_decoder
        from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm, ScaledDotProductAttention
        from torchtitan.models.common.config_utils import make_ffn_config, make_gqa_config
        from torchtitan.models.common.param_init import depth_scaled_std, skip_param_init
        from torchtitan.models.llama3 import Llama3Model
        from torchtitan.models.llama3.model import Llama3TransformerBlock
    except ImportError as e:
        raise unavailable(f"torchtitan does not import here ({type(e).__name__}: {e})") from None

    dim, heads = m.hidden_size, m.num_heads

    def normal(std, **bounds):
        return {"weight": partial(nn.init.trunc_normal_, std=std, **bounds), "bias": nn.init.zeros_}

    ones = {"weight": nn.init.ones_}
    rope = ComplexRoPE.Config(dim=dim // heads, max_seq_len=m.max_seq_len, theta=m.rope_theta, scaling="none")
    layers = [
        Llama3TransformerBlock.Config(
            attention_norm=RMSNorm.Config(normalized_shape=dim, eps=m.rms_norm_eps, param_init=ones),
            ffn_norm=RMSNorm.Config(normalized_shape=dim, eps=m.rms_norm_eps, param_init=ones),
            attention=make_gqa_config(
                dim=dim,
                n_heads=heads,
                n_kv_heads=m.kv_heads,
                fuse_qkv=True,
                rope=rope,
                inner_attention=ScaledDotProductAttention.Config(),
                wqkv_param_init=normal(0.02),
                wo_param_init=normal(depth_scaled_std(0.02, i)),
            ),
            feed_forward=make_ffn_config(
                dim=dim,
                hidden_dim=m.intermediate_size,
                w1_param_init=normal(0.02),
                w2w3_param_init=normal(depth_scaled_std(0.02, i)),
            ),
        )
        for i in range(m.num_layers)
    ]
    scale = dim**-0.5
    embedding_init = {"weight": skip_param_init} if m.tie_embeddings else {"weight": partial(nn.init.normal_, std=1.0)}
    config = Llama3Model.Config(
        dim=dim,
        vocab_size=m.vocab_size,
        enable_weight_tying=m.tie_embeddings,
        layers=layers,
        tok_embeddings=Embedding.Config(num_embeddings=m.vocab_size, embedding_dim=dim, param_init=embedding_init),
        norm=RMSNorm.Config(normalized_shape=dim, eps=m.rms_norm_eps, param_init=ones),
        lm_head=Linear.Config(
            in_features=dim, out_features=m.vocab_size, param_init=normal(scale, a=-3 * scale, b=3 * scale)
        ),
    )
    _one_process_group(device)
    with torch.device("meta"):
        model = config.build()
    for block in model.layers.children():  # torchtitan's order: compile, then FSDP
        block.compile(backend="inductor", fullgraph=True)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (1,), mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=torch.bfloat16, reduce_dtype=torch.float32, pp_enabled=False)
    model.to_empty(device=device)
    with torch.no_grad():
        model.init_weights(buffer_device=None)
    model.train()
    o = recipe.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=True
    )
    loss_fn = torch.compile(cross_entropy_loss)

    def step(batch: torch.Tensor) -> float:
        inputs, labels = batch[:, :-1], batch[:, 1:]
        # as torchtitan's apply_compile sets it, for its blocks only (they compile at the first call)
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            loss = loss_fn(model(inputs), labels) / labels.numel()  # summed, over the batch's tokens
            loss.backward()
        if o.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip, foreach=True)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        return loss.item()

    return step, model, optimizer


def _torch_2_11_stand_in() -> None:
    """torchtitan 0.3.0 imports `DataParallelMeshDims` from torch.distributed.fsdp, which
    torch 2.13 has and 2.11 lacks; torchtitan's single-mesh path only names it."""
    import torch.distributed.fsdp as fsdp

    if not hasattr(fsdp, "DataParallelMeshDims"):

        @dataclasses.dataclass
        class DataParallelMeshDims:
            shard: object = None
            replicate: object = None

        fsdp.DataParallelMeshDims = DataParallelMeshDims


def _one_process_group(device: torch.device) -> None:
    """torchtitan's FSDP2 wrapping needs a process group, one process here. It stays for the
    process: frugality's loss mean then runs a one-rank all-reduce a step (microseconds)."""
    import torch.distributed as dist

    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend(device).process_group, rank=0, world_size=1, init_method=f"tcp://127.0.0.1:{port}")
