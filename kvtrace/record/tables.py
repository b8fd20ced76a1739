"""The trace's tables made from what the trace writer buffers (recorder.py): one builder per table,
each turning one chunk's buffer into an Arrow table of the table's schema (kvtrace/trace/schema.py),
the tokens' in tokens_table.py.

What each table is buffered as, between two chunks:
- steps: the engine's StepRecords and DecodeLeaps, in step order (`steps_table`);
- kv_events: its KVEvents and the DecodeLeaps that allocated blocks, in seq order (`kv_events_table`);
- requests: its RequestStats (`requests_table`);
- tokens: grids of steps in which the same sequences each emit a token (tokens_table.py);
- gpu_samples: the NVML sampler's rows as columns (`gpu_samples_table`).

The records are kept as the engine handed them over (one append per step) and read field by field
once per chunk; where a column is made for many rows at once it is made with numpy, and arrays that
Arrow's compute functions would make are made from their buffers (arrays.py says why).
"""
from __future__ import annotations

from itertools import chain
from operator import attrgetter

import numpy as np
import pyarrow as pa

from engine import events as ev
from engine.events import KVEvent, RequestStats, StepRecord
from engine.sim.leap import DecodeLeap
from kvtrace.record.arrays import as_arrow, from_numpy, lists_then_singles
from kvtrace.trace.schema import DRAFT_ONLY, OPTIONAL_TABLES, TABLES, TIER_ONLY

# each steps column: the StepRecord (and DecodeLeap.step_columns) field it is read from
_STEP_FIELDS = {
    "step": "step", "start_s": "start_s", "end_s": "end_s", "device_ms": "device_ms", "running": "num_running",
    "waiting": "num_waiting", "swapped": "num_swapped", "prefill_tokens": "num_prefill_tokens",
    "decode_tokens": "num_decode_tokens", "recompute_tokens": "num_recompute_tokens",
    "preemptions": "num_preemptions", "free_blocks": "num_free_blocks", "used_blocks": "num_used_blocks",
    "cached_blocks": "num_cached_blocks", "total_blocks": "num_total_blocks", "kv_tokens": "num_kv_tokens",
    "admission_stop": "admission_stop",
}
_REQUEST_FIELDS = [f for f in TABLES["requests"].names
                   if f != "run_id" and f not in DRAFT_ONLY["requests"] and f not in TIER_ONLY["requests"]]
# speculative decoding's columns (a run that drafts; null in one that does not): steps' and requests'
_STEP_DRAFT_FIELDS = {"draft_tokens": "num_draft_tokens", "accepted_tokens": "num_accepted_tokens"}
_REQUEST_DRAFT_FIELDS = ("draft_tokens", "accepted_tokens")
# the KV tiers' columns (a run with a tier; null in one without), of the same names in the records
_STEP_TIER_FIELDS = TIER_ONLY["steps"]
_REQUEST_TIER_FIELDS = TIER_ONLY["requests"]
# The kv_events columns that only the rarer kinds set (preempt, swap_out, swap_in, reprefill, cow, and
# the KV tiers' offload, load, tier_evict, lookup), with the value every other event leaves
# (engine/events.py): they are read from the rarer events alone, and the rest of the rows take the default.
_PLAIN_KINDS = frozenset([ev.ALLOC, ev.FREE, ev.FINISH, ev.ADMIT, ev.PREFIX_HIT])
_RARE_DEFAULTS = {"bytes": 0, "duration_ms": None, "num_cached_tokens": 0, "num_recomputed_tokens": 0,
                  "src_blocks": None, "requester_req_id": None, "requester_sample": None, "victim_reason": None,
                  "tier": None, "tier_tokens": None}
# the KV-cache group columns, read only in a run of several groups
KV_GROUP_FIELDS = ("kv_group", "kv_group_blocks")
# the kv_events columns read from every KVEvent (kind aside, which `_kind` reads)
_COMMON_EVENT_FIELDS = [f for f in TABLES["kv_events"].names
                        if f not in ("run_id", "num_blocks", "kind") and f not in _RARE_DEFAULTS
                        and f not in KV_GROUP_FIELDS]
# an evict row's values but its seq, step, ts_s and blocks (the rest null)
_EVICT_VALUES = {"kind": ev.EVICT, "req_id": "", "sample": 0, "num_tokens": 0, "bytes": 0, "num_cached_tokens": 0,
                 "num_recomputed_tokens": 0}
# a leap's alloc row's values but its seq, step, ts_s, req_id, sample and blocks (the rest the default)
_LEAP_ALLOC_VALUES = {"kind": ev.ALLOC, "num_tokens": 0, "reason": ev.AllocReason.DECODE}
# the integer columns whose evict rows hold a number (_EVICT_VALUES)
_INT_EVENT_FIELDS = frozenset(["sample", "num_tokens", "bytes", "num_cached_tokens", "num_recomputed_tokens"])
_evicted = attrgetter("evicted")
_kind = attrgetter("kind")

