"""Golden tests of the SQL library on hand-built traces (see tests/helpers/tracegen.py for the two runs).

Every expected number is worked out by hand in the comments from the runs' timeline:
steps of 0.25 s; A's tokens at 0.25 0.5 0.75 1.0; B arrives at 0.1875, tokens at 0.5 1.25 1.5,
preempted at 0.5 and readmitted at 1.0.
"""
from __future__ import annotations

import re
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from kvtrace.errors import KvtraceError
from kvtrace.trace import db
from tests.helpers.tracegen import recompute_run, write_run

approx = pytest.approx


@pytest.fixture(scope="module")
def con(root):
    return db.connect([root])


def rows(con, name: str, **params) -> list[dict]:
    return db.run_analysis(con, name, **params).to_pylist()


def by(rows_: list[dict], *keys: str) -> dict:
    return {tuple(r[k] for k in keys) if len(keys) > 1 else r[keys[0]]: r for r in rows_}


# --------------------------------------------------------------------------- connect

def test_views_hold_every_run_with_the_contract_columns(con):
    assert con.sql("SELECT run_id, count(*) FROM steps GROUP BY ALL ORDER BY 1").fetchall() == [("rec", 6), ("swp", 6)]
    assert con.sql("SELECT count(*) FROM tokens").fetchall() == [(14,)]
    # gpu_samples has no chunk in either run: an empty view with the contract's columns
    assert con.sql("SELECT count(*) FROM gpu_samples").fetchall() == [(0,)]
    columns = [c[0] for c in con.sql("DESCRIBE gpu_samples").fetchall()]
    assert columns == ["run_id", "ts_s", "mem_used_bytes", "util_pct", "pcie_tx_bytes_s", "pcie_rx_bytes_s", "power_w"]


def test_runs_table_flattens_meta(con):
    runs = by(con.sql("SELECT * FROM runs").to_arrow_table().to_pylist(), "run_id")
    assert runs["rec"]["preemption_mode"] == "recompute" and runs["swp"]["preemption_mode"] == "swap"
    assert runs["swp"]["block_size"] == 2 and runs["swp"]["num_gpu_blocks"] == 6
    assert runs["rec"]["model"] == "tiny" and runs["rec"]["device"] == "test cpu"
    assert runs["rec"]["workload_sha256"] == "a" * 64 and runs["rec"]["status"] == "completed"
    assert (runs["rec"]["ordinal"], runs["swp"]["ordinal"]) == (0, 1)


def test_connect_accepts_runs_globs_and_parents(root):
    for args in ([root / "rec", root / "swp"], [str(root / "*")], [root], [root, root / "rec"]):
        con = db.connect(args)
        assert con.sql("SELECT run_id FROM runs ORDER BY ordinal").fetchall() == [("rec",), ("swp",)]


def test_chunked_tables_and_missing_columns(tmp_path):
    # 3 chunks of steps, one of them written without kv_tokens (an older recorder)
    run = recompute_run(tmp_path, "chunked")
    steps = pq.read_table(run / "steps" / "part-00000.parquet")
    (run / "steps" / "part-00000.parquet").unlink()
    pq.write_table(steps.slice(0, 2).drop_columns(["kv_tokens"]), run / "steps" / "part-00000.parquet")
    pq.write_table(steps.slice(2, 2), run / "steps" / "part-00001.parquet")
    pq.write_table(steps.slice(4), run / "steps" / "part-00002.parquet")
    con = db.connect([run])
    assert con.sql("SELECT step, kv_tokens FROM steps ORDER BY step").fetchall() == [
        (0, None), (1, None), (2, 8), (3, 9), (4, 5), (5, 6)]
    # a run whose every chunk lacks the column
    old = write_run(tmp_path, "old", steps=[{**r, "run_id": "old"} for r in steps.slice(0, 1).to_pylist()])
    pq.write_table(pq.read_table(old / "steps" / "part-00000.parquet").drop_columns(["kv_tokens"]),
                   old / "steps" / "part-00000.parquet")
    con = db.connect([old])
    assert con.sql("SELECT kv_tokens FROM steps").fetchall() == [(None,)]
    assert rows(con, "block_churn")[0]["avg_tokens_per_block"] is None


@pytest.mark.parametrize("make, message", [
    (lambda p: p / "missing", "no such run folder"),
    (lambda p: p / "empty", "not a run folder"),
    (lambda p: str(p / "zz*"), "no run folder matches"),
    (lambda p: p / "nochunks", "no parquet chunk files"),
    (lambda p: p / "badmeta", "cannot read"),
])
def test_connect_errors_name_the_path(tmp_path, make, message):
    (tmp_path / "empty").mkdir()
    write_run(tmp_path, "nochunks")
    (tmp_path / "badmeta").mkdir()
    (tmp_path / "badmeta" / "meta.json").write_text("{not json")
    arg = make(tmp_path)
    with pytest.raises(KvtraceError) as info:
        db.connect([arg])
    text = str(info.value)
    assert message in text and str(arg).rstrip("*").rstrip("z") in text and "\n" not in text


