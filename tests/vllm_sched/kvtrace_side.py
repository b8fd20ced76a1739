"""kvtrace's side of the scheduler-level differential: the simulator (`--engine sim`) driving engine/'s
real scheduler and block manager, in process, on the same workload and step clock as
tests/vllm_sched/vllm_driver.py, writing the same per-step record.

A step's record, on both sides (keys as the driver writes them):
    step          the step clock (a request arriving at step k is added before step k is scheduled)
    scheduled     [request:sample, tokens] in the batch's order
    preempted     victims, in the order they were preempted
    admitted      [request:sample, "new" | "resumed", prefix-hit tokens, block ids]
    grown         [request:sample, new block ids] of requests that ran before the step
    uncached      [request:sample, block ids]: a victim scheduled earlier in the step, the blocks its
                  scheduling cached taken out of the prefix cache (kvtrace's deliberate difference,
                  docs/scheduling.md; the vLLM driver applies it in exactly that case)
    num_free      free blocks right after scheduling; num_cached: how many of them hold a cached prefix
    finished      requests whose blocks were freed in the step, in the order they were freed
    free_queue    the free queue's block ids at the end of the step, next reused first
    placeholders  (async) [request:sample, tokens in flight] at the end of the step
A hybrid model's (a workload whose config names "kv_cache_groups"), also:
    given         [request:sample, [new block ids of each KV-cache group]] of each scheduled request
    dropped       [request:sample, group, block ids] that a sliding window dropped in the step
                  (admitted and grown then list every group's blocks, group by group, null blocks left out)
A speculative-decoding workload's (its "spec_tokens" drafts proposed a step, "spec_method"
"draft_model": vLLM's lookahead slots and drafting slot), in a step that verified drafts:
    drafts        [request:sample, drafts scheduled, drafts accepted] (the driver's `accepted` pattern)
A workload with a host KV tier's (its config's "offload": vLLM's OffloadingConnector with the driver's
StandInWorker; on kvtrace's side engine/offload.py, its copies on the same step clock: StepCopies):
    tier          {"loads": [job, request:sample, device blocks, device hit, tier hit, tokens, table],
                   "stores": [job, request:sample, device blocks], "flushed": jobs, "evicted": chunks,
                   "done": [job, ok]}: the copies issued in the step's scheduling, the jobs flushed,
                   the chunks evicted from the tier, and the copies that finished in its output
"""
from __future__ import annotations

from dataclasses import replace

from engine import events as ev
from engine.build import build_engine
from engine.config import (
    FULL_ATTENTION,
    PRESETS,
    SLIDING_ATTENTION,
    VLLM_VERSION,
    EngineConfig,
    PreemptionPolicy,
)
from engine.llm_engine import LLMEngine
from engine.model.loader import LoadedModel
from engine.offload import Lookup
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, SequenceStatus

PLANTS = ("wrong-victim", "head-first-free", "no-prefix-hits", "threshold-ignored")
# a hybrid model's (a workload of several KV-cache groups): no window drops a block; a window drops the
# blocks of positions still in flight (async); a whole request's admission counts a window's every block;
# a window's prefix hit found as full attention's (every block from the first, none left null)
HYBRID_PLANTS = ("window-ignored", "in-flight-dropped", "admission-uncapped", "window-hit-from-the-start")
# a drafting server's (speculative decoding): rejected drafts kept as computed; no lookahead slots reserved;
# no drafting slot counted against the step's budget; an admitted decode left unpadded; an EAGLE drafter's
# prefix hits made as a draft model's (vLLM up to 0.32 recomputes a hit's last block, 0.33 on hash each
# block with the token after it)
SPEC_PLANTS = ("rejected-kept", "no-lookahead", "no-drafting-slot", "unpadded", "eagle-as-draft-model")
# a host KV tier's (vLLM's offloading connector): the tier never consulted; a load admitted without leaving
# the blocks others still need; a finished request's stores not flushed when their blocks are reused; the
# other vLLM releases' eviction ranks
TIER_PLANTS = ("tier-unread", "load-unreserved", "stores-unfenced", "ranks-of-other-releases")


def key(seq) -> str:
    return f"{seq.req_id}:{seq.sample}"


