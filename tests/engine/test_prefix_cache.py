"""Shared KV blocks: prefix caching, n > 1 sampling with copy-on-write, recompute that reuses the cache."""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import (
    PROMPT_A,
    PROMPT_B,
    ListTracer,
    four_block_engine,
    run_checked,
)
from tests.helpers.properties import examples

PREFIX = list(range(100, 112))  # 3 full blocks of 4


def test_shared_prefix_is_stored_once(make_engine):
    outputs = {}
    for caching in (False, True):
        tracer = ListTracer()
        engine = make_engine(tracer, enable_prefix_caching=caching)
        first = engine.add_request("1", PREFIX + [7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()  # the first request's prefill: its full blocks enter the cache
        second = engine.add_request("2", PREFIX + [5, 6, 4], SamplingParams(max_tokens=8, ignore_eos=True))
        engine.step()
        if caching:
            assert first.block_table[:3] == second.block_table[:3]
            assert [engine.block_manager.blocks[b].ref_count for b in first.block_table[:3]] == [2, 2, 2]
            assert first.block_table[3] != second.block_table[3]
            # the second request computed only its own 3 suffix tokens
            assert tracer.records[1].num_prefill_tokens == 3
            assert second.num_prefix_hit_tokens == 12
            hits = [e for e in tracer.events if e.kind == "prefix_hit"]
            assert [(e.req_id, e.blocks, e.num_tokens) for e in hits] == [("2", first.block_table[:3], 12)]
        else:
            assert tracer.records[1].num_prefill_tokens == 15
        run_checked(engine)
        outputs[caching] = (first.token_ids, second.token_ids)
    assert outputs[True] == outputs[False]


def test_parallel_sampling_shares_the_prompt_and_copies_on_write(make_engine):
    # --n-mode cow (vLLM V0's parallel sampling): one prefill, then samples forked onto its blocks
    tracer = ListTracer()
    engine = make_engine(tracer, enable_prefix_caching=False, n_mode="cow")
    prompt = [30, 31, 32, 33, 34, 35, 36, 37, 38, 39]  # 2 full blocks + a partial block of 2
    params = SamplingParams(max_tokens=6, temperature=1.0, seed=42, n=4, ignore_eos=True)
    parent = engine.add_request("r", prompt, params)
    engine.step()  # prefill, then fork: four samples on the same three blocks
    samples = [engine.outputs[("r", i)] for i in range(4)]
    assert all(s.block_table == parent.block_table for s in samples)
    assert [engine.block_manager.blocks[b].ref_count for b in parent.block_table] == [4, 4, 4]
    assert not [e for e in tracer.events if e.kind == "cow"]
    shared_partial = parent.block_table[2]
    engine.step()  # each sample writes position 10 into the shared partial block
    cows = [e for e in tracer.events if e.kind == "cow"]
    assert len(cows) == 3  # the last writer finds the block its own
    assert all(e.src_blocks == [shared_partial] for e in cows)
    assert all(e.num_tokens == 2 for e in cows)
    assert [engine.block_manager.blocks[b].ref_count for b in samples[0].block_table[:2]] == [4, 4]
    run_checked(engine)
    assert not [e for e in tracer.events if e.kind == "cow" and e.step > 1]
    # each sample equals the same sample run alone (sample i draws from seed + i)
    for i, sample in enumerate(samples):
        alone = make_engine()
        seq = alone.add_request(f"alone{i}", prompt, SamplingParams(max_tokens=6, temperature=1.0, seed=42 + i,
                                                                    ignore_eos=True))
        run_checked(alone)
        assert sample.token_ids == seq.token_ids, i


def test_recompute_reuses_still_cached_blocks(make_engine):
    reference, _, _, b_ref = four_block_engine(make_engine, "recompute", num_gpu_blocks=16)
    run_checked(reference)
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=4, enable_prefix_caching=True,
                         max_num_batched_tokens=64)
    engine.add_request("A", PROMPT_A, SamplingParams(max_tokens=6, ignore_eos=True))
    b = engine.add_request("B", PROMPT_B, SamplingParams(max_tokens=4, ignore_eos=True))
    run_checked(engine)
    assert b.token_ids == b_ref.token_ids
    # B's freed tail block was evicted for A; its first block (p0..p3) survived in the cache
    reprefill = next(e for e in tracer.events if e.kind == "reprefill")
    assert (reprefill.num_tokens, reprefill.num_cached_tokens, reprefill.num_recomputed_tokens) == (9, 4, 4)
    assert b.num_recomputed_tokens == 4
    assert [e.num_tokens for e in tracer.events if e.kind == "prefix_hit" and e.req_id == "B"] == [4]
    assert sum(r.num_recompute_tokens for r in tracer.records) == 4


@pytest.mark.long  # a property test of whole random workloads
@settings(max_examples=examples(20), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), slack=st.integers(0, 8), num_cpu_blocks=st.integers(0, 12))
def test_invariants_with_caching_and_samples(make_engine, seed, slack, num_cpu_blocks):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 512) for _ in range(rng.choice([0, 4, 9]))]
    workload = []
    for i in range(rng.randint(2, 6)):
        prompt = prefix + [rng.randrange(3, 512) for _ in range(rng.randint(1, 12))]
        n = rng.choice([1, 1, 2, 3])
        params = SamplingParams(max_tokens=rng.randint(1, 10), ignore_eos=True, n=n,
                                temperature=0.0 if n == 1 else 0.8, seed=i)
        workload.append((prompt, params))
    need = max(-(-(len(t) + p.max_tokens) // 4) for t, p in workload)  # each sample fits alone

    def run(**settings):
        engine = make_engine(max_num_batched_tokens=16, **settings)
        for i, (prompt, params) in enumerate(workload):
            engine.add_request(str(i), prompt, params)
        run_checked(engine)
        assert all(s.finish_reason == "length" for s in engine.outputs.values())
        return {key: s.token_ids for key, s in engine.outputs.items()}

    reference = run(num_gpu_blocks=512)
    for mode in ("recompute", "swap"):
        assert run(num_gpu_blocks=need + slack, preemption_mode=mode, num_cpu_blocks=num_cpu_blocks) == reference


def test_a_hash_collision_never_maps_another_prompts_blocks(make_engine, monkeypatch):
    """Block hashes are 64-bit, so two different blocks can share one. The prefix cache compares a
    hit's tokens as well: with a hash that collides for every block at the same position, B (other
    tokens than A's) finds A's cached blocks under its hashes and still computes its own, and its
    outputs are those of a run without the prefix cache."""
    import engine.block_manager

    def outputs(caching: bool) -> tuple[list, list]:
        tracer = ListTracer()
        engine = make_engine(tracer, num_gpu_blocks=16, enable_prefix_caching=caching)
        a = engine.add_request("A", list(range(20, 29)), SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=0.0)
        run_checked(engine)
        b = engine.add_request("B", list(range(40, 49)), SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=0.0)
        run_checked(engine)
        return [a.token_ids, b.token_ids], [e for e in tracer.events if e.kind == "prefix_hit"]

    monkeypatch.setattr(engine.block_manager, "chain_hash", lambda prev, tokens: hash((prev, len(tokens))))
    tokens, hits = outputs(caching=True)
    assert hits == []
    assert tokens == outputs(caching=False)[0]


@pytest.mark.parametrize("block, where", [(1, 0), (1, 3), (0, 0)])
def test_blocks_differing_in_one_token_are_cached_apart_and_each_is_found(make_engine, block, where):
    """A and B (two blocks of 4 and a token) differ only in one token: the first or the last of their
    second block, or the first of their first. Each block gets a hash of its own, so C (B's 8 tokens
    and one more) finds B's two blocks, not one of A's under B's hash (which the token check would then
    refuse, losing the hit)."""
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=16)

    def prompt(token: int, last: int) -> list[int]:
        ids = [20, 21, 22, 23, 40, 41, 42, 43, last]
        ids[4 * block + where] = token
        return ids

    for name, token in (("A", 30), ("B", 31)):
        engine.add_request(name, prompt(token, 44), SamplingParams(max_tokens=2, ignore_eos=True))
        run_checked(engine)
    engine.add_request("C", prompt(31, 50), SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    hits = [(e.req_id, e.num_tokens) for e in tracer.events if e.kind == "prefix_hit"]
    assert hits == ([("B", 4), ("C", 8)] if block == 1 else [("C", 8)])


def test_a_prompt_admitted_later_in_the_same_step_hits_the_blocks_an_earlier_one_computes(make_engine):
    """V1 caches the blocks a step computes when it schedules them: P (one block) is cached by A; B
    and C arrive together with P and the same two blocks more. B, admitted first, hits P and computes
    the two blocks; C, admitted next in the same step, hits all three (their KV is written in the same
    forward, before any attention reads it)."""
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=32, max_num_batched_tokens=64)
    shared = [20, 21, 22, 23]
    engine.add_request("A", shared + [30], SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    more = [40, 41, 42, 43, 44, 45, 46, 47]
    engine.add_request("B", shared + more + [50], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("C", shared + more + [60], SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    hits = [(e.step, e.req_id, e.num_tokens) for e in tracer.events if e.kind == "prefix_hit"]
    assert hits == [(hits[0][0], "B", 4), (hits[0][0], "C", 12)]


def test_only_the_blocks_a_chunk_computes_are_cached_for_a_prompt_admitted_beside_it(make_engine):
    """A 21-token prompt prefilled in chunks of 7 beside another request (blocks of 4): after its second chunk it has computed
    14 positions and holds 4 blocks, the last half computed though all its tokens are known. C, the
    same prompt arriving then and admitted in that step, hits the 3 blocks whose KV is written, not
    the fourth."""
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=32, max_num_batched_tokens=64, long_prefill_token_threshold=7)
    prompt = list(range(20, 41))
    engine.add_request("A", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.add_request("B", [60, 61, 62], SamplingParams(max_tokens=8, ignore_eos=True))   # A is not alone
    engine.step()
    engine.add_request("C", prompt, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    engine.check_integrity()
    assert [(e.req_id, e.num_tokens) for e in tracer.events if e.kind == "prefix_hit"] == [("C", 12)]
    run_checked(engine)
