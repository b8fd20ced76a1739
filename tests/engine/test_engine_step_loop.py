"""The engine's step loop (engine/llm_engine.py): the run's counters (meta.json's summary), the
livelock guard, the sync and async loops' records, the requests rows of samples a rejected request
never forked, a request's first-scheduled and first-token times, positions counted as recomputed, the
async loop's tokens in flight, the end of an interrupted run, and the integrity check's waiting queue."""
from __future__ import annotations

import math
import sys
import time

import pytest
import torch

from engine.llm_engine import (
    MAX_STEPS_WITHOUT_PROGRESS,
    LivelockError,
    LLMEngine,
)
from engine.scheduler import SchedulerOutput
from engine.sequence import SamplingParams, SequenceStatus
from tests.helpers.engine_runs import ListTracer, run_checked

# ---------------------------------------------------------------- the run's counters (meta.json's summary)

def mixed_requests(engine, stop_token: int | None = None) -> list:
    """A preempting mix: samples of one request, one that stops on EOS, one too long to ever run (no
    room for a token within max_model_len 32), one that just fits (room for one token)."""
    seqs = [engine.add_request("n3", [40, 41, 42, 43, 44], SamplingParams(max_tokens=6, n=3, temperature=1.0, seed=1)),
            engine.add_request("long", list(range(60, 75)), SamplingParams(max_tokens=12, ignore_eos=True)),
            engine.add_request("eos", [5, 6, 7, 8], SamplingParams(max_tokens=9)),
            engine.add_request("too-big", list(range(100, 132)), SamplingParams(max_tokens=2)),
            engine.add_request("just-fits", list(range(200, 231)), SamplingParams(max_tokens=5, ignore_eos=True))]
    return seqs


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_the_engine_counts_each_finished_sequence_and_preemption_once(make_engine, async_scheduling):
    probe = make_engine(block_size=4, num_gpu_blocks=16)
    eos = probe.generate([[5, 6, 7, 8]], SamplingParams(max_tokens=2))[0][1]   # "eos" stops after two tokens
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=10, max_num_batched_tokens=16, max_model_len=32,
                         async_scheduling=async_scheduling)
    engine.stop_token_ids = frozenset({eos})
    seqs = mixed_requests(engine)
    run_checked(engine)
    finished = [(s.req_id, s.sample, s.finish_reason) for r in tracer.records for s in r.finished]
    assert sorted(finished) == [("eos", 0, "stop"), ("just-fits", 0, "length"), ("long", 0, "length"), ("n3", 0, "length"), ("n3", 1, "length"),
                                ("n3", 2, "length"), ("too-big", 0, "rejected")]
    assert engine.num_finished_seqs == 7
    # every output token is recorded once, at its index, with its id
    recorded = {}
    for r in tracer.records:
        for req_id, sample, idx, token in zip(r.token_req_ids, r.token_samples, r.token_idx, r.token_ids):
            recorded.setdefault((req_id, sample), []).append((idx, token))
    for seq in engine.outputs.values():
        output = seq.token_ids[seq.num_prompt_tokens:]
        assert recorded.get((seq.req_id, seq.sample), []) == list(enumerate(output)), (seq.req_id, seq.sample)
    assert seqs[-1].num_output_tokens == 1
    assert engine.num_preemptions == sum(r.num_preemptions for r in tracer.records) > 0


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_rejected_alone_is_a_step_that_computes_nothing(make_engine, async_scheduling):
    tracer = ListTracer()
    engine = make_engine(tracer, max_model_len=8, async_scheduling=async_scheduling)
    engine.add_request("too-long", list(range(10, 18)), SamplingParams(max_tokens=2))   # 8 + 1 > 8
    run_checked(engine)
    [record] = tracer.records
    assert (record.num_prefill_tokens, record.num_decode_tokens, record.num_recompute_tokens) == (0, 0, 0)
    assert [(s.req_id, s.finish_reason, s.output_tokens) for s in record.finished] == [("too-long", "rejected", 0)]
    assert engine.num_finished_seqs == 1


