"""`kvtrace capture`: a capture folder of live vLLM traffic (kvtrace/vllm/live.py, docs/vllm.md).

`ls` lists the servers that wrote there (of several folders side by side: a fleet), `run` cuts any
window of their traffic into a run, of one server or several joined (kvtrace/vllm/fleet.py). The
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

TIME_HELP = "An ISO 8601 time (UTC unless it names its zone, e.g. 2026-12-01T03:00:00Z) or Unix seconds."
CAPTURES_HELP = ("The capture folder the server writes (KVTRACE_CAPTURE_DIR of `kvtrace vllm-env`); several "
                 "side by side (a fleet, one folder per host) read as one.")


@capture_app.command("ls")
@user_errors
def ls(
    captures: Annotated[list[Path], typer.Argument(help=CAPTURES_HELP, show_default=False)],
    as_json: Annotated[bool, typer.Option("--json", help="The same as JSON.")] = False,
) -> None:
    """Each server that wrote into the folder: its data-parallel rank and host, its start, pid, vLLM
    version, model and scheduling mode, the time span its kept chunks cover, its requests, their size
    and the gaps retention left. A `vllm serve` with --data-parallel-size N writes N servers, one per rank.

    Example: kvtrace capture ls /var/lib/kvtrace/capture
    """
    from kvtrace.vllm import live

    if as_json:
        print(live.ls_json(captures))
        return
    for line in live.ls_lines(captures):
        print(line)


@capture_app.command("run")
@user_errors
def run(
    captures: Annotated[list[Path], typer.Argument(help=CAPTURES_HELP, show_default=False)],
    out: Annotated[Path, typer.Option("--output", "-o", help="The run folder to write.", show_default=False)],
    since: Annotated[str | None, typer.Option(help="The window's start. " + TIME_HELP, show_default=False)] = None,
    until: Annotated[str | None, typer.Option(help="The window's end (default: the newest data). " + TIME_HELP,
                                              show_default=False)] = None,
    last: Annotated[str | None, typer.Option(help="The window is the last D (15m, 90s, 2h) before --until or the "
                                                  "newest data.", show_default=False)] = None,
    server: Annotated[list[str] | None, typer.Option(
        help="A server to take (an id of `capture ls`, or a unique start of one); repeat for several. Default: "
             "every server that captured something in the window.", show_default=False)] = None,
    rank: Annotated[list[int] | None, typer.Option(
        help="The servers of a data-parallel rank to take; repeat for several.", show_default=False)] = None,
) -> None:
    """A run of the live traffic in a window, in the trace format: every request whose life overlaps
    it, those already in flight at its start and those still in flight at its end marked as such
    (the capture_requests table). Request ids are vLLM's own. Every analysis, the dashboard, report,
    compare, explain and the Perfetto export read it like any run.

    The servers chosen (by default every server of the folders that captured something in the window:
    the ranks of a data-parallel `vllm serve`, a fleet's hosts) are joined into one run: each row
    carries its server's label (`dp0`, `dp1`; the `server` column), request ids become `dp0/<vLLM's id>`,
    and each server keeps its own steps and KV pool. A run of one server is as before.

    Example: kvtrace capture run /var/lib/kvtrace/capture -o runs/incident --since 2026-12-01T03:00Z --until 2026-12-01T03:20Z
    """
    from kvtrace.vllm import fleet, live

    lo = live.parse_time(since, "--since") if since is not None else None
    hi = live.parse_time(until, "--until") if until is not None else None
    span = live.parse_duration(last, "--last") if last is not None else None
    meta = fleet.capture_run(captures, out, since=lo, until=hi, last=span, server_ids=server or [],
                             ranks=rank or [], command=" ".join(["kvtrace", *sys.argv[1:]]))
    window = meta["capture"]["window"]
    rows = meta["summary"]["rows"]
    servers = meta["capture"]["servers"]
    which = (f"server {meta['vllm']['server_id']}" if len(servers) == 1 else
             f"{len(servers)} servers ({', '.join(s['label'] for s in servers)})")
    Console(stderr=True, highlight=False, soft_wrap=True).print(
        f"wrote {out}: {rows['capture_requests']} requests, {rows['steps']} steps of {which} "
        f"from {window['since']} to {window['until']}")
