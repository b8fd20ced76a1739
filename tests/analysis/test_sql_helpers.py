"""Values of the SQL library's helpers (analyses/_*.sql) at the edges the golden runs do not reach,
each on a trace built by hand (tests/helpers/tracegen.py) so that one condition decides a value: a
run's span, cliffs and stalls, histogram percentiles, re-prefills, states around preemption, swap
copy rates, the timeline's numbering, flow ids and full-pool windows."""
from __future__ import annotations

import pytest

from kvtrace.trace import db
from tests.helpers.tracegen import recompute_run, swap_run, write_run

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


# ---------------------------------------------------------------- ITL cliffs: the time a gap spent stalled

U = 1 / 64  # s; exact in binary, so the sums below are exact


def stalled_run(tmp_path):
    """C: a 20 u gap between its 5th and 6th tokens, in which it is preempted twice (1 u + 2 u
    waiting, 1 u + 1 u re-prefilling; the first re-prefill cut short) and swapped out twice (1 u +
    2 u). D: a 10 u gap, 5 u waiting for readmission and then 5 u re-prefilling (a tie)."""
    times = [1, 2, 3, 4, 5, 25, 26]
    tokens = [{"req_id": "C", "sample": 0, "idx": i, "step": t, "ts_s": t * U} for i, t in enumerate(times)]
    marks = [(0, "admit", "new"), (5, "preempt", "recompute"), (6, "admit", "resume-recompute"),
             (7, "reprefill", "interrupted"), (7, "preempt", "recompute"), (9, "admit", "resume-recompute"),
             (10, "reprefill", None), (12, "preempt", "swap"), (13, "admit", "resume-swap"),
             (14, "preempt", "swap"), (16, "admit", "resume-swap")]
    d_marks = [(0, "admit", "new"), (5, "preempt", "recompute"), (10, "admit", "resume-recompute"),
               (15, "reprefill", None)]
    tokens += [{"req_id": "D", "sample": 0, "idx": i, "step": t, "ts_s": t * U} for i, t in enumerate([4, 5, 15])]
    events = [{"seq": i, "step": t, "ts_s": t * U, "kind": kind, "req_id": req, "sample": 0, "reason": reason}
              for i, (req, (t, kind, reason)) in enumerate([("C", m) for m in marks] + [("D", m) for m in d_marks])]
    events[3]["num_recomputed_tokens"], events[6]["num_recomputed_tokens"] = 3, 5   # C's two re-prefills
    events[3]["num_cached_tokens"], events[6]["num_cached_tokens"] = 1, 2
    requests = [{"req_id": "C", "sample": 0, "n": 1, "arrival_s": 0.0, "first_scheduled_s": 0.0,
                 "first_token_s": U, "finish_s": 26 * U, "finish_reason": "stop", "output_tokens": 7,
                 "prompt_tokens": 8, "preemptions": 4, "swaps": 2},
                {"req_id": "D", "sample": 0, "n": 1, "arrival_s": 0.0, "first_scheduled_s": 0.0,
                 "first_token_s": 4 * U, "finish_s": 15 * U, "finish_reason": "stop", "output_tokens": 3,
                 "prompt_tokens": 8, "preemptions": 1, "swaps": 0}]
    return write_run(tmp_path, "stalled", requests=requests, kv_events=events, tokens=tokens)


def test_a_cliffs_stalls_add_up_over_every_interval_in_it(tmp_path):
    con = db.connect([stalled_run(tmp_path)])
    cliff, tie = rows(con, "itl_cliffs", threshold_ms=100)
    assert (cliff["req_id"], cliff["idx"], cliff["gap_ms"], cliff["cause"]) == ("C", 5, 20 * U * 1000, "swap_wait")
    assert (cliff["preempted_ms"], cliff["reprefill_ms"], cliff["swapped_ms"]) == (3 * U * 1000, 2 * U * 1000, 3 * U * 1000)
    # as long waiting for readmission as re-prefilling: "preempted"
    assert (tie["req_id"], tie["preempted_ms"], tie["reprefill_ms"], tie["cause"]) == (
        "D", 5 * U * 1000, 5 * U * 1000, "preempted")
    # a gap exactly at a fixed threshold is not a cliff
    assert [r["req_id"] for r in rows(con, "itl_cliffs", threshold_ms=10 * U * 1000)] == ["C"]


# ---------------------------------------------------------------- latency histograms: negative values

