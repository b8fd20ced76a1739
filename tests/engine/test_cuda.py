"""The engine on CUDA: the same stories, with pinned host swap space, a side stream and CUDA events."""
from __future__ import annotations

import json
import random

import pytest
import torch

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import four_block_engine, random_workload, run_checked

pytestmark = pytest.mark.cuda


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_four_block_scenario_on_cuda(make_engine, mode):
    def make(tracer=None, **overrides):
        return make_engine(tracer, device="cuda", **overrides)

    reference, _, a_ref, b_ref = four_block_engine(make, mode, num_gpu_blocks=16)
    run_checked(reference)
    engine, tracer, a, b = four_block_engine(make, mode)
    run_checked(engine)
    assert (a.token_ids, b.token_ids) == (a_ref.token_ids, b_ref.token_ids)
    assert [e.step for e in tracer.events if e.kind == "preempt"] == [2]
    assert all(r.device_ms is not None and r.device_ms > 0 for r in tracer.records if r.num_decode_tokens)
    if mode == "swap":
        assert engine.runner.host_cache.is_pinned()
        swaps = [e for e in tracer.events if e.kind in ("swap_out", "swap_in")]
        assert [e.bytes for e in swaps] == [2 * engine.geometry.bytes_per_block] * 2
        assert all(e.duration_ms is not None and e.duration_ms > 0 for e in swaps)


def test_swaps_larger_than_the_staging_buffer_go_through_it_in_parts(make_engine, monkeypatch):
    from engine.executor import model_runner

    monkeypatch.setattr(model_runner, "SWAP_STAGING_BYTES", 1)   # a staging buffer of one block

    def make(tracer=None, **overrides):
        return make_engine(tracer, device="cuda", **overrides)

    reference, _, a_ref, b_ref = four_block_engine(make, "swap", num_gpu_blocks=16)
    run_checked(reference)
    engine, tracer, a, b = four_block_engine(make, "swap")
    run_checked(engine)
    assert engine.runner.staging.shape[0] == 1
    assert [e.bytes for e in tracer.events if e.kind in ("swap_out", "swap_in")] == [2 * engine.geometry.bytes_per_block] * 2
    assert (a.token_ids, b.token_ids) == (a_ref.token_ids, b_ref.token_ids)


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preemption_transparency_on_cuda(make_engine, mode):
    rng = random.Random(7)
    workload = random_workload(rng, 12)
    need = max(-(-(len(p) + m) // 4) for p, m in workload)

    def run(**settings):
        engine = make_engine(device="cuda", max_num_batched_tokens=32, **settings)
        seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
                for i, (p, m) in enumerate(workload)]
        run_checked(engine)
        return [s.token_ids for s in seqs], sum(s.num_preemptions for s in seqs)

    reference, _ = run(num_gpu_blocks=512)
    tokens, preemptions = run(num_gpu_blocks=need + 2, preemption_mode=mode, num_cpu_blocks=6)
    assert preemptions > 0
    assert tokens == reference


def test_record_on_cuda(tmp_path):
    from typer.testing import CliRunner

    import kvtrace.cli.commands  # noqa: F401
    from kvtrace.cli.app import app

    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"arrival_s": 0, "prompt_tokens": 20 + i, "max_tokens": 16}) + "\n"
                                for i in range(8)))
    out = tmp_path / "run"
    result = CliRunner().invoke(app, ["record", "--model", "tiny", "--device", "cuda", "-w", str(workload),
                                      "-o", str(out), "-q", "--block-size", "4", "--num-gpu-blocks", "40",
                                      "--preemption-mode", "swap", "--backlog"])
    assert result.exit_code == 0, result.output
    meta = json.loads((out / "meta.json").read_text())
    assert meta["device"]["type"] == "cuda" and meta["status"] == "completed"


