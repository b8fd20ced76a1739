"""Schema 5's KV-cache groups and drafts, read by the analyses, the dashboard and explain's figures.

Two hand-written runs of a capture: a hybrid model's (full attention beside a 64-token sliding window:
each group's allocations, the window's mid-request frees) and a drafting server's (steps' drafts and
acceptances, the spec_decode rows, a request's totals); and a run of kvtrace's engine, which records
neither (one group of full attention, no drafts).
"""
from __future__ import annotations

import io

from pytest import approx
from rich.console import Console

from kvtrace.trace import db
from kvtrace.views import dashboard
from tests.helpers.tracegen import write_run, write_table

GROUPS = [{"kind": "full_attention", "block_size": 4, "layers": 1},
          {"kind": "sliding_window", "block_size": 4, "sliding_window": 64, "layers": 1}]


def _step(step: int, **extra) -> dict:
    return {"step": step, "start_s": step * 0.1, "end_s": (step + 1) * 0.1, "prefill_tokens": 0, "decode_tokens": 4,
            "recompute_tokens": 0, "preemptions": 0, "used_blocks": 4, "total_blocks": 32, **extra}


def _event(seq: int, kind: str, blocks: list[int], reason: str, group: int | None) -> dict:
    return {"seq": seq, "step": seq, "ts_s": seq * 0.1, "kind": kind, "req_id": "a", "sample": 0, "blocks": blocks,
            "num_blocks": len(blocks), "num_tokens": 0, "bytes": 0, "reason": reason, "kv_group": group}


def _runs(tmp_path):
    write_run(tmp_path, "hybrid", meta={"kv_pool": {"kv_cache_groups": GROUPS}},
              steps=[_step(i) for i in range(6)],
              kv_events=[_event(0, "alloc", [1, 2, 3, 4], "prefill", 0), _event(1, "alloc", [5, 6, 7], "prefill", 1),
                         _event(2, "alloc", [8, 9], "decode", 0), _event(3, "alloc", [10], "decode", 1),
                         _event(4, "free", [5, 6], "window", 1),
                         _event(5, "free", [1, 2, 3, 4, 8, 9], "finish", 0), _event(6, "free", [7, 10], "finish", 1)])
    drafting = write_run(tmp_path, "drafting",
                         steps=[_step(0, prefill_tokens=8, decode_tokens=0, draft_tokens=0, accepted_tokens=0),
                                _step(1, draft_tokens=6, accepted_tokens=4),
                                _step(2, draft_tokens=6, accepted_tokens=2, recompute_tokens=3),
                                _step(3, draft_tokens=6, accepted_tokens=None)],   # its output never processed
                         requests=[{"req_id": "a", "sample": 0, "n": 1, "arrival_s": 0.0, "prompt_tokens": 8,
                                    "max_tokens": 8, "output_tokens": 8, "finish_s": 0.4, "finish_reason": "length",
                                    "preemptions": 0, "draft_tokens": 12, "accepted_tokens": 6}])
    write_table(drafting, "spec_decode", [
        {"step": s, "ts_s": 0.1 * s, "req_id": r, "sample": 0, "draft_tokens": 3, "accepted_tokens": a,
         "lookahead_slots": 3} for s, r, a in [(1, "a", 3), (1, "b", 1), (2, "a", 2), (2, "b", 0), (3, "a", None)]])
    write_run(tmp_path, "engine", steps=[_step(0)],
              kv_events=[{**_event(0, "alloc", [1], "prefill", None)}])
    return db.connect([tmp_path])


def test_each_groups_blocks_and_what_its_window_dropped(tmp_path):
    con = _runs(tmp_path)
    rows = {(r["run_id"], r["kv_group"]): r for r in db.records(db.run_analysis(con, "kv_groups"))}
    assert {k: (r["kind"], r["window_tokens"], r["layers"], r["alloc_blocks"], r["window_freed_blocks"])
            for k, r in rows.items() if k[0] == "hybrid"} == {
        ("hybrid", 0): ("full_attention", None, 1, 6, 0), ("hybrid", 1): ("sliding_window", 64, 1, 4, 2)}
    assert rows["hybrid", 0]["alloc_share"] == approx(0.6)
    # kvtrace's engine (and any run before schema 5): one group of full attention
    assert (rows["engine", 0]["kind"], rows["engine", 0]["alloc_blocks"], rows["engine", 0]["alloc_share"]) == (
        "full_attention", 1, 1.0)
    assert ("drafting", 0) in rows and ("engine", 1) not in rows


def test_drafts_accepted_and_rolled_back_beside_recompute(tmp_path):
    con = _runs(tmp_path)
    rows = {r["run_id"]: r for r in db.records(db.run_analysis(con, "spec_decode"))}
    d = rows["drafting"]
    # the step whose output never came counts as drafted, neither accepted nor rolled back
    assert (d["drafting"], d["steps_with_drafts"], d["draft_tokens"], d["accepted_tokens"], d["rolled_back_tokens"],
            d["recomputed_tokens"], d["wasted_tokens"], d["lookahead_slots"]) == (True, 3, 18, 6, 6, 3, 9, 3)
    assert d["acceptance"] == approx(0.5) and d["mean_accepted"] == approx(1.5)
    assert (rows["engine"]["drafting"], rows["engine"]["draft_tokens"], rows["engine"]["acceptance"]) == (False, 0, None)
    verdict = db.records(db.run_analysis(con, "request_verdict", req_id="a"))
    assert {r["run_id"]: (r["draft_tokens"], r["accepted_tokens"]) for r in verdict}["drafting"] == (12, 6)


def test_the_dashboard_shows_the_groups_and_the_drafts(tmp_path):
    con = _runs(tmp_path)
    figures = {f["run"]["run_id"]: f for f in dashboard.collect(con)["runs"]}
    out = io.StringIO()
    console = Console(file=out, width=140, color_system=None)
    for run in ("hybrid", "drafting", "engine"):
        console.print(dashboard.render_run(figures[run], 140, {}))
    text = out.getvalue()
    assert "2 KV-cache groups: full attention (60% of blocks), sliding window 64 tok (40% of blocks, 2 dropped)" in text
    assert text.count("KV-cache groups") == 1   # a run of one group of full attention says nothing of it
    assert "drafts" in text and "18 tok (50% accepted, 6 rolled back)" in text
