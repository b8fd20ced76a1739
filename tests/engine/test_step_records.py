"""The engine's step records at the edges of the pool: the KV tokens and the blocks a step shares,
frees and hits, swapped sequences that just fit, self-preemption, and the integrity check that every
engine test leans on, against each broken book."""
from __future__ import annotations

import re

import pytest

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import (
    ListTracer,
    distinct_kv_positions,
    integrity_state,
    params,
    probe_schedule,
    run_checked,
)


def test_kv_tokens_of_forked_samples_with_blocks_reserved_ahead(make_engine):
    # --kv-reserve max-tokens: a 6-token prompt holds 4 blocks of 4 from admission (6 + 10 positions);
    # its 3 samples share all 4, two of them still empty: a position counts once, an empty block not at all
    tracer = ListTracer()
    engine = make_engine(tracer, kv_reserve="max-tokens", max_model_len=32, n_mode="cow")
    expected = probe_schedule(engine, distinct_kv_positions)
    engine.add_request("fan", [50, 51, 52, 53, 54, 55], params(max_tokens=10, n=3, temperature=1.0, seed=3))
    kv = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        assert tracer.records[-1].num_kv_tokens == expected[-1], tracer.records[-1].step
        kv.append(tracer.records[-1].num_kv_tokens)
    # the prompt once; then each sample writes position 6 into its own copy of the half-full block 1
    # (copy-on-write: 2 prompt positions + its token), block 0's 4 positions still shared
    assert kv[:2] == [6, 4 + 3 * 3]


