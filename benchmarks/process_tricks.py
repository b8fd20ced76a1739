"""Suite `process`: what each of kvtrace/process.py's settings of its own process saves.

kvtrace/process.py sets the cyclic garbage collector three ways: `start_up` (no collection while the
command line loads, then what it made frozen), `steady_gc` (a recording's objects frozen out of the
collector's view and collections made rarer, from the workload's loading to the trace's close) and
`finished` (what the command made frozen before the interpreter's final collection). Each is kept
only for what it saves, so each is measured here by taking it out alone: the 1,000-request
ShareGPT-like simulated recording of the sim-speed suite (`kvtrace record --engine sim`, Llama-3-8B /
A100), run by benchmarks/process_tricks_driver.py as kvtrace is and with one setting a no-op, the
four variants in turn, a rotated order each round. Per run: the time in the collector until the
command's end (gc.callbacks), the exit (from the command's end to the process gone, the monotonic
clock read by both), and the whole command's wall time. A setting's saving is the median of its
rounds' differences (without it minus with everything), in what it acts on: the collector's time for
start_up and steady_gc, the exit for finished. The goal: each saves time, more than nothing.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.results import Section, markdown_table
from benchmarks.sim_speed import (
    SCENARIOS,
    SHAREGPT,
    SHAREGPT_SHAPE,
    byte_compile,
    kvtrace,
)
from benchmarks.stats import median

ROOT = Path(__file__).resolve().parent.parent
DRIVER = Path(__file__).resolve().parent / "process_tricks_driver.py"
VARIANTS = {"all": "everything on", "no-start_up": "without start_up", "no-steady_gc": "without steady_gc",
            "no-finished": "without finished"}
# what each setting acts on: the figure its saving is read in
ACTS_ON = {"no-start_up": "gc_ms", "no-steady_gc": "gc_ms", "no-finished": "exit_ms"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--rounds", type=int, default=8, help="Rounds of the four variants (8).")
    parser.add_argument("--num-requests", type=int, default=1000)


def one_run(variant: str, workload: Path, out: Path, report: Path) -> dict[str, float]:
    """One recording under `variant`: its collector time (ms), collections, exit (ms) and wall (s)."""
    command = [sys.executable, str(DRIVER), variant, str(report), "--", "record", "-q", "-w", str(workload),
               "-o", str(out), *SCENARIOS[SHAREGPT]]
    t0 = time.perf_counter()
    subprocess.run(command, check=True, cwd=ROOT)
    gone = time.monotonic()
    wall = time.perf_counter() - t0
    reported = json.loads(report.read_text())
    return {"gc_ms": reported["gc_s"] * 1e3, "collections": reported["collections"],
            "exit_ms": (gone - reported["ended_monotonic_s"]) * 1e3, "wall_s": wall}


def run(args: argparse.Namespace) -> None:
    section = Section("process")
    byte_compile()
    names = list(VARIANTS)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in names}
    with tempfile.TemporaryDirectory(prefix="kvtrace-process-") as tmp:
        tmp_path = Path(tmp)
        workload = tmp_path / "sharegpt-like.jsonl"
        kvtrace("workload", "synth", "--num-requests", str(args.num_requests), "--rate", "2.5", *SHAREGPT_SHAPE,
                "-o", str(workload))
        for i in range(args.rounds):
            order = names[i % len(names):] + names[:i % len(names)]
            for name in order:
                print(f"  [{i + 1}/{args.rounds}] {VARIANTS[name]} ...", flush=True)
                runs[name].append(one_run(name, workload, tmp_path / f"{name}-{i}", tmp_path / "report.json"))
    # each variant's median of each figure
    med = {name: {figure: median([r[figure] for r in runs[name]]) for figure in ("gc_ms", "collections", "exit_ms",
                                                                                  "wall_s")} for name in names}
    rows = [[VARIANTS[name], f"{med[name]['gc_ms']:.1f}", f"{med[name]['collections']:.0f}",
             f"{med[name]['exit_ms']:.1f}", f"{med[name]['wall_s']:.2f}",
             " ".join(f"{r['wall_s']:.2f}" for r in runs[name])] for name in names]
    section.add(f"`kvtrace record --engine sim` of {args.num_requests:,} ShareGPT-like requests (Llama-3-8B / A100, "
                f"the sim-speed suite's command), {args.rounds} rounds of the four variants in turn; medians:\n\n"
                + markdown_table(["variant", "in the collector ms", "collections", "exit ms", "wall s", "each wall s"],
                                 rows))

    def saved(name: str, figure: str) -> list[float]:
        """Per round: the figure without the setting minus with everything on."""
        return [without[figure] - on[figure] for without, on in zip(runs[name], runs["all"])]

    savings = {name: saved(name, figure) for name, figure in ACTS_ON.items()}
    section.add("Saved per round, the variant without the setting minus everything on (median, range), in what the "
                "setting acts on, and in the whole command's wall time (which a shared machine's noise can swamp):\n\n"
                + markdown_table(["setting", "acts on", "saved ms (median)", "range ms", "wall ms saved (median)"],
                                 [[name.removeprefix("no-"), "the collector" if ACTS_ON[name] == "gc_ms" else "the exit",
                                   f"{median(values):.1f}", f"{min(values):.1f} to {max(values):.1f}",
                                   f"{median(saved(name, 'wall_s')) * 1e3:.0f}"] for name, values in savings.items()]))
    met = all(median(values) > 0 for values in savings.values())
    section.write(
        f"each of kvtrace/process.py's settings taken out alone, medians of {args.rounds} rounds on the "
        f"{args.num_requests:,}-request simulated recording ({med['all']['wall_s']:.2f} s): "
        f"start_up saves {median(savings['no-start_up']):.1f} ms in the collector "
        f"({med['all']['gc_ms']:.1f} ms with it, {med['no-start_up']['gc_ms']:.1f} without), steady_gc "
        f"{median(savings['no-steady_gc']):.1f} ms ({med['no-steady_gc']['gc_ms']:.1f} without), finished "
        f"{median(savings['no-finished']):.1f} ms of the exit ({med['all']['exit_ms']:.1f} ms with it, "
        f"{med['no-finished']['exit_ms']:.1f} without); goal (each saves time): {'met' if met else 'missed'}")
