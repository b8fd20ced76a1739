"""Turn a vLLM capture folder (kvtrace/vllm/capture) into a kvtrace run folder.

The capture wrote pickled column chunks with vLLM's request ids and raw monotonic times; this maps
each id back to the workload's (`kvt<index>`, with vLLM's random suffix, `<k>_` for the k-th of
n samples and `cmpl-…-<i>` from the OpenAI server), rebases every time on the replay's origin, fills
what only the workload knows (n, the request of an interrupted run that never finished) and writes
the tables with kvtrace's schemas.
"""
from __future__ import annotations

import json
import pickle
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.errors import KvtraceError
from kvtrace.trace.schema import TABLES, token_predecessors
from kvtrace.vllm.capture.sink import COLUMNS

_ID = re.compile(r"^(?:(?P<sample>\d+)_)?(?:cmpl-)?kvt(?P<index>\d+)(?:-(?P<prompt>\d+))?(?:-[0-9A-Za-z]+)?$")
TIME_COLUMNS = {"requests": ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s"),
                "steps": ("start_s", "end_s"), "kv_events": ("ts_s",), "tokens": ("ts_s",)}


@dataclass
class Item:
    """What the importer needs of one workload request."""

    index: int
    req_id: str
    n: int
    priority: int
    arrival_s: float
    prompt_tokens: int
    max_tokens: int
    output_tokens: int | None


def read_chunks(capture: Path) -> dict[str, dict[str, list]]:
    columns = {table: {c: [] for c in cols} for table, cols in COLUMNS.items()}
    files = sorted((capture / "chunks").glob("*.pkl"),
                   key=lambda p: tuple(int(x) for x in p.stem.split("-")))
    for path in files:
        try:
            chunk = pickle.loads(path.read_bytes())
        except Exception as exc:   # a chunk is renamed into place whole; anything else is not ours
            raise KvtraceError(f"{path}: not a readable capture chunk ({exc})") from exc
        for table, cols in chunk.items():
            num_rows = len(next(iter(cols.values()), []))
            for name, values in columns[table].items():
                # a chunk of an older capture lacks the newer columns (schema 3's causes): null
                values.extend(cols.get(name, [None] * num_rows))
    return columns


def map_ids(raw_ids: Sequence[str], items: dict[int, Item]) -> dict[str, tuple[str, int]]:
    """vLLM's request id -> (workload id, sample); an id of no workload request is kept as it is."""
    mapping = {}
    for raw in set(raw_ids):
        if not raw:
            continue
        m = _ID.match(raw)
        item = items.get(int(m["index"])) if m else None
        mapping[raw] = (item.req_id, int(m["sample"] or 0)) if item is not None else (raw, 0)
    return mapping


WINDOW_COLUMNS = {"requests": "finish_s", "steps": "start_s", "kv_events": "ts_s", "tokens": "ts_s"}


def keep_window(columns: dict[str, dict[str, list]], lo: float, hi: float) -> None:
    """Only what happened between lo and hi (a server's capture folder holds every run it served)."""
    for table, name in WINDOW_COLUMNS.items():
        cols = columns[table]
        keep = [i for i, t in enumerate(cols[name]) if t is not None and lo <= t <= hi]
        if len(keep) != len(cols[name]):
            for key, values in cols.items():
                cols[key] = [values[i] for i in keep]


