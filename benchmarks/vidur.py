"""Vidur 0.0.26 side by side with kvtrace (suite `sim-speed`): the workload in Vidur's trace format, and one run.

Vidur runs in a venv of its own (scripts/vidur_env.sh) through benchmarks/peers/vidur_driver.py, which
reads a trace CSV made here by `write_vidur_trace` and the execution-time profiles named in `PROFILES`.
Nothing here imports Vidur.

Vidur's trace-replay request generator (`TraceReplayRequestGenerator`, request generator type
`trace_replay`) reads a CSV with one row per request: `Date` (it keeps the rows of one date),
`Time` (arrival, s), `PromptTokenCount` and `CompletionTokenCount` (decode tokens, the first one
included: Vidur's prefill yields the first output token). The driver sets its scale factors to 1.
"""
from __future__ import annotations

import csv
import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kvtrace.workload.format import WorkloadRequest, load_workload

ROOT = Path(__file__).resolve().parent.parent
DRIVER = ROOT / "benchmarks" / "peers" / "vidur_driver.py"
TRACE_DATE = "2023-08-21"   # the date Vidur's trace-replay generator keeps by default
TRACE_COLUMNS = ("Date", "Time", "PromptTokenCount", "CompletionTokenCount")
VERSION = "0.0.26"
CACHE_DIR = Path.home() / ".cache" / "kvtrace" / "vidur-cache"   # Vidur's trained predictors, kept between runs
# Vidur's execution-time profiles for Llama-3-8B on one A100 (benchmarks/data/vidur/README.md says
# where each comes from): its MLP table, trimmed to the medians of TP = 1, and 249 rows of its
# attention table (TP = 1, FlashInfer, block size 16) copied from pages of a public copy.
PROFILE_DIR = ROOT / "benchmarks" / "data" / "vidur" / "a100" / "Meta-Llama-3-8B"
PROFILES = {"mlp": PROFILE_DIR / "mlp.csv", "attention": PROFILE_DIR / "attention-sample.csv"}


def default_vidur_python() -> Path | None:
    """The cached venv's Python (scripts/vidur_env.sh), or $KVTRACE_VIDUR_PYTHON; None if neither exists."""
    env = os.environ.get("KVTRACE_VIDUR_PYTHON")
    if env:
        return Path(env)
    python = Path.home() / ".cache" / "kvtrace" / f"vidur-venv-{VERSION}" / "bin" / "python"
    return python if python.exists() else None


def vidur_lengths(req: WorkloadRequest) -> tuple[int, int]:
    """(prompt tokens, output tokens) of one request, as Vidur takes them; ValueError if it has none.

    The output is `output_tokens` where the request records where it stopped, else `max_tokens` for a
    request that ignores EOS. Vidur models neither text prompts (no tokenizer), nor n > 1, nor a
    request that may stop early.
    """
    if req.prompt_tokens is not None:
        num_prompt = req.prompt_tokens
    elif req.prompt_token_ids is not None:
        num_prompt = len(req.prompt_token_ids)
    else:
        raise ValueError(f"request {req.id!r}: a text prompt has no token count without a tokenizer")
    if req.n != 1:
        raise ValueError(f"request {req.id!r}: n = {req.n}; Vidur runs one sequence per request")
    if req.output_tokens is not None:
        num_output = req.output_tokens
    elif req.ignore_eos:
        num_output = req.max_tokens
    else:
        raise ValueError(f"request {req.id!r}: may stop at EOS, so its output length is unknown")
    if num_output < 1:
        raise ValueError(f"request {req.id!r}: Vidur needs at least one output token")
    return num_prompt, num_output


def write_vidur_trace(requests: list[WorkloadRequest], path: str | os.PathLike) -> int:
    """Write `requests` as Vidur's trace CSV at `path`, in arrival order; returns the number of rows."""
    rows = [(req.arrival_s, *vidur_lengths(req)) for req in requests]
    rows.sort(key=lambda row: row[0])   # stable: equal arrivals keep the workload's order
    with open(path, "w", newline="") as f:
        writer = csv.writer(f, lineterminator="\n")
        writer.writerow(TRACE_COLUMNS)
        for arrival_s, num_prompt, num_output in rows:
            writer.writerow([TRACE_DATE, repr(float(arrival_s)), num_prompt, num_output])
    return len(rows)


@dataclass
class VidurConfig:
    """What the driver sets in Vidur's SimulationConfig: one replica, TP = PP = 1, its vLLM scheduler."""

    block_size: int = 16
    batch_size_cap: int = 256             # kvtrace's --max-num-seqs
    max_tokens_in_batch: int = 8192       # kvtrace's --max-num-batched-tokens
    gpu_memory_utilization: float = 0.9   # Vidur's memory planner sizes the KV pool from it
    max_tokens: int = 8192                # kvtrace's --max-model-len: prompt + output per request
    seed: int = 7
    write_outputs: bool = True            # Vidur's defaults: its metrics and its Chrome trace; False: neither


@dataclass
class VidurRun:
    wall_s: float          # the whole driver process: start-up, Vidur's cached predictions, simulation, metrics
    cpu_s: float           # user + system CPU of that process
    info: dict             # the driver's JSON line: requests, batches, simulated seconds, num_blocks, ...


def run_vidur(python: str | os.PathLike, workload: str | os.PathLike, work_dir: str | os.PathLike,
              config: VidurConfig, *, cache_dir: str | os.PathLike) -> VidurRun:
    """Convert `workload` into Vidur's trace (under `work_dir`) and run Vidur's simulator on it once.

    `cache_dir` is Vidur's own cache of trained models and predictions: the first run with a given
    set of profiles trains them (minutes), later runs load them, as Vidur does between its own runs.
    """
    work = Path(work_dir)
    work.mkdir(parents=True, exist_ok=True)
    trace = work / "vidur-trace.csv"
    write_vidur_trace(load_workload(workload), trace)
    args = {"trace": str(trace), "output_dir": str(work / "vidur-output"), "cache_dir": str(cache_dir),
            "profiles": {k: str(v) for k, v in PROFILES.items()}, **config.__dict__}
    before = os.times()
    t0 = time.perf_counter()
    done = subprocess.run([str(python), str(DRIVER), json.dumps(args)], check=False,
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    after = os.times()
    if done.returncode != 0:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"Vidur's driver exited {done.returncode}:\n{tail}")
    info = json.loads(done.stdout.strip().splitlines()[-1])
    cpu = (after.children_user - before.children_user) + (after.children_system - before.children_system)
    return VidurRun(wall, cpu, info)
