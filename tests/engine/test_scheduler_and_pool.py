"""The scheduler (engine/scheduler.py) and the block pool (engine/block_manager.py) together: blocks
taken back out of a step, cached duplicates, samples and reservations coming back from the host, the
budget's last token, long-prefill caps, newest-sparing, and a copy-on-write dropped with its victim."""
from __future__ import annotations

import pytest

from engine.events import with_evictions
from engine.sequence import SamplingParams
from tests.helpers.engine_runs import (
    ListTracer,
    add_x_and_y,
    distinct_kv_positions,
    integrity_state,
    probe_schedule,
    run_checked,
)


def ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def step_events(tracer, step: int) -> list[tuple]:
    return [(e.kind, e.req_id, e.blocks) for e in tracer.records[step].events]


def b_then_a(make_engine, tracer, num_gpu_blocks: int):
    """Blocks of 4, token budget 8, chunks of 3 while others wait, priority policy: B (3 tokens, least
    important) runs one step alone, then A (13 tokens, most important) arrives."""
    engine = make_engine(tracer, num_gpu_blocks=num_gpu_blocks, max_num_batched_tokens=8,
                         long_prefill_token_threshold=3, preemption_policy="priority")
    engine.add_request("B", [49, 37, 37], ignore_eos(8), priority=2, arrival_s=0.0)
    engine.step()
    engine.add_request("A", list(range(100, 113)), ignore_eos(4), priority=0, arrival_s=0.0)
    return engine


# ---------------------------------------------------------------- block manager: the prefix cache

def test_a_block_taken_back_out_of_its_step_is_not_evicted_from_the_cache(make_engine):
    # 5 blocks of 4, token budget 8, chunks of 3 while others wait, priority policy. B (3 tokens,
    # least important) runs from step 0, A (13 tokens) from step 1. In step 5 B is scheduled for
    # position 7, which fills its second block (block 3, cached when scheduled, as in V1); then A's
    # prefill needs a block, none is free, and B is taken back out: block 3's KV is never written,
    # so it leaves the cache and is reused for A as a plain free block, not evicted as a cached one
    tracer = ListTracer()
    engine = b_then_a(make_engine, tracer, num_gpu_blocks=5)
    run_checked(engine)
    assert step_events(tracer, 5) == [("preempt", "B", [1, 3]), ("free", "B", [3, 1]), ("alloc", "A", [3])]



def test_when_a_cached_block_is_evicted_its_earliest_duplicate_serves_the_next_hit(make_engine):
    # 7 blocks of 4, chunks of 3 while others wait. A, B, C share their first 4 tokens; all three
    # are admitted in step 0 with 3 of them, so none finds the block cached, and each completes its
    # own copy in step 1: A's (block 1) is the one a lookup finds, B's (2) and C's (3) are
    # duplicates, in that order. A finishes (block 1 free, still cached, at the back of the queue);
    # in step 2 three 3-token requests take the 3 free blocks, evicting block 1. As in V1 (its lookup
    # takes the first block still cached under the hash), E then hits B's copy, not C's.
    shared = [60, 61, 62, 63]
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=7, long_prefill_token_threshold=3)
    engine.add_request("A", shared + [70, 71], ignore_eos(1), arrival_s=0.0)
    engine.add_request("B", shared + [80, 81], ignore_eos(4), arrival_s=0.0)
    engine.add_request("C", shared + [90, 91], ignore_eos(4), arrival_s=0.0)
    engine.step()
    engine.step()
    for i in range(3):
        engine.add_request(f"D{i}", [100 + 3 * i, 101 + 3 * i, 102 + 3 * i], ignore_eos(1), arrival_s=0.0)
    engine.step()
    engine.add_request("E", shared + [99, 98], ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert [e.blocks for e in with_evictions(tracer.records[2].events) if e.kind == "evict"] == [[1]]
    assert [(e.step, e.req_id, e.blocks) for e in tracer.events if e.kind == "prefix_hit"] == [(3, "E", [2])]


# ---------------------------------------------------------------- block manager: swap of copy-on-write samples

def cow_swap_engine(make_engine, tracer, **overrides):
    settings = dict(num_gpu_blocks=4, preemption_mode="swap", preemption_policy="newest", num_cpu_blocks=16,
                    enable_prefix_caching=False, n_mode="cow")
    settings.update(overrides)
    return make_engine(tracer, **settings)


def test_samples_sharing_a_partial_block_come_back_together_when_the_pool_just_holds_them(make_engine):
    # 4 blocks of 4. B (3 tokens) and C (9 tokens, n=2 by copy-on-write) fill the pool. In step 1 C's
    # first sample must copy the shared, partial third block; no block is free, and C's samples (the
    # newest) are swapped out together: 3 host blocks. When B finishes, bringing them back takes the
    # 3 blocks plus one copy (the first sample to write the shared block copies it, the last one
    # owns it): 4 blocks, the whole pool, so both come back in step 3, the copy made at once
    tracer = ListTracer()
    engine = cow_swap_engine(make_engine, tracer)
    engine.add_request("B", [1, 2, 3], ignore_eos(3), arrival_s=0.0)
    engine.add_request("C", list(range(40, 49)), ignore_eos(3, n=2, temperature=1.0, seed=1), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.sample, e.num_tokens) for e in tracer.events if e.kind == "swap_out"] == [(1, 0, 9), (1, 1, 9)]
    assert [(e.step, e.sample, e.blocks) for e in tracer.events if e.kind in ("swap_in", "cow")] == [
        (3, 0, [4, 1, 3]), (3, 1, []), (3, 0, [2])]