def model(cfg: dict) -> LoadedModel | None:
    """The simulated model: the tiny preset, or for a hybrid workload the tiny preset with one layer per
    KV-cache group the workload names ("full", "sliding": a window of `window_blocks` blocks), whose
    groups are vLLM's in the same order (the workloads name only orders vLLM's grouping makes)."""
    kinds = cfg.get("kv_cache_groups")
    if not kinds:
        return None
    layer_types = tuple(SLIDING_ATTENTION if k == "sliding" else FULL_ATTENTION for k in kinds)
    config = replace(PRESETS["tiny"], num_layers=len(kinds), layer_types=layer_types,
                     sliding_window=cfg.get("window_blocks", 4) * cfg["block_size"])
    assert [g.window is not None for g in config.kv_cache_groups] == [k == "sliding" for k in kinds], kinds
    return LoadedModel(config, {}, "a tiny hybrid model")


def accepted(rid: str, index: int, drafts: int) -> int:
    """How many of a request's drafts step `index` accepts: vllm_driver.py's placeholder model's pattern."""
    return (sum(map(ord, rid)) + index) % (drafts + 1)


def build(cfg: dict, vllm_version: str = VLLM_VERSION, spec: tuple[str, int] | None = None) -> LLMEngine:
    """`spec`: (vLLM's speculative method, draft tokens a step) of a speculative-decoding workload."""
    policy = PreemptionPolicy.PRIORITY if cfg["policy"] == "priority" else PreemptionPolicy.NEWEST
    config = EngineConfig(model="tiny", engine="sim", block_size=cfg["block_size"], num_gpu_blocks=cfg["num_blocks"],
                          num_cpu_blocks=0, max_num_seqs=cfg["max_num_seqs"],
                          max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"],
                          long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
                          preemption_policy=policy, async_scheduling=cfg["async"],
                          enable_prefix_caching=cfg["enable_prefix_caching"],
                          speculative_method=spec[0] if spec else None, num_speculative_tokens=spec[1] if spec else 0,
                          num_offload_blocks=cfg["offload"]["chunks"] if cfg.get("offload") else None)
    engine = build_engine(config, loaded=model(cfg))
    engine.scheduler.follow(vllm_version)
    engine.keep_outputs = False
    return engine


def plant(engine: LLMEngine, bug: str) -> None:
    """Make kvtrace's side wrong on purpose (the differential's self-test must catch each)."""
    sched, bm = engine.scheduler, engine.block_manager
    if bug == "wrong-victim":      # the oldest running request instead of the newest / least urgent
        sched._pick_victim = lambda needing: (sched.running[0], "newest")
    elif bug == "head-first-free":  # a finished request's blocks freed head first (its tail evicted last)
        release = bm._release_blocks

        def release_table(seq, reason):
            release(list(seq.block_table))
            seq.block_table, seq.block_hashes = [], []
        bm._release_table = release_table
    elif bug == "no-prefix-hits":
        bm.match_prefix = lambda seq: []
    elif bug == "threshold-ignored":
        sched.long_prefill_token_threshold = 0
    elif bug == "window-ignored":
        bm.drop_out_of_window = lambda seq, num_processed: None
    elif bug == "in-flight-dropped":
        drop = bm.drop_out_of_window
        bm.drop_out_of_window = lambda seq, num_processed: drop(seq, seq.num_computed_tokens)
    elif bug == "admission-uncapped":
        bm.admission_caps = (None,) * len(bm.admission_caps)
    elif bug == "window-hit-from-the-start":
        def window_hit(seq, hashes, limit, groups, hits, needed):
            n = 0
            while n < limit and bm._cached(seq, hashes, n, groups) is not None:
                n += 1
            for group in groups:
                hits[group] = [bm._cached(seq, hashes, i, [group])[0] for i in range(n)]
            return n
        bm._window_hit = window_hit
    elif bug == "rejected-kept":
        acceptance = engine.acceptance

        def keep_rejected(seq, index, num_drafts):
            accepted = acceptance(seq, index, num_drafts)
            seq.num_computed_tokens += num_drafts - accepted   # the engine then rolls back nothing
            return accepted
        engine.acceptance = keep_rejected
    elif bug == "no-lookahead":
        sched.num_lookahead_tokens = 0
    elif bug == "no-drafting-slot":
        sched.draft_slots = 0
    elif bug == "eagle-as-draft-model":
        bm.drop_last_hit_block, bm.hash_lookahead = False, 0
    elif bug == "unpadded":
        spec_tokens = sched.num_spec_tokens
        admit = sched._admit_waiting

        def admit_unpadded(out, budget, threshold):
            sched.num_spec_tokens = 0   # no padding (drafts of running sequences are scheduled before)
            try:
                admit(out, budget, threshold)
            finally:
                sched.num_spec_tokens = spec_tokens
        sched._admit_waiting = admit_unpadded
    elif bug == "tier-unread":
        sched.connector.tier.lookup = lambda key: Lookup.MISS
    elif bug == "load-unreserved":
        sched.connector.num_blocks_reserved = lambda loading, admitted, admitted_new: 0
    elif bug == "stores-unfenced":
        sched.connector._fence_reused = lambda: None
    elif bug == "ranks-of-other-releases":
        sched.connector.tier.ranks_by_request = not sched.connector.tier.ranks_by_request
    else:
        raise ValueError(f"no such plant {bug!r} (one of {', '.join(PLANTS + HYBRID_PLANTS + SPEC_PLANTS + TIER_PLANTS)})")


