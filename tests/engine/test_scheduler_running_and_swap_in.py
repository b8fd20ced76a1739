"""The scheduler's running pass and swap-in pass (engine/scheduler.py, its first part): the budget's
last tokens, samples coming back together, the watermark a swap-in keeps, chunk caps, and
max_num_seqs when swapped samples return.

Some states the swap-in pass decides on (a group coming back beside a running prefill that leaves it a
token or two of budget) take a long, fragile run to reach through the engine; those tests drive the
Scheduler and its BlockManager directly and say how the engine reaches the same state.
"""
from __future__ import annotations

import pytest

from engine.block_manager import BlockManager
from engine.events import AdmissionStop
from engine.scheduler import Scheduler, SchedulerOutput
from engine.sequence import SamplingParams, Sequence
from tests.helpers.engine_runs import ListTracer, run_checked


def ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def swap_ins(tracer) -> list[tuple]:
    return [(e.step, e.req_id, e.sample) for e in tracer.events if e.kind == "swap_in"]


# ---------------------------------------------------------------- the scheduler on its own

def scheduler(num_blocks: int = 32, watermark_blocks: int = 0, **settings) -> Scheduler:
    """Blocks of 4, no prefix cache, no watermark (unless given), swap mode, the newest policy."""
    bm = BlockManager(num_blocks, block_size=4, num_cpu_blocks=32, enable_prefix_caching=False,
                      watermark_blocks=watermark_blocks)
    args = dict(max_num_seqs=8, max_num_batched_tokens=8, preemption_mode="swap", preemption_policy="newest")
    args.update(settings)
    return Scheduler(bm, **args)


def sequence(req_id: str, num_prompt_tokens: int, sample: int = 0) -> Sequence:
    return Sequence(req_id, sample, list(range(10, 10 + num_prompt_tokens)), ignore_eos(16), 0.0, 0, 0)


def execute(out: SchedulerOutput) -> None:
    """What the engine makes of a step: the scheduled positions are computed, and a sequence whose
    last token was computed gets its next one."""
    for seq, num_new in zip(out.seqs, out.num_new_tokens):
        seq.num_computed_tokens += num_new
        if seq.num_computed_tokens == seq.num_tokens:
            seq.token_ids.append(7)


def step(sched: Scheduler) -> list[tuple[str, int, int]]:
    """Schedule and execute one step; the integrity of the pool is checked; returns (request, sample,
    tokens) in batch order."""
    out = sched.schedule()
    sched.bm.check_integrity(sched.all_seqs())
    execute(out)
    return [(s.req_id, s.sample, n) for s, n in zip(out.seqs, out.num_new_tokens)]


def running_prefill_beside_swapped(num_samples: int) -> tuple[Scheduler, Sequence]:
    """Token budget 8, chunks of 7 while others wait. A (20 tokens) prefills; C's samples (a 4-token
    prompt, one decode token each) are swapped out. The engine gets here when a third request needing
    blocks first swaps C out, then, still short, preempts itself: its blocks leave the room C needs."""
    sched = scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=7, swap_groups=True)
    c, a = sequence("C", 4), sequence("A", 20)
    sched.add(c)
    sched.add(a)
    assert step(sched) == [("C", 0, 4), ("A", 0, 4)]
    samples = [c]
    for index in range(1, num_samples):  # --n-mode cow: the samples fork when the prompt is done
        child = Sequence("C", index, c.token_ids, c.params, 0.0, 0, 0)
        sched.bm.fork(c, child)
        sched.adopt(child)
        samples.append(child)
    sched._preempt(samples, SchedulerOutput())
    assert list(sched.swapped) == samples and sched.running == [a]
    return sched, a


def test_the_last_token_of_the_budget_brings_a_swapped_sequence_back():
    # A's chunk of 7 leaves 1 token of the budget: enough for C's decode, so C comes back in that step
    sched, _ = running_prefill_beside_swapped(1)
    assert step(sched) == [("A", 0, 7), ("C", 0, 1)]
    assert not sched.swapped


