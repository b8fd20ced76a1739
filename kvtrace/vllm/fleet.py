"""A window of live traffic as a run (`kvtrace capture run`): of one server, or of several joined into one
run (the data-parallel ranks of a `vllm serve`, a fleet's hosts, one capture folder each; docs/vllm.md).

A window's run holds every request whose life overlaps it. Requests that arrived before the window
are marked `in_flight_at_start` in the run's `capture_requests` table; the run's clock starts at the
earliest of the window's start and those arrivals (times stay non-negative, as Perfetto's must be;
meta.json's capture.window.start_s is the window's start on it). A request not finished by the window's
end gets `finish_reason` 'in-flight', `finish_s` the window's end and the counts of what the window
saw of it, and is marked `in_flight_at_end`.

A run of several servers puts each server's rows on the first one's clock (each server's chunks carry
its own monotonic seconds, and its identity their offset from the wall clock), cuts each server's
window alone, and tells the servers apart: every row carries its server's label in the `server`
column (schema 4: `labels()`), request ids become `<label>/<vLLM's id>` (two servers' ids may be the
same), a step is (server, step), and the KV events are renumbered in time order, each server's kept in
its own order. A run of one server is written as before: no label, no server column (it reads as '').
"""
from __future__ import annotations

import heapq
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

import kvtrace
from kvtrace.atomic import write_json_atomic
from kvtrace.errors import KvtraceError
from kvtrace.trace.schema import (
    OPTIONAL_TABLES,
    SCHEMA_VERSION,
    SERVER_FIELD,
    SERVER_TABLES,
    write_parquet,
)
from kvtrace.vllm.importer import TIME_COLUMNS, kv_tiers, model_shape, read_chunks, rebase, write_tables
from kvtrace.vllm.live import (
    LOOK_AROUND_S,
    Server,
    describe,
    fleet,
    rank_text,
    utc_text,
)

# the identity's fields that the servers of one run must share: one model, one block size
SHARED = ("model", "block_size")
NAME_PRECISION_S = 0.001   # a chunk's name gives the span of its steps to the millisecond
NOTHING_CAPTURED = "no server captured anything in that window (kvtrace capture ls shows what the folder holds)"


def select(found: list[Server], server_ids: list[str], ranks: list[int]) -> list[Server]:
    """The servers named by `--server` (an id of `capture ls`, or a unique start of one) and `--rank` (every
    server of that data-parallel rank), in the fleet's order; none named: all of them."""
    chosen: list[Server] = []
    for server_id in server_ids:
        matches = ([s for s in found if s.server_id == server_id]
                   or [s for s in found if s.server_id.startswith(server_id)])
        if len(matches) != 1:
            raise KvtraceError(f"--server {server_id}: {'no' if not matches else 'more than one'} server of that id "
                               f"(kvtrace capture ls lists them: {', '.join(s.server_id for s in found)})")
        chosen += matches
    for rank in ranks:
        matches = [s for s in found if s.rank == rank]
        if not matches:
            known = sorted({s.rank for s in found if s.rank is not None})
            raise KvtraceError(f"--rank {rank}: no server of that data-parallel rank (the folder's: "
                               f"{', '.join(map(str, known)) or 'none recorded'})")
        chosen += matches
    if not server_ids and not ranks:
        return list(found)
    return [s for s in found if s in chosen]


def window(servers: list[Server], since: float | None, until: float | None, last: float | None) -> tuple[float, float]:
    """The window in wall-clock seconds: --since/--until, or --last D ending at --until or the newest data
    of `servers`; by default everything they kept."""
    if last is not None and since is not None:
        raise KvtraceError("give --since or --last, not both")
    kept = [s for s in servers if s.first is not None]
    if not kept:
        raise KvtraceError(NOTHING_CAPTURED)
    # a chunk's name gives its span to the millisecond (sink.py): the newest or oldest step may lie half of
    # one outside it
    hi = until if until is not None else max(s.last for s in kept) + NAME_PRECISION_S
    if last is not None:
        lo = hi - last
    else:
        lo = since if since is not None else min(s.first for s in kept) - NAME_PRECISION_S
    if hi < lo:
        raise KvtraceError(f"the window ends ({utc_text(hi)}) before it starts ({utc_text(lo)})")
    return lo, hi


