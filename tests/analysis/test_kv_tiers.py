"""Schema 6's KV tiers: the recorder writes the tier events and columns the engine hands it, the
analyses read them (tier_hits, tier_transfers, tier_recompute_avoided, tier_steps), and a run without a
tier, or one written before schema 6, reads with the columns null and no row in any of them.

The tiered run, written through the TraceWriter by hand (blocks of 4 positions, 1,000 bytes each):

    step 0  a (prompt 12) looked up: nothing anywhere; its 3 blocks offloaded to cpu (3,000 B, 0.6 ms)
    step 1  b (prompt 12) looked up: 4 positions on the device, 4 in cpu; cpu drops 2 blocks (LRU)
    step 2  b's 4 positions loaded from cpu (1,000 B, 0.4 ms); b's block offloaded: failed (time unknown)
    step 3  c (16 positions, resumed after a recompute preemption) looked up: 12 in cpu, then nothing
            more in disk; 12 loaded (3,000 B, 1.0 ms), the last block's 4 failed (1,000 B, 0.2 ms)
    requests: a and d loaded nothing, b 4 positions, c 12 (and recomputed the 4 of the failed load)
"""
from __future__ import annotations

import json

import pyarrow.parquet as pq
from pytest import approx

from engine import events as ev
from engine.events import KVEvent, RequestStats, StepRecord
from kvtrace.record.recorder import TraceWriter
from kvtrace.trace import db
from kvtrace.trace.schema import TIER_ONLY
from tests.analysis.step_records import step_record

TIER_ANALYSES = ("tier_hits", "tier_transfers", "tier_recompute_avoided", "tier_steps")
FAILED = ev.TransferReason.FAILED


def _step(step: int, events: list[KVEvent], tier: tuple | None, finished: list[RequestStats] = ()) -> StepRecord:
    """A step record of `events` (numbered from step * 10, stamped at its start); `tier`: its (offload_bytes,
    load_bytes, tier_transfer_ms), None in a run without a tier."""
    offload, load, ms = tier if tier is not None else (None, None, None)
    return step_record(step, events, stamp=lambda e, start, end: start, finished=finished, device_ms=None,
                       num_running=1, num_decode_tokens=0, offload_bytes=offload, load_bytes=load,
                       tier_transfer_ms=ms)


def _request(req_id: str, tier_hit_tokens: int | None, recomputed_tokens: int = 0) -> RequestStats:
    return RequestStats(req_id=req_id, sample=0, n=1, priority=0, arrival_s=0.0, prompt_tokens=12, max_tokens=4,
                        output_tokens=4, first_scheduled_s=0.0, first_token_s=0.1, finish_s=0.4,
                        finish_reason="length", preemptions=1 if recomputed_tokens else 0, swaps=0,
                        recomputed_tokens=recomputed_tokens, prefix_hit_tokens=0, tier_hit_tokens=tier_hit_tokens)


def _write(run, records: list[StepRecord], schema_version: int = 6) -> None:
    writer = TraceWriter(run, run.name)
    for record in records:
        writer.on_step(record)
    writer.close()
    (run / "meta.json").write_text(json.dumps({"run_id": run.name, "schema_version": schema_version}))


def _lookup(req_id: str, num_tokens: int, cached: int, found: int, tier: str, reason: str) -> KVEvent:
    return KVEvent(ev.LOOKUP, req_id, num_tokens=num_tokens, num_cached_tokens=cached, tier_tokens=found, tier=tier,
                   reason=reason)


def _copy(kind: str, req_id: str, blocks: list[int], ms: float | None, reason: str | None = None) -> KVEvent:
    return KVEvent(kind, req_id, blocks=blocks, num_tokens=4 * len(blocks), bytes=1000 * len(blocks),
                   duration_ms=ms, tier="cpu", reason=reason)


