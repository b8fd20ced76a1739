"""A sweep of a capture of a server that drafts (speculative decoding) simulates drafting as it did: its
method and draft tokens from the capture's meta.json, the acceptance rate fitted on its own verifications
(analyses/spec_decode.sql, kvtrace/calibrate.py), its scheduler (kvtrace/sweep/from_run.py)."""
from __future__ import annotations

import random

import pytest

from kvtrace.calibrate import fit_acceptance_rate
from kvtrace.cli.sweep import _record_command
from kvtrace.sweep.from_run import run_options
from kvtrace.sweep.grid import record_knobs
from tests.helpers.tracegen import write_run, write_table

KNOBS = record_knobs(_record_command())


def option(args: list[str], flag: str) -> str:
    return args[args.index(flag) + 1]


def drafting_capture(tmp_path, rate: float, method: str | None = "eagle", lookahead: int = 3, asynchronous=False):
    """A capture's run whose server drafted 3 tokens a step, each accepted with chance `rate` given the ones
    before it were (600 verifications drawn from that model)."""
    rng = random.Random(5)
    rows = []
    for i in range(600):
        accepted = 0
        while accepted < 3 and rng.random() < rate:
            accepted += 1
        rows.append({"step": i, "ts_s": 0.01 * i, "req_id": "a", "sample": 0, "draft_tokens": 3,
                     "accepted_tokens": accepted, "lookahead_slots": lookahead})
    rows.append({**rows[-1], "step": 600, "accepted_tokens": None})   # an output never processed: not counted
    run = write_run(tmp_path, "capture", meta={
        "vllm": {"version": "0.32.0"}, "model": {"source": "smollm2-135m"},
        "engine_config": {"engine": "vllm", "model": "smollm2-135m", "block_size": 16, "max_num_seqs": 8,
                          "async_scheduling": asynchronous, "num_speculative_tokens": 3,
                          "num_lookahead_tokens": lookahead, "speculative_method": method},
        "kv_pool": {"num_gpu_blocks": 200}},
        steps=[{"step": i, "start_s": 0.01 * i, "end_s": 0.01 * (i + 1), "prefill_tokens": 0, "decode_tokens": 4,
                "recompute_tokens": 0, "preemptions": 0, "used_blocks": 4, "total_blocks": 200, "draft_tokens": 3,
                "accepted_tokens": 1} for i in range(3)])
    write_table(run, "spec_decode", rows)
    return run


@pytest.mark.parametrize("rate", [0.3, 0.75])
def test_the_acceptance_rate_is_fitted_from_the_verifications(tmp_path, rate):
    fitted, verifications = fit_acceptance_rate([drafting_capture(tmp_path, rate)])
    assert verifications == 600 and abs(fitted - rate) < 0.04, fitted


def test_a_sweep_of_a_drafting_capture_drafts_as_it_did(tmp_path):
    run = drafting_capture(tmp_path, 0.6, asynchronous=True)
    args, notes = run_options(run, [], {"num_gpu_blocks": ["100", "200"]}, KNOBS)
    assert option(args, "--speculative-method") == "eagle" and option(args, "--num-speculative-tokens") == "3"
    assert abs(float(option(args, "--spec-acceptance-rate")) - 0.6) < 0.04
    assert "--async-scheduling" in args
    assert any("fitted on the run's 600 verifications" in n for n in notes)
    # a rate given on the command line wins
    args, _ = run_options(run, ["--spec-acceptance-rate", "0.9"], {}, KNOBS)
    assert "--spec-acceptance-rate" not in args


@pytest.mark.parametrize("lookahead, near", [(3, "eagle"), (0, "ngram")])
def test_an_unnamed_method_is_simulated_by_its_lookahead(tmp_path, lookahead, near):
    run = drafting_capture(tmp_path, 0.5, method=None, lookahead=lookahead)
    args, notes = run_options(run, [], {}, KNOBS)
    assert option(args, "--speculative-method") == near
    assert any(f"simulated as {near}" in n for n in notes)
