"""The wheel, as a new user gets it: built from the checkout, installed into a fresh virtual
environment away from the source tree, and the main job run there (record, analyze, sql, report on
the tiny model) with the working directory outside the checkout. Then the vLLM capture's import
exactly as `kvtrace vllm-env` arranges it, in an interpreter without kvtrace's dependencies.

The build runs on a copy of the files the build reads (pyproject.toml, setup.py, README.md,
kvtrace/, engine/, analyses/), so that a stale build/ folder of the checkout cannot put old files
in the wheel and the test writes nothing into the checkout. Torch and the other heavy dependencies
come from this Python (nothing is downloaded): the environment is created with
--system-site-packages, which gives it the base interpreter's site-packages, and when this Python
runs in a virtual environment of its own, that environment's site-packages is added after the new
one's (`see_running_packages`). The new environment's own site-packages comes first on sys.path, and
an editable install's finder (a meta-path hook for a developer's checkout) answers only for what the
path does not find. The test asserts where `kvtrace`, `engine` and the SQL library were imported from.
"""
from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BUILD_INPUTS = ("pyproject.toml", "setup.py", "README.md", "kvtrace", "engine", "analyses")
WORKLOAD = [{"id": str(i), "arrival_s": 0.0, "prompt_tokens": 6 + i, "max_tokens": 5, "ignore_eos": True}
            for i in range(3)]
CAPTURE = ("kvtrace.vllm.capture", "kvtrace.vllm.capture.sink", "kvtrace.vllm.capture.guard")


def expected_files() -> set[str]:
    """The wheel paths of every source file the installed kvtrace and engine need."""
    def files(pattern: str) -> list[Path]:
        return [p for p in ROOT.glob(pattern) if "__pycache__" not in p.parts]
    paths = {p.relative_to(ROOT).as_posix() for pattern in ("kvtrace/**/*.py", "engine/**/*.py",
                                                            "engine/kernels/csrc/*.c",
                                                            "engine/sim/profiles/*.json",
                                                            "kvtrace/vllm/dashboards/*.json")
             for p in files(pattern)}
    paths |= {f"kvtrace/analyses/{p.name}" for pattern in ("analyses/*.sql", "analyses/*.py") for p in files(pattern)}
    return paths


def see_running_packages(venv: Path) -> None:
    """Let `venv` (made by this Python with --system-site-packages, so it sees the base interpreter's
    site-packages) see the packages of the virtual environment this Python runs in, if it runs in one:
    its site-packages added by a .pth file after the venv's own, as `site` adds a site directory (its
    own .pth files processed too)."""
    if sys.prefix == sys.base_prefix:   # not in a virtual environment: the system site is this Python's
        return
    running = sysconfig.get_paths()
    ours = Path(sysconfig.get_paths(vars={"base": str(venv), "platbase": str(venv)})["purelib"])
    lines = [f"import site; site.addsitedir({path!r})"
             for path in dict.fromkeys([running["purelib"], running["platlib"]])]
    (ours / "zz-running-python.pth").write_text("\n".join(lines) + "\n")


class Installed:
    def __init__(self, root: Path, wheel: Path, build_log: str) -> None:
        self.venv = root / "venv"
        self.python = self.venv / "bin" / "python"
        self.work = root / "work"             # the user's working directory: outside the checkout
        self.tmp = root / "tmp"               # TMPDIR: this environment's own
        self.wheel, self.build_log = wheel, build_log
        self.work.mkdir()
        self.tmp.mkdir()
        path = [str(self.venv / "bin")] + [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON") and k != "VIRTUAL_ENV"}
        self.env.update(PATH=os.pathsep.join(path), TMPDIR=str(self.tmp), VIRTUAL_ENV=str(self.venv),
                        NO_COLOR="1", COLUMNS="120")

    def run(self, *args: str | Path, env: dict | None = None) -> subprocess.CompletedProcess:
        result = subprocess.run([str(a) for a in args], cwd=self.work, env=env or self.env, capture_output=True,
                                text=True, timeout=300)
        assert result.returncode == 0, f"{args}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
        return result

    def kvtrace(self, *args: str | Path) -> subprocess.CompletedProcess:
        return self.run(self.venv / "bin" / "kvtrace", *args)

    def capture_path(self) -> tuple[str, str]:
        """(PYTHONPATH entry, scheduler class) from `kvtrace vllm-env`'s lines."""
        out = self.kvtrace("vllm-env", "--capture-dir", self.work / "capture").stdout
        (path,) = re.findall(r'^export PYTHONPATH="([^"$]+)\$\{PYTHONPATH:\+:\$PYTHONPATH\}"$', out, re.MULTILINE)
        (cls,) = re.findall(r'^export KVTRACE_SCHEDULER_CLS="([\w.]+)"$', out, re.MULTILINE)
        return path, cls


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Installed:
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"
    for name in BUILD_INPUTS:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            source.mkdir(exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    dist = root / "dist"
    # -v: pip shows the backend's output, where setuptools prints its warnings
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "-w", str(dist), str(source)],
                           capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stdout + build.stderr
    (wheel,) = dist.glob("kvtrace-*.whl")
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root / "venv")],
                   check=True, timeout=120)
    see_running_packages(root / "venv")
    installed = Installed(root, wheel, build.stdout + build.stderr)
    # the venv has no pip of its own: this Python's installs into the venv; --ignore-installed, since
    # an editable kvtrace of the system site (or of this Python's venv) has the same version
    installed.run(installed.python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index",
                  "--ignore-installed", wheel)
    return installed


