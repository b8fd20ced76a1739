"""What `kvtrace explore` shows, gathered from the SQL library; no Textual here (the app, in
kvtrace/views/explore.py, only lays these out).

One `RunData` per run, on a connection of its own: the dashboard's figures (dashboard.collect),
the requests table (request_summary.sql), one request's story (kvtrace explain's, from
request_story, wait_causes and preemptions) and its timeline against the pool (request_pool.sql),
what ran in a step (step_sequences.sql and the step's row of `steps`). Each is computed once and
kept.
"""
from __future__ import annotations

import functools
from pathlib import Path

from kvtrace.trace import db
from kvtrace.views import dashboard, explain

TIMELINE_BUCKETS = 60     # intervals of a request's timeline where the width is not known


def list_runs(runs: list[str]) -> list[dict]:
    """The runs named by `runs` (as `kvtrace analyze` finds them), one row each from the `runs`
    table: run_id, path, status, model, device, workload and its requests."""
    con = db.connect(runs)
    return db.records(con.sql("""
        SELECT run_id, path, status, model, device, preemption_mode, preemption_policy, num_gpu_blocks,
               block_size, workload_path, workload_requests
        FROM runs ORDER BY ordinal""").to_arrow_table())


class RunData:
    """One run's figures for the explorer, each read once from the SQL library."""

    def __init__(self, path: str | Path) -> None:
        self.con = db.connect([path])
        self.run_id: str = self.con.execute("SELECT run_id FROM runs").fetchall()[0][0]
        self._overview: dict[int, dict] = {}

    def overview(self, width: int) -> dict:
        """The dashboard's figures of the run (one run of dashboard.collect's), its pool strip
        `dashboard.strip_width(width)` intervals wide."""
        buckets = dashboard.strip_width(width)
        if buckets not in self._overview:
            data = dashboard.collect(self.con, buckets=buckets, top=dashboard.default_top(width))
            self._overview[buckets] = {"fig": data["runs"][0], "params": data["params"]}
        return self._overview[buckets]

    @functools.cached_property
    def requests(self) -> list[dict]:
        """request_summary.sql's rows: one per sequence, in order of arrival."""
        return db.records(db.run_analysis(self.con, "request_summary"))

    def request(self, req_id: str, sample: int) -> dict | None:
        """One sequence's row of the requests table, or None if the run has no such sequence."""
        return next((r for r in self.requests if r["req_id"] == req_id and r["sample"] == sample), None)

    @functools.cache
    def timeline(self, req_id: str, sample: int, buckets: int = TIMELINE_BUCKETS) -> list[dict]:
        """request_pool.sql's rows: the sequence's life in `buckets` intervals, its state and the
        pool's occupancy in each."""
        return db.records(db.run_analysis(self.con, "request_pool", req_id=req_id, sample=sample, buckets=buckets))

    @functools.cached_property
    def explainer(self) -> explain.Explainer:
        return explain.Explainer(self.con, self.run_id)

    @functools.cache
    def story(self, req_id: str, sample: int) -> dict:
        """The sequence's story as `kvtrace explain` tells it (kvtrace/views/explain.py's story():
        phases, waits with their causes, preemptions with their requesters, gaps, verdict)."""
        return explain.story(self.explainer, req_id, sample)

    @functools.cache
    def step(self, step: int) -> dict | None:
        """The step's row of `steps` with `sequences`, step_sequences.sql's rows; None if the run
        has no such step."""
        found = db.records(self.con.sql("SELECT * FROM steps WHERE step = ?", params=[step]).to_arrow_table())
        if not found:
            return None
        return {**found[0], "sequences": db.records(db.run_analysis(self.con, "step_sequences", step=step))}

    @functools.cached_property
    def last_step(self) -> int:
        return self.con.execute("SELECT coalesce(max(step), 0) FROM steps").fetchall()[0][0]

    def step_at(self, ts_s: float) -> int | None:
        """The step running at `ts_s` (the first to end at or after it)."""
        return self.con.execute("SELECT min(step) FROM steps WHERE end_s >= ?", [ts_s]).fetchall()[0][0]
