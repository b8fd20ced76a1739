"""`kvtrace explore`: the interactive terminal explorer (kvtrace/views/explore.py)."""
from __future__ import annotations

from typing import Annotated

import typer

from kvtrace.cli.app import RUNS_HELP, app, user_errors


@app.command()
@user_errors
def explore(runs: Annotated[list[str], typer.Argument(help=RUNS_HELP, show_default=False)]) -> None:
    """Explore a run in the terminal: its key figures and every request, sortable by TTFT, E2E,
    preemptions and recomputed tokens; a request's states on a timeline against the pool's
    occupancy; the step each state began in and what else ran in it. Several runs: pick one.

    Keyboard only, fits 80 × 24 (over SSH too): arrows move, Enter opens, Escape goes back, q quits;
    the footer shows the keys of each screen.

    Example: kvtrace explore traces/runs/latest
    """
    # Textual is imported here, not at the top: no other command pays for its import
    from kvtrace.trace import db
    from kvtrace.views.explore import Explorer

    db.one_server_each(db.connect(runs), "kvtrace explore")   # one engine's steps per run
    Explorer(runs).run()
