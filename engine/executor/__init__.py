"""How a scheduled step runs: the protocol the engine loop calls, and what a step returns.

Two executors satisfy it, and engine/build.py picks one: `ModelRunner` (model_runner.py) runs the
model on real KV tensors; `SimExecutor` (engine/sim/executor.py) runs nothing and predicts each step's
duration from a cost model, in virtual time. The loop never asks which one it holds.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    import torch

    from engine.scheduler import SchedulerOutput
    from engine.sequence import Sequence


@dataclass
class StepTiming:
    """Device timings of one step, resolved when `ready()`."""

    forward: tuple | float | None = None                 # (start, end) CUDA events, or ms
    swap_out: tuple | float | None = None
    swap_in: tuple | float | None = None
    tier: list[tuple] = field(default_factory=list)      # the host KV tier's copies' events on CUDA

    def ready(self) -> bool:
        for t in (self.forward, self.swap_out, self.swap_in, *self.tier):   # a loop: asked once per step
            if isinstance(t, tuple) and not t[1].query():
                return False
        return True

    @staticmethod
    def ms(t: tuple | float | None) -> float | None:
        if isinstance(t, tuple):
            return t[0].elapsed_time(t[1])
        return t


@dataclass
class StepResult:
    """What an executor returns for one step."""

    sample_seqs: list[Sequence] = field(default_factory=list)  # sequences whose last token got logits
    # [len(sample_seqs) + drafts verified, vocab]; None when simulated
    logits: torch.Tensor | None = None
    # speculative decoding (the real engine): (sequence, the logits row of its first draft, its drafts)
    verify: list = field(default_factory=list)
    timing: StepTiming = field(default_factory=StepTiming)
    num_prefill_tokens: int = 0
    num_decode_tokens: int = 0


class Executor(Protocol):
    """What the engine loop calls each step, and the few facts about the device it needs."""

    # the step's timings are CUDA events: the end of a run synchronises the device before reading them
    is_cuda: bool
    # False: sampled ids are placeholders (simulated), recorded as null in the trace
    emits_token_ids: bool

    def clock(self) -> float:
        """Seconds, on the clock the engine's times are measured with (host time, or virtual)."""
        ...

    def idle_until(self, t: float) -> None:
        """Nothing is scheduled before clock time `t`: wait a little for it (real) or jump there (virtual)."""
        ...

    def execute(self, out: SchedulerOutput) -> StepResult:
        """Run one scheduled step: its KV block copies first (swap out, swap in, copy-on-write), then
        the forward of its batch; return which sequences sample and the step's timings."""
        ...

    def synchronize(self) -> None:
        """Wait until every step's timings have resolved (the end of a run)."""
        ...

    def sample(self, result: StepResult, seqs: list[Sequence], rows: list[int]) -> list[int]:
        """One token id for each of `seqs`, sampled from row `rows[i]` of the step's logits (a forked
        sample shares its parent's row)."""
        ...
