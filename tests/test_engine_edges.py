"""The engine's step records at edges the other tests do not reach (each test here was written for
a mutant of engine/*.py that no other test noticed: scripts/mutation.py, issue 20)."""
from __future__ import annotations

from tests.conftest import run_checked
from tests.test_preemption import ListTracer
from tests.test_scheduling import distinct_kv_positions, params


# ---------------------------------------------------------------- block manager

def test_kv_tokens_of_forked_samples_with_blocks_reserved_ahead(make_engine):
    # --kv-reserve max-tokens: a 6-token prompt holds 4 blocks of 4 from admission (6 + 10 positions);
    # its 3 samples share all 4, two of them still empty: a position counts once, an empty block not at all
    tracer = ListTracer()
    engine = make_engine(tracer, kv_reserve="max-tokens", max_model_len=32)
    engine.add_request("fan", [50, 51, 52, 53, 54, 55], params(max_tokens=10, n=3, temperature=1.0, seed=3))
    kv = []
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
        assert tracer.records[-1].num_kv_tokens == distinct_kv_positions(engine), tracer.records[-1].step
        kv.append(tracer.records[-1].num_kv_tokens)
    # the prompt once; then each sample writes position 6 into its own copy of the half-full block 1
    # (copy-on-write: 2 prompt positions + its token), block 0's 4 positions still shared
    assert kv[:2] == [6, 4 + 3 * 3]
