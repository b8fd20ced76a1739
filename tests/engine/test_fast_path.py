"""The simulator's fast path (engine/sim/fast_path.py: leaps and the cohort's lazy steps)
makes the general pass's decisions: with it and without it (--no-sim-fast-path), every KV event, step
record, token, finish and predicted time is the same, with the block accounting checked after every
step."""
from __future__ import annotations

import math
import random

import pytest

import engine.sim.fast_path as fast_path_module
from engine.build import build_engine
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.offload import OffloadTier
from engine.sequence import SamplingParams
from engine.sim.fast_path import DecodeFastPath
from tests.engine.test_simulation import SETTINGS, backlog_workload, decisions
from tests.helpers.engine_runs import ListTracer


def timed(tracer: ListTracer) -> list:
    """What `decisions` leaves out: the times and the events' order numbers."""
    return ([(r.start_s, r.end_s, r.device_ms, r.admission_stop, r.offload_bytes, r.load_bytes, r.tier_transfer_ms)
             for r in tracer.records],
            [(e.seq, e.ts_s, e.requester_req_id, e.victim_reason) for e in tracer.events])


def run(loaded, requests, fast: bool, arrivals: bool, eos_at: int = 0, *, cohort: bool = True, leaps: bool = True,
        **settings) -> tuple[ListTracer, int, list, int]:
    """Replay the requests step by step as a replay does (`LLMEngine.advance`), checking the books after
    each; return the trace, how many steps the fast path ran as lazy steps, every sequence's tokens, and
    how many it ran in leaps. `fast`: the fast path on (else the general pass decides every
    step); `cohort`, `leaps`: its lazy steps and its leaps. `eos_at`: every third sequence
    that does not ignore EOS samples the stop token as its output token of that index. Each step's
    count of tokens is checked against its recorded tokens."""
    tracer = ListTracer()
    engine = build_engine(EngineConfig(model="tiny", load_format="dummy", sim_fast_path=fast, **settings), tracer,
                          loaded=loaded)
    fast_path = engine.fast_path
    assert (fast_path is not None) == (fast and not engine.config.async_scheduling)
    if fast_path is not None and not cohort:
        fast_path.cohort = None
    if fast_path is not None and not leaps:
        fast_path._leap_worth_it = lambda until_s: False
    if eos_at:
        sample = engine.runner.sample
        stop = min(engine.stop_token_ids)

        def sample_eos(result, seqs, rows):
            return [stop if not s.params.ignore_eos and s.arrival_order % 3 == 0 and s.num_output_tokens == eos_at
                    else token for s, token in zip(seqs, sample(result, seqs, rows))]

        engine.runner.sample = sample_eos
        # the cohort rests on the simulator's placeholders never being a stop token, which this sampler
        # breaks: the fast path keeps only its leaps (which look at every sequence's next token)
        if fast_path is not None:
            fast_path.cohort = None
    pending = sorted(requests, key=lambda r: r.arrival_s if arrivals else 0.0)
    while pending or engine.has_unfinished():
        while pending and (not arrivals or pending[0].arrival_s <= engine.now()):
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r.max_tokens, temperature=r.temperature, seed=r.seed, n=r.n,
                                    ignore_eos=r.ignore_eos, output_tokens=r.output_tokens)
            engine.add_request(r.id, r.prompt_token_ids, params, arrival_s=r.arrival_s if arrivals else 0.0)
        if engine.has_unfinished():
            first = len(tracer.records)
            num_steps, num_tokens = engine.advance(pending[0].arrival_s if pending and arrivals else math.inf)
            if not engine.config.async_scheduling:   # (async: a step emits the tokens of the step before)
                assert num_steps == len(tracer.records) - first, "advance's steps are not the steps recorded"
                assert num_tokens == sum(len(r.token_req_ids) for r in tracer.records[first:]), \
                    "advance's tokens are not the tokens recorded"
            engine.check_integrity()
        else:
            engine.idle_until(pending[0].arrival_s)
    engine.flush()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    tokens = [list(s.token_ids) for s in engine.outputs.values()]
    if fast_path is None:
        return tracer, 0, tokens, 0
    return tracer, fast_path.num_lazy_steps, tokens, fast_path.num_leap_steps


