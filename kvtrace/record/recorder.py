"""The Parquet tracer: buffers the engine's step records, writes closed chunk files.

Chunks are made into tables by a background thread (for a simulated run, by the engine's own thread)
and written by the background thread to a hidden temporary name, then renamed into place, so a reader
(or a crash) never sees half a file. A chunk closes when a table's buffer reaches `max_rows` or, at a
step, when `flush_seconds` have passed since the last chunk: a SIGKILL loses at most the steps of
those last seconds (while the engine idles between arrivals nothing new is buffered, and what the last
steps buffered waits for the next step).
"""
from __future__ import annotations

import os
import queue
import threading
import time
from itertools import groupby
from operator import attrgetter, itemgetter
from pathlib import Path

import numpy as np
import pyarrow as pa

from engine import events as ev
from engine.events import DecodeWindow, RequestStats, StepRecord
from kvtrace.trace.schema import TABLES, write_parquet

_REQUEST_FIELDS = [f for f in TABLES["requests"].names if f != "run_id"]


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
# What only the rarer kinds set (preempt, swap_out, swap_in, reprefill, cow). The plain kinds' events,
# nearly all of a run's, leave these at their defaults (engine/events.py), so the columns are read
# from the rarer events alone and the plain rows take the default.
_PLAIN_KINDS = frozenset([ev.ALLOC, ev.FREE, ev.FINISH, ev.ADMIT, ev.PREFIX_HIT])
_RARE_DEFAULTS = {"bytes": 0, "duration_ms": None, "num_cached_tokens": 0, "num_recomputed_tokens": 0,
                  "src_blocks": None, "requester_req_id": None, "requester_sample": None, "victim_reason": None}
_COMMON_EVENT_FIELDS = [f for f in _EVENT_FIELDS if f not in _RARE_DEFAULTS and f != "kind"]
# an evict row's values but its seq, step, ts_s and block (the rest null)
_EVICT_VALUES = {"kind": ev.EVICT, "req_id": "", "sample": 0, "num_tokens": 0, "bytes": 0, "num_cached_tokens": 0,
                 "num_recomputed_tokens": 0}
_RECORD_TABLES = ("steps", "kv_events", "requests")   # buffered as records, not columns


def _records_as_columns(name: str, records: list) -> dict[str, list]:
    """A buffer of StepRecords, KVEvents or RequestStats as the table's columns."""
    if name == "steps":
        return _steps_as_columns(records)
    if name == "requests":
        return {column: list(map(attrgetter(column), records)) for column in _REQUEST_FIELDS}
    columns: dict = {column: list(map(attrgetter(column), records)) for column in _COMMON_EVENT_FIELDS}
    kinds = columns["kind"] = list(map(_kind, records))
    rare = [i for i, kind in enumerate(kinds) if kind not in _PLAIN_KINDS]
    for column, default in _RARE_DEFAULTS.items():
        values = columns[column] = [default] * len(records)
        for i in rare:
            values[i] = getattr(records[i], column)
    evicting = [i for i, evicted in enumerate(map(_evicted, records)) if evicted]
    if evicting:
        _add_evictions(columns, records, evicting)
    return columns


def _add_evictions(columns: dict[str, list | tuple], records: list, evicting: list[int]) -> None:
    """An `evict` row for each block an alloc event evicted, right before it, with the seq numbers the
    engine left free for them (engine/events.py, `with_evictions`); the rows kept in seq order."""
    evicted = [records[i].evicted for i in evicting]
    counts = list(map(len, evicted))
    parents = [i for i, count in zip(evicting, counts) for _ in range(count)]
    seq = columns["seq"]
    rows = {   # the evict rows' columns
        "seq": [seq[i] - count + place for i, count in zip(evicting, counts) for place in range(count)],
        "step": list(map(columns["step"].__getitem__, parents)),
        "ts_s": list(map(columns["ts_s"].__getitem__, parents)),
        "blocks": [[block] for blocks in evicted for block in blocks],
    }
    num = len(parents)
    for column in columns:
        if column not in rows:
            rows[column] = [_EVICT_VALUES.get(column)] * num
    order = np.argsort(np.array(seq + rows["seq"], dtype=np.int64), kind="stable").tolist()
    take = itemgetter(*order)   # (two rows at least: an alloc and its eviction)
    for column, values in columns.items():
        columns[column] = take(values + rows[column])   # a tuple


