"""kvtrace's capture of a KV tier on vLLM's own scheduler classes: the tier events it writes are what vLLM's
KV connector decided (issue 57, part 2).

The differential's driver (tests/vllm_sched/vllm_driver.py --capture) builds kvtrace's capture scheduler
with vLLM's native CPU offloading (the real OffloadingConnector's scheduler side, its CPU manager sized
in chunks) and a stand-in for its worker (StandInWorker: each transfer job completes a chosen number of
steps after it was issued, a flushed one at once, and on vLLM 0.34 every third job of some workloads
fails), steps generated workloads (tight pools that preempt, shared prompts, tiers from one chunk to
ample) with the capture's self-check on, and records, independently of the capture, every load and store
job the connector issued, each one's completion and the chunks its manager evicted. Checked on
kvtrace's side, for every workload:
- everything test_capture_on_vllm.py's capture_differences checks (self-check, pool, admissions, victims,
  frees, balance, tokens), an admission after a load being the rest of the request's blocks;
- a `lookup` per admission the connector was asked about: a load's with the device's hit and the tier's
  (the connector's hit, less the last position where it had them all), every other with none, and the
  positions it leaves to compute those of the admission that follows;
- a `load` for every load job and an `offload` for every store job, filed with the step whose output
  completed it, with its request, device blocks, positions, bytes and `failed` where it failed;
- a `tier_evict` count per step of the chunks the manager evicted; the steps' bytes each way and the
  requests' tier_hit_tokens their events'.
A planted wrong tier (a load's positions credited to the device's prefix cache) is caught.
"""
from __future__ import annotations

import json
import os
import shutil
from collections import Counter, defaultdict
from pathlib import Path

import pytest
from hypothesis import strategies as st

from tests.vllm import test_capture_on_vllm as on_vllm
from tests.vllm.test_capture_on_vllm import DRIVERS, capture_differences, for_each_workload, starts_vllm, unchecked
from tests.vllm_sched.differential import VllmScheduler
from tests.vllm_sched.workloads import tier_workloads

vllm = on_vllm.vllm   # the capture tests' fixture: a driver per vLLM venv
NUM_WORKLOADS = int(os.environ.get("KVTRACE_CAPTURE_TIER_WORKLOADS", "12"))
TIER_KINDS = ("lookup", "load", "offload", "tier_evict")


def as_captured(records: list[dict]) -> list[dict]:
    """vLLM's records with each admission after a load as the capture writes it: the blocks the request
    held while it waited (its device hit's and the load's) were given at the load, so the admission has
    no prefix hit and only the blocks given since. A sync load's request (vLLM 0.33's: loaded in the step
    that admits it) is admitted with its device hit as the prefix hit, the load's positions its own."""
    held: dict[str, list[int]] = {}
    loads: dict[int, str] = {}
    out = []
    for rec in records:
        sync = {load[1]: load[3] for load in rec["tier"]["loads"] if load[0] in rec["tier"].get("sync", ())}
        admitted = []
        for rid, kind, hit, table in rec["admitted"]:
            before = held.pop(rid, None)
            hit = sync.get(rid, hit)
            admitted.append([rid, kind, hit, table] if before is None else [rid, kind, 0, table[len(before):]])
        for job, rid, _, _, _, _, table in rec["tier"]["loads"]:
            if rid in sync:
                continue
            held[rid], loads[job] = table, rid
        for job, ok in rec["tier"]["done"]:
            if not ok and job in loads:   # a failed load gives its blocks back: admitted later as a new lookup
                held.pop(loads[job], None)
        out.append({**rec, "admitted": admitted})
    return out


