"""Preemptions caused by speculative decoding's drafts and lookahead slots (analyses/lookahead_preemptions.sql,
spec_decode.sql's count, request_verdict's list, explain's sentence), on hand-written captures' runs.

The drafting run: blocks of 4, 2 lookahead slots, five requests admitted at step 0 with one token each.

    step 1  a (prompt 6, 2 blocks) schedules 2 drafts: its verified token, position 6, fits its 8 slots,
            its drafts and lookahead (7 + 2 + 2 = 11 positions) do not: it preempts b         -> lookahead
            c (prompt 8, 2 blocks) needs a block for its verified token (position 8 of 8 slots): it
            preempts d                                                                     -> verified
    step 2  e (prompt 5, a prefix-hit block and one of its own) preempts itself: its drafts are not
            recorded, its verified token fitted, so only drafts and lookahead needed the block -> lookahead
    step 3  a (prompt 6 + 4 tokens, 3 blocks) is scheduled without drafts: its 2 lookahead slots need
            a block its verified token does not; it preempts c                             -> lookahead
    step 4  d and b resume: d re-prefills its 5 positions (2 new blocks) and emits its next token, b
            re-prefills 4 of its 5
    step 5  d (prompt 4 + 2 tokens, 2 blocks since it resumed: 3 free slots) schedules 1 draft, which
            with 2 lookahead slots needs a block: it preempts a                            -> lookahead
            b, still re-prefilling, preempts itself: not decoding, its positions unknown  -> null

The plain run has the same requests and a preemption, and no spec_decode rows: a run that drafts
nothing has no row, counts none, and its verdicts say nothing of drafts.
"""
from __future__ import annotations

import io

from rich.console import Console

from kvtrace.trace import db
from kvtrace.views import dashboard
from kvtrace.views import explain as stories
from tests.helpers.tracegen import write_run, write_table

PROMPTS = {"a": 6, "b": 4, "c": 8, "d": 4, "e": 5}
DRAFTING = {"engine_config": {"engine": "vllm", "num_speculative_tokens": 2, "num_lookahead_tokens": 2,
                              "max_model_len": 64},
            "kv_pool": {"num_gpu_blocks": 16, "kv_cache_groups": [{"kind": "full_attention", "block_size": 4,
                                                                   "layers": 1}]}}


def _step(step: int) -> dict:
    return {"step": step, "start_s": step * 0.1, "end_s": (step + 1) * 0.1, "prefill_tokens": 0, "decode_tokens": 4,
            "recompute_tokens": 0, "preemptions": 0, "used_blocks": 10, "total_blocks": 16}


def _events(rows: list[tuple]) -> list[dict]:
    """(step, kind, request, blocks, requester, extra) -> kv_events rows, seq in order."""
    out = []
    for seq, (step, kind, rid, blocks, requester, *extra) in enumerate(rows):
        row = {"seq": seq, "step": step, "ts_s": (step + 1) * 0.1, "kind": kind, "req_id": rid, "sample": 0,
               "blocks": blocks, "num_blocks": len(blocks), "num_tokens": 0, "bytes": 0,
               "reason": {"admit": "new", "alloc": "decode", "preempt": "recompute", "prefix_hit": "new"}.get(kind)}
        if kind == "preempt":
            row.update(requester_req_id=requester, requester_sample=0, victim_reason="newest")
        row.update(*extra)
        out.append(row)
    return out


def _tokens(rows: list[tuple[str, int, int]]) -> list[dict]:
    """(request, idx, step) -> tokens rows, stamped at their step's end."""
    return [{"req_id": rid, "sample": 0, "idx": idx, "token_id": 5, "step": step, "ts_s": (step + 1) * 0.1}
            for rid, idx, step in rows]


def _requests(preemptions: dict[str, int]) -> list[dict]:
    return [{"req_id": rid, "sample": 0, "n": 1, "arrival_s": 0.0, "prompt_tokens": prompt, "max_tokens": 16,
             "output_tokens": 4, "first_scheduled_s": 0.0, "first_token_s": 0.1, "finish_s": 0.6,
             "finish_reason": "length", "preemptions": preemptions.get(rid, 0)} for rid, prompt in PROMPTS.items()]


ADMITTED = [(0, "admit", "a", [], None), (0, "alloc", "a", [1, 2], None),
            (0, "admit", "b", [], None), (0, "alloc", "b", [3, 4], None),
            (0, "admit", "c", [], None), (0, "alloc", "c", [5, 6], None),
            (0, "admit", "d", [], None), (0, "alloc", "d", [7, 8], None),
            (0, "admit", "e", [], None), (0, "prefix_hit", "e", [9], None, {"num_tokens": 4}),
            (0, "alloc", "e", [10], None)]
FIRST_TOKENS = [(rid, 0, 0) for rid in PROMPTS]


