"""`kvtrace capture metrics`: a Prometheus exporter that follows a running server's capture folder.

`Exporter.poll` reads the chunks written since the last poll (kvtrace/vllm/follow.py), adds the rows
it has not seen yet (analyses/_exporter.sql: one row per trace row that adds to a counter, with its
identity) to counters that never go backwards, whatever the retention removes; the gauges are those
of the last step; the thrash verdict is thrash.sql's on the run of the last `window_s` seconds. Its
`collect` is a prometheus_client collector.

Each server of the folder (a data-parallel rank, a restarted server) has figures of its own, from its own
rows: its counters, its pool after its own last step, its verdict on its own last `window_s` seconds.
They carry the label `server`, the one `kvtrace capture run` of the folder gives it (fleet.labels over
the servers the folder keeps chunks of: `dp0`, `dp1`, else the server id); the figures of a folder of
one server have no such label, as before. The gauges and the verdict are those of the servers still
serving: a server that a later start of the same rank on the same host replaced (a restart) keeps its
counters, not its gauges.

A poll costs what is new, not the window: the tokens, nearly all of a busy server's rows, go into
the SQL once, in the poll that read them (each with its predecessor and the events and steps kept
around it, which is what its gap's cause needs); the window's run, read by the gauges and the
verdict, has none; the rows kept are pruned a tenth of the window at a time.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from engine.events import PreemptReason
from kvtrace.trace import db
from kvtrace.vllm import fleet
from kvtrace.vllm.follow import CaptureStatus, ChunkReader, LiveTrace, capture_status, server_info
from kvtrace.vllm.importer import read_json
from kvtrace.vllm.live import Server

if TYPE_CHECKING:   # duckdb is imported where a connection is made: not by every command's start-up
    import duckdb

# the upper bounds of the ITL histogram (s): vLLM's own inter-token latency buckets, from 1 ms
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
               5.0, 7.5, 10.0, 20.0, 40.0, 80.0, math.inf)
ITL_CAUSES = ("swap_wait", "preempted", "reprefill", "prefill_interference", "other")   # itl_cliffs.sql
VERDICTS = ("none", "occasional", "sustained")                                          # thrash.sql
POOL_GAUGES = {"used": "referenced by some sequence", "cached": "free, holding reusable prefix-cache KV",
               "free": "free (cached ones included)", "total": "in the pool"}   # pool.sql's columns
BATCH_CHUNKS = 64    # chunk files added to the figures at a time (a 2 s chunk each while the server is busy)


@dataclass
class Counts:
    """One server's counters and ITL histogram: what its rows added up (they never go backwards)."""

    totals: dict[tuple[str, str], float] = field(default_factory=lambda: defaultdict(float, {
        **{("preemptions", reason.value): 0.0 for reason in PreemptReason},
        **{(metric, ""): 0.0 for metric in ("recomputed_tokens", "reprefill_cached_tokens", "steps")}}))
    # per cause: the gaps per bucket (not cumulative), and their sum
    itl: dict[str, list[int]] = field(default_factory=lambda: {cause: [0] * len(ITL_BUCKETS) for cause in ITL_CAUSES})
    itl_sum: dict[str, float] = field(default_factory=lambda: dict.fromkeys(ITL_CAUSES, 0.0))


