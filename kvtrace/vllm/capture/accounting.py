"""What each step did, per request where it must be and in bulk where it can: the capture's
per-step accounting.

The running requests are many (1,024 and more) and nearly all of them decode, so per request the
accounting does only what must be recorded. Requests that need a closer look (admitted and still
prefilling, or re-prefilling after a preemption) are `watched`: when a step is scheduled, only they
are looked at one by one. Every other scheduled request decodes: it has computed every position it
ever had, so it recomputes nothing, and its tokens are the step's decode tokens (the scheduled
tokens less the watched ones' prefill). A step's KV tokens are one pass over the running requests.

Between two schedule() calls the accounting collects the KV events (the block pool's wrappers,
wraps.py, append theirs) and the requests freed; `take_step` hands them, with the step's row, to the
step they belong to (rows.py's ScheduledStep), which waits for its output (pending.py).
"""
from __future__ import annotations

import operator
from array import array
from collections import deque
from collections.abc import Sequence
from itertools import accumulate, chain, compress, islice, repeat
from operator import and_, eq, mod, neg

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvtrace.vllm.capture.rows import (
    BLOCKS,
    AcceptedDrafts,
    KvEvent,
    RequestState,
    ScheduledStep,
    StepRow,
    block_event,
)

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_IGNORED: "rejected",
}
# and those of later releases: a request the server ended on an error (e.g. vLLM 0.34's failed KV load under
# kv_load_failure_policy "fail"), and one stopped for repeating itself (a stop criterion)
FINISH_REASONS.update({getattr(RequestStatus, status): reason for status, reason in
                       (("FINISHED_ERROR", "error"), ("FINISHED_REPETITION", "stop")) if hasattr(RequestStatus, status)})
_num_computed_tokens = operator.attrgetter("num_computed_tokens")
# a running-loop event's fields but its kind, request, blocks, reason and group (rows.py's block_event)
_LOOP_DEFAULTS = dict(zip(KvEvent._fields, block_event("alloc", "", (), None, None)))
ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)


def reason_for_alloc(request: Request) -> str:
    """Why `request` is given blocks now, from its state as vLLM's allocate_slots sees it (which changes
    none of it): "prefill" while admitted or short of its last prompt token, else "decode"."""
    placeholders = request.num_output_placeholders   # async: sampled, not yet delivered
    return ("prefill" if request.status in ADMITTING
            or request.num_computed_tokens < request.num_tokens + placeholders - 1
            or not request.num_output_tokens + placeholders else "decode")


def split(flat: Sequence[int], counts: Sequence[int]) -> list[tuple[int, ...]]:
    """`flat` cut into tuples of `counts`' lengths, in order."""
    values = iter(flat)
    return [tuple(islice(values, n)) for n in counts]


class LoopEvents:
    """The block events of one step's running loop (wraps.py), kept flat until their events are made: each
    one's place among the step's events (None there until then) and its blocks' ids, one after another.
    An alloc's request, reason and group are the step's SchedulerOutput's (Attribution); a free out of a
    request's window says its own.

    With two groups and draft tokens the running loop makes hundreds of these a step (at 1,024 running,
    ~315 allocs and ~130 window frees). Kept as events, each a tuple or two that outlives the step's
    scheduling, they brought on a collection of the youngest generation every 700 of them, and more of
    the older ones; kept flat, they bring on none, and their events are made on the sink's builder
    thread."""

    __slots__ = ("alloc_places", "alloc_counts", "alloc_ids", "free_places", "free_counts", "free_ids",
                 "free_req_ids", "free_reasons", "free_groups")

    def __init__(self) -> None:
        self.alloc_places: list[int] = []
        self.alloc_counts: list[int] = []
        self.alloc_ids: list[int] = []
        self.free_places: list[int] = []
        self.free_counts: list[int] = []
        self.free_ids: list[int] = []
        self.free_req_ids: list[str] = []
        self.free_reasons: list[str] = []
        self.free_groups: list[int | None] = []

    def __bool__(self) -> bool:
        return bool(self.alloc_places or self.free_places)

    def make_frees(self, events: list) -> None:
        """The window frees' events, in their places in `events`."""
        for i, rid, ids, reason, group in zip(self.free_places, self.free_req_ids,
                                              split(self.free_ids, self.free_counts), self.free_reasons,
                                              self.free_groups):
            events[i] = block_event("free", rid, ids, reason, group)