MORE = {
    "async": dict(async_scheduling=True),
    "priority": dict(preemption_policy="priority"),
    "priority-0.33": dict(preemption_policy="priority", follow_vllm="0.33.0"),
    "chunked": dict(max_num_batched_tokens=16, long_prefill_token_threshold=6),
    "max-model-len": dict(max_model_len=40),
    "stop-token": dict(),   # sequences that stop on a stop token in the middle of their decode
    # a resumed sequence whose re-prefill's last chunk is one token (it looks like a decode)
    "reprefill-chunks": dict(num_gpu_blocks=16, max_num_batched_tokens=8, long_prefill_token_threshold=3),
    # forks share every block of their parent, those reserved ahead too: a write several steps on copies
    "reserve-forks-backlog": dict(kv_reserve="max-tokens", num_gpu_blocks=40, n_mode="cow"),
    # a host KV tier (leaps where it has nothing to do, lazy steps with its connector): of 2 chunks (evicting)
    # and ample, both releases' ranks
    "tier-small": dict(num_offload_blocks=2),
    "tier": dict(num_offload_blocks=64),
    "tier-0.33": dict(num_offload_blocks=64, follow_vllm="0.33.0"),
}
WORKLOAD = {"reprefill-chunks": (1, 16), "reserve-forks-backlog": (1, 12)}   # (seed, requests), all arriving at once


@pytest.mark.parametrize("arrive", ["spread", "backlog"])
@pytest.mark.parametrize("name", [*SETTINGS, *MORE])
def test_the_fast_path_decides_as_the_general_pass(tiny_loaded, name, arrive):
    rng = random.Random(7)
    seed, num_requests = WORKLOAD.get(name, (4, 16))
    requests = backlog_workload(seed, num_requests=num_requests)
    arrivals = arrive == "spread" and name not in WORKLOAD
    for i, r in enumerate(requests):   # arrivals spread over the run; some may stop at a stop token
        r.arrival_s = round(rng.uniform(0.0, 0.05), 4) if arrivals else 0.0
        r.ignore_eos = i % 3 != 0
    settings = dict(block_size=4, num_gpu_blocks=24, watermark=0.0, max_num_batched_tokens=64, engine="sim",
                    hardware="a100-80gb") | SETTINGS.get(name, {}) | MORE.get(name, {})
    eos_at = 4 if name == "stop-token" else 0
    reference, never, ref_tokens, no_leap = run(tiny_loaded, requests, False, arrivals, eos_at, **settings)
    fast, taken, fast_tokens, leaped = run(tiny_loaded, requests, True, arrivals, eos_at, **settings)
    assert never == 0 and no_leap == 0
    assert decisions(fast) == decisions(reference)
    assert timed(fast) == timed(reference)   # virtual time: the same to the last bit
    assert fast_tokens == ref_tokens
    if name == "stop-token":   # the cohort is off (it rests on placeholders never being a stop token), and a
        # leap runs only where no sequence's next token is one
        assert leaped >= 1 and taken == 0
    elif name == "tier-small":   # a tier of 2 chunks refuses all but the shortest prompts, offered again each
        # step: the sequences that offer them join no cohort, and no leap runs beside them
        assert taken + leaped < len(fast.records) // 10
    elif name != "async":   # async: every decode has a token in flight; the engine holds no fast path
        assert taken + leaped >= len(fast.records) // 10, f"the fast path ran {taken} + {leaped} of {len(fast.records)} steps"
    if name == "stop-token":
        assert sum(r.finish_reason == "stop" and r.output_tokens == 5 for rec in fast.records for r in rec.finished) >= 2
    if name == "reprefill-chunks":
        assert any(e.kind == "reprefill" for e in fast.events)