def test_samples_wait_together_until_the_budget_holds_a_token_for_each():
    # C's two samples come back together or not at all: while A's chunks of 7 leave 1 token, the
    # second sample would get none, so both wait; A's last chunk of 2 leaves room for both
    sched, _ = running_prefill_beside_swapped(2)
    assert step(sched) == [("A", 0, 7)]
    assert [s.sample for s in sched.swapped] == [0, 1]
    assert step(sched) == [("A", 0, 7)]
    assert step(sched) == [("A", 0, 2), ("C", 0, 1), ("C", 1, 1)]
    assert not sched.swapped


def test_independent_samples_coming_back_together_share_the_budget_by_what_each_takes():
    # --n-mode independent: X's three samples are separate sequences of one request. Token budget 14:
    # sample 0 prefills its 12 tokens, sample 1 2 of them; then 0 decodes, 1 finishes its prompt (10)
    # and 2 gets the 3 tokens left. The newest policy then swaps out 2, 1 and 0, in that order (as when
    # sample 0 needs a block and finally preempts itself). They come back as a group, each with what
    # it has left: 9, 1 and 1 tokens of the 14
    sched = scheduler(max_num_batched_tokens=14, swap_groups=False)
    samples = [sequence("X", 12, sample) for sample in range(3)]
    for seq in samples:
        sched.add(seq)
    assert step(sched) == [("X", 0, 12), ("X", 1, 2)]
    assert step(sched) == [("X", 0, 1), ("X", 1, 10), ("X", 2, 3)]
    for seq in reversed(samples):
        sched._preempt([seq], SchedulerOutput())
    assert step(sched) == [("X", 2, 9), ("X", 1, 1), ("X", 0, 1)]


@pytest.mark.parametrize("watermark_blocks, comes_back", [(0, True), (2, False)])
def test_a_swapped_sequence_comes_back_only_above_the_watermark(watermark_blocks, comes_back):
    # Guards can_swap_in's watermark: a swapped sequence comes back only if the pool keeps
    # watermark_blocks free after it, as an admission beside running sequences does. 6 blocks, token
    # budget 16. C (4 tokens) and A (12 tokens) are admitted in step 0 (A's 3 blocks and the
    # watermark's 2 fit the 5 left after C's): 2 blocks free. C is swapped out (3 free); in step 1 A's
    # decode takes its fourth block (2 free) and C needs 2: its host block and one for its 5th
    # position. With no watermark C fits and comes back; with a watermark of 2 it would leave none
    # free, so it waits in the swapped queue
    sched = scheduler(num_blocks=6, watermark_blocks=watermark_blocks, max_num_batched_tokens=16)
    c, a = sequence("C", 4), sequence("A", 12)
    sched.add(c)
    sched.add(a)
    assert step(sched) == [("C", 0, 4), ("A", 0, 12)]
    sched._preempt([c], SchedulerOutput())
    assert list(sched.swapped) == [c] and sched.bm.num_free_blocks == 3
    if comes_back:
        assert step(sched) == [("A", 0, 1), ("C", 0, 1)]
        assert not sched.swapped and sched.bm.num_free_blocks == 0
    else:
        assert step(sched) == [("A", 0, 1)]
        assert list(sched.swapped) == [c] and sched.bm.num_free_blocks == 2


# ---------------------------------------------------------------- the long-prefill threshold

def test_a_prefill_keeps_its_chunk_cap_while_a_swapped_request_waits(make_engine):
    # 8 blocks of 4, token budget 8, chunks of 3 while others wait, priority policy, swap. B (3 tokens,
    # least important) runs from step 0, A (27 tokens) from step 1; in step 7 A's chunk needs a block
    # and B is swapped out. A is then the only one running, but B waits for the pool: A is not alone,
    # so its last 6 tokens still come in chunks of 3 (steps 8 and 9), not in one chunk
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=8, max_num_batched_tokens=8, long_prefill_token_threshold=3,
                         preemption_policy="priority", preemption_mode="swap", num_cpu_blocks=8)
    engine.add_request("B", [49, 37, 37], ignore_eos(12), priority=2, arrival_s=0.0)
    engine.step()
    engine.add_request("A", list(range(100, 127)), ignore_eos(4), priority=0, arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id) for e in tracer.events if e.kind == "swap_out"] == [(7, "B")]
    assert [(r.num_prefill_tokens, r.num_swapped) for r in tracer.records[7:10]] == [(3, 1), (3, 1), (3, 1)]
    assert sum(r.num_prefill_tokens for r in tracer.records) == 3 + 27


