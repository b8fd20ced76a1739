"""What a replay takes from the workload: arrivals on the replay clock, and counts that must be
positive (checked when the file is read, before anything runs)."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

import kvtrace.cli  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from kvtrace.trace.db import connect
from tests.test_record import record, write_workload


def test_time_scale_divides_the_arrival_times(tmp_path):
    workload = write_workload(tmp_path / "w.jsonl", [
        {"id": f"r{i}", "arrival_s": 0.4 * i, "prompt_tokens": 6, "max_tokens": 2} for i in range(4)])
    result, run = record(tmp_path, workload, "fast", "--block-size", "4", "--time-scale", "4")
    assert result.exit_code == 0, result.output
    con = connect([run])
    arrivals = con.sql("SELECT req_id, arrival_s FROM requests ORDER BY req_id").fetchall()
    assert arrivals == [("r0", 0.0), ("r1", pytest.approx(0.1)), ("r2", pytest.approx(0.2)),
                        ("r3", pytest.approx(0.3))]
    # nothing is scheduled before it arrives, and the last arrives at 0.3 s, not 1.2 s
    early = con.sql("SELECT count(*) FROM requests WHERE first_scheduled_s < arrival_s").fetchall()
    assert early == [(0,)]
    [(first_scheduled,)] = con.sql("SELECT max(first_scheduled_s) FROM requests").fetchall()
    assert 0.3 <= first_scheduled < 1.2
    meta = json.loads((run / "meta.json").read_text())
    assert meta["replay"] == {"mode": "time-scale", "time_scale": 4.0}


@pytest.mark.parametrize("field, value", [
    ("max_tokens", -3), ("n", -1), ("prompt_tokens", -5), ("prefix_tokens", -2)])
def test_negative_counts_are_refused(tmp_path, field, value):
    row = {"id": "a", "arrival_s": 0, "prompt_tokens": 8, "max_tokens": 2}
    if field == "prefix_tokens":
        row["prefix_group"] = "g"
    row[field] = value
    path = write_workload(tmp_path / "w.jsonl", [{"id": "ok", "arrival_s": 0, "prompt_tokens": 4, "max_tokens": 2},
                                                 row])
    result = CliRunner().invoke(app, ["workload", "check", str(path)])
    assert result.exit_code == 2, result.output
    assert result.stderr == f"kvtrace: error: {path}: line 2: {field} must be >= 1, got {value}\n"
    assert result.stdout == ""
