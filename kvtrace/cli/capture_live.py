"""`kvtrace capture watch` and `kvtrace capture metrics`: a running server's capture folder, live.

`register(group)` adds both commands to a Typer group (the `capture` group). Both follow the folder
with kvtrace/vllm/follow.py; watch lays out the dashboard of `kvtrace analyze` (kvtrace/views/dashboard.py)
on the run of the last minutes, metrics serves kvtrace/vllm/metrics.py's figures in prometheus_client's
exposition format. `register` adds `capture dashboard` too, which prints the Grafana dashboard of those
figures (kvtrace/vllm/dashboards/kvtrace-capture.json, shipped in the wheel).
"""
from __future__ import annotations

import re
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console, RenderableType
from rich.live import Live
from rich.text import Text

from kvtrace.cli.app import parse_params, user_errors
from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.vllm.follow import LiveTrace

# duckdb, pyarrow, the dashboard and the folder's follower are imported by the commands themselves: every
# kvtrace command registers these two, and `record --engine sim` should not pay for them at start-up

CAPTURE_HELP = "The capture folder the server writes (KVTRACE_CAPTURE_DIR of `kvtrace vllm-env`)."
_DURATION = re.compile(r"^\s*(\d+(?:\.\d*)?|\.\d+)\s*(ms|s|m|h)?\s*$")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, None: 1.0}


def parse_duration(text: str, option: str) -> float:
    """'5m', '2s', '500ms', '1h' or plain seconds, as seconds (> 0)."""
    m = _DURATION.match(text)
    if not m or float(m[1]) <= 0:
        raise KvtraceError(f"{option}: expected a positive duration such as 5m, 30s or 500ms, got {text!r}")
    return float(m[1]) * _UNITS[m[2]]


def _capture_folder(capture: Path) -> Path:
    if not capture.is_dir():
        raise KvtraceError(f"{capture}: no such capture folder")
    return capture


def watch_view(trace: LiveTrace, capture: Path, window_s: float, params: dict[str, str], width: int) -> RenderableType:
    """The dashboard of the last `window_s` seconds of the server that wrote last."""
    from kvtrace.views import dashboard
    from kvtrace.vllm.follow import capture_status, server_info

    status = capture_status(capture)
    if status is not None and status.status in ("stepped_aside", "refused"):   # its newest server recorded nothing
        return Text(f"the capture of server {status.server_id} {status.status.replace('_', ' ')}: {status.error} "
                    f"[{status.reason}] (docs/vllm.md)")
    server = trace.newest_server()
    if server is None:
        return Text(f"waiting for the first steps in {capture} …")
    with tempfile.TemporaryDirectory(prefix="kvtrace-watch-") as tmp:
        run = Path(tmp) / f"last-{window_s:g}s"
        trace.write_run(server, run, f"server {server}, last {window_s:g} s", window_s=window_s,
                        info=server_info(capture, server), command=f"kvtrace capture watch {capture}")
        return dashboard.view([str(run)], params, width)


def register(group: typer.Typer) -> None:
    """Add `watch`, `metrics` and `dashboard` to `group`."""
    group.command()(watch)
    group.command()(metrics)
    group.command()(dashboard)


def dashboard_json() -> str:
    """The Grafana dashboard of `capture metrics`, as the wheel ships it (kvtrace/vllm/dashboards/)."""
    import importlib.resources

    path = importlib.resources.files("kvtrace.vllm") / "dashboards" / "kvtrace-capture.json"
    return path.read_text(encoding="utf-8")


@user_errors
def watch(
    capture: Annotated[Path, typer.Argument(help=CAPTURE_HELP, show_default=False)],
    window: Annotated[str, typer.Option(help="How far back the dashboard looks (5m, 90s, 1h).")] = "5m",
    refresh: Annotated[str, typer.Option(help="Time between redraws (2s, 500ms).")] = "2s",
    once: Annotated[bool, typer.Option("--once", help="Draw once and exit (for scripts and tests).")] = False,
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", help="A parameter of the analyses shown (SLOs, thrash thresholds), NAME=VALUE.")] = None,
) -> None:
    """The dashboard of `kvtrace analyze` on the last minutes of a running server, redrawn as its
    capture writes chunks (Ctrl-C stops).

    It shows the server that wrote last, over the --window that ends with its last step."""
    from kvtrace.vllm.follow import ChunkReader, LiveTrace

    window_s, refresh_s = parse_duration(window, "--window"), parse_duration(refresh, "--refresh")
    params = parse_params(param)
    capture = _capture_folder(capture)
    reader, trace = ChunkReader(capture), LiveTrace(window_s)
    console = Console(soft_wrap=False)

    def update() -> RenderableType:
        for server, chunk in reader.new_chunks():
            trace.add(server, chunk)
        view = watch_view(trace, capture, window_s, params, console.width)
        trace.prune()
        return view

    if once:
        console.print(update())
        return
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                live.update(update(), refresh=True)
                time.sleep(refresh_s)
        except KeyboardInterrupt:
            return


