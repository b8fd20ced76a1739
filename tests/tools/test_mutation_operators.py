"""scripts/mutation_operators.py: the mutation check's own operators (the bugs cosmic-ray cannot make),
each mutant one statement's lines, only where its type allows; and the harness's score per family."""
from __future__ import annotations

import ast
import importlib.util
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("mutation", ROOT / "scripts" / "mutation.py")
mutation = sys.modules["mutation"] = importlib.util.module_from_spec(spec)
spec.loader.exec_module(mutation)
operators = mutation.mutation_operators

SOURCE = '''\
LIMIT = 3


def pick(pool, seqs, n):
    """Pick."""
    total = 0
    for seq in seqs:
        if seq.done and not pool.full:
            continue
        total += seq.size
        total = min(total, n)
        pool.add(seq, n)
    assert total >= 0, "negative"
    print(f"picked {total}")
    return pool.items[total - 1] if total < LIMIT else None
'''


def test_each_family_makes_the_mutants_its_place_allows_and_nothing_at_import_or_in_asserts_or_logging():
    made = [(line, op, diff.replace("\n", " | ")) for line, op, _, diff in operators.mutants(SOURCE)]
    assert made == [
        (7, "ConstantReplacement_Name_EmptyList", "-    for seq in seqs: | +    for seq in []:"),
        (8, "ConstantReplacement_Attribute_False", "-        if seq.done and not pool.full: | +        if False and not pool.full:"),
        (8, "ConstantReplacement_Attribute_True", "-        if seq.done and not pool.full: | +        if True and not pool.full:"),
        (8, "BooleanTermDrop_And", "-        if seq.done and not pool.full: | +        if not pool.full:"),
        (8, "BooleanTermDrop_And", "-        if seq.done and not pool.full: | +        if seq.done:"),
        (8, "ConstantReplacement_Attribute_False", "-        if seq.done and not pool.full: | +        if seq.done and not False:"),
        (8, "ConstantReplacement_Attribute_True", "-        if seq.done and not pool.full: | +        if seq.done and not True:"),
        (9, "StatementDeletion_Continue", "-            continue | +            pass"),
        (10, "StatementDeletion_Assign", "-        total += seq.size | +        pass"),
        (10, "ConstantReplacement_Attribute_Zero", "-        total += seq.size | +        total += 0"),
        (11, "StatementDeletion_Assign", "-        total = min(total, n) | +        pass"),     # min's arguments: no swap
        (12, "StatementDeletion_Call", "-        pool.add(seq, n) | +        pass"),
        (12, "ArgumentSwap", "-        pool.add(seq, n) | +        pool.add(n, seq)"),
        (15, "StatementDeletion_Return", "-    return pool.items[total - 1] if total < LIMIT else None | +    pass"),
        (15, "ConstantReplacement_Name_Zero",
         "-    return pool.items[total - 1] if total < LIMIT else None | +    return pool.items[0 - 1] if total < LIMIT else None"),
        (15, "OffByOneIndex_Minus",
         "-    return pool.items[total - 1] if total < LIMIT else None | +    return pool.items[total - 1 - 1] if total < LIMIT else None"),
        (15, "OffByOneIndex_Plus",
         "-    return pool.items[total - 1] if total < LIMIT else None | +    return pool.items[total - 1 + 1] if total < LIMIT else None"),
        (15, "ConstantReplacement_Name_Zero",
         "-    return pool.items[total - 1] if total < LIMIT else None | +    return pool.items[total - 1] if 0 < LIMIT else None"),
        (15, "ConstantReplacement_Name_Zero",
         "-    return pool.items[total - 1] if total < LIMIT else None | +    return pool.items[total - 1] if total < 0 else None"),
    ]
    # `total = 0` is the local's first binding: deleting it would only raise NameError
    assert not any(line == 6 for line, *_ in made)
    assert {operators.family(op) for _, op, _ in made} == set(operators.FAMILIES.values())


