"""scripts/mutation.py: one row per target (a run of some targets replaces only their rows, and the
committed summary keeps them without the generated detail), tests chosen by component folder and
marker, and, per mutant, by the coverage of its statement."""
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


def test_a_fresh_checkout_keeps_every_targets_row_from_the_committed_summary(tmp_path):
    # results.json (every mutant with its diff) is not committed: summary.json and results.md are
    survivor = mutation.Mutant("engine/a.py", 3, "AddNot", "survived", "-    if x:\n+    if not x:")
    first = mutation.TargetResult("engine/a.py", ["tests/engine"], [survivor, *row("engine/a.py", "killed", "").mutants],
                                  2.0, date="2026-11-30 10:00", commit="abc1234")
    mutation.write(tmp_path, [first, row("engine/b.py", "timeout", "2026-11-30 10:05")])
    table = (tmp_path / "results.md").read_text()
    (tmp_path / "results.json").unlink()
    mutation.write(tmp_path, [])                                            # --report-only
    assert (tmp_path / "results.md").read_text() == table
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [(r["target"], r["counts"]["killed"], r["counts"]["survived"], r["counts"]["timeout"]) for r in summary] == [
        ("engine/a.py", 1, 1, 0), ("engine/b.py", 0, 0, 1)]
    # the summary lists the survivors and timeouts one by one (for --recheck and equivalent.json), not the killed
    assert [[m["outcome"] for m in r["mutants"]] for r in summary] == [["survived"], ["timeout"]]
    # a run of c keeps a's and b's rows from the summary
    mutation.write(tmp_path, [row("engine/c.py", "killed", "2026-11-30 12:00")])
    assert "| `engine/a.py` | 2 | 1 | 1 |" in (tmp_path / "results.md").read_text()
    assert [r.target for r in mutation.load(tmp_path)] == ["engine/a.py", "engine/b.py", "engine/c.py"]
    assert [r["target"] for r in json.loads((tmp_path / "results.json").read_text())] == ["engine/c.py"]


TESTS = Path(__file__).resolve().parents[1]


def test_every_target_runs_whole_component_folders_selected_by_markers_only():
    components = {p.name for p in TESTS.iterdir() if p.is_dir() and any(p.glob("test_*.py"))}
    chosen = set()
    for target in [*mutation.TARGETS, "analyses/_goodput.sql"]:
        args = mutation.tests_of(target)
        assert "-k" not in args and args[-2:] == mutation.SELECTION, target
        folders = args[:-2]
        assert all((TESTS.parent / f).is_dir() and Path(f).parent == Path("tests") for f in folders), target
        chosen |= {Path(f).name for f in folders}
    # the folders of the code under mutation (vllm/: the capture's tests that need no vLLM, the marker
    # deselects the rest); tools/ tests the tools; vllm_sched/ has only tests that step vLLM's own
    # scheduler (marker vllm), which the selection leaves out
    assert chosen == components - {"tools", "vllm_sched"}
    assert mutation.tests_of("sql") == mutation.tests_of("analyses/_timeline.sql") == ["tests/analysis", *mutation.SELECTION]
    registered = (TESTS.parent / "pyproject.toml").read_text()               # pytest's markers
    for marker in ("long", "slow", "cuda", "vllm", "browser", "external"):
        assert f"not {marker}" in mutation.SELECTION[1] and f'"{marker}: ' in registered


