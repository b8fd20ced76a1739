"""`kvtrace` command line: every command module registers itself on the shared app."""
from __future__ import annotations

from kvtrace.cli_app import app
from kvtrace import cli_calibrate, cli_export, cli_model, cli_record, cli_sql, cli_sweep, cli_view, cli_workload  # noqa: F401  (registration)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
