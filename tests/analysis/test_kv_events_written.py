"""The kv_events table the writer makes is the engine's events, row for row: an alloc event carries the
blocks it evicted from the prefix cache (one object for a prefill that evicts dozens), and the writer
turns each into an `evict` row of its own right before the alloc, with the seq numbers the engine
left free for them."""
from __future__ import annotations

import math

import pytest

from engine.events import ALLOC, EVICT, AllocReason, KVEvent, StepRecord, with_evictions
from engine.sequence import SamplingParams
from kvtrace.record.recorder import TraceWriter
from kvtrace.trace import db
from tests.helpers.engine_runs import ListTracer, run_checked

COLUMNS = ("seq", "step", "ts_s", "kind", "req_id", "sample", "blocks", "num_blocks", "num_tokens", "bytes",
           "duration_ms", "reason", "num_cached_tokens", "num_recomputed_tokens", "src_blocks", "requester_req_id",
           "requester_sample", "victim_reason")


class Tee:
    """The writer, and a copy of every record kept in memory."""

    def __init__(self, writer: TraceWriter) -> None:
        self.writer, self.kept = writer, ListTracer()

    def on_step(self, record) -> None:
        self.kept.on_step(record)
        self.writer.on_step(record)


def teed_engine(tmp_path, make_engine, engine: str, max_rows: int, **settings):
    """An engine (real or simulated) whose step records go to a TraceWriter of tmp_path/run and to a
    kept copy; returns (engine, tee)."""
    writer = TraceWriter(tmp_path / "run", "run", max_rows=max_rows, engine_makes_tables=engine == "sim")
    sim = {"engine": "sim", "hardware": "a100-80gb"} if engine == "sim" else {}
    tee = Tee(writer)
    return make_engine(tee, **settings, **sim), tee


def run_and_close(tmp_path, e, tee: Tee) -> None:
    run_checked(e)
    tee.writer.close()
    (tmp_path / "run" / "meta.json").write_text('{"run_id": "run", "schema_version": 3}')


@pytest.mark.parametrize("engine", ["real", "sim"])
@pytest.mark.parametrize("max_rows", [7, 200_000])
def test_every_eviction_is_a_row_before_the_alloc_that_made_it(tmp_path, make_engine, engine, max_rows):
    e, tee = teed_engine(tmp_path, make_engine, engine, max_rows, block_size=4, num_gpu_blocks=14,
                         enable_prefix_caching=True)
    # finished prompts leave their full blocks cached; later prompts (a shared prefix among them) take
    # those blocks back, a prefill evicting several at once, a decode one
    shared = list(range(100, 108))
    for i in range(10):
        own = [200 + 10 * i + j for j in range(5 + i % 4)]
        e.add_request(f"r{i}", (shared if i % 3 == 0 else []) + own,
                      SamplingParams(max_tokens=6 + i % 5, ignore_eos=True), arrival_s=0.0)
    run_and_close(tmp_path, e, tee)

    written = assert_written_as_kept(tmp_path / "run", tee)
    allocs = [ev for r in tee.kept.records for ev in r.events if ev.kind == "alloc" and ev.evicted]
    assert any(len(ev.evicted) > 1 for ev in allocs) and any(ev.reason == "decode" for ev in allocs)
    assert all(set(ev.evicted) <= set(ev.blocks) for ev in allocs)   # an evicted block is one the alloc took
    assert sum(1 for row in written if row[3] == EVICT) == sum(len(ev.evicted) for ev in allocs)
    if max_rows == 7:
        assert len(list((tmp_path / "run" / "kv_events").glob("part-*.parquet"))) > 3


