"""The block pool (engine/block_manager.py): a duplicate cached block evicted before its primary,
caching under async scheduling, a forked sample that needs a copy and a new block at once, taking a
sequence that shares its blocks back out of a step, and the integrity check's books of duplicates and
shared host blocks."""
from __future__ import annotations

import re
from collections import Counter

import pytest

from engine.block_manager import BlockManager
from engine.events import with_evictions
from engine.sequence import SamplingParams, Sequence
from tests.helpers.engine_runs import ListTracer, integrity_state, run_checked


def ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def kinds(tracer, step: int, *wanted: str) -> list[tuple]:
    return [(e.kind, e.req_id, e.blocks) for e in with_evictions(tracer.records[step].events) if e.kind in wanted]


def hand_built(req_id: str, token_ids: list[int], sample: int = 0) -> Sequence:
    return Sequence(req_id, sample, token_ids, ignore_eos(8), arrival_s=0.0, priority=0, admit_order=0)


# ---------------------------------------------------------------- the prefix cache

def test_a_duplicate_evicted_before_its_primary_leaves_the_primary_serving_hits(make_engine):
    # 6 blocks of 4, chunks of 3 while others wait. A and B share their first 4 tokens and are both
    # admitted in step 0 with 3 of them, so each completes its own copy in step 1: A's (block 1) is
    # the one a lookup finds, B's (block 2) a duplicate. B stops after one token: its copy goes to the
    # back of the free queue, and four 3-token requests in step 2 take every free block, evicting it.
    # A's copy stays cached and indexed: E hits it in step 3.
    shared = [60, 61, 62, 63]
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=6, long_prefill_token_threshold=3)
    engine.add_request("A", shared + [70, 71], ignore_eos(3), arrival_s=0.0)
    engine.add_request("B", shared + [80, 81], ignore_eos(1), arrival_s=0.0)
    engine.step()
    engine.step()
    engine.check_integrity()
    bm = engine.block_manager
    h = bm.blocks[1].hash
    assert bm.hash_to_block_id == {h: 1} and bm.duplicates == {h: [2]}
    assert list(bm.free_queue) == [4, 5, 6, 2]
    for i in range(4):
        engine.add_request(f"D{i}", [100 + 3 * i, 101 + 3 * i, 102 + 3 * i], ignore_eos(1), arrival_s=0.0)
    engine.step()
    engine.check_integrity()
    assert kinds(tracer, 2, "evict") == [("evict", "", [2])]
    assert bm.duplicates == {} and bm.hash_to_block_id[h] == 1
    engine.add_request("E", shared + [99, 98], ignore_eos(1), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id, e.blocks) for e in tracer.events if e.kind == "prefix_hit"] == [(3, "E", [1])]


def test_the_free_queue_view_counts_and_finds_the_blocks_of_both_its_parts(make_engine):
    # the pool of the test above after its step 1: blocks 4-6 free and uncached (the stack), block 2
    # free and cached (the LRU part), blocks 1 and 3 held. The view is one queue over both parts.
    engine = make_engine(ListTracer(), num_gpu_blocks=6, long_prefill_token_threshold=3)
    engine.add_request("A", [60, 61, 62, 63, 70, 71], ignore_eos(3), arrival_s=0.0)
    engine.add_request("B", [60, 61, 62, 63, 80, 81], ignore_eos(1), arrival_s=0.0)
    engine.step()
    engine.step()
    bm = engine.block_manager
    assert bm.free_uncached and list(bm.free_cached) == [2]
    queue = bm.free_queue
    assert len(queue) == 4 == len(list(queue))
    assert [b for b in range(8) if b in queue] == [2, 4, 5, 6]