def test_kv_tokens_after_samples_with_blocks_reserved_ahead_come_back_from_the_host(make_engine):
    # 6 blocks of 4, --kv-reserve max-tokens: B (3 tokens) and C (6 tokens, n=2 by copy-on-write)
    # each hold 3 blocks from admission. C's samples are swapped out in step 1 and come back in step 6
    # sharing blocks 3 (4 positions), 2 (2 positions) and 1 (reserved, no position yet): every step
    # records the distinct KV positions the block tables hold, an empty shared block adding none
    tracer = ListTracer()
    engine = cow_swap_engine(make_engine, tracer, num_gpu_blocks=6, kv_reserve="max-tokens", max_model_len=32)
    expected = probe_schedule(engine, distinct_kv_positions)
    engine.add_request("B", [1, 2, 3], ignore_eos(6), arrival_s=0.0)
    engine.add_request("C", list(range(40, 46)), ignore_eos(6, n=2, temperature=1.0, seed=1), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.sample, e.blocks) for e in tracer.events if e.kind == "swap_in"] == [(6, 0, [3, 2, 1]), (6, 1, [])]
    assert [r.num_kv_tokens for r in tracer.records] == expected
    # step 6: block 3's 4 positions once; each sample's own copy of block 2 (its 2 positions and the
    # new one); nothing in block 1
    assert expected[6] == 4 + 2 * 3


# ---------------------------------------------------------------- scheduler: the token budget

def test_the_last_token_of_the_budget_goes_to_a_waiting_prompt(make_engine):
    # a token budget of 2: A decodes 1 token a step, so B (3 tokens) is admitted beside it in step 1
    # with the 1 token left, and prefills a token a step until A finishes
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=2)
    engine.add_request("A", [5, 6], ignore_eos(3), arrival_s=0.0)
    engine.step()
    engine.add_request("B", [7, 8, 9], ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id) for e in tracer.events if e.kind == "admit"] == [(0, "A"), (1, "B")]
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [(2, 0), (1, 1), (1, 1), (1, 0), (0, 1)]


def test_a_long_prefill_threshold_of_one_token_caps_every_chunk(make_engine):
    # two 3-token prompts waiting together, --long-prefill-token-threshold 1: each is admitted with
    # a 1-token chunk, and prefills one token a step
    tracer = ListTracer()
    engine = make_engine(tracer, long_prefill_token_threshold=1)
    engine.add_request("A", [5, 6, 7], ignore_eos(2), arrival_s=0.0)
    engine.add_request("B", [7, 8, 9], ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [(2, 0), (2, 0), (2, 0), (0, 2)]


# ---------------------------------------------------------------- the integrity check every engine test leans on

def test_the_integrity_check_names_a_block_table_holding_the_null_block(make_engine):
    # block 0 is V1's null block, never handed out: a table that holds it is the first thing reported
    engine, _ = integrity_state(make_engine, 1)
    engine.scheduler.running[0].block_table.append(0)
    with pytest.raises(AssertionError, match="the null block is in use"):
        engine.check_integrity()


# ---------------------------------------------------------------- scheduler: kvtrace's own victim policies

def test_newest_sparing_does_not_spare_a_new_prompt_still_prefilling(make_engine):
    # 4 blocks of 4, chunks of 4 while others wait. A (3 tokens) and C (9 tokens) are admitted in
    # step 0; C prefills 4 positions a step. In step 2 A's position 4 takes the last free block and
    # C's last chunk needs a third one: C, the newest, is preempted. newest-sparing spares only
    # sequences resumed and re-prefilling; a new prompt is not one of them, so A keeps running.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, max_num_batched_tokens=8, long_prefill_token_threshold=4,
                         enable_prefix_caching=False, preemption_policy="newest-sparing")
    engine.add_request("A", [100, 101, 102], ignore_eos(6), arrival_s=0.0)
    engine.add_request("C", list(range(100, 109)), ignore_eos(6), arrival_s=0.0)
    run_checked(engine)
    assert step_events(tracer, 2) == [("alloc", "A", [4]), ("preempt", "C", [2, 3]), ("free", "C", [3, 2])]


