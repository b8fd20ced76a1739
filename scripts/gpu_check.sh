#!/usr/bin/env bash
# The check of kvtrace's CUDA path on a lent GPU machine: at most 6 minutes, everything it leaves in
# $OUT in two files, however far it gets.
#
# That machine is offline; its image has CUDA torch with Triton, numpy, pyarrow, pytest, hypothesis,
# rich, typer, jinja2, narwhals, nvidia-ml-py and the rest of what kvtrace imports but for a few,
# which travel as wheels fetched here first:
#
#     bash scripts/fetch_gpu_wheels.sh        # -> .whl/ (git-ignored), checks wheels + tree < 64 MiB
#
# then, with the device tool, carrying the wheel folder:
#
#     run(command="bash scripts/gpu_check.sh", carry=[".whl"], timeout_s=390)
#
# 390 s: the steps' own limits add up to 345 s, plus archiving; a machine's start takes a minute or
# two, so a second run after a fix still fits in the 15 minutes of device time. Killed early, the
# check still returns what it has: the archive is rewritten after every step.
#
# What comes back (the machine returns at most 8 files from $OUT):
#   $OUT/SUMMARY.txt    one line per step: name, exit status (124: its time limit), seconds
#   $OUT/results.tgz    each step's log (<step>.txt), the figures (swap.json, roofline.json,
#                       tracing.json, syncs.json, analyze.json, h200-measured.json), the workload and
#                       the recorded run folder (run/)
# Nothing else is written under $OUT (the steps work in a scratch folder).
#
# No model file travels (the real SmolLM2 GGUF is ~94 MB): the engine runs `tiny` and dummy-weight
# real shapes (llama-3.2-1b). Steps, each with its time limit in seconds:
#   env        20  torch, CUDA, Triton, GPU name
#   install    30  the carried wheels into .whl/site (pip --no-index --no-deps --target), then imports
#   pytest    110  CUDA tests: four-block scenario, preemption transparency, staged swaps, the host KV tier's copies, Triton + graphs
#                  + copy-on-write + prefix hits vs the dense reference (fp32, bf16), no sync inside a
#                  step, record on CUDA; the Triton kernels on CUDA (fp32, bf16)
#   swap       25  swap bandwidth of the engine's copy path vs a pinned cudaMemcpyAsync peak (goal >= 0.8)
#   record     50  a traced replay of llama-3.2-1b (dummy, bf16) with NVML samples; its trace is checked
#   analyze    20  `kvtrace analyze --json` on that run
#   calibrate  20  `kvtrace calibrate` on that run, compared with the shipped h200 profile; the same
#                  workload replayed by the simulator on each, against the recorded duration
#   roofline   25  decode step / HBM bound at batch 1, 8, 64 (goal <= 1.5 at 64)
#   tracing    25  traced / untraced replay time (goal <= 1.02)
#   syncs      20  synchronisations per step over a swapping replay (goal: none inside the runner's step)
# A failing step is reported and the others still run (a failed install too: the steps then use
# what the image has); the script exits 1 at the end if any failed.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1
PY=${PYTHON:-python3}
: > "$WORK/SUMMARY.txt"
failed=()

archive() {  # the results so far into $OUT (a rename: a kill mid-archive keeps the last one whole)
    cp "$WORK/SUMMARY.txt" "$OUT/SUMMARY.txt.part" && mv "$OUT/SUMMARY.txt.part" "$OUT/SUMMARY.txt"
    tar czf "$OUT/results.tgz.part" -C "$WORK" --exclude=./site . 2>/dev/null \
        && mv "$OUT/results.tgz.part" "$OUT/results.tgz"
    rm -f "$OUT/results.tgz.part" "$OUT/SUMMARY.txt.part"
}
trap 'echo "gpu_check: stopped" >> "$WORK/SUMMARY.txt"; archive; exit 143' TERM INT

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, its output to $WORK/NAME.txt
    local name=$1 limit=$2 rc=0 t0
    shift 2
    echo "=== $name (limit ${limit}s): $*"
    t0=$(date +%s)
    # a shell of its own, so that `set -e` holds inside the step's functions
    timeout --kill-after=5 "$limit" bash -euo pipefail -c '"$@"' "$name" "$@" > "$WORK/$name.txt" 2>&1 || rc=$?
    tail -n 15 "$WORK/$name.txt"
    echo "$name exit=$rc seconds=$(( $(date +%s) - t0 ))" | tee -a "$WORK/SUMMARY.txt"
    if [ "$rc" -ne 0 ]; then
        if [ "$rc" -eq 124 ]; then echo "FAILED: $name (over its ${limit}s)" >&2; else echo "FAILED: $name (exit $rc)" >&2; fi
        failed+=("$name")
    fi
    archive
    return 0
}

