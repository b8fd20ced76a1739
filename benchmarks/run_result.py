"""One engine's run of a workload, and the serving figures every suite reports from it.

The figures are computed here, the same way for every engine, from per-token arrival times taken
where each engine's step loop hands tokens over: kvtrace's `step()` return and vLLM's `step()` return.
"""
from __future__ import annotations

from dataclasses import dataclass

from benchmarks.stats import median, percentile


@dataclass
class RunResult:
    duration_s: float                      # first request added -> last token delivered (and trace closed)
    tokens: dict[str, list[int]]           # request id -> generated token ids
    token_times_s: dict[str, list[float]]  # request id -> seconds since start at which each token arrived
    num_preemptions: int | None = None
    prefix_cache_hit_tokens: int | None = None  # prompt positions served from the prefix cache

    @classmethod
    def from_json(cls, data: dict) -> RunResult:
        return cls(data["duration_s"], data["tokens"], data.get("token_times_s", {}), data.get("num_preemptions"),
                   data.get("prefix_cache_hit_tokens"))

    @property
    def num_output_tokens(self) -> int:
        return sum(len(t) for t in self.tokens.values())

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.duration_s

    @property
    def ttft_s(self) -> list[float]:
        """Time to first token of each request; all arrive at t=0 (backlog)."""
        return [times[0] for times in self.token_times_s.values() if times]

    @property
    def itl_s(self) -> list[float]:
        """Gaps between consecutive tokens of the same request."""
        return [b - a for times in self.token_times_s.values() for a, b in zip(times, times[1:])]


def first_divergence(a: list[int], b: list[int]) -> int:
    """Index of the first output token that differs (the shorter length when one is a prefix)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def agreement(a: RunResult, b: RunResult) -> str:
    """'15/16 sequences identical (94 %); the others first differ at output token 41'."""
    ids = list(a.tokens)
    same = sum(a.tokens[i] == b.tokens[i] for i in ids)
    diverged = sorted(first_divergence(a.tokens[i], b.tokens[i]) for i in ids if a.tokens[i] != b.tokens[i])
    text = f"{same}/{len(ids)} sequences identical ({100 * same / len(ids):.0f} %)"
    if diverged:
        text += f"; the others first differ at output token {', '.join(map(str, diverged))}"
    return text


def same_tokens_fraction(a: RunResult, b: RunResult) -> float:
    """Fraction of requests whose generated ids are identical in both runs."""
    ids = list(a.tokens)
    return sum(a.tokens[i] == b.tokens.get(i) for i in ids) / len(ids)


def _each(values: list[int | None]) -> str:
    """'5/5/4', one per run; 'n/a' where the engine does not report it."""
    return "n/a" if all(v is None for v in values) else "/".join(str(v) for v in values)


def serving_row(name: str, runs: list[RunResult]) -> list[str]:
    """Medians over repetitions: tok/s, TTFT p50/p90, ITL p50/p90/p99 (ms), preemptions, duration."""
    def med(f) -> float:
        return median([f(r) for r in runs])

    return [name, f"{med(lambda r: r.output_tokens_per_s):.1f}",
            f"{1000 * med(lambda r: percentile(r.ttft_s, 50)):.0f}",
            f"{1000 * med(lambda r: percentile(r.ttft_s, 90)):.0f}",
            f"{1000 * med(lambda r: percentile(r.itl_s, 50)):.1f}",
            f"{1000 * med(lambda r: percentile(r.itl_s, 90)):.1f}",
            f"{1000 * med(lambda r: percentile(r.itl_s, 99)):.1f}",
            _each([r.num_preemptions for r in runs]), _each([r.prefix_cache_hit_tokens for r in runs]),
            f"{med(lambda r: r.num_output_tokens):.0f}", f"{med(lambda r: r.duration_s):.2f}"]


SERVING_HEADER = ["engine", "output tok/s", "TTFT p50 ms", "TTFT p90 ms", "ITL p50 ms", "ITL p90 ms",
                  "ITL p99 ms", "preemptions (each run)", "prefix-cache hit tokens (each run)", "output tokens", "duration s"]
