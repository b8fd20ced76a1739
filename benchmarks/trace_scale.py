"""Do the analyses hold on a big trace? Writes synthetic runs of ~10 million KV events or more
(with the tokens, steps and requests that go with them), then measures kvtrace's commands on them,
each as its own process: wall time, CPU time and peak RSS.

    python benchmarks/trace_scale.py                                  # 10M events, issue 19's commands
    python benchmarks/trace_scale.py --events 1e7 --events 1e8 --out /work/bigtraces
    python benchmarks/trace_scale.py --runs RUN --baseline ../old-checkout --compare-with OTHER_RUN
    python benchmarks/trace_scale.py --runs RUN --commands all --exact-check

--baseline runs a second checkout's `python -m kvtrace` on the same runs (before / after); a command
is stopped past --rss-cap GiB or --timeout s. --exact-check compares latency.sql's approximate
percentiles with exact ones (that needs memory in proportion to the trace: ~10M events).

The run is shaped like a thrashing recompute-mode replay with prefix caching: ~64 sequences
running, prompts of 128-1024 tokens, 16-160 output tokens, block size 16, on average 1.2
recompute preemptions per sequence (each waits ~30 steps, then re-prefills its history in one
step), and an `evict` event for most blocks allocated, which is what makes a KV trace long.
Steps last 8 ms plus 12 us per prefill token, so prompts arriving slow down everyone's decode.
Everything is built with numpy, in batches of sequences, and written as closed chunk files as the
recorder writes them; generating holds one batch plus the per-step and per-request arrays (about
1 GB at 100M events), never the events or tokens.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvtrace.trace import db  # noqa: E402
from kvtrace.trace.schema import SCHEMA_VERSION, TABLES  # noqa: E402

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
        # each token's predecessor in its sequence (the tokens are in sequence, then idx, order)
        first = b["tok_idx"] == 0
        prev_step = np.concatenate([[0], b["tok_step"][:-1]])
        tokens.add({"req_id": pa.array(names[b["tok_seq"] + lo], pa.string()),
                    "sample": np.zeros(len(b["tok_seq"]), dtype=np.int32), "idx": b["tok_idx"],
                    "token_id": brng.integers(0, 49152, len(b["tok_seq"])), "step": b["tok_step"],
                    "ts_s": end_s[b["tok_step"]],
                    "prev_step": pa.array(prev_step, pa.int64(), mask=first),
                    "prev_ts_s": pa.array(end_s[prev_step], pa.float64(), mask=first)})

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


# --------------------------------------------------------------------------- measuring commands

# the commands of issue 19's table (and compare); --commands all adds every other analysis
TABLE_ANALYSES = ("thrash", "summary", "latency_cdf", "itl_cliff_summary")


@dataclass
class Measured:
    wall_s: float
    cpu_s: float                    # user + system time of the process
    peak_rss: int                   # bytes (the kernel's maxrss of the process)
    stopped: str = ""               # "memory" or "time" when the harness stopped it
    error: str = ""                 # the last line of its stderr when it failed
    output_bytes: int | None = None

    def cells(self, rss_cap: float, timeout: float) -> list[str]:
        if self.stopped == "memory":
            return [f"stopped at {self.wall_s:.0f} s", f"> {rss_cap / 2**30:.0f} GiB"]
        if self.stopped == "time":
            return [f"> {timeout:.0f} s", f"≥ {self.peak_rss / 2**30:.2f} GiB"]
        if self.error:
            return ["failed: " + self.error[:60], f"{self.peak_rss / 2**30:.2f} GiB"]
        return [f"{self.wall_s:.1f} s (cpu {self.cpu_s:.1f} s)", f"{self.peak_rss / 2**30:.2f} GiB"]


def _rss(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def measure(argv: list[str], cwd: Path, rss_cap: float, timeout: float, env: dict | None = None) -> Measured:
    """Run a command as its own process: wall time, CPU time and peak RSS (from the kernel's
    rusage). It is stopped when its RSS passes `rss_cap` bytes or it runs past `timeout` s, so that
    a command whose memory grows with the trace cannot take the shared machine's memory."""
    with tempfile.TemporaryFile() as err:
        started = time.perf_counter()
        proc = subprocess.Popen(argv, cwd=cwd, stdout=subprocess.DEVNULL, stderr=err,
                                env={**os.environ, **(env or {})})
        stopped, seen = "", 0
        while True:
            pid, status, usage = os.wait4(proc.pid, os.WNOHANG)
            if pid:
                break
            seen = max(seen, _rss(proc.pid))
            if not stopped and seen > rss_cap:
                stopped = "memory"
                proc.kill()
            elif not stopped and time.perf_counter() - started > timeout:
                stopped = "time"
                proc.kill()
            time.sleep(0.05)
        proc.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - started
        err.seek(0)
        lines = err.read().decode(errors="replace").strip().splitlines()
    error = "" if proc.returncode == 0 or stopped else (lines[-1] if lines else f"exit {proc.returncode}")
    return Measured(wall, usage.ru_utime + usage.ru_stime, max(usage.ru_maxrss * 1024, seen), stopped, error)