def test_a_block_completed_by_a_token_still_in_flight_is_not_offered_to_a_hit_before_delivery(make_engine):
    # Async scheduling, blocks of 4. A's 3-token prompt runs in step 0 (block 1); its first output
    # token x0 is sampled but not delivered when step 1 is scheduled with x0 as A's input at position
    # 3, which fills block 1. As V1 caches up to the delivered tokens only, block 1 is not in the
    # cache when B (A's prompt and x0, then one more) is admitted in step 1: B computes its own copy
    # (block 2). Once x0 is delivered, A's block is cached in step 2 too, as B's duplicate; C hits B's.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=16, async_scheduling=True)
    a = engine.add_request("A", [31, 32, 33], ignore_eos(4), arrival_s=0.0)
    engine.step()
    assert a.num_undelivered == 1
    prefix = a.token_ids[:4]
    engine.add_request("B", prefix + [7], ignore_eos(1), arrival_s=0.0)
    engine.step()
    engine.add_request("C", prefix + [8], ignore_eos(1), arrival_s=0.0)
    engine.step()
    bm = engine.block_manager
    h = bm.blocks[2].hash
    assert bm.hash_to_block_id[h] == 2 and bm.duplicates == {h: [1]}
    run_checked(engine)
    assert kinds(tracer, 1, "alloc", "prefix_hit") == [("alloc", "B", [2, 3])]
    assert [(e.step, e.req_id, e.blocks) for e in tracer.events if e.kind == "prefix_hit"] == [(2, "C", [2])]


def test_taking_a_forked_sample_back_out_of_its_step_keeps_the_blocks_it_shares_cached():
    # The pool alone, blocks of 4, prefix caching. P's 9-token prompt fills blocks 1 and 2 (cached
    # when allocated) and C is forked from it, sharing them. Taking C back out of a step from its
    # first block on drops only what C alone holds: P's KV is in the shared blocks, so they stay
    # cached, and a later prompt with the same 8 tokens still hits them. (Today's scheduler takes a
    # sequence back only in its running pass, where the blocks it cached that step are its own: a
    # shared block is copied before it is written. The pool must not rely on that.)
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=0, enable_prefix_caching=True, watermark_blocks=0)
    prompt = list(range(40, 49))
    parent = hand_built("P", prompt)
    bm.allocate(parent, [], len(prompt), "new")
    parent.num_computed_tokens = len(prompt)
    child = hand_built("P", prompt, sample=1)
    bm.fork(parent, child)
    assert child.block_hashes == parent.block_hashes and len(parent.block_hashes) == 2
    bm.uncache_from(child, 0)
    assert child.block_hashes == []
    bm.check_integrity([parent, child])
    assert bm.match_prefix(hand_built("Q", prompt[:8] + [1])) == parent.block_table[:2]


# ---------------------------------------------------------------- copy-on-write

def test_a_forked_sample_writing_past_its_shared_last_block_needs_a_block_for_the_copy_too():
    # The pool alone, blocks of 4, no prefix caching. P's 6-token prompt fills block 1 and half of
    # block 2; C is forked from it. C's next 3 positions (6..8) go to the shared block 2, which C must
    # copy first, and past it: two free blocks, not one, and grow then does both. (Today's scheduler
    # gives a forked sample one position a step, so it needs the copy or a new block, never both;
    # can_grow and grow are written for both, and a can_grow that says yes must leave grow enough.)
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=0, enable_prefix_caching=False, watermark_blocks=0)
    prompt = list(range(50, 56))
    parent = hand_built("P", prompt)
    bm.allocate(parent, [], len(prompt), "new")
    parent.num_computed_tokens = len(prompt)
    child = hand_built("P", prompt + [1, 2, 3], sample=1)
    bm.fork(parent, child)
    other = hand_built("O", [9])
    bm.allocate(other, [], 1, "new")   # the pool's last block but one
    assert bm.num_free_blocks == 1
    assert not bm.can_grow(child, 3)
    assert bm.can_grow(child, 2)        # positions 6 and 7: the copy alone
    bm.free(other, "finish")
    assert bm.num_free_blocks == 2 and bm.can_grow(child, 3)
    assert bm.grow(child, 3) == (2, 3)
    assert child.block_table == [1, 3, 4] and parent.block_table == [1, 2] and bm.num_free_blocks == 0
    bm.check_integrity([parent, child])


# ---------------------------------------------------------------- swapping a forked group

