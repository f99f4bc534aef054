#!/usr/bin/env bash
# The test suite, in tiers (pyproject's markers; docs/testing.md):
#   ./scripts/test.sh        everything: the README's test command and CI's. The main tier in
#                            .venv on a pytest-xdist worker per core, and tests/xla in .venv-xla
#                            as a step of its own beside it, in a session of its own (the
#                            scheduler's fair share of an autogroup); the 25 slowest tests
#                            printed.
#   ./scripts/test.sh fast   the inner loop: no slow, distributed, README, CUDA or XLA test.
# OpenMP's threads wait passively (OMP_WAIT_POLICY, unless set): spinning, a worker's threads
# took the cores the other worker's needed (two workers 705 s, one process 631 s; passive: 460 s).
# Further arguments go to pytest (e.g. ./scripts/test.sh fast tests/config -x).
set -uo pipefail
cd "$(dirname "$0")/.."
# `-n auto`'s workers: the CPUs this process may use (xdist's own count is the host's physical
# cores, which taskset does not lower; nproc follows OMP_NUM_THREADS)
cpus='import os; print(len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count())'
export PYTEST_XDIST_AUTO_NUM_WORKERS="${PYTEST_XDIST_AUTO_NUM_WORKERS:-$(.venv/bin/python -c "$cpus")}"

if [ "${1:-}" = "fast" ]; then
    shift
    OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" exec .venv/bin/python -m pytest -q -m fast -n auto "$@"
fi
[ "${1:-}" = "full" ] && shift

xla="$(mktemp -d)"
xla_pid=""
stop_xla() {  # (its own session: stopped with what it started, on any end of this script)
    [ -n "$xla_pid" ] && kill -- "-$xla_pid" 2>/dev/null
    rm -rf "$xla"
}
trap stop_xla EXIT
trap 'exit 130' INT TERM
if .venv-xla/bin/python -c "import torch_xla" 2>/dev/null; then
    # the bridge test's checks (tests/test_xla_environment.py), as a step: a time limit, and
    # every XLA test passed, none skipped
    # (a session of its own is an autogroup of its own under Linux's scheduler, which shares the
    # CPU between groups, not their processes: at nice 5 beside two workers it ended last, the
    # script 615 s, against 566 s at the workers' priority in the same hour; its OpenMP threads
    # wait passively too)
    setsid -w bash -c 'PJRT_DEVICE=CPU OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" timeout 1800 "$1" -m pytest -q -p no:cacheprovider --durations=10 tests/xla \
        >"$2/out" 2>&1; echo $? >"$2/status"' _ .venv-xla/bin/python "$xla" &
    xla_pid=$!
elif [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ]; then
    echo "tests/xla: .venv-xla has no torch_xla; ./scripts/setup.sh --test (or --xla) makes it" >"$xla/out"
    echo 1 >"$xla/status"
else  # torch-xla has wheels for Linux x86-64 only
    echo "tests/xla: not run (torch-xla has wheels for Linux x86-64 only)" >"$xla/out"
    echo 0 >"$xla/status"
fi

# the XLA bridge test deselected: the step above runs what it would start, as it checks it
OMP_WAIT_POLICY="${OMP_WAIT_POLICY:-PASSIVE}" .venv/bin/python -m pytest -q -m "not xla" -n auto --durations=25 "$@"
main=$?

[ -n "$xla_pid" ] && wait "$xla_pid"
xla_pid=""
status="$(cat "$xla/status" 2>/dev/null || echo 1)"
last="$(grep -v '^\s*$' "$xla/out" | tail -n 1)"
if [ "$status" -eq 0 ] && { [ ! -s "$xla/out" ] || ! grep -q " passed" <<<"$last" || grep -q "skipped" <<<"$last"; }; then
    case "$last" in "tests/xla: not run"*) ;; *) status="1 (not every XLA test ran and passed)" ;; esac
fi
echo
if [ "$status" = 0 ]; then
    echo "--- the XLA step's 10 slowest:"
    grep -E '^[0-9.]+s (call|setup|teardown) ' "$xla/out"
    echo "--- tests/xla in .venv-xla (the XLA step): $last"
else
    echo "--- tests/xla in .venv-xla (the XLA step) failed, exit $status:"
    cat "$xla/out"
fi
echo "main tier: exit $main; XLA step: exit $status"
[ "$main" -eq 0 ] && [ "$status" = 0 ]
