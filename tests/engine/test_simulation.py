"""The simulated engine: the real scheduler and block manager, a cost model instead of the model.

Its KV decisions must be the real engine's, event for event and step for step, on any backlog
workload; only time is predicted.
"""
from __future__ import annotations

import dataclasses
import json
import random
from types import SimpleNamespace

import pytest
from typer.testing import CliRunner

import kvtrace.cli.commands  # noqa: F401  (registers the commands)
from engine.build import build_engine
from engine.config import PRESETS, EngineConfig
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams
from engine.sim.cost_model import PROFILE_DIR, CostModel, load_profile
from kvtrace.cli.app import app
from kvtrace.record.replay import prepare, replay
from kvtrace.workload.format import WorkloadRequest
from tests.helpers.cli import one_line_error, sql, write_workload
from tests.helpers.cli import record as record_cli
from tests.helpers.engine_runs import ListTracer, run_checked


def record(tmp_path, workload, name: str, *args: str):
    result, out = record_cli(tmp_path, workload, name, *args)
    assert result.exit_code == 0, result.output
    return out


def backlog_workload(seed: int, num_requests: int = 12) -> list[WorkloadRequest]:
    """Requests sharing a few system prompts, some with n > 1 (greedy and sampled), some stopping
    before their cap (`output_tokens`), all arriving at once."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(17, 512) for _ in range(rng.randint(6, 20))] for _ in range(3)]
    requests = []
    for i in range(num_requests):
        ids = rng.choice(prefixes) + [rng.randrange(17, 512) for _ in range(rng.randint(1, 30))]
        max_tokens = rng.randint(2, 24)
        output_tokens = rng.choice([None, rng.randint(1, max_tokens)])
        n = rng.choice([1, 1, 2, 3])
        requests.append(WorkloadRequest(id=f"r{i}", arrival_s=0.0, prompt_token_ids=ids, max_tokens=max_tokens,
                                        output_tokens=output_tokens, ignore_eos=True, n=n,
                                        temperature=rng.choice([0.0, 0.0, 0.9]), seed=i))
    return requests


def run(tiny_loaded, requests, **settings) -> tuple[LLMEngine, ListTracer]:
    tracer = ListTracer()
    engine = build_engine(EngineConfig(model="tiny", load_format="dummy", **settings), tracer, loaded=tiny_loaded)
    items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=True, workload_name="w")
    replay(engine, items)
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    return engine, tracer


def decisions(tracer: ListTracer) -> tuple[list, list]:
    events = [(e.step, e.kind, e.req_id, e.sample, e.blocks, e.src_blocks, e.num_tokens, e.reason,
               e.num_cached_tokens, e.num_recomputed_tokens, e.bytes) for e in tracer.events]
    steps = [(r.step, r.num_running, r.num_waiting, r.num_swapped, r.num_prefill_tokens, r.num_decode_tokens,
              r.num_recompute_tokens, r.num_preemptions, r.num_free_blocks, r.num_used_blocks,
              r.num_cached_blocks, r.num_kv_tokens, r.token_req_ids, r.token_samples, r.token_idx,
              [(s.req_id, s.sample, s.output_tokens, s.finish_reason, s.preemptions, s.swaps, s.recomputed_tokens,
                s.prefix_hit_tokens) for s in r.finished]) for r in tracer.records]
    return events, steps


SETTINGS = {
    "recompute": dict(preemption_mode="recompute"),
    "swap": dict(preemption_mode="swap", num_cpu_blocks=40, n_mode="cow"),   # vLLM V0's swap and forks
    "swap-small-host": dict(preemption_mode="swap", num_cpu_blocks=6),   # falls back to recompute
    "no-prefix-cache": dict(enable_prefix_caching=False),
    "fewest-computed": dict(preemption_policy="fewest-computed", max_num_batched_tokens=24),
    "reserve-max-tokens": dict(kv_reserve="max-tokens", num_gpu_blocks=40, n_mode="cow"),  # forks copy on write
    "watermark": dict(watermark=0.1, max_num_seqs=6),
}


@pytest.mark.parametrize("name, seed", [(name, 1) for name in SETTINGS] + [("recompute", 2), ("swap", 2)])
def test_simulated_decisions_are_the_real_engines(tiny_loaded, name, seed):
    requests = backlog_workload(seed)
    settings = dict(block_size=4, num_gpu_blocks=24, watermark=0.0, max_num_batched_tokens=64) | SETTINGS[name]
    real_engine, real = run(tiny_loaded, requests, **settings)
    sim_engine, sim = run(tiny_loaded, requests, engine="sim", hardware="a100-80gb", **settings)
    real_events, real_steps = decisions(real)
    sim_events, sim_steps = decisions(sim)
    assert sim_events == real_events
    assert sim_steps == real_steps
    kinds = {e[1] for e in real_events}
    if name in ("recompute", "swap", "reserve-max-tokens"):  # the workload does exercise what it claims
        assert "preempt" in kinds and "prefix_hit" in kinds
    if name == "swap":
        assert {"swap_out", "swap_in"} <= kinds and "cow" in kinds
    assert real_engine.num_preemptions == sim_engine.num_preemptions
    # the simulated trace keeps no token ids; its clock is the cost model's
    assert all(t is None for r in sim.records for t in r.token_ids)
    assert all(t is not None for r in real.records for t in r.token_ids)


@pytest.mark.long  # the real SmolLM2 weights through both engines (a minute)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["recompute", "swap"])
def test_simulated_decisions_are_the_real_engines_on_smollm2(name):
    """The same on the real SmolLM2-135M weights (greedy and sampled tokens of a real model)."""
    import torch

    from engine.model.loader import load_weights
    try:
        loaded = load_weights("smollm2-135m", dtype=torch.float32)
    except (FileNotFoundError, ImportError, ValueError) as exc:
        pytest.skip(f"SmolLM2 weights not installed: {exc}")
    requests = backlog_workload(3, num_requests=6)
    settings = dict(block_size=4, num_gpu_blocks=24, watermark=0.0, max_num_batched_tokens=64) | SETTINGS[name]
    _, real = run(loaded, requests, **settings)
    _, sim = run(loaded, requests, engine="sim", **settings)
    assert decisions(sim) == decisions(real)
    assert any(e.kind == "preempt" for e in real.events)


def test_virtual_time_is_the_sum_of_predicted_steps_and_jumps_idle_gaps(tiny_loaded):
    requests = [WorkloadRequest(id="a", arrival_s=0.0, prompt_tokens=40, max_tokens=5),
                WorkloadRequest(id="b", arrival_s=1000.0, prompt_tokens=40, max_tokens=5)]
    tracer = ListTracer()
    engine = build_engine(EngineConfig(model="tiny", load_format="dummy", engine="sim", hardware="h100-sxm",
                                       num_gpu_blocks=64, block_size=4), tracer, loaded=tiny_loaded)
    items = prepare(requests, engine, tokenizer=None, seed=0, time_scale=None, backlog=False, workload_name="w")
    replay(engine, items)
    steps = tracer.records
    assert len(steps) == 10
    cost = engine.runner.cost_model
    first = steps[0]
    # a prefill of 40 tokens: the roofline's compute side is below the weights' read time for this model
    expected = cost.forward_ms(40, 0, 40, 40 * 41 / 2)
    assert first.start_s == 0.0 and first.end_s == pytest.approx(expected / 1000)
    assert first.device_ms == pytest.approx(expected)
    for prev, cur in zip(steps[:4], steps[1:5]):
        assert cur.start_s == prev.end_s
    assert steps[5].start_s == 1000.0   # b's arrival: the idle clock jumped, nobody slept
    assert steps[-1].end_s < 1001.0


def test_h100_roofline_for_llama_3_8b():
    """The built-in figures give the known shape of a Llama-3-8B step on an H100."""
    cost = CostModel(load_profile("h100-sxm"), PRESETS["llama-3-8b"], "bfloat16")
    assert cost.weight_bytes == pytest.approx(16.06e9, rel=0.01)
    decode_1 = cost.forward_ms(0, 1, 1000, 0)
    decode_256 = cost.forward_ms(0, 256, 256 * 100, 0)
    prefill_8k = cost.forward_ms(8192, 0, 8192, 8192 * 8193 / 2)
    assert 5 < decode_1 < 9                 # 16 GB at 89% of 3.35 TB/s, plus host and per-layer overheads
    # short-context decode batches ride mostly on the weights' read: not wholly, where weights and compute
    # are close (Vidur's H100 Llama-2-7B layer: 0.29 ms for 256 tokens, 0.18 ms for 1)
    assert decode_256 < 1.6 * decode_1
    assert cost.forward_ms(0, 256, 256 * 4000, 0) > 2 * decode_1   # long contexts: the KV read dominates
    assert 200 < prefill_8k < 320           # compute-bound: 8k tokens x 15 GFLOP at 59% of 989 TFLOP/s, plus attention


def test_kv_reserve_holds_the_whole_context_from_admission(make_engine):
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=16, kv_reserve="max-tokens",
                         enable_prefix_caching=False, max_model_len=40)
    a = engine.add_request("a", list(range(20, 27)), SamplingParams(max_tokens=10, ignore_eos=True))   # 17 -> 5 blocks
    b = engine.add_request("b", list(range(30, 37)), SamplingParams(max_tokens=40, ignore_eos=True))   # capped at 40 -> 10
    c = engine.add_request("c", list(range(40, 43)), SamplingParams(max_tokens=6, ignore_eos=True))    # 9 -> 3: waits
    engine.step()
    assert a.block_table == [1, 2, 3, 4, 5] and b.block_table == list(range(6, 16))
    assert not c.block_table and engine.block_manager.num_free_blocks == 1
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    allocs = [(e.req_id, e.reason, len(e.blocks)) for e in tracer.events if e.kind == "alloc"]
    assert allocs == [("a", "prefill", 5), ("b", "prefill", 10), ("c", "prefill", 3)]  # no decode-time allocation
    assert engine.num_preemptions == 0


def test_kv_reserve_max_model_len_holds_the_whole_model_length_from_admission(make_engine):
    # a pre-paging server that sized every request's KV for the longest context: 24 positions (6
    # blocks of 4) whatever the request asks for; a second request waits for the pool of 10 blocks
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=10, kv_reserve="max-model-len",
                         enable_prefix_caching=False, max_model_len=24)
    a = engine.add_request("a", list(range(20, 23)), SamplingParams(max_tokens=2, ignore_eos=True))
    b = engine.add_request("b", list(range(30, 33)), SamplingParams(max_tokens=2, ignore_eos=True))
    engine.step()
    assert len(a.block_table) == 6 and not b.block_table
    run_checked(engine)
    assert [(e.req_id, len(e.blocks)) for e in tracer.events if e.kind == "alloc"] == [("a", 6), ("b", 6)]


def test_kv_reserve_never_fitting_is_a_clear_error(tmp_path):
    w = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 10, "max_tokens": 100}])
    message = one_line_error(["record", "-w", str(w), "--model", "tiny", "--engine", "sim", "--num-gpu-blocks", "8",
                              "--block-size", "4", "--kv-reserve", "max-tokens", "-o", str(tmp_path / "r")])
    assert "can never fit the KV pool of 8 usable blocks" in message and "--kv-reserve max-tokens" in message


def test_output_tokens_stops_both_engines_with_reason_stop(tiny_loaded):
    requests = [WorkloadRequest(id="a", arrival_s=0.0, prompt_tokens=12, max_tokens=9, output_tokens=4),
                WorkloadRequest(id="b", arrival_s=0.0, prompt_tokens=12, max_tokens=5)]
    for settings in ({}, {"engine": "sim"}):
        _, tracer = run(tiny_loaded, requests, block_size=4, num_gpu_blocks=32, **settings)
        finished = {s.req_id: (s.output_tokens, s.finish_reason) for r in tracer.records for s in r.finished}
        assert finished == {"a": (4, "stop"), "b": (5, "length")}


def test_record_sim_writes_the_real_tables(tmp_path):
    rows = [{"arrival_s": i * 0.5, "prompt_tokens": 30 + i, "max_tokens": 8, "output_tokens": 5 + i % 3}
            for i in range(6)]
    w = write_workload(tmp_path / "w.jsonl", rows)
    real = record(tmp_path, w, "real", "--model", "tiny", "--num-gpu-blocks", "64", "--block-size", "4")
    sim = record(tmp_path, w, "sim", "--model", "tiny", "--engine", "sim", "--hardware", "l40s",
                 "--num-gpu-blocks", "64", "--block-size", "4")
    for table in ("requests", "steps", "kv_events", "tokens"):
        real_columns = sql(real, f"describe select * from {table}")
        assert sql(sim, f"describe select * from {table}") == real_columns
    assert sql(sim, "select count(*), count(token_id) from tokens") == [(5 + 6 + 7 + 5 + 6 + 7, 0)]
    assert sql(sim, "select count(*) from requests where finish_reason = 'stop'") == [(6,)]
    meta = json.loads((sim / "meta.json").read_text())
    assert meta["device"]["type"] == "sim" and meta["simulated"]["profile"] == "l40s"
    assert meta["engine_config"]["engine"] == "sim" and meta["model"]["dtype"] == "bfloat16"
    assert json.loads((real / "meta.json").read_text())["simulated"] is None
    # arrivals on the virtual clock: the last request arrives at 2.5 s and the run ends soon after
    assert sql(sim, "select max(arrival_s), max(finish_s) < 3.0 from requests") == [(2.5, True)]


def test_gpu_memory_utilization_sizes_the_pool_as_vllm_does(tmp_path):
    w = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 10, "max_tokens": 4}])
    run_dir = record(tmp_path, w, "r", "--model", "llama-3-8b", "--engine", "sim", "--hardware", "h100-sxm",
                     "--gpu-memory-utilization", "0.9")
    pool = json.loads((run_dir / "meta.json").read_text())["kv_pool"]
    d = pool["derivation"]
    assert d["device_memory"] == 80 * 10**9 and d["weights"] == pytest.approx(16.06e9, rel=0.01)
    assert d["kv_bytes"] == int(72e9) - d["weights"] - d["activations"] - d["non_torch"]
    # Llama-3-8B bf16: 128 KiB per token; one block of them is V1's null block
    assert pool["num_gpu_blocks"] == d["kv_bytes"] // (16 * 128 * 1024) - 1
    assert 25_000 < pool["num_gpu_blocks"] < 27_000                        # ~54 GB of KV, 2 MiB a block


@pytest.mark.parametrize("args, message", [
    (["--hardware", "tpu-v9"], "--hardware 'tpu-v9': not a built-in profile"),
    (["--kv-reserve", "some"], "--kv-reserve must be one of none, max-model-len, max-tokens"),
    (["--engine", "fake"], "--engine must be one of real, sim, vllm"),
])
def test_bad_sim_options_are_one_line_errors(tmp_path, args, message):
    w = write_workload(tmp_path / "w.jsonl", [{"arrival_s": 0, "prompt_tokens": 10, "max_tokens": 4}])
    engine = [] if "--engine" in args else ["--engine", "sim"]
    assert message in one_line_error(["record", "-w", str(w), "--model", "tiny", *engine, *args,
                                      "-o", str(tmp_path / "r")])


def test_calibrate_recovers_the_coefficients_a_run_was_made_with(tmp_path):
    """Steps whose periods follow known coefficients (and swaps a known host link) give those back."""
    from tests.helpers.tracegen import write_run
    truth = {"step_ms": 3.0, "prefill_token_ms": 0.25, "decode_token_ms": 2.0, "kv_token_ms": 0.01}
    rng = random.Random(0)
    steps, events, t = [], [], 0.0
    for step in range(60):
        prefill, decode, kv = rng.choice([0, 0, 64, 200]), rng.randint(1, 16), rng.randint(100, 3000)
        swap_bytes = rng.choice([0, 0, 0, 2_000_000, 4_000_000, 8_000_000])
        swap_ms = 0.05 + swap_bytes / 8e6 if swap_bytes else None   # 8 GB/s
        period = (truth["step_ms"] + truth["prefill_token_ms"] * prefill + truth["decode_token_ms"] * decode
                  + truth["kv_token_ms"] * kv + (swap_ms or 0.0))
        steps.append({"step": step, "start_s": t, "end_s": t + period / 1000 * 0.9, "running": 4, "waiting": 0,
                      "swapped": 0, "prefill_tokens": prefill, "decode_tokens": decode, "kv_tokens": kv})
        if swap_bytes:
            events.append({"seq": len(events), "step": step, "ts_s": t, "kind": "swap_out", "req_id": "a",
                           "bytes": swap_bytes, "duration_ms": swap_ms})
        t += period / 1000
    run = write_run(tmp_path, "cal", steps=steps, kv_events=events)
    out = tmp_path / "p.json"
    result = CliRunner().invoke(app, ["calibrate", str(run), "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "fitted on 59 steps" in result.output   # the last step has no period
    profile = json.loads(out.read_text())
    c = profile["coefficients"]
    for name, value in truth.items():
        assert c[name] == pytest.approx(value, rel=1e-6), name
    assert c["swap_byte_ms"] == pytest.approx(1 / 8e6, rel=1e-6) and c["swap_ms"] == pytest.approx(0.05, rel=1e-6)
    assert profile["fitted_on"]["error"]["total_error"] < 1e-9 and profile["fitted_on"]["model"] == "tiny"
    # the profile drives the simulator: a simulated step costs what the fit says
    cost = CostModel(load_profile(str(out)), PRESETS["tiny"], "float32")
    assert cost.forward_ms(64, 3, 500, 1e6) == pytest.approx(3.0 + 0.25 * 64 + 2.0 * 3 + 0.01 * 500)


def test_calibrate_leaves_out_steps_stalled_by_other_work(tmp_path):
    """A few steps stalled tenfold (a neighbour's burst on a shared machine) do not bend the fit."""
    from tests.helpers.tracegen import write_run
    rng = random.Random(2)
    steps, t = [], 0.0
    for step in range(60):
        prefill, decode, kv = rng.choice([0, 0, 40, 150]), rng.randint(1, 8), rng.randint(50, 900)
        period = 20.0 + 1.0 * prefill + 0.8 * decode + 0.005 * kv
        if step in (3, 4, 5, 30):
            period *= 10
        steps.append({"step": step, "start_s": t, "end_s": t + period / 1000, "running": 4, "waiting": 0,
                      "swapped": 0, "prefill_tokens": prefill, "decode_tokens": decode, "kv_tokens": kv})
        t += period / 1000
    result = CliRunner().invoke(app, ["calibrate", str(write_run(tmp_path, "cal", steps=steps)),
                                      "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    assert "fitted on 55 steps" in result.output and "left out 4 step(s)" in result.output
    profile = json.loads((tmp_path / "p.json").read_text())
    c = profile["coefficients"]
    truth = {"step_ms": 20.0, "prefill_token_ms": 1.0, "decode_token_ms": 0.8, "kv_token_ms": 0.005}
    assert {name: c[name] for name in truth} == pytest.approx(truth, rel=1e-6)
    assert profile["fitted_on"]["error"]["stalled_steps"] == 4


def test_calibrate_reports_its_error_by_kind_of_step(tmp_path):
    """A kind of step the cost model misses shows as that kind's bias; a kind the runs lack is named."""
    from tests.helpers.tracegen import write_run
    rng = random.Random(1)
    steps, t = [], 0.0
    for step in range(80):
        prefill, decode = rng.choice([(0, rng.randint(1, 8))] * 4 + [(rng.randint(20, 200), rng.randint(1, 8)),
                                                                     (rng.randint(20, 200), 0)])
        period = 20.0 + 1.0 * prefill + 0.5 * decode
        if prefill and not decode:
            period *= 1.3   # lone prefills cost 30 % more than the linear model can say
        steps.append({"step": step, "start_s": t, "end_s": t + period / 1000, "running": 4, "waiting": 0,
                      "swapped": 0, "prefill_tokens": prefill, "decode_tokens": decode, "kv_tokens": 100 + step})
        t += period / 1000
    result = CliRunner().invoke(app, ["calibrate", str(write_run(tmp_path, "cal", steps=steps)),
                                      "-o", str(tmp_path / "p.json")])
    assert result.exit_code == 0, result.output
    kinds = json.loads((tmp_path / "p.json").read_text())["fitted_on"]["error"]["by_kind"]
    counts = {"decode only": sum(1 for s in steps[:-1] if not s["prefill_tokens"]),
              "prefill only": sum(1 for s in steps[:-1] if s["prefill_tokens"] and not s["decode_tokens"]),
              "prefill + decode": sum(1 for s in steps[:-1] if s["prefill_tokens"] and s["decode_tokens"])}
    assert {kind: k["steps"] for kind, k in kinds.items()} == counts and min(counts.values()) > 5
    # one per-token prefill cost cannot fit both: lone prefills come out short, the others long
    assert kinds["prefill only"]["bias"] < -0.05 and kinds["prefill + decode"]["bias"] > 0.05
    assert abs(kinds["decode only"]["bias"]) < 0.01
    assert "by kind of step: decode only " in result.output and "prefill only" in result.output

    decode_only = write_run(tmp_path / "d", "d", steps=[s for s in steps if not s["prefill_tokens"]])
    result = CliRunner().invoke(app, ["calibrate", str(decode_only), "-o", str(tmp_path / "d.json")])
    assert result.exit_code == 0, result.output
    assert "prefill only: none" in result.output and "prefill + decode: none" in result.output


def test_calibrate_refuses_simulated_runs_and_mixed_models(tmp_path):
    from tests.helpers.tracegen import write_run
    steps = [{"step": i, "start_s": i * 0.1, "end_s": i * 0.1 + 0.05, "running": 1, "waiting": 0, "swapped": 0,
              "prefill_tokens": 0, "decode_tokens": 1, "kv_tokens": 10 + i} for i in range(20)]
    sim = write_run(tmp_path, "sim", steps=steps, meta={"device": {"type": "sim", "name": "h100-sxm"}})
    assert "simulated runs" in one_line_error(["calibrate", str(sim), "-o", str(tmp_path / "p.json")])
    a = write_run(tmp_path / "m", "a", steps=steps)
    b = write_run(tmp_path / "m", "b", steps=steps, meta={"model": {"name": "smollm2-135m"}})
    assert "one model and dtype" in one_line_error(["calibrate", str(a), str(b), "-o", str(tmp_path / "p.json")])


def test_pool_density_is_the_paged_kv_table(tmp_path):
    """avg running, held-KV share (stored positions over slots of held blocks) and counts, per run."""
    from kvtrace.trace import db
    from tests.helpers.tracegen import write_run
    steps = [{"step": i, "start_s": i * 0.1, "end_s": i * 0.1 + 0.1, "running": running, "waiting": 0,
              "swapped": 0, "prefill_tokens": 0, "decode_tokens": running, "kv_tokens": kv, "used_blocks": used,
              "preemptions": pre}
             for i, (running, kv, used, pre) in enumerate([(2, 10, 4, 0), (3, 14, 5, 1), (1, 4, 2, 0)])]
    run = write_run(tmp_path, "d", steps=steps, meta={"kv_pool": {"kv_reserve": "max-tokens"}})
    row = db.run_analysis(db.connect([run]), "pool_density").to_pylist()[0]
    assert row == {"run_id": "d", "block_size": 4, "kv_reserve": "max-tokens", "steps": 3, "avg_running": 2.0,
                   "held_kv_share": pytest.approx(28 / 44), "preemptions": 1}


def test_sim_without_a_pool_option_sizes_it_as_vllm_by_default(tiny_loaded):
    engine = build_engine(EngineConfig(model="llama-3-8b", engine="sim", hardware="h200", dtype="bfloat16"))
    d = engine.geometry.derivation
    assert d["gpu_memory_utilization"] == 0.9 and d["device_memory"] == 141 * 10**9
    assert engine.config.gpu_memory_utilization == 0.9 and engine.model is None



def test_a_profile_without_device_memory_needs_a_pool_size_and_says_so(tmp_path):
    # a profile may leave the device's memory out (0): the pool is then sized by the options that
    # need no memory figure, and the default (0.9 of the device) names what is missing
    data = json.loads((PROFILE_DIR / "cpu-here.json").read_text())
    path = tmp_path / "no-memory.json"
    path.write_text(json.dumps({**data, "name": "no-memory", "memory_bytes": 0}))
    with pytest.raises(ValueError, match="--gpu-memory-utilization needs a device whose memory is known"):
        build_engine(EngineConfig(model="tiny", engine="sim", hardware=str(path)))
    assert build_engine(EngineConfig(model="tiny", engine="sim", hardware=str(path), num_gpu_blocks=64)).geometry \
        .num_gpu_blocks == 64


def test_a_simulated_engine_takes_the_shape_it_is_handed():
    # the benchmarks hand one loaded model to each engine they make: a simulated one models that shape
    # and names its source, without reading the model again
    shape = dataclasses.replace(PRESETS["tiny"], name="tiny-3-layers", num_layers=3)
    engine = build_engine(EngineConfig(model="tiny", engine="sim", num_gpu_blocks=64),
                          loaded=SimpleNamespace(config=shape, source="handed over"))
    assert (engine.model_config.num_layers, engine.model_source) == (3, "handed over")
    assert build_engine(EngineConfig(model="tiny", engine="sim", num_gpu_blocks=64)).model_config.num_layers \
        == PRESETS["tiny"].num_layers != 3

def test_the_shipped_cpu_profile_is_a_calibrated_smollm2_profile():
    profile = load_profile("cpu-here")
    assert profile.fitted_on["model"] == "smollm2-135m" and profile.fitted_on["dtype"] == "float32"
    # fitted on a run with every kind of step it predicts (a backlog alone has one prefill-only step: its
    # lone prompts came out 16 % short, benchmarks/RESULTS.md sim-accuracy 2026-11-30 12:58)
    kinds = profile.fitted_on["error"]["by_kind"]
    assert set(kinds) == {"decode only", "prefill only", "prefill + decode"}
    assert all(kind["steps"] >= 3 for kind in kinds.values()), kinds
    cost = CostModel(profile, PRESETS["smollm2-135m"], "float32")
    assert cost.describe()["calibrated"] and cost.forward_ms(0, 8, 800, 0) > cost.forward_ms(0, 1, 100, 0) > 0
