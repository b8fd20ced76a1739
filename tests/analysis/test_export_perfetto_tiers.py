"""`kvtrace export perfetto` of a run with a KV tier (schema 6): each tier's track of copies and evictions,
the flows between each copy and its sequence's states, and the tier's counters, decoded back with
Perfetto's own protobuf classes (test_export_perfetto.decode).

The run, written through the TraceWriter by hand (steps at 0.1 s, each 50 ms long; scheduling events
stamped at a step's start, copies at its end, each with its own duration where timed):

    step 0  r7 (prompt 12) and v (prompt 8) admitted; v's blocks 3, 4 stored (0.5 ms: 49.5-50 ms)
    step 1  r7 grows: v preempted for it; r7's blocks 0-2 stored (100 ms, over a slow link: 50-150 ms,
            starting as v's ends); the tier evicts 2 blocks
    step 2  v looked up: 8 positions in cpu, loaded in 3.1 ms (246.9-250 ms); r7's block 9 stored
            (150 ms: 100-250 ms, beginning inside the store before and ending after it: a second lane)
    step 3  v readmitted (its reprefill); w (arrived at 250 ms) admitted before its load is done, as a
            capture may mark it
    step 4  w's load of block 8 failed, untimed (an instant at 450 ms); r7 and v finish
    step 5  w's first token; w finishes
"""
from __future__ import annotations

import json
from pathlib import Path

from engine import events as ev
from engine.events import KVEvent, RequestStats, StepRecord
from kvtrace.export import perfetto
from kvtrace.record.recorder import TraceWriter
from tests.analysis.step_records import step_record
from tests.analysis.test_export_perfetto import COUNTER_NAMES, decode

SCHEDULED = {ev.ADMIT, ev.PREEMPT, ev.ALLOC, ev.LOOKUP}   # stamped at the step's start
MS = 1_000_000   # ns


def _step(step: int, events: list[KVEvent], finished=(), preemptions: int = 0) -> StepRecord:
    return step_record(step, events, stamp=lambda e, start, end: start if e.kind in SCHEDULED else end,
                       finished=finished, num_total_blocks=16, num_preemptions=preemptions)


def _finished(req_id: str, prompt: int, arrival: float, first_token: float, finish: float,
              preemptions: int = 0, loaded: int = 0) -> RequestStats:
    return RequestStats(req_id=req_id, sample=0, n=1, priority=0, arrival_s=arrival, prompt_tokens=prompt,
                        max_tokens=4, output_tokens=4, first_scheduled_s=arrival, first_token_s=first_token,
                        finish_s=finish, finish_reason="length", preemptions=preemptions, swaps=0,
                        recomputed_tokens=0, prefix_hit_tokens=0, tier_hit_tokens=loaded)


def _copy(kind: str, req_id: str, blocks: list[int], num_tokens: int, ms: float | None,
          reason: str | None = None) -> KVEvent:
    return KVEvent(kind, req_id, blocks=blocks, num_tokens=num_tokens, bytes=1000 * len(blocks), duration_ms=ms,
                   tier="cpu", reason=reason)


def tiered_run(root, name: str = "tier-timeline"):
    run = root / name
    writer = TraceWriter(run, run.name)
    for record in (
        _step(0, [KVEvent(ev.ADMIT, "r7", num_tokens=12, reason="new"), KVEvent(ev.ADMIT, "v", num_tokens=8, reason="new"),
                  KVEvent(ev.ALLOC, "r7", blocks=[0, 1, 2], reason="prefill"),
                  KVEvent(ev.ALLOC, "v", blocks=[3, 4], reason="prefill"),
                  _copy(ev.OFFLOAD, "v", [3, 4], 8, 0.5)]),
        _step(1, [KVEvent(ev.PREEMPT, "v", blocks=[3, 4], num_tokens=9, reason="recompute",
                          requester_req_id="r7", requester_sample=0, victim_reason="newest"),
                  KVEvent(ev.ALLOC, "r7", blocks=[9], reason="decode"),
                  _copy(ev.OFFLOAD, "r7", [0, 1, 2], 12, 100.0),
                  KVEvent(ev.TIER_EVICT, "", num_tier_blocks=2, tier="cpu")], preemptions=1),
        _step(2, [KVEvent(ev.LOOKUP, "v", num_tokens=9, num_cached_tokens=0, tier_tokens=8, tier="cpu",
                          reason="resume-recompute"),
                  _copy(ev.LOAD, "v", [5, 6], 8, 3.1), _copy(ev.OFFLOAD, "r7", [9], 4, 150.0)]),
        _step(3, [KVEvent(ev.ADMIT, "v", num_tokens=1, reason="resume-recompute"),
                  KVEvent(ev.ADMIT, "w", num_tokens=4, reason="new"),
                  KVEvent(ev.REPREFILL, "v", num_tokens=9, num_cached_tokens=0, num_recomputed_tokens=1, tier_tokens=8)]),
        _step(4, [_copy(ev.LOAD, "w", [8], 4, None, ev.TransferReason.FAILED),
                  KVEvent(ev.FINISH, "r7", num_tokens=4, reason="length"),
                  KVEvent(ev.FINISH, "v", num_tokens=4, reason="length")],
              finished=[_finished("r7", 12, 0.0, 0.05, 0.45), _finished("v", 8, 0.0, 0.05, 0.45, 1, 8)]),
        _step(5, [KVEvent(ev.FINISH, "w", num_tokens=4, reason="length")],
              finished=[_finished("w", 4, 0.25, 0.5, 0.55)]),
    ):
        writer.on_step(record)
    writer.close()
    (run / "meta.json").write_text(json.dumps({"run_id": run.name, "schema_version": 6}))
    return run