def test_the_real_engine_idles_in_short_naps_and_not_at_all_past_the_arrival(make_engine):
    # a replay waiting for its next arrival: the real engine naps at most 50 ms at a time (so a signal or
    # an arrival is seen soon), and not at all once the arrival has passed
    engine = make_engine()
    engine.start_clock()
    began = time.perf_counter()
    engine.idle_until(60.0)
    assert 0.05 <= time.perf_counter() - began < 0.5
    began = time.perf_counter()
    for _ in range(5):
        engine.idle_until(engine.now() - 1.0)
    assert time.perf_counter() - began < 0.1


def test_swap_events_carry_their_bytes_and_their_share_of_the_copy_time(make_engine):
    # the simulated engine times each step's copies in one direction as one transfer; an event gets the
    # share of its blocks
    tracer = ListTracer()
    engine = make_engine(tracer, engine="sim", block_size=4, num_gpu_blocks=8, preemption_mode="swap",
                         max_num_batched_tokens=32)
    for i in range(4):
        engine.add_request(f"r{i}", list(range(20 + 10 * i, 29 + 10 * i)), SamplingParams(max_tokens=12, ignore_eos=True))
    run_checked(engine)
    per_block = engine.geometry.bytes_per_block
    swaps = [e for e in tracer.events if e.kind in ("swap_out", "swap_in")]
    assert {e.kind for e in swaps} == {"swap_out", "swap_in"} and max(len(e.blocks) for e in swaps) >= 2
    for e in swaps:
        together = sum(len(o.blocks) for o in swaps if (o.step, o.kind) == (e.step, e.kind))
        assert e.bytes == len(e.blocks) * per_block
        assert e.duration_ms == pytest.approx(engine.runner.cost_model.swap_ms(together * per_block) * len(e.blocks) / together)