def tier_differences(workload: dict, records: list[dict], answer: dict) -> list[str]:
    """Where the capture's tier events, and the columns they add up to, are not what vLLM's connector decided
    (the driver's records: each step's load and store jobs, their completions, the chunks evicted)."""
    from kvtrace.vllm.importer import read_chunks

    c = read_chunks(Path(answer["capture"]))
    bs = workload["config"]["block_size"]
    per_block = 2 * bs * 4   # a block's bytes: keys and values of 1 head of 1 float32 in 1 layer (the driver's)
    k = c["kv_events"]
    names = ("step", "kind", "req_id", "blocks", "num_blocks", "num_tokens", "num_cached_tokens", "tier",
             "tier_tokens", "bytes", "reason")
    events = [dict(zip(names, (k[n][i] for n in names))) for i in sorted(range(len(k["seq"])), key=lambda i: k["seq"][i])]
    want_lookups, want_copies, evicted, issued = [], [], Counter(), {}
    hits: dict[str, int] = defaultdict(int)
    for n, rec in enumerate(records):
        tier = rec["tier"]
        for job, rid, blocks, num_hit, num_external, num_tokens, _ in tier["loads"]:
            credited = min(num_external, num_tokens - 1 - num_hit)
            want_lookups.append((n, rid, num_tokens, num_hit, credited))
            issued[job] = ("load", rid, blocks, credited)
        for job, rid, blocks in tier["stores"]:
            issued[job] = ("offload", rid, blocks, len(blocks) * bs)
        for job, ok in tier["done"]:
            kind, rid, blocks, num_tokens = issued.pop(job)
            want_copies.append((n, kind, rid, blocks, num_tokens, None if ok else "failed", len(blocks) * per_block))
            if kind == "load" and ok:
                hits[rid] += num_tokens
        evicted[n] += tier["evicted"]
    problems = []
    chunks = workload["config"]["offload"]["chunks"]
    identity = json.loads((Path(answer["capture"]) / "capture.json").read_text())
    tier = {"name": "cpu", "num_blocks": chunks, "bytes": 4096 * chunks, "block_size": bs, "policy": "lru",
            "link_gb_s": None}
    if identity["kv_tiers"] != [tier]:
        problems.append(f"capture.json's kv_tiers {identity['kv_tiers']}, the tier {tier}")
    loading = {(n, rid) for n, rid, *_ in want_lookups}
    got_lookups = [(e["step"], e["req_id"], e["num_tokens"], e["num_cached_tokens"], e["tier_tokens"])
                   for e in events if e["kind"] == "lookup" and (e["step"], e["req_id"]) in loading]
    if sorted(got_lookups) != sorted(want_lookups):
        problems.append(f"lookups of a load {sorted(got_lookups)[:6]}, vLLM's loads {sorted(want_lookups)[:6]}")
    got_copies = [(e["step"], e["kind"], e["req_id"], e["blocks"], e["num_tokens"], e["reason"], e["bytes"])
                  for e in events if e["kind"] in ("load", "offload")]
    if sorted(got_copies, key=repr) != sorted(want_copies, key=repr):
        problems.append(f"copies {sorted(got_copies, key=repr)[:6]}, vLLM's {sorted(want_copies, key=repr)[:6]}")
    got_evicted = Counter()
    for e in events:
        if e["kind"] == "tier_evict":
            got_evicted[e["step"]] += e["num_blocks"]
    if +got_evicted != +evicted:
        problems.append(f"tier evictions per step {dict(+got_evicted)}, vLLM's {dict(+evicted)}")
    tiers = {(e["kind"], e["tier"]) for e in events}
    wrong = {(kind, tier) for kind, tier in tiers if (tier == "cpu") != (kind in TIER_KINDS)}
    if wrong:
        problems.append(f"events whose tier is wrong for their kind: {sorted(wrong, key=repr)}")
    # every other admission the connector was asked about: a lookup with no tier hit, then its admission,
    # whose positions to compute are what the lookup leaves
    for i, e in enumerate(events):
        if e["kind"] == "lookup" and (e["step"], e["req_id"]) not in loading:
            admit = events[i + 1] if i + 1 < len(events) else {}
            if (admit.get("kind"), admit.get("req_id"), admit.get("num_tokens")) != (
                    "admit", e["req_id"], e["num_tokens"] - e["num_cached_tokens"]):
                problems.append(f"step {e['step']}: {e['req_id']}'s lookup {e} is not followed by its admission")
        elif e["kind"] == "admit" and not any(x["kind"] == "lookup" and x["req_id"] == e["req_id"]
                                             for x in events[max(0, i - 2):i]):
            if not any(rid == e["req_id"] for _, rid, *_ in want_lookups):
                problems.append(f"step {e['step']}: {e['req_id']} admitted without a lookup")
    s = c["steps"]
    for kind, column in (("offload", "offload_bytes"), ("load", "load_bytes")):
        per_step = Counter()
        for e in events:
            if e["kind"] == kind:
                per_step[e["step"]] += e["bytes"]
        got = {n: b for n, b in zip(s["step"], s[column]) if b}
        if got != dict(+per_step):
            problems.append(f"steps' {column} {got}, their events' {dict(+per_step)}")
    if set(s["tier_transfer_ms"]) - {None}:
        problems.append("steps' tier_transfer_ms known, though the connector does not say")
    q = c["requests"]
    got_hits = {rid: n for rid, n in zip(q["req_id"], q["tier_hit_tokens"]) if n != 0}
    from engine.events import FinishReason

    unknown = set(q["finish_reason"]) - {reason.value for reason in FinishReason}
    if unknown:   # (a failed load under policy "fail" ends its request: vLLM's FINISHED_ERROR)
        problems.append(f"finish reasons outside the trace's vocabulary: {sorted(unknown)}")
    hits = {rid: n for rid, n in hits.items() if n}   # (a load of every position credits one fewer: maybe 0)
    if got_hits != hits or None in q["tier_hit_tokens"]:
        problems.append(f"requests' tier_hit_tokens {got_hits}, vLLM's loads {dict(hits)}")
    return problems


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
@starts_vllm(unless=bool(DRIVERS))
def test_the_capture_records_what_vllms_offloading_connector_decided(vllm, asynchronous):
    counts = Counter()

    def check(folder, n, workload):
        workload = unchecked({**workload, "capture_dir": str(folder)}, n)
        answer = vllm.answer(workload)
        records = answer["steps"]
        problems = capture_differences(workload, as_captured(records), answer)
        problems += tier_differences(workload, records, answer)
        assert not problems, (f"vLLM {vllm.version}, workload:\n{json.dumps(workload)}\n" + "\n".join(problems[:10]))
        loads = [load for r in records for load in r["tier"]["loads"]]
        counts["workloads"] += 1
        counts["loading"] += bool(loads)
        counts["resumed loads"] += any(rid in {p for r in records for p in r["preempted"]} for _, rid, *_ in loads)
        counts["storing"] += any(r["tier"]["stores"] for r in records)
        counts["evicting"] += any(r["tier"]["evicted"] for r in records)
        counts["failing"] += any(not ok for r in records for _, ok in r["tier"]["done"])
        counts["sync loads"] += any(r["tier"].get("sync") for r in records)
        failed_loads = {job for r in records for job, ok in r["tier"]["done"] if not ok} & {
            load[0] for r in records for load in r["tier"]["loads"]}
        counts[f"failed loads, {workload['config']['offload'].get('load_failure_policy')}"] += bool(failed_loads)

    resuming = {**RESUMING, "config": {**RESUMING["config"], "async": asynchronous}}
    # and where every third copy fails (vLLM 0.34: r01's load back), under vLLM's default policy, which
    # ends a request whose load failed
    failing = {**resuming, "config": {**resuming["config"], "offload": {
        **RESUMING["config"]["offload"], "fail_every": 3, "load_failure_policy": "fail"}}}
    for_each_workload(check, st.tuples(tier_workloads(asynchronous)), examples=[(resuming,), (failing,)],
                      max_examples=NUM_WORKLOADS)
    print(f"vLLM {vllm.version} {'AsyncScheduler' if asynchronous else 'Scheduler'} with a CPU tier: {dict(counts)}")
    assert counts["loading"] and counts["resumed loads"] and counts["storing"] and counts["evicting"], counts
    if vllm.version.startswith("0.34."):   # the first release whose worker output can say a copy failed
        assert counts["failing"] and counts["failed loads, fail"], counts
    if not vllm.version.startswith(("0.31.", "0.32.")):   # sync loads: vLLM 0.33 on
        assert counts["sync loads"], counts


