"""Columnar buffers of the capture and the chunk files they are written to.

The columns are those of kvtrace's trace tables (kvtrace/trace/schema.py; a test keeps the two equal)
less `run_id`, which the importer adds. Times are raw `time.monotonic()` seconds (the importer
rebases them on the run's origin): CLOCK_MONOTONIC is one clock for every process of the host, so
the driver's arrival clock and the EngineCore's step clock line up. A chunk is chunk_format.py's
file of `{table: {column: values}}` (typed columns behind a versioned header: reading one runs no
code), written to a hidden name and renamed into place, so a crash leaves only whole chunks. Each
server's chunks are `chunks/<server id>_<part>_<first>_<last>_<arrivals>.kvtc` (its identity is
`servers/<server id>.json`): the server, the chunk's number, the wall-clock span of its steps (Unix
seconds) and the requests that arrived in it, so that `kvtrace capture ls` and `capture run` know
what a chunk holds without reading it.
Besides the trace's tables a chunk may hold `arrivals`, the capture's own: one row per request when
the scheduler takes it, with its prompt's block hashes salted per capture (columns.py).

**No columns built and no write on the engine's thread.** The engine's thread hands each step's
rows over as they are (`add`: the step's outputs, events and row, which vLLM no longer changes; the
recorder's `build` turns them into columns, columns.py) and says when a chunk is due (`flush`: every
`flush_seconds`, after a step that leaves the engine with nothing to do, and at shutdown). A builder
thread builds the columns, step by step, while the engine waits for its model (a GPU's forward
releases the GIL; the builder's work a step is what building it inline would cost, never more than a
step's worth at a time), and hands a chunk over when one is due or a buffer reaches `max_rows`. A
writer thread encodes, compresses and writes the chunks, behind a queue of `queue_chunks` chunks: a
step never waits on the disk, and the builder never waits on it either, so what it has not built yet
is at most what the engine scheduled while it was busy. A disk slower than the capture for
long enough to fill the queue loses whole chunks, never parts of one: each is counted, the first
drop is said once in vLLM's log, and `servers/<server id>.dropped.json` keeps the count and the
spans lost (`kvtrace capture ls` shows them as gaps with their reason, the exporter as
`kvtrace_capture_dropped_chunks`). What a crash can lose: the chunks still queued and the rows of the
last `flush_seconds` (built or not). At shutdown `close` waits up to `close_timeout_s` for the queue to be written.

Retention keeps the folder bounded: after each chunk, the oldest whole chunks of the folder (every
server's) are removed while the chunks add up to more than `max_bytes`, or are older than
`max_age_s`; the newest chunk always stays. The folder's chunks are listed once, at start-up; later
the sink counts what it writes itself (a folder is meant for one server at a time).
A failed write (a full disk, a removed folder, a permission error) never stops vLLM: it stops the
capture, with one line in vLLM's log; from then on the rows are dropped, and the error is kept in
`error` (done.json, where it can still be written). An error of the builder's own (the capture's own
bug) drops the rows from then on and is kept in `build_error`, for the recorder to stop the capture
on the engine's thread (recorder.py's `fail`). Files and folders get files.py's modes.
"""
from __future__ import annotations

import logging
import queue
import re
import threading
import time
from array import array
from collections import deque
from collections.abc import Callable
from itertools import chain
from pathlib import Path

from kvtrace.vllm.capture import chunk_format
from kvtrace.vllm.capture.files import FILE_MODE, make_folder, write_file, write_json