@pytest.mark.cuda
def test_the_step_loop_waits_for_the_device_only_at_the_flush(make_engine, monkeypatch):
    # step records are handed over as their device timings resolve; only the end of the run waits
    tracer = ListTracer()
    engine = make_engine(tracer, device="cuda", num_gpu_blocks=30)
    waits = []
    synchronize = torch.cuda.synchronize

    def counted(*args, **kwargs):
        if sys._getframe(1).f_code.co_name == "_flush_records":
            waits.append(engine.step_counter)
        return synchronize(*args, **kwargs)

    monkeypatch.setattr(torch.cuda, "synchronize", counted)
    for i in range(3):
        engine.add_request(str(i), [5 + i, 6, 7, 8, 9], SamplingParams(max_tokens=6, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    assert waits == []
    engine.flush()
    assert waits == [engine.step_counter] and len(tracer.records) == engine.step_counter
    assert all(r.device_ms is not None and r.device_ms > 0 for r in tracer.records)



def test_only_the_flush_waits_for_the_device_cpu_stand_in(make_engine, monkeypatch):
    # the CUDA test above, where no GPU is: the runner says it is on CUDA and synchronize is counted;
    # handing records over step by step never waits, the end of the run waits once
    engine = make_engine(num_gpu_blocks=30)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=3, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    waits = []
    monkeypatch.setattr(engine.runner, "is_cuda", True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: waits.append(device))
    engine._flush_records(wait=False)
    assert waits == []
    engine.flush()
    assert waits == [engine.device]


class _Event:
    """A stand-in CUDA event: done when the test says so, 2.5 ms after its start."""

    def __init__(self, done: bool) -> None:
        self.done = done

    def query(self) -> bool:
        return self.done

    def elapsed_time(self, end) -> float:
        return 2.5


def test_records_wait_for_their_device_timing_in_order_and_the_flush_takes_them_all(make_engine, monkeypatch):
    # each step's forward ends on a stand-in event that is not done: its record (and every later one,
    # in step order) waits; once its event is done the next step hands it over; the flush takes the rest
    tracer = ListTracer()
    engine = make_engine(tracer, num_gpu_blocks=30)
    ends = []
    execute = engine.runner.execute

    def on_events(out):
        result = execute(out)
        ends.append(_Event(done=False))
        result.timing.forward = (_Event(done=True), ends[-1])
        return result

    monkeypatch.setattr(engine.runner, "execute", on_events)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.step()
    assert tracer.records == []
    ends[0].done = True
    engine.step()
    assert [(r.step, r.device_ms) for r in tracer.records] == [(0, 2.5)]
    while engine.has_unfinished():
        engine.step()
    engine.flush()
    assert [r.step for r in tracer.records] == list(range(engine.step_counter))

# ---------------------------------------------------------------- the livelock guard

def stalled_engine(make_engine, async_scheduling: bool = False) -> LLMEngine:
    engine = make_engine(block_size=4, num_gpu_blocks=16, max_model_len=16, async_scheduling=async_scheduling)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.scheduler.schedule = lambda: SchedulerOutput()    # a scheduler that never runs anything
    return engine


def test_a_livelock_is_reported_after_the_limit_of_steps_without_a_token(make_engine):
    engine = stalled_engine(make_engine)
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS):
        engine.step()
    with pytest.raises(LivelockError, match=f"no token emitted in {MAX_STEPS_WITHOUT_PROGRESS} steps with "
                                            "0 running, 1 waiting, 0 swapped"):
        engine.step()
    assert MAX_STEPS_WITHOUT_PROGRESS == 10_000


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_token_resets_the_livelock_count(make_engine, async_scheduling):
    engine = stalled_engine(make_engine, async_scheduling)
    stalled = engine.scheduler.schedule
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS - 1):
        engine.step()
    del engine.scheduler.schedule          # the real scheduler again: a token (a step later with async)
    while not engine.step():
        pass
    engine.scheduler.schedule = stalled
    while engine.step():                   # with async, the token still in flight is delivered
        pass
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS - 1):   # the count starts again from 0, not from where it was
        engine.step()
    with pytest.raises(LivelockError):
        engine.step()


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_idle_engine_is_not_a_livelock(make_engine, async_scheduling):
    # a server steps its engine while no request is in: those steps emit nothing and are not a stall,
    # nor do they count towards one that follows
    engine = make_engine(block_size=4, num_gpu_blocks=16, max_model_len=16, async_scheduling=async_scheduling)
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS + 1):
        assert engine.step() == []
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True))
    engine.scheduler.schedule = lambda: SchedulerOutput()
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS):
        engine.step()
    with pytest.raises(LivelockError):
        engine.step()


# ---------------------------------------------------------------- the async loop

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_follow_up_prompt_hits_the_blocks_the_first_answer_filled(make_engine, async_scheduling):
    # a chat's next turn: B's prompt is A's prompt and answer. A's 8 + 9 tokens fill 4 blocks of 4 (its
    # last token is never computed); with async scheduling they are cached as A's tokens are delivered
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=16, enable_prefix_caching=True,
                         async_scheduling=async_scheduling)
    a = engine.add_request("A", list(range(30, 38)), SamplingParams(max_tokens=9, ignore_eos=True))
    run_checked(engine)
    b = engine.add_request("B", list(a.token_ids), SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    assert [(e.req_id, e.num_tokens) for e in tracer.events if e.kind == "prefix_hit"] == [("B", 16)]
    assert b.num_prefix_hit_tokens == 16


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_rejection_counts_as_progress(make_engine, async_scheduling):
    engine = make_engine(block_size=4, num_gpu_blocks=16, max_model_len=16, async_scheduling=async_scheduling)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=2))
    engine.scheduler.schedule = lambda: SchedulerOutput()
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS - 1):
        engine.step()
    engine.add_request("too-long", list(range(10, 26)), SamplingParams(max_tokens=2))   # 16 + 1 > 16
    engine.step()                                          # it finishes: the engine is not stuck
    for _ in range(MAX_STEPS_WITHOUT_PROGRESS):
        engine.step()
    with pytest.raises(LivelockError):
        engine.step()



