"""The capture's self-check (KVTRACE_CAPTURE_SELF_CHECK=1): the pool state its events describe against
the pool's own, after every step whose output is processed.

It replays the written KV events into the blocks each request holds (an alloc or prefix hit gives
blocks, a window's free takes those it names, a preemption or finish takes all of them back; a hybrid
model's groups together: a block is in one group's tables at a time) and compares, per request, those with vLLM's
block table, the blocks in use with the pool's count, and the capture's count of cached free blocks
with the pool's blocks. The tests run it on every step of every workload; done.json reports what it
found (its count and first 20 examples). It walks the whole pool each step: for tests and
investigation, not for a production server.
"""
from __future__ import annotations

from collections.abc import Iterable

from kvtrace.vllm.capture.rows import BLOCKS, KIND, REASON, REQ_ID, KvEvent, ScheduledStep

MAX_EXAMPLES = 20   # of the problems found, the first kept for done.json


class SelfCheck:
    """The blocks each request holds by the events, and what the checks found."""

    def __init__(self, kvm, null_id: int, total_blocks: int) -> None:
        self.kvm = kvm
        self.pool = kvm.block_pool
        self.null_id = null_id
        self.total_blocks = total_blocks
        self.held: dict[str, set[int]] = {}                # blocks per request, from the written events
        self.check_errors: list[str] = []
        self.num_check_errors = 0
        self.num_checked_steps = 0

    def replay(self, events: list[KvEvent], held: dict[str, set[int]] | None = None) -> None:
        held = self.held if held is None else held
        for e in events:   # (by index: the wraps' events are plain tuples, rows.py)
            kind, rid, reason = e[KIND], e[REQ_ID], e[REASON]
            if kind in ("alloc", "prefix_hit") and rid:
                held.setdefault(rid, set()).update(e[BLOCKS])
            elif kind in ("preempt", "finish"):
                held.pop(rid, None)
            elif kind == "free" and (reason in ("window", "state") or reason == "other" and rid):
                # dropped mid-request; or given back otherwise (a KV connector's failed load, computed again)
                held.get(rid, set()).difference_update(e[BLOCKS])

    def check(self, step: int, waiting: Iterable[ScheduledStep], cached_free: int) -> None:
        """After `step`'s events were written; `waiting`: the steps scheduled since, whose events, and
        the requests freed filed with them, are not written yet but are in the pool already (async)."""
        self.num_checked_steps += 1
        problems = []
        in_use: set[int] = set()
        held = self.held
        waiting = list(waiting)
        if waiting:   # async: the next step is scheduled before this one's output; its events wait
            held = {rid: set(blocks) for rid, blocks in held.items()}
            for scheduled in waiting:
                self.replay(scheduled.events, held)
                for request, _ in scheduled.finishing:   # their finish events are made when written
                    held.pop(request.request_id, None)
        for rid, blocks in held.items():
            own = {b for ids in self.kvm.get_block_ids(rid) for b in ids if b != self.null_id}   # every group's
            if own != blocks:
                problems.append(f"step {step}: {rid} holds {sorted(own)} but the events say {sorted(blocks)}")
            in_use |= blocks
        pool_used = self.total_blocks - self.pool.get_num_free_blocks()
        if len(in_use) != pool_used:
            problems.append(f"step {step}: {pool_used} blocks in use but the events account for {len(in_use)}")
        cached = sum(1 for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None)
        if cached != cached_free:
            problems.append(f"step {step}: {cached} cached free blocks but the capture counted {cached_free}")
        if problems:
            self.num_check_errors += len(problems)
            self.check_errors.extend(problems[: max(0, MAX_EXAMPLES - len(self.check_errors))])