def labels(servers: list[Server]) -> list[str]:
    """Each server's label in a joined run, the shortest that tells them apart: `dp<rank>` (the ranks of
    one `vllm serve`), `<host>-dp<rank>` (a fleet's hosts), else the server ids. One server: ''."""
    if len(servers) == 1:
        return [""]
    for make in (lambda s: f"dp{s.rank}" if s.rank is not None else None,
                 lambda s: f"{s.host}-dp{s.rank}" if s.rank is not None and s.host else None):
        names = [make(s) for s in servers]
        if None not in names and len(set(names)) == len(names):
            return names
    return [s.server_id for s in servers]


def capture_run(captures: list[Path], run_dir: Path, *, since: float | None, until: float | None,
                last: float | None, server_ids: list[str], ranks: list[int], command: str) -> dict:
    """Write the run of the window of the servers chosen; return its meta."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise KvtraceError(f"run folder {run_dir} already exists and is not empty")
    candidates = select(fleet(captures), server_ids, ranks)
    lo, hi = window(candidates, since, until, last)
    chosen = [s for s in candidates if s.first is not None and s.last >= lo and s.first <= hi]
    if not chosen:
        raise KvtraceError(NOTHING_CAPTURED)
    for name in SHARED:
        values = {s.identity.get(name) for s in chosen}
        if len(values) > 1:
            raise KvtraceError(f"the servers chosen differ in {name} ({', '.join(sorted(map(str, values)))}): "
                               "a run joins servers of one deployment; choose them with --server or --rank")
    names = labels(chosen)
    clock = chosen[0].offset   # every server's rows on the first one's monotonic clock
    mono_lo, mono_hi = lo - clock, hi - clock
    parts = []
    for server, label in zip(chosen, names):
        near = [c for c in server.chunks if c.first is None
                or (c.last >= lo - LOOK_AROUND_S and c.first <= hi + LOOK_AROUND_S)]
        columns = read_chunks(server.folder, near)
        _shift(columns, server.offset - clock)
        marks = _cut(columns, mono_lo, mono_hi)
        if len(chosen) > 1:
            _label(columns, marks, label)
        parts.append((columns, marks))
    columns, marks = _join(parts) if len(parts) > 1 else parts[0]
    origin = min([mono_lo, *(t for t in columns["requests"]["arrival_s"] if t is not None)])
    rebase(columns, origin)
    rows = write_tables(columns, run_dir, run_dir.name)
    rows["capture_requests"] = _write_marks(run_dir, run_dir.name, marks)
    meta = _meta(chosen, names, run_dir, lo, hi, rows, command)
    meta["capture"]["window"].update(start_s=mono_lo - origin, end_s=mono_hi - origin)
    write_json_atomic(run_dir / "meta.json", meta)
    return meta


def _shift(columns: dict[str, dict[str, list]], by: float) -> None:
    """Every time of a server's columns moved by `by` seconds (onto another server's clock)."""
    if not by:
        return
    for table, names in {**TIME_COLUMNS, "arrivals": ("arrival_s",)}.items():
        for name in names:
            columns[table][name] = [None if t is None else t + by for t in columns[table][name]]


def _label(columns: dict[str, dict[str, list]], marks: list[tuple], label: str) -> None:
    """One server's rows in a joined run: its label in every row, before every request id."""
    for table in SERVER_TABLES:
        cols = columns[table]
        cols[SERVER_FIELD.name] = [label] * len(next(iter(cols.values())))
        if "req_id" in cols:   # an evict's is '' (no request): it stays so
            cols["req_id"] = [f"{label}/{r}" if r else r for r in cols["req_id"]]
    k = columns["kv_events"]
    k["requester_req_id"] = [f"{label}/{r}" if r else r for r in k["requester_req_id"]]
    marks[:] = [(f"{label}/{m[0]}", *m[1:]) for m in marks]


def _join(parts: list[tuple[dict, list]]) -> tuple[dict, list]:
    """Several servers' labelled columns and marks as one run's: rows one after the other, the requests
    and marks by arrival; the KV events merged by time, each server's in its own order, and numbered
    again from 0."""
    columns = {table: {name: [v for cols, _ in parts for v in cols[table][name]] for name in parts[0][0][table]}
               for table in ("requests", "steps", "tokens", "spec_decode")}
    events = [cols["kv_events"] for cols, _ in parts]
    streams = [[(ts, n, i) for i, ts in enumerate(k["ts_s"])] for n, k in enumerate(events)]
    order = [(n, i) for _, n, i in heapq.merge(*streams, key=lambda e: e[0])]
    columns["kv_events"] = {name: [events[n][name][i] for n, i in order] for name in events[0]}
    columns["kv_events"]["seq"] = list(range(len(order)))
    q = columns["requests"]
    by_arrival = sorted(range(len(q["req_id"])), key=lambda i: (q["arrival_s"][i] is None, q["arrival_s"][i] or 0,
                                                                q["req_id"][i]))
    columns["requests"] = {name: [values[i] for i in by_arrival] for name, values in q.items()}
    marks = [m for _, part in parts for m in part]
    arrival = dict(zip(q["req_id"], q["arrival_s"]))
    marks.sort(key=lambda m: (arrival.get(m[0]) is None, arrival.get(m[0]) or 0, m[0]))
    return columns, marks