# a workload whose victim comes back from the tier: r01 is preempted for r00's growth, its prompt's blocks
# taken by r00, and loaded from the tier when it resumes
RESUMING = {"config": {"block_size": 4, "num_blocks": 10, "max_num_seqs": 2, "max_num_batched_tokens": 64,
                       "max_model_len": 64, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                       "enable_prefix_caching": True, "offload": {"chunks": 32, "delay": 1, "fail_every": 0}},
            "requests": [{"id": "r00", "prompt": list(range(1, 25)), "max_tokens": 14, "arrival_step": 0},
                         {"id": "r01", "prompt": list(range(101, 117)), "max_tokens": 12, "arrival_step": 0}]}

# a workload whose second request loads the first's prompt from the tier: the device's prefix cache is
# too small to keep it (3 blocks for a prompt of 4)
LOADING = {"config": {"block_size": 4, "num_blocks": 5, "max_num_seqs": 2, "max_num_batched_tokens": 32,
                      "max_model_len": 40, "long_prefill_token_threshold": 0, "policy": "fcfs", "async": False,
                      "enable_prefix_caching": True, "offload": {"chunks": 16, "delay": 1, "fail_every": 0}},
           "requests": [{"id": "r00", "prompt": list(range(1, 17)), "max_tokens": 2, "arrival_step": 0},
                        {"id": "r01", "prompt": list(range(101, 117)), "max_tokens": 2, "arrival_step": 4},
                        {"id": "r02", "prompt": list(range(1, 17)) + [7], "max_tokens": 2, "arrival_step": 8}]}


