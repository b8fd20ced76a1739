"""Turn a vLLM capture folder (kvtrace/vllm/capture) into a kvtrace run folder.

The capture wrote column chunks (kvtrace/vllm/capture/chunk_format.py: typed columns, no code) with vLLM's request ids and raw monotonic times; this maps
each id back to the workload's (`kvt<index>`, with vLLM's random suffix, `<k>_` for the k-th of
n samples and `cmpl-…-<i>` from the OpenAI server), rebases every time on the replay's origin, fills
what only the workload knows (n, the request of an interrupted run that never finished) and writes
the tables with kvtrace's schemas.
"""
from __future__ import annotations

import json
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from itertools import chain, repeat
from operator import add
from pathlib import Path

import pyarrow as pa

from kvtrace.trace.schema import OPTIONAL_TABLES, SERVER_FIELD, TABLES, token_predecessors, write_parquet
from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.sink import ARRIVALS, CHUNK_COLUMNS, COLUMNS

_ID = re.compile(r"^(?:(?P<sample>\d+)_)?(?:cmpl-)?kvt(?P<index>\d+)(?:-(?P<prompt>\d+))?(?:-[0-9A-Za-z]+)?$")
# the tables a chunk's reader hands on (read_chunk has expanded the tokens' runs)
READ_COLUMNS = {**COLUMNS, "arrivals": ARRIVALS}
TIME_COLUMNS = {"requests": ("arrival_s", "first_scheduled_s", "first_token_s", "finish_s"),
                "steps": ("start_s", "end_s"), "kv_events": ("ts_s",), "tokens": ("ts_s",), "spec_decode": ("ts_s",)}


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


@dataclass(frozen=True)
class Chunk:
    """One chunk file: its server, its number and, from its name, the wall-clock span of its steps
    (Unix seconds) and the requests that arrived in it."""

    path: Path
    server_id: str
    part: int
    first: float | None = None
    last: float | None = None
    num_arrivals: int | None = None
    size: int = 0


def list_chunks(capture: Path) -> list[Chunk]:
    """Every chunk of the folder, each server's in order, servers in the order of their ids (their
    start times): `chunks/<server id>_<part>_<first>_<last>_<arrivals>.kvtc` (kvtrace/vllm/capture/sink.py)."""
    found = []
    for path in (capture / "chunks").glob(f"*{chunk_format.SUFFIX}"):
        fields = path.stem.split("_")
        if path.name.startswith(".") or len(fields) != 5:
            continue
        try:
            found.append(Chunk(path, fields[0], int(fields[1]), float(fields[2]), float(fields[3]),
                               int(fields[4]), _size(path)))
        except ValueError:
            continue   # not a chunk's name: foreign_files says so
    return sorted(found, key=lambda c: (c.server_id, c.part))


def foreign_files(capture: Path) -> list[tuple[Path, str]]:
    """The files of the folder's chunks/ that are no chunk kvtrace reads, each with why (a hidden file is
    a chunk being written, and no one's business)."""
    listed = {c.path.name for c in list_chunks(capture)}
    found = []
    for path in sorted((capture / "chunks").glob("*")):
        if path.name.startswith(".") or path.name in listed:
            continue
        if path.suffix == ".pkl":
            found.append((path, "a pickled chunk (an older kvtrace's capture, or planted): not read, since "
                                "loading a pickle can run code"))
        else:
            found.append((path, "not a capture chunk's name (<server>_<part>_<first>_<last>_<arrivals>.kvtc)"))
    return found


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def skipped_line(path: Path, reason: str) -> str:
    """The one line a reader says of a file it skips."""
    return f"kvtrace: skipped {path}: {reason}"


def say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def read_chunk(path: Path) -> dict[str, dict[str, list]]:
    """One chunk's tables. FileNotFoundError if retention removed it; chunk_format.ChunkError if it is
    no chunk this kvtrace reads (another OSError as reading gives it)."""
    tables = chunk_format.decode(path.read_bytes())
    for table, cols in tables.items():
        if table not in CHUNK_COLUMNS:
            raise chunk_format.ChunkError(f"a table {table!r}, which no capture writes")
        if len({len(v) for v in cols.values()}) > 1:
            raise chunk_format.ChunkError(f"{table}: columns of different lengths")
    if "tokens" in tables:
        expand_token_runs(tables["tokens"])
    return tables