def _steps_as_columns(records: list) -> dict[str, list]:
    """The steps buffer, StepRecords and DecodeWindows in step order, as the steps table's columns: a
    run of StepRecords column by column, a window from its own fields (DecodeWindow.step_fields)."""
    columns: dict[str, list] = {column: [] for column in _STEP_ATTRIBUTES}
    for windows, run in groupby(records, key=_is_window):
        if windows:
            for window in run:
                fields = window.step_fields()
                for column, attribute in _STEP_ATTRIBUTES.items():
                    columns[column] += fields[attribute]
        else:
            run = list(run)
            for column, attribute in _STEP_ATTRIBUTES.items():
                columns[column] += map(attrgetter(attribute), run)
    return columns


def _is_window(item: StepRecord | DecodeWindow) -> bool:
    return isinstance(item, DecodeWindow)


def _from_numpy(values: np.ndarray, type: pa.DataType, missing: np.ndarray | None = None) -> pa.Array:
    """A numeric numpy column as an Arrow array of `type` (rows where `missing` is true null), made from
    its buffer: pa.array's numpy path would import numpy.ma (10 ms of a simulated recording's start)."""
    values = np.ascontiguousarray(values, dtype=np.dtype(type.to_pandas_dtype()))
    validity = pa.py_buffer(np.packbits(~missing, bitorder="little")) if missing is not None and missing.any() else None
    return pa.Array.from_buffers(type, len(values), [validity, pa.py_buffer(values)])


