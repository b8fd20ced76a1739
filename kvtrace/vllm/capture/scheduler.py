"""vLLM V1 scheduler subclasses that record kvtrace's trace tables from inside the engine loop.

Select with vLLM's `scheduler_cls` option (`--scheduler-cls` on `vllm serve`):
`kvtrace.vllm.capture.scheduler.KvtraceCaptureScheduler` for every server. It becomes the kvtrace
subclass of the scheduler vLLM's own configuration would have used: `KvtraceAsyncScheduler` (vLLM's
AsyncScheduler) when `scheduler_config.async_scheduling` is on (vLLM's default on GPUs), else
`KvtraceScheduler` (its Scheduler); those two names still force one or the other. The options come
from the environment (`kvtrace vllm-env` prints them; docs/vllm.md): `KVTRACE_CAPTURE_DIR` the folder,
`KVTRACE_CAPTURE_MAX_BYTES` and `KVTRACE_CAPTURE_MAX_AGE` its retention (sink.py),
`KVTRACE_CAPTURE_FLUSH_EVERY` how often a busy server writes a chunk (default 2s: what a crash can lose),
`KVTRACE_CAPTURE_TOKEN_IDS=1` keeps token ids (by default none are written: live traffic's token ids
are its users' text), `KVTRACE_CAPTURE_SELF_CHECK=1` compares, every step, the pool state replayed
from the captured events with the pool's own.

What is wrapped, and nothing else (vLLM is not patched globally, and nothing changes a decision):
the scheduler's own `schedule`, `update_from_output`, `_preempt_request`, `_free_request` and
`reset_prefix_cache`, the `peek_request` of its waiting queues, and on this scheduler's own KV cache
manager and block pool the instance's `free`, `get_new_blocks`, `free_blocks`, `touch` and
`_maybe_evict_cached_block`, and `allocate_slots` from the waiting loop's first `peek_request` to the
end of the step (admissions).
Events are kept as tuples during a step and turned into columns once per step; request ids are
vLLM's (with the random suffix its frontend adds), mapped back to the workload's by the importer.

What a step costs: the running requests are many (1,024 and more) and nearly all of them decode, so
per request the capture does only what must be recorded, in bulk: the tokens rows (a few C-level
passes over the step's outputs) and the KV tokens of the step's row (one pass over the running
requests). Requests that need a closer look (admitted and still prefilling, or re-prefilling after
a preemption) are `watched`. The running loop's `allocate_slots`, called for every running request,
is vLLM's own, unwrapped: when it does call the block pool (a request's new block, every
block-size tokens), the wrapper finds the request in that allocate_slots call's frame, and a
preemption finds the request it serves (its requester) in the frame of vLLM's schedule; the guard
checks both locals by name (the vllm-capture-cost benchmark).
"""
from __future__ import annotations

import atexit
import hashlib
import json
import logging
import operator
import os
import secrets
import sys
import time
from collections import Counter
from datetime import datetime, timezone
from itertools import chain, repeat
from pathlib import Path

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import SchedulingPolicy
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

from kvtrace.vllm.capture import guard
from kvtrace.vllm.capture.sink import Sink, parse_age, parse_bytes

# vLLM's handlers are on its "vllm" logger: a child of it writes where vLLM's own lines go
logger = logging.getLogger("vllm.kvtrace.capture")

FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "aborted",
    RequestStatus.FINISHED_IGNORED: "rejected",
}
ADMITTING = (RequestStatus.WAITING, RequestStatus.PREEMPTED)
_num_computed_tokens = operator.attrgetter("num_computed_tokens")
MAX_PENDING = 16   # async: steps scheduled whose output is not processed yet (vLLM's batch queue holds 2)


class _ReqState:
    """What the capture keeps of one request between steps."""

    __slots__ = ["ever", "recomputed", "prefix_hits", "preemptions", "first_scheduled", "first_token",
                 "reprefill_target", "reprefill_cached", "reprefill_recomputed"]

    def __init__(self) -> None:
        self.ever = 0                 # most KV positions it ever had computed (kept up to date while watched)
        self.recomputed = 0
        self.prefix_hits = 0
        self.preemptions = 0
        self.first_scheduled: float | None = None
        self.first_token: float | None = None
        self.reprefill_target = 0     # while re-prefilling after a preemption: the positions to get back
        self.reprefill_cached = 0
        self.reprefill_recomputed = 0


