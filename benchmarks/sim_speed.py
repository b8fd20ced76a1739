"""Suite `sim-speed`: how fast the simulated engine replays, with the full trace written.

Two scenarios, each recorded by the CLI (`kvtrace record --engine sim`, wall time of the whole
command: start-up, replay and closing the trace):
- ShareGPT-like: 1,000 requests arriving at 2.5 req/s (Poisson), log-normal prompts and outputs, on
  simulated Llama-3-8B / A100-80GB with the pool vLLM would size (--gpu-memory-utilization 0.9).
  The reference is Vidur 0.0.26, run on the same workload in this run (benchmarks/vidur.py): its venv
  from scripts/vidur_env.sh (or --vidur-python), one A100 replica of Llama-3-8B under its vLLM
  scheduler (block 16, 256 requests, 8,192 tokens a batch), its profiles from benchmarks/data/vidur/.
  Each repeat runs kvtrace's command and then Vidur's whole process (start-up, its cached predictions,
  the simulation) twice, with its outputs (metrics and Chrome trace, as by default) and without;
  Vidur's first run, which trains its predictors when they are not cached yet, is not timed. Without a Vidur venv the reference is the 6.6 s measured once for a workload of this shape.
- paged-kv: the 4,000-request backlog of scripts/paged_kv_workload.py (a paged-KV lesson's draws), paged
  with 16-token blocks, 1,024 sequences at most: the scale test of docs/simulation.md.
- an hour: 72,000 requests of the ShareGPT-like shape at 20 req/s (issue 32's hour of production
  traffic), on simulated Llama-3-8B / H100 with the same limits; `--hour-repeats` runs (1 by default:
  it takes minutes), `--skip-hour` leaves it out.
- the hour's sweep (`--hour-sweep`, or `--only hour-sweep`; a quarter of an hour and more, so not by
  default): `kvtrace sweep` of that hour over 20 points, max_num_seqs 64 / 128 / 192 / 256 / 384 by
  gpu_memory_utilization 0.25 / 0.3 / 0.5 / 0.9 (the two smallest pools thrash: the question a sweep
  of memory asks, and the replay's slow case), the points run side by side as the sweep runs them
  (one process per core). The goal: the whole sweep within the hour it replays.
`--only sharegpt|paged-kv|hour|hour-sweep` runs one scenario.
`--offload-size 16GiB` runs each scenario that can have a host KV tier (prefix caching on: not paged-kv)
three times in every repeat: without the tier and with it (`record --offload-size`), one right after the
other, the one without first in every other repeat (the machine's drift, which a shared machine has in
tens of percent over minutes, weighs on both alike), and without it on the general pass
(`--no-sim-fast-path`). It prints the medians of the
repeats' ratios (issue 57's goal: with a tier within 10 % of the CPU time without) and the tier's copies,
counted from the trace, so that a tier that did nothing is seen.
Steps/s and sequence-steps/s (running sequences summed over steps) are measured per replay. kvtrace's
sources are byte-compiled first, as a wheel's are when pip installs it (`byte_compile`).
"""
from __future__ import annotations

import argparse
import compileall
import dataclasses
import json
import resource
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

from benchmarks.results import Section, markdown_table
from benchmarks.stats import median, ratios
from benchmarks.vidur import (
    CACHE_DIR,
    PROFILES,
    VidurConfig,
    default_vidur_python,
    run_vidur,
)
from kvtrace.trace.db import connect

