"""A capture folder of live traffic (`vllm serve` with kvtrace's scheduler): its servers, and any
window of what they served as a run (`kvtrace capture ls` / `kvtrace capture run`, docs/vllm.md).

Each server wrote its identity to `servers/<id>.json` and its chunks to `chunks/<id>_…`, each named
with the wall-clock span of its steps (kvtrace/vllm/capture/sink.py): what a folder holds is known
from the names, and a window reads only the chunks near it. Live traffic has no workload: request
ids are vLLM's own (`cmpl-…` from the OpenAI server, or the client's X-Request-Id with vLLM's
suffix), shown as they are.

A window's run holds every request whose life overlaps it. Requests that arrived before the window
are marked `in_flight_at_start` in the run's `capture_requests` table; the run's clock starts at the
earliest of the window's start and those arrivals (times stay non-negative, as Perfetto's must be;
meta.json's capture.window.start_s is the window's start on it). A request not finished by the window's
end gets `finish_reason` 'in-flight', `finish_s` the window's end and the counts of what the window
saw of it, and is marked `in_flight_at_end`.
"""
from __future__ import annotations

import json
import re
from collections import Counter
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import pyarrow as pa

import kvtrace
from kvtrace.atomic import write_json_atomic
from kvtrace.errors import KvtraceError
from kvtrace.trace.schema import OPTIONAL_TABLES, SCHEMA_VERSION, write_parquet
from kvtrace.vllm.importer import Chunk, foreign_files, list_chunks, read_chunks, read_json, rebase, write_tables

# how far before and after a window the chunks are read for the requests in flight across its edges
LOOK_AROUND_S = 3600.0


@dataclass
class Server:
    """One server that wrote into the folder."""

    server_id: str
    identity: dict
    chunks: list[Chunk] = field(default_factory=list)
    done: dict | None = None
    dropped: dict | None = None   # servers/<id>.dropped.json: what a slow disk made the capture drop
    error: dict | None = None     # servers/<id>.error.json: why its capture stepped aside, refused or stopped

    @property
    def first(self) -> float | None:
        times = [c.first for c in self.chunks if c.first is not None]
        return min(times) if times else None

    @property
    def last(self) -> float | None:
        times = [c.last for c in self.chunks if c.last is not None]
        return max(times) if times else None

    @property
    def num_requests(self) -> int:
        return sum(c.num_arrivals or 0 for c in self.chunks)

    @property
    def size(self) -> int:
        return sum(c.size for c in self.chunks)

    @property
    def started(self) -> float | None:
        text = self.identity.get("started_at")
        return datetime.fromisoformat(text).timestamp() if text else None

    @property
    def offset(self) -> float:
        """Wall-clock seconds minus the monotonic seconds the chunks' rows carry."""
        return float(self.identity.get("wall_minus_monotonic") or 0.0)

    def gaps(self) -> list[str]:
        """What retention, a slow disk or a stopped capture left out: chunks missing before the first kept
        one or between two kept ones, with the span they would have covered and why, where known."""
        parts = sorted(c.part for c in self.chunks)
        gaps = []
        dropped = set()
        said = self.dropped or {}
        for span in said.get("spans", ()):
            a, b = span["parts"]
            dropped.update(range(a, b + 1))
            gaps.append(f"chunks {a}–{b} dropped ({utc_text(span.get('first'))} – {utc_text(span.get('last'))}): "
                        f"{said.get('reason', 'the disk was slower than the capture')}")
        if said.get("dropped_chunks", 0) > len(dropped):
            gaps.append(f"{said['dropped_chunks']} chunks dropped in all ({said.get('dropped_rows', 0)} rows)")
        if not parts:
            return [*gaps, "no chunk kept (none written yet, or every one removed by retention)"]
        if parts[0] > 0 and not set(range(parts[0])) <= dropped:
            first = self.chunks[0].first
            span = f" (from the start {utc_text(self.started)} to {utc_text(first)})" if first and self.started else ""
            gaps.append(f"chunks 0–{parts[0] - 1} removed by retention{span}")
        for before, after in zip(parts, parts[1:]):
            if after > before + 1 and not set(range(before + 1, after)) <= dropped:
                gaps.append(f"chunks {before + 1}–{after - 1} missing")
        return gaps


