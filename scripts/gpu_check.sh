#!/usr/bin/env bash
# The check of kvtrace's CUDA path on a lent GPU machine, in one run of about 5-8 minutes.
#
# That machine is offline and bare: Python 3.12, CUDA torch with Triton, pyarrow, rich, typer and
# nvidia-ml-py. What else kvtrace and its tests import travels as wheels, fetched here first:
#
#     bash scripts/fetch_gpu_wheels.sh        # -> .whl/ (git-ignored), checks wheels + tree < 64 MiB
#
# then, with the device tool (carry the wheel folder; leave time for one rerun within 15 minutes):
#
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=570)
#
# No model file travels (the real SmolLM2 GGUF is ~94 MB): the engine runs `tiny` and dummy-weight
# real shapes (llama-3.2-1b). Steps, each writing <step>.txt (and JSON where it has figures) to $OUT:
#   env        torch, CUDA, Triton, GPU name
#   install    the carried wheels into .whl/site (pip --no-index --no-deps --target; no build, no network)
#   pytest     CUDA tests: four-block scenario, preemption transparency, Triton + graphs + copy-on-write
#              + prefix hits vs the dense reference (fp32, bf16), no sync inside a step, record on CUDA;
#              the Triton kernels on CUDA (fp32, bf16)
#   swap       swap bandwidth of the engine's copy path vs a pinned cudaMemcpyAsync peak (goal >= 0.8)
#   record     a traced replay of llama-3.2-1b (dummy, bf16) with NVML samples; its trace is checked
#   analyze    `kvtrace analyze --json` on that run
#   roofline   decode step / HBM bound at batch 1, 8, 64 (goal <= 1.5 at 64)
#   tracing    traced / untraced replay time (goal <= 1.02)
#   syncs      synchronisations per step over a swapping replay (goal: none inside the runner's step)
# A failing install stops the check; any other failing step is reported, the others still run, and
# the script exits 1 at the end. summary.txt lists every step with its exit status and duration.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export PYTHONUNBUFFERED=1
PY=${PYTHON:-python3}
: > "$OUT/summary.txt"
failed=()

step() {  # step NAME COMMAND...: run it, tee its output to $OUT/NAME.txt, record its status
    local name=$1 rc=0 t0
    shift
    echo "=== $name: $*"
    t0=$(date +%s)
    # a shell of its own, so that `set -e` holds inside the step's functions (bash ignores it in a
    # function called on the left of ||)
    bash -euo pipefail -c '"$@"' "$name" "$@" 2>&1 | tee "$OUT/$name.txt" || rc=$?
    echo "$name exit=$rc seconds=$(( $(date +%s) - t0 ))" | tee -a "$OUT/summary.txt"
    if [ "$rc" -ne 0 ]; then
        echo "FAILED: $name (exit $rc), see $OUT/$name.txt" >&2
        failed+=("$name")
    fi
    return 0
}

step env "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPU(s)')"

install() {
    local site=.whl/site wheels=()
    [ -d .whl ] && ls .whl/*.whl >/dev/null 2>&1 || { echo "no wheels in .whl/: run scripts/fetch_gpu_wheels.sh and carry .whl" >&2; return 1; }
    for wheel in .whl/*.whl; do
        # keep the machine's own numpy when it has one (its pyarrow and torch were built with it)
        if [[ $(basename "$wheel") == numpy-* ]] && "$PY" -c "import numpy" 2>/dev/null; then continue; fi
        wheels+=("$wheel")
    done
    rm -rf "$site"
    if "$PY" -m pip --version >/dev/null 2>&1; then
        "$PY" -m pip install --no-index --no-deps --no-compile --target "$site" "${wheels[@]}"
    else  # no pip: a wheel is a zip of its importable files
        for wheel in "${wheels[@]}"; do "$PY" -m zipfile -e "$wheel" "$site"; done
    fi
    PYTHONPATH="$PWD/$site:$PWD" "$PY" -c "import duckdb, numpy, safetensors, tokenizers, altair, pytest, hypothesis, \
pynvml, triton, kvtrace.cli; print('imports ok')"
}
record() {
    "$PY" -m kvtrace workload synth --preset chat --scale 0.5 --rate 8 --num-requests 64 --seed 1 --out "$OUT/w.jsonl"
    "$PY" -m kvtrace record --model llama-3.2-1b --load-format dummy --dtype bfloat16 --device cuda -w "$OUT/w.jsonl" \
        --kv-cache-memory 256MiB --preemption-mode swap --time-scale 4 --out "$OUT/run" --quiet
    "$PY" - "$OUT/run" <<'EOF'
import json, sys
import pyarrow.dataset as ds
run = sys.argv[1]
meta = json.load(open(f"{run}/meta.json"))
print("status", meta["status"], "| nvml", meta["nvml"])
steps = ds.dataset(f"{run}/steps").to_table()
samples = ds.dataset(f"{run}/gpu_samples").to_table().num_rows if meta["nvml"]["enabled"] else 0
timed = sum(v is not None and v > 0 for v in steps.column("device_ms").to_pylist())
print(f"steps {steps.num_rows} (with device_ms {timed}), gpu_samples {samples}")
assert meta["status"] == "completed", meta["status"]
assert meta["nvml"]["enabled"] and samples > 0, "no NVML samples"
assert timed > 0.9 * steps.num_rows, "device_ms missing"
EOF
}
analyze() {
    "$PY" -m kvtrace analyze "$OUT/run" --json > "$OUT/analyze.json"
    head -c 2000 "$OUT/analyze.json"
    echo
}
export OUT PY
export -f install record analyze
step install install
if [ ${#failed[@]} -ne 0 ]; then exit 1; fi
export PYTHONPATH="$PWD/.whl/site:$PWD"

step pytest "$PY" -m pytest -q -p no:cacheprovider -rs tests/engine/test_cuda.py tests/engine/test_triton_attention.py \
    -k "not under_the_interpreter"
step swap "$PY" scripts/swap_bandwidth.py --device cuda --out "$OUT/swap.json"

step record record
step analyze analyze
step roofline "$PY" scripts/gpu_figures.py roofline --out "$OUT/roofline.json"
step tracing "$PY" scripts/gpu_figures.py tracing --out "$OUT/tracing.json"
step syncs "$PY" scripts/gpu_figures.py syncs --out "$OUT/syncs.json"

if [ -d "$OUT/run" ]; then tar czf "$OUT/run.tgz" -C "$OUT" run && rm -rf "$OUT/run"; fi
if [ ${#failed[@]} -ne 0 ]; then
    echo "gpu_check: FAILED steps: ${failed[*]}" | tee -a "$OUT/summary.txt" >&2
    exit 1
fi
echo "gpu_check: all steps passed" | tee -a "$OUT/summary.txt"