class _Numbering(dict):
    """str -> int: each key numbered as it is first looked up (0, 1, ...); `names` the keys in order."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __missing__(self, key: str) -> int:
        self[key] = number = len(self.names)
        self.names.append(key)
        return number


_evicted = attrgetter("evicted")
_kind = attrgetter("kind")


class TraceWriter:
    """A `Tracer` (engine/events.py) that writes the trace tables of one run folder."""

    def __init__(self, run_dir: Path, run_id: str, *, record_token_ids: bool = True,
                 max_rows: int = 200_000, flush_seconds: float = 2.0, background: bool = True) -> None:
        """`background`: chunks are made into tables and written by a thread of their own, so that a
        real engine's steps never wait for one. A simulated engine's time is virtual: it makes the tables
        itself and leaves the thread only their encoding and writing, which holds no interpreter lock
        (the thread's Python work competing with the engine's cost a replay of 15,000 requests 16.0 s
        against 11.8 s with none of it in a thread), and hands it a chunk's tables once all are made:
        encoding beside the making of the rest slowed it (the 1,000-request ShareGPT-like command
        1.01 s against 0.98 s, medians of 10)."""
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.record_token_ids = record_token_ids
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self._records: dict[str, list] = {name: [] for name in _RECORD_TABLES}
        self._columns = {name: {c: [] for c in schema.names if c != "run_id"}
                         for name, schema in TABLES.items() if name not in _RECORD_TABLES}
        del self._columns["tokens"]["prev_step"], self._columns["tokens"]["prev_ts_s"]
        # a step's tokens share its step and ts_s: those columns hold one entry a step, and `num` its tokens
        self._columns["tokens"]["num"] = []
        # each token's request as a number (the run's requests numbered as their first token comes):
        # `_predecessors` groups the chunk's tokens by it
        self._columns["tokens"]["req"] = []
        self._req_numbers = _Numbering()
        self._finished_keys: list[tuple[str, int]] = []   # (req_id, sample) finished since the last tokens chunk
        self._part = {name: 0 for name in TABLES}
        self._last_flush = time.monotonic()
        # the writer thread's: (req_id, sample) -> (step, ts_s) of its last token in the chunks written,
        # while it runs (the predecessor of its first token in the next chunk)
        self._last_token: dict[tuple[str, int], tuple[int, float]] = {}
        self._lock = threading.Lock()  # gpu_samples arrive from the NVML thread
        self._queue: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self.rows_written = {name: 0 for name in TABLES}
        for name in TABLES:
            if name != "gpu_samples":
                (self.run_dir / name).mkdir(parents=True, exist_ok=True)
        self.background = background
        self._thread = threading.Thread(target=self._write_loop, name="kvtrace-writer", daemon=True)
        self._thread.start()

    # ---- the Tracer protocol ------------------------------------------------------------
    def on_step(self, r: StepRecord) -> None:
        """Buffer one step: its record and events as they are (the engine hands them over once and
        never changes them again), its tokens as columns (their predecessors are found per chunk, with
        its table: `_predecessors`)."""
        self._records["steps"].append(r)
        events = self._records["kv_events"]
        events += r.events
        num_tokens = len(r.token_req_ids)
        t = self._columns["tokens"]
        if num_tokens:
            t["req_id"] += r.token_req_ids
            t["req"] += map(self._req_numbers.__getitem__, r.token_req_ids)
            t["sample"] += r.token_samples
            t["idx"] += r.token_idx
            t["token_id"] += r.token_ids if self.record_token_ids else [None] * num_tokens
            t["step"].append(r.step)
            t["ts_s"].append(r.end_s)
            t["num"].append(num_tokens)
        if r.finished:
            self._finished_keys += [(stats.req_id, stats.sample) for stats in r.finished]
            self._records["requests"] += r.finished
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or len(t["idx"]) >= self.max_rows or len(events) >= self.max_rows):
            self.flush()

    def on_decode_window(self, w: DecodeWindow) -> None:
        """Buffer a stretch of simulated decode-only steps as `on_step` would buffer its records: the
        window itself in the steps buffer (turned into columns with the chunk), its events, and its
        tokens as columns (every running sequence's, step after step)."""
        self._records["steps"].append(w)
        events = self._records["kv_events"]
        events += w.events
        k, n = w.num_steps, w.num_running
        t = self._columns["tokens"]
        t["req_id"] += w.token_req_ids * k
        t["req"] += list(map(self._req_numbers.__getitem__, w.token_req_ids)) * k
        t["sample"] += w.token_samples * k
        first_idx = w.first_token_idx
        t["idx"] += [i + j for j in range(k) for i in first_idx]
        t["token_id"] += [None] * (k * n)   # the simulator's placeholders are recorded as null
        t["step"] += range(w.first_step, w.first_step + k)
        t["ts_s"] += w.end_s
        t["num"] += [n] * k
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or len(t["idx"]) >= self.max_rows or len(events) >= self.max_rows):
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
        chunks = []
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
                    if name == "tokens":   # the sequences done by then: the writer forgets their last token
                        buffer = {**buffer, "finished": self._finished_keys}
                        self._finished_keys = []
                chunks.append((name, self._part[name], buffer))
                self._part[name] += 1
        if self.background:
            for chunk in chunks:
                self._queue.put(chunk)
        elif self._error is None:
            try:
                tables = [(name, part, self._table(name, buffer)) for name, part, buffer in chunks]
            except Exception as exc:
                self._error = exc
            else:
                for chunk in tables:
                    self._queue.put(chunk)
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
            name, part, content = item
            try:
                self._store(name, part, self._table(name, content) if self.background else content)
            except BaseException as exc:  # reported on the engine's thread at the next flush
                self._error = exc

    def _table(self, name: str, buffer: dict[str, list] | list) -> pa.Table:
        """A chunk's buffer as an Arrow table of the trace's schema."""
        schema = TABLES[name]
        columns = _records_as_columns(name, buffer) if name in _RECORD_TABLES else dict(buffer)
        finished = columns.pop("finished", ())
        if name == "tokens":   # a step's step and ts_s, once for each of its tokens
            num = columns.pop("num")
            reqs = columns.pop("req")
            columns["step"] = _from_numpy(np.repeat(np.array(columns["step"], dtype=np.int64), num), pa.int64())
            columns["ts_s"] = _from_numpy(np.repeat(np.array(columns["ts_s"], dtype=np.float64), num), pa.float64())
            # the usual chunk of a simulated run: every sample 0, no token id (cheaper than converting the lists)
            if not any(columns["sample"]):
                columns["sample"] = _from_numpy(np.zeros(len(columns["sample"]), dtype=np.int32), pa.int32())
            if columns["token_id"].count(None) == len(columns["token_id"]):
                columns["token_id"] = pa.nulls(len(columns["token_id"]), pa.int32())
        num_rows = len(next(iter(columns.values())))
        arrays = {f.name: c if isinstance(c := columns[f.name], pa.Array) else pa.array(c, f.type)
                  for f in schema if f.name in columns}
        if name == "kv_events":
            arrays["num_blocks"] = _from_numpy(np.diff(arrays["blocks"].offsets.to_numpy()), pa.int32())   # a null: 0
        if name == "tokens":
            arrays["prev_step"], arrays["prev_ts_s"] = self._predecessors(arrays, reqs)
            for key in finished:
                self._last_token.pop(key, None)
        arrays["run_id"] = pa.repeat(pa.scalar(self.run_id, pa.string()), num_rows)
        return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)

    def _store(self, name: str, part: int, table: pa.Table) -> None:
        """Write the chunk under a hidden name, then rename it into place."""
        folder = self.run_dir / name
        folder.mkdir(exist_ok=True)
        final = folder / f"part-{part:05d}.parquet"
        tmp = folder / f".part-{part:05d}.parquet.tmp"
        write_parquet(table, tmp)
        os.replace(tmp, final)
        self.rows_written[name] += table.num_rows

    def _predecessors(self, tokens: dict[str, pa.Array], req_numbers: list[int]) -> tuple[pa.Array, pa.Array]:
        """prev_step and prev_ts_s of a chunk's tokens, so that an ITL gap is one row (schema 2): each
        token's predecessor is its sequence's token of idx - 1, the sequence's previous row in this
        chunk or its last token of an earlier chunk (`_last_token`); null for a first token. Whole
        columns at a time: only a chunk's first and last token of each sequence is looked at on its
        own. A sequence's tokens arrive in idx order (one a step at most, steps in order), so a stable
        sort by sequence puts each right after its predecessor."""
        num_rows = len(tokens["idx"])
        names = self._req_numbers.names
        reqs = np.fromiter(req_numbers, dtype=np.int64, count=num_rows)
        samples = tokens["sample"].to_numpy()
        codes = reqs.astype(np.int64) * (int(samples.max()) + 1) + samples
        order = np.argsort(codes, kind="stable")
        codes = codes[order]
        steps = tokens["step"].to_numpy()[order]
        times = tokens["ts_s"].to_numpy()[order]
        first = np.empty(num_rows, dtype=bool)   # a sequence's first token in the chunk
        first[0] = True
        np.not_equal(codes[1:], codes[:-1], out=first[1:])
        prev_step = np.empty(num_rows, dtype=np.int64)
        prev_ts = np.empty(num_rows, dtype=np.float64)
        prev_step[1:], prev_ts[1:] = steps[:-1], times[:-1]
        known = ~first
        sorted_samples = samples[order]
        sorted_req = reqs[order]
        last = self._last_token
        starts = np.flatnonzero(first)
        for i, req, sample in zip(starts.tolist(), sorted_req[starts].tolist(), sorted_samples[starts].tolist()):
            before = last.get((names[req], sample))
            if before is not None:
                prev_step[i], prev_ts[i] = before
                known[i] = True
        ends = np.append(starts[1:] - 1, num_rows - 1)   # a sequence's last token in the chunk
        for req, sample, step, ts_s in zip(sorted_req[ends].tolist(), sorted_samples[ends].tolist(),
                                           steps[ends].tolist(), times[ends].tolist()):
            last[(names[req], sample)] = (step, ts_s)
        unsorted_step = np.empty_like(prev_step)
        unsorted_ts = np.empty_like(prev_ts)
        unsorted_known = np.empty_like(known)
        unsorted_step[order], unsorted_ts[order], unsorted_known[order] = prev_step, prev_ts, known
        missing = ~unsorted_known
        return _from_numpy(unsorted_step, pa.int64(), missing), _from_numpy(unsorted_ts, pa.float64(), missing)
