"""A kernel's calls counted in a test: each C kernel has a fallback that gives the same
results, so a test of results alone would pass with the kernel never run."""

from __future__ import annotations

from frugality import kernels


def count_calls(monkeypatch, accessor: str) -> list[int]:
    """The return codes of the C function `frugality.kernels.<accessor>()` gives, a call
    each, from now to the test's end (the accessor still answers None where the kernel does
    not run here)."""
    codes: list[int] = []
    ask = getattr(kernels, accessor)

    def counted():
        kernel = ask()
        if kernel is None:
            return None

        def call(*args):
            codes.append(kernel(*args))
            return codes[-1]

        return call

    monkeypatch.setattr(kernels, accessor, counted)
    return codes
