"""The scheduler side of vLLM's OffloadingConnector (v1/kv_connector/v1/offloading_connector.py, vLLM 0.31
to 0.34): which copies between the device pool and the host KV tier a step makes (the words:
docs/glossary.md). The tier's books are engine/offload.py; the scheduler (engine/scheduler.py) asks this
class at a few points, as vLLM's scheduler asks its connector:

    lookup             a waiting sequence's hit in the tier past the device's (get_num_new_matched_tokens)
    admit              an admission without a tier hit (its lookup recorded); with one, record_lookup,
                       then start_load: a load of the hit into its new blocks (update_state_after_alloc)
    build_connector_meta   once the step is decided: stores of the blocks it computes, a finished
                       sequence's last offer, stores fenced where their blocks are reused
    preempted, request_finished, complete_copy   what the scheduler and the engine tell it

The loading sequences themselves (vLLM's WAITING_FOR_REMOTE_KVS) are the scheduler's queue.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine import events as ev
from engine.events import KVEvent
from engine.offload import Lookup, OffloadTier, TierCopy
from engine.sequence import Sequence, SequenceStatus

if TYPE_CHECKING:
    from engine.block_manager import BlockManager
    from engine.scheduler import SchedulerOutput


class OffloadingConnector:
    """vLLM's OffloadingConnector, scheduler side, over a host KV tier (`tier`) behind the pool `bm`."""

    def __init__(self, tier: OffloadTier, bm: BlockManager, max_model_len: int) -> None:
        self.tier = tier
        self.bm = bm
        self.max_model_len = max_model_len   # a sequence stops at this many tokens (0: no limit)
        # vLLM 0.33 and later: an admitted request's blocks are offered from the start again (the present
        # ones skipped); set by follow()
        self.offers_again = True
        self.copies_in_flight: list[TierCopy] = []
        self.keys_being_loaded: dict[int, int] = {}   # key -> loads of it in flight
        # finished since the last step: (sequence, its device blocks, positions it had computed)
        self._finished: list[tuple[Sequence, list[int], int]] = []
        self._blocks_given: set[int] = set()   # blocks put in a table this step (_fence_reused)
        self.prefilling: set[Sequence] = set()   # running, short of their tokens when last scheduled

    def follow(self, vllm_version: tuple[int, int]) -> None:
        """vLLM 0.33 ranks a request's chunks by the request (engine/offload.py) and offers an admitted
        request's blocks again; 0.31 and 0.32 do neither."""
        self.offers_again = vllm_version >= (0, 33)
        self.tier.ranks_by_request = vllm_version >= (0, 33)

    # ---- admission ------------------------------------------------------------------------
    def lookup(self, seq: Sequence, num_cached: int) -> int | None:
        """Positions past the device's hit that the tier holds ready: the run of chunks from the first
        block the device lacks up to the first the tier lacks (0 if none). None defers the sequence
        (vLLM's get_num_new_matched_tokens): a copy of its own in flight, a chunk of the run still being
        stored, or being loaded for another sequence."""
        if seq.num_tier_copies:
            return None
        bs = self.bm.block_size
        num_full = seq.num_tokens // bs
        hashes = self.bm.token_block_hashes(seq, num_full)
        num_hit = 0
        for key in hashes[num_cached // bs:num_full]:
            found = self.tier.lookup(key)
            if found is Lookup.MISS:
                break
            if found is Lookup.PENDING or key in self.keys_being_loaded:
                return None
            num_hit += 1
        return num_hit * bs

    def num_blocks_reserved(self, loading: list[Sequence], admitted: list[Sequence], admitted_new: list[int]) -> int:
        """The blocks a load must leave free (vLLM's in-flight reservations: a load holds its blocks
        through the copy without progress, so it is admitted only where it cannot starve): those the
        `loading` sequences still need to hold all their tokens, and those the sequences still
        prefilling need (admitted in an earlier step and short of their tokens when last scheduled, or
        `admitted` in this pass, with `admitted_new` tokens, short of them)."""
        def blocks_to_finish(seq: Sequence) -> int:
            num_tokens = min(seq.num_tokens, self.max_model_len) if self.max_model_len else seq.num_tokens
            return max(0, self.bm.blocks_for(num_tokens) - len(seq.block_table))
        reserved = sum([blocks_to_finish(s) for s in loading])
        reserved += sum([blocks_to_finish(s) for s in self.prefilling])
        return reserved + sum([blocks_to_finish(s) for s, n in zip(admitted, admitted_new)
                               if s.num_computed_tokens + n < s.num_tokens])

    def admit(self, seq: Sequence, num_cached: int, reason: str) -> None:
        """An admission without a tier hit: its lookup recorded; vLLM 0.33 on offers its blocks from the
        start again."""
        self.record_lookup(seq, num_cached, 0, reason)
        if self.offers_again:
            seq.num_offered_blocks = 0

    def record_lookup(self, seq: Sequence, num_cached: int, num_tier: int, reason: str) -> None:
        """An admission's lookup: `num_cached` positions found on the device, `num_tier` credited to the tier."""
        self.bm.events.append(KVEvent(ev.LOOKUP, seq.req_id, seq.sample, num_tokens=seq.num_tokens,
                                      num_cached_tokens=num_cached, tier_tokens=num_tier, reason=reason,
                                      tier=self.tier.name))

    def start_load(self, seq: Sequence, num_cached: int, num_tier: int, num_credited: int,
                   out: SchedulerOutput) -> None:
        """The tier's hit of `num_tier` positions past the device's `num_cached`, blocks allocated for
        both: its chunks pinned and a load issued into its blocks (`num_credited` positions: a hit of
        every position gives the last back to compute)."""
        bm, tier = self.bm, self.tier
        bs = bm.block_size
        first, last = num_cached // bs, (num_cached + num_tier) // bs
        keys = bm.token_block_hashes(seq, last)[first:last]
        blocks = seq.block_table[first:last]
        slots = tier.prepare_load(seq, keys, first)
        self._blocks_given.update(seq.block_table)   # every block of its table, prefix hits too
        for key in keys:
            self.keys_being_loaded[key] = self.keys_being_loaded.get(key, 0) + 1
        event = KVEvent(ev.LOAD, seq.req_id, seq.sample, blocks=list(blocks), num_tokens=num_credited, tier=tier.name)
        seq.load = TierCopy(seq, True, keys, list(blocks), slots, event)
        self._issue(seq.load, out)
        seq.num_offered_blocks = last   # what it loaded is not stored again
        seq.load_done = False

    # ---- the step decided -----------------------------------------------------------------
    def build_connector_meta(self, out: SchedulerOutput, seqs: list[Sequence] | None = None,
                             num_new_tokens: list[int] | None = None) -> None:
        """Once the step `out` is decided, one pass over the scheduled sequences (its own, or `seqs` with
        `num_new_tokens`, those of them that the pass would not pass over): the store of each one's prompt
        blocks that this step fills, the blocks of its table the connector sees for the first time, and
        whether it is still prefilling (vLLM's in-flight prefills); then the last offers of the sequences
        finished since the last step (their chunks re-ranked), and the stores fenced where their blocks
        are reused.

        Stores: each scheduled sequence offers the tier its prompt's blocks that this step fills (vLLM's
        default offload_prompt_only), one prepare_store a sequence a step; refused (no room), the same
        blocks are offered again next step. A store copies the blocks the tier lacked, after the forward.

        The blocks a table took are noted for the fences only where a store could be fenced (most
        steps none could: _may_fence)."""
        bs = self.bm.block_size
        given, prefilling = self._blocks_given, self.prefilling
        fence = self._may_fence()
        if seqs is None:
            seqs, num_new_tokens = out.seqs, out.num_new_tokens
        for seq, num_new in zip(seqs, num_new_tokens):
            num_computed = seq.num_computed_tokens + num_new
            if seq.num_offered_blocks < seq.num_prompt_tokens // bs:   # else its prompt's full blocks all offered
                self._offer(seq, seq.block_table, min(num_computed, seq.num_prompt_tokens), out)
            table = seq.block_table
            if len(table) != seq.num_connector_blocks:   # (most decodes add no block)
                if fence:
                    given.update(table[seq.num_connector_blocks:])
                seq.num_connector_blocks = len(table)
            if num_computed < len(seq.token_ids):
                prefilling.add(seq)
            elif prefilling:
                prefilling.discard(seq)
        if self._finished:
            for seq, blocks, num_computed in self._finished:
                self._offer_finished(seq, blocks, num_computed, out)
                self.tier.on_request_finished(seq)
            self._finished = []
        self._fence_reused()

    def see_tables(self, seqs: list[Sequence]) -> None:
        """build_connector_meta's look at the tables of scheduled sequences that have nothing to offer
        and are not prefilling (the simulator's fast path's members that took a block), alone: the
        blocks each took since the connector last saw it, for the fences of the pass that follows (noted
        as that pass notes them: only where a store could be fenced); a sequence no longer running
        (preempted since) passed over."""
        fence = self._may_fence()
        given = self._blocks_given
        for seq in seqs:
            if seq.status is SequenceStatus.RUNNING:
                table = seq.block_table
                if fence:
                    given.update(table[seq.num_connector_blocks:])
                seq.num_connector_blocks = len(table)

    def _may_fence(self) -> bool:
        """Whether a block put in a table in this step could fence a store (_fence_reused): a finished
        sequence's store in flight, not flushed yet, or sequences finished since the last step (their
        last offers, made in this step's pass, are such stores). Where none could, the blocks the tables
        took need not be noted: the fences would find nothing."""
        if self._finished:
            return True
        return any(not copy.is_load and not copy.flushed and copy.seq.status == SequenceStatus.FINISHED
                   for copy in self.copies_in_flight)

    def _offer_finished(self, seq: Sequence, blocks: list[int], num_computed: int, out: SchedulerOutput) -> None:
        """A sequence finished in the last step offers, once more, the prompt blocks it had computed and
        the tier refused (vLLM's connector builds store jobs for finished requests too, from the blocks
        they held: freed, but written by nothing before this step's forward, so copied before it)."""
        self._offer(seq, blocks, min(num_computed, seq.num_prompt_tokens), out, before_forward=True)

    def _offer(self, seq: Sequence, blocks: list[int], num_positions: int, out: SchedulerOutput,
               before_forward: bool = False) -> None:
        """One prepare_store of the sequence's full blocks among its first `num_positions` not offered
        yet; a store of those the tier lacked, from the device blocks `blocks` (its table)."""
        bm, tier = self.bm, self.tier
        bs = bm.block_size
        end = num_positions // bs
        start = seq.num_offered_blocks
        if end <= start:
            return
        keys = bm.token_block_hashes(seq, end)[start:end]
        plan = tier.prepare_store(seq, keys, start)
        if plan is None:
            return
        seq.num_offered_blocks = end
        if plan.evicted:
            bm.events.append(KVEvent(ev.TIER_EVICT, "", num_tier_blocks=len(plan.evicted), tier=tier.name))
        if plan.keys:
            if len(plan.keys) == len(keys):   # the tier held none of them (most offers)
                stored = blocks[start:end]
            else:
                index = {key: start + i for i, key in enumerate(keys)}
                stored = [blocks[index[key]] for key in plan.keys]
            event = KVEvent(ev.OFFLOAD, seq.req_id, seq.sample, blocks=stored, num_tokens=len(stored) * bs,
                            tier=tier.name)
            self._issue(TierCopy(seq, False, plan.keys, stored, plan.slots, event, before_forward=before_forward), out)

    def _fence_reused(self) -> None:
        """A finished sequence's stores still in flight finish with this step where a block they copy
        from is in a table again (vLLM's connector fences them: allocated anew, or a prefix hit, before
        the forward writes into it). The connector sees every block in a table that it did not see there
        before (`_blocks_given`): a scheduled sequence's new blocks, an admitted one's whole table (a
        loading one's at its load, and again once admitted)."""
        given = self._blocks_given
        if given:
            for copy in self.copies_in_flight:
                if (not copy.is_load and not copy.flushed and copy.seq.status == SequenceStatus.FINISHED
                        and not given.isdisjoint(copy.device_blocks)):
                    copy.flushed = True
            self._blocks_given = set()

    def _issue(self, copy: TierCopy, out: SchedulerOutput) -> None:
        out.tier_copies.append(copy)
        self.copies_in_flight.append(copy)
        copy.seq.num_tier_copies += 1

    def has_prompt_to_offer(self, seq: Sequence) -> bool:
        """Whether some full block of the sequence's prompt has not been offered to the tier yet."""
        return seq.num_offered_blocks < seq.num_prompt_tokens // self.bm.block_size

    def has_work_without_a_batch(self) -> bool:
        """Whether build_connector_meta of a step that schedules nothing would do anything: offer and
        re-rank what the sequences finished since the last step had, or fence stores where a table took
        their blocks."""
        return bool(self._finished or self._blocks_given)

    def finished_offer_nothing(self) -> bool:
        """Whether the sequences finished since the last step have no prompt block left to offer: the next
        build_connector_meta only re-ranks their chunks."""
        bs = self.bm.block_size
        return all(min(num_computed, seq.num_prompt_tokens) // bs <= seq.num_offered_blocks
                   for seq, _, num_computed in self._finished)

    # ---- what it is told -------------------------------------------------------------------
    def preempted(self, seqs: list[Sequence]) -> None:
        """Sequences preempted by recompute: their stores in flight finish with this step (vLLM flushes
        them), and their tables start again (the connector sees every block of them once admitted)."""
        for copy in self.copies_in_flight:
            if copy.seq in seqs:
                copy.flushed = True
        for seq in seqs:
            seq.num_connector_blocks = 0
            self.prefilling.discard(seq)

    def request_finished(self, seq: Sequence) -> None:
        """A sequence finished (before its blocks are freed): it offers the next step what it had computed."""
        self._finished.append((seq, list(seq.block_table), seq.num_computed_tokens))
        self.prefilling.discard(seq)

    def complete_copy(self, copy: TierCopy, success: bool = True) -> None:
        """A tier copy finished (the engine says when): a store's chunks become ready, a load's unpinned
        and its sequence admissible at the next step."""
        self.copies_in_flight.remove(copy)
        seq = copy.seq
        seq.num_tier_copies -= 1
        if copy.is_load:
            self.tier.complete_load(copy.keys)
            for key in copy.keys:
                left = self.keys_being_loaded[key] - 1
                if left:
                    self.keys_being_loaded[key] = left
                else:
                    del self.keys_being_loaded[key]
            seq.load_done = True
            seq.num_tier_hit_tokens += copy.event.num_tokens
        else:
            self.tier.complete_store(copy.keys, success)

    # ---- integrity -------------------------------------------------------------------------
    def check_integrity(self, loading: list[Sequence], running: list[Sequence]) -> None:
        """Assert the tier's books agree with the copies in flight: a chunk is pending exactly while a
        store of it is, pinned once per load of it; each `loading` sequence's load in flight or done; every
        block of the `running` sequences' tables seen (each was scheduled since it last grew)."""
        tier = self.tier
        tier.check_integrity()
        pins: dict[int, int] = {}
        pending = set()
        for copy in self.copies_in_flight:
            for key in copy.keys:
                if copy.is_load:
                    pins[key] = pins.get(key, 0) + 1
                else:
                    pending.add(key)
        assert pins == self.keys_being_loaded, "the chunks being loaded are not the loads' in flight"
        for key, ref_count in tier.chunks.items():
            assert ref_count == (-1 if key in pending else pins.get(key, 0)), \
                f"chunk {key}: ref_count {ref_count}, {pins.get(key, 0)} loads, pending {key in pending}"
        for seq in loading:
            assert (seq.load is not None and seq.load in self.copies_in_flight) != seq.load_done, \
                f"{seq}: its load neither in flight nor done"
        for seq in running:
            assert seq.num_connector_blocks == len(seq.block_table), f"{seq}: blocks the connector has not seen"