Column = list | tuple | np.ndarray | pa.Array   # a column as a builder makes it, before `as_arrow`


def steps_table(records: list[StepRecord | DecodeLeap], run_id: str) -> pa.Table:
    """The steps table of StepRecords and DecodeLeaps in step order: each leap's steps made at
    once (DecodeLeap.step_columns), the records' read field by field, the two merged by step."""
    leaps = [item for item in records if type(item) is DecodeLeap]
    if len(leaps) < len(records):
        steps = [item for item in records if type(item) is not DecodeLeap] if leaps else records
        fields = {name: list(map(attrgetter(name), steps)) for name in _STEP_FIELDS.values()}
        if not leaps:
            columns = {column: fields[name] for column, name in _STEP_FIELDS.items()}
            if steps[0].num_draft_tokens is not None:   # a run that drafts (the fast path's leaps never do)
                columns.update({column: list(map(attrgetter(name), steps)) for column, name in _STEP_DRAFT_FIELDS.items()})
            if steps[0].offload_bytes is not None:   # a run with a KV tier
                columns.update({column: list(map(attrgetter(column), steps)) for column in _STEP_TIER_FIELDS})
            return table("steps", columns, run_id)
    leap_fields = DecodeLeap.step_columns(leaps)
    if len(leaps) == len(records):
        columns = {column: leap_fields[name] for column, name in _STEP_FIELDS.items()}
        if leaps[0].tier:   # a run with a KV tier: the copies finished in the leaps' steps
            columns.update({column: leap_fields[column] for column in _STEP_TIER_FIELDS})
        return table("steps", columns, run_id)
    order = np.argsort(np.concatenate([leap_fields["step"], np.array(fields["step"], dtype=np.int64)]),
                       kind="stable")
    columns: dict[str, Column] = {}
    for column, name in _STEP_FIELDS.items():
        ours, theirs = leap_fields[name], fields[name]
        if isinstance(ours, np.ndarray) and ours.dtype != object and None not in theirs:
            columns[column] = np.concatenate([ours, np.array(theirs, dtype=ours.dtype)])[order]
        else:   # nullable (device_ms) or strings
            columns[column] = _in_order(order, [(ours, len(ours)), (theirs, len(theirs))])
    if steps[0].offload_bytes is not None:   # a run with a KV tier: the copies finished in the leaps' steps (a
        num_leap_steps = len(leap_fields["step"])   # leap that does not know of the tier: null)
        for column in _STEP_TIER_FIELDS:
            values = list(map(attrgetter(column), steps))
            ours = leap_fields[column] if leaps[0].tier else None
            if ours is not None and None not in values:   # (else a step whose copies' time is not known: null)
                columns[column] = np.concatenate([ours, np.array(values, dtype=ours.dtype)])[order]
            else:
                columns[column] = _in_order(order, [(ours, num_leap_steps), (values, len(steps))])
    return table("steps", columns, run_id)


