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
from itertools import chain
from operator import attrgetter
from pathlib import Path

import numpy as np
import pyarrow as pa

from engine import events as ev
from engine.events import RequestStats, StepRecord
from engine.sim.window import DecodeWindow
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
# a decode window's alloc row's values but its seq, step, ts_s, req_id, sample and block (the rest the default)
_WINDOW_ALLOC_VALUES = {"kind": ev.ALLOC, "num_tokens": 0, "reason": ev.AllocReason.DECODE}
# the integer columns whose evict rows hold a number (_EVICT_VALUES)
_INT_EVENT_FIELDS = frozenset(["sample", "num_tokens", "bytes", "num_cached_tokens", "num_recomputed_tokens"])
_RECORD_TABLES = ("steps", "kv_events", "requests")   # buffered as records, not columns
# The tokens buffer: stretches of steps in which the same sequences each emit a token a step, a step's
# tokens or a decode window's. A stretch's `num` sequences, `steps` steps and first `step`; each step's
# `ts_s`; each sequence's `req` (its request's number), `sample`, `idx` (of its token at the stretch's
# first step) and `token_id` (when recorded: a window's are null). The rows are made with the chunk.
_TOKEN_BUFFER = ("num", "steps", "step", "ts_s", "req", "sample", "idx", "token_id")
# the tables of the closing chunk made in this order: the slowest to write first
_CLOSING_ORDER = {"tokens": 0, "kv_events": 1, "steps": 2}


def _records_as_columns(name: str, records: list) -> dict[str, list]:
    """A buffer of StepRecords (and DecodeWindows), KVEvents (and DecodeWindows) or RequestStats as
    the table's columns."""
    if name == "steps":
        return _steps_as_columns(records)
    if name == "requests":
        return {column: list(map(attrgetter(column), records)) for column in _REQUEST_FIELDS}
    return _events_as_columns(records)


def _events_as_columns(items: list) -> dict[str, list | np.ndarray | pa.Array]:
    """The kv_events buffer, the steps' KVEvents and the decode windows whose allocs are rows
    (DecodeWindow.alloc_columns), in seq order, as the table's columns: an `evict` row for each block
    an alloc evicted, right before it, with the seq numbers the engine left free for them
    (engine/events.py, `with_evictions`)."""
    windows = [item for item in items if type(item) is DecodeWindow]
    events = [item for item in items if type(item) is not DecodeWindow] if windows else items
    columns: dict = {column: list(map(attrgetter(column), events)) for column in _COMMON_EVENT_FIELDS}
    kinds = columns["kind"] = list(map(_kind, events))
    evicted = list(map(_evicted, events))
    allocs = None
    if windows:
        allocs = DecodeWindow.alloc_columns(windows)
        evicted += allocs["evicted"]
    evicting = [i for i, blocks in enumerate(evicted) if blocks]
    rows = _merge_rows(columns, allocs, evicted, evicting) if allocs or evicting else range(len(events))
    num_rows = len(columns["seq"])
    rare = [i for i, kind in enumerate(kinds) if kind not in _PLAIN_KINDS]
    for column, default in _RARE_DEFAULTS.items():   # (an alloc's or evict row's value is the default too)
        set_values = [(rows[i], value) for i in rare if (value := getattr(events[i], column)) != default]
        if default is not None:   # a count
            values = np.full(num_rows, default, dtype=np.int64)
        elif set_values:
            values = [None] * num_rows
        else:
            columns[column] = pa.nulls(num_rows, TABLES["kv_events"].field(column).type)
            continue
        for row, value in set_values:
            values[row] = value
        columns[column] = values
    return columns