def finished_rows(tracer) -> list[tuple]:
    return sorted((s.req_id, s.sample, s.finish_reason, s.output_tokens) for r in tracer.records for s in r.finished)


# ---------------------------------------------------------------- rejected requests

@pytest.mark.parametrize("keep_outputs", [True, False])
def test_every_sample_of_a_request_rejected_before_forking_gets_a_requests_row(make_engine, keep_outputs):
    # --n-mode cow queues one sequence of an n > 1 request and forks the others when its prompt is done;
    # rejected before that, each of its n samples still finishes (a requests row each, and one
    # Sequence each in engine.outputs, unless a long replay turned those off). "big" can never run
    # (16 + 1 positions > max_model_len 16); "huge" fits max_model_len but never the pool of 3 blocks of 4
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=3, max_model_len=16, n_mode="cow")
    engine.keep_outputs = keep_outputs
    big = engine.add_request("big", list(range(10, 26)), SamplingParams(max_tokens=2, n=3, temperature=1.0))
    huge = engine.add_request("huge", list(range(30, 43)), SamplingParams(max_tokens=2, n=2, temperature=1.0))
    ok = engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2, n=2, temperature=1.0, ignore_eos=True))
    run_checked(engine)
    assert finished_rows(tracer) == [("big", 0, "rejected", 0), ("big", 1, "rejected", 0), ("big", 2, "rejected", 0),
                                     ("huge", 0, "rejected", 0), ("huge", 1, "rejected", 0),
                                     ("ok", 0, "length", 2), ("ok", 1, "length", 2)]
    assert engine.num_finished_seqs == 7
    assert big.num_pending_forks == huge.num_pending_forks == ok.num_pending_forks == 0
    if keep_outputs:
        assert sorted(engine.outputs) == [("big", 0), ("big", 1), ("big", 2), ("huge", 0), ("huge", 1),
                                          ("ok", 0), ("ok", 1)]
        for (req_id, sample), seq in engine.outputs.items():
            assert seq.status == SequenceStatus.FINISHED and seq.sample == sample
            if req_id != "ok":
                assert seq.finish_reason == "rejected" and seq.token_ids == engine.outputs[(req_id, 0)].token_ids
    else:
        assert engine.outputs == {}


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_a_request_the_pool_can_never_hold_reads_finished_from_the_step_that_rejects_it(make_engine, async_scheduling):
    # 20 + 1 positions fit max_model_len 64 but never 4 blocks of 4: the scheduler rejects it in the first
    # step, and its sequence (the one add_request returned) is finished from then on, like one rejected
    # on arrival
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=4, max_model_len=64, async_scheduling=async_scheduling)
    huge = engine.add_request("huge", list(range(20, 40)), SamplingParams(max_tokens=2))
    small = engine.add_request("small", [5, 6, 7], SamplingParams(max_tokens=3, ignore_eos=True))
    engine.step()
    assert (huge.status, huge.finish_reason) == (SequenceStatus.FINISHED, "rejected")
    assert small.status == SequenceStatus.RUNNING
    run_checked(engine)
    assert finished_rows(tracer) == [("huge", 0, "rejected", 0), ("small", 0, "length", 3)]
    assert huge.status == small.status == SequenceStatus.FINISHED


# ---------------------------------------------------------------- the requests row's times

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_first_scheduled_and_first_token_times_are_those_of_the_first_admission_and_token(make_engine, async_scheduling):
    # three requests in 8 blocks of 4 preempt each other (recompute): a request's first_scheduled_s is the
    # start of the step that first admitted it (not a later re-admission), its first_token_s falls within
    # the step whose record carries its first token (with async scheduling: the moment it is delivered,
    # that record's end)
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=8, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 + 10 * i, 16 + 10 * i)), SamplingParams(max_tokens=10, ignore_eos=True))
    run_checked(engine)
    admits = [e for e in tracer.events if e.kind == "admit"]
    assert {e.reason for e in admits} == {"new", "resume-recompute"}
    rows = {s.req_id: s for r in tracer.records for s in r.finished}
    assert sorted(rows) == ["r0", "r1", "r2"] and any(s.preemptions for s in rows.values())
    for req_id, row in rows.items():
        first_admit = next(e for e in admits if e.req_id == req_id)
        assert first_admit.reason == "new" and row.first_scheduled_s == first_admit.ts_s
        (first,) = [r for r in tracer.records for rid, idx in zip(r.token_req_ids, r.token_idx) if (rid, idx) == (req_id, 0)]
        assert first.start_s <= row.first_token_s <= first.end_s <= row.finish_s
        if async_scheduling:
            assert row.first_token_s == first.end_s