# ---------------------------------------------------------------- async scheduling: a sequence at its last token

def test_a_sequence_at_its_last_in_flight_token_does_not_hold_up_the_one_behind_it(make_engine):
    # --async-scheduling: A (2 tokens) and B (4 tokens) are admitted in step 0. In step 2 A's last
    # token is in flight, so A is not scheduled; B, behind it in the running batch, still decodes
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=16, async_scheduling=True)
    engine.add_request("A", [5, 6, 7], ignore_eos(2), arrival_s=0.0)
    engine.add_request("B", [8, 9, 10], ignore_eos(4), arrival_s=0.0)
    run_checked(engine)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [(6, 0), (0, 2), (0, 1), (0, 1), (0, 0)]
    assert [(r.step, r.token_req_ids) for r in tracer.records if r.token_req_ids][2:] == [(2, ["B"]), (3, ["B"])]


# ---------------------------------------------------------------- swap-in: the pool and max_num_seqs

def test_a_swapped_sequence_whose_next_position_fills_the_pool_waits_rather_than_being_rejected(make_engine):
    # 3 blocks of 4, swap. B (4 tokens) and A (11 tokens, B's 4 and 7 of its own) are admitted in step
    # 0; A finds B's block in the cache and fills the pool. In step 1 B's first decode needs a block:
    # A, the newest, is swapped out, 11 positions computed. Its next position, the 12th, fills the whole
    # pool: A can come back once B is done (step 5), and finishes by length, not for capacity
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=3, num_cpu_blocks=8, preemption_mode="swap", preemption_policy="newest")
    shared = [60, 61, 62, 63]
    engine.add_request("B", shared, ignore_eos(5), arrival_s=0.0)
    a = engine.add_request("A", shared + list(range(70, 77)), ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id, e.num_tokens) for e in tracer.events if e.kind == "swap_out"] == [(1, "A", 11)]
    assert swap_ins(tracer) == [(5, "A", 0)]
    assert a.finish_reason == "length" and a.num_output_tokens == 2


def samples_stopping_early(make_engine, max_num_seqs: int):
    """10 blocks of 4, 2 host blocks, swap, --n-mode cow, the newest policy. P (a 4-token prompt, 5
    samples by copy-on-write, max 10 tokens) is admitted alone, so all 5 samples run whatever
    max_num_seqs. In step 5 every sample needs a third block: samples 0-3 get one, sample 4 (the
    newest) is swapped out alone (the host cannot hold the group). Samples 1 and 2 stop on an EOS
    sampled in that same step, which leaves the pool room for sample 4 beside samples 0 and 3."""
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=10, num_cpu_blocks=2, n_mode="cow", enable_prefix_caching=False,
                         preemption_mode="swap", preemption_policy="newest", max_num_seqs=max_num_seqs)
    engine.stop_token_ids = frozenset({431, 466})  # the 6th token of samples 1 and 2 (seed 3), no one else's
    engine.add_request("P", [5, 6, 7, 8], SamplingParams(max_tokens=10, n=5, temperature=1.0, seed=3), arrival_s=0.0)
    run_checked(engine)
    stops = [(f.sample, f.finish_reason, f.output_tokens) for r in tracer.records[:6] for f in r.finished]
    assert stops == [(1, "stop", 6), (2, "stop", 6)], "the planned early stops (the tiny model's sampled tokens changed?)"
    assert [(e.step, e.sample) for e in tracer.events if e.kind == "swap_out"] == [(5, 4)]
    return tracer


def test_a_swapped_sample_comes_back_when_it_brings_the_batch_to_max_num_seqs(make_engine):
    # max_num_seqs 3: samples 0 and 3 run, so sample 4 coming back makes 3, allowed: it returns in step 6
    tracer = samples_stopping_early(make_engine, max_num_seqs=3)
    assert swap_ins(tracer) == [(6, "P", 4)]
    assert [r.num_running for r in tracer.records[6:10]] == [3, 3, 3, 3]


