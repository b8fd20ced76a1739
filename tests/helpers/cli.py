"""Driving the command line in tests: `kvtrace record` on a workload file, a query of the run, and
the one-line error every refused input must give."""
from __future__ import annotations

import json
import signal
from pathlib import Path

from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.trace.db import connect


def one_line_error(args: list[str]) -> str:
    """Run the CLI; assert it failed with exit 2 and one `kvtrace: error:` line; return that line."""
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvtrace: error: "), result.stderr
    return lines[0]


def write_workload(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def record(tmp_path: Path, workload: Path, name: str, *args: str):
    out = tmp_path / name
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "-w", str(workload), "-o", str(out), "-q", *args])
    return result, out


def sql(run: Path, query: str):
    return connect([run]).sql(query).fetchall()


def interruptible() -> None:
    """`preexec_fn` of a child that a test stops with Ctrl-C (SIGINT). A shell's background job starts
    with SIGINT ignored; the child would inherit that, and Python leaves an ignored SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
