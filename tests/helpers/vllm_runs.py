"""vLLM in tests: capture chunks built by hand (the importer's input, no vLLM needed), and the
command line run against vLLM's CPU build (KVTRACE_VLLM_PYTHON)."""
from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest

from kvtrace.vllm.capture.sink import COLUMNS
from kvtrace.vllm.importer import Item

ITEMS = {0: Item(0, "chat-a", 1, 0, 0.0, 40, 8, None), 3: Item(3, "chat-b", 2, 1, 0.5, 60, 16, 4)}


def chunk(rows: dict[str, list[dict]]) -> dict:
    """Columns of the capture's tables from rows (missing columns None)."""
    return {table: {c: [row.get(c) for row in rows.get(table, [])] for c in cols} for table, cols in COLUMNS.items()
            if rows.get(table)}


def write_capture(folder, chunks: list[dict]) -> None:
    (folder / "chunks").mkdir(parents=True)
    for part, rows in enumerate(chunks):
        (folder / "chunks" / f"77-{part:06d}.pkl").write_bytes(pickle.dumps(rows, protocol=4))


VLLM_PYTHON = os.environ.get("KVTRACE_VLLM_PYTHON", "")
# the marks of a module that starts vLLM: `vllm`, and a skip that says why where there is no vLLM environment
VLLM_MARKS = [pytest.mark.vllm]
if not VLLM_PYTHON:
    VLLM_MARKS.append(pytest.mark.skip(
        reason=os.environ.get("KVTRACE_VLLM_UNAVAILABLE") or "no vLLM environment: run scripts/vllm_env.sh and set "
                                                            "KVTRACE_VLLM_PYTHON"))


EAGER = ["--vllm-arg", "enforce_eager=true"]     # no torch.compile: start-up in seconds, same scheduling


def kvtrace(*args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run([sys.executable, "-m", "kvtrace", *map(str, args)], capture_output=True, text=True,
                          env={**os.environ, **(env or {})})
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
