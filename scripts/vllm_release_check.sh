#!/usr/bin/env bash
# Follow a vLLM release: build its scheduler-only venv, then check, on its own Scheduler and
# AsyncScheduler, (1) the capture's guard (everything the capture wraps or reads is there), (2) the
# scheduler-level differential (kvtrace's scheduler decides as that vLLM, step for step, on generated
# workloads) and (3) the capture-on-vLLM tests (every captured event against vLLM's own decisions;
# two data-parallel ranks into one folder).
# Prints what changed: the guard's first refusal, the first differing step, the capture tests that
# failed. Exit 0 when all hold, 1 when something changed, 2 on bad input.
#
#   bash scripts/vllm_release_check.sh 0.35.0
#
# A release kvtrace does not list yet (guard.SUPPORTED, engine/config.py's VLLM_VERSIONS) is checked
# as if it did: the capture with KVTRACE_VLLM_ANY_VERSION=1, the differential against kvtrace
# following the nearest version it follows, below it where there is one (KVTRACE_SCHED_FOLLOW). When all holds, supporting it is
# adding it to those two lists, to scripts/test.sh's venvs and to docs/vllm.md's support table.
# KVTRACE_SCHED_WORKLOADS (default 1000) sets the differential's workloads per scheduler class; the
# logs stay in $KVTRACE_RELEASE_CHECK_LOGS (default /tmp/kvtrace-release-check-VERSION).
set -uo pipefail
VERSION=${1:-}
if ! [[ "$VERSION" =~ ^[0-9]+\.[0-9]+\.[0-9]+([a-z0-9.+-]*)?$ ]]; then
    echo "error: give a vLLM release, e.g. bash scripts/vllm_release_check.sh 0.35.0 (got '${VERSION}')" >&2
    exit 2
fi
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOGS=${KVTRACE_RELEASE_CHECK_LOGS:-/tmp/kvtrace-release-check-$VERSION}
mkdir -p "$LOGS"
status=0

echo "== vLLM $VERSION: its scheduler-only venv (scripts/vllm_sched_env.sh)"
if [ -z "${KVTRACE_VLLM_PYTHON:-}" ]; then
    KVTRACE_VLLM_PYTHON=$(bash scripts/vllm_env.sh 2>"$LOGS/vllm-env.log" | tail -n 1) \
        || { echo "error: the vLLM CPU venv its dependencies come from could not be built: $(tail -n 1 "$LOGS/vllm-env.log")" >&2; exit 1; }
fi
export KVTRACE_VLLM_PYTHON
SCHED_PY=$(bash scripts/vllm_sched_env.sh "$VERSION" 2>"$LOGS/venv.log" | tail -n 1)
if [ -z "$SCHED_PY" ]; then
    echo "FAILED: no scheduler-only venv of vLLM $VERSION: $(tail -n 1 "$LOGS/venv.log")"
    exit 1
fi
echo "   $SCHED_PY"
VENV=$(basename "$(dirname "$(dirname "$SCHED_PY")")")

# listed: kvtrace follows the release and its capture accepts it; nearest: the version kvtrace follows
# nearest below it (a newer release: the newest kvtrace follows), else the oldest
read -r LISTED NEAREST < <("$PY" -c "
import sys
from engine.config import VLLM_VERSIONS
from kvtrace.vllm.capture.guard import SUPPORTED, version_tuple
version = sys.argv[1]
listed = version in VLLM_VERSIONS and version_tuple(version) in SUPPORTED
below = [v for v in VLLM_VERSIONS if version_tuple(v) <= version_tuple(version)]
print('yes' if listed else 'no', max(below, key=version_tuple) if below else VLLM_VERSIONS[0])" "$VERSION")
export KVTRACE_VLLM_SCHED_PYTHONS="$SCHED_PY"
if [ "$LISTED" = no ]; then
    echo "   not listed by kvtrace yet: the capture checked with KVTRACE_VLLM_ANY_VERSION=1, the scheduler against kvtrace following $NEAREST"
    export KVTRACE_VLLM_ANY_VERSION=1 KVTRACE_SCHED_FOLLOW="$NEAREST"
fi

echo "== the guard"
if "$PY" -m tests.vllm_sched.release_guard "$SCHED_PY" >"$LOGS/guard.log" 2>&1; then
    grep '^guard:' "$LOGS/guard.log" | sed 's/^/   /'
else
    status=1
    echo "   FAILED (the first refusal first; $LOGS/guard.log):"
    grep '^guard:' "$LOGS/guard.log" | sed 's/^/   /' || tail -n 5 "$LOGS/guard.log" | sed 's/^/   /'
fi

run_tests() {   # name, log, pytest arguments...
    local name=$1 log=$2
    shift 2
    "$PY" -m pytest -q -p no:cacheprovider -m vllm -k "$VENV" "$@" >"$log" 2>&1
    local rc=$?
    local summary
    summary=$(tail -n 1 "$log")
    if [ $rc -eq 0 ] && ! grep -q " skipped" <<<"$summary"; then
        echo "   held: $summary"
        return 0
    fi
    status=1
    echo "   FAILED ($name; $log): $summary"
    return 1
}

echo "== the scheduler-level differential (tests/vllm_sched)"
if ! run_tests differential "$LOGS/differential.log" tests/vllm_sched/test_sched_differential.py; then
    # the first differing step of the first workload that differs, as the test reports it
    grep -m 1 -A 40 "schedule otherwise, the first" "$LOGS/differential.log" | sed 's/^E  */   /' | head -n 40
    grep -E "^(FAILED|SKIPPED|ERROR)" "$LOGS/differential.log" | head -n 10 | sed 's/^/   /'
fi

echo "== the capture on vLLM's schedulers (tests/vllm/test_capture_on_vllm.py, test_capture_ranks_on_vllm.py)"
if ! run_tests capture "$LOGS/capture.log" tests/vllm/test_capture_on_vllm.py tests/vllm/test_capture_ranks_on_vllm.py -rfE; then
    grep -E "^(FAILED|ERROR)" "$LOGS/capture.log" | head -n 20 | sed 's/^/   /'
fi

if [ $status -eq 0 ]; then
    echo "vLLM $VERSION: everything holds$([ "$LISTED" = no ] && echo "; to support it, add it to guard.SUPPORTED, engine/config.py's VLLM_VERSIONS, scripts/test.sh and docs/vllm.md's support table")"
else
    echo "vLLM $VERSION: something changed (above); the logs are in $LOGS"
fi
exit $status
