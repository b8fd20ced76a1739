"""Replay a workload through the engine on its arrival clock."""
from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from kvtrace.errors import KvtraceError
from kvtrace.process import steady_gc
from kvtrace.workload import WorkloadRequest, resolve_prompt_ids, validate_lengths


@dataclass
class ReplayItem:
    req: WorkloadRequest
    prompt_token_ids: list[int] | None   # handed to the engine by the replay, which leaves None here
    arrival_s: float          # on the replay clock (after --time-scale / --backlog)
    params: SamplingParams


@dataclass
class ReplayStats:
    num_requests: int = 0
    num_finished: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0
    num_steps: int = 0
    duration_s: float = 0.0


def prepare(requests: list[WorkloadRequest], engine: LLMEngine, *, tokenizer, seed: int,
            time_scale: float | None, backlog: bool, workload_name: str) -> list[ReplayItem]:
    """Resolve prompts to token ids and check every request can ever run on this engine."""
    vocab = engine.model_config.vocab_size
    ids = [resolve_prompt_ids(r, vocab_size=vocab, tokenizer=tokenizer, seed=seed) for r in requests]
    validate_lengths(requests, [len(p) for p in ids], engine.max_model_len)
    bm = engine.block_manager
    needs = [max(len(p) + 1, engine.reserved_tokens(len(p), r.max_tokens)) for r, p in zip(requests, ids)]
    too_big = [(r, len(p), n) for r, p, n in zip(requests, ids, needs) if not bm.can_ever_hold(n)]
    if too_big:
        usable = bm.num_blocks
        what = "" if engine.config.kv_reserve == "none" else f" (--kv-reserve {engine.config.kv_reserve})"
        groups = f" across its {len(bm.windows)} KV-cache groups" if len(bm.windows) > 1 else ""
        listed = "; ".join(f"line {r.line or r.id}: a prompt of {p} tokens needs {bm.blocks_to_hold(n)} blocks{groups}{what}"
                           for r, p, n in too_big[:5])
        more = f"; and {len(too_big) - 5} more" if len(too_big) > 5 else ""
        raise KvtraceError(f"{workload_name}: {len(too_big)} request(s) can never fit the KV pool of "
                           f"{usable} usable blocks of {bm.block_size} tokens: {listed}{more}")
    items = []
    for r, prompt_ids in zip(requests, ids):
        if backlog:
            arrival = 0.0
        else:
            arrival = r.arrival_s / (time_scale or 1.0)
        params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, top_p=r.top_p,
                                seed=r.seed if r.seed is not None else seed, ignore_eos=r.ignore_eos, n=r.n,
                                output_tokens=r.output_tokens)
        items.append(ReplayItem(r, prompt_ids, arrival, params))
    items.sort(key=lambda item: item.arrival_s)
    return items


def replay(engine: LLMEngine, items: list[ReplayItem], *,
           on_progress: Callable[[ReplayStats], None] | None = None, progress_every_s: float = 0.25,
           stop: Callable[[], None] | None = None, stats: ReplayStats | None = None) -> ReplayStats:
    """Inject requests at their arrival times and step the engine until all are done.

    Requests whose arrival passed while a step ran join at the next step. Time starts now, on the engine's
    clock (virtual for the simulated engine, which jumps over idle gaps). `stop` is called between steps
    and raises to end the replay there (a signal, taken at a safe point). The items are used up: each
    prompt's list is handed to the engine as it arrives (prepare makes new ones for another replay).
    """
    if stats is None:   # given: it holds the counts so far if the replay is interrupted
        stats = ReplayStats()
    stats.num_requests = sum(item.params.n for item in items)
    engine.keep_outputs = False  # the trace keeps what matters; memory stays flat for long replays
    with steady_gc():   # collected before the clock starts: the first requests do not wait for it
        engine.start_clock()
        _run(engine, items, on_progress, progress_every_s, stop, stats)
    fill_stats(stats, engine)
    if on_progress is not None:
        on_progress(stats)
    return stats


def _run(engine: LLMEngine, items: list[ReplayItem], on_progress, progress_every_s: float, stop, stats: ReplayStats) -> None:
    next_item = 0
    last_progress = 0.0
    while next_item < len(items) or engine.has_unfinished():
        if stop is not None:
            stop()
        now = engine.now()
        while next_item < len(items) and items[next_item].arrival_s <= now:
            item = items[next_item]
            engine.add_request(item.req.id, item.prompt_token_ids, item.params,
                               arrival_s=item.arrival_s, priority=item.req.priority, prepared=True)
            item.prompt_token_ids = None   # the engine's now (it appends the outputs): let it go when done
            next_item += 1
        if engine.has_unfinished():
            # the next step, or (the simulator's fast path) several steps at once, up to the next arrival
            num_steps, num_tokens = engine.advance(items[next_item].arrival_s if next_item < len(items) else math.inf)
            stats.num_steps += num_steps
            stats.num_output_tokens += num_tokens
        else:  # idle until the next arrival
            engine.idle_until(items[next_item].arrival_s)
        if on_progress is not None and time.monotonic() - last_progress >= progress_every_s:
            last_progress = time.monotonic()
            fill_stats(stats, engine)
            on_progress(stats)
    engine.flush()


def fill_stats(stats: ReplayStats, engine: LLMEngine) -> None:
    stats.num_finished = engine.num_finished_seqs
    stats.num_preemptions = engine.num_preemptions
    stats.duration_s = engine.now()