def _cut(columns: dict[str, dict[str, list]], lo: float, hi: float) -> list[tuple]:
    """Keep the window [lo, hi] (monotonic seconds) of the columns, in place; return each request's
    marks (req_id, in flight at start, in flight at end, salted block hashes)."""
    q, arrivals = columns["requests"], columns["arrivals"]
    finished = {rid: i for i, rid in enumerate(q["req_id"])}
    arrived = {rid: i for i, rid in enumerate(arrivals["req_id"])}
    for table, name in (("steps", "start_s"), ("kv_events", "ts_s"), ("tokens", "ts_s"), ("spec_decode", "ts_s")):
        cols = columns[table]
        keep = [i for i, t in enumerate(cols[name]) if t is not None and lo <= t <= hi]
        for key, values in cols.items():
            cols[key] = [values[i] for i in keep]
    in_window: dict[str, dict] = {}
    for rid in {*finished, *arrived}:
        i, a = finished.get(rid), arrived.get(rid)
        arrival = q["arrival_s"][i] if i is not None else arrivals["arrival_s"][a]
        finish = q["finish_s"][i] if i is not None else None
        if arrival is None or arrival > hi or (finish is not None and finish < lo):
            continue
        row = {c: values[i] for c, values in q.items()} if i is not None else None
        in_window[rid] = {"row": row, "arrival": arrival, "a": a, "at_end": finish is None or finish > hi}
    seen = Counter(columns["tokens"]["req_id"])
    events: dict[str, Counter] = {}
    k = columns["kv_events"]
    for kind, rid, recomputed, num_tokens in zip(k["kind"], k["req_id"], k["num_recomputed_tokens"], k["num_tokens"]):
        if rid in in_window:
            c = events.setdefault(rid, Counter())
            if kind == "preempt":
                c["preemptions"] += 1
            elif kind == "reprefill":
                c["recomputed"] += recomputed or 0
            elif kind == "prefix_hit":
                c["prefix_hits"] += num_tokens or 0
    d = columns["spec_decode"]   # a speculative server's drafts, in the window
    for rid, drafts, accepted in zip(d["req_id"], d["draft_tokens"], d["accepted_tokens"]):
        if rid in in_window:
            c = events.setdefault(rid, Counter())
            c["drafts"] += drafts or 0
            c["accepted"] += accepted or 0
    out = {c: [] for c in q}
    marks = []
    for rid, w in sorted(in_window.items(), key=lambda kv: (kv[1]["arrival"], kv[0])):
        row, a = w["row"], w["a"]
        if w["at_end"]:   # what the window saw of it
            c = events.get(rid, Counter())
            base = row or {}
            row = {**{name: None for name in q}, **base}
            if a is not None:
                row.update(prompt_tokens=arrivals["prompt_tokens"][a], max_tokens=arrivals["max_tokens"][a],
                           priority=arrivals["priority"][a])
            row.update(req_id=rid, sample=0, n=1, arrival_s=w["arrival"], output_tokens=seen.get(rid, 0),
                       finish_s=hi, finish_reason="in-flight", preemptions=c["preemptions"], swaps=0,
                       recomputed_tokens=c["recomputed"], prefix_hit_tokens=c["prefix_hits"],
                       draft_tokens=c["drafts"], accepted_tokens=c["accepted"])
            for name in ("first_scheduled_s", "first_token_s"):
                if row[name] is not None and row[name] > hi:
                    row[name] = None
        for name, values in out.items():
            values.append(row[name])
        hashes = arrivals["block_hashes"][a] if a is not None else None
        marks.append((rid, w["arrival"] < lo, w["at_end"], hashes))
    columns["requests"] = out
    return marks