class Attribution:
    """The running loop's block events of one step (LoopEvents), and what its SchedulerOutput says of its
    allocs: the `cached` requests given blocks, with the ids of those blocks per group, and those scheduled
    whose tokens are prefill (the others decode). Made into the step's kv_events columns on the sink's
    builder thread (`columns`: the recorder hands it over with the step's events), or resolved into events
    at once where the engine's thread reads them (`resolve`: the self-check; an async step that a later
    one's finish concerns). One set of decisions for both (`alloc_owners`).

    What it keeps until then is flat, and in tuples: a list of a thousand values is walked value by
    value by every collection that meets it while it lives (the youngest generation's, a few a step,
    then the middle one's), a tuple of numbers and strings once, by the first, which then stops
    tracking it. (A typed array is never walked, but CPython builds one value by value through a
    format-string parse: 12 times a tuple's cost.)
    vLLM's own lists, kept a step longer than vLLM keeps its own, would be promoted to the oldest
    generation on the way, bringing on full collections of the server's heap that vLLM alone never needs
    (25-35 ms at 1,024 running)."""

    __slots__ = ("loop", "req_ids", "given_counts", "given_ids", "num_groups", "prefilling", "hybrid")

    def __init__(self, loop: LoopEvents, cached, num_groups: int, prefilling: set[str], hybrid: bool) -> None:
        self.loop = loop
        # only the requests given blocks (those with None for new_block_ids are left out in C), and their
        # blocks per request and group, flat: the k-th count is req_ids[k // num_groups]'s, of group
        # k % num_groups
        new_block_ids = cached.new_block_ids
        self.req_ids = tuple(compress(cached.req_ids, new_block_ids))
        given = tuple(compress(new_block_ids, new_block_ids))   # (two passes over every request, then the few)
        self.given_counts = tuple(map(len, chain.from_iterable(given)))
        self.given_ids = tuple(chain.from_iterable(chain.from_iterable(given)))
        self.num_groups, self.prefilling, self.hybrid = num_groups, prefilling, hybrid

    def columns(self, events: list) -> list[list]:
        """The kv_events fields (KvEvent's, in order) of the step's `events`, each a list as long as
        `events`: the running loop's events made here, in their places (None in `events`), the others
        read from their tuples. (resolve's decisions, on the sink's builder thread, with no object a
        loop event: its tuples, a few hundred alive at once, were enough to bring on a collection of
        the youngest generation nearly every step, which promotes whatever the server holds then.)"""
        loop, m = self.loop, len(events)
        alloc_reqs, alloc_reasons, alloc_groups = self.alloc_owners()
        alloc_places, free_places = loop.alloc_places, loop.free_places
        others = [i for i, e in enumerate(events) if e is not None]
        other_fields = list(zip(*[events[i] for i in others])) if others else [()] * len(KvEvent._fields)

        def column(default, alloc_values, free_values, k: int) -> list:
            values = [default] * m
            setitem = values.__setitem__
            deque(map(setitem, alloc_places, alloc_values), maxlen=0)
            deque(map(setitem, free_places, free_values), maxlen=0)
            deque(map(setitem, others, other_fields[k]), maxlen=0)
            return values

        # each loop event's blocks: a slice of the flat ids (an array: no object the cyclic GC tracks)
        alloc_ids, free_ids = array("q", loop.alloc_ids), array("q", loop.free_ids)
        alloc_at, free_at = list(accumulate(loop.alloc_counts, initial=0)), list(accumulate(loop.free_counts, initial=0))
        blocks = column(None, map(alloc_ids.__getitem__, map(slice, alloc_at, alloc_at[1:])),
                        map(free_ids.__getitem__, map(slice, free_at, free_at[1:])), BLOCKS)
        fields = []
        for k, name in enumerate(KvEvent._fields):
            if k == BLOCKS:
                fields.append(blocks)
            elif name == "kind":
                fields.append(column("alloc", (), repeat("free"), k))
            elif name == "req_id":
                fields.append(column("", alloc_reqs, loop.free_req_ids, k))
            elif name == "reason":
                fields.append(column(None, alloc_reasons, loop.free_reasons, k))
            elif name == "kv_group":
                fields.append(column(None, alloc_groups, loop.free_groups, k))
            else:   # as block_event makes it
                fields.append(column(_LOOP_DEFAULTS[name], (), (), k))
        return fields

    def alloc_owners(self) -> tuple[list[str], list[str], list[int | None]]:
        """Each of the running loop's allocs' request, reason and group, in the loop's order; "" and "other"
        for one whose blocks none was given. In lists, not an object an alloc.

        The running requests come first: a request resumed after them (on vLLM before 0.34 here too)
        lists all its blocks, a prefix hit on one that a running request was just given among them. The
        running loop gave blocks to the running requests in the order the SchedulerOutput lists them, one
        alloc a request and group (in group order), so the k-th alloc is the k-th request and group given
        blocks. Paired so while each pair's blocks are the same (their count and first id); from the first
        that is not, the blocks' owners say."""
        loop = self.loop
        n, req_ids, counts = self.num_groups, self.req_ids, loop.alloc_counts
        given = list(compress(range(len(self.given_counts)), self.given_counts))   # k of each (request, group) given any
        given_counts = list(filter(None, self.given_counts))
        given_at = list(accumulate(self.given_counts, initial=0))
        given_first = list(map(self.given_ids.__getitem__, map(given_at.__getitem__, given)))
        alloc_first = list(map(loop.alloc_ids.__getitem__, list(accumulate(counts, initial=0))[:-1]))
        same = list(map(and_, map(eq, counts, given_counts), map(eq, alloc_first, given_first)))
        paired = same.index(False) if False in same else len(same)
        reqs = list(map(req_ids.__getitem__, map(operator.floordiv, given[:paired], repeat(n))))
        groups = list(map(mod, given[:paired], repeat(n))) if self.hybrid else [None] * paired
        if paired < len(counts):   # from the first that is not, the blocks' owners say
            owner: dict[int, tuple[str, int]] = {}
            for k in given:
                for block in self.given_ids[given_at[k]:given_at[k + 1]]:
                    owner.setdefault(block, (req_ids[k // n], k % n))
            for first in alloc_first[paired:]:
                rid, group = owner.get(first, ("", None))
                reqs.append(rid)
                groups.append(group if self.hybrid else None)
        prefilling = self.prefilling
        reasons = ["other" if not rid else "prefill" if rid in prefilling else "decode" for rid in reqs]
        return reqs, reasons, groups

    def resolve(self, events: list) -> None:
        """Each of the running loop's events, as a tuple, in its place in `events` (the step's): where the
        engine's thread reads the events (`columns` makes them on the builder's)."""
        loop = self.loop
        loop.make_frees(events)
        for i, ids, rid, reason, group in zip(loop.alloc_places, split(loop.alloc_ids, loop.alloc_counts),
                                              *self.alloc_owners()):
            events[i] = block_event("alloc", rid, ids, reason, group)


class StepAccounting:
    """The requests' states, and what happened since the last schedule(); one per scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.kvm = scheduler.kv_cache_manager
        self.pool = self.kvm.block_pool
        self.null_id = self.pool.null_block.block_id
        self.block_size = scheduler.block_size
        self.total_blocks = self.pool.num_gpu_blocks - 1   # block 0 is vLLM's null block
        managers = self.kvm.coordinator.single_type_managers
        self.num_groups = len(managers)
        self.hybrid = len(managers) > 1
        # the groups whose blocks hold positions (attention's, not a Mamba state's): each has a request's
        # unfilled tail block
        self.position_groups = sum(1 for m in managers if type(m).__name__ != "MambaManager")
        self.is_async = isinstance(scheduler, AsyncScheduler)
        self.states: dict[str, RequestState] = {}
        # the requests whose steps need more than "a decode step": admitted and not yet past their
        # (re-)prefill; every other scheduled request decodes, which the step's totals account for
        self.watched: dict[str, RequestState] = {}
        self.events: list[KvEvent] = []                       # since the last schedule()
        # the running loop's block events this step (wraps.py), flat, with None for each in `events` until
        # they are made: an alloc's request, reason and group are the SchedulerOutput's (Attribution, once the
        # step is scheduled: `attribution`, for the placeholders in `events`)
        self.loop = LoopEvents()
        self.attribution: Attribution | None = None
        self.resolve_at_once = False        # the engine's thread reads every step's events (the self-check)
        self.finishing: list[tuple[Request, RequestState]] = []   # freed since the last schedule()
        self.step = -1
        self.step_start = 0.0
        self.step_preemptions = 0
        self.admit_failed = False                          # a waiting request's allocate_slots failed this step
        self.num_drafts: list[int] | None = None           # the step's drafts per request (scheduled)
        # vLLM's victim: the least urgent (priority policy), else the newest, running[-1]
        self.victim_reason = "lowest-priority" if scheduler.policy == SchedulingPolicy.PRIORITY else "newest"
        self.max_seats = getattr(scheduler, "max_num_active_reqs", scheduler.max_num_running_reqs)
        # speculative decoding: the KV slots allocate_slots reserves past a request's scheduled tokens
        self.lookahead = getattr(scheduler, "num_lookahead_tokens", 0) or 0
        self.max_step_tokens = getattr(scheduler, "max_num_scheduled_tokens",
                                       scheduler.scheduler_config.max_num_batched_tokens)

    def state(self, rid: str) -> RequestState:
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = RequestState()
        return st

    def begin_step(self, start: float) -> None:
        self.step_start = start
        self.step += 1
        self.step_preemptions = 0
        self.admit_failed = False

    def admitted(self, request: Request, status, num_hit: int, hit_blocks, mark: int, lookup: KvEvent | None = None,
                 loading: bool = False) -> None:
        """A waiting or preempted request got its blocks (`mark`: where its allocations' events
        begin): it is scheduled this step. With a KV connector (connector.py): its `lookup` event, and
        `loading`: it waits for a load from the tier instead (WAITING_FOR_REMOTE_KVS), admitted once
        that finishes, its loaded positions computed by then (vLLM's num_computed_tokens)."""
        rid = request.request_id
        st = self.state(rid)
        resumed = status == RequestStatus.PREEMPTED
        reason = "resume-recompute" if resumed else "new"
        rows = [] if lookup is None else [lookup._replace(reason=reason)]
        if not loading:
            self.watched[rid] = st
            if st.first_scheduled is None:
                st.first_scheduled = self.step_start
            # (the positions a sync load brings in this step are not computed either)
            num_loaded = lookup.tier_tokens if lookup is not None else 0
            rows.append(KvEvent("admit", rid, None, request.num_tokens - num_hit - num_loaded - request.num_computed_tokens,
                                reason))
        if num_hit:
            ids, per_group = self.block_ids(hit_blocks.get_block_ids()) if hit_blocks is not None else ([], None)
            rows.append(KvEvent("prefix_hit", rid, ids, num_hit, reason, kv_group_blocks=per_group))
            st.prefix_hits += num_hit
        self.events[mark:mark] = rows     # before the blocks it was given, as kvtrace's engine orders them
        if resumed or loading:
            if not request.num_computed_tokens:   # after its load: the device's hit is the lookup's
                st.reprefill_cached = num_hit
            if not loading:
                st.reprefill_target = request.num_tokens
                st.reprefill_recomputed = 0

    def scheduled(self, out, start: float, end: float, cached_free: int) -> StepRow:
        """The row of the step vLLM's schedule() just returned (`out`, its SchedulerOutput)."""
        sched = self.scheduler
        scheduled = out.num_scheduled_tokens
        num_scheduled = sum(scheduled.values())
        prefill = recompute = 0
        requests = sched.requests
        is_async = self.is_async
        watched = self.watched
        spec = out.scheduled_spec_decode_tokens   # speculative decoding: each request's drafts
        for new in out.scheduled_new_reqs:   # one admitted other than from WAITING / PREEMPTED (a KV connector's)
            if new.req_id not in watched:
                st = watched[new.req_id] = self.state(new.req_id)
                if st.first_scheduled is None:
                    st.first_scheduled = start
        # Only the watched requests are looked at one by one. Every other scheduled request decodes:
        # it has computed every position it ever had (`ever` is its begin, so nothing is recomputed)
        # and its tokens are the step's decode tokens, num_scheduled less the watched ones' prefill.
        done, reprefilled, prefilling = [], [], set()
        for rid, st in watched.items():
            n = scheduled.get(rid)
            if not n:
                continue
            req = requests[rid]
            stop = req.num_computed_tokens
            begin = stop - n
            # async: tokens sampled but not delivered count as known, less those this step will sample (the
            # next token, and its drafts under speculative decoding)
            extra = req.num_output_placeholders - (is_async and not req.is_prefill_chunk) * (1 + len(spec.get(rid, ())))
            # a prompt's last token is prefill
            decoding = begin >= req.num_tokens + extra - 1 and req.num_output_tokens + extra
            if not decoding:
                prefill += n
                prefilling.add(rid)
            again = min(stop, st.ever) - begin
            if again > 0:
                recompute += again
                st.recomputed += again
            else:
                again = 0
            if stop > st.ever:
                st.ever = stop
            if st.reprefill_target:
                st.reprefill_recomputed += again
                if stop >= st.reprefill_target:
                    reprefilled.append(KvEvent("reprefill", rid, None, st.reprefill_target, None, st.reprefill_cached,
                                               st.reprefill_recomputed))
                    st.reprefill_target = 0
            if decoding and not st.reprefill_target and stop >= st.ever:
                done.append(rid)   # from now on a decoding request like the others, until a preemption
        for rid in done:
            del watched[rid]
        if self.loop:   # its events, its allocs' requests: on the builder thread, or at once where asked
            self.attribution = Attribution(self.loop, out.scheduled_cached_reqs, self.num_groups, prefilling,
                                           self.hybrid)
            self.loop = LoopEvents()
            if self.resolve_at_once:
                self.resolve()
        if len(reprefilled) > 1:   # in the order the scheduler scheduled them
            order = {rid: i for i, rid in enumerate(scheduled)}
            reprefilled.sort(key=lambda event: order[event.req_id])
        self.events += reprefilled
        free = self.pool.get_num_free_blocks()
        used = self.total_blocks - free
        bs = self.block_size
        # the unfilled tail of each running request's last block: bs - filled, 0 for a full one
        # (-computed % bs for each, in C: mod(neg(computed), bs), a pass over every running request each step)
        gaps = sum(map(mod, map(neg, map(_num_computed_tokens, sched.running)), repeat(bs))) * self.position_groups
        # each request's drafts, counted once: the step's spec_decode rows take them too (take_step)
        self.num_drafts = tuple(map(len, spec.values())) if spec else None
        return StepRow(self.step, start, end, len(sched.running), len(sched.waiting), prefill, num_scheduled - prefill,
                       recompute, self.step_preemptions, free, used, cached_free, used * bs - gaps,
                       self.admission_stop(num_scheduled), sum(self.num_drafts) if spec else 0)

    def admission_stop(self, num_scheduled: int) -> str:
        """Why vLLM admitted no further waiting request this step, from what the step left behind
        (docs/trace-format.md): vLLM does not say, so the checks follow its waiting loop's order."""
        sched = self.scheduler
        if not len(sched.waiting) and not len(getattr(sched, "kv_holding_waiting", ())):
            return "nothing-waiting"
        if self.step_preemptions:
            return "preemption"                    # the waiting loop runs only without preemptions
        if num_scheduled >= self.max_step_tokens:
            return "budget"                        # the loop runs while tokens are left, then checks seats
        if len(sched.running) >= self.max_seats:
            return "seats"
        if self.admit_failed:
            return "blocks"                        # allocate_slots refused a waiting request
        return "other"

    def accepted(self, spec: dict, model_output) -> AcceptedDrafts:
        """Speculative decoding: what a step's output (vLLM's ModelRunnerOutput) says of the drafts scheduled
        in it (`spec`, its SchedulerOutput's scheduled_spec_decode_tokens), taken before vLLM's
        update_from_output, which cuts a stopped request's tokens short in place: each request's sampled
        tokens, counted (rows.py's AcceptedDrafts; the counts in `spec`'s order are the builder's, for the
        spec_decode rows, and a request's totals the reader's, importer.DraftTotals). Every request of a
        step drafts, so this is C-level passes over them, no Python per request, but for the watched ones,
        whose rejected drafts' positions are rolled back."""
        num_sampled = tuple(map(len, model_output.sampled_token_ids))
        states = self.states
        gone = frozenset() if spec.keys() <= states.keys() else frozenset(spec.keys() - states.keys())
        drafts = AcceptedDrafts(tuple(model_output.req_ids), num_sampled, gone)
        common = self.watched.keys() & spec.keys()
        if common:
            at = dict(zip(drafts.req_ids, num_sampled))
            for rid in common - gone:
                n = at.get(rid, 0) - 1
                if n >= 0:
                    # the rejected drafts' positions are rolled back: never kept, so computing them again is
                    # no recompute
                    st = self.watched[rid]
                    st.ever = max(0, st.ever - (len(spec[rid]) - n))
        return drafts

    def resolve(self) -> None:
        """The running loop's allocs among `events` given their requests now (Attribution)."""
        if self.attribution is not None:
            self.attribution.resolve(self.events)
            self.attribution = None

    def take_step(self, row: StepRow, out) -> ScheduledStep:
        """The step just scheduled, with what its scheduling did; the next one starts empty."""
        step = ScheduledStep(row, self.events, self.finishing, out, self.num_drafts, self.attribution)
        self.events, self.finishing, self.attribution = [], [], None
        return step

    def join(self, step: ScheduledStep) -> None:
        """What the step's scheduling did goes before what has happened since: its output is processed.
        (Its events first: its allocs' places among them stay as its Attribution has them.)"""
        self.events[:0] = step.events
        self.finishing[:0] = step.finishing
        self.attribution = step.attribution

    def file_with(self, step: ScheduledStep) -> None:
        """What has happened since goes with `step` (a step still waiting for its output)."""
        step.events += self.events
        step.finishing += self.finishing
        self.events, self.finishing = [], []

    def preempting(self, request: Request, requester: str | None) -> None:
        """vLLM is about to preempt `request` for `requester` (wraps.py finds it)."""
        rid = request.request_id
        st = self.state(rid)
        groups = self.kvm.get_block_ids(rid)
        if self.loop.alloc_places:   # given blocks this step and preempted now: the SchedulerOutput will not say
            self.claim(request, groups)
        blocks, per_group = self.block_ids(groups)
        # watched again from its resume: what it recomputes is counted against the most it had
        st.ever = max(st.ever, request.num_computed_tokens)
        if st.reprefill_target:   # cut short while re-prefilling: what it did redo, before the preemption
            self.events.append(KvEvent("reprefill", rid, None, st.reprefill_target, "interrupted", st.reprefill_cached,
                                       st.reprefill_recomputed))
            st.reprefill_target = 0
        # vLLM preempts inside the allocate_slots loop of the running request it could not serve
        # (that request itself when it is the newest); the victim is running[-1] or the least urgent
        self.events.append(KvEvent("preempt", rid, blocks, request.num_computed_tokens, "recompute", 0, 0,
                                   requester, self.victim_reason, None, per_group))
        st.preemptions += 1
        self.step_preemptions += 1

    def claim(self, request: Request, groups: tuple[list[int], ...]) -> None:
        """The running loop's allocs of this step that are `request`'s (it holds their blocks: `groups`, its
        block ids per group) get it, their reason from its state as vLLM's schedule left it."""
        owner = {block: group for group, ids in enumerate(groups) for block in ids}
        reason = reason_for_alloc(request)
        loop, events = self.loop, self.events
        left_places, left_counts, left_ids = [], [], []
        for i, blocks in zip(loop.alloc_places, split(loop.alloc_ids, loop.alloc_counts)):
            group = owner.get(blocks[0])
            if group is None:
                left_places.append(i)
                left_counts.append(len(blocks))
                left_ids += blocks
            else:
                events[i] = block_event("alloc", request.request_id, blocks, reason,
                                        group if self.hybrid else None)
        loop.alloc_places, loop.alloc_counts, loop.alloc_ids = left_places, left_counts, left_ids

    def block_ids(self, groups: tuple[list[int], ...]) -> tuple[list[int], list[int] | None]:
        """A request's blocks in every group (vLLM's block ids per group), the null block left out, and
        how many each group has (None for a model of one group)."""
        null = self.null_id
        if not self.hybrid:
            return [b for b in groups[0] if b != null], None
        per_group = [[b for b in ids if b != null] for ids in groups]
        return [b for ids in per_group for b in ids], [len(ids) for ids in per_group]

    def freeing(self, request: Request) -> None:
        """vLLM is about to free a finished request: its row is written with the step's output."""
        self.finishing.append((request, self.state(request.request_id)))

    def finished(self, request: Request) -> str:
        """A freed request's finish event; it is forgotten. Its finish reason, for its row."""
        rid = request.request_id
        reason = FINISH_REASONS.get(request.status, str(request.status).lower())
        self.events.append(KvEvent("finish", rid, None, request.num_output_tokens, reason))
        self.forget(rid)
        return reason

    def forget(self, rid: str) -> None:
        """A freed request is not followed any more (its row keeps the state it has)."""
        self.states.pop(rid, None)
        self.watched.pop(rid, None)
