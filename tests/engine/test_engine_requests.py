"""Requests entering the engine (engine/llm_engine.py): the replay clock (start_clock, idle_until),
add_request's checks, arrival times and priorities as the priority policy reads them, n > 1 samples,
and the kv_events' numbering."""
from __future__ import annotations

import time

import pytest

from engine import events as ev
from engine.build import build_engine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from tests.helpers.engine_runs import ListTracer, run_checked


def sim_engine(**overrides) -> LLMEngine:
    return build_engine(EngineConfig(**{"model": "tiny", "engine": "sim", "block_size": 4, "num_gpu_blocks": 64,
                                     **overrides}))


def admitted(tracer: ListTracer) -> list[str]:
    return [e.req_id for e in tracer.events if e.kind == ev.ADMIT]


# ---------------------------------------------------------------- the replay clock

def test_a_simulated_engine_idles_to_times_counted_from_its_clock_start():
    # a replay's t = 0 is when start_clock ran, however much virtual time went before it
    engine = sim_engine()
    engine.add_request("warm-up", [5, 6, 7], SamplingParams(max_tokens=4))
    run_checked(engine)
    assert engine.clock() > 0
    engine.start_clock()
    assert engine.now() == 0.0
    engine.idle_until(1.5)
    assert engine.now() == pytest.approx(1.5)
    engine.idle_until(1.0)                     # an arrival already passed: time never runs back
    assert engine.now() == pytest.approx(1.5)


def test_a_real_engine_sleeps_only_until_the_next_arrival_and_at_most_50_ms(make_engine, monkeypatch):
    engine = make_engine()
    engine.start_clock()
    slept = []
    monkeypatch.setattr(time, "sleep", slept.append)
    while engine.now() <= 0:                    # some time has passed since t = 0
        pass
    engine.idle_until(0.0)                      # due already: no wait
    engine.idle_until(engine.now() + 60.0)      # far off: a short nap, then the loop looks again
    engine.idle_until(engine.now() + 0.02)      # soon: until then
    assert slept[:2] == [0.0, 0.05]
    assert 0.0 < slept[2] <= 0.02


# ---------------------------------------------------------------- add_request's checks

def test_prompt_token_ids_must_lie_in_the_vocabulary_and_the_error_names_its_range(make_engine):
    engine = make_engine()
    vocab = engine.model_config.vocab_size      # 512
    assert engine.add_request("edges", [0, vocab - 1]).num_prompt_tokens == 2
    for bad in (vocab, -1):
        with pytest.raises(ValueError) as raised:
            engine.add_request(f"bad{bad}", [3, bad, 4])
        assert str(raised.value) == f"request bad{bad}: token id {bad} outside the vocabulary (0..{vocab - 1})"
    assert ("bad512", 0) not in engine.outputs and ("bad-1", 0) not in engine.outputs
    run_checked(engine)



@pytest.mark.parametrize("prepared", [False, True])
def test_an_empty_prompt_is_refused_by_name_even_from_a_prepared_replay(prepared):
    # a replay's prepare checks the ids, not that there are any: the engine says what is wrong, and
    # queues nothing that would schedule a sequence with no positions
    engine = sim_engine()
    with pytest.raises(ValueError) as raised:
        engine.add_request("void", [], prepared=prepared)
    assert str(raised.value) == "request void: empty prompt"
    assert not engine.has_unfinished() and ("void", 0) not in engine.outputs

# ---------------------------------------------------------------- arrival and priority (--preemption-policy priority)

def test_the_priority_policy_admits_by_the_arrival_time_given_not_the_order_added(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, preemption_policy="priority", max_num_seqs=1)
    late = engine.add_request("late", [5, 6, 7], SamplingParams(max_tokens=2), arrival_s=2.0)
    early = engine.add_request("early", [8, 9, 10], SamplingParams(max_tokens=2), arrival_s=1.0)
    now = engine.add_request("now", [11, 12, 13], SamplingParams(max_tokens=2))   # arrives at now()
    assert (late.arrival_s, early.arrival_s) == (2.0, 1.0)
    assert 0.0 <= now.arrival_s <= engine.now()
    run_checked(engine)
    assert admitted(tracer) == ["now", "early", "late"]
    assert {s.req_id: s.arrival_s for r in tracer.records for s in r.finished} == {
        "late": 2.0, "early": 1.0, "now": now.arrival_s}


def test_a_request_without_a_priority_has_priority_0_and_ties_go_by_the_order_added(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, preemption_policy="priority", max_num_seqs=1)
    for req_id, priority in (("x", {"priority": 0}), ("default", {}), ("z", {"priority": 0}), ("first", {"priority": -1})):
        engine.add_request(req_id, [5, 6, 7], SamplingParams(max_tokens=2), arrival_s=0.0, **priority)
    run_checked(engine)
    assert admitted(tracer) == ["first", "x", "default", "z"]
    assert {s.req_id: s.priority for r in tracer.records for s in r.finished}["default"] == 0


def test_the_priority_policy_preempts_the_request_added_last_among_equals(make_engine):
    # two requests of one block each, same priority and arrival, in a pool of three blocks: when both
    # need a second block, the one added last (the least urgent) makes room
    tracer = ListTracer()
    engine = make_engine(tracer, preemption_policy="priority", num_gpu_blocks=3, block_size=4)
    a = engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True), arrival_s=0.0)
    b = engine.add_request("b", [9, 10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True), arrival_s=0.0)
    run_checked(engine)
    preempted = [e.req_id for e in tracer.events if e.kind == ev.PREEMPT]
    assert preempted and set(preempted) == {"b"}
    assert (a.num_preemptions, a.num_output_tokens, b.num_output_tokens) == (0, 6, 6)


# ---------------------------------------------------------------- n > 1

@pytest.mark.parametrize("n_mode", ["independent", "cow"])
def test_add_request_returns_the_first_sample_of_a_request_with_n_samples(make_engine, n_mode):
    engine = make_engine(n_mode=n_mode)
    first = engine.add_request("r", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, n=3, temperature=1.0, seed=2))
    assert (first.req_id, first.sample) == ("r", 0)
    assert engine.outputs[("r", 0)] is first
    run_checked(engine)
    assert sorted(engine.outputs) == [("r", 0), ("r", 1), ("r", 2)]


# ---------------------------------------------------------------- the trace's kv_events

def test_kv_events_are_numbered_from_0_in_the_order_they_happened(make_engine):
    # docs/trace-format.md: seq, the global order of events within the run, starting at 0 (as the vLLM
    # capture numbers them)
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=3, block_size=4)
    engine.add_request("a", [5, 6, 7, 8], SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("b", [9, 10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True))
    run_checked(engine)
    seqs = [e.seq for e in tracer.events]
    assert len(seqs) > 10 and seqs == list(range(len(seqs)))


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_ignore_eos_runs_past_the_stop_token_to_max_tokens(make_engine, async_scheduling):
    # every greedy token of A is made a stop token: without ignore_eos A stops on its first, with it A
    # writes all of max_tokens (reason length)
    probe = make_engine(block_size=4, num_gpu_blocks=16)
    greedy = probe.generate([[5, 6, 7]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    for ignore_eos, expected, reason in ((False, greedy[:1], "stop"), (True, greedy, "length")):
        engine = make_engine(block_size=4, num_gpu_blocks=16, async_scheduling=async_scheduling)
        engine.stop_token_ids = frozenset(greedy)
        seq = engine.add_request("A", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=ignore_eos))
        run_checked(engine)
        assert (seq.token_ids[3:], seq.finish_reason) == (expected, reason)
