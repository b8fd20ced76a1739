"""The engine on CUDA: the same stories, with pinned host swap space, a side stream and CUDA events."""
from __future__ import annotations

import json
import random

import pytest

from engine.sequence import SamplingParams
from tests.conftest import run_checked
from tests.test_preemption import four_block_engine, random_workload

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

    import kvtrace.cli  # noqa: F401
    from kvtrace.cli_app import app

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