def _merge_rows(columns: dict[str, list | np.ndarray | pa.Array], allocs: dict | None, evicted: list,
                evicting: list[int]) -> np.ndarray:
    """The events' columns (KVEvents'), the windows' allocs after them, and an `evict` row for each
    block in `evicted` (of those rows, in their order), merged in seq order: the number columns as
    numpy arrays, blocks as an Arrow array, the strings as lists. Returns each event's row."""
    num_events = len(columns["seq"])
    num_allocs = len(allocs["seq"]) if allocs else 0
    counts = np.fromiter(map(len, [evicted[i] for i in evicting]), dtype=np.int64, count=len(evicting))
    num = int(counts.sum())
    parents = np.repeat(np.array(evicting, dtype=np.int64), counts)   # each evict row's alloc
    seq = np.array(columns["seq"], dtype=np.int64)
    if allocs:
        seq = np.concatenate([seq, allocs["seq"]])
    place = np.arange(num) - np.repeat(np.cumsum(counts) - counts, counts)   # among its alloc's evictions
    merged = np.concatenate([seq, seq[parents] - counts.repeat(counts) + place])
    order = np.argsort(merged, kind="stable")
    columns["seq"] = merged[order]
    for column, values in columns.items():
        if column == "seq":
            continue
        of_allocs = (allocs[column] if column in allocs else _WINDOW_ALLOC_VALUES.get(column)) if allocs else ()
        if column in ("step", "ts_s"):   # an evict row's: its alloc's
            array = np.array(values, dtype=np.float64 if column == "ts_s" else np.int64)
            if allocs:
                array = np.concatenate([array, of_allocs])
            columns[column] = np.concatenate([array, array[parents]])[order]
        elif column == "blocks":
            singles = np.fromiter(chain.from_iterable(evicted[i] for i in evicting), dtype=np.int64, count=num)
            if allocs:
                singles = np.concatenate([allocs["block"], singles])
            columns[column] = _with_single_lists(pa.array(values, pa.list_(pa.int32())), singles, order)
        elif column in _INT_EVENT_FIELDS and None not in values:
            columns[column] = np.concatenate([np.array(values, dtype=np.int64),
                                              np.broadcast_to(np.asarray(of_allocs, dtype=np.int64), num_allocs),
                                              np.full(num, _EVICT_VALUES[column], dtype=np.int64)])[order]
        else:   # strings (or None)
            columns[column] = _in_order(order, [(values, num_events), (of_allocs, num_allocs),
                                                (_EVICT_VALUES.get(column), num)])
    rows = np.empty(len(merged), dtype=np.int64)
    rows[order] = np.arange(len(merged))
    return rows[:num_events]


def _with_single_lists(lists: pa.ListArray, values: np.ndarray, order: np.ndarray) -> pa.Array:
    """`lists`, then a one-element list for each of `values`, rows taken in `order` (a permutation):
    made from the arrays' buffers (Arrow's take would import pyarrow.compute)."""
    offsets = lists.offsets.to_numpy()
    source = np.concatenate([lists.values.to_numpy(), values])
    lengths = np.concatenate([np.diff(offsets), np.ones(len(values), dtype=np.int64)])[order]
    starts = np.concatenate([offsets[:-1], len(lists.values) + np.arange(len(values))])[order]
    new_offsets = np.zeros(len(order) + 1, dtype=np.int64)
    np.cumsum(lengths, out=new_offsets[1:])
    index = np.repeat(starts - new_offsets[:-1], lengths) + np.arange(new_offsets[-1])
    validity = None
    if lists.null_count:
        valid = np.unpackbits(np.frombuffer(lists.buffers()[0], dtype=np.uint8), bitorder="little")
        valid = np.concatenate([valid[lists.offset:lists.offset + len(lists)].astype(bool),
                                np.ones(len(values), dtype=bool)])[order]
        validity = pa.py_buffer(np.packbits(valid, bitorder="little"))
    child = _from_numpy(source[index], lists.type.value_type)
    return pa.Array.from_buffers(lists.type, len(order), [validity, pa.py_buffer(new_offsets.astype(np.int32))],
                                 children=[child])


