"""`kvtrace export perfetto`: the file decodes back, with Perfetto's own protobuf classes, into the
tracks, slices, counters and flows the run's SQL analyses describe."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from kvtrace.cli.app import app
from kvtrace.export import perfetto
from kvtrace.trace import db
from tests.helpers.cli import one_line_error, record, write_workload

FIXTURES = Path(__file__).parents[1] / "fixtures" / "runs"
RUNS = [FIXTURES / "tiny-recompute", FIXTURES / "tiny-swap"]


# --------------------------------------------------------------------------- decoding

@dataclass
class Slice:
    track: int
    name: str
    ts: int
    end: int | None = None
    depth: int = 0
    args: dict = field(default_factory=dict)
    flow_ids: list[int] = field(default_factory=list)
    terminating_flow_ids: list[int] = field(default_factory=list)


@dataclass
class Decoded:
    tracks: dict[int, pb.TrackDescriptor] = field(default_factory=dict)
    slices: list[Slice] = field(default_factory=list)              # instants have end == ts
    counters: dict[int, list[tuple[int, int]]] = field(default_factory=lambda: defaultdict(list))
    sequence_of_track: dict[int, int] = field(default_factory=dict)

    def track_named(self, name: str, parent: int | None = None) -> int:
        found = [uuid for uuid, t in self.tracks.items()
                 if t.name == name and (parent is None or t.parent_uuid == parent)]
        assert len(found) == 1, (name, found)
        return found[0]

    def children(self, parent: int) -> list[pb.TrackDescriptor]:
        return sorted((t for t in self.tracks.values() if t.parent_uuid == parent), key=lambda t: t.sibling_order_rank)


def decode(path: Path) -> Decoded:
    """Rebuild a trace as Perfetto reads it, checking the rules of the format on the way."""
    trace = pb.Trace.FromString(path.read_bytes())
    out = Decoded()
    names: dict[int, dict[int, str]] = {}           # sequence -> iid -> event name
    arg_names: dict[int, dict[int, str]] = {}
    events = defaultdict(list)                       # track -> [(ts, file order, event)]
    for order, packet in enumerate(trace.packet):
        seq = packet.trusted_packet_sequence_id
        assert seq > 0, "every packet names its sequence"
        if seq not in names:
            assert packet.sequence_flags & pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED, \
                f"packet {order}: first packet of sequence {seq} does not clear incremental state"
            names[seq], arg_names[seq] = {}, {}
        for entry in packet.interned_data.event_names:
            assert names[seq].setdefault(entry.iid, entry.name) == entry.name, "an iid redefined"
        for entry in packet.interned_data.debug_annotation_names:
            assert arg_names[seq].setdefault(entry.iid, entry.name) == entry.name, "an iid redefined"
        if packet.HasField("track_descriptor"):
            desc = packet.track_descriptor
            assert desc.uuid not in out.tracks, f"track {desc.uuid} described twice"
            assert not desc.HasField("parent_uuid") or desc.parent_uuid in out.tracks, "parent described after child"
            out.tracks[desc.uuid] = desc
            out.sequence_of_track[desc.uuid] = seq
        if packet.HasField("track_event"):
            ev = packet.track_event
            assert ev.track_uuid in out.tracks, f"packet {order}: track {ev.track_uuid} used before it is described"
            assert packet.sequence_flags & pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
            if ev.HasField("name_iid"):
                assert ev.name_iid in names[seq], f"packet {order}: event name iid {ev.name_iid} not interned"
            for a in ev.debug_annotations:
                assert a.name_iid in arg_names[seq], f"packet {order}: argument name iid {a.name_iid} not interned"
            name = names[seq][ev.name_iid] if ev.HasField("name_iid") else ev.name
            args = {arg_names[seq][a.name_iid]: getattr(a, a.WhichOneof("value")) for a in ev.debug_annotations}
            events[ev.track_uuid].append((packet.timestamp, order, ev.type, name, args, list(ev.flow_ids),
                                          list(ev.terminating_flow_ids), ev.counter_value))
    for track, rows in events.items():
        stack: list[Slice] = []
        for ts, _, kind, name, args, flows, terminating, value in sorted(rows, key=lambda r: (r[0], r[1])):
            if kind == pb.TrackEvent.TYPE_COUNTER:
                assert out.tracks[track].HasField("counter"), "a counter value on a slice track"
                out.counters[track].append((ts, value))
                continue
            assert not out.tracks[track].HasField("counter"), "a slice on a counter track"
            if kind == pb.TrackEvent.TYPE_SLICE_END:
                assert stack, f"track {out.tracks[track].name}: an end without a begin at {ts}"
                stack.pop().end = ts
                continue
            s = Slice(track, name, ts, depth=len(stack), args=args, flow_ids=flows, terminating_flow_ids=terminating)
            out.slices.append(s)
            if kind == pb.TrackEvent.TYPE_SLICE_BEGIN:
                stack.append(s)
            else:
                assert kind == pb.TrackEvent.TYPE_INSTANT
                s.end = ts
        assert not stack, f"track {out.tracks[track].name}: {len(stack)} slices never end"
    return out


# --------------------------------------------------------------------------- the fixtures' export

@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[Path, Decoded]:
    path = tmp_path_factory.mktemp("perfetto") / "runs.pftrace"
    result = CliRunner().invoke(app, ["export", "perfetto", *map(str, RUNS), "-o", str(path)])
    assert result.exit_code == 0, result.output
    return path, decode(path)


@pytest.fixture(scope="module")
def con():
    return db.connect(RUNS)


def request_tracks(trace: Decoded, run_id: str) -> dict[str, int]:
    group = trace.track_named("Requests", trace.track_named(f"run {run_id}"))
    return {t.name: t.uuid for t in trace.children(group)}


def test_one_group_per_run_with_engine_counters_and_requests_in_arrival_order(exported, con):
    _, trace = exported
    tops = [t for t in trace.tracks.values() if not t.HasField("parent_uuid")]
    assert [t.name for t in tops] == ["run tiny-recompute", "run tiny-swap"]
    for top in tops:
        run_id = top.name.removeprefix("run ")
        children = [t.name for t in trace.children(top.uuid)]
        assert children[0] == "engine" and children[-1] == "Requests"
        assert {"used blocks", "free blocks", "cached blocks", "KV tokens held", "running", "waiting",
                "swapped", "preemptions (cumulative)"} <= set(children)
        arrival_order = [r[0] for r in con.sql(
            f"SELECT req_id FROM requests WHERE run_id = '{run_id}' ORDER BY arrival_s, req_id").fetchall()]
        assert list(request_tracks(trace, run_id)) == arrival_order
        assert len({trace.sequence_of_track[t.uuid] for t in trace.children(top.uuid)}) == 1


def test_request_phases_are_the_analysis_states(exported, con):
    _, trace = exported
    for run_id in ("tiny-recompute", "tiny-swap"):
        tracks = request_tracks(trace, run_id)
        for req_id, track in tracks.items():
            expected = [(r["state"], r["duration_ms"]) for r in db.records(db.run_analysis(con, "request_timeline",
                                                                                              req_id=req_id))
                        if r["run_id"] == run_id]
            slices = sorted((s for s in trace.slices if s.track == track), key=lambda s: (s.ts, s.depth))
            whole, phases = slices[0], slices[1:]
            assert whole.depth == 0 and whole.name == req_id and all(s.depth == 1 for s in phases)
            assert whole.ts == phases[0].ts and whole.end == phases[-1].end
            assert [s.name for s in phases] == [state for state, _ in expected]
            for s, (_, duration_ms) in zip(phases, expected):
                assert abs((s.end - s.ts) / 1e6 - duration_ms) <= 1e-6, (req_id, s.name)
            row = con.sql(f"SELECT prompt_tokens, output_tokens, preemptions, recomputed_tokens, finish_reason "
                          f"FROM requests WHERE run_id = '{run_id}' AND req_id = '{req_id}'").fetchall()[0]
            assert tuple(whole.args[k] for k in ("prompt_tokens", "output_tokens", "preemptions",
                                                  "recomputed_tokens", "finish_reason")) == row


def test_step_slices_and_counters_equal_the_steps_table(exported, con):
    _, trace = exported
    for run_id in ("tiny-recompute", "tiny-swap"):
        group = trace.track_named(f"run {run_id}")
        engine = trace.track_named("engine", group)
        steps = db.records(con.sql(f"SELECT * FROM steps WHERE run_id = '{run_id}' ORDER BY step").to_arrow_table())
        slices = sorted((s for s in trace.slices if s.track == engine and s.depth == 0 and s.end > s.ts),
                        key=lambda s: s.ts)
        assert [(s.args["step"], s.ts, s.end, s.args["prefill_tokens"], s.args["decode_tokens"],
                 s.args["recompute_tokens"], s.args["preemptions"]) for s in slices] == [
            (r["step"], round(r["start_s"] * 1e9), round(r["end_s"] * 1e9), r["prefill_tokens"],
             r["decode_tokens"], r["recompute_tokens"], r["preemptions"]) for r in steps]
        swap_bytes = dict(con.sql(f"SELECT kind || ':' || step, sum(bytes) FROM kv_events WHERE run_id = '{run_id}' "
                                  f"AND kind LIKE 'swap_%' GROUP BY ALL").fetchall())
        totals = defaultdict(int)
        for r in steps:
            totals["preemptions (cumulative)"] += r["preemptions"]
            totals["recomputed tokens (cumulative)"] += r["recompute_tokens"]
            totals["swap-out bytes (cumulative)"] += swap_bytes.get(f"swap_out:{r['step']}", 0)
            totals["swap-in bytes (cumulative)"] += swap_bytes.get(f"swap_in:{r['step']}", 0)
            expected = {"used blocks": r["used_blocks"], "free blocks": r["free_blocks"],
                        "cached blocks": r["cached_blocks"], "KV tokens held": r["kv_tokens"],
                        "running": r["running"], "waiting": r["waiting"], "swapped": r["swapped"], **totals}
            ts = round(r["start_s"] * 1e9)
            for name, value in expected.items():
                series = trace.counters[trace.track_named(name, group)]
                assert [v for t, v in series if t <= ts][-1] == value, (run_id, r["step"], name)
        assert totals["swap-out bytes (cumulative)"] > 0 if run_id == "tiny-swap" else True


def test_every_preemption_and_resumption_has_its_flow(exported, con):
    _, trace = exported
    origins = {f: s for s in trace.slices for f in s.flow_ids}
    targets = {f: s for s in trace.slices for f in s.terminating_flow_ids}
    assert set(origins) == set(targets) and len(origins) == sum(len(s.flow_ids) for s in trace.slices)
    flows = {(origins[f].track, origins[f].args["step"], targets[f].track, targets[f].name, targets[f].ts)
             for f in origins}
    events = con.sql("SELECT run_id, req_id, kind, reason, step, ts_s FROM kv_events "
                     "WHERE kind = 'preempt' OR (kind = 'admit' AND reason LIKE 'resume-%')").fetchall()
    assert len(events) == len(origins) > 40
    for run_id, req_id, kind, reason, step, ts_s in events:
        group = trace.track_named(f"run {run_id}")
        if kind == "preempt":
            states = {"swapped"} if reason == "swap" else {"preempted"}
        else:
            states = {"reprefill"} if reason == "resume-recompute" else {"decode", "prefill"}
        track = request_tracks(trace, run_id)[req_id]
        assert any((trace.track_named("engine", group), step, track, state, round(ts_s * 1e9)) in flows
                   for state in states), (run_id, req_id, kind, step)


def test_engine_instants_carry_block_ids_and_bytes(exported, con):
    _, trace = exported
    engine = trace.track_named("engine", trace.track_named("run tiny-swap"))
    instants = [s for s in trace.slices if s.track == engine and s.end == s.ts and s.name != "empty"]
    swap_outs = con.sql("SELECT step, blocks, bytes FROM kv_events WHERE run_id = 'tiny-swap' AND kind = 'swap_out' "
                        "ORDER BY seq").fetchall()
    assert [(s.args["step"], s.args["blocks"], s.args["bytes_copied"]) for s in instants if s.name == "swap_out"] == [
        (step, " ".join(map(str, blocks)), size) for step, blocks, size in swap_outs]
    evicted = con.sql("SELECT count(*) FROM kv_events WHERE run_id = 'tiny-swap' AND kind = 'evict'").fetchall()[0][0]
    assert sum(s.args["num_blocks"] for s in instants if s.name == "evict") == evicted
    assert all(s.depth == 1 for s in instants), "an event outside its step's slice"


def test_a_second_export_is_byte_identical(exported, tmp_path):
    path, _ = exported
    again = tmp_path / "again.pftrace"
    result = CliRunner().invoke(app, ["export", "perfetto", *map(str, RUNS), "-o", str(again)])
    assert result.exit_code == 0, result.output
    assert again.read_bytes() == path.read_bytes()


def test_the_engine_track_read_in_ranges_of_steps_is_the_same_file(exported, tmp_path, monkeypatch):
    """A range of about 50 kv_events' steps cuts each fixture's engine track into a dozen ranges
    or more (a step's rows never split); the file is the one read whole."""
    monkeypatch.setattr(perfetto, "EVENTS_PER_READ", 50)
    con = db.connect(RUNS)
    assert all(len(list(perfetto._engine_step_ranges(con, run.name))) >= 12 for run in RUNS)
    path, _ = exported
    ranged = tmp_path / "ranged.pftrace"
    perfetto.export_perfetto(RUNS, ranged)
    assert ranged.read_bytes() == path.read_bytes()


# --------------------------------------------------------------------------- a hybrid model's KV-cache groups

WORKLOAD = Path(__file__).parents[2] / "traces" / "examples" / "assistant.jsonl"
S, F = "sliding_attention", "full_attention"
MINISTRAL = {"model_type": "ministral", "architectures": ["MinistralForCausalLM"], "vocab_size": 512, "hidden_size": 64,
             "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
             "max_position_embeddings": 4096, "sliding_window": 64, "tie_word_embeddings": True, "eos_token_id": 2,
             "bos_token_id": 1, "rms_norm_eps": 1e-5}
# run -> (its layers, the simulator's options, its groups' track names)
NO_CACHE = "--no-enable-prefix-caching"
HYBRID_RUNS = {
    "sync": ([S, F, S, F], [NO_CACHE], ["sliding window 64 tok", "full attention"]),
    "async": ([S, F, S, F], [NO_CACHE, "--async-scheduling"], ["sliding window 64 tok", "full attention"]),
    "two-windows": ([S, S, S, S, F, F], [NO_CACHE],        # vLLM's grouping: two windowed groups of two layers
                    ["sliding window 64 tok (group 0)", "sliding window 64 tok (group 1)", "full attention"]),
    # prefix caching on (vLLM's default): hits share blocks, a window's free may name a block still shared
    "cached": ([S, F, S, F], ["--num-gpu-blocks", "80"], ["sliding window 64 tok", "full attention"]),
    "cached-async": ([S, S, S, S, F, F], ["--async-scheduling"],
                     ["sliding window 64 tok (group 0)", "sliding window 64 tok (group 1)", "full attention"]),
}


@pytest.fixture(scope="module")
def hybrid_runs(tmp_path_factory) -> dict[str, Path]:
    """The assistant example in kvtrace's simulator on Ministral-style dummy configs, in a pool so small
    that requests are preempted, windows dropping blocks as they go."""
    folder = tmp_path_factory.mktemp("hybrid")
    runs = {}
    for name, (layers, options, _) in HYBRID_RUNS.items():
        model = folder / f"{name}-model"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({**MINISTRAL, "num_hidden_layers": len(layers),
                                                       "layer_types": layers}))
        runs[name] = folder / name
        result = CliRunner().invoke(app, ["record", "--engine", "sim", "--model", str(model), "-w", str(WORKLOAD),
                                          "--num-gpu-blocks", "120", "-o", str(runs[name]), "-q", *options])
        assert result.exit_code == 0, result.output
    return runs


