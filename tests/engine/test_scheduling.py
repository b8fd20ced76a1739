"""The scheduler's limits, step by step: batch size, token budget, watermark, priority admission,
the KV positions a step reports, and top-p sampling.

Each test asserts on every step's record, so a limit that is ignored for one step fails it.
"""
from __future__ import annotations

import math

import torch

from engine.executor.model_runner import sample
from engine.sequence import SamplingParams, Sequence
from tests.helpers.engine_runs import (
    ListTracer,
    admits,
    distinct_kv_positions,
    params,
    probe_schedule,
    run_checked,
)


def test_max_num_seqs_caps_the_running_batch_every_step(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=2)
    for i in range(5):
        engine.add_request(f"r{i}", [10 + i, 11, 12, 13, 14], params())
    run_checked(engine)
    # (counted after scheduling, so a sequence in its last step still counts)
    assert [r.num_running for r in tracer.records] == [2, 2, 2, 2, 2, 2, 1, 1, 1]
    assert [r.num_waiting for r in tracer.records] == [3, 3, 3, 1, 1, 1, 0, 0, 0]
    # two at a time: r2 and r3 only once r0 and r1 have finished (3 tokens: steps 0..2)
    assert admits(tracer) == [(0, "r0", 0), (0, "r1", 0), (3, "r2", 0), (3, "r3", 0), (6, "r4", 0)]


def test_max_num_seqs_counts_the_samples_a_running_request_will_fork(make_engine):
    # A (n=2, copy-on-write) is admitted with one sample; its second is forked when its prompt is
    # done. B fits beside both (3 sequences); C would make 4, so it waits until A's and B's samples finish.
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=3, n_mode="cow")
    engine.add_request("A", [5, 6, 7, 8, 9], params(n=2))
    engine.add_request("B", [5, 6, 7, 8, 10], params())
    engine.add_request("C", [5, 6, 7, 8, 11], params())
    run_checked(engine)
    assert max(r.num_running for r in tracer.records) == 3
    assert [r.num_running for r in tracer.records] == [2, 3, 3, 1, 1, 1]  # after scheduling: A forks after step 0
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0), (3, "C", 0)]


def test_max_num_seqs_counts_the_forks_of_a_request_still_prefilling(make_engine):
    # A (n=2, copy-on-write) prefills its 8 prompt tokens over two steps (budget 5); at step 1 it runs
    # alone but will be two sequences once its prompt is done, so B (max 2) waits until A's samples finish
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=2, max_num_batched_tokens=5, n_mode="cow")
    engine.add_request("A", list(range(5, 13)), params(n=2))
    engine.step()
    engine.add_request("B", [5, 6, 7, 20], params())
    run_checked(engine)
    assert [r.num_running for r in tracer.records] == [1, 1, 2, 2, 1, 1, 1]  # after scheduling: A forks after step 1
    assert admits(tracer) == [(0, "A", 0), (4, "B", 0)]


# ---------------------------------------------------------------- max_num_batched_tokens

def test_admitted_prefills_are_charged_to_the_token_budget(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=8)
    for name in "ABC":
        engine.add_request(name, [ord(name), 20, 21, 22, 23], params(max_tokens=2))
    run_checked(engine)
    # step 0: A's 5 prompt tokens, then B's first 3 (chunked); step 1: A's decode, B's last 2 and
    # all of C; step 2: B and C decode (A is done)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [(8, 0), (7, 1), (0, 2)]
    assert all(r.num_prefill_tokens + r.num_decode_tokens <= 8 for r in tracer.records)
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0), (1, "C", 0)]


def test_the_token_budget_holds_when_forked_samples_outnumber_it(make_engine):
    # a 1-token prompt with n=3 (copy-on-write): three decoding samples, a budget of 2 tokens a step;
    # the oldest two decode first, the third waits until they are done instead of running on a budget of 0
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=2, n_mode="cow")
    engine.add_request("A", [7], params(max_tokens=3, n=3, temperature=1.0, seed=5))
    run_checked(engine)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [
        (1, 0), (0, 2), (0, 2), (0, 1), (0, 1)]
    assert [sorted(r.token_samples) for r in tracer.records] == [[0, 1, 2], [0, 1], [0, 1], [2], [2]]


# ---------------------------------------------------------------- watermark

def test_admission_keeps_the_watermark_free(make_engine):
    # 10 blocks, watermark 0.2: 2 blocks stay free at admission. Each prompt of 12 tokens takes 3.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=10, watermark=0.2, enable_prefix_caching=False)
    for name in "ABC":
        engine.add_request(name, [30 + ord(name)] * 12, params(max_tokens=2))
    engine.step()
    # A leaves 7 free, B 4; C would leave 1 < 2, so it waits
    assert tracer.records[0].num_free_blocks == 4
    assert (tracer.records[0].num_running, tracer.records[0].num_waiting) == (2, 1)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0), (2, "C", 0)]


# ---------------------------------------------------------------- priority

