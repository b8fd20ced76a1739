"""The fast path's lazy steps (engine/sim/cohort.py) advance the running decodes lazily: with them and
without the fast path (the general pass), every KV event, step record, token, finish and predicted
time is the same, with the block accounting checked after every step. The workloads keep many
sequences decoding at once in a roomy pool, so that several take or complete a block in the same
step, joined at different steps (their order in the batch decides which block each gets)."""
from __future__ import annotations

import math
import random

import pytest

import engine.sim.cohort
from engine.build import build_engine
from engine.config import EngineConfig
from engine.sequence import SamplingParams
from engine.sim.executor import SimExecutor
from engine.sim.fast_path import DecodeFastPath
from tests.engine.test_fast_path import run, timed
from tests.engine.test_simulation import backlog_workload, decisions


def staggered(seed: int, num_requests: int) -> list:
    rng = random.Random(seed)
    requests = backlog_workload(seed, num_requests=num_requests)
    for r in requests:
        r.n = 1
        r.arrival_s = round(rng.uniform(0.0, 0.3), 4)
        r.max_tokens = rng.randint(10, 70)
        r.output_tokens = rng.choice([None, rng.randint(5, r.max_tokens)])
    return requests


SETTINGS = {
    "prefix-cache": dict(),
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "tight": dict(num_gpu_blocks=60),   # preemptions: the cohort preempts for a short step itself
    "swap": dict(num_gpu_blocks=60, preemption_mode="swap", num_cpu_blocks=200),
    "block-8": dict(block_size=8, num_gpu_blocks=150),
    "reserve": dict(kv_reserve="max-tokens", num_gpu_blocks=400),
    "priority": dict(num_gpu_blocks=60, preemption_policy="priority"),
    # prompts prefilled in chunks beside the decodes: the cohort hands such steps to the general pass,
    # its members' counts written out first
    "chunked": dict(max_num_batched_tokens=40, max_num_seqs=32, long_prefill_token_threshold=12),
}


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("name", SETTINGS)
def test_the_cohort_decides_as_the_general_pass(tiny_loaded, name, seed):
    requests = staggered(seed, 40)
    settings = dict(block_size=4, num_gpu_blocks=400, watermark=0.0, max_num_batched_tokens=256, max_num_seqs=64,
                    engine="sim", hardware="a100-80gb") | SETTINGS[name]
    arrivals = seed != 3   # seed 3: a backlog
    leaps = seed == 2   # the leaps dissolve the cohort before they run
    general, _, general_tokens, _ = run(tiny_loaded, requests, False, arrivals, **settings)
    lazy, taken, lazy_tokens, leaped = run(tiny_loaded, requests, True, arrivals, leaps=leaps, **settings)
    assert decisions(lazy) == decisions(general)
    assert timed(lazy) == timed(general)
    assert lazy_tokens == general_tokens
    assert taken + leaped >= len(lazy.records) // 3, f"the fast path ran {taken} + {leaped} of {len(lazy.records)} steps"


def test_only_the_simulator_with_synchronous_scheduling_has_a_fast_path(tiny_loaded):
    def fast_path(**settings):
        engine = build_engine(EngineConfig(model="tiny", load_format="dummy", **settings), loaded=tiny_loaded)
        return engine.fast_path

    assert fast_path(engine="sim", hardware="a100-80gb").cohort is not None
    assert fast_path() is None   # the real engine: the model's tokens
    assert fast_path(engine="sim", hardware="a100-80gb", async_scheduling=True) is None   # a token in flight
    assert fast_path(engine="sim", hardware="a100-80gb", n_mode="cow").cohort is not None
    assert fast_path(engine="sim", hardware="a100-80gb", sim_fast_path=False) is None


def test_a_step_that_runs_short_of_blocks_preempts_from_the_cohort(tiny_loaded, monkeypatch):
    """Under the newest policy a lazy step whose blocks fall short preempts from the batch's end
    itself (as the general pass would: the comparison above) rather than handing the step to the
    general pass: the cohort stays formed through it."""
    calls = []
    preempt_for = DecodeFastPath._preempt_for

    def counted(self, seq, out):
        calls.append(self.cohort.num_members)
        preempt_for(self, seq, out)

    monkeypatch.setattr(DecodeFastPath, "_preempt_for", counted)
    settings = dict(block_size=4, num_gpu_blocks=60, watermark=0.0, max_num_batched_tokens=256, max_num_seqs=64,
                    engine="sim", hardware="a100-80gb")
    tracer, _, _, _ = run(tiny_loaded, staggered(1, 40), True, True, leaps=False, **settings)
    assert len(calls) >= 5 and min(calls) > 0
    assert sum(r.num_preemptions for r in tracer.records) >= len(calls)


def cohort_engine(make_engine, max_tokens: list[int]):
    """A simulated engine whose requests are all admitted at step 0 and then only decode, in a roomy
    pool, its fast path without leaps (each `advance` a lazy step)."""
    engine = make_engine(engine="sim", hardware="a100-80gb", num_gpu_blocks=400)
    engine.fast_path._leap_worth_it = lambda until_s: False
    for i, n in enumerate(max_tokens):
        engine.add_request(str(i), [10 + i] * (3 + i), SamplingParams(max_tokens=n, ignore_eos=True), arrival_s=0.0)
    return engine