def sweep_folder(runs: list[Path], out: Path) -> Path:
    """A sweep folder (as `kvtrace sweep` writes one) whose points are `runs`: each point's run
    folder holds its own meta.json with the sweep's marker and links to the run's tables."""
    folder = out / ("sweep-" + "-".join(run.name for run in runs))
    shutil.rmtree(folder, ignore_errors=True)
    points = []
    for index, run in enumerate(runs):
        settings = {"trace": run.name}
        point = folder / "runs" / run.name
        point.mkdir(parents=True)
        meta = json.loads((run / "meta.json").read_text())
        meta["sweep"] = {"name": "scale", "index": index, "settings": settings}
        (point / "meta.json").write_text(json.dumps(meta, indent=2))
        for table in ("requests", "steps", "kv_events", "tokens"):
            (point / table).symlink_to((run / table).resolve(), target_is_directory=True)
        points.append({"index": index, "run_id": run.name, "settings": settings, "status": "completed",
                       "returncode": 0, "error": None, "elapsed_s": None})
    (folder / "sweep.json").write_text(json.dumps({
        "version": 1, "name": "scale", "workload": "synthetic", "workload_sha256": "0" * 64, "shared_args": [],
        "grid": {"trace": [run.name for run in runs]}, "created_at": "", "updated_at": "", "points": points}))
    return folder


def commands(run: Path, other: Path | None, which: str, out: Path) -> list[tuple[str, list[str]]]:
    """(label, kvtrace arguments) of every command measured on `run`."""
    names = list(TABLE_ANALYSES)
    if which == "all":
        names += [info.name for info in db.list_analyses() if info.name not in TABLE_ANALYSES]
    found = [(f"sql --analysis {name}", ["sql", str(run), "--analysis", name, "--format", "csv",
                                         "--output", "/dev/null"]) for name in names]
    found += [("analyze (dashboard, 80 columns)", ["analyze", str(run)]),
              ("report", ["report", str(run), "--output", str(out / "report.html")])]
    if other is not None:
        found.append((f"compare (with {other.name})", ["compare", str(run), str(other)]))
    points = [run] + ([other] if other is not None else [])
    found.append((f"sweep show ({' + '.join(p.name for p in points)})",
                  ["sweep", "show", str(sweep_folder(points, out))]))
    return found


def _counts(run: Path) -> dict[str, int]:
    return {table: sum(pq.ParquetFile(f).metadata.num_rows for f in (run / table).glob("part-*.parquet"))
            for table in ("requests", "steps", "kv_events", "tokens")}


def exact_check(run: Path) -> list[str]:
    """latency.sql's percentiles (approximate, see _latency_hist.sql) against exact ones computed
    with quantile_cont over every value (memory grows with the trace: keep this to ~10M events)."""
    con = db.connect([run])
    con.execute("SET memory_limit = '8GB'")
    approx = db.run_analysis(con, "latency").to_pylist()
    exact = con.sql("""
        SELECT metric, quantile_cont(ms, [0.5, 0.9, 0.95, 0.99, 0.999]) AS q
        FROM _latency_samples GROUP BY metric""").fetchall()
    exact = dict(exact)
    lines = []
    for row in approx:
        worst = max(abs(a - e) / abs(e) if e else abs(a - e) for a, e in zip(
            [row[k] for k in ("p50_ms", "p90_ms", "p95_ms", "p99_ms", "p999_ms")], exact[row["metric"]]))
        lines.append(f"{row['metric']}: {row['num_values']:,} values, largest relative error of p50..p99.9 "
                     f"against quantile_cont: {worst:.2e}")
    return lines


