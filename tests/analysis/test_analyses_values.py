"""SQL boundaries and the values of analyses that other tests only run: an SLO met exactly is met,
a 1-token request can be good, a pool at exactly the full fraction is full."""
from __future__ import annotations

import pytest

from kvtrace.trace import db
from tests.helpers.tracegen import write_run

approx = pytest.approx


def rows(con, name: str, **params) -> list[dict]:
    return db.run_analysis(con, name, **params).to_pylist()


def by_run(result: list[dict]) -> dict:
    return {r["run_id"]: r for r in result}


# ---------------------------------------------------------------- goodput

def test_an_slo_met_exactly_is_met(root):
    # the golden recompute run: A's TTFT 250 ms, TPOT 250 ms, E2E 1000 ms; B's 312.5, 500, 1312.5
    con = db.connect([root / "rec"])
    for slo, good in [(dict(ttft_ms=250, tpot_ms=0), 1), (dict(ttft_ms=249.99, tpot_ms=0), 0),
                      (dict(ttft_ms=0, tpot_ms=250), 1), (dict(ttft_ms=0, tpot_ms=249.99), 0),
                      (dict(ttft_ms=0, tpot_ms=0, e2el_ms=1000), 1), (dict(ttft_ms=0, tpot_ms=0, e2el_ms=999.99), 0),
                      (dict(ttft_ms=312.5, tpot_ms=500, e2el_ms=1312.5), 2)]:
        (got,) = rows(con, "goodput", **slo)
        assert (got["completed_requests"], got["good_requests"]) == (2, good), slo


def one_token_run(tmp_path):
    """S: one token (no TPOT), TTFT 100 ms; L: three tokens 50 ms apart after a TTFT of 100 ms."""
    common = {"sample": 0, "n": 1, "priority": 0, "finish_reason": "length", "prefix_hit_tokens": 0,
              "preemptions": 0, "swaps": 0, "recomputed_tokens": 0, "prompt_tokens": 4, "first_scheduled_s": 0.0}
    requests = [{**common, "req_id": "S", "arrival_s": 0.0, "max_tokens": 1, "output_tokens": 1,
                 "first_token_s": 0.1, "finish_s": 0.1},
                {**common, "req_id": "L", "arrival_s": 0.0, "max_tokens": 3, "output_tokens": 3,
                 "first_token_s": 0.1, "finish_s": 0.2}]
    tokens = [{"req_id": "S", "sample": 0, "idx": 0, "token_id": 5, "step": 0, "ts_s": 0.1}] + [
        {"req_id": "L", "sample": 0, "idx": i, "token_id": 5, "step": i, "ts_s": 0.1 + 0.05 * i} for i in range(3)]
    steps = [{"step": i, "start_s": 0.05 * (i + 1), "end_s": 0.1 + 0.05 * i, "prefill_tokens": 8 if i == 0 else 0,
              "decode_tokens": 0 if i == 0 else 1, "recompute_tokens": 0, "preemptions": 0, "used_blocks": 2,
              "total_blocks": 8, "device_ms": 1.0} for i in range(3)]
    return write_run(tmp_path, "single", requests=requests, tokens=tokens, steps=steps)


def test_a_one_token_request_has_no_tpot_and_can_be_good(tmp_path):
    con = db.connect([one_token_run(tmp_path)])
    tpot = next(r for r in rows(con, "latency") if r["metric"] == "tpot")
    assert (tpot["num_values"], tpot["mean_ms"]) == (1, approx(50.0))
    (got,) = rows(con, "goodput")               # TTFT 2000, TPOT 100: both good
    assert (got["completed_requests"], got["good_requests"], got["good_share"]) == (2, 2, 1.0)
    (got,) = rows(con, "goodput", tpot_ms=40)   # L's TPOT misses; S has none to miss
    assert got["good_requests"] == 1
    (got,) = rows(con, "goodput", ttft_ms=99, tpot_ms=0)  # S's TTFT misses too
    assert got["good_requests"] == 0


# ---------------------------------------------------------------- thrash: the full-pool test

def pool_run(tmp_path, used: list[int], total: int):
    steps = [{"step": i, "start_s": float(i), "end_s": float(i + 1), "prefill_tokens": 0, "decode_tokens": 4,
              "recompute_tokens": 0, "preemptions": 1, "used_blocks": u, "total_blocks": total, "device_ms": 1.0}
             for i, u in enumerate(used)]
    events = [{"seq": i, "step": i, "ts_s": float(i), "kind": "preempt", "req_id": f"r{i}", "sample": 0,
               "reason": "recompute"} for i in range(len(used))]
    return write_run(tmp_path, f"pool{total}", steps=steps, kv_events=events)


def test_a_pool_at_exactly_the_full_fraction_is_full(tmp_path):
    # 3 of 4 blocks used is full at full_pool_frac 0.75; 2 of 4 is not
    con = db.connect([pool_run(tmp_path, [3, 2, 3, 4], 4)])
    (got,) = rows(con, "thrash", full_pool_frac=0.75)
    assert got["full_pool_step_share"] == 0.75
    # one preemption a second, no recompute: 2 s windows thrash on their full-pool share alone
    # (steps 1-3: windows of 2 or 3 steps, at least half of them full)
    (got,) = rows(con, "thrash", full_pool_frac=0.75, window_s=2)
    assert (got["verdict"], got["thrash_windows"], got["thrash_s"]) == ("sustained", 1, 4.0)
    # the thrash window's peak rate is its steps' highest: 2 preemptions in 2 s at step 1, 3 after
    (window,) = rows(con, "thrash_windows", full_pool_frac=0.75, window_s=2)
    assert (window["thrashing_steps"], window["peak_preempt_per_s"]) == (3, 1.5)
    (got,) = rows(con, "thrash", full_pool_frac=0.76)
    assert got["full_pool_step_share"] == 0.25
    # the default 0.95: 19 of 20 blocks is full
    con = db.connect([pool_run(tmp_path, [19, 18], 20)])
    assert rows(con, "thrash")[0]["full_pool_step_share"] == 0.5


def test_a_recompute_share_at_exactly_the_bar_is_thrashing(tmp_path):
    # one preemption a second, pool never full, 1 of 5 computed positions recomputed: the share is
    # exactly min_recompute_share 0.2
    steps = [{"step": i, "start_s": float(i), "end_s": float(i + 1), "prefill_tokens": 4, "decode_tokens": 1,
              "recompute_tokens": 1, "preemptions": 1, "used_blocks": 1, "total_blocks": 4, "device_ms": 1.0}
             for i in range(3)]
    events = [{"seq": i, "step": i, "ts_s": float(i), "kind": "preempt", "req_id": f"r{i}", "sample": 0,
               "reason": "recompute"} for i in range(3)]
    con = db.connect([write_run(tmp_path, "share", steps=steps, kv_events=events)])
    (got,) = rows(con, "thrash", window_s=1)
    assert (got["verdict"], got["full_pool_step_share"]) == ("sustained", 0.0)
    assert [w["peak_recompute_share"] for w in rows(con, "thrash_windows", window_s=1)] == [0.2]
    (got,) = rows(con, "thrash", window_s=1, min_recompute_share=0.21)
    assert got["verdict"] == "occasional"
