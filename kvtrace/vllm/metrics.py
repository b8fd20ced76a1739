"""A running server's capture folder, followed: the live figures of `kvtrace capture metrics` (a
Prometheus exporter) and `kvtrace capture watch` (the dashboard of the last minutes).

`ChunkReader` reads each chunk file once, new files only: a chunk removed by the capture's retention
before it was read is skipped, a hidden `.tmp` (a chunk being written) is not a chunk yet.
`LiveTrace` keeps the rows of the last `keep_s` seconds per server (a chunk file's prefix, the
EngineCore's pid) and, of the sequences still in flight, every row: a gap between two tokens is
caused by what happened to its sequence since the earlier one, however long ago that was.
`write_runs` turns what is kept into run folders that kvtrace's SQL library reads like any other.

`Exporter.poll` adds the rows it has not seen yet (analyses/_exporter.sql: one row per trace row
that adds to a counter, with its identity) to counters that never go backwards, whatever the
retention removes; the gauges are those of the last step; the thrash verdict is thrash.sql's on the
run of the last `window_s` seconds. Its `collect` is a prometheus_client collector.
"""
from __future__ import annotations

import json
import math
import pickle
import re
import shutil
import tempfile
import threading
from collections import defaultdict
from pathlib import Path

import duckdb
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.events import PreemptReason
from kvtrace.trace import db
from kvtrace.trace.schema import SCHEMA_VERSION, token_predecessors
from kvtrace.vllm.capture.sink import COLUMNS
from kvtrace.vllm.importer import TIME_COLUMNS, keep_window, read_json, write_tables

_CHUNK = re.compile(r"^(?P<server>[^.].*)-(?P<part>\d+)\.pkl$")
# the upper bounds of the ITL histogram (s): vLLM's own inter-token latency buckets, from 1 ms
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, math.inf)
ITL_CAUSES = ("swap_wait", "preempted", "reprefill", "prefill_interference", "other")   # itl_cliffs.sql
VERDICTS = ("none", "occasional", "sustained")                                          # thrash.sql
POOL_GAUGES = {"used": "referenced by some sequence", "cached": "free, holding reusable prefix-cache KV",
               "free": "free (cached ones included)", "total": "in the pool"}   # pool.sql's columns
BATCH_CHUNKS = 64    # chunk files added to the figures at a time (a 2 s chunk each while the server is busy)
MAX_AGE_S = 3600.0   # rows of a sequence that never finished (a lost request) are dropped after this


class ChunkReader:
    """The chunk files of a capture folder (`chunks/<server>-<part>.pkl`), each read once."""

    def __init__(self, capture: Path) -> None:
        self.folder = Path(capture) / "chunks"
        self.seen: set[str] = set()
        self.num_read = 0
        self.num_unreadable = 0

    def new_chunks(self, limit: int | None = None) -> list[tuple[str, dict]]:
        """(server, chunk) of the chunk files not read before (the first `limit` of them), in each
        server's order."""
        try:
            names = {p.name: m for p in self.folder.iterdir() if (m := _CHUNK.match(p.name))}
        except FileNotFoundError:   # the server has not started capturing yet
            return []
        self.seen &= set(names)     # forget what retention removed: the set stays as small as the folder
        found = []
        for name in sorted(set(names) - self.seen, key=lambda n: (names[n]["server"], int(names[n]["part"]))):
            if limit is not None and len(found) == limit:
                break
            self.seen.add(name)
            try:
                chunk = pickle.loads((self.folder / name).read_bytes())
            except FileNotFoundError:   # removed by retention since the listing
                continue
            except (pickle.UnpicklingError, EOFError, OSError):   # chunks are renamed into place whole:
                self.num_unreadable += 1                          # this one is not the capture's
                continue
            self.num_read += 1
            found.append((names[name]["server"], chunk))
        return found