@user_errors
def metrics(
    capture: Annotated[Path, typer.Argument(help=CAPTURE_HELP, show_default=False)],
    port: Annotated[int, typer.Option(help="The port to serve /metrics on (8473: outside 9100-9999, which "
                                           "Prometheus's exporters have taken; 9400 is NVIDIA's DCGM exporter).")
                    ] = 8473,
    host: Annotated[str, typer.Option(help="The address to listen on (0.0.0.0: every interface).")] = "127.0.0.1",
    window: Annotated[str, typer.Option(help="The window of the thrash verdict, and how long the exporter "
                                              "keeps finished requests' rows in memory (1m, 5m).")] = "1m",
    refresh: Annotated[str, typer.Option(help="Time between reads of the folder (2s: the capture's flush).")] = "2s",
    param: Annotated[list[str] | None, typer.Option(
        "--param", "-p", help="A parameter of thrash.sql (window_s, min_preempt_per_s, ...), NAME=VALUE.")] = None,
) -> None:
    """A Prometheus exporter that follows a capture folder: preemptions by reason, recomputed tokens,
    positions recovered from the prefix cache on resume, the KV pool, the thrash verdict of the
    last window, ITL by cause, requests and steps (docs/vllm.md lists them). Ctrl-C stops.

    Counters start from what the folder holds when it starts and never go backwards after, whatever
    the capture's retention removes."""
    # prometheus_client only for this command (as textual for explore)
    import duckdb
    import pyarrow as pa
    from prometheus_client import start_http_server
    from prometheus_client.core import CollectorRegistry

    from kvtrace.vllm.metrics import Exporter

    window_s, refresh_s = parse_duration(window, "--window"), parse_duration(refresh, "--refresh")
    if not 1 <= port <= 65535:
        raise KvtraceError(f"--port {port}: a TCP port is 1 to 65535")
    capture = _capture_folder(capture)
    exporter = Exporter(capture, window_s=window_s, thrash_params=parse_params(param))
    exporter.poll()   # before serving: a first scrape sees the folder's history
    registry = CollectorRegistry(auto_describe=False)
    registry.register(exporter)
    try:
        server, thread = start_http_server(port, addr=host, registry=registry)
    except OSError as exc:
        raise KvtraceError(f"--port {port}: cannot listen on {host} ({exc.strerror or exc})") from exc
    print(f"kvtrace: serving metrics of {capture} on http://{host}:{port}/metrics (Ctrl-C stops)", flush=True)
    last_error = ""
    try:
        while True:
            time.sleep(refresh_s)
            try:
                exporter.poll()
            except (KvtraceError, OSError, duckdb.Error, pa.ArrowException) as exc:   # serve on; say it once
                if str(exc) != last_error:
                    print(f"kvtrace: warning: reading {capture}: {exc}", file=sys.stderr, flush=True)
                last_error = str(exc)
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
        thread.join(timeout=5)
        exporter.close()


@user_errors
def dashboard(
    out: Annotated[Path | None, typer.Option("--output", "-o", help="Write it to this file instead of stdout.",
                                             show_default=False)] = None,
) -> None:
    """The Grafana dashboard of `capture metrics` (JSON): the thrash verdict, preemptions by reason,
    recomputed tokens, the KV pool, ITL by cause and the capture's health. Import it in Grafana
    (Dashboards > New > Import) and pick the Prometheus that scrapes the exporter.

    Example: kvtrace capture dashboard -o kvtrace-capture.json
    """
    text = dashboard_json()
    if out is None:
        sys.stdout.write(text)
        return
    try:
        out.write_text(text)
    except OSError as exc:
        raise KvtraceError(f"{out}: cannot write ({exc.strerror or exc})") from exc
    print(f"wrote {out}: import it in Grafana (Dashboards > New > Import)", file=sys.stderr)