install() {
    local site=$WORK/site
    if ls .whl/*.whl >/dev/null 2>&1; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$site" .whl/*.whl
    else
        echo "no wheels in .whl/ (scripts/fetch_gpu_wheels.sh): using what the image has"
    fi
    "$PY" -c "import duckdb, altair, numpy, safetensors, tokenizers, pytest, hypothesis, pynvml, triton, kvtrace.cli; \
print('imports ok')"
}
record() {
    "$PY" -m kvtrace workload synth --preset chat --scale 0.5 --rate 8 --num-requests 64 --seed 1 --out "$WORK/w.jsonl"
    "$PY" -m kvtrace record --model llama-3.2-1b --load-format dummy --dtype bfloat16 --device cuda -w "$WORK/w.jsonl" \
        --kv-cache-memory 256MiB --preemption-mode swap --swap-space 256MiB --time-scale 4 --out "$WORK/run" --quiet
    "$PY" - "$WORK/run" <<'PYEOF'
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
PYEOF
}
analyze() {
    "$PY" -m kvtrace analyze "$WORK/run" --json > "$WORK/analyze.json"
    head -c 2000 "$WORK/analyze.json"
    echo
}
calibrate() {
    "$PY" -m kvtrace calibrate "$WORK/run" --out "$WORK/h200-measured.json" --name h200-measured
    for hardware in h200 "$WORK/h200-measured.json"; do
        "$PY" -m kvtrace record --engine sim --hardware "$hardware" --model llama-3.2-1b --load-format dummy \
            --dtype bfloat16 -w "$WORK/w.jsonl" --kv-cache-memory 256MiB --preemption-mode swap --swap-space 256MiB \
            --time-scale 4 --out "$WORK/sim-$(basename "$hardware" .json)" --quiet
    done
    "$PY" - "$WORK" <<'PYEOF'
import json, sys
from engine.sim.cost_model import load_profile
work = sys.argv[1]
shipped, measured = load_profile("h200"), load_profile(f"{work}/h200-measured.json")
print("coefficients: measured vs shipped h200 (derived where not fitted)")
print(json.dumps({"measured": measured.coefficients, "shipped": shipped.coefficients}, indent=1))
duration = lambda run: json.load(open(f"{work}/{run}/meta.json"))["summary"]["duration_s"]
real = duration("run")
for run in ("sim-h200", "sim-h200-measured"):
    print(f"{run}: replay {duration(run):.2f} s against the recorded {real:.2f} s ({duration(run) / real:.2f}x)")
PYEOF
}
export WORK PY
export -f install record analyze calibrate

step env 20 "$PY" -c "import torch, triton; print('torch', torch.__version__, 'cuda', torch.version.cuda, \
'triton', triton.__version__, torch.cuda.get_device_name(), torch.cuda.device_count(), 'GPU(s)')"
step install 30 install
export PYTHONPATH="$WORK/site:$PWD"
step pytest 110 "$PY" -m pytest -q -p no:cacheprovider -rs tests/engine/test_cuda.py tests/engine/test_offload_copies.py tests/engine/test_triton_attention.py \
    -k "not under_the_interpreter"
step swap 25 "$PY" scripts/swap_bandwidth.py --device cuda --out "$WORK/swap.json"
step record 50 record
step analyze 20 analyze
step calibrate 20 calibrate
step roofline 25 "$PY" scripts/gpu_figures.py roofline --out "$WORK/roofline.json"
step tracing 25 "$PY" scripts/gpu_figures.py tracing --out "$WORK/tracing.json"
step syncs 20 "$PY" scripts/gpu_figures.py syncs --out "$WORK/syncs.json"

if [ ${#failed[@]} -ne 0 ]; then
    echo "gpu_check: FAILED steps: ${failed[*]}" | tee -a "$WORK/SUMMARY.txt" >&2
    archive
    rm -rf "$WORK"
    exit 1
fi
echo "gpu_check: all steps passed" | tee -a "$WORK/SUMMARY.txt"
archive
rm -rf "$WORK"
