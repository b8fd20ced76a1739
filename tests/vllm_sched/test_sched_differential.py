"""kvtrace's scheduler makes vLLM V1's decisions step for step, on generated workloads.

vLLM's own `Scheduler` and `AsyncScheduler` (from the vLLM venv the tests build, KVTRACE_VLLM_PYTHON,
and every other vLLM Python in KVTRACE_VLLM_SCHED_PYTHONS, e.g. scripts/vllm_sched_env.sh's 0.33),
built as vLLM's unit tests build them and stepped with placeholder model outputs, against kvtrace's
simulator driving engine/'s scheduler and block manager, on the same step clock. Compared every
step: scheduled requests and token counts in order, victims in order, admissions (new or resumed,
prefix-hit tokens, block ids), new blocks, free and cached blocks, the requests freed and in which
order, the free queue's order, and async scheduling's placeholders (tests/vllm_sched/kvtrace_side.py
lists the fields). A failure shows the shrunk workload and the first differing step on each side.

KVTRACE_SCHED_WORKLOADS sets the workloads per scheduler class and version (default 1000, in batches
of eight that the vLLM drivers run side by side);
`--hypothesis-profile thorough` runs ten times as many. KVTRACE_SCHED_PLANT=wrong-victim (or another of
kvtrace_side.PLANTS) makes kvtrace's side wrong, to see what a failure reports.
"""
from __future__ import annotations

import json
import os
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, find, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NoSuchExample

from engine.config import VLLM_VERSIONS
from tests.helpers.vllm_runs import VLLM_MARKS, VLLM_PYTHON
from tests.vllm_sched import kvtrace_side
from tests.vllm_sched.differential import VllmScheduler, VllmSchedulers, first_difference
from tests.vllm_sched.workloads import BATCH, tally, tier_workloads, workloads

pytestmark = VLLM_MARKS

