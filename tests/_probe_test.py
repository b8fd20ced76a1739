import pytest
from engine.sequence import SamplingParams
from tests.test_preemption import ListTracer
@pytest.mark.parametrize("plen", [7, 8, 9, 10, 11])
@pytest.mark.parametrize("m0", [5, 6, 7, 8])
def test_p(make_engine, plen, m0):
    tracer = ListTracer()
    e = make_engine(tracer, num_gpu_blocks=4, watermark=0.0, enable_prefix_caching=False, preemption_mode="swap", preemption_policy="priority", num_cpu_blocks=4)
    for i, (p, m, pr) in enumerate([([30], m0, 1), (list(range(40, 40 + plen)), 10, 2), ([60, 61], 1, 1)]):
        e.add_request(f"r{i}", p, SamplingParams(max_tokens=m, ignore_eos=True), priority=pr, arrival_s=0.0)
    for _ in range(40):
        if not e.has_unfinished(): break
        e.step()
    ev = [(x.step, x.kind, x.num_tokens) for x in tracer.events if x.req_id == "r1" and x.kind in ("preempt", "swap_in")]
    print("RES", plen, m0, ev, e.has_unfinished())