def swapped_group(prompt: list[int], decoded: int) -> tuple[BlockManager, Sequence, Sequence]:
    """The pool alone, blocks of 4, 8 host blocks, no prefix caching: P's prompt allocated and
    computed, C forked from it, each decoding `decoded` positions of its own (one new block or
    copy-on-write as the scheduler would), then a token more each, and the pair swapped out as
    one group."""
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=8, enable_prefix_caching=False, watermark_blocks=0)
    parent = hand_built("P", list(prompt))
    bm.allocate(parent, [], len(prompt), "new")
    parent.num_computed_tokens = len(prompt)
    child = hand_built("P", list(prompt), sample=1)
    bm.fork(parent, child)
    for k in range(decoded):
        for seq, token in ((parent, 100 + k), (child, 200 + k)):
            seq.token_ids.append(token)
            bm.grow(seq, 1)
            seq.num_computed_tokens += 1
    parent.token_ids.append(1)
    child.token_ids.append(2)
    bm.check_integrity([parent, child])
    assert bm.can_swap_out([parent, child])
    bm.swap_out([parent, child])
    bm.check_integrity([parent, child])
    bm.take_events()
    return bm, parent, child


@pytest.mark.parametrize("prompt_len, decoded, needed, copies", [
    (4, 1, 3, 0),   # block 0 shared, each writes its own block 1: 3 host blocks, no copy (none for block 0)
    (6, 0, 3, 1),   # both write to the shared, half-full block 1: 2 host blocks and one copy, the first writer's
    (8, 0, 4, 0),   # the shared blocks are full: 2 host blocks and a new block 2 each, no copy
    (5, 3, 5, 0),   # each wrote past block 1's copy: 3 host blocks and a new block 2 each, no copy
])
def test_a_forked_group_swapped_in_takes_the_blocks_its_count_said(prompt_len, decoded, needed, copies):
    # num_swap_in_blocks is what can_swap_in judges the pool by: the distinct host blocks, new blocks
    # past them, and a copy for each write to a block still shared. Whatever the group shares, the
    # swap-in and the step's growth must take exactly that many device blocks, no more, no fewer.
    bm, parent, child = swapped_group(list(range(10, 10 + prompt_len)), decoded)
    group, new_tokens = [parent, child], [1, 1]
    assert bm.num_swap_in_blocks(group, new_tokens) == needed
    free_before = bm.num_free_blocks
    bm.swap_in(group)
    made = [bm.grow(seq, num_new) for seq, num_new in zip(group, new_tokens)]
    bm.check_integrity(group)
    assert free_before - bm.num_free_blocks == needed
    assert sum(1 for copy in made if copy) == copies


def test_a_sample_whose_blocks_its_group_brought_back_gets_no_empty_swap_in_event():
    # P's 8-token prompt fills two blocks and C shares both (no position of its own yet): the group's
    # swap-in copies them back once, with P. C takes no block of its own, so it has no alloc event
    # (an empty one would be a block event naming no block); its swap-in event says it holds them.
    bm, parent, child = swapped_group(list(range(10, 18)), 0)
    bm.swap_in([parent, child])
    allocs = [(e.req_id, e.sample, e.blocks) for e in bm.take_events() if e.kind == "alloc"]
    assert allocs == [("P", 0, parent.block_table)]
    assert child.block_table == parent.block_table
    bm.check_integrity([parent, child])


# ---------------------------------------------------------------- the integrity check

def unindex(bm: BlockManager, block_id: int) -> int:
    """Take a cached block's hash out of the lookup index; return the hash."""
    h = bm.blocks[block_id].hash
    del bm.hash_to_block_id[h]
    return h


INTEGRITY_CORRUPTIONS = {  # what breaks -> (steps of integrity_state, how, the check's message)
    "a shared host block's count lost": (3, lambda bm: bm.host_refs.pop(0), "host block 0 held 2 times, counted 1"),
    "an empty duplicate list": (1, lambda bm: bm.duplicates.__setitem__(bm.blocks[1].hash, []),
                                "duplicate without a primary"),
    "a duplicate without its primary": (1, lambda bm: bm.duplicates.__setitem__(unindex(bm, 1), [1]),
                                        "duplicate without a primary"),
}


@pytest.mark.parametrize("what", INTEGRITY_CORRUPTIONS)
def test_the_integrity_check_catches_broken_duplicate_and_host_books(make_engine, what):
    steps, corrupt, message = INTEGRITY_CORRUPTIONS[what]
    engine, bm = integrity_state(make_engine, steps)
    corrupt(bm)
    with pytest.raises(AssertionError, match=re.escape(message)):
        engine.check_integrity()


