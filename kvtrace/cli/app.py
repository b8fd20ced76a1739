"""The Typer application objects; command modules register themselves on these."""
from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

import typer

from kvtrace.errors import KvtraceError

app = typer.Typer(
    name="kvtrace",
    help="What did the KV cache do to my requests? Record a replay, then analyse it.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
workload_app = typer.Typer(help="Make, import and check workloads (JSONL).", no_args_is_help=True)
model_app = typer.Typer(help="Built-in models: list them, export their weights.", no_args_is_help=True)
app.add_typer(workload_app, name="workload")
export_app = typer.Typer(help="Export runs for other tools (Perfetto's timeline).", no_args_is_help=True)
app.add_typer(model_app, name="model")
app.add_typer(export_app, name="export")

F = TypeVar("F", bound=Callable)

RUNS_HELP = "Run folders: a run, a glob of runs, or a folder holding runs (e.g. traces/runs)."


def parse_params(items: list[str] | None) -> dict[str, str]:
    """--param NAME=VALUE options as a dict."""
    values = {}
    for item in items or []:
        name, sep, value = item.partition("=")
        if not sep or not name.strip():
            raise KvtraceError(f"--param expects NAME=VALUE, got {item!r}")
        values[name.strip()] = value.strip()
    return values


def fail(message: str) -> None:
    """Print one line to stderr and exit with code 2."""
    print(f"kvtrace: error: {message}", file=sys.stderr)
    raise typer.Exit(code=2)


def user_errors(func: F) -> F:
    """Turn user mistakes (KvtraceError, ValueError, FileNotFoundError) into one line and exit 2."""

    @wraps(func)
    def wrapper(*args, **kwargs):
        try:
            return func(*args, **kwargs)
        except (KvtraceError, ValueError, FileNotFoundError) as exc:
            fail(str(exc))

    return wrapper  # type: ignore[return-value]
