"""The steps scheduled whose output is not processed yet.

With async scheduling vLLM schedules the next step before it processes this one's output (its batch
queue holds 2), so a step's row and what its scheduling did wait here, by their SchedulerOutput,
until `update_from_output` gets that output. vLLM processes every output it schedules, an empty one
too, in the order scheduled; one scheduled before and still waiting never will be (a caller that
skips empty steps), and none waits at all past MAX_PENDING (a caller that stops processing outputs):
such steps are written as they are, without tokens.
"""
from __future__ import annotations

from kvtrace.vllm.capture.rows import ScheduledStep

MAX_PENDING = 16   # async: steps scheduled whose output is not processed yet (vLLM's batch queue holds 2)


class PendingSteps:
    """Scheduled steps waiting for their output, oldest first."""

    def __init__(self) -> None:
        self._steps: dict[int, ScheduledStep] = {}   # id(its SchedulerOutput) -> the step

    def __len__(self) -> int:
        return len(self._steps)

    def __iter__(self):
        return iter(self._steps.values())

    def add(self, step: ScheduledStep) -> ScheduledStep | None:
        """Wait for `step`'s output; the oldest step, taken out, where more than MAX_PENDING wait."""
        self._steps[id(step.output)] = step
        if len(self._steps) > MAX_PENDING:   # outputs a caller never processes: written as they are
            return self._steps.pop(next(iter(self._steps)))
        return None

    def take(self, output) -> tuple[list[ScheduledStep], ScheduledStep | None]:
        """The step whose output `output` is (None for one that never waited), and the steps scheduled
        before it that still wait: their outputs never will be processed. All are taken out."""
        key = id(output)
        if key not in self._steps:
            return [], None
        older = []
        for other in list(self._steps):
            if other == key:
                break
            older.append(self._steps.pop(other))
        return older, self._steps.pop(key)

    def oldest(self) -> ScheduledStep:
        """The step whose output is processed next."""
        return next(iter(self._steps.values()))

    def take_all(self) -> list[ScheduledStep]:
        steps = list(self._steps.values())
        self._steps.clear()
        return steps
