"""The mutation check: plant small bugs one at a time and see whether a fast, relevant subset of
the tests fails. Run it (scripts/mutation.sh) before calling a change to these files done.

Python targets go through cosmic-ray (8.x) with the operators that make realistic bugs (boundary and
negated comparisons, + and -, * and /, numbers off by one, not, and/or, True/False, loops that
never run, break/continue), and then through the operators of our own that make the bugs cosmic-ray
cannot (scripts/mutation_operators.py: an attribute, name or call result replaced by a constant, a
term of and/or dropped, a statement deleted, two arguments swapped, an index off by one).
analyses/_*.sql get mutants of our own: comparison operators flipped, min/max and sum/avg swapped,
AND/OR swapped, + and - swapped, one at a time. Every operator belongs to a family (FAMILIES), and
the results give the score of each family, so a new blind spot shows itself.

Everything runs in a scratch copy of the work tree (git's tracked and unignored files), so the
checkout is never touched. The run has a time budget: a target that does not finish is reported
with what was covered, and nothing starts past it (a Python target reached late keeps its last rows;
a SQL file's mutants are listed as not run). Results: a JSON file and a Markdown table (survivors listed with their diff; the score per
operator family), written again after each target. The files keep one row per target and operator set
(a Python target's cosmic-ray row and its own-operators row): a run (--only, --operators) replaces the
rows it ran and keeps the others' last results, each row with the date and commit of its run.
A row the budget stopped can be finished by later runs (--resume): each runs the mutants the last
left unrun, provided the target's text, sample and test selection are the same, and the row adds
them up, saying in how many parts it ran.

Each mutant's tests run in a child forked from this process, which has already imported the heavy
third-party modules (torch, duckdb, pyarrow, pytest, ...) but nothing of the project: the child
imports the (mutated) project fresh, so a mutant costs its tests, not 3 s of start-up. The child
reads the analyses from the scratch copy (the editable install would send `kvtrace.analyses` to the
installed checkout), is killed past a per-target limit (a multiple of the unmutated run's time:
mutants that loop forever count as timeouts), and runs with CI=true (Hypothesis derandomised) but
without CI's failure on skips (a test the machine cannot run, say without AVX-512, kills nothing).

A target's tests are the component folders under tests/ that exercise it (TARGETS, SQL_FOLDERS; a new
test file there needs no edit here), less the tests marked `long` and those that need a GPU, vLLM,
Chromium, outside tools or the real weights (SELECTION).

A Python target's tests run once unmutated under coverage, each test (and each fixture's set-up) in
its own context; a mutant then runs only the tests that execute its statement (and those that use a
fixture that does), in their usual order. A test that never runs the mutated statement behaves as it
did, so it cannot kill the mutant: the selection changes no outcome, only the time. A statement outside
any function (run at import) gets all the tests; a mutant that no test reaches survives without a run.

The vLLM capture's parts (kvtrace/vllm/capture/: the scheduler subclasses and what they call) run only
inside vLLM, in a vLLM venv (NEEDS_VLLM): their tests are tests/vllm's that need no vLLM, and there
tests/vllm/test_capture_on_vllm.py steps vLLM's own Scheduler and AsyncScheduler with the capture and
no model in a driver process (not marked `vllm` when given drivers to use). vLLM's import takes tens
of seconds, so the run starts one driver
per vLLM venv (KVTRACE_VLLM_PYTHON, KVTRACE_VLLM_SCHED_PYTHONS) for the whole target, serving on a
socket in a private folder (`vllm_driver.py --serve`, KVTRACE_CAPTURE_DRIVERS): each mutant's tests
open a session there, forked from the driver, that loads the scratch copy's capture package, the
mutated file among its modules, from the source files (no bytecode; the rest of kvtrace from the
scratch copy, through a link in that folder; no other vLLM run on the machine sees either). Their
mutants run all these tests (no coverage inside vLLM); without a vLLM venv
they run the source-reading test only, and a survivor there is untested rather than equivalent.

    python scripts/mutation.py [--budget-min 30] [--only NAME ...] [--sample K] [--sample-own K] [--out DIR]
"""
from __future__ import annotations

import argparse
import ast
import functools
import gc
import hashlib
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
import traceback
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import mutation_operators  # noqa: E402 - beside this script

ROOT = Path(__file__).resolve().parent.parent
PYTEST_ARGS = ["-x", "-q", "-p", "no:cacheprovider"]
PYTEST = [sys.executable, "-m", "pytest", *PYTEST_ARGS]
# third-party modules the forked children share (imported once, here); never the project's own
PRELOAD = ["torch", "numpy", "pyarrow", "pyarrow.parquet", "duckdb", "pytest", "hypothesis", "rich",
           "typer", "typer.testing", "altair", "safetensors", "cosmic_ray.mutating", "_pytest.pytester",
           "_hypothesis_pytestplugin", "pytest_benchmark.plugin", "anyio.pytest_plugin"]

# Each target's tests are the component folders (tests/<component>/) whose tests exercise it, so a new
# test file in such a folder is picked up with no edit here. Tests marked `long` (minutes of property
# runs, seed sweeps, traces of a million events, whole recorded runs) stay out, and so do those that
# need what the mutation run does not set up (a GPU, vLLM, Chromium, outside tools, the real weights).
SELECTION = ["-m", "not long and not slow and not cuda and not vllm and not browser and not external"]
TARGETS: dict[str, list[str]] = {
    "kvtrace/record/replay.py": ["tests/workload", "tests/cli"],   # the replay and `kvtrace record`
    "kvtrace/workload/format.py": ["tests/workload"],
    "engine/scheduler.py": ["tests/engine"],
    "engine/sim/cohort.py": ["tests/engine"],
    "engine/sim/fast_path.py": ["tests/engine"],
    "engine/sim/leap.py": ["tests/engine", "tests/analysis"],
    "engine/block_manager.py": ["tests/engine"],
    "engine/llm_engine.py": ["tests/engine"],
}
# the vLLM capture's parts that run inside vLLM's scheduler (kvtrace/vllm/capture/; its sink and guard
# have tests of their own without vLLM): the capture's tests that need no vLLM, and
# test_capture_on_vllm.py's on vLLM drivers (vllm_drivers)
CAPTURE_TARGETS = [f"kvtrace/vllm/capture/{name}.py" for name in (
    "scheduler", "recorder", "wraps", "accounting", "pending", "columns", "self_check", "rows", "settings")]
TARGETS.update({target: ["tests/vllm"] for target in CAPTURE_TARGETS})
# targets that run only inside vLLM: their tests run in vLLM drivers started for the target
# (vllm_drivers), every mutant gets all of them, and without a vLLM venv a survivor is marked untested
NEEDS_VLLM = set(CAPTURE_TARGETS)
SQL_FOLDERS = ["tests/analysis"]                                 # every analyses/_*.sql


def tests_of(target: str) -> list[str]:
    """The pytest arguments for a target's tests: its folders and the marker selection."""
    folders = SQL_FOLDERS if target == "sql" or target.endswith(".sql") else TARGETS[target]
    return [*folders, *SELECTION]


EQUIVALENT = ROOT / "benchmarks" / "mutation" / "equivalent.json"

