#!/usr/bin/env bash
# The mutation check (scripts/mutation.py): plant small bugs one at a time in the scheduler, the
# block manager, the engine loop, the replay, the workload reader and analyses/_*.sql, run the tests
# of the target's component folders against each (tests/engine, tests/workload, tests/cli,
# tests/analysis, less those marked `long`; of a Python target's, those that run the mutated
# statement), and report the survivors. CPU-heavy: it runs at the lowest priority, one mutant at a
# time, within --budget-min (default 60). Needs cosmic-ray and coverage (pip install -e ".[mutation]").
# Results: benchmarks/mutation/results.md and summary.json (committed), results.json (the detail, not).
#
#   bash scripts/mutation.sh                                   # everything, 60 min budget
#   bash scripts/mutation.sh --only engine/scheduler.py analyses/_goodput.sql --budget-min 20
#   bash scripts/mutation.sh --operators own --skip-equivalent --resume   # go on where the budget stopped
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c "import cosmic_ray, coverage" 2>/dev/null; then
    "$PY" -m pip install --quiet "cosmic-ray>=8.7,<9" "coverage>=7.6"
fi
exec nice -n 19 "$PY" scripts/mutation.py "$@"
