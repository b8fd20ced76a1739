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
app.add_typer(model_app, name="model")

F = TypeVar("F", bound=Callable)


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