# each operator's family: cosmic-ray's, the SQL mutants' and our own (mutation_operators.FAMILIES)
FAMILIES = [  # (operator name pattern, family), the first match wins
    (r"ReplaceComparisonOperator_|(LtE_Lt|Lt_LtE|GtE_Gt|Gt_GtE|Eq_NotEq|NotEq_Eq)$", "comparison"),
    (r"ReplaceBinaryOperator_|(Add_Sub|Sub_Add)$", "arithmetic"),
    (r"NumberReplacer$", "number"),
    (r"AddNot$|ReplaceTrueWithFalse$|ReplaceFalseWithTrue$|ReplaceAndWithOr$|ReplaceOrWithAnd$|(And_Or|Or_And)$",
     "boolean"),
    (r"ZeroIterationForLoop$|ReplaceBreakWithContinue$|ReplaceContinueWithBreak$", "loop/flow"),
    (r"(min_max|max_min|sum_avg|avg_sum)$", "aggregate"),
    *((f"{prefix}(_|$)", name) for prefix, name in mutation_operators.FAMILIES.items()),
]


GENERATOR_FAMILIES = {"cosmic-ray": ("comparison", "arithmetic", "number", "boolean", "loop/flow"),
                      "sql": ("comparison", "arithmetic", "boolean", "aggregate"),
                      "own": tuple(mutation_operators.FAMILIES.values())}


def family(operator: str) -> str:
    return next((name for pattern, name in FAMILIES if re.match(pattern, operator)), "other")


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
    recheck: str = ""       # --recheck of a survivor: "killed by <test>" or "survives"
    note: str = ""          # "no test runs this line": a survivor whose statement no test executes


@dataclass
class TargetResult:
    target: str
    tests: list[str]
    mutants: list[Mutant] = field(default_factory=list)
    seconds: float = 0.0
    complete: bool = True
    interrupted: bool = False
    date: str = ""          # when this target's run began (UTC), and the commit it ran on
    commit: str = ""        # ("+changes": the work tree had uncommitted changes)
    sample: int = 1
    by_coverage: bool = False   # each mutant ran only the tests that execute its statement
    # outcome -> number of mutants, for a row read from summary.json, whose `mutants` lists only the
    # survivors and timeouts (empty: `mutants` lists every mutant)
    counts: dict[str, int] = field(default_factory=dict)
    family_counts: dict[str, dict[str, int]] = field(default_factory=dict)   # the same, per operator family
    sample_own: int = 1     # the sample of our own operators' mutants
    # which operators made the row's mutants: a Python target has a row for cosmic-ray's ("cosmic-ray") and
    # one for ours ("own"), each replaced by the next run of its operators; a SQL target's row: "sql"
    generator: str = "cosmic-ray"
    source_sha: str = ""    # the target's text when the run began (sha256, 16 hex digits): a resumed run needs the same
    parts: int = 1          # the runs this row adds up (--resume), the first of them begun at `first_date`
    first_date: str = ""

    @property
    def key(self) -> tuple[str, str]:
        return self.target, self.generator

    @property
    def label(self) -> str:
        return f"`{self.target}`" + (" (own operators)" if self.generator == "own" else "")

    def count(self, outcome: str) -> int:
        if self.counts:
            return self.counts.get(outcome, 0)
        return sum(m.outcome == outcome for m in self.mutants)

    @property
    def num_mutants(self) -> int:
        return sum(self.counts.values()) if self.counts else len(self.mutants)

    def families(self) -> dict[str, dict[str, int]]:
        """Operator family -> outcome -> number of mutants ({} for a row summarised before families)."""
        if self.counts:
            return self.family_counts
        out: dict[str, dict[str, int]] = {}
        for m in self.mutants:
            counts = out.setdefault(family(m.operator), dict.fromkeys(OUTCOMES, 0))
            counts[m.outcome] += 1
        return out


# ---------------------------------------------------------------- the scratch copy

def run_stamp() -> dict[str, str]:
    """The date (UTC) a target's run starts, and the commit of the checkout the scratch copy was made from."""
    return {"date": time.strftime("%Y-%m-%d %H:%M", time.gmtime()), "commit": _copied_commit()}


@functools.cache
def _copied_commit() -> str:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    commit = git("rev-parse", "--short", "HEAD") or "?"
    if git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/mutation"):
        commit += "+changes"
    return commit


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


KILLERS_FIRST = 3      # a mutant's first run: at most this many of the latest killers among its tests
KILLERS_KEPT = 40


def _node_ids(tests: list[str]) -> bool:
    """Whether a selection is a list of test node ids (by coverage), not folders and a marker expression."""
    return all("::" in t for t in tests)


def _selects(tests: list[str], test: str) -> bool:
    """Whether the selection `tests` (node ids, or folders and options) includes the node id `test`."""
    if _node_ids(tests):
        return test in tests
    return "::" in test and any(test.startswith(t.rstrip("/") + "/") for t in tests if not t.startswith("-"))