def test_percentiles_of_negative_values_are_read_from_their_own_bins(tmp_path):
    # a trace whose clock stepped back (an imported one, say): gaps of -100, -90 and -10 ms. Each
    # value is alone in its 0.1%-wide bin, so the percentiles are exact: p50 is the middle one
    # (one bin for all negative values would read it as -55)
    ts = [1.0, 0.9, 0.81, 0.8]
    tokens = [{"req_id": "N", "sample": 0, "idx": i, "step": i, "ts_s": t} for i, t in enumerate(ts)]
    run = write_run(tmp_path, "neg", tokens=tokens, requests=[request("N", 0.0, 1.0, output_tokens=4)])
    (itl,) = [r for r in rows(db.connect([run]), "latency") if r["metric"] == "itl"]
    assert (itl["num_values"], itl["p50_ms"], itl["max_ms"]) == (3, approx(-90.0), approx(-10.0))


def test_the_largest_value_is_exact_when_its_bin_holds_others(tmp_path):
    # gaps of 100 and 100.05 ms share a 0.1%-wide bin: max_ms is still the larger (exact, as
    # latency.sql says), and the median interpolates between the two
    ts = [0.0, 0.1, 0.20005]
    tokens = [{"req_id": "B", "sample": 0, "idx": i, "step": i, "ts_s": t} for i, t in enumerate(ts)]
    run = write_run(tmp_path, "bin", tokens=tokens, requests=[request("B", 0.0, 0.20005, output_tokens=3)])
    (itl,) = [r for r in rows(db.connect([run]), "latency") if r["metric"] == "itl"]
    assert (itl["num_values"], itl["max_ms"], itl["p50_ms"]) == (2, approx(100.05), approx(100.025))


def test_the_cdf_keeps_the_largest_values_one_by_one(tmp_path):
    # gaps of 10, 20, 30 and 40 ms; 2 points (levels 0, 0.5, 1) and a tail of 2: the two largest
    # values at the levels whose percentiles they are, (4 - k) / 3
    ts = [0.0, 0.01, 0.03, 0.06, 0.1]
    tokens = [{"req_id": "T", "sample": 0, "idx": i, "step": i, "ts_s": t} for i, t in enumerate(ts)]
    run = write_run(tmp_path, "cdf", tokens=tokens, requests=[request("T", 0.0, 0.1, output_tokens=5)])
    con = db.connect([run])

    def itl(**params):
        return [(r["value_ms"], r["cdf"]) for r in rows(con, "latency_cdf", **params) if r["metric"] == "itl"]

    assert itl(points=2, tail=2) == [(approx(10.0), 0.0), (approx(25.0), 0.5), (approx(30.0), approx(2 / 3)),
                                     (approx(40.0), 1.0)]
    # a tail as long as the values: every one of them, the smallest too
    assert sorted(itl(points=2, tail=4)) == [(approx(10.0), 0.0), (approx(10.0), 0.0), (approx(20.0), approx(1 / 3)),
                                             (approx(25.0), 0.5), (approx(30.0), approx(2 / 3)), (approx(40.0), 1.0)]


def test_a_percentile_inside_a_bin_interpolates_between_its_min_and_max(tmp_path):
    # gaps 50, 100, 100.02, 100.05 ms: the last three share a bin (ranks 1..3 of 0..3), read as
    # 100 + 0.05 x (rank - 1) / 2. p50 = rank 1.5: halfway between 100 and 100.025; p90 = rank 2.7:
    # 100.025 + 0.7 x 0.025
    ts = [0.0, 0.05, 0.15, 0.25002, 0.35007]
    tokens = [{"req_id": "I", "sample": 0, "idx": i, "step": i, "ts_s": t} for i, t in enumerate(ts)]
    run = write_run(tmp_path, "interp", tokens=tokens, requests=[request("I", 0.0, 0.35007, output_tokens=5)])
    (itl,) = [r for r in rows(db.connect([run]), "latency") if r["metric"] == "itl"]
    assert (itl["num_values"], itl["p50_ms"], itl["p90_ms"], itl["max_ms"]) == (
        4, approx(100.0125, rel=1e-9), approx(100.0425, rel=1e-9), approx(100.05))