def simulated_both_ways(loaded, requests, arrivals: bool, **settings) -> tuple[ListTracer, int]:
    """The simulator's run without and with the fast path, asserted the same to the bit; the fast
    run's trace and its steps in leaps."""
    settings = dict(block_size=4, watermark=0.0, max_num_batched_tokens=64, engine="sim", hardware="a100-80gb") | settings
    reference, _, ref_tokens, _ = run(loaded, requests, False, arrivals, **settings)
    fast, _, fast_tokens, leaped = run(loaded, requests, True, arrivals, **settings)
    assert decisions(fast) == decisions(reference)
    assert timed(fast) == timed(reference)
    assert fast_tokens == ref_tokens
    return fast, leaped


def roomy_requests() -> list:
    """Ten requests with long outputs arriving apart (the same ones each call): a pool of 200 blocks
    holds them all, so most steps are decode-only."""
    rng = random.Random(11)
    requests = backlog_workload(5, num_requests=10)
    for r in requests:
        r.arrival_s = round(rng.uniform(0.0, 0.2), 4)
        r.max_tokens = rng.randint(30, 60)
        r.output_tokens = rng.choice([None, rng.randint(20, r.max_tokens)])
    return requests


@pytest.mark.parametrize("settings", [dict(), dict(enable_prefix_caching=False), dict(preemption_mode="swap", num_cpu_blocks=64)])
def test_leaps_run_most_of_a_roomy_replay_as_its_steps_would(tiny_loaded, settings):
    """Long outputs, a pool with room, arrivals apart: most steps are decode-only steps, which
    the fast path's leaps run at once (blocks taken, prefix blocks cached, times predicted as the
    step-by-step run's)."""
    fast, leaped = simulated_both_ways(tiny_loaded, roomy_requests(), True, num_gpu_blocks=200, **settings)
    assert leaped >= len(fast.records) // 2, f"{leaped} of {len(fast.records)} steps in leaps"
    assert any(e.kind == "alloc" and e.reason == "decode" for e in fast.events)


@pytest.mark.parametrize("follow_vllm", ["0.32.0", "0.33.0"])
@pytest.mark.parametrize("num_chunks", [8, 64])
def test_leaps_beside_a_host_kv_tier_decide_as_its_steps(tiny_loaded, monkeypatch, num_chunks, follow_vllm):
    """The roomy replay above with a host KV tier: leaps run where the tier has nothing to do but finish
    stores (no load in flight, no finished sequence's blocks to offer, no prompt blocks left to offer),
    the stores that finish in their steps filed there, and a small tier, which refuses and evicts, ranks
    and offers between them as step by step."""
    leap_steps = set()
    take_leap = fast_path_module.take_leap

    def noted(engine, until_s):
        first = engine.step_counter
        ran = take_leap(engine, until_s)
        leap_steps.update(range(first, first + ran[0]))
        return ran

    monkeypatch.setattr(fast_path_module, "take_leap", noted)
    fast, leaped = simulated_both_ways(tiny_loaded, roomy_requests(), True, num_gpu_blocks=200, num_offload_blocks=num_chunks,
                                       follow_vllm=follow_vllm)
    assert leaped >= len(fast.records) // 5, f"{leaped} of {len(fast.records)} steps in leaps"
    kinds = {e.kind for e in fast.events}
    assert "offload" in kinds and ("tier_evict" in kinds) == (num_chunks < 64)
    filed = [r for r in fast.records if r.step in leap_steps and r.offload_bytes]
    assert all(any(e.kind == "offload" for e in r.events) for r in filed)
    assert filed or num_chunks < 64   # (a tier of 8 refuses the prompts offered while a store is in flight)


