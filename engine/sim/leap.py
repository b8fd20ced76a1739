"""Leaps: many simulated steps, in each of which every running sequence makes a plain decode and
nothing else happens, taken and handed to the tracer at once.

In such steps nothing waits, is swapped, preempted, finishes or arrives, so each step's outcome is
known ahead: the sequences' tokens are placeholders, and the steps at which each takes or completes
a block are computed once. A leap ends before the step that would start at or after the next
arrival, before the step at which a sequence would stop, and before the step whose blocks the free
queue no longer covers; those steps are left to the fast path's step or the general pass. Beside
a host KV tier, the stores in flight (nothing else: fast_path.py's `_tier_quiet`) finish in the
leap's steps whose ends reach their times, filed there as the general step files them.

A tracer with `on_decode_leap(leap)` (kvtrace's trace writer) takes the leap whole, as columns;
any other gets its steps' StepRecords one by one (`DecodeLeap.records()`). The words (leap, plain
decode) are defined in docs/glossary.md.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from itertools import chain
from typing import TYPE_CHECKING

import numpy as np

from engine.events import ALLOC, AdmissionStop, AllocReason, KVEvent, StepRecord
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.sim.decodes import grow_decode, is_plain_decode

if TYPE_CHECKING:
    from engine.connector import OffloadingConnector
    from engine.llm_engine import LLMEngine
    from engine.offload import TierCopy


class LeapAllocs:
    """A leap's events, every one a decode's alloc of one block, as columns, in order."""

    __slots__ = ("req_ids", "samples", "blocks", "evicted", "steps")

    def __init__(self) -> None:
        self.req_ids: list[str] = []
        self.samples: list[int] = []
        self.blocks: list[int] = []
        self.evicted: list[list[int] | None] = []   # the cached blocks the alloc evicted, if any
        self.steps: list[int] = []                  # the alloc's step in the leap (0: its first)

    def __len__(self) -> int:
        return len(self.blocks)

    def add(self, seq: Sequence, block_id: int, evicted: list[int] | None) -> None:
        """The sequence took `block_id` (its step is stamped by `stamp`)."""
        self.req_ids.append(seq.req_id)
        self.samples.append(seq.sample)
        self.blocks.append(block_id)
        self.evicted.append(evicted)

    def stamp(self, step: int) -> None:
        """The allocs added since the last stamp were made in the leap's step `step`."""
        self.steps += [step] * (len(self.blocks) - len(self.steps))


