"""The `kvtrace` command line: the top of the package (nothing in kvtrace imports it). Each command
module registers its commands on the shared Typer app (kvtrace/cli/app.py) when imported.

`main` imports only the module of the command it runs, so that a command's start-up pays for no
other command's imports (`kvtrace record --engine sim` is timed whole against other simulators, and
`kvtrace sweep` starts one per point; what the others' imports cost is in benchmarks/log/2026-12.md,
2026-12-05). `load()` registers every command (the help lists them all, and `import
kvtrace.cli.commands` does the same for tests and scripts that drive the app). What the process does
to start and end sooner is in kvtrace/process.py."""
from __future__ import annotations

import importlib
import sys

from kvtrace import process

# every command module, in the order their commands are listed
MODULES = ("calibrate", "capture", "explain", "explore", "export", "model", "record", "sql", "sweep", "view",
           "workload")
# each top-level command or group: the module that registers it (tests/cli/test_cli_start.py checks the list)
COMMAND_MODULES = {
    "calibrate": "calibrate", "capture": "capture", "explain": "explain", "explore": "explore", "export": "export",
    "model": "model", "record": "record", "vllm-env": "record", "sql": "sql", "compare": "sql", "sweep": "sweep",
    "analyze": "view", "report": "view", "workload": "workload",
}


def load(command: str | None = None):
    """The Typer app with `command`'s module registered (every module when None or not a command's
    name: the help, or Click's 'No such command' and its suggestions), its help reflowed."""
    from kvtrace.cli.app import app, reflow_help

    module = COMMAND_MODULES.get(command) if command else None
    for name in (module,) if module else MODULES:
        importlib.import_module(f"kvtrace.cli.{name}")
    reflow_help(app)
    return app


def main() -> None:
    """Run the command line; ends with SystemExit, as Typer's app does."""
    with process.start_up():
        app = load(sys.argv[1] if len(sys.argv) > 1 else None)
    try:
        app()
    finally:
        process.finished()


def run() -> None:
    """The process's entry (the `kvtrace` script, `python -m kvtrace`)."""
    main()


if __name__ == "__main__":
    run()