def counter_at(trace: Decoded, track: int, ts: int) -> int:
    return [v for t, v in trace.counters[track] if t <= ts][-1]


def replay_blocks_held(run: Path, cached: bool = False) -> tuple[list[dict], list[dict[int, int]], list[int]]:
    """The run's steps; each KV-cache group's blocks held at each step's scheduling (the moment of
    `used_blocks`), and the blocks dropped by windows up to it: its alloc and free events replayed
    block by block. kvtrace's engine stamps what a step's scheduling did with the step's start, what it
    did after its forward with its end: done before the next step's scheduling, or, scheduling async,
    after it. `cached`: a run with prefix caching, whose blocks are shared: the windows' drops only."""
    steps = pq.read_table(run / "steps").sort_by("step").to_pylist()
    start = {r["step"]: r["start_s"] for r in steps}
    lag = 1 + json.loads((run / "meta.json").read_text())["engine_config"]["async_scheduling"]
    events = [e for e in pq.read_table(run / "kv_events").to_pylist() if e["kind"] in ("alloc", "free")]
    events.sort(key=lambda e: (e["step"] + (0 if e["ts_s"] == start[e["step"]] else lag), e["seq"]))
    num_groups = len(json.loads((run / "meta.json").read_text())["kv_pool"]["kv_cache_groups"])
    held: list[set[int]] = [set() for _ in range(num_groups)]
    dropped, i = 0, 0
    by_step, dropped_by_step = [], []
    for r in steps:
        while i < len(events) and events[i]["step"] + (0 if events[i]["ts_s"] == start[events[i]["step"]] else lag) \
                <= r["step"]:
            e = events[i]
            blocks = set(e["blocks"])
            if e["kind"] == "free":
                dropped += len(blocks) if e["reason"] == "window" else 0
            if cached:
                pass
            elif e["kind"] == "alloc":
                assert not blocks & set().union(*held), f"event {e['seq']}: a block allocated twice"
                held[e["kv_group"]] |= blocks
            else:
                assert blocks <= held[e["kv_group"]], f"event {e['seq']}: frees blocks its group does not hold"
                held[e["kv_group"]] -= blocks
            i += 1
        by_step.append({g: len(blocks) for g, blocks in enumerate(held)})
        dropped_by_step.append(dropped)
    return steps, by_step, dropped_by_step