def _write_marks(run_dir: Path, run_id: str, marks: list[tuple]) -> int:
    schema = OPTIONAL_TABLES["capture_requests"]
    table = pa.table({"run_id": [run_id] * len(marks), "req_id": [m[0] for m in marks],
                      "sample": [0] * len(marks), "in_flight_at_start": [m[1] for m in marks],
                      "in_flight_at_end": [m[2] for m in marks], "block_hashes": [m[3] for m in marks]},
                     schema=schema)
    folder = run_dir / "capture_requests"
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / ".part-00000.parquet.tmp"
    write_parquet(table, tmp)
    tmp.replace(folder / "part-00000.parquet")
    return table.num_rows


def _meta(servers: list[Server], names: list[str], run_dir: Path, lo: float, hi: float, rows: dict,
          command: str) -> dict:
    """The run's meta.json: the first server's settings (the servers of a run share model and block size);
    the pool's size where every server's is the same (each server has a pool of its own)."""
    server, i = servers[0], servers[0].identity
    sizes = {s.identity.get("num_gpu_blocks") for s in servers}
    num_blocks = (i["num_gpu_blocks"] - 1) if len(sizes) == 1 and i.get("num_gpu_blocks") else None
    model = Path(str(i.get("model") or "unknown")).name
    policy = "priority" if i.get("policy") == "priority" else "newest"
    ids = ("`<server>/` (the server's label, the rows' `server`) before vLLM's own: " if len(servers) > 1 else "")
    return {
        "run_id": run_dir.name, "schema_version": SCHEMA_VERSION, "kvtrace_version": kvtrace.__version__,
        "command": command,
        "engine_config": {"engine": "vllm", "model": model, "dtype": None, "seed": None,
                          "block_size": i.get("block_size"), "num_gpu_blocks": num_blocks,
                          "max_num_seqs": i.get("max_num_seqs"), "max_num_batched_tokens": i.get("max_num_batched_tokens"),
                          "max_model_len": i.get("max_model_len"), "enable_prefix_caching": i.get("enable_prefix_caching"),
                          "preemption_mode": "recompute", "preemption_policy": policy, **model_shape(i)[1]},
        "scheduling": {"follows": "vLLM itself (live traffic, recorded from inside)", "departures": []},
        "model": {"name": model, "source": i.get("model"), "dtype": None, "shape": None,
                  "max_model_len": i.get("max_model_len")},
        "device": {"type": "vllm", "name": f"vLLM {i.get('vllm_version')} server", "torch": None, "threads": None,
                   "kernels": "vllm", "kernels_note": None},
        "simulated": None,
        "kv_pool": {"num_gpu_blocks": num_blocks, "block_size": i.get("block_size"), "bytes_per_block": None,
                    "num_cpu_blocks": 0, "total_bytes": None, "watermark_blocks": i.get("watermark_blocks"),
                    "kv_reserve": "none", "derivation": "vLLM's pool less its null block (block 0)",
                    **model_shape(i)[0]},
        "kv_tiers": kv_tiers(i),
        "workload": None,
        "replay": {"mode": "live", "time_scale": 1.0},
        "seed": None, "record_token_ids": bool(i.get("token_ids")),
        "capture": {"folder": str(server.folder) if server.folder else None,
                    "server": describe(server), "window": {"since": _iso(lo), "until": _iso(hi),
                                                           "since_unix": lo, "until_unix": hi},
                    # each server of the run by its label (the rows' `server`; '' in a run of one server)
                    "servers": [{"label": name, "rank_text": rank_text(s), **describe(s)}
                                for s, name in zip(servers, names)],
                    "request_ids": ids + "vLLM's own (no workload): the OpenAI server's cmpl-… ids, or the "
                                         "client's X-Request-Id with vLLM's suffix",
                    "origin": "the run's clock starts at the earliest of the window's start and the arrivals "
                              "of the requests in flight then (capture_requests.in_flight_at_start)"},
        "vllm": {"version": i.get("vllm_version"), "scheduler": i.get("scheduler"),
                 "async_scheduling": i.get("async_scheduling"), "server_id": server.server_id, "pid": i.get("pid"),
                 "server_ids": [s.server_id for s in servers]},
        "started_at": _iso(lo), "ended_at": _iso(hi), "status": "completed", "error": None,
        "nvml": {"enabled": False, "reason": "vLLM server: not sampled"},
        "summary": {"num_requests": rows.get("capture_requests", 0), "num_steps": rows.get("steps", 0),
                    "num_output_tokens": rows.get("tokens", 0), "num_preemptions": None,
                    "duration_s": hi - lo, "rows": rows},
    }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


