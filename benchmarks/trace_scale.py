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


class _ChunkWriter:
    """Rows of one table, written as closed chunk files of `chunk_rows` rows as they come, so that
    generating a trace of any size holds at most a chunk and a batch in memory."""

    def __init__(self, run: Path, table: str, chunk_rows: int) -> None:
        self.folder = run / table
        self.folder.mkdir(parents=True)
        self.schema = TABLES[table]
        self.run_id = run.name
        self.chunk_rows = chunk_rows
        self.pending: list[pa.Table] = []
        self.pending_rows = 0
        self.parts = 0
        self.rows = 0

    def add(self, columns: dict[str, object]) -> None:
        n = len(next(iter(columns.values())))
        if not n:
            return
        arrays = []
        for field in self.schema:
            if field.name == "run_id":
                arrays.append(_strings(np.zeros(n, dtype=np.int32), [self.run_id]))
            elif field.name in columns:
                value = columns[field.name]
                arrays.append(value if isinstance(value, pa.Array) else pa.array(value, field.type))
            else:
                arrays.append(pa.nulls(n, field.type))
        self.pending.append(pa.Table.from_arrays(arrays, schema=self.schema))
        self.pending_rows += n
        self.rows += n
        while self.pending_rows >= self.chunk_rows:
            self._flush(self.chunk_rows)

    def _flush(self, rows: int) -> None:
        table = pa.concat_tables(self.pending)
        pq.write_table(table.slice(0, rows), self.folder / f"part-{self.parts:05d}.parquet")
        self.parts += 1
        rest = table.slice(rows)
        self.pending, self.pending_rows = ([rest] if rest.num_rows else []), rest.num_rows

    def close(self) -> int:
        if self.pending_rows:
            self._flush(self.pending_rows)
        return self.rows


