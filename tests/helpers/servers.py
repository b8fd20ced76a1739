"""A run joined from several servers' captures against each server's run alone (tests/vllm/test_capture_fleet.py,
test_vllm_data_parallel.py): a server's rows of the joined run, its label taken off, must be the rows of
its run alone."""
from __future__ import annotations

import pytest

from kvtrace.trace import db

# a joined run numbers its KV events again (kv_events.seq: one order for the run)
SEQ = ("seq", "first_seq")


def rows_of(con, analysis: str, **params) -> list[dict]:
    return [{k: v for k, v in r.items() if k not in ("run_id", *SEQ)}
            for r in db.records(db.run_analysis(con, analysis, **params))]


def unlabelled(rows: list[dict], label: str) -> list[dict]:
    """A joined run's rows of one server as the run of that server alone has them: no label."""
    out = []
    for row in rows:
        if row.get("server", label) != label or not str(row.get("req_id") or f"{label}/").startswith(f"{label}/"):
            continue
        row = {**row, "server": ""} if "server" in row else dict(row)
        for key in ("req_id", "requester_req_id", "preempted_for"):
            if isinstance(row.get(key), str):
                row[key] = row[key].removeprefix(f"{label}/")
        out.append(row)
    return out


def same(got: list[dict], expected: list[dict], name: str) -> None:
    def approx(row):
        return {k: pytest.approx(v, rel=1e-9, abs=1e-9) if isinstance(v, float) else v for k, v in row.items()}
    assert got == [approx(r) for r in expected], name


def assert_each_server_alone(joined, alone, label: str, analyses: list[tuple[str, dict, dict]]) -> None:
    """Each analysis's rows of server `label` in the joined run's connection are those of its run alone:
    `analyses` are (name, params on the joined run, params on the run alone), a str param formatted with
    the label ({label}); and its thrash_servers row is its run's thrash row."""
    for name, joined_params, alone_params in analyses:
        got = rows_of(joined, name, **{k: v.format(label=label) if isinstance(v, str) else v
                                       for k, v in joined_params.items()})
        same(unlabelled(got, label), rows_of(alone, name, **alone_params), name)
    (server,) = [r for r in rows_of(joined, "thrash_servers") if r["server"] == label]
    same([{k: v for k, v in server.items() if k != "server"}], rows_of(alone, "thrash"), "thrash_servers")