def test_a_members_computed_positions_count_the_steps_it_has_not_settled(make_engine):
    """`num_computed` (what the integrity check compares with a member's blocks) is the sequence's own
    count plus the steps the cohort ran since its mark: what settling would write out."""
    engine = cohort_engine(make_engine, [40] * 6)
    cohort = engine.fast_path.cohort
    for _ in range(12):
        engine.advance()
    running = list(engine.scheduler.running)
    lagging = [m for m in cohort.members if cohort.clock > m.mark]
    assert len(lagging) >= 3 and all(m.mark > 0 for m in lagging)
    counted = [cohort.num_computed(seq) for seq in running]
    assert counted != [seq.num_computed_tokens for seq in running]
    cohort.dissolve()
    assert counted == [seq.num_computed_tokens for seq in running]
    assert [cohort.num_computed(seq) for seq in running] == counted   # no longer members: their own counts


def test_the_steps_before_the_next_stop_are_counted_to_the_step_and_forget_a_member_that_left(make_engine):
    engine = cohort_engine(make_engine, [9, 23, 16, 30])
    cohort = engine.fast_path.cohort
    assert cohort.steps_to_next_stop() == math.inf   # no member yet
    for _ in range(3):
        engine.advance()
    running = engine.scheduler.running
    assert cohort.num_members == 4
    k = cohort.steps_to_next_stop()
    assert k == min(m.stop_at for m in cohort.members) - cohort.clock - 1 and k >= 2
    for _ in range(k):   # k steps in which nobody stops, then the one in which the first does
        engine.advance()
    assert len(running) == 4 and cohort.steps_to_next_stop() == 0
    engine.advance()
    assert len(running) == 3 and cohort.steps_to_next_stop() == 16 - 9 - 1
    # a member that leaves before its stop (as a preemption takes it) takes its stop with it
    first = min(cohort.members, key=lambda m: m.stop_at)
    cohort.settle(first)
    cohort.leave(first.seq)
    assert cohort.steps_to_next_stop() == min(m.stop_at for m in cohort.members) - cohort.clock - 1


def test_a_lazy_steps_positions_are_what_its_members_computed_not_what_they_count_yet(make_engine, monkeypatch):
    seen = []
    execute = SimExecutor.execute

    def kept(self, out, lazy=None):
        if lazy is not None:
            members = out.seqs[:lazy[0]]
            seen.append((lazy[1], sum(cohort.num_computed(seq) for seq in members),
                         sum(seq.num_computed_tokens for seq in members)))
        return execute(self, out, lazy)

    monkeypatch.setattr(SimExecutor, "execute", kept)
    engine = cohort_engine(make_engine, [9, 23, 16, 30])
    cohort = engine.fast_path.cohort
    for _ in range(20):
        engine.advance()
    assert len(seen) >= 15 and max(true - own for _, true, own in seen) >= 3
    assert all(given == true for given, true, _ in seen)


@pytest.mark.parametrize("seed", [1, 3])
def test_without_prefix_caching_the_cohort_visits_a_member_only_for_the_block_it_takes(tiny_loaded, monkeypatch, seed):
    """The cohort's point: a member is touched at the step its next block starts, not between. Without
    the prefix cache a decode's grow_decode does nothing else, so every call must take a block."""
    calls = []
    grow_decode = engine.sim.cohort.grow_decode

    def counted(bm, seq, num_tokens, allocs=None):
        before = len(seq.block_table)
        grow_decode(bm, seq, num_tokens, allocs)
        calls.append(len(seq.block_table) - before)

    monkeypatch.setattr(engine.sim.cohort, "grow_decode", counted)
    settings = dict(block_size=4, num_gpu_blocks=400, watermark=0.0, max_num_batched_tokens=256, max_num_seqs=64,
                    engine="sim", hardware="a100-80gb", enable_prefix_caching=False)
    run(tiny_loaded, staggered(seed, 40), True, seed != 3, leaps=False, **settings)
    assert len(calls) >= 100 and set(calls) == {1}


def test_the_integrity_check_counts_a_members_unsettled_steps_against_its_blocks(make_engine):
    # a member's own count lags by the steps it has not settled: the check reads its true count, so
    # a cohort clock run ahead of the blocks taken (a missed grow) is caught
    engine = cohort_engine(make_engine, [12, 12])
    for _ in range(3):
        engine.advance()
    cohort = engine.fast_path.cohort
    assert cohort.num_members == 2
    engine.check_integrity()
    cohort.clock += 8   # two blocks of 4 that nobody took
    with pytest.raises(AssertionError, match="computed positions beyond its blocks"):
        engine.check_integrity()
    cohort.clock -= 8
    cohort.sum_marks += 1   # and the cohort's own sums, kept as members join, settle and leave
    with pytest.raises(AssertionError, match="the cohort's sum of marks is off"):
        engine.check_integrity()
