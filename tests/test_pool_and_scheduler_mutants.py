"""Behaviour of the block pool (engine/block_manager.py) and the scheduler (engine/scheduler.py) that
only a planted bug showed untested: each test here fails on a mutant that the other tests let
through (scripts/mutation.py, issue 20)."""
from __future__ import annotations

from engine.sequence import SamplingParams
from tests.conftest import probe_schedule, run_checked
from tests.test_preemption import ListTracer


def ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def step_events(tracer, step: int) -> list[tuple]:
    return [(e.kind, e.req_id, e.blocks) for e in tracer.records[step].events]


# ---------------------------------------------------------------- block manager: the prefix cache

def test_a_block_taken_back_out_of_its_step_is_not_evicted_from_the_cache(make_engine):
    # 5 blocks of 4, token budget 8, chunks of 3 while others wait, priority policy. B (3 tokens,
    # least important) runs from step 0, A (13 tokens) from step 1. In step 5 B is scheduled for
    # position 7, which fills its second block (block 3, cached when scheduled, as in V1); then A's
    # prefill needs a block, none is free, and B is taken back out: block 3's KV is never written,
    # so it leaves the cache and is reused for A as a plain free block, not evicted as a cached one
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=5, max_num_batched_tokens=8, long_prefill_token_threshold=3,
                         preemption_policy="priority")
    engine.add_request("B", [49, 37, 37], ignore_eos(8), priority=2, arrival_s=0.0)
    engine.step()
    engine.add_request("A", list(range(100, 113)), ignore_eos(4), priority=0, arrival_s=0.0)
    run_checked(engine)
    assert step_events(tracer, 5) == [("preempt", "B", [1, 3]), ("free", "B", [3, 1]), ("alloc", "A", [3])]
