"""The engine loop (engine/llm_engine.py) where the other tests do not look: how the pools are sized,
the run's counters (meta.json's summary), the livelock guard, and the sync and async step loops'
records. Each test here was written for a mutant of engine/llm_engine.py that no other test noticed
(scripts/mutation.py, issue 20)."""
from __future__ import annotations

import sys
import time

import pytest
import torch

from engine.config import PRESETS, EngineConfig
from engine.llm_engine import MAX_STEPS_WITHOUT_PROGRESS, LivelockError, LLMEngine, pool_geometry
from engine.scheduler import SchedulerOutput
from engine.sequence import SamplingParams
from tests.conftest import one_line_error, run_checked
from tests.test_preemption import ListTracer

TINY_BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 4   # K and V x 2 layers x 2 KV heads x 16 dims x fp32 x 4 positions


# ---------------------------------------------------------------- sizing the pools

def test_gpu_memory_utilization_leaves_the_documented_block_counts():
    # docs/simulation.md: Llama-3-8B bf16 on an 80 GB H100 at 0.9, 256 sequences and 8,192 tokens a step:
    # 72.0 GB - 16.06 GB weights - 0.97 GB activations - 1 GiB = 53.9 GB of KV in 2 MiB blocks, one of
    # them V1's null block; vLLM's H100 defaults (1,024 sequences, 16,384 tokens) leave 25,110
    mc = PRESETS["llama-3-8b"]
    per_token = 4 * mc.hidden_size + (mc.num_heads + 2 * mc.num_kv_heads) * mc.head_dim + 2 * mc.intermediate_size
    for limits, (seqs, tokens, blocks) in (({"max_num_seqs": 256, "max_num_batched_tokens": 8192}, (256, 8192, 25_698)),
                                           ({}, (1024, 16_384, 25_110))):   # an H100's: a CUDA device's defaults
        engine = LLMEngine(EngineConfig(model="llama-3-8b", engine="sim", hardware="h100-sxm", dtype="bfloat16",
                                        gpu_memory_utilization=0.9, **limits))
        assert (engine.config.max_num_seqs, engine.config.max_num_batched_tokens) == (seqs, tokens)
        d = engine.geometry.derivation
        # activations: every token's hidden states, q/k/v and MLP intermediates in bf16, fp32 logits a sequence
        assert d["activations"] == tokens * per_token * 2 + seqs * mc.vocab_size * 4
        assert d["non_torch"] == 1 << 30 and d["kv_bytes"] == 72 * 10**9 - d["weights"] - d["activations"] - (1 << 30)
        assert engine.geometry.num_gpu_blocks == d["num_gpu_blocks"] == blocks
        assert engine.block_manager.num_blocks == blocks


def test_gpu_memory_utilization_needs_room_for_one_block_besides_the_null_block():
    config = EngineConfig(model="tiny", block_size=4, gpu_memory_utilization=1.0, max_num_seqs=8,
                          max_num_batched_tokens=64)
    probe = pool_geometry(config, PRESETS["tiny"], 64, device_memory=1 << 40).derivation
    fixed = probe["weights"] + probe["activations"] + probe["non_torch"]
    assert pool_geometry(config, PRESETS["tiny"], 64, device_memory=fixed + 2 * TINY_BLOCK_BYTES).num_gpu_blocks == 1
    for short in (fixed + 2 * TINY_BLOCK_BYTES - 1, fixed - 1):   # one block (the null one), or less than nothing
        with pytest.raises(ValueError, match="--gpu-memory-utilization 1.0: .* leaves no KV block"):
            pool_geometry(config, PRESETS["tiny"], 64, device_memory=short)
    with pytest.raises(ValueError, match="needs a device whose memory is known"):
        pool_geometry(config, PRESETS["tiny"], 64, device_memory=None)


def test_a_device_too_small_for_the_weights_is_a_one_line_error_in_gigabytes(tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text('{"arrival_s": 0, "prompt_tokens": 10, "max_tokens": 4}\n')
    # 0.2 x 80 GB cannot even hold Llama-3-8B's bf16 weights; activations at vLLM's H100 defaults + 1 GiB
    assert one_line_error(["record", "-w", str(workload), "--model", "llama-3-8b", "--engine", "sim",
                           "--hardware", "h100-sxm", "--gpu-memory-utilization", "0.2", "-o", str(tmp_path / "r")]) == (
        "kvtrace: error: --gpu-memory-utilization 0.2: 16.0 GB of the device leaves no KV block after "
        "16.06 GB of weights and 3.28 GB of activations and runtime")
    assert not (tmp_path / "r").exists()


def test_kv_cache_memory_is_cut_into_blocks_less_the_null_block(make_engine):
    assert make_engine(num_gpu_blocks=None, kv_cache_memory=11 * TINY_BLOCK_BYTES).block_manager.num_blocks == 10
    assert make_engine(num_gpu_blocks=None, kv_cache_memory=2 * TINY_BLOCK_BYTES).block_manager.num_blocks == 1
    with pytest.raises(ValueError, match=f"--kv-cache-memory {2 * TINY_BLOCK_BYTES - 1} B holds no usable KV block"):
        make_engine(num_gpu_blocks=None, kv_cache_memory=2 * TINY_BLOCK_BYTES - 1)


def test_the_simulated_engine_takes_the_pool_option_it_is_given():
    # vLLM's 0.9 only stands in when no pool option is given
    for option, blocks in (({"kv_cache_memory": 11 * TINY_BLOCK_BYTES}, 10), ({"num_gpu_blocks": 7}, 7)):
        engine = LLMEngine(EngineConfig(model="tiny", engine="sim", block_size=4, **option))
        assert engine.block_manager.num_blocks == blocks
        assert engine.config.gpu_memory_utilization is None and engine.geometry.derivation is None


def test_without_a_pool_option_every_sequence_fits_at_full_length_up_to_one_gib(make_engine):
    # 8 sequences of 30 positions: 8 blocks of 4 each, and the null block
    engine = make_engine(num_gpu_blocks=None, max_num_seqs=8, max_model_len=30)
    assert engine.block_manager.num_blocks == 8 * 8
    # Llama-3-8B at 8,192 positions would want 256 x 512 blocks of 2 MiB: capped at 1 GiB
    config = EngineConfig(model="llama-3-8b", engine="sim", dtype="bfloat16", num_gpu_blocks=None, max_num_seqs=256)
    assert pool_geometry(config, PRESETS["llama-3-8b"], 8192).num_gpu_blocks == (1 << 30) // (2 << 20) - 1


def test_the_host_pool_follows_num_cpu_blocks_then_swap_space_then_the_preemption_mode(make_engine):
    def host_blocks(**overrides) -> int:
        return make_engine(num_gpu_blocks=12, **overrides).block_manager.num_cpu_blocks

    assert host_blocks(num_cpu_blocks=5, swap_space=40 * TINY_BLOCK_BYTES, preemption_mode="swap") == 5
    assert host_blocks(swap_space=7 * TINY_BLOCK_BYTES + 1, preemption_mode="swap") == 7
    assert host_blocks(preemption_mode="swap") == 12     # vLLM V0: as many as the device pool
    assert host_blocks() == 0                           # recompute needs none


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
        assert e.duration_ms == pytest.approx(engine.cost_model.swap_ms(together * per_block) * len(e.blocks) / together)


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