class _Capture:
    """The recorder's state; one per scheduler."""

    def __init__(self, scheduler: Scheduler) -> None:
        folder = os.environ.get("KVTRACE_CAPTURE_DIR")
        if not folder:
            raise RuntimeError("kvtrace capture: set KVTRACE_CAPTURE_DIR to the capture folder "
                               "(kvtrace record --engine vllm does; see docs/vllm.md for vllm serve)")
        import vllm
        version = getattr(vllm, "__version__", "unknown")
        self.folder = Path(folder)
        self.folder.mkdir(parents=True, exist_ok=True)
        started = datetime.now(timezone.utc)
        # one folder can hold several servers (restarts, replicas): each writes under its own id
        self.server_id = f"{started:%Y%m%dT%H%M%S}Z-{os.getpid()}"
        # prefix structure without content: vLLM's block hashes (of token ids) hashed again with a key
        # that is never written, so they match within this capture and cannot be matched to any text
        self.salt = secrets.token_bytes(16)
        self.salt_id = secrets.token_hex(4)
        self.token_ids = os.environ.get("KVTRACE_CAPTURE_TOKEN_IDS") == "1"
        self.wall_minus_monotonic = time.time() - time.monotonic()
        try:
            if os.environ.get("KVTRACE_VLLM_ANY_VERSION") != "1":
                guard.check_version(version)
            guard.check_instance(scheduler)
            guard.check_kv_cache(scheduler)
            kvm = scheduler.kv_cache_manager
            pool = kvm.block_pool
            try:
                from vllm.v1.core.sched.output import SchedulerOutput
                from vllm.v1.engine import EngineCoreOutput
            except ImportError as exc:
                raise guard.VllmChanged(f"vLLM changed: {exc} (the capture reads SchedulerOutput and "
                                        f"EngineCoreOutput)") from exc
            guard.check_classes(type(scheduler), type(kvm), type(pool), type(pool.null_block), Request, RequestStatus,
                                SchedulerOutput, EngineCoreOutput)
        except guard.VllmChanged as exc:   # EngineCore's exception stays in its log: say it where kvtrace reads
            self._write_json("error.json", {"error": str(exc), "vllm_version": version})
            raise
        max_bytes = parse_bytes(os.environ.get("KVTRACE_CAPTURE_MAX_BYTES") or "4GiB", "KVTRACE_CAPTURE_MAX_BYTES")
        max_age_s = parse_age(os.environ.get("KVTRACE_CAPTURE_MAX_AGE") or "7d", "KVTRACE_CAPTURE_MAX_AGE")
        flush_s = parse_age(os.environ.get("KVTRACE_CAPTURE_FLUSH_EVERY") or "2s", "KVTRACE_CAPTURE_FLUSH_EVERY")
        self.sink = Sink(self.folder, self.server_id, max_bytes=max_bytes, max_age_s=max_age_s, log=logger,
                         wall_minus_monotonic=self.wall_minus_monotonic, flush_seconds=flush_s)
        self.scheduler = scheduler
        self.pool = pool
        self.kvm = kvm
        self.null_id = pool.null_block.block_id
        self.block_size = scheduler.block_size
        self.total_blocks = pool.num_gpu_blocks - 1        # block 0 is vLLM's null block
        self.states: dict[str, _ReqState] = {}
        # the requests whose steps need more than "a decode step": admitted and not yet past their
        # (re-)prefill; every other scheduled request decodes, which the step's totals account for
        self.watched: dict[str, _ReqState] = {}
        self.emitted: Counter[str] = Counter()             # tokens delivered per request so far (tokens.idx)
        self.step_start = 0.0
        # (kind, req, blocks, num_tokens, reason, cached, recomputed[, requester, victim_reason])
        self.events: list[tuple] = []
        self.seq = 0
        self.step = -1
        self.last_end: float | None = None   # when the last processed step's output was (its row's end_s)
        self.step_preemptions = 0
        self.admit_failed = False                          # a waiting request's allocate_slots failed this step
        # vLLM's victim: the least urgent (priority policy), else the newest, running[-1]
        self.victim_reason = "lowest-priority" if scheduler.policy == SchedulingPolicy.PRIORITY else "newest"
        self.max_seats = getattr(scheduler, "max_num_active_reqs", scheduler.max_num_running_reqs)
        self.max_step_tokens = getattr(scheduler, "max_num_scheduled_tokens",
                                       scheduler.scheduler_config.max_num_batched_tokens)
        # id(scheduler_output) -> (the step's row so far, its events, its frees, the output itself: held so
        # that its id is not reused while it waits; vLLM processes every output, an empty one too)
        self.pending: dict[int, tuple] = {}
        self.finishing: list[tuple[Request, _ReqState]] = []
        self.current: Request | None = None                # the request a block-pool call is for
        # the running loop's allocate_slots is not wrapped (it is called for every running request);
        # a block-pool call made inside it finds its request in that call's frame (`allocating`), and
        # a preemption its requester in the frame of vLLM's schedule (`requester`)
        self.allocate_slots_code = type(kvm).allocate_slots.__code__
        self.schedule_code = super(_CaptureMixin, scheduler).schedule.__func__.__code__
        self.admitting = False                             # the admission wrapper is on allocate_slots
        self.allocate_slots = kvm.allocate_slots           # what the admission wrapper calls
        self.allocate_slots_before = None                  # the instance's own allocate_slots before it, if any
        self.free_reason = "other"
        self.cached_free = 0                               # free blocks that still hold a prefix-cache hash
        self.self_check = os.environ.get("KVTRACE_CAPTURE_SELF_CHECK") == "1"
        self.held: dict[str, set[int]] = {}                # self-check: blocks per request, from the events
        self.check_errors: list[str] = []
        self.num_check_errors = 0
        self.num_checked_steps = 0
        self.closed = False
        self.hook_s = 0.0                                  # time in the step hooks (after_schedule, after_update)
        self.is_async = isinstance(scheduler, AsyncScheduler)
        self._wrap_pool()
        model = getattr(getattr(scheduler, "vllm_config", None), "model_config", None)
        identity = {
            "server_id": self.server_id, "started_at": started.isoformat(), "pid": os.getpid(),
            "vllm_version": version, "model": getattr(model, "served_model_name", None) or getattr(model, "model", None),
            "scheduler": type(scheduler).__name__, "async_scheduling": isinstance(scheduler, AsyncScheduler),
            "policy": "priority" if scheduler.policy == SchedulingPolicy.PRIORITY else "fcfs",
            "salt_id": self.salt_id, "token_ids": self.token_ids, "capture_module": __file__,
            "max_bytes": max_bytes, "max_age_s": max_age_s, "flush_s": flush_s,
            "started_monotonic": time.monotonic(), "wall_minus_monotonic": self.wall_minus_monotonic,
            "block_size": self.block_size, "num_gpu_blocks": pool.num_gpu_blocks, "null_block": self.null_id,
            "enable_prefix_caching": bool(getattr(pool, "enable_caching", False)),
            "max_num_seqs": scheduler.scheduler_config.max_num_seqs,
            "max_num_batched_tokens": scheduler.scheduler_config.max_num_batched_tokens,
            "max_model_len": getattr(scheduler, "max_model_len", None),
            "watermark_blocks": getattr(kvm, "watermark_blocks", None),
            "self_check": self.self_check,
        }
        if isinstance(identity["model"], list):
            identity["model"] = identity["model"][0]
        self._write_json(f"servers/{self.server_id}.json", identity)
        self._write_json("capture.json", identity)   # the newest server's, for kvtrace record --endpoint
        logger.info("kvtrace capture %s: %s (retention %d bytes, %d s; token ids %s)", self.server_id,
                    self.folder, max_bytes, max_age_s, "kept" if self.token_ids else "not kept")
        atexit.register(self.close)

    def _write_json(self, name: str, data: dict) -> None:
        path = self.folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.parent / f".{path.name}.tmp"
        tmp.write_text(json.dumps(data, indent=2) + "\n")
        os.replace(tmp, path)

    def salted(self, block_hashes) -> list[int]:
        """vLLM's block hashes as 63-bit integers keyed by this capture's salt."""
        salt = self.salt
        return [int.from_bytes(hashlib.blake2b(bytes(h), key=salt, digest_size=8).digest(), "big") >> 1
                for h in block_hashes]

    def arrived(self, request: Request) -> None:
        """A request the scheduler has just taken: its arrival row (the capture's own table), so that a
        window of live traffic knows every request in flight, finished or not."""
        a = self.sink.columns["arrivals"]
        arrival = request.arrival_time - self.wall_minus_monotonic if request.arrival_time else time.monotonic()
        for name, value in (("req_id", request.request_id), ("arrival_s", arrival),
                            ("prompt_tokens", request.num_prompt_tokens), ("max_tokens", request.max_tokens),
                            ("priority", request.priority),
                            ("block_hashes", self.salted(getattr(request, "block_hashes", ()) or ()))):
            a[name].append(value)

    def state(self, rid: str) -> _ReqState:
        st = self.states.get(rid)
        if st is None:
            st = self.states[rid] = _ReqState()
        return st

    # ---- the block pool and KV cache manager of this scheduler ----------------------------------------
    def _wrap_pool(self) -> None:
        pool, kvm, cap = self.pool, self.kvm, self
        get_new_blocks, free_blocks = pool.get_new_blocks, pool.free_blocks
        touch, maybe_evict = pool.touch, pool._maybe_evict_cached_block
        free = kvm.free

        def get_new_blocks_(num_blocks):
            blocks = get_new_blocks(num_blocks)
            if blocks:
                # why, from the request's state inside allocate_slots (which changes none of it): only a
                # step that allocates works it out, so a decode step's allocate_slots stays cheap
                request = cap.current or cap.allocating()
                if request is None:
                    rid, alloc_reason = "", "other"
                else:
                    rid = request.request_id
                    placeholders = request.num_output_placeholders   # async: sampled, not yet delivered
                    alloc_reason = ("prefill" if request.status in ADMITTING
                                    or request.num_computed_tokens < request.num_tokens + placeholders - 1
                                    or not request.num_output_tokens + placeholders else "decode")
                cap.events.append(("alloc", rid, [b.block_id for b in blocks], 0, alloc_reason, 0, 0))
            return blocks

        def free_blocks_(ordered_blocks):
            blocks = list(ordered_blocks)
            free_blocks(blocks)
            freed = [b for b in blocks if b.ref_cnt == 0 and not b.is_null]
            if freed:
                cap.cached_free += sum(1 for b in freed if b.block_hash is not None)
                request = cap.current or cap.allocating()
                cap.events.append(("free", request.request_id if request is not None else "",
                                   [b.block_id for b in freed], 0, cap.free_reason, 0, 0))

        def touch_(blocks):
            for b in blocks:
                if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None:
                    cap.cached_free -= 1
            return touch(blocks)

        def maybe_evict_(block):
            evicted = maybe_evict(block)
            if evicted:
                if block.ref_cnt == 0:
                    cap.cached_free -= 1
                cap.events.append(("evict", "", [block.block_id], 0, None, 0, 0))
            return evicted

        # on allocate_slots only from the waiting loop's first request to the end of the step (`peek_request_`):
        # the running loop calls allocate_slots for every running request, and needs no wrapper
        def allocate_slots_(request, num_new_tokens, num_new_computed_tokens=0, new_computed_blocks=None,
                            *args, **kwargs):
            status = request.status   # the scheduler changes it only after allocate_slots
            if status in ADMITTING:
                return admit_slots(request, status, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                   args, kwargs)
            return cap.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                      *args, **kwargs)

        def admit_slots(request, status, num_new_tokens, num_new_computed_tokens, new_computed_blocks, args, kwargs):
            cap.current = request
            mark = len(cap.events)
            try:
                result = cap.allocate_slots(request, num_new_tokens, num_new_computed_tokens, new_computed_blocks,
                                            *args, **kwargs)
            finally:
                cap.current = None
            if result is None:   # vLLM stops admitting
                cap.admit_failed = True
            else:
                cap.admitted(request, status, num_new_computed_tokens, new_computed_blocks, mark)
            return result

        def free_(request):
            cap.current = request
            try:
                return free(request)
            finally:
                cap.current = None

        def wrap_peek(queue):
            peek = queue.peek_request

            def peek_request_():
                if not cap.admitting:   # the waiting loop has begun: admissions are watched from here on
                    cap.admitting = True
                    # whatever allocate_slots is now (vLLM's, or another instance wrapper's) stays under ours
                    cap.allocate_slots_before = kvm.__dict__.get("allocate_slots")
                    cap.allocate_slots = kvm.allocate_slots
                    kvm.allocate_slots = allocate_slots_
                return peek()
            queue.peek_request = peek_request_

        pool.get_new_blocks = get_new_blocks_
        pool.free_blocks = free_blocks_
        pool.touch = touch_
        pool._maybe_evict_cached_block = maybe_evict_
        kvm.free = free_
        for name in ("waiting", "kv_holding_waiting"):
            if hasattr(self.scheduler, name):
                wrap_peek(getattr(self.scheduler, name))

    def end_admitting(self) -> None:
        """The step's scheduling is over: the running loop of the next calls vLLM's own allocate_slots."""
        if self.admitting:
            self.admitting = False
            if self.allocate_slots_before is None:
                del self.kvm.allocate_slots
            else:
                self.kvm.allocate_slots = self.allocate_slots_before

    def allocating(self) -> Request | None:
        """The request of the allocate_slots call that a block-pool call is made in (None outside one)."""
        frame = sys._getframe(2)   # the caller of the block-pool wrapper
        for _ in range(8):         # allocate_slots -> coordinator -> its manager -> the pool
            if frame is None:
                return None
            if frame.f_code is self.allocate_slots_code:
                return frame.f_locals.get("request")
            frame = frame.f_back
        return None

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

    def admitted(self, request: Request, status, num_hit: int, hit_blocks, mark: int) -> None:
        """A waiting or preempted request got its blocks: it is scheduled this step."""
        rid = request.request_id
        st = self.state(rid)
        resumed = status == RequestStatus.PREEMPTED
        reason = "resume-recompute" if resumed else "new"
        self.watched[rid] = st
        if st.first_scheduled is None:
            st.first_scheduled = self.step_start
        rows = [("admit", rid, None, request.num_tokens - num_hit, reason, 0, 0)]
        if num_hit:
            ids = [b for b in hit_blocks.get_block_ids()[0] if b != self.null_id] if hit_blocks is not None else []
            rows.append(("prefix_hit", rid, ids, num_hit, reason, 0, 0))
            st.prefix_hits += num_hit
        self.events[mark:mark] = rows     # before the blocks it was given, as kvtrace's engine orders them
        if resumed:
            st.reprefill_target = request.num_tokens
            st.reprefill_cached = num_hit
            st.reprefill_recomputed = 0

    # ---- the scheduler's own steps -------------------------------------------------------------------
    def after_schedule(self, out, start: float) -> None:
        end = time.monotonic()
        try:
            self._after_schedule(out, start, end)
        finally:
            self.hook_s += time.monotonic() - end

    def _after_schedule(self, out, start: float, end: float) -> None:
        sched = self.scheduler
        scheduled = out.num_scheduled_tokens
        num_scheduled = sum(scheduled.values())
        prefill = recompute = 0
        requests = sched.requests
        is_async = self.is_async
        watched = self.watched
        for new in out.scheduled_new_reqs:   # one admitted other than from WAITING / PREEMPTED (a KV connector's)
            if new.req_id not in watched:
                st = watched[new.req_id] = self.state(new.req_id)
                if st.first_scheduled is None:
                    st.first_scheduled = start
        # Only the watched requests are looked at one by one. Every other scheduled request decodes:
        # it has computed every position it ever had (`ever` is its begin, so nothing is recomputed)
        # and its tokens are the step's decode tokens, num_scheduled less the watched ones' prefill.
        done, reprefilled = [], []
        for rid, st in watched.items():
            n = scheduled.get(rid)
            if not n:
                continue
            req = requests[rid]
            stop = req.num_computed_tokens
            begin = stop - n
            # async: tokens sampled but not delivered count as known, less the one this step will sample
            extra = req.num_output_placeholders - (is_async and not req.is_prefill_chunk)
            # a prompt's last token is prefill
            decoding = begin >= req.num_tokens + extra - 1 and req.num_output_tokens + extra
            if not decoding:
                prefill += n
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
                    reprefilled.append(("reprefill", rid, None, st.reprefill_target, None, st.reprefill_cached,
                                        st.reprefill_recomputed))
                    st.reprefill_target = 0
            if decoding and not st.reprefill_target and stop >= st.ever:
                done.append(rid)   # from now on a decoding request like the others, until a preemption
        for rid in done:
            del watched[rid]
        if len(reprefilled) > 1:   # in the order the scheduler scheduled them
            order = {rid: i for i, rid in enumerate(scheduled)}
            reprefilled.sort(key=lambda event: order[event[1]])
        self.events += reprefilled
        free = self.pool.get_num_free_blocks()
        used = self.total_blocks - free
        bs = self.block_size
        # the unfilled tail of each running request's last block: bs - filled, 0 for a full one
        gaps = sum([-computed % bs for computed in map(_num_computed_tokens, sched.running)])
        row = (self.step, start, end, len(sched.running), len(sched.waiting), prefill, num_scheduled - prefill,
               recompute, self.step_preemptions, free, used, self.cached_free, used * bs - gaps,
               self.admission_stop(out, num_scheduled))
        # what this scheduling did belongs to its step, however late its output is processed (async)
        self.pending[id(out)] = (row, self.events, self.finishing, out)
        self.events, self.finishing = [], []
        if len(self.pending) > MAX_PENDING:   # outputs a caller never processes: written as they are
            self.write_unprocessed(self.pending.pop(next(iter(self.pending))))

    def admission_stop(self, out, num_scheduled: int) -> str:
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

    def preempting(self, request: Request, caller) -> None:
        rid = request.request_id
        st = self.state(rid)
        blocks = [b for b in self.kvm.get_block_ids(rid)[0] if b != self.null_id]
        # watched again from its resume: what it recomputes is counted against the most it had
        st.ever = max(st.ever, request.num_computed_tokens)
        if st.reprefill_target:   # cut short while re-prefilling: what it did redo, before the preemption
            self.events.append(("reprefill", rid, None, st.reprefill_target, "interrupted", st.reprefill_cached,
                                st.reprefill_recomputed))
            st.reprefill_target = 0
        # vLLM preempts inside the allocate_slots loop of the running request it could not serve
        # (that request itself when it is the newest); the victim is running[-1] or the least urgent
        self.events.append(("preempt", rid, blocks, request.num_computed_tokens, "recompute", 0, 0,
                            self.requester(caller), self.victim_reason))
        st.preemptions += 1
        self.step_preemptions += 1

    def after_update(self, out, outputs, start: float) -> None:
        t = time.monotonic()
        self._after_update(out, outputs, start)
        self.hook_s += time.monotonic() - t

    def _after_update(self, out, outputs, start: float) -> None:
        now = time.monotonic()
        key = id(out)
        if key in self.pending and next(iter(self.pending)) != key:
            # outputs are processed in the order they were scheduled (vLLM's batch queue): one scheduled
            # before this and still waiting never will be (a caller that skips empty steps); written now
            update = self.events, self.finishing
            self.events, self.finishing = [], []
            for older in list(self.pending):
                if older == key:
                    break
                self.write_unprocessed(self.pending.pop(older))
            self.events, self.finishing = update
        row, events, finishing, _ = self.pending.pop(key, (None, [], [], None))
        step = row[0] if row is not None else self.step
        self.events[:0] = events
        self.finishing[:0] = finishing
        for engine_outputs in outputs.values():
            if engine_outputs.outputs:
                self.write_tokens(engine_outputs.outputs, step, now)
        self.finish_pending(now, step)
        if row is not None:
            self.write_step(row, now, (start - row[2]) * 1e3)
        self.last_end = now
        self.flush_events(step, now)
        if self.self_check:
            self.check(step)
        if self.scheduler.has_unfinished_requests():
            self.sink.maybe_flush(now)
        else:   # idle until the next request: keep nothing back
            self.sink.flush()

    def write_tokens(self, outs: list, step: int, now: float) -> None:
        """The tokens rows of one step's outputs (vLLM's EngineCoreOutput, one per request)."""
        t = self.sink.columns["tokens"]
        emitted = self.emitted
        req_ids = [o.request_id for o in outs]
        new_token_ids = [o.new_token_ids for o in outs]
        m = len(req_ids)
        if list(map(len, new_token_ids)).count(1) == m:
            # a decode step, one token each: in bulk, no Python per request but the two lists above
            idx = list(map(emitted.get, req_ids, repeat(0)))
            emitted.update(req_ids)   # a Counter: one more each, counted in C
            if 0 in idx:
                for rid, i in zip(req_ids, idx):
                    if i == 0:
                        st = self.state(rid)
                        if st.first_token is None:
                            st.first_token = now
            t["req_id"].extend(req_ids)
            t["idx"].extend(idx)
            t["token_id"].extend(chain.from_iterable(new_token_ids) if self.token_ids else repeat(None, m))
        else:
            m = 0
            for rid, ids in zip(req_ids, new_token_ids):
                if not ids:
                    continue
                st = self.state(rid)
                if st.first_token is None:
                    st.first_token = now
                k = len(ids)
                first = emitted.get(rid, 0)
                emitted[rid] = first + k
                t["req_id"].extend([rid] * k)
                t["idx"].extend(range(first, first + k))
                t["token_id"].extend(ids if self.token_ids else [None] * k)
                m += k
        t["sample"].extend(repeat(0, m))
        t["step"].extend(repeat(step, m))
        t["ts_s"].extend(repeat(now, m))

    def write_step(self, row: tuple, end: float, device_ms: float | None) -> None:
        s = self.sink.columns["steps"]
        (step, begin, sched_end, running, waiting, prefill, decode, recompute, preemptions, free, used, cached,
         kv, admission_stop) = row
        for name, value in (("step", step), ("start_s", begin), ("end_s", end),
                            ("device_ms", device_ms), ("running", running),
                            ("waiting", waiting), ("swapped", 0), ("prefill_tokens", prefill),
                            ("decode_tokens", decode), ("recompute_tokens", recompute),
                            ("preemptions", preemptions), ("free_blocks", free), ("used_blocks", used),
                            ("cached_blocks", cached), ("total_blocks", self.total_blocks), ("kv_tokens", kv),
                            ("admission_stop", admission_stop)):
            s[name].append(value)

    def finish_pending(self, now: float, step: int) -> None:
        """Requests freed since the last step: their finish event and request row."""
        if not self.finishing:
            return
        q = self.sink.columns["requests"]
        offset = self.wall_minus_monotonic
        for request, st in self.finishing:
            rid = request.request_id
            reason = FINISH_REASONS.get(request.status, str(request.status).lower())
            self.events.append(("finish", rid, None, request.num_output_tokens, reason, 0, 0))
            arrival = request.arrival_time - offset if request.arrival_time else None
            for name, value in (("req_id", rid), ("sample", 0), ("n", 1), ("priority", request.priority),
                                ("arrival_s", arrival), ("prompt_tokens", request.num_prompt_tokens),
                                ("max_tokens", request.max_tokens), ("output_tokens", request.num_output_tokens),
                                ("first_scheduled_s", st.first_scheduled), ("first_token_s", st.first_token),
                                ("finish_s", now), ("finish_reason", reason), ("preemptions", st.preemptions),
                                ("swaps", 0), ("recomputed_tokens", st.recomputed),
                                ("prefix_hit_tokens", st.prefix_hits)):
                q[name].append(value)
            self.states.pop(rid, None)
            self.watched.pop(rid, None)
            self.emitted.pop(rid, None)
        self.finishing = []

    def flush_events(self, step: int, now: float) -> None:
        events = self.events
        if not events:
            return
        k = self.sink.columns["kv_events"]
        m = len(events)
        # the events' fields as columns (a preemption's two more, its cause, are taken apart below)
        kinds, req_ids, blocks, num_tokens, reasons, cached, recomputed = list(zip(*events))[:7]
        k["seq"].extend(range(self.seq, self.seq + m))
        self.seq += m
        k["step"].extend(repeat(step, m))
        k["ts_s"].extend(repeat(now, m))
        k["kind"].extend(kinds)
        k["req_id"].extend(req_ids)
        k["sample"].extend(repeat(0, m))
        k["blocks"].extend(blocks)
        k["num_blocks"].extend([len(b) if b else 0 for b in blocks])
        k["num_tokens"].extend(num_tokens)
        k["bytes"].extend(repeat(0, m))
        k["duration_ms"].extend(repeat(None, m))
        k["reason"].extend(reasons)
        k["num_cached_tokens"].extend(cached)
        k["num_recomputed_tokens"].extend(recomputed)
        k["src_blocks"].extend(repeat(None, m))
        if "preempt" in kinds:
            causes = [e[7:] or (None, None) for e in events]
            requesters = [requester for requester, _ in causes]
            k["requester_req_id"].extend(requesters)
            k["requester_sample"].extend([0 if r else None for r in requesters])
            k["victim_reason"].extend([victim_reason for _, victim_reason in causes])
        else:
            k["requester_req_id"].extend(repeat(None, m))
            k["requester_sample"].extend(repeat(None, m))
            k["victim_reason"].extend(repeat(None, m))
        if self.self_check:
            self._replay(self.events)
        self.events = []

    # ---- self-check: the pool state the events describe against the pool's own -------------------------
    def _replay(self, events: list[tuple], held: dict[str, set[int]] | None = None) -> None:
        held = self.held if held is None else held
        for kind, rid, blocks, *_ in events:
            if kind in ("alloc", "prefix_hit") and rid:
                held.setdefault(rid, set()).update(blocks)
            elif kind in ("preempt", "finish"):
                held.pop(rid, None)

    def check(self, step: int) -> None:
        self.num_checked_steps += 1
        problems = []
        in_use: set[int] = set()
        held = self.held
        if self.pending:   # async: the next step is scheduled before this one's output; its events wait
            held = {rid: set(blocks) for rid, blocks in held.items()}
            for _, events, _, _ in self.pending.values():
                self._replay(events, held)
        for rid, blocks in held.items():
            own = {b for b in self.kvm.get_block_ids(rid)[0] if b != self.null_id}
            if own != blocks:
                problems.append(f"step {step}: {rid} holds {sorted(own)} but the events say {sorted(blocks)}")
            in_use |= blocks
        pool_used = self.total_blocks - self.pool.get_num_free_blocks()
        if len(in_use) != pool_used:
            problems.append(f"step {step}: {pool_used} blocks in use but the events account for {len(in_use)}")
        cached = sum(1 for b in self.pool.blocks if b.ref_cnt == 0 and not b.is_null and b.block_hash is not None)
        if cached != self.cached_free:
            problems.append(f"step {step}: {cached} cached free blocks but the capture counted {self.cached_free}")
        if problems:
            self.num_check_errors += len(problems)
            self.check_errors.extend(problems[: max(0, 20 - len(self.check_errors))])

    def file_between_steps(self) -> None:
        """What happened since the last schedule() (an abort's frees and finish, a prefix-cache reset's
        evictions) while a scheduled step still waits for its output (async): it joins that step's
        events, whose output is processed next, so that they reach the trace and the self-check at the
        same update as vLLM's pool does; filed with the step about to be scheduled, they would wait a
        step longer than the pool."""
        _, events, finishing, _ = next(iter(self.pending.values()))   # the oldest: processed next
        events += self.events
        finishing += self.finishing
        self.events, self.finishing = [], []

    def write_unprocessed(self, entry: tuple) -> None:
        """A step whose output was never processed: its row and what its scheduling did, without tokens."""
        row, events, finishing, _ = entry
        self.events[:0] = events
        self.finishing[:0] = finishing
        self.finish_pending(row[2], row[0])
        self.write_step(row, row[2], None)
        self.flush_events(row[0], row[2])

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # async: the last step's output is never processed (the engine stops once every request has
        # finished); its row and what its scheduling did are written as they are, without tokens
        for entry in self.pending.values():
            self.write_unprocessed(entry)
        self.pending.clear()
        # what happened after the last step (a shutdown's aborts) is filed with it, at its end, as an
        # unprocessed step's is above; before any step, when it happened
        end = self.last_end if self.last_end is not None else time.monotonic()
        self.finish_pending(end, self.step)
        self.flush_events(self.step, end)
        self.sink.close()
        if not self.folder.is_dir():
            return   # the folder was removed: not made again for a summary of nothing
        try:
            self._write_json("done.json", {
                "server_id": self.server_id,
                "steps": self.step + 1, "events": self.seq, "hook_s": self.hook_s,
                "self_check_steps": self.num_checked_steps,
                "self_check_errors": self.num_check_errors, "self_check_examples": self.check_errors,
                "writer_error": repr(self.sink.error) if self.sink.error else None,
            })
        except OSError:
            pass   # the disk that stopped the capture; the log already says so


