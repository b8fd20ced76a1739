"""The Parquet tracer: buffers the engine's step records and writes the trace in closed chunks.

A chunk closes when a table's buffer reaches `max_rows` or, at a step, when `flush_seconds` have
passed since the last chunk: a SIGKILL loses at most the steps of those last seconds (while the engine
idles between arrivals nothing new is buffered, and what the last steps buffered waits for the next
step). Each buffer of the chunk becomes a part of its table (tables.py and tokens_table.py make
them) that a thread of the writer's own writes to a hidden temporary name, then renames into place,
so a reader (or a crash) never sees half a file. The words (trace chunk, token grid, leap):
docs/glossary.md.
"""
from __future__ import annotations

import os
import queue
import threading
import time
from pathlib import Path

import pyarrow as pa

from engine.events import KVEvent, RequestStats, StepRecord
from engine.sim.leap import DecodeLeap
from kvtrace.record import tables
from kvtrace.record.tokens_table import RequestNumbers, TokenGrids, TokensTable
from kvtrace.trace.schema import TABLES, write_parquet

# the order a chunk's tables are handed to the writer thread: the slowest to write first, so that
# its writing overlaps the making of the others where the engine's thread makes them
_WRITING_ORDER = ("tokens", "kv_events", "steps", "requests", "spec_decode", "gpu_samples")


