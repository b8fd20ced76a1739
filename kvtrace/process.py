"""What kvtrace does to its own process to start, run and end sooner: the cyclic garbage collector's
settings and an exit without the interpreter's teardown. They are here, and nowhere else, each with
what it saves: `kvtrace record --engine sim` is timed whole against another simulator, and `kvtrace
sweep` starts one per point. The figures are of the 1,000-request ShareGPT-like simulated recording
(benchmarks/sim_speed.py; about 0.7 s), each trick taken out alone, medians of runs in turn with and
without it (the time in the collector over the whole command, from gc.callbacks; the exit's, from its
last atexit handler to the process gone), on the shared 2-core VM at a load of about 2, 2026-12-05
(benchmarks/log/2026-12.md). Only public functions of the standard library are used.
"""
from __future__ import annotations

import atexit
import gc
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn

# ---- the collector --------------------------------------------------------------------------


@contextmanager
def start_up() -> Iterator[None]:
    """While the command line loads (modules, classes: all live to the end), no collection; then what
    it made is frozen out of the collector's view, so that no later collection walks it. In the
    collector: 2 ms instead of 8 ms (16 collections instead of 59)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


_steady_gc_depth = 0   # the steady_gc blocks open (only the outermost acts)


@contextmanager
def steady_gc() -> Iterator[None]:
    """For a replay. It allocates a step's records and events by the thousand, nearly none in cycles,
    beside what lives for the whole run (the workload's prompts, the engine). The cyclic collector
    would walk the latter again at every full collection and the young objects every 700
    allocations: what exists on entry is frozen out of its view and it runs less often. On leaving,
    everything joins the oldest generation uncollected (frozen, then unfrozen: no young collection
    walks what the block made) and the thresholds are restored. Nested, only the outermost acts: a
    recording holds it from its preparation (the workload, the engine) until its trace is closed, so
    that the trace's buffers, let go by then, are not walked once more by a collection at the
    replay's end. In the collector: 2 ms instead of 62 ms (16 collections instead of 222); 12 ms (68
    collections) with the replay's own block alone, not the recording's around it."""
    global _steady_gc_depth
    _steady_gc_depth += 1
    if _steady_gc_depth > 1:
        try:
            yield
        finally:
            _steady_gc_depth -= 1
        return
    thresholds = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(200_000, 20, 100)
    try:
        yield
    finally:
        _steady_gc_depth -= 1
        gc.freeze()
        gc.set_threshold(*thresholds)
        gc.unfreeze()


# ---- the exit -------------------------------------------------------------------------------
# The interpreter's teardown frees every object of numpy, Arrow, the engine and the run one by one,
# and nothing after it needs them: the command line's exit ends the process once the exit's own work
# is done (from the last atexit handler to the process gone: 10 ms instead of 18 ms). The exit is the
# normal one up to its last atexit handler: its status, the other threads joined, every atexit
# handler run (logging's, tempfile's finalizers, Ray's in a sweep, a test's), then the standard
# streams flushed and `os._exit`. Handlers run in the reverse of the order they were registered in,
# so the one that ends the process is registered when the command line is imported
# (`end_after_atexit_handlers`), before anything the command does can register one; a handler
# registered earlier still, by the interpreter's start-up (site, a .pth file), would not run.

_exit_status: int | None = None   # set by `exit_without_teardown`; None: the exit is the normal one


def end_after_atexit_handlers() -> None:
    """Register `_end`, which ends the process once the atexit handlers registered after it have run,
    if `exit_without_teardown` was called (else it does nothing)."""
    atexit.register(_end)


def exit_without_teardown(code: object) -> NoReturn:
    """Exit as `raise SystemExit(code)` would, with its status (code None: 0; an int: itself; anything
    else: 1, the interpreter printing it), but end the process after the atexit handlers."""
    global _exit_status
    _exit_status = 0 if code is None else code if isinstance(code, int) else 1
    raise SystemExit(code)


def _end() -> None:
    if _exit_status is None:
        return
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):   # a closed pipe: the normal exit reports it
        return
    os._exit(_exit_status)