def _steps_as_columns(records: list) -> dict[str, list | tuple | np.ndarray]:
    """The steps buffer, StepRecords and DecodeWindows in step order, as the steps table's columns:
    the windows' steps made at once (DecodeWindow.step_columns), the records' read field by field,
    the two merged by step."""
    windows = [item for item in records if type(item) is DecodeWindow]
    if len(windows) < len(records):
        steps = [item for item in records if type(item) is not DecodeWindow] if windows else records
        fields = {attribute: list(map(attrgetter(attribute), steps)) for attribute in _STEP_ATTRIBUTES.values()}
        if not windows:
            return {column: fields[attribute] for column, attribute in _STEP_ATTRIBUTES.items()}
    window_fields = DecodeWindow.step_columns(windows)
    if len(windows) == len(records):
        return {column: window_fields[attribute] for column, attribute in _STEP_ATTRIBUTES.items()}
    order = np.argsort(np.concatenate([window_fields["step"], np.array(fields["step"], dtype=np.int64)]),
                       kind="stable")
    columns = {}
    for column, attribute in _STEP_ATTRIBUTES.items():
        ours, theirs = window_fields[attribute], fields[attribute]
        if isinstance(ours, np.ndarray) and ours.dtype != object and None not in theirs:
            columns[column] = np.concatenate([ours, np.array(theirs, dtype=ours.dtype)])[order]
        else:   # nullable (device_ms) or strings
            columns[column] = _in_order(order, [(ours, len(ours)), (theirs, len(theirs))])
    return columns


def _in_order(order: np.ndarray, parts: list[tuple[object, int]]) -> list:
    """Parts of a column one after another, each (its values, or one value for all its rows; its
    rows), as a list in `order` (a permutation of the rows): strings and nullable values, put in order
    through a numpy object array (an itemgetter of every row took twice as long)."""
    objects = np.empty(len(order), dtype=object)
    at = 0
    for values, num_rows in parts:
        objects[at:at + num_rows] = values
        at += num_rows
    return objects[order].tolist()


def _as_arrow(values: list | tuple | np.ndarray | pa.Array, type: pa.DataType) -> pa.Array:
    """A column as made (Python values, numpy's, Arrow's) as an Arrow array of `type`."""
    if isinstance(values, pa.Array):
        return values
    if isinstance(values, np.ndarray):
        return _from_numpy(values, type) if values.dtype != object else pa.array(values.tolist(), type)
    return pa.array(values, type)


def _from_numpy(values: np.ndarray, type: pa.DataType, missing: np.ndarray | None = None) -> pa.Array:
    """A numeric numpy column as an Arrow array of `type` (rows where `missing` is true null), made from
    its buffer: pa.array's numpy path would import numpy.ma (10 ms of a simulated recording's start)."""
    values = np.ascontiguousarray(values, dtype=np.dtype(type.to_pandas_dtype()))
    validity = pa.py_buffer(np.packbits(~missing, bitorder="little")) if missing is not None and missing.any() else None
    return pa.Array.from_buffers(type, len(values), [validity, pa.py_buffer(values)])


