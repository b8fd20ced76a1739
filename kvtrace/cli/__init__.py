"""The `kvtrace` command line: the top of the package (nothing in kvtrace imports it). Each command
module registers its commands on the shared Typer app when imported here."""
from __future__ import annotations

from kvtrace.cli import calibrate, capture, capture_live, explain, explore, export, model, record, sql, sweep, view, workload  # noqa: F401  (registration)
from kvtrace.cli.app import app, reflow_help

capture_live.register(capture.capture_app)

reflow_help(app)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
