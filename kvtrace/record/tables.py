"""The trace's tables made from what the trace writer buffers (recorder.py): one builder per table,
each turning one chunk's buffer into an Arrow table of the table's schema (kvtrace/trace/schema.py).

What each table is buffered as, between two chunks:
- steps: the engine's StepRecords and DecodeWindows, in step order (`steps_table`);
- kv_events: its KVEvents and the DecodeWindows that allocated blocks, in seq order (`kv_events_table`);
- requests: its RequestStats (`requests_table`);
- tokens: `TokenStretches` (`TokensTable`, which remembers each sequence's last token between chunks);
- gpu_samples: the NVML sampler's rows as columns (`gpu_samples_table`).

The records are kept as the engine handed them over (one append per step) and read field by field
once per chunk; where a column is made for many rows at once it is made with numpy, and arrays that
Arrow's compute functions would make are made from their buffers (arrays.py says why).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain
from operator import attrgetter

import numpy as np
import pyarrow as pa

from engine import events as ev
from engine.events import DecodeWindow, KVEvent, RequestStats, StepRecord
from kvtrace.record.arrays import as_arrow, from_numpy, lists_then_singles, take_strings
from kvtrace.trace.schema import TABLES

# each steps column: the StepRecord (and DecodeWindow.step_columns) field it is read from
_STEP_FIELDS = {
    "step": "step", "start_s": "start_s", "end_s": "end_s", "device_ms": "device_ms", "running": "num_running",
    "waiting": "num_waiting", "swapped": "num_swapped", "prefill_tokens": "num_prefill_tokens",
    "decode_tokens": "num_decode_tokens", "recompute_tokens": "num_recompute_tokens",
    "preemptions": "num_preemptions", "free_blocks": "num_free_blocks", "used_blocks": "num_used_blocks",
    "cached_blocks": "num_cached_blocks", "total_blocks": "num_total_blocks", "kv_tokens": "num_kv_tokens",
    "admission_stop": "admission_stop",
}
_REQUEST_FIELDS = [f for f in TABLES["requests"].names if f != "run_id"]
# The kv_events columns that only the rarer kinds set (preempt, swap_out, swap_in, reprefill, cow),
# with the value every other event leaves (engine/events.py): they are read from the rarer events
# alone, and the rest of the rows take the default.
_PLAIN_KINDS = frozenset([ev.ALLOC, ev.FREE, ev.FINISH, ev.ADMIT, ev.PREFIX_HIT])
_RARE_DEFAULTS = {"bytes": 0, "duration_ms": None, "num_cached_tokens": 0, "num_recomputed_tokens": 0,
                  "src_blocks": None, "requester_req_id": None, "requester_sample": None, "victim_reason": None}
# the kv_events columns read from every KVEvent (kind aside, which `_kind` reads)
_COMMON_EVENT_FIELDS = [f for f in TABLES["kv_events"].names
                        if f not in ("run_id", "num_blocks", "kind") and f not in _RARE_DEFAULTS]
# an evict row's values but its seq, step, ts_s and blocks (the rest null)
_EVICT_VALUES = {"kind": ev.EVICT, "req_id": "", "sample": 0, "num_tokens": 0, "bytes": 0, "num_cached_tokens": 0,
                 "num_recomputed_tokens": 0}
# a decode window's alloc row's values but its seq, step, ts_s, req_id, sample and blocks (the rest the default)
_WINDOW_ALLOC_VALUES = {"kind": ev.ALLOC, "num_tokens": 0, "reason": ev.AllocReason.DECODE}
# the integer columns whose evict rows hold a number (_EVICT_VALUES)
_INT_EVENT_FIELDS = frozenset(["sample", "num_tokens", "bytes", "num_cached_tokens", "num_recomputed_tokens"])
_evicted = attrgetter("evicted")
_kind = attrgetter("kind")

Column = list | tuple | np.ndarray | pa.Array   # a column as a builder makes it, before `as_arrow`


def steps_table(records: list[StepRecord | DecodeWindow], run_id: str) -> pa.Table:
    """The steps table of StepRecords and DecodeWindows in step order: each window's steps made at
    once (DecodeWindow.step_columns), the records' read field by field, the two merged by step."""
    windows = [item for item in records if type(item) is DecodeWindow]
    if len(windows) < len(records):
        steps = [item for item in records if type(item) is not DecodeWindow] if windows else records
        fields = {name: list(map(attrgetter(name), steps)) for name in _STEP_FIELDS.values()}
        if not windows:
            return _table("steps", {column: fields[name] for column, name in _STEP_FIELDS.items()}, run_id)
    window_fields = DecodeWindow.step_columns(windows)
    if len(windows) == len(records):
        return _table("steps", {column: window_fields[name] for column, name in _STEP_FIELDS.items()}, run_id)
    order = np.argsort(np.concatenate([window_fields["step"], np.array(fields["step"], dtype=np.int64)]),
                       kind="stable")
    columns: dict[str, Column] = {}
    for column, name in _STEP_FIELDS.items():
        ours, theirs = window_fields[name], fields[name]
        if isinstance(ours, np.ndarray) and ours.dtype != object and None not in theirs:
            columns[column] = np.concatenate([ours, np.array(theirs, dtype=ours.dtype)])[order]
        else:   # nullable (device_ms) or strings
            columns[column] = _in_order(order, [(ours, len(ours)), (theirs, len(theirs))])
    return _table("steps", columns, run_id)


