"""Continuous batching with chunked prefill, admission, and preemption when blocks run out."""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine import events as ev
from engine.block_manager import BlockManager
from engine.events import KVEvent
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What runs in one step."""

    # sequences that compute tokens this step, in batch order
    seqs: list[Sequence] = field(default_factory=list)
    # tokens each of `seqs` computes (1 for decode, a chunk for prefill)
    num_new_tokens: list[int] = field(default_factory=list)
    # (device block, host block) copies to make before the forward (preemption by swap)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block) copies to make before the forward (resume from swap)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (src, dst) device block copies for copy-on-write, before the forward
    copies: list[tuple[int, int]] = field(default_factory=list)
    # the swap_out / swap_in events whose duration the executor measures
    swap_out_events: list[KVEvent] = field(default_factory=list)
    swap_in_events: list[KVEvent] = field(default_factory=list)
    # sequences that finished without running (rejected: can never fit)
    rejected: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0


def victim_key(policy: str, seq: Sequence) -> tuple:
    """Sort key of preemption candidates: the largest key is preempted first."""
    if policy == "priority":
        return (seq.priority, seq.admitted_order)
    if policy == "fewest-computed":
        return (-seq.num_computed_tokens, seq.admitted_order)
    return (seq.admitted_order,)  # newest


class Scheduler:
    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str, preemption_policy: str) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.preemption_policy = preemption_policy
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # in admission order, oldest first
        self.swapped: deque[Sequence] = deque()
        self._admit_counter = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.swapped)

    def all_seqs(self) -> list[Sequence]:
        return [*self.running, *self.waiting, *self.swapped]

    # ---- the algorithm ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled: dict[int, int] = {}  # id(seq) -> tokens scheduled

        # 1. Running sequences, oldest first: decode tokens and continuing prefill chunks.
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            preempted_self = False
            while not self.bm.can_append_slot(seq):
                victim = self._pick_victim(seq)
                index = self.running.index(victim)
                if id(victim) in scheduled:  # already in this step's batch: take it back out
                    budget += scheduled.pop(id(victim))
                    j = out.seqs.index(victim)
                    del out.seqs[j], out.num_new_tokens[j]
                self._preempt(victim, out)
                if victim is seq:
                    preempted_self = True
                    break
                if index < i:
                    i -= 1
            if preempted_self:
                continue
            if not seq.is_prefilling:
                copy = self.bm.append_slot(seq)
                if copy:
                    out.copies.append(copy)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled[id(seq)] = num_new
            budget -= num_new
            i += 1

        if out.num_preemptions:
            return out

        # 2. Swapped sequences come back before anything new is admitted.
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if not self.bm.can_swap_in(seq):
                if self.bm.can_ever_hold(max(seq.num_tokens, seq.num_computed_tokens + 1, seq.num_reserved_tokens)):
                    break
                self.swapped.popleft()  # outgrew the whole pool: it can never resume
                seq.finish_reason = "capacity"
                out.rejected.append(seq)
                continue
            self.swapped.popleft()
            self._admit(seq, "resume-swap", seq.num_tokens - seq.num_computed_tokens)
            host_ids = list(seq.host_block_table)
            mapping = self.bm.swap_in(seq)
            out.swap_in.extend(mapping)
            event = KVEvent(ev.SWAP_IN, seq.req_id, seq.sample, blocks=[d for _, d in mapping],
                            src_blocks=host_ids, num_tokens=seq.num_computed_tokens)
            self.bm.events.append(event)
            out.swap_in_events.append(event)
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not seq.is_prefilling:  # was decoding: the pending token may need a block
                copy = self.bm.append_slot(seq)
                assert copy is None, "a swapped-in sequence shares no block"
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        if self.swapped:
            return out

        # 3. Waiting sequences (new, or preempted by recompute), front first. A running request
        # still prefilling will fork its other samples: they count against max_num_seqs already.
        num_forks = sum(s.num_pending_forks for s in self.running) if self.waiting else 0
        while self.waiting and budget > 0:
            seq = self._next_waiting()
            if self.running and len(self.running) + num_forks + 1 + seq.num_pending_forks > self.max_num_seqs:
                break
            if not self.bm.can_ever_hold(max(seq.num_tokens + 1, seq.num_reserved_tokens)):
                self.waiting.remove(seq)
                seq.finish_reason = "rejected" if seq.num_output_tokens == 0 else "capacity"
                out.rejected.append(seq)
                continue
            cached_ids = self.bm.match_prefix(seq)
            if not self.bm.can_allocate(seq, cached_ids):
                break
            self.waiting.remove(seq)
            num_forks += seq.num_pending_forks
            resumed = seq.num_ever_computed > 0
            reason = "resume-recompute" if resumed else "new"
            self._admit(seq, reason, seq.num_tokens - len(cached_ids) * self.bm.block_size)
            self.bm.allocate(seq, cached_ids, reason)
            seq.num_prefix_hit_tokens += seq.num_cached_tokens
            num_to_compute = seq.num_tokens - seq.num_computed_tokens
            if resumed:
                seq.reprefill_target = seq.num_tokens
                seq.reprefill_cached = seq.num_cached_tokens
                seq.reprefill_recomputed = 0
            num_new = min(num_to_compute, budget)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return out

    def adopt(self, seq: Sequence) -> None:
        """A sample forked from a running sequence joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)

    def _next_waiting(self) -> Sequence:
        if self.preemption_policy == "priority":
            return min(self.waiting, key=lambda s: (s.priority, s.arrival_order))
        return self.waiting[0]

    def _admit(self, seq: Sequence, reason: str, num_tokens: int) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._admit_counter
        self._admit_counter += 1
        seq.protected = reason != "new"
        self.running.append(seq)
        self.bm.events.append(KVEvent(ev.ADMIT, seq.req_id, seq.sample, num_tokens=num_tokens, reason=reason))

    def _pick_victim(self, needing: Sequence) -> Sequence:
        """The running sequence to preempt so that `needing` can get a block.

        Sequences resumed but not yet progressed are spared (no preempt-readmit livelock). Others
        whose release frees a block are preferred: a victim whose blocks are all shared frees
        nothing. `needing` itself is a candidate under the same policy (it may be the newest).
        """
        others = [s for s in self.running if s is not needing and not s.protected]
        freeing = [s for s in others if any(self.bm.blocks[b].ref_count == 1 for b in s.block_table)]
        candidates = (freeing or others) + [needing]
        return max(candidates, key=lambda s: victim_key(self.preemption_policy, s))

    def _preempt(self, seq: Sequence, out: SchedulerOutput) -> None:
        self.running.remove(seq)
        out.num_preemptions += 1
        seq.num_preemptions += 1
        held = list(seq.block_table)
        num_positions = seq.num_computed_tokens
        # A copy-on-write decided for the victim earlier in this step has not run yet: drop it.
        # Its new block holds nothing yet; a swap copies the shared source block instead.
        pending_cow = {dst: src for src, dst in out.copies if dst in held}
        if pending_cow:
            out.copies = [(src, dst) for src, dst in out.copies if dst not in pending_cow]
        if seq.reprefill_target:  # cut short while re-prefilling: record what it did redo
            self.record_reprefill(seq, "interrupted")
        if self.preemption_mode == "swap" and self.bm.can_swap_out(seq):
            self.bm.events.append(KVEvent(ev.PREEMPT, seq.req_id, seq.sample, blocks=held,
                                          num_tokens=num_positions, reason="swap"))
            mapping = self.bm.swap_out(seq)
            out.swap_out.extend((pending_cow.get(d, d), h) for d, h in mapping)
            event = KVEvent(ev.SWAP_OUT, seq.req_id, seq.sample, blocks=[d for d, _ in mapping],
                            src_blocks=[h for _, h in mapping], num_tokens=num_positions)
            self.bm.events.append(event)
            out.swap_out_events.append(event)
            seq.status = SequenceStatus.SWAPPED
            seq.num_swaps += 1
            self.swapped.append(seq)
            return
        reason = "recompute" if self.preemption_mode == "recompute" else "swap-full-fallback"
        self.bm.events.append(KVEvent(ev.PREEMPT, seq.req_id, seq.sample, blocks=held,
                                      num_tokens=num_positions, reason=reason))
        self.bm.free(seq, "preempt")
        seq.status = SequenceStatus.WAITING
        seq.protected = False
        self.waiting.appendleft(seq)

    def record_reprefill(self, seq: Sequence, reason: str | None) -> None:
        self.bm.events.append(KVEvent(
            ev.REPREFILL, seq.req_id, seq.sample, num_tokens=seq.reprefill_target,
            num_cached_tokens=seq.reprefill_cached, num_recomputed_tokens=seq.reprefill_recomputed,
            reason=reason))
        seq.reprefill_target = 0

    def finish(self, seq: Sequence) -> None:
        """Remove a finished sequence and release its blocks."""
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        self.bm.free(seq, "finish")
