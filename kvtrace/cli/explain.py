"""`kvtrace explain`: why a request was slow, and the requests that fared worst (the figures:
analyses/request_story.sql, wait_causes.sql, preemptions.sql, itl_cliffs.sql, worst_requests.sql;
gathered by kvtrace/views/explain.py)."""
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
        help="The request, REQ_ID or REQ_ID:SAMPLE (sample 0 unless given).", show_default=False)] = None,
    worst: Annotated[int | None, typer.Option(
        "--worst", help="Instead of one request: the N worst, each with its verdict.", show_default=False)] = None,
    by: Annotated[WorstBy, typer.Option(help="With --worst: ranked by ttft, e2e, itl (the longest gap) or "
                                             "preemptions.")] = WorstBy.e2e,
    as_json: Annotated[bool, typer.Option("--json", help="Print the same as JSON (docs/explain.md).")] = False,
) -> None:
    """Why was this request slow? Its life as phases with times (queued, prefill, decode, preempted,
    waiting to resume, re-prefill, finished); each wait with its causes by share of time (no seat,
    token budget spent, no free blocks, a preemption in the step); each preemption with the request
    that needed the blocks, why the policy chose this victim, the KV positions lost and what came back
    from the prefix cache or was computed again; each inter-token gap above the run's p99; a verdict.

    With --worst N, the N worst requests of the run instead, each with its one-line verdict.

    Example: kvtrace explain traces/runs/thrash B:0 ; kvtrace explain traces/runs/thrash --worst 5 --by ttft
    """
    if (request is None) == (worst is None):
        raise KvtraceError("give a request (REQ_ID[:SAMPLE]) or --worst N, not both" if request is not None
                           else "give a request (REQ_ID[:SAMPLE]) or --worst N")
    from kvtrace.views import explain as stories   # duckdb: only for this command

    ex = stories.Explainer.open(run)
    if worst is not None:
        data = stories.worst(ex, worst, by.value)
        render = stories.render_worst
    else:
        req_id, sample = stories.parse_request(request, ex.request_ids())
        data = stories.story(ex, req_id, sample)
        render = stories.render_story
    if as_json:
        sys.stdout.write(json.dumps(data, indent=2, default=str) + "\n")
        return
    Console(soft_wrap=False).print(render(data))
