"""The scheduler's admission of waiting sequences and its choice of victims (engine/scheduler.py, from
the waiting pass on): samples against max_num_seqs, a prompt rejected at admission, the token budget
without chunked prefill, and which sequence each preemption policy takes."""
from __future__ import annotations

from engine.sequence import SamplingParams, Sequence
from tests.helpers.engine_runs import ListTracer, run_checked


def ignore_eos(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def sampled(max_tokens: int, n: int) -> SamplingParams:
    """n samples, drawn (so that copy-on-write samples go their own way)."""
    return ignore_eos(max_tokens, n=n, temperature=1.0, seed=1)


def admits(tracer) -> list[tuple[int, str, int]]:
    return [(e.step, e.req_id, e.sample) for e in tracer.events if e.kind == "admit"]


def step_events(tracer, step: int) -> list[tuple]:
    return [(e.kind, e.req_id, e.sample, e.blocks, e.reason) for e in tracer.records[step].events]


def preempts(tracer) -> list[tuple[int, str, int, str]]:
    return [(e.step, e.req_id, e.sample, e.reason) for e in tracer.events if e.kind == "preempt"]


# ---------------------------------------------------------------- admission: max_num_seqs and pending forks

def test_a_request_that_will_fork_waits_until_all_its_samples_fit_max_num_seqs(make_engine):
    # max_num_seqs 3, --n-mode cow: A and B (n=2 each) arrive together. A is admitted and will fork
    # its second sample (2 sequences); B would make 4 once it forks, so it waits until A's samples
    # finish (3 tokens: steps 0..2), though only one sequence runs when it is first considered
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=3, n_mode="cow")
    engine.add_request("A", [5, 6, 7], sampled(3, n=2), arrival_s=0.0)
    engine.add_request("B", [5, 6, 8], sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (3, "B", 0)]
    assert [r.num_running for r in tracer.records] == [1, 2, 2, 1, 2, 2]  # after scheduling: forks follow


def test_a_request_whose_samples_just_fit_max_num_seqs_is_admitted_beside_the_running_one(make_engine):
    # max_num_seqs 3, --n-mode cow: A (n=1) and B (n=2) arrive together; B and its fork make 3
    # sequences with A, the limit exactly, so both start in step 0
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_seqs=3, n_mode="cow")
    engine.add_request("A", [5, 6, 7], ignore_eos(3), arrival_s=0.0)
    engine.add_request("B", [5, 6, 8], sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0)]
    assert [r.num_running for r in tracer.records] == [2, 3, 3]


# ---------------------------------------------------------------- admission: rejection and the token budget

def test_a_prompt_rejected_at_admission_does_not_hold_up_the_one_behind_it(make_engine):
    # 4 blocks of 4 (16 positions): A's 16-token prompt and its next token can never fit, so A is
    # rejected; B, behind it, is admitted in the same step
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, max_model_len=64)
    engine.add_request("A", list(range(100, 116)), ignore_eos(2), arrival_s=0.0)
    engine.add_request("B", [7, 8, 9], ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id, e.reason) for e in tracer.events if e.kind == "finish"] == [
        (0, "A", "rejected"), (1, "B", "length")]
    assert admits(tracer) == [(0, "B", 0)]


def test_without_chunked_prefill_a_prompt_that_exactly_fills_the_budget_left_is_admitted(make_engine):
    # budget 16, no chunked prefill: A (10 tokens) leaves 6, and B's 6-token prompt fits them exactly
    tracer = ListTracer()
    engine = make_engine(tracer, max_num_batched_tokens=16, enable_chunked_prefill=False)
    engine.add_request("A", list(range(100, 110)), ignore_eos(2), arrival_s=0.0)
    engine.add_request("B", list(range(200, 206)), ignore_eos(2), arrival_s=0.0)
    run_checked(engine)
    assert admits(tracer) == [(0, "A", 0), (0, "B", 0)]
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records] == [(16, 0), (0, 2)]