def test_duplicate_run_ids_are_refused(tmp_path):
    recompute_run(tmp_path / "a", "same")
    recompute_run(tmp_path / "b", "same")
    with pytest.raises(KvtraceError, match="also the id of"):
        db.connect([tmp_path / "a", tmp_path / "b"])


# --------------------------------------------------------------------------- the library itself

def test_every_analysis_documents_itself_and_runs_on_an_empty_run(tmp_path):
    step = {"step": 0, "start_s": 0.0, "end_s": 0.1, "prefill_tokens": 0, "decode_tokens": 0,
            "recompute_tokens": 0, "preemptions": 0, "used_blocks": 0, "total_blocks": 4}
    run = write_run(tmp_path, "empty", steps=[step])   # steps only: every other table has no chunk
    con = db.connect([run])
    infos = db.list_analyses()
    assert {i.name for i in infos} >= {
        "latency", "throughput", "goodput", "recompute", "recompute_by_request", "thrash", "thrash_windows",
        "itl_cliffs", "itl_cliff_summary", "swap", "pool", "block_churn", "request_timeline", "most_preempted",
        "summary"}
    # nothing happened in this run: no per-sequence or per-event row, and the per-run figures are zero
    no_rows = {"client_latency", "itl_cliff_summary", "itl_cliffs", "latency", "latency_cdf", "most_preempted",
               "recompute_by_request", "request_pool", "request_summary",
               "request_timeline", "step_sequences", "swap", "thrash_windows",
               "noisy_neighbours", "preemptions", "request_story", "request_verdict", "wait_causes", "worst_requests",
               "lookahead_preemptions", "tier_hits", "tier_transfers", "tier_recompute_avoided", "tier_steps"}
    for info in infos:
        assert info.description.endswith(("?", ".")), info.name
        assert "Columns" in info.doc, info.name
        result = rows(con, info.name)
        if info.name in no_rows:
            assert result == [], info.name
        else:
            assert result and {r["run_id"] for r in result} == {"empty"}, info.name
    got = {name: rows(con, name)[0] for name in ("throughput", "goodput", "recompute", "thrash", "pool")}
    assert (got["throughput"]["steps"], got["throughput"]["duration_s"], got["throughput"]["output_tokens"]) == (
        1, approx(0.1), 0)
    assert (got["goodput"]["completed_requests"], got["goodput"]["good_share"]) == (0, None)
    assert (got["recompute"]["preemptions"], got["recompute"]["recomputed_tokens"]) == (0, 0)
    assert (got["thrash"]["verdict"], got["thrash"]["preemptions"]) == ("none", 0)
    assert (got["pool"]["used_blocks"], got["pool"]["total_blocks"], got["pool"]["used_frac"]) == (0, 4, 0.0)


def test_shared_params_have_the_same_defaults_everywhere():
    defaults: dict[str, set] = {}
    for info in db.list_analyses():
        for p in info.params:
            defaults.setdefault(p.name, set()).add(p.default)
    assert {name: values for name, values in defaults.items() if len(values) > 1} == {}


def test_every_declared_param_is_used_and_every_used_one_declared():
    for info in db.list_analyses():
        text = (Path(str(db.analyses_dir())) / f"{info.name}.sql").read_text()
        used = set(re.findall(r"\$(\w+)", text))
        assert used == {p.name for p in info.params}, info.name


def test_unknown_analysis_or_param(con):
    with pytest.raises(KvtraceError, match="no analysis named 'nope'"):
        db.run_analysis(con, "nope")
    with pytest.raises(KvtraceError, match="unknown param x"):
        db.run_analysis(con, "goodput", x=1)
    with pytest.raises(KvtraceError, match="expects a number"):
        db.run_analysis(con, "goodput", ttft_ms="fast")
    with pytest.raises(KvtraceError):
        db.run_analysis(con, "_itl")


# --------------------------------------------------------------------------- golden results

def test_latency(con):
    result = rows(con, "latency")
    assert [(r["run_id"], r["metric"]) for r in result] == [
        (run, m) for run in ("rec", "swp") for m in ("ttft", "tpot", "itl", "e2el", "queueing")]
    got = by([r for r in result if r["run_id"] == "rec"], "metric")
    columns = ("num_values", "mean_ms", "p50_ms", "p90_ms", "p95_ms", "p99_ms", "p999_ms", "max_ms")
    expected = {
        # A 250, B 0.5 - 0.1875 = 312.5; p90 = 250 + 0.9 * 62.5
        "ttft": (2, 281.25, 281.25, 306.25, 309.375, 311.875, 312.4375, 312.5),
        # A (1.0 - 0.25) / 3 = 250, B (1.5 - 0.5) / 2 = 500
        "tpot": (2, 375.0, 375.0, 475.0, 487.5, 497.5, 499.75, 500.0),
        # gaps 250 250 250 (A), 750 250 (B); p90 at rank 3.6 of 0..4 = 250 + 0.6 * 500
        "itl": (5, 350.0, 250.0, 550.0, 650.0, 730.0, 748.0, 750.0),
        # A 1000, B 1.5 - 0.1875 = 1312.5
        "e2el": (2, 1156.25, 1156.25, 1281.25, 1296.875, 1309.375, 1312.1875, 1312.5),
        # A 0, B 0.25 - 0.1875 = 62.5
        "queueing": (2, 31.25, 31.25, 56.25, 59.375, 61.875, 62.4375, 62.5),
    }
    for metric, values in expected.items():
        assert tuple(got[metric][c] for c in columns) == approx(values), metric


