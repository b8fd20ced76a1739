"""Speculative decoding's acceptance model: how many of a sequence's draft tokens a step accepts.

kvtrace's engine drafts only in the simulator (EngineConfig.speculative_method), where no model
proposes or verifies a token: what matters to the KV cache is how many drafts are scheduled, how many
lookahead slots are reserved for them (engine/scheduler.py) and how many positions the rejected ones
roll back. A draft is accepted with chance `rate` if every draft before it was (the first rejection
ends the run of accepted ones, as a verifier's does); `kvtrace calibrate` fits the rate from a capture
of a server that drafts (kvtrace/calibrate.py, `fit_acceptance_rate`).
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


def mean_accepted(rate: float, num_drafts: int) -> float:
    """The expected accepted drafts of `num_drafts` at acceptance rate `rate` (GeometricAcceptance)."""
    return sum(rate ** j for j in range(1, num_drafts + 1))