def assert_written_as_kept(run, tee: Tee) -> list[tuple]:
    """The written kv_events, every column, equal the engine's events (evictions expanded); returns them."""
    expected = [tuple(getattr(ev, c) if c != "num_blocks" else len(ev.blocks or ()) for c in COLUMNS)
                for ev in tee.kept.events]
    con = db.connect([run])
    written = [tuple(row) for row in con.sql(f"SELECT {', '.join(COLUMNS)} FROM kv_events ORDER BY seq").fetchall()]
    normalised = [tuple(list(v) if isinstance(v, (list, tuple)) and v is not None else v for v in row)
                  for row in expected]
    assert [r[0] for r in written] == list(range(len(written)))   # seq: every number once, none skipped
    assert written == normalised
    return written


@pytest.mark.parametrize("engine", ["real", "sim"])
@pytest.mark.parametrize("max_rows", [5, 200_000])
def test_the_rarer_kinds_keep_every_field(tmp_path, make_engine, engine, max_rows):
    # preemptions by swap and by recompute, swaps both ways, re-prefills, copy-on-write forks: the
    # fields only these kinds set (bytes, src_blocks, requester_*, ...) are written from them alone
    e, tee = teed_engine(tmp_path, make_engine, engine, max_rows, block_size=4, num_gpu_blocks=12, num_cpu_blocks=6,
                         preemption_mode="swap", n_mode="cow", enable_prefix_caching=True)
    for i in range(6):
        e.add_request(f"r{i}", [300 + 7 * i + j for j in range(6 + i % 3)],
                      SamplingParams(max_tokens=10 + i % 4, ignore_eos=True, n=2 if i % 2 else 1), arrival_s=0.0)
    run_and_close(tmp_path, e, tee)
    written = assert_written_as_kept(tmp_path / "run", tee)
    kinds = {row[3] for row in written}
    assert {"preempt", "swap_out", "swap_in", "cow", "reprefill"} <= kinds, kinds
    bytes_at, requester_at = COLUMNS.index("bytes"), COLUMNS.index("requester_req_id")
    assert any(row[bytes_at] for row in written if row[3] == "swap_out")
    assert all(row[requester_at] for row in written if row[3] == "preempt")


def test_with_evictions_puts_them_first_in_the_order_evicted():
    from engine.events import ALLOC, KVEvent
    alloc = KVEvent(ALLOC, "a", 1, blocks=[5, 3, 9], evicted=[3, 9], step=4, ts_s=1.5, seq=12)
    finish = KVEvent("finish", "b", 0, step=4, ts_s=1.5, seq=13)
    out = with_evictions([alloc, finish])
    assert [(x.kind, x.req_id, x.blocks, x.seq, x.step, x.ts_s) for x in out] == [
        ("evict", "", [3], 10, 4, 1.5), ("evict", "", [9], 11, 4, 1.5), ("alloc", "a", [5, 3, 9], 12, 4, 1.5),
        ("finish", "b", None, 13, 4, 1.5)]


def test_a_chunk_closes_when_its_events_reach_max_rows(tmp_path):
    """Steps that emit no token (long prefills, a pool busy preempting) still close a chunk once their
    events reach max_rows: a crash loses at most that many, and the buffers stay bounded."""
    writer = TraceWriter(tmp_path / "run", "run", max_rows=10, flush_seconds=math.inf)
    for step in range(12):   # 4 events a step, no token: a chunk every 3 steps
        events = [KVEvent(ALLOC, f"r{step}", 0, blocks=[i + 1], reason=AllocReason.PREFILL, step=step,
                          ts_s=float(step), seq=4 * step + i) for i in range(4)]
        writer.on_step(StepRecord(step=step, start_s=float(step), end_s=step + 0.5, device_ms=None, num_running=1,
                                  num_waiting=0, num_swapped=0, num_prefill_tokens=4, num_decode_tokens=0,
                                  num_recompute_tokens=0, num_free_blocks=10, num_used_blocks=4, num_cached_blocks=0,
                                  num_total_blocks=14, num_kv_tokens=4, num_preemptions=0, events=events))
    writer.close()
    assert len(list((tmp_path / "run" / "kv_events").glob("part-*.parquet"))) == 4
    assert writer.rows_written["kv_events"] == 48