class _CaptureMixin:
    """Wraps the scheduler's steps; every decision stays vLLM's own. A capture that cannot start
    (its folder cannot be made or written) says so in one line of vLLM's log and the scheduler runs
    as vLLM's own, unrecorded (`_kvtrace` is None)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        try:
            self._kvtrace: _Capture | None = _Capture(self)
        except OSError as exc:
            logger.warning("kvtrace capture not started (vLLM serves on): %s", exc)
            self._kvtrace = None

    def add_request(self, request, *args, **kwargs):
        new = request.request_id not in self.requests   # a streaming session's next chunk is not a new request
        super().add_request(request, *args, **kwargs)
        if new and self._kvtrace is not None:
            self._kvtrace.arrived(request)

    def schedule(self, *args, **kwargs):
        cap = self._kvtrace
        if cap is None:
            return super().schedule(*args, **kwargs)
        if cap.pending:   # async, or outputs not processed: what happened since joins the oldest
            cap.file_between_steps()
        start = cap.step_start = time.monotonic()
        cap.step += 1
        cap.step_preemptions = 0
        cap.admit_failed = False
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            cap.end_admitting()
        cap.after_schedule(out, start)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        start = time.monotonic()
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if self._kvtrace is not None:
            self._kvtrace.after_update(scheduler_output, outputs, start)
        return outputs

    def _preempt_request(self, request, *args, **kwargs):
        cap = self._kvtrace
        if cap is None:
            return super()._preempt_request(request, *args, **kwargs)
        cap.preempting(request, sys._getframe(1))
        cap.free_reason = "preempt"
        try:
            return super()._preempt_request(request, *args, **kwargs)
        finally:
            cap.free_reason = "other"

    def _free_request(self, request, *args, **kwargs):
        cap = self._kvtrace
        if cap is None:
            return super()._free_request(request, *args, **kwargs)
        cap.finishing.append((request, cap.state(request.request_id)))
        cap.free_reason = "finish"
        try:
            return super()._free_request(request, *args, **kwargs)
        finally:
            cap.free_reason = "other"

    def reset_prefix_cache(self, *args, **kwargs):
        done = super().reset_prefix_cache(*args, **kwargs)
        if done and self._kvtrace is not None:
            self._kvtrace.cached_free = 0
        return done

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            if self._kvtrace is not None:
                self._kvtrace.close()


class KvtraceScheduler(_CaptureMixin, Scheduler):
    """vLLM's Scheduler, recorded."""


