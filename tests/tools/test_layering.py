"""The layering that docs/contributing.md's Layout section draws, read from the source (every import statement,
function-level and TYPE_CHECKING ones included, relative ones resolved):

- `engine/` imports nothing of `kvtrace` (kvtrace observes it only through its Tracer);
- nothing but `kvtrace/cli/` and `kvtrace/__main__.py` imports `kvtrace.cli` (the library, the
  benchmarks and the scripts included; the tests drive the app and may, and so does
  scripts/postmortem.py, which runs the README's commands in its own process under a modelled
  clock: it may import the app, nothing else of the CLI);
- `kvtrace/vllm/capture/` imports only the standard library, vLLM and itself (it runs in vLLM's
  environment, which has no kvtrace dependencies);
- inside `engine/`: `kernels/` imports nothing from `model/` or `executor/`, `model/` nothing from
  `executor/`, and the core (scheduler, block_manager, sequence, events, config) nothing from
  `model/`, `executor/` or `kernels/`;
- the engine loop and its core (llm_engine besides those) import nothing of the simulator's package
  `engine/sim/` (its fast path plugs in behind one seam, LLMEngine.fast_path), nothing of the builder
  `engine/build.py` that picks it, and no numpy.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = ("engine/scheduler.py", "engine/block_manager.py", "engine/sequence.py", "engine/events.py",
        "engine/config.py")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports(path: Path) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in the file; `from a import b` gives `a.b` as well as `a`,
    since b may be a module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:   # relative: from the file's package, one level up per extra dot
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.append((node.lineno, module))
            found += [(node.lineno, f"{module}.{alias.name}") for alias in node.names if alias.name != "*"]
    return found


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts)


def within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def violations(files: list[Path], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{path.relative_to(ROOT)}:{line} imports {module}"
            for path in files for line, module in imports(path)
            if any(within(module, package) for package in forbidden)]


def test_the_engine_imports_nothing_of_kvtrace():
    assert violations(python_files("engine"), ("kvtrace",)) == []


# what a script that drives the app in-process, or stands in for the entry point, may import of the CLI
APP_DRIVERS = {"scripts/postmortem.py": {"kvtrace.cli", "kvtrace.cli.commands", "kvtrace.cli.app", "kvtrace.cli.app.app"},
               "benchmarks/process_tricks_driver.py": {"kvtrace.cli", "kvtrace.cli.main"}}


def test_nothing_but_the_entry_point_imports_the_cli():
    files = [p for p in python_files("kvtrace", "engine", "benchmarks", "scripts")
             if not within(module_name(p), "kvtrace.cli") and p != ROOT / "kvtrace" / "__main__.py"]
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in files for line, module in imports(path)
             if within(module, "kvtrace.cli") and module not in APP_DRIVERS.get(str(path.relative_to(ROOT)), ())]
    assert found == []


def test_the_vllm_capture_imports_only_the_standard_library_vllm_and_itself():
    """...and the package's root for its version (`kvtrace.__version__`): importing the capture imports that
    root anyway, and it imports nothing."""
    allowed = set(sys.stdlib_module_names) | {"vllm"}
    found = [f"{path.relative_to(ROOT)}:{line} imports {module}"
             for path in python_files("kvtrace/vllm/capture") for line, module in imports(path)
             if module.split(".")[0] not in allowed and not within(module, "kvtrace.vllm.capture")
             and module != "kvtrace"]
    assert found == []
    assert imports(ROOT / "kvtrace" / "__init__.py") == []


@pytest.mark.parametrize("files, forbidden", [
    ("engine/kernels", ("engine.model", "engine.executor")),
    ("engine/model", ("engine.executor",)),
    (CORE, ("engine.model", "engine.executor", "engine.kernels")),
], ids=["kernels", "model", "core"])
def test_the_engine_layers(files, forbidden):
    paths = python_files(files) if isinstance(files, str) else [ROOT / f for f in files]
    assert all(p.is_file() for p in paths) and paths
    assert violations(paths, forbidden) == []


LOOP = ("engine/llm_engine.py", *CORE)


def test_the_engine_loop_imports_nothing_of_the_simulator_nor_numpy():
    assert violations([ROOT / f for f in LOOP], ("engine.sim", "engine.build", "numpy")) == []


def test_the_checker_reads_every_kind_of_import(tmp_path, monkeypatch):
    """The reader itself: absolute, from-, relative and function-level imports are all seen."""
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    source = tmp_path / "engine" / "kernels" / "k.py"
    source.parent.mkdir(parents=True)
    source.write_text("import os\nfrom ..model import llama\n\ndef f():\n    from kvtrace.cli import app\n"
                      "    import engine.executor.model_runner as m\n")
    assert imports(source) == [(1, "os"), (2, "engine.model"), (2, "engine.model.llama"),
                               (5, "kvtrace.cli"), (5, "kvtrace.cli.app"), (6, "engine.executor.model_runner")]
    assert violations([source], ("kvtrace.cli",)) == ["engine/kernels/k.py:5 imports kvtrace.cli",
                                                      "engine/kernels/k.py:5 imports kvtrace.cli.app"]
