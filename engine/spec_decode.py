"""Speculative decoding's drafts: who proposes them, and how many of a sequence's drafts a step accepts.

In the simulator (EngineConfig.speculative_method) no model proposes or verifies a token: what matters
to the KV cache is how many drafts are scheduled, how many lookahead slots are reserved for them
(engine/scheduler.py) and how many positions the rejected ones roll back. A draft is accepted with
chance `rate` if every draft before it was (the first rejection ends the run of accepted ones, as a
verifier's does); `kvtrace calibrate` fits the rate from a capture of a server that drafts
(kvtrace/calibrate.py, `fit_acceptance_rate`).

The real engine drafts by n-gram (prompt lookup, vLLM's `ngram` method: `propose_ngram`) and verifies
greedily: the model computes the sampled token's position and the drafts' in one forward, and a draft is
accepted while it equals the model's own greedy token there, so the output is the one without drafting.
"""
from __future__ import annotations

import random
from typing import Protocol

from engine.sequence import Sequence


class Acceptance(Protocol):
    def __call__(self, seq: Sequence, step: int, num_drafts: int) -> int:
        """Of `num_drafts` drafts verified for `seq` in step `step`, how many are accepted (0 to num_drafts)."""


class GeometricAcceptance:
    """Each draft accepted with chance `rate` given the ones before it were: a step accepts j of k
    drafts with chance rate^j (1 - rate), all k with rate^k. Seeded: a run is reproducible."""

    def __init__(self, rate: float, seed: int = 0) -> None:
        self.rate = rate
        self._random = random.Random(seed)

    def __call__(self, seq: Sequence, step: int, num_drafts: int) -> int:
        draw = self._random.random
        accepted = 0
        while accepted < num_drafts and draw() < self.rate:
            accepted += 1
        return accepted


NGRAM_MAX, NGRAM_MIN = 4, 1   # the longest and shortest suffix looked up (vLLM's prompt_lookup_max / _min)


def propose_ngram(token_ids: list[int], k: int, max_n: int = NGRAM_MAX, min_n: int = NGRAM_MIN) -> list[int]:
    """Up to k drafts: the tokens that followed the latest earlier occurrence of the sequence's last n
    tokens, the longest n from max_n down to min_n that occurs (none: no drafts)."""
    num_tokens = len(token_ids)
    for n in range(min(max_n, num_tokens - 1), min_n - 1, -1):
        suffix = token_ids[num_tokens - n:]
        for start in range(num_tokens - n - 1, -1, -1):
            if token_ids[start:start + n] == suffix:
                return token_ids[start + n:start + n + k]
    return []


def mean_accepted(rate: float, num_drafts: int) -> float:
    """The expected accepted drafts of `num_drafts` at acceptance rate `rate` (GeometricAcceptance)."""
    return sum(rate ** j for j in range(1, num_drafts + 1))
