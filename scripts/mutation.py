"""The mutation check: plant small bugs one at a time and see whether a fast, relevant subset of
the tests fails. Run it (scripts/mutation.sh) before calling a change to these files done.

Python targets go through cosmic-ray (8.x) with the operators that make realistic bugs (boundary and
negated comparisons, + and -, * and /, numbers off by one, not, and/or, True/False, loops that
never run, break/continue). analyses/_*.sql get mutants of our own: comparison operators flipped,
min/max and sum/avg swapped, AND/OR swapped, + and - swapped, one at a time.

Everything runs in a scratch copy of the work tree (git's tracked and unignored files), so the
checkout is never touched. The run has a time budget: a target that does not finish is reported
with what was covered. Results: a JSON file and a Markdown table (survivors listed with their diff).

    python scripts/mutation.py [--budget-min 30] [--only NAME ...] [--sample K] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PYTEST = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider"]

# fast tests that exercise each target; the long property tests stay out (the derandomised
# test_swap_cow property test stays in: it is the one that reaches the swap + copy-on-write path)
ENGINE_TESTS = ["tests/test_scheduling.py", "tests/test_swap_cow.py", "tests/test_preemption.py",
                "tests/test_prefix_cache.py", "-k", "not is_invisible and not progress_before and not invariants"]
TARGETS: dict[str, list[str]] = {
    "kvtrace/replay.py": ["tests/test_replay.py", "tests/test_record.py", "-k",
                          "time_scale or four_block or bad_input or missing_workload"],
    "kvtrace/workload/format.py": ["tests/test_workload.py", "tests/test_replay.py"],
    "engine/scheduler.py": ENGINE_TESTS,
    "engine/block_manager.py": ENGINE_TESTS,
    "engine/llm_engine.py": ENGINE_TESTS,
}
# the golden SQL tests on hand-built traces (the one that records runs through the engine stays out)
SQL_TESTS = ["tests/test_analyses.py", "tests/test_analyses_values.py", "-k", "not on_a_recorded_run"]

KEEP_OPERATORS = [
    r"core/ReplaceComparisonOperator_(Lt_LtE|LtE_Lt|Gt_GtE|GtE_Gt|Eq_NotEq|NotEq_Eq|Is_IsNot|IsNot_Is"
    r"|Lt_GtE|GtE_Lt|Gt_LtE|LtE_Gt|In_NotIn|NotIn_In)",
    r"core/ReplaceBinaryOperator_(Add_Sub|Sub_Add|Mul_FloorDiv|FloorDiv_Mul|Mul_Div|Div_Mul)",
    r"core/NumberReplacer", r"core/AddNot", r"core/ReplaceTrueWithFalse", r"core/ReplaceFalseWithTrue",
    r"core/ReplaceAndWithOr", r"core/ReplaceOrWithAnd", r"core/ZeroIterationForLoop",
    r"core/ReplaceBreakWithContinue", r"core/ReplaceContinueWithBreak",
]


@dataclass
class Mutant:
    target: str
    line: int
    operator: str
    outcome: str            # killed | survived | timeout | error | not run
    diff: str = ""


@dataclass
class TargetResult:
    target: str
    tests: list[str]
    mutants: list[Mutant] = field(default_factory=list)
    seconds: float = 0.0
    complete: bool = True

    def count(self, outcome: str) -> int:
        return sum(m.outcome == outcome for m in self.mutants)


# ---------------------------------------------------------------- the scratch copy

def scratch_copy() -> Path:
    files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=ROOT, check=True,
                           capture_output=True).stdout.decode().split("\0")
    dest = Path(tempfile.mkdtemp(prefix="kvtrace-mutation-"))
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


def run_tests(work: Path, tests: list[str], timeout: float) -> str:
    """'killed' if the tests fail, 'survived' if they pass, 'timeout' past the limit."""
    try:
        proc = subprocess.run(PYTEST + tests, cwd=work, capture_output=True, timeout=timeout,
                              start_new_session=True)
    except subprocess.TimeoutExpired:
        return "timeout"
    return "survived" if proc.returncode == 0 else "killed"


# ---------------------------------------------------------------- Python targets (cosmic-ray)

def cosmic_ray_target(work: Path, target: str, tests: list[str], deadline: float, sample: int,
                      test_timeout: float) -> TargetResult:
    result = TargetResult(target, tests)
    start = time.monotonic()
    session = work / f".mutation-{target.replace('/', '_')}.sqlite"
    config = work / f".mutation-{target.replace('/', '_')}.toml"
    command = shlex.join([sys.executable, *PYTEST[1:], *tests])
    exclude = "(?!(?:" + "|".join(KEEP_OPERATORS) + ")$).*"
    config.write_text(
        "[cosmic-ray]\n"
        f'module-path = "{target}"\n'
        f"timeout = {test_timeout}\n"
        "excluded-modules = []\n"
        f"test-command = {json.dumps(command)}\n"
        '[cosmic-ray.distributor]\nname = "local"\n'
        "[cosmic-ray.filters.operators-filter]\n"
        f"exclude-operators = [{json.dumps(exclude)}]\n")
    subprocess.run(["cosmic-ray", "init", str(config), str(session)], cwd=work, check=True, capture_output=True)
    subprocess.run(["cr-filter-operators", str(session), str(config)], cwd=work, check=True, capture_output=True)
    if sample > 1:
        _keep_every(session, sample)
    remaining = deadline - time.monotonic()
    if remaining > 0:
        proc = subprocess.Popen(["cosmic-ray", "exec", str(config), str(session)], cwd=work,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        try:
            proc.wait(timeout=remaining)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.copy2(ROOT / target, work / target)  # a run cut short may have left a mutant in place
    dump = subprocess.run(["cosmic-ray", "dump", str(session)], cwd=work, check=True, capture_output=True, text=True)
    for line in dump.stdout.splitlines():
        item, outcome = json.loads(line)
        mutation = item["mutations"][0]
        if outcome is None:
            state = "not run"
        elif outcome["worker_outcome"] == "skipped":
            continue                                   # an operator outside the chosen set, or not sampled
        elif outcome["worker_outcome"] == "timeout":
            state = "timeout"
        elif outcome["worker_outcome"] != "normal":
            state = "error"
        else:
            state = {"killed": "killed", "survived": "survived"}.get(outcome["test_outcome"], "error")
        diff = (outcome or {}).get("diff") or ""
        result.mutants.append(Mutant(target, mutation["start_pos"][0], mutation["operator_name"].removeprefix("core/"),
                                     state, diff))
    result.complete = not any(m.outcome == "not run" for m in result.mutants)
    result.seconds = time.monotonic() - start
    return result


def _keep_every(session: Path, k: int) -> None:
    """Mark all but every k-th pending mutant (in job order) as skipped: a deterministic sample."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session)) as db:
        for i, item in enumerate(sorted(db.pending_work_items, key=lambda w: w.job_id)):
            if i % k:
                db.set_result(item.job_id, WorkResult(output="not sampled", worker_outcome=WorkerOutcome.SKIPPED))