@dataclass(slots=True)
class DecodeLeap:
    """A leap handed over at once: the StepRecords it stands for, as columns, so that a long
    replay builds no record per step. Step j of the leap (0 <= j < num_steps) is step
    `first_step + j`: every running sequence decodes one token (its token idx `first_token_idx[i] + j`,
    a placeholder id recorded as null), nothing waits, is swapped, preempted or finishes, and its
    events are its decodes' block allocations (`allocs`; `alloc_columns`, `events`) and, beside a host
    KV tier, the stores in flight that finish in its steps (`copy_events`, each filed after its step's
    allocations). `records()` gives the steps one by one."""

    first_step: int
    start_s: list[float]
    end_s: list[float]
    device_ms: list[float]
    num_free_blocks: list[int]
    num_cached_blocks: list[int]
    num_running: int
    num_total_blocks: int
    first_kv_tokens: int            # num_kv_tokens of the first step; each later one holds num_running more
    first_event_seq: int            # the seq number its first event takes (the first alloc's evictions first)
    allocs: LeapAllocs
    token_req_ids: list[str]        # the running sequences in batch order: each step's tokens
    token_samples: list[int]
    first_token_idx: list[int]
    tier: bool = False              # the engine has a host KV tier: each step records its copies finished
    # beside a host KV tier: the stores that finished in its steps, stamped (step, ts_s, seq), in the order
    # filed; and what each step that filed any records of them (offload_bytes, load_bytes,
    # tier_transfer_ms), by its place in the leap (any other step: TIER_STEP)
    copy_events: list[KVEvent] = field(default_factory=list)
    tier_steps: dict[int, tuple[int, int, float]] = field(default_factory=dict)

    # what a leap's step records of the host KV tier's copies, in a run with one, where none finished
    TIER_STEP = {"offload_bytes": 0, "load_bytes": 0, "tier_transfer_ms": 0.0}

    @property
    def num_steps(self) -> int:
        return len(self.start_s)

    @staticmethod
    def step_columns(leaps: list[DecodeLeap]) -> dict[str, np.ndarray | list]:
        """The steps of `leaps`, in order, as StepRecord's fields (events, tokens and finishes aside),
        each a column over the steps (numpy's, but device_ms, a list): the one account of what a
        leap's step records."""
        k = np.array([w.num_steps for w in leaps], dtype=np.int64)
        n = np.repeat(np.array([w.num_running for w in leaps], dtype=np.int64), k)
        total = np.repeat(np.array([w.num_total_blocks for w in leaps], dtype=np.int64), k)
        j = np.arange(int(k.sum())) - np.repeat(np.cumsum(k) - k, k)   # a step's place in its leap
        free = np.array(list(chain.from_iterable(w.num_free_blocks for w in leaps)), dtype=np.int64)
        none = np.zeros(len(j), dtype=np.int64)
        return {
            "step": np.repeat(np.array([w.first_step for w in leaps], dtype=np.int64), k) + j,
            "start_s": np.array(list(chain.from_iterable(w.start_s for w in leaps)), dtype=np.float64),
            "end_s": np.array(list(chain.from_iterable(w.end_s for w in leaps)), dtype=np.float64),
            "device_ms": list(chain.from_iterable(w.device_ms for w in leaps)),
            "num_running": n, "num_waiting": none, "num_swapped": none, "num_prefill_tokens": none,
            "num_decode_tokens": n, "num_recompute_tokens": none, "num_free_blocks": free,
            "num_used_blocks": total - free,
            "num_cached_blocks": np.array(list(chain.from_iterable(w.num_cached_blocks for w in leaps)),
                                          dtype=np.int64),
            "num_total_blocks": total,
            "num_kv_tokens": np.repeat(np.array([w.first_kv_tokens for w in leaps], dtype=np.int64), k) + j * n,
            "num_preemptions": none, "admission_stop": np.full(len(j), AdmissionStop.NOTHING_WAITING, dtype=object),
            **(DecodeLeap._tier_columns(leaps) if leaps[0].tier else {}),
        }

    @staticmethod
    def _tier_columns(leaps: list[DecodeLeap]) -> dict[str, np.ndarray]:
        """The tier's columns of the leaps' steps (StepRecord's offload_bytes, load_bytes,
        tier_transfer_ms): TIER_STEP's, but where a step filed a copy."""
        num_steps = sum(w.num_steps for w in leaps)
        columns = {name: np.full(num_steps, value) for name, value in DecodeLeap.TIER_STEP.items()}
        at = 0
        for w in leaps:
            for j, values in w.tier_steps.items():
                for column, value in zip(columns.values(), values):
                    column[at + j] = value
            at += w.num_steps
        return columns

    @staticmethod
    def alloc_columns(leaps: list[DecodeLeap]) -> dict[str, np.ndarray | list]:
        """The alloc events of `leaps`, in order, as KVEvent's fields (kind, reason and blocks
        aside: each a decode's alloc of `block`), each a column: the one account of a leap's events.
        An alloc's evictions take the seq numbers right before its own (`events.with_evictions`), and a
        store filed in an earlier step of its leap one (`copy_events`)."""
        allocs = [w.allocs for w in leaps]
        num = np.array([len(a) for a in allocs], dtype=np.int64)
        evicted = list(chain.from_iterable(a.evicted for a in allocs))
        num_evicted = np.zeros(len(evicted), dtype=np.int64)
        evicting = [i for i, blocks in enumerate(evicted) if blocks]
        num_evicted[evicting] = [len(evicted[i]) for i in evicting]
        # a leap's i-th alloc: its first_event_seq + i + the blocks its allocs up to it evicted
        evicted_through = np.cumsum(num_evicted)
        first = np.cumsum(num) - num   # each leap's first alloc among the rows
        evicted_before = np.concatenate([[0], evicted_through])[first]   # by the leaps before
        seq = (np.repeat(np.array([w.first_event_seq for w in leaps], dtype=np.int64) - first - evicted_before, num)
               + np.arange(len(evicted)) + evicted_through)
        steps = np.array(list(chain.from_iterable(a.steps for a in allocs)), dtype=np.int64)
        filed = [(i, e.step - w.first_step) for i, w in enumerate(leaps) for e in w.copy_events]
        if filed:   # and the copies filed in the steps of its leap before its own: keyed (leap, step), in order
            leap_of = np.repeat(np.arange(len(leaps), dtype=np.int64), num)
            width = max(w.num_steps for w in leaps) + 1
            copy_keys = np.array([i * width + j for i, j in filed], dtype=np.int64)
            seq += (np.searchsorted(copy_keys, leap_of * width + steps, side="left")
                    - np.searchsorted(copy_keys, leap_of * width, side="left"))
        num_steps = np.array([w.num_steps for w in leaps], dtype=np.int64)
        start_s = np.array(list(chain.from_iterable(w.start_s for w in leaps)), dtype=np.float64)
        return {
            "seq": seq, "step": np.repeat(np.array([w.first_step for w in leaps], dtype=np.int64), num) + steps,
            "ts_s": start_s[np.repeat(np.cumsum(num_steps) - num_steps, num) + steps],
            "req_id": list(chain.from_iterable(a.req_ids for a in allocs)),
            "sample": np.array(list(chain.from_iterable(a.samples for a in allocs)), dtype=np.int64),
            "block": np.array(list(chain.from_iterable(a.blocks for a in allocs)), dtype=np.int64),
            "evicted": evicted,
        }

    @property
    def events(self) -> list[KVEvent]:
        """Its alloc events as the KVEvents the steps one by one would have made, stamped."""
        columns = {name: values.tolist() if isinstance(values, np.ndarray) else values
                   for name, values in self.alloc_columns([self]).items()}
        return [KVEvent(ALLOC, req_id, sample, blocks=[block], reason=AllocReason.DECODE, evicted=evicted,
                        step=step, ts_s=ts_s, seq=seq)
                for seq, step, ts_s, req_id, sample, block, evicted in zip(*columns.values())]

    def records(self) -> list[StepRecord]:
        """The leap's steps as the StepRecords the general pass would have made, in order."""
        fields = {name: values.tolist() if isinstance(values, np.ndarray) else values
                  for name, values in self.step_columns([self]).items()}
        by_step: dict[int, list[KVEvent]] = {}
        for e in self.events + self.copy_events:   # a step's allocations, then the copies it filed
            by_step.setdefault(e.step, []).append(e)
        return [StepRecord(**{name: values[j] for name, values in fields.items()},
                           events=by_step.get(self.first_step + j, []), token_req_ids=self.token_req_ids.copy(),
                           token_samples=self.token_samples.copy(), token_idx=[i + j for i in self.first_token_idx],
                           token_ids=[None] * self.num_running, finished=[])
                for j in range(self.num_steps)]


