"""The peers `frugality bench train` races against, each set up the way its own
documentation or training script sets it up, on the recipe's GPT-NeoX architecture:

- `transformers`: GPTNeoXForCausalLM + torch.optim.AdamW, eager (`frugality.bench.reference`);
- `transformers-compiled`: the same as `TrainingArguments(torch_compile=True)` runs it:
  `torch.compile(model)` (Inductor, default mode) and the fused AdamW that transformers
  picks by default on torch >= 2.8;
- `litgpt`: litgpt's own `GPT` and its pretraining step (`litgpt/pretrain.py`):
  `torch.compile(model)`, `chunked_cross_entropy`, AdamW (fused on CUDA only, as there),
  gradient clipping;
- `liger-kernel` and `torchtitan` (Llama recipes, CUDA only): transformers' Llama with
  liger-kernel's fused layers and loss, and torchtitan's own Llama 3 and step
  (`frugality.bench.cuda_peers`).

transformers' peers build GPTNeoXForCausalLM or LlamaForCausalLM from the recipe; litgpt's
is set up for GPT-NeoX.

A peer that cannot run here (not installed, needs CUDA, not set up, cannot build the
architecture or the precision, fails to compile) is a row that says why, never left out. Peers install
with `./scripts/setup.sh --peers`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import cast

import torch

from frugality.bench.reference import build_transformers, transformers_step
from frugality.config.recipe import Recipe
from frugality.errors import UserError
from frugality.models import GPTNeoXConfig

PEERS = ("transformers", "transformers-compiled", "litgpt", "torchtitan", "liger-kernel")
CUDA_ONLY = {"torchtitan", "liger-kernel"}


class PeerUnavailable(Exception):
    """The peer cannot run here; the message says why (it becomes the row's note)."""


@dataclass
class PeerRunner:
    step: Callable[[torch.Tensor], float]  # one training step on a (B, T + 1) batch
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    compiled: bool  # its warm-up steps include compilation


def parse_baselines(spec: str | None) -> list[tuple[str, str | None]]:
    """`--baseline`: comma-separated peers, each optionally `:PRECISION` (the precision the
    peer runs at; default the pass's). A bare precision name is transformers at it (the
    option's older meaning)."""
    from frugality.config.recipe import PRECISIONS

    if not spec:
        return [("transformers", None)]
    out = []
    for item in (s.strip() for s in spec.split(",") if s.strip()):
        name, _, precision = item.partition(":")
        if name in PRECISIONS and not precision:
            name, precision = "transformers", name
        if name not in PEERS:
            raise UserError(
                f"--baseline {item!r}: choose peers from {', '.join(PEERS)} (each optionally "
                f":PRECISION), or a precision for transformers"
            )
        if precision and precision not in PRECISIONS:
            raise UserError(f"--baseline {item!r}: unknown precision {precision!r} (have: {', '.join(PRECISIONS)})")
        if any(name == seen for seen, _ in out):
            raise UserError(f"--baseline names {name} twice: one precision per peer and run")
        out.append((name, precision or None))
    return out


def build_peer(name: str, recipe: Recipe, precision: str, device: torch.device) -> PeerRunner:
    if name in CUDA_ONLY:
        return _cuda_peer(name, recipe, precision, device)
    if recipe.model.family not in ("gpt-neox", "llama") or (name == "litgpt" and recipe.model.family != "gpt-neox"):
        raise PeerUnavailable(f"{name} is set up for GPT-NeoX recipes here; this one is {recipe.model.family}")
    if precision not in ("fp32", "amp-bf16", "bf16", "bf16-sr"):
        raise PeerUnavailable(f"{name} has no {precision} training here")
    if name in ("transformers", "transformers-compiled"):
        compiled = name == "transformers-compiled"
        try:
            # fused AdamW for both: TrainingArguments' default optimizer on torch >= 2.8
            model, optimizer, autocast = build_transformers(recipe, precision, device, fused_adamw=True)
        except UserError as e:  # transformers not installed
            raise PeerUnavailable(str(e)) from None
        if compiled:
            model = cast(torch.nn.Module, torch.compile(model))  # an OptimizedModule (torch types it as a callable)
        clip = recipe.optim.grad_clip
        return PeerRunner(lambda b: transformers_step(model, optimizer, autocast, b, clip), model, optimizer, compiled)
    return _litgpt(recipe, precision, device)


def _cuda_peer(name: str, recipe: Recipe, precision: str, device: torch.device) -> PeerRunner:
    if device.type != "cuda":
        raise PeerUnavailable(f"{name} needs CUDA (its kernels are Triton's); this run is on {device.type}")
    if precision != "amp-bf16":
        raise PeerUnavailable(f"{name} runs in amp-bf16 here (bf16 products over fp32 master weights), not {precision}")
    from frugality.bench import cuda_peers

    build = cuda_peers.liger if name == "liger-kernel" else cuda_peers.torchtitan
    try:
        step, model, optimizer = build(recipe, device, PeerUnavailable)
    except PeerUnavailable:
        raise
    except Exception as e:  # noqa: BLE001 - a peer that fails to build is a row saying so, not the end of the bench
        raise PeerUnavailable(f"failed to build: {type(e).__name__}: {str(e).splitlines()[0][:160]}") from None
    return PeerRunner(step, model, optimizer, name == "torchtitan")


def _litgpt(recipe: Recipe, precision: str, device: torch.device) -> PeerRunner:
    try:
        from litgpt.config import Config
        from litgpt.model import GPT
        from litgpt.utils import chunked_cross_entropy
    except ImportError as e:
        raise PeerUnavailable(f"litgpt is not installed ({e.name}; ./scripts/setup.sh --peers)") from None
    m = cast(GPTNeoXConfig, recipe.model)  # (GPT-NeoX recipes only, as build_peer checked)
    config = Config(
        name=recipe.name,
        block_size=m.max_seq_len,
        n_layer=m.num_layers,
        n_embd=m.hidden_size,
        n_head=m.num_heads,
        vocab_size=m.vocab_size,
        padded_vocab_size=m.vocab_size,
        padding_multiple=1,
        rotary_percentage=m.rotary_pct,
        rope_base=int(m.rotary_base),
        parallel_residual=m.parallel_residual,
        bias=True,
        norm_class_name="LayerNorm",
        norm_eps=m.layer_norm_eps,
        mlp_class_name="GptNeoxMLP",
        intermediate_size=m.ffn_size,
        gelu_approximate="none",
    )
    model = GPT(config).to(device)
    if precision in ("bf16", "bf16-sr"):  # litgpt's "bf16-true": the weights in bf16
        model = model.to(torch.bfloat16)
    autocast = (
        torch.autocast(device.type, dtype=torch.bfloat16) if precision == "amp-bf16" else contextlib.nullcontext()
    )  # "bf16-mixed"
    model.train()
    o = recipe.optim
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay, fused=device.type == "cuda"
    )
    compiled_model = torch.compile(model)

    def step(batch: torch.Tensor) -> float:
        with autocast:
            loss = chunked_cross_entropy(compiled_model(batch[:, :-1]), batch[:, 1:])
        loss.backward()
        if o.grad_clip > 0:  # 0: off, as in the recipe
            torch.nn.utils.clip_grad_norm_(model.parameters(), o.grad_clip)
        optimizer.step()
        optimizer.zero_grad()
        return loss.item()

    return PeerRunner(step, model, optimizer, True)