def tiered_run(root):
    run = root / "tiered"
    _write(run, [
        _step(0, [_lookup("a", 12, 0, 0, "cpu", "new"),
                  KVEvent(ev.ALLOC, "a", blocks=[1, 2, 3], reason="prefill"),
                  _copy(ev.OFFLOAD, "a", [1, 2, 3], 0.6)], (3000, 0, 0.6)),
        _step(1, [_lookup("b", 12, 4, 4, "cpu", "new"),
                  KVEvent(ev.TIER_EVICT, "", num_tier_blocks=2, tier="cpu")], (0, 0, None)),
        _step(2, [_copy(ev.LOAD, "b", [5], 0.4), _copy(ev.OFFLOAD, "b", [6], None, FAILED)], (1000, 1000, 0.4)),
        _step(3, [_lookup("c", 16, 0, 12, "cpu", "resume-recompute"),
                  _lookup("c", 16, 12, 0, "disk", "resume-recompute"),
                  _copy(ev.LOAD, "c", [7, 8, 9], 1.0), _copy(ev.LOAD, "c", [10], 0.2, FAILED)], (0, 4000, 1.2),
              finished=[_request("a", 0), _request("b", 4), _request("c", 12, recomputed_tokens=4),
                        _request("d", 0)]),
    ])
    return run


def plain_run(root, name: str = "plain"):
    """A run without a tier: one step, one alloc, one request."""
    run = root / name
    _write(run, [_step(0, [KVEvent(ev.ALLOC, "a", blocks=[1], reason="prefill")], None,
                       finished=[_request("a", None)])])
    return run


def rows(con, name: str) -> list[dict]:
    return db.records(db.run_analysis(con, name))


def test_the_recorder_writes_the_tier_events_and_columns(tmp_path):
    con = db.connect([tiered_run(tmp_path)])
    events = con.sql("SELECT kind, req_id, blocks, num_blocks, num_tokens, num_cached_tokens, num_recomputed_tokens, "
                     "tier, tier_tokens, reason FROM kv_events ORDER BY seq").fetchall()
    assert events[:4] == [("lookup", "a", None, 0, 12, 0, 0, "cpu", 0, "new"),
                          ("alloc", "a", [1, 2, 3], 3, 0, 0, 0, None, None, "prefill"),   # no tier: null
                          ("offload", "a", [1, 2, 3], 3, 12, 0, 0, "cpu", None, None),
                          ("lookup", "b", None, 0, 12, 4, 0, "cpu", 4, "new")]
    assert events[4] == ("tier_evict", "", None, 2, 0, 0, 0, "cpu", None, None)   # the tier's blocks, counted
    assert con.sql("SELECT step, offload_bytes, load_bytes, tier_transfer_ms FROM steps ORDER BY step").fetchall() == [
        (0, 3000, 0, 0.6), (1, 0, 0, None), (2, 1000, 1000, 0.4), (3, 0, 4000, 1.2)]
    assert con.sql("SELECT req_id, tier_hit_tokens FROM requests ORDER BY req_id").fetchall() == [
        ("a", 0), ("b", 4), ("c", 12), ("d", 0)]
    # the trace's identities: a step's bytes are its events', a request's hits its loads' but the failed
    assert con.sql("SELECT step FROM steps JOIN (SELECT step, "
                   "coalesce(sum(bytes) FILTER (WHERE kind = 'offload'), 0) o, "
                   "coalesce(sum(bytes) FILTER (WHERE kind = 'load'), 0) l FROM kv_events GROUP BY step) USING (step) "
                   "WHERE offload_bytes <> o OR load_bytes <> l").fetchall() == []
    assert con.sql("SELECT req_id, tier_hit_tokens, (SELECT coalesce(sum(num_tokens), 0) FROM kv_events e WHERE "
                   "e.kind = 'load' AND e.req_id = r.req_id AND e.reason IS DISTINCT FROM 'failed') FROM requests r "
                   "ORDER BY req_id").fetchall() == [("a", 0, 0), ("b", 4, 4), ("c", 12, 12), ("d", 0, 0)]


