"""Driving the engine in tests: a tracer that keeps every step record, stepping to completion with the
integrity check after each step, probes of the scheduler's decisions, and the small scenarios several
test modules share."""
from __future__ import annotations

import random

from engine.events import with_evictions
from engine.llm_engine import LLMEngine
from engine.sequence import SamplingParams


class ListTracer:
    """A Tracer that keeps every step record (and so every KV event) in memory."""

    def __init__(self) -> None:
        self.records = []

    def on_step(self, record) -> None:
        self.records.append(record)

    @property
    def events(self):
        """Every event as the trace has them (an alloc's evictions as events of their own)."""
        return [e for r in self.records for e in with_evictions(r.events)]


# the four-block story's two prompts (tests/engine/test_preemption.py): 7 tokens each, 2 blocks of 4
PROMPT_A = [11, 12, 13, 14, 15, 16, 17]
PROMPT_B = [21, 22, 23, 24, 25, 26, 27]


def four_block_engine(make_engine, mode: str, num_gpu_blocks: int = 4):
    tracer = ListTracer()
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=num_gpu_blocks, watermark=0.0,
                         enable_prefix_caching=False, preemption_mode=mode, num_cpu_blocks=4,
                         max_num_batched_tokens=64)
    a = engine.add_request("A", PROMPT_A, SamplingParams(max_tokens=6, ignore_eos=True), arrival_s=0.0)
    b = engine.add_request("B", PROMPT_B, SamplingParams(max_tokens=4, ignore_eos=True), arrival_s=0.0)
    return engine, tracer, a, b


def random_workload(rng: random.Random, num_requests: int):
    return [([rng.randrange(3, 512) for _ in range(rng.randint(1, 24))], rng.randint(1, 16))
            for _ in range(num_requests)]


def run_checked(engine: LLMEngine) -> None:
    """Step to completion, checking block accounting after every step."""
    while engine.has_unfinished():
        engine.step()
        engine.check_integrity()
    engine.flush()
    engine.check_integrity()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks, "blocks leaked"
    assert len(engine.block_manager.free_cpu_block_ids) == engine.block_manager.num_cpu_blocks, "host blocks leaked"


def probe_schedule(engine: LLMEngine, measure) -> list:
    """Call `measure(engine, out)` right after each scheduling decision (where the steps table's pool
    columns are read); return the list its results are appended to."""
    values = []
    schedule = engine.scheduler.schedule

    def probed():
        out = schedule()
        values.append(measure(engine, out))
        return out

    engine.scheduler.schedule = probed
    return values


def integrity_state(make_engine, steps: int, tracer=None):
    """D runs first; then after 1 more step: blocks 1 and 2 cached-free (D's), A's prompt blocks 3 and
    4 shared by its two samples (n=2, copy-on-write); after 3: A's two samples swapped out together,
    sharing host block 0; after 4: blocks 5 and 6 cached-free."""
    engine = make_engine(tracer, block_size=4, num_gpu_blocks=6, watermark=0.0, enable_prefix_caching=True,
                         preemption_mode="swap", num_cpu_blocks=4, max_num_batched_tokens=64, n_mode="cow",
                         preemption_policy="newest-sparing")
    engine.add_request("D", list(range(1, 10)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()
    engine.add_request("A", list(range(11, 18)), SamplingParams(max_tokens=6, ignore_eos=True, n=2,
                                                                  temperature=1.0, seed=1))
    engine.add_request("B", list(range(21, 28)), SamplingParams(max_tokens=4, ignore_eos=True))
    for _ in range(steps):
        engine.step()
    engine.check_integrity()
    return engine, engine.block_manager


def params(max_tokens: int = 3, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True, **kw)


def admits(tracer) -> list[tuple[int, str, int]]:
    return [(e.step, e.req_id, e.sample) for e in tracer.events if e.kind == "admit"]


def distinct_kv_positions(engine, out=None) -> int:
    """KV positions in device blocks, from the block tables: a shared block counted once. With a
    scheduler output `out`, once the step's scheduled positions are written (the steps table's view)."""
    bs = engine.block_manager.block_size
    new = {id(s): n for s, n in zip(out.seqs, out.num_new_tokens)} if out is not None else {}
    fill: dict[int, int] = {}
    for seq in engine.scheduler.running:
        computed = seq.num_computed_tokens + new.get(id(seq), 0)
        for i, block_id in enumerate(seq.block_table):
            held = min(max(computed - i * bs, 0), bs)
            fill[block_id] = max(fill.get(block_id, 0), held)
    return sum(fill.values())


def add_x_and_y(engine, policy: str) -> None:
    """X: n=3, a prompt ending in a partial block; Y: a prompt of two full blocks (its next token
    needs a new block). X's first sample is scheduled before Y and copies the shared partial block;
    Y then finds no free block and the policy picks X's first sample: it holds the only unshared block.
    """
    x_params = SamplingParams(max_tokens=8, ignore_eos=True, n=3)
    y_params = SamplingParams(max_tokens=4, ignore_eos=True)
    if policy == "fewest-computed":  # admitted together, first come first; X has computed fewer
        engine.add_request("X", [11, 12, 13, 14, 15, 16], x_params)
        engine.add_request("Y", [21, 22, 23, 24, 25, 26, 27, 28], y_params)
    else:  # priority: X (less important) prefills over steps 0-1, Y arrives and is admitted after it
        engine.add_request("X", list(range(30, 44)), x_params, priority=5)
        engine.step()
        engine.add_request("Y", [21, 22, 23, 24, 25, 26, 27, 28], y_params, priority=0)


def run_with_a_late_arrival(engine, prompts: list[list[int]], max_tokens: int) -> None:
    """Run every prompt but the last to the end, then the last: it arrives once a request sharing its
    prefix is done, so that its full prefix blocks are cached (a prefix-cache hit whose query starts
    past position 0)."""
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    for i, p in enumerate(prompts[:-1]):
        engine.add_request(str(i), p, params)
    while engine.has_unfinished():
        engine.step()
    engine.add_request("last", prompts[-1], params)
    while engine.has_unfinished():
        engine.step()


def capture_logits(engine):
    """Wrap the runner so every sampled row is kept with the tokens it was computed over."""
    seen = []
    execute = engine.runner.execute

    def wrapped(out):
        ends = {id(s): s.num_computed_tokens + n for s, n in zip(out.seqs, out.num_new_tokens)}
        result = execute(out)
        for row, seq in enumerate(result.sample_seqs):
            seen.append((list(seq.token_ids[:ends[id(seq)]]), result.logits[row].clone()))
        return result

    engine.runner.execute = wrapped
    return seen
