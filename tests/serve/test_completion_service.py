"""Completions' continuous batching on compiled steps (`serve --compile`), without a server
or the `openai` client (the GPU check's image has neither installed: its cuda case runs)."""

from __future__ import annotations

import pytest
import torch

PROMPTS = [[5, 17, 33, 2, 9, 100, 7], [250], list(range(12, 25)), [3, 3, 3, 4]]
NEW = 12


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_compiled_steps_give_the_eager_loops_tokens(decoder_folder, device):
    """The service's prefill and decoding step through torch.compile, prompts joining one
    loop, the eager loop's tokens. On a GPU with Inductor, the step replayed as a CUDA graph on
    the service's own thread; on the CPU with the "eager" backend (Inductor's compiles take
    tens of seconds there)."""
    from frugality.inference.generate import Sampling, load_decoder
    from frugality.serve.completions import CompletionService
    from frugality.serve.metrics import ServeMetrics

    decoder, _ = load_decoder(str(decoder_folder), torch.device(device), "fp32", pack=False)
    tokens = {}
    for compile in (None, "inductor" if device == "cuda" else "eager"):
        service = CompletionService(decoder, ServeMetrics(), 0.0, 16, 3, 64, compile=compile)
        try:
            assert service.replays is (compile == "inductor")  # (CUDA graphs: Inductor on a GPU only)
            asks = [(p, Sampling(max_new_tokens=NEW), None) for p in PROMPTS]
            tokens[compile] = [f.result(timeout=300).tokens for f in service.submit_all(asks)]
        finally:
            service.close()
    eager, compiled = tokens.values()
    assert compiled == eager and all(len(t) == NEW for t in eager)  # (no stop token asked)
