"""Columnar buffers of the capture and the chunk files a background thread writes.

The columns are those of kvtrace's trace tables (kvtrace/schema.py; a test keeps the two equal)
less `run_id`, which the importer adds. Times are raw `time.monotonic()` seconds (the importer
rebases them on the run's origin): CLOCK_MONOTONIC is one clock for every process of the host, so
the driver's arrival clock and the EngineCore's step clock line up. A chunk is a pickle of
`{table: {column: list}}`, written to a hidden name and renamed into place, so a crash leaves only
whole chunks; one closes every `flush_seconds` at a step, or when a buffer reaches `max_rows`, and
the writer thread closes one itself when the engine has idled that long (a server between bursts),
under `lock`, which the engine holds while it appends a step.
"""
from __future__ import annotations

import os
import pickle
import queue
import threading
import time
from pathlib import Path

COLUMNS = {
    "requests": ("req_id", "sample", "n", "priority", "arrival_s", "prompt_tokens", "max_tokens",
                 "output_tokens", "first_scheduled_s", "first_token_s", "finish_s", "finish_reason",
                 "preemptions", "swaps", "recomputed_tokens", "prefix_hit_tokens"),
    "steps": ("step", "start_s", "end_s", "device_ms", "running", "waiting", "swapped", "prefill_tokens",
              "decode_tokens", "recompute_tokens", "preemptions", "free_blocks", "used_blocks",
              "cached_blocks", "total_blocks", "kv_tokens"),
    "kv_events": ("seq", "step", "ts_s", "kind", "req_id", "sample", "blocks", "num_blocks", "num_tokens",
                  "bytes", "duration_ms", "reason", "num_cached_tokens", "num_recomputed_tokens",
                  "src_blocks"),
    "tokens": ("req_id", "sample", "idx", "token_id", "step", "ts_s"),
}


class Sink:
    """Buffers rows as columns and hands closed chunks to a writer thread."""

    def __init__(self, folder: Path, *, max_rows: int = 100_000, flush_seconds: float = 2.0) -> None:
        self.folder = Path(folder) / "chunks"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self.prefix = f"{os.getpid()}"
        self.part = 0
        self.columns = {table: {c: [] for c in cols} for table, cols in COLUMNS.items()}
        self.last_flush = time.monotonic()
        self.error: BaseException | None = None
        self.lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue()
        self._thread = threading.Thread(target=self._write_loop, name="kvtrace-capture-writer", daemon=True)
        self._thread.start()

    def maybe_flush(self, now: float) -> None:
        if (now - self.last_flush >= self.flush_seconds
                or len(self.columns["tokens"]["ts_s"]) >= self.max_rows
                or len(self.columns["kv_events"]["seq"]) >= self.max_rows):
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        chunk = {t: cols for t, cols in self.columns.items() if next(iter(cols.values()))}
        if chunk:
            self.columns = {table: {c: [] for c in cols} for table, cols in COLUMNS.items()}
            self._queue.put((self.part, chunk))
            self.part += 1

    def close(self) -> None:
        with self.lock:
            self.flush()
        self._queue.put(None)
        self._thread.join()

    def _write_loop(self) -> None:
        while True:
            try:
                item = self._queue.get(timeout=self.flush_seconds)
            except queue.Empty:   # the engine idles: close what its last steps buffered
                with self.lock:
                    if time.monotonic() - self.last_flush >= self.flush_seconds:
                        self.flush()
                continue
            if item is None:
                return
            part, chunk = item
            try:
                final = self.folder / f"{self.prefix}-{part:06d}.pkl"
                tmp = self.folder / f".{self.prefix}-{part:06d}.pkl.tmp"
                with open(tmp, "wb") as f:
                    pickle.dump(chunk, f, protocol=4)
                os.replace(tmp, final)
            except BaseException as exc:  # a full disk: the capture says so at shutdown
                self.error = exc