def servers(capture: Path) -> list[Server]:
    """Every server of the folder, oldest first. KvtraceError if it is no capture folder."""
    if not capture.is_dir():
        raise KvtraceError(f"{capture}: no such folder")
    found: dict[str, Server] = {}
    for path in sorted((capture / "servers").glob("*.json")):
        if path.name.endswith((".done.json", ".dropped.json", ".error.json")):
            continue
        identity = read_json(path)
        if identity:
            found[path.stem] = Server(path.stem, identity, done=read_json(path.with_suffix(".done.json")),
                                      dropped=read_json(path.with_suffix(".dropped.json")))
    for path in sorted((capture / "servers").glob("*.error.json")):   # a capture that did not record (aside.py)
        said = read_json(path)
        if said:
            server_id = path.name.removesuffix(".error.json")
            server = found.setdefault(server_id, Server(server_id, said))   # its identity: what it says
            server.error = said
    for chunk in list_chunks(capture):
        server = found.get(chunk.server_id)
        if server is None:   # an older capture: one server, its identity in capture.json
            server = found[chunk.server_id] = Server(chunk.server_id, read_json(capture / "capture.json") or {})
        server.chunks.append(chunk)
    if not found:
        raise KvtraceError(f"{capture}: not a kvtrace capture folder (no servers/ and no chunks/; "
                           "start vllm serve as eval \"$(kvtrace vllm-env --capture-dir DIR)\" says)")
    return sorted(found.values(), key=lambda s: (s.started or 0.0, s.server_id))


def utc_text(t: float | None) -> str:
    """Unix seconds as `2026-12-01 02:14:03Z` (— for none)."""
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ") if t is not None else "—"


def _size(n: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


def describe(server: Server) -> dict:
    """A server as `capture ls --json` shows it."""
    i = server.identity
    return {"server_id": server.server_id, "started_at": i.get("started_at"), "pid": i.get("pid"),
            "vllm_version": i.get("vllm_version"), "model": i.get("model"),
            "scheduling": "async" if i.get("async_scheduling") else "sync", "scheduler": i.get("scheduler"),
            "first": server.first, "last": server.last, "num_requests": server.num_requests,
            "num_chunks": len(server.chunks), "bytes": server.size, "gaps": server.gaps(),
            "token_ids": i.get("token_ids"), "salt_id": i.get("salt_id"),
            "writer_error": (server.done or {}).get("writer_error"),
            "dropped_chunks": (server.dropped or {}).get("dropped_chunks", 0),
            "kvtrace_version": i.get("kvtrace_version"), "chunk_format": i.get("chunk_format"),
            # "recorded", or why not: stepped_aside (vLLM served unrecorded), refused (strict), stopped
            "capture": (server.error or {}).get("status", "recorded"),
            "capture_reason": (server.error or {}).get("reason"), "capture_error": (server.error or {}).get("error")}


def ls_lines(capture: Path) -> list[str]:
    found = servers(capture)
    lines = [f"{capture}: {len(found)} server{'s' if len(found) != 1 else ''}, "
             f"{_size(sum(s.size for s in found))} in {sum(len(s.chunks) for s in found)} chunks"]
    for s in found:
        d = describe(s)
        lines.append(f"server {s.server_id}  started {utc_text(s.started)}  pid {d['pid']}  vLLM {d['vllm_version']}  "
                     f"{d['model']}  {d['scheduling']} scheduling")
        said = {"stepped_aside": "stepped aside (vLLM served unrecorded)", "refused": "refused to start (strict mode: "
                "vLLM did not start)", "stopped": "stopped by an error of its own (vLLM served on)"}.get(d["capture"])
        if said:
            said = f"  capture {said} at {s.error.get('at')}: {d['capture_error']} [{d['capture_reason']}]"
            if d["capture"] != "stopped":   # it recorded nothing
                lines.append(said)
                continue
        span = (f"{utc_text(s.first)} – {utc_text(s.last)} ({s.last - s.first:.0f} s)" if s.first is not None
                else "nothing kept")
        lines.append(f"  covers {span} · {d['num_requests']} requests · {_size(d['bytes'])} in "
                     f"{d['num_chunks']} chunks · token ids {'kept' if d['token_ids'] else 'not kept'}")
        for gap in d["gaps"]:
            lines.append(f"  gap: {gap}")
        if d["writer_error"]:
            lines.append(f"  capture stopped: {d['writer_error']}")
        if said:
            lines.append(said)
    foreign = foreign_files(capture) if (capture / "chunks").is_dir() else []
    if foreign:   # not read by capture run, watch or metrics either
        path, why = foreign[0]
        lines.append(f"not read: {len(foreign)} file{'s' if len(foreign) != 1 else ''} of chunks/ that no kvtrace "
                     f"reads (first: {path.name}: {why})")
    return lines


# ---- times on the command line ---------------------------------------------------------------------------
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d)?\s*$")