def test_a_rank_at_a_bins_first_value_is_read_in_that_bin(tmp_path):
    # gaps 50, 99.96, 100.05 (one bin: [99.953, 100.053) ms) and 100.06 (the next bin). p90 = rank
    # 2.7, between the first bin's last value and the next bin's first: 100.05 + 0.7 x 0.01. (Reading
    # rank 3 in the first bin too would extrapolate it to 100.14.)
    ts = [0.0, 0.05, 0.14996, 0.25001, 0.35007]
    tokens = [{"req_id": "E", "sample": 0, "idx": i, "step": i, "ts_s": t} for i, t in enumerate(ts)]
    run = write_run(tmp_path, "edge", tokens=tokens, requests=[request("E", 0.0, 0.35007, output_tokens=5)])
    (itl,) = [r for r in rows(db.connect([run]), "latency") if r["metric"] == "itl"]
    assert itl["p90_ms"] == approx(100.057, rel=1e-9)


def test_the_most_preempted_add_up_every_re_prefill_and_stall(tmp_path):
    con = db.connect([stalled_run(tmp_path)])
    got = [(r["req_id"], r["rank"], r["preemptions"], r["swaps"], r["recomputed_tokens"], r["stall_ms"])
           for r in rows(con, "most_preempted")]
    # C: re-prefilled 3 then 5 positions; stalled 1 + 2 u preempted and 1 + 2 u swapped out
    assert got == [("C", 1, 4, 2, 8, approx(6 * U * 1000)), ("D", 2, 1, 0, 0, approx(5 * U * 1000))]


def test_recompute_adds_up_every_re_prefill(tmp_path):
    con = db.connect([stalled_run(tmp_path)])
    (got,) = rows(con, "recompute")
    # C: 2 recompute and 2 swap preemptions, re-prefills of 3 (+1 cached, cut short) and 5 (+2 cached)
    # positions; D: 1 recompute preemption, 1 re-prefill
    assert (got["preemptions"], got["recompute_preemptions"], got["reprefills"], got["recomputed_tokens"],
            got["reprefill_cached_tokens"]) == (5, 3, 3, 8, 3)


def test_a_two_token_sequence_has_a_tpot(tmp_path):
    # two tokens 40 ms apart: TPOT 40 ms (one gap); a single token has none
    tokens = [{"req_id": "two", "sample": 0, "idx": i, "step": i, "ts_s": t} for i, t in enumerate([0.1, 0.14])]
    tokens += [{"req_id": "one", "sample": 0, "idx": 0, "step": 0, "ts_s": 0.1}]
    run = write_run(tmp_path, "tpot", tokens=tokens, requests=[request("two", 0.0, 0.14), request("one", 0.0, 0.1,
                                                                                                   output_tokens=1)])
    (tpot,) = [r for r in rows(db.connect([run]), "latency") if r["metric"] == "tpot"]
    assert (tpot["num_values"], tpot["mean_ms"]) == (1, approx(40.0))


def test_a_steps_device_time_is_shared_among_all_its_tokens(tmp_path):
    # 6 ms for 4 prefill positions (all recomputed) and 2 decode ones: 4 ms of it recomputing
    steps = [step(0, 0.0, 0.01, prefill_tokens=4, decode_tokens=2, recompute_tokens=4, device_ms=6.0)]
    (got,) = rows(db.connect([write_run(tmp_path, "share", steps=steps)]), "recompute")
    assert (got["recompute_device_ms"], got["device_ms"], got["recompute_device_share"]) == (
        approx(4.0), approx(6.0), approx(4 / 6))


# ---------------------------------------------------------------- sequence states around the first token

