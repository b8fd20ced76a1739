#!/usr/bin/env bash
# One short check on a lent GPU machine (device tool): CUDA tests, the four-block scenario on CUDA,
# swap bandwidth, a short traced replay. Results go to $OUT (or ./gpu-check) and stdout.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-gpu-check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.get_device_name())"
python3 -m pip install -q -e ".[test,gpu]" 2>&1 | tail -1   # the machine's CUDA torch satisfies torch>=2.4
python3 -m pytest -q -m cuda tests/test_cuda.py 2>&1 | tee "$OUT/pytest.txt"
python3 scripts/swap_bandwidth.py --device cuda 2>&1 | tee "$OUT/swap_bandwidth.txt"
python3 -m kvtrace workload synth --preset chat --scale 0.5 --rate 8 --num-requests 64 --seed 1 -o "$OUT/w.jsonl"
python3 -m kvtrace record --model llama-3.2-1b --load-format dummy --dtype bfloat16 --device cuda -w "$OUT/w.jsonl" \
    --kv-cache-memory 256MiB --preemption-mode swap --time-scale 4 -o "$OUT/run" 2>&1 | tail -3
python3 -m kvtrace analyze "$OUT/run" --json > "$OUT/analyze.json" 2>&1 || true
tar czf "$OUT/run.tgz" -C "$OUT" run && rm -rf "$OUT/run"