def take_leap(engine: LLMEngine, until_s: float, max_steps: int = 256) -> tuple[int, int]:
    """Run the leap that starts at the engine's next step, up to the step that would start
    at or after `until_s`: (steps, tokens), or (0, 0) when the next step cannot start one. The caller
    has dissolved any lazy decodes (cohort.py): every running sequence's counts are its own.

    Each step is the one the general pass would run: the same block allocations, evictions and
    prefix-cache entries in the same order, the same predicted times, the same step records, events
    and tokens. What the leap makes cheap is the per-sequence work: a step touches only the
    sequences that take or complete a block, and each sequence's counts are advanced once at the end."""
    sched, bm, runner = engine.scheduler, engine.block_manager, engine.runner
    running = sched.running
    num_running = len(running)
    tokens = runner.sample(None, running, None)
    bs = bm.block_size
    shared = bm.shared_fill
    stop_token_ids = engine.stop_token_ids
    horizon = max_steps
    for seq, token in zip(running, tokens):   # every decode plain, and the first stop
        computed = seq.num_computed_tokens
        num_tokens = len(seq.token_ids)
        if not is_plain_decode(seq) or token in stop_token_ids:
            return 0, 0
        if shared and not shared.keys().isdisjoint(seq.block_table[computed // bs:]):
            return 0, 0   # a write ahead copies a shared block first (forks share even blocks reserved ahead)
        # after step j it holds num_tokens + j + 1 tokens: the leap ends before the step it stops at
        horizon = min(horizon, seq.stop_num_tokens - num_tokens - 1)
    if horizon < 2:
        return 0, 0
    # the steps at which each sequence takes a block (allocs) or completes one (prefix cache), in the
    # batch's order within a step (a running sequence's hashes are up to date: every grow caches what
    # its step completes, a swap-in's included)
    caching = bm.enable_prefix_caching
    touched: dict[int, list[Sequence]] = {}
    num_allocs = [0] * horizon
    for seq in running:
        computed = seq.num_computed_tokens
        first = len(seq.block_table) * bs - computed
        steps = set(range(first, horizon, bs))
        for j in steps:
            num_allocs[j] += 1
        if caching:
            steps.update(range((-1 - computed) % bs, horizon, bs))
        for j in steps:
            touched.setdefault(j, []).append(seq)
    # the blocks run short at the first step whose allocations the free blocks no longer cover
    num_free = bm.num_free_blocks
    for j, n in enumerate(num_allocs):
        num_free -= n
        if num_free < 0:
            horizon = j
            break
    if horizon < 1:
        return 0, 0
    for seq, token in zip(running, tokens):   # their tokens, ahead (a block's hash reads them)
        seq.token_ids.extend([token] * horizon)
    first_idx = [len(seq.token_ids) - horizon - seq.num_prompt_tokens for seq in running]
    held = sum(seq.num_computed_tokens for seq in running)
    num_kv = bm.num_kv_positions(running) + num_running   # of the first step; then num_running more a step
    first_step = engine.step_counter
    # the steps' times first (the clock is the executor's; nothing below moves it), and the steps in which
    # a host KV tier's stores in flight finish (fast_path.py's _tier_quiet: stores only); then their block work
    connector = sched.connector
    in_flight = list(connector.copies_in_flight) if connector is not None else []
    starts, ends, forward, finishing = runner.decode_clock(num_running, held, horizon, until_s, engine.time_origin,
                                                           [copy.done_s for copy in in_flight])
    if connector is not None and connector.has_work_without_a_batch():
        connector.build_connector_meta(SchedulerOutput())   # its first step's: nothing offered, the finished re-ranked
    free: list[int] = []
    cached: list[int] = []
    allocs = LeapAllocs()
    free_now, cached_now = bm.num_free_blocks, bm.num_cached_free_blocks   # change only as sequences grow
    k = len(starts)
    for j in range(k):
        grow = touched.get(j)
        if grow is not None:
            for seq in grow:   # the decode's grow, at this step's length
                grow_decode(bm, seq, seq.num_computed_tokens + j + 1, allocs)
            allocs.stamp(j)
            free_now, cached_now = bm.num_free_blocks, bm.num_cached_free_blocks
        free.append(free_now)
        cached.append(cached_now)
    assert not bm.events and not bm.evicted, "a leap's step made an event other than a decode's alloc"
    engine.step_counter = first_step + k
    event_seq = engine._event_seq
    copy_events, tier_steps = _file_copies(connector, in_flight, finishing, allocs, first_step, ends, event_seq)
    leap = DecodeLeap(
        first_step=first_step, start_s=starts, end_s=ends, device_ms=forward, num_free_blocks=free,
        num_cached_blocks=cached, num_running=num_running, num_total_blocks=bm.num_blocks, first_kv_tokens=num_kv,
        first_event_seq=event_seq, allocs=allocs, token_req_ids=[seq.req_id for seq in running],
        token_samples=[seq.sample for seq in running], first_token_idx=first_idx, tier=connector is not None,
        copy_events=copy_events, tier_steps=tier_steps)
    # each alloc's evictions take the seq numbers before its own (events.with_evictions)
    engine._event_seq = (event_seq + len(allocs) + sum(len(evicted) for evicted in allocs.evicted if evicted)
                         + len(copy_events))
    on_leap = getattr(engine.tracer, "on_decode_leap", None)
    if on_leap is not None:
        on_leap(leap)
    else:
        for record in leap.records():
            engine.tracer.on_step(record)
    for seq in running:   # k steps of the general pass's accounting; the tokens of steps not run go
        seq.num_computed_tokens = seq.num_ever_computed = seq.num_computed_tokens + k
        del seq.token_ids[len(seq.token_ids) - horizon + k:]
    if connector is not None:   # the connector saw the blocks each step gave: every block of their tables now
        assert not connector.prefilling, "a leap beside a sequence prefilling"
        for seq in running:
            seq.num_connector_blocks = len(seq.block_table)
    engine._steps_without_progress = 0
    return k, k * num_running


def _file_copies(connector: OffloadingConnector, in_flight: list[TierCopy], finishing: list[int | None], allocs: LeapAllocs, first_step: int,
                 ends: list[float], event_seq: int) -> tuple[list[KVEvent], dict[int, tuple[int, int, float]]]:
    """The host KV tier's stores that finish in the leap's steps (`finishing`: each one's step, None
    past the leap), completed and filed as the general step's _finish_copies files them: after their
    step's allocations, in the order they were issued, stamped with its end; returns their events and
    what each step that filed any records of them (bytes stored, bytes loaded, milliseconds)."""
    copy_events: list[KVEvent] = []
    tier_steps: dict[int, tuple[int, int, float]] = {}
    for j, i in sorted((j, i) for i, j in enumerate(finishing) if j is not None):
        copy = in_flight[i]
        assert not copy.is_load, "a leap beside a load in flight"
        connector.complete_copy(copy)
        event = copy.event
        num_allocs = bisect_right(allocs.steps, j)   # its step's and those before
        event.step, event.ts_s = first_step + j, ends[j]
        event.seq = (event_seq + num_allocs + sum(len(evicted) for evicted in allocs.evicted[:num_allocs] if evicted)
                     + len(copy_events))
        copy_events.append(event)
        stored, loaded, ms = tier_steps.get(j, (0, 0, 0.0))
        tier_steps[j] = (stored + event.bytes, loaded, ms + (event.duration_ms or 0.0))
    return copy_events, tier_steps
