"""Callbacks: what happens around the training loop (`frugality.training.loop`) without
being part of it. Each concern is one module with one class; the trainer chooses them and
their order, and the loop calls every hook of each, in that order.

Hooks (all optional): on_train_start(state), on_compiled(state, phase),
on_step_end(state, result), on_eval(state, result), on_step_done(state),
on_train_end(state), on_exit(state) (always, also after an error).
"""

from __future__ import annotations

HOOKS = ("on_train_start", "on_compiled", "on_step_end", "on_eval", "on_step_done", "on_train_end", "on_exit")


class Callback:
    """A no-op at every hook; subclasses override the hooks they need."""

    def on_train_start(self, state) -> None: ...
    def on_compiled(self, state, phase: str) -> None: ...
    def on_step_end(self, state, result) -> None: ...
    def on_eval(self, state, result) -> None: ...
    def on_step_done(self, state) -> None: ...
    def on_train_end(self, state) -> None: ...
    def on_exit(self, state) -> None: ...


class Callbacks:
    """Callbacks called in order at each hook."""

    def __init__(self, *callbacks: Callback) -> None:
        self.callbacks = list(callbacks)

    def __getattr__(self, hook: str):
        if hook not in HOOKS:
            raise AttributeError(hook)
        return lambda *args: [getattr(cb, hook)(*args) for cb in self.callbacks] and None
