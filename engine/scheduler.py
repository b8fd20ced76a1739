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
    if policy == "priority":  # V1: the least urgent, then the latest to arrive
        return (seq.priority, seq.arrival_s, seq.arrival_order)
    if policy == "fewest-computed":
        return (-seq.num_computed_tokens, seq.admitted_order)
    return (seq.admitted_order,)  # newest, newest-sparing


class Scheduler:
    """vLLM V1's scheduling step (vLLM 0.32.0, v1/core/sched/scheduler.py), with vLLM V0's swap queue
    and kvtrace's own preemption policies as options.

    Running sequences are served first, oldest first, each with blocks for the tokens it computes in
    this step; when the pool runs dry the victim policy frees a sequence, possibly the one being
    served, which ends the pass. Waiting sequences are admitted front first, only in a step without
    preemptions, only if their whole prompt fits, with blocks for their first chunk.
    """

    def __init__(self, block_manager: BlockManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 preemption_mode: str, preemption_policy: str, long_prefill_token_threshold: int = 0,
                 enable_chunked_prefill: bool = True) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.preemption_policy = preemption_policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
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
        bm = self.bm
        budget = self.max_num_batched_tokens
        threshold = self.long_prefill_token_threshold
        if threshold and len(self.running) + len(self.waiting) + len(self.swapped) <= 1:
            threshold = 0  # a lone request starves nobody: it may use the whole budget
        scheduled: dict[int, tuple[int, int]] = {}  # id(seq) -> (tokens scheduled, cached blocks before)

        # 1. Running sequences, oldest first: decode tokens and continuing prefill chunks.
        running = self.running
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            num_new = seq.num_tokens - seq.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                num_new = budget
            preempted_self = False
            while not bm.can_grow(seq, num_new):
                victim = self._pick_victim(seq)
                index = running.index(victim)
                if id(victim) in scheduled:  # already in this step's batch: take it back out
                    num_victim, num_hashed = scheduled.pop(id(victim))
                    budget += num_victim
                    j = out.seqs.index(victim)
                    del out.seqs[j], out.num_new_tokens[j]
                    bm.uncache_from(victim, num_hashed)  # cached when scheduled, never computed
                self._preempt(victim, out)
                if victim is seq:
                    preempted_self = True
                    break
                if index < i:
                    i -= 1
            if preempted_self:
                if self.preemption_policy in ("newest", "priority"):
                    break  # V1: the sequence that preempted itself ends the running pass
                continue
            num_hashed = len(seq.block_hashes)
            copy = bm.grow(seq, num_new)
            if copy:
                out.copies.append(copy)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled[id(seq)] = (num_new, num_hashed)
            budget -= num_new
            i += 1

        if out.num_preemptions:
            return out

        # 2. vLLM V0's swap mode: swapped sequences come back before anything new is admitted.
        while self.swapped and budget > 0 and len(running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if not bm.can_swap_in(seq, num_new):
                if bm.can_ever_hold(max(seq.num_tokens, seq.num_computed_tokens + 1, seq.num_reserved_tokens)):
                    break
                self.swapped.popleft()  # outgrew the whole pool: it can never resume
                seq.finish_reason = "capacity"
                out.rejected.append(seq)
                continue
            self.swapped.popleft()
            self._admit(seq, "resume-swap", seq.num_tokens - seq.num_computed_tokens)
            host_ids = list(seq.host_block_table)
            mapping = bm.swap_in(seq)
            out.swap_in.extend(mapping)
            event = KVEvent(ev.SWAP_IN, seq.req_id, seq.sample, blocks=[d for _, d in mapping],
                            src_blocks=host_ids, num_tokens=seq.num_computed_tokens)
            bm.events.append(event)
            out.swap_in_events.append(event)
            copy = bm.grow(seq, num_new)
            assert copy is None, "a swapped-in sequence shares no block"
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        if self.swapped:
            return out

        # 3. Waiting sequences (new, or preempted by recompute), front first. A running request
        # still prefilling will fork its other samples (--n-mode cow): they count against
        # max_num_seqs already.
        num_forks = sum(s.num_pending_forks for s in running) if self.waiting else 0
        while self.waiting and budget > 0:
            if len(running) + num_forks >= self.max_num_seqs:
                break
            seq = self._next_waiting()
            if seq.num_pending_forks and running and len(running) + num_forks + 1 + seq.num_pending_forks > self.max_num_seqs:
                break
            if not bm.can_ever_hold(max(seq.num_tokens + 1, seq.num_reserved_tokens)):
                self.waiting.remove(seq)
                seq.finish_reason = "rejected" if seq.num_output_tokens == 0 else "capacity"
                out.rejected.append(seq)
                continue
            cached_ids = bm.match_prefix(seq)
            num_cached = len(cached_ids) * bm.block_size
            num_new = seq.num_tokens - num_cached
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    break
                num_new = budget
            # V1's watermark holds back admissions only while something else runs
            if not bm.can_allocate(seq, cached_ids, watermark=bool(running)):
                break
            self.waiting.remove(seq)
            num_forks += seq.num_pending_forks
            resumed = seq.num_ever_computed > 0
            reason = "resume-recompute" if resumed else "new"
            self._admit(seq, reason, seq.num_tokens - num_cached)
            bm.allocate(seq, cached_ids, num_new, reason)
            seq.num_prefix_hit_tokens += num_cached
            if resumed:
                seq.reprefill_target = seq.num_tokens
                seq.reprefill_cached = num_cached
                seq.reprefill_recomputed = 0
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
            return min(self.waiting, key=lambda s: (s.priority, s.arrival_s, s.arrival_order))
        return self.waiting[0]

    def _admit(self, seq: Sequence, reason: str, num_tokens: int) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._admit_counter
        self._admit_counter += 1
        seq.protected = reason != "new"
        self.running.append(seq)
        self.bm.events.append(KVEvent(ev.ADMIT, seq.req_id, seq.sample, num_tokens=num_tokens, reason=reason))

    def _pick_victim(self, needing: Sequence) -> Sequence:
        """The running sequence to preempt so that `needing` can get blocks; `needing` itself is a
        candidate (it may be the newest).

        V1's policies (newest, priority) take the last admitted or the least urgent, unconditionally.
        kvtrace's newest-sparing and fewest-computed spare sequences resumed but not yet progressed
        (no preempt-readmit livelock) and prefer victims whose release frees a block (a victim whose
        blocks are all shared frees nothing).
        """
        policy = self.preemption_policy
        if policy == "newest":
            return self.running[-1]
        if policy == "priority":
            return max(self.running, key=lambda s: (s.priority, s.arrival_s, s.arrival_order))
        others = [s for s in self.running if s is not needing and not s.protected]
        freeing = [s for s in others if any(self.bm.blocks[b].ref_count == 1 for b in s.block_table)]
        if needing.protected and others:  # a resumed sequence re-prefilling in chunks is spared too
            return max(freeing or others, key=lambda s: victim_key(policy, s))
        candidates = (freeing or others) + [needing]
        return max(candidates, key=lambda s: victim_key(policy, s))

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
