"""The wraps of vLLM's KV-cache methods on one scheduler's instances, and the frames they read.

What is wrapped here, and nothing else (the scheduler's own methods are scheduler.py's; vLLM's
classes are never patched, and nothing changes a decision): on this scheduler's block pool the
instance's `get_new_blocks`, `free_blocks`, `touch` and `_maybe_evict_cached_block`; on its KV
cache manager `free`, and `allocate_slots` from the waiting loop's first `peek_request` to the end of
the step (admissions); the `peek_request` of its waiting queues, which marks where admissions begin.

Each wrapper calls the method it replaced and writes what it saw as KV events into the step's
accounting (accounting.py), and keeps the count of free blocks that still hold a prefix-cache hash.
What a wrapper does of its own is in a `try` (free until it raises, CPython 3.11+): an error there goes
to `on_error` (the recorder stops the capture and takes the wrappers off, `remove`), and vLLM's call,
already made or still to make, stands, so that a half-done schedule never reaches vLLM.

A hybrid model's KV cache is several groups (full attention beside sliding-window, chunked local or
Mamba layers), each with a manager of its own over the one pool: a block-pool call is made by one
group's manager, whose `kv_cache_group_id` the event takes (read from the caller's frame, and only in a
model of several groups); a free made by a manager's `_remove_blocks_in_range` or Mamba's
`remove_skipped_blocks` is a request's blocks falling out of its window (or a Mamba state it no longer
needs) mid-request, a `free` whose reason says so (`window`, `state`) and which lists every block the
request dropped, those another request still holds included.

The running loop's `allocate_slots`, called for every running request every step, is vLLM's own,
unwrapped: when it does call the block pool (a request's new block, every block-size tokens, or every
few steps with draft tokens), the wrapper writes the alloc event without its request, which the step's
SchedulerOutput says once the step is scheduled (accounting.py's `Attribution`; a request preempted in
the same step after its blocks were given, which the SchedulerOutput leaves out, says at its preemption).
Those allocs and the running loop's window frees are kept flat until then (accounting.py's `LoopEvents`).
A block-pool call elsewhere finds its request in the frame of the allocate_slots call it is made in
(`allocating`), and a preemption finds the request it serves (its requester) in the frame of vLLM's
schedule (`requester`). guard.py checks both locals by name at start-up.
"""
from __future__ import annotations

import sys
from operator import attrgetter

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request

from kvtrace.vllm.capture.accounting import ADMITTING, StepAccounting, reason_for_alloc
from kvtrace.vllm.capture.connector import TierWraps
from kvtrace.vllm.capture.instance_wraps import InstanceWraps, own_attribute
from kvtrace.vllm.capture.rows import block_event

_block_id = attrgetter("block_id")
# the managers' methods that free a running request's blocks out of its window (guard.py checks them)
SKIPPING = frozenset(("_remove_blocks_in_range", "remove_skipped_blocks"))