# ---------------------------------------------------------------- victims: kvtrace's policies

def test_newest_sparing_takes_the_sample_forked_last(make_engine):
    # 5 blocks of 4, --n-mode cow, newest-sparing: A (3 tokens, n=3) forks samples 1 and 2 after
    # step 0, in that order. In step 1 samples 0 and 1 copy the shared partial block 1 (blocks 2, 3)
    # and sample 2 keeps it; in step 2 each needs a block for position 4, samples 0 and 1 take the
    # last two, and sample 2, the newest (forked after sample 1), preempts itself
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=5, n_mode="cow", preemption_policy="newest-sparing",
                         enable_prefix_caching=False)
    engine.add_request("A", [5, 6, 7], sampled(6, n=3), arrival_s=0.0)
    run_checked(engine)
    assert step_events(tracer, 2) == [
        ("alloc", "A", 0, [4], "decode"), ("alloc", "A", 1, [5], "decode"),
        ("preempt", "A", 2, [1], "recompute"), ("free", "A", 2, [1], "preempt")]
    assert preempts(tracer) == [(2, "A", 2, "recompute")]
    assert step_events(tracer, 1) == [   # each copy-on-write takes its block (an alloc), then copies into it
        ("alloc", "A", 0, [2], "cow"), ("cow", "A", 0, [2], None), ("alloc", "A", 1, [3], "cow"), ("cow", "A", 1, [3], None)]


def test_a_resumed_sequence_takes_the_newest_other_when_no_victim_would_free_a_block(make_engine):
    # 4 blocks of 4, --n-mode cow, newest-sparing, chunks of 4 while others wait. Y (1 token), X (12)
    # and P (8, n=2) arrive together; P and then X are preempted, and when Y finishes both resume
    # (step 4). In step 5 P's re-prefill ends and it forks: P's two samples share blocks 3 and 2. In
    # step 6 X, resumed and still re-prefilling (spared), needs a block: no other frees one on its
    # own, so the newest other (P's sample 1) is preempted, freeing nothing, then P's sample 0,
    # which now holds the blocks alone
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, n_mode="cow", preemption_policy="newest-sparing",
                         enable_prefix_caching=False, long_prefill_token_threshold=4)
    engine.add_request("Y", [10], ignore_eos(4), arrival_s=0.0)
    engine.add_request("X", list(range(30, 42)), ignore_eos(3), arrival_s=0.0)
    engine.add_request("P", list(range(50, 58)), sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.req_id, e.reason) for e in tracer.events if e.kind == "admit"][3:5] == [
        (4, "X", "resume-recompute"), (4, "P", "resume-recompute")]
    assert step_events(tracer, 6) == [
        ("preempt", "P", 1, [3, 2], "recompute"), ("preempt", "P", 0, [3, 2], "recompute"),
        ("free", "P", 0, [2, 3], "preempt"), ("alloc", "X", 0, [2], "prefill")]


# ---------------------------------------------------------------- victims: swap groups

def test_independent_samples_of_a_request_are_swapped_out_one_at_a_time(make_engine):
    # swap mode, n=2 as V1 runs it (independent sequences): 4 blocks of 4, A's two samples hold 2
    # each. In step 2 sample 0 needs a block and only sample 1 (the newest) is swapped out; only
    # --n-mode cow swaps a request's samples together
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=8,
                         enable_prefix_caching=False)
    engine.add_request("A", [11, 12, 13, 14, 15, 16, 17], sampled(6, n=2), arrival_s=0.0)
    run_checked(engine)
    assert [(e.step, e.sample) for e in tracer.events if e.kind == "swap_out"] == [(2, 1)]
    assert step_events(tracer, 2) == [
        ("preempt", "A", 1, [3, 4], "swap"), ("free", "A", 1, [4, 3], "preempt"),
        ("swap_out", "A", 1, [3, 4], None), ("alloc", "A", 0, [4], "decode")]


