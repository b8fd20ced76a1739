"""Capture folders of live traffic (`vllm serve` with kvtrace's scheduler): their servers, as `kvtrace
capture ls` lists them (docs/vllm.md); kvtrace/vllm/fleet.py cuts a window of what one or several of
them served into a run (`kvtrace capture run`).

Each server wrote its identity to `servers/<id>.json` and its chunks to `chunks/<id>_…`, each named
with the wall-clock span of its steps (kvtrace/vllm/capture/sink.py): what a folder holds is known
from the names, and a window reads only the chunks near it. Live traffic has no workload: request
ids are vLLM's own (`cmpl-…` from the OpenAI server, or the client's X-Request-Id with vLLM's
suffix), shown as they are.

A server is one scheduler: a `vllm serve`, or one data-parallel rank of it (vLLM runs an engine core
per rank); its identity says its rank, host and vLLM instance (kvtrace/vllm/capture/settings.py).
Several folders side by side (one per host) are one fleet: `fleet()` lists their servers together.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from kvtrace.errors import KvtraceError
from kvtrace.vllm.importer import Chunk, foreign_files, list_chunks, read_json

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
    folder: Path | None = None    # the capture folder it wrote into

    @property
    def rank(self) -> int | None:
        """Its data-parallel rank (null in a capture before ranks were recorded)."""
        return self.identity.get("data_parallel_rank")

    @property
    def host(self) -> str | None:
        return self.identity.get("host")

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
                                      dropped=read_json(path.with_suffix(".dropped.json")), folder=capture)
    for path in sorted((capture / "servers").glob("*.error.json")):   # a capture that did not record (aside.py)
        said = read_json(path)
        if said:
            server_id = path.name.removesuffix(".error.json")
            server = found.setdefault(server_id, Server(server_id, said, folder=capture))   # its identity: what it says
            server.error = said
    for chunk in list_chunks(capture):
        server = found.get(chunk.server_id)
        if server is None:   # an older capture: one server, its identity in capture.json
            server = found[chunk.server_id] = Server(chunk.server_id, read_json(capture / "capture.json") or {},
                                                     folder=capture)
        server.chunks.append(chunk)
    if not found:
        raise KvtraceError(f"{capture}: not a kvtrace capture folder (no servers/ and no chunks/; "
                           "start vllm serve as eval \"$(kvtrace vllm-env --capture-dir DIR)\" says)")
    return sorted(found.values(), key=lambda s: (s.started or 0.0, s.server_id))


def fleet(captures: list[Path]) -> list[Server]:
    """Every server of the folders given (a fleet's, one folder per host), oldest first. KvtraceError if
    one is no capture folder, or if two folders hold the same server (a copy of one folder)."""
    found: dict[str, Server] = {}
    for capture in folders(captures):
        for server in servers(capture):
            other = found.setdefault(server.server_id, server)
            if other is not server:
                raise KvtraceError(f"server {server.server_id} is in both {other.folder} and {capture}: "
                                   "give each capture folder once")
    return sorted(found.values(), key=lambda s: (s.started or 0.0, s.server_id))


def folders(captures: list[Path]) -> list[Path]:
    """The folders given, each once (the first spelling of a folder given twice)."""
    given: dict[Path, Path] = {}
    for capture in captures:
        given.setdefault(Path(capture).resolve(), Path(capture))
    return list(given.values())


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
    return {"server_id": server.server_id, "folder": str(server.folder) if server.folder else None,
            "host": server.host, "data_parallel_rank": server.rank, "data_parallel_size": i.get("data_parallel_size"),
            "vllm_instance_id": i.get("vllm_instance_id"), "started_at": i.get("started_at"), "pid": i.get("pid"),
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


def ls_lines(captures: list[Path]) -> list[str]:
    """`capture ls` of one folder, or of several side by side (a fleet): each folder's servers with
    their ranks and hosts, the span their kept chunks cover, their requests and gaps."""
    found = fleet(captures)
    lines = []
    for capture in folders(captures):
        mine = [s for s in found if s.folder == capture]
        if lines:
            lines.append("")
        lines.append(f"{capture}: {len(mine)} server{'s' if len(mine) != 1 else ''}, "
                     f"{_size(sum(s.size for s in mine))} in {sum(len(s.chunks) for s in mine)} chunks")
        for s in mine:
            lines += _server_lines(s)
        foreign = foreign_files(capture) if (capture / "chunks").is_dir() else []
        if foreign:   # not read by capture run, watch or metrics either
            path, why = foreign[0]
            lines.append(f"not read: {len(foreign)} file{'s' if len(foreign) != 1 else ''} of chunks/ that no kvtrace "
                         f"reads (first: {path.name}: {why})")
    recorded = [s for s in found if s.chunks]
    if len(recorded) > 1:
        lines.append(f"kvtrace capture run joins the {len(recorded)} servers that kept chunks into one run "
                     f"(--server or --rank chooses some)")
    return lines


def _server_lines(s: Server) -> list[str]:
    d = describe(s)
    where = f"  {rank_text(s)}  host {d['host']}" if d["host"] or s.rank is not None else ""
    lines = [f"server {s.server_id}{where}  started {utc_text(s.started)}  pid {d['pid']}  "
             f"vLLM {d['vllm_version']}  {d['model']}  {d['scheduling']} scheduling"]
    said = {"stepped_aside": "stepped aside (vLLM served unrecorded)", "refused": "refused to start (strict mode: "
            "vLLM did not start)", "stopped": "stopped by an error of its own (vLLM served on)"}.get(d["capture"])
    if said:
        said = f"  capture {said} at {s.error.get('at')}: {d['capture_error']} [{d['capture_reason']}]"
        if d["capture"] != "stopped":   # it recorded nothing
            return [*lines, said]
    span = (f"{utc_text(s.first)} – {utc_text(s.last)} ({s.last - s.first:.0f} s)" if s.first is not None
            else "nothing kept")
    lines.append(f"  covers {span} · {d['num_requests']} requests · {_size(d['bytes'])} in "
                 f"{d['num_chunks']} chunks · token ids {'kept' if d['token_ids'] else 'not kept'}")
    lines += [f"  gap: {gap}" for gap in d["gaps"]]
    if d["writer_error"]:
        lines.append(f"  capture stopped: {d['writer_error']}")
    if said:
        lines.append(said)
    return lines


def rank_text(s: Server) -> str:
    """`rank 1/2`, `rank 1` where vLLM does not keep the size (a dense model's ranks, a server without data
    parallelism), `rank ?` before ranks were recorded."""
    if s.rank is None:
        return "rank ?"
    size = s.identity.get("data_parallel_size")
    return f"rank {s.rank}/{size}" if size else f"rank {s.rank}"


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


def ls_json(captures: list[Path]) -> str:
    """`capture ls --json`: the folders and their servers (each server names its folder)."""
    given = [str(c) for c in folders(captures)]
    return json.dumps({"folder": given[0] if len(given) == 1 else None, "folders": given,
                       "servers": [describe(s) for s in fleet(captures)]}, indent=2)
