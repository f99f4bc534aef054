"""Joining a Ray cluster for the engines that run on one (`data prepare --engine ray`,
`embed --engine ray`): Ray is an optional extra, imported only here."""

from __future__ import annotations

import logging
from contextlib import contextmanager

from frugality.errors import UserError


def ray_module():
    """Ray, or one line saying how to install it."""
    try:
        import ray
    except ImportError:
        raise UserError("--engine ray: Ray is not installed here; pip install 'frugality[ray]'") from None
    return ray


@contextmanager
def joined(address: str | None):
    """Ray connected to the cluster at `address` (None: a local instance) for the block, and
    left after it unless this process was already connected."""
    ray = ray_module()
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address, logging_level=logging.WARNING, log_to_driver=False, include_dashboard=False)
        except ConnectionError as e:
            raise UserError(f"--address {address}: no Ray cluster there ({e})") from None
    try:
        yield ray
    finally:
        if started:
            ray.shutdown()
