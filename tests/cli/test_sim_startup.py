"""`kvtrace record --engine sim` pays only for what it uses: it runs no model, so it never imports
torch (seconds in a cold process), nor the report's and explorer's libraries, nor DuckDB (it queries
nothing), nor a tokenizer library (its models have none), nor the other commands' modules; and its
trace writer needs neither Arrow's compute functions nor numpy's masked arrays (together 40 ms), nor
its option parsing pydantic (typer 0.29's, 80 ms: pyproject.toml caps typer below it); quiet, it
loads no Rich, and it reads torch's version without importlib.metadata (together 35 ms)."""
from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
from pathlib import Path

from tests.helpers.cli import write_workload

ROOT = Path(__file__).resolve().parents[2]
NOT_IMPORTED = ("torch", "altair", "textual", "safetensors", "duckdb", "tokenizers", "pyarrow.compute", "numpy.ma",
                "pydantic", "kvtrace.cli.sql", "kvtrace.views", "rich", "importlib.metadata", "kvtrace.workload.importers")

# the command line as `python -m kvtrace` runs it (its `main`, less the exit of `run`), then the
# modules it loaded, as JSON
RECORD_THEN_LIST_MODULES = """
import json, sys
from kvtrace.cli import main
sys.argv = ["kvtrace", *sys.argv[1:]]
try:
    main()
except SystemExit as exc:
    assert not exc.code, exc.code
print(json.dumps(sorted(sys.modules)))
"""


def test_sim_record_imports_no_torch(tmp_path):
    workload = write_workload(tmp_path / "w.jsonl", [
        {"id": "a", "arrival_s": 0, "prompt_tokens": 40, "max_tokens": 8},
        {"id": "b", "arrival_s": 0.01, "prompt_tokens": 30, "max_tokens": 8, "n": 2, "temperature": 0.8},
    ])
    done = subprocess.run(
        [sys.executable, "-c", RECORD_THEN_LIST_MODULES, "record", "-q", "-w", str(workload), "-o",
         str(tmp_path / "run"), "--engine", "sim", "--model", "llama-3-8b", "--num-gpu-blocks", "64"],
        cwd=ROOT, capture_output=True, text=True, check=True)
    modules = json.loads(done.stdout.splitlines()[-1])
    assert "engine" in modules and "pyarrow" in modules   # it did record
    assert not [m for m in NOT_IMPORTED if m in modules], done.stdout
    meta = json.loads((tmp_path / "run" / "meta.json").read_text())
    assert meta["status"] == "completed" and meta["device"]["type"] == "sim"
    assert meta["device"]["torch"] == importlib.metadata.version("torch")   # read from its dist-info