def _runs(tmp_path):
    drafting = write_run(
        tmp_path, "drafting", meta=DRAFTING, steps=[_step(i) for i in range(6)],
        requests=_requests({"a": 1, "b": 2, "c": 1, "d": 1, "e": 1}),
        kv_events=_events(ADMITTED + [
            (1, "preempt", "b", [3, 4], "a"), (1, "alloc", "a", [3], None),
            (1, "preempt", "d", [7, 8], "c"), (1, "alloc", "c", [7, 8], None),
            (2, "preempt", "e", [9, 10], "e"),
            (3, "preempt", "c", [5, 6, 7, 8], "a"), (3, "alloc", "a", [5], None),
            (4, "admit", "d", [], None, {"reason": "resume-recompute"}), (4, "alloc", "d", [11, 12], None),
            (4, "admit", "b", [], None, {"reason": "resume-recompute"}), (4, "alloc", "b", [13, 14], None),
            (5, "preempt", "a", [1, 2, 3, 5], "d"), (5, "alloc", "d", [1], None),
            (5, "preempt", "b", [13, 14], "b")]),
        tokens=_tokens(FIRST_TOKENS + [("a", 1, 1), ("a", 2, 1), ("c", 1, 1), ("a", 3, 2), ("a", 4, 2),
                                       ("a", 5, 3), ("d", 1, 4), ("d", 2, 5)]))
    write_table(drafting, "spec_decode", [
        {"step": s, "ts_s": (s + 1) * 0.1, "req_id": r, "sample": 0, "draft_tokens": 2, "accepted_tokens": acc,
         "lookahead_slots": 2} for s, r, acc in [(1, "a", 1), (1, "c", 0), (2, "a", 1)]] + [
        {"step": 5, "ts_s": 0.6, "req_id": "d", "sample": 0, "draft_tokens": 1, "accepted_tokens": 0,
         "lookahead_slots": 2}])
    write_run(tmp_path, "plain", steps=[_step(i) for i in range(3)], requests=_requests({"b": 1}),
              kv_events=_events(ADMITTED[:4] + [(1, "preempt", "b", [3, 4], "a"), (1, "alloc", "a", [3], None)]),
              tokens=_tokens(FIRST_TOKENS + [("a", 1, 1)]))
    return db.connect([tmp_path])


def test_each_preemption_says_whether_drafts_and_lookahead_caused_it(tmp_path):
    con = _runs(tmp_path)
    rows = db.records(db.run_analysis(con, "lookahead_preemptions"))
    got = [(r["run_id"], r["step"], r["req_id"], r["requester_req_id"], r["requester_scheduled"],
            r["requester_positions"], r["requester_blocks"], r["requester_free_slots"], r["draft_tokens"],
            r["lookahead_slots"], r["caused_by_lookahead"]) for r in rows]
    assert got == [
        ("drafting", 1, "b", "a", True, 6, 2, 2, 2, 2, True),      # 1 fits 2 free slots, 1 + 2 + 2 does not
        ("drafting", 1, "d", "c", True, 8, 2, 0, 2, 2, False),     # its verified token needed the block
        ("drafting", 2, "e", "e", False, 5, 2, 3, None, 2, True),  # preempted itself: drafts not recorded
        ("drafting", 3, "c", "a", True, 10, 3, 2, 0, 2, True),     # no drafts: its lookahead alone
        ("drafting", 5, "a", "d", True, 5, 2, 3, 1, 2, True),      # its blocks since it resumed
        ("drafting", 5, "b", "b", False, None, 2, None, None, 2, None),   # re-prefilling: not known
    ]
    # a run that drafts nothing has no row
    assert all(r["run_id"] == "drafting" for r in rows)


def test_spec_decode_counts_them_and_each_verdict_lists_its_own(tmp_path):
    con = _runs(tmp_path)
    summary = {r["run_id"]: r["lookahead_preemptions"] for r in db.records(db.run_analysis(con, "spec_decode"))}
    assert summary == {"drafting": 4, "plain": 0}
    verdicts = {(r["run_id"], r["req_id"]): r["lookahead_preemptions"]
                for r in db.records(db.run_analysis(con, "request_verdict"))}
    assert verdicts["drafting", "b"] == [{"step": 1, "requester_req_id": "a", "requester_sample": 0,
                                          "draft_tokens": 2, "lookahead_slots": 2}]
    assert verdicts["drafting", "d"] == [] and verdicts["plain", "b"] == []
    assert [p["draft_tokens"] for p in verdicts["drafting", "e"]] == [None]


def test_explain_says_whose_drafts_and_lookahead_needed_the_block(tmp_path):
    _runs(tmp_path)
    drafting = stories.Explainer.open(str(tmp_path / "drafting"))
    said = {rid: stories.story(drafting, rid)["verdict"] for rid in PROMPTS}
    assert "preempted at step 1 by a, whose 2 draft tokens and 2 lookahead slots needed a block its verified " \
           "token did not" in said["b"]
    assert "preempted at step 5 by d, whose 1 draft token and 2 lookahead slots needed a block its verified " \
           "token did not" in said["a"]
    assert "preempted at step 3 by a, whose 2 lookahead slots needed a block its verified token did not" in said["c"]
    assert "preempted at step 2 by itself: its drafts and 2 lookahead slots needed a block its verified token " \
           "did not" in said["e"]
    assert said["b"].count("verified token") == 1   # its own preemption at step 5 is not known to be lookahead's
    plain = stories.Explainer.open(str(tmp_path / "plain"))
    for verdict in (said["d"], stories.story(plain, "b")["verdict"]):   # a verified token's, no drafts at all
        assert "preempted once by" in verdict and "lookahead" not in verdict and "verified" not in verdict


def test_the_dashboard_counts_them_beside_the_drafts(tmp_path):
    con = _runs(tmp_path)
    figures = {f["run"]["run_id"]: f for f in dashboard.collect(con)["runs"]}
    out = io.StringIO()
    Console(file=out, width=140, color_system=None).print(dashboard.render_run(figures["drafting"], 140, {}))
    assert "rolled back, 4 preempting)" in out.getvalue()
