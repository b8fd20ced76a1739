"""Hypothesis workloads for the scheduler-level differential.

A workload is {"config": CONFIG, "requests": [REQUEST, ...]}:
    CONFIG   block_size, num_blocks (usable, the null block not counted), max_num_seqs,
             max_num_batched_tokens, max_model_len, long_prefill_token_threshold (0: none),
             policy ("fcfs" | "priority"), async (bool), enable_prefix_caching (bool)
    REQUEST  id (zero-padded: vLLM breaks priority ties by id, kvtrace by arrival order), prompt
             (token ids), max_tokens, n, priority, arrival_step

Every request can complete alone in the pool (vLLM's scheduler would preempt itself forever
otherwise): its stored positions, prompt + max_tokens - 1 capped at max_model_len - 1 (the last
sampled token is never stored), fit. The pool ranges from "just fits the longest request" to ample.
"""
from __future__ import annotations

import random

from hypothesis import strategies as st

BATCH = 8   # workloads a Hypothesis example holds: the vLLM drivers run them side by side


def positions(prompt_len: int, max_tokens: int, max_model_len: int) -> int:
    """KV positions a request ever stores."""
    return min(prompt_len + max_tokens - 1, max_model_len - 1)


# a hybrid model's KV-cache groups, in orders vLLM's grouping makes (ModelConfig.kv_cache_groups): a window
# on every layer (Mistral), full attention beside a window either way round, two windowed groups beside one
# full (Gemma 3's pattern, shortened)
HYBRID_GROUPS = [["sliding"], ["full", "sliding"], ["sliding", "full"], ["sliding", "sliding", "full"]]