def kv_events_table(items: list[KVEvent | DecodeWindow], run_id: str) -> pa.Table:
    """The kv_events table of KVEvents and of decode windows' allocs (DecodeWindow.alloc_columns), in
    seq order: an `evict` row for each block an alloc evicted, right before it, with the seq numbers
    the engine left free for them (engine/events.py, `with_evictions`)."""
    windows = [item for item in items if type(item) is DecodeWindow]
    events = [item for item in items if type(item) is not DecodeWindow] if windows else items
    columns: dict[str, Column] = {column: list(map(attrgetter(column), events)) for column in _COMMON_EVENT_FIELDS}
    kinds = columns["kind"] = list(map(_kind, events))
    evicted = list(map(_evicted, events))
    allocs = None
    if windows:
        allocs = DecodeWindow.alloc_columns(windows)
        evicted += allocs["evicted"]
    evicting = [i for i, blocks in enumerate(evicted) if blocks]
    rows = _merge_event_rows(columns, allocs, evicted, evicting) if allocs or evicting else range(len(events))
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
    blocks = columns["blocks"] = as_arrow(columns["blocks"], TABLES["kv_events"].field("blocks").type)
    columns["num_blocks"] = from_numpy(np.diff(blocks.offsets.to_numpy()), pa.int32())   # a null: 0
    return _table("kv_events", columns, run_id)


def _merge_event_rows(columns: dict[str, Column], allocs: dict | None, evicted: list, evicting: list[int]) -> np.ndarray:
    """The events' columns (KVEvents'), the windows' allocs after them, and an `evict` row for each
    block in `evicted` (of those rows, in their order), merged in seq order, in place: the number
    columns as numpy arrays, blocks as an Arrow array, the strings as lists. Returns each event's row."""
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
            columns[column] = lists_then_singles(pa.array(values, pa.list_(pa.int32())), singles, order)
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


def _in_order(order: np.ndarray, parts: list[tuple[object, int]]) -> list:
    """Parts of a column one after another, each (its values, or one value for all its rows; its
    rows), as a list in `order` (a permutation of the rows): strings and nullable values, put in order
    through a numpy object array."""
    objects = np.empty(len(order), dtype=object)
    at = 0
    for values, num_rows in parts:
        objects[at:at + num_rows] = values
        at += num_rows
    return objects[order].tolist()


def requests_table(stats: list[RequestStats], run_id: str) -> pa.Table:
    """The requests table: one row per finished sequence."""
    return _table("requests", {column: list(map(attrgetter(column), stats)) for column in _REQUEST_FIELDS}, run_id)


def gpu_samples_table(columns: dict[str, list], run_id: str) -> pa.Table:
    """The gpu_samples table of the NVML sampler's rows, buffered as columns (the schema's, run_id aside)."""
    return _table("gpu_samples", columns, run_id)


def _table(name: str, columns: dict[str, Column], run_id: str) -> pa.Table:
    """Table `name` of `columns` (every column of its schema but run_id) and `run_id`."""
    schema = TABLES[name]
    num_rows = len(next(iter(columns.values())))
    arrays = {f.name: as_arrow(columns[f.name], f.type) for f in schema if f.name != "run_id"}
    arrays["run_id"] = pa.repeat(pa.scalar(run_id, pa.string()), num_rows)
    return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)


class RequestNumbers(dict):
    """req_id -> int: each request numbered as it is first looked up (0, 1, ...); `names` the req_ids
    in that order. The tokens are buffered with their request's number (one int a token), and the
    table's req_id column is taken from the names."""

    def __init__(self) -> None:
        super().__init__()
        self.names: list[str] = []

    def __missing__(self, key: str) -> int:
        self[key] = number = len(self.names)
        self.names.append(key)
        return number