def test_the_wheel_holds_every_source_file_and_builds_without_a_warning(installed):
    names = set(zipfile.ZipFile(installed.wheel).namelist())
    assert sorted(expected_files() - names) == []
    assert {name.split("/")[0] for name in names} == {"kvtrace", "engine", installed.wheel.name.split("-py")[0]
                                                      + ".dist-info"}
    warnings = [line for line in installed.build_log.splitlines()
                if re.search(r"Deprecat|_Warning|absent from the .packages.", line)]
    assert warnings == []


def test_the_environment_imports_the_installed_packages(installed):
    where = json.loads(installed.run(installed.python, "-c", (
        "import json, kvtrace, engine, kvtrace.cli\nfrom kvtrace.trace import db\n"
        "print(json.dumps({'kvtrace': kvtrace.__file__, 'engine': engine.__file__, 'cli': kvtrace.cli.__file__,"
        " 'analyses': str(db.analyses_dir())}))")).stdout)
    print(where)
    site = installed.venv.resolve()
    for name, file in where.items():
        assert Path(file).resolve().is_relative_to(site), (name, file)
        assert not Path(file).resolve().is_relative_to(ROOT), (name, file)
    assert (Path(where["analyses"]) / "summary.sql").is_file()


def test_the_main_job_runs_from_the_wheel(installed):
    workload = installed.work / "tiny.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in WORKLOAD))
    installed.kvtrace("record", "--model", "tiny", "--load-format", "dummy", "-w", workload, "-o", "runs/tiny", "-q",
                      "--block-size", "4", "--num-gpu-blocks", "64", "--backlog")
    figures = json.loads(installed.kvtrace("analyze", "runs/tiny", "--json").stdout)
    (run,) = figures["runs"]
    assert (run["summary"]["completed_requests"], run["summary"]["output_tokens"]) == (3, 15)
    screen = installed.kvtrace("analyze", "runs/tiny").stdout
    assert "tiny" in screen and "TTFT" in screen
    rows = json.loads(installed.kvtrace("sql", "runs/tiny", "select count(*) as n, sum(output_tokens)::int as tokens "
                                        "from requests", "--format", "json").stdout)
    assert rows == [{"n": 3, "tokens": 15}]
    installed.kvtrace("report", "runs/tiny", "-o", "x.html")
    html = (installed.work / "x.html").read_text()
    assert "vega" in html and len(html) > 10_000


def test_the_installed_kvtrace_prints_the_grafana_dashboard(installed):
    printed = installed.kvtrace("capture", "dashboard").stdout
    assert printed == (ROOT / "kvtrace" / "vllm" / "dashboards" / "kvtrace-capture.json").read_text()


def test_the_capture_imports_with_the_standard_library_only(installed):
    """vLLM's environment may have none of kvtrace's dependencies: the capture's package, its sink
    and its guard import with nothing but the standard library and the path vllm-env prints, and
    the scheduler module is missing only vLLM."""
    path, cls = installed.capture_path()
    assert cls == "kvtrace.vllm.capture.scheduler.KvtraceCaptureScheduler"   # one class for every server
    assert Path(path, "kvtrace").resolve().is_relative_to(installed.venv.resolve())
    script = f"""
import importlib, json, sys
missing = []
for heavy in ("torch", "duckdb", "pyarrow", "numpy", "rich", "typer"):
    try:
        importlib.import_module(heavy)
    except ModuleNotFoundError:
        missing.append(heavy)
files = {{name: importlib.import_module(name).__file__ for name in {CAPTURE!r}}}
try:
    importlib.import_module("{cls.rpartition('.')[0]}")
    scheduler = "imported"
except ModuleNotFoundError as exc:
    scheduler = exc.name
outside = [m.split(".")[0] for m in sys.modules if m.split(".")[0] not in sys.stdlib_module_names | {{"__main__"}}]
print(json.dumps({{"missing": missing, "files": files, "scheduler": scheduler, "outside": sorted(set(outside))}}))
"""
    env = {"PATH": installed.env["PATH"], "PYTHONPATH": path, "TMPDIR": installed.env["TMPDIR"]}
    # -S: no site-packages, hence no torch, DuckDB or pyarrow and no editable-install finder
    result = json.loads(installed.run(sys.executable, "-S", "-c", script, env=env).stdout)
    assert result["missing"] == ["torch", "duckdb", "pyarrow", "numpy", "rich", "typer"]
    for name, file in result["files"].items():
        assert Path(file).resolve().is_relative_to(installed.venv.resolve()), (name, file)
    assert result["scheduler"] == "vllm"
    assert result["outside"] == ["kvtrace"]


@pytest.mark.vllm
@pytest.mark.skipif(not os.environ.get("KVTRACE_VLLM_PYTHON"), reason=os.environ.get("KVTRACE_VLLM_UNAVAILABLE")
                    or "no vLLM environment: run scripts/vllm_env.sh and set KVTRACE_VLLM_PYTHON")
def test_vllms_python_imports_the_capture_scheduler_from_the_wheel(installed):
    """vLLM's own environment (no kvtrace installed) imports the scheduler class vllm-env names,
    from the installed wheel, and the capture's guard accepts that vLLM."""
    path, cls = installed.capture_path()
    module, _, name = cls.rpartition(".")
    script = (f"import importlib, json, vllm\nfrom kvtrace.vllm.capture import guard\n"
              f"m = importlib.import_module({module!r})\nguard.check_version(vllm.__version__)\n"
              f"print(json.dumps({{'file': m.__file__, 'cls': getattr(m, {name!r}).__name__}}))")
    env = {**installed.env, "PYTHONPATH": path}
    env.pop("VIRTUAL_ENV")
    result = json.loads(installed.run(os.environ["KVTRACE_VLLM_PYTHON"], "-c", script, env=env).stdout.splitlines()[-1])
    assert result["cls"] == name
    assert Path(result["file"]).resolve().is_relative_to(installed.venv.resolve())