# ---------------------------------------------------------------- SQL targets (our own mutants)

SQL_SWAPS = [  # (pattern, replacement, name); each match is one mutant
    (r"<=", "<", "LtE_Lt"), (r"(?<![<>!=:])<(?![=>])", "<=", "Lt_LtE"),
    (r">=", ">", "GtE_Gt"), (r"(?<![<>!=:-])>(?![=])", ">=", "Gt_GtE"),
    (r"(?<![<>!=:])=(?![=>])", "<>", "Eq_NotEq"), (r"<>|!=", "=", "NotEq_Eq"),
    (r"\bmin\(", "max(", "min_max"), (r"\bmax\(", "min(", "max_min"),
    (r"\bsum\(", "avg(", "sum_avg"), (r"\bavg\(", "sum(", "avg_sum"),
    (r"\bAND\b", "OR", "And_Or"), (r"\bOR\b", "AND", "Or_And"),
    (r"(?<=\s)\+(?=\s)", "-", "Add_Sub"), (r"(?<=\s)-(?=\s)", "+", "Sub_Add"),
]


def sql_mutants(text: str) -> list[tuple[int, str, str, str]]:
    """(line, operator, mutated text, diff line) for each site outside comments and strings."""
    mutants = []
    lines = text.splitlines(keepends=True)
    for number, line in enumerate(lines, start=1):
        code = line.split("--", 1)[0]
        masked = re.sub(r"'[^']*'|\bOR REPLACE\b", lambda m: " " * len(m.group()), code)
        for pattern, replacement, name in SQL_SWAPS:
            for match in re.finditer(pattern, masked):
                new_line = line[:match.start()] + replacement + line[match.end():]
                mutated = "".join(lines[:number - 1]) + new_line + "".join(lines[number:])
                mutants.append((number, name, mutated, f"-{line.rstrip()}\n+{new_line.rstrip()}"))
    return mutants


