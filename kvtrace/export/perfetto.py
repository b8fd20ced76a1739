"""`kvtrace export perfetto`: runs as a native Perfetto trace, to open in ui.perfetto.dev.

Tracks of each run, under one top-level group per run (in the order the runs were given):

    run <run_id>
      engine          one slice per step (args: step, prefill / decode / recompute tokens,
                      preemptions, device_ms); instants for each preempt, swap_out and swap_in, and
                      one per step for its evictions, with their block ids and bytes
      <counters>      free / used / cached blocks, KV tokens held, running / waiting / swapped,
                      cumulative preemptions, recomputed tokens and swap bytes (see COUNTERS); in
                      a run of several KV-cache groups (a hybrid model), after the pool's blocks,
                      each group's used blocks ("used blocks: sliding window 64 tok", ...) and the
                      blocks dropped by windows (cumulative)
      KV tier: <tier> a run with a KV tier (schema 6), each tier by name: a slice per offload and load
                      copy (ts_s less duration_ms to ts_s; an untimed one an instant at ts_s), an
                      instant per tier_evict; copies that overlap without nesting on tracks of the
                      same name, which the UI shows as one (_tier_lanes); then its bytes stored and
                      loaded (cumulative)
      Requests        one track per sequence, ordered by arrival: the whole request as a slice
                      (args: prompt / output tokens, preemptions, recomputed tokens, finish
                      reason), its states nested inside it
    flows             from the step that preempted a sequence to its preempted or swapped slice,
                      and from the step that resumed it to its reprefill (or, after a swap-in, the
                      decode or prefill that follows); and (schema 3) from the requester whose
                      growth needed the blocks, an instant "preempts <victim>" on its track, to
                      the victim's preempted or swapped slice; and (schema 6) between each tier copy
                      and a state of its sequence: an offload's, the state it began in (the phase that
                      computed the blocks), a load's, the phase it resumes or starts in (or was in),
                      from whichever of the two began first (_timeline_tiers.sql)

Every row comes from the SQL library's timeline views (analyses/_timeline.sql, _timeline_tiers.sql), which read a
sequence's states from _sequence_states like the report's Gantt; this module only orders the rows
and writes them as packets, streaming: query results are read in Arrow batches, a chunk of rows
(whole steps, whole sequences) becomes a table of packets in file order (slice ends and requester
instants put in place by sort keys), and the writer encodes the table with numpy and appends it
to the file (kvtrace/export/perfetto_writer.py), so memory stays flat and no Python runs per
packet; the engine track, whose query gathers every evicted block, is read a range of steps at
a time.
Timestamps are integer nanoseconds on each run's clock (seconds since it started); the same runs
give the same bytes.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from kvtrace.errors import KvtraceError
from kvtrace.export.perfetto_writer import (
    EVENT_COLUMNS,
    TYPE_COUNTER,
    TYPE_INSTANT,
    TYPE_SLICE_BEGIN,
    TYPE_SLICE_END,
    UNIT_BYTES,
    TraceWriter,
    pb,
)
from kvtrace.trace import db

if TYPE_CHECKING:   # duckdb is imported where a connection is made: not by every command's start-up
    import duckdb

BATCH_ROWS = 8_192             # rows per Arrow batch read from DuckDB
CHUNK_ROWS = 16_384            # rows turned into packets at once (numpy's working arrays: some tens of MB)
DUCKDB_MEMORY = "128MB"        # DuckDB's working memory; sorts and aggregations beyond it spill to disk
EVENTS_PER_READ = 1_000_000      # about this many kv_events per range of steps the engine track's stream reads

# column of _timeline_counters -> (track name, unit shown, axis key: counters with one share a y axis)
COUNTERS: dict[str, tuple[str, str, str]] = {
    "used_blocks": ("used blocks", "blocks", "blocks"),
    "cached_blocks": ("cached blocks", "blocks", "blocks"),
    "free_blocks": ("free blocks", "blocks", "blocks"),
    "kv_tokens": ("KV tokens held", "tokens", "kv_tokens"),
    "running": ("running", "sequences", "sequences"),
    "waiting": ("waiting", "sequences", "sequences"),
    "swapped": ("swapped", "sequences", "sequences"),
    "preemptions_total": ("preemptions (cumulative)", "preemptions", "preemptions"),
    "recomputed_tokens_total": ("recomputed tokens (cumulative)", "tokens", "recomputed_tokens"),
    "swap_out_bytes_total": ("swap-out bytes (cumulative)", "bytes", "swap_bytes"),
    "swap_in_bytes_total": ("swap-in bytes (cumulative)", "bytes", "swap_bytes"),
}
WINDOW_DROPPED = "blocks dropped by windows (cumulative)"   # a run of several KV-cache groups (_timeline_kv_groups)
# a KV tier's counters, by direction (_timeline_tier_counters): the tier's name is put in
TIER_COUNTERS = {"offload": "{tier}: bytes stored (cumulative)", "load": "{tier}: bytes loaded (cumulative)"}
TIER_LANES = (1 << 20) - 2       # most tracks a tier's copies can need (copies overlapping without nesting)


@dataclass(frozen=True)
class RunTracks:
    """Track uuids of one run: its ordinal in the export sets the high bits, so runs never collide."""
    ordinal: int

    @property
    def group(self) -> int:
        return (self.ordinal + 1) << 40

    @property
    def engine(self) -> int:
        return self.group + 1

    @property
    def requests(self) -> int:
        return self.group + 2

    def counter(self, index: int) -> int:
        return self.group + 16 + index

    @property
    def window_dropped(self) -> int:
        return self.counter(len(COUNTERS))

    def kv_group(self, kv_group: int) -> int:
        """A KV-cache group's used blocks, after every counter of COUNTERS and window_dropped."""
        assert 16 + len(COUNTERS) + 1 + kv_group < 1024, f"KV-cache group {kv_group}: its track is a sequence's"
        return self.counter(len(COUNTERS) + 1 + kv_group)

    def sequence(self, rank: int) -> int:
        return self.group + 1024 + rank

    def tier(self, index: int, lane: int) -> int:
        """A KV tier's track (its `lane`-th: see _tier_lanes), above every sequence's."""
        assert lane < TIER_LANES, f"tier {index}: {lane + 1} lanes of copies overlapping"
        return self.group + (1 << 39) + (index << 20) + lane

    def tier_counter(self, index: int, direction: int) -> int:
        """A KV tier's bytes copied each way (0 offload, 1 load), after its lanes."""
        return self.tier(index, 0) + TIER_LANES + direction