def test_a_mutant_is_planted_back_from_its_diff_and_keeps_the_rest_of_the_file():
    for line, op, mutated, diff in operators.mutants(SOURCE):
        m = mutation.Mutant("t.py", line, op, "survived", diff)
        assert mutation.apply_diff(SOURCE, m) == mutated


def test_the_issues_swap_in_mutant_is_made_a_constant_for_the_watermark():
    # issue #34: `>= self.watermark_blocks` -> `>= 0` in can_swap_in, a bug cosmic-ray never makes
    module = (ROOT / "engine" / "block_manager.py").read_text()
    method = next(node for node in ast.walk(ast.parse(module))
                  if isinstance(node, ast.FunctionDef) and node.name == "can_swap_in")
    source = textwrap.dedent(ast.get_source_segment(module, method))   # the method alone: the same edits
    made = {(op, diff.splitlines()[1][1:].strip()) for _, op, _, diff in operators.mutants(source)}
    assert ("ConstantReplacement_Attribute_Zero",
            "return self.num_free_blocks - self.num_swap_in_blocks(seqs, new_tokens) >= 0") in made


def test_a_multiline_statement_is_deleted_whole_and_columns_count_characters():
    source = 'def f(log, xs):\n    note = "é→"\n    log.record(note,\n               xs)\n    note = "ü"; xs[note] = 1\n'
    made = {(line, op, diff) for line, op, _, diff in operators.mutants(source)}
    assert (3, "StatementDeletion_Call",
            '-    log.record(note,\n-               xs)\n+    pass') in made
    assert (5, "StatementDeletion_Assign", '-    note = "ü"; xs[note] = 1\n+    note = "ü"; pass') in made


def test_the_score_is_reported_per_operator_family_over_all_targets_and_per_target(tmp_path):
    def m(target, op, outcome, diff="-a\n+b"):
        return mutation.Mutant(target, 1, op, outcome, diff)
    a = mutation.TargetResult("engine/a.py", ["tests/engine"], [
        m("engine/a.py", "ReplaceComparisonOperator_Lt_LtE", "killed"),
        m("engine/a.py", "StatementDeletion_Call", "killed"),
        m("engine/a.py", "StatementDeletion_Assign", "survived", "-    x = 1\n+    pass"),
        m("engine/a.py", "StatementDeletion_Assign", "survived", "-    y = 2\n+    pass")], 1.0, date="d", commit="c")
    b = mutation.TargetResult("engine/b.py", ["tests/engine"], [m("engine/b.py", "ArgumentSwap", "timeout")], 1.0,
                              date="d", commit="c")
    equivalents = [{"target": "engine/a.py", "before": "y = 2", "after": "pass", "reason": "y is never read"}]
    table = mutation.markdown([a, b], equivalents)
    header = next(ln for ln in table.splitlines() if ln.startswith("| target | comparison"))
    names = header.strip("| ").split(" | ")[1:]
    rows = {ln.split(" | ")[0].strip("| `"): dict(zip(names, ln.strip(" |").split(" | ")[1:]))
            for ln in table.splitlines() if ln.startswith("| all targets") or ln.startswith("| `engine/")
            and "statement-deletion" not in ln and ln.count("|") == len(names) + 2}
    assert rows["all targets"]["comparison"] == "100% of 1"
    assert rows["all targets"]["statement-deletion"] == "50% of 2"   # the equivalent survivor is not counted
    assert rows["engine/b.py"]["argument-swap"] == "100% of 1" and rows["engine/b.py"]["comparison"] == "-"
    # the committed summary keeps the counts per family, so a fresh checkout's table is the same
    mutation.write(tmp_path, [a, b])
    (tmp_path / "results.json").unlink()
    assert mutation.load(tmp_path)[0].families()["statement-deletion"]["survived"] == 2
    assert mutation.family("NumberReplacer") == "number" and mutation.family("min_max") == "aggregate"
    assert mutation.family("ZeroIterationForLoop") == "loop/flow" and mutation.family("And_Or") == "boolean"


