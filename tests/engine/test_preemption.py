"""Preemption when blocks run out: the four-block scenario, transparency, swap-full fallback."""
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
    random_workload,
    run_checked,
)
from tests.helpers.properties import examples


def story(tracer) -> list[tuple]:
    return [(e.step, e.kind, e.req_id, e.blocks, e.num_tokens, e.reason) for e in tracer.events]


def token_steps(tracer, req_id: str) -> list[int]:
    return [r.step for r in tracer.records for rid in r.token_req_ids if rid == req_id]


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_four_block_scenario(make_engine, mode):
    unconstrained, _, a_ref, b_ref = four_block_engine(make_engine, mode, num_gpu_blocks=16)
    run_checked(unconstrained)

    engine, tracer, a, b = four_block_engine(make_engine, mode)
    engine.step()
    engine.step()
    engine.check_integrity()
    # after the prefill step and one decode step: 2 blocks and 8 KV positions each, x0 and x1 delivered
    # block 0 is V1's null block: the pool's 4 blocks are 1..4
    assert (a.block_table, b.block_table) == ([1, 2], [3, 4])
    assert a.num_computed_tokens == b.num_computed_tokens == 8
    assert a.num_output_tokens == b.num_output_tokens == 2
    assert engine.block_manager.num_free_blocks == 0
    run_checked(engine)

    assert a.token_ids == a_ref.token_ids and b.token_ids == b_ref.token_ids
    assert a.num_output_tokens == 6 and b.num_output_tokens == 4
    assert a.num_preemptions == 0 and b.num_preemptions == 1
    head = [
        (0, "admit", "A", None, 7, "new"), (0, "alloc", "A", [1, 2], 0, "prefill"),
        (0, "admit", "B", None, 7, "new"), (0, "alloc", "B", [3, 4], 0, "prefill"),
    ]
    # freed blocks are released tail first and reused most recently freed first (V1's free queue)
    if mode == "recompute":
        assert story(tracer) == head + [
            (2, "preempt", "B", [3, 4], 8, "recompute"), (2, "free", "B", [4, 3], 0, "preempt"),
            (2, "alloc", "A", [4], 0, "decode"),
            (5, "free", "A", [4, 2, 1], 0, "finish"), (5, "finish", "A", None, 6, "length"),
            # re-admitted only once 3 blocks are free: 9 tokens re-prefilled, 8 of them recomputed
            (6, "admit", "B", None, 9, "resume-recompute"), (6, "alloc", "B", [4, 2, 1], 0, "prefill"),
            (6, "reprefill", "B", None, 9, None),
            (7, "free", "B", [1, 2, 4], 0, "finish"), (7, "finish", "B", None, 4, "length"),
        ]
        reprefill = next(e for e in tracer.events if e.kind == "reprefill")
        assert reprefill.num_recomputed_tokens == 8 and b.num_recomputed_tokens == 8
        assert sum(r.num_recompute_tokens for r in tracer.records) == 8
    else:
        assert story(tracer) == head + [
            (2, "preempt", "B", [3, 4], 8, "swap"), (2, "free", "B", [4, 3], 0, "preempt"),
            (2, "swap_out", "B", [3, 4], 8, None), (2, "alloc", "A", [4], 0, "decode"),
            (5, "free", "A", [4, 2, 1], 0, "finish"), (5, "finish", "A", None, 6, "length"),
            # back into 2 newly allocated blocks, plus one more to process x1
            (6, "admit", "B", None, 1, "resume-swap"),
            (6, "alloc", "B", [4, 2], 0, "swap_in"), (6, "swap_in", "B", [4, 2], 8, None),
            (6, "alloc", "B", [1], 0, "decode"),
            (7, "free", "B", [1, 2, 4], 0, "finish"), (7, "finish", "B", None, 4, "length"),
        ]
        swaps = [e for e in tracer.events if e.kind in ("swap_out", "swap_in")]
        assert [e.bytes for e in swaps] == [2 * engine.geometry.bytes_per_block] * 2
        assert all(e.duration_ms is not None and e.duration_ms >= 0 for e in swaps)
        assert b.num_recomputed_tokens == 0 and b.num_swaps == 1
        assert sum(r.num_recompute_tokens for r in tracer.records) == 0
    # B's stall: x1 came at step 1, x2 only after A's remaining steps (2..5) and the resume
    assert token_steps(tracer, "B") == [0, 1, 6, 7]
    assert token_steps(tracer, "A") == [0, 1, 2, 3, 4, 5]
    assert engine.block_manager.num_free_blocks == 4