def blocks_needed(prompt_len: int, max_tokens: int, cfg: dict, spec_tokens: int = 0) -> int:
    """Blocks a request holds at most, every KV-cache group's: a windowed group's no more than vLLM's
    admission cap (a window less one position, the steps in flight, one block more). `spec_tokens`:
    speculative decoding's drafts a step, whose positions and lookahead slots go past the last token."""
    bs, max_model_len = cfg["block_size"], cfg["max_model_len"]
    need = -(-positions(prompt_len, max_tokens, max_model_len) // bs)
    if spec_tokens:
        need = -(-min(prompt_len + max_tokens + 2 * spec_tokens, max_model_len) // bs)
    kinds = cfg.get("kv_cache_groups")
    if not kinds:
        return need
    window = cfg["window_blocks"] * bs
    in_flight = cfg["max_num_batched_tokens"] * (2 if cfg["async"] else 1)
    cap = -(-min(window - 1 + in_flight, max_model_len) // bs) + 1
    return sum(need if kind == "full" else min(need, cap) for kind in kinds)


@st.composite
def workloads(draw, asynchronous: bool, hybrid: bool = False, spec: bool = False) -> dict:
    """Hypothesis draws the structure (sizes, kinds, limits, arrivals) and a seed; the token ids come
    from the seed, which keeps generation cheap enough for thousands of workloads a run (shrinking
    still shortens prompts and drops requests). `hybrid`: a model of sliding windows beside full
    attention (HYBRID_GROUPS, windows of 1 to 4 blocks). `spec`: a server
    drafting 1 to 4 tokens a step with a draft model (lookahead slots and a drafting slot) or EAGLE
    (lookahead slots; a prefix hit's last block recomputed)."""
    block_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    rng = random.Random(draw(st.integers(0, 2**32 - 1)))
    vocab = draw(st.sampled_from([3, 50, 500]))   # a tiny vocabulary repeats blocks: accidental prefix hits

    def tokens(n: int) -> list[int]:
        return [rng.randint(1, vocab) for _ in range(n)]
    systems = [tokens(n) for n in draw(st.lists(st.integers(1, 48), min_size=1, max_size=3))]
    long_prompts = draw(st.booleans())
    arrivals = draw(st.sampled_from(["backlog", "over-time"]))
    policy = draw(st.sampled_from(["fcfs", "priority"]))
    num_requests = draw(st.integers(1, 10))
    requests = []
    step = 0
    for i in range(num_requests):
        kind = draw(st.sampled_from(["random", "shared", "shared", "long"] if long_prompts else ["random", "shared"]))
        if kind == "random":
            prompt = tokens(draw(st.integers(1, 40)))
        elif kind == "shared":   # a burst on a shared system prompt
            prompt = systems[draw(st.integers(0, len(systems) - 1))] + tokens(draw(st.integers(0, 20)))
        else:                    # long: chunked over several steps
            prompt = tokens(draw(st.integers(60, 200)))
        if arrivals == "over-time":
            step += draw(st.integers(0, 6))
        requests.append({
            "id": f"r{i:02d}", "prompt": prompt,
            "max_tokens": draw(st.one_of(st.integers(1, 3), st.integers(1, 24))),
            "n": draw(st.sampled_from([1, 1, 1, 2, 3])),
            "priority": draw(st.integers(0, 3)) if policy == "priority" else 0,
            "arrival_step": step,
        })
    longest_prompt = max(len(r["prompt"]) for r in requests)
    max_model_len = longest_prompt + 1 + draw(st.sampled_from([0, 2, 8, 1000]))   # some stop at the limit
    max_num_seqs = draw(st.integers(1, 8))
    max_num_batched_tokens = max(max_num_seqs, draw(st.sampled_from([4, 8, 16, 32, 64, 256])))
    threshold = draw(st.sampled_from([0, 0, 1, 4, 16, 48]))
    threshold = min(threshold, max_model_len)
    config = {"block_size": block_size, "max_num_seqs": max_num_seqs,
              "max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
              "long_prefill_token_threshold": threshold, "policy": policy, "async": asynchronous}
    if hybrid:
        config.update(kv_cache_groups=draw(st.sampled_from(HYBRID_GROUPS)), window_blocks=draw(st.integers(1, 4)))
    spec_tokens = draw(st.integers(1, 4)) if spec else 0
    if spec_tokens:
        # a step's budget holds a padded decode (1 + k positions) and its drafting slot: with less, vLLM's
        # scheduler never admits a request whose prefix hit leaves one token (it waits for room to pad; found
        # by this generator, kvtrace's does the same), and no step-by-step comparison ends
        config["max_num_batched_tokens"] = max(max_num_batched_tokens, spec_tokens + 2)
    if spec_tokens and 0 < threshold <= spec_tokens:
        config["long_prefill_token_threshold"] = 0   # vLLM fails padding a decode past the threshold
    need = [blocks_needed(len(r["prompt"]), r["max_tokens"], config, spec_tokens) for r in requests]
    total = sum(n * r["n"] for n, r in zip(need, requests))
    slack = max(total - max(need), 0)   # 0: just fits the longest request; slack: holds every request at once
    num_blocks = max(need) + draw(st.sampled_from([0, 0, 1, 2, slack // 4, slack // 2, slack + 4]))
    # (drawn last, as before hybrid workloads: a dense workload of a given seed is the same as it was)
    config["enable_prefix_caching"] = draw(st.sampled_from([True, True, True, False]))
    workload = {"config": {"block_size": block_size, "num_blocks": num_blocks, **config}, "requests": requests}
    if spec_tokens:   # a draft model (a drafting slot a request), or EAGLE (a prefix hit's last block dropped)
        workload.update(spec_tokens=spec_tokens, spec_method=draw(st.sampled_from(["draft_model", "eagle"])))
    return workload


@st.composite
def tier_workloads(draw, asynchronous: bool, failing: bool = True, prefix_caching: bool | None = None) -> dict:
    """A workload with a host KV tier, vLLM's native CPU offloading (the driver's StandInWorker): 1 chunk
    to ample (a chunk is a block), its copies taking 0 to 3 steps, with `failing` every third failing in
    some (vLLM 0.34: the others cannot fail a copy), a failed load computed again or its request ended,
    and in some loads that fit a budget run in the step that admits their request (vLLM 0.33's sync loads). `prefix_caching`: only workloads with it on (True;
    kvtrace's tier keys its chunks by the prefix cache's hashes) or off."""
    # (no prompt of one token: one that the tier holds whole is loaded, given back to compute (its last
    # position) and so looked up again, forever: vLLM 0.31 to 0.34 never schedule it)
    workload = draw(workloads(asynchronous).filter(
        lambda w: min(len(r["prompt"]) for r in w["requests"]) > 1
        and prefix_caching in (None, w["config"]["enable_prefix_caching"])))
    offload = {"chunks": draw(st.sampled_from([1, 2, 4, 8, 1000])), "delay": draw(st.integers(0, 3)),
               "fail_every": draw(st.sampled_from([0, 0, 3])) if failing else 0}
    if offload["fail_every"]:   # what vLLM does with a request whose load failed: computes it, or ends it
        offload["load_failure_policy"] = draw(st.sampled_from(["recompute", "fail"]))
    if failing and draw(st.booleans()):   # vLLM 0.33 on: loads of up to 64 KiB a step run in the step
        offload["sync_load_bytes"] = 1 << 16
    workload["config"]["offload"] = offload
    return workload


def tally(steps: list[dict]) -> dict[str, int]:
    """What a workload exercised: preemptions, prefix hits, resumptions (the corpus must not be vacuous)."""
    admitted = [a for s in steps for a in s["admitted"]]
    return {"workloads": 1, "steps": len(steps),
            "preempting": int(any(s["preempted"] for s in steps)),
            "hitting": int(any(a[2] > 0 for a in admitted)),
            "resuming": int(any(a[1] == "resumed" for a in admitted)),
            "uncaching": int(any(s["uncached"] for s in steps)),
            "dropping": int(any(s.get("dropped") for s in steps)),
            "drafting": int(any(s.get("drafts") for s in steps)),
            # a host KV tier's: loads, evictions from the tier, copies flushed (a preemption, a block reused)
            "loading": int(any(s["tier"]["loads"] for s in steps if "tier" in s)),
            "tier-evicting": int(any(s["tier"]["evicted"] for s in steps if "tier" in s)),
            "flushing": int(any(s["tier"]["flushed"] for s in steps if "tier" in s))}
