"""Step records of hand-written runs (tests/analysis' tiered runs), written through the TraceWriter.

A step `step` starts at step × 0.1 s and lasts 50 ms; its events are numbered from step × 10 and stamped
where the test says (its end by default); every other figure of the record is a fixed small pool's,
which a test overrides by name.
"""
from __future__ import annotations

from engine.events import KVEvent, StepRecord

DEFAULTS = dict(device_ms=10.0, num_running=2, num_waiting=0, num_swapped=0, num_prefill_tokens=4,
                num_decode_tokens=1, num_recompute_tokens=0, num_free_blocks=4, num_used_blocks=4,
                num_cached_blocks=0, num_total_blocks=8, num_kv_tokens=16, num_preemptions=0,
                offload_bytes=0, load_bytes=0, tier_transfer_ms=None)


def step_record(step: int, events: list[KVEvent], *, stamp=None, tokens: list[tuple[str, int]] = (),
                finished=(), **fields) -> StepRecord:
    """The record of step `step` holding `events`; `stamp(event, start, end)`: an event's time (the step's
    end where None); `tokens`: (request, index) of the tokens it delivered (token id 5 each); `fields`: the
    record's figures other than DEFAULTS."""
    start, end = step * 0.1, step * 0.1 + 0.05
    for i, e in enumerate(events):
        e.step, e.seq = step, step * 10 + i
        e.ts_s = end if stamp is None else stamp(e, start, end)
    record = StepRecord(step=step, start_s=start, end_s=end, events=events, finished=list(finished),
                        **{**DEFAULTS, **fields})
    record.token_req_ids = [r for r, _ in tokens]
    record.token_samples = [0] * len(tokens)
    record.token_idx = [i for _, i in tokens]
    record.token_ids = [5] * len(tokens)
    return record