def sql_target(work: Path, target: str, deadline: float, test_timeout: float) -> TargetResult:
    result = TargetResult(target, SQL_TESTS)
    start = time.monotonic()
    path = work / target
    original = path.read_text()
    try:
        for line, operator, mutated, diff in sql_mutants(original):
            if time.monotonic() >= deadline:
                result.mutants.append(Mutant(target, line, operator, "not run", diff))
                continue
            path.write_text(mutated)
            result.mutants.append(Mutant(target, line, operator, run_tests(work, SQL_TESTS, test_timeout), diff))
    finally:
        path.write_text(original)
    result.complete = not any(m.outcome == "not run" for m in result.mutants)
    result.seconds = time.monotonic() - start
    return result


# ---------------------------------------------------------------- report

def markdown(results: list[TargetResult], budget_min: float, sample: int) -> str:
    out = [f"| target | mutants | killed | survived | timeout | error | not run | score | time |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        ran = r.count("killed") + r.count("survived") + r.count("timeout")
        score = f"{(r.count('killed') + r.count('timeout')) / ran:.0%}" if ran else "-"
        out.append(f"| `{r.target}` | {len(r.mutants)} | {r.count('killed')} | {r.count('survived')} | "
                   f"{r.count('timeout')} | {r.count('error')} | {r.count('not run')} | {score} | {r.seconds:.0f} s |")
    out.append(f"\nBudget {budget_min:g} min; sample: every {sample} mutant(s) of the Python targets.\n")
    for r in results:
        survivors = [m for m in r.mutants if m.outcome == "survived"]
        if survivors:
            out.append(f"\nSurvivors in `{r.target}` (tests: `{' '.join(r.tests)}`):\n")
            for m in survivors:
                changed = [ln for ln in m.diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
                out.append(f"- line {m.line}, {m.operator}: `{' / '.join(s.strip() for s in changed)[:160]}`")
    return "\n".join(out) + "\n"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-min", type=float, default=60.0, help="stop starting mutants after this")
    parser.add_argument("--only", nargs="*", help="targets to run, in this order: the Python paths in TARGETS, "
                        "analyses/_NAME.sql, or 'sql' for every analyses/_*.sql")
    parser.add_argument("--sample", type=int, default=1, help="run every K-th mutant of the Python targets")
    parser.add_argument("--sample-of", nargs="*", default=None,
                        help="the Python targets --sample applies to (default: all of them)")
    parser.add_argument("--test-timeout", type=float, default=300.0, help="seconds before a mutant counts as a timeout")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "mutation")
    args = parser.parse_args()
    deadline = time.monotonic() + args.budget_min * 60
    names = args.only or [*TARGETS, "sql"]
    work = scratch_copy()
    results: list[TargetResult] = []
    try:
        baseline = run_tests(work, [*SQL_TESTS], args.test_timeout)
        if baseline != "survived":
            print("the tests fail without any mutant: fix them first", file=sys.stderr)
            return 2
        for name in names:
            if name == "sql" or name.endswith(".sql"):
                files = sorted((work / "analyses").glob("_*.sql")) if name == "sql" else [work / name]
                for sql in files:
                    results.append(sql_target(work, str(sql.relative_to(work)), deadline, args.test_timeout))
                    print(markdown(results[-1:], args.budget_min, args.sample).splitlines()[2], flush=True)
            else:
                sample = args.sample if args.sample_of is None or name in args.sample_of else 1
                results.append(cosmic_ray_target(work, name, TARGETS[name], deadline, sample, args.test_timeout))
                print(markdown(results[-1:], args.budget_min, args.sample).splitlines()[2], flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps([asdict(r) for r in results], indent=1))
        (args.out / "results.md").write_text(markdown(results, args.budget_min, args.sample))
    print(f"wrote {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