def test_the_tier_track_has_a_slice_per_copy_an_instant_per_eviction_and_flows_to_the_sequences(tmp_path):
    out = tmp_path / "tier.pftrace"
    perfetto.export_perfetto([tiered_run(tmp_path)], out)
    trace = decode(out)
    group = trace.track_named("run tier-timeline")
    children = trace.children(group)
    # after the counters: the tier's two lanes (one name: the UI shows them as one track), its counters
    assert [t.name for t in children] == ["engine", *COUNTER_NAMES, "KV tier: cpu", "KV tier: cpu",
                                          "cpu: bytes stored (cumulative)", "cpu: bytes loaded (cumulative)",
                                          "Requests"]
    lanes = [t.uuid for t in children if t.name == "KV tier: cpu"]
    assert all(trace.tracks[uuid].sibling_merge_behavior == 1 for uuid in lanes)   # BY_TRACK_NAME

    tier = sorted((s for s in trace.slices if s.track in lanes), key=lambda s: (s.ts, s.depth))
    assert [(lanes.index(s.track), s.name, s.ts, s.end, s.depth) for s in tier] == [
        (0, "offload v · 2 blocks · 2.0 kB", 49_500_000, 50 * MS, 0),
        (0, "offload r7 · 3 blocks · 3.0 kB", 50 * MS, 150 * MS, 0),
        (1, "offload r7 · 1 block · 1.0 kB", 100 * MS, 250 * MS, 0),   # overlaps the one before: lane 1
        (0, "evicts 2 blocks", 150 * MS, 150 * MS, 0),
        (0, "load v · 8 tok · 2.0 kB", 246_900_000, 250 * MS, 0),
        (0, "load w · 4 tok · 1.0 kB · failed", 450 * MS, 450 * MS, 0)]   # untimed: an instant
    args = ("step", "sequence", "blocks", "num_blocks", "num_tokens", "bytes", "duration_ms", "reason")
    assert [tuple(s.args.get(a) for a in args) for s in tier] == [
        (0, "v", "3 4", 2, 8, 2000, 0.5, None),
        (1, "r7", "0 1 2", 3, 12, 3000, 100.0, None),
        (2, "r7", "9", 1, 4, 1000, 150.0, None),
        (1, None, None, 2, 0, 0, None, None),
        (2, "v", "5 6", 2, 8, 2000, 3.1, None),
        (4, "w", "8", 1, 4, 1000, None, "failed")]

    # each flow from whichever of the two began first (at a tie, the copy) to the other
    sequences = {t.uuid: t.name for t in trace.children(trace.track_named("Requests", group))}
    origins = {f: s for s in trace.slices for f in s.flow_ids}
    targets = {f: s for s in trace.slices for f in s.terminating_flow_ids}
    assert set(origins) == set(targets)

    def end(s) -> str:
        return f"{sequences[s.track]}:{s.name}" if s.track in sequences else s.name

    tier_flows = {(end(origins[f]), end(targets[f])) for f in origins
                  if origins[f].track in lanes or targets[f].track in lanes}
    assert tier_flows == {
        ("v:prefill", "offload v · 2 blocks · 2.0 kB"),          # the phase that computed the blocks
        ("offload r7 · 3 blocks · 3.0 kB", "r7:decode"),          # began as r7's decode did: the copy first
        ("r7:decode", "offload r7 · 1 block · 1.0 kB"),
        ("load v · 8 tok · 2.0 kB", "v:reprefill"),              # the phase it resumes in
        ("w:prefill", "load w · 4 tok · 1.0 kB · failed")}       # admitted before its load was done
    assert all(origins[f].ts <= targets[f].ts for f in origins), "a flow going back in time"
    # the run's other flows are still there: the preemption's and the resumption's from the engine, the requester's
    assert {(end(origins[f]), end(targets[f])) for f in origins} - tier_flows == {
        ("prefill+decode", "v:preempted"), ("r7:preempts v", "v:preempted"), ("prefill+decode", "v:reprefill")}

    stored = trace.counters[trace.track_named("cpu: bytes stored (cumulative)", group)]
    loaded = trace.counters[trace.track_named("cpu: bytes loaded (cumulative)", group)]
    assert stored == [(0, 0), (50 * MS, 2000), (150 * MS, 5000), (250 * MS, 6000)]
    assert loaded == [(0, 0), (250 * MS, 2000), (450 * MS, 3000)]   # the failed load's bytes too