def main() -> list[tuple[int, str, Measured]]:
    """Measures; returns (kv_events, command label, result) of every command run on the current code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=float, action="append",
                        help="KV events to generate (about); repeat for several sizes (default 10e6)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvtrace-scale"), help="parent folder of the runs")
    parser.add_argument("--runs", type=Path, nargs="+", help="measure these runs instead of generating")
    parser.add_argument("--compare-with", type=Path, help="the second run of `kvtrace compare` (default: none)")
    parser.add_argument("--commands", choices=["table", "all"], default="table",
                        help="table: issue 19's commands; all: every analysis too")
    parser.add_argument("--only", nargs="+", help="measure only the commands whose label contains one of these")
    parser.add_argument("--baseline", type=Path, help="a checkout of the code before, measured side by side")
    parser.add_argument("--rss-cap", type=float, default=6, help="stop a command past this peak RSS (GiB)")
    parser.add_argument("--timeout", type=float, default=600, help="stop a command after this long (s)")
    parser.add_argument("--exact-check", action="store_true",
                        help="check the approximate percentiles against exact ones (runs up to ~20M events)")
    parser.add_argument("--chunk-rows", type=int, default=500_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reuse", action="store_true", help="measure already generated runs")
    args = parser.parse_args()

    runs = args.runs or []
    if not runs:
        for events in args.events or [10e6]:
            run = args.out / f"scale-{events / 1e6:g}m"
            runs.append(run)
            if args.reuse and (run / "meta.json").exists():
                continue
            shutil.rmtree(run, ignore_errors=True)
            started = time.perf_counter()
            generate(run, int(events), args.seed, args.chunk_rows)
            print(f"generated {run} in {time.perf_counter() - started:.0f} s")
    rss_cap = args.rss_cap * 2**30
    checkouts = ([("before", args.baseline.resolve())] if args.baseline else []) + [("after", ROOT)]
    out = Path(tempfile.mkdtemp(prefix="kvtrace-scale-"))
    header = ["events", "command"] + [f"{name} {what}" for name, _ in checkouts for what in ("wall", "peak RSS")]
    rows = []
    measured = []
    for run in runs:
        counts = _counts(run)
        size_mb = sum(f.stat().st_size for f in run.rglob("*.parquet")) / 1e6
        print(f"{run}: " + ", ".join(f"{n:,} {t}" for t, n in counts.items()) + f"; {size_mb:,.0f} MB of parquet",
              flush=True)
        other = args.compare_with if args.compare_with and args.compare_with.resolve() != run.resolve() else None
        for label, argv in commands(run, other, args.commands, out):
            if args.only and not any(word in label for word in args.only):
                continue
            row = [f"{counts['kv_events'] / 1e6:.1f} M", f"`{label}`"]
            for name, code in checkouts:
                result = measure([sys.executable, "-m", "kvtrace", *argv], code, rss_cap, args.timeout,
                                 env={"COLUMNS": "80"})
                row += result.cells(rss_cap, args.timeout)
                if name == "after":
                    measured.append((counts["kv_events"], label, result))
                if label == "report" and not result.stopped and not result.error:
                    row[-2] += f", {(out / 'report.html').stat().st_size / 1e6:.1f} MB"
                print(f"  {name:6s} {label:36s} " + " | ".join(result.cells(rss_cap, args.timeout)), flush=True)
            rows.append(row)
        if args.exact_check:
            for line in exact_check(run):
                print(f"  exact check: {line}", flush=True)
    shutil.rmtree(out, ignore_errors=True)
    print()
    print("| " + " | ".join(header) + " |\n|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")
    return measured


if __name__ == "__main__":
    main()
