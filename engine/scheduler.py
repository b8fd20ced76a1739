"""Continuous batching with chunked prefill, admission, and preemption when blocks run out.

A step is two passes: the running pass, then admission (the words: docs/glossary.md).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from engine import events as ev
from engine.block_manager import BlockManager
from engine.config import VLLM_VERSIONS, PreemptionMode, PreemptionPolicy
from engine.connector import OffloadingConnector
from engine.events import (
    REPREFILL_INTERRUPTED,
    AdmissionStop,
    AdmitReason,
    FinishReason,
    FreeReason,
    KVEvent,
    PreemptReason,
    VictimReason,
)
from engine.offload import OffloadTier, TierCopy
from engine.sequence import Sequence, SequenceStatus


@dataclass
class SchedulerOutput:
    """What runs in one step."""

    # sequences that compute tokens this step, in batch order
    seqs: list[Sequence] = field(default_factory=list)
    # tokens each of `seqs` computes (1 for decode, a chunk for prefill; a decode's drafts on top)
    num_new_tokens: list[int] = field(default_factory=list)
    # speculative decoding: of each of `seqs`' tokens, the draft positions to verify (empty: no drafts)
    num_drafts: list[int] = field(default_factory=list)
    # (device block, host block) copies to make before the forward (preemption by swap)
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    # (host block, device block) copies to make before the forward (resume from swap)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    # (src, dst) device block copies for copy-on-write, before the forward
    copies: list[tuple[int, int]] = field(default_factory=list)
    # the swap_out / swap_in events whose duration the executor measures
    swap_out_events: list[KVEvent] = field(default_factory=list)
    swap_in_events: list[KVEvent] = field(default_factory=list)
    # the host KV tier: stores of the blocks this step computes, loads of admitted sequences' chunks
    tier_copies: list[TierCopy] = field(default_factory=list)
    # sequences that finished without running (rejected: can never fit)
    rejected: list[Sequence] = field(default_factory=list)
    num_preemptions: int = 0
    # speculative decoding: whether the running pass scheduled a sequence that was mid-prompt (V1 pads
    # no admitted decode to the step's uniform 1 + k positions then)
    prefill_scheduled: bool = False
    # why admission stopped: what held back the front of the swapped and waiting queues (an
    # AdmissionStop; nothing-waiting when both are empty at the end of the step's scheduling)
    admission_stop: str = AdmissionStop.NOTHING_WAITING


def urgency(seq: Sequence) -> tuple:
    """V1's priority order: the smallest key is admitted first, the largest preempted first (priority
    value, then arrival)."""
    return (seq.priority, seq.arrival_s, seq.arrival_order)


def victim_key(policy: str, seq: Sequence) -> tuple:
    """Sort key of the candidates of kvtrace's own policies (newest-sparing, fewest-computed): the
    largest key is preempted first. V1's policies pick without it (_pick_victim)."""
    if policy == PreemptionPolicy.FEWEST_COMPUTED:
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
                 enable_chunked_prefill: bool = True, swap_groups: bool = False, max_model_len: int = 0,
                 num_spec_tokens: int = 0, num_lookahead_tokens: int = 0, draft_slots: int = 0) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.preemption_policy = preemption_policy
        self.long_prefill_token_threshold = long_prefill_token_threshold
        self.enable_chunked_prefill = enable_chunked_prefill
        self.swap_groups = swap_groups          # --n-mode cow: a request's samples swap together
        self.max_model_len = max_model_len      # a sequence stops at this many tokens (0: no limit)
        # speculative decoding (EngineConfig.speculative_method): draft tokens proposed a step, KV slots
        # reserved past a sequence's scheduled tokens for its next drafts, and the input slots each
        # scheduled sequence costs beyond its tokens (the step's budget counts them)
        self.num_spec_tokens = num_spec_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.draft_slots = draft_slots
        # async scheduling: a scheduled sequence's next drafts are proposed when it is scheduled, as
        # placeholders (V1's AsyncScheduler), not after its output
        self.drafts_at_schedule = False
        # vLLM 0.33 and later: under the priority policy, the running pass goes on after a sequence that
        # preempted itself (those after it are more urgent and may fit in what it freed); 0.31 and 0.32
        # end it there
        self.priority_pass_goes_on = False
        # vLLM 0.33 and later, speculative decoding: a delivered output caches the full blocks its tokens
        # complete (0.31 and 0.32 cache only what a step schedules, drafts left out)
        self.caches_on_delivery = False
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []      # in admission order, oldest first
        self.swapped: deque[Sequence] = deque()
        self._admit_counter = 0
        # a host KV tier's copies, decided as vLLM's OffloadingConnector does (engine/connector.py; None:
        # no tier), and the sequences whose blocks it loads (holding them, not scheduled: vLLM's
        # WAITING_FOR_REMOTE_KVS)
        self.connector: OffloadingConnector | None = None
        self.loading: list[Sequence] = []
        self.vllm_version = (0, 32)   # (major, minor) of the vLLM whose decisions it makes (follow)

    def follow(self, vllm_version: str) -> None:
        """Make the decisions of this vLLM where versions differ (0.31.0, 0.32.0 (the default),
        0.33.0 or 0.34.0;
        docs/scheduling.md lists what differs)."""
        if vllm_version not in VLLM_VERSIONS:
            raise ValueError(f"kvtrace's scheduler follows vLLM {' or '.join(VLLM_VERSIONS)}, not {vllm_version!r}")
        major, minor = (int(part) for part in vllm_version.split(".")[:2])
        self.vllm_version = (major, minor)
        self.priority_pass_goes_on = (major, minor) >= (0, 33)
        self.caches_on_delivery = (major, minor) >= (0, 33)
        # an EAGLE-style drafter's KV at a block's last position depends on the token after it: up to 0.32 a
        # prefix hit's last block is recomputed; 0.33 on hash each block with the token after it instead
        # (num_hash_lookahead_tokens: 1, as kvtrace's three methods read it; a host tier beside a drafter,
        # where vLLM's connectors decide otherwise, is refused)
        lookahead = self.bm.eagle_drafter and self.bm.enable_prefix_caching and (major, minor) >= (0, 33)
        self.bm.hash_lookahead = 1 if lookahead else 0
        self.bm.drop_last_hit_block = self.bm.eagle_drafter and not lookahead
        if self.connector is not None:
            self.connector.follow(self.vllm_version)

    def add_tier(self, tier: OffloadTier) -> None:
        """Put a host KV tier behind the pool, its copies decided as vLLM's OffloadingConnector decides them."""
        self.connector = OffloadingConnector(tier, self.bm, self.max_model_len)
        self.connector.follow(self.vllm_version)

    @property
    def tier(self) -> OffloadTier | None:
        """The host KV tier (None: none)."""
        return self.connector.tier if self.connector is not None else None

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        """Sequences left, or the host KV tier's copies in flight (the simulator's last stores: the run
        ends once they are filed)."""
        return bool(self.waiting or self.running or self.swapped or self.loading
                    or self.connector is not None and self.connector.copies_in_flight)

    def all_seqs(self) -> list[Sequence]:
        return [*self.running, *self.waiting, *self.swapped, *self.loading]

    # ---- the algorithm ------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Decide the next step: the running sequences first, then the queues (`admit`)."""
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.max_num_batched_tokens)
        self.admit(out, budget)
        if self.connector is not None:   # the tier's copies, once the step is decided
            self.connector.build_connector_meta(out)
        return out

    def prefill_cap(self) -> int:
        """The largest prefill chunk a step gives one sequence (--long-prefill-token-threshold; 0: none)."""
        if len(self.running) + len(self.waiting) + len(self.swapped) + len(self.loading) <= 1:
            return 0   # a lone request starves nobody: it may use the whole budget
        return self.long_prefill_token_threshold

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """1. Running sequences, oldest first: decode tokens and continuing prefill chunks, each with
        blocks for what it computes, preempting when they run out. Returns the budget left."""
        bm = self.bm
        threshold = self.prefill_cap()
        scheduled: dict[int, tuple[int, int]] = {}  # id(seq) -> (tokens scheduled, cached blocks before)
        running = self.running
        max_model_len = self.max_model_len
        hybrid = bm.hybrid
        drafting = self.num_spec_tokens > 0
        draft_slots = self.draft_slots
        i = 0
        while i < len(running) and budget > draft_slots:
            seq = running[i]
            if seq.num_undelivered and seq.num_output_tokens >= seq.stop_length:
                i += 1  # async: its undelivered token is its last (V1 skips it rather than decode past it)
                continue
            # its tokens without KV, and the drafts proposed for it (V1's num_tokens_with_spec)
            num_new = len(seq.token_ids) + seq.num_drafts + seq.num_draft_placeholders - seq.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget - draft_slots:
                num_new = budget - draft_slots
            if max_model_len and num_new > max_model_len - 1 - seq.num_computed_tokens:
                # no input position at or past the max model length: async, a sequence whose
                # in-flight token reaches it is not scheduled again (it finishes on delivery)
                num_new = max_model_len - 1 - seq.num_computed_tokens
                if num_new <= 0:
                    i += 1
                    continue
            if hybrid:   # a window's blocks behind the processed positions go first
                bm.drop_out_of_window(seq, seq.num_computed_tokens - seq.num_in_flight_tokens)
            preempted_self = False
            num_slots = num_new + self.lookahead(seq.num_computed_tokens, num_new) if drafting else num_new
            while not bm.can_grow(seq, num_slots):
                victim, why = self._pick_victim(seq)
                victims = self._swap_group(victim)
                i -= sum(1 for v in victims if v is not seq and running.index(v) < i)
                for taken in victims:
                    if id(taken) in scheduled:  # already in this step's batch: take it back out
                        num_victim, num_hashed = scheduled.pop(id(taken))
                        budget += num_victim + draft_slots
                        j = out.seqs.index(taken)
                        del out.seqs[j], out.num_new_tokens[j]
                        if drafting:
                            del out.num_drafts[j]
                        bm.uncache_from(taken, num_hashed)  # cached when scheduled, never computed
                self._preempt(victims, out, seq, {id(victim): why})
                if seq in victims:
                    preempted_self = True
                    break
            if preempted_self:
                if self.preemption_policy == PreemptionPolicy.NEWEST or (
                        self.preemption_policy == PreemptionPolicy.PRIORITY and not self.priority_pass_goes_on):
                    break  # V1: the sequence that preempted itself ends the running pass
                continue
            num_hashed = len(seq.block_hashes)
            copy = bm.grow(seq, num_new, num_slots - num_new) if drafting else bm.grow(seq, num_new)
            if copy:
                out.copies.append(copy)
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            scheduled[id(seq)] = (num_new, num_hashed)
            budget -= num_new + draft_slots
            if drafting:
                out.prefill_scheduled |= seq.is_prefill_chunk   # as of its last step (V1's flag)
                self._schedule_drafts(seq, num_new, out)
            i += 1
        return budget

    def lookahead(self, start: int, num_new: int) -> int:
        """Speculative decoding: the KV slots reserved past `num_new` positions scheduled from position
        `start`, for the sequence's next drafts, never past the max model length (V1's allocate_slots)."""
        if self.max_model_len and start + num_new + self.num_lookahead_tokens > self.max_model_len:
            return max(0, self.max_model_len - start - num_new)
        return self.num_lookahead_tokens

    def _schedule_drafts(self, seq: Sequence, num_new: int, out: SchedulerOutput, padded: bool = False) -> None:
        """Speculative decoding: of a scheduled sequence's `num_new` positions, those past its tokens
        are drafts to verify (as many of its proposed ones as fit; `padded`: an admitted sequence's
        decode padded to the step's uniform 1 + k positions, placeholder drafts). Its proposals are
        used up: the next are made after the step (V1 clears spec_token_ids when scheduled)."""
        num_tokens = len(seq.token_ids) + seq.num_draft_placeholders   # async: the drafts in flight too
        num_drafts = num_new - 1 if padded else max(0, min(seq.num_drafts, seq.num_computed_tokens + num_new - num_tokens))
        out.num_drafts.append(num_drafts)
        seq.num_drafts = 0
        seq.is_prefill_chunk = seq.num_computed_tokens + num_new < num_tokens
        if self.drafts_at_schedule and not seq.is_prefill_chunk:   # async: placeholders for the next step
            seq.num_draft_placeholders += num_drafts
            seq.num_drafts = self.num_spec_tokens

    def admit(self, out: SchedulerOutput, budget: int) -> None:
        """The queues' turn, after the running pass: swapped sequences come back (vLLM V0's swap mode),
        then waiting ones are admitted; nothing in a step that preempted (V1). Sets why admission
        stopped."""
        if out.num_preemptions:
            if self.waiting or self.swapped:
                out.admission_stop = AdmissionStop.PREEMPTION
            return
        threshold = self.prefill_cap()
        budget = self._swap_in(out, budget)
        if self.swapped:
            if budget <= 0:
                out.admission_stop = AdmissionStop.BUDGET
            return
        self._admit_waiting(out, budget, threshold)

    def _swap_in(self, out: SchedulerOutput, budget: int) -> int:
        """2. vLLM V0's swap mode: swapped sequences come back before anything new is admitted (a
        request's copy-on-write samples together, as they left). Returns the budget left."""
        bm = self.bm
        running = self.running
        while self.swapped and budget > 0:
            group = [self.swapped[0]]
            while len(group) < len(self.swapped) and self.swapped[len(group)].req_id == group[0].req_id:
                group.append(self.swapped[len(group)])
            if running and len(running) + len(group) > self.max_num_seqs:  # alone, may outnumber it (as admitted)
                out.admission_stop = AdmissionStop.SEATS
                break
            new_tokens = []
            left = budget
            for seq in group:
                new_tokens.append(min(seq.num_tokens - seq.num_computed_tokens, left))
                left -= new_tokens[-1]
            if 0 in new_tokens:
                out.admission_stop = AdmissionStop.BUDGET
                break
            if len(group) > 1 and bm.num_swap_in_blocks(group, new_tokens) > bm.num_blocks:
                group, new_tokens = group[:1], new_tokens[:1]  # together they outgrew the pool: one by one
            if not bm.can_swap_in(group, new_tokens):
                seq = group[0]
                if bm.can_ever_hold(max(seq.num_tokens, seq.num_computed_tokens + 1, seq.num_reserved_tokens)):
                    out.admission_stop = AdmissionStop.BLOCKS
                    break
                self.swapped.popleft()  # outgrew the whole pool: it can never resume
                seq.finish_reason = FinishReason.CAPACITY
                out.rejected.append(seq)
                continue
            for _ in group:
                self.swapped.popleft()
            for seq in group:
                self._admit(seq, AdmitReason.RESUME_SWAP, seq.num_tokens - seq.num_computed_tokens)
            copies = bm.swap_in(group)
            for seq, mine in zip(group, copies):
                out.swap_in.extend(mine)
                event = KVEvent(ev.SWAP_IN, seq.req_id, seq.sample, blocks=[d for _, d in mine],
                                src_blocks=[h for h, _ in mine], num_tokens=seq.num_computed_tokens)
                bm.events.append(event)
                out.swap_in_events.append(event)
            for seq, num_new in zip(group, new_tokens):
                copy = bm.grow(seq, num_new)
                if copy:
                    out.copies.append(copy)
                out.seqs.append(seq)
                out.num_new_tokens.append(num_new)
                budget -= num_new
        return budget

    def _admit_waiting(self, out: SchedulerOutput, budget: int, threshold: int) -> None:
        """3. Waiting sequences (new, or preempted by recompute), front first, each only if its whole
        prompt fits, with blocks for its first chunk. A running request still prefilling will fork its
        other samples (--n-mode cow): they count against max_num_seqs already."""
        bm = self.bm
        running = self.running
        first_admitted = len(out.seqs)   # out.seqs[first_admitted:]: admitted in this pass
        num_forks = sum([s.num_pending_forks for s in running]) if self.waiting else 0
        drafting = self.num_spec_tokens > 0
        draft_slots = self.draft_slots
        ran = bool(out.seqs)   # the running pass scheduled someone
        if self.loading:
            budget = self._admit_loaded(out, budget, threshold)
            if budget is None:
                return
        skipped: list[Sequence] = []   # their chunks still stored or loaded: passed over this step
        while self.waiting and budget > draft_slots:
            if len(running) + num_forks >= self.max_num_seqs:
                out.admission_stop = AdmissionStop.SEATS
                break
            seq = self._next_waiting()
            if seq.num_pending_forks and running and len(running) + num_forks + 1 + seq.num_pending_forks > self.max_num_seqs:
                out.admission_stop = AdmissionStop.SEATS
                break
            if not bm.can_ever_hold(max(self._num_positions_to_progress(seq), seq.num_reserved_tokens)):
                self.waiting.remove(seq)
                seq.finish_reason = FinishReason.REJECTED if seq.num_output_tokens == 0 else FinishReason.CAPACITY
                out.rejected.append(seq)
                continue
            cached_ids = bm.match_prefix(seq)
            num_cached = bm.num_hit_tokens(cached_ids)
            if self.connector is not None:
                num_tier = self.connector.lookup(seq, num_cached)
                if num_tier is None:   # vLLM defers it: its chunks are being stored, or loaded for another
                    self.waiting.remove(seq)
                    skipped.append(seq)
                    continue
                if num_tier:   # blocks for the device's and the tier's hits, a load, and no token this step
                    reserved = self.connector.num_blocks_reserved(self.loading, out.seqs[first_admitted:],
                                                                  out.num_new_tokens[first_admitted:])
                    if not (bm.can_allocate(seq, cached_ids, watermark=bool(running)) and bm.can_load(
                            seq, cached_ids, num_cached + num_tier, bool(running), reserved)):
                        out.admission_stop = (AdmissionStop.WATERMARK if running and bm.can_allocate(
                            seq, cached_ids, watermark=False) else AdmissionStop.BLOCKS)
                        break
                    self.waiting.remove(seq)
                    self._start_load(seq, cached_ids, num_tier, out)
                    continue
            num_new = seq.num_tokens - num_cached
            padded = False
            if drafting and num_new == 1 and not out.prefill_scheduled and (ran or num_cached):
                # V1 pads an admitted decode to the step's uniform 1 + k positions (placeholder drafts),
                # where the max model length leaves room; it rather waits than goes unpadded
                k = self.num_spec_tokens
                if not self.max_model_len or num_cached + 1 + k + 1 <= self.max_model_len:
                    if 1 + k > budget - draft_slots:
                        out.admission_stop = AdmissionStop.BUDGET
                        break
                    num_new, padded = 1 + k, True
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget - draft_slots:
                if not self.enable_chunked_prefill:
                    out.admission_stop = AdmissionStop.BUDGET
                    break
                num_new = budget - draft_slots
            # its first chunk's positions (and lookahead slots, drafting) must fit as well as the whole sequence
            num_slots = num_cached + num_new + (self.lookahead(num_cached, num_new) if drafting else 0)
            # V1's watermark holds back admissions only while something else runs
            if not bm.can_allocate(seq, cached_ids, watermark=bool(running), num_slots=num_slots):
                out.admission_stop = (AdmissionStop.WATERMARK if running and bm.can_allocate(
                    seq, cached_ids, watermark=False, num_slots=num_slots) else AdmissionStop.BLOCKS)
                break
            self.waiting.remove(seq)
            num_forks += seq.num_pending_forks
            resumed = seq.num_ever_computed > 0
            reason = AdmitReason.RESUME_RECOMPUTE if resumed else AdmitReason.NEW
            if self.connector is not None:
                self.connector.admit(seq, num_cached, reason)
            self._admit(seq, reason, seq.num_tokens - num_cached)
            bm.allocate(seq, cached_ids, num_new, reason, num_slots - num_cached - num_new if drafting else 0)
            seq.num_prefix_hit_tokens += num_cached
            if resumed:
                seq.reprefill_target = seq.num_tokens
                seq.reprefill_cached = num_cached
                seq.reprefill_recomputed = 0
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new + draft_slots
            if drafting:
                self._schedule_drafts(seq, num_new, out, padded)
        if self.waiting and budget <= draft_slots:
            out.admission_stop = AdmissionStop.BUDGET
        if skipped:
            self.waiting.extendleft(reversed(skipped))
        if out.admission_stop == AdmissionStop.NOTHING_WAITING and (skipped or self.loading):
            out.admission_stop = AdmissionStop.OTHER   # held back by the tier's copies (as a capture says it)

    # ---- the host KV tier's loads (the copies: engine/connector.py) ----------------------------
    def _start_load(self, seq: Sequence, cached_ids: list[int], num_tier: int, out: SchedulerOutput) -> None:
        """Admit a sequence whose prefix the tier holds past the device's hit: blocks for both hits (the
        tier's not in the prefix cache until loaded: vLLM's delay_cache_blocks), its chunks pinned and a
        load issued; it waits, holding them, until the load finishes (`_admit_loaded`). A hit of every
        position gives the last back to compute (its logits give the next token): the load's credit."""
        num_cached = self.bm.num_hit_tokens(cached_ids)
        reason = AdmitReason.RESUME_RECOMPUTE if seq.num_ever_computed > 0 else AdmitReason.NEW
        num_credited = min(num_tier, seq.num_tokens - 1 - num_cached)
        self.connector.record_lookup(seq, num_cached, num_credited, reason)
        self.bm.allocate(seq, cached_ids, num_tier, reason, delay_cache=True)
        seq.num_prefix_hit_tokens += num_cached
        seq.reprefill_cached = num_cached
        self.connector.start_load(seq, num_cached, num_tier, num_credited, out)
        seq.num_computed_tokens = num_cached + num_tier
        seq.status = SequenceStatus.LOADING
        self.loading.append(seq)

    def _admit_loaded(self, out: SchedulerOutput, budget: int, threshold: int) -> int | None:
        """Sequences whose loads finished are admitted first (vLLM's kv_holding_waiting queue), each with
        blocks for the rest of its tokens. Returns the budget left, None where admission stopped."""
        bm = self.bm
        for seq in [s for s in self.loading if s.load_done]:
            if budget <= self.draft_slots:
                out.admission_stop = AdmissionStop.BUDGET
                return None
            if len(self.running) >= self.max_num_seqs:
                out.admission_stop = AdmissionStop.SEATS
                return None
            if seq.num_computed_tokens >= seq.num_tokens:   # a hit of every position: the last computed again
                seq.num_computed_tokens = seq.num_tokens - 1
            num_new = seq.num_tokens - seq.num_computed_tokens
            if 0 < threshold < num_new:
                num_new = threshold
            if num_new > budget:
                if not self.enable_chunked_prefill:
                    out.admission_stop = AdmissionStop.BUDGET
                    return None
                num_new = budget
            # as any admission: the whole sequence must fit, above the watermark while others run
            if not bm.can_allocate(seq, seq.block_table, watermark=bool(self.running)):
                out.admission_stop = (AdmissionStop.WATERMARK if self.running and bm.can_allocate(
                    seq, seq.block_table, watermark=False) else AdmissionStop.BLOCKS)
                return None
            self.loading.remove(seq)
            seq.load = None
            resumed = seq.num_ever_computed > 0
            self._admit(seq, AdmitReason.RESUME_RECOMPUTE if resumed else AdmitReason.NEW,
                        seq.num_tokens - seq.num_computed_tokens)
            bm.grow(seq, num_new)   # and caches the loaded blocks with those it computes
            if resumed:
                seq.reprefill_target = seq.num_tokens
                seq.reprefill_recomputed = 0
            out.seqs.append(seq)
            out.num_new_tokens.append(num_new)
            budget -= num_new
        return budget

    def adopt(self, seq: Sequence) -> None:
        """A sample forked from a running sequence joins the running batch."""
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._admit_counter
        self._admit_counter += 1
        self.running.append(seq)

    def _num_positions_to_progress(self, seq: Sequence) -> int:
        """KV positions a waiting sequence needs to get past its next token: its tokens, and the
        position of the token it samples next unless that token is its last (the last sampled token
        is never stored). V1 admits a prompt that exactly fills the pool with max_tokens 1; one that
        would need one block more to decode can never finish (V1 would preempt it forever): it is
        rejected instead."""
        last = (seq.num_output_tokens + 1 >= seq.stop_length
                or 0 < self.max_model_len <= seq.num_tokens + 1)
        if last:
            return seq.num_tokens
        if self.num_spec_tokens:   # speculative decoding: its next step's drafts and lookahead slots too
            num_positions = seq.num_tokens + 1 + self.num_spec_tokens + self.num_lookahead_tokens
            return min(num_positions, self.max_model_len) if self.max_model_len else num_positions
        return seq.num_tokens + 1

    def _next_waiting(self) -> Sequence:
        if self.preemption_policy == PreemptionPolicy.PRIORITY:
            # V1's waiting heap breaks a tie by request id: a request's samples in index order
            return min(self.waiting, key=lambda seq: (*urgency(seq), seq.sample))
        return self.waiting[0]

    def _admit(self, seq: Sequence, reason: str, num_tokens: int) -> None:
        seq.status = SequenceStatus.RUNNING
        seq.admitted_order = self._admit_counter
        self._admit_counter += 1
        seq.protected = reason != AdmitReason.NEW
        self.running.append(seq)
        self.bm.events.append(KVEvent(ev.ADMIT, seq.req_id, seq.sample, num_tokens=num_tokens, reason=reason))

    def _pick_victim(self, needing: Sequence) -> tuple[Sequence, str]:
        """The running sequence to preempt so that `needing` can get blocks, and why the policy chose
        it (a VictimReason); `needing` itself is a candidate (it may be the newest).

        V1's policies (newest, priority) take the last admitted or the least urgent, unconditionally.
        kvtrace's newest-sparing and fewest-computed spare sequences resumed but not yet progressed
        (no preempt-readmit livelock) and prefer victims whose release frees a block (a victim whose
        blocks are all shared frees nothing).
        """
        policy = self.preemption_policy
        if policy == PreemptionPolicy.NEWEST:
            return self.running[-1], VictimReason.NEWEST
        if policy == PreemptionPolicy.PRIORITY:
            return max(self.running, key=urgency), VictimReason.LOWEST_PRIORITY
        why = VictimReason.FEWEST_COMPUTED if policy == PreemptionPolicy.FEWEST_COMPUTED else VictimReason.NEWEST
        others = [s for s in self.running if s is not needing and not s.protected]
        if not others:
            return needing, VictimReason.ONLY_CANDIDATE
        freeing = [s for s in others if any(self.bm.blocks[b].ref_count == 1 for b in s.block_table)]
        if needing.protected:  # a resumed sequence re-prefilling in chunks is spared too
            return max(freeing or others, key=lambda s: victim_key(policy, s)), why
        candidates = (freeing or others) + [needing]
        return max(candidates, key=lambda s: victim_key(policy, s)), why

    def _swap_group(self, victim: Sequence) -> list[Sequence]:
        """The sequences preempted with `victim`: with swap and copy-on-write samples, every running
        sample of its request (vLLM V0 swapped a sequence group whole), if the host has room."""
        if self.preemption_mode != PreemptionMode.SWAP or not self.swap_groups:
            return [victim]
        group = [s for s in self.running if s.req_id == victim.req_id]
        return group if len(group) > 1 and self.bm.can_swap_out(group) else [victim]

    def _preempt(self, seqs: list[Sequence], out: SchedulerOutput, requester: Sequence | None = None,
                 reasons: dict[int, str] | None = None) -> None:
        """Preempt the sequences so that `requester` can grow: swap them out together (swap mode, when
        the host has room), else drop their KV to recompute it later. `reasons`: id(seq) -> why the
        policy chose it (the others of a swap group went with it)."""
        requester_req_id = requester.req_id if requester is not None else None
        requester_sample = requester.sample if requester is not None else None
        reasons = reasons or {}
        held = {}
        for seq in seqs:
            self.running.remove(seq)
            out.num_preemptions += 1
            seq.num_preemptions += 1
            seq.num_drafts = seq.num_draft_placeholders = 0   # V1 drops a victim's proposals and placeholders
            held[id(seq)] = self.bm.blocks_held(seq)
            if seq.reprefill_target:  # cut short while re-prefilling: record what it did redo
                self.record_reprefill(seq, REPREFILL_INTERRUPTED)
        # A copy-on-write decided for a victim earlier in this step has not run yet: drop it.
        # Its new block holds nothing yet; a swap copies the shared source block instead.
        tables = {b for seq in seqs for b in held[id(seq)][0]}
        pending_cow = {dst: src for src, dst in out.copies if dst in tables}
        if pending_cow:
            out.copies = [(src, dst) for src, dst in out.copies if dst not in pending_cow]
        if self.preemption_mode == PreemptionMode.SWAP and self.bm.can_swap_out(seqs):
            for seq in seqs:
                self.bm.events.append(KVEvent(
                    ev.PREEMPT, seq.req_id, seq.sample, blocks=held[id(seq)][0], num_tokens=seq.num_computed_tokens,
                    reason=PreemptReason.SWAP, requester_req_id=requester_req_id, requester_sample=requester_sample,
                    victim_reason=reasons.get(id(seq), VictimReason.SWAP_GROUP)))
            copies = self.bm.swap_out(seqs)
            for seq, mine in zip(seqs, copies):
                out.swap_out.extend((pending_cow.get(d, d), h) for d, h in mine)
                event = KVEvent(ev.SWAP_OUT, seq.req_id, seq.sample, blocks=[d for d, _ in mine],
                                src_blocks=[h for _, h in mine], num_tokens=seq.num_computed_tokens)
                self.bm.events.append(event)
                out.swap_out_events.append(event)
                seq.status = SequenceStatus.SWAPPED
                seq.num_swaps += 1
                self.swapped.append(seq)
            return
        reason = (PreemptReason.RECOMPUTE if self.preemption_mode == PreemptionMode.RECOMPUTE
                  else PreemptReason.SWAP_FULL_FALLBACK)
        if self.connector is not None:
            self.connector.preempted(seqs)
        for seq in seqs:
            blocks, per_group = held[id(seq)]
            self.bm.events.append(KVEvent(
                ev.PREEMPT, seq.req_id, seq.sample, blocks=blocks, num_tokens=seq.num_computed_tokens,
                reason=reason, requester_req_id=requester_req_id, requester_sample=requester_sample,
                victim_reason=reasons.get(id(seq), VictimReason.SWAP_GROUP), kv_group_blocks=per_group))
            self.bm.free(seq, FreeReason.PREEMPT)
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
        """Remove a finished sequence and release its blocks. With async scheduling a sequence preempted
        with a token in flight can finish on that token while it waits."""
        if seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        else:
            self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        if self.connector is not None:
            self.connector.request_finished(seq)
        self.bm.free(seq, FreeReason.FINISH)
