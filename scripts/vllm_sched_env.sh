#!/usr/bin/env bash
# Build (once) a scheduler-only venv of another vLLM version for the scheduler-level differential
# (tests/vllm_sched): that version's wheel installed without its dependencies, which come from the
# vLLM CPU venv scripts/vllm_env.sh builds (a .pth file appends its site-packages). Its CUDA kernels
# do not load and need not: the differential runs only the scheduler's Python, on vLLM's CPU platform.
# Cached in $KVTRACE_VLLM_SCHED_VENV (default ~/.cache/kvtrace/vllm-sched-venv-<version>). Prints the
# venv's Python on the last line of stdout; on failure prints why on stderr and exits 1.
set -euo pipefail
VERSION=${1:-0.33.0}
BASE_PY=${KVTRACE_VLLM_PYTHON:-$(bash "$(dirname "$0")/vllm_env.sh" | tail -n 1)}
VENV=${KVTRACE_VLLM_SCHED_VENV:-$HOME/.cache/kvtrace/vllm-sched-venv-$VERSION}
check() { "$VENV/bin/python" -c "import vllm, sys; assert vllm.__version__ == sys.argv[1], vllm.__version__
from vllm.v1.core.sched.async_scheduler import AsyncScheduler" "$VERSION" >/dev/null 2>&1; }
if ! check; then
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$BASE_PY" -m venv "$VENV" >&2
    site=$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    base_site=$("$BASE_PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
    # KVTRACE_VLLM_SCHED_WHEEL: a wheel file already at hand instead of the index
    "$VENV/bin/pip" install --quiet --no-deps "${KVTRACE_VLLM_SCHED_WHEEL:-vllm==$VERSION}" >&2
    echo "$base_site" > "$site/zz_vllm_base_deps.pth"   # after the venv's own: its vllm comes first
    check || { echo "error: vllm $VERSION in $VENV does not import its scheduler" >&2; exit 1; }
fi
echo "$VENV/bin/python"