def test_taking_no_blocks_takes_none_and_taking_them_all_takes_the_front_first():
    bm = BlockManager(num_blocks=4, block_size=4, num_cpu_blocks=0, enable_prefix_caching=False, watermark_blocks=0)
    front = list(bm.free_queue)
    assert bm._allocate_blocks(0) == [] and list(bm.free_queue) == front   # a zero-length slice is not the stack
    assert bm._allocate_blocks(4) == front and len(bm.free_queue) == 0
    assert all(bm.blocks[b].ref_count == 1 for b in front)


@pytest.mark.parametrize("caching", [True, False])
@pytest.mark.parametrize("n_mode", ["independent", "cow"])
def test_every_block_a_request_takes_comes_back_in_its_free_events(make_engine, caching, n_mode):
    # requests shorter than a block (no full block: nothing cached), longer ones (their full blocks
    # cached under prefix caching), and forked samples sharing blocks: whatever part of the pool a
    # release takes, each finished sequence's free event names every block it took that is free again
    tracer = ListTracer()
    engine = make_engine(tracer, enable_prefix_caching=caching, n_mode=n_mode)
    engine.add_request("short", [5, 6], ignore_eos(1), arrival_s=0.0)
    engine.add_request("long", list(range(20, 31)), ignore_eos(6), arrival_s=0.0)
    engine.add_request("forked", [40, 41, 42, 43, 44], ignore_eos(5, n=2), arrival_s=0.0)
    run_checked(engine)
    events = tracer.events
    assert {e.req_id for e in events if e.kind == "free"} == {"short", "long", "forked"}
    # every block ends free: each one taken (alloc) as often as it came back (free)
    assert Counter(b for e in events if e.kind == "alloc" for b in e.blocks) == \
        Counter(b for e in events if e.kind == "free" for b in e.blocks)


def test_taking_a_chunk_back_out_of_its_step_uncaches_the_blocks_it_would_have_completed():
    # The pool alone, blocks of 4, prefix caching. P's 12-token prompt is prefilled in chunks: the first
    # (5 tokens) completes block 1; the second (7) is scheduled, which caches blocks 2 and 3 at once (V1
    # caches on scheduling), and is then taken back out of the step: their KV is never written, so
    # they must leave the cache (a hit on them would read nothing), while block 1 stays cached.
    bm = BlockManager(num_blocks=8, block_size=4, num_cpu_blocks=0, enable_prefix_caching=True, watermark_blocks=0)
    prompt = list(range(60, 72))
    seq = hand_built("P", prompt)
    bm.allocate(seq, [], 5, "new")
    seq.num_computed_tokens = 5
    first = seq.block_table[0]
    bm.grow(seq, 7)
    assert len(seq.block_hashes) == 3 and len(bm.hash_to_block_id) == 3
    taken = seq.block_table[1:3]
    bm.uncache_from(seq, 1)
    assert seq.block_hashes == [bm.blocks[first].hash] and list(bm.hash_to_block_id.values()) == [first]
    assert all(bm.blocks[b].hash is None and bm.blocks[b].token_ids is None for b in taken)
    assert bm.match_prefix(hand_built("Q", prompt + [1])) == [first]
    bm.check_integrity([seq])


@pytest.mark.parametrize("engine_kind", ["real", "sim"])
def test_without_prefix_caching_no_block_is_ever_hashed(make_engine, engine_kind):
    # chunked prefills, decodes (the simulator's fast path: its cohort and leaps), preemptions
    # and swaps in a tight pool: with the prefix cache off, nothing registers a block in it
    sim = dict(engine="sim", hardware="a100-80gb") if engine_kind == "sim" else {}
    engine = make_engine(ListTracer(), enable_prefix_caching=False, num_gpu_blocks=24, num_cpu_blocks=40,
                         preemption_mode="swap", long_prefill_token_threshold=5, **sim)
    for i in range(8):
        engine.add_request(f"r{i}", [7 + i] * (3 + 2 * i), ignore_eos(6 + 3 * i), arrival_s=0.0)
    bm = engine.block_manager
    swaps = 0
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        swaps += engine.tracer.records[-1].num_preemptions
        assert not bm.hash_to_block_id and all(b.hash is None for b in bm.blocks)
        assert all(not seq.block_hashes for seq in engine.scheduler.all_seqs())
    assert swaps >= 2
