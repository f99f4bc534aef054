"""A model ready to train on a device under a precision policy: built plain, cast or
converted by the policy, then fitted to the device by `frugality.kernels.specialize`."""

from __future__ import annotations

import torch
from torch import nn

from frugality.kernels.specialize import specialize
from frugality.models import build_model


def build_training_model(model_config, policy, device: torch.device) -> tuple[nn.Module, list[str]]:
    """(model, the kernel choices made for it). `policy`: a resolved PrecisionPolicy."""
    with device:
        model = policy.prepare_model(build_model(model_config))
    return model, specialize(model, device, policy)