class LiveTrace:
    """The capture's rows in memory, per server: the last `keep_s` seconds, and every row of the
    sequences still in flight. Times stay on the capture's monotonic clock."""

    def __init__(self, keep_s: float) -> None:
        self.keep_s = keep_s
        self.servers: dict[str, dict[str, dict[str, list]]] = {}

    def add(self, server: str, chunk: dict) -> None:
        columns = self.servers.setdefault(server, {t: {c: [] for c in cols} for t, cols in COLUMNS.items()})
        for table, cols in chunk.items():
            if table not in columns:
                continue
            num_rows = len(next(iter(cols.values()), []))
            for name, values in columns[table].items():
                values.extend(cols.get(name, [None] * num_rows))

    def end_s(self, server: str) -> float | None:
        """When the server's last step kept here ended (the capture's clock)."""
        ends = self.servers[server]["steps"]["end_s"]
        return max(ends) if ends else None

    def newest_server(self) -> str | None:
        ends = {s: e for s in self.servers if (e := self.end_s(s)) is not None}
        return max(ends, key=ends.get) if ends else None

    def prune(self) -> None:
        """Drop what no later figure needs: finished sequences and steps older than `keep_s`
        (a step a kept re-prefill names stays: its end is when the re-prefill was done), tokens
        older than that but the last of each sequence still in flight (the next gap starts there)."""
        for server, columns in list(self.servers.items()):
            end = self.end_s(server)
            if end is None:
                continue
            horizon, oldest = end - self.keep_s, end - max(self.keep_s, MAX_AGE_S)
            q = columns["requests"]
            done = {(r, s) for r, s, f in zip(q["req_id"], q["sample"], q["finish_s"]) if f is not None and f < horizon}
            _keep(q, [(r, s) not in done for r, s in zip(q["req_id"], q["sample"])])
            k = columns["kv_events"]
            _keep(k, [t is not None and t >= oldest and (t >= horizon or (r, s) not in done and bool(r))
                      for r, s, t in zip(k["req_id"], k["sample"], k["ts_s"])])
            named = {st for st, kind in zip(k["step"], k["kind"]) if kind == "reprefill"}
            st = columns["steps"]
            _keep(st, [e >= horizon or step in named for step, e in zip(st["step"], st["end_s"])])
            t = columns["tokens"]
            last: dict[tuple, int] = {}
            for i, key in enumerate(zip(t["req_id"], t["sample"])):
                last[key] = i
            tail = set(last.values())
            _keep(t, [ts is not None and ts >= oldest and (ts >= horizon or (i in tail and key not in done))
                      for i, (key, ts) in enumerate(zip(zip(t["req_id"], t["sample"]), t["ts_s"]))])
            if not any(next(iter(cols.values())) for cols in columns.values()):
                del self.servers[server]

    def write_run(self, server: str, run_dir: Path, run_id: str, *, window_s: float | None,
                  info: dict, command: str) -> dict[str, int]:
        """A run folder of what is kept of `server` (the last `window_s` seconds of it when given),
        on a clock that starts with the window (else with its first step); the rows per table."""
        columns = {t: {c: list(v) for c, v in cols.items()} for t, cols in self.servers[server].items()}
        t = columns["tokens"]   # predecessors before the window: a gap that ends in it counts
        t["prev_step"], t["prev_ts_s"] = token_predecessors(t["req_id"], t["sample"], t["idx"], t["step"], t["ts_s"])
        end = self.end_s(server) or 0.0
        if window_s is not None:
            keep_window(columns, end - window_s, end)
        # the window's start is 0 (a request that arrived before it has a negative arrival)
        origin = end - window_s if window_s is not None else min(columns["steps"]["start_s"], default=end)
        for table, names in TIME_COLUMNS.items():
            for name in names:
                columns[table][name] = [None if v is None else v - origin for v in columns[table][name]]
        t["prev_ts_s"] = [None if v is None else v - origin for v in columns["tokens"]["prev_ts_s"]]
        rows = write_tables(columns, run_dir, run_id)
        for table, num in rows.items():   # rewritten in place (the exporter's views stay): none left over
            if not num:
                (run_dir / table / "part-00000.parquet").unlink(missing_ok=True)
        (run_dir / "meta.json").write_text(json.dumps(run_meta(run_id, info, command, rows)))
        # and the tokens with a predecessor (db's runs.token_gaps_recorded: whether there are any)
        return {**rows, "token_gaps": sum(v is not None for v in t["prev_ts_s"])}


