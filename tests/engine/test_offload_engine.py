"""The host KV tier in the engine loop (engine/scheduler.py's connector side, engine/llm_engine.py's copies):
stores as blocks are computed, a lookup at admission, loads that the sequence waits for, evictions of a
tiny tier; checked on the engine's books after every step and from the trace alone (analyses/tier_*.sql)."""
from __future__ import annotations

import json
import random

import pytest

from engine import events as ev
from engine.build import build_engine
from engine.config import EngineConfig
from engine.sequence import SamplingParams
from engine.sim.cost_model import PROFILES
from kvtrace.trace.db import connect, run_analysis
from tests.helpers.cli import record, sql, write_workload
from tests.helpers.engine_runs import ListTracer, run_checked


def sim(tracer=None, **overrides):
    settings = dict(model="tiny", engine="sim", block_size=4, num_gpu_blocks=8, max_num_batched_tokens=64)
    return build_engine(EngineConfig(**{**settings, **overrides}), tracer)


def two_growing_requests(engine) -> None:
    """A and B, 3 prompt blocks each, grow past the 8-block pool: B (the newest) is preempted at step 5
    and comes back when A finishes, its prompt's blocks in the tier."""
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    engine.add_request("A", list(range(100, 112)), params, arrival_s=0)
    engine.add_request("B", list(range(200, 212)), params, arrival_s=0)


def kinds(tracer, *names):
    return [(e.step, e.kind, e.req_id, e.blocks, e.num_tokens) for e in tracer.events if e.kind in names]


def test_a_preempted_request_loads_what_the_device_lost_and_computes_the_rest():
    tracer = ListTracer()
    engine = sim(tracer, num_offload_blocks=32)
    two_growing_requests(engine)
    run_checked(engine)
    # stored after their prompts' step, filed when the copies finished (the step after: the link is
    # free beside step 1's forward); B's prompt blocks 4, 5 still cached on the device at its return,
    # block 6 reused, so its third block comes back from the tier
    assert kinds(tracer, "offload", "load") == [(1, "offload", "A", [1, 2, 3], 12), (1, "offload", "B", [4, 5, 6], 12),
                                                (12, "load", "B", [6], 4)]
    lookups = [(e.step, e.req_id, e.num_tokens, e.num_cached_tokens, e.tier_tokens, e.reason)
               for e in tracer.events if e.kind == ev.LOOKUP]
    assert lookups == [(0, "A", 12, 0, 0, "new"), (0, "B", 12, 0, 0, "new"), (12, "B", 17, 8, 4, "resume-recompute")]
    # it waited for the load (step 12, nothing else to run: the clock jumped to the copy's end), then
    # computed the 5 positions neither held: 4 outputs computed before, and its newest token
    admits = [(e.step, e.req_id, e.num_tokens) for e in tracer.events if e.kind == ev.ADMIT]
    assert admits[-1] == (13, "B", 5)
    assert [(r.admission_stop, r.num_waiting) for r in tracer.records[12:14]] == [("other", 1), ("nothing-waiting", 0)]
    b = engine.outputs[("B", 0)]
    assert (b.num_tier_hit_tokens, b.num_recomputed_tokens, b.num_prefix_hit_tokens) == (4, 4, 8)
    step_bytes = [(r.step, r.offload_bytes, r.load_bytes) for r in tracer.records if r.offload_bytes or r.load_bytes]
    block = engine.geometry.bytes_per_block
    assert step_bytes == [(1, 6 * block, 0), (12, 0, block)]


def test_without_a_tier_the_same_request_recomputes_what_it_loaded():
    tracer = ListTracer()
    engine = sim(tracer)
    two_growing_requests(engine)
    run_checked(engine)
    b = engine.outputs[("B", 0)]
    assert (b.num_tier_hit_tokens, b.num_recomputed_tokens) == (0, 8)
    assert not kinds(tracer, "offload", "load", "lookup")
    assert tracer.records[0].offload_bytes is None and tracer.records[0].load_bytes is None


