"""Analyses on a trace of large counts (the trace-scale generator at 1M events: 10k requests,
880k inter-token gaps, 12k preemptions, 7.6M recomputed tokens): the approximate percentiles
against exact ones, the dashboard's labels at 80 columns, and the memory settings."""
from __future__ import annotations

import io

import duckdb
import pytest
from rich.console import Console

from benchmarks import trace_scale
from kvtrace.cli.view import dashboard_view
from kvtrace.errors import KvtraceError
from kvtrace.trace import db
from kvtrace.views import dashboard

pytestmark = pytest.mark.long  # a trace of a million events

LEVELS = [0.0, 0.001, 0.01, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 0.999, 1.0]
STATED_ERROR = 0.001     # the analyses' headers: each percentile within 0.1% of the exact one


@pytest.fixture(scope="module")
def big_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("scale") / "big"
    trace_scale.generate(run, 1_000_000, seed=1, chunk_rows=200_000)
    return run


def exact(con, levels: list[float]) -> dict[str, list[float]]:
    """quantile_cont over every value: what the histograms stand in for."""
    rows = con.sql(f"SELECT metric, quantile_cont(ms, {levels}) FROM _latency_samples GROUP BY metric").fetchall()
    return dict(rows)


def test_percentiles_within_their_stated_error(big_run):
    con = db.connect([big_run])
    truth = exact(con, [0.5, 0.9, 0.95, 0.99, 0.999])
    stats = db.run_analysis(con, "latency").to_pylist()
    assert {row["metric"] for row in stats} == set(truth) == {"ttft", "tpot", "itl", "e2el", "queueing"}
    counts = dict(con.sql("SELECT metric, count(*) FROM _latency_samples GROUP BY metric").fetchall())
    for row in stats:
        assert row["num_values"] == counts[row["metric"]]
        got = [row[k] for k in ("p50_ms", "p90_ms", "p95_ms", "p99_ms", "p999_ms")]
        for level, value, true in zip([0.5, 0.9, 0.95, 0.99, 0.999], got, truth[row["metric"]]):
            assert value == pytest.approx(true, rel=STATED_ERROR, abs=1e-9), (row["metric"], level)
    # the ITL has 880k gaps in a few thousand bins: the histogram is far smaller than the values
    bins = con.sql("SELECT count(*) FROM _latency_hist WHERE metric = 'itl'").fetchall()[0][0]
    assert bins < counts["itl"] / 50


def test_cdf_levels_within_their_stated_error_and_the_tail_exact(big_run):
    con = db.connect([big_run])
    cdf = db.run_analysis(con, "latency_cdf", points=20, tail=5).to_pylist()
    itl = [row for row in cdf if row["metric"] == "itl"]
    levels = sorted({row["cdf"] for row in itl if row["cdf"] in [i / 20 for i in range(20)]})
    assert len(levels) == 20
    truth = dict(zip(levels, exact(con, levels)["itl"]))
    for row in itl:
        if row["cdf"] in truth:
            assert row["value_ms"] == pytest.approx(truth[row["cdf"]], rel=STATED_ERROR), row["cdf"]
    largest = [r[0] for r in con.sql("SELECT ms FROM _latency_samples WHERE metric = 'itl' "
                                     "ORDER BY ms DESC LIMIT 5").fetchall()]
    assert [row["value_ms"] for row in itl[-5:]] == sorted(largest)
    assert itl[-1]["cdf"] == 1.0 and itl[0]["cdf"] == 0.0


def test_cliff_threshold_within_its_stated_error(big_run):
    con = db.connect([big_run])
    p50, p99 = exact(con, [0.5, 0.99])["itl"]
    row = db.run_analysis(con, "itl_cliff_summary").to_pylist()[0]
    assert row["itl_p50_ms"] == pytest.approx(p50, rel=STATED_ERROR)
    assert row["itl_p99_ms"] == pytest.approx(p99, rel=STATED_ERROR)
    threshold = max(5 * row["itl_p50_ms"], row["itl_p99_ms"])
    assert row["threshold_ms"] == pytest.approx(threshold)
    cliffs = sum(r["cliffs"] for r in db.run_analysis(con, "itl_cliff_summary").to_pylist())
    above = con.sql(f"SELECT count(*) FROM _itl WHERE gap_ms > {row['threshold_ms']}").fetchall()[0][0]
    assert cliffs == above > 0


def test_dashboard_labels_whole_at_80_columns(big_run):
    width = 80
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(dashboard_view([big_run], {}, width, None, None))
    text = console.export_text()
    assert "…" not in text, text
    assert max(len(line) for line in text.splitlines()) <= width
    s = db.run_analysis(db.connect([big_run]), "summary").to_pylist()[0]
    assert s["preemptions"] > 10_000 and s["recomputed_tokens"] > 1_000_000   # the counts are large
    for label in ("throughput", "goodput", "TTFT", "TPOT", "ITL", "E2E", "preemptions", "recomputed",
                  "prefill interference", "swap wait", "re-prefill"):
        assert any(line.startswith(label + " ") or f" {label} " in line for line in text.splitlines()), label
    assert f"preemptions {dashboard.fmt_num(s['preemptions'])} (" in text
    assert f"{dashboard.fmt_num(s['recomputed_tokens'], 'tok')} (53% of compute)" in text


