"""The Typer application objects; command modules register themselves on these."""
from __future__ import annotations

import inspect
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


def paragraphs(text: str) -> str:
    """A docstring with each paragraph (lines up to a blank line) on one line. Typer's Rich help
    keeps a docstring's line breaks, which then fall mid-sentence at any width but the source's;
    on one line, Rich wraps the paragraph to the terminal. A paragraph that starts with \\b (Click's
    "keep as written") is kept."""
    return "\n\n".join(p if p.startswith("\b") else " ".join(p.split())
                       for p in inspect.cleandoc(text).split("\n\n"))


def reflow_help(typer_app: typer.Typer) -> None:
    """Every command's and group's help under `typer_app` as `paragraphs` (the options' help Typer
    already reflows). Run once every command module has registered its commands."""
    if typer_app.info.help:
        typer_app.info.help = paragraphs(typer_app.info.help)
    for command in typer_app.registered_commands:
        text = command.help or inspect.getdoc(command.callback)
        command.help = paragraphs(text) if text else text
    for group in typer_app.registered_groups:
        if group.help:
            group.help = paragraphs(group.help)
        reflow_help(group.typer_instance)
