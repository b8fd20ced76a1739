"""`kvtrace export perfetto`: a run's timeline for the Perfetto UI (see kvtrace/export/perfetto.py)."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtrace.cli.app import RUNS_HELP, export_app, user_errors


@export_app.command("perfetto")
@user_errors
def perfetto(
    runs: Annotated[list[str], typer.Argument(help=RUNS_HELP, show_default=False)],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="The trace file (default: <run>.pftrace beside a single run folder, "
                               "else kvtrace.pftrace).", show_default=False)] = None,
) -> None:
    """A native Perfetto trace of the runs: every request as a track of its states (waiting,
    prefill, decode, preempted, swapped, reprefill), the engine's steps with preemptions, swaps and
    evictions, and the KV pool's counters, with flows from the step that preempted or resumed a
    request to its state. Several runs: one top-level group each.

    Open it by dragging the file onto https://ui.perfetto.dev (it stays on your machine).

    Example: kvtrace export perfetto traces/runs/latest -o bursty.pftrace
    """
    # imported here: Perfetto's protobuf classes are needed by this command only (the offline GPU
    # check installs kvtrace's other dependencies without them)
    from kvtrace.export import perfetto as perfetto_export

    path = output or perfetto_export.default_output(runs)
    started = time.perf_counter()
    summary = perfetto_export.export_perfetto(runs, path)
    seconds = time.perf_counter() - started
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    err.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {summary.num_packets:,} packets from "
              f"{summary.num_kv_events:,} KV events of {len(summary.run_ids)} run(s), {seconds:.1f} s); "
              f"open it on https://ui.perfetto.dev")
    for run_id, last_step in summary.running:
        upto = f" (steps up to {last_step})" if last_step is not None else ""
        err.print(f"note: run {run_id} is still being recorded: exported the chunks closed so far{upto}; "
                  f"requests still in flight are left out")
