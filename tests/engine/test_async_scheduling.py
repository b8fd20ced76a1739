"""--async-scheduling: vLLM V1's batch queue of two (docs/scheduling.md). Each step is scheduled while
the previous step's output is in flight; that output is processed after, so a sequence's next token
is its input before it is delivered, a sequence whose in-flight token is its last is not scheduled
again, a sequence that stops on an in-flight EOS was scheduled once more for nothing, and blocks of a
finished sequence come back a step later. Greedy output must not change."""
from __future__ import annotations

import random

import pytest

from engine.config import EngineConfig
from engine.sequence import SamplingParams, SequenceStatus
from tests.helpers.cli import one_line_error
from tests.helpers.engine_runs import ListTracer, probe_schedule, run_checked


def tight_engine(make_engine, async_scheduling: bool, tracer=None, **overrides):
    settings = dict(block_size=4, num_gpu_blocks=14, max_num_seqs=6, max_num_batched_tokens=64,
                    async_scheduling=async_scheduling)
    settings.update(overrides)
    return make_engine(tracer, **settings)


def add_random(engine, seed: int, count: int = 10) -> list:
    rng = random.Random(seed)
    return [engine.add_request(str(i), [rng.randrange(5, 200) for _ in range(rng.randint(3, 30))],
                               SamplingParams(max_tokens=rng.randint(1, 20)), arrival_s=0.0)
            for i in range(count)]


def outputs(seqs) -> list[list[int]]:
    return [s.token_ids[s.num_prompt_tokens:] for s in seqs]


@pytest.mark.long  # a 24-run seed sweep (about a minute)
def test_greedy_output_and_block_accounting_survive_async_preemption(make_engine):
    """Across seeds with preemptions, async gives the tokens sync gives, the pool balances after every
    step, and some sequence is preempted with its token in flight (delivered while it waits)."""
    stale = 0
    preemptions = 0
    for seed in range(12):
        sync = tight_engine(make_engine, False)
        reference = add_random(sync, seed)
        run_checked(sync)
        expected = outputs(reference)
        engine = tight_engine(make_engine, True)
        seqs = add_random(engine, seed)
        waiting_with_token = probe_schedule(
            engine, lambda e, out: sum(1 for s in e.scheduler.waiting if s.num_undelivered))
        run_checked(engine)
        assert outputs(seqs) == expected, f"seed {seed}"
        assert all(s.num_undelivered == 0 and s.status == SequenceStatus.FINISHED for s in seqs)
        stale += sum(waiting_with_token)
        preemptions += engine.num_preemptions
    assert preemptions > 0 and stale > 0, (preemptions, stale)


def test_a_sequence_whose_in_flight_token_is_its_last_is_not_scheduled_again(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=16, async_scheduling=True)
    engine.add_request("A", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=0.0)
    run_checked(engine)
    steps = [(r.step, r.num_prefill_tokens, r.num_decode_tokens, len(r.token_req_ids)) for r in tracer.records]
    # step 0: prefill (x0 in flight); 1: decode x0 (x1 in flight), x0 delivered; 2: decode x1, x1 delivered;
    # step 3: nothing: x2, in flight, is the last; x2 delivered, A finishes. Step 3 is never processed.
    assert steps == [(0, 5, 0, 1), (1, 0, 1, 1), (2, 0, 1, 1), (3, 0, 0, 0)]
    finish = [(e.step, e.kind) for e in tracer.events if e.kind in ("free", "finish")]
    assert finish == [(2, "free"), (2, "finish")]
    assert [r.finished[0].output_tokens for r in tracer.records if r.finished] == [3]


def test_a_sequence_that_stops_on_an_in_flight_eos_runs_once_more_and_frees_a_step_later(make_engine):
    tracer = ListTracer()
    probe = make_engine(block_size=4, num_gpu_blocks=16)
    first = probe.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=1))[0][0]
    for async_scheduling in (False, True):
        tracer = ListTracer()
        engine = make_engine(tracer, block_size=4, num_gpu_blocks=16, async_scheduling=async_scheduling)
        engine.stop_token_ids = frozenset({first})   # the first greedy token is EOS
        seq = engine.add_request("A", [5, 6, 7, 8], SamplingParams(max_tokens=10), arrival_s=0.0)
        run_checked(engine)
        assert outputs([seq]) == [[first]] and seq.finish_reason == "stop"
        decode = sum(r.num_decode_tokens for r in tracer.records)
        allocs = [(e.step, e.blocks) for e in tracer.events if e.kind == "alloc"]
        frees = [(e.step, sorted(e.blocks)) for e in tracer.events if e.kind == "free"]
        if not async_scheduling:
            assert decode == 0 and allocs == [(0, [1])] and frees == [(0, [1])]
        else:
            # step 1 decodes the EOS token (its position 4 needs a second block) before step 0's output
            # says A stopped; both blocks come back when that output is processed, in step 0's record
            assert decode == 1 and allocs == [(0, [1]), (1, [2])] and frees == [(0, [1, 2])]
            assert [r.step for r in tracer.records] == [0, 1]


