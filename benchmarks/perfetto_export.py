"""Suite `perfetto-export`: how fast `kvtrace export perfetto` writes a big trace, in how much memory.

Generates the synthetic ~10M-event run of benchmarks/trace_scale.py (or reuses it with --reuse),
then runs the whole command, `python -m kvtrace export perfetto RUN -o FILE`, `--repeats` times in a
child process. Per run: wall and CPU time, the child's peak resident memory (ru_maxrss), and speed
as the run's kv_events rows per second of wall time; the table gives each run and the medians.
Goal (issue 17): at least 300k events/s and under 500 MB.
"""
from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.machine import load_average
from benchmarks.results import Section, markdown_table

ROOT = Path(__file__).resolve().parent.parent


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--events", type=float, default=10e6, help="KV events to generate (about)")
    parser.add_argument("--out", type=Path, default=Path("/tmp/kvtrace-scale"), help="parent folder of the run")
    parser.add_argument("--reuse", action="store_true", help="export an already generated run")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chunk-rows", type=int, default=500_000)


def _export_once(run: Path, output: Path) -> tuple[float, float, float, int]:
    """(wall s, cpu s, peak RSS MB, kv_events exported) of one export in a fresh child process. The
    child's own rusage comes from wait4; the event count from the line the command prints."""
    with tempfile.TemporaryFile("w+") as err:
        started = time.perf_counter()
        child = subprocess.Popen([sys.executable, "-m", "kvtrace", "export", "perfetto", str(run), "-o", str(output)],
                                 cwd=ROOT, stderr=err)
        _, status, usage = os.wait4(child.pid, 0)
        wall = time.perf_counter() - started
        err.seek(0)
        message = err.read()
    print(message, end="")
    if os.waitstatus_to_exitcode(status) != 0:
        raise SystemExit(f"kvtrace export perfetto failed: {message.strip()}")
    num_events = int(re.search(r"from ([\d,]+) KV events", message).group(1).replace(",", ""))
    return wall, usage.ru_utime + usage.ru_stime, usage.ru_maxrss / 1024, num_events     # ru_maxrss: kB


def _generate(run: Path, events: float, seed: int, chunk_rows: int) -> None:
    """benchmarks/trace_scale.py's generator, in a child process: a child forked from a parent that
    held the generated arrays would start with their pages and report them as its peak RSS."""
    code = ("import sys; from pathlib import Path; from benchmarks import trace_scale; "
            "counts = trace_scale.generate(Path(sys.argv[1]), int(float(sys.argv[2])), int(sys.argv[3]), "
            "int(sys.argv[4])); print(', '.join(f'{n:,} {t}' for t, n in counts.items()))")
    subprocess.run([sys.executable, "-c", code, str(run), str(events), str(seed), str(chunk_rows)],
                   check=True, cwd=ROOT)


def run(args: argparse.Namespace) -> int:
    section = Section("perfetto-export")
    run_dir = args.out / "scale"
    if not args.reuse:
        shutil.rmtree(run_dir, ignore_errors=True)
        started = time.perf_counter()
        _generate(run_dir, args.events, args.seed, args.chunk_rows)
        section.add(f"Generated {run_dir} (benchmarks/trace_scale.py) in {time.perf_counter() - started:.1f} s.")
    output = args.out / "scale.pftrace"
    rows, speeds, cpu_speeds, peaks = [], [], [], []
    for repeat in range(args.repeats):
        load = load_average()
        wall, cpu, peak_mb, num_events = _export_once(run_dir, output)
        speeds.append(num_events / wall)
        cpu_speeds.append(num_events / cpu)
        peaks.append(peak_mb)
        rows.append([repeat + 1, f"{wall:.1f}", f"{cpu:.1f}", f"{num_events / wall / 1e3:,.0f}k",
                     f"{num_events / cpu / 1e3:,.0f}k", f"{peak_mb:,.0f}", load])
    size_mb = output.stat().st_size / 1e6
    rows.append(["median", "", "", f"{statistics.median(speeds) / 1e3:,.0f}k", "",
                 f"{statistics.median(peaks):,.0f}", ""])
    section.add(markdown_table(["export", "wall s", "cpu s", "kv_events/s (wall)", "kv_events per cpu s",
                                "peak RSS MB", "load at start"], rows))
    section.add(f"{num_events:,} kv_events in; {size_mb:,.0f} MB of trace out. Peak RSS is the export process's "
                "own (Python, DuckDB and the writer; its imports alone take about 130 MB).")
    speed, peak = statistics.median(speeds), statistics.median(peaks)
    section.write(f"export of {num_events / 1e6:.1f} M kv_events: {speed / 1e3:,.0f}k events/s of wall time "
                  f"({statistics.median(cpu_speeds) / 1e3:,.0f}k per CPU s), peak RSS {peak:,.0f} MB; "
                  f"goal ≥ 300k/s and < 500 MB: {'met' if speed >= 300e3 and peak < 500 else 'missed'}")
    return 0