def test_own_mutants_run_like_cosmic_rays_the_tests_that_execute_their_statement_each_planted_once(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text(SOURCE)

    class Runner:                               # kills a mutant whose file lacks `pool.add(seq, n)`
        work = tmp_path
        runs: list[list[str]] = []

        def run_mutant(self, tests, timeout, fresh=None):
            self.runs.append(tests)
            assert fresh == "engine/a.py"
            return "survived" if "pool.add(seq, n)" in (tmp_path / "engine" / "a.py").read_text() else "killed"

    covered = {"tests": ["t::x", "t::y"], "fixtures": {}, "lines": {"7": ["t:t::x"], "12": ["t:t::y"]}}
    result = mutation.TargetResult("engine/a.py", ["tests/engine"])
    runner = Runner()
    mutation.own_target(runner, "engine/a.py", ["tests/engine"], float("inf"), 1, 60.0, covered, result)
    assert (tmp_path / "engine" / "a.py").read_text() == SOURCE            # every mutant taken back out
    by_line = {(m.line, m.operator): (m.outcome, m.note) for m in result.mutants}
    assert by_line[(12, "StatementDeletion_Call")] == ("killed", "") and by_line[(12, "ArgumentSwap")] == ("killed", "")
    assert by_line[(7, "ConstantReplacement_Name_EmptyList")] == ("survived", "")
    # line 15 runs in no test: it survives without a run; the for (lines 7-12) gets the tests of its lines
    assert by_line[(15, "StatementDeletion_Return")] == ("survived", "no test runs this line")
    assert runner.runs[0] == ["t::x", "t::y"] and len(runner.runs) == sum(m.note == "" for m in result.mutants)
    sampled = mutation.TargetResult("engine/a.py", ["tests/engine"])
    mutation.own_target(runner, "engine/a.py", ["tests/engine"], float("inf"), 4, 60.0, covered, sampled)
    assert [m.line for m in sampled.mutants] == [m.line for m in result.mutants][::4]


def test_a_targets_sample_is_its_own_entry_or_the_default():
    pick = mutation.sample_for
    assert pick("a.py", None, 3, 1) == 3                                   # no --sample-of: --sample for all
    assert pick("a.py", ["a.py"], 3, 1) == 3 and pick("b.py", ["a.py"], 3, 1) == 1
    assert pick("a.py", ["a.py=5", "b.py"], 3, 1) == 5 and pick("b.py", ["a.py=5", "b.py"], 3, 1) == 3
    assert pick("c.py", ["4", "a.py=2"], 1, 1) == 4 and pick("a.py", ["4", "a.py=2"], 1, 1) == 2  # --sample-own


def test_a_mutant_listed_as_equivalent_is_recognised_from_the_texts_before_and_after():
    # --skip-equivalent: cosmic-ray's mutant is known only as the mutated file; equivalent.json lists it
    source = (ROOT / "engine" / "block_manager.py").read_text()
    line = "            dst = self._allocate_blocks(1)[0]\n"
    assert source.count(line) == 1
    assert mutation.listed_equivalent("engine/block_manager.py", source, source.replace(line, line.replace("[0]", "[ -1]")))  # cosmic-ray spells it so
    assert not mutation.listed_equivalent("engine/block_manager.py", source, source.replace(line, line.replace("[0]", "[1]")))


def test_a_stopped_run_of_own_mutants_lists_the_rest_as_not_run(tmp_path):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text(SOURCE)

    class Runner:                               # stopped (Ctrl-C, the budget's SIGTERM) at the second mutant
        work = tmp_path
        calls = 0

        def run_mutant(self, tests, timeout, fresh=None):
            self.calls += 1
            if self.calls == 2:
                raise KeyboardInterrupt
            return "killed"

    covered = {"tests": ["t::x"], "fixtures": {}, "lines": {str(n): ["t:t::x"] for n in range(1, 40)}}
    result = mutation.TargetResult("engine/a.py", ["tests/engine"])
    mutation.own_target(Runner(), "engine/a.py", ["tests/engine"], float("inf"), 1, 60.0, covered, result)
    assert result.interrupted and (tmp_path / "engine" / "a.py").read_text() == SOURCE
    assert len(result.mutants) == len(mutation.mutation_operators.mutants(SOURCE))   # every mutant counted
    assert [m.outcome for m in result.mutants][:2] == ["killed", "not run"]
    assert {m.outcome for m in result.mutants[1:]} == {"not run"}


def test_a_run_the_budget_stopped_is_resumed_where_it_stopped_and_its_row_adds_both_parts(tmp_path, monkeypatch):
    (tmp_path / "engine").mkdir()
    (tmp_path / "engine" / "a.py").write_text(SOURCE)
    monkeypatch.setattr(mutation, "run_stamp", lambda: {"date": "2026-12-02 05:00", "commit": "abc1234"})
    total = len(mutation.mutation_operators.mutants(SOURCE))
    assert total > 4

    class Runner:                               # scripted outcomes; stopped (the budget's SIGTERM) at the 4th mutant
        work = tmp_path

        def __init__(self, outcomes, stop_at=None):
            self.outcomes, self.stop_at, self.planted = list(outcomes), stop_at, []

        def run_mutant(self, tests, timeout, fresh=None):
            self.planted.append((tmp_path / "engine" / "a.py").read_text())
            if len(self.planted) == self.stop_at:
                raise KeyboardInterrupt
            return self.outcomes.pop(0) if self.outcomes else "killed"

    covered = {"tests": ["t::x"], "fixtures": {}, "lines": {str(n): ["t:t::x"] for n in range(1, 40)}}
    first = Runner(["killed", "survived", "killed"], stop_at=4)
    [row] = mutation.python_target(first, "engine/a.py", ["tests/engine"], float("inf"), 1, 1, 60.0, covered,
                                   operators="own")
    assert row.interrupted and row.count("not run") == total - 3
    out = tmp_path / "results"
    mutation.write(out, [row])                  # what the next session finds: the committed summary only
    (out / "results.json").unlink()
    previous = {r.key: r for r in mutation.load(out)}
    second = Runner(["survived"])
    [resumed] = mutation.python_target(second, "engine/a.py", ["tests/engine"], float("inf"), 1, 1, 60.0, covered,
                                       operators="own", previous=previous)
    assert len(second.planted) == total - 3     # only what the first left unrun
    assert first.planted[:3] + second.planted == [m[2] for m in mutation.mutation_operators.mutants(SOURCE)]
    assert resumed.complete and resumed.parts == 2 and resumed.first_date == "2026-12-02 05:00"
    assert resumed.num_mutants == total and resumed.count("not run") == 0
    assert (resumed.count("killed"), resumed.count("survived")) == (total - 2, 2)
    assert [m.outcome for m in resumed.mutants] == ["survived", "survived"]   # both parts' survivors listed
    assert sum(c["not run"] for c in resumed.families().values()) == 0
    assert sum(sum(c.values()) for c in resumed.families().values()) == total
    mutation.write(out, [resumed])
    assert "in 2 parts since 2026-12-02 05:00" in (out / "results.md").read_text()
    # a finished row, or a changed target, is run again whole
    assert mutation.resumable(resumed, resumed) == 0
    (tmp_path / "engine" / "a.py").write_text(SOURCE + "\nEXTRA = 1\n")
    third = Runner([])
    mutation.python_target(third, "engine/a.py", ["tests/engine"], float("inf"), 1, 1, 60.0, covered,
                           operators="own", previous=previous)
    assert len(third.planted) == len(mutation.mutation_operators.mutants(SOURCE + "\nEXTRA = 1\n"))