PYTHONS = [p for p in [VLLM_PYTHON, *os.environ.get("KVTRACE_VLLM_SCHED_PYTHONS", "").split(os.pathsep)] if p]
NUM_WORKLOADS = int(os.environ.get("KVTRACE_SCHED_WORKLOADS", "1000")) * max(1, settings.default.max_examples // 100)
NUM_HYBRID_WORKLOADS = max(BATCH, NUM_WORKLOADS // 10)   # per class and version: 100 by default
NUM_SPEC_WORKLOADS = max(BATCH, NUM_WORKLOADS // 5)      # per version: 200 by default
NUM_TIER_WORKLOADS = max(BATCH, NUM_WORKLOADS // 5)      # per version: 200 by default
FAST = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                                   HealthCheck.filter_too_much])


# a release kvtrace does not follow yet (scripts/vllm_release_check.sh): compared with the decisions kvtrace
# makes following this one, to find the first step where the new release decides otherwise
FOLLOW_INSTEAD = os.environ.get("KVTRACE_SCHED_FOLLOW")


def followed(vllm) -> str:
    """The vLLM version kvtrace's side follows against this vLLM (its own, or FOLLOW_INSTEAD's)."""
    if vllm.version in VLLM_VERSIONS:
        return vllm.version
    if FOLLOW_INSTEAD in VLLM_VERSIONS:
        return FOLLOW_INSTEAD
    pytest.skip(f"kvtrace's scheduler follows vLLM {', '.join(VLLM_VERSIONS)}, not {vllm.version} "
                f"(KVTRACE_SCHED_FOLLOW=VERSION compares it with one of those)")


def venv_name(python: str) -> str:
    return Path(python).parent.parent.name   # .../vllm-venv-0.32.0/bin/python: vllm-venv-0.32.0


@pytest.fixture(scope="module", params=PYTHONS or ["none"], ids=venv_name)
def vllm(request):
    from kvtrace.vllm.record import model_folder

    schedulers = VllmSchedulers(request.param, str(model_folder("smollm2-135m")))
    yield schedulers
    schedulers.close()


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_schedules_as_vllm(vllm, asynchronous):
    follows = followed(vllm)
    totals: Counter = Counter()

    plant = os.environ.get("KVTRACE_SCHED_PLANT") or None   # see a failure's report: a planted wrong scheduler

    def kvtrace_run(workload):
        return kvtrace_side.run(workload, plant, vllm_version=follows)

    shrinking: dict = {}   # once a batch differs, each workload's pair is kept while Hypothesis shrinks it

    @settings(max_examples=max(1, NUM_WORKLOADS // BATCH), **FAST)
    @given(st.lists(workloads(asynchronous), min_size=BATCH, max_size=BATCH))
    def check(batch):
        differing = []
        pairs = vllm.compare(batch, kvtrace_run, shrinking if shrinking.get("on") else None)
        for workload, (mine, theirs) in zip(batch, pairs):
            difference = first_difference(mine, theirs)
            if difference:
                differing.append(f"vLLM {vllm.version} (kvtrace following {follows}), "
                                 f"workload:\n{json.dumps(workload)}\n{difference}")
            totals.update(tally(theirs))
        # Hypothesis shrinks the batch: the first differing workload, shrunk, and its first differing step
        if differing:
            shrinking["on"] = True
        assert not differing, f"{len(differing)} of {len(batch)} workloads schedule otherwise, the first:\n{differing[0]}"

    check()
    print(f"vLLM {vllm.version} {'AsyncScheduler' if asynchronous else 'Scheduler'}: {dict(totals)}")
    # not vacuous: one workload in twenty at least preempts, hits the prefix cache, resumes a preempted
    # request; and a victim scheduled earlier in its step (kvtrace's deliberate difference) is reached
    assert min(totals["preempting"], totals["hitting"], totals["resuming"]) >= totals["workloads"] // 20, totals
    assert totals["uncaching"] > 0, totals


def compared_step_for_step(vllm, strategy, num_workloads: int) -> Counter:
    """vLLM's scheduler against kvtrace's on `num_workloads` of `strategy`'s workloads, in batches; every
    workload's steps must be equal. Returns the tally of what they exercised."""
    follows = followed(vllm)
    totals: Counter = Counter()
    plant = os.environ.get("KVTRACE_SCHED_PLANT") or None

    @settings(max_examples=max(1, num_workloads // BATCH), **FAST)
    @given(st.lists(strategy, min_size=BATCH, max_size=BATCH))
    def check(batch):
        pairs = vllm.compare(batch, lambda w: kvtrace_side.run(w, plant, vllm_version=follows))
        for workload, (mine, theirs) in zip(batch, pairs):
            difference = first_difference(mine, theirs)
            totals.update(tally(theirs))
            assert not difference, (f"vLLM {vllm.version} (kvtrace following {follows}), workload:\n"
                                    f"{json.dumps(workload)}\n{difference}")

    check()
    return totals


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_schedules_a_hybrid_model_as_vllm(vllm, asynchronous):
    """A model of sliding windows beside full attention (workloads.HYBRID_GROUPS): vLLM's hybrid coordinator
    keeps a table per KV-cache group and drops a window's blocks mid-request; kvtrace's block manager
    too. Compared as above, and per step each group's new blocks and what each window dropped."""
    totals = compared_step_for_step(vllm, workloads(asynchronous, hybrid=True), NUM_HYBRID_WORKLOADS)
    print(f"vLLM {vllm.version} {'AsyncScheduler' if asynchronous else 'Scheduler'}, hybrid: {dict(totals)}")
    assert min(totals["preempting"], totals["resuming"]) >= totals["workloads"] // 20, totals
    assert totals["dropping"] >= totals["workloads"] // 4, totals


@pytest.mark.parametrize("bug", kvtrace_side.HYBRID_PLANTS)
def test_a_planted_wrong_hybrid_kv_cache_is_caught(vllm, bug):
    follows = followed(vllm)

    def caught(workload) -> bool:
        try:
            mine = kvtrace_side.run(workload, bug, vllm_version=follows)
        except RuntimeError:   # no end: a pool that no window frees can preempt for ever
            return True
        return first_difference(mine, vllm.run(workload)) is not None

    try:
        find(workloads(asynchronous=bug == "in-flight-dropped", hybrid=True), caught,
             settings=settings(max_examples=300, phases=[Phase.generate], database=None, derandomize=True, **FAST))
    except NoSuchExample:
        pytest.fail(f"kvtrace's hybrid KV cache planted with {bug!r} agreed with vLLM {vllm.version} on 300 workloads")


@pytest.mark.parametrize("asynchronous", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_schedules_speculative_decoding_as_vllm(vllm, asynchronous):
    """A server drafting 1 to 4 tokens a step with a draft model or EAGLE: vLLM's Scheduler given the drafts (the
    AsyncScheduler schedules its own placeholders) and the driver's accepted counts against kvtrace's
    simulator drafting as vLLM's method does, its acceptance the driver's pattern: compared as above, and
    per step the drafts each request verified and accepted (the lookahead slots show in the blocks each
    step gives, the drafting slot in the tokens scheduled, the drafts in flight in the placeholders)."""
    totals = compared_step_for_step(vllm, spec_workloads(vllm, asynchronous), NUM_SPEC_WORKLOADS)
    print(f"vLLM {vllm.version} {'AsyncScheduler' if asynchronous else 'Scheduler'}, drafting: {dict(totals)}")
    assert min(totals["preempting"], totals["resuming"], totals["hitting"]) >= totals["workloads"] // 20, totals
    assert totals["drafting"] >= totals["workloads"] // 2, totals


def spec_workloads(vllm, asynchronous: bool):
    """Speculative workloads, drafting with a draft model or EAGLE (up to vLLM 0.32 EAGLE recomputes a
    prefix hit's last block; 0.33 on hash each block with the token after it, lookahead block hashes)."""
    return workloads(asynchronous, spec=True)


@pytest.mark.parametrize("bug", kvtrace_side.SPEC_PLANTS)
def test_a_planted_wrong_speculative_decoding_is_caught(vllm, bug):
    follows = followed(vllm)

    def caught(workload) -> bool:
        try:
            mine = kvtrace_side.run(workload, bug, vllm_version=follows)
        except RuntimeError:   # no end
            return True
        return first_difference(mine, vllm.run(workload)) is not None

    try:
        find(spec_workloads(vllm, asynchronous=bug == "rejected-kept"), caught,
             settings=settings(max_examples=300, phases=[Phase.generate], database=None, derandomize=True, **FAST))
    except NoSuchExample:
        pytest.fail(f"kvtrace's speculative decoding planted with {bug!r} agreed with vLLM {vllm.version} on 300 workloads")


def test_schedules_with_a_host_kv_tier_as_vllm(vllm):
    """A host KV tier (vLLM's native CPU offloading: its OffloadingConnector's scheduler side and CPU
    manager, its worker stood in for with copies that take 0 to 3 steps; workloads.tier_workloads, tiers of
    1 chunk to ample) against kvtrace's simulator with engine/offload.py's tier, its copies on the same
    step clock. Compared as above, and per step the copies each side issues (the loads with each request's
    device and tier hits and its table, the stores with their blocks), the jobs flushed, the chunks
    evicted from the tier and the copies finished. vLLM's Scheduler only, prefix caching on, no copy
    failing: kvtrace models a tier with neither async scheduling nor its own prefix cache off, and its
    copies do not fail (tests/vllm/test_capture_tiers_on_vllm.py covers the rest for the capture)."""
    totals = compared_step_for_step(vllm, tier_workloads(asynchronous=False, failing=False, prefix_caching=True),
                                    NUM_TIER_WORKLOADS)
    print(f"vLLM {vllm.version} Scheduler, host KV tier: {dict(totals)}")
    # not vacuous: loads, evictions from the tier and flushed copies in many workloads
    assert totals["loading"] >= totals["workloads"] // 10, totals
    assert min(totals["tier-evicting"], totals["flushing"], totals["preempting"]) >= totals["workloads"] // 20, totals


@pytest.mark.parametrize("bug", kvtrace_side.TIER_PLANTS)
def test_a_planted_wrong_tier_is_caught(vllm, bug):
    follows = followed(vllm)

    def caught(workload) -> bool:
        return first_difference(kvtrace_side.run(workload, bug, vllm_version=follows),
                                vllm.run(workload)) is not None

    try:
        find(tier_workloads(asynchronous=False, failing=False, prefix_caching=True), caught,
             settings=settings(max_examples=300, phases=[Phase.generate], database=None, derandomize=True, **FAST))
    except NoSuchExample:
        pytest.fail(f"kvtrace's host KV tier planted with {bug!r} agreed with vLLM {vllm.version} on 300 workloads")


def test_reused_vllm_configs_schedule_as_fresh_ones(vllm):
    """The driver builds vLLM's configs once and sets each workload's values on them: on a sample of
    workloads, vLLM's steps are those of configs built and validated afresh for each workload."""
    from kvtrace.vllm.record import model_folder

    fresh = VllmScheduler(vllm.drivers[0].python, str(model_folder("smollm2-135m")),
                          env={"KVTRACE_SCHED_FRESH_CONFIGS": "1"})
    try:
        @settings(max_examples=5, database=None, derandomize=True, phases=[Phase.generate], **FAST)
        @given(st.lists(workloads(asynchronous=False), min_size=2, max_size=2),
               st.lists(workloads(asynchronous=True), min_size=2, max_size=2))
        def check(sync, asynchronous):
            for workload in sync + asynchronous:
                assert vllm.run(workload) == fresh.run(workload), json.dumps(workload)
        check()
    finally:
        fresh.close()


@pytest.mark.parametrize("bug", kvtrace_side.PLANTS)
def test_a_planted_wrong_scheduler_is_caught(vllm, bug):
    follows = followed(vllm)

    def caught(workload) -> bool:   # planted in the scheduler that follows this vLLM: no difference but the bug's
        return first_difference(kvtrace_side.run(workload, bug, vllm_version=follows),
                                vllm.run(workload)) is not None

    try:
        find(workloads(asynchronous=bug == "head-first-free"), caught,
             settings=settings(max_examples=300, phases=[Phase.generate], database=None, derandomize=True, **FAST))
    except NoSuchExample:
        pytest.fail(f"kvtrace's scheduler planted with {bug!r} agreed with vLLM {vllm.version} on 300 workloads")