def test_throughput(con):
    got = by(rows(con, "throughput"), "run_id")
    rec = got["rec"]
    assert rec == approx({
        "run_id": "rec", "duration_s": 1.5, "completed_requests": 2, "prompt_tokens": 10, "output_tokens": 7,
        "output_tok_s": 7 / 1.5,
        "peak_output_tok_s": 4,             # 0.25 0.5 0.5 0.75 in [0, 1); 1.0 1.25 1.5 in [1, 2)
        "steps": 6, "prefill_tokens": 15, "decode_tokens": 4, "processed_tokens": 19,
        "processed_tok_s": 19 / 1.5, "request_throughput": 2 / 1.5})
    assert (got["swp"]["prefill_tokens"], got["swp"]["decode_tokens"]) == (10, 5)


def test_goodput(con):
    # defaults (TTFT 2000, TPOT 100): A's TPOT 250 and B's 500 both miss
    assert [(r["good_requests"], r["good_share"], r["goodput_req_s"]) for r in rows(con, "goodput")] == [
        (0, 0.0, 0.0), (0, 0.0, 0.0)]
    got = by(rows(con, "goodput", tpot_ms=300), "run_id")["rec"]
    assert got == approx({"run_id": "rec", "ttft_slo_ms": 2000.0, "tpot_slo_ms": 300.0, "e2el_slo_ms": 0.0,
                          "completed_requests": 2, "good_requests": 1, "good_share": 0.5,
                          "goodput_req_s": 1 / 1.5, "duration_s": 1.5})
    # E2E only: A 1000 ok, B 1312.5 not
    got = by(rows(con, "goodput", ttft_ms=0, tpot_ms=0, e2el_ms=1100), "run_id")["rec"]
    assert got["good_requests"] == 1
    # TTFT only, 300: A 250 ok, B 312.5 not
    assert by(rows(con, "goodput", ttft_ms=300, tpot_ms=0), "run_id")["rec"]["good_requests"] == 1


def test_recompute(con):
    got = by(rows(con, "recompute"), "run_id")
    assert got["rec"] == approx({
        "run_id": "rec", "preemptions": 1, "recompute_preemptions": 1, "reprefills": 1,
        "recomputed_tokens": 4, "reprefill_cached_tokens": 0, "prefill_tokens": 15, "processed_tokens": 19,
        "recompute_share_of_prefill": 4 / 15, "recompute_share_of_processed": 4 / 19,
        "recompute_device_ms": 150 * 4 / 5,          # step 4: 150 ms for 5 positions, 4 recomputed
        "device_ms": 810.0, "recompute_device_share": 120 / 810})
    assert got["swp"] == approx({
        "run_id": "swp", "preemptions": 1, "recompute_preemptions": 0, "reprefills": 0,
        "recomputed_tokens": 0, "reprefill_cached_tokens": 0, "prefill_tokens": 10, "processed_tokens": 15,
        "recompute_share_of_prefill": 0.0, "recompute_share_of_processed": 0.0,
        "recompute_device_ms": 0.0, "device_ms": 760.0, "recompute_device_share": 0.0})


def test_recompute_by_request(con):
    assert rows(con, "recompute_by_request") == [approx({
        "run_id": "rec", "req_id": "B", "sample": 0, "recompute_preemptions": 1, "reprefills": 1,
        "recomputed_tokens": 4, "reprefill_cached_tokens": 0, "prompt_tokens": 4, "output_tokens": 3,
        "recompute_ratio": 4 / 7, "recompute_device_ms_est": 120.0})]


def test_thrash_default_thresholds(con):
    got = by(rows(con, "thrash"), "run_id")
    # one preemption in a 5 s window: 0.2/s, far under 1/s
    assert got["rec"] == approx({
        "run_id": "rec", "verdict": "occasional", "preemptions": 1, "peak_preempt_per_s": 0.2,
        "thrash_windows": 0, "thrash_s": 0.0, "preempted_sequences": 1, "repreempted_sequences": 0,
        "full_pool_step_share": 2 / 6,              # steps 1 and 3 use all 3 blocks
        "recompute_share": 4 / 19, "processed_tokens": 19, "useful_tokens": 15,
        "processed_tok_s": 19 / 1.5, "useful_tok_s": 10.0, "reloaded_tokens": 0})
    assert got["swp"]["verdict"] == "occasional" and got["swp"]["full_pool_step_share"] == approx(1 / 6)


