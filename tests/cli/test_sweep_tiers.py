"""kvtrace sweep of the host KV tier's size (--set offload_size=...): the operator's answer, the smallest
size past the knee and what it saves against no tier (kvtrace/sweep/view.py's tier_sizing)."""
from __future__ import annotations

import json

from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers every command)
from kvtrace.cli.app import app
from kvtrace.sweep.view import tier_sizing
from tests.cli.test_sweep import SIM, WORKLOAD


def point(size: str, recomputed: int, ttft: float, itl: float, **settings: str) -> dict:
    return {"settings": {"offload_size": size, **settings}, "recomputed_tokens": recomputed, "ttft_p99_ms": ttft,
            "itl_p99_ms": itl}


def test_the_smallest_size_past_the_knee_and_what_it_saves():
    points = [point("0", 1000, 900.0, 60.0), point("8GiB", 400, 700.0, 50.0), point("2GiB", 700, 800.0, 55.0),
              point("32GiB", 120, 650.0, 45.0), point("128GiB", 100, 640.0, 44.0)]
    # the largest cuts 900; 32GiB is the first with 90% of that (880)
    assert tier_sizing(points) == (
        "A host KV tier of 32GiB is the smallest past the knee: against 0 it cuts recomputed positions from 1,000 "
        "to 120 (−88%), TTFT p99 900 ms → 650 ms, ITL p99 60.0 ms → 45.0 ms; the largest, 128GiB, saves 20 more.")


def test_no_saving_is_said_plainly_and_other_sweeps_say_nothing():
    flat = [point("0", 50, 100.0, 10.0), point("4GiB", 50, 100.0, 10.0)]
    assert tier_sizing(flat).startswith("No host tier size swept (0..4GiB) recomputes fewer positions than 0 (50)")
    other = [{"settings": {"max_num_seqs": n}, "recomputed_tokens": 1, "ttft_p99_ms": 1.0, "itl_p99_ms": 1.0}
             for n in ("8", "16")]
    assert tier_sizing(other) is None


def test_a_sweep_of_tier_sizes_on_the_simulator_answers(tmp_path):
    out = tmp_path / "tiers"
    # no prefix cache keeps no block: without a tier the preempted requests recompute their prompts
    result = CliRunner().invoke(app, ["sweep", "-w", str(WORKLOAD), *SIM, "--set", "offload_size=0,64KiB,16MiB",
                                      "-o", str(out), "--jobs", "1"])
    assert result.exit_code == 0, result.output
    shown = CliRunner().invoke(app, ["sweep", "show", str(out), "--json"])
    data = json.loads(shown.output)
    by_size = {p["settings"]["offload_size"]: p["recomputed_tokens"] for p in data["points"]}
    assert by_size["16MiB"] < by_size["0"], by_size
    assert data["tier_sizing"].startswith("A host KV tier of "), data["tier_sizing"]
