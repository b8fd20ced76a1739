"""The simulator's fast path: the engine loop's decisions, made cheaper where most simulated steps are
plain decodes. The loop (engine/llm_engine.py) holds it only when it simulates with it on
(EngineConfig.sim_fast_path, `kvtrace record --no-sim-fast-path` to turn it off) and asks it first
for every step a replay runs (`LLMEngine.advance`); wherever it declines, the general pass decides.

    advance(until_s):  a leap, when one can start (leap.py), else
                       a lazy step, when every running sequence makes a plain decode (cohort.py), else
                       None: the cohort dissolved, the general step runs

A lazy step is the general step's schedule-run-process-record with its running pass made by the
cohort: the members' counts advance only where the step changes something for them, while the
sequences admitted in the same step (the scheduler's `admit`), their tokens and their finishes are
processed by the loop's own parts.

Beside a host KV tier a leap is taken only where the tier has nothing to do (`_tier_quiet`). A lazy
step asks the tier's connector what the general step asks it (build_connector_meta, the copies
finished), showing it, of the members, only those whose tables grew: a member has offered every block
of its prompt (a sequence that has not does not join), so the connector's pass would find nothing else
to do for it.

The fast path makes the general pass's decisions, block for block and event for event, at the same
predicted times: tests/engine/test_fast_path.py runs every setting with it and without it. The words
(fast path, general pass, plain decode, leap, lazy step, cohort) are defined in docs/glossary.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from engine.config import PreemptionPolicy
from engine.llm_engine import TokenColumns, in_batch_order
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence, SequenceStatus
from engine.sim.cohort import DecodeCohort
from engine.sim.leap import take_leap

if TYPE_CHECKING:
    from engine.llm_engine import LLMEngine
    from engine.sim.executor import SimExecutor

# the shortest leap worth dissolving a cohort for, and a step longer for every so many running
# sequences (dissolving it and forming it again is work per sequence)
MIN_LEAP_OVER_COHORT = 2
SEQUENCES_PER_LEAP_STEP = 16


class DecodeFastPath:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.runner: SimExecutor = engine.runner
        self.cohort: DecodeCohort | None = DecodeCohort(engine.block_manager)   # None: leaps only (tests)
        self.num_leap_steps = 0   # steps run in leaps, and as lazy steps (for tests, and curiosity)
        self.num_lazy_steps = 0

    def settle(self) -> None:
        if self.cohort is not None:
            self.cohort.dissolve()

    def check_integrity(self) -> None:
        if self.cohort is None:
            return
        sched = self.engine.scheduler
        self.cohort.check_integrity(sched.running)
        connector = sched.connector
        if connector is not None:   # what lets a lazy step show the connector only the members that grew
            for member in self.cohort.members:
                seq = member.seq
                assert not connector.has_prompt_to_offer(seq), f"{seq}: a member with blocks to offer"
                assert seq not in connector.prefilling, f"{seq}: a member prefilling, as the connector sees it"

    def advance(self, until_s: float) -> tuple[int, int] | None:
        engine = self.engine
        sched = engine.scheduler
        running = sched.running
        if not running or len(running) > sched.max_num_batched_tokens:   # no step of plain decodes
            self.settle()
            return None
        # a leap's steps are decodes only: nothing may wait, nor be finished (rejected) by the next step
        if (not sched.waiting and not sched.swapped and not engine._pending_finished and not engine._pending_records
                and not sched.loading and self._leap_worth_it(until_s) and self._tier_quiet()):
            self.settle()
            ran = take_leap(engine, until_s)
            if ran[0]:
                self.num_leap_steps += ran[0]
                return ran
        if self.cohort is None:
            return None
        num_tokens = self._lazy_step()
        if num_tokens is None:
            self.cohort.dissolve()
            return None
        self.num_lazy_steps += 1
        return 1, num_tokens

    def _tier_quiet(self) -> bool:
        """Whether a host KV tier, if any, would have nothing to do in a leap's steps but see their blocks
        (and, in its first, re-rank the chunks of sequences finished since the last step): no load in
        flight, no store flushed or of a finished sequence (a block a decode takes may be one it copies
        from), no finished sequence's blocks to offer once more, no running sequence with prompt blocks
        still to offer (a member of the cohort has offered all: only the others are looked at). A store in
        flight that finishes in a leap's step is filed there (take_leap)."""
        connector = self.engine.scheduler.connector
        if connector is None:
            return True
        if any(copy.is_load or copy.flushed or copy.seq.status == SequenceStatus.FINISHED
               for copy in connector.copies_in_flight) or not connector.finished_offer_nothing():
            return False
        running = self.engine.scheduler.running
        num_members = self.cohort.num_members if self.cohort is not None else 0
        return not any(map(connector.has_prompt_to_offer, running[num_members:]))

    def _leap_worth_it(self, until_s: float) -> bool:
        """Whether a leap may run now: always without lazy decodes; with them, only one long enough
        to repay dissolving the cohort and forming it again."""
        cohort = self.cohort
        if cohort is None or not cohort.num_members:
            return True
        engine = self.engine
        running = engine.scheduler.running
        num_kv = engine.block_manager.num_kv_positions(running, cohort.positions(running)) + len(running)
        step_s = self.runner.cost_model.forward_ms(0, len(running), num_kv, 0.0) / 1000
        shortest = MIN_LEAP_OVER_COHORT + len(running) // SEQUENCES_PER_LEAP_STEP
        return min(cohort.steps_to_next_stop(), (until_s - engine.now()) / step_s) >= shortest

    def _lazy_step(self) -> int | None:
        """The general step with its running pass made by the cohort; the tokens it emitted, or None
        (nothing changed but members' counts written out) when a running sequence does not make a
        plain decode, or blocks fall short under a policy other than newest."""
        engine, cohort = self.engine, self.cohort
        sched, bm = engine.scheduler, engine.block_manager
        running = sched.running
        start_s = engine.now()
        out = SchedulerOutput()
        # V1's newest policy preempts from the batch's end, which the cohort follows; the other policies,
        # and swap groups (a victim's samples swapped out with it, some scheduled earlier in the step),
        # leave a step short of blocks to the general pass
        preempt = None
        if sched.preemption_policy == PreemptionPolicy.NEWEST and not sched.swap_groups:
            preempt = lambda seq: self._preempt_for(seq, out)   # noqa: E731
        connector = sched.connector
        if connector is not None:   # a member has offered its prompt's blocks: those that have not, join later
            if any(map(connector.has_prompt_to_offer, running[cohort.num_members:])):
                return None
        if not cohort.grow(running, preempt):
            return None
        num_members = len(running)
        out.seqs = list(running)
        out.num_new_tokens = [1] * num_members
        sched.admit(out, sched.max_num_batched_tokens - num_members)
        if connector is not None:   # the connector's pass sees the members whose tables grew, and the admitted
            self._build_connector_meta(out, num_members)
        sched_events = bm.take_events()
        held = cohort.positions(running)
        occupancy = engine._occupancy(out, held)
        result = self.runner.execute(out, lazy=(num_members, cohort.computed_base + num_members * cohort.clock))
        rest, rest_new = out.seqs[num_members:], out.num_new_tokens[num_members:]
        num_recompute = engine._account(rest, rest_new, start_s)
        tier = engine._finish_copies(out, start_s + engine.time_origin) if connector is not None else None
        sampled = engine._sample(result)   # the admitted sequences' (the members' tokens are the cohort's)
        stopped = cohort.advance()
        for seq in stopped:
            engine._check_stop(seq, seq.token_ids[-1])
            assert seq.finish_reason, f"{seq} at its stop length without a reason to stop"
        for seq, token in sampled:
            seq.token_ids.append(token)
        engine._deliver(sampled, engine.now())
        tokens = self._token_columns(sampled)
        for seq in stopped:
            cohort.leave(seq)
        # the members' stops first: they lead the batch
        finished = engine._finish(out, stopped + in_batch_order([seq for seq, _ in sampled if seq.finish_reason],
                                                                 rest))
        engine._record(step=engine.step_counter, start_s=start_s, end_s=engine.now(), out=out, result=result,
                       kv_events=sched_events + bm.take_events(), num_sched_events=len(sched_events),
                       occupancy=occupancy, num_recompute=num_recompute, tokens=tokens, finished=finished, tier=tier)
        engine.step_counter += 1
        num_tokens = num_members + len(sampled)
        engine._check_progress(bool(num_tokens or finished))
        return num_tokens

    def _build_connector_meta(self, out: SchedulerOutput, num_members: int) -> None:
        """The host KV tier's connector's pass over the step (build_connector_meta) as over all of
        `out.seqs`: of the members it sees only the tables of those that took a block (the blocks
        given; each has offered its prompt's blocks and is not prefilling, so nothing else would
        change for it), then the sequences admitted; its copies go in `out`. A step that admitted
        none, with no finished sequence to offer and no block given that could fence a store (most
        steps), has nothing left for the pass once the tables are seen: it is not run."""
        connector = self.engine.scheduler.connector
        if self.cohort.grown:
            connector.see_tables(self.cohort.grown)
        if len(out.seqs) > num_members or connector.has_work_without_a_batch():
            connector.build_connector_meta(out, out.seqs[num_members:], out.num_new_tokens[num_members:])

    def _preempt_for(self, seq: Sequence, out: SchedulerOutput) -> None:
        """Preempt the policy's victim so that `seq` can grow (the general running pass's inner loop)."""
        sched = self.engine.scheduler
        victim, why = sched._pick_victim(seq)
        sched._preempt(sched._swap_group(victim), out, seq, {id(victim): why})

    def _token_columns(self, sampled: list[tuple[Sequence, int]]) -> TokenColumns:
        """The step's token columns: the members' (each one's idx is its member idx plus the clock, so
        that they are not visited one by one), then the admitted sequences'."""
        cohort = self.cohort
        clock = cohort.clock
        columns = TokenColumns(cohort.member_req_ids[:], cohort.member_samples[:],
                               [idx + clock for idx in cohort.member_idx], [])
        if sampled:
            rest = self.engine._token_columns(sampled)
            columns.req_ids.extend(rest.req_ids)
            columns.samples.extend(rest.samples)
            columns.idx.extend(rest.idx)
        columns.token_ids.extend([None] * len(columns.req_ids))   # the simulator's placeholders are recorded as null
        return columns