def test_priority_admission_takes_the_most_important_first(make_engine):
    # one sequence at a time, so the admission order is the order of importance (lower value
    # first; equal priorities in arrival order)
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=1, preemption_policy="priority")
    for name, priority in (("p5", 5), ("p0", 0), ("p3a", 3), ("p3b", 3)):
        engine.add_request(name, [40, 41, 42, len(name) + priority], params(max_tokens=1), priority=priority)
    run_checked(engine)
    assert [req for _, req, _ in admits(tracer)] == ["p0", "p3a", "p3b", "p5"]
    assert [r.token_req_ids for r in tracer.records] == [["p0"], ["p3a"], ["p3b"], ["p5"]]


# ---------------------------------------------------------------- steps.kv_tokens


def test_kv_tokens_count_a_shared_position_once(make_engine):
    # a shared prefix (prefix cache) and four samples forked onto one prompt (n=4, copy-on-write)
    tracer = ListTracer()
    engine = make_engine(tracer, n_mode="cow")
    expected = probe_schedule(engine, distinct_kv_positions)
    prefix = list(range(100, 112))
    engine.add_request("first", prefix + [7, 8], params(max_tokens=6))
    engine.step()
    engine.add_request("second", prefix + [9], params(max_tokens=6))
    engine.add_request("fan", [50, 51, 52, 53, 54, 55], params(max_tokens=5, n=4, temperature=1.0, seed=3))
    naive = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        assert tracer.records[-1].num_kv_tokens == expected[-1], tracer.records[-1].step
        naive.append(sum(s.num_computed_tokens for s in engine.scheduler.running))
    kv = [r.num_kv_tokens for r in tracer.records]
    # the sharing is real: 12 of the second request's 13 positions are the first's cached ones; in
    # the step after the fork, 4 samples x 6 prompt positions are held once, plus each one's new token
    assert kv[1] == 15 + 1 + 6 and naive[0] == 15 + 13 + 4 * 6
    assert all(k > 0 for k in kv)


# ---------------------------------------------------------------- top_p

def test_top_p_keeps_only_the_nucleus():
    # probabilities 0.5, 0.3, 0.2: top_p 0.6 keeps the first two (0.5 before the second < 0.6)
    logits = torch.tensor([[math.log(0.5), math.log(0.3), math.log(0.2)]])
    seq = Sequence("r", 0, [1], SamplingParams(temperature=1.0, top_p=0.6, seed=7), 0.0, 0, 0)
    drawn = [sample(logits, [seq])[0] for _ in range(300)]
    assert set(drawn) == {0, 1}
    assert 0.5 < drawn.count(0) / 300 < 0.75          # 0.5 / 0.8 = 0.625 of the kept mass
    seq = Sequence("r", 0, [1], SamplingParams(temperature=1.0, top_p=1.0, seed=7), 0.0, 0, 0)
    assert set(sample(logits, [seq])[0] for _ in range(300)) == {0, 1, 2}


def test_a_tiny_top_p_samples_greedily(make_engine):
    prompts = [[60, 61, 62, 63, 64], [70, 71, 72]]
    greedy = make_engine().generate(prompts, params(max_tokens=8))
    nucleus = make_engine().generate(prompts, params(max_tokens=8, temperature=1.0, top_p=1e-6, seed=1))
    loose = make_engine().generate(prompts, params(max_tokens=8, temperature=1.0, top_p=1.0, seed=1))
    assert nucleus == greedy
    assert loose != greedy  # the seed draws other tokens when the whole distribution is kept


# ---------------------------------------------------------------- V1's prefill options

def test_long_prefill_threshold_caps_chunks_while_others_wait(make_engine):
    # budget 64, threshold 8: A's and B's 20-token prompts go 8 tokens a step each (8 + 8, 8 + 8,
    # 4 + 4) instead of both in one step; a request alone may use the whole budget
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    engine.add_request("A", list(range(100, 120)), params(max_tokens=1))
    engine.add_request("B", list(range(200, 220)), params(max_tokens=1))
    run_checked(engine)
    assert [r.num_prefill_tokens for r in tracer.records] == [16, 16, 8]
    alone = ListTracer()
    engine = make_engine(alone, max_num_batched_tokens=64, long_prefill_token_threshold=8)
    engine.add_request("A", list(range(100, 120)), params(max_tokens=1))
    run_checked(engine)
    assert [r.num_prefill_tokens for r in alone.records] == [20]   # a lone request starves nobody


def test_without_chunked_prefill_a_prompt_waits_for_a_step_with_room(make_engine):
    # budget 16: A (10 tokens) is admitted; B (10 tokens) does not fit the 6 left, so it waits whole
    # (with chunked prefill it would start with 6 tokens in the same step)
    for chunked, expected in ((False, [(0, "A", 0), (1, "B", 0)]), (True, [(0, "A", 0), (0, "B", 0)])):
        tracer = ListTracer()
        engine = make_engine(tracer, max_num_batched_tokens=16, enable_chunked_prefill=chunked)
        engine.add_request("A", list(range(100, 110)), params(max_tokens=2))
        engine.add_request("B", list(range(200, 210)), params(max_tokens=2))
        run_checked(engine)
        assert admits(tracer) == expected, chunked
        assert all(r.num_prefill_tokens + r.num_decode_tokens <= 16 for r in tracer.records)
