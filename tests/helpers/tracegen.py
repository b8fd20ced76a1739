"""Hand-built traces for tests: meta.json plus Parquet chunks written from Python lists.

`write_run` writes any rows; `recompute_run` and `swap_run` write the two small golden runs that
the analysis tests work out by hand:

    block_size 4 (swap run: 2), steps of 0.25 s: step k runs [0.25k, 0.25(k+1)]
    A: arrives 0,      prompt 6, 4 tokens at 0.25 0.5 0.75 1.0   (steps 0 1 2 3), never preempted
    B: arrives 0.1875, prompt 4, 3 tokens at 0.5 1.25 1.5        (steps 1 4 5)
       preempted at step 2 (t 0.5) when it needs a block, readmitted at step 4 (t 1.0):
       recompute run: re-prefills 5 positions at step 4, 4 of them computed before;
       swap run: its 2 blocks swapped out (2 MB in 4 ms) and back in (2 MB in 2 ms).
Events carry their step's start time (as the recorder writes them), finish and free-at-finish its end.
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from kvtrace.trace.schema import OPTIONAL_TABLES, SCHEMA_VERSION, TABLES, token_predecessors

WORKLOAD_SHA = "a" * 64


def default_meta(run_id: str) -> dict:
    return {
        "run_id": run_id,
        "schema_version": SCHEMA_VERSION,
        "kvtrace_version": "0.1.0",
        "command": "kvtrace record traces/examples/tiny.jsonl --model tiny",
        "engine_config": {"model": "tiny", "block_size": 4, "num_gpu_blocks": 3, "num_cpu_blocks": 8,
                          "preemption_mode": "recompute", "preemption_policy": "newest",
                          "enable_prefix_caching": False, "max_num_seqs": 8, "max_num_batched_tokens": 64},
        "model": {"name": "tiny", "source": "preset", "dtype": "float32",
                  "shape": {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "head_dim": 16, "vocab": 512}},
        "device": {"type": "cpu", "name": "test cpu"},
        "kv_pool": {"num_gpu_blocks": 3, "block_size": 4, "bytes_per_block": 1_000_000, "num_cpu_blocks": 8,
                    "total_bytes": 3_000_000},
        "workload": {"path": "traces/examples/tiny.jsonl", "sha256": WORKLOAD_SHA, "num_requests": 2},
        "replay": {"mode": "wallclock", "time_scale": 1.0},
        "seed": 0,
        "started_at": "2025-01-01T00:00:00+00:00",
        "status": "completed",
        "error": None,
        "nvml": {"enabled": False, "reason": "cpu"},
        "summary": {"requests": 2, "tokens": 7, "steps": 6, "preemptions": 1, "duration_s": 1.5},
    }


def _merge(base: dict, overrides: dict) -> dict:
    out = copy.deepcopy(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _merge(out[key], value)
        else:
            out[key] = value
    return out


TOKEN_GAP_COLUMNS = ("prev_step", "prev_ts_s")   # schema 2: each token's predecessor


def with_token_gaps(rows: list[dict]) -> list[dict]:
    """Token rows with each one's predecessor in its sequence filled in (kvtrace.trace.schema's
    token_predecessors, as a writer of schema 2 does), where a row does not set them itself."""
    columns = {name: [row.get(name, 0 if name == "sample" else None) for row in rows]
               for name in ("req_id", "sample", "idx", "step", "ts_s")}
    prev_step, prev_ts_s = token_predecessors(*columns.values())
    return [{"prev_step": p, "prev_ts_s": t, **row} for row, p, t in zip(rows, prev_step, prev_ts_s)]


def write_table(run: Path, table: str, rows: list[dict], chunk_rows: int | None = None,
                token_gaps: bool = True) -> None:
    """Write `rows` as chunks of `table` (no chunk at all when there are no rows). Tokens get their
    predecessors filled in; `token_gaps=False` writes them without those columns, as a trace of
    schema 1 (before they existed) was written."""
    schema = TABLES[table] if table in TABLES else OPTIONAL_TABLES[table]
    if table == "tokens" and token_gaps:
        rows = with_token_gaps(rows)
    elif table == "tokens":
        schema = pa.schema([f for f in schema if f.name not in TOKEN_GAP_COLUMNS])
    folder = run / table
    folder.mkdir(parents=True, exist_ok=True)
    rows = [{"run_id": run.name, **row} for row in rows]
    size = chunk_rows or max(len(rows), 1)
    for part, start in enumerate(range(0, len(rows), size)):
        chunk = pa.Table.from_pylist(rows[start:start + size], schema=schema)
        pq.write_table(chunk, folder / f"part-{part:05d}.parquet")


def write_run(root: Path, run_id: str, *, requests: list[dict] = (), steps: list[dict] = (),
              kv_events: list[dict] = (), tokens: list[dict] = (), gpu_samples: list[dict] = (),
              meta: dict | None = None, chunk_rows: int | None = None, token_gaps: bool = True) -> Path:
    """A run folder `root/run_id` with meta.json (defaults merged with `meta`) and the tables;
    `token_gaps=False`: a trace of schema 1, whose tokens lack prev_step and prev_ts_s."""
    run = Path(root) / run_id
    run.mkdir(parents=True, exist_ok=True)
    meta = _merge(default_meta(run_id), meta or {})
    if not token_gaps:
        meta["schema_version"] = 1
    (run / "meta.json").write_text(json.dumps(meta, indent=2))
    tables = {"requests": requests, "steps": steps, "kv_events": kv_events, "tokens": tokens}
    for table, rows in tables.items():
        write_table(run, table, list(rows), chunk_rows, token_gaps)
    if gpu_samples:
        write_table(run, "gpu_samples", list(gpu_samples), chunk_rows)
    return run


# ------------------------------------------------------------------ the two golden runs

STEP_S = 0.25
STEP_COLUMNS = ("step", "device_ms", "running", "waiting", "swapped", "prefill_tokens", "decode_tokens",
                "recompute_tokens", "preemptions", "free_blocks", "used_blocks", "cached_blocks",
                "total_blocks", "kv_tokens")


def _steps(table: list[tuple]) -> list[dict]:
    rows = []
    for values in table:
        row = dict(zip(STEP_COLUMNS, values, strict=True))
        row["start_s"] = row["step"] * STEP_S
        row["end_s"] = (row["step"] + 1) * STEP_S
        rows.append(row)
    return rows


def _events(table: list[tuple]) -> list[dict]:
    """(step, at, kind, req_id, blocks, num_tokens, reason, extra) -> kv_events rows; `at` is
    'start' or 'end' of the step."""
    rows = []
    for seq, (step, at, kind, req_id, blocks, num_tokens, reason, extra) in enumerate(table):
        row = {"seq": seq, "step": step, "ts_s": (step + (at == "end")) * STEP_S, "kind": kind,
               "req_id": req_id, "sample": 0, "blocks": blocks, "num_blocks": len(blocks or []),
               "num_tokens": num_tokens, "bytes": 0, "duration_ms": None, "reason": reason,
               "num_cached_tokens": 0, "num_recomputed_tokens": 0, "src_blocks": None}
        row.update(extra)
        rows.append(row)
    return rows


def _tokens() -> list[dict]:
    emitted = {"A": [0, 1, 2, 3], "B": [1, 4, 5]}
    return [{"req_id": req_id, "sample": 0, "idx": idx, "token_id": 100 + step, "step": step,
             "ts_s": (step + 1) * STEP_S}
            for req_id, steps in emitted.items() for idx, step in enumerate(steps)]


def _requests(b_swaps: int, b_recomputed: int) -> list[dict]:
    common = {"sample": 0, "n": 1, "priority": 0, "finish_reason": "length", "prefix_hit_tokens": 0}
    return [
        {**common, "req_id": "A", "arrival_s": 0.0, "prompt_tokens": 6, "max_tokens": 4, "output_tokens": 4,
         "first_scheduled_s": 0.0, "first_token_s": 0.25, "finish_s": 1.0, "preemptions": 0, "swaps": 0,
         "recomputed_tokens": 0},
        {**common, "req_id": "B", "arrival_s": 0.1875, "prompt_tokens": 4, "max_tokens": 3, "output_tokens": 3,
         "first_scheduled_s": 0.25, "first_token_s": 0.5, "finish_s": 1.5, "preemptions": 1, "swaps": b_swaps,
         "recomputed_tokens": b_recomputed},
    ]


def recompute_run(root: Path, run_id: str = "rec", *, token_gaps: bool = True, **meta) -> Path:
    """The golden run in recompute mode: 3 device blocks of 4 positions (`token_gaps`: see write_run)."""
    steps = _steps([
        # step dev_ms run wait swp  pre dec rec pmt free used cached total kv
        (0, 200.0, 1, 0, 0, 6, 0, 0, 0, 1, 2, 0, 3, 6),
        (1, 160.0, 2, 0, 0, 4, 1, 0, 0, 0, 3, 0, 3, 11),
        (2, 100.0, 1, 1, 0, 0, 1, 0, 1, 1, 2, 0, 3, 8),
        (3, 100.0, 1, 1, 0, 0, 1, 0, 0, 0, 3, 0, 3, 9),
        (4, 150.0, 1, 0, 0, 5, 0, 4, 0, 1, 2, 0, 3, 5),
        (5, 100.0, 1, 0, 0, 0, 1, 0, 0, 1, 2, 0, 3, 6),
    ])
    events = _events([
        (0, "start", "admit", "A", None, 6, "new", {}),
        (0, "start", "alloc", "A", [0, 1], 0, "prefill", {}),
        (1, "start", "admit", "B", None, 4, "new", {}),
        (1, "start", "alloc", "B", [2], 0, "prefill", {}),
        (2, "start", "preempt", "B", [2], 4, "recompute", {}),
        (2, "start", "free", "B", [2], 0, "preempt", {}),
        (3, "start", "alloc", "A", [2], 0, "decode", {}),
        (3, "end", "finish", "A", None, 4, "length", {}),
        (3, "end", "free", "A", [0, 1, 2], 0, "finish", {}),
        (4, "start", "admit", "B", None, 5, "resume-recompute", {}),
        (4, "start", "alloc", "B", [0, 1], 0, "prefill", {}),
        (4, "start", "reprefill", "B", None, 5, None, {"num_recomputed_tokens": 4}),
        (5, "end", "finish", "B", None, 3, "length", {}),
        (5, "end", "free", "B", [0, 1], 0, "finish", {}),
    ])
    return write_run(root, run_id, requests=_requests(0, 4), steps=steps, kv_events=events,
                     tokens=_tokens(), meta=meta, token_gaps=token_gaps)


def swap_run(root: Path, run_id: str = "swp", *, token_gaps: bool = True, **meta) -> Path:
    """The golden run in swap mode: 6 device blocks of 2 positions, 1 MB each (`token_gaps`: see write_run)."""
    steps = _steps([
        # step dev_ms run wait swp  pre dec rec pmt free used cached total kv
        (0, 200.0, 1, 0, 0, 6, 0, 0, 0, 3, 3, 0, 6, 6),
        (1, 160.0, 2, 0, 0, 4, 1, 0, 0, 0, 6, 0, 6, 11),
        (2, 100.0, 1, 0, 1, 0, 1, 0, 1, 2, 4, 0, 6, 8),
        (3, 100.0, 1, 0, 1, 0, 1, 0, 0, 1, 5, 0, 6, 9),
        (4, 100.0, 1, 0, 0, 0, 1, 0, 0, 3, 3, 0, 6, 5),
        (5, 100.0, 1, 0, 0, 0, 1, 0, 0, 3, 3, 0, 6, 6),
    ])
    copy_out = {"src_blocks": [0, 1], "bytes": 2_000_000, "duration_ms": 4.0}
    copy_in = {"src_blocks": [0, 1], "bytes": 2_000_000, "duration_ms": 2.0}
    events = _events([
        (0, "start", "admit", "A", None, 6, "new", {}),
        (0, "start", "alloc", "A", [0, 1, 2], 0, "prefill", {}),
        (1, "start", "admit", "B", None, 4, "new", {}),
        (1, "start", "alloc", "B", [3, 4], 0, "prefill", {}),
        (1, "start", "alloc", "A", [5], 0, "decode", {}),
        (2, "start", "preempt", "B", [3, 4], 4, "swap", {}),
        (2, "start", "swap_out", "B", [3, 4], 4, None, copy_out),
        (2, "start", "free", "B", [3, 4], 0, "preempt", {}),
        (3, "start", "alloc", "A", [3], 0, "decode", {}),
        (3, "end", "finish", "A", None, 4, "length", {}),
        (3, "end", "free", "A", [0, 1, 2, 5, 3], 0, "finish", {}),
        (4, "start", "admit", "B", None, 0, "resume-swap", {}),
        (4, "start", "alloc", "B", [0, 1], 0, "swap_in", {}),
        (4, "start", "swap_in", "B", [0, 1], 4, None, copy_in),
        (4, "start", "alloc", "B", [2], 0, "decode", {}),
        (5, "end", "finish", "B", None, 3, "length", {}),
        (5, "end", "free", "B", [0, 1, 2], 0, "finish", {}),
    ])
    defaults = {"engine_config": {"block_size": 2, "num_gpu_blocks": 6, "preemption_mode": "swap"},
                "kv_pool": {"num_gpu_blocks": 6, "block_size": 2, "total_bytes": 6_000_000}}
    return write_run(root, run_id, requests=_requests(1, 0), steps=steps, kv_events=events,
                     tokens=_tokens(), meta=_merge(defaults, meta), token_gaps=token_gaps)
