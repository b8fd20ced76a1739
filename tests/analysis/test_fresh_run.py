"""The dashboard and the report of runs recorded here, by the engine and the recorder, during the
test: a change anywhere on the way (scheduler, block manager, recorder, SQL, presentation) reaches
them. The committed runs under tests/fixtures/runs only exercise the presentation.

The four-block story of tests/engine/test_preemption.py: A and B fill the 4-block pool; at step 2 A needs
a block and B is preempted (recompute: 8 positions computed again; swap: 2 blocks out and in).
"""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.trace import db
from tests.helpers.report import specs_of

pytestmark = pytest.mark.long  # records runs through the engine and the CLI

runner = CliRunner()
MODES = ("recompute", "swap")


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("fresh")
    workload = root / "four.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "A", "arrival_s": 0, "prompt_token_ids": [11, 12, 13, 14, 15, 16, 17], "max_tokens": 6,
         "ignore_eos": True},
        {"id": "B", "arrival_s": 0, "prompt_token_ids": [21, 22, 23, 24, 25, 26, 27], "max_tokens": 4,
         "ignore_eos": True}]))
    for mode in MODES:
        result = runner.invoke(app, [
            "record", "--model", "tiny", "-w", str(workload), "-o", str(root / "runs" / mode), "-q",
            "--block-size", "4", "--num-gpu-blocks", "4", "--watermark", "0", "--no-enable-prefix-caching",
            "--backlog", "--preemption-mode", mode, "--num-cpu-blocks", "4"])
        assert result.exit_code == 0, result.output
    return root / "runs"


def bytes_per_block(run: Path) -> int:
    return json.loads((run / "meta.json").read_text())["kv_pool"]["bytes_per_block"]


def test_the_dashboard_figures_of_a_fresh_run(runs):
    result = runner.invoke(app, ["analyze", str(runs / "recompute"), str(runs / "swap"), "--json"])
    assert result.exit_code == 0, result.output
    figures = {f["run"]["run_id"]: f for f in json.loads(result.stdout)["runs"]}
    assert list(figures) == list(MODES)
    two_blocks = 2 * bytes_per_block(runs / "swap")
    for mode, recomputed, swapped in (("recompute", 8, 0), ("swap", 0, two_blocks)):
        summary = figures[mode]["summary"]
        assert (summary["completed_requests"], summary["output_tokens"], summary["preemptions"]) == (2, 10, 1), mode
        assert (summary["recomputed_tokens"], summary["swap_out_bytes"], summary["swap_in_bytes"]) == (
            recomputed, swapped, swapped), mode
        assert summary["output_tok_s"] > 0 and summary["duration_s"] > 0
        (victim,) = figures[mode]["most_preempted"]
        assert (victim["req_id"], victim["preemptions"], victim["swaps"], victim["recomputed_tokens"]) == (
            "B", 1, 1 if mode == "swap" else 0, recomputed)
        assert victim["stall_ms"] > 0
        latency = figures[mode]["latency"]
        assert (latency["ttft"]["num_values"], latency["itl"]["num_values"]) == (2, 8)  # gaps: A 5, B 3
        # thrash reads the steps table's preemptions: one in the default 5 s window
        assert figures[mode]["thrash"]["peak_preempt_per_s"] == pytest.approx(0.2)
        assert figures[mode]["thrash"]["verdict"] == "occasional"
        timeline = figures[mode]["pool_timeline"]
        assert sum(r["preemptions"] for r in timeline) == 1
        assert max(r["max_used_frac"] or 0 for r in timeline) == 1.0
    screen = runner.invoke(app, ["analyze", str(runs / "recompute")], env={"NO_COLOR": "1", "COLUMNS": "100"})
    assert screen.exit_code == 0, screen.output
    text = screen.stdout
    assert "preemptions 1 (1 seqs, 0 again)" in text and "recomputed 8 tok" in text
    assert "ITL: 8 gaps" in text
    assert re.search(r"^B\s+1×\s.*\s8 tok\s", text, re.MULTILINE), text


def chart_data(spec: dict) -> list[list[dict]]:
    """Every dataset of a Vega-Lite spec: top-level `datasets` and inline `data.values`, nested too."""
    found = [list(v) for v in spec.get("datasets", {}).values()]

    def walk(node):
        if isinstance(node, dict):
            data = node.get("data")
            if isinstance(data, dict) and "values" in data:
                found.append(data["values"])
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(spec)
    return found