def test_copy_on_write_samples_the_host_cannot_hold_are_not_preempted_together(make_engine):
    # swap mode, --n-mode cow, 4 blocks of 4 and 2 host blocks. B (3 tokens) and C (9 tokens, n=2)
    # fill the pool; in step 1 C's first sample must copy their shared partial block and no block is
    # free. The host cannot take C's 3 blocks, so its samples do not go together: only the newest is
    # preempted (by recompute), which leaves C's first sample the block's sole holder, and it decodes
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, preemption_mode="swap", num_cpu_blocks=2,
                         enable_prefix_caching=False, n_mode="cow")
    engine.add_request("B", [1, 2, 3], ignore_eos(3), arrival_s=0.0)
    engine.add_request("C", list(range(40, 49)), sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert preempts(tracer)[0] == (1, "C", 1, "swap-full-fallback")
    assert step_events(tracer, 1) == [("preempt", "C", 1, [2, 3, 4], "swap-full-fallback")]
    assert sorted(tracer.records[1].token_samples) == [0, 0]


def test_a_preempted_sequence_whose_tokens_fill_the_pool_comes_back_for_its_last_token():
    """A sequence preempted by recompute with 4 of its 5 output tokens (16 tokens: the whole pool of 4
    blocks of 4) samples its last token from position 15 and never stores it: it needs the 16
    positions the pool has, so it is readmitted, not rejected for one position more."""
    from tests.engine.test_scheduler_running_and_swap_in import scheduler
    sched = scheduler(num_blocks=4, max_num_batched_tokens=16, preemption_mode="recompute")
    seq = Sequence("S", 0, list(range(10, 22)), SamplingParams(max_tokens=5, ignore_eos=True), 0.0, 0, 0)
    seq.token_ids += [7, 7, 7, 7]            # what it had sampled when it was preempted
    seq.num_ever_computed = 15
    sched.add(seq)
    out = sched.schedule()
    assert not out.rejected and out.seqs == [seq] and out.num_new_tokens == [16]


def test_a_prompt_whose_next_token_reaches_the_max_model_length_needs_no_position_for_it():
    """With max_model_len 17, a 16-token prompt samples one token and stops there: it needs the 16
    positions of a 4-block pool, not 17, and is admitted; a 15-token prompt with max_model_len 18
    would need 16 and is admitted too, one of 16 tokens with max_model_len 18 would not fit."""
    from tests.engine.test_scheduler_running_and_swap_in import scheduler
    for num_prompt, max_model_len, fits in ((16, 17, True), (15, 18, True), (16, 18, False)):
        sched = scheduler(num_blocks=4, max_num_batched_tokens=16, max_model_len=max_model_len)
        seq = Sequence("S", 0, list(range(10, 10 + num_prompt)), SamplingParams(max_tokens=8, ignore_eos=True),
                       0.0, 0, 0)
        sched.add(seq)
        out = sched.schedule()
        assert (out.seqs == [seq]) is fits and (out.rejected == [seq]) is not fits, (num_prompt, max_model_len)


def victims_beside_forked_samples(order: list[str], needing_protected: bool):
    """A hand-built batch (newest-sparing, recompute, blocks of 4), admitted in `order`: each named
    sequence holds its 4-token prompt's block alone, but P1, P's sample forked from it, shares P's
    block (preempting either frees nothing). N is the sequence needing a block; `needing_protected`:
    it is resumed and still re-prefilling (newest-sparing spares it)."""
    from tests.engine.test_scheduler_running_and_swap_in import scheduler
    sched = scheduler(num_blocks=16, max_num_batched_tokens=16, preemption_mode="recompute",
                      preemption_policy="newest-sparing")
    seqs = {}
    for name in order:
        if name == "P1":
            seq = Sequence("P", 1, list(seqs["P"].token_ids), seqs["P"].params, 0.0, 0, 0)
            sched.bm.fork(seqs["P"], seq)
        else:
            seq = Sequence(name, 0, list(range(10, 14)), SamplingParams(max_tokens=8, ignore_eos=True), 0.0, 0, 0)
            sched.bm.allocate(seq, [], 4, "new")
            seq.num_computed_tokens = 4
        seq.admitted_order = len(sched.running)
        sched.running.append(seq)
        seqs[name] = seq
    seqs["N"].protected = needing_protected
    sched.bm.check_integrity(sched.all_seqs())
    return sched, seqs


def test_a_spared_sequence_needing_a_block_takes_a_victim_that_frees_one_over_a_newer_one_that_frees_none():
    # X (oldest) holds its blocks alone; P's samples (newer) share theirs; N (newest) is resumed and
    # spared: it preempts X, whose release frees blocks, not P's sample 1 and not itself
    sched, seqs = victims_beside_forked_samples(["X", "P", "P1", "N"], needing_protected=True)
    assert sched._pick_victim(seqs["N"]) == (seqs["X"], "newest")


def test_when_no_other_victim_frees_a_block_the_newest_of_all_is_taken_even_if_it_frees_none():
    # N (oldest, not spared) needs a block; only P's samples are others, and neither frees a block on
    # its own: the newest of them and N (P's sample 1) is taken
    sched, seqs = victims_beside_forked_samples(["N", "P", "P1"], needing_protected=False)
    victim, _ = sched._pick_victim(seqs["N"])
    assert victim is seqs["P1"]


def test_a_sequence_needing_a_block_preempts_itself_before_a_newer_one_that_frees_none():
    # X (oldest) frees a block, N needs one, P's samples (newer than N) free none: the candidates are
    # those that free a block and N itself, and N, the newer of X and N, is taken, not P's sample 1
    sched, seqs = victims_beside_forked_samples(["X", "N", "P", "P1"], needing_protected=False)
    assert sched._pick_victim(seqs["N"]) == (seqs["N"], "newest")


def test_copy_on_write_samples_preempted_by_recompute_go_one_at_a_time(make_engine):
    # recompute mode, --n-mode cow, 4 blocks of 4: B (3 tokens) and C (9 tokens, n=2) fill the pool;
    # in step 1 C's first sample must copy their shared partial block and no block is free. Only swap
    # mode takes a request's samples together (vLLM V0 swapped a group whole): by recompute only the
    # newest sample is preempted, even with host blocks to spare (--num-cpu-blocks, unused by recompute),
    # and C's first sample, now the block's sole holder, decodes
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=4, preemption_mode="recompute", enable_prefix_caching=False,
                         n_mode="cow", num_cpu_blocks=8)
    engine.add_request("B", [1, 2, 3], ignore_eos(3), arrival_s=0.0)
    engine.add_request("C", list(range(40, 49)), sampled(3, n=2), arrival_s=0.0)
    run_checked(engine)
    assert preempts(tracer)[0] == (1, "C", 1, "recompute")
    assert step_events(tracer, 1)[0] == ("preempt", "C", 1, [2, 3, 4], "recompute")
    assert sorted(tracer.records[1].token_samples) == [0, 0]


def test_a_victims_pending_copy_on_write_is_dropped_and_the_others_kept():
    """The running pass decided two copy-on-writes in this step, into the blocks X and N now hold, then
    preempts X: X's copy is dropped (its new block holds nothing yet), N's stays."""
    from engine.scheduler import SchedulerOutput
    sched, seqs = victims_beside_forked_samples(["X", "N", "P", "P1"], needing_protected=False)
    x_block, n_block = seqs["X"].block_table[0], seqs["N"].block_table[0]
    out = SchedulerOutput()
    out.copies = [(3, x_block), (4, n_block)]
    sched._preempt([seqs["X"]], out, seqs["N"])
    assert out.copies == [(4, n_block)]