# ---------------------------------------------------------------- recomputed positions

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_positions_taken_from_the_prefix_cache_are_not_recomputed_ones(make_engine, async_scheduling):
    # B's prompt starts with A's 8 prompt tokens: 2 blocks from the prefix cache, its KV computed once; B
    # computes the rest for the first time (recomputed: 0, not a negative count)
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, enable_prefix_caching=True, async_scheduling=async_scheduling)
    engine.add_request("A", list(range(30, 38)), SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    b = engine.add_request("B", list(range(30, 38)) + [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    assert b.num_prefix_hit_tokens == 8
    assert [r.num_recompute_tokens for r in tracer.records] == [0] * len(tracer.records)
    assert [(s.req_id, s.recomputed_tokens, s.prefix_hit_tokens) for r in tracer.records for s in r.finished] == [
        ("A", 0, 0), ("B", 0, 8)]


# ---------------------------------------------------------------- async scheduling: tokens in flight

def in_flight_tokens(engine) -> dict[int, int]:
    """id(sequence) -> its tokens sampled and not yet delivered (the engine's pending step)."""
    counts: dict[int, int] = {}
    if engine._in_flight is not None:
        for seq, _ in engine._in_flight.sampled:
            counts[id(seq)] = counts.get(id(seq), 0) + 1
    return counts


def test_an_async_sequence_counts_exactly_its_token_in_flight_as_undelivered(make_engine):
    # Sequence.num_undelivered is the tokens at the end of token_ids whose output the engine has not
    # processed: the one sampled by the pending step, none once it is delivered; and each output token
    # is decoded once (max_tokens - 1 decodes: the last token is never an input)
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, async_scheduling=True)
    seqs = [engine.add_request(f"r{i}", list(range(10 + 10 * i, 15 + 10 * i)), SamplingParams(max_tokens=7, ignore_eos=True))
            for i in range(2)]
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        in_flight = in_flight_tokens(engine)
        for seq in seqs:
            assert seq.num_undelivered == in_flight.get(id(seq), 0), (engine.step_counter, seq)
    engine.flush()
    assert sum(r.num_decode_tokens for r in tracer.records) == 2 * 6
    assert [len(s.token_ids) - s.num_prompt_tokens for s in seqs] == [7, 7]


@pytest.mark.parametrize("joins_after", [1, 2])
def test_an_async_request_hits_the_blocks_a_running_sequence_fills_up_to_its_delivered_tokens(make_engine, joins_after):
    # V1 caches a running sequence's blocks when it schedules them, but never past its delivered tokens
    # (request.num_tokens: the token in flight is not one of them). B continues A's tokens, the one in
    # flight included, and arrives while A decodes: it is admitted after A is scheduled and hits every
    # full block of A's delivered tokens, the one this very step completes included (7 + 1 delivered: 2
    # blocks of 4), and none beyond (7 + 1 in flight: 1 block)
    engine = make_engine(block_size=4, enable_prefix_caching=True, async_scheduling=True)
    a = engine.add_request("A", list(range(30, 37)), SamplingParams(max_tokens=5, ignore_eos=True))
    for _ in range(joins_after):
        engine.step()
    assert a.num_undelivered == 1
    delivered = a.num_tokens - 1
    b = engine.add_request("B", list(a.token_ids) + [5], SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert b.status == SequenceStatus.RUNNING
    assert b.num_prefix_hit_tokens == delivered // 4 * 4
    run_checked(engine)


# ---------------------------------------------------------------- an interrupted run

@pytest.mark.parametrize("async_scheduling", [False, True])
def test_an_interrupted_run_keeps_only_delivered_tokens_and_aborts_every_unfinished_sequence(make_engine, async_scheduling):
    # interrupted after 4 steps (replay's SIGINT path: flush, then abort_all): the tokens still in flight
    # (async) are taken back, so each sequence holds exactly the tokens its records carry; every sequence
    # still running, waiting or swapped gets an "aborted" requests row
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=6, max_num_seqs=2, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    seqs = [engine.add_request(f"r{i}", list(range(10 + 10 * i, 15 + 10 * i)), SamplingParams(max_tokens=9, ignore_eos=True))
            for i in range(3)]
    for _ in range(4):
        engine.step()
    assert len(engine.scheduler.running) == 2 and len(engine.scheduler.waiting) == 1
    engine.flush()
    recorded = {}
    for r in tracer.records:
        for req_id, idx in zip(r.token_req_ids, r.token_idx):
            recorded.setdefault(req_id, []).append(idx)
    expected = 3 if async_scheduling else 4
    assert recorded == {"r0": list(range(expected)), "r1": list(range(expected))}
    for seq in seqs:
        assert seq.num_output_tokens == len(recorded.get(seq.req_id, []))
        assert seq.num_undelivered == 0
    assert len(tracer.records) == 4
    aborted = engine.abort_all()
    assert sorted((s.req_id, s.finish_reason, s.output_tokens) for s in aborted) == [
        ("r0", "aborted", expected), ("r1", "aborted", expected), ("r2", "aborted", 0)]
    assert all(s.finish_s >= tracer.records[-1].start_s for s in aborted)
    assert [seq.finish_reason for seq in seqs] == ["aborted"] * 3   # the sequences themselves, as their rows


def test_an_interrupted_simulated_run_reports_the_tokens_its_decode_cohort_had_not_written_out(make_engine):
    # the simulator's running decodes advance lazily (engine/sim/cohort.py): interrupted mid-run, the
    # aborted rows still count every token the records carry
    tracer = ListTracer()
    engine = make_engine(tracer, engine="sim", hardware="a100-80gb", block_size=4, num_gpu_blocks=64,
                         enable_prefix_caching=False)
    for i in range(3):
        engine.add_request(f"r{i}", list(range(10 + 10 * i, 15 + 10 * i)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.fast_path._leap_worth_it = lambda until_s: False   # lazy steps only
    for _ in range(12):
        engine.advance()
    assert engine.fast_path.cohort.num_members == 3
    engine.flush()
    recorded = {}
    for r in tracer.records:
        for req_id in r.token_req_ids:
            recorded[req_id] = recorded.get(req_id, 0) + 1
    aborted = engine.abort_all()
    assert sorted((s.req_id, s.output_tokens) for s in aborted) == sorted(recorded.items())
    assert recorded == {"r0": 12, "r1": 12, "r2": 12}


# ---------------------------------------------------------------- the integrity check

def test_the_integrity_check_catches_a_waiting_sequence_that_kept_its_blocks(make_engine):
    # a preemption that forgot to free: the block manager's own books still balance (the blocks are
    # referenced by a sequence it knows of), but a waiting sequence must hold none
    engine = make_engine(block_size=4, num_gpu_blocks=16)
    engine.add_request("a", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True))
    engine.step()
    engine.check_integrity()
    sched = engine.scheduler
    seq = sched.running.pop()
    seq.status = SequenceStatus.WAITING
    sched.waiting.appendleft(seq)
    with pytest.raises(AssertionError, match=r"waiting Sequence\(a#0 WAITING .* holds blocks"):
        engine.check_integrity()


def test_async_scheduling_computes_no_position_past_the_max_model_len(make_engine):
    """A sequence that runs into max_model_len: async scheduling, whose next step is scheduled before the
    token in flight is delivered, must not schedule an input position at or past the limit (the
    scheduler clamps, as vLLM's does): the same positions computed and tokens made as synchronous."""
    results = {}
    for async_scheduling in (False, True):
        tracer = ListTracer()
        engine = make_engine(tracer, block_size=4, max_model_len=12, async_scheduling=async_scheduling)
        engine.add_request("long", list(range(10, 15)), SamplingParams(max_tokens=40))   # capped by 12
        engine.add_request("short", list(range(20, 23)), SamplingParams(max_tokens=3))
        run_checked(engine)
        computed = sum(r.num_prefill_tokens + r.num_decode_tokens + r.num_recompute_tokens for r in tracer.records)
        finished = sorted((s.req_id, s.finish_reason, s.output_tokens) for r in tracer.records for s in r.finished)
        results[async_scheduling] = computed, finished
    assert results[True] == results[False]
    assert ("long", "length", 7) in results[False][1]   # 5 + 7 = 12 positions


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_sequences_finishing_in_one_step_are_freed_in_the_order_it_scheduled_them(make_engine, async_scheduling):
    # chunks of 4 while others wait: A (8 tokens, admitted first) prefills its second chunk in step 1
    # while B (4 tokens) decodes beside it, and both finish there. The runner samples decodes first (B,
    # then A), but V1 frees the finished in the step's scheduled order, A then B: the order their
    # blocks join the free queue, which decides the blocks that later allocations take
    tracer = ListTracer()
    engine = make_engine(tracer, long_prefill_token_threshold=4, async_scheduling=async_scheduling)
    engine.add_request("A", list(range(10, 18)), SamplingParams(max_tokens=1, ignore_eos=True), arrival_s=0.0)
    engine.add_request("B", [5, 6, 7, 9], SamplingParams(max_tokens=2, ignore_eos=True), arrival_s=0.0)
    run_checked(engine)
    assert [(r.num_prefill_tokens, r.num_decode_tokens) for r in tracer.records][:2] == [(8, 0), (4, 1)]
    assert [(e.kind, e.req_id) for e in tracer.events if e.kind in ("free", "finish")] == [
        ("free", "A"), ("free", "B"), ("finish", "A"), ("finish", "B")]


@pytest.mark.parametrize("engine_kind", ["real", "sim"])
@pytest.mark.parametrize("async_scheduling", [False, True])
def test_advance_counts_what_step_returns_in_both_loops(make_engine, engine_kind, async_scheduling):
    # a replay steps with advance, which counts the tokens rather than make (sequence, token) pairs, and
    # may run several steps at once (the simulator's fast path): its counts must add up to what step
    # returns (the async loop's are its previous step's), and the trace must be the same
    def run(advancing: bool) -> tuple[list[int], list]:
        tracer = ListTracer()
        settings = dict(engine="sim", num_gpu_blocks=64) if engine_kind == "sim" else {}
        engine = make_engine(tracer, async_scheduling=async_scheduling, max_num_batched_tokens=8, **settings)
        engine.add_request("A", [5, 6, 7, 8, 9], SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=0.0)
        engine.add_request("B", [3, 4], SamplingParams(max_tokens=6, n=2, ignore_eos=True), arrival_s=0.0)
        counts = []
        while engine.has_unfinished() and len(counts) < 50:
            if len(counts) == 4:   # a prompt joins while the others decode
                engine.add_request("C", [11, 12, 13], SamplingParams(max_tokens=3, ignore_eos=True), arrival_s=0.0)
            if advancing:
                num_steps, num_tokens = engine.advance(math.inf if len(counts) >= 4 else engine.now())
                counts += [num_tokens] + [0] * (num_steps - 1)
            else:
                counts.append(len(engine.step()))
        return counts, [(r.step, r.num_prefill_tokens, r.num_decode_tokens, [(e.kind, e.req_id) for e in r.events],
                         list(zip(r.token_req_ids, r.token_samples, r.token_idx))) for r in tracer.records]

    advanced, trace = run(advancing=True)
    stepped, stepped_trace = run(advancing=False)
    assert trace == stepped_trace and sum(advanced) == sum(stepped) == 4 + 2 * 6 + 3
    assert len(advanced) == len(stepped)
    assert any(prefill and decode for _, prefill, decode, _, _ in trace)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_positions_recomputed_in_chunks_are_each_counted_once(make_engine, async_scheduling):
    # a budget of 4 tokens re-prefills a preempted sequence's 12 or 16 lost positions in chunks: every
    # chunk inside the lost span is recomputation, the position after it is new, and the counts of the
    # steps, the sequences and the re-prefill events agree with the positions each preemption lost
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=9, max_num_batched_tokens=4, enable_prefix_caching=False,
                         async_scheduling=async_scheduling)
    seqs = [engine.add_request(f"r{i}", list(range(10 + i, 22 + i)), SamplingParams(max_tokens=12, ignore_eos=True),
                               arrival_s=0.0) for i in range(3)]
    run_checked(engine)
    lost, recomputed = {}, {}
    for e in tracer.events:
        if e.kind == "preempt":
            lost[e.req_id] = lost.get(e.req_id, 0) + e.num_tokens
        elif e.kind == "reprefill":
            assert e.num_cached_tokens == 0 and e.num_tokens > e.num_recomputed_tokens
            recomputed[e.req_id] = recomputed.get(e.req_id, 0) + e.num_recomputed_tokens
    assert lost and recomputed == lost
    assert {s.req_id: s.num_recomputed_tokens for s in seqs if s.num_recomputed_tokens} == lost
    assert sum(r.num_recompute_tokens for r in tracer.records) == sum(lost.values())


def test_samples_forked_or_finished_unforked_carry_their_requests_standing(make_engine):
    # --n-mode cow: the samples of a request share its arrival, priority and arrival order (the
    # priority policy's tie-break), whether forked when its prompt is done or finished unforked with a
    # rejected parent; a forked sample also starts where its parent stands: first scheduled, prefix
    # positions hit, positions reserved (--kv-reserve), stop length, positions computed
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=40, max_model_len=24, n_mode="cow",
                         enable_prefix_caching=True, kv_reserve="max-tokens", preemption_policy="priority")
    engine.add_request("warm", list(range(40, 48)), SamplingParams(max_tokens=1), arrival_s=0.0)
    engine.step()
    engine.step()
    parent = engine.add_request("R", list(range(40, 50)), SamplingParams(max_tokens=20, n=3, temperature=1.0,
                                                                          ignore_eos=True), arrival_s=0.5, priority=2)
    engine.add_request("big", list(range(60, 84)), SamplingParams(max_tokens=2, n=2, temperature=1.0),
                       arrival_s=0.25, priority=1)
    while parent.num_pending_forks:
        engine.step()
    children = [engine.outputs[("R", i)] for i in (1, 2)]
    assert parent.num_prefix_hit_tokens == 8 and parent.num_reserved_tokens == 24
    for child in children:
        for name in ("arrival_s", "priority", "arrival_order", "first_scheduled_s", "num_prefix_hit_tokens",
                     "num_reserved_tokens", "stop_num_tokens", "num_ever_computed"):
            assert getattr(child, name) == getattr(parent, name), name
    run_checked(engine)
    rows = {(r.req_id, r.sample): r for rec in tracer.records for r in rec.finished}
    assert [(rows[("big", i)].arrival_s, rows[("big", i)].priority, rows[("big", i)].finish_reason) for i in (0, 1)] \
        == [(0.25, 1, "rejected")] * 2
    # the samples stop at max_model_len (24 positions), not at the prompt plus max_tokens (30)
    assert [(rows[("R", i)].output_tokens, rows[("R", i)].finish_reason) for i in range(3)] == [(14, "length")] * 3


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_generate_hands_every_steps_record_to_the_tracer(make_engine, async_scheduling):
    # generate runs to the end and flushes: the async loop's last step (its output never processed)
    # is recorded too, one record a step
    tracer = ListTracer()
    engine = make_engine(tracer, async_scheduling=async_scheduling)
    engine.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert [r.step for r in tracer.records] == list(range(engine.step_counter))