def _strings(names: pa.Array, codes: np.ndarray) -> pa.Array:
    """names[codes] as a string array, its characters copied by numpy (Arrow's take would import
    pyarrow.compute: 30 ms of a simulated recording's start)."""
    _, offsets, data = names.buffers()
    offsets = np.frombuffer(offsets, dtype=np.int32, count=names.offset + len(names) + 1)[names.offset:]
    lengths = np.diff(offsets)[codes]
    row_offsets = np.zeros(len(codes) + 1, dtype=np.int64)
    np.cumsum(lengths, out=row_offsets[1:])
    if row_offsets[-1] >= 2 ** 31:   # past one string array's 32-bit offsets: Arrow's chunks
        strings = names.to_pylist()
        return pa.array([strings[code] for code in codes.tolist()], pa.string())
    index = np.repeat(offsets[:-1][codes] - row_offsets[:-1], lengths) + np.arange(row_offsets[-1])
    chars = np.frombuffer(data, dtype=np.uint8)[index] if data is not None else np.zeros(0, dtype=np.uint8)
    return pa.Array.from_buffers(pa.string(), len(codes), [None, pa.py_buffer(row_offsets.astype(np.int32)),
                                                          pa.py_buffer(chars)])


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
        # the tokens as stretches (_TOKEN_BUFFER: a step's tokens, or a decode window's), turned into rows
        # with the chunk (`_tokens_table`)
        self._columns["tokens"] = {c: [] for c in _TOKEN_BUFFER}
        self._num_token_rows = 0
        self._num_events = 0   # the kv_events buffer's events (a window's allocs each one)
        # the run's requests numbered as their first token comes: a token's request is buffered as its
        # number, and its req_id is taken from `_names` (the names as Arrow strings, the writer's)
        self._req_numbers = _Numbering()
        self._names = pa.array([], pa.string())
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
        its table: `_tokens_table`)."""
        self._records["steps"].append(r)
        events = self._records["kv_events"]
        events += r.events
        self._num_events += len(r.events)
        num_tokens = len(r.token_req_ids)
        t = self._columns["tokens"]
        if num_tokens:
            t["num"].append(num_tokens)
            t["steps"].append(1)
            t["step"].append(r.step)
            t["ts_s"].append(r.end_s)
            t["req"] += map(self._req_numbers.__getitem__, r.token_req_ids)
            t["sample"] += r.token_samples
            t["idx"] += r.token_idx
            if self.record_token_ids:
                t["token_id"] += r.token_ids
            self._num_token_rows += num_tokens
        if r.finished:
            self._finished_keys += [(stats.req_id, stats.sample) for stats in r.finished]
            self._records["requests"] += r.finished
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or self._num_token_rows >= self.max_rows or self._num_events >= self.max_rows):
            self.flush()

    def on_decode_window(self, w: DecodeWindow) -> None:
        """Buffer a stretch of simulated decode-only steps as `on_step` would buffer its records: the
        window itself in the steps buffer and, if it has any, in the events buffer (both turned into
        columns with the chunk), and its tokens as one stretch (every running sequence's token, step
        after step)."""
        self._records["steps"].append(w)
        if w.allocs:   # its events, as rows
            self._records["kv_events"].append(w)
            self._num_events += len(w.allocs)
        k, n = w.num_steps, w.num_running
        t = self._columns["tokens"]
        t["num"].append(n)
        t["steps"].append(k)
        t["step"].append(w.first_step)
        t["ts_s"] += w.end_s
        t["req"] += map(self._req_numbers.__getitem__, w.token_req_ids)
        t["sample"] += w.token_samples
        t["idx"] += w.first_token_idx
        if self.record_token_ids:
            t["token_id"] += [None] * n   # the simulator's placeholders are recorded as null
        self._num_token_rows += n * k
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or self._num_token_rows >= self.max_rows or self._num_events >= self.max_rows):
            self.flush()

    def add_request(self, stats: RequestStats) -> None:
        self._records["requests"].append(stats)

    def add_gpu_sample(self, row: dict) -> None:
        with self._lock:
            g = self._columns["gpu_samples"]
            for name, values in g.items():
                values.append(row[name])

    # ---- chunks -------------------------------------------------------------------------
    def flush(self, closing: bool = False) -> None:
        """Hand every non-empty buffer to the writer thread as one closed chunk. `closing`: the last
        flush, whose tables are handed over one by one as they are made (the largest to write first),
        so that writing them overlaps the making of the rest: nothing else is left to run."""
        self._last_flush = time.monotonic()
        chunks = []
        with self._lock:
            for name in TABLES:
                if name in self._records:
                    buffer = self._records[name]
                    if not buffer:
                        continue
                    self._records[name] = []
                    if name == "kv_events":
                        self._num_events = 0
                else:
                    buffer = self._columns[name]
                    if not next(iter(buffer.values())):
                        continue
                    self._columns[name] = {c: [] for c in buffer}
                    if name == "tokens":   # the sequences done by then: the writer forgets their last token
                        buffer = {**buffer, "finished": self._finished_keys}
                        self._finished_keys = []
                        self._num_token_rows = 0
                chunks.append((name, self._part[name], buffer))
                self._part[name] += 1
        if self.background:
            for chunk in chunks:
                self._queue.put(chunk)
        elif closing:
            chunks.sort(key=lambda chunk: _CLOSING_ORDER.get(chunk[0], len(_CLOSING_ORDER)))
            for name, part, buffer in chunks:
                if self._error is not None:
                    break
                try:
                    self._queue.put((name, part, self._table(name, buffer)))
                except Exception as exc:
                    self._error = exc
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
        """Flush everything and wait until every chunk is on disk. Tables made here (not `background`)
        this thread writes too, beside the writer thread, until none is left (a background writer's
        chunks stay its own: it makes the tokens chunks' tables in order)."""
        try:
            self.flush(closing=True)
        finally:
            self._queue.put(None)
            while not self.background:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:   # the writer thread took the last, and the stop
                    break
                if item is None:
                    self._queue.put(None)   # the writer thread's stop
                    break
                self._write(item)
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the trace failed: {self._error}") from self._error

    def _write_loop(self) -> None:
        while (item := self._queue.get()) is not None:
            self._write(item)

    def _write(self, item: tuple) -> None:
        """Write one chunk (its table made here in the background mode); an error is kept for the
        engine's thread, which reports it at its next flush."""
        if self._error is not None:
            return
        name, part, content = item
        try:
            self._store(name, part, self._table(name, content) if self.background else content)
        except BaseException as exc:
            self._error = exc

    def _table(self, name: str, buffer: dict[str, list] | list) -> pa.Table:
        """A chunk's buffer as an Arrow table of the trace's schema."""
        if name == "tokens":
            return self._tokens_table(buffer)
        schema = TABLES[name]
        columns = _records_as_columns(name, buffer) if name in _RECORD_TABLES else buffer
        num_rows = len(next(iter(columns.values())))
        arrays = {f.name: _as_arrow(columns[f.name], f.type) for f in schema if f.name in columns}
        if name == "kv_events":
            arrays["num_blocks"] = _from_numpy(np.diff(arrays["blocks"].offsets.to_numpy()), pa.int32())   # a null: 0
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
        with self._lock:   # (the closing thread writes too)
            self.rows_written[name] += table.num_rows

    def _tokens_table(self, buffer: dict[str, list]) -> pa.Table:
        """A chunk's tokens buffer (_TOKEN_BUFFER) as its table. A stretch's rows run step by step,
        each step's in the stretch's batch order: its i-th sequence's token at its j-th step has idx
        `idx[i] + j`, and its predecessor is that sequence's token of the step before (j > 0), or, at
        the stretch's first step, its sequence's last token before the stretch (`_first_predecessors`,
        which reads and updates the writer's state: the chunks' tables are made in order)."""
        num = np.array(buffer["num"], dtype=np.int64)   # a stretch's sequences
        first_step = np.array(buffer["step"], dtype=np.int64)
        ts_s = np.array(buffer["ts_s"], dtype=np.float64)   # each step's
        req, sample, idx = (np.array(buffer[c], dtype=np.int64) for c in ("req", "sample", "idx"))
        stretch_of = np.repeat(np.arange(len(num)), num)   # each sequence's stretch
        if len(ts_s) == len(num):   # every stretch a single step (always so in a real engine's run)
            member = None
            width = num   # each step's tokens
            step_number = first_step
            last_step = stretch_of   # each sequence's last step in its stretch
            first_row = np.arange(len(req))   # each sequence's row at its stretch's first step
        else:
            steps = np.array(buffer["steps"], dtype=np.int64)
            stretch = np.repeat(np.arange(len(num)), steps)   # each step's
            stretch_first_step = np.cumsum(steps) - steps
            j = np.arange(len(ts_s)) - stretch_first_step[stretch]   # each step's place in its stretch
            width = num[stretch]
            step_first_row = np.cumsum(width) - width
            stretch_first_member = np.cumsum(num) - num
            member = (np.arange(int(width.sum()))   # each row's sequence
                      - np.repeat(step_first_row - stretch_first_member[stretch], width))
            idx = idx[member] + np.repeat(j, width)
            step_number = first_step[stretch] + j
            last_step = (stretch_first_step + steps - 1)[stretch_of]
            first_row = (step_first_row[stretch_first_step][stretch_of]
                         + np.arange(len(req)) - stretch_first_member[stretch_of])
        step = np.repeat(step_number, width)
        num_rows = len(step)
        prev_step = step - 1
        prev_ts_s = np.repeat(np.roll(ts_s, 1), width)
        missing = np.zeros(num_rows, dtype=bool)
        prev_step[first_row], prev_ts_s[first_row], missing[first_row] = self._first_predecessors(
            req, sample, step_number[last_step], ts_s[last_step])
        for key in buffer["finished"]:
            self._last_token.pop(key, None)
        ids = buffer["token_id"]
        if ids.count(None) == len(ids):   # none recorded, or the simulator's placeholders
            token_id = pa.nulls(num_rows, pa.int32())
        else:
            none = np.fromiter((i is None for i in ids), dtype=bool, count=len(ids))
            values = np.array([0 if i is None else i for i in ids] if none.any() else ids, dtype=np.int64)
            if member is not None:
                values, none = values[member], none[member]
            token_id = _from_numpy(values, pa.int32(), none)
        if member is not None:
            req, sample = req[member], sample[member]
        names = self._req_numbers.names
        if len(self._names) < len(names):   # (the engine's thread may be numbering more meanwhile)
            self._names = pa.concat_arrays([self._names, pa.array(names[len(self._names):], pa.string())])
        arrays = {"req_id": _strings(self._names, req), "sample": _from_numpy(sample, pa.int32()),
                  "idx": _from_numpy(idx, pa.int32()), "token_id": token_id, "step": _from_numpy(step, pa.int64()),
                  "ts_s": _from_numpy(np.repeat(ts_s, width), pa.float64()),
                  "prev_step": _from_numpy(prev_step, pa.int64(), missing),
                  "prev_ts_s": _from_numpy(prev_ts_s, pa.float64(), missing),
                  "run_id": pa.repeat(pa.scalar(self.run_id, pa.string()), num_rows)}
        schema = TABLES["tokens"]
        return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)

    def _first_predecessors(self, reqs: np.ndarray, samples: np.ndarray, last_steps: np.ndarray,
                            last_times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The predecessor (step, ts_s, missing) of each stretch's sequence's first token in a chunk
        (_tokens_table), given each one's last token's step and ts_s: its sequence's last token in
        the stretch before, or in an earlier chunk (`_last_token`), or none (a first token). A stable
        sort by sequence puts each right after the stretch before it (a sequence is in a step at most
        once, steps in order); only a sequence's first and last stretch in the chunk is looked at
        on its own."""
        num = len(reqs)
        names = self._req_numbers.names
        codes = reqs * (int(samples.max()) + 1) + samples
        order = np.argsort(codes, kind="stable")
        codes = codes[order]
        steps = last_steps[order]
        times = last_times[order]
        first = np.empty(num, dtype=bool)   # a sequence's first stretch in the chunk
        first[0] = True
        np.not_equal(codes[1:], codes[:-1], out=first[1:])
        prev_step = np.empty(num, dtype=np.int64)
        prev_ts = np.empty(num, dtype=np.float64)
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
        ends = np.append(starts[1:] - 1, num - 1)   # a sequence's last stretch in the chunk
        for req, sample, step, ts_s in zip(sorted_req[ends].tolist(), sorted_samples[ends].tolist(),
                                           steps[ends].tolist(), times[ends].tolist()):
            last[(names[req], sample)] = (step, ts_s)
        unsorted_step = np.empty_like(prev_step)
        unsorted_ts = np.empty_like(prev_ts)
        unsorted_known = np.empty_like(known)
        unsorted_step[order], unsorted_ts[order], unsorted_known[order] = prev_step, prev_ts, known
        return unsorted_step, unsorted_ts, ~unsorted_known
