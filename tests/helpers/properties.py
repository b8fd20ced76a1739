"""Property tests' example counts, scaled by the Hypothesis profile tests/conftest.py loads."""
from __future__ import annotations

from hypothesis import settings


def examples(n: int) -> int:
    """A property test's example count: `n`, scaled by the loaded profile (x10 under `thorough`)."""
    return n * max(settings.default.max_examples // 100, 1)