ROOT = Path(__file__).resolve().parent.parent
VIDUR_WALL_S = 6.6


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--repeats", type=int, default=5,
                        help="Runs of each scenario but the hour (5: the median of a second-long command on a shared machine).")
    parser.add_argument("--num-requests", type=int, default=1000)
    parser.add_argument("--rate", type=float, default=2.5)
    parser.add_argument("--skip-paged-kv", action="store_true")
    parser.add_argument("--skip-hour", action="store_true", help="Leave out the 72,000-request hour.")
    parser.add_argument("--hour-repeats", type=int, default=1, help="Runs of the hour (default 1).")
    parser.add_argument("--hour-sweep", action="store_true",
                        help="Also sweep the hour over 20 points (max_num_seqs by gpu_memory_utilization).")
    parser.add_argument("--only", choices=sorted([*ONLY, "hour-sweep"]), help="Run one scenario only.")
    parser.add_argument("--offload-size", metavar="SIZE",
                        help="Also run each scenario with a host KV tier of this size (e.g. 16GiB), side by side with "
                             "the runs without it (fast path and general pass), and print the ratios.")
    parser.add_argument("--vidur-python", type=Path, default=default_vidur_python(),
                        help="Python of Vidur 0.0.26's venv (default: scripts/vidur_env.sh's cached one, if built).")
    parser.add_argument("--vidur-cache", type=Path, default=CACHE_DIR,
                        help="Vidur's cache of trained predictors (kept between runs, as Vidur keeps it).")