def test_a_copy_on_write_dropped_with_its_swapped_out_victim_is_not_executed(make_engine):
    # tests/engine/test_swap_cow.py's fewest-computed case: in step 1 X's first sample copies the shared
    # partial block 2 into block 5, then is swapped out in that same step with its samples. The
    # swap reads block 2 instead; the copy into block 5 (free again, its KV never needed) is not run.
    engine = make_engine(block_size=4, num_gpu_blocks=5, preemption_mode="swap", preemption_policy="fewest-computed",
                         num_cpu_blocks=12, enable_prefix_caching=False, n_mode="cow")
    copies = []
    execute = engine.runner.execute

    def spy(out):
        copies.append(list(out.copies))
        return execute(out)

    engine.runner.execute = spy
    add_x_and_y(engine, "fewest-computed")
    run_checked(engine)
    assert copies[1] == []


# ---------------------------------------------------------------- scheduler: the running pass

def test_a_victim_taken_back_out_of_the_step_leaves_no_one_behind_it_unscheduled(make_engine):
    # 6 blocks of 4, token budget 8, chunks of 3 while others wait, priority policy. B (3 tokens,
    # least important) runs from step 0; A (13 tokens, most important) and Y (1 token) from step 1;
    # the batch order is B, A, Y. In step 5 B is scheduled, then A's prefill needs a block and B is
    # taken back out of the step; A gets B's block, and Y, after A, still decodes in that step
    tracer = ListTracer()
    engine = b_then_a(make_engine, tracer, num_gpu_blocks=6)
    engine.add_request("Y", [7], ignore_eos(8), priority=1, arrival_s=0.0)
    run_checked(engine)
    assert [(k, r) for k, r, _ in step_events(tracer, 5) if k in ("preempt", "alloc")] == [
        ("preempt", "B"), ("alloc", "A"), ("alloc", "Y")]
    assert sorted(tracer.records[5].token_req_ids) == ["A", "Y"]
    assert [r.step for r in tracer.records if "Y" in r.token_req_ids] == [1, 2, 3, 4, 5, 6, 7, 8]


# ---------------------------------------------------------------- scheduler: the swap queue

def test_samples_outnumbering_max_num_seqs_come_back_from_the_host(make_engine):
    # max_num_seqs 2, yet B (n=3, copy-on-write) is admitted alone and runs its 3 samples (as when
    # admitted, a request alone may exceed it). 7 blocks of 4: in step 7 the third sample finds no
    # block and the three are swapped out together. They come back (one by one: the pool cannot
    # hold the three and their next blocks) and finish with the tokens of an unconstrained run.
    # (Before the fix the swap queue waited for room for three beside nothing, forever.)
    def run(num_gpu_blocks, tracer=None):
        engine = make_engine(tracer, num_gpu_blocks=num_gpu_blocks, preemption_mode="swap", num_cpu_blocks=16,
                             max_num_seqs=2, enable_prefix_caching=False, n_mode="cow", max_model_len=32)
        engine.add_request("B", [76, 57, 40, 40, 45, 33, 37, 38], ignore_eos(9, n=3, temperature=1.0, seed=1))
        run_checked(engine)
        return {k: s.token_ids for k, s in engine.outputs.items()}

    tracer = ListTracer()
    assert run(7, tracer) == run(64)
    assert [(e.step, e.sample) for e in tracer.events if e.kind == "swap_out"] == [(5, 0), (5, 1), (5, 2)]
    assert sorted(e.sample for e in tracer.events if e.kind == "swap_in") == [0, 1, 2]


def test_newest_sparing_spares_a_sequence_resumed_and_still_re_prefilling(make_engine):
    # 5 blocks of 4, chunks of 3 while others wait. X (3 tokens), Y (7) and Z (8) start together; Z,
    # the newest, is preempted in step 2 and resumed in step 6, re-prefilling its 8 positions 3 a
    # step. In step 8 Y needs a block: Z, resumed and not yet progressed, is spared (no
    # preempt-readmit livelock), so Y preempts itself and Z finishes its re-prefill
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=5, long_prefill_token_threshold=3, enable_prefix_caching=False,
                         preemption_policy="newest-sparing")
    for name, prompt, max_tokens in [("X", [0, 1, 2], 6), ("Y", list(range(10, 17)), 11), ("Z", list(range(20, 28)), 9)]:
        engine.add_request(name, prompt, ignore_eos(max_tokens), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id) for e in tracer.events if e.kind == "preempt"] == [(2, "Z"), (8, "Y")]
    assert [(e.step, e.req_id, e.reason) for e in tracer.events if e.kind == "reprefill"] == [
        (8, "Z", None), (17, "Y", None)]