@dataclass
class ExportSummary:
    path: Path
    run_ids: list[str]
    num_packets: int = 0
    num_kv_events: int = 0                                  # kv_events rows of the runs exported
    running: list[tuple[str, int | None]] = field(default_factory=list)   # (run_id, last step) still recording


def default_output(runs: list[str | Path]) -> Path:
    """One run folder: <run>.pftrace beside it; several: kvtrace.pftrace here."""
    found = db.find_runs(runs)
    return Path(f"{str(found[0]).rstrip('/')}.pftrace") if len(found) == 1 else Path("kvtrace.pftrace")


def export_perfetto(runs: list[str | Path], output: Path) -> ExportSummary:
    """Write the runs to `output` (atomically: a temporary file renamed at the end)."""
    con = db.connect(runs)
    db.one_server_each(con, "the Perfetto timeline")
    if output.is_dir():
        raise KvtraceError(f"{output}: is a folder; give the trace file to write")
    temp = output.with_name(f".{output.name}.{os.getpid()}.tmp")
    try:
        file = open(temp, "wb")
    except OSError as exc:
        raise KvtraceError(f"{output}: cannot write ({exc.strerror})") from exc
    try:
        with file, tempfile.TemporaryDirectory(prefix="kvtrace-export-") as spill:
            con.execute(f"SET memory_limit = '{DUCKDB_MEMORY}'")
            con.execute(f"SET temp_directory = '{spill}'")
            db.keep(con, "_timeline_phases", "_timeline_flows")     # once: the flows of the engine track's
            #                                                        step ranges and the requests' states read them
            summary = _write_runs(con, TraceWriter(file), output)
            con.close()
        os.replace(temp, output)
    except OSError as exc:
        temp.unlink(missing_ok=True)
        raise KvtraceError(f"{output}: cannot write ({exc.strerror})") from exc
    except BaseException:
        temp.unlink(missing_ok=True)
        raise
    return summary