def test_thrash_one_second_windows(con):
    # window [end - 1, end] of each step; step k ends 0.25 (k + 1); preemption in step 2.
    # step 2: 1/s, recompute 0, full 1/3          -> no
    # step 3: steps 0-3, full 2/4                 -> yes
    # step 4: steps 0-4, recompute 4/18           -> yes
    # step 5: steps 1-5, recompute 4/13, full 2/5 -> yes
    got = by(rows(con, "thrash", window_s=1), "run_id")
    assert (got["rec"]["verdict"], got["rec"]["thrash_windows"], got["rec"]["thrash_s"]) == ("sustained", 1, 1.5)
    assert got["swp"]["verdict"] == "occasional"     # swap: no recompute, pool full in 1 step of 6
    assert rows(con, "thrash_windows", window_s=1) == [approx({
        "run_id": "rec", "start_s": 0.0, "end_s": 1.5, "duration_s": 1.5, "thrashing_steps": 3,
        "peak_preempt_per_s": 1.0, "peak_recompute_share": 4 / 13, "peak_full_pool_share": 0.5, "server": ""})]
    # a higher bar on the rate: nothing thrashes
    assert rows(con, "thrash_windows", window_s=1, min_preempt_per_s=2) == []


def test_thrash_none_without_preemption(tmp_path):
    run = write_run(tmp_path, "calm", steps=[
        {"step": 0, "start_s": 0.0, "end_s": 1.0, "prefill_tokens": 4, "decode_tokens": 0, "recompute_tokens": 0,
         "preemptions": 0, "used_blocks": 1, "total_blocks": 4, "device_ms": 10.0}])
    assert rows(db.connect([run]), "thrash")[0]["verdict"] == "none"


CLIFF_COLUMNS = ("req_id", "idx", "gap_ms", "cause", "start_s", "end_s", "preempted_ms", "swapped_ms", "reprefill_ms",
                 "step_prefill_tokens")


def test_itl_cliffs_default_threshold_finds_none(con):
    # threshold = max(5 x p50 250, p99 730) = 1250 ms; the longest gap is 750
    assert rows(con, "itl_cliffs") == []


def test_itl_cliffs_causes(con):
    cliffs = rows(con, "itl_cliffs", threshold_ms=200)
    got = [tuple(r[c] for c in CLIFF_COLUMNS) for r in cliffs if r["run_id"] == "rec"]
    assert got == [
        # B preempted 0.5 -> readmitted 1.0 (500 ms), re-prefilling 1.0 -> 1.25 (250 ms)
        ("B", 1, 750.0, "preempted", 0.5, 1.25, 500.0, 0.0, 250.0, 5),
        ("A", 1, 250.0, "prefill_interference", 0.25, 0.5, 0.0, 0.0, 0.0, 4),   # B's prompt in step 1
        ("A", 2, 250.0, "other", 0.5, 0.75, 0.0, 0.0, 0.0, 0),
        ("A", 3, 250.0, "other", 0.75, 1.0, 0.0, 0.0, 0.0, 0),
        ("B", 2, 250.0, "other", 1.25, 1.5, 0.0, 0.0, 0.0, 0),
    ]
    swapped = by([r for r in cliffs if r["run_id"] == "swp"], "req_id", "idx")
    assert (swapped["B", 1]["cause"], swapped["B", 1]["swapped_ms"]) == ("swap_wait", 500.0)


def test_itl_cliff_summary(con):
    got = [r for r in rows(con, "itl_cliff_summary", threshold_ms=200) if r["run_id"] == "rec"]
    assert [(r["cause"], r["cliffs"], r["tail_ms"], r["max_gap_ms"]) for r in got] == [
        ("swap_wait", 0, 0.0, None), ("preempted", 1, 750.0, 750.0), ("reprefill", 0, 0.0, None),
        ("prefill_interference", 1, 250.0, 250.0), ("other", 3, 750.0, 250.0)]
    assert [r["tail_share"] for r in got] == approx([0, 3 / 7, 0, 1 / 7, 3 / 7])
    for r in got:
        assert (r["threshold_ms"], r["itl_p50_ms"], r["itl_p99_ms"], r["p99_p50_ratio"]) == approx(
            (200.0, 250.0, 730.0, 730 / 250))


def cliff_run(tmp_path) -> Path:
    """One sequence, tokens every u = 1/64 s but one gap of 10 u: preempted for 1 u, then 9 u of re-prefill."""
    u = 1 / 64
    times = [1, 2, 3, 4, 5, 15, 16, 17, 18, 19, 20]
    tokens = [{"req_id": "C", "sample": 0, "idx": i, "step": t, "ts_s": t * u} for i, t in enumerate(times)]
    events = [
        {"seq": 0, "step": 0, "ts_s": 0.0, "kind": "admit", "req_id": "C", "sample": 0, "reason": "new"},
        {"seq": 1, "step": 5, "ts_s": 5 * u, "kind": "preempt", "req_id": "C", "sample": 0, "reason": "recompute"},
        {"seq": 2, "step": 6, "ts_s": 6 * u, "kind": "admit", "req_id": "C", "sample": 0, "reason": "resume-recompute"},
        {"seq": 3, "step": 14, "ts_s": 15 * u, "kind": "reprefill", "req_id": "C", "sample": 0,
         "num_tokens": 9, "num_recomputed_tokens": 9},
    ]
    requests = [{"req_id": "C", "sample": 0, "n": 1, "arrival_s": 0.0, "first_scheduled_s": 0.0,
                 "first_token_s": u, "finish_s": 20 * u, "finish_reason": "stop", "output_tokens": 11,
                 "prompt_tokens": 8, "preemptions": 1, "swaps": 0}]
    # no steps table at all yet: the cause cannot be prefill interference, the view is empty
    return write_run(tmp_path, "cliff", requests=requests, kv_events=events, tokens=tokens)


