"""Suite `sim-speed`: how fast the simulated engine replays, with the full trace written.

Two scenarios, each recorded by the CLI (`kvtrace record --engine sim`, wall time of the whole
command: start-up, replay and closing the trace):
- ShareGPT-like: 1,000 requests arriving at 2.5 req/s (Poisson), log-normal prompts and outputs, on
  simulated Llama-3-8B / A100-80GB with the pool vLLM would size (--gpu-memory-utilization 0.9).
  The reference is Vidur 0.0.26 on this machine: 6.6 s of wall time for a workload of this shape,
  keeping no KV trace.
- paged-kv: the 4,000-request backlog of paged-kv-memory.txt (scripts/paged_kv_workload.py), paged
  with 16-token blocks, 1,024 sequences at most: the scale test of docs/simulation.md.
- an hour: 72,000 requests of the ShareGPT-like shape at 20 req/s (issue 32's hour of production
  traffic), on simulated Llama-3-8B / H100 with the same limits; `--hour-repeats` runs (1 by default:
  it takes minutes), `--skip-hour` leaves it out.
Steps/s and sequence-steps/s (running sequences summed over steps) are measured per replay.
"""
from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import Section, markdown_table
from benchmarks.stats import median
from kvtrace.trace.db import connect

ROOT = Path(__file__).resolve().parent.parent
VIDUR_WALL_S = 6.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2.5)
    parser.add_argument("--skip-paged-kv", action="store_true")
    parser.add_argument("--skip-hour", action="store_true", help="Leave out the 72,000-request hour.")
    parser.add_argument("--hour-repeats", type=int, default=1, help="Runs of the hour (default 1).")


def kvtrace(*args: str) -> tuple[float, float]:
    """(wall s, CPU s of the child: user + system) of one kvtrace command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvtrace", *args], check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


SCENARIOS = {
    "ShareGPT-like, Llama-3-8B / A100": [
        "--model", "llama-3-8b", "--engine", "sim", "--hardware", "a100-80gb", "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"],
    "paged-kv 4,000 backlog, paged 16": [
        "--model", "llama-3-8b", "--engine", "sim", "--hardware", "a100-80gb", "--num-gpu-blocks", "24795",
        "--block-size", "16", "--max-num-seqs", "1024", "--max-model-len", "8192", "--max-num-batched-tokens",
        "10000000", "--watermark", "0", "--no-enable-prefix-caching", "--backlog"],
    "an hour at 20 req/s, Llama-3-8B / H100": [
        "--model", "llama-3-8b", "--engine", "sim", "--hardware", "h100-sxm", "--gpu-memory-utilization", "0.9",
        "--max-num-seqs", "256", "--max-num-batched-tokens", "8192"],
}
HOUR = "an hour at 20 req/s, Llama-3-8B / H100"
SHAREGPT_SHAPE = ["--prompt-median", "250", "--prompt-sigma", "1.0", "--output-median", "200", "--output-sigma", "0.9",
                  "--output-cap", "2048", "--max-model-len", "8192", "--seed", "7"]


def run(args: argparse.Namespace) -> None:
    section = Section("sim-speed")
    with tempfile.TemporaryDirectory(prefix="kvtrace-sim-speed-") as tmp:
        tmp_path = Path(tmp)
        workloads = {
            "ShareGPT-like, Llama-3-8B / A100": tmp_path / "sharegpt-like.jsonl",
            "paged-kv 4,000 backlog, paged 16": tmp_path / "paged-kv.jsonl",
            HOUR: tmp_path / "hour.jsonl",
        }
        kvtrace("workload", "synth", "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                *SHAREGPT_SHAPE, "-o", str(workloads["ShareGPT-like, Llama-3-8B / A100"]))
        if not args.skip_hour:
            kvtrace("workload", "synth", "--num-requests", "72000", "--rate", "20", *SHAREGPT_SHAPE,
                    "-o", str(workloads[HOUR]))
        subprocess.run([sys.executable, str(ROOT / "scripts" / "paged_kv_workload.py"), "-o",
                        str(workloads["paged-kv 4,000 backlog, paged 16"])], check=True)
        rows = []
        medians: dict[str, float] = {}
        for name, options in SCENARIOS.items():
            if (args.skip_paged_kv and name.startswith("paged-kv")) or (args.skip_hour and name == HOUR):
                continue
            walls, cpus = [], []
            for i in range(args.hour_repeats if name == HOUR else args.repeats):
                out = tmp_path / f"{len(rows)}-{i}"
                wall, cpu = kvtrace("record", "-q", "-w", str(workloads[name]), "-o", str(out), *options)
                walls.append(wall)
                cpus.append(cpu)
            meta = json.loads((out / "meta.json").read_text())
            steps, seq_steps, simulated_s = connect([out]).sql(
                "SELECT count(*), sum(running), max(end_s) FROM steps").fetchall()[0]
            rows_written = sum(meta["summary"]["rows"].values())
            wall = median(walls)
            medians[name] = wall
            rows.append([name, f"{meta['workload']['num_requests']:,}", f"{simulated_s:,.0f}", f"{steps:,}",
                         f"{rows_written:,}", " ".join(f"{w:.1f}" for w in walls), f"{wall:.1f}",
                         f"{median(cpus):.1f}", f"{steps / wall:,.0f} / {steps / median(cpus):,.0f}",
                         f"{seq_steps / wall:,.0f} / {seq_steps / median(cpus):,.0f}"])
            if name.startswith("ShareGPT"):
                vs_vidur = (wall / VIDUR_WALL_S, median(cpus) / VIDUR_WALL_S)
    section.add("Wall time of `kvtrace record --engine sim` (start-up, replay, trace closed), "
                f"{args.repeats} runs each ({args.hour_repeats} of the hour), and the CPU time (user + system) it used, which a busy machine "
                "inflates less; steps/s and sequence-steps/s over the median wall time / over the median CPU time.")
    section.add(markdown_table(["scenario", "requests", "simulated s", "steps", "trace rows", "each wall s",
                                "median wall s", "median CPU s", "steps/s (wall / CPU)",
                                "sequence-steps/s (wall / CPU)"], rows)
                + (f"\n\nShareGPT-like vs Vidur 0.0.26 ({VIDUR_WALL_S} s of wall time here, no KV trace): "
                   f"**{vs_vidur[0]:.2f}x** its time in wall time, **{vs_vidur[1]:.2f}x** in CPU time."
                   if "vs_vidur" in locals() else ""))
    headline = "median wall s of `record --engine sim`: " + "; ".join(f"{n} {w:.1f} s" for n, w in medians.items())
    if "vs_vidur" in locals():
        headline += f" (ShareGPT-like: {vs_vidur[0]:.2f}× Vidur's {VIDUR_WALL_S} s)"
    section.write(headline)