def test_a_new_test_file_in_a_targets_folder_is_picked_up_and_long_tests_stay_out(pytester):
    pytester.makeini("[pytest]\nmarkers =\n" + "".join(
        f"    {m}: x\n" for m in ("long", "slow", "cuda", "vllm", "browser", "external")))
    pytester.mkdir("tests")
    pytester.mkdir("tests/engine")
    (pytester.path / "tests/engine/test_new.py").write_text(
        "import pytest\n\ndef test_fast():\n    pass\n\n@pytest.mark.long\ndef test_long():\n    pass\n")
    result = pytester.runpytest(*mutation.tests_of("engine/scheduler.py"), "-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, deselected=1)


class _Child:
    """A ForkRunner whose children are scripted: each run() returns the next (outcome, output)."""

    def __init__(self, killers: list[str], answers: list[tuple[str, str]]):
        self.runner = object.__new__(mutation.ForkRunner)
        self.runner.killers = list(killers)
        self.calls: list[list[str]] = []
        answers = iter(answers)

        def run(tests, timeout, fresh=None):
            self.calls.append(list(tests))
            self.outcome, self.text = next(answers)
            return self.outcome

        self.runner.run = run
        self.runner.output = lambda: self.text


def test_a_mutant_runs_the_latest_killers_first_and_the_rest_only_if_they_pass():
    tests = ["tests/engine/test_a.py::one", "tests/engine/test_b.py::two", "tests/engine/test_c.py::three"]
    child = _Child(["tests/engine/test_b.py::two", "tests/other/test_x.py::x"],
                   [("killed", "FAILED tests/engine/test_b.py::two - assert 1 == 2")])
    assert child.runner.run_mutant(tests, 60) == "killed"
    assert child.calls == [["tests/engine/test_b.py::two"]]          # a killer outside `tests` is not run

    child = _Child(["tests/engine/test_b.py::two"],
                   [("survived", ""), ("killed", "FAILED tests/engine/test_c.py::three - boom")])
    assert child.runner.run_mutant(tests, 60) == "killed"
    assert child.calls == [["tests/engine/test_b.py::two"], ["tests/engine/test_a.py::one", "tests/engine/test_c.py::three"]]
    assert child.runner.killers[0] == "tests/engine/test_c.py::three"   # the new killer goes first next time

    child = _Child(["tests/engine/test_b.py::two"], [("survived", ""), ("survived", "")])
    assert child.runner.run_mutant(tests, 60) == "survived"             # every test ran: a survivor is one


def test_a_first_run_that_names_no_failed_test_is_no_kill_and_folders_select_their_own_killers():
    tests = ["tests/engine/test_a.py::one", "tests/engine/test_b.py::two"]
    child = _Child(["tests/engine/test_b.py::two"],
                   [("killed", "ERROR: not found: tests/engine/test_b.py::two"), ("survived", "")])
    assert child.runner.run_mutant(tests, 60) == "survived"
    assert child.calls[1] == ["tests/engine/test_a.py::one"]

    folders = ["tests/engine", "-m", "not long"]
    child = _Child(["tests/analysis/test_x.py::x", "tests/engine/test_b.py::two"],
                   [("survived", ""), ("survived", "")])
    assert child.runner.run_mutant(folders, 60) == "survived"
    assert child.calls == [["tests/engine/test_b.py::two"], folders]   # all of the folder still runs


def test_a_recheck_takes_survivors_before_timeouts_and_its_resume_leaves_out_the_killed(tmp_path, monkeypatch):
    # a stand-in runner: every planted text is noted, and the tests kill every mutant but "c"
    target = "engine/t.py"
    (tmp_path / "engine").mkdir()
    (tmp_path / target).write_text("a = 1\nb = 2\nc = 3\n")

    def mutant(line: int, name: str, outcome: str, recheck: str = "") -> mutation.Mutant:
        return mutation.Mutant(target, line, "ConstantReplacement_Name_Zero", outcome,
                               f"--- a\n+++ b\n@@ -{line} +{line} @@\n-{name} = {line}\n+{name} = 0\n", recheck=recheck)

    class Runner:
        work, planted = tmp_path, []

        def run(self, tests, timeout, fresh=None):
            text = (tmp_path / target).read_text()
            self.planted.append(next(ln for ln in text.splitlines() if ln.endswith(" = 0")))
            return "survived" if "c = 0" in text else "killed"

        def output(self):
            return "FAILED tests/x.py::test_t - assert\n"

    monkeypatch.setattr(mutation, "changed_tests", lambda commit, folders: [])
    monkeypatch.setitem(mutation.TARGETS, target, ["tests/x.py"])
    r = mutation.TargetResult(target, ["tests/x.py"], [mutant(1, "a", "timeout"), mutant(2, "b", "survived"),
                                                       mutant(3, "c", "survived")], 1.0, commit="abc1234")
    runner = Runner()
    mutation.recheck(runner, [r], [], timeout=5.0)
    assert runner.planted == ["b = 0", "c = 0", "a = 0"]   # survivors first, in file order
    assert [m.recheck for m in r.mutants] == ["killed by tests/x.py::test_t", "killed by tests/x.py::test_t", "survives"]
    assert (tmp_path / target).read_text() == "a = 1\nb = 2\nc = 3\n"
    runner.planted = []
    mutation.recheck(runner, [r], [], timeout=5.0, resume=True)
    assert runner.planted == ["c = 0"]


def test_an_equivalent_with_a_line_answers_only_that_line_or_those_it_lists():
    """A line whose text occurs twice in the file: an entry answers the mutant of the line it names,
    or of any line it lists (the line moved since a run still reported: its number there, and now)."""
    def mutant(line: int) -> mutation.Mutant:
        return mutation.Mutant("t.py", line, "AddNot", "survived", "-    if a:\n+    if not a:")
    entry = {"target": "t.py", "before": "if a:", "after": "if not a:", "reason": "why"}
    assert [mutation.equivalence(mutant(n), [entry]) for n in (3, 9)] == ["why", "why"]
    assert [mutation.equivalence(mutant(n), [{**entry, "line": 9}]) for n in (3, 9)] == [None, "why"]
    assert [mutation.equivalence(mutant(n), [{**entry, "line": [3, 5]}]) for n in (3, 5, 9)] == ["why", "why", None]


def test_a_rows_open_count_leaves_out_the_equivalent_and_what_a_recheck_killed():
    """Open: survivors neither listed equivalent nor killed when rechecked, and timeouts a recheck found
    surviving; a timeout not rechecked counts as caught."""
    def mutant(line: int, outcome: str, recheck: str = "") -> mutation.Mutant:
        return mutation.Mutant("t.py", line, "AddNot", outcome, f"-    x = {line}\n+    x = not {line}", recheck=recheck)
    mutants = [mutant(1, "survived"), mutant(2, "survived", "killed by tests/t.py::a"), mutant(3, "survived"),
               mutant(4, "timeout"), mutant(5, "timeout", "survives"), mutant(6, "survived", "survives"),
               mutant(7, "killed")]
    equivalents = [{"target": "t.py", "before": "x = 3", "after": "x = not 3", "reason": "why"}]
    table = mutation.markdown([mutation.TargetResult("t.py", ["tests/t.py"], mutants, 1.0, date="d", commit="c")],
                              equivalents)
    header, _, row = table.splitlines()[:3]
    assert dict(zip(header.split(" | "), row.split(" | ")))["open"] == "3", (header, row)   # lines 1, 5 and 6
