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
"""
from __future__ import annotations

from engine.build import build_engine
from engine.config import VLLM_VERSION, EngineConfig, PreemptionPolicy
from engine.llm_engine import LLMEngine
from engine.scheduler import Scheduler
from engine.sequence import SamplingParams, SequenceStatus

PLANTS = ("wrong-victim", "head-first-free", "no-prefix-hits", "threshold-ignored")


def key(seq) -> str:
    return f"{seq.req_id}:{seq.sample}"


def build(cfg: dict, vllm_version: str = VLLM_VERSION) -> LLMEngine:
    policy = PreemptionPolicy.PRIORITY if cfg["policy"] == "priority" else PreemptionPolicy.NEWEST
    config = EngineConfig(model="tiny", engine="sim", block_size=cfg["block_size"], num_gpu_blocks=cfg["num_blocks"],
                          num_cpu_blocks=0, max_num_seqs=cfg["max_num_seqs"],
                          max_num_batched_tokens=cfg["max_num_batched_tokens"], max_model_len=cfg["max_model_len"],
                          long_prefill_token_threshold=cfg["long_prefill_token_threshold"],
                          preemption_policy=policy, async_scheduling=cfg["async"],
                          enable_prefix_caching=cfg["enable_prefix_caching"])
    engine = build_engine(config)
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
    else:
        raise ValueError(f"no such plant {bug!r} (one of {', '.join(PLANTS)})")


def run(workload: dict, bug: str | None = None, vllm_version: str = VLLM_VERSION, tracer=None) -> list[dict]:
    """The workload's step records; `vllm_version`: the vLLM whose scheduling kvtrace follows;
    `tracer`: the engine's Tracer (its own trace of the run, every step handed over by the end)."""
    cfg = workload["config"]
    engine = build(cfg, vllm_version)
    if tracer is not None:
        engine.tracer = tracer
    if bug:
        plant(engine, bug)
    sched, bm = engine.scheduler, engine.block_manager
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
        taken = [b for b in seq.block_table[num_blocks:len(seq.block_hashes)]
                 if bm.blocks[b].hash is not None and bm.blocks[b].ref_count == 1]
        uncache_from(seq, num_blocks)
        if taken:
            uncached.append([key(seq), taken])
    bm.uncache_from = uncache_and_note

    def schedule_and_note():
        before = {id(s): len(s.block_table) for s in sched.running}
        was_preempted = {id(s): s.num_preemptions > 0 for s in sched.waiting}
        num_events = len(bm.events)
        uncached.clear()
        out = Scheduler.schedule(sched)
        scheduled, admitted, grown = [], [], []
        for seq, n in zip(out.seqs, out.num_new_tokens):
            scheduled.append([key(seq), n])
            if id(seq) in before:
                new = seq.block_table[before[id(seq)]:]
                if new:
                    grown.append([key(seq), list(new)])
            else:
                kind = "resumed" if was_preempted[id(seq)] else "new"
                admitted.append([key(seq), kind, seq.num_computed_tokens, list(seq.block_table)])
        preempted = [f"{e.req_id}:{e.sample}" for e in bm.events[num_events:] if e.kind == "preempt"]
        seen.update(scheduled=scheduled, preempted=preempted, admitted=admitted, grown=grown,
                    uncached=list(uncached), num_free=bm.num_free_blocks, num_cached=bm.num_cached_free_blocks)
        return out
    sched.schedule = schedule_and_note

    pending = sorted(workload["requests"], key=lambda r: r["arrival_step"])
    steps: list[dict] = []
    step = 0
    max_steps = workload.get("max_steps", 3000)

    def active() -> bool:   # requests to serve, or (async) a step in flight whose output is to process
        in_flight = engine._in_flight
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
        engine.step()
        record = {"step": step, **seen, "finished": list(finished), "free_queue": list(bm.free_queue)}
        if cfg["async"]:
            record["placeholders"] = sorted([key(s), s.num_undelivered] for s in sched.running + list(sched.waiting)
                                            if s.num_undelivered and s.status != SequenceStatus.FINISHED)
        steps.append(record)
        step += 1
        if len(steps) > max_steps:
            raise RuntimeError(f"no end after {max_steps} steps")
    if tracer is not None:
        engine.flush()
    return steps