def _write_runs(con: duckdb.DuckDBPyConnection, writer: TraceWriter, output: Path) -> ExportSummary:
    meta = con.sql("SELECT run_id, ordinal, status, model, preemption_mode, num_gpu_blocks, block_size "
                   "FROM runs ORDER BY ordinal").fetchall()
    summary = ExportSummary(output, [row[0] for row in meta])
    for run_id, ordinal, status, model, mode, num_blocks, block_size in meta:
        description = f"model {model}, preemption by {mode}, {num_blocks} blocks of {block_size} tokens, status {status}"
        _write_run(con, writer, run_id, RunTracks(ordinal), description)
        summary.num_kv_events += _scalar(con, "SELECT count(*) FROM kv_events WHERE run_id = $run", run_id)
        if status == "running":
            summary.running.append((run_id, _scalar(con, "SELECT max(step) FROM steps WHERE run_id = $run", run_id)))
    writer.close()
    summary.num_packets = writer.num_packets
    return summary


def _scalar(con: duckdb.DuckDBPyConnection, query: str, run_id: str):
    return con.sql(query, params={"run": run_id}).fetchall()[0][0]


def _rows(con: duckdb.DuckDBPyConnection, query: str, run_id: str, **params: object) -> Iterator[tuple]:
    """The rows of a query about one run (and its other `params`), read in Arrow batches."""
    reader = con.sql(query, params={"run": run_id, **params}).to_arrow_reader(BATCH_ROWS)
    for batch in reader:
        yield from zip(*(column.to_pylist() for column in batch.columns))


# --------------------------------------------------------------------------- one run

def _write_run(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, tracks: RunTracks,
               description: str) -> None:
    writer.start_sequence(tracks.ordinal + 1)
    # every track is described before anything is written on it
    writer.track(tracks.group, f"run {run_id}", explicit_child_order=True, description=description)
    writer.track(tracks.engine, "engine", parent=tracks.group, rank=0,
                 description="one slice per step; preemptions, swaps and evictions as instants")
    kv_groups = list(_rows(con, "SELECT kv_group, name FROM _timeline_kv_groups WHERE run_id = $run "
                                "ORDER BY kv_group", run_id))
    counters = []   # (uuid, name, unit, axis key), in the order shown
    for index, (column, (name, unit, axis)) in enumerate(COUNTERS.items()):
        counters.append((tracks.counter(index), name, unit, axis))
        if column == "free_blocks" and kv_groups:   # the pool's blocks, then a hybrid model's by group
            counters += [(tracks.kv_group(kv_group), f"used blocks: {group_name}", "blocks", "blocks")
                         for kv_group, group_name in kv_groups]
            counters.append((tracks.window_dropped, WINDOW_DROPPED, "blocks", "window_dropped_blocks"))
    for rank, (uuid, name, unit, axis) in enumerate(counters, 1):
        counter = pb.CounterDescriptor(y_axis_share_key=axis)
        if unit == "bytes":
            counter.unit = UNIT_BYTES
        else:
            counter.unit_name = unit
        writer.track(uuid, name, parent=tracks.group, rank=rank, counter=counter)
    tiers = _tier_layout(con, run_id)
    rank = 1 + len(counters)
    for index, tier in enumerate(tiers):   # after the counters: each tier's lanes, then its counters
        for lane in range(tier.num_lanes):
            writer.track(tracks.tier(index, lane), f"KV tier: {tier.name}", parent=tracks.group, rank=rank,
                         merge_by_name=True, description="copies to and from the tier, and its evictions")
            rank += 1
        for direction, name in enumerate(TIER_COUNTERS.values()):
            writer.track(tracks.tier_counter(index, direction), name.format(tier=tier.name), parent=tracks.group,
                         rank=rank, counter=pb.CounterDescriptor(y_axis_share_key="tier_bytes", unit=UNIT_BYTES))
            rank += 1
    writer.track(tracks.requests, "Requests", parent=tracks.group, rank=rank,
                 explicit_child_order=True, description="one track per sequence, ordered by arrival")
    for rows in _chunks(con, "SELECT rank, name FROM _timeline_sequences WHERE run_id = $run ORDER BY rank",
                        run_id, None):
        rank = _ints(rows["rank"])
        writer.tracks(tracks.sequence(0) + rank, rows["name"].combine_chunks(), tracks.requests, rank)

    _write_engine(con, writer, run_id, tracks.engine)
    _write_counters(con, writer, run_id, tracks)
    if kv_groups:
        _write_kv_group_counters(con, writer, run_id, tracks)
    for index, tier in enumerate(tiers):
        writer.events(_tier_events(tier, index, tracks))
    if tiers:
        _write_tier_counters(con, writer, run_id, tracks, [tier.name for tier in tiers])
    _write_requests(con, writer, run_id, tracks, tier_flows=bool(tiers))


