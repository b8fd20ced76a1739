"""Runs `kvtrace` with one of kvtrace/process.py's settings taken out, and reports what the process
spent in the cyclic collector; started by benchmarks/process_tricks.py, one process per run:

    python benchmarks/process_tricks_driver.py VARIANT REPORT.json -- KVTRACE ARGS...

VARIANT is `all` (kvtrace as it is) or `no-start_up`, `no-steady_gc`, `no-finished`: that function of
kvtrace/process.py made a no-op before anything imports it. REPORT.json gets, as the command ends
(when process.finished is called, whether or not it acts), the collector's time and collections so
far and the moment, on the machine's monotonic clock that the parent reads too, so that the parent can
tell how long the exit took from there to the process gone.
"""
from __future__ import annotations

import contextlib
import gc
import json
import sys
import time

VARIANTS = ("all", "no-start_up", "no-steady_gc", "no-finished")


def main() -> None:
    variant, report, separator, *argv = sys.argv[1:]
    if variant not in VARIANTS or separator != "--":
        raise SystemExit(f"usage: process_tricks_driver.py {{{','.join(VARIANTS)}}} REPORT.json -- ARGS...")
    spent = {"s": 0.0, "collections": 0}
    started = [0.0]

    def timed(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            spent["s"] += time.perf_counter() - started[0]
            spent["collections"] += 1

    gc.callbacks.append(timed)

    # kvtrace.process imports only the standard library: nothing of kvtrace's command line is loaded yet
    from kvtrace import process

    if variant == "no-start_up":
        process.start_up = contextlib.nullcontext
    elif variant == "no-steady_gc":
        process.steady_gc = contextlib.nullcontext   # kvtrace.record imports it by name, later
    finished = process.finished

    def finished_and_reported() -> None:
        if variant != "no-finished":
            finished()
        with open(report, "w") as f:
            json.dump({"gc_s": spent["s"], "collections": spent["collections"],
                       "ended_monotonic_s": time.monotonic()}, f)

    process.finished = finished_and_reported
    sys.argv = ["kvtrace", *argv]
    from kvtrace.cli import main as kvtrace_main
    kvtrace_main()


if __name__ == "__main__":
    main()