def shared_prefix_workload(rng: random.Random, num_requests: int) -> list[tuple[list[int], int]]:
    """Prompts that share a 12-token prefix (three blocks of 4) half of the time."""
    prefix = [rng.randrange(3, 512) for _ in range(12)]
    return [((prefix if i % 2 else []) + [rng.randrange(3, 512) for _ in range(rng.randint(1, 30))],
             rng.randint(4, 20)) for i in range(num_requests)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_triton_graphs_cow_and_prefix_hits_match_dense_reference(make_engine, tiny_loaded, dtype, monkeypatch):
    """Triton attention, decode graphs, copy-on-write (n=2 forks share a partial block) and prefix hits,
    against the dense fp32 forward; bf16 within its rounding. fp32 without TF32 (the engine's default
    on CUDA): the reference is full fp32."""
    from tests.helpers.engine_runs import capture_logits
    from tests.helpers.reference_model import reference_forward

    monkeypatch.setenv("KVTRACE_TF32", "0")

    engine = make_engine(device="cuda", dtype=dtype, max_num_batched_tokens=24, enable_prefix_caching=True)
    assert engine.model.use_triton and engine.runner.decode_graphs is not None
    seen = capture_logits(engine)
    graph_steps = []
    run = engine.runner.decode_graphs.run
    engine.runner.decode_graphs.run = lambda batch: graph_steps.append(batch.num_decodes) or run(batch)
    for i, (prompt, max_tokens) in enumerate(shared_prefix_workload(random.Random(3), 8)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=1 + i % 2))
        engine.step()  # staggered arrivals: later prompts hit the earlier ones' cached blocks
    run_checked(engine)
    seqs = list(engine.outputs.values())
    assert sum(s.num_prefix_hit_tokens for s in seqs) > 0
    assert graph_steps
    worst = 0.0
    for tokens, logits in seen:
        ref = reference_forward(tiny_loaded.config, tiny_loaded.weights, tokens)[-1]
        worst = max(worst, ((logits.float().cpu() - ref).abs().max() / ref.abs().max()).item())
    assert worst < (1e-4 if dtype == "float32" else 5e-2), worst


def test_no_synchronisation_inside_a_step(make_engine):
    """Between the end-of-step points (sampling reads the tokens; the flush at the end of a run),
    nothing waits for the device: swap copies, copy-on-write, prefix hits, prefill and graph decode
    steps all run under torch's sync debug mode set to raise."""
    engine = make_engine(device="cuda", dtype="bfloat16", num_gpu_blocks=30, num_cpu_blocks=40,
                         preemption_mode="swap", max_num_batched_tokens=32)
    execute = engine.runner.execute

    def strict(out):
        torch.cuda.set_sync_debug_mode("error")
        try:
            return execute(out)
        finally:
            torch.cuda.set_sync_debug_mode(0)

    torch.cuda.set_sync_debug_mode("error")
    try:
        with pytest.raises(RuntimeError):  # the mode is live: a device read in a step would fail
            torch.ones(1, device="cuda").item()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    engine.runner.execute = strict
    for i, (prompt, max_tokens) in enumerate(shared_prefix_workload(random.Random(5), 12)):
        engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, n=1 + (i % 3 == 0)))
    run_checked(engine)
    seqs = list(engine.outputs.values())
    assert sum(s.num_swaps for s in seqs) > 0 and sum(s.num_prefix_hit_tokens for s in seqs) > 0


def test_graphs_and_eager_launches_agree(make_engine, monkeypatch):
    rng = random.Random(9)
    workload = random_workload(rng, 10)

    def tokens(**env):
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        engine = make_engine(device="cuda", max_num_batched_tokens=48)
        seqs = [engine.add_request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
                for i, (p, m) in enumerate(workload)]
        run_checked(engine)
        return [s.token_ids for s in seqs], engine.runner.decode_graphs is not None

    graphs, used_graphs = tokens()
    eager, used_eager = tokens(KVTRACE_CUDA_GRAPHS="0")
    sdpa, _ = tokens(KVTRACE_TRITON="0")
    assert used_graphs and not used_eager
    assert graphs == eager == sdpa


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_second_gpu(make_engine):
    engine, tracer, a, b = four_block_engine(lambda t=None, **o: make_engine(t, device="cuda:1", **o), "swap")
    run_checked(engine)
    assert engine.runner.kv_caches[0].device == torch.device("cuda", 1)
    assert all(r.device_ms is not None and r.device_ms > 0 for r in tracer.records if r.num_decode_tokens)