def _engine_step_ranges(con: duckdb.DuckDBPyConnection, run_id: str) -> Iterator[tuple[str, dict]]:
    """The run's steps cut into ranges of about EVENTS_PER_READ kv_events, in order, as (condition
    on step, its params); then the rows without a step, which sort last."""
    starts = [row[0] for row in _rows(con, f"""
        SELECT min(step) FROM (
            SELECT step, sum(count(*)) OVER (ORDER BY step) AS events_to_here
            FROM kv_events WHERE run_id = $run AND step IS NOT NULL GROUP BY step)
        GROUP BY (events_to_here - 1) // {EVENTS_PER_READ}
        ORDER BY 1""", run_id)]
    if len(starts) < 2:
        yield "step IS NOT NULL", {}
    else:
        yield "step < $hi", {"hi": starts[1]}
        for lo, hi in zip(starts[1:], starts[2:]):
            yield "step >= $lo AND step < $hi", {"lo": lo, "hi": hi}
        yield "step >= $lo", {"lo": starts[-1]}
    yield "step IS NULL", {}


def _write_engine(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, track: int) -> None:
    """Step slices with the instants of each step inside them: one ordered stream (_timeline_engine),
    a step's slice closed when the next step's rows begin.

    The stream is read a range of steps at a time (_engine_step_ranges), so that what DuckDB holds at
    once (the step's evicted blocks gathered, the flows joined, the rows sorted) is a range's, not
    the run's: read whole, the stream of 10M kv_events did not fit in DUCKDB_MEMORY (nor in twice
    that) although each of its parts did."""
    for where, params in _engine_step_ranges(con, run_id):
        for rows in _chunks(con, f"""
                SELECT part, ts_ns, end_ns, name, flow_ids, {', '.join(_ENGINE_ARGS)}
                FROM _timeline_engine WHERE run_id = $run AND {where}
                ORDER BY step, part, ts_ns, seq""", run_id, "step", **params):
            writer.events(_engine_events(rows, track))


# the engine track's arguments: a step slice's, then an instant's (step is both's); the stream's
# rows have the other kind's columns null
_ENGINE_ARGS = ("step", "prefill_tokens", "decode_tokens", "recompute_tokens", "preemptions", "device_ms",
                "sequence", "blocks", "num_blocks", "num_tokens", "kv_bytes", "bytes_copied", "duration_ms", "reason")


def _engine_events(rows: pa.Table, track: int) -> pa.Table:
    """The packets of a part of the engine stream that ends with a step's rows: each row as a slice
    begin (part 0) or an instant (part 1), and a slice end before the first row of another step
    while a step's slice is open, and after the last row (at the open slice's end_ns)."""
    n = rows.num_rows
    step, has_step = _ints(rows["step"]), _valid(rows["step"])
    begins = _ints(rows["part"]) == 0
    new_step = np.ones(n, bool)
    new_step[1:] = (step[1:] != step[:-1]) | (has_step[1:] != has_step[:-1])
    index = np.arange(n)
    last_begin = np.maximum.accumulate(np.where(begins, index, -1))         # the slice open at each row
    open_after = last_begin >= np.maximum.accumulate(np.where(new_step, index, 0))
    closes = np.flatnonzero(np.append(new_step[1:], True) & open_after) + 1   # an end before row closes[i]
    schema = _schema(rows, _ENGINE_ARGS)
    events = pa.concat_tables([
        _events(n, schema, type=np.where(begins, TYPE_SLICE_BEGIN, TYPE_INSTANT), ts=rows["ts_ns"], track=track,
                name=rows["name"], flow_ids=rows["flow_ids"], **{arg: rows[arg] for arg in _ENGINE_ARGS}),
        _events(len(closes), schema, type=TYPE_SLICE_END, ts=_ints(rows["end_ns"])[last_begin[closes - 1]],
                track=track)])
    return events.take(np.argsort(np.concatenate([2 * index + 1, 2 * closes]), kind="stable"))


def _write_counters(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, tracks: RunTracks) -> None:
    uuids = {column: tracks.counter(i) for i, column in enumerate(COUNTERS)}
    for rows in _chunks(con, "SELECT counter, ts_ns, value FROM _timeline_counters "
                             "WHERE run_id = $run ORDER BY counter, step", run_id, None):
        counters = rows["counter"].combine_chunks().dictionary_encode()
        track = np.array([uuids[name] for name in counters.dictionary.to_pylist()], np.int64)[_ints(counters.indices)]
        writer.events(_events(rows.num_rows, pa.schema(EVENT_COLUMNS), type=TYPE_COUNTER, ts=rows["ts_ns"],
                              track=track, counter=rows["value"]))