def test_short_numbers():
    assert [dashboard.fmt_num(v) for v in (9_999, 10_000, 12_351, 121_273, 999_499, 999_999, 75_032_029,
                                           1.2e9, -45_600)] == [
        "9,999", "10.0k", "12.4k", "121k", "999k", "1.00M", "75.0M", "1.20G", "-45.6k"]
    assert dashboard.fmt_num(2_399.4, "tok/s") == "2,399 tok/s"


def test_memory_settings(monkeypatch, tmp_path, big_run):
    monkeypatch.setenv("KVTRACE_MEMORY_LIMIT", "300MB")
    monkeypatch.setenv("KVTRACE_TEMP_DIR", str(tmp_path / "spill"))
    monkeypatch.setenv("KVTRACE_THREADS", "1")
    con = db.connect([big_run])
    settings = dict(con.sql("SELECT name, value FROM duckdb_settings() WHERE name IN "
                            "('memory_limit', 'temp_directory', 'threads')").fetchall())
    assert settings["temp_directory"] == str(tmp_path / "spill")
    assert settings["threads"] == "1"
    assert settings["memory_limit"].startswith(("286", "300"))      # DuckDB says it in MiB
    monkeypatch.setenv("KVTRACE_MEMORY_LIMIT", "lots")
    with pytest.raises(KvtraceError, match="KVTRACE_MEMORY_LIMIT='lots'"):
        db.connect([big_run])


def test_perfetto_export_in_bounded_memory(monkeypatch, tmp_path, big_run):
    """The engine track read a range of steps at a time fits DuckDB memory that its stream read
    whole does not (at 10M events it needed more than 256 MB; here, at 1M, more than 56 MB)."""
    from kvtrace.export import perfetto
    monkeypatch.setattr(perfetto, "DUCKDB_MEMORY", "56MB")
    monkeypatch.setattr(perfetto, "EVENTS_PER_READ", 100_000)
    summary = perfetto.export_perfetto([big_run], tmp_path / "ranges.pftrace")
    assert summary.num_kv_events == 977_176
    monkeypatch.setattr(perfetto, "EVENTS_PER_READ", 10**12)       # one read: the whole stream
    with pytest.raises(duckdb.OutOfMemoryException):
        perfetto.export_perfetto([big_run], tmp_path / "whole.pftrace")
    assert not (tmp_path / "whole.pftrace").exists()


def test_thrash_windows_are_the_sliding_frame(big_run):
    """_thrash_steps sums each step's window as a difference of running sums (a scan, not a
    sliding frame); on 22k steps it must give what the RANGE frame it stands for gives."""
    con = db.connect([big_run])
    frame = con.sql("""
        SELECT step, count(*) OVER w, sum(preemptions) OVER w, sum(recompute_tokens) OVER w,
               sum(prefill_tokens + decode_tokens) OVER w,
               count(*) FILTER (WHERE used_blocks >= 0.95 * total_blocks) OVER w
        FROM steps
        WINDOW w AS (PARTITION BY run_id ORDER BY end_s / 5 RANGE BETWEEN 1 PRECEDING AND CURRENT ROW)
        ORDER BY step""").fetchall()
    running = con.sql("""
        SELECT step, window_steps, window_preemptions, recompute_share, full_pool_share, preempt_per_s
        FROM _thrash_steps(5, 0.95, 1, 0.2, 0.5) ORDER BY step""").fetchall()
    assert len(frame) == len(running) > 20_000
    for (step, steps, preempts, recomputed, processed, full), got in zip(frame, running):
        assert got == (step, steps, preempts, recomputed / processed if processed else 0, full / steps, preempts / 5)
    assert 0 < sum(got[2] > 0 for got in running) < len(running)   # windows with and without preemptions


def test_thrash_window_includes_a_step_exactly_window_s_before(tmp_path):
    """A step that ended exactly window_s before another is in that step's window (the frame's
    RANGE 1 PRECEDING includes it): the golden run's steps end every 0.25 s, exact in binary."""
    from tests.helpers.tracegen import recompute_run

    con = db.connect([recompute_run(tmp_path)])
    frame = con.sql("""
        SELECT step, count(*) OVER w, sum(preemptions) OVER w FROM steps
        WINDOW w AS (PARTITION BY run_id ORDER BY end_s / 0.5 RANGE BETWEEN 1 PRECEDING AND CURRENT ROW)
        ORDER BY step""").fetchall()
    running = con.sql("SELECT step, window_steps, window_preemptions FROM _thrash_steps(0.5, 0.95, 1, 0.2, 0.5) "
                      "ORDER BY step").fetchall()
    assert running == frame
    assert [steps for _, steps, _ in running] == [1, 2, 3, 3, 3, 3]


