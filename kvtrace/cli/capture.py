"""`kvtrace capture`: a capture folder of live vLLM traffic (kvtrace/vllm/live.py, docs/vllm.md).

`ls` lists the servers that wrote there, `run` cuts any window of their traffic into a run. The
group is `capture_app`; `capture watch` and `capture metrics` (kvtrace/cli/capture_live.py) register
on it too.
"""
from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from kvtrace.cli import capture_live
from kvtrace.cli.app import app, user_errors

capture_app = typer.Typer(help="A vLLM server's capture folder of live traffic: list it, turn a window of it into a run, watch it, export its metrics.",
                          no_args_is_help=True)
app.add_typer(capture_app, name="capture")
capture_live.register(capture_app)

CAPTURE_HELP = "The capture folder the server writes (KVTRACE_CAPTURE_DIR of `kvtrace vllm-env`)."
TIME_HELP = "An ISO 8601 time (UTC unless it names its zone, e.g. 2026-12-01T03:00:00Z) or Unix seconds."


@capture_app.command("ls")
@user_errors
def ls(
    capture: Annotated[Path, typer.Argument(help=CAPTURE_HELP, show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="The same as JSON.")] = False,
) -> None:
    """Each server that wrote into the folder: its start, pid, vLLM version, model and scheduling mode,
    the time span its kept chunks cover, its requests, their size and the gaps retention left.

    Example: kvtrace capture ls /var/lib/kvtrace/capture
    """
    from kvtrace.vllm import live

    if as_json:
        print(live.ls_json(capture))
        return
    for line in live.ls_lines(capture):
        print(line)


@capture_app.command("run")
@user_errors
def run(
    capture: Annotated[Path, typer.Argument(help=CAPTURE_HELP, show_default=False)],
    out: Annotated[Path, typer.Option("--output", "-o", help="The run folder to write.", show_default=False)],
    since: Annotated[str | None, typer.Option(help="The window's start. " + TIME_HELP, show_default=False)] = None,
    until: Annotated[str | None, typer.Option(help="The window's end (default: the newest data). " + TIME_HELP,
                                              show_default=False)] = None,
    last: Annotated[str | None, typer.Option(help="The window is the last D (15m, 90s, 2h) before --until or the "
                                                  "newest data.", show_default=False)] = None,
    server: Annotated[str | None, typer.Option(help="The server (an id of `capture ls`, or its start) when several "
                                                    "wrote in the window.", show_default=False)] = None,
) -> None:
    """A run of the live traffic in a window, in the trace format: every request whose life overlaps
    it, those already in flight at its start and those still in flight at its end marked as such
    (the capture_requests table). Request ids are vLLM's own. Every analysis, the dashboard, report,
    compare, explain and the Perfetto export read it like any run.

    Example: kvtrace capture run /var/lib/kvtrace/capture -o runs/incident --since 2026-12-01T03:00Z --until 2026-12-01T03:20Z
    """
    from kvtrace.vllm import live

    lo = live.parse_time(since, "--since") if since is not None else None
    hi = live.parse_time(until, "--until") if until is not None else None
    span = live.parse_duration(last, "--last") if last is not None else None
    meta = live.capture_run(capture, out, since=lo, until=hi, last=span, server_id=server,
                            command=" ".join(["kvtrace", *sys.argv[1:]]))
    window = meta["capture"]["window"]
    rows = meta["summary"]["rows"]
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"wrote {out}: {rows['capture_requests']} requests, {rows['steps']} steps of server "
        f"{meta['vllm']['server_id']} from {window['since']} to {window['until']}")
