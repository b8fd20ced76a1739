"""The host KV tier's real copies (engine/executor/model_runner.py `tier_copy`): on the CPU a copy per
block between the KV tensors and the tier's host buffer; on CUDA a pinned buffer, the swap's side
stream and staging buffer, CUDA events for the time. Either way a preempted request loads the prompt
blocks the device lost, its tokens are those of a pool that never preempts, and every copy is timed."""
from __future__ import annotations

import pytest

from engine.sequence import SamplingParams
from tests.helpers.engine_runs import ListTracer, run_checked

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)]


def two_growing_requests(make_engine, device: str, **overrides):
    """A and B (3 prompt blocks each) grow past a 7-block pool: B is preempted and comes back with its
    prompt's blocks in the tier, or recomputes them where there is no tier."""
    tracer = ListTracer()
    engine = make_engine(tracer, device=device, block_size=4, enable_prefix_caching=True,
                         max_num_batched_tokens=64, **overrides)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    a = engine.add_request("A", list(range(100, 112)), params, arrival_s=0.0)
    b = engine.add_request("B", list(range(200, 212)), params, arrival_s=0.0)
    run_checked(engine)
    return engine, tracer, (a.token_ids, b.token_ids)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("staging_bytes", [None, 1], ids=["staged-whole", "staged-block-by-block"])
def test_a_preempted_request_loads_its_blocks_back_and_keeps_its_tokens(make_engine, monkeypatch, device,
                                                                       staging_bytes):
    from engine.executor import model_runner

    if staging_bytes is not None:   # a staging buffer of one block: every CUDA copy goes in parts
        monkeypatch.setattr(model_runner, "SWAP_STAGING_BYTES", staging_bytes)
    _, _, expected = two_growing_requests(make_engine, device, num_gpu_blocks=64)
    engine, tracer, tokens = two_growing_requests(make_engine, device, num_gpu_blocks=7, num_offload_blocks=16)
    assert tokens == expected
    assert engine.num_preemptions > 0
    loads = [e for e in tracer.events if e.kind == "load"]
    assert loads and sum(e.num_tokens for e in loads) == engine.outputs[("B", 0)].num_tier_hit_tokens > 0
    copies = [e for e in tracer.events if e.kind in ("offload", "load")]
    assert all(e.duration_ms is not None and e.duration_ms > 0 for e in copies)
    steps = [r for r in tracer.records if r.offload_bytes or r.load_bytes]
    assert steps and all(r.tier_transfer_ms is not None and r.tier_transfer_ms > 0 for r in steps)
    if device == "cuda":
        assert engine.runner.tier_cache.is_pinned()