def test_a_prefill_chunk_shares_only_the_blocks_it_has_computed(make_engine):
    # A's 12-token prompt is prefilled in chunks (token budget 8): 8 positions, then 4. B, the same 12
    # tokens and one more, arrives after A's first chunk and is admitted beside its second. As in V1,
    # a block is cached when the step that fills it is scheduled, so B reuses all three of A's blocks,
    # the third one's KV being written in that very step (before any attention reads it): 12
    # positions from the cache, 1 computed, and the same tokens as B alone
    prompt = list(range(100, 112))
    alone = make_engine(enable_prefix_caching=True)
    b_alone = alone.add_request("B", prompt + [7], SamplingParams(max_tokens=4, ignore_eos=True))
    run_checked(alone)
    tracer = ListTracer()
    engine = make_engine(tracer, enable_prefix_caching=True, max_num_batched_tokens=8)
    a = engine.add_request("A", prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    assert a.num_computed_tokens == 8
    b = engine.add_request("B", prompt + [7], SamplingParams(max_tokens=4, ignore_eos=True))
    run_checked(engine)
    assert [(e.req_id, e.num_tokens) for e in tracer.events if e.kind == "prefix_hit"] == [("B", 12)]
    # B's admission counts the positions it has to compute: 13 - 12 from the cache
    assert [e.num_tokens for e in tracer.events if e.kind == "admit" and e.req_id == "B"] == [1]
    assert b.token_ids == b_alone.token_ids


# ---------------------------------------------------------------- the integrity check every engine test leans on


def _swapped(engine):
    return engine.scheduler.swapped[0]


CORRUPTIONS = {  # what breaks -> (steps, how, the check's message)
    "a reference lost": (1, lambda e, bm: setattr(bm.blocks[3], "ref_count", 3), "block 3: ref_count 3 but 2"),
    "a used block in the free queue": (1, lambda e, bm: bm.free_uncached.append(3), "block 3: free=True ref_count=2"),
    "a cached block among the uncached": (4, lambda e, bm: bm.free_uncached.append(bm.free_cached.popitem()[0]),
                                          "a cached block in the uncached part"),
    "a block free twice": (4, lambda e, bm: bm.free_cached.__setitem__(bm.free_uncached[0], None),
                           "a block twice in the free queue"),
    "a block nowhere": (1, lambda e, bm: bm.free_cached.pop(1), "block 1: free=False ref_count=0"),
    "a cached block's hash gone": (1, lambda e, bm: setattr(bm.blocks[1], "hash", None), "an uncached block in the cached part"),
    "the null block handed out": (1, lambda e, bm: bm.free_uncached.append(0), "the null block is in the free queue"),
    "a duplicate unindexed": (1, lambda e, bm: bm.duplicates.__setitem__(bm.blocks[1].hash, [2]),
                              "duplicate index points to block 2"),
    "a hash unindexed": (1, lambda e, bm: bm.hash_to_block_id.pop(bm.blocks[1].hash), "block 1: hash not indexed"),
    "a stale share": (1, lambda e, bm: bm.shared_fill.__setitem__(5, 1), "shared-block index out of date"),
    "a stale hash": (1, lambda e, bm: bm.hash_to_block_id.__setitem__(12345, 1), "hash index points to block 1"),
    "a block beyond the pool": (4, lambda e, bm: bm.free_uncached.append(7), "beyond the pool"),
    "a host id twice": (1, lambda e, bm: bm.free_cpu_block_ids.append(2), "duplicate id in the host free list"),
    "a host block free and used": (3, lambda e, bm: bm.free_cpu_block_ids.append(0), "host block both free and used"),
    "a host block lost": (1, lambda e, bm: bm.free_cpu_block_ids.pop(), "host blocks lost"),
    "a host block held twice": (3, lambda e, bm: setattr(e.scheduler.running[0], "host_block_table", [0]),
                                "host block 0 held 3 times, counted 2"),
    "a shared host block unheld": (3, lambda e, bm: bm.host_refs.__setitem__(3, 2), "host block 3 held 1 times, counted 2"),
    "positions beyond the blocks": (1, lambda e, bm: setattr(e.scheduler.running[1], "num_computed_tokens", 9),
                                    "computed positions beyond its blocks"),
}


@pytest.mark.parametrize("what", CORRUPTIONS)
def test_the_integrity_check_catches_each_broken_book(make_engine, what):
    steps, corrupt, message = CORRUPTIONS[what]
    engine, bm = integrity_state(make_engine, steps)
    corrupt(engine, bm)
    with pytest.raises(AssertionError, match=re.escape(message)):
        engine.check_integrity()


# ---------------------------------------------------------------- scheduler

def test_a_swapped_sequence_behind_one_that_outgrew_the_pool_resumes_in_that_step(make_engine):
    # 6 blocks of 4: r0 grows to hold all 6 and is swapped out needing a 7th: it can never come back.
    # When the queue reaches it, it is dropped ("capacity") and the swapped sequences behind it are
    # resumed in the same step, not one step later.
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=6, watermark=0.0, enable_prefix_caching=False,
                         preemption_mode="swap", preemption_policy="fewest-computed", num_cpu_blocks=32)
    for i, (prompt, max_tokens, priority) in enumerate([(8, 25, 0), (8, 13, 0), (1, 14, 0), (1, 7, 1)]):
        engine.add_request(f"r{i}", list(range(20 + 30 * i, 20 + 30 * i + prompt)),
                           SamplingParams(max_tokens=max_tokens, ignore_eos=True), priority=priority, arrival_s=0.0)
    run_checked(engine)
    (dropped,) = [e for e in tracer.events if e.kind == "finish" and e.reason == "capacity"]
    assert dropped.req_id == "r0"
    swapped_out = {e.req_id: e.step for e in tracer.events if e.kind == "swap_out" and e.step < dropped.step}
    resumed = [(e.step, e.req_id) for e in tracer.events if e.kind == "swap_in" and e.step >= dropped.step]
    # r2 had been swapped out behind r0 (after r0's own swap-out)
    assert swapped_out["r2"] > swapped_out["r0"]
    assert (dropped.step, "r2") in resumed