def test_tier_hits(tmp_path):
    con = db.connect([tiered_run(tmp_path)])
    got = {r["tier"]: r for r in rows(con, "tier_hits")}
    figures = ("lookups", "resumed_lookups", "lookup_tokens", "device_hit_tokens", "tier_hit_tokens",
               "computed_tokens", "evicted_blocks")
    # cpu: a 12 found nowhere; b 4 on the device, 4 in cpu, 4 computed; c 12 in cpu, 4 left
    assert {tier: tuple(r[f] for f in figures) for tier, r in got.items()} == {
        "cpu": (3, 1, 40, 4, 16, 20, 2), "disk": (1, 1, 16, 12, 0, 4, 0)}
    assert got["cpu"]["tier_hit_rate"] == approx(16 / 36)   # of what the device did not hold
    assert got["disk"]["tier_hit_rate"] == 0.0


def test_tier_transfers(tmp_path):
    con = db.connect([tiered_run(tmp_path)])
    got = {(r["tier"], r["direction"]): r for r in rows(con, "tier_transfers")}
    assert list(got) == [("cpu", "offload"), ("cpu", "load")]
    figures = ("copies", "failed", "blocks", "tokens", "bytes", "timed_copies")
    assert tuple(got["cpu", "offload"][f] for f in figures) == (2, 1, 4, 16, 4000, 1)
    assert tuple(got["cpu", "load"][f] for f in figures) == (3, 1, 5, 20, 5000, 3)
    offload, load = got["cpu", "offload"], got["cpu", "load"]
    assert (offload["total_ms"], offload["p50_ms"], offload["p99_ms"]) == (approx(0.6), approx(0.6), approx(0.6))
    # the loads took 0.2, 0.4 and 1.0 ms: the 99th percentile lies 98% of the way from 0.4 to 1.0
    assert (load["total_ms"], load["p50_ms"], load["p99_ms"]) == (approx(1.6), approx(0.4), approx(0.988))


def test_tier_recompute_avoided(tmp_path):
    con = db.connect([tiered_run(tmp_path)])
    got = [(r["req_id"], r["recomputed_tokens"], r["tier_hit_tokens"], r["loads"], r["failed_loads"],
            r["load_wait_ms"] and round(r["load_wait_ms"], 9)) for r in rows(con, "tier_recompute_avoided")]
    assert got == [("c", 4, 12, 2, 1, 1.2), ("b", 0, 4, 1, 0, 0.4), ("a", 0, 0, 0, 0, None), ("d", 0, 0, 0, 0, None)]


def test_tier_steps(tmp_path):
    con = db.connect([tiered_run(tmp_path)])
    assert [(r["server"], r["step"], r["offload_bytes"], r["load_bytes"], r["tier_transfer_ms"])
            for r in rows(con, "tier_steps")] == [
        ("", 0, 3000, 0, 0.6), ("", 1, 0, 0, None), ("", 2, 1000, 1000, 0.4), ("", 3, 0, 4000, 1.2)]


def test_a_run_without_a_tier_and_one_before_schema_6_read_with_the_columns_null(tmp_path):
    """A run without a tier writes the columns null; a run of schema 5, whose chunks lack them, reads them
    as null, beside a tiered run in the same connection; neither has a row in the tier analyses."""
    tiered, plain = tiered_run(tmp_path), plain_run(tmp_path)
    old = plain_run(tmp_path, "old")
    (old / "meta.json").write_text(json.dumps({"run_id": "old", "schema_version": 5}))
    dropped = 0
    for table, columns in TIER_ONLY.items():
        for chunk in (old / table).glob("part-*.parquet"):
            written = pq.read_table(chunk)
            pq.write_table(written.drop_columns(list(columns)), chunk)
            dropped += len(columns)
    assert dropped == 6
    con = db.connect([tiered, plain, old])
    for run in ("plain", "old"):
        assert con.sql(f"SELECT offload_bytes, load_bytes, tier_transfer_ms FROM steps WHERE run_id = '{run}'"
                       ).fetchall() == [(None, None, None)]
        assert con.sql(f"SELECT tier_hit_tokens FROM requests WHERE run_id = '{run}'").fetchall() == [(None,)]
        assert con.sql(f"SELECT kind, tier, tier_tokens FROM kv_events WHERE run_id = '{run}'").fetchall() == [
            ("alloc", None, None)]
    for name in TIER_ANALYSES:
        assert {r["run_id"] for r in rows(con, name)} == {"tiered"}, name
        assert rows(db.connect([plain, old]), name) == [], name