@pytest.mark.parametrize("follow, r0_kept", [("0.33.0", 0), ("0.32.0", 2)])
def test_a_tiny_tier_evicts_the_least_recent_and_refuses_what_does_not_fit(follow, r0_kept):
    tracer = ListTracer()
    engine = sim(tracer, num_gpu_blocks=64, num_offload_blocks=4, follow_vllm=follow)
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    for i, base in enumerate((100, 200, 300)):   # one after the other: 3 prompt blocks each
        engine.add_request(f"r{i}", list(range(base, base + 12)), params)
        run_checked(engine)
    stores = [(e.req_id, e.num_tokens) for e in tracer.events if e.kind == ev.OFFLOAD]
    evictions = [(e.step, e.num_tier_blocks) for e in tracer.events if e.kind == ev.TIER_EVICT]
    # r0's 3 blocks stored; r1's 3 evict 2 of r0's (r0 finished, but the tier re-ranks a finished
    # request's chunks only after the next step's stores, as vLLM's connector does): vLLM 0.33 ranks a
    # request's chunks tail first, 0.32 by when they were stored, head first. r0's chunk left then takes a
    # fresh rank, above r1's, so r2's 3 evict all of r1's
    assert stores == [("r0", 12), ("r1", 12), ("r2", 12)]
    assert [n for _, n in evictions] == [2, 3]
    hashes = engine.block_manager.token_block_hashes
    r0, r2 = engine.outputs[("r0", 0)], engine.outputs[("r2", 0)]
    assert set(engine.scheduler.tier.chunks) == {hashes(r0, 3)[r0_kept], *hashes(r2, 3)}