def parse_duration(text: str, option: str) -> float:
    m = _DURATION.match(text)
    if not m:
        raise KvtraceError(f"{option} {text!r}: expected a duration such as 15m, 90s, 2h")
    return float(m[1]) * {"s": 1, "m": 60, "h": 3600, "d": 86400, None: 1}[m[2]]


def parse_time(text: str, option: str) -> float:
    """An ISO 8601 time (UTC unless it names its zone) or Unix seconds -> Unix seconds."""
    try:
        return float(text)
    except ValueError:
        pass
    try:
        t = datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise KvtraceError(f"{option} {text!r}: expected an ISO time (2026-12-01T03:00:00Z) or Unix seconds") from None
    if t.tzinfo is None:
        t = t.replace(tzinfo=timezone.utc)
    return t.timestamp()


def choose_server(found: list[Server], server_id: str | None, lo: float | None, hi: float | None) -> Server:
    if server_id is not None:
        matches = [s for s in found if s.server_id == server_id] or [s for s in found if s.server_id.startswith(server_id)]
        if len(matches) != 1:
            raise KvtraceError(f"--server {server_id}: {'no' if not matches else 'more than one'} server of that id "
                               f"(kvtrace capture ls lists them: {', '.join(s.server_id for s in found)})")
        return matches[0]
    kept = [s for s in found if s.first is not None]
    overlapping = [s for s in kept if (lo is None or s.last >= lo) and (hi is None or s.first <= hi)]
    if not overlapping:
        raise KvtraceError("no server captured anything in that window (kvtrace capture ls shows what the folder holds)")
    if len(overlapping) > 1:
        raise KvtraceError(f"the window covers {len(overlapping)} servers: choose one with --server "
                           f"({', '.join(s.server_id for s in overlapping)})")
    return overlapping[0]


def window(server: Server, since: float | None, until: float | None, last: float | None) -> tuple[float, float]:
    """The window in wall-clock seconds: --since/--until, or --last D ending at --until or the newest data."""
    if last is not None and since is not None:
        raise KvtraceError("give --since or --last, not both")
    hi = until if until is not None else server.last
    lo = hi - last if last is not None else (since if since is not None else server.first)
    if hi < lo:
        raise KvtraceError(f"the window ends ({utc_text(hi)}) before it starts ({utc_text(lo)})")
    return lo, hi


# ---- a window as a run ---------------------------------------------------------------------------------------
def capture_run(capture: Path, run_dir: Path, *, since: float | None, until: float | None, last: float | None,
                server_id: str | None, command: str) -> dict:
    """Write the run of the window; return its meta."""
    if run_dir.exists() and any(run_dir.iterdir()):
        raise KvtraceError(f"run folder {run_dir} already exists and is not empty")
    found = servers(capture)
    server = choose_server(found, server_id, since if last is None else None, until)
    lo, hi = window(server, since, until, last)
    offset = server.offset
    mono_lo, mono_hi = lo - offset, hi - offset
    near = [c for c in server.chunks if c.first is None
            or (c.last >= lo - LOOK_AROUND_S and c.first <= hi + LOOK_AROUND_S)]
    columns = read_chunks(capture, near)
    marks = _cut(columns, mono_lo, mono_hi)
    origin = min([mono_lo, *(t for t in columns["requests"]["arrival_s"] if t is not None)])
    rebase(columns, origin)
    rows = write_tables(columns, run_dir, run_dir.name)
    rows["capture_requests"] = _write_marks(run_dir, run_dir.name, marks)
    meta = _meta(server, run_dir, lo, hi, rows, command)
    meta["capture"]["window"].update(start_s=mono_lo - origin, end_s=mono_hi - origin)
    write_json_atomic(run_dir / "meta.json", meta)
    return meta