class ForkRunner:
    """Runs a pytest selection in a child forked from a process that preloaded the heavy modules."""

    def __init__(self, work: Path, log: Path):
        self.work, self.log = work, log
        self.killers: list[str] = []                   # tests that killed recent mutants, latest first
        for name in PRELOAD:
            try:
                __import__(name)
            except ImportError:
                pass
        gc.freeze()  # the children's collections (pytest runs several at exit) skip the preloaded heap
        assert not any(m.split(".")[0] in ("engine", "kvtrace", "tests") for m in sys.modules), \
            "the runner must not import the project: the children import the mutated copy"

    def run(self, tests: list[str], timeout: float, fresh: str | None = None,
            coverage_of: tuple[list[str], Path] | None = None) -> str:
        """'killed' if the tests fail, 'survived' if they pass, 'timeout' past the limit. `fresh`: a
        module path whose cached bytecode is dropped first (the mutated file), and no bytecode is
        written by the child (a mutant and the original can share size and mtime second).
        `coverage_of` (targets, path): measure which tests run which of the targets' lines, into path
        (see measure_coverage)."""
        if fresh:
            for pyc in (self.work / fresh).parent.glob(f"__pycache__/{Path(fresh).stem}.*.pyc"):
                pyc.unlink()
        pid = os.fork()
        if pid == 0:                                   # the child: never returns
            code = 3
            try:
                os.setsid()
                fd = os.open(self.log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                os.chdir(self.work)
                sys.path.insert(0, str(self.work))
                sys.meta_path[:] = [f for f in sys.meta_path if "editable" not in getattr(f, "__module__", "")]
                sys.dont_write_bytecode = fresh is not None
                os.environ["CI"] = "true"
                os.environ["KVTRACE_STRICT_SKIPS"] = "0"    # a test this machine cannot run is not a kill
                import pytest
                if coverage_of:
                    code = measure_coverage(tests, {t: self.work / t for t in coverage_of[0]}, coverage_of[1])
                else:
                    code = int(pytest.main([*PYTEST_ARGS, *tests]))
            except BaseException:                      # noqa: BLE001 - report and exit, whatever it was
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        end = time.monotonic() + timeout
        try:
            while True:
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    pid = 0
                    return "survived" if os.waitstatus_to_exitcode(status) == 0 else "killed"
                if time.monotonic() > end:
                    return "timeout"
                time.sleep(0.05)
        finally:
            if pid:                                    # past the limit, or this run was stopped
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                os.waitpid(pid, 0)

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def run_mutant(self, tests: list[str], timeout: float, fresh: str | None = None) -> str:
        """run() for a planted mutant, killers first: the tests that failed on the last mutants (and are
        among `tests`) run alone before the rest. Most mutants of a file die on one of a few tests, and a
        child that collects one test module starts seconds sooner than one that collects twenty; the
        outcome is the same, as every test of `tests` still runs unless one has failed. A first run
        counts as a kill only if pytest names a failed test (a node id it could not find is no kill)."""
        began = time.monotonic()
        first = [t for t in self.killers if _selects(tests, t)][:KILLERS_FIRST]
        if first:
            outcome = self.run(first, timeout, fresh)
            if outcome == "timeout" or (outcome == "killed" and self._note_killer()):
                return outcome
        rest = [t for t in tests if t not in first] if _node_ids(tests) else tests
        outcome = self.run(rest, max(1.0, timeout - (time.monotonic() - began)), fresh)
        if outcome == "killed":
            self._note_killer()
        return outcome

    def _note_killer(self) -> bool:
        """Move the test the last child reports failed to the front of `killers`; False: none named."""
        failed = re.findall(r"^(?:FAILED|ERROR) (\S+)", self.output(), re.MULTILINE)
        if not failed:
            return False
        killer = failed[0]
        self.killers[:] = [killer] + [t for t in self.killers if t != killer][:KILLERS_KEPT - 1]
        return True

    def check_reads_the_copy(self) -> None:
        """The children must read the analyses and the code from the scratch copy."""
        probe = self.work / "tests" / "_mutation_probe_test.py"
        probe.write_text(
            "from pathlib import Path\n"
            "def test_probe():\n"
            "    import engine.scheduler, kvtrace.trace.db, kvtrace.record.replay\n"
            f"    here = Path({str(self.work)!r}).resolve()\n"
            "    for path in (engine.scheduler.__file__, kvtrace.record.replay.__file__, str(kvtrace.trace.db.analyses_dir())):\n"
            "        assert Path(path).resolve().is_relative_to(here), path\n")
        try:
            outcome = self.run([str(probe.relative_to(self.work))], 120)
        finally:
            probe.unlink()
        if outcome != "survived":
            raise SystemExit(f"the tests would not read the scratch copy:\n{self.output()}")


# ---------------------------------------------------------------- vLLM drivers (NEEDS_VLLM)

def vllm_pythons() -> list[str]:
    """The vLLM venvs' Pythons the tests would use (tests/vllm_sched/test_sched_differential.py's PYTHONS)."""
    return [p for p in [os.environ.get("KVTRACE_VLLM_PYTHON", ""),
                        *os.environ.get("KVTRACE_VLLM_SCHED_PYTHONS", "").split(os.pathsep)] if p]


class VllmDrivers:
    """tests/vllm_sched/vllm_driver.py --serve in each vLLM Python, for one NEEDS_VLLM target: each
    imports vLLM once, then forks a session per connection that loads the capture file the session
    names (the scratch copy's, mutated). Their sockets and the link to the scratch copy's kvtrace (their
    PYTHONPATH) lie in a folder of this run's own (mode 0700), so nothing else reaches them.
    `start` puts the sockets in KVTRACE_CAPTURE_DRIVERS, which the forked test children inherit."""

    def __init__(self, work: Path, pythons: list[str], workloads: int) -> None:
        self.work, self.pythons, self.workloads = work, pythons, workloads
        self.procs: list[subprocess.Popen] = []
        self.folder = Path(tempfile.mkdtemp(prefix="kvtrace-mutation-drivers-"))
        self.saved = {k: os.environ.get(k) for k in ("KVTRACE_CAPTURE_DRIVERS", "KVTRACE_CAPTURE_WORKLOADS",
                                                      "KVTRACE_VLLM_PYTHON")}

    def start(self) -> None:
        (self.folder / "path").mkdir()
        (self.folder / "path" / "kvtrace").symlink_to(self.work / "kvtrace")
        # the model folder's config only (no weights are read): found as the tests find it, in a child
        # (this process imports nothing of the project)
        found = subprocess.run([sys.executable, "-c", "from kvtrace.vllm.record import model_folder; "
                                "print(model_folder('smollm2-135m'))"], cwd=self.work, capture_output=True,
                               text=True, env={**os.environ, "PYTHONPATH": str(self.work)})
        if found.returncode:
            raise SystemExit(f"the vLLM drivers' model folder: {found.stderr[-2000:]}")
        model = found.stdout.strip()
        sockets = []
        for i, python in enumerate(self.pythons):
            sock = self.folder / f"driver{i}.sock"
            env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
            env["PYTHONPATH"] = str(self.folder / "path")
            self.procs.append(subprocess.Popen(
                [python, str(self.work / "tests" / "vllm_sched" / "vllm_driver.py"), model, "--serve", str(sock)],
                stdout=subprocess.PIPE, stderr=open(self.folder / f"driver{i}.log", "w"), text=True, env=env,
                start_new_session=True))
            sockets.append(str(sock))
        for proc, python in zip(self.procs, self.pythons):   # they import vLLM side by side
            ready = proc.stdout.readline()
            if not ready:
                raise SystemExit(f"{python} vllm_driver.py --serve exited (rc {proc.wait()}):\n"
                                 + (self.folder / f"driver{self.procs.index(proc)}.log").read_text()[-3000:])
            print(f"  vLLM driver: {python} ({json.loads(ready)['vllm_version']})", flush=True)
        os.environ["KVTRACE_CAPTURE_DRIVERS"] = os.pathsep.join(sockets)
        os.environ["KVTRACE_CAPTURE_WORKLOADS"] = str(self.workloads)
        os.environ["KVTRACE_VLLM_PYTHON"] = self.pythons[0]   # the `vllm` mark's skip looks at it

    def stop(self) -> None:
        for proc in self.procs:   # each driver and the session it may have forked (a session of their own)
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
        for k, v in self.saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(self.folder, ignore_errors=True)


# ---------------------------------------------------------------- which tests run which lines

def measure_coverage(tests: list[str], sources: dict[str, Path], out: Path) -> int:
    """Run the tests (in the forked child) with coverage of the `sources` only (targets that share
    these tests: one run for all), each test in a context of its own ("t:" node id) and each
    fixture's set-up in one named for the fixture ("f:" name: a module fixture's work belongs to
    every test that uses it, not only to the first). Writes, for each source's name, {"tests": node
    ids in the order they ran, "fixtures": {node id: fixture names}, "lines": {line: contexts}}; lines
    run outside any test (at import or collection) have the context ""."""
    import coverage
    import pytest

    tests_run: list[str] = []
    fixtures: dict[str, list[str]] = {}

    class Contexts:
        @pytest.hookimpl(hookwrapper=True)
        def pytest_runtest_protocol(self, item, nextitem):
            tests_run.append(item.nodeid)
            fixtures[item.nodeid] = list(item.fixturenames)
            cov.switch_context("t:" + item.nodeid)
            yield
            cov.switch_context("")

        @pytest.hookimpl(hookwrapper=True)
        def pytest_fixture_setup(self, fixturedef, request):
            outer = getattr(request, "node", None)
            cov.switch_context("f:" + fixturedef.argname)
            yield
            cov.switch_context("t:" + outer.nodeid if isinstance(outer, pytest.Item) else "")

    cov = coverage.Coverage(data_file=None, include=[str(p) for p in sources.values()], branch=False)
    cov.start()
    try:
        code = int(pytest.main([*PYTEST_ARGS, *tests], plugins=[Contexts()]))
    finally:
        cov.stop()
    data = cov.get_data()
    found: dict[str, dict] = {}
    for name, source in sources.items():
        lines: dict[int, set[str]] = {}
        for measured in data.measured_files():
            if Path(measured).resolve() == source.resolve():
                for line, contexts in data.contexts_by_lineno(measured).items():
                    lines.setdefault(line, set()).update(contexts)
        found[name] = {"tests": tests_run, "fixtures": fixtures, "lines": {str(k): sorted(v) for k, v in lines.items()}}
    out.write_text(json.dumps(found))
    return code


def statement_span(source: str, line: int) -> tuple[int, int] | None:
    """The lines of the innermost statement holding `line`, if it lies in a function's body (it runs
    only when the function is called); None for a statement run at import (module or class level,
    a decorator), which changes what every test sees."""
    best: tuple[int, int] | None = None

    def visit(node: ast.AST, in_function: bool) -> None:
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.stmt) and child.lineno <= line <= (child.end_lineno or child.lineno):
                is_function = isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef))
                # a def's own line (its defaults) counts as its body: they matter only to its callers
                # (its decorators lie before that line: they stay with the enclosing statement)
                best = (child.lineno, child.end_lineno or child.lineno) if in_function or is_function else None
                visit(child, in_function or is_function)
                return
            if not isinstance(child, ast.stmt):
                visit(child, in_function)

    visit(ast.parse(source), False)
    return best