def test_a_slow_link_holds_the_loading_request_while_others_run(tmp_path):
    # a host link of 1 MB/s: a block's 2 KiB take 2.5 ms, more than a step
    profile = {**PROFILES["h100-sxm"].to_dict(), "name": "slow-link", "host_bytes_s": 1e6}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    tracer = ListTracer()
    engine = sim(tracer, num_gpu_blocks=64, num_offload_blocks=16, hardware=str(path))
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("first", list(range(100, 112)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.add_request("busy", list(range(500, 504)), params)
    run_checked_until(engine, lambda: ("first", 0) in finished(tracer))
    # the device forgets first's prompt: evict its cached blocks by filling the pool with another prompt
    drop_cached_blocks(engine)
    engine.add_request("again", list(range(100, 112)) + [7], SamplingParams(max_tokens=2, ignore_eos=True))
    run_checked(engine)
    lookup = next(e for e in tracer.events if e.kind == ev.LOOKUP and e.req_id == "again")
    load = next(e for e in tracer.events if e.kind == ev.LOAD and e.req_id == "again")
    admit = next(e for e in tracer.events if e.kind == ev.ADMIT and e.req_id == "again")
    assert lookup.tier_tokens == 12 and load.num_tokens == 12
    assert load.duration_ms > 7.5          # 3 blocks over the slow link
    assert lookup.step < load.step < admit.step
    busy_steps = {r.step for r in tracer.records if r.num_decode_tokens}
    assert set(range(lookup.step + 1, load.step + 1)) <= busy_steps   # busy decoded while again waited


def finished(tracer):
    return {(s.req_id, s.sample) for r in tracer.records for s in r.finished}


def run_checked_until(engine, done) -> None:
    while not done():
        engine.step()
        engine.check_integrity()


def drop_cached_blocks(engine) -> None:
    """Take every cached free block out of the prefix cache (as an eviction by other prompts would)."""
    bm = engine.block_manager
    for block_id in list(bm.free_cached):
        del bm.free_cached[block_id]
        bm._uncache(bm.blocks[block_id])
        bm.free_uncached.insert(0, block_id)
    bm.check_integrity(engine.scheduler.all_seqs())


@pytest.mark.parametrize("num_offload_blocks", [1, 3, 8, 64])
def test_random_workloads_keep_the_books_and_the_outputs(num_offload_blocks):
    rng = random.Random(num_offload_blocks)
    prefixes = [[rng.randrange(3, 500) for _ in range(8)] for _ in range(3)]
    requests = [(rng.choice(prefixes) + [rng.randrange(3, 500) for _ in range(rng.randint(1, 14))], rng.randint(1, 12))
                for _ in range(24)]
    outputs = {}
    for tier in (0, num_offload_blocks):
        tracer = ListTracer()
        engine = sim(tracer, num_gpu_blocks=12, num_offload_blocks=tier, max_num_batched_tokens=16)
        for i, (prompt, max_tokens) in enumerate(requests):
            engine.add_request(str(i), prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        run_checked(engine)
        outputs[tier] = {key: seq.token_ids for key, seq in engine.outputs.items()}
        events = tracer.events
        for e in events:
            if e.kind == ev.LOOKUP:
                assert 0 <= e.num_tokens - e.num_cached_tokens - e.tier_tokens
        loads = sum(e.num_tokens for e in events if e.kind == ev.LOAD)
        assert loads == sum(seq.num_tier_hit_tokens for seq in engine.outputs.values())
        assert sum(seq.num_recomputed_tokens for seq in engine.outputs.values()) == \
            sum(r.num_recompute_tokens for r in tracer.records) == sum(e.num_recomputed_tokens for e in events)
        if tier:
            assert not engine.scheduler.connector.copies_in_flight and not engine.scheduler.loading
    assert outputs[0] == outputs[num_offload_blocks]


@pytest.mark.parametrize("engine", ["sim", "real"])
def test_the_trace_says_the_tier_spared_a_recompute(tmp_path, engine):
    """From the trace alone (kvtrace record, analyses/tier_*.sql): with --offload-size the preempted
    requests load positions they recompute without, in the simulator and on the real CPU engine."""
    rows = [{"arrival_s": 0, "prompt_tokens": 24, "max_tokens": 24} for _ in range(3)]
    workload = write_workload(tmp_path / "w.jsonl", rows)
    common = ["--engine", engine, "--block-size", "4", "--num-gpu-blocks", "20", "--max-num-batched-tokens", "64"]
    runs = {}
    for name, extra in (("plain", []), ("tier", ["--offload-size", "1MiB"])):
        result, runs[name] = record(tmp_path, workload, name, *common, *extra)
        assert result.exit_code == 0, result.output
    con = connect([runs["tier"]])
    avoided = run_analysis(con, "tier_recompute_avoided").to_pylist()
    assert sum(r["tier_hit_tokens"] for r in avoided) > 0
    hits = run_analysis(con, "tier_hits").to_pylist()
    assert hits[0]["tier"] == "cpu" and hits[0]["resumed_lookups"] >= 1 and hits[0]["tier_hit_tokens"] > 0
    transfers = {r["direction"]: r for r in run_analysis(con, "tier_transfers").to_pylist()}
    assert transfers["offload"]["bytes"] > 0 and transfers["load"]["tokens"] == sum(r["tier_hit_tokens"] for r in avoided)
    recomputed = {name: sql(run, "SELECT sum(recomputed_tokens) FROM requests")[0][0] for name, run in runs.items()}
    assert recomputed["tier"] < recomputed["plain"]
    meta = json.loads((runs["tier"] / "meta.json").read_text())
    (tier,) = meta["kv_tiers"]
    assert tier["name"] == "cpu" and tier["policy"] == "lru" and tier["num_blocks"] > 0
    assert (tier["link_gb_s"] > 0) if engine == "sim" else tier["link_gb_s"] is None   # the real copies are timed
    durations = sql(runs["tier"], "SELECT count(*) FROM kv_events WHERE kind IN ('offload', 'load') AND duration_ms > 0")
    assert durations[0][0] == sum(r["copies"] for r in transfers.values())
    assert json.loads((runs["plain"] / "meta.json").read_text())["kv_tiers"] == []


def test_the_last_stores_are_filed_before_the_run_ends():
    # one step computes the prompt and finishes it; its store is still on the link: the engine steps on
    # (running nothing, its clock jumping to the copy's end) until it is filed
    tracer = ListTracer()
    engine = sim(tracer, num_offload_blocks=8)
    engine.add_request("only", list(range(100, 112)), SamplingParams(max_tokens=1, ignore_eos=True))
    run_checked(engine)
    assert [(r.step, r.num_prefill_tokens, r.offload_bytes) for r in tracer.records] == \
        [(0, 12, 0), (1, 0, 3 * engine.geometry.bytes_per_block)]
    assert tracer.records[1].start_s < tracer.records[1].end_s


# the simulator's copy of r0's store is on the link until step 1 ends, the real engine's done in step 0:
# r1 finishes at step 1 in the one, at step 0 in the other, with its offers refused until then
@pytest.mark.parametrize("engine, r1_tokens", [("sim", 2), ("real", 1)])
def test_a_finished_request_offers_its_refused_blocks_once_more(engine, r1_tokens):
    """r0's store fills a tier of 3 and is pending while r1 offers its prompt (refused: nothing ready to
    evict) and finishes; the step after, r1 offers its prompt once more, from the blocks it freed (the
    real engine copies them before anything reuses them), and r0's, ready by then, make room (vLLM's
    connector stores for finished requests too)."""
    outputs = {}
    for tier in (0, 3):
        tracer = ListTracer()
        e = sim(tracer, num_gpu_blocks=16, num_offload_blocks=tier, engine=engine)
        r0 = e.add_request("r0", list(range(100, 112)), SamplingParams(max_tokens=4, ignore_eos=True))
        r1 = e.add_request("r1", list(range(200, 212)), SamplingParams(max_tokens=r1_tokens, ignore_eos=True))
        run_checked(e)
        outputs[tier] = (r0.token_ids, r1.token_ids)
    assert outputs[0] == outputs[3]
    stores = [(e.req_id, e.blocks) for e in tracer.events if e.kind == ev.OFFLOAD]
    assert stores == [("r0", [1, 2, 3]), ("r1", [4, 5, 6])]
    evict = next(e for e in tracer.events if e.kind == ev.TIER_EVICT)
    finish = next(e for e in tracer.events if e.kind == ev.FINISH and e.req_id == "r1")
    assert evict.num_tier_blocks == 3 and evict.step == finish.step + 1


def test_a_step_waiting_only_for_a_load_wakes_for_the_next_arrival(tmp_path):
    """Nothing runs while again's load crosses the slow link: the simulator's clock jumps, but to the
    next arrival when it comes first, so that the new request is admitted while the load goes on."""
    profile = {**PROFILES["h100-sxm"].to_dict(), "name": "slow-link", "host_bytes_s": 1e6}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    tracer = ListTracer()
    engine = sim(tracer, num_gpu_blocks=64, num_offload_blocks=16, hardware=str(path))
    engine.add_request("first", list(range(100, 112)), SamplingParams(max_tokens=1, ignore_eos=True))
    run_checked_until(engine, lambda: ("first", 0) in finished(tracer))
    drop_cached_blocks(engine)
    engine.add_request("again", list(range(100, 112)) + [7], SamplingParams(max_tokens=2, ignore_eos=True))
    arrival = engine.now() + 0.001       # the load takes 7.5 ms over this link
    engine.advance(arrival)             # looks again up, starts its load, runs nothing
    engine.check_integrity()
    assert not any(e.kind == ev.LOAD for e in tracer.events)   # the load still in flight
    assert engine.now() == pytest.approx(arrival)
    engine.add_request("late", list(range(300, 304)), SamplingParams(max_tokens=2, ignore_eos=True),
                       arrival_s=arrival)
    run_checked(engine)
    admit_late = next(e for e in tracer.events if e.kind == ev.ADMIT and e.req_id == "late")
    load = next(e for e in tracer.events if e.kind == ev.LOAD and e.req_id == "again")
    assert admit_late.step <= load.step   # admitted while again's load was in flight



@pytest.mark.parametrize("sim_fast_path", [True, False], ids=["fast-path", "general-pass"])
@pytest.mark.parametrize("num_gpu_blocks, fenced", [(5, True), (64, False)], ids=["block-reused", "fresh-block"])
def test_a_finished_requests_store_finishes_where_its_block_is_taken_again(tmp_path, sim_fast_path, num_gpu_blocks,
                                                                          fenced):
    """first (3 prompt blocks) finishes at step 0, its store on a slow link for many steps; at step 4
    busy's decode takes a block: in a pool of 5 one that first freed, and the store finishes with that
    step (vLLM's connector flushes it before the forward writes into the block); in a pool of 64 a
    fresh one, and the store takes its time. In the simulator's fast path the block is taken in a lazy
    step, by a member of its cohort; in the general pass by the running pass."""
    profile = {**PROFILES["h100-sxm"].to_dict(), "name": "slow-link", "host_bytes_s": 1e6}
    path = tmp_path / "slow.json"
    path.write_text(json.dumps(profile))
    tracer = ListTracer()
    engine = sim(tracer, num_gpu_blocks=num_gpu_blocks, num_offload_blocks=16, hardware=str(path),
                 sim_fast_path=sim_fast_path)
    engine.add_request("busy", list(range(500, 505)), SamplingParams(max_tokens=30, ignore_eos=True))
    engine.add_request("first", list(range(100, 112)), SamplingParams(max_tokens=1, ignore_eos=True))
    while engine.has_unfinished():
        engine.advance()
        engine.check_integrity()
    firsts = next(e for e in tracer.events if e.kind == ev.ALLOC and e.req_id == "first")
    grow = next(e for e in tracer.events if e.kind == ev.ALLOC and e.req_id == "busy" and e.step == 4)
    store = next(e for e in tracer.events if e.kind == ev.OFFLOAD and e.req_id == "first")
    assert (firsts.step, store.blocks) == (0, firsts.blocks)
    assert (set(grow.blocks) <= set(firsts.blocks)) == fenced
    assert (store.step == 4) == fenced and store.step >= 4
    assert (engine.fast_path is not None and engine.fast_path.num_lazy_steps >= 4) == sim_fast_path