def test_states_around_a_preemption_before_the_first_token(tmp_path):
    # steps of 1 u. P: preempted (recompute) in its prefill, re-prefilled in step 2, which also gives
    # its first token. Q: swapped out in its prefill, back in step 2, first token at the end of step 3.
    # R: like P, but its first token comes a step after the re-prefill. M (a trace whose tokens are
    # stamped before their step ends, as an imported one may be): its first token at 3 u, during the
    # re-prefill that ends with step 3 at 4 u: decode from 3 u and from 4 u, one interval merged.
    steps = [step(k, k * U, (k + 1) * U) for k in range(5)]
    marks = {"P": [(0, "admit", "new"), (1, "preempt", "recompute"), (2, "admit", "resume-recompute"),
                   (2, "reprefill", None)],
             "Q": [(0, "admit", "new"), (1, "preempt", "swap"), (2, "admit", "resume-swap")],
             "R": [(0, "admit", "new"), (1, "preempt", "recompute"), (2, "admit", "resume-recompute"),
                   (2, "reprefill", None)],
             "M": [(0, "admit", "new"), (1, "preempt", "recompute"), (2, "admit", "resume-recompute"),
                   (3, "reprefill", None)]}
    first = {"P": 3, "Q": 4, "R": 4, "M": 3}
    events = [{"seq": i, "step": k, "ts_s": k * U, "kind": kind, "req_id": req, "sample": 0, "reason": reason}
              for i, (req, (k, kind, reason)) in enumerate((r, m) for r in marks for m in marks[r])]
    tokens = [{"req_id": r, "sample": 0, "idx": i, "step": first[r] - 1 + i, "ts_s": (first[r] + i) * U}
              for r in marks for i in range(5 - first[r] + 1)]
    requests = [request(r, 0.0, 5 * U, first_scheduled_s=0.0, first_token_s=first[r] * U,
                        output_tokens=5 - first[r] + 1) for r in marks]
    con = db.connect([write_run(tmp_path, "states", steps=steps, kv_events=events, tokens=tokens, requests=requests)])
    got = {}
    for r in con.sql("SELECT req_id, state, start_s, end_s FROM _sequence_states ORDER BY req_id, start_s"
                     ).to_arrow_table().to_pylist():
        got.setdefault(r["req_id"], []).append((r["state"], round(r["start_s"] / U), round(r["end_s"] / U)))
    assert got.pop("M") == [("prefill", 0, 1), ("preempted", 1, 2), ("reprefill", 2, 3), ("decode", 3, 5)]
    assert got == {"P": [("prefill", 0, 1), ("preempted", 1, 2), ("reprefill", 2, 3), ("decode", 3, 5)],
                   "Q": [("prefill", 0, 1), ("swapped", 1, 2), ("prefill", 2, 4), ("decode", 4, 5)],
                   "R": [("prefill", 0, 1), ("preempted", 1, 2), ("reprefill", 2, 3), ("prefill", 3, 4),
                         ("decode", 4, 5)]}
    # each interval names the event that began it (kv_events.seq; the run's first event is seq 0)
    p_seqs = con.sql("SELECT start_seq FROM _sequence_spans WHERE req_id = 'P' ORDER BY start_s").fetchall()
    assert [s for (s,) in p_seqs] == [0, 1, 2, 3]


# ---------------------------------------------------------------- swap: copies too short to time

def test_an_untimed_swap_copy_is_left_out_of_the_copy_rates(tmp_path):
    # swap-out: 2 MB in 4 ms and 1 MB whose time was 0 (not measured): rates from the timed one only;
    # swap-in: 1 MB untimed only: no rate at all (not an infinite one)
    def copy(seq, kind, nbytes, ms):
        return {"seq": seq, "step": seq, "ts_s": seq * U, "kind": kind, "req_id": "S", "sample": 0,
                "num_blocks": 1, "num_tokens": 4, "bytes": nbytes, "duration_ms": ms}
    events = [copy(0, "swap_out", 2_000_000, 4.0), copy(1, "swap_out", 1_000_000, 0.0), copy(2, "swap_in", 1_000_000, 0.0)]
    con = db.connect([write_run(tmp_path, "untimed", kv_events=events)])
    got = {r["direction"]: r for r in rows(con, "swap")}
    out, into = got["swap_out"], got["swap_in"]
    assert (out["copies"], out["bytes"], out["p50_copy_gb_s"], out["min_copy_gb_s"], out["gb_s"]) == (
        2, 3_000_000, approx(0.5), approx(0.5), approx(0.5))
    assert (into["copies"], into["p50_copy_gb_s"], into["min_copy_gb_s"], into["gb_s"]) == (1, None, None, None)
    # the per-run helper the summaries read: each direction's bytes and both together
    (by_run,) = con.sql("SELECT * FROM _swap_by_run").to_arrow_table().to_pylist()
    assert by_run == {"run_id": "untimed", "swap_out_bytes": 3_000_000, "swap_in_bytes": 1_000_000,
                      "swap_bytes": 4_000_000, "swap_gb_s": approx(0.5)}


def test_timeline_sequences_are_numbered_from_0_and_named_by_sample(tmp_path):
    # the Perfetto export's rows: 0-based by arrival; a request with n > 1 names each sample req#k
    requests = [request("A", 0.0, 1.0), request("B", 0.5, 1.0, n=2), request("B", 0.5, 1.0, n=2, sample=1)]
    con = db.connect([write_run(tmp_path, "names", requests=requests)])
    got = con.sql("SELECT rank, name FROM _timeline_sequences ORDER BY rank").fetchall()
    assert got == [(0, "A"), (1, "B#0"), (2, "B#1")]


