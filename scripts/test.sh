#!/usr/bin/env bash
# The test suite, in tiers (pyproject's markers):
#   ./scripts/test.sh        everything: the README's test command and CI's. The main tier in
#                            .venv, and tests/xla in .venv-xla as a step of its own, started
#                            first at the lowest priority so that it takes the cores the main
#                            tier leaves idle while it waits on its processes; the 25 slowest
#                            tests printed.
#   ./scripts/test.sh fast   the inner loop: no slow, distributed, README, CUDA or XLA test.
# Further arguments go to pytest (e.g. ./scripts/test.sh fast tests/config -x).
set -uo pipefail
cd "$(dirname "$0")/.."

if [ "${1:-}" = "fast" ]; then
    shift
    exec .venv/bin/python -m pytest -q -m fast "$@"
fi
[ "${1:-}" = "full" ] && shift

xla_log="$(mktemp -d)"
trap 'rm -rf "$xla_log"' EXIT
xla_pid=""
if .venv-xla/bin/python -c "import torch_xla" 2>/dev/null; then
    (
        PJRT_DEVICE=CPU nice -n 19 .venv-xla/bin/python -m pytest -q -p no:cacheprovider tests/xla \
            >"$xla_log/out" 2>&1
        echo $? >"$xla_log/status"
    ) &
    xla_pid=$!
elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    echo "tests/xla: .venv-xla has no torch_xla; ./scripts/setup.sh --test (or --xla) makes it" >"$xla_log/out"
    echo 1 >"$xla_log/status"
else  # torch-xla has wheels for Linux x86-64 only
    echo "tests/xla: skipped (torch-xla has wheels for Linux x86-64 only)" >"$xla_log/out"
    echo 0 >"$xla_log/status"
fi

# the XLA bridge test deselected: the step above runs what it would start
.venv/bin/python -m pytest -q -m "not xla" --durations=25 "$@"
main=$?

[ -n "$xla_pid" ] && wait "$xla_pid"
echo
echo "--- tests/xla in .venv-xla (the XLA step):"
tail -n 40 "$xla_log/out"
xla="$(cat "$xla_log/status" 2>/dev/null || echo 1)"
echo "main tier: exit $main; XLA step: exit $xla"
[ "$main" -eq 0 ] && [ "$xla" -eq 0 ]
