"""scripts/mutation.py keeps one row per target: a run of some targets replaces only their rows."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

spec = importlib.util.spec_from_file_location("mutation", Path(__file__).resolve().parents[2] / "scripts" / "mutation.py")
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


SOURCE = '''\
LIMIT = 3


class Pool:
    size: int = 4

    @staticmethod
    def grow(n, step=1):
        if n > LIMIT:
            return [i
                    for i in range(n)]
        return n + step


def helper():
    return 1
'''


def test_a_mutant_in_a_function_gets_the_tests_that_run_its_statement_and_one_at_import_gets_all():
    span = mutation.statement_span
    assert span(SOURCE, 10) == (10, 11) and span(SOURCE, 11) == (10, 11)   # a two-line return: one statement
    assert span(SOURCE, 9) == (9, 11)                                       # the if: its test and its body
    assert span(SOURCE, 8) == (8, 12)                                       # a default: the function's callers
    assert span(SOURCE, 16) == (16, 16)
    for at_import in (1, 5, 7):                                             # a constant, a field, a decorator
        assert span(SOURCE, at_import) is None
    covered = {"tests": ["t.py::a", "t.py::b", "t.py::c", "t.py::d"],
               "fixtures": {"t.py::a": [], "t.py::b": ["pool"], "t.py::c": [], "t.py::d": ["pool"]},
               "lines": {"10": ["t:t.py::c"], "12": ["t:t.py::a", "f:pool"], "16": ["", "t:t.py::a"]}}
    assert mutation.tests_for((10, 11), covered) == ["t.py::c"]
    # a line a fixture's set-up runs belongs to every test that uses the fixture, in run order
    assert mutation.tests_for((9, 12), covered) == ["t.py::a", "t.py::b", "t.py::c", "t.py::d"]
    assert mutation.tests_for((12, 12), covered) == ["t.py::a", "t.py::b", "t.py::d"]
    assert mutation.tests_for((16, 16), covered) is None                   # run outside any test: all of them
    assert mutation.tests_for(None, covered) is None
    assert mutation.tests_for((13, 14), covered) == []                     # no test runs it
