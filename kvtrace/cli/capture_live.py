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
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.text import Text

from kvtrace.cli.app import parse_params, user_errors
from kvtrace.errors import KvtraceError

if TYPE_CHECKING:
    from kvtrace.vllm.follow import LiveTrace
    from kvtrace.vllm.live import Server

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


def watch_view(trace: LiveTrace, capture: Path, window_s: float, params: dict[str, str], width: int,
               found: list[Server] | None = None, chosen: list[Server] | None = None) -> RenderableType:
    """The dashboard of the last `window_s` seconds of one server: of the servers `chosen` among those
    `found` in the folder (by default all of them), the one that wrote last (by the wall clock: its newest
    chunk's last step)."""
    from kvtrace.views import dashboard
    from kvtrace.vllm.fleet import labels
    from kvtrace.vllm.follow import capture_status, server_info

    if found is None or chosen is None:
        found, chosen = watched(capture, [], [])
    status = capture_status(capture)
    if (status is not None and status.status in ("stepped_aside", "refused")   # it recorded nothing
            and status.server_id in {s.server_id for s in chosen}):
        return Text(f"the capture of server {status.server_id} {status.status.replace('_', ' ')}: {status.error} "
                    f"[{status.reason}] (docs/vllm.md)")
    shown = [s for s in chosen if s.server_id in trace.servers and trace.end_s(s.server_id) is not None]
    if not shown:
        return Text(f"waiting for the first steps in {capture} …")
    server = max(shown, key=lambda s: s.last or 0.0)
    kept = [s for s in found if s.chunks]
    names = dict(zip((s.server_id for s in kept), labels(kept))) if kept else {}
    label = names.get(server.server_id) or ""
    name = f"{label} ({server.server_id})" if label else server.server_id
    with tempfile.TemporaryDirectory(prefix="kvtrace-watch-") as tmp:
        run = Path(tmp) / f"last-{window_s:g}s"
        trace.write_run(server.server_id, run, f"server {name}, last {window_s:g} s", window_s=window_s,
                        info=server_info(capture, server.server_id), command=f"kvtrace capture watch {capture}")
        board = dashboard.view([str(run)], params, width)
    if len(kept) < 2:
        return board
    picked = chosen != found   # by --server or --rank
    line = f"the folder holds {len(kept)} servers ({', '.join(names.values())}): showing {label}"
    if len(shown) > 1:
        line += f", the one that wrote last{' of those chosen' if picked else ''}"
    if not picked:
        line += " (--server or --rank picks one; kvtrace capture ls lists them)"
    return Group(Text(line), board)


def watched(capture: Path, server_ids: list[str], ranks: list[int]) -> tuple[list[Server], list[Server]]:
    """The servers of the folder (none before one wrote there) and those --server and --rank choose
    (kvtrace capture run's choice; by default all)."""
    from kvtrace.vllm.fleet import select
    from kvtrace.vllm.live import servers

    found = servers(capture) if (capture / "servers").is_dir() or (capture / "chunks").is_dir() else []
    return found, select(found, server_ids, ranks)


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
    server: Annotated[list[str] | None, typer.Option(
        help="A server to show (an id of `capture ls`, or a unique start of one); given several, the one of them "
             "that wrote last. Default: the folder's server that wrote last.", show_default=False)] = None,
    rank: Annotated[list[int] | None, typer.Option(
        help="Show the servers of this data-parallel rank (the one that wrote last).", show_default=False)] = None,
) -> None:
    """The dashboard of `kvtrace analyze` on the last minutes of a running server, redrawn as its
    capture writes chunks (Ctrl-C stops).

    It shows one server over the --window that ends with its last step: the server that wrote last,
    or of those --server and --rank choose (as for `capture run`), the one that wrote last. Where the
    folder holds several (the ranks of a data-parallel server, a restart), its first line says which."""
    from kvtrace.vllm.follow import ChunkReader, LiveTrace

    window_s, refresh_s = parse_duration(window, "--window"), parse_duration(refresh, "--refresh")
    params = parse_params(param)
    capture = _capture_folder(capture)
    reader, trace = ChunkReader(capture), LiveTrace(window_s)
    console = Console(soft_wrap=False)

    def update() -> RenderableType:
        chunks = reader.new_chunks()
        found, chosen = watched(capture, server or [], rank or [])
        ids = {s.server_id for s in chosen}
        for server_id, chunk in chunks:
            if server_id in ids:
                trace.add(server_id, chunk)
        view = watch_view(trace, capture, window_s, params, console.width, found, chosen)
        trace.prune()
        return view

    view = update()   # a bad --server or --rank: one line, before anything is drawn
    if once:
        console.print(view)
        return
    with Live(console=console, auto_refresh=False) as live:
        try:
            while True:
                live.update(view, refresh=True)
                time.sleep(refresh_s)
                view = update()
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
