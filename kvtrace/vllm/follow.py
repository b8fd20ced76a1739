"""A running server's capture folder, followed: what `kvtrace capture metrics` (kvtrace/vllm/metrics.py)
and `kvtrace capture watch` read (`kvtrace capture ls` / `run` read a folder once: kvtrace/vllm/live.py).

`ChunkReader` reads each chunk file once, new files only: a chunk removed by the capture's retention
before it was read is skipped, a hidden `.tmp` (a chunk being written) is not a chunk yet.
`LiveTrace` keeps the rows of the last `keep_s` seconds per server (a chunk file's prefix, the
EngineCore's pid) and, of the sequences still in flight, every row: a gap between two tokens is
caused by what happened to its sequence since the earlier one, however long ago that was.
`LiveTrace.write_run` turns what is kept into a run folder that kvtrace's SQL library reads like any other;
for a follower that counts each row once (the exporter), it can write only the tokens added since
its last such run, their predecessors found from what came before, or no tokens at all: the tokens
are nearly all of a busy server's rows, so a poll then costs what is new, not the window.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from kvtrace.trace.schema import SCHEMA_VERSION, token_predecessors
from kvtrace.vllm.capture.chunk_format import ChunkError
from kvtrace.vllm.capture.sink import COLUMNS
from kvtrace.vllm.importer import (TIME_COLUMNS, DraftTotals, foreign_files, keep_window, kv_tiers, list_chunks,
                                  model_shape, read_chunk, read_json, say, skipped_line, write_tables)

MAX_AGE_S = 3600.0   # rows of a sequence that never finished (a lost request) are dropped after this


class ChunkReader:
    """The chunk files of a capture folder (importer.list_chunks), each read once; a file that is no
    chunk kvtrace reads is skipped, said once to `warn` (a line naming it), and counted."""

    def __init__(self, capture: Path, warn=say) -> None:
        self.capture = Path(capture)
        self.warn = warn
        self.seen: set[str] = set()
        self.foreign: set[str] = set()
        self.num_read = 0
        self.num_unreadable = 0
        self.server_ids: set[str] = set()   # the servers the folder kept chunks of at the last listing

    def new_chunks(self, limit: int | None = None) -> list[tuple[str, dict]]:
        """(server, chunk) of the chunk files not read before (the first `limit` of them), in each
        server's order."""
        if not (self.capture / "chunks").is_dir():   # the server has not started capturing yet
            return []
        for path, reason in foreign_files(self.capture):
            if path.name not in self.foreign:
                self.foreign.add(path.name)
                self.num_unreadable += 1
                self.warn(skipped_line(path, reason))
        chunks = list_chunks(self.capture)
        self.server_ids = {c.server_id for c in chunks}
        self.seen &= {c.path.name for c in chunks}   # forget what retention removed: the set stays small
        found = []
        for c in chunks:
            if c.path.name in self.seen:
                continue
            if limit is not None and len(found) == limit:
                break
            self.seen.add(c.path.name)
            try:
                chunk = read_chunk(c.path)
            except FileNotFoundError:   # removed by retention since the listing
                continue
            except (ChunkError, OSError) as exc:   # chunks are renamed into place whole: this one is not ours
                self.num_unreadable += 1
                self.warn(skipped_line(c.path, str(exc)))
                continue
            self.num_read += 1
            found.append((c.server_id, chunk))
        return found


