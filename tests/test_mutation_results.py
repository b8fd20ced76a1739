"""scripts/mutation.py keeps one row per target: a run of some targets replaces only their rows."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("mutation", Path(__file__).resolve().parent.parent / "scripts" / "mutation.py")
mutation = sys.modules["mutation"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)


def row(target: str, outcome: str, date: str):
    return mutation.TargetResult(target, ["tests/x.py"], [mutation.Mutant(target, 1, "AddNot", outcome)],
                                 1.0, date=date, commit="abc1234")


def test_a_run_of_one_target_keeps_the_other_targets_last_results(tmp_path):
    mutation.write(tmp_path, [row("engine/a.py", "survived", "2026-11-30 10:00"),
                              row("engine/b.py", "killed", "2026-11-30 10:05")])
    mutation.write(tmp_path, [row("engine/a.py", "killed", "2026-11-30 12:00"), row("engine/c.py", "killed", "2026-11-30 12:01")])
    rows = json.loads((tmp_path / "results.json").read_text())
    assert [(r["target"], r["date"], r["mutants"][0]["outcome"]) for r in rows] == [
        ("engine/a.py", "2026-11-30 12:00", "killed"), ("engine/b.py", "2026-11-30 10:05", "killed"),
        ("engine/c.py", "2026-11-30 12:01", "killed")]
    table = (tmp_path / "results.md").read_text()
    assert "| `engine/b.py` | 1 | 1 |" in table and "2026-11-30 10:05 `abc1234`" in table
    assert "Survivors in" not in table  # a's survivor of the earlier run is gone with its row