def test_a_tiered_runs_steps_beside_a_leaps_keep_their_tier_columns():
    """A chunk of step records and a leap (the simulator's decode-only steps taken at once) merged by step:
    the records' tier columns kept in their rows, the leap's steps null (it says nothing of tiers)."""
    from engine.sim.leap import DecodeLeap, LeapAllocs
    from kvtrace.record.tables import steps_table

    leap = DecodeLeap(first_step=1, start_s=[0.1, 0.2], end_s=[0.15, 0.25], device_ms=[1.0, 1.0],
                      num_free_blocks=[4, 4], num_cached_blocks=[0, 0], num_running=1, num_total_blocks=8,
                      first_kv_tokens=16, first_event_seq=10, allocs=LeapAllocs(), token_req_ids=["a"],
                      token_samples=[0], first_token_idx=[0])
    table = steps_table([_step(0, [], (3000, 0, 0.6)), leap, _step(3, [], (0, 1000, None))], "run")
    assert [(r["step"], r["offload_bytes"], r["load_bytes"], r["tier_transfer_ms"]) for r in table.to_pylist()] == [
        (0, 3000, 0, 0.6), (1, None, None, None), (2, None, None, None), (3, 0, 1000, None)]
    # a leap of an engine with a tier (the simulator's fast path beside one): no copy finished in its steps,
    # as the general pass records them; alone in a chunk too
    leap.tier = True
    table = steps_table([_step(0, [], (3000, 0, 0.6)), leap, _step(3, [], (0, 1000, None))], "run")
    assert [(r["step"], r["offload_bytes"], r["load_bytes"], r["tier_transfer_ms"]) for r in table.to_pylist()] == [
        (0, 3000, 0, 0.6), (1, 0, 0, 0.0), (2, 0, 0, 0.0), (3, 0, 1000, None)]
    assert [(r["offload_bytes"], r["load_bytes"], r["tier_transfer_ms"]) for r in steps_table([leap], "run").to_pylist()] \
        == [(0, 0, 0.0)] * 2


def test_compare_has_a_row_for_each_kv_tier(tmp_path):
    """`kvtrace compare` of a run without a tier against one with two: the headline's "KV tiers" line (the
    dashboard's figures each side) and each tier's figures in the table and the JSON, null for the run
    without it."""
    from typer.testing import CliRunner

    import kvtrace.cli.sql  # noqa: F401  (registers the commands)
    from kvtrace.cli.app import app

    plain, tiered = plain_run(tmp_path), tiered_run(tmp_path)
    result = CliRunner().invoke(app, ["compare", str(plain), str(tiered)])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("KV tiers"))
    assert line.split()[2:4] == ["–", "→"] and "cpu 44% hit · 16 tok back · 4 kB stored, 5 kB loaded; disk 0.0% hit" in line
    document = json.loads(CliRunner().invoke(app, ["compare", str(tiered), str(plain), "--format", "json"]).stdout)
    metrics = {m["metric"]: m["values"] for m in document["metrics"]}
    assert metrics["tier_cpu_hit_tokens"] == {"tiered": 16, "plain": None}
    assert metrics["tier_cpu_stored_bytes"] == {"tiered": 4000, "plain": None}
    assert metrics["tier_cpu_loaded_bytes"] == {"tiered": 5000, "plain": None}
    assert metrics["tier_disk_hit_tokens"] == {"tiered": 0, "plain": None}
    back = document["changes"][0]["figures"]["tier_hit_tokens"]
    assert (back["base"], back["value"], back["better"]) == (16, None, None)
    # two runs without a tier: no tier line, no tier row
    result = CliRunner().invoke(app, ["compare", str(plain), str(plain_run(tmp_path, "plain2"))])
    assert result.exit_code == 0 and "KV tiers" not in result.stdout and "tier_" not in result.stdout