def test_itl_cliffs_own_threshold_and_reprefill_cause(tmp_path):
    con = db.connect([cliff_run(tmp_path)])
    # gaps: nine of 15.625 ms, one of 156.25; p99 at rank 8.91 = 15.625 + 0.91 x 140.625 = 143.59375
    (cliff,) = rows(con, "itl_cliffs")
    assert (cliff["idx"], cliff["gap_ms"], cliff["threshold_ms"], cliff["cause"]) == (
        5, 156.25, approx(143.59375), "reprefill")
    assert (cliff["preempted_ms"], cliff["reprefill_ms"]) == (15.625, 140.625)
    # 20 x the median = 312.5 ms: no cliff
    assert rows(con, "itl_cliffs", median_multiple=20) == []
    summary = by(rows(con, "itl_cliff_summary"), "cause")
    assert summary["reprefill"]["cliffs"] == 1 and summary["reprefill"]["tail_share"] == 1.0


def test_swap(con):
    got = rows(con, "swap")
    assert [r["run_id"] for r in got] == ["swp"] * 3
    assert got == [approx(r) for r in [
        {"run_id": "swp", "direction": "swap_out", "copies": 1, "blocks": 2, "tokens": 4, "bytes": 2_000_000,
         "p50_copy_ms": 4.0, "max_copy_ms": 4.0, "total_copy_ms": 4.0,
         "p50_copy_gb_s": 0.5, "min_copy_gb_s": 0.5, "gb_s": 0.5},        # 2 MB in 4 ms
        {"run_id": "swp", "direction": "swap_in", "copies": 1, "blocks": 2, "tokens": 4, "bytes": 2_000_000,
         "p50_copy_ms": 2.0, "max_copy_ms": 2.0, "total_copy_ms": 2.0,
         "p50_copy_gb_s": 1.0, "min_copy_gb_s": 1.0, "gb_s": 1.0},        # 2 MB in 2 ms
        {"run_id": "swp", "direction": "both", "copies": 2, "blocks": 4, "tokens": 8, "bytes": 4_000_000,
         "p50_copy_ms": 3.0, "max_copy_ms": 4.0, "total_copy_ms": 6.0,
         "p50_copy_gb_s": 0.75, "min_copy_gb_s": 0.5, "gb_s": 4 / 6},     # 4 MB in 6 ms
    ]]


def test_pool(con):
    got = [r for r in rows(con, "pool") if r["run_id"] == "rec"]
    assert [(r["step"], r["used_blocks"], r["free_blocks"], r["used_frac"], r["kv_tokens"], r["preemptions"])
            for r in got] == [(0, 2, 1, approx(2 / 3), 6, 0), (1, 3, 0, 1.0, 11, 0), (2, 2, 1, approx(2 / 3), 8, 1),
                              (3, 3, 0, 1.0, 9, 0), (4, 2, 1, approx(2 / 3), 5, 0), (5, 2, 1, approx(2 / 3), 6, 0)]


def test_block_churn(con):
    got = [r for r in rows(con, "block_churn") if r["run_id"] == "rec"]
    assert got == [approx(r) for r in [
        # allocs in [0, 1): 2 + 1 + 1, frees: 1 (B's preempt); steps ending .25 .5 .75: used 2 3 2, kv 6 11 8
        {"run_id": "rec", "start_s": 0.0, "end_s": 1.0, "alloc_blocks": 4, "free_blocks": 1,
         "evicted_blocks": 0, "alloc_blocks_per_s": 4.0, "free_blocks_per_s": 1.0, "steps": 3,
         "avg_used_blocks": 7 / 3, "avg_tokens_per_block": 25 / 7, "block_fill": 25 / 28},
        # allocs in [1, 2): 2, frees: 3 (A) + 2 (B); steps ending 1.0 1.25 1.5: used 3 2 2, kv 9 5 6
        {"run_id": "rec", "start_s": 1.0, "end_s": 2.0, "alloc_blocks": 2, "free_blocks": 5,
         "evicted_blocks": 0, "alloc_blocks_per_s": 2.0, "free_blocks_per_s": 5.0, "steps": 3,
         "avg_used_blocks": 7 / 3, "avg_tokens_per_block": 20 / 7, "block_fill": 20 / 28},
    ]]
    halves = [r for r in rows(con, "block_churn", interval_s=0.5) if r["run_id"] == "rec"]
    assert [(r["start_s"], r["alloc_blocks"], r["alloc_blocks_per_s"]) for r in halves] == [
        (0.0, 3, 6.0), (0.5, 1, 2.0), (1.0, 2, 4.0), (1.5, 0, 0.0)]