def run_workload(make_engine, workload, independent=None, **settings):
    engine = make_engine(**settings)
    if independent is not None:  # count positions the runner actually runs twice, on its own
        execute = engine.runner.execute
        computed: dict = {}

        def counting(out):
            for seq, n in zip(out.seqs, out.num_new_tokens):
                done = computed.setdefault(seq.req_id, set())
                positions = set(range(seq.num_computed_tokens, seq.num_computed_tokens + n))
                independent[0] += len(positions & done)
                done |= positions
            return execute(out)

        engine.runner.execute = counting
    seqs = [engine.add_request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (prompt, m) in enumerate(workload)]
    run_checked(engine)
    return engine, [s.token_ids for s in seqs]


@pytest.mark.long  # a property test of whole random workloads (minutes)
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), num_requests=st.integers(2, 8), slack=st.integers(0, 6),
       num_cpu_blocks=st.integers(0, 10), budget=st.sampled_from([8, 16, 64]),
       caching=st.booleans())
def test_preemption_is_invisible(make_engine, seed, num_requests, slack, num_cpu_blocks, budget, caching):
    rng = random.Random(seed)
    workload = random_workload(rng, num_requests)
    need = max(-(-(len(p) + m) // 4) for p, m in workload)  # every request fits alone
    _, reference = run_workload(make_engine, workload, num_gpu_blocks=256)
    for mode in ("recompute", "swap"):
        for policy in ("newest", "priority", "fewest-computed"):
            independent = [0]
            engine, tokens = run_workload(
                make_engine, workload, independent, num_gpu_blocks=need + slack, preemption_mode=mode,
                preemption_policy=policy, num_cpu_blocks=num_cpu_blocks, max_num_batched_tokens=budget,
                enable_prefix_caching=caching)
            assert tokens == reference, (mode, policy)
            seqs = engine.outputs.values()
            assert all(s.finish_reason == "length" for s in seqs)
            assert independent[0] == sum(s.num_recomputed_tokens for s in seqs)


def test_swap_full_falls_back_to_recompute(make_engine):
    tracer = ListTracer()
    rng = random.Random(5)
    workload = random_workload(rng, 6)
    _, reference = run_workload(make_engine, workload, num_gpu_blocks=256)
    engine = make_engine(tracer, num_gpu_blocks=12, preemption_mode="swap", num_cpu_blocks=2,
                         max_num_batched_tokens=64)
    seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(workload)]
    run_checked(engine)
    assert [s.token_ids for s in seqs] == reference
    reasons = [e.reason for e in tracer.events if e.kind == "preempt"]
    assert "swap-full-fallback" in reasons and "swap" in reasons


def test_priority_policy_preempts_least_important(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, preemption_policy="priority", enable_prefix_caching=False)
    # A arrives last but matters most (lower value): the older, less important B is preempted
    engine.add_request("B", PROMPT_B, SamplingParams(max_tokens=4, ignore_eos=True), priority=5)
    engine.add_request("A", PROMPT_A, SamplingParams(max_tokens=6, ignore_eos=True), priority=0)
    run_checked(engine)
    assert [e.req_id for e in tracer.events if e.kind == "preempt"] == ["B"]


def test_fewest_computed_policy(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=5, preemption_policy="fewest-computed",
                         enable_prefix_caching=False)
    engine.add_request("long", list(range(3, 14)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    run_checked(engine)
    # short has computed 4 positions to long's 12: it goes, and only it
    assert [(e.step, e.req_id, e.num_tokens, e.reason) for e in tracer.events if e.kind == "preempt"] == [
        (2, "short", 4, "recompute")]
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=6, preemption_policy="fewest-computed", enable_prefix_caching=False)
    engine.add_request("long", list(range(3, 14)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("mid", list(range(20, 26)), SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("short", [5, 6, 7], SamplingParams(max_tokens=8, ignore_eos=True))
    run_checked(engine)
    # every victim, in order: the sequence with the fewest computed positions each time
    assert [(e.step, e.req_id, e.num_tokens, e.reason) for e in tracer.events if e.kind == "preempt"] == [
        (2, "short", 4, "recompute"), (3, "mid", 8, "recompute"), (12, "short", 8, "recompute")]
    assert all(s.finish_reason == "length" and s.num_output_tokens == 8 for s in engine.outputs.values())


def test_request_that_can_never_fit_is_rejected(make_engine):
    engine = make_engine(num_gpu_blocks=4)
    too_big = engine.add_request("big", list(range(3, 19)), SamplingParams(max_tokens=2))  # 16 + 1 > 16
    fits = engine.add_request("ok", [3, 4, 5], SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    assert too_big.finish_reason == "rejected" and too_big.num_output_tokens == 0
    assert fits.finish_reason == "length"


def test_request_outgrowing_the_pool_finishes_with_capacity(make_engine):
    for mode in ("recompute", "swap"):
        engine = make_engine(num_gpu_blocks=3, preemption_mode=mode)
        seq = engine.add_request("grow", [3, 4, 5, 6, 7], SamplingParams(max_tokens=20, ignore_eos=True))
        run_checked(engine)
        assert seq.finish_reason == "capacity"
        assert seq.num_output_tokens == 12 - 5 + 1  # filled all 12 slots, then one more token sampled


@pytest.mark.long  # a property test of whole random workloads
@settings(max_examples=examples(25), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 10_000), mode=st.sampled_from(["recompute", "swap"]),
       policy=st.sampled_from(["newest", "priority", "fewest-computed", "newest-sparing"]))
def test_resumed_sequences_progress_before_being_preempted_again(make_engine, seed, mode, policy):
    # a token budget of 4 makes every re-prefill take several steps: the room a livelock needs.
    # Every policy finishes the workload (run_checked fails on a livelock); kvtrace's own policies
    # also never preempt a resumed sequence before it has delivered a token (V1's preempt the newest
    # unconditionally, as vLLM does)
    rng = random.Random(seed)
    workload = random_workload(rng, 8)
    need = max(-(-(len(p) + m) // 4) for p, m in workload)
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=need + 1, max_num_batched_tokens=4, preemption_mode=mode,
                         preemption_policy=policy, num_cpu_blocks=3)
    for i, (prompt, m) in enumerate(workload):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=m, ignore_eos=True), priority=i % 3)
    run_checked(engine)
    if policy in ("newest", "priority"):
        return
    resumed_without_token: set[str] = set()
    for record in tracer.records:
        for e in record.events:
            if e.kind == "admit" and e.reason != "new":
                resumed_without_token.add(e.req_id)
            if e.kind == "preempt":
                assert e.req_id not in resumed_without_token, f"{e.req_id} preempted again before progressing"
        resumed_without_token -= set(record.token_req_ids)


def test_victim_whose_blocks_are_all_shared_is_passed_over(make_engine):
    # O and A hold unique blocks; P (n=2, forked by copy-on-write) has just forked C, and P and C
    # share every block, so preempting C alone frees nothing. When O needs a block, newest-first
    # would pick C; the newest-sparing policy passes over it and takes the newest sequence whose
    # release frees blocks: A.
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=7, enable_prefix_caching=False, max_num_batched_tokens=64,
                         n_mode="cow", preemption_policy="newest-sparing")
    engine.add_request("O", [3, 4, 5, 6, 7, 8, 9], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("A", [30, 31, 32, 33, 34], SamplingParams(max_tokens=8, ignore_eos=True))
    engine.step()
    engine.add_request("P", list(range(10, 20)), SamplingParams(max_tokens=4, ignore_eos=True, n=2,
                                                                temperature=1.0, seed=1))
    engine.step()  # O and A decode; P prefills and forks C onto its 3 blocks
    assert engine.block_manager.num_free_blocks == 0
    engine.step()  # O needs a block for position 8
    preempts = [(e.req_id, e.sample) for e in tracer.events if e.kind == "preempt"]
    assert preempts == [("A", 0)]
    run_checked(engine)
    assert all(s.finish_reason == "length" for s in engine.outputs.values())


def test_a_request_id_used_twice_is_refused(make_engine):
    engine = make_engine()
    engine.add_request("r", [5, 6, 7])
    with pytest.raises(ValueError, match="used twice"):
        engine.add_request("r", [8, 9])


@pytest.mark.parametrize("version, scheduled", [("0.31.0", []), ("0.32.0", []), ("0.33.0", ["B"]), ("0.34.0", ["B"])])
def test_priority_pass_after_a_self_preemption_follows_the_vllm_version(version, scheduled):
    """A (least urgent) preempts itself for a block; vLLM 0.32 ends the running pass there, 0.33 goes
    on to B, whose decode needs no new block."""
    from engine.build import build_engine
    from engine.config import EngineConfig, scheduling_description

    engine = build_engine(EngineConfig(model="tiny", engine="sim", block_size=2, num_gpu_blocks=4, num_cpu_blocks=0,
                                       preemption_policy="priority", enable_prefix_caching=False, follow_vllm=version))
    engine.add_request("A", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True), priority=5)
    engine.step()   # A: blocks 1, 2
    engine.add_request("B", [4, 5, 6], SamplingParams(max_tokens=8, ignore_eos=True), arrival_s=1.0, priority=0)
    engine.step()   # A decodes into block 2; B admitted: blocks 3, 4; the pool is full
    out = engine.scheduler.schedule()   # A needs a block: it is the least urgent, it preempts itself
    assert out.num_preemptions == 1 and [s.req_id for s in engine.scheduler.waiting] == ["A"]
    assert [s.req_id for s in out.seqs] == scheduled
    assert scheduling_description(engine.config)["follows"] == f"vLLM {version} V1 scheduler and block pool"
    with pytest.raises(ValueError):
        engine.scheduler.follow("0.30.0")
    with pytest.raises(ValueError, match="--follow-vllm must be one of 0.31.0, 0.32.0, 0.33.0, 0.34.0, got '0.30.0'"):
        EngineConfig(model="tiny", engine="sim", follow_vllm="0.30.0")


@pytest.mark.parametrize("policy", ["newest", "fewest-computed"])
@pytest.mark.parametrize("seed", range(3))
def test_every_re_prefill_ends_in_one_event_that_counts_its_own_recomputation(tiny_loaded, seed, policy):
    """Every readmission after a recompute preemption ends in exactly one `reprefill` event: when its
    history is computed again, or cut short by another preemption (`interrupted`); and the events'
    recomputed tokens add up to the steps' recomputed tokens. A thrashing pool (18 blocks of 4) with
    re-prefills in chunks of 4 has sequences preempted twice and re-prefills cut short."""
    from engine.events import REPREFILL_INTERRUPTED, AdmitReason
    from tests.engine.test_simulation import backlog_workload, run

    requests = backlog_workload(seed, num_requests=24)
    for r in requests:
        r.n = 1   # each sequence a request of its own: one readmission count per request
    _, tracer = run(tiny_loaded, requests, engine="sim", hardware="a100-80gb", block_size=4, num_gpu_blocks=18,
                    watermark=0.0, preemption_mode="recompute", preemption_policy=policy,
                    max_num_batched_tokens=32, long_prefill_token_threshold=4, max_num_seqs=16)
    resumes: dict[str, int] = {}
    reprefills: dict[str, int] = {}
    for e in tracer.events:
        if e.kind == "admit" and e.reason == AdmitReason.RESUME_RECOMPUTE:
            resumes[e.req_id] = resumes.get(e.req_id, 0) + 1
        elif e.kind == "reprefill":
            reprefills[e.req_id] = reprefills.get(e.req_id, 0) + 1
            assert e.num_recomputed_tokens <= e.num_tokens - e.num_cached_tokens, e
    assert reprefills == resumes
    assert max(resumes.values()) >= 2, "no sequence was preempted twice"
    events = [e for e in tracer.events if e.kind == "reprefill"]
    assert any(e.reason == REPREFILL_INTERRUPTED and e.num_recomputed_tokens for e in events), "none cut short"
    assert sum(e.num_recomputed_tokens for e in events) == sum(r.num_recompute_tokens for r in tracer.records)
