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
from the captured events with the pool's own (settings.py, self_check.py), `KVTRACE_CAPTURE_STRICT=1`
refuses to start vLLM where the capture cannot start, instead of stepping aside (aside.py).

What is wrapped here: the scheduler's own `add_request`, `schedule`, `update_from_output`,
`_preempt_request`, `_free_request`, `reset_prefix_cache` and `shutdown`, each calling vLLM's and
then the recorder (recorder.py); wraps.py puts the rest on this scheduler's KV cache manager, block
pool and waiting queues. vLLM is not patched globally, and nothing changes a decision. Request ids
are vLLM's (with the random suffix its frontend adds), mapped back to the workload's by the importer.
"""
from __future__ import annotations

import sys
import time

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.scheduler import Scheduler

from kvtrace.vllm.capture.recorder import Recorder, start_capture


class _CaptureMixin:
    """Wraps the scheduler's steps; every decision stays vLLM's own. A capture that cannot start steps
    aside (aside.py: one line in vLLM's log, error.json) and the scheduler runs as vLLM's own, unrecorded
    (`_kvtrace` is None); KVTRACE_CAPTURE_STRICT=1 raises instead. Each hook calls vLLM's method as it
    is, and the recorder's in a `try` (free until it raises): an error of the capture's own stops the
    capture (`Recorder.fail`, which sets `_kvtrace` to None), never vLLM's step."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # vLLM's own schedule: a preemption's requester is read from its frame (wraps.py)
        self._kvtrace: Recorder | None = start_capture(self, super().schedule, __file__)

    def add_request(self, request, *args, **kwargs):
        new = request.request_id not in self.requests   # a streaming session's next chunk is not a new request
        super().add_request(request, *args, **kwargs)
        cap = self._kvtrace
        if new and cap is not None:
            try:
                cap.arrived(request)
            except Exception as exc:  # noqa: BLE001 (the capture's own error: it stops, vLLM serves on)
                cap.fail(exc)

    def schedule(self, *args, **kwargs):
        cap = self._kvtrace
        if cap is None:
            return super().schedule(*args, **kwargs)
        try:
            start = cap.before_schedule()
        except Exception as exc:  # noqa: BLE001 (as above)
            cap.fail(exc)
            return super().schedule(*args, **kwargs)
        try:
            out = super().schedule(*args, **kwargs)
        finally:
            cap.wraps.end_admitting()
        if self._kvtrace is cap:   # not stopped by a wrapper while vLLM scheduled
            try:
                cap.after_schedule(out, start)
            except Exception as exc:  # noqa: BLE001 (as above)
                cap.fail(exc)
        return out

    def update_from_output(self, scheduler_output, model_runner_output):
        start = time.monotonic()
        cap = self._kvtrace
        accepted = None
        if cap is not None:
            try:
                accepted = cap.before_update(scheduler_output, model_runner_output)
            except Exception as exc:  # noqa: BLE001 (as above)
                cap.fail(exc)
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        cap = self._kvtrace
        if cap is not None:
            try:
                cap.after_update(scheduler_output, accepted, outputs, start)
            except Exception as exc:  # noqa: BLE001 (as above)
                cap.fail(exc)
        return outputs

    def _preempt_request(self, request, *args, **kwargs):
        cap = self._kvtrace
        if cap is None:
            return super()._preempt_request(request, *args, **kwargs)
        try:
            cap.preempting(request, sys._getframe(1))
        except Exception as exc:  # noqa: BLE001 (as above)
            cap.fail(exc)
            return super()._preempt_request(request, *args, **kwargs)
        wraps = cap.wraps
        wraps.free_reason = "preempt"
        try:
            return super()._preempt_request(request, *args, **kwargs)
        finally:
            wraps.free_reason = "other"

    def _free_request(self, request, *args, **kwargs):
        cap = self._kvtrace
        if cap is None:
            return super()._free_request(request, *args, **kwargs)
        try:
            cap.steps.freeing(request)
        except Exception as exc:  # noqa: BLE001 (as above)
            cap.fail(exc)
            return super()._free_request(request, *args, **kwargs)
        wraps = cap.wraps
        wraps.free_reason = "finish"
        try:
            return super()._free_request(request, *args, **kwargs)
        finally:
            wraps.free_reason = "other"

    def reset_prefix_cache(self, *args, **kwargs):
        done = super().reset_prefix_cache(*args, **kwargs)
        if done and self._kvtrace is not None:
            self._kvtrace.wraps.cached_free = 0   # no free block holds a hash any more
        return done

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            cap = self._kvtrace
            if cap is not None:
                try:
                    cap.close()
                except Exception as exc:  # noqa: BLE001 (as above)
                    cap.fail(exc)


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
    (SchedulerConfig.get_scheduler_cls, the same in 0.31 to 0.34). `__new__` makes that same choice
    and returns the instance it builds (not an instance of this class, so Python does not call
    `__init__` again)."""

    def __new__(cls, *args, **kwargs):
        return chosen_scheduler(kwargs["vllm_config"] if "vllm_config" in kwargs else args[0])(*args, **kwargs)


def chosen_scheduler(vllm_config) -> type:
    """KvtraceAsyncScheduler where vLLM would have used its AsyncScheduler, else KvtraceScheduler."""
    return KvtraceAsyncScheduler if vllm_config.scheduler_config.async_scheduling else KvtraceScheduler