def test_a_free_event_lists_only_the_blocks_that_became_free(make_engine):
    # A and B share two cached prompt blocks; A finishes first: its free event lists its own last block
    # only (the shared ones are still B's); B's, when it finishes, lists the shared ones too
    tracer = ListTracer()
    engine = make_engine(tracer, enable_prefix_caching=True)
    prefix = list(range(100, 108))
    a = engine.add_request("A", prefix + [1], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    b = engine.add_request("B", prefix + [2, 3], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    assert a.block_table[:2] == b.block_table[:2]
    a_blocks = list(a.block_table)
    run_checked(engine)
    frees = {e.req_id: e.blocks for e in tracer.events if e.kind == "free"}
    assert frees["A"] == [a_blocks[2]]
    assert set(a_blocks[:2]) <= set(frees["B"]) and a_blocks[2] not in frees["B"]


def test_cached_free_hits_are_counted_once_at_admission(make_engine):
    # 4 blocks of 4. A (9 prompt tokens, 2 outputs) finishes: its 2 full prompt blocks stay cached-free.
    # B shares those 8 tokens and needs 3 blocks: its 2 hits plus 1 of the 2 other free blocks. It is
    # admitted at once (charging each hit block once, not twice) and finishes within its 4 steps.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, enable_prefix_caching=True, watermark=0.0)
    prefix = list(range(100, 108))
    engine.add_request("A", prefix + [1], SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    assert engine.block_manager.num_cached_free_blocks == 2
    engine.add_request("B", prefix + [2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(4):
        engine.step()
        engine.check_integrity()
    assert not engine.has_unfinished()
    b_events = [(e.kind, e.num_tokens) for e in tracer.events if e.req_id == "B" and e.kind in ("admit", "prefix_hit")]
    assert b_events == [("prefix_hit", 8), ("admit", 2)] or b_events == [("admit", 2), ("prefix_hit", 8)]


def test_a_prefix_hit_needs_the_whole_chain_before_it(make_engine):
    # A and B share block 0 and block 2's tokens but not block 1's. C repeats B's prompt: it may reuse
    # B's blocks 0-2, never A's block 2 (its KV was computed after A's block 1): the same blocks, and
    # the same tokens as C alone
    p0, p2 = list(range(100, 104)), list(range(200, 204))
    a_prompt, b_prompt = p0 + [1, 2, 3, 4] + p2 + [9], p0 + [5, 6, 7, 8] + p2 + [9]
    alone = make_engine(enable_prefix_caching=True)
    c_alone = alone.add_request("C", b_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    run_checked(alone)
    tracer = ListTracer()
    engine = make_engine(tracer, enable_prefix_caching=True)
    a = engine.add_request("A", a_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    b = engine.add_request("B", b_prompt, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    c = engine.add_request("C", b_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    hits = {e.req_id: e.blocks for e in tracer.events if e.kind == "prefix_hit"}
    assert hits["B"] == a.block_table[:1]
    assert hits["C"] == b.block_table[:3] and a.block_table[2] not in hits["C"]
    run_checked(engine)
    assert c.token_ids == c_alone.token_ids


def test_a_request_that_exactly_fits_the_pool_runs(make_engine):
    # 8 blocks of 4: 32 positions is the most a sequence can ever hold; the watermark (0.25) holds
    # back admissions while others run, not what can fit at all (as in vLLM V1). "fits" needs 31 + 1
    # positions and runs; "exact" fills all 32 with its prompt and, with max_tokens 1, runs too (its
    # one sampled token is never stored: V1 admits it, docs/scheduling.md); "too-big" needs 33 and
    # is rejected.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=8, watermark=0.25, enable_prefix_caching=False)
    engine.add_request("fits", list(range(100, 131)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request("exact", list(range(200, 232)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request("too-big", list(range(300, 333)), SamplingParams(max_tokens=1, ignore_eos=True))
    run_checked(engine)
    finishes = {e.req_id: e.reason for e in tracer.events if e.kind == "finish"}
    assert finishes == {"fits": "length", "exact": "length", "too-big": "rejected"}


def test_every_step_records_the_pool_as_the_block_tables_hold_it(make_engine):
    # prefix sharing, forks and swapping: each record's used / free / cached blocks are the pool's
    # after scheduling (used: the distinct blocks in running block tables; they add up to the total)
    tracer = ListTracer()
    engine, bm = integrity_state(make_engine, 0, tracer)
    pool = probe_schedule(engine, lambda e, out: (
        {b for s in e.scheduler.running for b in s.block_table},
        sum(1 for b in e.block_manager.free_queue if e.block_manager.blocks[b].hash is not None),
        distinct_kv_positions(e, out)))
    while engine.has_unfinished():
        engine.step()
        r = tracer.records[-1]
        held, cached, kv = pool[-1]
        assert (r.num_used_blocks, r.num_free_blocks, r.num_cached_blocks, r.num_total_blocks) == (
            len(held), 6 - len(held), cached, 6), r.step
        # KV positions, a shared one once: also right after the two samples come back from the host
        # sharing their prompt blocks again
        assert r.num_kv_tokens == kv, r.step
    assert any(e.kind == "swap_in" for e in tracer.events)


def test_a_swapped_sequence_needing_every_free_block_resumes(make_engine):
    # 4 blocks of 4, no watermark: r1 (10-token prompt, least important) is swapped out for r0; when r0
    # finishes, r1 needs all 4 blocks (its 3, plus one for its next position) and 4 are free: it
    # resumes in the next step, and does not wait forever
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, watermark=0.0, enable_prefix_caching=False,
                         preemption_mode="swap", preemption_policy="priority", num_cpu_blocks=4)
    for i, (prompt, max_tokens, priority) in enumerate([([30], 7, 1), (list(range(40, 50)), 10, 2), ([60, 61], 1, 1)]):
        engine.add_request(f"r{i}", prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                           priority=priority, arrival_s=0.0)
    for _ in range(40):
        if not engine.has_unfinished():
            break
        engine.step()
        engine.check_integrity()
    assert not engine.has_unfinished()
    r0_done = next(e.step for e in tracer.events if e.kind == "finish" and e.req_id == "r0")
    swap_ins = [(e.step, len(e.blocks)) for e in tracer.events if e.kind == "swap_in" and e.req_id == "r1"]
    assert swap_ins[0] == (r0_done + 1, 3) and engine.block_manager.num_blocks == 4


def test_a_swapped_sequence_whose_next_token_fits_its_last_block_resumes_on_its_own_blocks(make_engine):
    # 4 blocks of 4. R needs a second block in step 1: S (least important) is swapped out with 7
    # positions in 2 blocks; its next token (position 7) still fits the second. T's 1 block frees in
    # step 1: 2 blocks free are enough for S, which resumes in step 2, not after R finishes.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, watermark=0.0, enable_prefix_caching=False,
                         preemption_mode="swap", preemption_policy="priority", num_cpu_blocks=4)
    engine.add_request("R", [10, 11, 12, 13], SamplingParams(max_tokens=6, ignore_eos=True), priority=0, arrival_s=0.0)
    engine.add_request("S", list(range(20, 27)), SamplingParams(max_tokens=6, ignore_eos=True), priority=2, arrival_s=0.0)
    engine.add_request("T", [30], SamplingParams(max_tokens=2, ignore_eos=True), priority=1, arrival_s=0.0)
    run_checked(engine)
    story = [(e.step, e.kind, e.req_id, e.num_tokens) for e in tracer.events if e.kind in ("preempt", "swap_in")]
    assert story[:2] == [(1, "preempt", "S", 7), (2, "swap_in", "S", 7)]


def test_a_sequence_that_preempts_itself_ends_the_running_pass(make_engine):
    # 4 blocks of 4, priority policy. A (least important) arrives first, B a step later: the batch
    # is A, B, holding 2 blocks each. In step 2 A needs a third block and is its own victim; as in
    # vLLM V1 that ends the running pass, so B, after it in the batch, decodes again from step 3.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, watermark=0.0, enable_prefix_caching=False,
                         preemption_mode="recompute", preemption_policy="priority")
    engine.add_request("A", list(range(10, 17)), SamplingParams(max_tokens=6, ignore_eos=True), priority=2, arrival_s=0.0)
    engine.step()
    engine.add_request("B", list(range(20, 27)), SamplingParams(max_tokens=6, ignore_eos=True), priority=0, arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id) for e in tracer.events if e.kind == "preempt"][0] == (2, "A")
    b_steps = [r.step for r in tracer.records for rid in r.token_req_ids if rid == "B"]
    assert b_steps == [1, 3, 4, 5, 6, 7]


def test_a_sequence_preempted_after_one_position_is_resumed_not_new(make_engine):
    # 3 blocks of 4, newest first. A (8-token prompt) then B (1 token): after step 0 A needs a third
    # block for position 8 and B, the newest, is preempted having computed its one position. Its
    # readmission is a resume (it recomputes that position), not a new admission.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=3, watermark=0.0, enable_prefix_caching=False,
                         preemption_mode="recompute", preemption_policy="newest")
    engine.add_request("A", list(range(10, 18)), SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=0.0)
    engine.add_request("B", [40], SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=0.0)
    run_checked(engine)
    b = [(e.kind, e.reason, e.num_tokens) for e in tracer.events if e.req_id == "B" and e.kind in ("admit", "preempt")]
    assert b[:3] == [("admit", "new", 1), ("preempt", "recompute", 1), ("admit", "resume-recompute", 2)]


def test_a_swapped_sequence_that_exactly_fits_the_pool_above_the_watermark_comes_back(make_engine):
    # 7 blocks of 4, 1 kept free (watermark 0.15): a sequence may hold 6 blocks, 24 positions. A
    # (20-token prompt) is swapped out for B in step 4 with 23 positions computed and its 24th
    # pending: it fits exactly, so it comes back when B finishes (not dropped as outgrowing the pool)
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=7, watermark=0.15, enable_prefix_caching=False,
                         preemption_mode="swap", preemption_policy="newest", num_cpu_blocks=16)
    engine.add_request("B", [40], SamplingParams(max_tokens=12, ignore_eos=True), arrival_s=0.0)
    engine.add_request("A", list(range(10, 30)), SamplingParams(max_tokens=5, ignore_eos=True), arrival_s=0.0)
    run_checked(engine)
    story = [(e.step, e.kind, e.req_id, e.num_tokens) for e in tracer.events
             if e.kind in ("preempt", "swap_in") or (e.kind == "finish" and e.req_id == "A")]
    b_done = next(e.step for e in tracer.events if e.kind == "finish" and e.req_id == "B")
    assert story == [(4, "preempt", "A", 23), (b_done + 1, "swap_in", "A", 23), (b_done + 1, "finish", "A", 5)]


def test_a_victim_taken_back_out_of_its_step_resumes_from_a_correct_prefix(make_engine):
    # 3 blocks of 4, priority policy. A (least important) runs alone, then B; at step 5 A is scheduled
    # for position 7, which fills its second block (cached when scheduled, as in V1), and then taken
    # back out as B's victim: that block is un-cached, its KV never written. C, whose prompt is A's first
    # 8 tokens and one more, recomputes the block and caches it again; A, resuming with those same 8
    # tokens, may reuse only its first block (a prefix hit always leaves the last token to compute).
    # Both match their runs alone, token for token.
    def alone(name, prompt, max_tokens, **kw):
        engine = make_engine(num_gpu_blocks=64, preemption_policy="priority")
        seq = engine.add_request(name, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True), **kw)
        run_checked(engine)
        return seq.token_ids

    a_alone = alone("A", [10, 11, 12], 6)
    c_prompt = a_alone[:8] + [7]
    c_alone = alone("C", c_prompt, 3)
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=3, preemption_policy="priority")
    a = engine.add_request("A", [10, 11, 12], SamplingParams(max_tokens=6, ignore_eos=True), priority=5, arrival_s=0.0)
    engine.step()
    engine.add_request("B", [30], SamplingParams(max_tokens=6, ignore_eos=True), priority=0, arrival_s=0.0)
    for _ in range(5):
        engine.step()
        engine.check_integrity()
    assert [(e.step, e.req_id, e.num_tokens) for e in tracer.events if e.kind == "preempt"] == [(5, "A", 7)]
    c = engine.add_request("C", c_prompt, SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=0.0)
    run_checked(engine)
    hits = [(e.req_id, e.num_tokens) for e in tracer.events if e.kind == "prefix_hit"]
    assert hits == [("C", 4), ("A", 4)]
    assert a.token_ids == a_alone and c.token_ids == c_alone
