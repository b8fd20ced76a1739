"""`kvtrace export perfetto`: runs as a native Perfetto trace, to open in ui.perfetto.dev.

Tracks of each run, under one top-level group per run (in the order the runs were given):

    run <run_id>
      engine          one slice per step (args: step, prefill / decode / recompute tokens,
                      preemptions, device_ms); instants for each preempt, swap_out and swap_in, and
                      one per step for its evictions, with their block ids and bytes
      <counters>      free / used / cached blocks, KV tokens held, running / waiting / swapped,
                      cumulative preemptions, recomputed tokens and swap bytes (see COUNTERS)
      Requests        one track per sequence, ordered by arrival: the whole request as a slice
                      (args: prompt / output tokens, preemptions, recomputed tokens, finish
                      reason), its states nested inside it
    flows             from the step that preempted a sequence to its preempted or swapped slice,
                      and from the step that resumed it to its reprefill (or, after a swap-in, the
                      decode or prefill that follows); and (schema 3) from the requester whose
                      growth needed the blocks, an instant "preempts <victim>" on its track, to
                      the victim's preempted or swapped slice

Every row comes from the SQL library's timeline views (analyses/_timeline.sql), which read a
sequence's states from _sequence_states like the report's Gantt; this module only orders the rows
and writes them as packets, streaming: query results are read in Arrow batches and packets are
appended to the file as they are made (kvtrace/export/perfetto_writer.py), so memory stays flat.
Timestamps are integer nanoseconds on each run's clock (seconds since it started); the same runs
give the same bytes.
"""
from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import duckdb

from kvtrace.errors import KvtraceError
from kvtrace.export.perfetto_writer import UNIT_BYTES, TraceWriter, pb
from kvtrace.trace import db

BATCH_ROWS = 8_192             # rows per Arrow batch read from DuckDB (as Python objects, a few MB)
DUCKDB_MEMORY = "128MB"        # DuckDB's working memory; sorts and aggregations beyond it spill to disk

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

    def sequence(self, rank: int) -> int:
        return self.group + 1024 + rank


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


def _rows(con: duckdb.DuckDBPyConnection, query: str, run_id: str) -> Iterator[tuple]:
    """The rows of a query about one run, read in Arrow batches."""
    reader = con.sql(query, params={"run": run_id}).to_arrow_reader(BATCH_ROWS)
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
    for index, (column, (name, unit, axis)) in enumerate(COUNTERS.items()):
        counter = pb.CounterDescriptor(y_axis_share_key=axis)
        if unit == "bytes":
            counter.unit = UNIT_BYTES
        else:
            counter.unit_name = unit
        writer.track(tracks.counter(index), name, parent=tracks.group, rank=1 + index, counter=counter)
    writer.track(tracks.requests, "Requests", parent=tracks.group, rank=1 + len(COUNTERS),
                 explicit_child_order=True, description="one track per sequence, ordered by arrival")
    for rank, name in _rows(con, "SELECT rank, name FROM _timeline_sequences WHERE run_id = $run ORDER BY rank",
                            run_id):
        writer.track(tracks.sequence(rank), name, parent=tracks.requests, rank=rank)

    _write_engine(con, writer, run_id, tracks.engine)
    _write_counters(con, writer, run_id, tracks)
    _write_requests(con, writer, run_id, tracks)


def _write_engine(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, track: int) -> None:
    """Step slices with the instants of each step inside them: one ordered stream (_timeline_engine),
    a step's slice closed when the next step's rows begin."""
    rows = _rows(con, "SELECT step, part, ts_ns, end_ns, name, device_ms, prefill_tokens, decode_tokens, "
                      "recompute_tokens, preemptions, flow_ids, sequence, blocks, num_blocks, num_tokens, kv_bytes, "
                      "bytes_copied, duration_ms, reason FROM _timeline_engine WHERE run_id = $run "
                      "ORDER BY step, part, ts_ns, seq", run_id)
    open_step, open_end = None, 0
    for (step, part, ts, end, name, device_ms, prefill, decode, recompute, preemptions, flow_ids,
         sequence, blocks, num_blocks, num_tokens, kv_bytes, copied, duration_ms, reason) in rows:
        if open_step is not None and step != open_step:
            writer.slice_end(track, open_end)
            open_step = None
        if part == 0:
            writer.slice_begin(track, ts, name, (
                ("step", step), ("prefill_tokens", prefill), ("decode_tokens", decode),
                ("recompute_tokens", recompute), ("preemptions", preemptions), ("device_ms", device_ms)),
                flow_ids=flow_ids)
            open_step, open_end = step, end
        else:       # inside its step's slice; outside any when the step's row is not closed yet (recording)
            writer.instant(track, ts, name, (
                ("step", step), ("sequence", sequence), ("blocks", blocks), ("num_blocks", num_blocks),
                ("num_tokens", num_tokens), ("kv_bytes", kv_bytes), ("bytes_copied", copied),
                ("duration_ms", duration_ms), ("reason", reason)))
    if open_step is not None:
        writer.slice_end(track, open_end)