@pytest.mark.parametrize("follow_vllm", ["0.32.0", "0.33.0"])
def test_the_tier_is_asked_the_same_in_the_same_order_with_and_without_the_fast_path(tiny_loaded, monkeypatch,
                                                                                       follow_vllm):
    """The roomy replay with a small tier, its calls to the tier's books logged: the fast path makes the
    general pass's calls (stores, re-ranks of the finished, completions) in the same order, which the
    trace alone does not show (it counts a store's evictions, not which chunks went)."""
    log: list[tuple] = []
    for name in ("prepare_store", "complete_store", "on_request_finished", "prepare_load", "complete_load"):
        method = getattr(OffloadTier, name)

        def logged(tier, *args, _name=name, _method=method):
            log.append((_name, *(getattr(a, "req_id", a) for a in args)))
            return _method(tier, *args)

        monkeypatch.setattr(OffloadTier, name, logged)
    calls = []
    for fast in (False, True):
        log.clear()
        run(tiny_loaded, roomy_requests(), fast, True, block_size=4, watermark=0.0, max_num_batched_tokens=64,
            engine="sim", hardware="a100-80gb", num_gpu_blocks=200, num_offload_blocks=8, follow_vllm=follow_vllm)
        calls.append(list(log))
    assert any(call[0] == "on_request_finished" for call in calls[0])
    assert calls[1] == calls[0]


@pytest.mark.parametrize("seed, num_blocks, num_chunks, follow_vllm", [
    (0, 40, 12, "0.32.0"),    # a leap while a loaded sequence waits to be admitted would skip its admission
    (4, 40, 12, "0.32.0"),    # a leap right after a finish would put off its offer and its chunks' new ranks
    (3, 200, 6, "0.33.0")])
def test_leaps_wait_for_the_tier_as_its_steps_would(tiny_loaded, seed, num_blocks, num_chunks, follow_vllm):
    """Shorter outputs arriving apart in pools that preempt, and tiers that evict: the steps a leap must
    leave to the general pass (a sequence loaded or loading, a finished sequence's blocks to offer) are
    found in these workloads, which a leap taking them gets wrong."""
    fast, leaped = simulated_both_ways(tiny_loaded, apart(seed, 10, 40), True, num_gpu_blocks=num_blocks,
                                       num_offload_blocks=num_chunks, follow_vllm=follow_vllm)
    assert leaped >= 1


def apart(seed: int, min_tokens: int, max_tokens: int) -> list:
    """Ten requests arriving apart, each running to its max_tokens (drawn between the two)."""
    rng = random.Random(seed)
    requests = backlog_workload(seed, num_requests=10)
    for r in requests:
        r.arrival_s = round(rng.uniform(0.0, 0.2), 4)
        r.max_tokens = rng.randint(min_tokens, max_tokens)
        r.output_tokens = None
    return requests


@pytest.mark.parametrize("seed, num_blocks, num_chunks, follow_vllm, max_tokens", [
    (0, 40, 12, "0.32.0", 40),   # loads issued, finished and admitted, preemptions, stores and tier evictions
    (3, 24, 16, "0.33.0", 40),
    (30, 40, 6, "0.32.0", 8)])   # a finished sequence's refused blocks stored once more, from the blocks it freed