def _keep(cols: dict[str, list], mask: list[bool]) -> None:
    if all(mask):
        return
    for name, values in cols.items():
        cols[name] = [v for v, m in zip(values, mask) if m]


def server_info(capture: Path, server: str) -> dict:
    """What capture.json says of the server, where it is the one that wrote it last."""
    info = read_json(Path(capture) / "capture.json") or {}
    return info if str(info.get("pid")) == server else {}


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
                          "max_num_batched_tokens": info.get("max_num_batched_tokens")},
        # vLLM's null block is no block a request can hold
        "kv_pool": {"block_size": info.get("block_size"), "num_gpu_blocks": blocks - 1 if blocks else None},
        "vllm": {"version": version, "scheduler": info.get("scheduler"),
                 "async_scheduling": info.get("async_scheduling")},
        "summary": {"rows": rows},
    }


class Exporter:
    """Counters, gauges and the ITL histogram of a capture folder, for prometheus_client."""

    def __init__(self, capture: Path, *, window_s: float = 300.0, thrash_params: dict | None = None) -> None:
        self.capture = Path(capture)
        self.reader = ChunkReader(capture)
        self.trace = LiveTrace(window_s)
        self.window_s = window_s
        self.thrash_params = thrash_params or {}
        self.counts: dict[tuple[str, str], float] = defaultdict(float)   # (metric, label) -> total
        for reason in PreemptReason:
            self.counts["preemptions", reason.value] = 0.0
        for metric in ("recomputed_tokens", "reprefill_cached_tokens", "steps"):
            self.counts[metric, ""] = 0.0
        self.itl = {cause: [0] * len(ITL_BUCKETS) for cause in ITL_CAUSES}   # per bucket, not cumulative
        self.itl_sum = dict.fromkeys(ITL_CAUSES, 0.0)
        self.seen: set[tuple[str, str, str]] = set()    # (run_id, metric, key) already counted
        self.pool: dict | None = None
        self.verdict: str | None = None
        self.lock = threading.Lock()                     # poll() and a scrape's collect()
        self.folder = tempfile.TemporaryDirectory(prefix="kvtrace-live-")   # the live runs, rewritten each poll
        self.con: duckdb.DuckDBPyConnection | None = None
        self.signature: list | None = None

    def poll(self) -> int:
        """Read the chunks written since the last poll and update the figures; the chunks read.
        A folder's history is taken `BATCH_CHUNKS` at a time, so that memory holds no more of it
        than a window's worth and a batch."""
        num_read = 0
        while chunks := self.reader.new_chunks(BATCH_CHUNKS):
            self._update(chunks)
            num_read += len(chunks)
            if len(chunks) < BATCH_CHUNKS:
                break
        return num_read

    def _update(self, chunks: list[tuple[str, dict]]) -> None:
        for server, chunk in chunks:
            self.trace.add(server, chunk)
        newest = self.trace.newest_server()
        folder = Path(self.folder.name)
        runs: dict[Path, tuple] = {}   # run folder -> what its views depend on
        for server in self.trace.servers:
            run = folder / f"live-{server}"
            rows = self.trace.write_run(server, run, run.name, window_s=None, info={}, command="")
            runs[run] = tuple(t for t, n in rows.items() if n)
        if newest is not None:
            run = folder / "window"
            rows = self.trace.write_run(newest, run, "window", window_s=self.window_s,
                                        info=server_info(self.capture, newest), command="")
            runs[run] = tuple(t for t, n in rows.items() if n)
        for gone in set(folder.iterdir()) - set(runs):
            shutil.rmtree(gone)
        con = self._connect(runs)
        counts = con.execute("SELECT run_id, metric, label, key, value FROM _exporter_counts "
                             "WHERE run_id <> 'window'").fetchall()
        cursor = con.execute("SELECT * FROM _exporter_pool WHERE run_id = 'window'")
        pool = [dict(zip([d[0] for d in cursor.description], row)) for row in cursor.fetchall()]
        verdict = None
        if newest is not None:
            thrash = db.records(db.run_analysis(con, "thrash", **self.thrash_params))
            verdict = next((r["verdict"] for r in thrash if r["run_id"] == "window"), None)
        with self.lock:
            seen = set()
            for run_id, metric, label, key, value in counts:
                seen.add((run_id, metric, key))
                if (run_id, metric, key) in self.seen:
                    continue
                if metric == "itl":
                    bucket = next(i for i, bound in enumerate(ITL_BUCKETS) if value <= bound)
                    self.itl.setdefault(label, [0] * len(ITL_BUCKETS))[bucket] += 1
                    self.itl_sum[label] = self.itl_sum.get(label, 0.0) + value
                else:
                    self.counts[metric, label] += value
            self.seen = seen   # what left the window is never seen again
            self.pool = pool[0] if pool else self.pool
            self.verdict = verdict or self.verdict
        self.trace.prune()

    def _connect(self, runs: dict[Path, tuple]) -> duckdb.DuckDBPyConnection:
        """The connection over `runs`, made again only when what its views and runs table read
        changes (a run, a table that has rows, whether tokens carry their predecessors): the run
        folders are rewritten in place, and the helpers take a second to install."""
        signature = sorted((str(run), key) for run, key in runs.items())
        if self.con is None or signature != self.signature:
            if self.con is not None:
                self.con.close()
            self.con, self.signature = db.connect(list(runs)), signature
        return self.con

    def close(self) -> None:
        if self.con is not None:
            self.con.close()
            self.con = None
        self.folder.cleanup()

    def collect(self):
        """The metric families (prometheus_client's Collector protocol)."""
        with self.lock:
            preemptions = CounterMetricFamily("kvtrace_preemptions", "Preemptions decided by the scheduler, "
                                              "by how the victim gives up its KV (recompute, swap).", labels=["reason"])
            for (metric, label), value in sorted(self.counts.items()):
                if metric == "preemptions":
                    preemptions.add_metric([label], value)
            yield preemptions
            yield CounterMetricFamily("kvtrace_recomputed_tokens", "KV positions computed again after a "
                                      "recompute preemption (re-prefills).", value=self.counts["recomputed_tokens", ""])
            yield CounterMetricFamily("kvtrace_reprefill_cached_tokens", "Positions of re-prefills served by the "
                                      "prefix cache instead of computed again, when a preempted sequence resumed.",
                                      value=self.counts["reprefill_cached_tokens", ""])
            finished = CounterMetricFamily("kvtrace_requests_finished", "Sequences finished, by finish reason.",
                                           labels=["finish_reason"])
            for (metric, label), value in sorted(self.counts.items()):
                if metric == "requests_finished":
                    finished.add_metric([label], value)
            yield finished
            yield CounterMetricFamily("kvtrace_steps", "Engine steps.", value=self.counts["steps", ""])
            yield CounterMetricFamily("kvtrace_capture_chunks_read", "Capture chunk files read.",
                                      value=self.reader.num_read)
            itl = HistogramMetricFamily("kvtrace_itl_seconds", "Inter-token latency: the gap between consecutive "
                                        "tokens of a sequence, by cause (itl_cliffs.sql's rules).", labels=["cause"])
            for cause, counts in self.itl.items():
                cumulative, buckets = 0, []
                for bound, count in zip(ITL_BUCKETS, counts):
                    cumulative += count
                    buckets.append(("+Inf" if math.isinf(bound) else repr(bound), cumulative))
                itl.add_metric([cause], buckets, self.itl_sum[cause])
            yield itl
            if self.pool is not None:
                for name, text in POOL_GAUGES.items():
                    value = self.pool[f"{name}_blocks"]
                    if value is not None:
                        yield GaugeMetricFamily(f"kvtrace_kv_{name}_blocks", f"KV blocks {text}, after the last "
                                                "step's scheduling.", value=value)
            if self.verdict is not None:
                verdict = GaugeMetricFamily("kvtrace_thrash_verdict", f"thrash.sql's verdict on the last "
                                            f"{self.window_s:g} s: 1 for the verdict that holds.", labels=["verdict"])
                for name in VERDICTS:
                    verdict.add_metric([name], float(name == self.verdict))
                yield verdict