def _write_counters(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, tracks: RunTracks) -> None:
    index = {column: i for i, column in enumerate(COUNTERS)}
    for counter, ts, value in _rows(con, "SELECT counter, ts_ns, value FROM _timeline_counters "
                                         "WHERE run_id = $run ORDER BY counter, step", run_id):
        writer.counter(tracks.counter(index[counter]), ts, value)


def _write_requests(con: duckdb.DuckDBPyConnection, writer: TraceWriter, run_id: str, tracks: RunTracks) -> None:
    """Per sequence track: the request's slice, its states nested inside it, and inside those the
    instants where its growth preempted another sequence (a flow to the victim's slice)."""
    outgoing: dict[int, list[tuple]] = {}   # rank -> (ts_ns, victim, victim_reason, flow_id), in time order
    for rank, ts, victim, why, flow_id in _rows(con, """
            SELECT s.rank, f.ts_ns, f.victim, f.victim_reason, f.flow_id
            FROM _timeline_requester_flows f JOIN _timeline_sequences s USING (run_id, req_id, sample)
            WHERE f.run_id = $run ORDER BY s.rank, f.ts_ns, f.flow_id""", run_id):
        outgoing.setdefault(rank, []).append((ts, victim, why, flow_id))
    rows = _rows(con, """
        SELECT s.rank, s.name, s.arrival_ns, s.finish_ns, s.prompt_tokens, s.output_tokens, s.preemptions,
               s.swaps, s.recomputed_tokens, s.prefix_hit_tokens, s.finish_reason,
               p.state, p.start_ns, p.end_ns, p.flow_id, p.requester_flow_id
        FROM _timeline_sequences s
        LEFT JOIN _timeline_phases p USING (run_id, req_id, sample)
        WHERE s.run_id = $run
        ORDER BY s.rank, p.start_ns""", run_id)

    def preempts(track: int, pending: list[tuple], before: int | None) -> None:
        """The requester instants of `pending` before `before` (all when None), written and removed."""
        while pending and (before is None or pending[0][0] < before):
            ts, victim, why, flow_id = pending.pop(0)
            writer.instant(track, ts, f"preempts {victim}", (("victim", victim), ("victim_reason", why)),
                           flow_ids=(flow_id,))

    open_track, open_end, pending = None, 0, []
    for (rank, name, arrival, finish, prompt, output, preemptions, swaps, recomputed, prefix_hits, reason,
         state, start, end, flow_id, requester_flow_id) in rows:
        track = tracks.sequence(rank)
        if track != open_track:
            if open_track is not None:
                preempts(open_track, pending, None)
                writer.slice_end(open_track, open_end)
            pending = list(outgoing.get(rank, ()))
            writer.slice_begin(track, arrival, name, (
                ("prompt_tokens", prompt), ("output_tokens", output), ("preemptions", preemptions),
                ("swaps", swaps), ("recomputed_tokens", recomputed), ("prefix_hit_tokens", prefix_hits),
                ("finish_reason", reason)), intern_name=False)
            open_track, open_end = track, finish if finish is not None else arrival
        if state is not None:
            preempts(track, pending, start)
            terminating = tuple(f for f in (flow_id, requester_flow_id) if f is not None)
            writer.slice_begin(track, start, state, terminating_flow_ids=terminating)
            preempts(track, pending, end)
            writer.slice_end(track, end)
            open_end = max(open_end, end)
    if open_track is not None:
        preempts(open_track, pending, None)
        writer.slice_end(open_track, open_end)