def test_lazy_steps_beside_a_host_kv_tier_decide_as_its_steps(tiny_loaded, monkeypatch, seed, num_blocks, num_chunks,
                                                              follow_vllm, max_tokens):
    """The cohort's lazy steps alone (no leap) beside tiers that evict, in pools that preempt: the
    connector sees in a lazy step what it sees in the general step (the members whose tables grew,
    the sequences admitted, those finished the step before), and the tier's copies issued and
    finished in lazy steps are the step-by-step run's."""
    lazy_steps = set()
    lazy_step = DecodeFastPath._lazy_step

    def noted(self):
        step = self.engine.step_counter
        num_tokens = lazy_step(self)
        if num_tokens is not None:
            lazy_steps.add(step)
        return num_tokens

    monkeypatch.setattr(DecodeFastPath, "_lazy_step", noted)
    requests = apart(seed, 1 if max_tokens < 10 else 10, max_tokens)
    settings = dict(block_size=4, watermark=0.0, max_num_batched_tokens=64, engine="sim", hardware="a100-80gb",
                    num_gpu_blocks=num_blocks, num_offload_blocks=num_chunks, follow_vllm=follow_vllm)
    reference, _, ref_tokens, _ = run(tiny_loaded, requests, False, True, **settings)
    fast, taken, fast_tokens, leaped = run(tiny_loaded, requests, True, True, leaps=False, **settings)
    assert decisions(fast) == decisions(reference)
    assert timed(fast) == timed(reference)
    assert fast_tokens == ref_tokens
    assert leaped == 0 and taken == len(lazy_steps) >= len(fast.records) // 3
    lazy = [e for e in fast.events if e.step in lazy_steps]
    if max_tokens < 10:
        finished_at = {e.req_id: e.step for e in fast.events if e.kind == "finish"}
        assert any(e.kind == "offload" and finished_at[e.req_id] < e.step for e in lazy)
    else:
        assert {"offload", "load", "preempt", "tier_evict"} <= {e.kind for e in lazy}
        assert any(e.kind == "lookup" and e.tier_tokens for e in lazy)


@pytest.mark.parametrize("settings", [dict(), dict(preemption_mode="swap", num_cpu_blocks=64)])
def test_a_leap_ends_before_the_step_whose_blocks_run_out(tiny_loaded, settings):
    """Three long decodes in a pool that runs dry while they decode: the leap stops at the step the
    free blocks no longer cover, and that step preempts as the step-by-step run does."""
    requests = backlog_workload(6, num_requests=3)
    for r in requests:
        r.n, r.max_tokens, r.output_tokens = 1, 40, None
    fast, leaped = simulated_both_ways(tiny_loaded, requests, False, num_gpu_blocks=20, **settings)
    assert any(e.kind == "preempt" for e in fast.events) and leaped >= 20


def test_more_decodes_than_the_token_budget_are_stepped_not_leaped(tiny_loaded):
    """Samples forked past the token budget (--n-mode cow forks them when the prompt is done, outside
    the budget): 6 of them decoding under a budget of 4 tokens, of which a step decodes 4, which no
    leap (every running sequence a token a step) may stand in for."""
    requests = backlog_workload(3, num_requests=2)
    for r in requests:
        r.n, r.temperature, r.max_tokens, r.output_tokens = 6, 1.0, 12, None
    fast, _ = simulated_both_ways(tiny_loaded, requests, False, num_gpu_blocks=200, max_num_batched_tokens=4,
                                  n_mode="cow")
    assert max(r.num_running for r in fast.records) > 4


def leap(engine: LLMEngine, until_s: float = math.inf) -> tuple[int, int]:
    """The fast path's leap alone (its lazy step not tried): (steps, tokens), (0, 0) where it
    declines."""
    fast_path = engine.fast_path
    cohort, fast_path.cohort = fast_path.cohort, None
    try:
        return fast_path.advance(until_s) or (0, 0)
    finally:
        fast_path.cohort = cohort


def decoding(tiny_loaded, tracer=None, **settings) -> LLMEngine:
    """A simulated engine whose three sequences are all decoding, nothing else queued."""
    engine = build_engine(EngineConfig(model="tiny", engine="sim", block_size=4, num_gpu_blocks=64, **settings), tracer,
                          loaded=tiny_loaded)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), arrival_s=0.0)
    engine.step()
    assert len(engine.scheduler.running) == 3
    return engine