@dataclass(slots=True)
class TokenStretches:
    """A chunk's tokens as stretches: runs of steps in which the same sequences each emit one token a
    step, in the same batch order (a step's tokens, one step; or a decode window's). The rows are made
    with the table (`TokensTable`): a stretch's i-th sequence's token at its j-th step has idx
    `idx[i] + j`."""

    num: list[int] = field(default_factory=list)       # each stretch's sequences
    steps: list[int] = field(default_factory=list)     # each stretch's steps
    step: list[int] = field(default_factory=list)      # each stretch's first step
    ts_s: list[float] = field(default_factory=list)    # each step's time, stretch after stretch
    req: list[int] = field(default_factory=list)       # each stretch's sequences' requests (RequestNumbers)
    sample: list[int] = field(default_factory=list)
    idx: list[int] = field(default_factory=list)       # each sequence's token idx at its stretch's first step
    # each sequence's token id, when recorded (empty when not): a one-step stretch's; a window's are None
    token_id: list[int | None] = field(default_factory=list)
    # (req_id, sample) of the sequences finished since the last tokens chunk: no later token follows theirs
    finished: list[tuple[str, int]] = field(default_factory=list)
    num_rows: int = 0                                  # the rows the stretches make


class TokensTable:
    """Makes the tokens table of each chunk's TokenStretches, the chunks in order: a token's
    predecessor (prev_step, prev_ts_s: its sequence's token before it) may be in an earlier chunk,
    so it keeps each live sequence's last token written."""

    def __init__(self, numbers: RequestNumbers, run_id: str) -> None:
        self.numbers = numbers   # (the engine's thread may number more requests while a table is made)
        self.run_id = run_id
        self._names = pa.array([], pa.string())   # numbers.names as Arrow strings, as far as taken
        # (req_id, sample) -> (step, ts_s) of its last token in the chunks made so far
        self._last_token: dict[tuple[str, int], tuple[int, float]] = {}

    def make(self, buffer: TokenStretches) -> pa.Table:
        """The chunk's rows run stretch by stretch, step by step, each step's in its stretch's batch
        order. A token's predecessor is its sequence's token of the step before inside a stretch; at a
        stretch's first step, its sequence's last token before the stretch (`_first_predecessors`)."""
        num = np.array(buffer.num, dtype=np.int64)   # a stretch's sequences
        first_step = np.array(buffer.step, dtype=np.int64)
        ts_s = np.array(buffer.ts_s, dtype=np.float64)   # each step's
        req, sample, idx = (np.array(values, dtype=np.int64) for values in (buffer.req, buffer.sample, buffer.idx))
        stretch_of = np.repeat(np.arange(len(num)), num)   # each sequence's stretch
        if len(ts_s) == len(num):   # every stretch a single step (always so in a real engine's run)
            member = None
            width = num   # each step's tokens
            step_number = first_step
            last_step = stretch_of   # each sequence's last step in its stretch
            first_row = np.arange(len(req))   # each sequence's row at its stretch's first step
        else:
            steps = np.array(buffer.steps, dtype=np.int64)
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
        for key in buffer.finished:
            self._last_token.pop(key, None)
        ids = buffer.token_id
        if ids.count(None) == len(ids):   # none recorded, or the simulator's placeholders
            token_id = pa.nulls(num_rows, pa.int32())
        else:
            none = np.fromiter((i is None for i in ids), dtype=bool, count=len(ids))
            values = np.array([0 if i is None else i for i in ids] if none.any() else ids, dtype=np.int64)
            if member is not None:
                values, none = values[member], none[member]
            token_id = from_numpy(values, pa.int32(), none)
        if member is not None:
            req, sample = req[member], sample[member]
        names = self.numbers.names
        if len(self._names) < len(names):
            self._names = pa.concat_arrays([self._names, pa.array(names[len(self._names):], pa.string())])
        columns = {"req_id": take_strings(self._names, req), "sample": from_numpy(sample, pa.int32()),
                   "idx": from_numpy(idx, pa.int32()), "token_id": token_id, "step": from_numpy(step, pa.int64()),
                   "ts_s": from_numpy(np.repeat(ts_s, width), pa.float64()),
                   "prev_step": from_numpy(prev_step, pa.int64(), missing),
                   "prev_ts_s": from_numpy(prev_ts_s, pa.float64(), missing)}
        return _table("tokens", columns, self.run_id)

    def _first_predecessors(self, reqs: np.ndarray, samples: np.ndarray, last_steps: np.ndarray,
                            last_times: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The predecessor (step, ts_s, missing) of each stretch's sequence's first token in a chunk,
        given each one's last token's step and ts_s: its sequence's last token in the stretch before,
        or in an earlier chunk (`_last_token`, which this updates), or none (a first token). A stable
        sort by sequence puts each right after the stretch before it (a sequence is in a step at most
        once, steps in order); only a sequence's first and last stretch in the chunk is looked at
        on its own."""
        num = len(reqs)
        names = self.numbers.names
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
