"""How fast do the analyses run on a big trace? Writes a synthetic run of ~10 million KV events
(with the tokens, steps and requests that go with them), then times `kvtrace sql` on it.

    python benchmarks/trace_scale.py                       # 10M events, thrash + itl_cliffs
    python benchmarks/trace_scale.py --events 2e6 --analyses summary itl_cliff_summary

The run is shaped like a thrashing recompute-mode replay with prefix caching: ~64 sequences
running, prompts of 128-1024 tokens, 16-160 output tokens, block size 16, on average 1.2
recompute preemptions per sequence (each waits ~30 steps, then re-prefills its history in one
step), and an `evict` event for most blocks allocated, which is what makes a KV trace long.
Steps last 8 ms plus 12 us per prefill token, so prompts arriving slow down everyone's decode.
Everything is built with numpy and written as closed chunk files, as the recorder writes them.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace import db  # noqa: E402
from kvtrace.schema import SCHEMA_VERSION, TABLES  # noqa: E402

BLOCK_SIZE = 16
EVENTS_PER_SEQUENCE = 98           # measured on this generator's shape, to size the run
KINDS = ["admit", "alloc", "evict", "preempt", "free", "reprefill", "finish"]
REASONS = ["", "new", "prefill", "decode", "recompute", "preempt", "resume-recompute", "finish", "length"]


def _strings(codes: np.ndarray, names: list[str]) -> pa.Array:
    return pa.DictionaryArray.from_arrays(pa.array(codes, pa.int32()), pa.array(names)).cast(pa.string())


def _write(run: Path, table: str, columns: dict[str, object], chunk_rows: int) -> int:
    schema = TABLES[table]
    n = len(next(iter(columns.values())))
    arrays = []
    for field in schema:
        if field.name == "run_id":
            arrays.append(_strings(np.zeros(n, dtype=np.int32), [run.name]))
        elif field.name in columns:
            value = columns[field.name]
            arrays.append(value if isinstance(value, pa.Array) else pa.array(value, field.type))
        else:
            arrays.append(pa.nulls(n, field.type))
    full = pa.Table.from_arrays(arrays, schema=schema)
    (run / table).mkdir(parents=True)
    for part, start in enumerate(range(0, n, chunk_rows)):
        pq.write_table(full.slice(start, chunk_rows), run / table / f"part-{part:05d}.parquet")
    return n


def generate(run: Path, target_events: int, seed: int, chunk_rows: int) -> dict[str, int]:
    rng = np.random.default_rng(seed)
    num_seqs = max(target_events // EVENTS_PER_SEQUENCE, 10)
    prompt = rng.integers(128, 1025, num_seqs)
    output = rng.integers(16, 161, num_seqs)
    # admissions at ~0.47 per step keep ~64 sequences running (each lives ~136 steps)
    admit_step = np.sort(rng.integers(0, int(num_seqs / 0.47), num_seqs))

    # ---- tokens: one per step while running; a preemption before token j delays it by `wait` steps
    offsets = np.concatenate([[0], np.cumsum(output)])
    tok_seq = np.repeat(np.arange(num_seqs), output)
    tok_idx = np.arange(len(tok_seq)) - offsets[tok_seq]
    num_preempt = np.minimum(rng.poisson(1.2, num_seqs), output - 1)
    pre_seq = np.repeat(np.arange(num_seqs), num_preempt)
    pre_pos = 1 + (rng.random(len(pre_seq)) * (output[pre_seq] - 1)).astype(np.int64)
    key = np.unique(pre_seq * 1_000_000 + pre_pos)
    pre_seq, pre_pos = key // 1_000_000, key % 1_000_000
    wait = rng.geometric(1 / 30, len(pre_seq))
    extra = np.zeros(len(tok_seq), dtype=np.int64)
    extra[offsets[pre_seq] + pre_pos] = wait
    cum = np.cumsum(extra)
    tok_step = admit_step[tok_seq] + tok_idx + cum - cum[offsets[tok_seq]]
    num_steps = int(tok_step.max()) + 1

    pre_at = tok_step[offsets[pre_seq] + pre_pos - 1] + 1        # step that preempts it
    resume_at = tok_step[offsets[pre_seq] + pre_pos]             # step that re-prefills it
    held_tokens = prompt[pre_seq] + pre_pos - 1                   # KV positions held when preempted
    held_blocks = -(-held_tokens // BLOCK_SIZE)
    prompt_blocks = -(-prompt // BLOCK_SIZE)
    last_tok = offsets[1:] - 1
    finish_step = tok_step[last_tok]
    final_blocks = -(-(prompt + output - 1) // BLOCK_SIZE)
    decode_alloc = (tok_idx >= 1) & ((prompt[tok_seq] + tok_idx - 1) % BLOCK_SIZE == 0)

    # ---- steps
    def per_step(at: np.ndarray, weights=None) -> np.ndarray:
        return np.bincount(at, weights=weights, minlength=num_steps)[:num_steps]

    prefill = per_step(admit_step, prompt) + per_step(resume_at, held_tokens + 1)
    recompute = per_step(resume_at, held_tokens)
    emitted = per_step(tok_step)
    decode = emitted - per_step(admit_step) - per_step(resume_at)
    preemptions = per_step(pre_at)
    waiting = np.cumsum(per_step(pre_at) - per_step(resume_at))
    used = np.cumsum(per_step(admit_step, prompt_blocks) + per_step(tok_step[decode_alloc])
                     - per_step(pre_at, held_blocks) + per_step(resume_at, held_blocks)
                     - per_step(finish_step + 1, final_blocks))
    total_blocks = int(np.quantile(used, 0.9))
    used = np.minimum(used, total_blocks).astype(np.int64)
    duration_ms = 8.0 + 0.012 * prefill + 0.02 * emitted + rng.gamma(2.0, 0.5, num_steps)
    end_s = np.cumsum(duration_ms) / 1000
    start_s = end_s - duration_ms / 1000
    free = total_blocks - used
    steps = {
        "step": np.arange(num_steps), "start_s": start_s, "end_s": end_s, "device_ms": duration_ms * 0.9,
        "running": emitted, "waiting": waiting, "swapped": np.zeros(num_steps, dtype=np.int64),
        "prefill_tokens": prefill.astype(np.int64), "decode_tokens": decode.astype(np.int64),
        "recompute_tokens": recompute.astype(np.int64), "preemptions": preemptions,
        "free_blocks": free, "used_blocks": used, "cached_blocks": (free * 0.8).astype(np.int64),
        "total_blocks": np.full(num_steps, total_blocks),
        "kv_tokens": (used * BLOCK_SIZE * rng.uniform(0.85, 0.97, num_steps)).astype(np.int64),
    }

    # ---- kv_events: (step, at_end, kind, reason, seq, num_blocks, num_tokens, recomputed)
    parts = []

    def add(step, at_end, kind, reason, seq, num_blocks, num_tokens, recomputed=0):
        n = len(step)
        parts.append([np.asarray(step), np.full(n, at_end), np.full(n, KINDS.index(kind)),
                      np.full(n, REASONS.index(reason)), np.asarray(seq),
                      np.broadcast_to(num_blocks, n), np.broadcast_to(num_tokens, n), np.broadcast_to(recomputed, n)])

    seqs = np.arange(num_seqs)
    add(admit_step, 0, "admit", "new", seqs, 0, prompt)
    add(admit_step, 0, "alloc", "prefill", seqs, prompt_blocks, 0)
    dec = np.flatnonzero(decode_alloc)
    add(tok_step[dec], 0, "alloc", "decode", tok_seq[dec], 1, 0)
    add(pre_at, 0, "preempt", "recompute", pre_seq, held_blocks, held_tokens)
    add(pre_at, 0, "free", "preempt", pre_seq, held_blocks, 0)
    add(resume_at, 0, "admit", "resume-recompute", pre_seq, 0, held_tokens + 1)
    add(resume_at, 0, "alloc", "prefill", pre_seq, held_blocks, 0)
    add(resume_at, 1, "reprefill", "", pre_seq, 0, held_tokens + 1, held_tokens)
    add(finish_step, 1, "finish", "length", seqs, 0, output)
    add(finish_step, 1, "free", "finish", seqs, final_blocks, 0)
    # most blocks handed out had to be reclaimed from the prefix cache first: one evict each
    alloc_steps = np.concatenate([np.repeat(admit_step, prompt_blocks), tok_step[dec],
                                  np.repeat(resume_at, held_blocks)])
    evict_steps = alloc_steps[rng.random(len(alloc_steps)) < 0.9]
    add(evict_steps, 0, "evict", "", np.full(len(evict_steps), -1), 1, 0)
    step_, at_end, kind, reason, seq_, num_blocks, num_tokens, recomputed = (np.concatenate(c) for c in zip(*parts))
    order = np.lexsort((kind, at_end, step_))
    step_, at_end, kind, reason, seq_ = step_[order], at_end[order], kind[order], reason[order], seq_[order]
    num_blocks, num_tokens, recomputed = num_blocks[order], num_tokens[order], recomputed[order]
    n_events = len(step_)
    block_offsets = np.concatenate([[0], np.cumsum(num_blocks)]).astype(np.int32)
    block_ids = pa.array(rng.integers(0, total_blocks, int(block_offsets[-1])).astype(np.int32))
    blocks = pa.ListArray.from_arrays(pa.array(block_offsets), block_ids)
    names = [f"req-{i:07d}" for i in range(num_seqs)] + [""]
    kv_events = {
        "seq": np.arange(n_events), "step": step_, "ts_s": np.where(at_end == 1, end_s[step_], start_s[step_]),
        "kind": _strings(kind, KINDS), "req_id": _strings(np.where(seq_ < 0, num_seqs, seq_), names),
        "sample": np.zeros(n_events, dtype=np.int32), "blocks": blocks, "num_blocks": num_blocks,
        "num_tokens": num_tokens, "bytes": np.zeros(n_events, dtype=np.int64),
        "reason": _strings(reason, REASONS), "num_cached_tokens": np.zeros(n_events, dtype=np.int32),
        "num_recomputed_tokens": recomputed,
    }

    tokens = {"req_id": _strings(tok_seq, names), "sample": np.zeros(len(tok_seq), dtype=np.int32),
              "idx": tok_idx, "token_id": rng.integers(0, 49152, len(tok_seq)), "step": tok_step,
              "ts_s": end_s[tok_step]}
    recomputed_per_seq = np.bincount(pre_seq, weights=held_tokens, minlength=num_seqs).astype(np.int64)
    requests = {
        "req_id": _strings(seqs, names), "sample": np.zeros(num_seqs, dtype=np.int32),
        "n": np.ones(num_seqs, dtype=np.int32), "priority": np.zeros(num_seqs, dtype=np.int32),
        "arrival_s": np.maximum(start_s[admit_step] - rng.exponential(0.3, num_seqs), 0.0),
        "prompt_tokens": prompt, "max_tokens": output, "output_tokens": output,
        "first_scheduled_s": start_s[admit_step], "first_token_s": end_s[tok_step[offsets[:-1]]],
        "finish_s": end_s[finish_step], "finish_reason": _strings(np.zeros(num_seqs, dtype=np.int32), ["length"]),
        "preemptions": np.bincount(pre_seq, minlength=num_seqs), "swaps": np.zeros(num_seqs, dtype=np.int32),
        "recomputed_tokens": recomputed_per_seq, "prefix_hit_tokens": np.zeros(num_seqs, dtype=np.int64),
    }

    run.mkdir(parents=True)
    counts = {name: _write(run, name, columns, chunk_rows)
              for name, columns in (("requests", requests), ("steps", steps), ("kv_events", kv_events),
                                    ("tokens", tokens))}
    meta = {"run_id": run.name, "schema_version": SCHEMA_VERSION, "kvtrace_version": "0.1.0",
            "command": "benchmarks/trace_scale.py", "status": "completed",
            "engine_config": {"block_size": BLOCK_SIZE, "preemption_mode": "recompute", "preemption_policy": "newest"},
            "model": {"name": "synthetic"}, "device": {"type": "cpu", "name": "synthetic"},
            "kv_pool": {"num_gpu_blocks": total_blocks, "block_size": BLOCK_SIZE},
            "workload": {"path": None, "sha256": "0" * 64, "num_requests": num_seqs},
            "summary": {"duration_s": float(end_s[-1])}}
    (run / "meta.json").write_text(json.dumps(meta, indent=2))
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=float, default=10e6, help="KV events to generate (about)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvtrace-scale"), help="parent folder of the run")
    parser.add_argument("--analyses", nargs="+", default=["thrash", "itl_cliffs"])
    parser.add_argument("--chunk-rows", type=int, default=500_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", action="store_true", help="time an already generated run")
    args = parser.parse_args()

    run = args.out / "scale"
    if not args.reuse:
        shutil.rmtree(run, ignore_errors=True)
        started = time.perf_counter()
        counts = generate(run, int(args.events), args.seed, args.chunk_rows)
        size_mb = sum(f.stat().st_size for f in run.rglob("*.parquet")) / 1e6
        print(f"generated {run} in {time.perf_counter() - started:.1f} s: "
              + ", ".join(f"{n:,} {t}" for t, n in counts.items()) + f"; {size_mb:.0f} MB of parquet")

    # CPU time next to wall time: on a shared machine the wall time says more about the neighbours
    threads = db.connect([run]).sql("SELECT current_setting('threads')").fetchall()[0][0]
    print(f"DuckDB threads: {threads}")
    for name in args.analyses:
        started, cpu_started = time.perf_counter(), time.process_time()
        con = db.connect([run])
        connected = time.perf_counter()
        result = db.run_analysis(con, name)
        finished, cpu_finished = time.perf_counter(), time.process_time()
        print(f"{name:18s} in-process: connect {connected - started:5.2f} s, query {finished - connected:5.2f} s "
              f"(cpu {cpu_finished - cpu_started:5.2f} s), {result.num_rows:,} rows")
        started = time.perf_counter()
        subprocess.run([sys.executable, "-m", "kvtrace", "sql", str(run), "--analysis", name,
                        "--format", "csv", "--output", "/dev/null"], check=True, cwd=ROOT)
        print(f"{name:18s} kvtrace sql (whole command): {time.perf_counter() - started:5.2f} s")


if __name__ == "__main__":
    main()