def test_a_leap_declines_an_idle_engine_the_slow_path_and_a_rejection_to_record(tiny_loaded):
    idle = build_engine(EngineConfig(model="tiny", engine="sim", block_size=4, num_gpu_blocks=64), loaded=tiny_loaded)
    assert leap(idle) == (0, 0) and idle.step_counter == 0
    assert leap(decoding(tiny_loaded))[0] > 0   # as it is, a leap runs
    # the reference every leap is checked against steps one by one
    slow = decoding(tiny_loaded, sim_fast_path=False)
    before = slow.step_counter
    assert slow.fast_path is None and slow.advance() == (1, 3) and slow.step_counter == before + 1
    # a request the pool can never hold is finished (rejected) by the next step, which records it: no
    # leap may run first and move its finish later
    tracer = ListTracer()
    assert leap(decoding(tiny_loaded, max_model_len=8))[0] > 0
    rejecting = decoding(tiny_loaded, tracer, max_model_len=8)
    rejecting.add_request("too-long", list(range(10, 20)), SamplingParams(max_tokens=2))
    step = rejecting.step_counter
    assert leap(rejecting) == (0, 0)
    rejecting.step()
    assert ("too-long", "rejected") in [(r.req_id, r.finish_reason) for r in tracer.records[step].finished]


def test_a_leap_declines_steps_whose_first_token_is_a_stop(tiny_loaded):
    # the simulator's placeholders are never a stop token, but a sampler that gives one (as the
    # stop-token case above does) ends that sequence in the next step, which only that step can record
    engine = decoding(tiny_loaded)
    stop, sample = min(engine.stop_token_ids), engine.runner.sample
    engine.runner.sample = lambda result, seqs, rows: [stop if s.req_id == "r1" else t
                                                       for s, t in zip(seqs, sample(result, seqs, rows))]
    assert leap(engine) == (0, 0)


@pytest.mark.parametrize("prompt_len", [5, 6, 7])
def test_forked_samples_sharing_the_block_they_write_next_are_stepped_not_leaped(tiny_loaded, prompt_len):
    """--n-mode cow: samples forked when the prompt is done share its last, partial block, which
    their next decode writes: that step copies the block first, which only the general pass does."""
    requests = backlog_workload(5, num_requests=3)
    for r in requests:
        r.n, r.temperature, r.max_tokens, r.output_tokens = 3, 1.0, 20, None
        r.prompt_token_ids = r.prompt_token_ids[:prompt_len]
    fast, _ = simulated_both_ways(tiny_loaded, requests, False, num_gpu_blocks=200, n_mode="cow")
    assert any(e.kind == "cow" for e in fast.events)


def test_leaps_stamp_their_steps_on_the_clock_started_after_a_warm_up(tiny_loaded):
    """A replay's t = 0 is when start_clock ran, however much virtual time went before it: the steps
    a leap runs carry the times the step-by-step run gives them."""
    def stamped(leaps: bool) -> list:
        tracer = ListTracer()
        engine = build_engine(EngineConfig(model="tiny", engine="sim", block_size=4, num_gpu_blocks=64), tracer,
                              loaded=tiny_loaded)
        engine.add_request("warm-up", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=0.0)
        while engine.has_unfinished():
            engine.step()
        engine.start_clock()
        for i in range(3):
            engine.add_request(f"r{i}", [5 + i, 6, 7], SamplingParams(max_tokens=30, ignore_eos=True), arrival_s=0.0)
        leaped = 0
        while engine.has_unfinished():
            num_steps = leap(engine)[0] if leaps else 0
            leaped += num_steps
            if not num_steps:
                engine.step()
        assert leaped > 10 or not leaps
        return [(r.step, r.start_s, r.end_s) for r in tracer.records]

    assert stamped(leaps=True) == stamped(leaps=False)


def test_a_leap_returns_its_tokens_and_counts_as_progress(tiny_loaded):
    # the replay adds the tokens to its counts, and the livelock guard counts steps without a token:
    # a leap's steps each gave every running sequence one
    tracer = ListTracer()
    engine = decoding(tiny_loaded, tracer)
    engine._steps_without_progress = 7   # as after steps that only re-prefilled
    first = len(tracer.records)
    steps, tokens = leap(engine)
    assert steps > 1 and tokens == 3 * steps == sum(len(r.token_req_ids) for r in tracer.records[first:])
    assert engine._steps_without_progress == 0