@pytest.mark.parametrize("name", list(HYBRID_RUNS))
def test_a_hybrid_run_has_each_kv_cache_groups_used_blocks(hybrid_runs, tmp_path, name):
    """A track per group beside the pool's, on its blocks axis: at every step the group's blocks held,
    as its events replayed block by block say, and together the pool's used blocks."""
    run = hybrid_runs[name]
    out = tmp_path / f"{name}.pftrace"
    result = CliRunner().invoke(app, ["export", "perfetto", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    trace = decode(out)
    group = trace.track_named(f"run {name}")
    names = [f"used blocks: {n}" for n in HYBRID_RUNS[name][2]]
    children = [t.name for t in trace.children(group)]
    assert children[:len(COUNTER_NAMES[:3]) + 1] == ["engine", *COUNTER_NAMES[:3]]
    assert children[4:] == [*names, perfetto.WINDOW_DROPPED, *COUNTER_NAMES[3:], "Requests"]
    tracks = [trace.track_named(n, group) for n in names]
    assert {trace.tracks[t].counter.y_axis_share_key for t in tracks} == {
        trace.tracks[trace.track_named("used blocks", group)].counter.y_axis_share_key}
    dropped_track = trace.track_named(perfetto.WINDOW_DROPPED, group)

    cached = NO_CACHE not in HYBRID_RUNS[name][1]
    steps, held, dropped = replay_blocks_held(run, cached)
    for r, expected, expected_dropped in zip(steps, held, dropped):
        ts = round(r["start_s"] * 1e9)
        got = [counter_at(trace, t, ts) for t in tracks]
        if not cached:
            assert got == [expected[g] for g in range(len(tracks))], (name, r["step"])
        assert min(got) >= 0 and sum(got) == r["used_blocks"] == counter_at(trace, trace.track_named("used blocks", group), ts), (name, r["step"], got)
        assert counter_at(trace, dropped_track, ts) == expected_dropped, (name, r["step"])
    assert sum(r["preemptions"] for r in steps) > 0 and dropped[-1] > 0
    if cached:   # blocks shared by hits, some let go by one sequence's window while another holds them
        events = pq.read_table(run / "kv_events").to_pylist()
        hits = {b for e in events if e["kind"] == "prefix_hit" for b in e["blocks"]}
        assert hits and any(e["kind"] == "free" and e["reason"] == "window" and set(e["blocks"]) & hits for e in events)
    assert all(min(v for _, v in trace.counters[t]) < max(v for _, v in trace.counters[t]) for t in tracks)


def test_a_free_without_a_group_counts_in_its_blocks_groups(hybrid_runs, tmp_path):
    """vLLM's deferred frees free several groups' blocks at once, with no group: the run's finish frees
    merged that way (one event a request, kv_group null) give each group the same counter."""
    run = tmp_path / "deferred"
    shutil.copytree(hybrid_runs["sync"], run)
    (part,) = (run / "kv_events").glob("*.parquet")
    table = pq.read_table(part)
    rows, merged = [], 0
    for e in table.to_pylist():
        last = rows[-1] if rows else None
        if e["kind"] == "free" and e["reason"] == "finish":
            if last and last["kind"] == "free" and last["reason"] == "finish" and last["req_id"] == e["req_id"] \
                    and last["step"] == e["step"]:
                last["blocks"] += e["blocks"]
                last["num_blocks"] += e["num_blocks"]
                merged += 1
                continue
            e = {**e, "kv_group": None}
        rows.append(e)
    assert merged >= 60
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), part)
    traces = {}
    for name, folder in (("as recorded", hybrid_runs["sync"]), ("deferred", run)):
        perfetto.export_perfetto([folder], tmp_path / f"{name}.pftrace")
        trace = decode(tmp_path / f"{name}.pftrace")
        group = trace.track_named("run sync")   # the copy keeps its run_id (meta.json's)
        traces[name] = {n: trace.counters[trace.track_named(f"used blocks: {n}", group)]
                        for n in HYBRID_RUNS["sync"][2]}
    assert traces["deferred"] == traces["as recorded"]