class StepCopies:
    """The host KV tier's copies on the driver's step clock instead of the simulator's host link, as
    vllm_driver.py's StandInWorker finishes vLLM's transfer jobs: a copy issued in step i finishes in step
    i + `delay` (a flushed one in its own step), numbered as vLLM's connector numbers its jobs (from 0,
    in the order issued). Notes each step's part of the record's "tier": the loads and stores issued
    (a load with its sequence's device hit, tier hit, tokens and table), the jobs flushed, the chunks
    the tier evicted, and the jobs finished ([job, ok])."""

    def __init__(self, engine: LLMEngine, offload: dict) -> None:
        self.engine, self.delay = engine, offload.get("delay", 1)
        self.index = 0                  # the step being run (the driver's record index)
        self.jobs: dict[int, list] = {}  # id(copy) -> [job id, due step, the copy (kept: its id stays its own)]
        self.tier: dict = {}
        connector = engine.scheduler.connector
        issue = connector._issue
        numbered = iter(range(1 << 62))

        def issue_and_number(copy, out) -> None:
            self.jobs[id(copy)] = [next(numbered), self.index + self.delay, copy]
            issue(copy, out)
        connector._issue = issue_and_number
        engine._finish_copies = self.finish

    def scheduled(self, out, events) -> None:
        """What the tier's side decided in this step's scheduling."""
        connector, bs = self.engine.scheduler.connector, self.engine.block_manager.block_size
        loads, stores = [], []
        for copy in out.tier_copies:
            seq, job = copy.seq, self.jobs[id(copy)][0]
            if copy.is_load:
                num_tier = len(copy.keys) * bs
                loads.append([job, key(seq), list(copy.device_blocks), seq.num_computed_tokens - num_tier, num_tier,
                              seq.num_tokens, list(seq.block_table)])
            else:
                stores.append([job, key(seq), list(copy.device_blocks)])
        flushed = sorted(self.jobs[id(c)][0] for c in connector.copies_in_flight if c.flushed)
        evicted = sum(e.num_tier_blocks for e in events if e.kind == ev.TIER_EVICT)
        self.tier = {"loads": sorted(loads), "stores": sorted(stores), "flushed": flushed, "evicted": evicted}

    def finish(self, out, start_clock: float) -> tuple[int, int, float]:
        """LLMEngine._finish_copies on the step clock: the copies due by this step finish, in job order."""
        engine, connector = self.engine, self.engine.scheduler.connector
        for copy in out.tier_copies:
            copy.event.bytes = len(copy.device_blocks) * engine.geometry.bytes_per_block
        done = sorted((c for c in connector.copies_in_flight if c.flushed or self.jobs[id(c)][1] <= self.index),
                      key=lambda c: self.jobs[id(c)][0])
        stored = loaded = 0
        for copy in done:
            connector.complete_copy(copy)
            engine.block_manager.events.append(copy.event)
            if copy.is_load:
                loaded += copy.event.bytes
            else:
                stored += copy.event.bytes
        self.tier["done"] = [[self.jobs[id(c)][0], True] for c in done]
        return stored, loaded, 0.0