def test_async_trace_tokens_carry_the_step_that_computed_them(make_engine):
    tracer = ListTracer()
    engine = tight_engine(make_engine, True, tracer)
    seqs = add_random(engine, 3)
    run_checked(engine)
    for seq in seqs:
        steps = [r.step for r in tracer.records for rid, s in zip(r.token_req_ids, r.token_samples)
                 if (rid, s) == (seq.req_id, seq.sample)]
        assert len(steps) == seq.num_output_tokens and steps == sorted(steps)
    assert [r.step for r in tracer.records] == list(range(len(tracer.records)))


@pytest.mark.parametrize("other", [{"preemption_mode": "swap"}, {"n_mode": "cow"}])
def test_async_scheduling_refuses_vllm_v0_options(other):
    with pytest.raises(ValueError, match="--async-scheduling"):
        EngineConfig(model="tiny", async_scheduling=True, **other)


def test_record_refuses_async_scheduling_with_swap_in_one_line(tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"prompt_tokens": 8, "max_tokens": 4}\n')
    line = one_line_error(["record", "--model", "tiny", "--load-format", "dummy", "-w", str(workload),
                           "-o", str(tmp_path / "run"), "--async-scheduling", "--preemption-mode", "swap"])
    assert "--async-scheduling" in line and "--preemption-mode swap" in line
    assert not (tmp_path / "run").exists()


def test_a_steps_output_is_processed_after_the_next_step_is_scheduled_and_re_prefills_end_with_it(make_engine):
    """Each record's end is when its output was processed, which is after the next step was
    scheduled (V1's batch queue: schedule, then process the previous output); a re-prefill completes
    at the end of the step that computed it. On a clock that ticks at every reading, neither can
    coincide with a step's start."""
    tracer = ListTracer()
    engine = tight_engine(make_engine, True, tracer)
    ticks = iter(range(1, 10**6))
    engine.clock = lambda: float(next(ticks))
    engine.start_clock()
    add_random(engine, seed=3, count=10)
    run_checked(engine)
    records = tracer.records
    assert all(r.end_s > nxt.start_s for r, nxt in zip(records, records[1:]) if r.token_req_ids)
    reprefills = [(r, e) for r in records for e in r.events if e.kind == "reprefill"]
    assert reprefills and all(e.ts_s == r.end_s for r, e in reprefills)
    # and in the record of the step that computed it: after the sequence was admitted again
    admitted = {}
    for e in tracer.events:
        key = (e.req_id, e.sample)
        if e.kind in ("preempt", "admit"):
            admitted[key] = e.kind == "admit"
        elif e.kind == "reprefill":
            assert admitted.get(key), f"{key}: re-prefill recorded before its sequence was admitted again"


def test_a_sequence_stopped_by_an_in_flight_eos_leaves_the_block_that_token_completes_uncached(make_engine):
    """A (3 tokens) stops on its first token, EOS, at position 3. Async runs that token's position in
    step 1 before step 0's output says A stopped, but V1 caches only what the delivered tokens complete
    less the step's input: block 0 (positions 0-3) is not cached, as in the synchronous run, where
    position 3 is never computed. C, arriving after, repeats A's tokens and hits nothing."""
    probe = make_engine(block_size=4, num_gpu_blocks=16)
    first = probe.generate([[5, 6, 7]], SamplingParams(max_tokens=1))[0][0]
    for async_scheduling in (False, True):
        engine = make_engine(block_size=4, num_gpu_blocks=16, enable_prefix_caching=True,
                             async_scheduling=async_scheduling)
        engine.stop_token_ids = frozenset({first})
        a = engine.add_request("A", [5, 6, 7], SamplingParams(max_tokens=10), arrival_s=0.0)
        run_checked(engine)
        assert outputs([a]) == [[first]] and a.finish_reason == "stop"
        c = engine.add_request("C", [5, 6, 7, first, 9], SamplingParams(max_tokens=1), arrival_s=0.0)
        run_checked(engine)
        assert c.num_prefix_hit_tokens == 0, async_scheduling