def test_the_report_of_a_fresh_run_charts_its_data(runs, tmp_path):
    page = tmp_path / "report.html"
    result = runner.invoke(app, ["report", str(runs / "recompute"), str(runs / "swap"), "-o", str(page)])
    assert result.exit_code == 0, result.output
    specs = specs_of(page.read_text())
    data = {name: [row for rows in chart_data(spec) for row in rows] for name, spec in specs.items()}
    con = db.connect([runs])
    two_blocks = 2 * bytes_per_block(runs / "swap")

    def per_run(rows: list[dict], column: str) -> dict:
        return {mode: sum(r[column] or 0 for r in rows if r["run_id"] == mode) for mode in MODES}

    pool = data["pool_occupancy"]
    assert per_run(pool, "steps") == {m: n for m, n in con.sql(
        "SELECT run_id, count(*) FROM steps GROUP BY run_id").fetchall()}
    assert per_run(pool, "preemptions") == {"recompute": 1, "swap": 1}
    assert per_run(pool, "swap_out_bytes") == per_run(pool, "swap_in_bytes") == {"recompute": 0, "swap": two_blocks}
    assert {r["run_id"] for r in pool if r["max_used_frac"] == 1.0} == set(MODES)

    # the Gantt: B's stall between its preemption and its return, as the trace has it
    stalls = {(r["run_id"], r["req_id"], r["state"]): r for r in data["request_gantt"]
              if r["state"] in ("preempted", "swapped", "reprefill")}
    assert set(stalls) == {("recompute", "B", "preempted"), ("recompute", "B", "reprefill"), ("swap", "B", "swapped")}
    preempted_at = dict(con.sql("SELECT run_id, ts_s FROM kv_events WHERE kind = 'preempt'").fetchall())
    for mode, state in (("recompute", "preempted"), ("swap", "swapped")):
        assert stalls[(mode, "B", state)]["start_s"] == pytest.approx(preempted_at[mode])
        assert stalls[(mode, "B", state)]["duration_ms"] > 0

    # ITL CDF: 8 gaps per run, each kept exactly (the tail keeps the largest values one by one),
    # the levels between them within 0.1 % (latency_cdf.sql), rising to 1; TTFT and E2E: one point
    # per request, from the trace
    itl = [r for r in data["itl_cdf"] if r.get("metric") == "itl"]
    gaps = con.sql("SELECT run_id, (ts_s - lag(ts_s) OVER (PARTITION BY run_id, req_id, sample ORDER BY idx)) * 1000 "
                   "AS ms FROM tokens QUALIFY ms IS NOT NULL").fetchall()
    for mode in MODES:
        rows = sorted((r for r in itl if r["run_id"] == mode), key=lambda r: r["cdf"])
        assert rows[-1]["cdf"] == 1.0
        # rising with the share, up to the histogram's 0.1 % between a level and an exact tail value
        assert all(b["value_ms"] >= a["value_ms"] * 0.999 for a, b in zip(rows, rows[1:]))
        trace_gaps = sorted(ms for run_id, ms in gaps if run_id == mode)
        assert len(trace_gaps) == 8
        values = [r["value_ms"] for r in rows]
        # exact unless two gaps share a 0.1 %-wide bin, then within it (latency_cdf.sql's stated error)
        assert all(any(v == pytest.approx(g, rel=1e-3) for v in values) for g in trace_gaps)
        assert min(values) >= trace_gaps[0] * 0.999 and max(values) == pytest.approx(trace_gaps[-1], rel=1e-3)
    ttft = {(r["run_id"], round(r["value_ms"], 6)) for r in data["latency_distributions"] if r["metric"] == "ttft"}
    assert ttft == {(run_id, round(ms, 6)) for run_id, ms in con.sql(
        "SELECT run_id, (first_token_s - arrival_s) * 1000 FROM requests").fetchall()}
    causes = {r["cause"] for r in data["itl_cdf"] if "cause" in r}
    assert {"preempted", "swap_wait", "reprefill"} <= causes

    rates = data["recompute_swap"]
    assert per_run(rates, "recomputed_tokens") == {"recompute": 8, "swap": 0}
    assert per_run(rates, "processed_tokens") == {m: n for m, n in con.sql(
        "SELECT run_id, sum(prefill_tokens + decode_tokens) FROM steps GROUP BY run_id").fetchall()}
    assert {r["run_id"] for r in rates if r["swap_out_bytes_s"] > 0} == {"swap"}