def expand_token_runs(t: dict[str, list]) -> None:
    """A chunk's tokens rows as one row per token: a row of format 2 stands for `num_tokens` of a
    request's tokens from `idx` on (a speculative step's; sink.py's CHUNK_COLUMNS), a row of format 1
    (no such column) or a null for one. The column goes: no reader past this one sees it."""
    counts = t.pop("num_tokens", None)
    if counts is None or all(c == 1 or c is None for c in counts):
        return
    if not all(c is None or (type(c) is int and c >= 1) for c in counts):
        raise chunk_format.ChunkError("tokens: a num_tokens that is not a positive count")
    counts = [1 if c is None else c for c in counts]
    for name, values in t.items():
        if name == "idx":
            t[name] = list(chain.from_iterable(map(range, values, map(add, values, counts))))
        else:
            t[name] = list(chain.from_iterable(map(repeat, values, counts)))


def read_chunks(capture: Path, chunks: list[Chunk] | None = None, warn=say) -> dict[str, dict[str, list]]:
    """The columns of `chunks` (default: every chunk of the folder), `arrivals` among them. A file that
    is no chunk kvtrace reads (a pickle, a truncated or foreign file, a newer format) is skipped, with
    one line each to `warn`; the others are read."""
    columns = {table: {c: [] for c in cols} for table, cols in READ_COLUMNS.items()}
    if (capture / "chunks").is_dir():
        for path, reason in foreign_files(capture):
            warn(skipped_line(path, reason))
    totals = DraftTotals()
    for c in (list_chunks(capture) if chunks is None else chunks):
        try:
            chunk = read_chunk(c.path)
        except FileNotFoundError:
            continue   # retention removed it since it was listed: a running server's oldest
        except (chunk_format.ChunkError, OSError) as exc:
            warn(skipped_line(c.path, str(exc)))
            continue
        totals.add(chunk)
        for table, cols in chunk.items():
            num_rows = len(next(iter(cols.values()), []))
            for name, values in columns[table].items():
                values.extend(cols.get(name, [None] * num_rows))
    return columns


class DraftTotals:
    """Each request's draft positions and accepted drafts over its life, for its requests row: the
    capture writes that row without them (keeping them per request would cost the server a pass over
    its requests' states every step) and a reader adds up the spec_decode rows, chunk by chunk in the
    order they were written, into the rows of the requests that finish. A step's drafts whose output
    was never processed (accepted null) count in no total, as in vLLM's own counts. A chunk of an older
    capture has its totals already, or none at all (no such column): those stay as they are."""

    def __init__(self) -> None:
        self.drafts: dict[str, int] = {}     # per request still in flight: its totals so far
        self.accepted: dict[str, int] = {}

    def add(self, chunk: dict[str, dict[str, list]]) -> None:
        """Take a chunk's spec_decode rows; fill in its finished requests' totals (a request's last spec
        rows are written before, or with, its row)."""
        d = chunk.get("spec_decode")
        if d:
            drafts, accepted = self.drafts, self.accepted
            for rid, n, a in zip(d["req_id"], d["draft_tokens"], d["accepted_tokens"]):
                if a is not None:
                    drafts[rid] = drafts.get(rid, 0) + n
                    accepted[rid] = accepted.get(rid, 0) + a
        q = chunk.get("requests")
        if q and "draft_tokens" in q and "accepted_tokens" in q:
            for i, rid in enumerate(q["req_id"]):
                if q["draft_tokens"][i] is None:
                    q["draft_tokens"][i] = self.drafts.pop(rid, 0)
                    q["accepted_tokens"][i] = self.accepted.pop(rid, 0)


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


