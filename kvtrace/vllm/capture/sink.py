"""Columnar buffers of the capture and the chunk files they are written to.

The columns are those of kvtrace's trace tables (kvtrace/trace/schema.py; a test keeps the two equal)
less `run_id`, which the importer adds. Times are raw `time.monotonic()` seconds (the importer
rebases them on the run's origin): CLOCK_MONOTONIC is one clock for every process of the host, so
the driver's arrival clock and the EngineCore's step clock line up. A chunk is a pickle of
`{table: {column: list}}`, written to a hidden name and renamed into place, so a crash (a SIGKILL
included) leaves only whole chunks: at most the rows of the last couple of seconds are lost. Each
server's chunks are `chunks/<server id>_<part>_<first>_<last>_<arrivals>.pkl` (its identity is
`servers/<server id>.json`): the server, the chunk's number, the wall-clock span of its steps (Unix
seconds) and the requests that arrived in it, so that `kvtrace capture ls` and `capture run` know
what a chunk holds without reading it.
Besides the trace's tables a chunk may hold `arrivals`, the capture's own: one row per request when
the scheduler takes it, with its prompt's block hashes salted per capture (columns.py).

Retention keeps the folder bounded: after each chunk, the oldest whole chunks of the folder (every
server's) are removed while the chunks add up to more than `max_bytes`, or are older than
`max_age_s`; the newest chunk always stays. The folder's chunks are listed once, at start-up; later
the sink counts what it writes itself (a folder is meant for one server at a time).

There is no writer thread: the engine's own thread writes each chunk, synchronously, at the end of
a step's `update_from_output` (recorder.py): every `flush_seconds`, when a buffer reaches
`max_rows`, after a step that leaves the engine with nothing to do (a server between bursts keeps
nothing back), and at shutdown (`close`). A background writer thread was tried and measured +3 % on
the replay's wall time (docs/vllm.md; the vllm-capture benchmark), more than the writes themselves cost
(a pickle of a couple of seconds' rows). A failed write (a full disk, a removed folder, a permission
error) never stops vLLM: it stops the capture, with one line in vLLM's log; from then on the rows
are dropped, and the error is kept in `error` (done.json, where it can still be written).
"""
from __future__ import annotations

import logging
import os
import pickle
import re
import time
from collections import deque
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
# the capture's own table (not the trace's): one row per request the scheduler takes
ARRIVALS = ("req_id", "arrival_s", "prompt_tokens", "max_tokens", "priority", "block_hashes")
CHUNK_COLUMNS = {**COLUMNS, "arrivals": ARRIVALS}

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


class Sink:
    """Buffers rows as columns and writes them out in chunks."""

    def __init__(self, folder: Path, server_id: str, *, max_bytes: int = 4 * 1024**3, max_age_s: float = 7 * 86400,
                 log: logging.Logger | None = None, wall_minus_monotonic: float | None = None,
                 max_rows: int = 100_000, flush_seconds: float = 2.0) -> None:
        self.folder = Path(folder) / "chunks"
        self.folder.mkdir(parents=True, exist_ok=True)
        self.server_id = server_id
        self.max_rows = max_rows
        self.flush_seconds = flush_seconds
        self.max_bytes, self.max_age_s = max_bytes, max_age_s
        self.log = log or logging.getLogger("vllm.kvtrace.capture")
        self.part = 0
        self.wall_minus_monotonic = (time.time() - time.monotonic() if wall_minus_monotonic is None
                                     else wall_minus_monotonic)
        self.columns = self._empty()
        self.last_flush = time.monotonic()
        self.error: BaseException | None = None
        # (wall time written, bytes, path) of every chunk in the folder, oldest first
        self.kept: deque[tuple[float, int, Path]] = deque(sorted(self._listed()))
        self.num_bytes = sum(size for _, size, _ in self.kept)
        self.num_removed = 0

    @staticmethod
    def _empty() -> dict[str, dict[str, list]]:
        return {table: {c: [] for c in cols} for table, cols in CHUNK_COLUMNS.items()}

    def _listed(self):
        for path in self.folder.glob("*.pkl"):
            try:
                st = path.stat()
            except OSError:
                continue
            yield st.st_mtime, st.st_size, path

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
        self.columns = self._empty()
        if self.error is not None:
            return   # stopped: the rows are dropped
        part, self.part = self.part, self.part + 1
        steps = chunk.get("steps")
        now = time.monotonic()
        first, last = (min(steps["start_s"]), max(steps["end_s"])) if steps else (now, now)
        offset = self.wall_minus_monotonic
        name = f"{part:06d}_{first + offset:.3f}_{last + offset:.3f}_{len(chunk.get('arrivals', {}).get('req_id', ()))}"
        final = self.folder / f"{self.server_id}_{name}.pkl"
        tmp = self.folder / f".{self.server_id}_{name}.pkl.tmp"
        try:
            with open(tmp, "wb") as f:
                pickle.dump(chunk, f, protocol=4)
            os.replace(tmp, final)
            size = final.stat().st_size
        except Exception as exc:  # noqa: BLE001 (a full disk, a removed folder, no permission): stop, serve on
            self.stop(exc)
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            return
        self.kept.append((time.time(), size, final))
        self.num_bytes += size
        self.retain()

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
        self.error = exc
        self.log.warning("kvtrace capture stopped (vLLM serves on): cannot write into %s: %s", self.folder, exc)

    def close(self) -> None:
        self.flush()
