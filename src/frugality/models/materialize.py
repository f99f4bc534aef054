"""A model's part given the values the whole model would have had, without building the
whole: what lets a tensor- or pipeline-parallel rank of a 20B model start on a device that
cannot hold the whole model once.

`build_model` under a seed draws every value from the device's generator in one order:
each layer's constructor (`reset_parameters`: nn.Linear's and nn.Embedding's draws), then
the model's own `reset_parameters`, a parameter at a time in `named_parameters` order.
`draw_parameters` makes the same draws, one layer or one parameter at a time on the
device, and hands each parameter's value to the caller, who keeps what its rank holds: the
same seed gives every layout, and one process, the same weights, bit for bit.

`build_empty` gives a whole model's structure to load weights into, its parameters allocated
but not initialised (`allocate`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TypeVar, cast

import torch
from torch import nn

from frugality.models import Decoder, Model, build_model

M = TypeVar("M", bound=nn.Module)


def build_empty(cfg, device: torch.device | str = "cpu") -> Model:
    """The model's structure to load weights into, without the cost of initialising them:
    built on the meta device, its parameters then allocated (uninitialised) on `device`,
    and the buffers no checkpoint holds (rotary tables) computed there."""
    with torch.device("meta"):
        model = build_model(cfg)
    return allocate(model, device)


def draw_parameters(cfg, device: torch.device | str, take: Callable[[str, torch.Tensor], None]) -> None:
    """Draw the values `build_model(cfg)` gives each parameter under the generator's
    current state, calling `take(name, value)` for each (float32, on `device`, whole);
    at most one layer's parameters exist at a time."""
    with torch.device("meta"):
        # the structure: names, shapes, and the order layers were built in (tensor and pipeline
        # parallel, the only callers, run decoders)
        shadow = cast(Decoder, build_model(cfg))
    names = [(name, p.shape) for name, p in shadow.named_parameters()]  # before any tie is undone below
    with torch.no_grad():
        for module in _built_order(shadow):  # what the layers' constructors drew, in their order
            if module is not shadow and hasattr(module, "reset_parameters"):
                module.to_empty(device=device, recurse=False)
                cast(Callable[[], None], module.reset_parameters)()
                module.to_empty(device="meta", recurse=False)
        for name, shape in names:  # the model's own initialisation, a parameter at a time
            value = torch.empty(shape, device=device)
            shadow.init_parameter(name, value)
            take(name, value)


def _built_order(module: nn.Module) -> Iterator[nn.Module]:
    """Modules in the order their constructors finished: children (in the order they were
    assigned) before their parent."""
    for child in module.children():
        yield from _built_order(child)
    yield module


def allocate(model: M, device: torch.device | str) -> M:
    """`model` (built on the meta device, or a part of it) given uninitialised storage on
    `device`, its tied parameters tied again and the buffers no checkpoint holds (rotary
    tables) computed there."""
    first: dict[int, str] = {}
    ties = [(name, first.setdefault(id(p), name)) for name, p in model.named_parameters(remove_duplicate=False)]
    model = model.to_empty(device=device)  # gives each parameter storage of its own: ties undone
    for name, source in ties:
        if name != source:
            owner, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(owner), leaf, model.get_parameter(source))
    for module in model.modules():
        if hasattr(module, "reset_tables"):
            cast(Callable[[], None], module.reset_tables)()
    return model
