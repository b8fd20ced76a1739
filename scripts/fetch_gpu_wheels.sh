#!/usr/bin/env bash
# Download, here (with network), the wheels that scripts/gpu_check.sh installs on the lent GPU machine,
# which is offline. Its image (Python 3.12) already has CUDA torch and Triton, numpy, pyarrow, pytest,
# pluggy, iniconfig, hypothesis, sortedcontainers, attrs, packaging, narwhals, jinja2, rich, typer,
# safetensors, tokenizers, protobuf and nvidia-ml-py (/work/.library/device/KINDS.md lists it): those are
# not carried, since a second copy first on PYTHONPATH can break the image's own (its pytest plugins).
# What kvtrace and `kvtrace analyze` import beyond them comes from here, pinned, as cp312 manylinux
# x86_64 wheels in the git-ignored folder .whl/ (carried with `carry: [".whl"]`).
# Not carried: vl-convert-python (~30 MB, PNG export only; imported lazily), gguf (no GGUF travels: the
# check runs dummy-weight shapes) and perfetto (`kvtrace export` only).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
    duckdb==2.0.1                                                        # kvtrace.trace.db
    altair==6.3.0 jsonschema==4.26.0 jsonschema-specifications==2025.9.1 # kvtrace.views.report (analyze
    referencing==0.37.0 rpds-py==0.30.0                                  # imports it) and their needs
)
rm -rf .whl
mkdir -p .whl
# --no-deps: every dependency the image lacks is listed above, so nothing unlisted (a second torch) comes along
"$PY" -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
wheels_bytes=$(du -cb .whl/*.whl | tail -1 | cut -f1)
tree_bytes=$(git ls-files -z | du -cb --files0-from=- | tail -1 | cut -f1)
total=$((wheels_bytes + tree_bytes))
limit=$((64 << 20))
printf 'wheels %.1f MiB + working tree %.1f MiB = %.1f MiB (limit 64 MiB)\n' \
    "$(echo "$wheels_bytes / 1048576" | bc -l)" "$(echo "$tree_bytes / 1048576" | bc -l)" "$(echo "$total / 1048576" | bc -l)"
if [ "$total" -gt "$limit" ]; then
    echo "error: what must travel exceeds 64 MiB; drop a wheel or untracked files" >&2
    exit 1
fi
