"""The Parquet tracer: buffers the engine's step records as columns, writes closed chunk files.

Chunks are written by a background thread to a hidden temporary name and renamed into place,
so a reader (or a crash) never sees half a file. A chunk closes when a table's buffer reaches
`max_rows` or, at a step, when `flush_seconds` have passed since the last chunk: a SIGKILL loses at most
the steps of those last seconds (while the engine idles between arrivals nothing new is buffered, and
what the last steps buffered waits for the next step).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.events import RequestStats, StepRecord
from kvtrace.trace.schema import TABLES

_REQUEST_FIELDS = [f for f in TABLES["requests"].names if f != "run_id"]
_NO_TOKEN = (None, None)   # a sequence's first token has no predecessor


class TraceWriter:
    """A `Tracer` (engine/events.py) that writes the trace tables of one run folder."""

    def __init__(self, run_dir: Path, run_id: str, *, record_token_ids: bool = True,
                 max_rows: int = 200_000, flush_seconds: float = 2.0) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.record_token_ids = record_token_ids
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self._columns = {name: {c: [] for c in schema.names if c != "run_id"} for name, schema in TABLES.items()}
        self._part = {name: 0 for name in TABLES}
        self._last_flush = time.monotonic()
        self._last_token: dict[tuple[str, int], tuple[int, float]] = {}  # (req_id, sample) -> (step, ts_s)
        self._lock = threading.Lock()  # gpu_samples arrive from the NVML thread
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.rows_written = {name: 0 for name in TABLES}
        for name in TABLES:
            if name != "gpu_samples":
                (self.run_dir / name).mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._write_loop, name="kvtrace-writer", daemon=True)
        self._thread.start()

    # ---- the Tracer protocol ------------------------------------------------------------
    def on_step(self, r: StepRecord) -> None:
        s = self._columns["steps"]
        s["step"].append(r.step)
        s["start_s"].append(r.start_s)
        s["end_s"].append(r.end_s)
        s["device_ms"].append(r.device_ms)
        s["running"].append(r.num_running)
        s["waiting"].append(r.num_waiting)
        s["swapped"].append(r.num_swapped)
        s["prefill_tokens"].append(r.num_prefill_tokens)
        s["decode_tokens"].append(r.num_decode_tokens)
        s["recompute_tokens"].append(r.num_recompute_tokens)
        s["preemptions"].append(r.num_preemptions)
        s["free_blocks"].append(r.num_free_blocks)
        s["used_blocks"].append(r.num_used_blocks)
        s["cached_blocks"].append(r.num_cached_blocks)
        s["total_blocks"].append(r.num_total_blocks)
        s["kv_tokens"].append(r.num_kv_tokens)
        s["admission_stop"].append(r.admission_stop)
        if r.events:
            k = self._columns["kv_events"]
            for e in r.events:
                k["seq"].append(e.seq)
                k["step"].append(e.step)
                k["ts_s"].append(e.ts_s)
                k["kind"].append(e.kind)
                k["req_id"].append(e.req_id)
                k["sample"].append(e.sample)
                k["blocks"].append(e.blocks)
                k["num_blocks"].append(len(e.blocks) if e.blocks else 0)
                k["num_tokens"].append(e.num_tokens)
                k["bytes"].append(e.bytes)
                k["duration_ms"].append(e.duration_ms)
                k["reason"].append(e.reason)
                k["num_cached_tokens"].append(e.num_cached_tokens)
                k["num_recomputed_tokens"].append(e.num_recomputed_tokens)
                k["src_blocks"].append(e.src_blocks)
                k["requester_req_id"].append(e.requester_req_id)
                k["requester_sample"].append(e.requester_sample)
                k["victim_reason"].append(e.victim_reason)
        num_tokens = len(r.token_req_ids)
        if num_tokens:
            t = self._columns["tokens"]
            t["req_id"].extend(r.token_req_ids)
            t["sample"].extend(r.token_samples)
            t["idx"].extend(r.token_idx)
            t["token_id"].extend(r.token_ids if self.record_token_ids else [None] * num_tokens)
            t["step"].extend([r.step] * num_tokens)
            t["ts_s"].extend([r.end_s] * num_tokens)
            # each token's predecessor in its sequence, so that an ITL gap is one row (schema 2)
            last = self._last_token
            this = (r.step, r.end_s)
            prev_step, prev_ts_s = t["prev_step"], t["prev_ts_s"]
            for key in zip(r.token_req_ids, r.token_samples):
                step, ts_s = last.get(key, _NO_TOKEN)
                prev_step.append(step)
                prev_ts_s.append(ts_s)
                last[key] = this
        for stats in r.finished:
            self._last_token.pop((stats.req_id, stats.sample), None)
            self.add_request(stats)
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or len(self._columns["tokens"]["ts_s"]) >= self.max_rows
                or len(self._columns["kv_events"]["seq"]) >= self.max_rows):
            self.flush()

    def add_request(self, stats: RequestStats) -> None:
        q = self._columns["requests"]
        for name in _REQUEST_FIELDS:
            q[name].append(getattr(stats, name))

    def add_gpu_sample(self, row: dict) -> None:
        with self._lock:
            g = self._columns["gpu_samples"]
            for name, values in g.items():
                values.append(row[name])

    # ---- chunks -------------------------------------------------------------------------
    def flush(self) -> None:
        """Hand every non-empty buffer to the writer thread as one closed chunk."""
        self._last_flush = time.monotonic()
        with self._lock:
            for name, columns in self._columns.items():
                first = next(iter(columns.values()))
                if not first:
                    continue
                self._queue.put((name, self._part[name], columns))
                self._part[name] += 1
                self._columns[name] = {c: [] for c in columns}
        if self._error is not None:
            raise RuntimeError(f"writing the trace failed: {self._error}") from self._error

    def close(self) -> None:
        """Flush everything and wait until every chunk is on disk."""
        self.flush()
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the trace failed: {self._error}") from self._error

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            if self._error is not None:
                continue
            try:
                self._write_chunk(*item)
            except BaseException as exc:  # reported on the engine's thread at the next flush
                self._error = exc

    def _write_chunk(self, name: str, part: int, columns: dict[str, list]) -> None:
        schema = TABLES[name]
        num_rows = len(next(iter(columns.values())))
        arrays = [pa.array([self.run_id] * num_rows, pa.string()) if f.name == "run_id"
                  else pa.array(columns[f.name], f.type) for f in schema]
        table = pa.Table.from_arrays(arrays, schema=schema)
        folder = self.run_dir / name
        folder.mkdir(exist_ok=True)
        final = folder / f"part-{part:05d}.parquet"
        tmp = folder / f".part-{part:05d}.parquet.tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, final)
        self.rows_written[name] += num_rows
