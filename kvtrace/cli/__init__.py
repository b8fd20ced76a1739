"""The `kvtrace` command line: the top of the package (nothing in kvtrace imports it). Each command
module registers its commands on the shared Typer app (kvtrace/cli/app.py) when imported.

`main` imports only the module of the command it runs, so that a command's start-up pays for no
other command's imports (`kvtrace record --engine sim` is timed whole against other simulators, and
`kvtrace sweep` starts one per point): the rest (the analyses, DuckDB, Rich's tables, the sweep's
views) cost a tenth of a second more. `load()` registers every command (the help lists them all, and
`import kvtrace.cli.commands` does the same for tests and scripts that drive the app)."""
from __future__ import annotations

import atexit
import gc
import importlib
import os
import sys
import threading
from typing import NoReturn

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
    # The cyclic collector need not walk what start-up makes (modules, classes: all live to the end),
    # nor anything once the command is done: the collection at the interpreter's exit then has
    # nothing to look at (together 40 ms of a simulated recording of 1,000 requests).
    gc.disable()
    app = load(sys.argv[1] if len(sys.argv) > 1 else None)
    gc.freeze()
    gc.enable()
    try:
        app()
    finally:
        gc.freeze()


def run() -> NoReturn:
    """The process's entry (the `kvtrace` script, `python -m kvtrace`): `main`, then an exit without the
    interpreter's teardown, which frees every object of numpy, Arrow, the engine and the run one by one
    (50 ms of a one-second simulated recording). Standard output and error are flushed and the atexit
    handlers run first, as at a normal exit; with another thread still running, or output that cannot
    be flushed, the exit is the normal one."""
    try:
        main()
        code = None
    except SystemExit as exc:
        code = exc.code
    if threading.active_count() == 1:
        status = 0 if code is None else code if isinstance(code, int) else 1
        if not isinstance(code, (int, type(None))):
            print(code, file=sys.stderr)
        atexit._run_exitfuncs()   # (and forgets them)
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        except (OSError, ValueError):   # a closed pipe: the normal exit reports it
            raise SystemExit(code) from None
        os._exit(status)
    raise SystemExit(code)


if __name__ == "__main__":
    run()