WINDOW_COLUMNS = {"requests": "finish_s", "steps": "start_s", "kv_events": "ts_s", "tokens": "ts_s",
                  "spec_decode": "ts_s"}


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
    for table in ("requests", "kv_events", "tokens", "spec_decode"):
        cols = columns[table]
        mapped = [ids.get(r, (r, 0)) for r in cols["req_id"]]
        cols["req_id"] = [m[0] for m in mapped]
        cols["sample"] = [m[1] for m in mapped]
    k = columns["kv_events"]   # a preemption's requester, in the workload's ids too
    requesters = [ids.get(r, (r, 0)) if r else (None, None) for r in k["requester_req_id"]]
    k["requester_req_id"] = [m[0] for m in requesters]
    k["requester_sample"] = [m[1] for m in requesters]
    rebase(columns, origin)
    if not record_token_ids:
        columns["tokens"]["token_id"] = [None] * len(columns["tokens"]["token_id"])
    _fill_requests(columns, items, interrupted)
    return write_tables(columns, run_dir, run_id)


def rebase(columns: dict[str, dict[str, list]], origin: float) -> None:
    """Every time of the trace's tables on the run's clock: seconds since `origin` (monotonic)."""
    for table, names in TIME_COLUMNS.items():
        for name in names:
            columns[table][name] = [None if t is None else t - origin for t in columns[table][name]]


def write_tables(columns: dict[str, dict[str, list]], run_dir: Path, run_id: str, *,
                 predecessors: bool = True) -> dict[str, int]:
    """The trace's tables of a run from the capture's columns (on the run's clock); the rows per table.
    Columns that hold `server` write it (a run joined from several servers). With `predecessors` False the tokens' prev_step / prev_ts_s are the caller's (a window that keeps
    each sequence's token before it, kvtrace/vllm/follow.py). A column of the schema the capture does not
    write (schema 6's KV tiers', until it captures a connector's) is null."""
    t = columns["tokens"]   # each token's predecessor in its sequence (schema 2), on the run's clock
    if predecessors:
        t["prev_step"], t["prev_ts_s"] = token_predecessors(t["req_id"], t["sample"], t["idx"], t["step"],
                                                            t["ts_s"])
    rows = {}
    for table in COLUMNS:
        cols = columns[table]
        schema = TABLES[table] if table in TABLES else OPTIONAL_TABLES[table]   # spec_decode: optional
        if SERVER_FIELD.name in cols:   # a run of several servers (kvtrace/vllm/fleet.py)
            schema = schema.append(SERVER_FIELD)
        num = len(next(iter(cols.values())))
        arrays = [pa.array([run_id] * num, pa.string()) if f.name == "run_id"
                  else pa.array(cols[f.name], f.type) if f.name in cols else pa.nulls(num, f.type)
                  for f in schema]
        folder = run_dir / table
        folder.mkdir(parents=True, exist_ok=True)
        if num:
            tmp = folder / ".part-00000.parquet.tmp"
            write_parquet(pa.Table.from_arrays(arrays, schema=schema), tmp)
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
            for name, values in q.items():   # what the capture never knew of it (its drafts) is null
                values.append(row.get(name))


def model_shape(identity: dict) -> tuple[dict, dict]:
    """What a capture's identity (capture.json) says of its model's KV cache and drafting, for a run's
    meta.json (schema 5): kv_pool's `kv_cache_groups` (null from a capture before them: one group of full
    attention), and engine_config's speculative decoding settings (0: none)."""
    return ({"kv_cache_groups": identity.get("kv_cache_groups")},
            {"num_speculative_tokens": identity.get("num_spec_tokens", 0),
             "num_lookahead_tokens": identity.get("num_lookahead_tokens", 0),
             "speculative_method": identity.get("spec_method") if identity.get("num_spec_tokens") else None})


def kv_tiers(identity: dict) -> list[dict]:
    """meta.json's kv_tiers (schema 6) from a capture's identity (capture.json): the KV connector's tier as
    the capture names it, [] without a connector (or from a capture before it said)."""
    return identity.get("kv_tiers") or []


def read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None
