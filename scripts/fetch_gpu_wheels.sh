#!/usr/bin/env bash
# Download, here (with network), the wheels that scripts/gpu_check.sh installs on the lent GPU machine,
# which is offline and bare: Python 3.12 with CUDA torch (and Triton), pyarrow, rich, typer, jinja2
# and nvidia-ml-py. What kvtrace, its CUDA tests and `kvtrace analyze` import beyond that comes from
# here, as cp312 manylinux x86_64 wheels in the git-ignored folder .whl/ (carried with `carry: [".whl"]`).
# Not carried: vl-convert-python (~30 MB, PNG export only; imported lazily) and gguf (no GGUF travels:
# the check runs dummy-weight shapes). Everything that travels must stay under 64 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(
    duckdb numpy safetensors tokenizers                                  # engine and kvtrace imports
    altair jsonschema jsonschema-specifications referencing rpds-py narwhals attrs   # kvtrace.views.report (analyze imports it)
    pytest iniconfig pluggy packaging hypothesis sortedcontainers       # the tests
)
rm -rf .whl
mkdir -p .whl
# --no-deps: every dependency is listed above, so nothing unlisted (a second torch) comes along
"$PY" -m pip download --quiet --only-binary=:all: --no-deps --python-version 3.12 --implementation cp \
    --abi cp312 --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
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