def tests_for(span: tuple[int, int] | None, covered: dict) -> list[str] | None:
    """The tests (node ids, in their run order) that execute a line of `span`, or use a fixture whose
    set-up does; None: every test (the statement runs at import, or outside any test)."""
    if span is None:
        return None
    contexts: set[str] = set()
    for line in range(span[0], span[1] + 1):
        contexts.update(covered["lines"].get(str(line), ()))
    if "" in contexts:
        return None
    fixtures = {c[2:] for c in contexts if c.startswith("f:")}
    return [t for t in covered["tests"]
            if "t:" + t in contexts or fixtures.intersection(covered["fixtures"].get(t, ()))]


# ---------------------------------------------------------------- Python targets (cosmic-ray)

def coverage_of(runner: ForkRunner, target: str, tests: list[str], targets: list[str], cache: dict) -> dict:
    """Which tests run which lines of the target: measured once for all the `targets` that share its
    tests (the first of them to ask pays for the run), kept in `cache`."""
    key = tuple(tests)
    if key not in cache:
        start = time.monotonic()
        sharing = [t for t in targets if t not in NEEDS_VLLM and tests_of(t) == tests]
        covered_path = runner.work / ".mutation-coverage.json"
        if runner.run(tests, 1800, coverage_of=(sharing, covered_path)) != "survived":
            raise SystemExit(f"{target}: the tests fail under coverage:\n{runner.output()}")
        cache[key] = json.loads(covered_path.read_text())
        for name, covered in cache[key].items():
            print(f"  {name}: {len(covered['tests'])} tests, {len(covered['lines'])} lines covered "
                  f"({time.monotonic() - start:.0f} s)", flush=True)
    return cache[key][target]


def python_target(runner: ForkRunner, target: str, tests: list[str], deadline: float, sample: int,
                  sample_own: int, test_timeout: float, covered: dict | None, skip_equivalent: bool = False,
                  operators: str = "all", previous: dict | None = None) -> list[TargetResult]:
    """A Python target's rows: cosmic-ray's mutants, then our own (own_target), as `operators` asks
    ("all", "cosmic-ray", "own"). With `covered` (coverage_of), each mutant gets only the tests that
    execute its statement (tests_for); without (a target in NEEDS_VLLM, or --all-tests), all its tests.
    `previous` (--resume): the last rows by key; one this run can resume (resumable) runs only the
    mutants it left unrun, and the row returned adds both up (resumed)."""
    rows = []
    source_sha = hashlib.sha256((runner.work / target).read_bytes()).hexdigest()[:16]
    for generator in ("cosmic-ray", "own"):
        if operators not in ("all", generator) or (rows and rows[-1].interrupted):
            continue
        result = TargetResult(target, tests, **run_stamp(), sample=sample if generator == "cosmic-ray" else sample_own,
                              by_coverage=covered is not None, sample_own=sample_own, generator=generator,
                              source_sha=source_sha)
        before = (previous or {}).get(result.key)
        skip = resumable(before, result)
        if skip:
            print(f"{target} ({generator}): resuming after the {skip} mutants its last run decided", flush=True)
        start = time.monotonic()
        run = cosmic_ray_target if generator == "cosmic-ray" else own_target
        run(runner, target, tests, deadline, result.sample, test_timeout, covered, result, skip_equivalent, skip=skip)
        if target in NEEDS_VLLM and not os.environ.get("KVTRACE_CAPTURE_DRIVERS"):
            for m in result.mutants:
                if m.outcome == "survived":
                    m.note = "untested: it runs only inside vLLM"
        result.complete = not any(m.outcome == "not run" for m in result.mutants)
        result.seconds = time.monotonic() - start
        rows.append(resumed(before, result) if skip else result)
    return rows


def resumable(before: TargetResult | None, result: TargetResult) -> int:
    """How many mutants (in run order) a new run can take as decided from `before`, the last row of the
    same target and operators: those it ran, if it stopped before the rest (the budget, Ctrl-C) and its
    target's text, sample and test selection were the same; else 0 (run them all)."""
    if (before is None or before.complete or not before.source_sha or before.source_sha != result.source_sha
            or before.sample != result.sample or before.by_coverage != result.by_coverage
            or before.tests != result.tests):
        return 0
    return before.num_mutants - before.count("not run")


def resumed(before: TargetResult, part: TargetResult) -> TargetResult:
    """The row of a target's run in parts: `before` (its first `skip` mutants decided) and `part` (the
    rest, run now), their counts added as summary.json keeps them: the survivors and timeouts listed,
    the rest counted."""
    counts = {outcome: before.count(outcome) + part.count(outcome) for outcome in OUTCOMES}
    counts["not run"] = part.count("not run")
    families: dict[str, dict[str, int]] = {}
    # the first part's outcomes but its "not run", which the second part ran; all of the second's
    for source, left in ((before.families(), "not run"), (part.families(), None)):
        for name, outcomes in source.items():
            merged_counts = families.setdefault(name, dict.fromkeys(OUTCOMES, 0))
            for outcome, n in outcomes.items():
                if outcome != left:
                    merged_counts[outcome] += n
    listed = [m for m in (*before.mutants, *part.mutants) if m.outcome in LISTED]
    return replace(part, mutants=listed, counts=counts, family_counts=families,
                               seconds=before.seconds + part.seconds, parts=before.parts + 1,
                               first_date=before.first_date or before.date)


SKIPPED_EQUIVALENT = "listed equivalent, not run (--skip-equivalent)"


def listed_equivalent(target: str, original: str, mutated: str) -> bool:
    """Whether the mutant (the target's text before and after) is listed in equivalent.json."""
    import difflib
    diff = list(difflib.unified_diff(original.splitlines(), mutated.splitlines(), lineterm="", n=0))
    hunks = [ln for ln in diff if ln.startswith("@@")]
    if len(hunks) != 1:
        return False
    line = int(re.match(r"@@ -(\d+)", hunks[0]).group(1))
    return equivalence(Mutant(target, line, "", "survived", "\n".join(diff)), load_equivalents()) is not None