def convert(capture: Path, run_dir: Path, run_id: str, items: list[Item], origin: float,
            *, interrupted: bool, record_token_ids: bool = True,
            window: tuple[float, float] | None = None) -> dict[str, int]:
    """Write the run's tables from the capture; return the rows per table."""
    columns = read_chunks(capture)
    if window is not None:
        keep_window(columns, *window)
    by_index = {item.index: item for item in items}
    raw = [*columns["requests"]["req_id"], *columns["kv_events"]["req_id"], *columns["tokens"]["req_id"],
           *(r for r in columns["kv_events"]["requester_req_id"] if r)]
    ids = map_ids(raw, by_index)
    for table in ("requests", "kv_events", "tokens"):
        cols = columns[table]
        mapped = [ids.get(r, (r, 0)) for r in cols["req_id"]]
        cols["req_id"] = [m[0] for m in mapped]
        cols["sample"] = [m[1] for m in mapped]
    k = columns["kv_events"]   # a preemption's requester, in the workload's ids too
    requesters = [ids.get(r, (r, 0)) if r else (None, None) for r in k["requester_req_id"]]
    k["requester_req_id"] = [m[0] for m in requesters]
    k["requester_sample"] = [m[1] for m in requesters]
    for table, names in TIME_COLUMNS.items():
        for name in names:
            columns[table][name] = [None if t is None else t - origin for t in columns[table][name]]
    if not record_token_ids:
        columns["tokens"]["token_id"] = [None] * len(columns["tokens"]["token_id"])
    _fill_requests(columns, items, interrupted)
    t = columns["tokens"]   # each token's predecessor in its sequence (schema 2), on the run's clock
    t["prev_step"], t["prev_ts_s"] = token_predecessors(t["req_id"], t["sample"], t["idx"], t["step"], t["ts_s"])
    return write_tables(columns, run_dir, run_id)


def write_tables(columns: dict[str, dict[str, list]], run_dir: Path, run_id: str) -> dict[str, int]:
    """Write the trace tables (every column of their schemas, tokens' predecessors included) into
    `run_dir`, one Parquet chunk each; return the rows per table."""
    rows = {}
    for table, cols in columns.items():
        schema = TABLES[table]
        num = len(next(iter(cols.values())))
        arrays = [pa.array([run_id] * num, pa.string()) if f.name == "run_id" else pa.array(cols[f.name], f.type)
                  for f in schema]
        folder = run_dir / table
        folder.mkdir(parents=True, exist_ok=True)
        if num:
            tmp = folder / ".part-00000.parquet.tmp"
            pq.write_table(pa.Table.from_arrays(arrays, schema=schema), tmp, compression="zstd")
            tmp.replace(folder / "part-00000.parquet")
        rows[table] = num
    return rows


def _fill_requests(columns: dict[str, dict[str, list]], items: list[Item], interrupted: bool) -> None:
    """n and priority from the workload; `stop` where vLLM stopped at the recorded output length; and,
    for an interrupted run, an `aborted` row for every sample that never finished."""
    q = columns["requests"]
    by_id = {item.req_id: item for item in items}
    for i, rid in enumerate(q["req_id"]):
        item = by_id.get(rid)
        if item is None:
            continue
        q["n"][i] = item.n
        q["max_tokens"][i] = item.max_tokens
        if (q["finish_reason"][i] == "length" and item.output_tokens is not None
                and q["output_tokens"][i] == item.output_tokens and item.output_tokens < item.max_tokens):
            q["finish_reason"][i] = "stop"
    if not interrupted:
        return
    done = set(zip(q["req_id"], q["sample"]))
    t = columns["tokens"]
    first_token: dict[tuple[str, int], float] = {}
    count: dict[tuple[str, int], int] = {}
    for rid, sample, ts in zip(t["req_id"], t["sample"], t["ts_s"]):
        key = (rid, sample)
        first_token.setdefault(key, ts)
        count[key] = count.get(key, 0) + 1
    end = max([*columns["steps"]["end_s"], 0.0])
    for item in items:
        for sample in range(item.n):
            key = (item.req_id, sample)
            if key in done:
                continue
            row = {"req_id": item.req_id, "sample": sample, "n": item.n, "priority": item.priority,
                   "arrival_s": item.arrival_s, "prompt_tokens": item.prompt_tokens, "max_tokens": item.max_tokens,
                   "output_tokens": count.get(key, 0), "first_scheduled_s": None,
                   "first_token_s": first_token.get(key), "finish_s": end, "finish_reason": "aborted",
                   "preemptions": 0, "swaps": 0, "recomputed_tokens": 0, "prefix_hit_tokens": 0}
            for name, value in row.items():
                q[name].append(value)


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