COLUMNS = {
    "requests": ("req_id", "sample", "n", "priority", "arrival_s", "prompt_tokens", "max_tokens",
                 "output_tokens", "first_scheduled_s", "first_token_s", "finish_s", "finish_reason",
                 "preemptions", "swaps", "recomputed_tokens", "prefix_hit_tokens", "draft_tokens", "accepted_tokens",
                 "tier_hit_tokens"),
    "steps": ("step", "start_s", "end_s", "device_ms", "running", "waiting", "swapped", "prefill_tokens",
              "decode_tokens", "recompute_tokens", "preemptions", "free_blocks", "used_blocks",
              "cached_blocks", "total_blocks", "kv_tokens", "admission_stop", "draft_tokens", "accepted_tokens",
              "offload_bytes", "load_bytes", "tier_transfer_ms"),
    "kv_events": ("seq", "step", "ts_s", "kind", "req_id", "sample", "blocks", "num_blocks", "num_tokens",
                  "bytes", "duration_ms", "reason", "num_cached_tokens", "num_recomputed_tokens",
                  "src_blocks", "requester_req_id", "requester_sample", "victim_reason", "kv_group", "kv_group_blocks",
                  "tier", "tier_tokens"),
    "tokens": ("req_id", "sample", "idx", "token_id", "step", "ts_s"),
    "spec_decode": ("step", "ts_s", "req_id", "sample", "draft_tokens", "accepted_tokens", "lookahead_slots"),
}
# the capture's own table (not the trace's): one row per request the scheduler takes
ARRIVALS = ("req_id", "arrival_s", "prompt_tokens", "max_tokens", "priority", "block_hashes")
# a chunk's tokens row may stand for a run of a request's tokens (chunk format 2): `num_tokens` of them
# from `idx` on, their ids not kept (a speculative step delivers several); the reader expands it
# (importer.read_chunk), so that no reader sees the column
CHUNK_COLUMNS = {**COLUMNS, "tokens": (*COLUMNS["tokens"], "num_tokens"), "arrivals": ARRIVALS}

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
          "t": 1000**4, "tb": 1000**4, "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4}
_AGES = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_bytes(text: str, name: str) -> int:
    """`4GiB`, `500MB`, `1000000` -> bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].lower() not in _UNITS:
        raise ValueError(f"{name}={text!r}: expected a size such as 4GiB, 500MB or 1000000")
    return int(float(m[1]) * _UNITS[m[2].lower()])


def parse_age(text: str, name: str) -> float:
    """`7d`, `12h`, `90m`, `30s`, `600` -> seconds."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", text)
    if not m or m[2].lower() not in _AGES:
        raise ValueError(f"{name}={text!r}: expected an age such as 7d, 12h, 90m or 600 (seconds)")
    return float(m[1]) * _AGES[m[2].lower()]


_FLUSH = object()   # a builder's item: hand what is built over as a chunk
_DRAIN = object()   # and: say when every item before it is built (its Event)


def segment(values: list) -> array | tuple:
    """One step's new values of a column, sealed: numbers as a typed array, which is no container of
    objects, so that no collection walks them; anything else (strings, nulls, tuples of block ids) as a
    tuple, walked once, at its first collection, which then leaves it alone (it holds no container).
    A step's new tuples of numbers, a few dozen of a thousand values each at 1,024 running with drafts,
    made most of what the engine thread's young collections walked after the builder's turn. The writer
    joins a column's segments into one list of their values (chunk_format.encode), a float column's
    integers as floats, as its encoding of such a column would have them anyway. A list column's rows come
    as flat runs (chunk_format.Lists), joined into one."""
    kind = type(values[0])
    if kind is chunk_format.Lists:   # a list column's runs (the block ids: kept flat, chunk_format.Lists)
        return chunk_format.Lists.joined(values)
    if kind is int or kind is float:
        try:
            return array("q" if kind is int else "d", values)
        except (TypeError, OverflowError):   # a null, a string or a float among integers
            pass
    return tuple(values)


