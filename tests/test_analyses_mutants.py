"""Values of the SQL library where a planted mutant of analyses/_*.sql survived the other tests
(scripts/mutation.py, issue 20): each test names the mutant it kills. The traces are built by hand
(tests/tracegen.py) so that the mutated condition decides a value."""
from __future__ import annotations

import pytest

from kvtrace.trace import db
from tests.tracegen import recompute_run, swap_run, write_run

approx = pytest.approx
U = 1 / 64  # s; exact in binary, so sums and differences below are exact


def rows(con, name: str, **params) -> list[dict]:
    return db.run_analysis(con, name, **params).to_pylist()


def query(con, sql: str) -> list[tuple]:
    return con.sql(sql).fetchall()


def request(req_id: str, arrival_s: float, first_token_s: float | None, finish_s: float, **extra) -> dict:
    row = {"req_id": req_id, "sample": 0, "n": 1, "priority": 0, "arrival_s": arrival_s, "prompt_tokens": 4,
           "max_tokens": 4, "output_tokens": 2, "first_scheduled_s": arrival_s, "first_token_s": first_token_s,
           "finish_s": finish_s, "finish_reason": "length", "preemptions": 0, "swaps": 0,
           "recomputed_tokens": 0, "prefix_hit_tokens": 0}
    return {**row, **extra}


def event(seq: int, ts_s: float, kind: str, req_id: str, reason: str | None = None, step: int | None = None,
          **extra) -> dict:
    return {"seq": seq, "step": seq if step is None else step, "ts_s": ts_s, "kind": kind, "req_id": req_id,
            "sample": 0, "reason": reason, **extra}


# ---------------------------------------------------------------- _timeline.sql: flow ids

def test_a_flow_id_is_the_runs_base_plus_the_events_seq(tmp_path):
    # _timeline.sql documents flow_id as (runs.ordinal + 1) * 2^40 + kv_events.seq: a flow in the
    # Perfetto export can be traced back to its event. Kills `+ m.seq` -> `- m.seq`.
    con = db.connect([swap_run(tmp_path), recompute_run(tmp_path)])
    got = query(con, "SELECT run_id, state, flow_id, flow_step FROM _timeline_phases "
                     "WHERE flow_id IS NOT NULL ORDER BY run_id, start_ns")
    base = 2 ** 40
    # rec (ordinal 1): B preempted by event 4 in step 2, readmitted by event 9 in step 4;
    # swp (ordinal 0): B swapped out by event 5 in step 2, swapped back in by event 11 in step 4
    assert got == [("rec", "preempted", 2 * base + 4, 2), ("rec", "reprefill", 2 * base + 9, 4),
                   ("swp", "swapped", base + 5, 2), ("swp", "decode", base + 11, 4)]


# ---------------------------------------------------------------- _sequence_states.sql

def test_a_sequence_admitted_in_the_step_of_its_first_token_is_decoding_after_it(tmp_path):
    # a vLLM capture stamps a step's events at its end, the time of the tokens it gave: X is admitted
    # (new) and gives its first token in the step ending at 2 u. From then on it decodes; its admit is
    # not a prefill that lasts to the finish. (Found by the mutant `kind = 'admit'` -> `kind <> 'admit'`
    # of the admit-new rule, which survived because the rule was wrong there and right elsewhere.)
    steps = [{"step": k, "start_s": (k + 1) * U, "end_s": (k + 2) * U, "prefill_tokens": 4 if k == 0 else 0,
              "decode_tokens": 0 if k == 0 else 1} for k in range(3)]
    events = [event(0, 2 * U, "admit", "X", "new", step=0)]
    tokens = [{"req_id": "X", "sample": 0, "idx": i, "step": i, "ts_s": (i + 2) * U} for i in range(3)]
    con = db.connect([write_run(tmp_path, "capture", steps=steps, kv_events=events, tokens=tokens,
                                requests=[request("X", 0.0, 2 * U, 4 * U, output_tokens=3)])])
    got = [(r["state"], r["start_s"] / U, r["end_s"] / U) for r in rows(con, "request_timeline", req_id="X")]
    assert got == [("waiting", 0, 2), ("decode", 2, 4)]