class KvtraceAsyncScheduler(_CaptureMixin, AsyncScheduler):
    """vLLM's AsyncScheduler (async scheduling), recorded."""


class KvtraceCaptureScheduler:
    """The one class to name for every server: an instance is the kvtrace subclass of the scheduler
    vLLM's configuration chose, so an async server stays async.

    vLLM resolves `scheduler_cls` and calls it once, in EngineCore, as `cls(vllm_config=..., ...)`,
    after its platform hook has had the last word on `scheduler_config.async_scheduling`; without a
    `scheduler_cls` it would have used AsyncScheduler when that is on, Scheduler otherwise
    (SchedulerConfig.get_scheduler_cls, the same in 0.32 and 0.33). `__new__` makes that same choice
    and returns the instance it builds (not an instance of this class, so Python does not call
    `__init__` again)."""

    def __new__(cls, *args, **kwargs):
        return chosen_scheduler(kwargs["vllm_config"] if "vllm_config" in kwargs else args[0])(*args, **kwargs)


def chosen_scheduler(vllm_config) -> type:
    """KvtraceAsyncScheduler where vLLM would have used its AsyncScheduler, else KvtraceScheduler."""
    return KvtraceAsyncScheduler if vllm_config.scheduler_config.async_scheduling else KvtraceScheduler
