"""The simulator's running decodes, advanced lazily: a step of plain decodes costs what changes in
it (a block taken or completed, a sequence that stops), not a visit to every running sequence.

Most steps of a long simulated replay decode one token for every running sequence (the scheduler's
fast path, Scheduler._grow_decodes). The simulator's tokens are placeholders fixed per sequence
(engine/executor/sim_executor.py), so what each of those steps does to a sequence is known ahead:
one more position computed, one more token, a block taken every block_size steps, a block completed
and cached every block_size steps, a stop at a known length. The cohort leaves the running
sequences' counts behind by the steps taken since each was last brought up to date (its
`cohort_mark`, on the cohort's step clock) and files each sequence under the step at which it next
takes or completes a block (`_grows`) and the step after which it stops (`_stops`), so a step touches
only those.

    running:  [ m0  m1  m2 ... m(k-1) | j0  j1 ]    members first (the batch's order), then the
               \\___ num_members ____/  \\____/      sequences admitted since the last step, which
                                                     join at the next fast step

A member's true counts: num_computed_tokens + lag and len(token_ids) + lag, lag = clock -
cohort_mark, every missing token its placeholder. `settle` writes one member's counts out, `dissolve`
every member's; the scheduler dissolves the cohort before any pass that reads the running sequences
(the general pass; the engine before a decode window and at an abort), and what reads a member's
count between steps asks `num_computed`. The decisions are the fast path's, block for block and
event for event (tests/engine/test_decode_fast_path.py runs every setting with and without it).

Only the simulated engine with synchronous scheduling and independent samples has a cohort: the real
engine's tokens come from the model, async scheduling keeps a token in flight, and copy-on-write
samples share the block a decode writes to.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus, is_plain_decode

_admitted_order = attrgetter("admitted_order")
_computed = attrgetter("num_computed_tokens")


class DecodeCohort:
    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.caching = block_manager.enable_prefix_caching
        self.clock = 0                          # fast steps taken
        self.num_members = 0                    # running[:num_members]
        self.sum_marks = 0                      # of the members' cohort_mark: their lag is num_members * clock - sum_marks
        # of the members' num_computed_tokens - cohort_mark, which a settle leaves as it is (both grow by the
        # lag): their true positions are computed_base + num_members * clock
        self.computed_base = 0
        # the members in the batch's order (running[:num_members]) and their token rows' columns, kept as
        # they join and leave: a cohort step's token rows copy them (LLMEngine._cohort_tokens), its
        # indices each member's cohort_idx plus the clock
        self.members: list[Sequence] = []
        self.member_req_ids: list[str] = []
        self.member_samples: list[int] = []
        self.member_idx: list[int] = []
        # a member is filed once in each: under the step that next takes or completes a block for it
        # (its cohort_grow_at), and under the step after which it stops (its cohort_stop_at)
        self._grows: dict[int, list[Sequence]] = {}
        self._stops: dict[int, list[Sequence]] = {}

    # ---- a member's counts ------------------------------------------------------------------
    def num_computed(self, seq: Sequence) -> int:
        """The sequence's computed positions, its lag included (any sequence: a non-member has none)."""
        return seq.num_computed_tokens + (self.clock - seq.cohort_mark if seq.cohort_mark >= 0 else 0)

    @property
    def lag(self) -> int:
        """Positions the members computed that their Sequences do not count yet."""
        return self.num_members * self.clock - self.sum_marks

    def positions(self, running: list[Sequence]) -> int:
        """The running sequences' computed positions, lags included: the members' from the sums kept
        (no visit to each), the sequences after them (admitted since the last step) counted."""
        members = self.num_members
        return self.computed_base + members * self.clock + sum(map(_computed, running[members:]))

    def steps_to_next_stop(self) -> float:
        """Fast steps the members can take before the one after which one of them stops (inf: none)."""
        return min(self._stops) - self.clock - 1 if self._stops else math.inf

    def settle(self, seq: Sequence) -> None:
        """Write out the member's lag: its positions, and its placeholder tokens."""
        lag = self.clock - seq.cohort_mark
        if lag:
            seq.num_computed_tokens = seq.num_ever_computed = seq.num_computed_tokens + lag
            seq.token_ids += [seq.cohort_token] * lag
            seq.cohort_mark = self.clock
            self.sum_marks += lag

    def dissolve(self, running: list[Sequence]) -> None:
        """Settle every member and let them go: the general pass (or another reader) decides next."""
        if not self.num_members:
            return
        for seq in running[:self.num_members]:
            self.settle(seq)
            seq.cohort_mark = -1
        self.num_members = 0
        self.sum_marks = 0
        self.computed_base = 0
        for column in (self.members, self.member_req_ids, self.member_samples, self.member_idx):
            column.clear()
        self._grows.clear()
        self._stops.clear()

    def leave(self, seq: Sequence) -> None:
        """A member leaves the running batch (it finished, or was preempted), settled: out of the
        cohort and out of its files."""
        if seq.cohort_mark < 0:
            return
        for files, at in ((self._grows, seq.cohort_grow_at), (self._stops, seq.cohort_stop_at)):
            filed = files.get(at)
            if filed is not None and seq in filed:   # its grow is not filed while its step is taken
                filed.remove(seq)
                if not filed:
                    del files[at]
        self.sum_marks -= seq.cohort_mark
        self.computed_base -= seq.num_computed_tokens - seq.cohort_mark
        seq.cohort_mark = -1
        self.num_members -= 1
        i = self.members.index(seq)
        for column in (self.members, self.member_req_ids, self.member_samples, self.member_idx):
            del column[i]

    # ---- the step -----------------------------------------------------------------------------
    def grow(self, running: list[Sequence], preempt: Callable[[Sequence], None] | None) -> bool:
        """The scheduler's fast path when every running sequence decodes one token: give each member
        whose step it is its block or prefix-cache entry (BlockManager.grow_decode), join the
        newcomers, in the batch's order, and return True. When the free blocks fall short of the
        blocks the step takes, `preempt(seq)` preempts the policy's victim for `seq` (the newest
        running sequence, which may be `seq`: the general pass ends there) until they suffice, as the
        general pass would. Without `preempt`, or when a sequence does not just decode, return False
        having changed nothing but members' counts written out: the scheduler then dissolves the cohort
        and the general pass decides the step."""
        bm = self.bm
        bs = bm.block_size
        shared = bm.shared_fill
        step = self.clock + 1
        joiners = running[self.num_members:]
        for seq in joiners:   # the fast path's conditions; the members met them when they joined
            if not is_plain_decode(seq):
                return False
            computed = seq.num_computed_tokens
            table = seq.block_table
            if shared and computed < len(table) * bs and table[computed // bs] in shared:
                return False
        due = self._grows.pop(step, None) or ()
        num_needed = 0
        for seq in due:
            self.settle(seq)
            num_needed += seq.num_computed_tokens >= len(seq.block_table) * bs
        for seq in joiners:
            num_needed += seq.num_computed_tokens >= len(seq.block_table) * bs
        short = num_needed > bm.num_free_blocks
        if short and preempt is None:
            return False   # the due members, settled and out of the files: the dissolve lets every member go
        if len(due) > 1:
            due.sort(key=_admitted_order)   # the batch's order (running is in admission order)
        for seq in due:
            if seq.cohort_mark < 0:
                continue   # preempted in this step
            if short and not self._make_room(seq, running, preempt):
                break
            bm.grow_decode(seq, seq.num_computed_tokens + 1)
            self._file_grow(seq, 2)
        else:
            clock = self.clock
            for seq in joiners:   # after the members in the batch's order
                if seq.status is not SequenceStatus.RUNNING:
                    continue   # preempted in this step
                if short and not self._make_room(seq, running, preempt):
                    break
                token_ids = seq.token_ids
                seq.cohort_mark = clock
                seq.cohort_token = token_ids[-1]   # the simulator gives a sequence one token, every step
                seq.cohort_idx = len(token_ids) - seq.num_prompt_tokens - 1 - clock
                self.sum_marks += clock
                self.computed_base += seq.num_computed_tokens - clock
                self.num_members += 1
                self.members.append(seq)
                self.member_req_ids.append(seq.req_id)
                self.member_samples.append(seq.sample)
                self.member_idx.append(seq.cohort_idx)
                steps_left = seq.stop_num_tokens - len(token_ids)
                assert steps_left >= 1, f"{seq}: running at its stop length"
                stop_at = seq.cohort_stop_at = clock + steps_left
                stops = self._stops.get(stop_at)
                if stops is None:
                    self._stops[stop_at] = [seq]
                else:
                    stops.append(seq)
                k = self._steps_to_grow(seq)
                if k <= 1:
                    bm.grow_decode(seq, seq.num_computed_tokens + 1)
                    self._file_grow(seq, 2)
                else:
                    self._file(seq, clock + k)
        assert self.num_members == len(running), "a running sequence outside the cohort after its step"
        return True

    def _make_room(self, seq: Sequence, running: list[Sequence], preempt: Callable[[Sequence], None]) -> bool:
        """Preempt for the settled sequence (a member or a joiner) until the free blocks hold the block
        its decode takes, if it takes one. False: it preempted itself (it was the last)."""
        bm = self.bm
        if seq.num_computed_tokens < len(seq.block_table) * bm.block_size:
            return True
        while not bm.num_free_blocks:
            victim = running[-1]
            if victim.cohort_mark >= 0:
                self.settle(victim)   # its counts are read as it goes
                self.leave(victim)
            preempt(seq)
            if victim is seq:
                return False
        return True

    def _steps_to_grow(self, seq: Sequence) -> int:
        """Steps from the clock until the settled member's next position starts a block (it takes one)
        or completes one that the prefix cache takes; 1 or less: this step's."""
        bs = self.block_size
        computed = seq.num_computed_tokens
        num_blocks = len(seq.block_table)
        k = num_blocks * bs - computed + 1   # after k steps it holds num_blocks * bs + 1 positions
        if self.caching:
            num_hashed = len(seq.block_hashes)
            if num_hashed < num_blocks:
                k = min(k, (num_hashed + 1) * bs - computed)   # position (num_hashed + 1) * bs - 1 is written
        return k

    def _file_grow(self, seq: Sequence, earliest: int) -> None:
        """File the settled member under its next step that takes or completes a block, at least
        `earliest` steps on."""
        k = self._steps_to_grow(seq)
        self._file(seq, self.clock + (k if k > earliest else earliest))

    def _file(self, seq: Sequence, step: int) -> None:
        seq.cohort_grow_at = step
        grows = self._grows.get(step)
        if grows is None:
            self._grows[step] = [seq]
        else:
            grows.append(seq)

    def advance(self) -> list[Sequence]:
        """The fast step ran: the clock moves on. Returns the members whose stop length its token
        reaches, settled, in the batch's order."""
        self.clock += 1
        stopped = self._stops.pop(self.clock, None)
        if not stopped:
            return []
        for seq in stopped:
            self.settle(seq)
        if len(stopped) > 1:
            stopped.sort(key=_admitted_order)
        return stopped