class LiveTrace:
    """The capture's rows in memory, per server: the last `keep_s` seconds, and every row of the
    sequences still in flight. Times stay on the capture's monotonic clock."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.servers: dict[str, dict[str, dict[str, list]]] = {}
        self.new_tokens: dict[str, int] = {}   # per server: the token rows added since its last run of new tokens
        # per server: each sequence's last token written in such a run, (idx, step, ts_s): its next
        # token's predecessor
        self.last_token: dict[str, dict[tuple, tuple]] = {}
        self.pruned_at: dict[str, float] = {}  # per server: its end when it was last pruned
        self.draft_totals: dict[str, DraftTotals] = {}   # per server: its requests' drafts, for their rows

    def add(self, server: str, chunk: dict) -> None:
        columns = self.servers.setdefault(server, {t: {c: [] for c in cols} for t, cols in COLUMNS.items()})
        self.draft_totals.setdefault(server, DraftTotals()).add(chunk)
        for table, cols in chunk.items():
            if table not in columns:
                continue
            num_rows = len(next(iter(cols.values()), []))
            for name, values in columns[table].items():
                values.extend(cols.get(name, [None] * num_rows))
            if table == "tokens":
                self.new_tokens[server] = self.new_tokens.get(server, 0) + num_rows

    def end_s(self, server: str) -> float | None:
        """When the server's last step kept here ended (the capture's clock)."""
        ends = self.servers[server]["steps"]["end_s"]
        return max(ends) if ends else None

    def forget(self, server: str) -> None:
        """Drop every row kept of `server` (one whose chunks the folder no longer keeps)."""
        self.servers.pop(server, None)
        self.last_token.pop(server, None)
        self.new_tokens.pop(server, None)
        self.pruned_at.pop(server, None)
        self.draft_totals.pop(server, None)

    def prune(self, every_s: float = 0.0) -> None:
        """Drop what no later figure needs: finished sequences and steps older than `keep_s`
        (a step a kept re-prefill names stays: its end is when the re-prefill was done), tokens
        older than that but the last of each sequence still in flight (the next gap starts there).
        `every_s`: a server pruned less than that long ago (on its clock) is left as it is: a prune
        reads every row kept, and a row kept a little longer changes no figure."""
        for server, columns in list(self.servers.items()):
            end = self.end_s(server)
            if end is None or end - self.pruned_at.get(server, -float("inf")) < every_s:
                continue
            self.pruned_at[server] = end
            horizon, oldest = end - self.keep_s, end - max(self.keep_s, MAX_AGE_S)
            q = columns["requests"]
            done = {(r, s) for r, s, f in zip(q["req_id"], q["sample"], q["finish_s"]) if f is not None and f < horizon}
            last = self.last_token.get(server)
            if last:   # a finished sequence has no next token; one gone for MAX_AGE_S is lost
                for key in [key for key, (_, _, ts) in last.items() if key in done or ts is None or ts < oldest]:
                    del last[key]
            _keep(q, [(r, s) not in done for r, s in zip(q["req_id"], q["sample"])])
            k = columns["kv_events"]
            _keep(k, [t is not None and t >= oldest and (t >= horizon or (r, s) not in done and bool(r))
                      for r, s, t in zip(k["req_id"], k["sample"], k["ts_s"])])
            named = {st for st, kind in zip(k["step"], k["kind"]) if kind == "reprefill"}
            st = columns["steps"]
            _keep(st, [e >= horizon or step in named for step, e in zip(st["step"], st["end_s"])])
            d = columns["spec_decode"]   # a speculative step's drafts: figures of recent steps only
            _keep(d, [ts is not None and ts >= horizon for ts in d["ts_s"]])
            t = columns["tokens"]
            last: dict[tuple, int] = {}
            for i, key in enumerate(zip(t["req_id"], t["sample"])):
                last[key] = i
            tail = set(last.values())
            _keep(t, [ts is not None and ts >= oldest and (ts >= horizon or (i in tail and key not in done))
                      for i, (key, ts) in enumerate(zip(zip(t["req_id"], t["sample"]), t["ts_s"]))])
            if not any(next(iter(cols.values())) for cols in columns.values()):
                self.forget(server)

    def write_run(self, server: str, run_dir: Path, run_id: str, *, window_s: float | None,
                  info: dict, command: str, tokens: str = "all") -> dict[str, int]:
        """A run folder of what is kept of `server` (the last `window_s` seconds of it when given),
        on a clock that starts with the window (else with its first step); the rows per table.
        `tokens`: "all" kept; "new": only those added since the last run written with "new" (each
        with its predecessor, however long ago); "none"."""
        kept = self.servers[server]
        columns = {t: {c: list(v) for c, v in cols.items()} for t, cols in kept.items() if t != "tokens"}
        if tokens == "all":
            t = columns["tokens"] = {c: list(v) for c, v in kept["tokens"].items()}
            # predecessors before the window: a gap that ends in it counts
            t["prev_step"], t["prev_ts_s"] = token_predecessors(t["req_id"], t["sample"], t["idx"], t["step"],
                                                                t["ts_s"])
        elif tokens == "new":
            t = columns["tokens"] = self._new_tokens(server)
        else:
            t = columns["tokens"] = {c: [] for c in kept["tokens"]}
            t["prev_step"], t["prev_ts_s"] = [], []
        end = self.end_s(server) or 0.0
        if window_s is not None:
            keep_window(columns, end - window_s, end)
        # the window's start is 0 (a request that arrived before it has a negative arrival)
        origin = end - window_s if window_s is not None else min(columns["steps"]["start_s"], default=end)
        for table, names in TIME_COLUMNS.items():
            for name in names:
                columns[table][name] = [None if v is None else v - origin for v in columns[table][name]]
        t["prev_ts_s"] = [None if v is None else v - origin for v in columns["tokens"]["prev_ts_s"]]
        rows = write_tables(columns, run_dir, run_id, predecessors=False)
        for table, num in rows.items():   # rewritten in place (the exporter's views stay): none left over
            if not num:
                (run_dir / table / "part-00000.parquet").unlink(missing_ok=True)
        (run_dir / "meta.json").write_text(json.dumps(run_meta(run_id, info, command, rows)))
        # and the tokens with a predecessor (db's runs.token_gaps_recorded: whether there are any)
        return {**rows, "token_gaps": sum(v is not None for v in t["prev_ts_s"])}

    def _new_tokens(self, server: str) -> dict[str, list]:
        """The tokens added since the last call (the end of the kept lists: add() appends, a prune
        keeps the order), with prev_step / prev_ts_s: the token before in its sequence by idx, the
        last one of an earlier call included (what token_predecessors finds over every kept token:
        the capture numbers a sequence's tokens in the order it writes them, and its chunks are read
        in that order)."""
        kept = self.servers[server]["tokens"]
        num = self.new_tokens.get(server, 0)
        start = len(kept["idx"]) - num
        t = {c: v[start:] for c, v in kept.items()}
        self.new_tokens[server] = 0
        last = self.last_token.setdefault(server, {})
        req_id, sample, idx, step, ts_s = t["req_id"], t["sample"], t["idx"], t["step"], t["ts_s"]
        prev_step, prev_ts_s = [None] * num, [None] * num
        for i in sorted(range(num), key=lambda i: (req_id[i], sample[i], idx[i])):
            key = req_id[i], sample[i]
            before = last.get(key)
            if before is not None:
                prev_step[i], prev_ts_s[i] = before[1], before[2]
            last[key] = idx[i], step[i], ts_s[i]
        t["prev_step"], t["prev_ts_s"] = prev_step, prev_ts_s
        return t


def _keep(cols: dict[str, list], mask: list[bool]) -> None:
    if all(mask):
        return
    for name, values in cols.items():
        cols[name] = [v for v, m in zip(values, mask) if m]


class CaptureStatus(NamedTuple):
    """Whether a folder's newest server is capturing, or why not."""

    server_id: str
    capturing: bool
    status: str   # "capturing", or its error.json's: stepped_aside, refused, stopped (capture/aside.py)
    reason: str   # "" while capturing, else error.json's word: vllm_version, model, settings, folder, ...
    error: str    # error.json's message ("" while capturing)


