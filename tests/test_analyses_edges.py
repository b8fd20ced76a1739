"""Values of the SQL library at the edges the golden runs do not reach (each test here was written
for a mutant of analyses/_*.sql that no other test noticed: scripts/mutation.py, issue 20)."""
from __future__ import annotations

import pytest

from kvtrace import db
from tests.tracegen import write_run

approx = pytest.approx


def rows(con, name: str, **params) -> list[dict]:
    return db.run_analysis(con, name, **params).to_pylist()


def by_run(result: list[dict]) -> dict:
    return {r["run_id"]: r for r in result}


def request(req_id: str, arrival_s: float, finish_s: float, **extra) -> dict:
    row = {"req_id": req_id, "sample": 0, "n": 1, "priority": 0, "arrival_s": arrival_s, "prompt_tokens": 4,
           "max_tokens": 2, "output_tokens": 2, "first_scheduled_s": arrival_s, "first_token_s": finish_s,
           "finish_s": finish_s, "finish_reason": "length", "preemptions": 0, "swaps": 0,
           "recomputed_tokens": 0, "prefix_hit_tokens": 0}
    return {**row, **extra}


def step(i: int, start_s: float, end_s: float, **extra) -> dict:
    row = {"step": i, "start_s": start_s, "end_s": end_s, "prefill_tokens": 0, "decode_tokens": 1,
           "recompute_tokens": 0, "preemptions": 0, "used_blocks": 1, "total_blocks": 8, "device_ms": 1.0}
    return {**row, **extra}


# ---------------------------------------------------------------- a run's span (every rate's denominator)

def test_a_runs_span_is_from_the_first_arrival_or_step_to_the_last_step_or_finish(tmp_path):
    # "late": the first request arrives before the first step starts, and a request rejected after the
    # last step finishes last: span 0 -> 3 s
    late = write_run(tmp_path, "late", steps=[step(0, 0.25, 1.0), step(1, 1.0, 2.0)],
                     requests=[request("A", 0.0, 2.0), request("B", 0.5, 1.0),
                               request("C", 3.0, 3.0, output_tokens=0, first_token_s=None,
                                       first_scheduled_s=None, finish_reason="rejected")])
    # "killed": a run cut short: the steps began before, and ended after, the only request it finished
    killed = write_run(tmp_path, "killed", steps=[step(0, 0.0, 1.0), step(1, 1.0, 2.0), step(2, 2.0, 3.0)],
                       requests=[request("A", 0.5, 2.0)])
    con = db.connect([late, killed])
    # the helper's documented columns (`kvtrace sql` shows them), then the rates that divide by it
    span = {r["run_id"]: (r["start_s"], r["end_s"], r["duration_s"])
            for r in con.sql("SELECT * FROM _run_span").to_arrow_table().to_pylist()}
    assert span == {"late": (0.0, 3.0, 3.0), "killed": (0.0, 3.0, 3.0)}
    got = by_run(rows(con, "throughput"))
    assert (got["late"]["duration_s"], got["late"]["request_throughput"]) == (approx(3.0), approx(2 / 3))
    assert got["killed"]["duration_s"] == approx(3.0)
    (first, *_, last) = [r for r in rows(con, "pool_timeline", buckets=3) if r["run_id"] == "late"]
    assert (first["start_s"], last["end_s"]) == (approx(0.0), approx(3.0))
