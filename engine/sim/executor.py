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

import math

from engine.executor import StepResult
from engine.scheduler import SchedulerOutput
from engine.sequence import Sequence
from engine.sim.cost_model import CostModel

GREEDY_TOKEN = -1


class SimExecutor:
    """The Executor of `--engine sim`: virtual time, predicted step durations, placeholder tokens."""

    is_cuda = False
    emits_token_ids = False   # placeholders: the trace records them as null

    def __init__(self, cost_model: CostModel, bytes_per_block: int,
                 layer_windows: tuple[int | None, ...] = ()) -> None:
        """`layer_windows`: each layer's sliding window (None: full attention), a windowed layer reading
        no more than its window of keys per query; empty: every layer reads the whole context."""
        self.cost_model = cost_model
        self.bytes_per_block = bytes_per_block
        self.now_s = 0.0        # virtual time, seconds
        windows = [w for w in layer_windows if w is not None]
        # (window, share of the layers): a step's KV reads and attention pairs are the layers' mean
        self.window_shares = [(None, 1 - len(windows) / len(layer_windows))] + [
            (w, windows.count(w) / len(layer_windows)) for w in sorted(set(windows))] if windows else []

    def clock(self) -> float:
        return self.now_s

    def idle_until(self, t: float) -> None:
        """Idle until `t` (nothing to run before the next arrival): virtual time jumps there."""
        if t > self.now_s:
            self.now_s = t

    def synchronize(self) -> None:
        """Nothing runs: every timing is known when the step returns."""

    def execute(self, out: SchedulerOutput, lazy: tuple[int, int] | None = None) -> StepResult:
        """Predict the step's time and say who samples. `lazy` = (n, positions): the first n of out.seqs
        are the fast path's lazy decodes (fast_path.py), holding `positions` KV positions in all, which
        their Sequences do not count yet; they decode one token each and are left out of
        `sample_seqs` (the fast path gives them their tokens)."""
        result = StepResult()
        timing = result.timing
        cost = self.cost_model
        total_ms = 0.0
        if out.swap_out:
            timing.swap_out = cost.swap_ms(len(out.swap_out) * self.bytes_per_block)
            total_ms += timing.swap_out
        if out.swap_in:
            timing.swap_in = cost.swap_ms(len(out.swap_in) * self.bytes_per_block)
            total_ms += timing.swap_in
        if out.copies:
            total_ms += cost.copy_ms(len(out.copies) * self.bytes_per_block)
        for copy in out.tier_copies:   # over the host link beside the steps: the engine times them (no clock here)
            copy.event.duration_ms = cost.swap_ms(len(copy.device_blocks) * self.bytes_per_block)
        if out.seqs:
            # the model runner's batch order: decodes first, then prefill chunks (sampling order follows it)
            num_lazy, num_kv = lazy or (0, 0)
            num_kv += num_lazy   # each lazy decode's new position
            decodes: list[Sequence] = []
            prefill_samples: list[Sequence] = []
            num_prefill = 0
            num_pairs = 0.0
            rest = zip(out.seqs[num_lazy:], out.num_new_tokens[num_lazy:]) if num_lazy else \
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
                if end >= num_tokens:   # (past them: an admitted decode padded with drafts)
                    prefill_samples.append(seq)
            if self.window_shares:
                num_kv, num_pairs = self._windowed_reads(out)
            result.sample_seqs = decodes + prefill_samples
            result.num_prefill_tokens = num_prefill
            result.num_decode_tokens = num_lazy + len(decodes)
            if out.num_drafts:   # speculative decoding: a decode's drafts are verified in its forward
                decoding = {id(seq) for seq in decodes}
                result.num_decode_tokens += sum(n for seq, n in zip(out.seqs, out.num_drafts) if id(seq) in decoding)
            timing.forward = cost.forward_ms(num_prefill, result.num_decode_tokens, num_kv, num_pairs)
            total_ms += timing.forward
        self.now_s += total_ms / 1000
        return result

    def _windowed_reads(self, out: SchedulerOutput) -> tuple[float, float]:
        """The step's KV positions read and attention pairs, each layer's mean, a windowed layer's query
        at position p reading min(p + 1, window) keys (`execute`'s num_kv and num_pairs for windows)."""
        num_kv = num_pairs = 0.0
        for seq, num_new in zip(out.seqs, out.num_new_tokens):
            start = seq.num_computed_tokens
            end = start + num_new
            decode = len(seq.token_ids) - start <= 1 and len(seq.token_ids) != seq.num_prompt_tokens
            for window, share in self.window_shares:
                w = end if window is None or window > end else window
                num_kv += share * w
                if not decode:   # keys read by queries start+1..end (1-based), each min(q, w)
                    below = max(0, min(end, w) - start)   # queries reading all their keys
                    num_pairs += share * (below * (2 * start + below + 1) / 2 + (num_new - below) * w)
        return num_kv, num_pairs

    def decode_clock(self, num_decodes: int, held: int, max_steps: int, until_s: float, origin: float,
                     copies_done_s: list[float] = ()) -> tuple[list[float], list[float], list[float], list[int | None]]:
        """The clock of a leap (leap.py): up to `max_steps` steps that each
        decode one token for each of `num_decodes` sequences and copy no block, step j with
        `held + (j + 1) * num_decodes` KV positions, the leap ending before the first step after its
        first that would start at or after `until_s` (times less `origin`). Returns the steps' starts,
        ends (less `origin`) and forward milliseconds, the clock moved past them, as `execute` step by
        step would: the same prediction, the same floats; and for each of `copies_done_s` (a host KV
        tier's copies in flight, the clock times they finish at) the step whose end reaches it (the
        step that files it), None if none of the leap's does."""
        step_ms = self.cost_model.decode_ms(num_decodes)
        now = self.now_s
        start = now - origin
        starts: list[float] = []
        ends: list[float] = []
        forward: list[float] = []
        finishing: list[int | None] = [None] * len(copies_done_s)
        next_done = min(copies_done_s, default=math.inf)
        for j in range(max_steps):
            if j and not start < until_s:
                break
            forward_ms = step_ms(held + (j + 1) * num_decodes)
            now += forward_ms / 1000
            if now >= next_done:   # (a copy finishes where its time is at most the step's end: _finish_copies)
                for i, done_s in enumerate(copies_done_s):
                    if finishing[i] is None and done_s <= now:
                        finishing[i] = j
                next_done = min([done_s for i, done_s in enumerate(copies_done_s) if finishing[i] is None],
                                default=math.inf)
            starts.append(start)
            forward.append(forward_ms)
            start = now - origin
            ends.append(start)
        self.now_s = now
        return starts, ends, forward, finishing

    def sample(self, result: StepResult, seqs: list[Sequence], rows: list[int]) -> list[int]:
        """Placeholder tokens for the sequences that sample this step (no logits: `rows` unused)."""
        return [GREEDY_TOKEN if seq.params.temperature == 0.0 else -2 - hash((seq.params.seed, seq.sample)) % (1 << 30)
                for seq in seqs]   # temperature 0: SamplingParams.greedy