STALL_ROWS = """SELECT req_id, state, start_s / {u}, end_s / {u}, start_seq FROM {view}
                ORDER BY req_id, start_s, start_seq"""


def test_stalls_that_tie_with_an_arrival_a_finish_or_another_event(tmp_path):
    # _stall_spans (what the cliffs and the most preempted read) must give the stall rows of
    # _sequence_spans whatever ties with a stall's start (test_scale checks it on a big run, outside
    # the mutation check's tests). Marks at the same time sort arrival, first token, events, finish.
    # A: admitted and preempted at the instant it arrived: its stall runs from there to its
    #    readmission (kills `r.arrival_s > s.ts_s` -> `>=`, which ends it at once).
    # B: swapped out at the instant it finishes, an event after that: no stall (kills
    #    `r.finish_s >= s.ts_s` -> `>`, which runs it to the later event).
    # C: preempted and readmitted at one time: no zero-length stall (kills `end_s > start_s` -> `>=`).
    marks = [("A", 0, "admit", "new"), ("A", 0, "preempt", "recompute"), ("A", 2, "admit", "resume-recompute"),
             ("B", 1, "admit", "new"), ("B", 5, "preempt", "swap"), ("B", 8, "admit", "resume-swap"),
             ("C", 1, "admit", "new"), ("C", 2, "preempt", "recompute"), ("C", 2, "admit", "resume-recompute")]
    events = [event(seq, t * U, kind, req, reason) for seq, (req, t, kind, reason) in enumerate(marks)]
    requests = [request("A", 0.0, 3 * U, 4 * U), request("B", 0.0, 2 * U, 5 * U), request("C", 0.0, 3 * U, 4 * U)]
    con = db.connect([write_run(tmp_path, "ties", kv_events=events, requests=requests)])
    stalls = query(con, STALL_ROWS.format(u=U, view="_stall_spans"))
    assert stalls == [("A", "preempted", 0, 2, 1), ("A", "reprefill", 2, 3, 2), ("C", "reprefill", 2, 3, 8)]
    assert stalls == query(con, STALL_ROWS.format(
        u=U, view="_sequence_spans WHERE state IN ('preempted', 'swapped', 'reprefill')"))
    # what a user reads: the time each sequence stalled waiting (A 2 u; B and C none)
    assert [(r["req_id"], r["stall_ms"]) for r in rows(con, "most_preempted")] == [
        ("A", approx(2 * U * 1000)), ("B", 0.0), ("C", 0.0)]


# ---------------------------------------------------------------- _thrash.sql: a full pool that left the window

def test_full_pool_steps_that_left_the_window_do_not_count(tmp_path):
    # window 1 s. Steps end at 0.5 and 1.0 with a full pool, then at 2.5 and 3.0 with a free one and a
    # preemption each: the late windows hold no full-pool step (share 0, not the earlier ones counted
    # again), so 1 preemption/s with no recompute and no full pool is no thrash. Kills
    # `hi.full_pool_steps - lo.full_pool_steps` -> `+`.
    def step(i, end_s, used, preemptions):
        return {"step": i, "start_s": end_s - 0.5, "end_s": end_s, "prefill_tokens": 0, "decode_tokens": 1,
                "recompute_tokens": 0, "preemptions": preemptions, "used_blocks": used, "total_blocks": 4}
    steps = [step(0, 0.5, 4, 0), step(1, 1.0, 4, 0), step(2, 2.5, 1, 1), step(3, 3.0, 1, 1)]
    con = db.connect([write_run(tmp_path, "left", steps=steps)])
    got = query(con, "SELECT step, window_steps, window_preemptions, full_pool_share, thrashing "
                     "FROM _thrash_steps(1.0, 0.95, 1.0, 0.2, 0.5) ORDER BY step")
    assert got == [(0, 1, 0, 1.0, False), (1, 2, 0, 1.0, False), (2, 1, 1, 0.0, False), (3, 2, 2, 0.0, False)]
    params = dict(window_s=1, full_pool_frac=0.95, min_preempt_per_s=1, min_recompute_share=0.2,
                  min_full_pool_share=0.5)
    assert rows(con, "thrash_windows", **params) == []
