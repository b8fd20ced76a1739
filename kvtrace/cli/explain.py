"""`kvtrace explain`: why a request was slow, and the requests that fared worst (the figures:
analyses/request_story.sql, wait_causes.sql, preemptions.sql, itl_cliffs.sql, worst_requests.sql,
lookahead_preemptions.sql; gathered by kvtrace/views/explain.py)."""
from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Annotated

import typer
from rich.console import Console

from kvtrace.cli.app import app, user_errors
from kvtrace.errors import KvtraceError


class WorstBy(str, Enum):
    ttft = "ttft"
    e2e = "e2e"
    itl = "itl"
    preemptions = "preemptions"


@app.command()
@user_errors
def explain(
    run: Annotated[str, typer.Argument(help="The run folder.", show_default=False)],
    request: Annotated[str | None, typer.Argument(
        help="The request, REQ_ID or REQ_ID:SAMPLE (sample 0 unless given); in a capture, also the client's "
             "X-Request-Id or a unique start of an id.", show_default=False)] = None,
    worst: Annotated[int | None, typer.Option(
        "--worst", help="Instead of one request: the N worst, each with its verdict.", show_default=False)] = None,
    by: Annotated[WorstBy, typer.Option(help="With --worst: ranked by ttft, e2e, itl (the longest gap) or "
                                             "preemptions.")] = WorstBy.e2e,
    at: Annotated[str | None, typer.Option(
        "--at", help="Instead of one request: those in flight at a time. A capture's run takes the wall clock "
                     "(02:14, 02:14:30, an ISO time, UTC); any run takes run seconds as +12.5.",
        show_default=False)] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the same as JSON (docs/explain.md).")] = False,
) -> None:
    """Why was this request slow? Its life as phases with times (queued, prefill, decode, preempted,
    waiting to resume, re-prefill, finished); each wait with its causes by share of time (no seat,
    token budget spent, no free blocks, a preemption in the step); each preemption with the request
    that needed the blocks (and, under speculative decoding, whether only its drafts and lookahead slots
    needed them), why the policy chose this victim, the KV positions lost and what came back
    from the prefix cache or was computed again; each inter-token gap above the run's p99; a verdict.

    With --worst N, the N worst requests of the run instead, each with its one-line verdict; with --at
    TIME, the requests in flight then. A capture's run prints wall-clock times (UTC).

    Example: kvtrace explain traces/runs/thrash B:0 ; kvtrace explain traces/runs/thrash --worst 5 --by ttft ;
    kvtrace explain runs/incident abc (the request sent with X-Request-Id: abc) ; kvtrace explain runs/incident --at 02:14
    """
    if sum(x is not None for x in (request, worst, at)) != 1:
        raise KvtraceError("give one of a request (REQ_ID[:SAMPLE] or an X-Request-Id), --worst N or --at TIME")
    from kvtrace.views import explain as stories   # duckdb: only for this command

    ex = stories.Explainer.open(run)
    if worst is not None:
        data = stories.worst(ex, worst, by.value)
        render = stories.render_worst
    elif at is not None:
        data = stories.in_flight(ex, ex.run_time(at))
        render = stories.render_in_flight
    else:
        req_id, sample = stories.parse_request(request, ex.request_ids())
        data = stories.story(ex, req_id, sample)
        render = stories.render_story
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    Console(soft_wrap=False).print(render(data))