class Sink:
    """Buffers rows as columns, built on a thread of their own; a writer thread writes them out in chunks."""

    def __init__(self, folder: Path, server_id: str, *, build: Callable[[object], None] | None = None,
                 max_bytes: int = 4 * 1024**3, max_age_s: float = 7 * 86400,
                 log: logging.Logger | None = None, wall_minus_monotonic: float | None = None,
                 max_rows: int = 100_000, flush_seconds: float = 2.0, queue_chunks: int = 16,
                 file_mode: int = FILE_MODE, close_timeout_s: float = 30.0, meta: dict | None = None,
                 on_stop: Callable[[BaseException], None] | None = None) -> None:
        """`build(rows)`: writes what one `add` handed over into `columns` (on the builder thread);
        `on_stop(exc)`: called once, on the writer's thread, when a write fails and the sink stops (it
        says so in the folder: recorder.py writes error.json); an error of the builder's own is kept in
        `build_error` instead, for the recorder to stop on the engine's thread."""
        self.capture = Path(folder)
        self.build = build
        self.on_stop = on_stop
        self.folder = self.capture / "chunks"
        self.file_mode = file_mode
        make_folder(self.folder, file_mode)
        self.server_id = server_id
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.close_timeout_s = close_timeout_s
        self.meta = {"server_id": server_id, **(meta or {})}   # into every chunk's header
        self.log = log or logging.getLogger("vllm.kvtrace.capture")
        self.part = 0
        self.wall_minus_monotonic = (time.time() - time.monotonic() if wall_minus_monotonic is None
                                     else wall_minus_monotonic)
        self.columns: dict[str, dict[str, list]] = {}   # the builder's, as segments (_seal)
        self.num_rows: dict[str, int] = {}                  # each table's rows in them
        self.num_segments: dict[str, int] = {}              # and its segments
        self._empty()
        self.last_flush = time.monotonic()
        self.error: BaseException | None = None
        self.abandoned = False
        self.build_error: BaseException | None = None   # an error of the builder's own (not the disk's)
        self.build_s = 0.0                  # the builder thread's CPU time building columns
        # what the engine's thread handed over and the builder has not built yet (unbounded: building never
        # waits on the disk, and is less work than the steps that made it)
        self.rows: queue.SimpleQueue = queue.SimpleQueue()
        self.builder: threading.Thread | None = None
        # (wall time written, bytes, path) of every chunk in the folder, oldest first: the writer's
        self.kept: deque[tuple[float, int, Path]] = deque(sorted(self._listed()))
        self.num_bytes = sum(size for _, size, _ in self.kept)
        self.num_removed = 0
        self.num_written = 0
        self.queue: queue.Queue = queue.Queue(maxsize=queue_chunks)
        self.writer: threading.Thread | None = None
        # chunks lost to a full queue: their count, rows and spans [first part, last part, first, last]
        self.num_dropped = 0
        self.dropped_rows = 0
        self.dropped: list[list] = []
        self.dropped_said = 0        # the count dropped.json last said (the writer's)

    def _empty(self) -> None:
        """No rows built: every column empty."""
        self.columns = {table: {c: [] for c in cols} for table, cols in CHUNK_COLUMNS.items()}
        self.num_rows = dict.fromkeys(CHUNK_COLUMNS, 0)
        self.num_segments = dict.fromkeys(CHUNK_COLUMNS, 0)

    def _seal(self) -> None:
        """The rows just built, made one segment: in each column a step's new values become one segment at
        its end (`segment`), so that a column is a list of segments, a few a second, its values in them.

        A chunk's columns live for up to `flush_seconds` and end in the oldest generation, where every full
        collection of the server's heap walked each value of a flat list (hundreds of thousands at 1,024
        running: 20-25 ms a collection against vLLM's own 10-12)."""
        for table, cols in self.columns.items():
            sealed = self.num_segments[table]
            built = len(next(iter(cols.values()))) - sealed
            if built:
                self.num_rows[table] += built
                self.num_segments[table] = sealed + 1
                for values in cols.values():
                    values[sealed:] = (segment(values[sealed:]),)

    def _listed(self):
        for path in self.folder.glob(f"*{chunk_format.SUFFIX}"):
            try:
                st = path.stat()
            except OSError:
                continue
            yield st.st_mtime, st.st_size, path

    # ---- the engine's thread ---------------------------------------------------------------------------------
    def add(self, rows) -> None:
        """Hand one step's rows to the builder (never waits)."""
        if self.error is None and not self.abandoned:
            self._put_rows(rows)

    def flush_due(self, now: float) -> bool:
        """Whether `flush_seconds` have passed since the last chunk was handed over."""
        return now - self.last_flush >= self.flush_seconds

    def flush(self, wait_s: float = 0.0) -> None:
        """Hand the rows built by then to the writer as one chunk. A step's flush never waits (a full queue
        drops the chunk); `wait_s`: how long to wait for room instead (at shutdown)."""
        self.last_flush = time.monotonic()
        if self.error is None and not self.abandoned:
            self._put_rows((_FLUSH, wait_s))

    def _put_rows(self, item) -> None:
        if self.builder is None:
            builder = threading.Thread(target=self._build_chunks, name="kvtrace-capture-builder", daemon=True)
            try:
                builder.start()
            except RuntimeError:   # the interpreter is shutting down (atexit, Python 3.12+): no new thread;
                self._built(item)   # built here, where there is nothing left to stall
                return
            self.builder = builder
        self.rows.put(item)

    # ---- the builder's thread --------------------------------------------------------------------------------
    def _build_chunks(self) -> None:
        while True:
            item = self.rows.get()
            try:
                if item is None:
                    if self.abandoned:
                        self._empty()   # what an error of the capture's own may have left half-built
                    return
                if type(item) is tuple and item and item[0] is _DRAIN:
                    item[1].set()
                elif self.error is None and not self.abandoned:
                    self._built(item)
            except Exception as exc:  # noqa: BLE001 (an error of the capture's own: it stops, vLLM serves on)
                # the rows from here on are dropped; the recorder stops the capture at its next hook, on
                # the engine's thread, and says why (build_error)
                self._empty()
                self.build_error = self.error = exc
            # Let the step's rows go before waiting for the next: held through the wait (a step), its
            # outputs, events and lists outlived the collections meanwhile, each promoted to the oldest
            # generation, bringing on full collections of the server's heap that vLLM alone never needs
            # (a 25-35 ms pause every 50 steps at 1,024 running)
            item = None

    def _built(self, item) -> None:
        """One item handed over: a step's rows built into the columns, or a flush."""
        if type(item) is tuple and item and item[0] is _FLUSH:
            self._hand_over(item[1])
            return
        cpu = time.thread_time()
        self.build(item)
        self._seal()
        self.build_s += time.thread_time() - cpu
        if self.num_rows["tokens"] >= self.max_rows or self.num_rows["kv_events"] >= self.max_rows:
            self._hand_over(0.0)

    def _hand_over(self, wait_s: float) -> None:
        """The columns built so far, as one chunk, to the writer (`wait_s`: as flush's)."""
        chunk = {t: cols for t, cols in self.columns.items() if self.num_rows[t]}
        num_rows, arrivals = sum(self.num_rows.values()), self.num_rows["arrivals"]   # (a column holds segments)
        if not chunk:
            return
        self._empty()
        if self.error is not None:
            return   # stopped: the rows are dropped
        part, self.part = self.part, self.part + 1
        steps = chunk.get("steps")
        now = time.monotonic()
        first, last = ((min(chain.from_iterable(steps["start_s"])), max(chain.from_iterable(steps["end_s"])))
                       if steps else (now, now))
        offset = self.wall_minus_monotonic
        name = f"{self.server_id}_{part:06d}_{first + offset:.3f}_{last + offset:.3f}_{arrivals}{chunk_format.SUFFIX}"
        if self.writer is None:
            writer = threading.Thread(target=self._write_chunks, name="kvtrace-capture-writer", daemon=True)
            try:
                writer.start()
            except RuntimeError:   # the interpreter is shutting down (atexit, Python 3.12+): no new thread;
                self._write_chunk(name, part, chunk)   # written here, where there is nothing left to stall
                return
            self.writer = writer
        try:
            self.queue.put((name, part, chunk), timeout=wait_s or None, block=wait_s > 0)
        except queue.Full:
            self._drop(part, first + offset, last + offset, num_rows)

    def _drop(self, part: int, first: float, last: float, rows: int) -> None:
        if not self.num_dropped:
            self.log.warning("kvtrace capture: the disk is slower than the capture (%d chunks queued): whole "
                             "chunks are dropped from now on while it stays behind, counted in %s (vLLM serves on)",
                             self.queue.maxsize, self.capture / "servers" / f"{self.server_id}.dropped.json")
        self.num_dropped += 1
        self.dropped_rows += rows
        spans = self.dropped
        if spans and spans[-1][1] == part - 1:
            spans[-1][1], spans[-1][3] = part, last
        else:
            spans.append([part, part, first, last])
            del spans[:-100]   # the newest hundred spans; the counts keep the rest

    def close(self) -> None:
        """Build and write what was handed over, and wait (up to close_timeout_s) until the writer has written it all."""
        self.flush(wait_s=self.close_timeout_s)
        deadline = time.monotonic() + self.close_timeout_s
        if self.builder is not None:
            self.rows.put(None)
            self.builder.join(max(0.0, deadline - time.monotonic()))
            if self.builder.is_alive():
                self.log.warning("kvtrace capture: the rows of %d steps were not written at shutdown: they were "
                                 "not built in %.0f s", self.rows.qsize(), self.close_timeout_s)
                return
            self.builder = None
        if self.writer is None:
            return
        try:
            self.queue.put(None, timeout=max(0.0, deadline - time.monotonic()))
        except queue.Full:
            pass
        self.writer.join(max(0.0, deadline - time.monotonic()))
        if self.writer.is_alive():
            self.log.warning("kvtrace capture: %d chunks were not written at shutdown: the disk did not take them "
                             "in %.0f s", self.queue.qsize(), self.close_timeout_s)
        else:
            self.writer = None
        self._say_dropped()

    def abandon(self) -> None:
        """Stop without writing what is handed over and not yet written as a chunk (a capture stopped by an
        error of its own, which may have left half a row): the chunks already handed to the writer are
        still written, then the builder and the writer end. Never waits."""
        self.abandoned = True
        if self.builder is not None:
            self.rows.put(None)
        if self.writer is not None:
            try:
                self.queue.put_nowait(None)
            except queue.Full:
                pass   # a full queue: the writer writes it and then waits for nothing more (a daemon thread)

    def drain(self) -> None:
        """Wait until every step handed over has been built, and every chunk handed over written (or
        dropped by a stopped capture)."""
        if self.builder is not None:
            built = threading.Event()
            self.rows.put((_DRAIN, built))
            while not built.wait(0.1):
                if not self.builder.is_alive():
                    break
        if self.writer is not None:
            self.queue.join()

    # ---- the writer's thread ---------------------------------------------------------------------------------
    def _write_chunks(self) -> None:
        while True:
            item = self.queue.get()
            try:
                if item is None:
                    return
                if self.error is None:
                    self._write_chunk(*item)
                if self.dropped_said != self.num_dropped and self.error is None:
                    self._say_dropped()
            except Exception as exc:  # noqa: BLE001 (nothing of the writer's may reach vLLM)
                self.stop(exc)
            finally:
                self.queue.task_done()

    def _write_chunk(self, name: str, part: int, chunk: dict) -> None:
        final = self.folder / name
        try:
            data = chunk_format.encode(chunk, {**self.meta, "part": part}, segments=True)
            size = self._write_file(final, data)
        except Exception as exc:  # noqa: BLE001 (a full disk, a removed folder, no permission): stop, serve on
            self.stop(exc)
            return
        self.num_written += 1
        self.kept.append((time.time(), size, final))
        self.num_bytes += size
        self.retain()

    def _write_file(self, path: Path, data: bytes) -> int:
        """One chunk's bytes onto the disk (the seam a test or benchmark slows down)."""
        return write_file(path, data, self.file_mode)

    def _say_dropped(self) -> None:
        """servers/<server id>.dropped.json: the chunks a full queue dropped, for capture ls and the exporter."""
        if not self.num_dropped or self.error is not None:
            return
        self.dropped_said = count = self.num_dropped
        said = {"server_id": self.server_id, "dropped_chunks": count, "dropped_rows": self.dropped_rows,
                "reason": "the disk was slower than the capture (its queue of "
                          f"{self.queue.maxsize} chunks was full)",
                "spans": [{"parts": [a, b], "first": f, "last": t} for a, b, f, t in list(self.dropped)]}
        try:
            write_json(self.capture, f"servers/{self.server_id}.dropped.json", said, self.file_mode)
        except OSError:
            pass   # the disk that is behind; the log said so

    def retain(self) -> None:
        """Remove the oldest whole chunks while over the budget or the age limit; keep the newest."""
        oldest_kept = time.time() - self.max_age_s
        kept = self.kept
        while len(kept) > 1 and (self.num_bytes > self.max_bytes or kept[0][0] < oldest_kept):
            _, size, path = kept.popleft()
            self.num_bytes -= size
            try:
                path.unlink(missing_ok=True)
            except OSError as exc:
                self.stop(exc)
                return
            self.num_removed += 1

    def stop(self, exc: BaseException) -> None:
        if self.error is not None:
            return
        self.log.warning("kvtrace capture stopped (vLLM serves on): cannot write into %s: %s", self.folder, exc)
        self.error = exc
        if self.on_stop is not None:
            try:
                self.on_stop(exc)
            except Exception:  # noqa: BLE001 (the disk that stopped the sink may refuse this too)
                pass