def test_request_timeline(con):
    got = [(r["run_id"], r["req_id"], r["state"], r["start_s"], r["end_s"], r["duration_ms"])
           for r in rows(con, "request_timeline")]
    assert got == [
        ("rec", "B", "waiting", 0.1875, 0.25, 62.5),
        ("rec", "B", "prefill", 0.25, 0.5, 250.0),
        ("rec", "B", "preempted", 0.5, 1.0, 500.0),
        ("rec", "B", "reprefill", 1.0, 1.25, 250.0),
        ("rec", "B", "decode", 1.25, 1.5, 250.0),
        ("swp", "B", "waiting", 0.1875, 0.25, 62.5),
        ("swp", "B", "prefill", 0.25, 0.5, 250.0),
        ("swp", "B", "swapped", 0.5, 1.0, 500.0),
        ("swp", "B", "decode", 1.0, 1.5, 500.0),
    ]
    # A: admitted on arrival (a waiting interval of zero length is dropped)
    assert [(r["state"], r["start_s"], r["end_s"]) for r in rows(con, "request_timeline", req_id="A")
            if r["run_id"] == "rec"] == [("prefill", 0.0, 0.25), ("decode", 0.25, 1.0)]
    assert rows(con, "request_timeline", req_id="nobody") == []


def test_request_timeline_of_the_most_preempted_keeps_each_runs_own_ranking(con):
    """top=N: each run's N most preempted sequences, ranked within that run (as most_preempted), and no
    sequence of one run brought in because it ranks in another."""
    for top in (1, 2, 5):
        chosen = {(r["run_id"], r["req_id"], r["sample"], r["rank"]) for r in rows(con, "request_timeline", top=top)}
        assert chosen == {(r["run_id"], r["req_id"], r["sample"], r["rank"])
                          for r in rows(con, "most_preempted", limit=top)}


def test_most_preempted(con):
    assert rows(con, "most_preempted") == [approx(r) for r in [
        {"run_id": "rec", "req_id": "B", "sample": 0, "rank": 1, "preemptions": 1, "swaps": 0,
         "recomputed_tokens": 4, "stall_ms": 500.0, "e2el_ms": 1312.5, "stall_share": 500 / 1312.5,
         "output_tokens": 3, "finish_reason": "length"},
        {"run_id": "swp", "req_id": "B", "sample": 0, "rank": 1, "preemptions": 1, "swaps": 1,
         "recomputed_tokens": 0, "stall_ms": 500.0, "e2el_ms": 1312.5, "stall_share": 500 / 1312.5,
         "output_tokens": 3, "finish_reason": "length"},
    ]]
    assert rows(con, "most_preempted", limit=0) == []


def test_request_summary(con):
    # A: arrives at 0, admitted at once, tokens at 0.25 .. 1.0; B: arrives at 0.1875, scheduled at
    # 0.25, first token 0.5, preempted 0.5 .. 1.0, finished at 1.5 (recompute: its 4 positions again)
    got = by(rows(con, "request_summary"), "run_id", "req_id")
    assert got["rec", "A"] == approx({
        "run_id": "rec", "req_id": "A", "sample": 0, "arrival_s": 0.0, "prompt_tokens": 6, "output_tokens": 4,
        "finish_reason": "length", "ttft_ms": 250.0, "tpot_ms": 250.0, "e2el_ms": 1000.0, "queueing_ms": 0.0,
        "preemptions": 0, "swaps": 0, "recomputed_tokens": 0, "stall_ms": 0.0})
    assert got["rec", "B"] == approx({
        "run_id": "rec", "req_id": "B", "sample": 0, "arrival_s": 0.1875, "prompt_tokens": 4, "output_tokens": 3,
        "finish_reason": "length", "ttft_ms": 312.5, "tpot_ms": 500.0, "e2el_ms": 1312.5, "queueing_ms": 62.5,
        "preemptions": 1, "swaps": 0, "recomputed_tokens": 4, "stall_ms": 500.0})
    assert (got["swp", "B"]["swaps"], got["swp", "B"]["recomputed_tokens"], got["swp", "B"]["stall_ms"]) == (1, 0, 500.0)
    # the same preemptions, recomputed positions and stall as the most preempted table
    for r in rows(con, "most_preempted"):
        assert {k: got[r["run_id"], r["req_id"]][k] for k in ("preemptions", "recomputed_tokens", "stall_ms")} == {
            k: r[k] for k in ("preemptions", "recomputed_tokens", "stall_ms")}


