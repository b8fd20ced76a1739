"""The Parquet tracer: buffers the engine's step records, writes closed chunk files.

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
from itertools import repeat
from operator import attrgetter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from engine.events import RequestStats, StepRecord
from kvtrace.trace.schema import TABLES

_REQUEST_FIELDS = [f for f in TABLES["requests"].names if f != "run_id"]
_NO_TOKEN = (None, None)   # a sequence's first token has no predecessor


# The steps and kv_events columns as attributes of the engine's StepRecord and KVEvent: those tables
# are buffered as the records themselves (one append per step, one extend per step's events) and
# turned into columns once per chunk, in the writer thread.
_STEP_ATTRIBUTES = {
    "step": "step", "start_s": "start_s", "end_s": "end_s", "device_ms": "device_ms", "running": "num_running",
    "waiting": "num_waiting", "swapped": "num_swapped", "prefill_tokens": "num_prefill_tokens",
    "decode_tokens": "num_decode_tokens", "recompute_tokens": "num_recompute_tokens",
    "preemptions": "num_preemptions", "free_blocks": "num_free_blocks", "used_blocks": "num_used_blocks",
    "cached_blocks": "num_cached_blocks", "total_blocks": "num_total_blocks", "kv_tokens": "num_kv_tokens",
    "admission_stop": "admission_stop",
}
_EVENT_FIELDS = [f for f in TABLES["kv_events"].names if f not in ("run_id", "num_blocks")]
_RECORD_TABLES = ("steps", "kv_events", "requests")   # buffered as records, not columns


def _records_as_columns(name: str, records: list) -> dict[str, list]:
    """A buffer of StepRecords, KVEvents or RequestStats as the table's columns."""
    if name == "steps":
        return {column: list(map(attrgetter(attribute), records)) for column, attribute in _STEP_ATTRIBUTES.items()}
    if name == "requests":
        return {column: list(map(attrgetter(column), records)) for column in _REQUEST_FIELDS}
    columns = {column: list(map(attrgetter(column), records)) for column in _EVENT_FIELDS}
    columns["num_blocks"] = [len(blocks) if blocks else 0 for blocks in columns["blocks"]]
    return columns


class TraceWriter:
    """A `Tracer` (engine/events.py) that writes the trace tables of one run folder."""

    def __init__(self, run_dir: Path, run_id: str, *, record_token_ids: bool = True,
                 max_rows: int = 200_000, flush_seconds: float = 2.0) -> None:
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.record_token_ids = record_token_ids
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self._records: dict[str, list] = {name: [] for name in _RECORD_TABLES}
        self._columns = {name: {c: [] for c in schema.names if c != "run_id"}
                         for name, schema in TABLES.items() if name not in _RECORD_TABLES}
        del self._columns["tokens"]["prev_step"], self._columns["tokens"]["prev_ts_s"]
        self._prev_tokens: list[tuple[int | None, float | None]] = []   # the tokens' prev_step, prev_ts_s
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
        """Buffer one step: its record and events as they are (the engine hands them over once and
        never changes them again), its tokens as columns."""
        self._records["steps"].append(r)
        events = self._records["kv_events"]
        events += r.events
        num_tokens = len(r.token_req_ids)
        t = self._columns["tokens"]
        if num_tokens:
            t["req_id"] += r.token_req_ids
            t["sample"] += r.token_samples
            t["idx"] += r.token_idx
            t["token_id"] += r.token_ids if self.record_token_ids else [None] * num_tokens
            t["step"] += [r.step] * num_tokens
            t["ts_s"] += [r.end_s] * num_tokens
            # each token's predecessor in its sequence, so that an ITL gap is one row (schema 2); a
            # sequence emits at most one token a step, so a step's lookups and updates do not overlap
            last = self._last_token
            keys = list(zip(r.token_req_ids, r.token_samples))
            self._prev_tokens += map(last.get, keys, repeat(_NO_TOKEN, num_tokens))
            last.update(dict.fromkeys(keys, (r.step, r.end_s)))
        for stats in r.finished:
            self._last_token.pop((stats.req_id, stats.sample), None)
        self._records["requests"] += r.finished
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or len(t["ts_s"]) >= self.max_rows or len(events) >= self.max_rows):
            self.flush()

    def add_request(self, stats: RequestStats) -> None:
        self._records["requests"].append(stats)

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
            for name in TABLES:
                if name in self._records:
                    buffer = self._records[name]
                    if not buffer:
                        continue
                    self._records[name] = []
                else:
                    buffer = self._columns[name]
                    if not next(iter(buffer.values())):
                        continue
                    self._columns[name] = {c: [] for c in buffer}
                    if name == "tokens":
                        buffer = {**buffer, "prev": self._prev_tokens}
                        self._prev_tokens = []
                self._queue.put((name, self._part[name], buffer))
                self._part[name] += 1
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

    def _write_chunk(self, name: str, part: int, buffer: dict[str, list] | list) -> None:
        schema = TABLES[name]
        columns = _records_as_columns(name, buffer) if name in _RECORD_TABLES else buffer
        if name == "tokens":
            prev = columns.pop("prev")
            columns["prev_step"] = [step for step, _ in prev]
            columns["prev_ts_s"] = [ts_s for _, ts_s in prev]
        num_rows = len(next(iter(columns.values())))
        arrays = [pa.repeat(pa.scalar(self.run_id, pa.string()), num_rows) if f.name == "run_id"
                  else pa.array(columns[f.name], f.type) for f in schema]
        table = pa.Table.from_arrays(arrays, schema=schema)
        folder = self.run_dir / name
        folder.mkdir(exist_ok=True)
        final = folder / f"part-{part:05d}.parquet"
        tmp = folder / f".part-{part:05d}.parquet.tmp"
        pq.write_table(table, tmp, compression="zstd")
        os.replace(tmp, final)
        self.rows_written[name] += num_rows