def _write_kv_group_counters(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str,
                             tracks: RunTracks) -> None:
    """A run of several KV-cache groups: each group's used blocks, and the blocks dropped by windows."""
    for rows in _chunks(con, "SELECT kv_group, ts_ns, value FROM _timeline_kv_group_counters "
                             "WHERE run_id = $run ORDER BY kv_group NULLS FIRST, step", run_id, None):
        kv_group = rows["kv_group"]
        track = np.where(_valid(kv_group), tracks.kv_group(0) + _ints(kv_group), tracks.window_dropped)
        writer.events(_events(rows.num_rows, pa.schema(EVENT_COLUMNS), type=TYPE_COUNTER, ts=rows["ts_ns"],
                              track=track, counter=rows["value"]))


# a request's slice's arguments, then those of its instants where its growth preempted another sequence
_REQUEST_ARGS = ("prompt_tokens", "output_tokens", "preemptions", "swaps", "recomputed_tokens", "prefix_hit_tokens",
                 "finish_reason")
_PREEMPTS_ARGS = ("victim", "victim_reason")


def _write_requests(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, tracks: RunTracks,
                    tier_flows: bool = False) -> None:
    """Per sequence track: the request's slice, its states nested inside it, and inside those the
    instants where its growth preempted another sequence (a flow to the victim's slice); with
    `tier_flows`, each state's flows to and from the KV tier's copies (_timeline_tier_flows)."""
    tier_ids = ("t.out_ids, t.in_ids" if tier_flows else "NULL::BIGINT[] AS out_ids, NULL::BIGINT[] AS in_ids")
    tier_join = """
            LEFT JOIN (SELECT run_id, req_id, sample, phase_start_s,
                              list(flow_id ORDER BY flow_id) FILTER (WHERE phase_first) AS out_ids,
                              list(flow_id ORDER BY flow_id) FILTER (WHERE NOT phase_first) AS in_ids
                       FROM _timeline_tier_flows GROUP BY ALL) t
                   ON t.run_id = p.run_id AND t.req_id = p.req_id AND t.sample = p.sample
                  AND t.phase_start_s = p.start_s""" if tier_flows else ""
    preempts = con.sql("""
        SELECT s.rank, f.ts_ns, 'preempts ' || f.victim AS name, f.victim, f.victim_reason, f.flow_id
        FROM _timeline_requester_flows f JOIN _timeline_sequences s USING (run_id, req_id, sample)
        WHERE f.run_id = $run ORDER BY s.rank, f.ts_ns, f.flow_id""", params={"run": run_id}).to_arrow_table()
    preempts_rank = _ints(preempts["rank"])
    for rows in _chunks(con, f"""
            SELECT s.rank, s.name, s.arrival_ns, s.finish_ns, {', '.join(f's.{arg}' for arg in _REQUEST_ARGS)},
                   p.state, p.start_ns, p.end_ns, p.flow_id, p.requester_flow_id, {tier_ids}
            FROM _timeline_sequences s
            LEFT JOIN _timeline_phases p USING (run_id, req_id, sample){tier_join}
            WHERE s.run_id = $run
            ORDER BY s.rank, p.start_s""", run_id, "rank"):
        rank = _ints(rows["rank"])
        lo, hi = np.searchsorted(preempts_rank, rank[0], "left"), np.searchsorted(preempts_rank, rank[-1], "right")
        writer.events(_request_events(rows, preempts.slice(lo, hi - lo), tracks))


