"""Renaming state dicts between frugality's parameter names and another framework's.

Every family's mapping is the same shape: whole names for the tensors outside the layer
stack, module names inside numbered layers, and a few of their tensors (buffers, tied
copies) to skip. Each family module declares its table; this does the renaming.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

_OURS_LAYER = "layers.{i}.{module}.{kind}"


def _pattern(layout: str) -> re.Pattern:
    escaped = re.escape(layout)
    for field, group in (("i", r"(?P<i>\d+)"), ("module", r"(?P<module>.+)"), ("kind", r"(?P<kind>weight|bias)")):
        escaped = escaped.replace(re.escape("{" + field + "}"), group)
    return re.compile(f"^{escaped}$")


@dataclass(frozen=True)
class NameMap:
    family: str  # for error messages, e.g. "GPT-NeoX"
    top: tuple[tuple[str, str], ...]  # (ours, theirs) full names outside the layers
    layer: tuple[tuple[str, str], ...]  # (ours, theirs) module names inside layer i
    theirs_layer: str  # their layout, e.g. "gpt_neox.layers.{i}.{module}.{kind}"
    ignored: str | None = None  # regex of their tensors to skip when reading

    def to_theirs(self, state: dict[str, torch.Tensor], top: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """Our names -> theirs; `top` overrides entries of the top-level table."""
        return _rename(
            state,
            dict(self.top) | (top or {}),
            dict(self.layer),
            _pattern(_OURS_LAYER),
            self.theirs_layer,
            lambda name: f"no Hugging Face name for parameter {name!r}",
        )

    def to_ours(self, state: dict[str, torch.Tensor], top: dict[str, str] | None = None) -> dict[str, torch.Tensor]:
        """Their names -> ours, skipping `ignored`; `top` adds (theirs -> ours) aliases."""
        skip = re.compile(self.ignored) if self.ignored else None
        kept = {k: v for k, v in state.items() if not (skip and skip.search(k))}
        return _rename(
            kept,
            {t: o for o, t in self.top} | (top or {}),
            {t: o for o, t in self.layer},
            _pattern(self.theirs_layer),
            _OURS_LAYER,
            lambda name: f"unexpected tensor {name!r} in a {self.family} checkpoint",
        )


def _rename(state, top, layer, source: re.Pattern, target: str, error) -> dict[str, torch.Tensor]:
    out = {}
    for name, tensor in state.items():
        if name in top:
            out[top[name]] = tensor
        elif (m := source.match(name)) and m["module"] in layer:
            out[target.format(i=m["i"], module=layer[m["module"]], kind=m["kind"])] = tensor
        else:
            raise KeyError(error(name))
    return out
