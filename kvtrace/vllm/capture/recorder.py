"""The recorder: one per scheduler, the capture's parts put together, and what each of the scheduler's
hooks (scheduler.py) does with them.

`start_capture` makes it: it reads the options, checks that vLLM still has every name the capture uses and
that this model's KV cache is one it can follow (guard.py), puts the wraps on (wraps.py) and writes
the server's identity (settings.py); where any of that fails the capture steps aside, or refuses in
strict mode (aside.py says why, in vLLM's log and error.json). Each step: `before_schedule` numbers it; `after_schedule` takes its row from the
accounting (accounting.py) and keeps it waiting for its output (pending.py); `after_update` hands
that step's tokens, finished requests, row and KV events to the sink, whose builder thread writes them
into its columns (columns.py), self-checks where asked (self_check.py), and lets the sink write a chunk
when one is due (sink.py).
The time spent in those two hooks is `hook_s` (done.json; the vllm-capture-cost benchmark).
An error of the capture's own in a hook reaches `fail` (scheduler.py and wraps.py catch it): the capture
stops and vLLM serves on.
"""
from __future__ import annotations

import atexit
import os
import time

from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import Request, RequestStatus

import kvtrace
from kvtrace.vllm.capture import aside, guard
from kvtrace.vllm.capture.accounting import StepAccounting
from kvtrace.vllm.capture.aside import logger
from kvtrace.vllm.capture.columns import Columns
from kvtrace.vllm.capture.files import make_folder, write_json
from kvtrace.vllm.capture.pending import PendingSteps
from kvtrace.vllm.capture.rows import KIND, REASON, REQ_ID, AcceptedDrafts, ScheduledStep
from kvtrace.vllm.capture.self_check import SelfCheck
from kvtrace.vllm.capture.settings import (
    Server,
    Settings,
    capture_folder,
    write_identity,
)
from kvtrace.vllm.capture.sink import Sink
from kvtrace.vllm.capture.wraps import PoolWraps


def start_capture(scheduler: Scheduler, vllm_schedule, capture_module: str) -> Recorder | None:
    """The scheduler's recorder, or None where the capture cannot start: it steps aside and vLLM serves
    unrecorded, or, with KVTRACE_CAPTURE_STRICT=1, this raises and vLLM does not start (aside.py: the
    log line and error.json either way). The arguments are Recorder's."""
    import vllm
    version = getattr(vllm, "__version__", "unknown")
    server = Server.starting()
    settings, kind = None, "settings"
    try:
        settings = Settings.from_environment(capture_folder())
        guard.accepted_versions()   # KVTRACE_VLLM_VERSIONS, parsed with the other options
        kind = None                 # from here, the exception's kind says (aside.py)
        return Recorder(scheduler, vllm_schedule, capture_module, settings, server, version)
    except Exception as exc:  # noqa: BLE001 (nothing of the capture's start may stop vLLM's, unless strict)
        aside.not_started(exc, kind, settings, server, scheduler, version)
        if aside.strict():
            raise
        return None