def test_request_pool(con):
    # B's life, 0.1875 .. 1.5, in 4 intervals of 0.328125 s, their middles at 0.352, 0.680, 1.008,
    # 1.336: prefill, preempted, reprefill (1.0 .. 1.25), decode. Steps end every 0.25 s; rec's
    # pool (3 blocks) holds 2, 3, 2, 3, 2, 2 blocks after steps 0 .. 5: the first interval has the
    # steps ending 0.25 and 0.5 (mean 5/6), the last those ending 1.25 and 1.5 (its end included).
    # B's preemption (step 2, stamped at its start, 0.5) falls in the first.
    got = [(r["bucket"], r["start_s"], r["end_s"], r["state"], r["used_frac"], r["steps"], r["preemptions"],
            r["own_preemptions"]) for r in rows(con, "request_pool", req_id="B", buckets=4) if r["run_id"] == "rec"]
    assert got == [approx(r) for r in [
        (0, 0.1875, 0.515625, "prefill", 5 / 6, 2, 1, 1),
        (1, 0.515625, 0.84375, "preempted", 2 / 3, 1, 0, 0),
        (2, 0.84375, 1.171875, "reprefill", 1.0, 1, 0, 0),
        (3, 1.171875, 1.5, "decode", 2 / 3, 2, 0, 0),
    ]]
    assert [r["state"] for r in rows(con, "request_pool", req_id="B", buckets=4) if r["run_id"] == "swp"] == [
        "prefill", "swapped", "decode", "decode"]
    # more intervals than steps: an interval in which no step ended has the running step's occupancy
    fine = [r for r in rows(con, "request_pool", req_id="B", buckets=40) if r["run_id"] == "rec"]
    assert all(r["used_frac"] is not None for r in fine) and sum(r["steps"] for r in fine) == 6
    assert rows(con, "request_pool", req_id="nobody") == []
    assert rows(con, "request_pool", req_id="B", sample=1) == []
    assert rows(con, "request_pool", req_id="B", sample=0, buckets=4) == rows(con, "request_pool", req_id="B", buckets=4)


def test_step_sequences(con):
    # step 2 (0.5 .. 0.75): B preempted at its start, A decodes its third token
    got = [(r["run_id"], r["req_id"], r["state"], r["tokens"], r["blocks_allocated"], r["blocks_freed"], r["events"])
           for r in rows(con, "step_sequences", step=2)]
    assert got == [
        ("rec", "B", "preempted", 0, 0, 1, "preempt:recompute free:preempt"),
        ("rec", "A", "decode", 1, 0, 0, None),
        ("swp", "B", "swapped", 0, 0, 2, "preempt:swap swap_out free:preempt"),
        ("swp", "A", "decode", 1, 0, 0, None),
    ]
    # step 1: B admitted with one block, A and B each given a token
    assert [(r["req_id"], r["state"], r["tokens"], r["blocks_allocated"], r["events"])
            for r in rows(con, "step_sequences", step=1) if r["run_id"] == "rec"] == [
        ("B", "prefill", 1, 1, "admit:new alloc:prefill"), ("A", "decode", 1, 0, None)]
    assert rows(con, "step_sequences", step=99) == []


def test_summary(con):
    got = by(rows(con, "summary"), "run_id")
    assert got["rec"] == approx({
        "run_id": "rec", "model": "tiny", "device": "test cpu", "preemption_mode": "recompute",
        "preemption_policy": "newest", "block_size": 4, "num_gpu_blocks": 3,
        "duration_s": 1.5, "completed_requests": 2, "output_tokens": 7, "output_tok_s": 7 / 1.5,
        "request_throughput": 2 / 1.5, "goodput_req_s": 0.0, "good_share": 0.0,
        "ttft_p50_ms": 281.25, "ttft_p99_ms": 311.875, "tpot_p50_ms": 375.0, "tpot_p99_ms": 497.5,
        "itl_p50_ms": 250.0, "itl_p99_ms": 730.0, "e2el_p50_ms": 1156.25, "e2el_p99_ms": 1309.375,
        "preemptions": 1, "recomputed_tokens": 4, "recompute_share": 4 / 19, "recompute_device_ms": 120.0,
        "swap_out_bytes": 0, "swap_in_bytes": 0, "swap_gb_s": None,
        "thrash_verdict": "occasional", "peak_preempt_per_s": 0.2, "useful_tok_s": 10.0, "servers": 1})
    swp = got["swp"]
    assert (swp["swap_out_bytes"], swp["swap_in_bytes"], swp["swap_gb_s"]) == (2_000_000, 2_000_000, approx(4 / 6))
    assert by(rows(con, "summary", tpot_ms=300, window_s=1), "run_id")["rec"]["thrash_verdict"] == "sustained"


def test_analyses_on_one_run_match_the_multi_run_rows(root, con):
    single = db.connect([root / "swp"])
    for name in ("latency", "throughput", "summary", "swap", "most_preempted"):
        assert rows(single, name) == [r for r in rows(con, name) if r["run_id"] == "swp"], name


# --------------------------------------------------------------------------- a recorded trace