class TraceWriter:
    """A `Tracer` (engine/events.py) that writes the trace tables of one run folder."""

    def __init__(self, run_dir: Path, run_id: str, *, record_token_ids: bool = True,
                 max_rows: int = 200_000, flush_seconds: float = 2.0, engine_makes_tables: bool = False,
                 kv_cache_groups: bool = False) -> None:
        """Who makes a chunk's tables from its buffers (the writer thread always writes them):
        - the writer thread (`engine_makes_tables` false): a real engine's steps never wait for it;
        - the engine's thread, at the flush (true: for a simulated engine, whose time is virtual). The
          making is Python work, which in a second thread competes with the engine's for the
          interpreter; the writing (Parquet's encoding) holds no interpreter lock. The cost of either
          way for the simulator is in benchmarks/log/2026-12.md (2026-12-05).
        `kv_cache_groups`: a model of several KV-cache groups (or a window), whose events carry their groups."""
        self.run_dir = Path(run_dir)
        self.run_id = run_id
        self.record_token_ids = record_token_ids
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self.engine_makes_tables = engine_makes_tables
        self.kv_cache_groups = kv_cache_groups
        # The buffers of the chunk being filled (tables.py says what each holds). The engine's thread
        # fills them; gpu_samples come from the NVML thread, under `_lock`.
        self._steps: list[StepRecord | DecodeLeap] = []
        self._events: list[KVEvent | DecodeLeap] = []
        self._num_events = 0   # the rows of `_events` but evictions (a leap's allocs each one)
        self._requests: list[RequestStats] = []
        self._drafting: list[StepRecord] = []   # speculative decoding: the steps that verified drafts
        self._tokens = TokenGrids()
        self._gpu_samples: dict[str, list] = {c: [] for c in TABLES["gpu_samples"].names if c != "run_id"}
        self._lock = threading.Lock()
        self._last_flush = time.monotonic()
        self._req_numbers = RequestNumbers()
        self._tokens_table = TokensTable(self._req_numbers, run_id)
        self._part = {name: 0 for name in (*TABLES, "spec_decode")}   # each table's next part number
        # the writer thread's; read once it has stopped (spec_decode: a run that drafts, its folder made then)
        self.rows_written = {name: 0 for name in (*TABLES, "spec_decode")}
        # (table name, part number, its buffer or its table made) for the writer thread; None: stop
        self._queue: queue.Queue[tuple[str, int, object] | None] = queue.Queue()
        self._error: BaseException | None = None   # the first failure, reported on the engine's thread
        for name in TABLES:
            if name != "gpu_samples":
                (self.run_dir / name).mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._write_loop, name="kvtrace-writer", daemon=True)
        self._thread.start()

    # ---- the Tracer protocol ------------------------------------------------------------
    def on_step(self, r: StepRecord) -> None:
        """Buffer one step: its record and events as they are (the engine hands them over once and
        never changes them again), its tokens as a one-step grid."""
        self._steps.append(r)
        self._events += r.events
        self._num_events += len(r.events)
        num_tokens = len(r.token_req_ids)
        t = self._tokens
        if num_tokens:
            t.num.append(num_tokens)
            t.steps.append(1)
            t.step.append(r.step)
            t.ts_s.append(r.end_s)
            t.req += map(self._req_numbers.__getitem__, r.token_req_ids)
            t.sample += r.token_samples
            t.idx += r.token_idx
            if self.record_token_ids:
                t.token_id += r.token_ids
            t.num_rows += num_tokens
        if r.finished:
            t.finished += [(stats.req_id, stats.sample) for stats in r.finished]
            self._requests += r.finished
        if r.drafts:   # (None: a run that does not draft)
            self._drafting.append(r)
        self._flush_if_due()

    def on_decode_leap(self, w: DecodeLeap) -> None:
        """Buffer a leap (simulated decode-only steps taken at once) as `on_step` would buffer its
        records: the leap itself in the steps buffer and, if it allocated blocks, in the events
        buffer, and its tokens as one grid (every running sequence's token, step after step)."""
        self._steps.append(w)
        if w.allocs:
            self._events.append(w)
            self._num_events += len(w.allocs)
        if w.copy_events:   # a host KV tier's stores that finished in its steps
            self._events += w.copy_events
            self._num_events += len(w.copy_events)
        k, n = w.num_steps, w.num_running
        t = self._tokens
        t.num.append(n)
        t.steps.append(k)
        t.step.append(w.first_step)
        t.ts_s += w.end_s
        t.req += map(self._req_numbers.__getitem__, w.token_req_ids)
        t.sample += w.token_samples
        t.idx += w.first_token_idx
        if self.record_token_ids:
            t.token_id += [None] * n   # the simulator's placeholders are recorded as null
        t.num_rows += n * k
        self._flush_if_due()

    def _flush_if_due(self) -> None:
        """Close the chunk when `flush_seconds` have passed since the last or a buffer holds `max_rows`."""
        if (time.monotonic() - self._last_flush >= self.flush_seconds
                or self._tokens.num_rows >= self.max_rows or self._num_events >= self.max_rows):
            self.flush()

    def add_request(self, stats: RequestStats) -> None:
        self._requests.append(stats)

    def add_gpu_sample(self, row: dict) -> None:
        with self._lock:
            for name, values in self._gpu_samples.items():
                values.append(row[name])

    # ---- chunks -------------------------------------------------------------------------
    def flush(self) -> None:
        """Close a chunk: each non-empty buffer is handed to the writer thread as the next part of its
        table, as it is or (`engine_makes_tables`) as its table, made here, one table after another
        (_WRITING_ORDER). Raises if writing the trace has failed."""
        self._last_flush = time.monotonic()
        for name, buffer in self._take_buffers():
            if self._error is not None:
                break
            part = self._part[name]
            self._part[name] += 1
            if self.engine_makes_tables:
                try:
                    buffer = self._make_table(name, buffer)
                except Exception as exc:
                    self._error = exc
                    break
            self._queue.put((name, part, buffer))
        if self._error is not None:
            raise RuntimeError(f"writing the trace failed: {self._error}") from self._error

    def close(self) -> None:
        """Flush everything and wait until every chunk is on disk."""
        try:
            self.flush()
        finally:
            self._queue.put(None)
            self._thread.join()
        if self._error is not None:
            raise RuntimeError(f"writing the trace failed: {self._error}") from self._error

    def _take_buffers(self) -> list[tuple[str, object]]:
        """The non-empty buffers, (table name, buffer) in _WRITING_ORDER, each replaced by an empty one
        (the tokens' finished sequences stay until a tokens chunk takes them)."""
        taken = {}
        if self._tokens.num:
            taken["tokens"], self._tokens = self._tokens, TokenGrids()
        if self._events:
            taken["kv_events"], self._events, self._num_events = self._events, [], 0
        if self._steps:
            taken["steps"], self._steps = self._steps, []
        if self._requests:
            taken["requests"], self._requests = self._requests, []
        if self._drafting:
            taken["spec_decode"], self._drafting = self._drafting, []
        with self._lock:
            if self._gpu_samples["ts_s"]:
                taken["gpu_samples"] = self._gpu_samples
                self._gpu_samples = {c: [] for c in self._gpu_samples}
        return [(name, taken[name]) for name in _WRITING_ORDER if name in taken]

    def _make_table(self, name: str, buffer) -> pa.Table:
        """A chunk's buffer as its table: in the chunks' order for the tokens (TokensTable)."""
        if name == "tokens":
            return self._tokens_table.make(buffer)
        if name == "kv_events":
            return tables.kv_events_table(buffer, self.run_id, kv_cache_groups=self.kv_cache_groups)
        if name == "steps":
            return tables.steps_table(buffer, self.run_id)
        if name == "requests":
            return tables.requests_table(buffer, self.run_id)
        if name == "spec_decode":
            return tables.spec_decode_table(buffer, self.run_id)
        return tables.gpu_samples_table(buffer, self.run_id)

    def _write_loop(self) -> None:
        """The writer thread: each part's table made (unless made already) and written, in the order
        handed over; after a failure, the rest is dropped (the engine's thread reports it)."""
        while (item := self._queue.get()) is not None:
            if self._error is not None:
                continue
            name, part, content = item
            try:
                table = content if self.engine_makes_tables else self._make_table(name, content)
                self._store(name, part, table)
            except BaseException as exc:
                self._error = exc

    def _store(self, name: str, part: int, table: pa.Table) -> None:
        """Write the part under a hidden name, then rename it into place."""
        folder = self.run_dir / name
        folder.mkdir(exist_ok=True)
        final = folder / f"part-{part:05d}.parquet"
        tmp = folder / f".part-{part:05d}.parquet.tmp"
        write_parquet(table, tmp)
        os.replace(tmp, final)
        self.rows_written[name] += table.num_rows
