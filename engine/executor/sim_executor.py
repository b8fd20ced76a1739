"""The simulated executor: runs nothing, predicts each step's duration, and keeps virtual time.

It stands where the ModelRunner stands (both are engine/executor's Executor): the engine hands it
the scheduler's output and gets a StepResult back (the sequences that receive a token, the step's
composition, its timings), so every KV decision around it is the real scheduler's and block
manager's. No weights, no KV tensors.

Tokens are placeholders: the engine records them as null. A placeholder still enters the prefix
cache's block hashes, so it is chosen to keep the real engine's equalities: greedy decoding continues
equal contexts equally (-1 for every greedy token), a sampled sequence's tokens depend on its seed and
sample index (a negative id from both). Which id the real model would emit is unknowable here, so a
request stops at its `output_tokens` or `max_tokens`, never at EOS.
"""
from __future__ import annotations

from operator import attrgetter

from engine.cohort import DecodeCohort
from engine.executor import StepResult
from engine.executor.cost_model import CostModel
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence

GREEDY_TOKEN = -1
_computed = attrgetter("num_computed_tokens")


class SimExecutor:
    """The Executor of `--engine sim`: virtual time, predicted step durations, placeholder tokens."""

    is_cuda = False
    emits_token_ids = False   # placeholders: the trace records them as null

    def __init__(self, cost: CostModel, bytes_per_block: int) -> None:
        self.cost = cost
        self.bytes_per_block = bytes_per_block
        self.now_s = 0.0        # virtual time, seconds
        self.cohort: DecodeCohort | None = None   # the scheduler's, if it has one

    def clock(self) -> float:
        return self.now_s

    def idle_until(self, t: float) -> None:
        """Idle until `t` (nothing to run before the next arrival): virtual time jumps there."""
        if t > self.now_s:
            self.now_s = t

    def execute(self, out: SchedulerOutput) -> StepResult:
        result = StepResult()
        timing = result.timing
        cost = self.cost
        total_ms = 0.0
        if out.swap_out:
            timing.swap_out = cost.swap_ms(len(out.swap_out) * self.bytes_per_block)
            total_ms += timing.swap_out
        if out.swap_in:
            timing.swap_in = cost.swap_ms(len(out.swap_in) * self.bytes_per_block)
            total_ms += timing.swap_in
        if out.copies:
            total_ms += cost.copy_ms(len(out.copies) * self.bytes_per_block)
        if out.seqs:
            # the model runner's batch order: decodes first, then prefill chunks (sampling order follows
            # it); the running pass's decodes (out.num_decodes) lead, their positions summed in C
            num_decodes = out.num_decodes
            decodes: list[Sequence] = out.seqs[:num_decodes]
            prefill_samples: list[Sequence] = []
            num_prefill = 0
            if out.cohort:   # the decodes are the cohort's members, whose positions it keeps summed (engine/cohort.py)
                num_kv = self.cohort.positions(decodes) + num_decodes
            else:
                num_kv = sum(map(_computed, decodes)) + num_decodes
            num_pairs = 0.0
            rest = zip(out.seqs[num_decodes:], out.num_new_tokens[num_decodes:]) if num_decodes else \
                zip(out.seqs, out.num_new_tokens)
            for seq, num_new in rest:
                start = seq.num_computed_tokens
                end = start + num_new
                num_kv += end
                num_tokens = len(seq.token_ids)
                if num_tokens - start <= 1 and num_tokens != seq.num_prompt_tokens:   # not seq.is_prefilling
                    decodes.append(seq)
                    continue
                num_prefill += num_new
                num_pairs += num_new * (start + (num_new + 1) / 2)
                if end == num_tokens:
                    prefill_samples.append(seq)
            result.sample_seqs = decodes + prefill_samples
            result.num_prefill_tokens = num_prefill
            result.num_decode_tokens = len(decodes)
            timing.forward = cost.forward_ms(num_prefill, len(decodes), num_kv, num_pairs)
            total_ms += timing.forward
        self.now_s += total_ms / 1000
        return result

    def decode_clock(self, num_decodes: int, held: int, max_steps: int, until_s: float,
                     origin: float) -> tuple[list[float], list[float], list[float]]:
        """The clock of a decode window (LLMEngine.decode_window): up to `max_steps` steps that each
        decode one token for each of `num_decodes` sequences and copy no block, step j with
        `held + (j + 1) * num_decodes` KV positions, the window ending before the first step after its
        first that would start at or after `until_s` (times less `origin`). Returns the steps' starts,
        ends (less `origin`) and forward milliseconds, the clock moved past them, as `execute` step by
        step would: the same prediction, the same floats."""
        step_ms = self.cost.decode_ms(num_decodes)
        now = self.now_s
        start = now - origin
        starts: list[float] = []
        ends: list[float] = []
        forward: list[float] = []
        for j in range(max_steps):
            if j and not start < until_s:
                break
            forward_ms = step_ms(held + (j + 1) * num_decodes)
            now += forward_ms / 1000
            starts.append(start)
            forward.append(forward_ms)
            start = now - origin
            ends.append(start)
        self.now_s = now
        return starts, ends, forward

    def sample(self, result: StepResult, seqs: list[Sequence], rows: list[int]) -> list[int]:
        """Placeholder tokens for the sequences that sample this step (no logits: `rows` unused)."""
        return [GREEDY_TOKEN if seq.params.temperature == 0.0 else -2 - hash((seq.params.seed, seq.sample)) % (1 << 30)
                for seq in seqs]   # temperature 0: SamplingParams.greedy
