"""The running decodes, advanced lazily: a step of plain decodes costs what changes in it (a block taken
or completed, a sequence that stops), not a visit to every running sequence.

The simulator's tokens are placeholders fixed per sequence (executor.py), so what a plain decode
(decodes.py) does to a sequence is known ahead: one more position computed, one more token, a block
taken every block_size steps, a block completed and cached every block_size steps, a stop at a known
length. The cohort lets the running sequences' counts fall behind by the steps taken since each was
last brought up to date (its member's `mark`, on the cohort's step clock), and files each member
under the step at which it next takes or completes a block (`_grows`) and the step after which it
stops (`_stops`), so that a step touches only those.

    running:  [ m0  m1  m2 ... m(k-1) | j0  j1 ]    members first (the batch's order), then the
               \\___ num_members ____/  \\____/      sequences admitted since the last step, which
                                                     join at the next step the cohort takes

A member's true counts: num_computed_tokens + lag and len(token_ids) + lag, lag = clock - mark, every
missing token its placeholder. `settle` writes one member's counts out, `dissolve` every member's;
the fast path dissolves the cohort before the general pass or a leap reads the running
sequences. The words (cohort, member, settle, dissolve, lag) are defined in docs/glossary.md.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from operator import attrgetter

from engine.block_manager import BlockManager
from engine.sequence import Sequence, SequenceStatus
from engine.sim.decodes import grow_decode, is_plain_decode

_computed = attrgetter("num_computed_tokens")
_order = attrgetter("order")


class Member:
    """What the cohort keeps of one running sequence."""

    __slots__ = ("seq", "mark", "token", "idx", "order", "grow_at", "stop_at")

    def __init__(self, seq: Sequence, clock: int) -> None:
        self.seq = seq
        self.mark = clock                 # the clock at which the sequence's own counts are true
        self.token = seq.token_ids[-1]    # its placeholder: the simulator gives a sequence one token, every step
        self.idx = len(seq.token_ids) - seq.num_prompt_tokens - 1 - clock   # its token index, less the clock
        self.order = seq.admitted_order   # its place in the batch (running is in admission order)
        self.grow_at = 0                  # the step it is filed under in _grows
        self.stop_at = 0                  # ... and in _stops


class DecodeCohort:
    def __init__(self, block_manager: BlockManager) -> None:
        self.bm = block_manager
        self.block_size = block_manager.block_size
        self.caching = block_manager.enable_prefix_caching
        self.clock = 0                          # steps the cohort took
        self.members: list[Member] = []         # running[:num_members], in the batch's order
        self._of: dict[int, Member] = {}        # id(seq) -> its member
        self.sum_marks = 0                      # of the members' marks: their lag is num_members * clock - sum_marks
        # of the members' num_computed_tokens - mark, which a settle leaves as it is (both grow by the
        # lag): their true positions are computed_base + num_members * clock
        self.computed_base = 0
        # the members' token rows' columns, kept as they join and leave: a step's token rows copy them,
        # its indices each member's idx plus the clock
        self.member_req_ids: list[str] = []
        self.member_samples: list[int] = []
        self.member_idx: list[int] = []
        # a member is filed once in each: under the step that next takes or completes a block for it,
        # and under the step after which it stops
        self._grows: dict[int, list[Member]] = {}
        self._stops: dict[int, list[Member]] = {}
        # the sequences the last step gave a block (grow_decode), in the order it did: what a host KV
        # tier's connector looks at of the members (fast_path.py)
        self.grown: list[Sequence] = []

    @property
    def num_members(self) -> int:
        return len(self.members)

    # ---- a member's counts ------------------------------------------------------------------
    def num_computed(self, seq: Sequence) -> int:
        """The sequence's computed positions, its lag included (any sequence: a non-member has none)."""
        member = self._of.get(id(seq))
        return seq.num_computed_tokens + (self.clock - member.mark if member is not None else 0)

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
        """Steps the members can take before the one after which one of them stops (inf: none)."""
        return min(self._stops) - self.clock - 1 if self._stops else math.inf

    def settle(self, member: Member) -> None:
        """Write out the member's lag: its positions, and its placeholder tokens."""
        lag = self.clock - member.mark
        if lag:
            seq = member.seq
            seq.num_computed_tokens = seq.num_ever_computed = seq.num_computed_tokens + lag
            seq.token_ids += [member.token] * lag
            member.mark = self.clock
            self.sum_marks += lag

    def dissolve(self) -> None:
        """Settle every member and let them go: the general pass (or another reader) decides next."""
        if not self.members:
            return
        for member in self.members:
            self.settle(member)
        self.members.clear()
        self._of.clear()
        self.sum_marks = 0
        self.computed_base = 0
        for column in (self.member_req_ids, self.member_samples, self.member_idx):
            column.clear()
        self._grows.clear()
        self._stops.clear()

    def leave(self, seq: Sequence) -> None:
        """A member leaves the running batch (it finished, or was preempted), settled: out of the
        cohort and out of its files."""
        member = self._of.pop(id(seq), None)
        if member is None:
            return
        for files, at in ((self._grows, member.grow_at), (self._stops, member.stop_at)):
            filed = files.get(at)
            if filed is not None and member in filed:   # its grow is not filed while its step is taken
                filed.remove(member)
                if not filed:
                    del files[at]
        self.sum_marks -= member.mark
        self.computed_base -= seq.num_computed_tokens - member.mark
        i = self.members.index(member)
        for column in (self.members, self.member_req_ids, self.member_samples, self.member_idx):
            del column[i]

    # ---- the step -----------------------------------------------------------------------------
    def grow(self, running: list[Sequence], preempt: Callable[[Sequence], None] | None) -> bool:
        """The running pass when every running sequence makes a plain decode: give each member whose
        step it is its block or prefix-cache entry (decodes.grow_decode), join the newcomers, in the
        batch's order, and return True. When the free blocks fall short of the blocks the step takes,
        `preempt(seq)` preempts the policy's victim for `seq` (the newest running sequence, which may
        be `seq`: the general pass ends there) until they suffice, as the general pass would. Without
        `preempt`, or when a sequence does not make a plain decode, return False having changed
        nothing but members' counts written out: the general pass then decides the step."""
        bm = self.bm
        bs = bm.block_size
        shared = bm.shared_fill
        step = self.clock + 1
        self.grown = []
        joiners = running[self.num_members:]
        for seq in joiners:   # a plain decode's conditions; the members met them when they joined
            if not is_plain_decode(seq):
                return False
            # no block it will write is shared (forks share their parent's, even those reserved ahead):
            # a write to one copies it first, which the general pass does. Once a member, none becomes
            # shared: forks are of sequences just done with their prompt, prefix hits of full blocks.
            if shared and not shared.keys().isdisjoint(seq.block_table[seq.num_computed_tokens // bs:]):
                return False
        due = self._grows.pop(step, None) or ()
        num_needed = 0
        for member in due:
            self.settle(member)
            seq = member.seq
            num_needed += seq.num_computed_tokens >= len(seq.block_table) * bs
        for seq in joiners:
            num_needed += seq.num_computed_tokens >= len(seq.block_table) * bs
        short = num_needed > bm.num_free_blocks
        if short and preempt is None:
            return False   # the due members, settled and out of the files: the dissolve lets every member go
        if len(due) > 1:
            due.sort(key=_order)   # the batch's order
        for member in due:
            seq = member.seq
            if id(seq) not in self._of:
                continue   # preempted in this step
            if short and not self._make_room(seq, running, preempt):
                break
            if grow_decode(bm, seq, seq.num_computed_tokens + 1):
                self.grown.append(seq)
            self._file_grow(member, 2)
        else:
            for seq in joiners:   # after the members in the batch's order
                if seq.status is not SequenceStatus.RUNNING:
                    continue   # preempted in this step
                if short and not self._make_room(seq, running, preempt):
                    break
                self._join(seq)
        assert self.num_members == len(running), "a running sequence outside the cohort after its step"
        return True

    def _join(self, seq: Sequence) -> None:
        """The settled sequence joins: filed under its stop, and under its next block (taken now if
        this step's decode takes one)."""
        clock = self.clock
        member = Member(seq, clock)
        self._of[id(seq)] = member
        self.sum_marks += clock
        self.computed_base += seq.num_computed_tokens - clock
        self.members.append(member)
        self.member_req_ids.append(seq.req_id)
        self.member_samples.append(seq.sample)
        self.member_idx.append(member.idx)
        steps_left = seq.stop_num_tokens - len(seq.token_ids)
        assert steps_left >= 1, f"{seq}: running at its stop length"
        stop_at = member.stop_at = clock + steps_left
        stops = self._stops.get(stop_at)
        if stops is None:
            self._stops[stop_at] = [member]
        else:
            stops.append(member)
        k = self._steps_to_grow(seq)
        if k <= 1:
            if grow_decode(self.bm, seq, seq.num_computed_tokens + 1):
                self.grown.append(seq)
            self._file_grow(member, 2)
        else:
            self._file(member, clock + k)

    def _make_room(self, seq: Sequence, running: list[Sequence], preempt: Callable[[Sequence], None]) -> bool:
        """Preempt for the settled sequence (a member or a joiner) until the free blocks hold the block
        its decode takes, if it takes one. False: it preempted itself (it was the last)."""
        bm = self.bm
        if seq.num_computed_tokens < len(seq.block_table) * bm.block_size:
            return True
        while not bm.num_free_blocks:
            victim = running[-1]
            member = self._of.get(id(victim))
            if member is not None:
                self.settle(member)   # its counts are read as it goes
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

    def _file_grow(self, member: Member, earliest: int) -> None:
        """File the settled member under its next step that takes or completes a block, at least
        `earliest` steps on."""
        k = self._steps_to_grow(member.seq)
        self._file(member, self.clock + (k if k > earliest else earliest))

    def _file(self, member: Member, step: int) -> None:
        member.grow_at = step
        grows = self._grows.get(step)
        if grows is None:
            self._grows[step] = [member]
        else:
            grows.append(member)

    def advance(self) -> list[Sequence]:
        """The step ran: the clock moves on. Returns the members whose stop length its token reaches,
        settled, in the batch's order."""
        self.clock += 1
        stopped = self._stops.pop(self.clock, None)
        if not stopped:
            return []
        for member in stopped:
            self.settle(member)
        if len(stopped) > 1:
            stopped.sort(key=_order)
        return [member.seq for member in stopped]

    def check_integrity(self, running: list[Sequence]) -> None:
        """Assert its sums and columns are its members', and the members lead the running batch."""
        members = self.members
        assert [m.seq for m in members] == running[:len(members)], "the members are not the running batch's lead"
        assert set(self._of) == {id(m.seq) for m in members}, "the member index is off"
        assert self.sum_marks == sum(m.mark for m in members), "the cohort's sum of marks is off"
        assert self.computed_base == sum(m.seq.num_computed_tokens - m.mark for m in members), \
            "the cohort's sum of positions is off"
        assert self.member_idx == [m.idx for m in members] and self.member_req_ids == [m.seq.req_id for m in members] \
            and self.member_samples == [m.seq.sample for m in members], "the cohort's member columns are off"
        for m in members:
            assert len(m.seq.block_table) * self.block_size >= self.num_computed(m.seq), \
                f"{m.seq}: computed positions beyond its blocks"
