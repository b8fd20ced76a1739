"""The Typer application objects; command modules register themselves on these."""
from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from functools import wraps
from typing import TypeVar

import typer
from typer.core import TyperCommand

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
# issue 29, part B: a group of its own for `capture watch` / `capture metrics` (cli/capture_live.py)
# until the `capture` group of part A (cli/capture.py) takes them with capture_live.register
capture_app = typer.Typer(help="A vLLM server's capture folder: watch it, export its metrics.", no_args_is_help=True)
app.add_typer(capture_app, name="capture")

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


class SwitchesAsOneName(TyperCommand):
    """A command whose --help shows an on/off switch as one name, `--[no-]enable-prefix-caching`.
    Typer gives the two forms a column each, and at 80 columns Rich then cuts both
    ("--enable-chunked-pr…  --no-enable-chunke…"). Only the help changes: both forms still parse."""

    def format_help(self, ctx, formatter) -> None:
        switches = [(p, p.opts) for p in self.params
                    if len(p.opts) == 1 and p.secondary_opts == ["--no-" + p.opts[0].removeprefix("--")]]
        try:
            for param, opts in switches:
                param.opts, param.secondary_opts = ["--[no-]" + opts[0].removeprefix("--")], []
                param._get_default_string = lambda *, _on=bool(param.default), **_: "on" if _on else "off"
            super().format_help(ctx, formatter)
        finally:
            for param, opts in switches:
                param.opts, param.secondary_opts = opts, ["--no-" + opts[0].removeprefix("--")]
                del param._get_default_string


def reflow_help(typer_app: typer.Typer) -> None:
    """Every command's and group's help under `typer_app` as `paragraphs` (the options' help Typer
    already reflows), its switches shown as one name each (SwitchesAsOneName). Run once every
    command module has registered its commands."""
    if typer_app.info.help:
        typer_app.info.help = paragraphs(typer_app.info.help)
    for command in typer_app.registered_commands:
        if command.cls in (None, TyperCommand):
            command.cls = SwitchesAsOneName
        text = command.help or inspect.getdoc(command.callback)
        command.help = paragraphs(text) if text else text
    for group in typer_app.registered_groups:
        if group.help:
            group.help = paragraphs(group.help)
        reflow_help(group.typer_instance)