class Exporter:
    """Counters, gauges and the ITL histogram of a capture folder, for prometheus_client."""

    def __init__(self, capture: Path, *, window_s: float = 60.0, thrash_params: dict | None = None) -> None:
        self.capture = Path(capture)
        self.reader = ChunkReader(capture)
        self.trace = LiveTrace(window_s)
        self.window_s = window_s
        self.thrash_params = thrash_params or {}
        self.counts: dict[str, Counts] = {}   # per server id
        self.seen: set[tuple[str, str, str]] = set()    # (run_id, metric, key) already counted
        self.identities: dict[str, Server] = {}   # each server read so far, as its identity says
        self.labels: dict[str, str] = {}     # server id -> label, of each server the folder keeps chunks of
        self.serving: set[str] = set()       # of those, the servers no later start replaced: their gauges
        self.pools: dict[str, dict] = {}     # server id -> its pool after its last step
        self.verdicts: dict[str, str] = {}   # server id -> thrash.sql's verdict on its last window_s
        self.lock = threading.Lock()                     # poll() and a scrape's collect()
        self.folder = tempfile.TemporaryDirectory(prefix="kvtrace-live-")   # the live runs, rewritten each poll
        self.con: duckdb.DuckDBPyConnection | None = None
        self.signature: list | None = None
        self.dropped: dict[str, int] = {}   # per server: chunks its sink dropped (a disk slower than the capture)
        self.status: CaptureStatus | None = None   # whether the newest server captures, or why not

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
        self._follow()   # retention may have taken a server's last chunk since
        dropped = {}
        for path in (self.capture / "servers").glob("*.dropped.json"):
            said = read_json(path) or {}
            if isinstance(said.get("dropped_chunks"), int):
                dropped[path.name.removesuffix(".dropped.json")] = said["dropped_chunks"]
        status = capture_status(self.capture)
        with self.lock:
            self.dropped = dropped
            self.status = status
        return num_read

    def _follow(self) -> None:
        """The servers the folder keeps chunks of (the reader's last listing): each one's label and whether
        it still serves (no later start of its rank on its host); the trace forgets the others."""
        for server_id in self.reader.server_ids:
            if not (server_id in self.identities and self.identities[server_id].identity):   # read until it says
                self.identities[server_id] = Server(server_id, server_info(self.capture, server_id))
        kept = sorted((self.identities[s] for s in self.reader.server_ids), key=lambda s: (s.started or 0.0,
                                                                                          s.server_id))
        latest = {(s.host, s.rank): s.server_id for s in kept}   # oldest first: the latest start of each
        for gone in set(self.trace.servers) - self.reader.server_ids:
            self.trace.forget(gone)
        with self.lock:
            self.labels = dict(zip((s.server_id for s in kept), fleet.labels(kept))) if kept else {}
            self.serving = set(latest.values())

    def _update(self, chunks: list[tuple[str, dict]]) -> None:
        for server, chunk in chunks:
            self.trace.add(server, chunk)
        self._follow()
        folder = Path(self.folder.name)
        runs: dict[Path, tuple] = {}   # run folder -> what its views depend on
        for server in self.trace.servers:
            run = folder / f"live-{server}"
            rows = self.trace.write_run(server, run, run.name, window_s=None, info={}, command="", tokens="new")
            runs[run] = tuple(t for t, n in rows.items() if n)
            if server in self.serving:   # its gauges and verdict: its last window_s, on its own clock
                run = folder / f"window-{server}"
                rows = self.trace.write_run(server, run, run.name, window_s=self.window_s,
                                            info=server_info(self.capture, server), command="", tokens="none")
                runs[run] = tuple(t for t, n in rows.items() if n)
        for gone in set(folder.iterdir()) - set(runs):
            shutil.rmtree(gone)
        con = self._connect(runs)
        counts = con.execute("SELECT run_id, metric, label, key, value FROM _exporter_counts "
                             "WHERE starts_with(run_id, 'live-')").fetchall()
        cursor = con.execute("SELECT * FROM _exporter_pool WHERE starts_with(run_id, 'window-')")
        names = [d[0] for d in cursor.description]
        pools = {row[0].removeprefix("window-"): dict(zip(names, row)) for row in cursor.fetchall()}
        verdicts = {}
        if any(run.name.startswith("window-") for run in runs):
            thrash = db.records(db.run_analysis(con, "thrash", **self.thrash_params))
            verdicts = {r["run_id"].removeprefix("window-"): r["verdict"] for r in thrash
                        if r["run_id"].startswith("window-") and r["verdict"]}
        with self.lock:
            seen = set()
            for run_id, metric, label, key, value in counts:
                seen.add((run_id, metric, key))
                if (run_id, metric, key) in self.seen:
                    continue
                server = self.counts.setdefault(run_id.removeprefix("live-"), Counts())
                if metric == "itl":
                    bucket = next(i for i, bound in enumerate(ITL_BUCKETS) if value <= bound)
                    server.itl.setdefault(label, [0] * len(ITL_BUCKETS))[bucket] += 1
                    server.itl_sum[label] = server.itl_sum.get(label, 0.0) + value
                else:
                    server.totals[metric, label] += value
            self.seen = seen   # what left the window is never seen again
            self.pools.update(pools)
            self.verdicts.update(verdicts)
        self.trace.prune(every_s=self.window_s / 10)

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
            servers = [(label, self.counts.get(s) or Counts()) for s, label in self.labels.items()]
            serving = [(label, s) for s, label in self.labels.items() if s in self.serving]
            by = ["server"] if len(servers) > 1 else []   # one server: no label, as before servers had one

            def family(kind, name: str, text: str, *names: str):
                return kind(name, text + (", per server." if by else "."), labels=[*by, *names])

            def at(label: str, *values: str) -> list[str]:
                return [label, *values] if by else list(values)

            preemptions = family(CounterMetricFamily, "kvtrace_preemptions", "Preemptions decided by the scheduler, "
                                 "by how the victim gives up its KV (recompute, swap)", "reason")
            finished = family(CounterMetricFamily, "kvtrace_requests_finished", "Sequences finished, by finish "
                              "reason", "finish_reason")
            scalars = {metric: family(CounterMetricFamily, f"kvtrace_{metric}", text) for metric, text in (
                ("recomputed_tokens", "KV positions computed again after a recompute preemption (re-prefills)"),
                ("reprefill_cached_tokens", "Positions of re-prefills served by the prefix cache instead of "
                                            "computed again, when a preempted sequence resumed"),
                ("steps", "Engine steps"))}
            itl = family(HistogramMetricFamily, "kvtrace_itl_seconds", "Inter-token latency: the gap between "
                         "consecutive tokens of a sequence, by cause (itl_cliffs.sql's rules)", "cause")
            for label, counts in servers:
                for (metric, name), value in sorted(counts.totals.items()):
                    if metric in scalars:
                        scalars[metric].add_metric(at(label), value)
                    elif metric in ("preemptions", "requests_finished"):
                        (preemptions if metric == "preemptions" else finished).add_metric(at(label, name), value)
                for cause, per_bucket in counts.itl.items():
                    cumulative, buckets = 0, []
                    for bound, count in zip(ITL_BUCKETS, per_bucket):
                        cumulative += count
                        buckets.append(("+Inf" if math.isinf(bound) else repr(bound), cumulative))
                    itl.add_metric(at(label, cause), buckets, counts.itl_sum[cause])
            yield preemptions
            yield scalars["recomputed_tokens"]
            yield scalars["reprefill_cached_tokens"]
            yield finished
            yield scalars["steps"]
            yield CounterMetricFamily("kvtrace_capture_chunks_read", "Capture chunk files read.",
                                      value=self.reader.num_read)
            yield CounterMetricFamily("kvtrace_capture_chunks_skipped", "Files of the capture folder's chunks/ "
                                      "skipped as no chunk kvtrace reads (a pickle, a truncated or foreign file).",
                                      value=self.reader.num_unreadable)
            # the capture's health names a server by its id (capture ls's, its files' in servers/): the server
            # whose capture stepped aside recorded nothing, and so has no label of a run
            if self.status is not None:
                up = GaugeMetricFamily("kvtrace_capture_up", "1 while the newest server of the folder is "
                                       "capturing; 0 when its capture stepped aside (vLLM served unrecorded), "
                                       "refused to start (strict mode) or stopped on an error of its own, "
                                       "`reason` saying why in a word (its error.json); `server` its id.",
                                       labels=["server", "reason"])
                up.add_metric([self.status.server_id, self.status.reason], float(self.status.capturing))
                yield up
            dropped = CounterMetricFamily("kvtrace_capture_dropped_chunks", "Chunks the capture dropped because "
                                          "the disk was slower than it (the sink's queue was full), by server id.",
                                          labels=["server"])
            for server, count in sorted(self.dropped.items()):
                dropped.add_metric([server], count)
            yield dropped
            yield itl
            for name, text in POOL_GAUGES.items():
                gauge = family(GaugeMetricFamily, f"kvtrace_kv_{name}_blocks", f"KV blocks {text}, after the last "
                               "step's scheduling")
                for label, server in serving:
                    value = (self.pools.get(server) or {}).get(f"{name}_blocks")
                    if value is not None:
                        gauge.add_metric(at(label), value)
                if gauge.samples:
                    yield gauge
            verdict = family(GaugeMetricFamily, "kvtrace_thrash_verdict", f"thrash.sql's verdict on the last "
                             f"{self.window_s:g} s: 1 for the verdict that holds", "verdict")
            for label, server in serving:
                if server in self.verdicts:
                    for name in VERDICTS:
                        verdict.add_metric(at(label, name), float(name == self.verdicts[server]))
            if verdict.samples:
                yield verdict
