#!/usr/bin/env bash
# Build (once) the venv of Vidur 0.0.26, the simulator `python -m benchmarks sim-speed` runs side by side
# with kvtrace's (benchmarks/peers/vidur_driver.py). Vidur's wheel (cp311, with its native module) is
# installed with all its dependencies from PyPI: numpy, pandas, scikit-learn, wandb, streamlit, plotly,
# kaleido, ... (about 100 packages, 1.3 GB; a few minutes). Its simulator needs no GPU and no network once
# built: the driver feeds it the profiles in benchmarks/data/vidur/ instead of its Hugging Face datasets.
# Cached in $KVTRACE_VIDUR_VENV (default ~/.cache/kvtrace/vidur-venv-0.0.26). Prints the venv's Python
# on the last line of stdout; on failure prints why on stderr and exits 1.
set -euo pipefail
VERSION=0.0.26
VENV=${KVTRACE_VIDUR_VENV:-$HOME/.cache/kvtrace/vidur-venv-$VERSION}
PYTHON=${PYTHON:-python3}
check() { "$VENV/bin/python" -c "import sys; from importlib.metadata import version
assert version('vidur') == sys.argv[1], version('vidur')
from vidur.simulator import Simulator
from vidur.execution_time_predictor.sklearn_execution_time_predictor import SklearnExecutionTimePredictor" \
    "$VERSION" >/dev/null 2>&1; }
if ! check; then
    rm -rf "$VENV"
    mkdir -p "$(dirname "$VENV")"
    "$PYTHON" -m venv "$VENV" >&2
    "$VENV/bin/pip" install --quiet "vidur==$VERSION" >&2
    check || { echo "error: vidur $VERSION in $VENV does not import its simulator" >&2; exit 1; }
fi
echo "$VENV/bin/python"