class Recorder:
    """The capture of one scheduler. Made by `start_capture`; any exception from here means it did not start.
    `fail` stops it at runtime: it takes its wraps off and sets the scheduler's `_kvtrace` to None."""

    def __init__(self, scheduler: Scheduler, vllm_schedule, capture_module: str, settings: Settings,
                 server: Server, version: str) -> None:
        """`vllm_schedule`: vLLM's own schedule method (wraps.py reads its frame); `capture_module`: the
        file of the scheduler class vLLM was told to load (capture.json names it)."""
        folder = settings.folder
        self.settings, self.server, self.version = settings, server, version
        make_folder(folder, settings.file_mode)
        self._check_vllm(scheduler, version)
        self.folder = folder
        self.sink = Sink(folder, self.server.server_id, max_bytes=settings.max_bytes, max_age_s=settings.max_age_s,
                         log=logger, wall_minus_monotonic=self.server.wall_minus_monotonic,
                         flush_seconds=settings.flush_s, file_mode=settings.file_mode,
                         meta={"kvtrace_version": kvtrace.__version__}, on_stop=self._writer_stopped,
                         build=Columns.build)
        self.scheduler = scheduler
        self.steps = StepAccounting(scheduler)
        self.steps.resolve_at_once = settings.self_check   # it reads every step's events on this thread
        self.columns = Columns(self.sink, token_ids=settings.token_ids, salt=self.server.salt,
                               wall_minus_monotonic=self.server.wall_minus_monotonic,
                               total_blocks=self.steps.total_blocks,
                               tiered=getattr(scheduler, "connector", None) is not None)
        self.rows: list[tuple] = []          # what this step hands the sink's builder (Columns.build)
        self.pending = PendingSteps()
        self.attribution = None              # the joined step's running loop's, for its kv_events rows (_resolve_later)
        self.self_check = SelfCheck(scheduler.kv_cache_manager, self.steps.null_id, self.steps.total_blocks)
        self.last_end: float | None = None   # when the last processed step's output was (its row's end_s)
        self.closed = False
        self.failed = False                  # stopped by an error of its own (fail)
        self.hook_s = 0.0                    # time in the step hooks (after_schedule, after_update)
        self.wraps = PoolWraps(scheduler, vllm_schedule, self.steps, self.fail)
        try:
            write_identity(settings, self.server, scheduler, version, capture_module)
        except BaseException:
            self.wraps.remove()
            raise
        logger.info("kvtrace capture %s: %s (retention %d bytes, %d s; token ids %s)", self.server.server_id,
                    folder, settings.max_bytes, settings.max_age_s, "kept" if settings.token_ids else "not kept")
        atexit.register(self.close)

    @staticmethod
    def _check_vllm(scheduler: Scheduler, version: str) -> None:
        """guard.py's checks of this vLLM and this model (guard.VllmChanged names what failed)."""
        if os.environ.get("KVTRACE_VLLM_ANY_VERSION") != "1":
            guard.check_version(version)
        guard.check_instance(scheduler)
        guard.check_kv_cache(scheduler)
        guard.check_connector(scheduler)
        kvm = scheduler.kv_cache_manager
        pool = kvm.block_pool
        try:
            from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
            from vllm.v1.engine import EngineCoreOutput
            from vllm.v1.outputs import ModelRunnerOutput
        except ImportError as exc:
            raise guard.VllmChanged(f"vLLM changed: {exc} (the capture reads SchedulerOutput, CachedRequestData, "
                                    f"EngineCoreOutput and ModelRunnerOutput)") from exc
        guard.check_classes(type(scheduler), type(kvm), type(pool), type(pool.null_block), Request, RequestStatus,
                            SchedulerOutput, EngineCoreOutput, ModelRunnerOutput, CachedRequestData)

    def fail(self, exc: BaseException) -> None:
        """An error of the capture's own, at runtime: the capture stops and vLLM serves on. The wraps come
        off and the scheduler runs as vLLM's own from here (`_kvtrace` None); the chunks already handed to
        the writer are written, the rows buffered since are not (the error may have left half a row);
        one line in vLLM's log and error.json say why (aside.py)."""
        if self.failed:
            return
        self.failed = self.closed = True   # closed: nothing more is written at shutdown
        self.scheduler._kvtrace = None      # first: from here vLLM decides alone, whatever follows
        self.wraps.remove()
        self.rows = []
        self.sink.abandon()
        aside.stopped(exc, self.settings, self.server, self.scheduler, self.version)

    def _writer_stopped(self, exc: BaseException) -> None:
        """The sink could not write a chunk (its writer thread calls this once): the capture records no
        more, error.json says so (reason `disk`) for `capture ls` and the exporter's kvtrace_capture_up."""
        aside.writer_stopped(exc, self.settings, self.server, self.scheduler, self.version)

    # ---- the scheduler's hooks ------------------------------------------------------------------------------
    def arrived(self, request: Request) -> None:
        self.rows.append(self.columns.arrival_row(request))

    def before_schedule(self) -> float:
        """A step begins: its number; its start, returned."""
        if self.sink.build_error is not None:   # the builder thread's: the capture stops here (fail)
            raise self.sink.build_error
        if self.pending:   # async, or outputs not processed: what happened since joins the oldest
            self.file_between_steps()
        start = time.monotonic()
        self.steps.begin_step(start)
        self.wraps.begin_step()
        return start

    def after_schedule(self, out, start: float) -> None:
        end = time.monotonic()
        try:
            row = self.steps.scheduled(out, start, end, self.wraps.cached_free)
            # what this scheduling did belongs to its step, however late its output is processed (async)
            dropped = self.pending.add(self.steps.take_step(row, out))
            if dropped is not None:
                self._write_unprocessed(dropped)
            self._hand_rows()   # the engine runs the model now: the builder thread's time (sink.py)
        finally:
            self.hook_s += time.monotonic() - end

    def preempting(self, request: Request, caller) -> None:
        """vLLM's `_preempt_request` is called from `caller` (a frame)."""
        self.steps.preempting(request, self.wraps.requester(caller))

    def before_update(self, out, model_output) -> AcceptedDrafts | None:
        """Speculative decoding: what the output says of each request's drafts (StepAccounting.accepted),
        taken before vLLM's update_from_output, which cuts a stopped request's tokens short in place (None
        without drafts)."""
        spec = out.scheduled_spec_decode_tokens
        return self.steps.accepted(spec, model_output) if spec else None

    def after_update(self, out, accepted_drafts: AcceptedDrafts | None, outputs, start: float) -> None:
        """vLLM's update_from_output(out, ...) returned `outputs`; it began at `start`; `accepted_drafts`:
        before_update's."""
        t = time.monotonic()
        self._after_update(out, accepted_drafts, outputs, start)
        self.hook_s += time.monotonic() - t

    def _after_update(self, out, accepted_drafts: AcceptedDrafts | None, outputs, start: float) -> None:
        now = time.monotonic()
        # outputs are processed in the order they were scheduled (vLLM's batch queue): one scheduled
        # before this and still waiting never will be (a caller that skips empty steps); written now
        older, scheduled = self.pending.take(out)
        for unprocessed in older:
            self._write_unprocessed(unprocessed)
        # async: the steps scheduled since ran before this output
        filed_later = self._finish_after_later_steps() if self.pending and self.steps.finishing else ()
        if scheduled is not None:
            self.steps.join(scheduled)
            self._resolve_later()
            step = scheduled.row.step
        else:
            step = self.steps.step
        for engine_outputs in outputs.values():
            if engine_outputs.outputs:
                self.rows.append((self.columns.tokens, engine_outputs.outputs, step, now))
        accepted = 0
        if scheduled is not None and scheduled.row.draft_tokens:   # a speculative step: before its finished rows
            self.rows.append((self.columns.spec_decode, tuple(out.scheduled_spec_decode_tokens), scheduled.num_drafts,
                              accepted_drafts, step, now, self.steps.lookahead))
            accepted = accepted_drafts if accepted_drafts is not None else 0   # (counted by the spec_decode rows)
        self._write_finished(now)
        for rid in filed_later:   # followed no more: a later step's output for it is stale
            self.steps.forget(rid)
        if scheduled is not None:
            self.rows.append((self.columns.step, scheduled.row, now, (start - scheduled.row.schedule_end_s) * 1e3,
                              accepted, self.steps.events))
        self.last_end = now
        self._write_events(step, now)
        if self.settings.self_check:
            had = self.self_check.num_check_errors
            self.self_check.check(step, self.pending, self.wraps.cached_free)
            if not had and self.self_check.num_check_errors:   # the first: in the log (done.json has them all)
                logger.warning("kvtrace capture self-check: %s", self.self_check.check_errors[0])
        # the step's rows go to the builder after the next scheduling (_hand_rows), unless a chunk is due
        # now, or the engine idles until the next request: then they are in it
        if self.sink.flush_due(now) or not self.scheduler.has_unfinished_requests():
            self._hand_rows()
            self.sink.flush()

    def _finish_after_later_steps(self) -> dict[str, ScheduledStep]:
        """Async: the steps scheduled since this one ran before its output, and may have given blocks
        to a request this output has just finished (speculative decoding schedules a request whose last
        tokens are in flight: its drafts might not all be accepted). The pool saw that scheduling first,
        then this output's frees: such a request's frees, finish event and row go with the latest such
        step, after its events. Filed with this step, its later blocks would come after its finish, or,
        moved ahead of it, before that step's preemption that freed them. (A request that a later step
        only preempted, its last token in flight, keeps its finish here, ahead of the preemption, as
        kvtrace's engine files it: its blocks are freed at its preempt event, so none is held twice.)
        Returns those requests, each with its step."""
        steps = self.steps
        finished = {request.request_id for request, _ in steps.finishing}
        for scheduled in self.pending:   # their allocs' requests are read here
            scheduled.resolve()
        # (events by index: the wraps' are plain tuples, rows.py)
        later = {e[REQ_ID]: scheduled for scheduled in self.pending for e in scheduled.events
                 if e[REQ_ID] in finished and "preempt" not in (e[KIND], e[REASON])}   # a preemption's: its frees too
        if not later:
            return later
        for e in steps.events:   # this output's: the frees of the requests it finished
            if e[REQ_ID] in later:
                later[e[REQ_ID]].events.append(e)
        steps.events = [e for e in steps.events if e[REQ_ID] not in later]
        for request, st in steps.finishing:
            if request.request_id in later:
                later[request.request_id].finishing.append((request, st))
        steps.finishing = [(request, st) for request, st in steps.finishing if request.request_id not in later]
        return later

    def file_between_steps(self) -> None:
        """What happened since the last schedule() (an abort's frees and finish, a prefix-cache reset's
        evictions) while a scheduled step still waits for its output (async): it joins that step's
        events, whose output is processed next, so that they reach the trace and the self-check at the
        same update as vLLM's pool does; filed with the step about to be scheduled, they would wait a
        step longer than the pool."""
        self.steps.file_with(self.pending.oldest())

    # ---- to the sink's builder -------------------------------------------------------------------------------
    def _resolve_later(self) -> None:
        """The allocs of the step just joined get their requests on the builder thread, as its kv_events rows
        are built (accounting.py's Attribution: `_write_events` hands it over with the events)."""
        self.attribution, self.steps.attribution = self.steps.attribution, None

    def _hand_rows(self) -> None:
        """What the steps since the last hand-over wrote, to the sink's builder thread. Handed over once a
        step is scheduled, when the engine goes on to run the model (sync) or to wait for the step
        before's output (async), without the GIL while a GPU computes: the builder's time. Handed over
        when the previous output is processed, it would compete for the GIL with the next scheduling."""
        if self.rows:
            self.sink.add(self.rows)
            self.rows = []

    def _write_finished(self, now: float) -> None:
        """Requests freed since the last step: their finish event and request row."""
        steps = self.steps
        if not steps.finishing:
            return
        for request, st in steps.finishing:
            self.rows.append(self.columns.request_row(request, st, steps.finished(request), now))
        steps.finishing = []

    def _write_events(self, step: int, now: float) -> None:
        # handed over (the builder reads the list later, as its step's row does): a new list from here
        events, self.steps.events = self.steps.events, []
        attribution, self.attribution = self.attribution, None   # (never one without events: its placeholders)
        if not events:
            return
        self.rows.append((self.columns.kv_events, events, step, now, attribution))
        if self.settings.self_check:
            self.self_check.replay(events)

    def _write_unprocessed(self, scheduled: ScheduledStep) -> None:
        """A step whose output was never processed: its row and what its scheduling did, without tokens,
        at its scheduling's end. What has happened since is not its own, and waits."""
        steps = self.steps
        since = steps.events, steps.finishing
        steps.events, steps.finishing = [], []
        steps.join(scheduled)
        self._resolve_later()
        end = scheduled.row.schedule_end_s
        self._write_finished(end)
        if scheduled.row.draft_tokens:   # drafts never checked: none accepted, none known to be rejected
            self.rows.append((self.columns.spec_decode, tuple(scheduled.output.scheduled_spec_decode_tokens),
                              scheduled.num_drafts, None, scheduled.row.step, end, self.steps.lookahead))
        self.rows.append((self.columns.step, scheduled.row, end, None, None if scheduled.row.draft_tokens else 0,
                          steps.events))
        self._write_events(scheduled.row.step, end)
        steps.events, steps.finishing = since

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        # async: the last step's output is never processed (the engine stops once every request has
        # finished); its row and what its scheduling did are written as they are, without tokens, and
        # what happened after the last step (a shutdown's aborts) is filed with it, at its end
        if self.pending:
            self.file_between_steps()
        for scheduled in self.pending.take_all():
            self._write_unprocessed(scheduled)
        # without a step waiting: filed with the last step, at its end; before any step, when it happened
        end = self.last_end if self.last_end is not None else time.monotonic()
        self._write_finished(end)
        self._write_events(self.steps.step, end)
        self._hand_rows()
        self.sink.close()
        if self.sink.build_error is not None:   # the builder's, since the last step: stopped, no summary
            self.fail(self.sink.build_error)
            return
        if not self.folder.is_dir():
            return   # the folder was removed: not made again for a summary of nothing
        check = self.self_check
        try:   # the folder's newest (kvtrace record reads it) and the server's own (capture ls)
            done = {
                "server_id": self.server.server_id,
                "steps": self.steps.step + 1, "events": self.columns.seq, "hook_s": self.hook_s,
                "self_check_steps": check.num_checked_steps,
                "self_check_errors": check.num_check_errors, "self_check_examples": check.check_errors,
                "writer_error": repr(self.sink.error) if self.sink.error else None,
                "chunks_written": self.sink.num_written, "dropped_chunks": self.sink.num_dropped,
                "dropped_rows": self.sink.dropped_rows,
            }
            write_json(self.folder, "done.json", done, self.settings.file_mode)
            if (self.folder / "servers" / f"{self.server.server_id}.json").is_file():   # not in a remade folder
                write_json(self.folder, f"servers/{self.server.server_id}.done.json", done, self.settings.file_mode)
        except OSError:
            pass   # the disk that stopped the capture; the log already says so
