"""`kvtrace analyze` (terminal dashboard) and `kvtrace report` (HTML charts): both only present the
results of the SQL library (see kvtrace/views/dashboard.py and kvtrace/views/report.py)."""
from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from kvtrace.cli.app import RUNS_HELP, app, parse_params, user_errors
from kvtrace.errors import KvtraceError
from kvtrace.sweep import view as sweep_view
from kvtrace.trace import db
from kvtrace.views import dashboard
from kvtrace.views import report as report_charts
from kvtrace.views.dashboard import view as dashboard_view  # the dashboard of runs at a width

PARAM_HELP = "A parameter of the analyses shown (SLOs, thrash thresholds, ITL cliff threshold), NAME=VALUE."


# --------------------------------------------------------------------------- kvtrace analyze

def follow(console: Console, runs: list[str], view: Callable[[int], RenderableType],
           interval: float, sleep: Callable[[float], None] = time.sleep) -> None:
    """Redraw `view(width)` every `interval` seconds until no run is `running` any more (or Ctrl-C)."""
    run_dirs = db.find_runs(runs)
    # taller than the terminal: cropped while live, shown whole when the run ends
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                # the status first: once a run is no longer running, every chunk it wrote is there
                statuses = [db.read_meta(run).get("status") for run in run_dirs]
                if any(any(run.glob("*/part-*.parquet")) for run in run_dirs):
                    live.update(view(console.width), refresh=True)
                else:
                    live.update(Text(f"waiting for the first chunks of {', '.join(map(str, run_dirs))} …"),
                                refresh=True)
                if "running" not in statuses:
                    return
                sleep(interval)
        except KeyboardInterrupt:
            return


@app.command()
@user_errors
def analyze(
    runs: Annotated[list[str], typer.Argument(help=RUNS_HELP, show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="Print the figures as JSON instead (for scripts).")] = False,
    follow_run: Annotated[bool, typer.Option(
        "--follow", "-f", help="Redraw as chunks land while a run is being recorded, until it ends.")] = False,
    interval: Annotated[float, typer.Option(help="Seconds between redraws with --follow.")] = 1.0,
    top: Annotated[int | None, typer.Option(
        help="Most preempted requests listed (default: 3 below 120 columns, else 5).", show_default=False)] = None,
    buckets: Annotated[int | None, typer.Option(
        help="Intervals of the pool timeline (default: as many as fit; 60 with --json).", show_default=False)] = None,
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
) -> None:
    """What did the KV cache do to my requests? One screen: key figures, the thrash verdict, the
    KV pool over time with its preemptions, the ITL tail and its causes, the most preempted
    requests. Several runs: side by side.

    Every figure comes from the SQL library (analyses/*.sql); --json prints them.
    """
    params = parse_params(param)
    for name, value in (("--top", top), ("--buckets", buckets)):
        if value is not None and value < 1:
            raise KvtraceError(f"{name} must be >= 1, got {value}")
    if as_json:
        data = dashboard.collect(db.connect(runs), params=params, buckets=buckets or dashboard.DEFAULT_BUCKETS,
                                 top=top or 5)
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    console = Console(soft_wrap=False)
    if follow_run:
        if interval <= 0:
            raise KvtraceError(f"--interval must be > 0, got {interval}")
        follow(console, runs, lambda width: dashboard_view(runs, params, width, top, buckets), interval)
        return
    console.print(dashboard_view(runs, params, console.width, top, buckets))


# --------------------------------------------------------------------------- kvtrace report

class ReportFormat(str, Enum):
    html = "html"
    png = "png"
    svg = "svg"


@app.command()
@user_errors
def report(
    runs: Annotated[list[str], typer.Argument(help=RUNS_HELP, show_default=False)],
    output: Annotated[Path | None, typer.Option(
        "--output", "-o", help="The HTML file (default: report.html); with --format png or svg, the folder "
                               "for one file per chart (default: report/).", show_default=False)] = None,
    fmt: Annotated[ReportFormat, typer.Option("--format", help="html (one self-contained page), png or svg.")]
    = ReportFormat.html,
    buckets: Annotated[int, typer.Option(help="Intervals per run of the timelines (pool_timeline.sql).")]
    = report_charts.TIMELINE_BUCKETS,
    requests: Annotated[int, typer.Option(help="Most preempted requests per run in the Gantt chart.")]
    = report_charts.GANTT_REQUESTS,
    param: Annotated[list[str] | None, typer.Option("--param", "-p", help=PARAM_HELP)] = None,
    objective: Annotated[str, typer.Option(help="For a sweep folder: the objective whose best point the charts "
                                                "mark (see kvtrace sweep show).")] = "goodput",
) -> None:
    """Charts of what the KV cache did, in one HTML file that opens offline: pool occupancy with
    preemptions and swaps, a Gantt of the most preempted requests, the ITL CDF and its tail causes,
    TTFT and E2E distributions, recompute waste and swap traffic. Several runs: overlaid.

    A sweep folder (kvtrace sweep) gives the sweep's charts instead: each metric against the swept
    knob, a line per value of the other knobs, the best point marked.

    Example: kvtrace report traces/runs/bursty-* -o report.html
    """
    if len(runs) == 1 and sweep_view.is_sweep(runs[0]):
        err = Console(stderr=True, soft_wrap=True)
        if fmt is ReportFormat.html:
            path = output or Path("sweep.html")
            count = sweep_view.write_report(Path(runs[0]), path, objective, parse_params(param))
            err.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {count} charts)", highlight=False)
        else:
            folder = output or Path("sweep")
            written = report_charts.write_images(
                sweep_view.sweep_charts(Path(runs[0]), objective, parse_params(param)), folder, fmt.value)
            err.print(f"wrote {len(written)} charts to {folder}/: {', '.join(p.name for p in written)}",
                      highlight=False)
        return
    for name, value in (("--buckets", buckets), ("--requests", requests)):
        if value < 1:
            raise KvtraceError(f"{name} must be >= 1, got {value}")
    if fmt is ReportFormat.html and output is not None and output.is_dir():
        raise KvtraceError(f"{output}: is a folder; give the HTML file to write")
    if fmt is not ReportFormat.html and output is not None and output.exists() and not output.is_dir():
        raise KvtraceError(f"{output}: not a folder (--format {fmt.value} writes one file per chart)")
    con = db.connect(runs)
    params = parse_params(param)
    charts = report_charts.build(con, params=params, buckets=buckets, requests=requests)
    err = Console(stderr=True, soft_wrap=True)
    if fmt is ReportFormat.html:
        path = output or Path("report.html")
        path.write_text(report_charts.to_html(charts, con, params))
        err.print(f"wrote {path} ({path.stat().st_size / 1e6:.1f} MB, {len(charts)} charts)", highlight=False)
        return
    folder = output or Path("report")
    written = report_charts.write_images(charts, folder, fmt.value)
    err.print(f"wrote {len(written)} charts to {folder}/: {', '.join(p.name for p in written)}", highlight=False)