def test_a_swapped_sample_waits_while_it_would_take_the_batch_past_max_num_seqs(make_engine):
    # max_num_seqs 2: samples 0 and 3 already make 2, so sample 4 waits until they finish (step 9),
    # though the pool has room for it from step 6
    tracer = samples_stopping_early(make_engine, max_num_seqs=2)
    assert swap_ins(tracer) == [(10, "P", 4)]
    assert [r.num_running for r in tracer.records[6:11]] == [2, 2, 2, 2, 1]


# ---------------------------------------------------------------- a victim taken back out of the batch

def test_a_victim_already_in_the_batch_gives_its_tokens_back_to_the_budget():
    # 8 blocks of 4, token budget 8, the priority policy, recompute. V (11 tokens, least urgent) runs
    # from step 0; X (2), Y (4) and Z (12), all more urgent, are admitted in step 1. In step 3 V decodes
    # first (1 token of the budget), X decodes, then Y's decode needs a block: V is preempted and taken
    # back out of the batch, its token returned to the budget, so Z's chunk is 6 tokens, not 5
    sched = scheduler(num_blocks=8, max_num_batched_tokens=8, preemption_policy="priority",
                      preemption_mode="recompute")
    requests = []
    for k, (name, num_prompt_tokens, priority) in enumerate([("V", 11, 5), ("X", 2, 0), ("Y", 4, 0), ("Z", 12, 0)]):
        prompt = list(range(100 * k + 1, 100 * k + 1 + num_prompt_tokens))
        requests.append(Sequence(name, 0, prompt, ignore_eos(40), 0.1 * k, priority, k))
    sched.add(requests[0])
    assert step(sched) == [("V", 0, 8)]
    for seq in requests[1:]:
        sched.add(seq)
    assert step(sched) == [("V", 0, 3), ("X", 0, 2), ("Y", 0, 3)]
    assert step(sched) == [("V", 0, 1), ("X", 0, 1), ("Y", 0, 1), ("Z", 0, 5)]
    assert step(sched) == [("X", 0, 1), ("Y", 0, 1), ("Z", 0, 6)]
    assert [s.req_id for s in sched.waiting] == ["V"]


# ---------------------------------------------------------------- swap-in: one request at a time

def test_swapped_requests_come_back_one_request_at_a_time():
    # 7 blocks of 4. C and D (3 tokens each, a block each) and A (20 tokens, 5 blocks) fill the pool in
    # step 0; C and D are swapped out (as a request needing blocks would have them). In step 1 A's
    # decode takes one of the two free blocks: C comes back into the other, D waits (the swap queue
    # groups only the samples of one request, never two requests)
    sched = scheduler(num_blocks=7, max_num_batched_tokens=64)
    c, d, a = sequence("C", 3), sequence("D", 3), sequence("A", 20)
    for seq in (c, d, a):
        sched.add(seq)
    assert step(sched) == [("C", 0, 3), ("D", 0, 3), ("A", 0, 20)]
    sched._preempt([c], SchedulerOutput())
    sched._preempt([d], SchedulerOutput())
    assert step(sched) == [("A", 0, 1), ("C", 0, 1)]
    assert list(sched.swapped) == [d]
    # C's swap-in event names the host block it comes back from: the one its swap-out copied it to
    events = {kind: [e for e in sched.bm.events if e.kind == kind and e.req_id == "C"]
              for kind in ("swap_out", "swap_in")}
    assert len(events["swap_in"]) == 1 and events["swap_in"][0].src_blocks == events["swap_out"][0].src_blocks == [0]


def test_a_swapped_sequence_that_outgrew_the_pool_is_rejected_for_capacity(make_engine):
    # 2 blocks of 4, swap. A (3 tokens, 10 to generate) decodes until its 9th position needs a third
    # block: alone in the pool, it swaps itself out (step 6); it can never come back, so the next step
    # rejects it for capacity with the 6 tokens it made
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=2, num_cpu_blocks=8, preemption_mode="swap", preemption_policy="newest")
    a = engine.add_request("A", [5, 6, 7], ignore_eos(10), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id) for e in tracer.events if e.kind == "swap_out"] == [(6, "A")]
    assert not swap_ins(tracer)
    assert (a.finish_reason, a.num_output_tokens) == ("capacity", 6)


