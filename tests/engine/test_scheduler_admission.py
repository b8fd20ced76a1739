"""The scheduler's admission of waiting sequences and its choice of victims (engine/scheduler.py, from
the waiting pass on): samples against max_num_seqs, a prompt rejected at admission, the token budget
without chunked prefill, and which sequence each preemption policy takes."""
from __future__ import annotations

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import ListTracer, run_checked


def ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(max_tokens: int, n: int) -> SamplingParams:
    """n samples, drawn (so that copy-on-write samples go their own way)."""
    return ignore_eos(max_tokens, n=n, temperature=1.0, seed=1)


def admits(tracer) -> list[tuple[int, str, int]]:
    return [(e.step, e.req_id, e.sample) for e in tracer.events if e.kind == "admit"]


def step_events(tracer, step: int) -> list[tuple]:
    return [(e.kind, e.req_id, e.sample, e.blocks, e.reason) for e in tracer.records[step].events]


def preempts(tracer) -> list[tuple[int, str, int, str]]:
    return [(e.step, e.req_id, e.sample, e.reason) for e in tracer.events if e.kind == "preempt"]


# ---------------------------------------------------------------- admission: max_num_seqs and pending forks

def test_a_request_that_will_fork_waits_until_all_its_samples_fit_max_num_seqs(make_engine):
    # max_num_seqs 3, --n-mode cow: A and B (n=2 each) arrive together. A is admitted and will fork
    # its second sample (2 sequences); B would make 4 once it forks, so it waits until A's samples
    # finish (3 tokens: steps 0..2), though only one sequence runs when it is first considered
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=3, n_mode="cow")
    engine.add_request("A", [5, 6, 7], sampled(3, n=2), arrival_s=0.0)
    engine.add_request("B", [5, 6, 8], sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (3, "B", 0)]
    assert [r.num_running for r in tracer.records] == [1, 2, 2, 1, 2, 2]  # after scheduling: forks follow


def test_a_request_whose_samples_just_fit_max_num_seqs_is_admitted_beside_the_running_one(make_engine):
    # max_num_seqs 3, --n-mode cow: A (n=1) and B (n=2) arrive together; B and its fork make 3
    # sequences with A, the limit exactly, so both start in step 0
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=3, n_mode="cow")
    engine.add_request("A", [5, 6, 7], ignore_eos(3), arrival_s=0.0)
    engine.add_request("B", [5, 6, 8], sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0)]
    assert [r.num_running for r in tracer.records] == [2, 3, 3]


# ---------------------------------------------------------------- admission: rejection and the token budget

def test_a_prompt_rejected_at_admission_does_not_hold_up_the_one_behind_it(make_engine):
    # 4 blocks of 4 (16 positions): A's 16-token prompt and its next token can never fit, so A is
    # rejected; B, behind it, is admitted in the same step
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, max_model_len=64)
    engine.add_request("A", list(range(100, 116)), ignore_eos(2), arrival_s=0.0)
    engine.add_request("B", [7, 8, 9], ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id, e.reason) for e in tracer.events if e.kind == "finish"] == [
        (0, "A", "rejected"), (1, "B", "length")]
    assert admits(tracer) == [(0, "B", 0)]


def test_without_chunked_prefill_a_prompt_that_exactly_fills_the_budget_left_is_admitted(make_engine):
    # budget 16, no chunked prefill: A (10 tokens) leaves 6, and B's 6-token prompt fits them exactly
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=16, enable_chunked_prefill=False)
    engine.add_request("A", list(range(100, 110)), ignore_eos(2), arrival_s=0.0)
    engine.add_request("B", list(range(200, 206)), ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0)]
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [(16, 0), (0, 2)]


# ---------------------------------------------------------------- victims: kvtrace's policies