def _request_events(rows: pa.Table, preempts: pa.Table, tracks: RunTracks) -> pa.Table:
    """The packets of the sequences of `rows` (whole sequences, in rank order, states in time order).
    Row i's packets are ordered by key: 10i the request's slice begins (first row of a sequence),
    10i+2 and 10i+4 the state's slice begins and ends, 10i+6 the request's slice ends (last row, at
    the latest of its finish, its arrival when none, and its states' ends); a requester instant
    comes at 10i+1 or 10i+3, before the first state boundary later than it, or at 10i+5 of the
    last row, in its own order among those at the same key."""
    n = rows.num_rows
    rank = _ints(rows["rank"])
    first = np.ones(n, bool)
    first[1:] = rank[1:] != rank[:-1]
    last = np.append(first[1:], True)
    has_state = _valid(rows["state"])
    start, end = _ints(rows["start_ns"]), _ints(rows["end_ns"])
    track = tracks.sequence(0) + rank
    opened = np.where(_valid(rows["finish_ns"]), _ints(rows["finish_ns"]), _ints(rows["arrival_ns"]))
    latest = np.maximum.reduceat(np.where(has_state, np.maximum(opened, end), opened), np.flatnonzero(first))
    key = 10 * np.arange(n)

    flow_id, requester = rows["flow_id"].combine_chunks(), rows["requester_flow_id"].combine_chunks()
    terminating = pa.ListArray.from_arrays(
        pa.array(np.concatenate([[0], np.cumsum(_valid(flow_id).astype(np.int32) + _valid(requester))]), pa.int32()),
        pc.drop_null(pa.array(np.stack([_ints(flow_id), _ints(requester)], 1).reshape(-1), pa.int64(),
                              mask=~np.stack([_valid(flow_id), _valid(requester)], 1).reshape(-1))))
    tier_in = rows["in_ids"].combine_chunks()
    if tier_in.null_count < n:   # then the KV tier's copies that ended here (their flows began at the copy)
        terminating = _concat_lists(terminating, tier_in)
    schema = _schema(rows, _REQUEST_ARGS + _PREEMPTS_ARGS, preempts)
    begun, stated, ended = rows.filter(first), rows.filter(has_state), rows.filter(last)
    parts = [
        _events(begun.num_rows, schema, type=TYPE_SLICE_BEGIN, ts=begun["arrival_ns"], track=track[first],
                plain_name=begun["name"], **{arg: begun[arg] for arg in _REQUEST_ARGS}),
        _events(stated.num_rows, schema, type=TYPE_SLICE_BEGIN, ts=start[has_state], track=track[has_state],
                name=stated["state"], flow_ids=stated["out_ids"], terminating_flow_ids=terminating.filter(pa.array(has_state))),
        _events(stated.num_rows, schema, type=TYPE_SLICE_END, ts=end[has_state], track=track[has_state]),
        _events(ended.num_rows, schema, type=TYPE_SLICE_END, ts=latest, track=track[last])]
    keys = [key[first], key[has_state] + 2, key[has_state] + 4, key[last] + 6]
    if preempts.num_rows:
        parts.append(_events(preempts.num_rows, schema, type=TYPE_INSTANT, ts=preempts["ts_ns"],
                             track=tracks.sequence(0) + _ints(preempts["rank"]), name=preempts["name"],
                             flow_ids=pa.ListArray.from_arrays(pa.array(np.arange(preempts.num_rows + 1, dtype=np.int32)),
                                                               preempts["flow_id"].combine_chunks()),
                             **{arg: preempts[arg] for arg in _PREEMPTS_ARGS}))
        keys.append(_preempts_keys(rank, has_state, start, end, _ints(preempts["rank"]), _ints(preempts["ts_ns"])))
    return pa.concat_tables(parts).take(np.argsort(np.concatenate(keys), kind="stable"))


def _concat_lists(first: pa.ListArray, second: pa.ListArray) -> pa.ListArray:
    """Row by row, the values of `first` then those of `second` (a null list has none)."""
    counts = [np.asarray(pc.fill_null(pc.list_value_length(lists), 0).to_numpy(zero_copy_only=False), np.int64)
              for lists in (first, second)]
    values = [np.asarray(lists.flatten().to_numpy(zero_copy_only=False), np.int64) for lists in (first, second)]
    offsets = np.concatenate([[0], np.cumsum(counts[0] + counts[1])])
    out = np.empty(int(offsets[-1]), np.int64)
    for count, value, before in ((counts[0], values[0], 0), (counts[1], values[1], counts[0])):
        row = np.repeat(np.arange(len(count)), count)
        within = np.arange(len(value)) - np.repeat(np.cumsum(count) - count, count)
        out[offsets[:-1][row] + np.broadcast_to(before, len(count))[row] + within] = value
    return pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(out, pa.int64()))


