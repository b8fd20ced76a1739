#!/usr/bin/env bash
# Install everything the tests need (packages, headless Chromium for the report test), run them.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# what only the tests need: pytest, Hypothesis, Triton (its interpreter runs the GPU kernels on the
# CPU) and the Ray extra (the sweep test starts a local Ray cluster); the main job needs none of them
"${PYTHON:-python3}" -m pip install --quiet -e ".[test,ray]"
# the report's browser test needs Chromium, kvtrace explore's terminal test tmux, and the exporter's
# test a Prometheus server (Debian's prometheus, started on loopback); a skipped
# test would hide the area, so any of them missing is an error here (and CI=true fails the run on any
# skip but cuda/external: tests/helpers/strict_skips.py)
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v tmux >/dev/null 2>&1 || missing="$missing tmux"
command -v prometheus >/dev/null 2>&1 || missing="$missing prometheus"   # the exporter's scrape test
if [ -n "$missing" ]; then
    if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
        # shellcheck disable=SC2086  (one Debian package per word)
        (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $missing >/dev/null) \
            || { echo "error: could not install$missing (apt-get install$missing failed)" >&2; exit 1; }
    else
        echo "error: no$missing, and no apt-get as root to install it; install$missing and rerun" >&2
        exit 1
    fi
fi
PY=${PYTHON:-python3}
if [ "$#" -gt 0 ]; then   # a developer's selection: just that
    exec "$PY" -m pytest -q -p no:cacheprovider "$@"
fi
"$PY" -m pytest -q -p no:cacheprovider -m "not vllm"
# the vLLM-capture tests start real vLLM (its CPU build, in a venv of its own) several times: a step
# of their own. Where that venv cannot be built (no network), they skip and say why; CI allows that
# skip only then (tests/helpers/strict_skips.py)
if VLLM_PY=$(bash scripts/vllm_env.sh 2>/tmp/kvtrace-vllm-env.log | tail -n 1) && [ -n "$VLLM_PY" ]; then
    export KVTRACE_VLLM_PYTHON="$VLLM_PY"
else
    export KVTRACE_VLLM_UNAVAILABLE="the vLLM environment could not be built: $(tail -n 1 /tmp/kvtrace-vllm-env.log)"
    echo "warning: $KVTRACE_VLLM_UNAVAILABLE" >&2
fi
# the scheduler-level differential and the capture's tests also run the schedulers of the other vLLM
# releases the capture supports (scheduler-only venvs, scripts/vllm_sched_env.sh; docs/vllm.md's support
# table); a release whose venv cannot be built is left out and the reason said
SCHED_PYS=""
if [ -n "${KVTRACE_VLLM_PYTHON:-}" ]; then
    for version in ${KVTRACE_VLLM_SCHED_VERSIONS:-0.31.0 0.33.0 0.34.0}; do
        if SCHED_PY=$(bash scripts/vllm_sched_env.sh "$version" 2>"/tmp/kvtrace-vllm-sched-env-$version.log" | tail -n 1) \
                && [ -n "$SCHED_PY" ]; then
            SCHED_PYS="${SCHED_PYS:+$SCHED_PYS:}$SCHED_PY"
        else
            echo "warning: no vLLM $version scheduler venv: $(tail -n 1 "/tmp/kvtrace-vllm-sched-env-$version.log" 2>/dev/null)" >&2
        fi
    done
fi
export KVTRACE_VLLM_SCHED_PYTHONS="$SCHED_PYS"
exec "$PY" -m pytest -q -p no:cacheprovider -m vllm tests