def test_newest_sparing_takes_the_sample_forked_last(make_engine):
    # 5 blocks of 4, --n-mode cow, newest-sparing: A (3 tokens, n=3) forks samples 1 and 2 after
    # step 0, in that order. In step 1 samples 0 and 1 copy the shared partial block 1 (blocks 2, 3)
    # and sample 2 keeps it; in step 2 each needs a block for position 4, samples 0 and 1 take the
    # last two, and sample 2, the newest (forked after sample 1), preempts itself
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=5, n_mode="cow", preemption_policy="newest-sparing",
                         enable_prefix_caching=False)
    engine.add_request("A", [5, 6, 7], sampled(6, n=3), arrival_s=0.0)
    run_checked(engine)
    assert step_events(tracer, 2) == [
        ("alloc", "A", 0, [4], "decode"), ("alloc", "A", 1, [5], "decode"),
        ("preempt", "A", 2, [1], "recompute"), ("free", "A", 2, [1], "preempt")]
    assert preempts(tracer) == [(2, "A", 2, "recompute")]


def test_a_resumed_sequence_takes_the_newest_other_when_no_victim_would_free_a_block(make_engine):
    # 4 blocks of 4, --n-mode cow, newest-sparing, chunks of 4 while others wait. Y (1 token), X (12)
    # and P (8, n=2) arrive together; P and then X are preempted, and when Y finishes both resume
    # (step 4). In step 5 P's re-prefill ends and it forks: P's two samples share blocks 3 and 2. In
    # step 6 X, resumed and still re-prefilling (spared), needs a block: no other frees one on its
    # own, so the newest other (P's sample 1) is preempted, freeing nothing, then P's sample 0,
    # which now holds the blocks alone
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, n_mode="cow", preemption_policy="newest-sparing",
                         enable_prefix_caching=False, long_prefill_token_threshold=4)
    engine.add_request("Y", [10], ignore_eos(4), arrival_s=0.0)
    engine.add_request("X", list(range(30, 42)), ignore_eos(3), arrival_s=0.0)
    engine.add_request("P", list(range(50, 58)), sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id, e.reason) for e in tracer.events if e.kind == "admit"][3:5] == [
        (4, "X", "resume-recompute"), (4, "P", "resume-recompute")]
    assert step_events(tracer, 6) == [
        ("preempt", "P", 1, [3, 2], "recompute"), ("preempt", "P", 0, [3, 2], "recompute"),
        ("free", "P", 0, [2, 3], "preempt"), ("alloc", "X", 0, [2], "prefill")]


# ---------------------------------------------------------------- victims: swap groups

def test_independent_samples_of_a_request_are_swapped_out_one_at_a_time(make_engine):
    # swap mode, n=2 as V1 runs it (independent sequences): 4 blocks of 4, A's two samples hold 2
    # each. In step 2 sample 0 needs a block and only sample 1 (the newest) is swapped out; only
    # --n-mode cow swaps a request's samples together
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=8,
                         enable_prefix_caching=False)
    engine.add_request("A", [11, 12, 13, 14, 15, 16, 17], sampled(6, n=2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.sample) for e in tracer.events if e.kind == "swap_out"] == [(2, 1)]
    assert step_events(tracer, 2) == [
        ("preempt", "A", 1, [3, 4], "swap"), ("free", "A", 1, [4, 3], "preempt"),
        ("swap_out", "A", 1, [3, 4], None), ("alloc", "A", 0, [4], "decode")]


def test_copy_on_write_samples_the_host_cannot_hold_are_not_preempted_together(make_engine):
    # swap mode, --n-mode cow, 4 blocks of 4 and 2 host blocks. B (3 tokens) and C (9 tokens, n=2)
    # fill the pool; in step 1 C's first sample must copy their shared partial block and no block is
    # free. The host cannot take C's 3 blocks, so its samples do not go together: only the newest is
    # preempted (by recompute), which leaves C's first sample the block's sole holder, and it decodes
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=2,
                         enable_prefix_caching=False, n_mode="cow")
    engine.add_request("B", [1, 2, 3], ignore_eos(3), arrival_s=0.0)
    engine.add_request("C", list(range(40, 49)), sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert preempts(tracer)[0] == (1, "C", 1, "swap-full-fallback")
    assert step_events(tracer, 1) == [("preempt", "C", 1, [2, 3, 4], "swap-full-fallback")]
    assert sorted(tracer.records[1].token_samples) == [0, 0]