def _preempts_keys(rank: np.ndarray, has_state: np.ndarray, start: np.ndarray, end: np.ndarray,
                   preempts_rank: np.ndarray, preempts_ts: np.ndarray) -> np.ndarray:
    """The key of each requester instant (see _request_events): its sequence's state boundaries
    walked in order, as the instants pending on its track are written before each (few: one per
    preemption that another sequence needed)."""
    keys = np.empty(len(preempts_rank), np.int64)
    rows_of = np.searchsorted(rank, preempts_rank, side="left"), np.searchsorted(rank, preempts_rank, side="right")
    pending = 0
    while pending < len(preempts_rank):
        lo, hi = int(rows_of[0][pending]), int(rows_of[1][pending])
        done = int(np.searchsorted(preempts_rank, preempts_rank[pending], side="right"))
        for i in range(lo, hi):
            if has_state[i]:
                for boundary, offset in ((start[i], 1), (end[i], 3)):
                    while pending < done and preempts_ts[pending] < boundary:
                        keys[pending] = 10 * i + offset
                        pending += 1
        keys[pending:done] = 10 * (hi - 1) + 5
        pending = done
    return keys


# --------------------------------------------------------------------------- KV tiers (schema 6)

@dataclass
class TierTrack:
    """A KV tier's events (_timeline_tier_events' rows, in order of start, longest first), with the lane
    of each: its track among the tier's."""
    name: str
    rows: pa.Table
    lanes: np.ndarray
    num_lanes: int


# the tier track's arguments
_TIER_ARGS = ("step", "sequence", "blocks", "num_blocks", "num_tokens", "bytes", "duration_ms", "reason")


def _tier_layout(con: duckdb.DuckDBPyConnection, run_id: str) -> list[TierTrack]:
    """The run's tiers by name, each with its events read whole (a run's copies are a small share of its
    events: one a sequence's chunk of blocks stored or loaded); none in a run without a tier."""
    rows = con.sql(f"""
        SELECT tier, start_ns, end_ns, name, flow_id, phase_first, {', '.join(_TIER_ARGS)}
        FROM _timeline_tier_events WHERE run_id = $run
        ORDER BY tier, start_ns, end_ns DESC, seq""", params={"run": run_id}).to_arrow_table()
    tiers = []
    for name in pc.unique(rows["tier"]).to_pylist():
        part = rows.filter(pc.equal(rows["tier"], name))
        lanes = _tier_lanes(_ints(part["start_ns"]), _ints(part["end_ns"]))
        tiers.append(TierTrack(name, part, lanes, int(lanes.max(initial=0)) + 1))
    return tiers