def run(workload: dict, bug: str | None = None, vllm_version: str = VLLM_VERSION, tracer=None) -> list[dict]:
    """The workload's step records; `vllm_version`: the vLLM whose scheduling kvtrace follows;
    `tracer`: the engine's Tracer (its own trace of the run, every step handed over by the end)."""
    cfg = workload["config"]
    spec = (workload["spec_method"], workload["spec_tokens"]) if workload.get("spec_tokens") else None
    engine = build(cfg, vllm_version, spec)
    if tracer is not None:
        engine.tracer = tracer
    drafted: list[list] = []   # the step's drafts: [request:sample, drafts, accepted]

    def accept_and_note(seq, index: int, num_drafts: int) -> int:
        n = accepted(key(seq), index, num_drafts)
        drafted.append([key(seq), num_drafts, n])
        return n
    engine.acceptance = accept_and_note
    if bug:
        plant(engine, bug)
    sched, bm = engine.scheduler, engine.block_manager
    copies = StepCopies(engine, cfg["offload"]) if cfg.get("offload") else None
    finished: list[str] = []
    seen: dict = {}
    finish = sched.finish

    def finish_and_note(seq) -> None:
        finished.append(key(seq))
        finish(seq)
    sched.finish = finish_and_note
    uncached: list[list] = []
    uncache_from = bm.uncache_from

    def uncache_and_note(seq, num_blocks: int) -> None:
        taken = [b for table in seq.tables() for b in table[num_blocks:len(seq.block_hashes)]
                 if b and bm.blocks[b].hash is not None and bm.blocks[b].ref_count == 1]
        uncache_from(seq, num_blocks)
        if taken:
            uncached.append([key(seq), taken])
    bm.uncache_from = uncache_and_note

    def schedule_and_note():
        before = {id(s): [len(t) for t in s.tables()] for s in sched.running}
        was_preempted = {id(s): s.num_preemptions > 0 for s in [*sched.waiting, *sched.loading]}
        num_events = len(bm.events)
        uncached.clear()
        out = Scheduler.schedule(sched)
        scheduled, admitted, grown, given = [], [], [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            scheduled.append([key(seq), n])
            since = before.get(id(seq), [0] * len(seq.tables()))
            new = [[b for b in table[start:] if b] for table, start in zip(seq.tables(), since)]
            if id(seq) in before:
                if any(new):
                    grown.append([key(seq), [b for blocks in new for b in blocks]])
            else:
                kind = "resumed" if was_preempted[id(seq)] else "new"
                admitted.append([key(seq), kind, seq.num_computed_tokens, [b for t in seq.tables() for b in t if b]])
            if any(new):
                given.append([key(seq), new])
        events = bm.events[num_events:]
        preempted = [f"{e.req_id}:{e.sample}" for e in events if e.kind == "preempt"]
        if copies is not None:
            copies.scheduled(out, events)
        seen.update(scheduled=scheduled, preempted=preempted, admitted=admitted, grown=grown,
                    uncached=list(uncached), num_free=bm.num_free_blocks, num_cached=bm.num_cached_free_blocks)
        if bm.hybrid:
            seen.update(given=sorted(given), dropped=sorted(
                [f"{e.req_id}:{e.sample}", e.kv_group, sorted(e.blocks)] for e in events
                if e.kind == ev.FREE and e.reason == ev.FreeReason.WINDOW))
        return out
    sched.schedule = schedule_and_note

    pending = sorted(workload["requests"], key=lambda r: r["arrival_step"])
    steps: list[dict] = []
    step = 0
    max_steps = workload.get("max_steps", 3000)

    def active() -> bool:   # requests to serve, or (async) a step in flight whose output is to process
        in_flight = engine._in_flight
        if copies is not None:   # copies left in flight when the last request finished: vLLM stops stepping
            return bool(sched.all_seqs())
        return engine.has_unfinished() or in_flight is not None and bool(in_flight.out.seqs)

    while pending or active():
        if not active():
            step = max(step, pending[0]["arrival_step"])   # idle until the next arrival
        while pending and pending[0]["arrival_step"] <= step:
            r = pending.pop(0)
            params = SamplingParams(max_tokens=r["max_tokens"], n=r.get("n", 1), ignore_eos=True)
            engine.add_request(r["id"], list(r["prompt"]), params, arrival_s=float(r["arrival_step"]),
                               priority=r.get("priority", 0))
        if not active():
            continue
        finished.clear()
        drafted.clear()
        if copies is not None:
            copies.index = len(steps)
        engine.step()
        record = {"step": step, **{k: v for k, v in seen.items() if k not in ("given", "dropped")},
                  "finished": list(finished), "free_queue": list(bm.free_queue)}
        if bm.hybrid:   # in the driver's order of keys
            record.update(given=seen["given"], dropped=seen["dropped"])
        if drafted:
            record["drafts"] = sorted(drafted)
        if copies is not None:
            record["tier"] = copies.tier
        if cfg["async"]:
            # (speculative decoding: the drafts in flight too)
            record["placeholders"] = sorted([key(s), s.num_undelivered + s.num_draft_placeholders]
                                            for s in sched.running + list(sched.waiting)
                                            if (s.num_undelivered or s.num_draft_placeholders)
                                            and s.status != SequenceStatus.FINISHED)
        steps.append(record)
        step += 1
        if len(steps) > max_steps:
            raise RuntimeError(f"no end after {max_steps} steps")
    if tracer is not None:
        engine.flush()
    return steps