def test_a_run_without_a_tier_has_no_tier_track(tmp_path):
    from tests.analysis.test_kv_tiers import plain_run

    out = tmp_path / "plain.pftrace"
    perfetto.export_perfetto([plain_run(tmp_path)], out)
    trace = decode(out)
    assert [t.name for t in trace.children(trace.track_named("run plain"))] == ["engine", *COUNTER_NAMES, "Requests"]


def test_a_simulated_run_with_a_tier_links_every_copy_to_its_sequence(tmp_path):
    """kvtrace's simulator with a host tier on the assistant example, a pool small enough to preempt: a slice
    per copy (its kv_events row's times), the tier's bytes, and one flow per copy between it and a state of
    its own sequence's track, forwards in time; a load's to a state that is not a wait."""
    from kvtrace.trace import db
    from tests.helpers.cli import record

    workload = Path(__file__).parents[2] / "traces" / "examples" / "assistant.jsonl"
    result, run = record(tmp_path, workload, "sim-tier", "--engine", "sim", "--block-size", "4",
                         "--num-gpu-blocks", "120", "--offload-size", "2MiB")
    assert result.exit_code == 0, result.output
    out = tmp_path / "sim.pftrace"
    perfetto.export_perfetto([run], out)
    trace = decode(out)
    group = trace.track_named("run sim-tier")
    lanes = [t.uuid for t in trace.children(group) if t.name == "KV tier: cpu"]
    sequences = {t.uuid: t.name for t in trace.children(trace.track_named("Requests", group))}
    copies = db.connect([run]).sql(
        "SELECT kind, req_id, round(ts_s * 1e9)::BIGINT - round(duration_ms * 1e6)::BIGINT, round(ts_s * 1e9)::BIGINT, "
        "bytes FROM kv_events WHERE kind IN ('offload', 'load') ORDER BY seq").fetchall()
    assert sum(kind == "load" for kind, *_ in copies) > 0 and any(kind == "offload" for kind, *_ in copies)
    tier = [s for s in trace.slices if s.track in lanes]
    assert sorted((s.name.split()[0], s.args["sequence"], s.ts, s.end) for s in tier) == sorted(
        (kind, req_id, start, end) for kind, req_id, start, end, _ in copies)
    origins = {f: s for s in trace.slices for f in s.flow_ids}
    targets = {f: s for s in trace.slices for f in s.terminating_flow_ids}
    linked = 0
    for s in tier:
        flows = [f for f in s.flow_ids + s.terminating_flow_ids]
        assert len(flows) == 1, s.name
        other = targets[flows[0]] if s.flow_ids else origins[flows[0]]
        assert sequences[other.track] == s.args["sequence"], s.name
        assert (s if s.flow_ids else other).ts <= (other if s.flow_ids else s).ts, s.name
        if s.name.startswith("load"):
            assert other.name not in ("waiting", "preempted", "swapped") and other.end > s.end, s.name
        linked += 1
    assert linked == len(copies)
    for direction, name in (("offload", "stored"), ("load", "loaded")):
        series = trace.counters[trace.track_named(f"cpu: bytes {name} (cumulative)", group)]
        assert series[-1][1] == sum(size for kind, *_, size in copies if kind == direction)
