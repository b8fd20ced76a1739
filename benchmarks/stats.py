"""Medians, spreads and percentiles, and the A, B, A, B order every comparison is measured in."""
from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def percentile(values: list[float], p: float) -> float:
    """The p-th percentile (0..100), linear between the closest ranks; nan for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def ratios(numerators: list[float], denominators: list[float]) -> list[float]:
    """Pairwise ratios of runs measured next to each other (rep i of A over rep i of B)."""
    return [a / b for a, b in zip(numerators, denominators)]


def fmt_ratio(values: list[float]) -> str:
    """'1.23× (1.10–1.31, n=5)': the median and the range of the pairwise ratios."""
    if not values:
        return "n/a"
    return f"{median(values):.2f}× ({min(values):.2f}–{max(values):.2f}, n={len(values)})"


def interleave(runs: dict[str, Callable[[], T]], repeats: int) -> dict[str, list[T]]:
    """Call each run once per repetition, in the same order every time: A, B, A, B, ..."""
    results: dict[str, list[T]] = {name: [] for name in runs}
    for rep in range(repeats):
        for name, run in runs.items():
            print(f"  [{rep + 1}/{repeats}] {name} ...", flush=True)
            results[name].append(run())
    return results
