"""The causes the scheduler records (trace schema 3): each preemption's requester and why the policy
chose its victim, and why admission stopped in each step."""
from __future__ import annotations

import pytest

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import ListTracer, add_x_and_y, four_block_engine, run_checked


def preempts(tracer) -> list[tuple]:
    return [(e.step, e.req_id, e.sample, e.requester_req_id, e.requester_sample, e.victim_reason)
            for e in tracer.events if e.kind == "preempt"]


def stops(tracer) -> list[str]:
    return [r.admission_stop for r in tracer.records]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_the_four_block_preemption_names_a_as_its_requester(make_engine, mode):
    engine, tracer, _, _ = four_block_engine(make_engine, mode)
    run_checked(engine)
    assert preempts(tracer) == [(2, "B", 0, "A", 0, "newest")]
    # both admitted at step 0; B preempted at step 2 (nothing more admitted in it), then it waits for
    # blocks (recompute) or for its swap-in (swap) until A finishes at step 5
    assert stops(tracer) == ["nothing-waiting", "nothing-waiting", "preemption", "blocks", "blocks", "blocks",
                             "nothing-waiting", "nothing-waiting"]
    # other events carry no cause
    assert all(e.requester_req_id is None and e.victim_reason is None for e in tracer.events if e.kind != "preempt")


def test_seats_and_the_token_budget_stop_admission(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=2, max_num_batched_tokens=64)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 * i + 1, 10 * i + 9)), SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    assert stops(tracer)[:2] == ["seats", "seats"] and stops(tracer)[-1] == "nothing-waiting"

    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=16)
    for i in range(2):
        engine.add_request(f"r{i}", list(range(40 * i + 1, 40 * i + 41)), SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    # r0's 40-token prompt takes the whole budget twice; r1 starts beside its last 8 tokens
    assert stops(tracer)[:3] == ["budget", "budget", "nothing-waiting"]
    assert "budget" not in stops(tracer)[2:]

    tracer = ListTracer()   # chunked prefill off: a prompt that does not fit what is left of the budget waits
    engine = make_engine(tracer, max_num_batched_tokens=48, enable_chunked_prefill=False, max_model_len=48)
    for i in range(2):
        engine.add_request(f"r{i}", list(range(40 * i + 1, 40 * i + 41)), SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    assert stops(tracer)[0] == "budget"


def test_the_watermark_is_told_apart_from_too_few_blocks(make_engine):
    def first_stop(num_gpu_blocks: int) -> str:
        tracer = ListTracer()
        engine = make_engine(tracer, block_size=4, num_gpu_blocks=num_gpu_blocks, watermark=0.25,
                             enable_prefix_caching=False)
        engine.add_request("A", list(range(1, 17)), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        engine.add_request("B", list(range(21, 33)), SamplingParams(max_tokens=2, ignore_eos=True))
        engine.step()
        return tracer.records[-1].admission_stop
    # A holds 5 blocks; B needs 3: with 8 blocks, 3 free fit but not above the 2-block watermark
    assert first_stop(8) == "watermark"
    assert first_stop(7) == "blocks"


@pytest.mark.parametrize("policy, reason", [("priority", "lowest-priority"), ("fewest-computed", "fewest-computed")])
def test_a_policys_victim_says_why_it_was_chosen(make_engine, policy, reason):
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, preemption_mode="swap", preemption_policy=policy, num_cpu_blocks=12,
                         enable_prefix_caching=False, max_num_batched_tokens=12 if policy == "priority" else 64,
                         n_mode="cow", num_gpu_blocks=5 if policy == "fewest-computed" else 7)
    add_x_and_y(engine, policy)
    run_checked(engine)
    first = [p for p in preempts(tracer) if p[0] == preempts(tracer)[0][0]]
    # Y's growth swaps X out whole (vLLM V0's sequence group): the sample the policy picked says why,
    # the other samples went with it
    assert sorted(p[1:5] for p in first) == [("X", 0, "Y", 0), ("X", 1, "Y", 0), ("X", 2, "Y", 0)]
    assert sorted(p[5] for p in first) == sorted([reason, "swap-group", "swap-group"])


def test_a_sequence_with_no_one_else_to_preempt_yields_to_itself(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=2, enable_prefix_caching=False,
                         preemption_policy="newest-sparing")
    engine.add_request("A", list(range(1, 8)), SamplingParams(max_tokens=6, ignore_eos=True))
    run_checked(engine)
    assert preempts(tracer)[0][1:] == ("A", 0, "A", 0, "only-candidate")