def test_kept_thrash_helpers_answer_only_for_their_params(tmp_path):
    """The dashboard computes the thrash helpers once (db.keep_calls); called again with the kept
    params they give the same rows, with other params they fail rather than answer for the kept."""
    from tests.helpers.tracegen import recompute_run

    con = db.connect([recompute_run(tmp_path)])
    params = db.analysis_params("thrash")
    fresh = db.records(db.run_analysis(con, "thrash"))
    db.keep_calls(con, "_thrash_steps", "_thrash_windows", "_thrash", **params)
    assert db.records(db.run_analysis(con, "thrash")) == fresh
    with pytest.raises(KvtraceError, match="kept for other params"):
        db.run_analysis(con, "thrash", window_s=2)


STALL_SPANS = """SELECT run_id, req_id, sample, state, start_s, end_s, start_seq FROM {}
                 ORDER BY run_id, req_id, sample, start_s, start_seq"""


def _stall_edge_run(root):
    """Stalls whose next mark is each kind of mark, ties included (a preempt with a later event of
    its time, a finish at a stall's time, a first token or an arrival inside a stall, a stall with
    no later mark, an interrupted re-prefill, a re-prefill ending with its step, an event after
    the finish)."""
    from tests.helpers.tracegen import write_run

    def request(req_id, arrival_s, first_token_s, finish_s):
        return {"req_id": req_id, "sample": 0, "n": 1, "arrival_s": arrival_s, "first_token_s": first_token_s,
                "finish_s": finish_s, "finish_reason": "length" if finish_s is not None else None}

    # every admit and preempt before its step's end (one stamped at or after it is marked at the
    # step's start, as a vLLM capture's are: test_sql_helpers); step 9 has no steps row
    marks = [  # req_id, step, ts_s, kind, reason
        ("P", 0, 0.1, "admit", "new"), ("P", 1, 0.3, "preempt", "recompute"),
        ("P", 1, 0.3, "admit", "resume-recompute"), ("P", 1, 0.3, "reprefill", None),
        ("P", 3, 0.6, "preempt", "swap"),
        ("Q", 0, 0.1, "admit", "new"), ("Q", 1, 0.2, "preempt", "recompute"),
        ("Q", 2, 0.3, "admit", "resume-recompute"), ("Q", 2, 0.35, "reprefill", "interrupted"),
        ("Q", 2, 0.4, "preempt", "recompute"),
        ("R", 0, 0.1, "admit", "new"), ("R", 3, 0.7, "preempt", "swap"),
        ("S", 0, 0.1, "admit", "new"), ("S", 3, 0.5, "preempt", "recompute"), ("S", 9, 0.8, "admit", "resume-recompute"),
        ("T", 9, 0.9, "preempt", "recompute"), ("T", 9, 1.2, "admit", "resume-recompute"),
        ("T", 9, 1.2, "reprefill", None),
    ]
    events = [{"seq": seq, "step": step, "ts_s": ts_s, "kind": kind, "req_id": req_id, "sample": 0,
               "reason": reason} for seq, (req_id, step, ts_s, kind, reason) in enumerate(marks)]
    steps = [{"step": step, "start_s": end_s - 0.1, "end_s": end_s} for step, end_s in enumerate([0.15, 0.5, 0.45, 0.8])]
    requests = [request("P", 0.0, 0.2, 0.6), request("Q", 0.0, 0.25, 0.5), request("R", 0.0, 0.2, None),
                request("S", 0.0, 0.2, 0.5),
                request("T", 1.0, None, 1.5)]
    return write_run(root, "edge", requests=requests, steps=steps, kv_events=events)


def test_stall_spans_are_the_sequence_spans_of_the_stall_states(big_run, tmp_path):
    """_stall_spans (what the cliffs and the most preempted read) is computed without the window
    over every mark; it must give the rows of _sequence_spans in the states preempted, swapped
    and reprefill: on the 1M-event trace, the golden runs and runs of edge cases."""
    from tests.helpers.tracegen import recompute_run, swap_run

    edge = _stall_edge_run(tmp_path)
    for run in (big_run, edge, recompute_run(tmp_path), swap_run(tmp_path)):
        con = db.connect([run])
        spans = con.sql(STALL_SPANS.format(
            "_sequence_spans WHERE state IN ('preempted', 'swapped', 'reprefill')")).fetchall()
        assert con.sql(STALL_SPANS.format("_stall_spans")).fetchall() == spans, run.name
        assert spans
        if run == edge:
            # the tie at 0.3, the finishes at 0.5 (S) and 0.6 (P) and T's re-prefill done at once end
            # theirs at once
            # (no span); the first token ends Q's first stall, an arrival T's, and R's has no end
            assert [row[1:6] for row in spans] == [
                ("P", 0, "reprefill", 0.3, 0.5), ("Q", 0, "preempted", 0.2, 0.25),
                ("Q", 0, "reprefill", 0.3, 0.4), ("Q", 0, "preempted", 0.4, 0.5),
                ("T", 0, "preempted", 0.9, 1.0)]
