#!/usr/bin/env bash
# The GPU check: the cuda tests, `bench train` against the peers, embedding, generation,
# serving, the largest model one GPU trains and measured energy on a GPU machine, in one go within a time budget; every
# table under one folder (scripts/gpu_check.py says what each section runs).
#
#   scripts/gpu-check.sh --fetch-wheels      on a machine with PyPI: the packages a GPU image
#                                            without network lacks (Python 3.12), into .whl/
#   scripts/gpu-check.sh [--dry-run] [--out DIR] [--budget-s 570] [--all | --only SECTION,...]
#
# Python: $PYTHON, else .venv/bin/python, else python3 (a GPU image's own, holding its CUDA
# build of torch). Wheels in .whl/ are installed into a folder of their own first (no
# network, no dependencies resolved: .whl/ holds them all). --dry-run runs every section on
# the CPU, small and short; CI runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

# What the GPU image (KINDS.md of the device machines: torch, transformers,
# sentence-transformers, tokenizers, click, httpx, prometheus-client, uvloop, ...) lacks, at
# the versions tested here: frugality's own needs; FastAPI (which imports opentelemetry-api),
# uvicorn, httptools (its fast HTTP parser) and orjson (`serve` refuses to start without it);
# torchao (fp8); liger-kernel; torchtitan and what its model package imports (spmd-types,
# torch-checkpointing, tyro with docstring-parser and typeguard).
WHEELS=(
    pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5
    typing-extensions==4.16.0 tomli-w==1.2.0 zstandard==0.25.0
    fastapi==0.165.0 starlette==1.10.0 uvicorn==0.54.0 opentelemetry-api==1.45.2 httptools==0.9.0 orjson==3.13.0
    torchao==0.18.0 liger-kernel==0.8.5
    torchtitan==0.3.0 spmd-types==0.2.3 torch-checkpointing==0.1.1 tyro==1.0.17
    docstring-parser==0.18.0 typeguard==4.6.1
)

if [ "${1:-}" = "--fetch-wheels" ]; then
    mkdir -p .whl
    pip=(python3 -m pip)
    [ -x .venv/bin/python ] && pip=(.venv/bin/python -m pip)
    "${pip[@]}" download --disable-pip-version-check -q --no-deps --only-binary=:all: \
        --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 \
        --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d .whl "${WHEELS[@]}"
    du -sh .whl
    exit 0
fi

python="${PYTHON:-}"
if [ -z "$python" ]; then
    if [ -x .venv/bin/python ]; then python=.venv/bin/python; else python=python3; fi
fi
if [ "$python" != .venv/bin/python ] && compgen -G ".whl/*.whl" >/dev/null; then  # (.venv has them all)
    site="${TMPDIR:-/tmp}/frugality-gpu-check-site"
    "$python" -m pip install --disable-pip-version-check -q --no-index --no-deps --no-compile \
        --upgrade --target "$site" .whl/*.whl
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
export PYTHONPATH="$PWD/src${PYTHONPATH:+:$PYTHONPATH}"
exec "$python" scripts/gpu_check.py "$@"