@starts_vllm()
def test_a_tier_hit_credited_to_the_device_is_caught(vllm, tmp_path, monkeypatch):
    """Planted: the capture's lookup counts the tier's positions as found in the device's prefix cache."""
    from kvtrace.vllm.record import model_folder
    from tests.vllm_sched import differential

    workload = {**LOADING, "capture_dir": str(tmp_path / "working")}
    answer = vllm.answer(workload)
    assert any(r["tier"]["loads"] for r in answer["steps"])
    assert not tier_differences(workload, answer["steps"], answer)
    source = differential.capture_package()
    planted = tmp_path / "planted" / "kvtrace" / "vllm" / "capture"
    shutil.copytree(source.parents[1], planted.parents[1], ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    connector = planted / "connector.py"
    text = connector.read_text()
    at = "num_cached_tokens=num_hit,\n                          tier_tokens=credited)"
    assert text.count(at) == 1   # the plant still fits the code
    connector.write_text(text.replace(at, "num_cached_tokens=num_hit + credited,\n                          tier_tokens=0)"))
    monkeypatch.setattr(differential, "capture_package", lambda: planted)
    scheduler = VllmScheduler(vllm.python, str(model_folder("smollm2-135m")), capture=True)
    try:
        workload = {**LOADING, "capture_dir": str(tmp_path / "planted-capture")}
        answer = scheduler.answer(workload)
        problems = tier_differences(workload, answer["steps"], answer)
        assert any(p.startswith("lookups of a load") for p in problems), problems
    finally:
        scheduler.close()


@starts_vllm(unless=bool(DRIVERS))
def test_a_connector_without_a_name_the_capture_uses_makes_it_step_aside_or_refuse(vllm, tmp_path):
    """The capture relies on the connector's scheduler-side names (guard.check_connector): one gone, it steps
    aside (vLLM serves, the connector working, unrecorded), or in strict mode vLLM does not start, and
    error.json names it."""
    named = "OffloadingConnector.request_finished is gone"
    workload = {**LOADING, "hide": ["vllm.distributed.kv_transfer.kv_connector.v1.offloading_connector:"
                                    "OffloadingConnector.request_finished"]}
    answer = vllm.answer({**workload, "capture_dir": str(tmp_path / "capture")})
    error = on_vllm.stepped_aside(answer, tmp_path / "capture", "vllm_changed")
    assert named in error["error"], error
    assert any(r["tier"]["loads"] for r in answer["steps"])   # vLLM's connector loaded, unrecorded
    assert named in on_vllm.refused(vllm, workload, tmp_path / "strict", "vllm_changed", "VllmChanged")["error"]
