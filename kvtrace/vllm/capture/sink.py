"""Columnar buffers of the capture and the chunk files they are written to.

The columns are those of kvtrace's trace tables (kvtrace/trace/schema.py; a test keeps the two equal)
less `run_id`, which the importer adds. Times are raw `time.monotonic()` seconds (the importer
rebases them on the run's origin): CLOCK_MONOTONIC is one clock for every process of the host, so
the driver's arrival clock and the EngineCore's step clock line up. A chunk is a pickle of
`{table: {column: list}}`, written to a hidden name and renamed into place, so a crash leaves only
whole chunks.

There is no writer thread: the engine's own thread writes each chunk, synchronously, at the end of
a step's `update_from_output` (scheduler.py): every `flush_seconds`, when a buffer reaches
`max_rows`, after a step that leaves the engine with nothing to do (a server between bursts keeps
nothing back), and at shutdown (`close`). A background writer thread was tried and measured +3 % on
the replay's wall time (docs/vllm.md; the vllm-capture benchmark), more than the writes themselves cost
(a pickle of a couple of seconds' rows). A failed write (a full disk) does not stop vLLM: the error
is kept in `error` and reported in the capture's done.json.
"""
from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

COLUMNS = {
    "requests": ("req_id", "sample", "n", "priority", "arrival_s", "prompt_tokens", "max_tokens",
                 "output_tokens", "first_scheduled_s", "first_token_s", "finish_s", "finish_reason",
                 "preemptions", "swaps", "recomputed_tokens", "prefix_hit_tokens"),
    "steps": ("step", "start_s", "end_s", "device_ms", "running", "waiting", "swapped", "prefill_tokens",
              "decode_tokens", "recompute_tokens", "preemptions", "free_blocks", "used_blocks",
              "cached_blocks", "total_blocks", "kv_tokens", "admission_stop"),
    "kv_events": ("seq", "step", "ts_s", "kind", "req_id", "sample", "blocks", "num_blocks", "num_tokens",
                  "bytes", "duration_ms", "reason", "num_cached_tokens", "num_recomputed_tokens",
                  "src_blocks", "requester_req_id", "requester_sample", "victim_reason"),
    "tokens": ("req_id", "sample", "idx", "token_id", "step", "ts_s"),
}


class Sink:
    """Buffers rows as columns and writes them out in chunks."""

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

    def maybe_flush(self, now: float) -> None:
        if (now - self.last_flush >= self.flush_seconds
                or len(self.columns["tokens"]["ts_s"]) >= self.max_rows
                or len(self.columns["kv_events"]["seq"]) >= self.max_rows):
            self.flush()

    def flush(self) -> None:
        self.last_flush = time.monotonic()
        chunk = {t: cols for t, cols in self.columns.items() if next(iter(cols.values()))}
        if not chunk:
            return
        self.columns = {table: {c: [] for c in cols} for table, cols in COLUMNS.items()}
        part, self.part = self.part, self.part + 1
        try:
            final = self.folder / f"{self.prefix}-{part:06d}.pkl"
            tmp = self.folder / f".{self.prefix}-{part:06d}.pkl.tmp"
            with open(tmp, "wb") as f:
                pickle.dump(chunk, f, protocol=4)
            os.replace(tmp, final)
        except Exception as exc:  # a full disk: the capture says so at shutdown; vLLM keeps serving
            self.error = exc

    def close(self) -> None:
        self.flush()
