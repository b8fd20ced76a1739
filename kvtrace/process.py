"""What kvtrace does to its own process to run and end sooner: the cyclic garbage collector's
settings. They are here, and nowhere else, each with what it saves: `kvtrace record --engine sim` is
timed whole against another simulator, and `kvtrace sweep` starts one per point. Each figure below is
`python -m benchmarks process` (benchmarks/RESULTS.md, its `process` row): the 1,000-request
ShareGPT-like simulated recording (about 1 s), each setting taken out alone, medians of 8 rounds in
turn, 2026-12-05, load about 1. Only public functions of the standard library are used.

The process exits the normal way, every atexit handler run. Ending it with `os._exit` after the
atexit handlers, which skipped the interpreter's teardown, saved about 8 ms more (1 % of that
recording; benchmarks/log/2026-12.md), but a handler registered before the command line's own (by
site, a .pth file, a coverage hook) would never have run: not worth it.
"""
from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

# ---- the collector --------------------------------------------------------------------------


@contextmanager
def start_up() -> Iterator[None]:
    """While the command line loads (modules, classes: all live to the end), no collection; then what
    it made is frozen out of the collector's view, so that no later collection walks it. In the
    collector: 2.0 ms instead of 7.7 ms (15 collections instead of 59)."""
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
    replay's end. In the collector: 2.0 ms instead of 59.3 ms (15 collections instead of 185); with the
    replay's own block alone, not the recording's around it, 12 ms (68 collections; the log, 2026-12-05)."""
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


def finished() -> None:
    """The command is done: what it made is frozen out of the collector's view, so that the collection
    the interpreter makes as it exits walks none of it (from the command's end to the process gone:
    16.3 ms instead of 78.0 ms)."""
    gc.freeze()