def cosmic_ray_target(runner: ForkRunner, target: str, tests: list[str], deadline: float, sample: int,
                      test_timeout: float, covered: dict | None, result: TargetResult,
                      skip_equivalent: bool = False, skip: int = 0) -> None:
    """cosmic-ray makes and applies the mutants (init, operator filter, mutate_and_test); the tests
    of each run in a forked child (ForkRunner) instead of a fresh interpreter: with `covered`, only
    the tests that execute the mutated statement. The mutants are added to `result`, less the first
    `skip` in file order (decided by an earlier run: --resume)."""
    from cosmic_ray import mutating
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import TestOutcome

    work = runner.work
    source = (work / target).read_text()
    chosen: list[str] | None = None                    # the current mutant's tests (None: all of them)
    decided: set[str] = set()                          # the job ids of the mutants an earlier run decided
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

    def run_tests(_command, timeout):
        if chosen == []:
            return TestOutcome.SURVIVED, "[no test runs this line]"
        if skip_equivalent and listed_equivalent(target, source, (work / target).read_text()):
            return TestOutcome.SURVIVED, "[listed equivalent]"
        outcome = runner.run_mutant(tests if chosen is None else chosen, timeout, fresh=target)
        return {"killed": TestOutcome.KILLED, "survived": TestOutcome.SURVIVED,
                "timeout": TestOutcome.KILLED}[outcome], f"[{outcome}]\n{runner.output()}"

    mutating.run_tests = run_tests
    here = os.getcwd()
    os.chdir(work)                                     # the mutations' module paths are relative to it
    try:
        with use_db(str(session)) as db:
            pending = sorted(db.pending_work_items, key=_site)
            decided = {item.job_id for item in pending[:skip]}
            for n, item in enumerate(pending[skip:], start=skip + 1):
                if time.monotonic() >= deadline:
                    break
                if covered is not None:
                    chosen = tests_for(statement_span(source, item.mutations[0].start_pos[0]), covered)
                try:
                    outcome = mutating.mutate_and_test(item.mutations, command, test_timeout)
                except (KeyboardInterrupt, SystemExit):     # stopped: keep what was covered
                    result.interrupted = True
                    break
                db.set_result(item.job_id, outcome)
                spec = item.mutations[0]
                state = "error" if outcome.worker_outcome != "normal" else (
                    "timeout" if (outcome.output or "").startswith("[timeout]") else outcome.test_outcome.value)
                ran = "all tests" if chosen is None else f"{len(chosen)} tests"
                print(f"  {target}:{spec.start_pos[0]} {spec.operator_name.removeprefix('core/')} "
                      f"[{n}/{len(pending)}] {state} ({ran})"
                      + (f"  {_changed(outcome.diff or '')}" if state == "survived" else ""), flush=True)
    finally:
        os.chdir(here)
        shutil.copy2(ROOT / target, work / target)  # never leave a mutant in place
    dump = subprocess.run(["cosmic-ray", "dump", str(session)], cwd=work, check=True, capture_output=True, text=True)
    for line in dump.stdout.splitlines():
        item, outcome = json.loads(line)
        mutation = item["mutations"][0]
        if item["job_id"] in decided:
            continue                                   # its outcome is the earlier run's
        if outcome is None:
            state = "not run"
        elif outcome["worker_outcome"] == "skipped":
            continue                                   # an operator outside the chosen set, or not sampled
        elif outcome["worker_outcome"] != "normal":
            state = "error"
        elif (outcome.get("output") or "").startswith("[timeout]"):
            state = "timeout"
        else:
            state = {"killed": "killed", "survived": "survived"}.get(outcome["test_outcome"], "error")
        diff = (outcome or {}).get("diff") or ""
        note = {"[no test runs this line]": "no test runs this line",
                "[listed equivalent]": SKIPPED_EQUIVALENT}.get((outcome or {}).get("output"), "")
        result.mutants.append(Mutant(target, mutation["start_pos"][0], mutation["operator_name"].removeprefix("core/"),
                                     state, diff, note=note))


def own_target(runner: ForkRunner, target: str, tests: list[str], deadline: float, sample: int,
               test_timeout: float, covered: dict | None, result: TargetResult, skip_equivalent: bool = False,
               skip: int = 0) -> None:
    """Our own operators' mutants (mutation_operators), every `sample`-th in file order, each planted
    in the scratch copy and run like cosmic-ray's: the same tests by coverage, timeout and outcomes;
    the first `skip` left out (decided by an earlier run: --resume)."""
    path = runner.work / target
    original = path.read_text()
    chosen_mutants = mutation_operators.mutants(original)[::sample]
    try:
        for n, (line, operator, mutated, diff) in enumerate(chosen_mutants[skip:], start=skip + 1):
            if time.monotonic() >= deadline:
                result.mutants.append(Mutant(target, line, operator, "not run", diff))
                continue
            chosen = None if covered is None else tests_for(statement_span(original, line), covered)
            if chosen == []:
                result.mutants.append(Mutant(target, line, operator, "survived", diff, note="no test runs this line"))
                state = "survived"
            elif skip_equivalent and equivalence(Mutant(target, line, operator, "survived", diff),
                                                 load_equivalents()) is not None:
                result.mutants.append(Mutant(target, line, operator, "survived", diff, note=SKIPPED_EQUIVALENT))
                state = "survived"
            else:
                path.write_text(mutated)
                try:
                    state = runner.run_mutant(tests if chosen is None else chosen, test_timeout, fresh=target)
                except (KeyboardInterrupt, SystemExit):     # stopped: keep what was covered
                    result.interrupted = True
                    result.mutants.extend(Mutant(target, ln, op, "not run", d) for ln, op, _, d in chosen_mutants[n - 1:])
                    break
                result.mutants.append(Mutant(target, line, operator, state, diff))
            ran = "all tests" if chosen is None else f"{len(chosen)} tests"
            print(f"  {target}:{line} {operator} [{n}/{len(chosen_mutants)}] {state} ({ran})"
                  + (f"  {_changed(diff)}" if state == "survived" else ""), flush=True)
    finally:
        path.write_text(original)


def _changed(diff: str) -> str:
    changed = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    return " / ".join(s.strip() for s in changed)[:160]


def _site(item) -> tuple:
    """A mutant's place in the file (cosmic-ray's job ids are random): runs and samples in file order."""
    spec = item.mutations[0]
    return tuple(spec.start_pos), spec.operator_name, spec.occurrence


def _keep_every(session: Path, k: int) -> None:
    """Mark all but every k-th pending mutant (in file order) as skipped: the same sample every run."""
    from cosmic_ray.work_db import use_db
    from cosmic_ray.work_item import WorkerOutcome, WorkResult

    with use_db(str(session)) as db:
        for i, item in enumerate(sorted(db.pending_work_items, key=_site)):
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