def test_a_run_of_one_kv_cache_group_has_the_pool_tracks_only(exported):
    """Every run before schema 5, and a dense model's: no group's track (the file is the same bytes
    as before groups had tracks)."""
    _, trace = exported
    for run_id in ("tiny-recompute", "tiny-swap"):
        children = [t.name for t in trace.children(trace.track_named(f"run {run_id}"))]
        assert children == ["engine", *COUNTER_NAMES, "Requests"]


COUNTER_NAMES = [name for name, _, _ in perfetto.COUNTERS.values()]


# --------------------------------------------------------------------------- fresh runs and bad input

def test_parallel_samples_get_their_own_tracks(tmp_path):
    workload = write_workload(tmp_path / "n.jsonl", [
        {"id": "Z", "arrival_s": 0, "prompt_tokens": 5, "max_tokens": 4, "ignore_eos": True},
        {"id": "A", "arrival_s": 0.002, "prompt_tokens": 9, "max_tokens": 6, "n": 2, "ignore_eos": True}])
    result, run = record(tmp_path, workload, "n2", "--block-size", "4")
    assert result.exit_code == 0, result.output
    result = CliRunner().invoke(app, ["export", "perfetto", str(run)])
    assert result.exit_code == 0, result.output
    trace = decode(tmp_path / "n2.pftrace")                   # the default: <run>.pftrace beside the run
    assert list(request_tracks(trace, "n2")) == ["Z", "A#0", "A#1"]     # by arrival