def kv_events_table(items: list[KVEvent | DecodeLeap], run_id: str, kv_cache_groups: bool = False) -> pa.Table:
    """The kv_events table of KVEvents and of leaps' allocs (DecodeLeap.alloc_columns), in
    seq order: an `evict` row for each block an alloc evicted, right before it, with the seq numbers
    the engine left free for them (engine/events.py, `with_evictions`). `kv_cache_groups`: a run of
    several KV-cache groups, whose events' groups are read (else null, as in every older trace)."""
    leaps = [item for item in items if type(item) is DecodeLeap]
    events = [item for item in items if type(item) is not DecodeLeap] if leaps else items
    columns: dict[str, Column] = {column: list(map(attrgetter(column), events)) for column in _COMMON_EVENT_FIELDS}
    kinds = columns["kind"] = list(map(_kind, events))
    evicted = list(map(_evicted, events))
    allocs = None
    if leaps:
        allocs = DecodeLeap.alloc_columns(leaps)
        evicted += allocs["evicted"]
    evicting = [i for i, blocks in enumerate(evicted) if blocks]
    rows = _merge_event_rows(columns, allocs, evicted, evicting) if allocs or evicting else range(len(events))
    num_rows = len(columns["seq"])
    rare = [i for i, kind in enumerate(kinds) if kind not in _PLAIN_KINDS]
    rare_events = [events[i] for i in rare]
    rare_rows = (rows if isinstance(rows, np.ndarray) else np.arange(len(events)))[rare]
    for column, default in _RARE_DEFAULTS.items():   # (an alloc's or evict row's value is the default too)
        values = list(map(attrgetter(column), rare_events))
        num_set = len(values) - values.count(default)
        field_type = TABLES["kv_events"].field(column).type
        if default is not None:   # a count: the default but where set
            counts = columns[column] = np.full(num_rows, default, dtype=np.int64)
            if num_set:
                counts[rare_rows] = values
        elif not num_set:
            columns[column] = pa.nulls(num_rows, field_type)
        elif pa.types.is_integer(field_type) or pa.types.is_floating(field_type):   # a number: null but where set
            objects = np.array(values, dtype=object)
            is_set = objects != None   # noqa: E711 (numpy's comparison, value by value)
            at = rare_rows[is_set]
            numbers = np.zeros(num_rows, dtype=field_type.to_pandas_dtype())
            numbers[at] = objects[is_set]
            missing = np.ones(num_rows, dtype=bool)
            missing[at] = False
            columns[column] = from_numpy(numbers, field_type, missing)
        elif pa.types.is_string(field_type):   # a string: null but where set, taken from its few names by code
            names = sorted(set(values) - {None})
            code = {name: i for i, name in enumerate(names)} | {None: len(names)}
            codes = np.full(num_rows, len(names), dtype=np.int32)
            codes[rare_rows] = [code[value] for value in values]
            columns[column] = pa.array([*names, None], pa.string()).take(codes)
        else:   # a list
            lists = columns[column] = [None] * num_rows
            for row, value in zip(rare_rows.tolist(), values):
                if value is not None:
                    lists[row] = value
    blocks = columns["blocks"] = as_arrow(columns["blocks"], TABLES["kv_events"].field("blocks").type)
    num_blocks = np.diff(blocks.offsets.to_numpy())   # a null: 0
    tier_blocks = np.array(list(map(attrgetter("num_tier_blocks"), rare_events)), dtype=object)
    counted = tier_blocks != None   # noqa: E711 (a tier_evict's blocks are the tier's, counted, with no device id)
    num_blocks[rare_rows[counted]] = tier_blocks[counted].astype(np.int64)
    columns["num_blocks"] = from_numpy(num_blocks, pa.int32())
    for column in KV_GROUP_FIELDS:
        if kv_cache_groups:   # an evict row's or a leap's alloc's: null
            values = [None] * num_rows
            for i, event in enumerate(events):
                values[rows[i]] = getattr(event, column)
            columns[column] = values
        else:
            columns[column] = pa.nulls(num_rows, TABLES["kv_events"].field(column).type)
    return table("kv_events", columns, run_id)


def _merge_event_rows(columns: dict[str, Column], allocs: dict | None, evicted: list, evicting: list[int]) -> np.ndarray:
    """The events' columns (KVEvents'), the leaps' allocs after them, and an `evict` row for each
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
        of_allocs = (allocs[column] if column in allocs else _LEAP_ALLOC_VALUES.get(column)) if allocs else ()
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
    fields = _REQUEST_FIELDS + list(_REQUEST_DRAFT_FIELDS) if stats[0].draft_tokens is not None else _REQUEST_FIELDS
    if stats[0].tier_hit_tokens is not None:   # a run with a KV tier
        fields = fields + list(_REQUEST_TIER_FIELDS)
    return table("requests", {column: list(map(attrgetter(column), stats)) for column in fields}, run_id)


def spec_decode_table(records: list[StepRecord], run_id: str) -> pa.Table:
    """The spec_decode table of a run that drafts: a row per sequence and step that verified drafts."""
    rows = [(r.step, r.end_s, *d) for r in records for d in r.drafts]
    columns = dict(zip(("step", "ts_s", "req_id", "sample", "draft_tokens", "accepted_tokens", "lookahead_slots"),
                       map(list, zip(*rows))))
    schema = OPTIONAL_TABLES["spec_decode"]
    return pa.Table.from_pydict({"run_id": [run_id] * len(rows), **columns}, schema=schema)


def gpu_samples_table(columns: dict[str, list], run_id: str) -> pa.Table:
    """The gpu_samples table of the NVML sampler's rows, buffered as columns (the schema's, run_id aside)."""
    return table("gpu_samples", columns, run_id)


def table(name: str, columns: dict[str, Column], run_id: str) -> pa.Table:
    """Table `name` of `columns` (every column of its schema but run_id, as a builder made it; those only a
    run that drafts or has a KV tier fills, schema.DRAFT_ONLY and TIER_ONLY, null where `columns` lacks
    them) and `run_id`."""
    schema = TABLES[name]
    num_rows = len(next(iter(columns.values())))
    unfilled = [c for c in (*DRAFT_ONLY.get(name, ()), *TIER_ONLY.get(name, ())) if c not in columns]
    arrays = {f.name: pa.nulls(num_rows, f.type) if f.name in unfilled else as_arrow(columns[f.name], f.type)
              for f in schema if f.name != "run_id"}
    arrays["run_id"] = pa.repeat(pa.scalar(run_id, pa.string()), num_rows)
    return pa.Table.from_arrays([arrays[f.name] for f in schema], schema=schema)