def two_requests_swapped_beside_a_prefill(max_num_seqs: int = 8) -> tuple[Scheduler, Sequence, Sequence, Sequence]:
    """Token budget 8, chunks of 7 while others wait. C and D (4-token prompts) prefill and decode a
    token each, A (20 tokens) prefills its first 6 beside them; then D and C are swapped out, in that
    order (the engine gets there when a sequence needing blocks preempts the newest twice)."""
    sched = scheduler(max_num_batched_tokens=8, long_prefill_token_threshold=7)
    c, d, a = sequence("C", 4), sequence("D", 4), sequence("A", 20)
    for seq in (c, d, a):
        sched.add(seq)
    assert step(sched) == [("C", 0, 4), ("D", 0, 4)]
    assert step(sched) == [("C", 0, 1), ("D", 0, 1), ("A", 0, 6)]
    sched._preempt([d], SchedulerOutput())
    sched._preempt([c], SchedulerOutput())
    assert list(sched.swapped) == [d, c] and sched.running == [a]
    sched.max_num_seqs = max_num_seqs
    return sched, a, c, d


def test_a_swap_in_that_spends_the_budget_stops_admission_for_the_budget():
    """A's chunk of 7 leaves one token: D comes back with it and C, still swapped, waits for the
    budget (the step says so), even where max_num_seqs (2) would also stop it: as in the waiting pass,
    a spent budget is what stops admission."""
    for max_num_seqs in (8, 2):
        sched, a, c, d = two_requests_swapped_beside_a_prefill(max_num_seqs)
        out = sched.schedule()
        assert [(s.req_id, n) for s, n in zip(out.seqs, out.num_new_tokens)] == [("A", 7), ("D", 1)]
        assert list(sched.swapped) == [c]
        assert out.admission_stop == AdmissionStop.BUDGET, max_num_seqs


def test_the_tokens_of_sequences_swapped_in_leave_the_rest_of_the_budget_to_admissions():
    """With nothing running, D and C come back (a token each) and the waiting prompt gets the 6 tokens
    left of the 8: a step never schedules more tokens than the budget."""
    sched = scheduler(max_num_batched_tokens=8)
    c, d = sequence("C", 4), sequence("D", 4)
    sched.add(c)
    sched.add(d)
    assert step(sched) == [("C", 0, 4), ("D", 0, 4)]
    sched._preempt([c], SchedulerOutput())
    sched._preempt([d], SchedulerOutput())
    sched.add(sequence("W", 10))
    assert step(sched) == [("C", 0, 1), ("D", 0, 1), ("W", 0, 6)]


def test_nothing_new_is_admitted_while_a_swapped_sequence_waits_for_blocks():
    """vLLM V0's order: swapped sequences come back before anything new. In a pool of 6 blocks of 4,
    C (4-token prompt) decodes a token beside R's prefill (18 tokens, chunks of up to 8) and is
    swapped out; R's last chunk then takes 5 blocks, leaving 1: too few for C (6 tokens), enough for
    W's 2-token prompt. W still waits behind C, and the step says blocks stopped admission."""
    sched = scheduler(num_blocks=6, max_num_batched_tokens=8)
    c, r, w = sequence("C", 4), sequence("R", 18), sequence("W", 2)
    sched.add(c)
    sched.add(r)
    assert step(sched) == [("C", 0, 4), ("R", 0, 4)]
    assert step(sched) == [("C", 0, 1), ("R", 0, 7)]
    sched._preempt([c], SchedulerOutput())
    sched.add(w)
    out = sched.schedule()
    sched.bm.check_integrity(sched.all_seqs())
    assert [(s.req_id, n) for s, n in zip(out.seqs, out.num_new_tokens)] == [("R", 7)]
    assert list(sched.swapped) == [c] and list(sched.waiting) == [w]
    assert sched.bm.can_allocate(w, [], watermark=True)   # W alone would fit
    assert out.admission_stop == AdmissionStop.BLOCKS