def test_a_run_still_recording_exports_what_is_closed(tmp_path):
    run = tmp_path / "live"
    shutil.copytree(FIXTURES / "tiny-swap", run)
    meta = json.loads((run / "meta.json").read_text())
    (run / "meta.json").write_text(json.dumps({**meta, "status": "running"}))
    # the run as its chunks stood at step 100: later rows not written yet, requests in flight absent
    step_end = {r["step"]: r["end_s"] for r in pq.read_table(run / "steps").to_pylist()}[100]
    for table in ("requests", "steps", "kv_events", "tokens"):
        part = run / table / "part-00000.parquet"
        chunk = pq.read_table(part)
        keep = [r for r in chunk.to_pylist() if (r["finish_s"] <= step_end if table == "requests" else r["step"] <= 100)]
        pq.write_table(pa.Table.from_pylist(keep, schema=chunk.schema), part)
    out = tmp_path / "live.pftrace"
    result = CliRunner().invoke(app, ["export", "perfetto", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "still being recorded" in result.stderr and "steps up to 100" in result.stderr
    finished = pq.read_table(run / "requests").num_rows
    assert 0 < len(request_tracks(decode(out), "tiny-swap")) == finished < 20


def test_bad_input_is_one_line(tmp_path):
    assert "not a run folder" in one_line_error(["export", "perfetto", str(tmp_path)])
    assert "no such run folder" in one_line_error(["export", "perfetto", str(tmp_path / "nope")])
    line = one_line_error(["export", "perfetto", str(RUNS[0]), "-o", str(tmp_path / "missing" / "x.pftrace")])
    assert "cannot write" in line and "missing" in line
    assert "is a folder" in one_line_error(["export", "perfetto", str(RUNS[0]), "-o", str(tmp_path)])
    assert not list(tmp_path.glob(".*.tmp")), "a temporary file left behind"


# --------------------------------------------------------------------------- Perfetto's own reader

@pytest.mark.external
@pytest.mark.skipif(not os.environ.get("KVTRACE_TRACE_PROCESSOR"),
                    reason="KVTRACE_TRACE_PROCESSOR does not name a local trace_processor_shell")
def test_trace_processor_reads_the_same_figures(exported, con):
    from perfetto.trace_processor import TraceProcessor, TraceProcessorConfig

    path, _ = exported
    binary = os.environ["KVTRACE_TRACE_PROCESSOR"]
    assert subprocess.run([binary, "--version"], capture_output=True).returncode == 0, binary
    tp = TraceProcessor(trace=str(path), config=TraceProcessorConfig(bin_path=binary))
    try:
        def query(sql: str) -> list[tuple]:
            return [tuple(row.__dict__.values()) for row in tp.query(sql)]

        phases = query("""
            SELECT run.name, t.name, s.name, s.dur FROM slice s
            JOIN track t ON s.track_id = t.id
            JOIN track req ON t.parent_id = req.id AND req.name = 'Requests'
            JOIN track run ON req.parent_id = run.id
            WHERE s.depth = 1 ORDER BY run.name, t.name, s.ts""")
        expected = con.sql("""
            SELECT 'run ' || run_id, req_id, state, round(end_s * 1e9)::BIGINT - round(start_s * 1e9)::BIGINT
            FROM _sequence_states ORDER BY 'run ' || run_id, req_id, start_s""").fetchall()
        assert phases == [tuple(r) for r in expected]
        assert query("SELECT count(*) FROM flow")[0][0] == con.sql(
            "SELECT count(*) FROM kv_events WHERE kind = 'preempt' OR (kind = 'admit' AND reason LIKE 'resume-%')"
        ).fetchall()[0][0]
        used = query("""
            SELECT c.ts, c.value FROM counter c JOIN counter_track t ON c.track_id = t.id
            JOIN track run ON t.parent_id = run.id
            WHERE t.name = 'used blocks' AND run.name = 'run tiny-swap' ORDER BY c.ts""")
        steps = con.sql("SELECT round(start_s * 1e9)::BIGINT, used_blocks FROM steps "
                        "WHERE run_id = 'tiny-swap' ORDER BY step").fetchall()
        for ts, value in steps:
            assert [v for t, v in used if t <= ts][-1] == value
    finally:
        tp.close()