class PoolWraps:
    """The wrappers on one scheduler's KV cache manager, block pool and waiting queues, and their state."""

    def __init__(self, scheduler: Scheduler, vllm_schedule, steps: StepAccounting, on_error) -> None:
        """Put the wrappers on. `vllm_schedule`: vLLM's own schedule method, whose frame a preemption's
        requester is read from; `on_error(exc)`: what an error of a wrapper's own is handed to."""
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        self.kvm, self.steps, self.on_error = kvm, steps, on_error
        self._put = InstanceWraps()                        # what this put on vLLM's instances
        self.current: Request | None = None                # the request a block-pool call is for
        self.free_reason = "other"                         # what the blocks freed now are freed for
        managers = kvm.coordinator.single_type_managers
        self.hybrid = len(managers) > 1                    # several KV-cache groups: each event says its group
        # what a group's mid-request frees are: blocks out of an attention window, or Mamba states
        # (by the class's name, as guard.py checks it: a module-level import of a name a release lacks
        # would keep the scheduler class from loading, and vLLM from starting)
        self.skip_reasons = {m.kv_cache_group_id: "state" if type(m).__name__ == "MambaManager" else "window"
                             for m in managers}
        if self.hybrid:   # an evicted block's group, from vLLM's prefix-cache key (guard.py checks it is there)
            from vllm.v1.core.kv_cache_utils import get_group_id
            self.group_of_key = get_group_id
        self.cached_free = 0                               # free blocks that still hold a prefix-cache hash
        self.allocate_slots_code = type(kvm).allocate_slots.__code__
        self.allocate_slots_depth = 2                      # where `allocating` last found its frame
        self.schedule_code = vllm_schedule.__func__.__code__
        self.admitting = False                             # the admission wrapper is on allocate_slots
        self.running_loop = False                          # vLLM's schedule is in its running loop
        self.allocate_slots = kvm.allocate_slots           # what the admission wrapper calls
        self.allocate_slots_before = None                  # the instance's own allocate_slots before it, if any
        # what each wrapper calls: the instance's method as it found it
        self._get_new_blocks, self._free_blocks = pool.get_new_blocks, pool.free_blocks
        self._touch, self._maybe_evict = pool.touch, pool._maybe_evict_cached_block
        self._free = kvm.free
        self.tier: TierWraps | None = None                 # a KV connector's wraps (connector.py), if one is configured
        try:
            if getattr(scheduler, "connector", None) is not None:
                self.tier = TierWraps(scheduler, steps, on_error)
            self._put(pool, "get_new_blocks", self.get_new_blocks)
            self._put(pool, "free_blocks", self.free_blocks)
            self._put(pool, "touch", self.touch)
            self._put(pool, "_maybe_evict_cached_block", self.maybe_evict_cached_block)
            self._put(kvm, "free", self.free)
            for name in ("waiting", "kv_holding_waiting"):
                if hasattr(scheduler, name):
                    self._wrap_peek(getattr(scheduler, name))
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Take the wrappers off: each instance has what it had before them again (its class's method).
        One that something else has wrapped since stays under that, and its accounting fails into
        `on_error` from then on (once stopped, a no-op), its events no longer kept."""
        self.end_admitting()
        if self.tier is not None:
            self.tier.remove()
        self._put.remove()
        self.steps = None

    # ---- the block pool ----------------------------------------------------------------------------------
    def get_new_blocks(self, num_blocks):
        blocks = self._get_new_blocks(num_blocks)
        if blocks:
            try:
                if self.running_loop and self.current is None:
                    # a running request's: whose, why and of which group the step's SchedulerOutput says
                    # (accounting.py's Attribution). Read here from allocate_slots' frame, as below, it cost
                    # more than the rest of a step's capture where draft tokens make requests grow often.
                    # Kept flat till then (accounting.py's LoopEvents): no object the cyclic GC tracks
                    steps = self.steps
                    loop = steps.loop
                    loop.alloc_places.append(len(steps.events))
                    loop.alloc_counts.append(len(blocks))
                    loop.alloc_ids.extend(map(_block_id, blocks))
                    steps.events.append(None)   # its place among the step's events, filled then
                    return blocks
                # an admission's (`current`), or one made elsewhere: its request's, if it is in an
                # allocate_slots call, and why from that request's state
                request = self.current or self.allocating()
                if request is None:
                    rid, reason = "", "other"
                else:
                    rid, reason = request.request_id, reason_for_alloc(request)
                group = group_of(sys._getframe(1)) if self.hybrid else None
                self.steps.events.append(block_event("alloc", rid, tuple(map(_block_id, blocks)), reason, group))
            except Exception as exc:  # noqa: BLE001 (the capture's own error: it stops, vLLM's call stands)
                self.on_error(exc)
        return blocks

    def free_blocks(self, ordered_blocks):
        blocks = list(ordered_blocks)
        self._free_blocks(blocks)
        try:
            freed = []
            for b in blocks:   # (one loop, no comprehension: a window's frees are a block or two, every few steps)
                if b.ref_cnt == 0 and not b.is_null:
                    freed.append(b)
                    if b.block_hash is not None:
                        self.cached_free += 1
            caller = sys._getframe(1)
            if caller.f_code.co_name in SKIPPING:   # out of a request's window, mid-request
                owner = caller.f_locals
                group = owner["self"].kv_cache_group_id
                steps = self.steps
                if self.running_loop:   # (the running loop's: kept flat till the step's events are made)
                    loop = steps.loop
                    loop.free_places.append(len(steps.events))
                    loop.free_counts.append(len(blocks))
                    loop.free_ids.extend(map(_block_id, blocks))
                    loop.free_req_ids.append(owner["request_id"])
                    loop.free_reasons.append(self.skip_reasons[group])
                    loop.free_groups.append(group if self.hybrid else None)
                    steps.events.append(None)
                else:
                    steps.events.append(block_event("free", owner["request_id"], tuple(map(_block_id, blocks)),
                                                    self.skip_reasons[group], group if self.hybrid else None))
            elif freed:
                request = self.current or self.allocating()
                self.steps.events.append(block_event("free", request.request_id if request is not None else "",
                                                     tuple(map(_block_id, freed)), self.free_reason,
                                                     group_of(caller) if self.hybrid else None))
        except Exception as exc:  # noqa: BLE001 (as above)
            self.on_error(exc)

    def touch(self, blocks):
        try:
            for b in blocks:
                if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None:
                    self.cached_free -= 1
        except Exception as exc:  # noqa: BLE001 (as above)
            self.on_error(exc)
        return self._touch(blocks)

    def maybe_evict_cached_block(self, block):
        key = block.block_hash if self.hybrid else None   # a hybrid model's keys name the group (gone once evicted)
        evicted = self._maybe_evict(block)
        if evicted:
            try:
                if block.ref_cnt == 0:
                    self.cached_free -= 1
                group = self.group_of_key(key) if key is not None else None
                self.steps.events.append(block_event("evict", "", (block.block_id,), None, group))
            except Exception as exc:  # noqa: BLE001 (as above)
                self.on_error(exc)
        return evicted

    # ---- the KV cache manager ------------------------------------------------------------------------------
    def free(self, request):
        self.current = request
        try:
            return self._free(request)
        finally:
            self.current = None

    def admit_slots(self, request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                    *args, **kwargs):
        """allocate_slots while the waiting loop admits: a waiting or preempted request's blocks are an
        admission's (accounting.py's `admitted`), or vLLM stops admitting."""
        status = request.status   # the scheduler changes it only after allocate_slots
        if status not in ADMITTING:
            return self.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                       *args, **kwargs)
        self.current = request
        mark = len(self.steps.events)
        try:
            result = self.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                         *args, **kwargs)
        finally:
            self.current = None
        try:
            if result is None:   # vLLM stops admitting
                self.steps.admit_failed = True
            elif self.tier is not None and not request.num_computed_tokens:   # the connector was asked too
                lookup, loading = self.tier.lookup(request, num_new_computed_tokens, kwargs)
                self.steps.admitted(request, status, num_new_computed_tokens, new_computed_blocks, mark, lookup,
                                    loading)
            else:
                self.steps.admitted(request, status, num_new_computed_tokens, new_computed_blocks, mark)
        except Exception as exc:  # noqa: BLE001 (as above)
            self.on_error(exc)
        return result

    # ---- the waiting queues: where admissions begin -----------------------------------------------------
    def _wrap_peek(self, queue) -> None:
        kvm = self.kvm
        peek = queue.peek_request

        def peek_request():
            if not self.admitting:   # the waiting loop has begun: admissions are watched from here on
                self.admitting = True
                self.running_loop = False
                # whatever allocate_slots is now (vLLM's, or another instance wrapper's) stays under ours
                self.allocate_slots_before = own_attribute(kvm, "allocate_slots")
                self.allocate_slots = kvm.allocate_slots
                kvm.allocate_slots = self.admit_slots
            return peek()
        self._put(queue, "peek_request", peek_request)

    def begin_step(self) -> None:
        """vLLM's schedule begins: its running loop first, then its waiting loop (peek_request)."""
        self.running_loop = True

    def end_admitting(self) -> None:
        """The step's scheduling is over: the running loop of the next calls vLLM's own allocate_slots."""
        self.running_loop = False
        if self.admitting:
            self.admitting = False
            if self.allocate_slots_before is None:
                del self.kvm.allocate_slots
            else:
                self.kvm.allocate_slots = self.allocate_slots_before

    # ---- vLLM's frames ---------------------------------------------------------------------------------------
    def allocating(self) -> Request | None:
        """The request of the allocate_slots call that a block-pool call is made in (None outside one)."""
        # allocate_slots -> coordinator -> its manager -> the pool: the same frames call after call, so its
        # frame is looked for first where it was last found (a walk up to it makes an object of every frame
        # on the way, and a step with draft tokens calls the pool for every few tokens a request takes)
        try:
            frame = sys._getframe(self.allocate_slots_depth)
        except ValueError:   # a stack shallower than that: not inside allocate_slots
            frame = None
        if frame is None or frame.f_code is not self.allocate_slots_code:
            frame = sys._getframe(2)        # the caller of the block-pool wrapper
            for depth in range(2, 10):
                if frame is None:
                    return None
                if frame.f_code is self.allocate_slots_code:
                    self.allocate_slots_depth = depth
                    break
                frame = frame.f_back
            else:
                return None
        return frame.f_locals.get("request")

    def requester(self, frame) -> str | None:
        """The running request whose allocate_slots failed, when vLLM's schedule (`frame`, the caller of
        `_preempt_request`, or a few frames up where something else wraps it on the instance) preempts
        for it: its running loop's `request`; None for a preemption from anywhere else
        (reset_prefix_cache)."""
        for _ in range(4):
            if frame is None:
                return None
            if frame.f_code is self.schedule_code:
                return getattr(frame.f_locals.get("request"), "request_id", None)
            frame = frame.f_back
        return None


def group_of(frame) -> int | None:
    """The KV-cache group of the manager whose method `frame` is (None: a call from elsewhere, such as
    the scheduler's deferred frees, whose blocks may be of several groups)."""
    return getattr(frame.f_locals.get("self"), "kv_cache_group_id", None)