def capture_status(capture: Path) -> CaptureStatus | None:
    """The newest server of the folder (by its start: servers/<id>.json, or its <id>.error.json where its
    capture did not start) and whether its capture records; None before any server wrote there."""
    found: dict[str, tuple[str, dict | None]] = {}   # server id -> (its start, what its error.json says)
    for path in (Path(capture) / "servers").glob("*.json"):
        name = path.name
        if name.endswith((".done.json", ".dropped.json")):
            continue
        said = read_json(path)
        if not said:
            continue
        if name.endswith(".error.json"):   # a capture stopped at runtime has both files: this one wins
            found[name.removesuffix(".error.json")] = (said.get("started_at") or "", said)
        else:
            found.setdefault(path.stem, (said.get("started_at") or "", None))
    if not found:
        return None
    server_id, (_, said) = max(found.items(), key=lambda kv: (kv[1][0], kv[0]))
    if said is None:
        return CaptureStatus(server_id, True, "capturing", "", "")
    return CaptureStatus(server_id, False, said.get("status") or "stepped_aside", said.get("reason") or "error",
                         said.get("error") or "")


def server_info(capture: Path, server: str) -> dict:
    """What the server says of itself: its identity (servers/<id>.json), else what capture.json says of it,
    where it is the one that wrote it last (a capture from before servers/)."""
    identity = read_json(Path(capture) / "servers" / f"{server}.json")
    if identity:
        return identity
    info = read_json(Path(capture) / "capture.json") or {}
    return info if server in (info.get("server_id"), str(info.get("pid"))) else {}


def run_meta(run_id: str, info: dict, command: str, rows: dict[str, int]) -> dict:
    """The meta.json of a live run: what the capture knows of the server (capture.json)."""
    blocks = info.get("num_gpu_blocks")
    version = info.get("vllm_version")
    return {
        "run_id": run_id, "schema_version": SCHEMA_VERSION, "status": "running", "command": command,
        "model": {"name": info.get("model") or "model ?", "dtype": info.get("dtype") or ""},
        "device": {"name": f"vLLM {version}" if version else "vLLM", "type": "live"},
        "workload": {"path": "live traffic", "num_requests": rows.get("requests", 0)},
        "engine_config": {"preemption_mode": "recompute", "preemption_policy": "vLLM's",
                          "enable_prefix_caching": info.get("enable_prefix_caching"),
                          "max_num_seqs": info.get("max_num_seqs"),
                          "max_num_batched_tokens": info.get("max_num_batched_tokens"), **model_shape(info)[1]},
        # vLLM's null block is no block a request can hold
        "kv_pool": {"block_size": info.get("block_size"), "num_gpu_blocks": blocks - 1 if blocks else None,
                    **model_shape(info)[0]},
        "kv_tiers": kv_tiers(info),
        "vllm": {"version": version, "scheduler": info.get("scheduler"),
                 "async_scheduling": info.get("async_scheduling")},
        "summary": {"rows": rows},
    }