def _sequences(rng: np.random.Generator, prompt: np.ndarray, output: np.ndarray, admit_step: np.ndarray) -> dict:
    """A batch of sequences' tokens and preemptions: one token per step while running; a preemption
    before token j delays it by `wait` steps. Draws from `rng` in a fixed order (the first pass and
    the second regenerate the same batch from the same seed)."""
    n = len(prompt)
    offsets = np.concatenate([[0], np.cumsum(output)])
    tok_seq = np.repeat(np.arange(n), output)
    tok_idx = np.arange(len(tok_seq)) - offsets[tok_seq]
    num_preempt = np.minimum(rng.poisson(1.2, n), output - 1)
    pre_seq = np.repeat(np.arange(n), num_preempt)
    pre_pos = 1 + (rng.random(len(pre_seq)) * (output[pre_seq] - 1)).astype(np.int64)
    key = np.unique(pre_seq * 1_000_000 + pre_pos)
    pre_seq, pre_pos = key // 1_000_000, key % 1_000_000
    wait = rng.geometric(1 / 30, len(pre_seq))
    extra = np.zeros(len(tok_seq), dtype=np.int64)
    extra[offsets[pre_seq] + pre_pos] = wait
    cum = np.cumsum(extra)
    tok_step = admit_step[tok_seq] + tok_idx + cum - cum[offsets[tok_seq]]
    held_tokens = prompt[pre_seq] + pre_pos - 1                   # KV positions held when preempted
    last_tok = offsets[1:] - 1
    return {
        "offsets": offsets, "tok_seq": tok_seq, "tok_idx": tok_idx, "tok_step": tok_step,
        "pre_seq": pre_seq, "pre_at": tok_step[offsets[pre_seq] + pre_pos - 1] + 1,   # step that preempts it
        "resume_at": tok_step[offsets[pre_seq] + pre_pos],                           # step that re-prefills it
        "held_tokens": held_tokens, "held_blocks": -(-held_tokens // BLOCK_SIZE),
        "prompt_blocks": -(-prompt // BLOCK_SIZE), "finish_step": tok_step[last_tok],
        "final_blocks": -(-(prompt + output - 1) // BLOCK_SIZE),
        "decode_alloc": (tok_idx >= 1) & ((prompt[tok_seq] + tok_idx - 1) % BLOCK_SIZE == 0),
    }


class _PerStep:
    """Sums per step over batches of sequences, the steps table's counters."""

    def __init__(self) -> None:
        self.sums: dict[str, np.ndarray] = {}

    def add(self, name: str, at: np.ndarray, weights=None) -> None:
        counts = np.bincount(at, weights=weights)
        have = self.sums.get(name, np.zeros(0))
        if len(have) < len(counts):
            have = np.concatenate([have, np.zeros(len(counts) - len(have))])
        have[:len(counts)] += counts
        self.sums[name] = have

    def get(self, name: str, num_steps: int) -> np.ndarray:
        have = self.sums.get(name, np.zeros(0))[:num_steps]
        return np.concatenate([have, np.zeros(num_steps - len(have))])


def generate(run: Path, target_events: int, seed: int, chunk_rows: int,
             batch_seqs: int = 5_000) -> dict[str, int]:
    """Write the run. Sequences are made in batches of `batch_seqs` (admitted in order, each batch
    from its own seed) in two passes: the first sums the steps' counters, the second writes the
    batch's events and tokens. Memory: the per-step and per-request arrays (~2 % of the rows) and
    one batch; the events and tokens (98 %) go to disk as they are made."""
    rng = np.random.default_rng(seed)
    num_seqs = max(target_events // EVENTS_PER_SEQUENCE, 10)
    prompt = rng.integers(128, 1025, num_seqs)
    output = rng.integers(16, 161, num_seqs)
    # admissions at ~0.47 per step keep ~64 sequences running (each lives ~136 steps)
    admit_step = np.sort(rng.integers(0, int(num_seqs / 0.47), num_seqs))
    batches = [(lo, min(lo + batch_seqs, num_seqs)) for lo in range(0, num_seqs, batch_seqs)]

    def batch(lo: int, hi: int) -> tuple[np.random.Generator, dict]:
        brng = np.random.default_rng([seed, lo])
        return brng, _sequences(brng, prompt[lo:hi], output[lo:hi], admit_step[lo:hi])

    # ---- first pass: the steps' counters
    acc = _PerStep()
    preempts = np.zeros(num_seqs, dtype=np.int64)
    recomputed_per_seq = np.zeros(num_seqs, dtype=np.int64)
    first_token_step = np.zeros(num_seqs, dtype=np.int64)
    finish_step = np.zeros(num_seqs, dtype=np.int64)
    for lo, hi in batches:
        _, b = batch(lo, hi)
        adm = admit_step[lo:hi]
        acc.add("prefill", adm, prompt[lo:hi])
        acc.add("prefill", b["resume_at"], b["held_tokens"] + 1)
        acc.add("recompute", b["resume_at"], b["held_tokens"])
        acc.add("emitted", b["tok_step"])
        acc.add("admits", adm)
        acc.add("admits", b["resume_at"])
        acc.add("preemptions", b["pre_at"])
        acc.add("resumes", b["resume_at"])
        acc.add("blocks", adm, b["prompt_blocks"])
        acc.add("blocks", b["tok_step"][b["decode_alloc"]])
        acc.add("blocks", b["pre_at"], -b["held_blocks"])
        acc.add("blocks", b["resume_at"], b["held_blocks"])
        acc.add("blocks", b["finish_step"] + 1, -b["final_blocks"])
        preempts[lo:hi] = np.bincount(b["pre_seq"], minlength=hi - lo)
        recomputed_per_seq[lo:hi] = np.bincount(b["pre_seq"], weights=b["held_tokens"], minlength=hi - lo)
        first_token_step[lo:hi] = b["tok_step"][b["offsets"][:-1]]
        finish_step[lo:hi] = b["finish_step"]
    num_steps = int(finish_step.max()) + 1

    # ---- steps
    prefill = acc.get("prefill", num_steps)
    emitted = acc.get("emitted", num_steps)
    preemptions = acc.get("preemptions", num_steps).astype(np.int64)
    waiting = np.cumsum(preemptions - acc.get("resumes", num_steps)).astype(np.int64)
    used = np.cumsum(acc.get("blocks", num_steps))
    total_blocks = int(np.quantile(used, 0.9))
    used = np.minimum(used, total_blocks).astype(np.int64)
    duration_ms = 8.0 + 0.012 * prefill + 0.02 * emitted + rng.gamma(2.0, 0.5, num_steps)
    end_s = np.cumsum(duration_ms) / 1000
    start_s = end_s - duration_ms / 1000
    free = total_blocks - used
    run.mkdir(parents=True)
    steps = _ChunkWriter(run, "steps", chunk_rows)
    steps.add({
        "step": np.arange(num_steps), "start_s": start_s, "end_s": end_s, "device_ms": duration_ms * 0.9,
        "running": emitted.astype(np.int64), "waiting": waiting, "swapped": np.zeros(num_steps, dtype=np.int64),
        "prefill_tokens": prefill.astype(np.int64),
        "decode_tokens": (emitted - acc.get("admits", num_steps)).astype(np.int64),
        "recompute_tokens": acc.get("recompute", num_steps).astype(np.int64), "preemptions": preemptions,
        "free_blocks": free, "used_blocks": used, "cached_blocks": (free * 0.8).astype(np.int64),
        "total_blocks": np.full(num_steps, total_blocks),
        "kv_tokens": (used * BLOCK_SIZE * rng.uniform(0.85, 0.97, num_steps)).astype(np.int64),
    })
    del acc, prefill, emitted, preemptions, waiting, used, free, duration_ms

    # ---- requests
    names = np.array([f"req-{i:07d}" for i in range(num_seqs)] + [""], dtype=object)
    requests = _ChunkWriter(run, "requests", chunk_rows)
    requests.add({
        "req_id": pa.array(names[:-1], pa.string()), "sample": np.zeros(num_seqs, dtype=np.int32),
        "n": np.ones(num_seqs, dtype=np.int32), "priority": np.zeros(num_seqs, dtype=np.int32),
        "arrival_s": np.maximum(start_s[admit_step] - rng.exponential(0.3, num_seqs), 0.0),
        "prompt_tokens": prompt, "max_tokens": output, "output_tokens": output,
        "first_scheduled_s": start_s[admit_step], "first_token_s": end_s[first_token_step],
        "finish_s": end_s[finish_step], "finish_reason": _strings(np.zeros(num_seqs, dtype=np.int32), ["length"]),
        "preemptions": preempts, "swaps": np.zeros(num_seqs, dtype=np.int32),
        "recomputed_tokens": recomputed_per_seq, "prefix_hit_tokens": np.zeros(num_seqs, dtype=np.int64),
    })

    # ---- second pass: kv_events in step order, tokens in sequence order, a batch at a time. A
    # batch's events reach at most into later batches' steps, never before their first admission:
    # events before the next batch's first admission are final and go out, the rest wait.
    kv_events = _ChunkWriter(run, "kv_events", chunk_rows)
    tokens = _ChunkWriter(run, "tokens", chunk_rows)
    waiting_events: pa.Table | None = None
    for lo, hi in batches:
        brng, b = batch(lo, hi)
        adm = admit_step[lo:hi]
        parts = []

        def add(step, at_end, kind, reason, seq, num_blocks, num_tokens, recomputed=0):
            n = len(step)
            parts.append([np.asarray(step), np.full(n, at_end), np.full(n, KINDS.index(kind)),
                          np.full(n, REASONS.index(reason)), np.asarray(seq),
                          np.broadcast_to(num_blocks, n), np.broadcast_to(num_tokens, n),
                          np.broadcast_to(recomputed, n)])

        seqs = np.arange(hi - lo)
        pre_seq, pre_at, resume_at = b["pre_seq"], b["pre_at"], b["resume_at"]
        held_tokens, held_blocks = b["held_tokens"], b["held_blocks"]
        dec = np.flatnonzero(b["decode_alloc"])
        add(adm, 0, "admit", "new", seqs, 0, prompt[lo:hi])
        add(adm, 0, "alloc", "prefill", seqs, b["prompt_blocks"], 0)
        add(b["tok_step"][dec], 0, "alloc", "decode", b["tok_seq"][dec], 1, 0)
        add(pre_at, 0, "preempt", "recompute", pre_seq, held_blocks, held_tokens)
        add(pre_at, 0, "free", "preempt", pre_seq, held_blocks, 0)
        add(resume_at, 0, "admit", "resume-recompute", pre_seq, 0, held_tokens + 1)
        add(resume_at, 0, "alloc", "prefill", pre_seq, held_blocks, 0)
        add(resume_at, 1, "reprefill", "", pre_seq, 0, held_tokens + 1, held_tokens)
        add(b["finish_step"], 1, "finish", "length", seqs, 0, output[lo:hi])
        add(b["finish_step"], 1, "free", "finish", seqs, b["final_blocks"], 0)
        # most blocks handed out had to be reclaimed from the prefix cache first: one evict each
        alloc_steps = np.concatenate([np.repeat(adm, b["prompt_blocks"]), b["tok_step"][dec],
                                      np.repeat(resume_at, held_blocks)])
        evict_steps = alloc_steps[brng.random(len(alloc_steps)) < 0.9]
        add(evict_steps, 0, "evict", "", np.full(len(evict_steps), -1), 1, 0)
        step_, at_end, kind, reason, seq_, num_blocks, num_tokens, recomputed = (np.concatenate(c) for c in zip(*parts))
        block_offsets = np.concatenate([[0], np.cumsum(num_blocks)]).astype(np.int32)
        block_ids = pa.array(brng.integers(0, total_blocks, int(block_offsets[-1])).astype(np.int32))
        new = pa.table({
            "step": step_, "_at_end": at_end, "_kind": kind,
            "ts_s": np.where(at_end == 1, end_s[step_], start_s[step_]),
            "kind": _strings(kind, KINDS), "req_id": pa.array(names[np.where(seq_ < 0, num_seqs, seq_ + lo)], pa.string()),
            "blocks": pa.ListArray.from_arrays(pa.array(block_offsets), block_ids), "num_blocks": num_blocks,
            "num_tokens": num_tokens, "reason": _strings(reason, REASONS), "num_recomputed_tokens": recomputed,
        })
        merged = new if waiting_events is None else pa.concat_tables([waiting_events, new])
        merged = merged.sort_by([("step", "ascending"), ("_at_end", "ascending"), ("_kind", "ascending")])
        final = int(np.searchsorted(merged["step"].to_numpy(), admit_step[hi] if hi < num_seqs else num_steps))
        out, waiting_events = merged.slice(0, final), merged.slice(final)
        n = out.num_rows
        kv_events.add({
            "seq": np.arange(kv_events.rows, kv_events.rows + n), **{c: out[c].combine_chunks() for c in
                                                                     ("step", "ts_s", "kind", "req_id", "blocks",
                                                                      "num_blocks", "num_tokens", "reason",
                                                                      "num_recomputed_tokens")},
            "sample": np.zeros(n, dtype=np.int32), "bytes": np.zeros(n, dtype=np.int64),
            "num_cached_tokens": np.zeros(n, dtype=np.int32),
        })
        tokens.add({"req_id": pa.array(names[b["tok_seq"] + lo], pa.string()),
                    "sample": np.zeros(len(b["tok_seq"]), dtype=np.int32), "idx": b["tok_idx"],
                    "token_id": brng.integers(0, 49152, len(b["tok_seq"])), "step": b["tok_step"],
                    "ts_s": end_s[b["tok_step"]]})

    counts = {"requests": requests.close(), "steps": steps.close(), "kv_events": kv_events.close(),
              "tokens": tokens.close()}
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