def sql_target(runner: ForkRunner, target: str, deadline: float, test_timeout: float) -> TargetResult:
    work = runner.work
    tests = tests_of(target)
    result = TargetResult(target, tests, **run_stamp(), generator="sql")
    start = time.monotonic()
    path = work / target
    original = path.read_text()
    try:
        for line, operator, mutated, diff in sql_mutants(original):
            if time.monotonic() >= deadline:
                result.mutants.append(Mutant(target, line, operator, "not run", diff))
                continue
            path.write_text(mutated)
            state = runner.run_mutant(tests, test_timeout)
            result.mutants.append(Mutant(target, line, operator, state, diff))
            print(f"  {target}:{line} {operator} {state}" + (f"  {_changed(diff)}" if state == "survived" else ""),
                  flush=True)
    finally:
        path.write_text(original)
    result.complete = not any(m.outcome == "not run" for m in result.mutants)
    result.seconds = time.monotonic() - start
    return result


# ---------------------------------------------------------------- report

def apply_diff(text: str, m: Mutant) -> str:
    """The file text with the mutant's changed lines in place (its '-' lines, from line m.line on)."""
    lines = [ln for ln in m.diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    before = [ln[1:] for ln in lines if ln[0] == "-"]
    after = [ln[1:] for ln in lines if ln[0] == "+"]
    source = text.splitlines(keepends=True)
    start = m.line - 1
    if [ln.rstrip("\n") for ln in source[start:start + len(before)]] != before:
        raise ValueError(f"{m.target}:{m.line}: the file no longer has the mutated lines")
    return "".join(source[:start] + [ln + "\n" for ln in after] + source[start + len(before):])


def changed_tests(commit: str, folders: list[str]) -> list[str]:
    """The test files under `folders` that changed since `commit` (committed or not): a survivor's
    likely killers are the tests written after the run that left it."""
    done = subprocess.run(["git", "diff", "--name-only", commit, "--", *folders], cwd=ROOT, capture_output=True,
                          text=True)
    new = subprocess.run(["git", "ls-files", "--others", "--exclude-standard", "--", *folders], cwd=ROOT,
                         capture_output=True, text=True)
    names = (done.stdout + new.stdout).split() if done.returncode == 0 else []
    return sorted({n for n in names if Path(n).name.startswith("test_") and n.endswith(".py") and (ROOT / n).exists()})


def mutant_limit(unmutated_s: float) -> float:
    """A mutant's time limit: six times the tests' unmutated time, at least 30 s."""
    return max(30.0, 6 * unmutated_s)


def recheck(runner: ForkRunner, results: list[TargetResult], equivalents: list[dict], timeout: float | None,
            resume: bool = False) -> None:
    """Plant each survivor (and timeout) of a previous run again and run its target's tests as they
    are now: first the test files changed since that run (changed_tests), then, if none fails, all of
    them. Without a `timeout`, a mutant's limit is six times the tests' unmutated time, measured
    first (as a run's is), so that a loaded machine does not turn slow runs into kills. Survivors go
    before timeouts (a timeout already counts as detected). `resume`: leave out the mutants an earlier,
    stopped recheck found killed (what it decided is written even when it is stopped)."""
    def pending(m: Mutant) -> bool:
        return (m.outcome in ("survived", "timeout") and equivalence(m, equivalents) is None
                and not (resume and m.recheck.startswith("killed")))

    for r in results:
        tests = tests_of(r.target)
        first = changed_tests(r.commit.split("+")[0], [t for t in tests if not t.startswith("-")])
        path = runner.work / r.target
        original = path.read_text()
        fresh = None if r.target.endswith(".sql") else r.target
        limit = timeout
        if limit is None and any(map(pending, r.mutants)):
            began = time.monotonic()
            if runner.run(tests, 900, fresh=fresh) != "survived":
                print(f"{r.target}: the tests fail without any mutant: not rechecked\n{runner.output()}",
                      file=sys.stderr, flush=True)
                continue
            seconds = time.monotonic() - began
            limit = mutant_limit(seconds)
            print(f"{r.target}: unmutated tests {seconds:.1f} s; a mutant's limit {limit:.0f} s", flush=True)
        try:
            # a timeout is planted again too (after the survivors): on a loaded machine it may be a slow run, not a loop
            for m in sorted(filter(pending, r.mutants), key=lambda m: m.outcome == "timeout"):
                try:
                    path.write_text(apply_diff(original, m))
                except ValueError:                     # the line was edited since: rerun the target instead
                    m.recheck = "not replanted (its line changed)"
                    print(f"  {r.target}:{m.line} {m.operator}: {m.recheck}", flush=True)
                    continue
                state = "survived"
                if first:   # the test files changed since the run: the likely killers, alone first
                    state = runner.run([*first, *SELECTION], limit, fresh=fresh)
                if state == "survived":
                    state = runner.run(tests, limit, fresh=fresh)
                failed = re.findall(r"^FAILED (\S+)", runner.output(), re.MULTILINE)
                m.recheck = (f"killed by {failed[0].split(' ')[0]}" if state == "killed" and failed
                             else "killed (timeout)" if state == "timeout" else
                             "killed" if state == "killed" else "survives")
                print(f"  {r.target}:{m.line} {m.operator}: {m.recheck}", flush=True)
        finally:
            path.write_text(original)


def load_equivalents(path: Path = EQUIVALENT) -> list[dict]:
    """Survivors judged equivalent (the same behaviour, or unreachable), each with its reason: a list of
    {target, before, after, reason[, line]}, before/after the changed line without its indentation (line:
    its number, or numbers, where the same text occurs elsewhere in the file)."""
    for attempt in range(50):   # an editor may be saving it while a run reads it (survivors answered as they come)
        try:
            return json.loads(path.read_text()) if path.exists() else []
        except json.JSONDecodeError:
            if attempt == 49:
                raise
            time.sleep(0.1)


def _changed_lines(diff: str) -> tuple[str, str]:
    lines = [ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---")]
    before = " ".join(ln[1:].strip() for ln in lines if ln[0] == "-")
    after = " ".join(ln[1:].strip() for ln in lines if ln[0] == "+")
    return before, after


def equivalence(m: Mutant, equivalents: list[dict]) -> str | None:
    before, after = _changed_lines(m.diff)
    # "line" (optional): for a line whose text occurs more than once in the file; a list where the line
    # has moved since a run that is still reported (its number there, and now)
    for e in equivalents:
        line = e.get("line", m.line)
        if (e["target"], e["before"], e["after"]) == (m.target, before, after) and m.line in (
                line if isinstance(line, list) else [line]):
            return e["reason"]
    return None


def is_open(m: Mutant, equivalents: list[dict]) -> bool:
    """A survivor, or a timeout that a recheck found surviving, neither listed equivalent nor killed when
    rechecked: left to answer."""
    if m.outcome == "survived" or (m.outcome == "timeout" and m.recheck == "survives"):
        return equivalence(m, equivalents) is None and not m.recheck.startswith("killed")
    return False


def markdown(results: list[TargetResult], equivalents: list[dict] | None = None) -> str:
    equivalents = load_equivalents() if equivalents is None else equivalents
    out = ["| target | mutants | killed | survived | equivalent | timeout | error | not run | score | open | time | run |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        equivalent = sum(m.outcome == "survived" and equivalence(m, equivalents) is not None for m in r.mutants)
        ran = r.count("killed") + r.count("survived") + r.count("timeout") - equivalent
        score = f"{(r.count('killed') + r.count('timeout')) / ran:.0%}" if ran else "-"
        out.append(f"| {r.label} | {r.num_mutants} | {r.count('killed')} | {r.count('survived') - equivalent} | "
                   f"{equivalent} | {r.count('timeout')} | {r.count('error')} | {r.count('not run')} | {score} | "
                   f"{sum(is_open(m, equivalents) for m in r.mutants)} | "
                   f"{r.seconds:.0f} s | {r.date or '?'} `{r.commit or '?'}`"
                   + (f", in {r.parts} parts since {r.first_date}" if r.parts > 1 else "")
                   + (f", every {r.sample}th mutant" if r.sample > 1 else "")
                   + (", tests by coverage" if r.by_coverage else "") + " |")
    out.append("\nEach row is its target's last run (run: its date, UTC, and commit; `+changes`: with uncommitted "
               "changes; tests by coverage: each mutant ran the tests that execute its statement). Score: (killed + "
               "timeout) / (mutants run - equivalent), as the run found them. Open: its survivors (and timeouts a "
               "recheck found surviving) neither listed equivalent nor killed by the tests when rechecked (`--recheck`, "
               "the survivors' lines below): what is left to answer. Equivalent survivors: "
               f"{EQUIVALENT.relative_to(ROOT)}.\n")
    out.extend(family_table(results, equivalents))
    for r in results:
        survivors = [m for m in r.mutants if m.outcome == "survived"]
        if survivors:
            out.append(f"\nSurvivors in {r.label} (tests: `{' '.join(r.tests)}`):\n")
            for m in survivors:
                reason = equivalence(m, equivalents)
                out.append(f"- line {m.line}, {m.operator}: `{_changed(m.diff)}`"
                           + (f" — {m.note}" if m.note else "")
                           + (f" — equivalent: {reason}" if reason else "")
                           + (f" — now {m.recheck}" if m.recheck and not reason else ""))
    return "\n".join(out) + "\n"


def family_table(results: list[TargetResult], equivalents: list[dict]) -> list[str]:
    """The score per operator family, over all targets and per target: `score of N` (N: the mutants
    run, less the equivalent ones); a row summarised before families were counted shows `?` (and the
    total over all targets `+ ?`)."""
    names = list(dict.fromkeys(name for _, name in FAMILIES))
    cells: dict[str, dict[str, list[int]]] = {}          # target -> family -> [caught, run]
    unknown: set[tuple[str, str]] = set()                # (target, family) of a row summarised before families
    for r in results:
        families = r.families()
        if not families:
            unknown |= {(r.target, name) for name in GENERATOR_FAMILIES.get(r.generator, ())}
            continue
        row = cells.setdefault(r.target, {})
        for name, counts in families.items():
            equivalent = sum(m.outcome == "survived" and family(m.operator) == name
                             and equivalence(m, equivalents) is not None for m in r.mutants)
            caught = counts.get("killed", 0) + counts.get("timeout", 0)
            before = row.get(name, [0, 0])
            row[name] = [before[0] + caught, before[1] + caught + counts.get("survived", 0) - equivalent]
    total = {name: [sum(row.get(name, [0, 0])[i] for row in cells.values()) for i in (0, 1)] for name in names}

    def cell(value: list[int] | None) -> str:
        return f"{value[0] / value[1]:.0%} of {value[1]}" if value and value[1] else "-"
    out = ["\nScore per operator family ((killed + timeout) / (mutants run - equivalent), of how many): "
           "cosmic-ray's comparison, arithmetic, number, boolean and loop/flow, the SQL mutants' aggregate, and "
           "our own (scripts/mutation_operators.py).\n",
           "| target | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names),
           "| all targets | " + " | ".join(cell(total[name]) + (" + ?" if any(f == name for _, f in unknown) else "")
                                           for name in names) + " |"]
    for target in dict.fromkeys(r.target for r in results):
        row = cells.get(target)
        out.append(f"| `{target}` | " + " | ".join("?" if (target, name) in unknown else cell((row or {}).get(name))
                                                  for name in names) + " |")
    return out


OUTCOMES = ("killed", "survived", "timeout", "error", "not run")
LISTED = ("survived", "timeout")   # the mutants summary.json lists one by one (--report-only, --recheck); the rest are counted


def _row(r: dict) -> TargetResult:
    return TargetResult(r["target"], r["tests"], [Mutant(**m) for m in r["mutants"]], r["seconds"], r["complete"],
                        r.get("interrupted", False), r.get("date", ""), r.get("commit", ""), r.get("sample", 1),
                        r.get("by_coverage", False), r.get("counts") or {}, r.get("family_counts") or {},
                        r.get("sample_own", r.get("sample", 1)),
                        r.get("generator") or ("sql" if r["target"].endswith(".sql") else "cosmic-ray"),
                        r.get("source_sha", ""), r.get("parts", 1), r.get("first_date", ""))


def load(out: Path) -> list[TargetResult]:
    """Every target's last result: the rows of summary.json (committed), each with its full detail from
    results.json (generated, not committed) where that file holds the same run of the target."""
    detail_path, summary_path = out / "results.json", out / "summary.json"
    detail = [_row(r) for r in json.loads(detail_path.read_text())] if detail_path.exists() else []
    if not summary_path.exists():
        return detail
    same_run = {(r.key, r.date, r.commit): r for r in detail}
    return [same_run.get((r.key, r.date, r.commit), r) for r in map(_row, json.loads(summary_path.read_text()))]


def summarised(r: TargetResult) -> dict:
    """A row of summary.json: the counts of each outcome, and the survivors and timeouts themselves
    (their diffs cut to the changed lines)."""
    row = asdict(r)
    row["counts"] = {outcome: r.count(outcome) for outcome in OUTCOMES}
    row["family_counts"] = r.families()
    row["mutants"] = [{**asdict(m), "diff": _diff_lines(m.diff)} for m in r.mutants if m.outcome in LISTED]
    return row


def _diff_lines(diff: str) -> str:
    """A diff's changed lines only (what equivalence, apply_diff and the table read), without its context."""
    return "\n".join(ln for ln in diff.splitlines() if ln[:1] in "+-" and ln[:3] not in ("+++", "---"))


def merged(previous: list[TargetResult], results: list[TargetResult]) -> list[TargetResult]:
    """The previous rows with those of the targets (and operators) in `results` replaced (in place; new
    ones last)."""
    fresh = {r.key: r for r in results}
    kept = [fresh.pop(r.key, r) for r in previous]
    return kept + [r for r in results if r.key in fresh]


def write(out: Path, results: list[TargetResult]) -> None:
    """Write summary.json, results.md and results.json: these targets' rows replace their previous
    ones, the other targets' rows stay as their last run left them. summary.json (committed) and
    results.md (the table, committed) are small; results.json (every mutant with its diff, for the
    rows whose detail this checkout has) is not committed."""
    out.mkdir(parents=True, exist_ok=True)
    results = merged(load(out), results)
    (out / "summary.json").write_text(json.dumps([summarised(r) for r in results], indent=1) + "\n")
    (out / "results.json").write_text(json.dumps([asdict(r) for r in results if not r.counts], indent=1))
    (out / "results.md").write_text(markdown(results))


def sample_for(target: str, entries: list[str] | None, k: int, otherwise: int) -> int:
    """The sample of a target from --sample-of / --sample-own entries: TARGET=K for that target, a
    bare K for every target; a bare target name takes `k`; no entries: `k` for all; unnamed: `otherwise`."""
    if entries is None:
        return k
    for entry in entries:
        name, _, value = entry.rpartition("=")
        if name == target:
            return int(value)
        if not name and value.isdigit():
            otherwise = int(value)
        elif not name and value == target:
            return k
    return otherwise


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--budget-min", type=float, default=60.0, help="stop starting mutants after this")
    parser.add_argument("--only", nargs="*", help="targets to run, in this order: the Python paths in TARGETS, "
                        "analyses/_NAME.sql, or 'sql' for every analyses/_*.sql")
    parser.add_argument("--sample", type=int, default=1, help="run every K-th mutant of the Python targets")
    parser.add_argument("--sample-of", nargs="*", default=None,
                        help="the Python targets --sample applies to (default: all of them); TARGET=K: that "
                             "target's own K")
    parser.add_argument("--sample-own", nargs="*", default=None,
                        help="run every K-th mutant of our own operators (K, or TARGET=K for one target; "
                             "default: the target's --sample)")
    parser.add_argument("--test-timeout", type=float, default=None,
                        help="seconds before a mutant counts as a timeout (default: 6x the unmutated run, at least "
                             "30; given, a target measured by coverage skips the unmutated run)")
    parser.add_argument("--operators", choices=("all", "cosmic-ray", "own"), default="all",
                        help="the Python targets' operators to run: each has its own row, which a run of them replaces")
    parser.add_argument("--skip-equivalent", action="store_true",
                        help="do not run the mutants listed in equivalent.json (they survive, noted as not run): "
                             "a listed one runs all its tests, minutes each on a loaded machine")
    parser.add_argument("--coverage-from", type=Path, default=None,
                        help="a .mutation-coverage.json kept from an earlier run of the same code and tests: "
                             "its targets skip the coverage run")
    parser.add_argument("--all-tests", action="store_true",
                        help="run every mutant against all its target's tests, not only those that execute it")
    parser.add_argument("--capture-workloads", type=int, default=8,
                        help="the vLLM capture's generated workloads per scheduler class and vLLM venv, per mutant "
                             "(KVTRACE_CAPTURE_WORKLOADS)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "mutation")
    parser.add_argument("--recheck", action="store_true",
                        help="plant each survivor and timeout in summary.json (not listed as equivalent) again, run its "
                             "target's tests as they are now (the test files changed since its run first), and "
                             "record which test kills it")
    parser.add_argument("--resume", action="store_true",
                        help="a target whose last row the budget stopped, on the same text, sample and tests: run "
                             "only the mutants it left unrun and add them to that row; with --recheck: leave out "
                             "the mutants a stopped recheck found killed")
    parser.add_argument("--report-only", action="store_true",
                        help="rewrite results.md from summary.json (after editing equivalent.json); run nothing")
    args = parser.parse_args()
    if args.report_only or args.recheck:
        results = load(args.out)
        chosen = results
        if args.recheck:
            chosen = [r for r in results if not args.only or r.target in args.only]
            signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # stopped: what it decided is written
            work = scratch_copy()
            drivers = None
            try:
                runner = ForkRunner(work, work / ".mutation-test.log")
                runner.check_reads_the_copy()
                if any(r.target in NEEDS_VLLM for r in chosen) and vllm_pythons():
                    drivers = VllmDrivers(work, vllm_pythons(), args.capture_workloads)
                    drivers.start()
                recheck(runner, chosen, load_equivalents(), args.test_timeout, resume=args.resume)
            finally:
                if drivers is not None:
                    drivers.stop()
                shutil.rmtree(work, ignore_errors=True)
                # only the rows rechecked: another target's row may have been rewritten by a run going on meanwhile
                write(args.out, chosen)
        else:
            write(args.out, chosen)
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))   # clean up (restore, write results) when stopped
    deadline = time.monotonic() + args.budget_min * 60
    names = args.only or [*TARGETS, "sql"]
    unmutated: dict[tuple, float] = {}                 # the tests' unmutated time, by test selection
    coverage_cache: dict[tuple, dict] = {}
    if args.coverage_from:                             # a coverage run kept from before (same code and tests)
        kept = json.loads(args.coverage_from.read_text())
        coverage_cache[tuple(tests_of(next(iter(kept))))] = kept
    previous = {r.key: r for r in load(args.out)} if args.resume else None
    _copied_commit()                                   # the commit the scratch copy is made from
    work = scratch_copy()
    runner = ForkRunner(work, work / ".mutation-test.log")
    results: list[TargetResult] = []
    started: list[VllmDrivers] = []
    try:
        runner.check_reads_the_copy()
        for name in names:
            tests = tests_of(name)
            past_budget = time.monotonic() >= deadline
            if past_budget and name in TARGETS:            # nothing more runs: its last rows stay as they are
                print(f"{name}: past the budget, not run (its last rows are kept)", flush=True)
                continue
            by_coverage = name in TARGETS and name not in NEEDS_VLLM and not args.all_tests
            drivers = None
            if name in NEEDS_VLLM and vllm_pythons() and not past_budget:
                drivers = VllmDrivers(work, vllm_pythons(), args.capture_workloads)
                started.append(drivers)
                drivers.start()
            # with --test-timeout, the coverage run is the check that the tests pass unmutated
            needed = not (args.test_timeout and by_coverage)
            if tuple(tests) not in unmutated and not past_budget and needed:  # targets sharing tests share it
                began = time.monotonic()
                if runner.run(tests, 600) != "survived":
                    print(f"{name}: the tests fail without any mutant: fix them first\n{runner.output()}",
                          file=sys.stderr)
                    return 2
                unmutated[tuple(tests)] = time.monotonic() - began
            seconds = unmutated.get(tuple(tests), 0.0)
            timeout = args.test_timeout or mutant_limit(seconds)
            print(f"{name}: unmutated tests {seconds:.1f} s; a mutant's limit {timeout:.0f} s" if needed else
                  f"{name}: a mutant's limit {timeout:.0f} s (the tests pass unmutated: checked under coverage)"
                  + (" (past the budget: nothing runs)" if past_budget else ""), flush=True)
            if name == "sql" or name.endswith(".sql"):
                files = sorted((work / "analyses").glob("_*.sql")) if name == "sql" else [work / name]
                for sql in files:
                    results.append(sql_target(runner, str(sql.relative_to(work)), deadline, timeout))
                    print(markdown(results[-1:]).splitlines()[2], flush=True)
                    write(args.out, results)
            else:
                sample = sample_for(name, args.sample_of, args.sample, 1)
                sample_own = sample_for(name, args.sample_own, sample, sample)
                covered = None if not by_coverage or past_budget else coverage_of(
                    runner, name, tests, [n for n in names if n in TARGETS], coverage_cache)
                rows = python_target(runner, name, tests, deadline, sample, sample_own, timeout, covered,
                                     args.skip_equivalent, args.operators, previous)
                if drivers is not None:
                    started.remove(drivers)
                    drivers.stop()
                results.extend(rows)
                for line in markdown(rows).splitlines()[2:2 + len(rows)]:
                    print(line, flush=True)
                write(args.out, results)
                if results[-1].interrupted:
                    raise SystemExit(143)
    finally:
        for drivers in started:
            drivers.stop()
        shutil.rmtree(work, ignore_errors=True)
        write(args.out, results)
    print(f"wrote {args.out / 'results.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