def _cut(columns: dict[str, dict[str, list]], lo: float, hi: float) -> list[tuple]:
    """Keep the window [lo, hi] (monotonic seconds) of the columns, in place; return each request's
    marks (req_id, in flight at start, in flight at end, salted block hashes)."""
    q, arrivals = columns["requests"], columns["arrivals"]
    finished = {rid: i for i, rid in enumerate(q["req_id"])}
    arrived = {rid: i for i, rid in enumerate(arrivals["req_id"])}
    for table, name in (("steps", "start_s"), ("kv_events", "ts_s"), ("tokens", "ts_s")):
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
                       recomputed_tokens=c["recomputed"], prefix_hit_tokens=c["prefix_hits"])
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


def _meta(server: Server, run_dir: Path, lo: float, hi: float, rows: dict, command: str) -> dict:
    i = server.identity
    num_blocks = (i["num_gpu_blocks"] - 1) if i.get("num_gpu_blocks") else None
    model = Path(str(i.get("model") or "unknown")).name
    policy = "priority" if i.get("policy") == "priority" else "newest"
    return {
        "run_id": run_dir.name, "schema_version": SCHEMA_VERSION, "kvtrace_version": kvtrace.__version__,
        "command": command,
        "engine_config": {"engine": "vllm", "model": model, "dtype": None, "seed": None,
                          "block_size": i.get("block_size"), "num_gpu_blocks": num_blocks,
                          "max_num_seqs": i.get("max_num_seqs"), "max_num_batched_tokens": i.get("max_num_batched_tokens"),
                          "max_model_len": i.get("max_model_len"), "enable_prefix_caching": i.get("enable_prefix_caching"),
                          "preemption_mode": "recompute", "preemption_policy": policy},
        "scheduling": {"follows": "vLLM itself (live traffic, recorded from inside)", "departures": []},
        "model": {"name": model, "source": i.get("model"), "dtype": None, "shape": None,
                  "max_model_len": i.get("max_model_len")},
        "device": {"type": "vllm", "name": f"vLLM {i.get('vllm_version')} server", "torch": None, "threads": None,
                   "kernels": "vllm", "kernels_note": None},
        "simulated": None,
        "kv_pool": {"num_gpu_blocks": num_blocks, "block_size": i.get("block_size"), "bytes_per_block": None,
                    "num_cpu_blocks": 0, "total_bytes": None, "watermark_blocks": i.get("watermark_blocks"),
                    "kv_reserve": "none", "derivation": "vLLM's pool less its null block (block 0)"},
        "workload": None,
        "replay": {"mode": "live", "time_scale": 1.0},
        "seed": None, "record_token_ids": bool(i.get("token_ids")),
        "capture": {"folder": str(server.chunks[0].path.parents[1]) if server.chunks else None,
                    "server": describe(server), "window": {"since": _iso(lo), "until": _iso(hi),
                                                           "since_unix": lo, "until_unix": hi},
                    "request_ids": "vLLM's own (no workload): the OpenAI server's cmpl-… ids, or the "
                                   "client's X-Request-Id with vLLM's suffix",
                    "origin": "the run's clock starts at the earliest of the window's start and the arrivals "
                              "of the requests in flight then (capture_requests.in_flight_at_start)"},
        "vllm": {"version": i.get("vllm_version"), "scheduler": i.get("scheduler"),
                 "async_scheduling": i.get("async_scheduling"), "server_id": server.server_id, "pid": i.get("pid")},
        "started_at": _iso(lo), "ended_at": _iso(hi), "status": "completed", "error": None,
        "nvml": {"enabled": False, "reason": "vLLM server: not sampled"},
        "summary": {"num_requests": rows.get("capture_requests", 0), "num_steps": rows.get("steps", 0),
                    "num_output_tokens": rows.get("tokens", 0), "num_preemptions": None,
                    "duration_s": hi - lo, "rows": rows},
    }


def _iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat()


def ls_json(capture: Path) -> str:
    return json.dumps({"folder": str(capture), "servers": [describe(s) for s in servers(capture)]}, indent=2)