def _tier_lanes(start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """The lane of each event, in order of start (longest first): the first lane where it nests in the
    slice open there, if any, once those ended by its start are closed. A track's slices must nest,
    and copies need not: a step's copies end together (kvtrace's engine files them at its end, each with
    its own duration: they nest), but a copy that waited for the link can begin before the last step's
    copies ended. Instants (an untimed copy, an eviction) nest anywhere: lane 0."""
    lanes = np.zeros(len(start), np.int64)
    open_ends: list[list[int]] = [[]]            # per lane, the ends of its slices still open
    for i in np.flatnonzero(end > start):
        s, e = int(start[i]), int(end[i])
        for lane, stack in enumerate(open_ends):
            while stack and stack[-1] <= s:
                stack.pop()
            if not stack or e <= stack[-1]:
                break
        else:
            open_ends.append([])
            lane = len(open_ends) - 1
        open_ends[lane].append(e)
        lanes[i] = lane
    return lanes


def _tier_events(tier: TierTrack, index: int, tracks: RunTracks) -> pa.Table:
    """The packets of a tier's tracks: a slice per timed copy, an instant per untimed copy and eviction,
    each lane's in time order (at a time: slice ends, instants, then slice begins, outer first); a copy
    begins its flow (flow_ids) or ends it (terminating_flow_ids, where its sequence's state began first)."""
    rows = tier.rows
    n = rows.num_rows
    start, end = _ints(rows["start_ns"]), _ints(rows["end_ns"])
    timed = end > start
    track = tracks.tier(index, 0) + tier.lanes
    flow_id = rows["flow_id"].combine_chunks()
    has_flow = _valid(flow_id)
    phase_first = np.asarray(pc.fill_null(rows["phase_first"], False).to_numpy(zero_copy_only=False), bool)
    ids = pa.ListArray.from_arrays(pa.array(np.concatenate([[0], np.cumsum(has_flow)]), pa.int32()),
                                   pc.drop_null(flow_id))
    schema = _schema(rows, _TIER_ARGS)
    opened = _events(n, schema, type=np.where(timed, TYPE_SLICE_BEGIN, TYPE_INSTANT), ts=start, track=track,
                     plain_name=rows["name"],
                     flow_ids=_masked_lists(ids, has_flow & ~phase_first),
                     terminating_flow_ids=_masked_lists(ids, has_flow & phase_first),
                     **{arg: rows[arg] for arg in _TIER_ARGS})
    closed = _events(int(timed.sum()), schema, type=TYPE_SLICE_END, ts=end[timed], track=track[timed])
    index_of = np.arange(n)
    ts = np.concatenate([start, end[timed]])
    order = np.concatenate([np.where(timed, 2, 1), np.zeros(int(timed.sum()), np.int64)])
    lane = np.concatenate([tier.lanes, tier.lanes[timed]])
    stable = np.concatenate([index_of, index_of[timed]])
    return pa.concat_tables([opened, closed]).take(np.lexsort((stable, order, ts, lane)))


def _masked_lists(lists: pa.ListArray, mask: np.ndarray) -> pa.Array:
    """`lists` where `mask`, null elsewhere."""
    return pc.if_else(pa.array(mask), lists, pa.nulls(len(lists), lists.type))


def _write_tier_counters(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, tracks: RunTracks,
                         tiers: list[str]) -> None:
    rows = con.sql("SELECT tier, direction, ts_ns, value FROM _timeline_tier_counters WHERE run_id = $run "
                   "ORDER BY tier, direction, ts_ns", params={"run": run_id}).to_arrow_table()
    uuids = {(tier, direction): tracks.tier_counter(index, d)
             for index, tier in enumerate(tiers) for d, direction in enumerate(TIER_COUNTERS)}
    track = np.array([uuids[key] for key in zip(rows["tier"].to_pylist(), rows["direction"].to_pylist())], np.int64)
    writer.events(_events(rows.num_rows, pa.schema(EVENT_COLUMNS), type=TYPE_COUNTER, ts=rows["ts_ns"],
                          track=track, counter=rows["value"]))


# --------------------------------------------------------------------------- tables of packets

def _chunks(con: duckdb.DuckDBPyConnection, query: str, run_id: str, key: str | None,
            **params: object) -> Iterator[pa.Table]:
    """The rows of a query about one run (and its other `params`) in tables of about CHUNK_ROWS
    rows, read in Arrow batches; with a `key` (an integer column), each table ends where its value
    changes, so that rows with the same key (a step's, a sequence's) come in the same table."""
    reader = con.sql(query, params={"run": run_id, **params}).to_arrow_reader(BATCH_ROWS)
    held: list[pa.RecordBatch] = []
    num_held = 0
    for batch in reader:
        held.append(batch)
        num_held += batch.num_rows
        if num_held >= CHUNK_ROWS:
            table = pa.Table.from_batches(held, reader.schema)
            if key is None:
                yield table
                held, num_held = [], 0
                continue
            values, valid = _ints(table[key]), _valid(table[key])
            changes = np.flatnonzero((values[1:] != values[:-1]) | (valid[1:] != valid[:-1]))
            if len(changes):
                cut = int(changes[-1]) + 1
                yield table.slice(0, cut)
                held = table.slice(cut).to_batches()
                num_held = table.num_rows - cut
    if num_held:
        yield pa.Table.from_batches(held, reader.schema)


def _ints(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """An integer column as numpy int64, 0 where null."""
    return np.asarray(pc.fill_null(column, 0).to_numpy(), np.int64)


def _valid(column: pa.Array | pa.ChunkedArray) -> np.ndarray:
    return np.asarray(column.is_valid(), bool)


def _schema(rows: pa.Table, args: tuple[str, ...], *more: pa.Table) -> pa.Schema:
    """EVENT_COLUMNS, then the arguments with the types of their columns in `rows` (or `more`)."""
    types = {field.name: field.type for table in (rows, *more) for field in table.schema}
    return pa.schema([*EVENT_COLUMNS.items(), *((arg, types[arg]) for arg in args)])


def _events(n: int, schema: pa.Schema, **columns: object) -> pa.Table:
    """A table of n track events: the columns given (a column, or one value for every row), the
    others of `schema` null."""
    arrays = []
    for column in schema:
        value = columns.get(column.name)
        if value is None:
            arrays.append(pa.nulls(n, column.type))
        elif isinstance(value, (pa.Array, pa.ChunkedArray, np.ndarray)):
            arrays.append(pa.array(value, column.type) if isinstance(value, np.ndarray) else value.cast(column.type))
        else:
            arrays.append(pa.array(np.full(n, value), column.type))
    return pa.Table.from_arrays(arrays, schema=schema)