def test_timeline_steps_instants_and_swap_counters(tmp_path):
    # the Perfetto export's step slices, instant events and running swap totals
    steps = [step(0, 0.0, U, prefill_tokens=4, decode_tokens=0), step(1, U, 2 * U, decode_tokens=2),
             step(2, 2 * U, 3 * U, prefill_tokens=3, decode_tokens=1, recompute_tokens=3),
             step(3, 3 * U, 4 * U, decode_tokens=0)]

    def event(seq, k, kind, **extra):
        return {"seq": seq, "step": k, "ts_s": (k + seq / 10) * U, "kind": kind, "req_id": "A", "sample": 0, **extra}
    events = [event(0, 1, "evict", req_id="", blocks=[7], num_blocks=1),
              event(1, 1, "evict", req_id="", blocks=[5, 6], num_blocks=2),
              event(2, 2, "preempt", blocks=[1, 2], num_blocks=2, reason="swap"),
              event(3, 2, "swap_out", blocks=[1], num_blocks=1, bytes=200, duration_ms=1.0),
              event(4, 2, "swap_out", blocks=[2], num_blocks=1, bytes=300, duration_ms=1.0),
              event(5, 3, "swap_in", blocks=[3, 4], num_blocks=2, bytes=300, duration_ms=1.0)]
    con = db.connect([write_run(tmp_path, "tl", steps=steps, kv_events=events)])
    names = con.sql("SELECT name FROM _timeline_steps ORDER BY step").fetchall()
    assert [n for (n,) in names] == ["prefill", "decode", "prefill+decode +recompute", "empty"]
    instants = con.sql("SELECT step, ts_ns, seq, kind, blocks, num_blocks, kv_bytes, bytes_copied "
                       "FROM _timeline_instants ORDER BY seq").fetchall()
    ns = lambda s: round(s * 1e9)  # noqa: E731
    assert instants == [(1, ns(U), 0, "evict", "5 6 7", 3, 3_000_000, None),     # one instant per step's evictions
                        (2, ns(2.2 * U), 2, "preempt", "1 2", 2, 2_000_000, None),
                        (2, ns(2.3 * U), 3, "swap_out", "1", 1, None, 200),
                        (2, ns(2.4 * U), 4, "swap_out", "2", 1, None, 300),
                        (3, ns(3.5 * U), 5, "swap_in", "3 4", 2, None, 300)]
    totals = con.sql("SELECT step, swap_out_bytes_total, swap_in_bytes_total FROM _step_counters ORDER BY step").fetchall()
    assert totals == [(0, 0, 0), (1, 0, 0), (2, 500, 0), (3, 500, 300)]


def query(con, sql: str) -> list[tuple]:
    return con.sql(sql).fetchall()


def timed_request(req_id: str, arrival_s: float, first_token_s: float | None, finish_s: float, **extra) -> dict:
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
    # (new) and gives its first token in the step from 1 u to 2 u. It is in prefill for that step (vLLM
    # scheduled it at the step's start), then decodes; its admit is not a prefill that lasts to the
    # finish, nor a queue that lasts to its first token. (The admit-new rule once got this case wrong
    # while every other case was right: flipping `kind = 'admit'` went unnoticed.)
    steps = [{"step": k, "start_s": (k + 1) * U, "end_s": (k + 2) * U, "prefill_tokens": 4 if k == 0 else 0,
              "decode_tokens": 0 if k == 0 else 1} for k in range(3)]
    events = [event(0, 2 * U, "admit", "X", "new", step=0)]
    tokens = [{"req_id": "X", "sample": 0, "idx": i, "step": i, "ts_s": (i + 2) * U} for i in range(3)]
    con = db.connect([write_run(tmp_path, "capture", steps=steps, kv_events=events, tokens=tokens,
                                requests=[timed_request("X", 0.0, 2 * U, 4 * U, output_tokens=3)])])
    got = [(r["state"], r["start_s"] / U, r["end_s"] / U) for r in rows(con, "request_timeline", req_id="X")]
    assert got == [("waiting", 0, 1), ("prefill", 1, 2), ("decode", 2, 4)]


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
    requests = [timed_request("A", 0.0, 3 * U, 4 * U), timed_request("B", 0.0, 2 * U, 5 * U), timed_request("C", 0.0, 3 * U, 4 * U)]
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