def kvtrace(*args: str) -> tuple[float, float]:
    """(wall s, CPU s of the child: user + system) of one kvtrace command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "kvtrace", *args], check=True, cwd=ROOT)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def replay_s(run_dir: Path) -> float:
    """The recording's own span (meta.json's started_at to ended_at): the replay with its trace written and
    closed, without the command's start-up and the workload's loading."""
    meta = json.loads((run_dir / "meta.json").read_text())
    return (datetime.fromisoformat(meta["ended_at"]) - datetime.fromisoformat(meta["started_at"])).total_seconds()


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
SHAREGPT = "ShareGPT-like, Llama-3-8B / A100"
ONLY = {"sharegpt": SHAREGPT, "paged-kv": "paged-kv 4,000 backlog, paged 16", "hour": HOUR}
# the hour's sweep: its scenario's options less the two swept, and the grid (5 x 4 = 20 points)
HOUR_SWEEP_SHARED = ["--model", "llama-3-8b", "--engine", "sim", "--hardware", "h100-sxm",
                     "--max-num-batched-tokens", "8192"]
HOUR_SWEEP_GRID = ["--set", "max_num_seqs=64,128,192,256,384", "--set", "gpu_memory_utilization=0.25,0.3,0.5,0.9"]
# Vidur's settings for the ShareGPT-like scenario, as close to its kvtrace options as Vidur allows
VIDUR_CONFIG = VidurConfig(block_size=16, batch_size_cap=256, max_tokens_in_batch=8192, gpu_memory_utilization=0.9,
                           max_tokens=8192)
VIDUR_BARE = dataclasses.replace(VIDUR_CONFIG, write_outputs=False)   # the simulation alone: no metrics, no trace
SHAREGPT_SHAPE = ["--prompt-median", "250", "--prompt-sigma", "1.0", "--output-median", "200", "--output-sigma", "0.9",
                  "--output-cap", "2048", "--max-model-len", "8192", "--seed", "7"]


def wanted(args: argparse.Namespace, name: str) -> bool:
    if name == "hour-sweep":
        return args.only == "hour-sweep" or (args.hour_sweep and not args.only)
    if args.only:
        return name == ONLY.get(args.only)
    return not ((args.skip_paged_kv and name.startswith("paged-kv")) or (args.skip_hour and name == HOUR))


def byte_compile() -> None:
    """Compile kvtrace's and the engine's sources to bytecode before anything is timed, as pip does when it
    installs the wheel (and as Vidur's venv has its own). An editable install run with
    PYTHONDONTWRITEBYTECODE set, as on this machine, would otherwise compile them at every start
    (0.15 s of each ShareGPT-like command)."""
    for package in ("kvtrace", "engine"):
        compileall.compile_dir(ROOT / package, quiet=1)


def run(args: argparse.Namespace) -> None:
    section = Section("sim-speed")
    byte_compile()
    vidur_python = args.vidur_python if args.vidur_python and Path(args.vidur_python).exists() else None
    vidur_runs, vidur_bare_runs, vidur_first = [], [], None
    vs_vidur = None        # (wall, CPU) ratios against Vidur, once the ShareGPT-like case has run
    with tempfile.TemporaryDirectory(prefix="kvtrace-sim-speed-") as tmp:
        tmp_path = Path(tmp)
        workloads = {
            "ShareGPT-like, Llama-3-8B / A100": tmp_path / "sharegpt-like.jsonl",
            "paged-kv 4,000 backlog, paged 16": tmp_path / "paged-kv.jsonl",
            HOUR: tmp_path / "hour.jsonl",
        }
        if wanted(args, SHAREGPT):
            kvtrace("workload", "synth", "--num-requests", str(args.num_requests), "--rate", str(args.rate),
                    *SHAREGPT_SHAPE, "-o", str(workloads["ShareGPT-like, Llama-3-8B / A100"]))
        if wanted(args, HOUR) or wanted(args, "hour-sweep"):
            kvtrace("workload", "synth", "--num-requests", "72000", "--rate", "20", *SHAREGPT_SHAPE,
                    "-o", str(workloads[HOUR]))
        if wanted(args, ONLY["paged-kv"]):
            subprocess.run([sys.executable, str(ROOT / "scripts" / "paged_kv_workload.py"), "-o",
                            str(workloads["paged-kv 4,000 backlog, paged 16"])], check=True)
        if vidur_python and wanted(args, SHAREGPT):   # trains (or loads) Vidur's predictors; not timed
            vidur_first = run_vidur(vidur_python, workloads[SHAREGPT], tmp_path / "vidur-first", VIDUR_CONFIG,
                                    cache_dir=args.vidur_cache)
        rows = []
        medians: dict[str, float] = {}
        tier_lines = []   # each scenario's ratios with a tier to without (--offload-size)
        for name, options in SCENARIOS.items():
            if not wanted(args, name):
                continue
            variants = {name: options}
            general = tiered = None
            if args.offload_size and "--no-enable-prefix-caching" not in options:   # a tier's chunks are keyed by its hashes
                # the general pass without a tier: what the fast path saves
                general, tiered = f"{name}, general pass", f"{name}, {args.offload_size} host KV tier"
                variants[general] = [*options, "--no-sim-fast-path"]
                variants[tiered] = [*options, "--offload-size", args.offload_size]
            runs = {variant: Runs([], [], [], tmp_path) for variant in variants}
            for i in range(args.hour_repeats if name == HOUR else args.repeats):
                order = list(variants)   # side by side in each repeat
                if tiered:   # the run with a tier next to the one without, which goes first in every other
                    order = [name, tiered, general] if i % 2 == 0 else [general, tiered, name]
                for v, variant in enumerate(order):
                    variant_options = variants[variant]
                    out = tmp_path / f"{len(rows)}-{i}-{v}"
                    wall, cpu = kvtrace("record", "-q", "-w", str(workloads[name]), "-o", str(out), *variant_options)
                    runs[variant].walls.append(wall)
                    runs[variant].cpus.append(cpu)
                    runs[variant].replays.append(replay_s(out))
                    runs[variant].last = out
                if name == SHAREGPT and vidur_python:   # interleaved: Vidur right after each kvtrace run
                    vidur_runs.append(run_vidur(vidur_python, workloads[name], tmp_path / f"vidur-{i}",
                                                VIDUR_CONFIG, cache_dir=args.vidur_cache))
                    vidur_bare_runs.append(run_vidur(vidur_python, workloads[name], tmp_path / f"vidur-bare-{i}",
                                                     VIDUR_BARE, cache_dir=args.vidur_cache))
            for variant, r in runs.items():
                out = r.last
                meta = json.loads((out / "meta.json").read_text())
                steps, seq_steps, simulated_s = connect([out]).sql(
                    "SELECT count(*), sum(running), max(end_s) FROM steps").fetchall()[0]
                rows_written = sum(meta["summary"]["rows"].values())
                wall = median(r.walls)
                rows.append([variant, f"{meta['workload']['num_requests']:,}", f"{simulated_s:,.0f}", f"{steps:,}",
                             f"{rows_written:,}", " ".join(f"{w:.2f}" for w in r.walls), f"{wall:.2f}",
                             f"{median(r.replays):.2f}", f"{median(r.cpus):.1f}",
                             f"{steps / wall:,.0f} / {steps / median(r.cpus):,.0f}",
                             f"{seq_steps / wall:,.0f} / {seq_steps / median(r.cpus):,.0f}"])
                if variant == tiered:
                    tier_lines.append(tier_ratio(variant, r, runs[name], runs[general]))
                if variant != name:
                    continue
                medians[name] = wall
                if name == SHAREGPT:
                    sharegpt = {"walls": r.walls, "cpus": r.cpus, "steps": steps, "seq_steps": seq_steps,
                                "simulated_s": simulated_s, "num_gpu_blocks": meta["kv_pool"]["num_gpu_blocks"]}
                    vidur_wall = median([v.wall_s for v in vidur_runs]) if vidur_runs else VIDUR_WALL_S
                    vidur_cpu = median([v.cpu_s for v in vidur_runs]) if vidur_runs else VIDUR_WALL_S
                    vs_vidur = (wall / vidur_wall, median(r.cpus) / vidur_cpu)
        swept = hour_sweep(workloads[HOUR], tmp_path / "hour-sweep") if wanted(args, "hour-sweep") else None
    section.add("Wall time of `kvtrace record --engine sim` (start-up, replay, trace closed), "
                f"{args.repeats} runs each ({args.hour_repeats} of the hour), and the CPU time (user + system) it used, which a busy machine "
                "inflates less; the replay's own span (meta.json's started_at to ended_at: the replay with its trace "
                "written and closed, without start-up and the workload's loading); steps/s and sequence-steps/s over the median wall time / over the median CPU time.")
    table = markdown_table(["scenario", "requests", "simulated s", "steps", "trace rows", "each wall s",
                            "median wall s", "median replay s", "median CPU s", "steps/s (wall / CPU)",
                            "sequence-steps/s (wall / CPU)"], rows)
    if vs_vidur is not None and not vidur_runs:
        table += (f"\n\nShareGPT-like vs Vidur 0.0.26 ({VIDUR_WALL_S} s of wall time here, no KV trace): "
                  f"**{vs_vidur[0]:.2f}x** its time in wall time, **{vs_vidur[1]:.2f}x** in CPU time. "
                  "(No Vidur venv: `bash scripts/vidur_env.sh` builds it, and this suite then runs it.)")
    if rows:
        section.add(table)
    if tier_lines:
        section.add(f"With a host KV tier (`--offload-size {args.offload_size}`), each repeat's run with it over the "
                    "run without it in the same repeat (issue 57's goal: within 10 %, ≤ 1.10× in CPU time), and "
                    "over the general pass without it (`--no-sim-fast-path`):\n\n"
                    + "\n".join(f"- {line}" for line, _ in tier_lines))
    if swept:
        section.add(swept["report"])
    if vidur_runs:
        section.add(side_by_side(sharegpt, vidur_runs, vidur_bare_runs, vidur_first))
    headline = ("median wall s of `record --engine sim`: " + "; ".join(f"{n} {w:.2f} s" if w < 10 else f"{n} {w:.1f} s"
                                                                       for n, w in medians.items())
                if medians else "")
    if vs_vidur is not None:
        if vidur_runs:
            bare = median([r.wall_s for r in vidur_bare_runs])
            headline += (f" (ShareGPT-like: {vs_vidur[0]:.3f}× Vidur 0.0.26's "
                         f"{median([r.wall_s for r in vidur_runs]):.1f} s side by side, "
                         f"{medians[SHAREGPT] / bare:.2f}× its {bare:.1f} s without metrics; goal ≤ 0.1×: "
                         f"{'met' if vs_vidur[0] <= 0.1 else 'missed'})")
        else:
            headline += f" (ShareGPT-like: {vs_vidur[0]:.2f}× Vidur's {VIDUR_WALL_S} s)"
    if tier_lines:
        headline += "; with a host KV tier / without, CPU time: " + ", ".join(short for _, short in tier_lines)
    if swept:
        headline = "; ".join(filter(None, [headline, swept["headline"]]))
    section.write(headline)


@dataclasses.dataclass
class Runs:
    """One scenario's repeats, as one variant (with or without a tier): each run's times, and its last trace."""

    walls: list[float]
    cpus: list[float]
    replays: list[float]
    last: Path


def tier_ratio(variant: str, tiered: Runs, plain: Runs, general: Runs) -> tuple[str, str]:
    """(a sentence, a short form for the headline) of a scenario's runs with a tier against those without
    (and against the general pass without, which is what a run with a tier runs): the medians of the
    repeats' ratios, and what the tier did in the last run (its copies, from the trace)."""
    cpu = median(ratios(tiered.cpus, plain.cpus))
    wall = median(ratios(tiered.walls, plain.walls))
    over_general = median(ratios(tiered.cpus, general.cpus))
    offloads, loads, preempts = connect([tiered.last]).sql(
        "SELECT count(*) FILTER (WHERE kind = 'offload'), count(*) FILTER (WHERE kind = 'load'), "
        "count(*) FILTER (WHERE kind = 'preempt') FROM kv_events").fetchall()[0]
    each = " ".join(f"{t / p:.2f}" for t, p in zip(tiered.cpus, plain.cpus))
    sentence = (f"{variant}: **{cpu:.2f}×** in CPU time (each repeat {each}), {wall:.2f}× in wall time; "
                f"{over_general:.2f}× the general pass's CPU time without a tier; "
                f"{offloads:,} stores and {loads:,} loads, {preempts:,} preemptions; "
                f"goal ≤ 1.10×: {'met' if cpu <= 1.10 else 'missed'}")
    return sentence, f"{variant.partition(',')[0]} {cpu:.2f}×"


def grid_axis(setting: str) -> str:
    """A `--set name=a,b,c` value as prose: "name a / b / c"."""
    name, _, values = setting.partition("=")
    return f"{name} {' / '.join(values.split(','))}"


def hour_sweep(workload: Path, folder: Path) -> dict:
    """`kvtrace sweep` of the hour over HOUR_SWEEP_GRID: the whole command's wall time, and each point's
    replay (its meta.json's span) and outcome."""
    wall, cpu = kvtrace("sweep", "run", "-w", str(workload), "-o", str(folder), *HOUR_SWEEP_SHARED, *HOUR_SWEEP_GRID)
    spec = json.loads((folder / "sweep.json").read_text())
    points = spec["points"]
    spans = {p["run_id"]: replay_s(folder / "runs" / p["run_id"]) for p in points if p["status"] == "completed"}
    replays = list(spans.values())
    done = len(spans)
    by_run = dict(connect([folder / "runs" / run_id for run_id in spans]).sql(
        "SELECT run_id, count(*) FILTER (WHERE kind = 'preempt') FROM kv_events GROUP BY run_id").fetchall())
    preempted = sum(by_run.values())
    rows = [[", ".join(f"{k} {v}" for k, v in p["settings"].items()), p["status"],
             f"{spans[p['run_id']]:.1f}" if p["run_id"] in spans else "-",
             f"{by_run.get(p['run_id'], 0):,}" if p["run_id"] in spans else "-"] for p in points]
    report = (f"The hour swept: `kvtrace sweep run` of its 72,000 requests over {len(points)} points "
              f"({' by '.join(grid_axis(s) for s in HOUR_SWEEP_GRID[1::2])}; "
              "Llama-3-8B / H100, 8,192 tokens a step), its points run side by side, one process per core: "
              f"**{wall / 60:.1f} min** of wall time for the whole sweep ({cpu / 60:.1f} min of CPU time), "
              f"{done} of {len(points)} points completed, each point's replay {min(replays, default=0):.1f}"
              f"–{max(replays, default=0):.1f} s (median {median(replays) if replays else 0:.1f} s), "
              f"{preempted:,} preemptions over all points. Goal: within the hour it replays (60 min).\n\n"
              + markdown_table(["point", "status", "replay s", "preemptions"], rows))
    return {"report": report,
            "headline": f"the hour swept over {len(points)} points in {wall / 60:.1f} min ({done} completed)"}


def side_by_side(kv: dict, vidur_runs: list, bare_runs: list, vidur_first) -> str:
    """The ShareGPT-like scenario's kvtrace runs and Vidur's, interleaved, and what each simulated."""
    def vidur_row(label: str, runs: list) -> list[str]:
        info = runs[-1].info
        return [f"Vidur {info['vidur_version']} ({label})", " ".join(f"{r.wall_s:.1f}" for r in runs),
                f"{median([r.wall_s for r in runs]):.1f}", f"{median([r.cpu_s for r in runs]):.1f}",
                f"{info['batches']:,}", f"{info['sequence_steps']:,}", f"{info['simulated_s']:,.0f}",
                f"{info['num_blocks']:,}"]

    rows = [["kvtrace `record --engine sim` (full KV trace)", " ".join(f"{w:.2f}" for w in kv["walls"]),
             f"{median(kv['walls']):.2f}", f"{median(kv['cpus']):.2f}", f"{kv['steps']:,}", f"{kv['seq_steps']:,}",
             f"{kv['simulated_s']:,.0f}", f"{kv['num_gpu_blocks']:,}"],
            vidur_row("its metrics and Chrome trace, as by default", vidur_runs),
            vidur_row("no metrics, no trace", bare_runs)]
    kv_wall, kv_cpu = median(kv["walls"]), median(kv["cpus"])
    ratios = "; ".join(
        f"{what}: **{kv_wall / median([r.wall_s for r in runs]):.3f}x** in wall time, "
        f"{kv_cpu / median([r.cpu_s for r in runs]):.3f}x in CPU time"
        for what, runs in (("against Vidur with its outputs", vidur_runs), ("against Vidur without", bare_runs)))
    phases = " / ".join(f"{median([r.info[k] for r in vidur_runs]):.1f}" for k in ("import_s", "predictor_s", "simulate_s"))
    first = (f"Vidur's first run, not timed (it trains its random forests into --vidur-cache when they are not "
             f"there yet), took {vidur_first.wall_s:.0f} s, {vidur_first.info['predictor_s']:.0f} s of them in its "
             "predictor." if vidur_first else "")
    return (
        "Side by side on the ShareGPT-like workload, each repeat kvtrace, then Vidur, then Vidur without outputs "
        "(whole processes):\n\n"
        + markdown_table(["simulator", "each wall s", "median wall s", "median CPU s", "steps (batches)",
                          "sequence-steps", "simulated s", "KV blocks (16 tokens)"], rows)
        + f"\n\nkvtrace's time {ratios}. "
        f"Vidur's median seconds in import / predictor (loading its cached predictions) / simulation and outputs: "
        f"{phases}. {first}\n\n"
        "Vidur's configuration: meta-llama/Llama-3-8B, device a100 (network a100_dgx, unused at TP = PP = 1), "
        "one replica, its `vllm` replica scheduler (whole prefills, no chunking), block size 16, batch_size_cap 256, "
        "max_tokens_in_batch 8,192, KV pool from gpu_memory_utilization 0.9 by its memory planner, requests of at "
        "most 8,192 tokens, its random-forest predictor (one point of its grid: 250 trees, depth 16, min split 2; "
        "predictions to 8,192 tokens), no plots (kaleido needs a Chrome it cannot fetch here). Its execution-time "
        "profiles (benchmarks/data/vidur/README.md): "
        + ", ".join(f"`{p.relative_to(ROOT)}`" for p in PROFILES.values())
        + " — Vidur's own A100 measurements of Llama-3-8B: the MLP table's medians at TP = 1, and 249 rows of its "
        "attention table (prefill and decode, FlashInfer, block 16, TP = 1) copied from a public copy of it."
    )