@pytest.mark.long  # records runs through the engine and the CLI
def test_every_analysis_on_a_recorded_run(tmp_path):
    """The recorder's four-block story (tests/cli/test_record.py): B is preempted at step 2, by
    recompute in one run and by swap in the other; the analyses agree with the raw tables."""
    import json

    from typer.testing import CliRunner

    import kvtrace.cli.commands  # noqa: F401  (registers the commands)
    from kvtrace.cli.app import app

    workload = tmp_path / "four.jsonl"
    workload.write_text("".join(json.dumps(r) + "\n" for r in [
        {"id": "A", "arrival_s": 0, "prompt_token_ids": [11, 12, 13, 14, 15, 16, 17], "max_tokens": 6,
         "ignore_eos": True},
        {"id": "B", "arrival_s": 0, "prompt_token_ids": [21, 22, 23, 24, 25, 26, 27], "max_tokens": 4,
         "ignore_eos": True}]))
    for mode in ("recompute", "swap"):
        result = CliRunner().invoke(app, [
            "record", "--model", "tiny", "-w", str(workload), "-o", str(tmp_path / "runs" / mode), "-q",
            "--block-size", "4", "--num-gpu-blocks", "4", "--watermark", "0", "--no-enable-prefix-caching",
            "--backlog", "--preemption-mode", mode, "--num-cpu-blocks", "4"])
        assert result.exit_code == 0, result.output
    con = db.connect([tmp_path / "runs"])
    for info in db.list_analyses():
        db.run_analysis(con, info.name)

    recompute = by(rows(con, "recompute"), "run_id")
    raw = con.sql("SELECT run_id, (SELECT sum(recomputed_tokens) FROM requests r WHERE r.run_id = s.run_id), "
                  "sum(recompute_tokens) FROM steps s GROUP BY run_id ORDER BY run_id").fetchall()
    assert raw == [("recompute", 8, 8), ("swap", 0, 0)]
    assert (recompute["recompute"]["recomputed_tokens"], recompute["swap"]["recomputed_tokens"]) == (8, 0)
    assert [r["output_tokens"] for r in rows(con, "throughput")] == [10, 10]
    assert [(r["run_id"], r["req_id"], r["preemptions"]) for r in rows(con, "most_preempted")] == [
        ("recompute", "B", 1), ("swap", "B", 1)]
    states = {(r["run_id"], r["state"]) for r in rows(con, "request_timeline")}
    assert {("recompute", "preempted"), ("recompute", "reprefill"), ("swap", "swapped")} <= states
    assert {r["direction"]: r["bytes"] > 0 for r in rows(con, "swap")} == {
        "swap_out": True, "swap_in": True, "both": True}
    # with every gap a cliff, B's gap across its preemption is put down to it
    cliffs = rows(con, "itl_cliffs", threshold_ms=1e-9)
    stalled = {(r["run_id"], r["cause"]) for r in cliffs if r["req_id"] == "B" and r["cause"] not in (
        "prefill_interference", "other")}
    assert stalled in ({("recompute", "preempted"), ("swap", "swap_wait")},
                       {("recompute", "reprefill"), ("swap", "swap_wait")})


def test_thrash_windows_never_overlap(tmp_path):
    # preemptions at the steps ending 1 s and 3.4 s; with 2 s windows the steps ending 1, 2, 3
    # thrash, the one ending 3.2 does not, and the one ending 3.4 does again: its window reaches
    # back to 1.4 s, inside the first thrash window, so the second starts where the first ended
    ends = [1.0, 2.0, 3.0, 3.2, 3.4]
    preempts = [3, 0, 0, 0, 3]
    steps = [{"step": i, "start_s": (ends[i - 1] if i else 0.0), "end_s": e, "prefill_tokens": 0,
              "decode_tokens": 4, "recompute_tokens": 0, "preemptions": p, "used_blocks": 4, "total_blocks": 4,
              "device_ms": 1.0} for i, (e, p) in enumerate(zip(ends, preempts))]
    run = write_run(tmp_path, "close", steps=steps)
    windows = rows(db.connect([run]), "thrash_windows", window_s=2)
    assert [(w["start_s"], w["end_s"], w["thrashing_steps"]) for w in windows] == [
        (0.0, 3.0, 3), (approx(3.0), approx(3.4), 1)]
    verdict = rows(db.connect([run]), "thrash", window_s=2)[0]
    assert verdict["thrash_s"] == approx(3.4)


def test_a_zero_length_run_has_null_rates_not_nan(tmp_path):
    """One request rejected on arrival: no steps, a span of zero seconds."""
    write_run(tmp_path, "empty", requests=[{
        "req_id": "X", "sample": 0, "n": 1, "priority": 0, "arrival_s": 0.5, "prompt_tokens": 9000,
        "max_tokens": 4, "output_tokens": 0, "first_scheduled_s": None, "first_token_s": None, "finish_s": 0.5,
        "preemptions": 0, "swaps": 0, "recomputed_tokens": 0, "prefix_hit_tokens": 0, "finish_reason": "rejected"}])
    con = db.connect([tmp_path / "empty"])
    (throughput,) = rows(con, "throughput")
    assert throughput["duration_s"] is None
    assert throughput["output_tok_s"] is None and throughput["processed_tok_s"] is None
    for name in ("summary", "goodput", "thrash"):
        for row in rows(con, name):
            assert not any(isinstance(v, float) and v != v for v in row.values()), (name, row)
